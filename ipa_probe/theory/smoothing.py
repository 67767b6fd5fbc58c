"""Gaussian Nadaraya–Watson (NW) smoothing of a finite support, with input checks and task batching (paper §C.2).

Given a support ``S = {s_1 .. s_m}`` and a bandwidth ``h``, the NW weights and local mean of a query ``x`` are

    w_i(x) = softmax_i( -|x - s_i|^2 / (2 h^2) ),        m_h(x) = sum_i w_i(x) s_i.

The logits come from :func:`ipa_probe.statistics.kernels.nw_logits` (a dot product plus the key-norm bias), computed on
coordinates centred at the support mean: the weights are translation invariant, and centring keeps the dot products
small so that float32 stays accurate far from the origin. The softmax is log-sum-exp stable.

Shapes: queries ``(n, d)`` or ``(B, n, d)``; support ``(m, d)`` or ``(B, m, d)`` (``B`` tasks, each with its own
support; a 2-D support is shared by every task); the bandwidth is a float or a tensor broadcastable to the query
rows: ``()``, ``(n,)``, ``(B, n)``, ``(B, 1)``, or any of them with a trailing 1.
"""

from __future__ import annotations

import math

import torch

from ..statistics import kernels
from ._checks import check_points, check_positive, check_support, row_param

__all__ = ["kde_log_density", "n_eff", "nw_log_weights", "nw_mean", "nw_weights"]


def _prepare(
    query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate, then centre query and support at the support mean. Returns ``(q - c, s - c, h_column, c)``."""
    check_points(query, "query")
    support = check_support(support, query)
    h = check_positive(row_param(h, query, "bandwidth h"), "bandwidth h")  # (..., n, 1)
    center = support.mean(-2, keepdim=True)  # (..., 1, d)
    return query - center, support - center, h, center


def nw_log_weights(query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """Log NW weights ``log w_i(x) = log_softmax_i(-|x - s_i|^2 / (2 h^2))``; arguments as in :func:`nw_weights`."""
    q, s, h, _ = _prepare(query, support, h)
    return torch.log_softmax(kernels.nw_logits(q, s, h), dim=-1)  # (..., n, m)


def nw_weights(query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """Gaussian NW weights ``w_i(x) = softmax_i(-|x - s_i|^2 / (2 h^2))`` (paper §C.2).

    Each row lies in the probability simplex. As ``h -> inf`` the weights become uniform (``1/m``); as ``h -> 0``
    they concentrate on the nearest support point. Shape ``(n, m)`` or ``(B, n, m)``; ``h > 0``.

    Example:
        >>> s = torch.tensor([[0.0], [1.0]])
        >>> nw_weights(torch.tensor([[0.25]]), s, h=1.0)  # logits -1/32 and -9/32
        tensor([[0.5622, 0.4378]])
    """
    q, s, h, _ = _prepare(query, support, h)
    return torch.softmax(kernels.nw_logits(q, s, h), dim=-1)  # (..., n, m)


def nw_mean(
    query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """The NW local mean ``m_h(x) = sum_i w_i(x) s_i``: a point of the convex hull of the support, shape ``(n, d)``
    or ``(B, n, d)``. ``chunk_size``: at most this many query rows at a time (``chunk_size * m`` weights per task).
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"expected chunk_size >= 1 or None, got {chunk_size}")
    q, s, h, center = _prepare(query, support, h)
    n = q.shape[-2]
    if chunk_size is None or chunk_size >= n:
        return kernels.nw_mean(torch.softmax(kernels.nw_logits(q, s, h), dim=-1), s) + center
    parts = [
        kernels.nw_mean(torch.softmax(kernels.nw_logits(q_c, s, h_c), dim=-1), s)  # (..., chunk, d)
        for q_c, h_c in zip(q.split(chunk_size, dim=-2), h.split(chunk_size, dim=-2), strict=True)
    ]
    return torch.cat(parts, dim=-2) + center


def n_eff(weights: torch.Tensor) -> torch.Tensor:
    """Kish effective sample size ``1 / sum_i w_i^2`` of normalised weights ``(..., m)`` -> ``(...)``.

    1 means all weight on one support point (nearest neighbour), ``m`` means uniform weights.
    """
    if weights.ndim == 0 or weights.shape[-1] == 0:
        raise ValueError(f"expected weights of shape (..., m) with m >= 1, got {tuple(weights.shape)}")
    return kernels.n_eff(weights)


def kde_log_density(query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor) -> torch.Tensor:
    """Log of the Gaussian kernel density estimate ``(1/m) sum_i N(x; s_i, h^2 I)`` (paper Prop 4.2); arguments as
    in :func:`nw_weights`; shape ``(n,)`` or ``(B, n)``."""
    check_points(query, "query")
    support = check_support(support, query)
    h = check_positive(row_param(h, query, "bandwidth h"), "bandwidth h")  # (..., n, 1)
    d, m = query.shape[-1], support.shape[-2]
    sq_dist = torch.cdist(query, support, compute_mode="donot_use_mm_for_euclid_dist").square()  # (..., n, m)
    log_kernel = -sq_dist / (2 * h * h) - d * torch.log(h) - 0.5 * d * math.log(2 * math.pi)
    return torch.logsumexp(log_kernel, dim=-1) - math.log(m)
