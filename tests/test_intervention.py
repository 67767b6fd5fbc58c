"""Interventions on one reference's image tokens: settings, lifecycle (the pipeline comes back bit for bit), and what
ablation and swap compute, checked against runs that simply leave the reference out (or put the other image in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import masks_for

import ipa_probe
from ipa_probe.intervention import InterventionConfig, generate, intervene, measure_intervention
from ipa_probe.tiny.digits import DIGITS_PROMPT, classify_digit_images, digits_reference_images

STEPS = 4


@pytest.fixture(scope="module")
def refs():
    return digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)


def call(refs, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("guidance_scale", 1.0)
    return dict(prompt=DIGITS_PROMPT, ip_adapter_image=[list(refs)], **kwargs)


def latents(pipe, seed=0, **kwargs):
    return pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="latent").images


def snapshot(pipe):
    """Everything an intervention could leave behind: weights, buffers, hooks on every module, processors, the
    denoiser's instance attributes."""
    unet = pipe.unet
    hooks = {
        name: tuple(len(getattr(m, attr)) for attr in ("_forward_pre_hooks", "_forward_hooks"))
        for name, m in unet.named_modules()
    }
    return {
        "state": {k: v.detach().clone() for k, v in unet.state_dict().items()},
        "hooks": hooks,
        "processors": dict(unet.attn_processors),
        "attributes": set(unet.__dict__),
    }


def assert_unchanged(pipe, before):
    after = snapshot(pipe)
    assert after["hooks"] == before["hooks"]
    assert after["attributes"] == before["attributes"]
    assert all(after["processors"][k] is v for k, v in before["processors"].items())
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert ipa_probe.list_hooks(pipe) == []


# ------------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reference": 0, "mode": "zero"}, ValueError, "ablate"),
        ({"reference": 0, "mode": "swap"}, ValueError, "needs other="),
        ({"reference": 0, "other": "img"}, ValueError, "takes none"),
        ({"reference": -1}, ValueError, "int >= 0"),
        ({"reference": True}, TypeError, "image index"),
        ({"reference": [1, 1]}, ValueError, "distinct"),
        ({"reference": [0, 1], "mode": "swap", "other": "img"}, ValueError, "one index"),
        ({"reference": 0, "steps": 3}, TypeError, "expected a list of loop indices"),
        ({"reference": 0, "steps": [-1]}, ValueError, "non-negative"),
        ({"reference": 0, "layers": "("}, ValueError, "regular expression"),
        ({"reference": 0, "adapter": -1}, ValueError, "loaded IP-Adapter"),
    ],
)
def test_bad_settings_name_the_remedy(kwargs, error, match):
    with pytest.raises(error, match=match):
        InterventionConfig(**kwargs)


def test_settings_describe_and_select_steps():
    config = InterventionConfig([2, 0], steps=slice(1, None, 2))
    assert config.references == (0, 2)
    assert [s for s in range(6) if config.acts_at(s)] == [1, 3, 5]
    assert config.describe()["reference"] == [0, 2] and config.describe()["steps"] == "slice(1, None, 2)"


def test_refuses_what_a_family_lacks_and_missing_adapters(sd3, flux, organism):
    with pytest.raises(ValueError, match="one reference image per prompt"):
        ipa_probe.intervention.apply_intervention(sd3, 1, mode="scale", factor=0.5)
    with pytest.raises(ValueError, match="hold 1 IP-Adapter"):
        ipa_probe.intervention.apply_intervention(flux, 0, adapter=1)
    assert ipa_probe.list_hooks(flux) == [] and ipa_probe.list_hooks(sd3) == []
    with pytest.raises(ValueError, match="hold 1 IP-Adapter"):
        ipa_probe.intervention.apply_intervention(organism, 0, adapter=1)
    with pytest.raises(ValueError, match="matched none"):
        ipa_probe.intervention.apply_intervention(organism, 0, layers="no_such_layer")
    with pytest.raises(ValueError, match="no intervention is applied"):
        ipa_probe.intervention.remove_intervention(organism)
    assert ipa_probe.list_hooks(organism) == []


# ------------------------------------------------------------------------------------------------------ lifecycle


def test_pipeline_comes_back_bit_for_bit(organism, refs, one_thread):
    before = snapshot(organism)
    plain = latents(organism, **call(refs))
    with intervene(organism, 1, steps=[0, 2], layers="up_blocks") as state:
        assert [a.feature for a in ipa_probe.list_hooks(organism)] == ["intervene"]
        assert ipa_probe.list_hooks(organism)[0].layers == tuple(state.layers)
        changed = latents(organism, **call(refs))
        # interventions nest (a scale too, whose edit is a hook points' user): the innermost goes first
        inner = ipa_probe.intervention.apply_intervention(organism, 0, mode="scale", factor=0.5)
        assert [a.feature for a in ipa_probe.list_hooks(organism)] == ["intervene", "intervene"]
        ipa_probe.intervention.remove_intervention(organism)
        assert not inner.active and state.active
    assert not torch.equal(changed, plain)
    assert not state.active
    assert_unchanged(organism, before)
    assert torch.equal(latents(organism, **call(refs)), plain)  # same process and threads: bitwise


@pytest.mark.parametrize("exception", [RuntimeError("boom"), KeyboardInterrupt()])
def test_pipeline_comes_back_after_an_exception_inside_the_block(organism, refs, exception):
    before = snapshot(organism)
    with pytest.raises(type(exception)):
        with intervene(organism, 0, mode="swap", other=refs[2]):
            latents(organism, **call(refs, num_inference_steps=2))
            raise exception
    assert_unchanged(organism, before)


def test_masked_call_raises_and_the_pipeline_comes_back(organism, refs):
    before = snapshot(organism)
    masks = masks_for(len(refs), size=16)
    with pytest.raises(ValueError, match="ip_adapter_masks"):
        with intervene(organism, 0):
            latents(organism, **call(refs, cross_attention_kwargs={"ip_adapter_masks": masks}))
    assert_unchanged(organism, before)
    unmasked = call(refs, cross_attention_kwargs={"ip_adapter_masks": [None]})  # no mask for this adapter: fine
    with intervene(organism, 0):
        assert torch.equal(latents(organism, **unmasked), latents(organism, **call(refs)))


def test_reference_index_beyond_the_call_raises(organism, refs):
    with pytest.raises(ValueError, match="has 4 reference image"):
        with intervene(organism, 4):
            latents(organism, **call(refs))
    assert ipa_probe.list_hooks(organism) == []


def test_acts_exactly_at_the_selected_steps_and_layers(organism, refs):
    names = [layer.name for layer in ipa_probe.find_ip_layers(organism)]
    seen: list[tuple[str, int]] = []  # the test's own hooks: how many reference images each to_k_ip saw
    handles = [
        layer.processor.to_k_ip[0].register_forward_hook(
            lambda module, args, output, name=layer.name: seen.append((name, args[0].shape[1]))
        )
        for layer in ipa_probe.find_ip_layers(organism)
    ]
    steps: list[torch.Tensor] = []

    def keep(pipe, step, timestep, kwargs):
        steps.append(kwargs["latents"].clone())
        return kwargs

    try:
        plain = latents(organism, **call(refs), callback_on_step_end=keep)
        plain_steps, steps[:] = list(steps), []
        seen.clear()
        with intervene(organism, 2, steps=[2], layers="up_blocks.2") as state:
            latents(organism, **call(refs), callback_on_step_end=keep)
    finally:
        for handle in handles:
            handle.remove()
    chosen = [n for n in names if "up_blocks.2" in n]
    assert state.acted == [(2, n) for n in chosen]
    per_step = len(names)
    for step in range(STEPS):
        images = dict(seen[step * per_step : (step + 1) * per_step])
        assert images == {n: 3 if (step == 2 and n in chosen) else 4 for n in names}
    for step in range(STEPS):  # latents after steps 0 and 1 untouched; from step 2 on they differ
        assert torch.equal(steps[step], plain_steps[step]) == (step < 2)
    assert plain.shape == steps[-1].shape


# ------------------------------------------------------------------------------------------------ what it computes


def _embeds(pipe, images):
    """(1, n, D) image embeddings, computed once so that both runs share them bit for bit."""
    with torch.no_grad():
        embeds, _ = pipe.encode_image(images, "cpu", 1, False)
    return embeds[None]


def test_ablation_equals_leaving_the_reference_out(organism, refs):
    embeds = _embeds(organism, refs)  # (1, 4, D)
    base = dict(prompt=DIGITS_PROMPT, num_inference_steps=STEPS, guidance_scale=1.0)
    for j in (0, 3):
        keep = [i for i in range(4) if i != j]
        without = latents(organism, ip_adapter_image_embeds=[embeds[:, keep]], **base)
        with intervene(organism, j):
            ablated = latents(organism, ip_adapter_image_embeds=[embeds], **base)
        # 1e-5: the image projection runs on 3 vs 4 images (batch-size dependent float32 rounding), then 4 steps
        torch.testing.assert_close(ablated, without, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ablated, latents(organism, ip_adapter_image_embeds=[embeds], **base), atol=1e-4)


def test_ablating_every_reference_equals_adapter_scale_zero(organism, refs):
    with intervene(organism, [0, 1, 2, 3]):
        ablated = latents(organism, **call(refs))
    organism.set_ip_adapter_scale(0.0)
    try:
        off = latents(organism, **call(refs))
    finally:
        organism.set_ip_adapter_scale(1.0)
    assert torch.equal(ablated, off)  # the branch adds exactly 0 (scale x zero values) where diffusers skips it


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_swap_equals_giving_the_other_image(organism, refs, guidance):
    other = digits_reference_images(7, 1, seed=5)[0]
    swapped_refs = [refs[0], other, refs[2], refs[3]]
    given = latents(organism, **call(swapped_refs, guidance_scale=guidance))
    with intervene(organism, 1, mode="swap", other=other):
        swapped = latents(organism, **call(refs, guidance_scale=guidance))
    # 1e-5: the other image is encoded alone here and in a batch of 4 there (float32 rounding), then 4 steps
    torch.testing.assert_close(swapped, given, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(swapped, latents(organism, **call(refs, guidance_scale=guidance)), atol=1e-4)


def test_swap_refuses_a_bare_denoiser(organism, refs):
    with pytest.raises(ValueError, match="image_encoder"):
        ipa_probe.intervention.apply_intervention(organism.unet, 0, mode="swap", other=refs[0])
    assert ipa_probe.list_hooks(organism) == []


def test_measured_effect_matches_an_independent_recomputation(organism, refs):
    kwargs = call(refs, guidance_scale=3.0)
    baseline = generate(organism, seed=3, **kwargs)
    plain = organism(**kwargs, generator=torch.Generator().manual_seed(3), output_type="np").images
    np.testing.assert_array_equal(baseline.images, plain)  # decoded as the pipeline decodes
    effect = measure_intervention(organism, 2, seed=3, classify=classify_digit_images, **kwargs)
    with intervene(organism, 2):
        changed_latents = latents(organism, seed=3, **kwargs).double().numpy()
        changed_images = organism(**kwargs, generator=torch.Generator().manual_seed(3), output_type="np").images
    base_latents = baseline.latents.double().numpy()
    expected_latent = np.sqrt(((changed_latents - base_latents) ** 2).mean(axis=(1, 2, 3)))
    expected_pixel = np.sqrt(((changed_images.astype(np.float64) - plain) ** 2).mean(axis=(1, 2, 3)))
    np.testing.assert_allclose(effect.latent_distance, expected_latent, rtol=1e-12)  # float64 of the same tensors
    np.testing.assert_allclose(effect.pixel_distance, expected_pixel, rtol=1e-12)
    assert effect.latent_distance[0] > 0
    # the classifier's own verdicts on the two images (scikit-learn, outside ipa_probe's measuring code)
    classifier, _ = ipa_probe.tiny.digits.digit_classifier()

    def verdict(images):
        n, h, w, _ = images.shape
        grey = images.astype(np.float64).mean(-1).reshape(n, 8, h // 8, 8, w // 8).mean(axis=(2, 4)) * 16.0
        return classifier.predict(grey.reshape(n, 64))

    np.testing.assert_array_equal(effect.baseline_labels, verdict(plain))
    np.testing.assert_array_equal(effect.intervened_labels, verdict(changed_images))
    reused = measure_intervention(organism, 2, seed=3, baseline=baseline, **kwargs)
    np.testing.assert_array_equal(reused.pixel_distance, effect.pixel_distance)
    assert reused.baseline_labels is None and reused.flipped is None
    assert effect.to_dict()["config"]["reference"] == 2


def test_a_baseline_of_another_seed_or_call_is_refused_in_one_line(organism, refs):
    from ipa_probe.intervention import Generation

    kwargs = call(refs)
    baseline = generate(organism, seed=0, **kwargs)
    assert baseline.seed == 0 and baseline.call is not None
    with pytest.raises(ValueError, match=r"seed=0, but this measurement uses seed=1") as err:
        measure_intervention(organism, 0, seed=1, baseline=baseline, **kwargs)
    assert "\n" not in str(err.value)
    other_refs = call(list(refs)[::-1])  # the same references in another order: another call
    for other in (call(refs, guidance_scale=3.0), other_refs, call(refs, num_inference_steps=STEPS + 1)):
        with pytest.raises(ValueError, match="other call arguments") as err:
            measure_intervention(organism, 0, seed=0, baseline=baseline, **other)
        assert "\n" not in str(err.value)
    bare = Generation(baseline.latents, baseline.images)  # made by hand: no record of its seed and call
    with pytest.raises(ValueError, match="no seed or call record"):
        measure_intervention(organism, 0, seed=0, baseline=bare, **kwargs)
    # the same seed and call (a new but equal list of the same images) is accepted, and measures the same effect
    again = measure_intervention(organism, 0, seed=0, baseline=baseline, **call(list(refs)))
    fresh = measure_intervention(organism, 0, seed=0, **kwargs)
    np.testing.assert_array_equal(again.latent_distance, fresh.latent_distance)


def test_generate_refuses_the_arguments_it_sets(organism, refs):
    with pytest.raises(ValueError, match="generator="):
        generate(organism, generator=torch.Generator(), **call(refs))


@pytest.mark.slow
def test_a_panoramas_views_are_passes_of_one_step(refs):
    """StableDiffusionPanoramaPipeline runs the UNet once per view at each step and restores a deep copy of its
    scheduler's state before each view: the intervention's step index follows the loop, not the scheduler object."""
    from ipa_probe.tiny.zoo import Zoo

    pipe = Zoo().build("StableDiffusionPanoramaPipeline").pipe
    seen = []  # the test's own record: the timestep of every UNet pass

    def record(module, args, kwargs):
        seen.append(float(args[1] if len(args) > 1 else kwargs["timestep"]))

    handle = pipe.unet.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with ipa_probe.intervene(pipe, reference=0, steps=[1]) as intervention:
            pipe(
                prompt="a photo",
                ip_adapter_image=[refs],
                num_inference_steps=2,
                height=512,
                width=576,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            )
    finally:
        handle.remove()
    timesteps = sorted(set(seen), reverse=True)
    assert len(timesteps) == 2 and len(seen) == 4  # two steps, two views each
    assert {step for step, _ in intervention.acted} == {1}
    assert len(intervention.acted) == seen.count(timesteps[1]) * len(intervention.layers)
