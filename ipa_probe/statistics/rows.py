"""Per-row statistics of attention-weight matrices, reduced over the last axis or over the rows of many cells
flattened side by side (:class:`Segments`): ranks, Spearman and Pearson correlations, masked means and spreads, the
copies among keys, and the KL-optimal bandwidth. Pure torch (a CPU sorts through numpy); all on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Segments",
    "copy_groups",
    "finite_rows",
    "fit_bandwidth",
    "rank",
    "raveled_pearson",
    "row_spearman",
    "weighted_alike",
]


def rank(x: torch.Tensor) -> torch.Tensor:
    """Ranks ``1..K`` along the last dimension, ties given their average rank (as ``scipy.stats.rankdata``).

    Args:
        x: values, shape ``(..., K)``.

    Returns:
        ranks in ``x``'s floating dtype (float32 for integer input), shape ``(..., K)``.
    """
    return (_bound_sums(x, x.dtype if x.is_floating_point() else torch.float32) + 1) / 2


#: Whether a CPU sorts float32 ranks and nulls' keys through numpy (5x torch's speed on rows of 64), or as others do,
#: the same values (two binary searches, torch's argsort): ``benchmarks/launches.py`` counts so, torch.compile runs so.
NUMPY_SORTS_CPU = True


def numpy_sorts(x: torch.Tensor) -> bool:
    """Whether :data:`NUMPY_SORTS_CPU` applies to ``x``: a float32 CPU tensor, eager."""
    return NUMPY_SORTS_CPU and x.is_cpu and x.dtype == torch.float32 and not torch.compiler.is_compiling()


def sort_packed(bits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rows of int32 ``bits`` ``(..., K)`` sorted in place as int64, each one's place in the low ``shift`` bits (a
    stable argsort), and ``shift``; in torch's memory (numpy's large arrays ask for huge pages: calls stalled)."""
    shift = max(bits.shape[-1] - 1, 1).bit_length()
    packed = bits.long().bitwise_left_shift_(shift).bitwise_or_(torch.arange(bits.shape[-1], device=bits.device))
    packed.numpy().sort(axis=-1)
    return packed, shift


def _bound_sums(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per entry of ``x`` ``(..., K)``, ``low + high`` in ``dtype`` (exact integers): its row's entries below it plus
    those not above it (average rank ``(low + high + 1) / 2``). On a CPU (:func:`numpy_sorts`) the sorted rows' places;
    in rows with ties, each place's group's first place (a running max) and end (a running min from the right)."""
    if not numpy_sorts(x):
        x = x.contiguous()
        sorted_x = x.sort(dim=-1).values
        return (torch.searchsorted(sorted_x, x) + torch.searchsorted(sorted_x, x, right=True)).to(dtype)
    bits = x.detach().view(torch.int32)  # as ordered ints: a negative's magnitude bits negated (-0 as 0; NaN unread)
    packed, shift = sort_packed(((sign := bits >> 31) & 0x7FFFFFFF).bitwise_xor_(bits).sub_(sign))
    order, sorted_x = packed & ((1 << shift) - 1), packed.bitwise_right_shift_(shift)
    n, m, pad = x.shape[-1], math.prod(x.shape[:-1]), torch.nn.functional.pad
    place = torch.arange(n, dtype=dtype, device=x.device)  # without ties: low + high = 2 place + 1, in row order
    sums = x.new_empty(x.shape, dtype=dtype).scatter_(-1, order, (2 * place + 1).expand(x.shape))
    same = (sorted_x[..., 1:] == sorted_x[..., :-1]).reshape(m, n - 1)  # no tie group ends between two places
    tied = same.sum(-1, dtype=torch.int32).nonzero()[:, 0]  # rows with ties (a CPU: no device to wait; K = 1: none)
    if len(tied):
        new = same[tied].logical_not_()
        low = torch.where(pad(new, (1, 0), value=True), place, 0).cummax(-1).values
        high = torch.where(pad(new, (0, 1), value=True), place + 1, n).flip(-1).cummin(-1).values.flip(-1)
        sums.view(m, n)[tied] = low.scatter_(-1, order.reshape(m, n)[tied], low.add(high))
    return sums


def centred_ranks(x: torch.Tensor, mask: torch.Tensor | None, keys: torch.Tensor | None, dtype) -> torch.Tensor:
    """:func:`rank` of each row of ``x`` ``(..., K)`` among its kept entries (``mask``, kept first or anywhere),
    centred over them (their mean ``(n + 1) / 2``, ``n = keys`` ``(...)`` kept entries), 0 at the others; exact
    (half-integers). Without a mask every entry is kept."""
    sums = _bound_sums(x if mask is None else torch.where(mask, x, math.inf), dtype)
    if mask is None:
        return sums.sub_(x.shape[-1]).mul_(0.5)  # (low + high + 1) / 2 - (K + 1) / 2
    return (sums - keys.unsqueeze(-1)).mul_(0.5).mul_(mask)


def _row_pearson(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is None:
        a, b = (x - x.mean(-1, keepdim=True) for x in (a, b))
    else:
        n = (m := mask.to(a.dtype)).sum(-1, keepdim=True)
        a, b = ((x - (x * m).sum(-1, keepdim=True) / n) * m for x in (a, b))
    return (a * b).sum(-1) / ((a * a).sum(-1) * (b * b).sum(-1)).sqrt()


def row_spearman(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman's rho of each row of ``a`` against the same row of ``b``, ``(..., K), (..., K) -> (...)``, over the
    entries where the optional bool ``mask`` ``(..., K)`` holds; NaN where a row is constant, as in scipy."""
    # left-out entries rank above every kept one, so the kept entries get ranks 1..n among themselves
    a, b = (rank(x if mask is None else torch.where(mask, x, math.inf)) for x in (a, b))
    return _row_pearson(a, b, mask)


def raveled_pearson(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pearson's r over all entries of the last two dimensions: ``(..., R, K) -> (...)``.

    Args:
        a, b: weights, shape ``(..., R, K)``.
        mask: optional boolean, ``(..., R)`` (rows where it is False are left out) or ``(..., R, K)`` (entries).
    """
    if mask is None:
        mask = torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device)
    m = (mask.unsqueeze(-1) if mask.dim() == a.dim() - 1 else mask).to(a.dtype).expand(a.shape)
    a, b, n = *(torch.where(m > 0, x, 0.0) for x in (a, b)), m.sum((-2, -1), keepdim=True)
    da, db = ((x - x.sum((-2, -1), keepdim=True) / n) * m for x in (a, b))
    return (da * db).sum((-2, -1)) / ((da * da).sum((-2, -1)) * (db * db).sum((-2, -1))).sqrt()


def _log_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x - logsumexp(x)`` over the last dimension (the values of torch.log_softmax, several times faster on CPU for
    short rows) and whether each row's weights are finite, ``(..., K) -> (..., K), (...)``: the weights
    ``exp(x - lse)`` are all finite exactly when ``lse`` is (a NaN or ``+inf`` logit makes it NaN or ``+inf``, and a
    row of ``-inf`` makes it ``-inf``; ``-inf`` beside a finite logit is a weight of 0), which the row's sum already
    holds."""
    lse = x.logsumexp(-1, keepdim=True)
    return x - lse, finite_rows(lse)


@dataclass(frozen=True)
class Segments:
    """The rows of many cells flattened on one axis (cells of any number of rows in one pass): each row's cell, and
    its replicate group for the sampling errors (:func:`~.agreement.compare_frames`' ``replicates``: row ``j`` of a
    cell in group ``j mod G``).

    Attributes:
        ids: ``(N,)`` int64, each row's cell in ``0..cells - 1``.
        cells: how many cells.
        replicate_ids: ``(N,)`` int64, ``cell * G + j mod G``, or ``None`` without replicates.
        replicates: ``G``, or ``None``.
    """

    ids: torch.Tensor
    cells: int
    replicate_ids: torch.Tensor | None = None
    replicates: int | None = None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per cell, the sum of ``x``'s rows: ``(..., N) -> (..., cells)``."""
        return x.new_zeros(*x.shape[:-1], self.cells).index_add_(x.dim() - 1, self.ids, x)

    def sum_replicates(self, x: torch.Tensor) -> torch.Tensor:
        """Per cell and replicate group, the sum of ``x``'s rows: ``(..., N) -> (..., cells * G)``."""
        size = self.cells * self.replicates
        return x.new_zeros(*x.shape[:-1], size).index_add_(x.dim() - 1, self.replicate_ids, x)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Whether every entry of each row is finite, ``(..., K) -> (...)``: ``x.isfinite().all(-1)``, as the sum of
    ``x * 0`` (0 for a finite entry, NaN for an infinite or NaN one), which is several times faster on CPU."""
    return (x * 0).sum(-1) == 0


def _row_sd(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Population standard deviation of each row, over the entries where ``mask`` holds: ``(..., K) -> (...)``."""
    if mask is None:
        # two passes (mean, then the centred squares), several times faster than torch.std's per-row Welford on CPU
        # for short rows; equal to it within float32 rounding (a few ulp)
        centred = x - x.mean(-1, keepdim=True)
        return (centred * centred).mean(-1).sqrt()
    m = mask.to(x.dtype)
    x = torch.where(mask, x, 0.0)
    n = m.sum(-1, keepdim=True)
    centred = (x - x.sum(-1, keepdim=True) / n) * m
    return ((centred * centred).sum(-1) / n.squeeze(-1)).sqrt()


def copy_groups(keys: torch.Tensor, rtol: float = 1e-5) -> torch.Tensor:
    """Which keys are copies of one token: for each key, the index of the first key equal to it up to float noise.

    Two keys count as copies when ``|k_i - k_j|^2 <= rtol * (|k_i|^2 + |k_j|^2)`` (e.g. the unconditional image
    tokens of several reference images, projected from the same zero embedding, agree up to rounding).

    Args:
        keys: ``(..., K, D)``.
        rtol: relative tolerance on the squared distance.

    Returns:
        group ids, shape ``(..., K)``, int64: equal ids mark copies (pass them as ``key_groups`` to
        :func:`~.agreement.compare_weights`).
    """
    keys = keys.float()
    gram = keys @ keys.transpose(-1, -2)  # (..., K, K)
    sq = gram.diagonal(dim1=-2, dim2=-1)  # (..., K) |k_i|^2
    # |k_i - k_j|^2 = sq_i + sq_j - 2 k_i·k_j <= rtol (sq_i + sq_j), i.e. (1 - rtol) (sq_i + sq_j) / 2 <= k_i·k_j
    same = (sq.unsqueeze(-1) + sq.unsqueeze(-2)).mul_((1 - rtol) / 2) <= gram
    return same.to(torch.uint8).argmax(-1)  # the first True of each row (the diagonal is always True)


def weighted_alike(x: torch.Tensor, groups: torch.Tensor, atol: float = 1e-4) -> torch.Tensor:
    """Per key of rows ``x`` ``(..., K)``, the key whose value ranks it (int64): its copies (``groups``) within
    ``atol`` of one another (chained) share one, so copies an edit weighted apart rank apart, others tie exactly."""
    groups = groups.expand(x.shape)
    order = x.argsort(-1)  # by value, then (stable) by group: each group's copies side by side, ascending
    order = order.gather(-1, groups.gather(-1, order).argsort(dim=-1, stable=True))
    value, group = x.gather(-1, order), groups.gather(-1, order)
    new = torch.nn.functional.pad((value.diff(dim=-1) > atol) | (group.diff(dim=-1) != 0), (1, 0), value=True)
    start = torch.where(new, torch.arange(x.shape[-1], device=x.device), 0).cummax(-1).values  # each run's first
    return torch.empty_like(order).scatter_(-1, order, order.gather(-1, start))


def fit_bandwidth(
    attn_logits: torch.Tensor,
    energy: torch.Tensor,
    center: float,
    coarse: int = 25,
    fine: int = 17,
    span: float = 6.0,
) -> torch.Tensor:
    """The bandwidth ``h`` per group that minimises the row-mean ``KL(attention || NW_h)``, by a two-stage grid.

    NW logits at bandwidth ``h`` are ``energy / h^2`` with ``energy = q·k - |k|^2 / 2`` (paper §C.3). The search runs
    over ``log h^2`` in ``log(center^2) ± span`` on ``coarse`` points, then on ``fine`` points within one coarse step
    of the best, all on the device (no host synchronisation).

    Args:
        attn_logits: attention logits, shape ``(..., R, K)``.
        energy: ``q·k - |k|^2 / 2`` for the same rows and keys, shape ``(..., R, K)``.
        center: the bandwidth around which to search (e.g. the matched one).

    Returns:
        ``h``, shape ``(...)``, float32.
    """
    log_a = torch.log_softmax(attn_logits.float(), dim=-1)
    a = log_a.exp()
    energy = energy.float()

    def mean_kl(log_tau: torch.Tensor) -> torch.Tensor:
        log_w = torch.log_softmax(energy * torch.exp(-log_tau)[..., None, None], dim=-1)
        kl = torch.where(a > 0, a * (log_a - log_w), 0.0).sum(-1)
        return torch.nan_to_num(kl, nan=math.inf).mean(-1)

    group_shape = attn_logits.shape[:-2]
    step = 2 * span / (coarse - 1)
    best = torch.full(group_shape, 2 * math.log(center), device=attn_logits.device)
    best_kl = torch.full(group_shape, math.inf, device=attn_logits.device)
    for offsets, around in ((torch.linspace(-span, span, coarse), None), (torch.linspace(-step, step, fine), True)):
        base = best.clone() if around else best
        for offset in offsets.tolist():  # host-side grid, no device sync
            log_tau = base + offset
            kl = mean_kl(log_tau)
            better = kl < best_kl
            best = torch.where(better, log_tau, best)
            best_kl = torch.where(better, kl, best_kl)
    return torch.exp(best / 2)
