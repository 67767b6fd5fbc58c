"""Edges that used to give wrong numbers: host copies in the loop, failed passes, compiled denoisers, negative step
slices, degenerate rows, the NW head's joint softmax, and the summary's counts."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import CountScalarReads, masks_for
from torch.overrides import TorchFunctionMode

from ipa_probe.capture.config import ProbeConfig
from ipa_probe.capture.report import summarize
from ipa_probe.capture.run import probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.statistics.schema import GAUGE_COLUMNS, NULL_COLUMNS
from ipa_probe.tiny.dit import tiny_sd3_pipeline
from ipa_probe.tiny.sd import tiny_pipeline

PROMPT = "a photo of a flower"
STEPS = 3


def generate(pipe, refs, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "latent")
    generator = torch.Generator().manual_seed(0)
    return pipe(PROMPT, ip_adapter_image=[refs], generator=generator, **kwargs).images


class CountHostTensors(TorchFunctionMode):
    """Counts tensors made from host data (``torch.tensor(1.0, device=...)``, ``torch.as_tensor(x, device=...)``):
    on a GPU each is a blocking host-to-device copy. Tensors made by a device kernel (``torch.full``, ``arange``)
    are not counted."""

    MAKERS = (torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.MAKERS and args and not isinstance(args[0], torch.Tensor):
            self.count += 1
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def sd15_cfg():
    return tiny_pipeline("sd15", num_adapters=2)


@pytest.mark.parametrize(
    ("bandwidth", "branch"),
    [("matched", "image"), ("fit", "image"), (1.5, "image"), (lambda t: 1.0 + t / 1000, "image"), ("matched", "both")],
)
def test_no_host_tensors_or_scalar_reads_inside_the_denoising_loop(sd15_cfg, refs, bandwidth, branch):
    """Probed and plain calls make the same number of tensors from host data and read the same number of scalars,
    with masks and two adapters, so the probe adds no host-to-device copy and no device-to-host read per layer; the
    gauge and null columns are among what it computed (``kind="both"``: the text branch's padded rows, whose
    chance levels come from a per-run table of the number of keys)."""
    masks = masks_for(len(refs))
    kwargs = {"guidance_scale": 5.0, "cross_attention_kwargs": {"ip_adapter_masks": masks * 2}}
    pipe = sd15_cfg
    pipe("warm-up", ip_adapter_image=[refs, refs], num_inference_steps=1, output_type="latent", **kwargs)

    def counted():
        with CountHostTensors() as made, CountScalarReads() as reads:
            generator = torch.Generator().manual_seed(0)
            pipe(PROMPT, ip_adapter_image=[refs, refs], num_inference_steps=STEPS, output_type="latent",
                 generator=generator, **kwargs)  # fmt: skip
        return made.count, reads.count

    plain = counted()
    with probe(pipe, bandwidth=bandwidth, branch=branch) as run:
        probed = counted()
    assert probed == plain
    table = run.to_dataframe()
    assert len(table) > 0
    assert set(table["kind"]) == ({"image", "text"} if branch == "both" else {"image"})
    cond = table[table["branch"] == "cond"]
    assert cond[list(GAUGE_COLUMNS + NULL_COLUMNS)].notna().all().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sync-debug mode only exists there")
def test_no_synchronising_cuda_operation_in_the_probes_hooks(refs):
    """On CUDA, everything the probe runs inside the loop passes ``torch.cuda.set_sync_debug_mode("error")``, and a
    probed call synchronises no more often than a plain one."""
    pipe = tiny_pipeline("sd15", device="cuda")
    kwargs = {"guidance_scale": 5.0, "num_inference_steps": STEPS, "output_type": "latent"}

    def syncs() -> int:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pipe(PROMPT, ip_adapter_image=[refs], generator=torch.Generator("cuda").manual_seed(0), **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    plain = syncs()
    with probe(pipe) as run:
        record, layout = run._capture.record, run.evidence.layout

        @contextlib.contextmanager
        def strict():
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def strict_record(*args):
            with strict():
                return record(*args)

        def strict_layout(*args):
            with strict():
                return layout(*args)

        run._capture.record, run.evidence.layout = strict_record, strict_layout
        probed = syncs()
    assert probed == plain
    assert len(run.to_dataframe()) > 0


def test_negative_step_slices_are_refused_naming_the_remedy():
    for steps in (slice(-3, None), slice(0, -1), slice(None, None, -1)):
        with pytest.raises(ValueError, match="slice"):
            ProbeConfig(steps=steps)
    assert ProbeConfig(steps=slice(1, None, 2)).records_step(3)


@pytest.mark.parametrize("strength", [None, 0.5], ids=["txt2img", "img2img"])
def test_probe_steps_by_timestep_record_the_steps_whose_timesteps_match(sd15, refs, strength):
    """``steps=`` takes a ``Timesteps`` or a predicate as ``intervene`` does: the probe records exactly the loop
    steps whose scheduler timestep matches, read from the pipeline's own schedule (img2img: its loop's part)."""
    import diffusers

    from ipa_probe.intervention import Timesteps

    pipe, extra = sd15, {}
    if strength is not None:
        pipe = diffusers.StableDiffusionImg2ImgPipeline.from_pipe(sd15)
        pipe.set_progress_bar_config(disable=True)
        extra = {"image": torch.zeros(1, 3, 64, 64), "strength": strength}
    generate(pipe, refs, num_inference_steps=4, **extra)
    loop = pipe.scheduler.timesteps[len(pipe.scheduler.timesteps) - pipe.num_timesteps :].tolist()
    assert len(loop) == (4 if strength is None else 2)
    cut = loop[1]
    for steps, chosen in [
        (Timesteps(low=cut), [i for i, t in enumerate(loop) if t >= cut]),
        (lambda step, t: t <= cut, [i for i, t in enumerate(loop) if t <= cut]),
        (Timesteps([loop[-1]]), [len(loop) - 1]),
    ]:
        with probe(pipe, steps=steps) as run:
            generate(pipe, refs, num_inference_steps=4, **extra)
        df = run.to_dataframe()
        assert sorted(df["step"].unique()) == chosen and chosen
        assert df.groupby("step")["timestep"].first().tolist() == [loop[i] for i in chosen]
    with pytest.raises(ValueError, match="selected no pass"):  # a selection that picks nothing: refused on exit
        with probe(pipe, steps=Timesteps(high=-1)):
            generate(pipe, refs, num_inference_steps=4, **extra)


def test_probe_map_budget_counts_every_step_for_a_timestep_selection(sd15, refs):
    """Before step 0 the probe cannot know which steps a predicate takes: its map budget counts all of them."""
    from ipa_probe.intervention import Timesteps

    config = ProbeConfig(steps=Timesteps(low=500))
    assert all(config.records_step(s) for s in range(4))  # before the loop: an upper bound
    assert config.records_step(0, 600.0) and not config.records_step(0, 400.0)
    # a selection that will pick no step is still counted in full: one byte is refused before step 0
    with pytest.raises(ValueError, match="max_map_bytes"):
        with probe(sd15, steps=Timesteps(low=1e9), keep_maps=True, max_map_bytes=1):
            generate(sd15, refs, num_inference_steps=2)


def _unet_loop(pipe, refs, steps: int, fail_at: int | None = None, layer=None):
    """A hand-written loop calling ``pipe.unet``; the pass of step ``fail_at`` raises inside ``layer``'s image
    branch, after its query was formed, and the loop carries on (as research code with ``try/except`` would)."""
    positive, negative = pipe.encode_prompt(PROMPT, "cpu", 1, True, "blurry")
    image_embeds = pipe.prepare_ip_adapter_image_embeds([refs], None, "cpu", 1, True)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    pipe.scheduler.set_timesteps(steps)
    for step, t in enumerate(pipe.scheduler.timesteps):
        handle = None
        if step == fail_at:

            def boom(module, args, output):
                raise RuntimeError("boom")

            handle = layer.processor.to_k_ip[0].register_forward_hook(boom, prepend=True)
        try:
            x = torch.cat([latents] * 2)
            pipe.unet(
                x,
                t,
                encoder_hidden_states=torch.cat([negative, positive]),
                added_cond_kwargs={"image_embeds": image_embeds},
            )
        except RuntimeError:
            pass
        finally:
            if handle is not None:
                handle.remove()


def test_a_failed_pass_leaks_no_query_and_its_step_is_flagged(refs, caplog):
    pipe = tiny_pipeline("sd15")
    layer = find_ip_layers(pipe)[-1]  # the last IP layer fails: the ones before it recorded step 0
    with caplog.at_level(logging.WARNING, logger="ipa_probe"), probe(pipe, steps=[0]) as run:
        _unet_loop(pipe, refs, steps=2, fail_at=0, layer=layer)
    df = run.to_dataframe()
    assert set(df["step"]) == {0}  # step 1 is not recorded: no stale query from step 0 paired with its keys
    assert not df["complete"].any()
    assert layer.name not in set(df["layer"])  # the failing layer recorded nothing
    assert "cut short" in caplog.text
    with probe(pipe) as run:
        _unet_loop(pipe, refs, steps=2)
    assert run.to_dataframe()["complete"].all()


@pytest.mark.slow
@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_denoiser_compiled_and_run_before_the_probe_is_refused_never_empty(refs, fresh_dynamo, in_place):
    pipe = tiny_pipeline("sd15")
    layer_ids = {layer.name for layer in find_ip_layers(pipe.unet)}
    if in_place:
        pipe.unet.compile(backend="eager")  # module.compile(): the module itself, compiled
    else:
        pipe.unet = torch.compile(pipe.unet, backend="eager")
    generate(pipe, refs, num_inference_steps=1)  # compiled without the probe's hooks
    with pytest.raises(RuntimeError, match="compiled"):
        with probe(pipe):
            generate(pipe, refs, num_inference_steps=1)
    torch.compiler.reset()  # the remedy the error names
    with probe(pipe) as run:
        generate(pipe, refs, num_inference_steps=1)
    df = run.to_dataframe()
    assert len(df) > 0 and set(df["layer"]) == layer_ids  # diffusers' ids, no `_orig_mod.` prefix
    # at scale 0 diffusers skips every image branch: an eager run records nothing either, so no refusal
    torch.compiler.reset()
    pipe.set_ip_adapter_scale(0.0)
    generate(pipe, refs, num_inference_steps=1)  # compiled without the probe's hooks
    with probe(pipe) as run:
        generate(pipe, refs, num_inference_steps=1)
    assert run.to_dataframe().empty


def test_rows_with_fewer_than_three_keys_are_flagged(refs, caplog):
    pipe = tiny_pipeline("sd15")
    with caplog.at_level(logging.WARNING, logger="ipa_probe"), probe(pipe, kind="both") as run:
        pipe("", ip_adapter_image=[refs[:1]], num_inference_steps=1, guidance_scale=1.0, output_type="latent")
    df = run.to_dataframe()
    text, image = df[df["kind"] == "text"], df[df["kind"] == "image"]
    assert (text["keys"] == 2).all() and text["few_keys"].all()  # start and end-of-text tokens only
    assert (image["keys"] == 4).all() and not image["few_keys"].any()


def test_frac_rho_counts_finite_cells_and_says_how_many():
    table = pd.DataFrame(
        {
            "call": 0,
            "step": 0,
            "timestep": 999.0,
            "kind": "image",
            "branch": "cond",
            "spearman": [0.95, math.nan, 0.5, 0.99],
            "nonfinite": [0.0, 1.0, 0.0, 0.0],
        }
    )
    summary = summarize(table)
    assert summary["frac_rho_gt_0.9"].item() == pytest.approx(2 / 3)
    assert summary["rho_cells"].item() == 3 and summary["cells"].item() == 4


def test_summary_has_every_numeric_column_the_table_averages(sd15, refs):
    with probe(sd15) as run:
        generate(sd15, refs, num_inference_steps=1)
    summary = run.summary()
    assert {"ip_mass", "k_norm_spread", "q_norm", "neff_nw", "bandwidth", "rho_cells"} <= set(summary.columns)
    table = run.to_dataframe()
    cond = table[table["branch"] == "cond"]
    assert summary[summary["branch"] == "cond"]["k_norm_spread"].item() == pytest.approx(cond["k_norm_spread"].mean())


def test_ip_mass_on_an_nw_head_pipeline_matches_the_heads_own_joint_softmax(refs):
    """SD3 with the NW head swapped in: ``ip_mass`` is the image columns' share of the head's joint NW softmax over
    [latent keys; image keys], recomputed in float64 from our own hooks."""
    from ipa_probe.nwhead import nw_head

    pipe = tiny_sd3_pipeline()
    layer = find_ip_layers(pipe, r"blocks\.0\.")[0]
    h = 0.9
    seen = {}
    modules = {"q": layer.processor.norm_q, "k_lat": layer.processor.norm_k, "k_ip": layer.processor.norm_ip_k}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, o)) for n, m in modules.items()]
    try:
        with nw_head(pipe, bandwidth=h), probe(pipe, layers=layer.name, steps=[0]) as run:
            pipe(PROMPT, ip_adapter_image=refs[0], num_inference_steps=2, output_type="latent", max_sequence_length=16,
                 guidance_scale=1.0, generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    q, k_lat, k_ip = (seen[n].double()[0] for n in ("q", "k_lat", "k_ip"))  # (H, N, D)
    joint = torch.softmax(-(torch.cdist(q, torch.cat([k_lat, k_ip], 1)) ** 2) / (2 * h * h), -1)
    share = joint[..., k_lat.shape[1] :].sum(-1).mean(-1)  # (H,)
    df = run.to_dataframe().sort_values("head")
    np.testing.assert_allclose(df["ip_mass"].to_numpy(), share.numpy(), rtol=1e-4)
