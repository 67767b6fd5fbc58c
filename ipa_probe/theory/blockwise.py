"""Generalisations of the exact NW field: multi-head blockwise smoothing (§C.4) and anisotropic kernels (§C.3).

**Blockwise (H heads).** Split ``R^d`` into ``H`` orthogonal subspaces with orthonormal bases ``P_1 .. P_H``
(``d x k_j`` matrices whose columns together form an orthonormal basis of ``R^d``; coordinate blocks are the
default). Head ``j`` smooths inside its subspace:

    w_i^(j) = softmax_i( -|P_j^T (x~ - s_i)|^2 / (2 h^2) ),   m^(j) = sum_i w_i^(j) P_j P_j^T s_i,

and the heads' outputs add up to ``m_H = sum_j m^(j)``, giving ``u_H = (m_H - (1 - sigma_min) x) / sigma_t``.
``H = 1`` is the exact field. ``H > 1`` is not: the exact posterior multiplies the block kernels inside one softmax,
while here each block has its own softmax. Each head's kernel lives in ``k_j = d / H`` dimensions, so it collapses
later (larger ``n_eff``) and converges at the faster NW rate ``4 / (4 + d / H)``, at the price of ignoring the
dependence between blocks.

**Mahalanobis (anisotropic) kernel.** With ``M = L L^T``,

    w_i(x) = softmax_i( -(x - s_i)^T M (x - s_i) / (2 h^2) ) = isotropic NW weights of ``L^T x`` against ``L^T s_i``,

so a learned ``W_q = W_k = L^T / h`` implements a learned metric. For invertible ``L`` the field
``(m_M(x~) - (1 - sigma_min) x) / sigma_t`` is the exact OT-path velocity of the support when the source noise is
``N(0, M^{-1})`` instead of ``N(0, I)``; mapped by ``L^T`` it is the isotropic field of the mapped support.

Row-vector convention: points are rows, so ``L^T x`` is ``x @ L``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import check_points, check_support
from .fields import _ot_time
from .smoothing import nw_mean, nw_weights

__all__ = [
    "blockwise_nw_mean",
    "blockwise_nw_velocity",
    "blockwise_nw_weights",
    "mahalanobis_nw_velocity",
    "mahalanobis_nw_weights",
]


def _bases(
    d: int, n_heads: int | None, projections: torch.Tensor | Sequence[torch.Tensor] | None, like: torch.Tensor
) -> list[torch.Tensor] | list[slice]:
    """The heads' subspaces: coordinate slices (from ``n_heads``) or checked orthonormal bases (``projections``)."""
    if projections is None:
        heads = 1 if n_heads is None else n_heads
        if isinstance(heads, bool) or not isinstance(heads, int) or not 1 <= heads <= d:
            raise ValueError(f"expected n_heads an int in [1, d = {d}], got {n_heads!r}")
        sizes = [len(block) for block in torch.arange(d).tensor_split(heads)]
        starts = [sum(sizes[:j]) for j in range(heads)]
        return [slice(a, a + k) for a, k in zip(starts, sizes, strict=True)]
    bases = list(projections.unbind(0)) if isinstance(projections, torch.Tensor) else list(projections)
    if n_heads is not None and n_heads != len(bases):
        raise ValueError(f"expected n_heads = len(projections) = {len(bases)}, got n_heads = {n_heads}; pass one")
    if not bases or any(not isinstance(p, torch.Tensor) or p.ndim != 2 or p.shape[0] != d for p in bases):
        shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in bases]
        raise ValueError(
            f"expected projections as a (H, d, k) tensor or a list of (d, k_j) bases with d = {d}, got {shapes}"
        )
    bases = [p.to(dtype=like.dtype, device=like.device) for p in bases]
    stacked = torch.cat(bases, dim=1)  # (d, sum_j k_j)
    eye = torch.eye(d, dtype=like.dtype, device=like.device)
    tol = 1e-4 if like.dtype in (torch.float16, torch.bfloat16, torch.float32) else 1e-8
    if stacked.shape[1] != d or not torch.allclose(stacked.T @ stacked, eye, atol=tol):
        raise ValueError(
            "expected projections whose columns together form an orthonormal basis of R^d "
            f"(sum of k_j = d = {d} and P^T P = I), got {stacked.shape[1]} columns; "
            "orthonormalise them, e.g. with torch.linalg.qr"
        )
    return bases


def _project(x: torch.Tensor, basis: torch.Tensor | slice) -> torch.Tensor:
    return x[..., basis] if isinstance(basis, slice) else x @ basis


def blockwise_nw_weights(
    query: torch.Tensor,
    support: torch.Tensor,
    h: float | torch.Tensor,
    n_heads: int | None = None,
    projections: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each head's NW weights ``w^(j) = softmax_i(-|P_j^T (x - s_i)|^2 / (2 h^2))`` (paper §C.4).

    Arguments as in :func:`~ipa_probe.theory.nw_weights`, and ``n_heads`` contiguous coordinate blocks (sizes
    differ by at most one when ``H`` does not divide ``d``; default 1, or ``len(projections)``), or ``projections``,
    the heads' orthonormal bases: a ``(H, d, k)`` tensor or a list of ``(d, k_j)`` tensors whose columns together
    form an orthonormal basis of ``R^d``. Shape ``(H, n, m)`` or ``(H, B, n, m)``.
    """
    check_points(query, "query")
    support = check_support(support, query)
    bases = _bases(query.shape[-1], n_heads, projections, query)
    return torch.stack([nw_weights(_project(query, p), _project(support, p), h) for p in bases])


def blockwise_nw_mean(
    query: torch.Tensor,
    support: torch.Tensor,
    h: float | torch.Tensor,
    n_heads: int | None = None,
    projections: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The blockwise NW mean ``m_H(x) = sum_j P_j P_j^T sum_i w_i^(j)(x) s_i`` (paper §C.4); ``H = 1`` gives ``m_h``.

    Arguments as in :func:`blockwise_nw_weights`. Returns shape ``(n, d)`` or ``(B, n, d)``.
    """
    check_points(query, "query")
    support = check_support(support, query)
    bases = _bases(query.shape[-1], n_heads, projections, query)
    if all(isinstance(p, slice) for p in bases):
        # Coordinate blocks: each head fills its own coordinates of the output.
        return torch.cat([nw_mean(query[..., p], support[..., p], h) for p in bases], dim=-1)
    return sum(nw_mean(query @ p, support @ p, h) @ p.T for p in bases)


def blockwise_nw_velocity(
    x: torch.Tensor,
    t: float | torch.Tensor,
    support: torch.Tensor,
    n_heads: int | None = None,
    projections: torch.Tensor | Sequence[torch.Tensor] | None = None,
    sigma_min: float = 0.01,
) -> torch.Tensor:
    """The H-head blockwise plug-in velocity ``u_H = (m_H(x / t) - (1 - sigma_min) x) / sigma_t`` (paper §C.4).

    With ``H = 1`` (the default) it is the exact field :func:`~ipa_probe.theory.nw_velocity`. Arguments as there,
    and ``n_heads`` or ``projections`` as in :func:`blockwise_nw_weights`.
    """
    check_points(x, "x")
    support = check_support(support, x)
    t, sigma_t = _ot_time(t, x, sigma_min)
    m = blockwise_nw_mean(x / t, support, sigma_t / t, n_heads=n_heads, projections=projections)
    return (m - (1.0 - sigma_min) * x) / sigma_t


def _check_metric(L: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(L, torch.Tensor) or L.ndim not in (2, 3) or L.shape[-2] != x.shape[-1]:
        shape = tuple(L.shape) if isinstance(L, torch.Tensor) else type(L).__name__
        raise ValueError(f"expected L of shape (d, k) or (B, d, k) with d = {x.shape[-1]}, got {shape}")
    return L.to(dtype=x.dtype, device=x.device)


def mahalanobis_nw_weights(
    query: torch.Tensor, support: torch.Tensor, h: float | torch.Tensor, L: torch.Tensor
) -> torch.Tensor:
    """NW weights under the Mahalanobis metric ``M = L L^T``: ``softmax_i(-|L^T (x - s_i)|^2 / (2 h^2))``.

    Arguments as in :func:`~ipa_probe.theory.nw_weights`, and the metric's factor ``L``, ``(d, k)`` or ``(B, d, k)``
    (``k < d`` gives a degenerate metric that ignores the directions outside the column span of ``L``).
    """
    check_points(query, "query")
    support = check_support(support, query)
    L = _check_metric(L, query)
    return nw_weights(query @ L, support @ L, h)


def mahalanobis_nw_velocity(
    x: torch.Tensor, t: float | torch.Tensor, support: torch.Tensor, L: torch.Tensor, sigma_min: float = 0.01
) -> torch.Tensor:
    """The anisotropic plug-in velocity ``(m_M(x / t) - (1 - sigma_min) x) / sigma_t`` with ``M = L L^T``.

    ``m_M`` is the Mahalanobis NW mean (weights of :func:`mahalanobis_nw_weights`, values ``s_i``) at
    ``h(t) = sigma_t / t``. For invertible ``L`` this is the exact velocity of the support on the OT path with
    source ``N(0, M^{-1})``, and ``u @ L`` equals ``nw_velocity(x @ L, t, support @ L)``. Arguments as in
    :func:`~ipa_probe.theory.nw_velocity` and :func:`mahalanobis_nw_weights`.
    """
    check_points(x, "x")
    support = check_support(support, x)
    L = _check_metric(L, x)
    t, sigma_t = _ot_time(t, x, sigma_min)
    w = nw_weights((x / t) @ L, support @ L, sigma_t / t)  # (..., n, m)
    return (w @ support - (1.0 - sigma_min) * x) / sigma_t
