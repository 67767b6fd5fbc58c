"""Attribution patching (ipa_probe.attribution.patching) against the test's own finite differences and ablations.

The gradients come from one backward pass through a tiny float64 SD 1.5 pipeline; the references here are the test's
own: central differences of the ablation path (``intervene(mode="scale")``, another code path than the gradient's
hooks), central differences and an exact zeroing of the contributions with the test's own callbacks, and a near-linear
case (adapter scale 1e-3, where the output is linear in the contributions to ~1e-3 relative) in which the first-order
estimate must equal the exact change.
"""

from __future__ import annotations

import numpy as np
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


#: The test's own smooth judge of images: softmax of a fixed linear map of the 8 x 8 grey (the organism's judge's
#: input, centred) into 3 classes; weights small enough that the softmax is not saturated.
JUDGE = np.random.default_rng(5).normal(0.0, 0.05, (64, 3))


def _judge(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, probabilities)`` of ``(N, H, W, 3)`` images in [0, 1], in float64 numpy."""
    n, h, w, _ = images.shape
    logits = (images.mean(-1).reshape(n, 8, h // 8, 8, w // 8).mean((2, 4)) * 16.0 - 8.0).reshape(n, 64) @ JUDGE
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p.argmax(1), p / p.sum(1, keepdims=True)


def test_integrated_patching_is_complete_for_a_smooth_judge_of_the_image(pipe):
    """Completeness through the decoder and the whole trajectory: the path integral of the test's own smooth judge
    of the decoded image (its torch twin, written here) equals the change of the judge's probability that
    ``measure_intervention`` measures by exact ablation (another code path: ``mode="ablate"``, the pipeline's own
    decode), while first order at the clean run is off."""
    from ipa_probe.attribution import integrated_patching

    call = _call(pipe)
    weights = torch.as_tensor(JUDGE)

    def judged(latents: torch.Tensor) -> list[torch.Tensor]:
        pixels = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample  # (1, 3, H, W)
        images = (pixels / 2 + 0.5).clamp(0, 1).mean(1)  # (1, H, W) grey
        _, h, w = images.shape
        grey = images.reshape(1, 8, h // 8, 8, w // 8).mean((2, 4)).reshape(1, 64) * 16.0 - 8.0
        return list(torch.softmax(grey @ weights, -1)[0])

    pipe.set_ip_adapter_scale(4.0)
    try:
        df, _ = patching_gradients(pipe, judged, seed=3, **call)
        off = 0.0
        for j in range(3):
            effect = ipa_probe.measure_intervention(pipe, j, seed=3, classify=_judge, **call)
            exact = effect.intervened_probabilities[0] - effect.baseline_probabilities[0]  # (3,)
            integrated = integrated_patching(pipe, judged, [j], points=16, seed=3, **call)
            # tolerance: the midpoint rule's error (~ m'' / (24 * 16^2)) and float64 decode differences (~1e-12)
            np.testing.assert_allclose(integrated, exact, rtol=2e-2, atol=1e-3 * np.abs(exact).max())
            off = max(off, np.abs(-df[:, j] - exact).max() / np.abs(exact).max())
            assert np.abs(exact).max() > 1e-3  # an effect to size
        assert off > 0.05, f"first order within {off:.3f}: the case does not discriminate"
    finally:
        pipe.set_ip_adapter_scale(1.0)


def test_digit_judge_jumps_where_no_gradient_sees():
    """Why no path integral of gradients sizes the organisms' digit effects: the judge's P(digit) is not continuous.
    On the segment between a training 4 and a training 6, the test bisects its largest step of P(4) down to inputs
    1e-9 apart (in units of the segment; the grey values span [0, 16]): a continuous P would close the gap, P(4)
    keeps it."""
    from ipa_probe.tiny.digits import digit_classifier
    from ipa_probe.tiny.digits.data import TRAIN_SIZE, _digits

    clf, _ = digit_classifier()
    images, labels = _digits()
    x = images.reshape(len(images), 64)[:TRAIN_SIZE].astype(np.float64)
    start, end = x[np.flatnonzero(labels[:TRAIN_SIZE] == 4)[0]], x[np.flatnonzero(labels[:TRAIN_SIZE] == 6)[0]]
    column = int(np.flatnonzero(clf.classes_ == 4)[0])

    def p4(t: np.ndarray) -> np.ndarray:
        return clf.predict_proba(start + np.asarray(t)[:, None] * (end - start))[:, column]

    grid = np.linspace(0.0, 1.0, 1001)
    values = p4(grid)
    k = int(np.abs(np.diff(values)).argmax())
    low, high = grid[k], grid[k + 1]
    middle = (values[k] + values[k + 1]) / 2
    above = values[k] > middle  # which side of the step P(4) is higher
    while high - low > 1e-9:
        t = (low + high) / 2
        if (p4([t])[0] > middle) == above:
            low = t
        else:
            high = t
    gap = abs(p4([low])[0] - p4([high])[0])
    assert gap > 0.1, f"P(4) closes to {gap:.2g} across 1e-9: continuous there"
