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
from collections.abc import Sequence

import torch

from .draws import Draws, shuffle_rows
from .kernels import n_eff
from .nulls import null_tail, rho_baseline
from .rows import Segments, _log_softmax, _row_pearson, _row_sd, centred_ranks, raveled_pearson, weighted_alike
from .schema import ROW_THRESHOLD, STAT_NAMES, rows_column

__all__ = ["compare_frames", "compare_weights", "null_tail_table"]


def null_tail_table(keys: int, device: torch.device) -> torch.Tensor:
    """:func:`null_tail` for ``0..keys`` keys as a ``(keys + 1,)`` float32 tensor made by fills on ``device`` (no
    tensor from host data, so no host-to-device copy)."""
    table = torch.empty(keys + 1, device=device)
    for k in range(keys + 1):
        table[k] = null_tail(k)
    return table


def compare_weights(
    attn_logits: torch.Tensor,
    nw_logits: torch.Tensor,
    generator: torch.Generator | None = None,
    key_mask: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    key_term: torch.Tensor | None = None,
    null_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compare attention weights with NW weights row by row, reduced over rows.

    With ``a = softmax(attn_logits)`` and ``w = softmax(nw_logits)`` (over keys), the statistics, in the order of
    :data:`STAT_NAMES`, are:

    - ``spearman``: per-row Spearman rho between ``a`` and ``w``, averaged over rows (rows where it is undefined,
      e.g. ``K = 1`` or constant logits, are left out of it and of every statistic of rho below); keys of one
      ``key_groups`` group tie (their average rank) on both sides;
    - ``spearman_null``: the same with the key order of ``w`` shuffled independently in each row (chance level, ~0);
    - ``pearson``: Pearson r over all ``R * K`` entries; NaN when either side has no spread in any row (every NW row
      uniform, as in a query frame of one query);
    - ``kl``: ``KL(a || w) = sum_i a_i (log a_i - log w_i)``, averaged over rows;
    - ``top1``: fraction of rows whose arg-max key agrees (keys of one ``key_groups`` group count as one key), over
      the rows with a rank correlation (an all-tied row's arg-max is a tie-break: undefined, left out);
    - ``neff_attn``, ``neff_nw``: Kish ``1 / sum_i w_i^2``, averaged over rows;
    - ``nonfinite``: fraction of rows whose logits give non-finite weights (left out of everything else);
    - ``logit_ratio``: per row ``r = sd_i(attn_logits) / sd_i(key_term)``, averaged over the rows where it is
      finite (infinite where the key term is flat to float32 rounding: 1e-5 of its largest entry). Without
      ``key_term`` (NW weights not made from the attention's own query and keys) ``r`` is estimated as
      ``c / sqrt(1 - c^2)`` from the per-row Pearson ``c`` of the two logit vectors, the same ``r`` under the
      baseline's model (``|c|`` within 1e-6 of 1, as with two keys, gives ``r = +-inf``: left out of the mean of
      ``r``, baseline +-1);
    - ``rho_baseline``: per row :func:`rho_baseline` of its ``r`` and its number of kept keys, averaged;
    - ``rho_excess``: ``spearman - rho_baseline`` (the mean over rows of the per-row differences);
    - ``rows_rho_gt_0.9``: share of rows whose rho is above :data:`~ipa_probe.statistics.schema.ROW_THRESHOLD`, and
      ``rows_rho_gt_0.9_null`` its chance level (the mean over the same rows of :func:`null_tail` of their number
      of keys);
    - ``rows_rho_pos1``, ``rows_rho_neg1``: share of rows whose ranks agree exactly (rho = +1) or are exactly
      reversed (rho = -1), and ``rows_rho_pos1_null`` the chance of either, ``1 / K!`` averaged over the rows.

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
        key_groups: optional integers, broadcastable to the logits' shape: for each key, the index (in the last
            dimension) of the first copy of its token (:func:`~.rows.copy_groups`), e.g. the unconditional image tokens
            of several reference images: copies tie in ``spearman`` and an arg-max on either copy is the same choice
            for ``top1``.
        key_term: optional, broadcastable to the logits' shape (typically ``(..., 1, K)``): the NW logits' per-key
            term in the units of ``attn_logits``, such that the NW ranks follow ``attn_logits - key_term`` (for NW
            weights from the same ``q, k`` as dot-product attention, ``|k|^2 / (2 sqrt(d))``). Its spread against
            the attention logits' is ``logit_ratio``.
        null_tails: optional ``(K + 1,)`` tensor of :func:`null_tail` for ``0..K`` keys on the logits' device, for
            ``key_mask`` rows (made by fills when omitted; pass it to reuse one).

    Returns:
        statistics, shape ``(..., len(STAT_NAMES))``, float32, on the logits' device.
    """
    for name, value in (("attn_logits", attn_logits), ("nw_logits", nw_logits), ("key_term", key_term)):
        if not isinstance(value, torch.Tensor) and not (name == "key_term" and value is None):
            raise TypeError(f"{name}: expected a tensor of shape (..., R, K), got {type(value).__name__}")
    if attn_logits.shape != nw_logits.shape:
        raise ValueError(
            f"expected attention and NW logits of the same shape, got {attn_logits.shape} and {nw_logits.shape}"
        )
    if generator is None:
        generator = torch.Generator(device=attn_logits.device).manual_seed(0)
    logits = torch.stack((attn_logits, nw_logits))
    return _frame_stats(logits, nw_logits.shape, generator, key_mask, row_mask, key_groups, key_term, null_tails)


def compare_frames(
    attn_logits: torch.Tensor,
    frames: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Generator]],
    key_mask: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    key_groups: torch.Tensor | None = None,
    null_tails: torch.Tensor | None = None,
    replicates: int | None = None,
    segments: Segments | None = None,
    stack: torch.Tensor | None = None,
    apart: bool = False,
) -> list[torch.Tensor]:
    """:func:`compare_weights` of one attention against several NW weightings, its shared part computed once.

    The attention is stacked with the frames' NW logits, so every step of one side (the reordering for the key mask,
    log-softmax, arg-max, ``n_eff``, ranks) runs once for the attention and all frames. Each frame's result equals
    :func:`compare_weights` of the same arguments (its own generator draws the same null).

    Args:
        attn_logits: ``(..., R, K)`` attention logits.
        frames: per frame ``(nw_logits, key_term, generator)``: NW logits of shape ``(*F, ..., R, K)`` (extra
            leading dimensions ``F`` allowed, e.g. the two query-frame forms), ``key_term`` broadcastable to them or
            ``None``, the null's random source (or its keys, :data:`~.draws.Draws`).
        key_mask, row_mask, key_groups, null_tails: as for :func:`compare_weights`, shaped like (or broadcastable
            to) ``attn_logits``.
        replicates: ``G`` to also estimate each statistic's sampling error over the rows: the rows (a stratified
            sample, strata in row order) are split into ``G`` interleaved groups (row ``j`` in group ``j mod G``;
            ``R`` a multiple of ``G``), each statistic is computed in every group, and its standard error is
            ``sd_g / sqrt(G)`` (the random-groups estimator); for a share of rows (``top1``, ``nonfinite``,
            ``rows_rho_*``) at least the binomial error ``sqrt(p (1 - p) / n)`` at ``p = (hits + 1/2) / (n + 1)``,
            so that an event the sample missed does not get an error of 0.
        segments: the rows of many cells flattened on one axis (``attn_logits`` ``(N, K)``, NW logits ``(*F, N, K)``,
            masks and key terms per row): each statistic is reduced per cell (:class:`~.rows.Segments`), so cells of
            any sizes go through one pass; without a key mask.
        stack: ``attn_logits`` and every frame's NW logits stacked, ``(1 + sum F, ..., R, K)`` (they are its views),
            or ``None`` to stack them here.
        apart: the attention's copies tie only where its logits agree (:func:`~.rows.weighted_alike`: an edit's
            weights, which may weight copies apart); the NW weightings' (from the keys) and ``top1`` keep the groups.

    Returns:
        per frame, ``(*F, ..., len(STAT_NAMES))`` float32; with ``replicates``, ``(*F, ..., 2, len(STAT_NAMES))``:
        the estimates, then their standard errors (``...`` is the cells with ``segments``).
    """
    if not isinstance(attn_logits, torch.Tensor):
        raise TypeError(f"attn_logits: expected a tensor of shape (..., R, K), got {type(attn_logits).__name__}")
    if segments is not None and (key_mask is not None or attn_logits.dim() != 2):
        raise ValueError("segments: expected flattened rows (N, K) without a key mask")
    if segments is None and replicates is not None and (replicates < 2 or attn_logits.shape[-2] % replicates):
        raise ValueError(f"replicates: expected G >= 2 dividing the rows ({attn_logits.shape[-2]}), got {replicates}")
    for nw_logits, _, _ in frames:
        if nw_logits.shape[-attn_logits.dim() :] != attn_logits.shape:
            raise ValueError(f"expected NW logits of shape (..., {tuple(attn_logits.shape)}), got {nw_logits.shape}")
    lead = [nw.shape[: nw.dim() - attn_logits.dim()] for nw, _, _ in frames]  # each frame's F
    per_key = attn_logits.shape[:-2] + (1, attn_logits.shape[-1])  # (..., 1, K)
    if all(t is not None and t.shape[-2] == 1 for _, t, _ in frames):
        term_shape = per_key
    elif segments is not None and all(t is not None for _, t, _ in frames):
        term_shape = attn_logits.shape  # flattened rows: each row carries its cell's key term
    else:
        term_shape = None
    if len(frames) > 1 and term_shape is not None:
        # Frames whose key terms are per key (the probe's stored and query frames) go through one stacked pass:
        # (sum F, ..., R, K). Every statistic is per row and reduced per cell, so each frame's values are those of
        # its own pass; each generator draws its own frames' nulls.
        sizes = [math.prod(f) for f in lead]
        if stack is None:
            stack = torch.cat([attn_logits[None], *(nw.reshape(-1, *attn_logits.shape) for nw, _, _ in frames)])
        terms = torch.cat(
            [t.expand(*f, *term_shape).reshape(-1, *term_shape) for (_, t, _), f in zip(frames, lead, strict=True)]
        )
        draws = [(g, n) for (_, _, g), n in zip(frames, sizes, strict=True)]
        shape = (sum(sizes), *attn_logits.shape)
        rest = (key_mask, row_mask, key_groups, terms, null_tails, replicates, segments, apart)
        stats = _frame_stats(stack, shape, draws, *rest)
        return [part.reshape(*f, *part.shape[1:]) for part, f in zip(stats.split(sizes), lead, strict=True)]
    return [
        _frame_stats(
            torch.cat((attn_logits[None], nw.reshape(-1, *attn_logits.shape))),
            *(nw.shape, generator, key_mask, row_mask, key_groups, key_term, null_tails, replicates, segments, apart),
        )
        for nw, key_term, generator in frames
    ]


#: Most keys for which sums of squared centred ranks are exact in float32 (:func:`_frame_stats`' rank agreement):
#: centred ranks are multiples of 1/2, their products multiples of 1/4, and a row's sum of ``K`` of them stays below
#: ``K^3 / 12 < 2^22`` (where multiples of 1/4 are exact) up to ``K = 369``; 128 leaves room for masked rows.
EXACT_RANK_SUMS = 128


def _frame_stats(
    logits: torch.Tensor,
    shape: torch.Size,
    generator: Draws,
    key_mask: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    key_groups: torch.Tensor | None,
    key_term: torch.Tensor | None,
    null_tails: torch.Tensor | None,
    replicates: int | None = None,
    segments: Segments | None = None,
    apart: bool = False,
) -> torch.Tensor:
    """The statistics of :func:`compare_weights` of NW weightings of ``shape`` ``(*F, ..., R, K)`` (several frames
    stacked on the leading dimension with per-block ``generator`` draws, see :func:`~.draws.shuffle_rows`) against
    one attention, both in ``logits`` ``(1 + prod(F), ..., R, K)``, the attention first: every step of one side runs
    once on the stack; per cell of ``segments`` where given."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits, n_keys = logits.to(dtype), shape[-1]
    # Copies of one token are one key: both sides rank every copy on its group's first copy, so copies tie exactly.
    # Their logits, equal in exact arithmetic, can differ in the last bits on one side only (a matmul's vector tail,
    # another CPU's kernel), and an average rank on one side against split ranks on the other lowered rho by ~1e-3.
    # An edited attention (apart) ranks the copies it weighted apart as the keys they are.
    order_by = logits if key_groups is None else logits.gather(-1, key_groups.expand(logits.shape))
    if apart and key_groups is not None:
        order_by[0] = logits[0].gather(-1, weighted_alike(logits[0], key_groups))
    groups, keys = key_groups, n_keys  # keys kept per row: a number without a key mask
    key_term = key_term.to(dtype) if key_term is not None else None
    if key_mask is not None:
        key_mask = key_mask.to(torch.bool).expand(logits.shape[1:])
        # One permutation for both weightings, kept keys first: every statistic is invariant to it, and the mask
        # becomes a prefix, which the null's shuffle needs.
        order = (~key_mask).to(torch.uint8).argsort(dim=-1, stable=True)
        key_mask = key_mask.gather(-1, order)
        logits = logits.gather(-1, order.expand(logits.shape)).masked_fill(~key_mask, -math.inf)
        order_by = order_by.gather(-1, order.expand(logits.shape))
        groups = key_groups.expand(order.shape).gather(-1, order) if key_groups is not None else None
        key_term = key_term.expand(shape).gather(-1, order.expand(shape)) if key_term is not None else None
        keys = key_mask.sum(-1).to(dtype)
    log_p, finite = _log_softmax(logits)  # (1 + F, ..., R, K), (1 + F, ..., R)
    p = log_p.exp()  # not finite in rows left out of everything (valid), whose values every reduction masks
    top = p.max(-1, keepdim=True).indices  # the first largest, as argmax (and faster on CPU)
    if groups is not None:
        top = groups.expand(logits.shape).gather(-1, top)
    # Ranks are taken on the logits: the same order as the weights, without the ties that underflow makes.
    centred = centred_ranks(order_by, key_mask, keys if key_mask is not None else None, dtype)
    centred_sq = (centred * centred).sum(-1)

    def nw(x: torch.Tensor) -> torch.Tensor:  # the NW weightings' part of a stacked tensor, (*F, ..., R[, K])
        return x[1:].reshape(*shape[: len(shape) + 1 - logits.dim()], *x.shape[1:])

    a, log_a, c_a, sq_a = p[0], log_p[0], centred[0], centred_sq[0]
    w, c_w, sq_w = nw(p), nw(centred), nw(centred_sq)
    valid = finite[0] & nw(finite)  # (*F, ..., R)
    valid = valid if row_mask is None else valid & row_mask
    kl_rows = (a * (log_a - nw(log_p))).masked_fill_(a <= 0, 0.0).sum(-1)
    # The null shuffles the centred ranks: a row's kept ranks keep their mean and sum of squares under a permutation
    # (exactly: half-integers), so centring after the shuffle would give the same values.
    # (2, *F, ..., R): each side's products summed apart (exact: multiples of 1/4), not a stacked copy of the ranks
    cross = torch.stack([(c_a * c).sum(-1) for c in (c_w, shuffle_rows(c_w, generator, key_mask))])
    (rho_rows, null_rows), cross = cross / (sq_a * sq_w).sqrt(), cross[0]
    ranked = valid & (rho_rows == rho_rows)  # rows with a rank correlation
    # an arg-max of an all-tied row (a query frame of one query, constant logits) is a tie-break, not a choice: the
    # row's top1 is undefined (NaN, left out of the mean, as rho is)
    top1_rows = (top[0] == nw(top)).squeeze(-1) + rho_rows * 0
    if key_term is not None:
        # the key term's spread; a term the same in every row (the probe's: (..., 1, K)) is measured once, one per
        # row with the attention logits' (one stack)
        if key_mask is not None or key_term.shape[-2] != 1:
            sd = _row_sd(torch.cat((logits[:1], key_term.expand(shape).reshape(-1, *logits.shape[1:]))), key_mask)
            gauge = sd[0] / _flat(nw(sd), key_term)  # its largest entry per row, broadcast
        else:
            gauge = _row_sd(logits[0], key_mask) / _flat(_row_sd(key_term, key_mask), key_term)
    else:
        gauge = _gauge_rows(logits[0], nw(logits), key_mask)
    baseline_rows = rho_baseline(gauge, keys)
    if key_mask is None:
        chance_rows = torch.full_like(sq_a, null_tail(n_keys))
        inverse_factorial = torch.full_like(sq_a, math.exp(-math.lgamma(n_keys + 1)))
    else:
        table = null_tails if null_tails is not None else null_tail_table(n_keys, keys.device)
        chance_rows = table.to(dtype)[key_mask.sum(-1)]
        inverse_factorial = torch.exp(-torch.lgamma(keys + 1))
    if n_keys <= EXACT_RANK_SUMS or dtype == torch.float64:
        # |c_a -+ c_w|^2 = |c_a|^2 + |c_w|^2 -+ 2 c_a.c_w over the centred ranks, exact (see EXACT_RANK_SUMS): 0 iff
        # the kept keys' ranks agree (same) or are reversed
        sq, twice = sq_a + sq_w, 2 * cross
        same, reversed_ = sq == twice, sq == -twice
    else:  # centred ranks (0 at left-out keys) equal or opposite at every key
        same, reversed_ = (c_a == c_w).all(-1), (c_a == -c_w).all(-1)
    raveled, a_full, entries = [], None, None  # the one form each branch below fills (closures read them)
    if key_mask is None:
        # Pearson over a cell's R * K entries from per-row sums: without a key mask every row's weights sum to 1, so
        # the entries' mean is 1/K on both sides and the centred cross products and squares add up row by row
        deviation = p - 1.0 / n_keys
        deviation_sq = (deviation * deviation).sum(-1)
        raveled = [(deviation[0] * nw(deviation)).sum(-1), deviation_sq[0], nw(deviation_sq)]
        neff = 1.0 / (deviation_sq + 1.0 / n_keys)  # sum_i w_i^2 = sum_i (w_i - 1/K)^2 + 1/K: no cancellation
    else:
        a_full, entries = a.expand(shape), valid.unsqueeze(-1) & key_mask
        neff = n_eff(p)
    rows = row_mask.expand(valid.shape) if row_mask is not None else torch.ones_like(valid)
    varies = centred_sq > 0  # the rows whose ranks vary, on each side
    # Every per-row value stacked on a leading axis (S, *F, ..., R), each with the rows it is averaged over: the
    # valid rows, the ranked ones (rho defined; the gauge where it is finite, + 0 * gauge making it NaN elsewhere),
    # then the counts of rows whose ranks vary on each side, of valid, ranked and compared rows, and the raveled
    # Pearson's per-row sums. Non-NaN values only, so that one masked sum gives every mean.
    per_row = (rho_rows, null_rows, kl_rows, top1_rows, neff[0], nw(neff))  # over the valid rows
    per_row += (baseline_rows, rho_rows - baseline_rows, rho_rows > ROW_THRESHOLD + ROW_TIE, chance_rows)
    per_row += (same, reversed_, inverse_factorial, gauge + gauge * 0, varies[0], nw(varies), valid, ranked, rows)
    values = torch.stack([x.expand(valid.shape) for x in (*per_row, *raveled)])  # bools as 0 / 1
    over_rows = (valid,) * 6 + (ranked,) * 8 + (valid,) * 3 + (ranked, rows) + (valid,) * len(raveled)
    masks = (values == values) & torch.stack(over_rows)

    def reduce(split, total) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics from per-row values: ``split`` lays the rows out for ``total``, which sums over a cell's rows
        (the last axis, its replicate groups', or each segment's), every sum in one; ``keyed``: rows on -2. And the
        counts of valid, ranked and compared rows."""
        m = split(masks)
        sums = total(torch.cat((torch.where(m, split(values), 0.0), m)))  # (2 S, *F, ..., cells)
        means = sums[:14] / sums[len(over_rows) : len(over_rows) + 14]
        if key_mask is None:  # from the rows' cross products and squares
            pearson = sums[19] / (sums[20] * sums[21]).sqrt()
        else:
            pearson = raveled_pearson(split(a_full, True), split(w, True), split(entries, True))
        # a side without variation over the cell's rows (every NW row uniform, as in a query frame of one query) has
        # no correlation: NaN, not the float noise of 1/K - softmax(0)
        pearson = pearson.masked_fill(sums[14] * sums[15] == 0, math.nan)
        nonfinite = 1.0 - sums[16] / sums[18]  # rows valid over rows
        parts = (means[:2], pearson[None], means[2:6], nonfinite[None], means[13:], means[6:13])
        return torch.cat(parts).movedim(0, -1).float(), sums[16:19]

    total = (lambda x: x.sum(-1)) if segments is None else segments.sum
    stats, counts = reduce(lambda x, keyed=False: x, total)
    if replicates is None:
        return stats

    def groups_of(x: torch.Tensor, keyed: bool = False) -> torch.Tensor:
        # (..., R[, K]) -> (..., G, R / G[, K]): row j to group j mod G
        axis = -2 if keyed else -1
        x = x.unflatten(axis, (x.shape[axis] // replicates, replicates))
        return x.transpose(axis - 1, axis)

    if segments is None:
        per_group = reduce(groups_of, lambda x: x.sum(-1))[0]  # (*F, ..., G, S)
    else:  # (*F, cells * G, S) -> (*F, cells, G, S)
        per_group = reduce(lambda x, keyed=False: x, segments.sum_replicates)[0].unflatten(-2, (-1, replicates))
    se = per_group.std(-2, correction=1) / math.sqrt(replicates)
    # A share of rows (top1, nonfinite, the rows' rho shares) whose event no group saw (or every group saw) has a
    # random-groups error of 0; its error is at least the binomial one at p = (hits + 1/2) / (n + 1), which is never 0.
    counts = dict(zip(("valid", "ranked", "rows"), counts, strict=True))
    n = torch.stack([counts[over] for over in _SHARES.values()], -1)  # (*F, ..., cells, shares)
    p = (torch.stack([stats[..., STAT_NAMES.index(name)] for name in _SHARES], -1) * n + 0.5) / (n + 1)
    floor = torch.sqrt(p * (1 - p) / n.clamp(min=1)).float().unbind(-1)
    floors = dict(zip(map(STAT_NAMES.index, _SHARES), floor, strict=True))
    zero = torch.zeros_like(se[..., 0])  # the other statistics' floor (an error is never below 0)
    se = torch.maximum(se, torch.stack([floors.get(i, zero) for i in range(se.shape[-1])], -1))
    return torch.stack((stats, se), dim=-2)


#: The statistics that are shares of rows, and the rows they are shares of (see :func:`compare_frames`).
_SHARES: dict[str, str] = {
    "top1": "ranked",
    "nonfinite": "rows",
    rows_column(): "ranked",
    "rows_rho_pos1": "ranked",
    "rows_rho_neg1": "ranked",
}


#: A row's rho within this of :data:`~ipa_probe.statistics.schema.ROW_THRESHOLD` counts as at it, not above it. rho
#: takes discrete values (``1 - 6 S / (K^3 - K)`` for integer ``S``), and 0.9 itself is one of them for some ``K``
#: (5, 9, 11, ...): float32 rank arithmetic puts such a row a few ulps either side of 0.9 depending on the CPU's
#: summation order, so without this margin the share of rows above 0.9 would depend on the machine. The null's exact
#: values at 0.9 are not above it either (:meth:`RhoNull.tail` is strict), and its next value above 0.9 is at least
#: 1e-3 away for the tabulated ``K``, far beyond this margin.
ROW_TIE = 1e-5

#: ``|c|`` within this of 1 counts as exactly linear in :func:`_gauge_rows` (float32 resolution near 1).
_LINEAR = 1e-6


def _flat(sd: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """A key term's spread ``sd`` (per row of ``term`` ``(..., K)``), 0 where it is flat to float32 rounding, as the
    query frame of weights that are its own NW weights (inside the NW head): ``r`` infinite, not rounding's 1e7."""
    return sd.masked_fill(sd <= 1e-5 * term.abs().amax(-1), 0.0)


def _gauge_rows(attn_logits: torch.Tensor, nw_logits: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Per-row logit ratio ``r`` (see :func:`compare_weights`), ``(..., R, K) -> (..., R)``; masked keys left out."""
    attn = attn_logits if key_mask is None else torch.where(key_mask, attn_logits, 0.0)
    nw = nw_logits if key_mask is None else torch.where(key_mask, nw_logits, 0.0)
    c = _row_pearson(attn, nw, key_mask)
    # Logits linear in each other to float32 precision (always so for two keys) have c = +-1: r = +-inf.
    c = torch.where(c.abs() >= 1 - _LINEAR, c.sign(), c)
    return c / torch.sqrt(1 - c * c)
