"""Statistics that compare two attention-weight matrices row by row. Pure torch; everything stays on the device.

The probe (IP-Adapter attention against Gaussian NW weights) and the experiments (learned heads of the in-context
model against data-space NW weights) both reduce their comparisons through :func:`compare_weights`, so the
numbers in both tables mean the same thing.

Conventions: inputs are logits of shape ``(..., R, K)`` (``R`` rows, e.g. queries of every batch item, ``K`` keys);
the leading dimensions ``...`` are groups (typically heads) and are kept. A row whose weights are not all finite is
counted in ``nonfinite`` and left out of every other statistic instead of raising.
"""

from __future__ import annotations

import math

import torch

from .kernels import n_eff
from .schema import STAT_NAMES

__all__ = [
    "STAT_NAMES",
    "compare_weights",
    "copy_groups",
    "fit_bandwidth",
    "rank",
    "raveled_pearson",
    "row_spearman",
]


def rank(x: torch.Tensor) -> torch.Tensor:
    """Ranks ``1..K`` along the last dimension, ties given their average rank (as ``scipy.stats.rankdata``).

    Args:
        x: values, shape ``(..., K)``.

    Returns:
        ranks in ``x``'s floating dtype (float32 for integer input), shape ``(..., K)``.
    """
    dtype = x.dtype if x.is_floating_point() else torch.float32
    k = x.shape[-1]
    sorted_x, order = x.sort(dim=-1)
    position = torch.arange(1, k + 1, device=x.device, dtype=dtype).expand(sorted_x.shape)
    starts = torch.ones_like(sorted_x, dtype=torch.bool)
    starts[..., 1:] = sorted_x[..., 1:] != sorted_x[..., :-1]
    group = starts.cumsum(-1) - 1  # (..., K) index of each sorted value's tie group within its row
    total = torch.zeros_like(position).scatter_add_(-1, group, position)
    count = torch.zeros_like(position).scatter_add_(-1, group, torch.ones_like(position))
    average = total.gather(-1, group) / count.gather(-1, group)
    return torch.empty_like(average).scatter_(-1, order, average)


def _row_pearson(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is None:
        a = a - a.mean(-1, keepdim=True)
        b = b - b.mean(-1, keepdim=True)
    else:
        m = mask.to(a.dtype)
        n = m.sum(-1, keepdim=True)
        a = (a - (a * m).sum(-1, keepdim=True) / n) * m
        b = (b - (b * m).sum(-1, keepdim=True) / n) * m
    return (a * b).sum(-1) / ((a * a).sum(-1) * (b * b).sum(-1)).sqrt()


def _masked_ranks(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # Left-out entries rank above every kept one, so the kept entries get ranks 1..n among themselves.
    return rank(x if mask is None else torch.where(mask, x, math.inf))


def row_spearman(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman's rho of each row of ``a`` against the same row of ``b``: ``(..., K), (..., K) -> (...)``.

    A row that is constant in ``a`` or ``b`` has no rank correlation and gives NaN, as in scipy.

    Args:
        a, b: values, shape ``(..., K)``.
        mask: optional boolean ``(..., K)``: only the entries where it holds take part (ranked among themselves).
    """
    return _row_pearson(_masked_ranks(a, mask), _masked_ranks(b, mask), mask)


def raveled_pearson(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pearson's r over all entries of the last two dimensions: ``(..., R, K) -> (...)``.

    Args:
        a, b: weights, shape ``(..., R, K)``.
        mask: optional boolean, ``(..., R)`` (rows where it is False are left out) or ``(..., R, K)`` (entries).
    """
    if mask is None:
        mask = torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device)
    if mask.dim() == a.dim() - 1:
        mask = mask.unsqueeze(-1)
    m = mask.to(a.dtype).expand(a.shape)
    a = torch.where(m > 0, a, 0.0)
    b = torch.where(m > 0, b, 0.0)
    n = m.sum((-2, -1))
    mean_a = a.sum((-2, -1)) / n
    mean_b = b.sum((-2, -1)) / n
    da = (a - mean_a[..., None, None]) * m
    db = (b - mean_b[..., None, None]) * m
    return (da * db).sum((-2, -1)) / ((da * da).sum((-2, -1)) * (db * db).sum((-2, -1))).sqrt()


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    # x - logsumexp(x): the same values as torch.log_softmax, several times faster on CPU for short rows
    return x - x.logsumexp(-1, keepdim=True)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the last dimension where ``mask`` holds (NaN where nothing does)."""
    mask = mask & ~x.isnan()
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1)


def _shuffle_rows(w: torch.Tensor, generator: torch.Generator, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` with an independent uniformly random permutation of the last dimension in every row.

    With a boolean ``prefix`` mask (kept entries first in every row), only the kept entries are shuffled.
    """
    noise = torch.rand(w.shape, generator=generator, device=w.device, dtype=torch.float32)
    if prefix is not None:
        noise = torch.where(prefix, noise, 2.0)
    return w.gather(-1, noise.argsort(-1))


def compare_weights(
    attn_logits: torch.Tensor,
    nw_logits: torch.Tensor,
    generator: torch.Generator | None = None,
    key_mask: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compare attention weights with NW weights row by row, reduced over rows.

    With ``a = softmax(attn_logits)`` and ``w = softmax(nw_logits)`` (over keys), the statistics, in the order of
    :data:`STAT_NAMES`, are:

    - ``spearman``: per-row Spearman rho between ``a`` and ``w``, averaged over rows (rows where it is undefined,
      e.g. ``K = 1``, are left out);
    - ``spearman_null``: the same with the key order of ``w`` shuffled independently in each row (chance level, ~0);
    - ``pearson``: Pearson r over all ``R * K`` entries;
    - ``kl``: ``KL(a || w) = sum_i a_i (log a_i - log w_i)``, averaged over rows;
    - ``top1``: fraction of rows whose arg-max key agrees (keys of one ``key_groups`` group count as one key);
    - ``neff_attn``, ``neff_nw``: Kish ``1 / sum_i w_i^2``, averaged over rows;
    - ``nonfinite``: fraction of rows whose logits give non-finite weights (left out of everything else).

    Rows where ``row_mask`` is False (e.g. queries outside an IP-Adapter mask) take part in nothing, ``nonfinite``
    included.

    Args:
        attn_logits: logits of the attention weights, shape ``(..., R, K)``.
        nw_logits: logits of the NW weights, same shape.
        generator: random source of the null's permutations; a fixed-seed generator on the logits' device is made
            when omitted, so the caller's global random state is never touched.
        key_mask: optional boolean, broadcastable to the logits' shape: keys where it is False (e.g. padding
            tokens) are left out, and both weightings are renormalised over the kept keys.
        row_mask: optional boolean, shape ``(..., R)``: only the rows where it holds are compared.
        key_groups: optional integers, broadcastable to the logits' shape: keys with the same value are copies of one
            token (e.g. the unconditional image tokens of several reference images), so an arg-max on either copy
            is the same choice for ``top1``.

    Returns:
        statistics, shape ``(..., len(STAT_NAMES))``, float32, on the logits' device.
    """
    for name, value in (("attn_logits", attn_logits), ("nw_logits", nw_logits)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor of shape (..., R, K), got {type(value).__name__}")
    if attn_logits.shape != nw_logits.shape:
        raise ValueError(
            f"expected attention and NW logits of the same shape, got {attn_logits.shape} and {nw_logits.shape}"
        )
    if generator is None:
        generator = torch.Generator(device=attn_logits.device).manual_seed(0)
    dtype = torch.promote_types(attn_logits.dtype, torch.float32)
    attn_logits, nw_logits = attn_logits.to(dtype), nw_logits.to(dtype)
    if key_groups is not None:
        key_groups = key_groups.expand(attn_logits.shape)
    if key_mask is not None:
        key_mask = key_mask.to(torch.bool).expand(attn_logits.shape)
        # One permutation for both weightings, kept keys first: every statistic is invariant to it, and the mask
        # becomes a prefix, which the null's shuffle needs.
        order = (~key_mask).to(torch.uint8).argsort(dim=-1, stable=True)
        key_mask = key_mask.gather(-1, order)
        attn_logits = attn_logits.gather(-1, order).masked_fill(~key_mask, -math.inf)
        nw_logits = nw_logits.gather(-1, order).masked_fill(~key_mask, -math.inf)
        key_groups = key_groups.gather(-1, order) if key_groups is not None else None
    log_a = _log_softmax(attn_logits)  # (..., R, K)
    log_w = _log_softmax(nw_logits)
    a, w = log_a.exp(), log_w.exp()
    finite = (a.isfinite() & w.isfinite()).all(-1)  # (..., R)
    valid = finite if row_mask is None else finite & row_mask
    a = torch.where(valid.unsqueeze(-1), a, 1.0)
    w = torch.where(valid.unsqueeze(-1), w, 1.0)

    kl_rows = torch.where(a > 0, a * (log_a - log_w), 0.0).sum(-1)
    top_a, top_w = a.argmax(-1, keepdim=True), w.argmax(-1, keepdim=True)  # (..., R, 1)
    if key_groups is not None:
        top_a, top_w = key_groups.gather(-1, top_a), key_groups.gather(-1, top_w)
    top1_rows = (top_a == top_w).squeeze(-1).float()
    # Ranks are taken on the logits: the same order as the weights, without the ties that underflow makes. The null
    # shuffles the NW ranks themselves (ranking is permutation-equivariant), so each side is ranked once.
    entries = valid if key_mask is None else valid.unsqueeze(-1) & key_mask
    attn_ranks, nw_ranks = _masked_ranks(attn_logits, key_mask), _masked_ranks(nw_logits, key_mask)
    stats = (
        _masked_mean(_row_pearson(attn_ranks, nw_ranks, key_mask), valid),
        _masked_mean(_row_pearson(attn_ranks, _shuffle_rows(nw_ranks, generator, key_mask), key_mask), valid),
        raveled_pearson(a, w, entries),
        _masked_mean(kl_rows, valid),
        _masked_mean(top1_rows, valid),
        _masked_mean(n_eff(a), valid),
        _masked_mean(n_eff(w), valid),
        1.0 - valid.float().mean(-1) if row_mask is None else 1.0 - valid.sum(-1) / row_mask.sum(-1),
    )
    return torch.stack(stats, dim=-1).float()


def copy_groups(keys: torch.Tensor, rtol: float = 1e-5) -> torch.Tensor:
    """Which keys are copies of one token: for each key, the index of the first key equal to it up to float noise.

    Two keys count as copies when ``|k_i - k_j|^2 <= rtol * (|k_i|^2 + |k_j|^2)`` (e.g. the unconditional image
    tokens of several reference images, projected from the same zero embedding, agree up to rounding).

    Args:
        keys: ``(..., K, D)``.
        rtol: relative tolerance on the squared distance.

    Returns:
        group ids, shape ``(..., K)``, int64: equal ids mark copies (pass them as ``key_groups`` to
        :func:`compare_weights`).
    """
    keys = keys.float()
    sq = (keys * keys).sum(-1)  # (..., K)
    dist = sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2 * keys @ keys.transpose(-1, -2)  # (..., K, K)
    same = dist <= rtol * (sq.unsqueeze(-1) + sq.unsqueeze(-2))
    return same.to(torch.uint8).argmax(-1)  # the first True of each row (the diagonal is always True)


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
