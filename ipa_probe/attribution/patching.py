"""Attribution patching: each reference's ablation effect estimated to first order from one forward and one backward
pass (issue #40 point 5), and its contribution projected on the direction that changes the output.

Ablating reference ``j`` is the end point ``f_j = 0`` of the path ``mode="scale"`` follows
(:func:`ipa_probe.intervention.custom.scale_hooks`): ``w'_i(f) = f_{r(i)} w_i / sum_k f_{r(k)} w_k``. For a scalar
metric ``m`` of the final latents, ``attribution_patching_j = dm/df_j`` at ``f = 1`` estimates the drop
``m(clean) - m(ablated)``; ``output_projection_j = dm/dg_j`` at ``g = 1``, ``g_j`` a gate on reference ``j``'s
``contribution``, is ``sum < dm/dy, c_j >`` over layers, steps and queries. The experiment's metric is the digit
classifier's probability of the reference's own digit (:func:`digit_probability_gradients`). Definitions, what each
column estimates and how the tests hold them: docs/attribution.md ("Attribution patching: the ablation to first
order").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "PATCHING_COLUMNS",
    "digit_metrics",
    "digit_probability_gradients",
    "integrated_patching",
    "patching_gradients",
]

#: The columns :func:`digit_probability_gradients` adds per reference.
PATCHING_COLUMNS: tuple[str, ...] = ("attribution_patching", "output_projection")

#: Central-difference step of the digit classifier's input (8 x 8 grey values in [0, 16]): the SVC's probabilities
#: are smooth at that scale (RBF of width ~ the data's spread, tens of units), so a step of 1e-2 has truncation error
#: ~1e-4 of the slope and stays far above float64 rounding of probabilities (~1e-16 / 1e-2).
CLASSIFIER_STEP = 1e-2


def patching_gradients(
    pipe,
    metrics: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    *,
    seed: int = 0,
    adapter: int = 0,
    factors: Sequence[float] | None = None,
    **call: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """One seeded generation with gradients: ``dm/df`` and ``dm/dg`` (module docstring) for each metric, taken at
    ``f = factors`` (default: every reference at 1, the clean run).

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter (float32 or float64).
        metrics: given the final latents ``(1, C, h, w)`` (with their graph) returns scalars ``m_0, m_1, ...``.
        seed: the generator's seed (as :func:`ipa_probe.intervention.generate`: the same initial noise).
        adapter: the IP-Adapter whose references are gated.
        **call: the pipeline's arguments, one prompt, ``ip_adapter_image=[[...]]``; without ``generator`` /
            ``output_type``.

    Returns:
        ``(df, dg)``, each ``(M, R)`` float64: row ``m`` the gradient of metric ``m`` over the ``R`` references.
    """
    from .._checks import check_seed
    from ..intervention import intervene
    from ..intervention.points import hook_point_layers, list_hook_points, point_name
    from .collect import _references

    references = len(_references(call, adapter))
    dtype = pipe.unet.dtype
    start = np.ones(references) if factors is None else np.asarray(factors, dtype=np.float64)
    if start.shape != (references,) or (start < 0).any() or not start.any():
        raise ValueError(f"factors: expected {references} values >= 0, not all 0, got {list(start)}")
    f = torch.tensor(start, dtype=dtype, requires_grad=True)  # (R,) the ablation path's factors
    g = torch.ones(references, dtype=dtype, requires_grad=True)  # (R,) the contributions' gates

    def scale(weights: torch.Tensor, ctx) -> torch.Tensor:  # (B, H, Q, K), K = R * T
        scaled = weights * f.to(weights.device).repeat_interleave(ctx.tokens)
        return scaled / scaled.sum(-1, keepdim=True)

    def gate(contribution: torch.Tensor, ctx) -> torch.Tensor:  # (B, R, Q, C)
        return contribution * g.to(contribution.device)[None, :, None, None]

    known = set(list_hook_points(pipe))
    hooks = {}
    for layer in hook_point_layers(pipe):
        weights, contribution = (point_name(layer.name, p, adapter) for p in ("weights", "contribution"))
        if weights in known:
            hooks[weights], hooks[contribution] = scale, gate
    # diffusers' __call__ runs under torch.no_grad(); its undecorated body keeps the graph
    body = getattr(type(pipe).__call__, "__wrapped__", None)
    if body is None:
        raise ValueError(f"{type(pipe).__name__}.__call__ is not a no_grad-wrapped diffusers call; cannot backprop")
    generator = torch.Generator().manual_seed(check_seed(seed))
    with torch.enable_grad(), intervene(pipe, hooks=hooks):
        latents = body(pipe, **call, generator=generator, output_type="latent").images  # (1, C, h, w)
        values = list(metrics(latents))
        df, dg = [], []
        for i, value in enumerate(values):
            a, b = torch.autograd.grad(value, (f, g), retain_graph=i + 1 < len(values), allow_unused=True)
            df.append(np.zeros(references) if a is None else a.double().cpu().numpy())
            dg.append(np.zeros(references) if b is None else b.double().cpu().numpy())
    return np.array(df), np.array(dg)


def integrated_patching(pipe, metrics, ablated: Sequence[int], *, points: int = 8, seed: int = 0, **call: Any):
    """The change ablating the references ``ablated`` together makes in each metric, integrated along the ablation
    path instead of taken to first order: with ``f_J = a`` for the ablated references (the others at 1),
    ``m(a = 0) - m(a = 1) = -integral_0^1 sum_{j in J} dm/df_j da``, by the midpoint rule over ``points`` values of
    ``a`` (one forward and one backward pass each). Complete only for a metric continuous along the path: a jump
    (the digit judge's, :func:`digit_metrics`) counts only where a point falls on it.

    Returns:
        ``(M,)`` float64: per metric, the estimated ``m(ablated) - m(clean)``.
    """
    from .collect import _references

    if points < 1:
        raise ValueError(f"points: expected at least 1, got {points}")
    factors, total = np.ones(len(_references(call, 0))), 0.0
    for a in (np.arange(points) + 0.5) / points:
        factors[list(ablated)] = a
        df, _ = patching_gradients(pipe, metrics, seed=seed, factors=factors, **call)
        total = total + df[:, list(ablated)].sum(1)
    return -total / points


def _grey_8x8(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The classifier's input from final latents, differentiable: decode, ``[0, 1]`` as ``output_type="np"``,
    grey (mean of RGB), area-downsampled to 8 x 8, times 16 (:func:`ipa_probe.tiny.digits.classify_digit_images`)."""
    vae = pipe.vae
    pixels = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample  # (1, 3, H, W)
    images = (pixels / 2 + 0.5).clamp(0, 1)
    _, _, h, w = images.shape
    grey = images.mean(1).reshape(1, 8, h // 8, 8, w // 8).mean((2, 4)) * 16.0  # (1, 8, 8)
    return grey.reshape(64)


def _classifier_slope(grey: np.ndarray, digit: int) -> tuple[float, np.ndarray]:
    """``P(digit | grey)`` and its gradient over the 64 inputs by central differences (:data:`CLASSIFIER_STEP`)."""
    from ..tiny.digits import digit_classifier

    clf, _ = digit_classifier()
    column = int(np.flatnonzero(clf.classes_ == digit)[0])
    steps = np.eye(64) * CLASSIFIER_STEP
    rows = np.concatenate([grey[None], grey[None] + steps, grey[None] - steps])  # (129, 64)
    p = clf.predict_proba(rows)[:, column]
    return float(p[0]), (p[1:65] - p[65:]) / (2 * CLASSIFIER_STEP)


def digit_metrics(pipe, digits: Sequence[int]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """The metrics ``P(d | image)`` for each ``d`` in ``digits``: ``m_d = slope_d . grey``, the classifier's slope
    (central differences at the current image) times the model's differentiable 8 x 8 input, so ``dm_d = dP(d)`` to
    first order wherever ``P(d)`` is smooth. It is not everywhere: the SVC's one-vs-rest score counts one-vs-one
    votes, so ``P(d)`` jumps where a vote flips, seen only within a central difference's step (docs/attribution.md)."""

    def metrics(latents: torch.Tensor) -> list[torch.Tensor]:
        grey = _grey_8x8(pipe, latents)  # (64,)
        host = grey.detach().double().cpu().numpy()
        slopes = [_classifier_slope(host, digit)[1] for digit in digits]
        return [(grey * torch.as_tensor(s, dtype=grey.dtype, device=grey.device)).sum() for s in slopes]

    return metrics


def digit_probability_gradients(pipe, digits: Sequence[int], *, seed: int = 0, **call: Any):
    """Per reference, :data:`PATCHING_COLUMNS` for the metric ``P(digits[j] | image)`` (the experiment's
    ``class_drop`` measure): ``attribution_patching`` estimates ``class_drop``, ``output_projection`` the same
    without renormalisation (module docstring). The classifier (an SVC) is differentiated by central differences
    over its 64 inputs; the model by autograd.

    Returns:
        a DataFrame with ``reference``, ``attribution_patching``, ``output_projection``.
    """
    import pandas as pd

    wanted = sorted(set(digits))
    df, dg = patching_gradients(pipe, digit_metrics(pipe, wanted), seed=seed, **call)
    metric, j = [wanted.index(d) for d in digits], np.arange(len(digits))  # reference j's own digit's row
    return pd.DataFrame({"reference": j, "attribution_patching": df[metric, j], "output_projection": dg[metric, j]})
