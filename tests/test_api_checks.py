"""The Python API checks its documented arguments before anything is attached or run: a ``TypeError`` for a value of
the wrong type, a ``ValueError`` for one out of range, each naming the argument, and the pipeline untouched."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import runner_for

import ipa_probe
from ipa_probe.compare import compare_methods, generate_methods
from ipa_probe.sweep import RowDefaults, SweepRunner, aggregate, read_manifest, run_sweep

CALL = {"num_inference_steps": 1, "height": 64, "width": 64}


def untouched(pipe) -> dict:
    """The processor objects of every attention layer and the hooks of the denoiser: what a feature attaches."""
    unet = pipe.unet
    return {"processors": dict(unet.attn_processors), "hooks": len(unet._forward_pre_hooks) + len(unet._forward_hooks)}


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": "abc"}, TypeError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"keep_maps": "yes"}, TypeError, "keep_maps"),
        ({"maps": 1}, TypeError, "maps"),
        ({"layers": 5}, TypeError, "layers"),
        ({"layers": ["("]}, ValueError, "layers"),
        ({"steps": 5}, TypeError, "steps"),
        ({"steps": "abc"}, TypeError, "steps"),
        ({"heads": 3}, TypeError, "heads"),
        ({"heads": [-1]}, ValueError, "heads"),
        ({"kind": "neither"}, ValueError, "kind"),
        ({"branches": 5}, TypeError, "branches"),
        ({"bandwidth": None}, TypeError, "bandwidth"),
        ({"bandwidth": -1.0}, ValueError, "bandwidth"),
        ({"max_map_bytes": 0}, ValueError, "max_map_bytes"),
        # issue 39: values of the wrong type raised ValueError where docs/failures.md promises TypeError
        ({"max_map_bytes": "5"}, TypeError, "max_map_bytes"),
        ({"rows": "5"}, ValueError, "rows"),  # a str other than "auto"
        ({"rows": 4}, ValueError, "rows"),
        ({"threads": "2"}, TypeError, "threads"),
        ({"threads": 0}, ValueError, "threads"),
        ({"kind": 5}, TypeError, "kind"),
        ({"query_frame": 5}, TypeError, "query_frame"),
        ({"query_frame": "all"}, ValueError, "query_frame"),
    ],
)
def test_probe_checks_every_argument_before_attaching(sd15, refs, kwargs, error, name):
    before = untouched(sd15)
    with pytest.raises(error, match=f"^{name}"):
        with ipa_probe.probe(sd15, **kwargs):
            sd15("a", ip_adapter_image=[refs], output_type="latent", **CALL)
    assert untouched(sd15) == before


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"bandwidth": -1}, ValueError, "bandwidth"),
        ({"bandwidth": "fit"}, ValueError, "bandwidth"),
        ({"bandwidth": "wide"}, (TypeError, ValueError), "bandwidth"),
        ({"layers": 5}, TypeError, "layers"),
        ({"layers": ["("]}, ValueError, "layers"),
        ({"frame": 1}, TypeError, "frame"),
        ({"frame": "keys"}, ValueError, "frame"),
        ({"frame": "query", "form": None, "bandwidth": 2.0}, ValueError, "bandwidth"),
        ({"frame": "query", "form": "laplace"}, ValueError, "form"),
        ({"frame": "query", "form": ["exact"]}, TypeError, "form"),
        ({"form": "exact"}, ValueError, "form"),
    ],
)
def test_nw_head_checks_its_arguments_before_swapping(sd15, kwargs, error, name):
    before = untouched(sd15)
    with pytest.raises(error, match=name):
        with ipa_probe.nw_head(sd15, **kwargs):
            pass
    assert untouched(sd15) == before


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"prompt": "a", "seed": 1}) + "\n")
    return read_manifest(path)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"n_resamples": 0}, ValueError, "n_resamples"),
        ({"n_resamples": "9"}, TypeError, "n_resamples"),
        ({"confidence": 2.0}, ValueError, "confidence"),
        ({"confidence": "high"}, TypeError, "confidence"),
        ({"threshold": 1.5}, ValueError, "threshold"),
        ({"restart": "no"}, TypeError, "restart"),
        ({"progress": "no"}, TypeError, "progress"),
        ({"extra": 5}, TypeError, "extra"),
        ({"state": 5}, TypeError, "state"),
        ({"clock": 5}, TypeError, "clock"),
        ({"out": 5}, TypeError, "out"),
        ({"manifest": "m.jsonl"}, TypeError, "manifest: expected a Manifest from read_manifest"),
        ({"runner": "pipe"}, TypeError, "runner"),
    ],
)
def test_run_sweep_checks_its_arguments_before_touching_the_folder(
    sd15, refs, manifest, tmp_path, kwargs, error, name
):
    arguments = {"manifest": manifest, "runner": runner_for(sd15, default_images=refs), "out": tmp_path / "out"}
    arguments.update(kwargs)
    with pytest.raises(error, match=f"^{name}"):
        run_sweep(**arguments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"defaults": {"steps": 1}}, TypeError, "defaults"),
        ({"call_kwargs": 5}, TypeError, "call_kwargs"),
        ({"heads": "a"}, TypeError, "heads"),
        ({"heads": [1.5]}, TypeError, "heads"),
        ({"default_images": 5}, TypeError, "default_images"),
        ({"default_images": ["a.png"]}, TypeError, "default_images"),
        ({"layers": 5}, TypeError, "layers"),
        ({"settings": [1]}, TypeError, "settings"),
    ],
)
def test_sweep_runner_checks_its_arguments(sd15, kwargs, error, name):
    with pytest.raises(error, match=f"^{name}"):
        SweepRunner(sd15, **kwargs)


def test_manifest_defaults_and_aggregate_check_their_arguments(tmp_path):
    import pandas as pd

    with pytest.raises(TypeError, match="^path"):
        read_manifest(5)
    with pytest.raises(TypeError, match="^require_images"):
        read_manifest(tmp_path / "m.jsonl", require_images="yes")
    with pytest.raises(ValueError, match="^seed"):
        RowDefaults(seed=2**64)
    with pytest.raises(TypeError, match="^seed"):  # issue 39: the wrong type was a ValueError
        RowDefaults(seed=[1])
    with pytest.raises(TypeError, match="^steps"):
        RowDefaults(steps=None)
    for kwargs, name in (
        ({"confidence": 1.0}, "confidence"),
        ({"n_resamples": 0}, "n_resamples"),
        ({"seed": -1}, "seed"),
    ):
        with pytest.raises(ValueError, match=f"^{name}"):
            aggregate(pd.DataFrame(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"seeds": ["a"]}, TypeError, "seeds"),
        ({"seeds": [2**64]}, ValueError, "seeds"),
        ({"seeds": 5}, TypeError, "seeds"),
        ({"seeds": []}, ValueError, "seeds"),
        ({"references": "one"}, TypeError, "references"),
        ({"references": []}, ValueError, "references"),
        ({"call_kwargs": 5}, TypeError, "call_kwargs"),
        ({"scorer": "clip"}, TypeError, "scorer"),
        ({"bandwidth": -1.0}, ValueError, "bandwidth"),
        ({"methods": ["x"]}, ValueError, "unknown method"),
    ],
)
def test_compare_checks_its_arguments_before_generating(sd15, refs, kwargs, error, name, monkeypatch):
    calls = []
    monkeypatch.setattr(type(sd15), "__call__", lambda *a, **k: calls.append(1))  # nothing may generate
    arguments = {"references": refs, "seeds": [0], "call_kwargs": dict(CALL)} | kwargs
    for function in (compare_methods, generate_methods):
        if function is generate_methods and name in ("scorer",):
            continue
        with pytest.raises(error, match=name):
            function(sd15, **arguments)
    assert calls == []


def test_one_image_as_references_names_the_fix(sd15, refs):
    with pytest.raises(TypeError, match=r"got one image; pass \[image\]"):
        compare_methods(sd15, refs[0], seeds=[0])


def test_compare_weights_names_a_non_tensor():
    with pytest.raises(TypeError, match="^nw_logits"):
        ipa_probe.statistics.agreement.compare_weights(torch.rand(2, 3), "x")


@pytest.mark.parametrize(
    "args, kwargs, error, name",
    [
        ((11, 3), {}, ValueError, "digit"),
        (("3", 3), {}, ValueError, "digit"),
        ((3, 0), {}, ValueError, "n to be"),
        ((3, 31), {}, ValueError, "n to be"),
        ((3, 3), {"seed": -1}, ValueError, "seed"),
        ((3, 3), {"seed": "abc"}, TypeError, "seed"),
    ],
)
def test_digits_reference_images_names_the_argument(args, kwargs, error, name):
    with pytest.raises(error, match=name):
        ipa_probe.digits_reference_images(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [({"recipe": "x"}, ValueError, "recipe"), ({"path": "/nonexistent"}, FileNotFoundError, "train-digits")],
)
def test_digits_pipeline_names_the_argument_and_the_remedy(kwargs, error, match):
    with pytest.raises(error, match=match):
        ipa_probe.digits_pipeline(**kwargs)


# ------------------------------------------------------------------------------- issue 31: arguments named at use


def _weights(pipe) -> dict:
    return {name: value.clone() for name, value in pipe.unet.state_dict().items()}


def _same_weights(pipe, before: dict) -> bool:
    return all(torch.equal(value, before[name]) for name, value in pipe.unet.state_dict().items())


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"seed": "x"}, TypeError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"mode": "swap", "other": "text"}, TypeError, "other"),
        ({"mode": "swap", "other": 5}, TypeError, "other"),
        ({"steps": [999]}, ValueError, "steps"),  # a 1-step call: known before anything runs
        ({"steps": slice(3, None)}, ValueError, "steps"),
    ],
)
def test_measure_intervention_names_its_arguments_before_generating(sd15, refs, kwargs, error, name, monkeypatch):
    import ipa_probe.intervention.effect as effect

    monkeypatch.setattr(effect, "generate", lambda *a, **k: pytest.fail("generated before checking its arguments"))
    before = untouched(sd15)
    with pytest.raises(error, match=f"^{name}"):
        ipa_probe.measure_intervention(sd15, 0, prompt="a", ip_adapter_image=[refs], **CALL, **kwargs)
    assert untouched(sd15) == before


@pytest.mark.parametrize("steps", [[999], [0, 2], slice(2, None)])
def test_intervene_on_steps_the_call_did_not_have_is_an_error_not_a_zero_effect(sd15, refs, steps):
    """Not knowable before the call (the loop's length is the pipeline's): checked when the block ends."""
    before, weights = untouched(sd15), _weights(sd15)
    with pytest.raises(ValueError, match=r"^steps: .*it ran 2 steps"):
        with ipa_probe.intervene(sd15, 0, steps=steps) as state:
            sd15("a", ip_adapter_image=[refs], output_type="latent", **{**CALL, "num_inference_steps": 2})
    assert untouched(sd15) == before and _same_weights(sd15, weights)
    assert {step for step, _ in state.acted} <= {0, 1}  # it acted only where the call had steps


def test_intervene_on_steps_the_call_had_passes_the_check(sd15, refs):
    with ipa_probe.intervene(sd15, 0, steps=[1]) as state:
        sd15("a", ip_adapter_image=[refs], output_type="latent", **{**CALL, "num_inference_steps": 2})
    assert state.acted and {step for step, _ in state.acted} == {1}


@pytest.mark.parametrize("feature", ["probe", "nw_head"])
@pytest.mark.parametrize("value", ["abc", None, [1.0]])
def test_a_bandwidth_callable_returning_no_number_is_named_when_first_called(sd15, refs, feature, value):
    before, weights = untouched(sd15), _weights(sd15)

    def bandwidth(timestep):
        return value

    with pytest.raises(ValueError, match=r"^bandwidth: the callable 'bandwidth' returned"):
        with getattr(ipa_probe, feature)(sd15, bandwidth=bandwidth):
            sd15("a", ip_adapter_image=[refs], output_type="latent", **CALL)
    assert untouched(sd15) == before and _same_weights(sd15, weights)


def test_branches_that_do_not_divide_the_batch_are_an_error_not_a_merge(sd15, refs):
    """Under CFG the batch is 2; three labels cannot cut it into equal chunks."""
    before = untouched(sd15)
    with pytest.raises(ValueError, match=r"^branches: 3 labels .* batch of 2"):
        with ipa_probe.probe(sd15, branches=("a", "b", "c")):
            sd15("a", ip_adapter_image=[refs], output_type="latent", guidance_scale=5.0, **CALL)
    assert untouched(sd15) == before
    with ipa_probe.probe(sd15, branches=("u", "c")) as run:  # two labels divide it: each half is labelled
        sd15("a", ip_adapter_image=[refs], output_type="latent", guidance_scale=5.0, **CALL)
    assert set(run.to_dataframe()["branch"]) == {"u", "c"}


@pytest.mark.parametrize(
    "kwargs, error, name",
    [({"seed": "x"}, TypeError, "seed"), ({"seed": -1}, ValueError, "seed"), ({"adapter": "0"}, TypeError, "adapter")],
)
def test_reference_attribution_names_its_arguments(sd15, refs, kwargs, error, name):
    from ipa_probe.attribution import reference_attribution

    before = untouched(sd15)
    with pytest.raises(error, match=f"^{name}"):
        reference_attribution(sd15, prompt="a", ip_adapter_image=[refs], **CALL, **kwargs)
    assert untouched(sd15) == before


def test_probe_steps_the_call_never_had_raise_after_the_block():
    """Issue 31: probe(steps=[999]) on a 2-step call named its steps nowhere and gave an empty table."""
    import torch

    import ipa_probe
    from ipa_probe.tiny.digits import DIGITS_PROMPT

    pipe = ipa_probe.digits_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = ipa_probe.digits_reference_images(3, 1)
    call = {"num_inference_steps": 2, "generator": torch.Generator().manual_seed(0), "output_type": "latent"}
    with pytest.raises(ValueError, match=r"steps: \[999\] selects loop indices the call did not have"):
        with ipa_probe.probe(pipe, steps=[999]):
            pipe(DIGITS_PROMPT, ip_adapter_image=[refs], **call)
    assert ipa_probe.list_hooks(pipe) == []  # the pipeline is given back all the same
    with ipa_probe.probe(pipe, steps=[1]) as run:  # a step the call has: no error
        pipe(DIGITS_PROMPT, ip_adapter_image=[refs], **call)
    assert set(run.to_dataframe()["step"]) == {1}
