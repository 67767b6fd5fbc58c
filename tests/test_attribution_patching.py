"""Attribution patching (ipa_probe.attribution.patching) against the test's own finite differences and ablations.

The gradients come from one backward pass through a tiny float64 SD 1.5 pipeline; the references here are the test's
own: central differences of the ablation path (``intervene(mode="scale")``, another code path than the gradient's
hooks), central differences and an exact zeroing of the contributions with the test's own callbacks, and a near-linear
case (adapter scale 1e-3, where the output is linear in the contributions to ~1e-3 relative) in which the first-order
estimate must equal the exact change.
"""

from __future__ import annotations

import pytest
import torch

import ipa_probe
from ipa_probe.attribution.patching import patching_gradients
from ipa_probe.intervention.points import hook_point_layers, point_name
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline

STEPS = 2


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline("sd15", dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe):
    refs = default_reference_images()
    refs = [*refs, refs[0].transpose(0)]  # a third reference: the first mirrored
    return dict(prompt="a digit", ip_adapter_image=[refs], num_inference_steps=STEPS, guidance_scale=3.0)


def _direction(latents: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, latents.numel(), dtype=torch.float64).reshape(latents.shape)


def _metric(latents: torch.Tensor) -> torch.Tensor:
    """A linear metric of the final latents: its own first order is exact."""
    return (latents.double() * _direction(latents)).sum()


@torch.no_grad()
def _run(pipe, call, **kwargs) -> float:
    latents = pipe(**call, generator=torch.Generator().manual_seed(3), output_type="latent").images
    return float(_metric(latents))


def _gated(pipe, gates: list[float]):
    """The test's own contribution callbacks: reference j's contribution times gates[j]."""
    factors = torch.tensor(gates, dtype=torch.float64)

    def fn(contribution, ctx):
        return contribution * factors[None, :, None, None]

    names = [point_name(layer.name, "contribution") for layer in hook_point_layers(pipe)]
    return ipa_probe.intervene(pipe, hooks={name: fn for name in names})


def test_ablation_path_gradient_matches_central_differences(pipe):
    call = _call(pipe)
    df, dg = patching_gradients(pipe, lambda x: [_metric(x)], seed=3, **call)
    eps = 1e-4  # central differences: truncation O(eps^2 * m''') ~ 1e-8 relative in float64
    for j in range(3):
        with ipa_probe.intervene(pipe, reference=j, mode="scale", factor=1 + eps):
            up = _run(pipe, call)
        with ipa_probe.intervene(pipe, reference=j, mode="scale", factor=1 - eps):
            down = _run(pipe, call)
        fd = (up - down) / (2 * eps)
        # tolerance: the difference quotient's truncation (~eps^2) and float64 rounding of m / eps (~1e-12)
        assert df[0, j] == pytest.approx(fd, rel=1e-5, abs=1e-9)
        gates = [1.0] * 3
        gates[j] = 1 + eps
        with _gated(pipe, gates):
            up = _run(pipe, call)
        gates[j] = 1 - eps
        with _gated(pipe, gates):
            down = _run(pipe, call)
        assert dg[0, j] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)  # as above
    assert abs(df).max() > 1e-6 and abs(dg).max() > 1e-6  # the gradients are not trivially zero


def test_first_order_is_exact_where_the_model_is_nearly_linear(pipe):
    """At adapter scale 1e-3 the branch's contributions move the output by ~1e-3, where the UNet is linear to
    ~1e-3 relative: zeroing c_j changes the metric by -dm/dg_j to that accuracy."""
    call = _call(pipe)
    pipe.set_ip_adapter_scale(1e-3)
    try:
        _, dg = patching_gradients(pipe, lambda x: [_metric(x)], seed=3, **call)
        clean = _run(pipe, call)
        for j in range(3):
            gates = [1.0] * 3
            gates[j] = 0.0
            with _gated(pipe, gates):
                exact = _run(pipe, call) - clean
            # tolerance: the second-order term, ~scale (1e-3) of the first-order one; 2e-2 relative leaves room
            assert -dg[0, j] == pytest.approx(exact, rel=2e-2)
            assert abs(exact) > 1e-9  # an effect to estimate
    finally:
        pipe.set_ip_adapter_scale(1.0)


def test_gradients_leave_the_pipeline_as_it_was(pipe):
    call = _call(pipe)
    before = _run(pipe, call)
    patching_gradients(pipe, lambda x: [_metric(x)], seed=3, **call)
    assert _run(pipe, call) == before  # bit for bit: the hooks came off
    assert not torch.is_grad_enabled() or all(not p.requires_grad or p.grad is None for p in pipe.unet.parameters())


def test_integrated_patching_sizes_the_exact_ablation(pipe):
    """The ablation path integrated (midpoint rule, 16 points) equals the exact change from ablating the reference
    (``intervene(mode="ablate")``, another code path); at adapter scale 4 the first-order estimate at the clean run
    is measurably off, so the test can tell the two apart."""
    from ipa_probe.attribution import integrated_patching

    call = _call(pipe)
    pipe.set_ip_adapter_scale(4.0)
    try:
        clean = _run(pipe, call)
        df, _ = patching_gradients(pipe, lambda x: [_metric(x)], seed=3, **call)
        worst_first_order = 0.0
        for j in range(3):
            with ipa_probe.intervene(pipe, reference=j, mode="ablate"):
                exact = _run(pipe, call) - clean
            integrated = integrated_patching(pipe, lambda x: [_metric(x)], [j], points=16, seed=3, **call)[0]
            # tolerance: the midpoint rule's error, ~ m'' / (24 * 16^2) of a smooth path
            assert integrated == pytest.approx(exact, rel=1e-2)
            worst_first_order = max(worst_first_order, abs(-df[0, j] - exact) / abs(exact))
        assert worst_first_order > 0.05, f"first order within {worst_first_order:.3f}: the case does not discriminate"
    finally:
        pipe.set_ip_adapter_scale(1.0)
    with pytest.raises(ValueError, match="factors"):
        patching_gradients(pipe, lambda x: [_metric(x)], factors=[0.0, 0.0, 0.0], **call)
