"""``intervene(pipe, reference, ...)`` on Flux and SD3 (issue 49 point 5). Each edit is held against the pipeline
itself given the edited reference list (a plain diffusers call, no ipa_probe code in it): an ablation equals the call
without the reference, a swap the call with the other image in its slot, a scale of 0 the ablation and a scale of 1
the plain call bit for bit; the pipeline comes back bit for bit, also after an exception inside the call. On Flux
with true CFG the negative pass holds ``negative_ip_adapter_image``, not the references, and stays as it is. SD3 takes
one reference image per prompt: ablating it is the call without an image (bit for bit), and other references are
refused with one line (its scale and hook points: tests/test_intervention_points.py)."""

from __future__ import annotations

import pytest
import torch
from test_compose import STEPS, Boom, assert_unchanged, boom, snapshot

import ipa_probe
from ipa_probe.intervention import intervene
from ipa_probe.layers import find_ip_layers
from ipa_probe.tiny.sd import default_reference_images


@pytest.fixture(scope="module")
def refs():
    return default_reference_images(3)


def generate(pipe, images, extra=None, **call):
    """Latents of a plain call; ``images`` the reference list (Flux: one adapter's list; SD3: one image or None)."""
    kwargs = dict(prompt="a", num_inference_steps=STEPS, height=64, width=64, output_type="latent", **(extra or {}))
    if images is not None:
        kwargs["ip_adapter_image"] = [list(images)] if isinstance(images, list) else images
    return pipe(**kwargs, **call, generator=torch.Generator().manual_seed(0)).images


def close(a, b):  # the image encoder runs on batches of other sizes in the two calls: float32 rounding apart
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def assert_restores(pipe, before, plain, images, extra, edits):
    for edit in edits:
        with pytest.raises(Boom), edit():
            generate(pipe, images, extra, callback_on_step_end=boom)
        assert_unchanged(pipe, before)
    assert torch.equal(generate(pipe, images, extra), plain)


@pytest.mark.parametrize("extra", [{}, {"negative_prompt": "b", "true_cfg_scale": 2.0}], ids=["plain", "true_cfg"])
def test_flux_edits_equal_the_call_given_the_edited_references(flux, refs, extra, one_thread):
    plain = generate(flux, refs[:2], extra)
    before = snapshot(flux)
    layers = sorted(layer.name for layer in find_ip_layers(flux))
    for reference in (0, 1):
        without = generate(flux, [refs[1 - reference]], extra)
        with intervene(flux, reference) as edit:
            close(generate(flux, refs[:2], extra), without)
        # once per step and layer: never in the negative pass
        assert sorted(edit.acted) == [(step, name) for step in range(STEPS) for name in layers]
        with intervene(flux, reference, mode="scale", factor=0.0):
            close(generate(flux, refs[:2], extra), without)
    with intervene(flux, 1):  # a block that labels passes too leaves inside it: the outer one still tells them
        with ipa_probe.cache_hook_points(flux, r"\.ip\.output$"):
            generate(flux, refs[:2], extra)
        close(generate(flux, refs[:2], extra), without)  # ``without``: reference 1 left out, from the loop
    with intervene(flux, 1, mode="swap", other=refs[2]), ipa_probe.probe(flux, maps=True) as run:
        swapped = generate(flux, refs[:2], extra)
    with ipa_probe.probe(flux, maps=True) as given:
        close(swapped, generate(flux, [refs[0], refs[2]], extra))
    # a probe inside reads the swapped keys: the shares of the call given the other image
    mass, expected = run.reference_mass(), given.reference_mass()
    assert len(mass) == len(expected) > 0
    close(torch.tensor(mass.attention.to_numpy()), torch.tensor(expected.attention.to_numpy()))
    assert (swapped - plain).abs().max() > 1e-3
    with intervene(flux, [0, 1], mode="scale", factor=1.0):
        assert torch.equal(generate(flux, refs[:2], extra), plain)
    edits = (lambda: intervene(flux, 1), lambda: intervene(flux, 0, mode="swap", other=refs[2]))
    assert_restores(flux, before, plain, refs[:2], extra, edits)


@pytest.mark.parametrize("guidance", [1.0, 5.0], ids=["no_cfg", "cfg"])
def test_sd3_edits_equal_the_call_given_the_edited_reference(sd3, refs, guidance, one_thread):
    extra = {"guidance_scale": guidance}
    plain = generate(sd3, refs[0], extra)
    before = snapshot(sd3)
    with intervene(sd3, 0):
        assert torch.equal(generate(sd3, refs[0], extra), generate(sd3, None, extra))
    with intervene(sd3, 0, mode="swap", other=refs[1]):
        swapped = generate(sd3, refs[0], extra)
    close(swapped, generate(sd3, refs[1], extra))
    assert (swapped - plain).abs().max() > 1e-3
    # one layer: as diffusers' own switch of that processor's branch (scale 0), set by the test
    layer = find_ip_layers(sd3)[0]
    with intervene(sd3, 0, layers=f"^{layer.name}$"):
        ablated = generate(sd3, refs[0], extra)
    scale, layer.processor.scale = layer.processor.scale, 0.0
    try:
        assert torch.equal(ablated, generate(sd3, refs[0], extra)) and not torch.equal(ablated, plain)
    finally:
        layer.processor.scale = scale
    edits = (lambda: intervene(sd3, 0), lambda: intervene(sd3, 0, mode="swap", other=refs[1]))
    assert_restores(sd3, before, plain, refs[0], extra, edits)


def test_sd3_refusals_name_the_reason_and_the_remedy(sd3, refs):
    before = snapshot(sd3)
    with pytest.raises(ValueError, match="one reference image per prompt.*pass reference=0"):
        intervene(sd3, 1).__enter__()
    assert_unchanged(sd3, before)
