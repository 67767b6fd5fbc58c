"""The statistics of one record: a layer's image-branch (or text-branch) logits at one denoiser pass, by cell.

A *record* is what the probe's taps deliver once per layer, adapter (or the text branch) and pass: the query
``(B, H, Q, D)`` and keys ``(B, H, K, D)`` the processor's softmax uses. Its *cells* are its batch items (a group:
one item with its frames pooled) per head; every statistic of a cell is computed here on the pipeline's device and
returned as one ``(groups, H, fields)`` tensor in the order of :data:`~ipa_probe.statistics.schema.CELL_FIELDS`, which
:mod:`~.run` adds into its buffers. Records are formed with those of their layer size stacked (:func:`record_logits`,
:func:`group_cell`, :func:`cell_inputs`; an edited, masked or SD3 record in its hook), and compared many at once
(:func:`compare_cells`). Nothing here reads the host or keeps state between records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layers import image_branch_logits
from ..statistics.agreement import compare_frames
from ..statistics.draws import uniform_keys
from ..statistics.kernels import matched_bandwidth, nw_logits, query_frame_terms, segment_query_frame_terms
from ..statistics.rows import Segments, copy_groups, finite_rows, fit_bandwidth
from ..statistics.schema import QUERY_FRAME_STATS, STAT_NAMES
from .config import SAMPLE_GROUPS

__all__ = [
    "CHUNK_ELEMENTS",
    "JOIN_FRAMES_CPU",
    "Cell",
    "CellInputs",
    "cell_inputs",
    "compare_cells",
    "frame_terms",
    "group_cell",
    "image_share",
    "join_cells",
    "joint_frames",
    "null_keys",
    "record_logits",
    "take_rows",
]

#: Largest logit block formed at once for ``ip_mass`` (elements; queries are taken in chunks below it).
CHUNK_ELEMENTS = 2**26

#: Most logits (elements) the probe stacks into one pass on a CPU (1 MiB of float32;
#: :meth:`~.forming.RecordForming._held_parts`): stacking saves each record's fixed cost (some 30 small operations),
#: but a stack that leaves the cache costs more CPU time than it saves (docs/measured.md). Other devices stack a size's
#: records whole (what it saves there is kernel launches; :data:`~.forming.FRAME_ELEMENTS` bounds the memory).
JOIN_ELEMENTS_CPU = 2**18


#: Most logits (elements) a CPU joins into one query-frame pass over a pass's layer sizes (:func:`joint_frames`): none.
#: The joint pass's segment reductions took 1.5x the CPU time of one pass per size (medians of 6 calls, 28 against
#: 19 ms of forming per call: SD 1.5 at full width, 16 x 16 latents, 4 tokens, 3 steps, one thread); other devices
#: join every size (what it saves there is kernel launches).
JOIN_FRAMES_CPU = 0


@dataclass
class Cell:
    """One record's tensors by group (a batch item with its frames): ``(groups, H, rows, K)`` and friends."""

    attn: torch.Tensor  # attention logits
    nw: torch.Tensor  # NW logits
    h: torch.Tensor  # (groups, H) bandwidth
    key_mask: torch.Tensor | None  # kept keys (text padding left out)
    row_mask: torch.Tensor | None  # (groups, H, rows) rows inside an IP-Adapter mask
    copies: torch.Tensor | None  # (groups, H, 1 or rows, K) key ids, equal for copies of one token
    key_term: torch.Tensor | None  # (groups, H, 1 or rows, K) |k|^2 / (2 sqrt(d)): NW ranks follow attn - key_term


def record_logits(
    processor: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, text: bool, other: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits the record's softmax uses, ``(B, H, Q, K)``, and the queries' norms ``(B, H, Q)``: plain scaled
    dot-product attention for the text branch, the processor's own for the image branch
    (:func:`~ipa_probe.layers.image_branch_logits`, ``other`` the further keys of its softmax: SD3's latent keys).

    Dot-product logits are formed key-major, ``(k q^T)^T`` (a transposed view): 2-3x faster on CPU where queries
    outnumber keys, the per-key reductions then along contiguous memory. On a CPU a query of 1,024 rows or more that is
    a view of the layer's projection is read in place one head at a time (norms taken while it is in cache)."""
    if not text and getattr(processor, "image_branch_logits", None) is not None:
        return image_branch_logits(processor, q, k, other), q.norm(dim=-1)
    k = k * (1.0 / math.sqrt(q.shape[-1]))
    if q.device.type == "cpu" and not q.is_contiguous() and q.shape[-2] >= 1024:
        heads = [(k[:, h] @ q[:, h].transpose(-1, -2), q[:, h].norm(dim=-1)) for h in range(q.shape[1])]
        by_key, norms = (torch.stack(parts, 1) for parts in zip(*heads, strict=True))
    else:
        by_key, norms = k @ q.transpose(-1, -2), q.norm(dim=-1)
    return by_key.transpose(-1, -2), norms  # (B, H, K, Q) -> (B, H, Q, K)


def group_cell(
    groups: int,
    q: torch.Tensor,
    k: torch.Tensor,
    attn: torch.Tensor,
    text: bool,
    rows: torch.Tensor | None,
    processor: torch.nn.Module,
    text_mask: torch.Tensor | None,
    h: torch.Tensor,
    fit: bool,
    nw_rows: torch.Tensor | None = None,
    dot: bool = True,
    nw_scale: torch.Tensor | None = None,
    key_copies: bool = True,
) -> Cell:
    """A record's logits, masks and copy ids by group: ``(B, H, R, C)`` -> ``(groups, H, frames * R, C)``.

    Args:
        groups: how many groups (batch items) the batch holds; ``B`` is a multiple of it.
        q, k, attn: ``(B, H, Q, D)``, ``(B, H, K, D)`` float32 and their :func:`record_logits` ``(B, H, Q, K)``.
        text, processor: the record is the text branch; the layer's attention processor.
        rows: ``(B, Q)`` bool, the queries inside the branch's IP-Adapter mask, or ``None`` for all.
        text_mask: ``(B, tokens)`` bool, the pass's prompt tokens (text branch), or ``None``.
        h, fit: 0-d bandwidth on the device; fit ``h`` per cell (``bandwidth="fit"``) instead.
        nw_rows: optional ``(n,)`` row indices (the record's row sample, when nothing reads the other rows' NW
            logits): ``nw`` holds these rows only (when a group is one batch item; every row otherwise).
        dot: ``attn`` are the dot-product logits of ``q`` and ``k`` (not an edit's): the NW logits are formed from
            them and the key norms, without a second product, times ``nw_scale`` (``sqrt(d) / h^2`` made once).
        key_copies: form the ids of copies of one key (the statistics read them, the maps not).
    """
    batch, n_heads, n_queries, n_keys = attn.shape

    def by_group(x: torch.Tensor) -> torch.Tensor:
        # (B, H, R, C) -> (groups, H, frames * R, C): a group is one item of the denoiser's batch, with its frames
        return x.reshape(groups, batch // groups, n_heads, x.shape[-2], x.shape[-1]).transpose(1, 2).flatten(2, 3)

    key_mask = None
    if text and text_mask is not None and text_mask.shape[0] == batch:
        key_mask = by_group(text_mask[:, None, None, :].expand(batch, n_heads, n_queries, n_keys))
    row_mask = None
    if rows is not None:
        row_mask = by_group(rows[:, None, :, None].expand(batch, n_heads, n_queries, 1)).squeeze(-1)

    def per_key(x: torch.Tensor) -> torch.Tensor:
        # (B, H, K) -> (groups, H, 1, K) when a group is one item (broadcast over its rows, never repeated), else
        # (groups, H, frames * Q, K): each frame's rows carry their frame's keys
        if batch == groups:
            return x.unsqueeze(-2)
        return by_group(x.unsqueeze(-2).expand(batch, n_heads, n_queries, n_keys))

    copies = per_key(copy_groups(k)) if key_copies else None
    key_term = k_term = None
    if text or getattr(processor, "image_branch_logits", None) is None:
        # dot-product logits q·k / sqrt(d): the NW ranks follow q·k - |k|^2 / 2, i.e. attn - |k|^2 / (2 sqrt(d))
        k_term = (k * k).sum(-1) / (2 * math.sqrt(k.shape[-1]))  # (B, H, K)
        key_term = per_key(k_term)  # by group
    if fit:
        k_sq = (k * k).sum(-1)  # (B, H, K)
        energy = by_group(q @ k.transpose(-1, -2) - k_sq.unsqueeze(-2) / 2)  # NW logits times h^2
        attn_c = by_group(attn)
        if key_mask is not None:
            attn_c, energy = attn_c.masked_fill(~key_mask, -math.inf), energy.masked_fill(~key_mask, -math.inf)
        h_cell = fit_bandwidth(attn_c, energy, matched_bandwidth(q.shape[-1]))  # (groups, H)
        nw = energy / (h_cell * h_cell)[..., None, None]
        return Cell(
            attn=attn_c, nw=nw, h=h_cell, key_mask=key_mask, row_mask=row_mask, copies=copies, key_term=key_term
        )
    h_cell = h.expand(groups, n_heads)
    nw_attn = attn
    if nw_rows is not None and batch == groups:  # only the sampled rows' NW logits are read (no maps)
        q, nw_attn = take_rows(q, nw_rows, 2), take_rows(attn, nw_rows, 2)
    if k_term is not None and dot:  # (q·k - |k|^2 / 2) / h^2 from the logits: (attn - k_term) sqrt(d) / h^2
        nw = (nw_attn - k_term.unsqueeze(-2)) * (math.sqrt(k.shape[-1]) / (h * h) if nw_scale is None else nw_scale)
    else:
        nw = nw_logits(q, k, h)
    return Cell(
        attn=by_group(attn),
        nw=by_group(nw),
        h=h_cell,
        key_mask=key_mask,
        row_mask=row_mask,
        copies=copies,
        key_term=key_term,
    )


@dataclass
class CellInputs:
    """What the per-row statistics of one record compare (its rows sampled), and its per-cell scalars: kept until
    :func:`compare_cells` runs the waiting records that share a :meth:`signature` together."""

    attn: torch.Tensor  # (groups, H, n, K) attention logits of the compared rows
    nw: torch.Tensor  # (groups, H, n, K) stored-frame NW logits
    key_term: torch.Tensor | None  # (groups, H, 1 or n, K)
    key_mask: torch.Tensor | None  # (groups, H, n, K)
    row_mask: torch.Tensor | None  # (groups, H, n)
    copies: torch.Tensor | None  # (groups, H, 1 or n, K)
    tails: torch.Tensor | None  # (K + 1,)
    sampled: bool  # rows sampled: standard errors from SAMPLE_GROUPS random groups (0 when exact)
    scalars: torch.Tensor  # (groups, H, 6) bandwidth, q_norm, k_norm_spread, ip_mass, keys, row_fraction
    frame_nw: torch.Tensor | None = None  # (2, groups, H, n, K) query-frame NW logits, exact and Gaussian forms
    frame_b: torch.Tensor | None = None  # (2, groups, H, 1, K) their key terms
    # (1, groups, H, n, K), (1, groups, H, 1, K): the exact form's query frame over the other pool, or None where the
    # two pools are the same rows (one item per CFG branch: schema.QUERY_POOL_OTHER_COLUMN)
    other_nw: torch.Tensor | None = None
    other_b: torch.Tensor | None = None
    apart: bool = False  # the attention is an edit's, which may weight copies apart (compare_frames' apart)

    def pending_elements(self) -> int:
        """The query-frame NW logits the record's statistics will compare (both forms, and the other pool's)."""
        return (2 + (self.other_nw is not None)) * self.attn.numel()

    def signature(self) -> tuple:
        """Records with equal signatures are compared in one pass: without a key mask (the image branch), their rows
        flattened side by side whatever their heads and rows (:class:`~ipa_probe.statistics.rows.Segments`), sampled
        or exact, so a pass's records of every layer size go through one pass; with one (the text branch),
        concatenated along their groups when their shapes are equal."""
        if self.key_mask is None:
            present = tuple(x is not None for x in (self.key_term, self.row_mask, self.copies))
            return (self.attn.shape[-1], self.attn.dtype, self.attn.device, present, self.other_nw is not None)

        def form(x: torch.Tensor | None) -> tuple | None:
            return None if x is None else (tuple(x.shape[1:]), x.dtype, x.device)

        tensors = (self.attn, self.nw, self.key_term, self.key_mask, self.row_mask, self.copies, self.tails)
        return (*(form(x) for x in tensors), self.sampled, self.other_nw is not None)


def cell_inputs(
    cell: Cell,
    groups: int,
    q: torch.Tensor,
    k: torch.Tensor,
    other: torch.Tensor | None,
    text: bool,
    processor: torch.nn.Module,
    tails: torch.Tensor | None,
    text_mask: torch.Tensor | None,
    pools: int,
    q_norms: torch.Tensor,
    sample: torch.Tensor | None = None,
    other_pools: int | None = None,
    frame: tuple[torch.Tensor, torch.Tensor] | None = None,
    share: torch.Tensor | None = None,
    cache: dict | None = None,
) -> CellInputs:
    """One record's :class:`CellInputs`: its query frames formed over every row (:func:`frame_terms`), then its rows
    sampled and its per-cell scalars taken.

    Args:
        cell: the record by group (:func:`group_cell`).
        groups, q, k, text, processor, text_mask: as for :func:`group_cell`.
        other: ``(B, H, N, D)``, further keys of the same softmax (SD3's latent keys), or ``None``.
        tails: :func:`~ipa_probe.statistics.agreement.null_tail_table` for the record's number of keys (with a key
            mask), or ``None``.
        pools: how many query frames the groups form (:func:`frame_terms`).
        q_norms: ``(B, H, Q)``, the queries' norms (:func:`record_logits`).
        sample: ``(n,)`` row indices (:func:`~ipa_probe.statistics.draws.stratified_rows`) to compute the per-row
            statistics and their standard errors on; ``None`` for every row (exact, errors 0). The query frame's key
            term is estimated over every row either way.
        other_pools: the number of frames of the other query pool
            (:data:`~ipa_probe.statistics.schema.QUERY_POOL_OTHER_COLUMN`): its exact-form frame is formed too, over
            the same rows; ``None`` (or ``pools``) where the two pools are the same rows, which forms nothing more.
        frame: the record's query frame, both forms, when formed with others' (:func:`joint_frames`), or ``None``.
        share: ``(B, H, Q)``, the image share an edit left (SD3), else ``None`` (:func:`image_share` of the keys).
        cache: where the scalars' constants are kept (0-d, per value and device), or ``None``.
    """
    n_rows = cell.attn.shape[-2]
    other_pools = other_pools if other_pools != pools else None
    frames = {"frame": frame or frame_terms(cell.attn, cell.key_mask, cell.row_mask, pools, "both")}
    if other_pools is not None:  # the other pool's exact form (schema.QUERY_POOL_OTHER_COLUMN)
        frames["other"] = frame_terms(cell.attn, cell.key_mask, cell.row_mask, other_pools, "exact")
    attn, nw, key_mask, row_mask = cell.attn, cell.nw, cell.key_mask, cell.row_mask
    copies, key_term = cell.copies, cell.key_term

    def rows_of(x: torch.Tensor | None, axis: int = -2) -> torch.Tensor | None:
        # the sampled rows of a per-row tensor; per-key ones ((..., 1, K)) and None pass through
        if x is None or sample is None or x.shape[axis] != n_rows:
            return x
        return take_rows(x, sample, axis)

    if sample is not None:
        attn, nw, key_mask = rows_of(attn), rows_of(nw), rows_of(key_mask)
        row_mask, copies, key_term = rows_of(row_mask, -1), rows_of(copies), rows_of(key_term)
    batch, n_heads, n_keys = k.shape[0], k.shape[1], k.shape[2]

    def by_group(x: torch.Tensor) -> torch.Tensor:  # (B, H, R) -> (groups, H, items * R)
        return x.reshape(groups, batch // groups, n_heads, x.shape[-1]).transpose(1, 2).flatten(2, 3)

    cache = {} if cache is None else cache

    def constant(value: float) -> torch.Tensor:  # (groups, H) of one value, a view of a 0-d tensor made once
        if (key := ("constant", repr(value), q_norm.dtype, q_norm.device)) not in cache:
            cache[key] = torch.full((), value, dtype=q_norm.dtype, device=q_norm.device)
        return cache[key].expand_as(q_norm)

    q_norm = by_group(q_norms)  # (groups, H, items * Q)
    if cell.row_mask is not None:
        inside = cell.row_mask.float()
        q_norm = (q_norm * inside).sum(-1) / inside.sum(-1)
    else:
        q_norm = q_norm.mean(-1)
    k_norm = by_group(k.norm(dim=-1))  # (groups, H, items * K)
    if cell.key_mask is None:
        sd, mean = torch.std_mean(k_norm, dim=-1, correction=0)
        spread, keys = sd / mean, constant(n_keys)  # (groups, H), keys per row
    else:
        kept = by_group(text_mask[:, None, :].expand(batch, n_heads, n_keys).float())
        mean = (k_norm * kept).sum(-1) / kept.sum(-1)
        spread = (((k_norm - mean[..., None]) ** 2 * kept).sum(-1) / kept.sum(-1)).sqrt() / mean
        keys = kept.sum(-1) / (batch // groups)  # (groups, H) keys per row
    ip_mass = constant(math.nan)
    if other is not None and not text:
        share = image_share(processor, q, k, other.float()) if share is None else share  # (B, H, Q)
        ip_mass = by_group(share).mean(-1)
    fraction = constant(1.0 if sample is None else sample.shape[-1] / n_rows)
    scalars = torch.stack(
        (cell.h.expand_as(q_norm), q_norm, spread, ip_mass, keys, fraction), dim=-1
    )  # (groups, H, 6)
    return CellInputs(
        attn=attn,
        nw=nw,
        key_term=key_term,
        key_mask=key_mask,
        row_mask=row_mask,
        copies=copies,
        tails=tails,
        sampled=sample is not None,
        scalars=scalars,
        **{f"{name}_nw": rows_of(rows) - b for name, (rows, b) in frames.items()},  # (F, groups, H, n, K)
        **{f"{name}_b": b for name, (_, b) in frames.items()},  # (F, groups, H, 1, K)
    )


def compare_cells(
    records: list[CellInputs], generators: Sequence, cache: dict | None = None, joined: tuple | None = None
) -> list[torch.Tensor]:
    """The per-cell fields (:data:`~ipa_probe.statistics.schema.CELL_FIELDS`) of records of one
    :meth:`~CellInputs.signature`, ``(groups, H, fields)`` each, from one
    :func:`~ipa_probe.statistics.agreement.compare_frames` pass over all their rows: every statistic is per row and
    reduced per cell, so each record's values are what its own pass would give; only the nulls draw otherwise.

    Args:
        records: the records' inputs (:func:`cell_inputs`), equal signatures.
        generators: the nulls' random sources on the device: the stored frame's, the query frame's, and optionally
            the other pool's (its own, drawn and discarded; one seeded 0 when not given); or their keys
            (:func:`null_keys`).
        cache: where the rows' cell ids are kept between calls (per shapes), or ``None``.
        joined: the records' :func:`join_cells`, when joined beforehand.
    """
    first, (attn, joined_frames, rest, scalars, exact) = records[0], joined or join_cells(records, cache)
    flat, keys, sampled = first.key_mask is None, attn.shape[-1], rest[4] is not None
    if len(generators) < len(joined_frames):  # the other pool's null from a generator of its own
        generators = (*generators, torch.Generator(device=attn.device).manual_seed(0))
    frames = [(nw, term, d) for (nw, term), d in zip(joined_frames, generators, strict=False)]
    stats, frame, *other = compare_frames(attn, frames, *rest)
    if not sampled:  # exact: no sampling error
        stats, frame = (torch.nn.functional.pad(x.unsqueeze(-2), (0, 0, 0, 1)) for x in (stats, frame))  # errors 0
    for x in (stats, frame, *other) if sampled and exact is not None else ():  # exact cells beside sampled: no error
        x[..., 1, :].masked_fill_(exact, 0.0)
    rho = STAT_NAMES.index("spearman")
    if other:  # the other pool's exact-form rho: (1, cells, S), or (1, cells, 2, S) with errors
        other_rho = other[0][0][..., 0, rho] if sampled else other[0][0][..., rho]
    else:  # the pools are the same rows: the query frame's own (exact form)
        other_rho = frame[0][..., 0, rho]
    other_rho = other_rho.unsqueeze(-1)  # (cells, 1)
    _count_lost_rows(stats, frame, keys)
    # stats (cells, 2, S), frame (2, cells, 2, S): estimate and standard error (cells: (groups, H), or flat)
    # per part (estimate, error) the exact form's statistics, then the Gaussian form's (QUERY_FRAME_COLUMNS' order)
    picked = [[frame[form, ..., part, run] for form in range(2) for run in _FRAME_RUNS] for part in range(2)]
    # the buffers keep each standard error squared, so that a mean over cells adds variances (report.run_table)
    errors = torch.cat((stats[..., 1, :], *picked[1]), dim=-1)
    parts = (scalars[..., :1], stats[..., 0, :], scalars[..., 1:5], *picked[0], scalars[..., 5:], errors * errors)
    parts += (other_rho,)
    values = torch.cat(parts, dim=-1)  # (cells of every record, fields) in the order of CELL_FIELDS
    if not flat:
        return list(values.split([record.attn.shape[0] for record in records]))
    cells = [record.attn.shape[0] * record.attn.shape[1] for record in records]
    return [part.unflatten(0, r.attn.shape[:2]) for part, r in zip(values.split(cells), records, strict=True)]


#: :data:`~ipa_probe.statistics.schema.QUERY_FRAME_STATS`' columns as runs (slices) of ``STAT_NAMES``' ones.
_PICKED = [STAT_NAMES.index(name) for name in QUERY_FRAME_STATS]
_STARTS, _ENDS = [i for i in _PICKED if i - 1 not in _PICKED], [i + 1 for i in _PICKED if i + 1 not in _PICKED]
_FRAME_RUNS = [slice(i, j) for i, j in zip(_STARTS, _ENDS, strict=True)]


def null_keys(joined: tuple, generators: tuple[torch.Generator, ...]) -> list[torch.Tensor]:
    """The uniform keys the nulls of :func:`compare_cells` draw from ``generators`` (one draw per frame, in its order:
    what :func:`compare_cells` draws), drawn beforehand so that a compiled pass draws nothing."""
    return [uniform_keys(nw.shape, g, nw.device) for (nw, _), g in zip(joined[1], generators, strict=False)]


def join_cells(records: list[CellInputs], cache: dict | None = None) -> tuple:
    """:func:`~ipa_probe.statistics.agreement.compare_frames`' arguments for the records of :func:`compare_cells` (the
    frames without their random sources), and the records' scalars: one batch's tensors side by side."""
    first = records[0]
    flat = first.key_mask is None  # every record's rows side by side, reduced per cell (stats.Segments)
    replicates = SAMPLE_GROUPS if any(record.sampled for record in records) else None  # exact ones' errors: 0
    segments, exact = _segments(records, replicates, cache) if flat else (None, None)

    def joined(name: str, axis: int = 0) -> torch.Tensor | None:
        parts = [getattr(record, name) for record in records]
        if parts[0] is None or (len(parts) == 1 and not flat):
            return parts[0]
        lead = axis  # the frames' leading axes
        if flat and all(
            x.dim() == r.attn.dim() + lead and x.shape[-2] == 1 for x, r in zip(parts, records, strict=True)
        ):
            # per key, (*F, groups, H, 1, C): every cell's row, then each flattened row its cell's (one gather)
            cells = torch.cat([x.reshape(*x.shape[:lead], -1, x.shape[-1]) for x in parts], lead)
            return cells.index_select(lead, segments.ids)  # (*F, rows, C)
        if flat:  # (*F, groups, H, 1 or n, C) -> (*F, groups * H * n, C), rows of every record side by side
            parts = [
                x.expand(*x.shape[:-2], record.attn.shape[-2], x.shape[-1]).reshape(*x.shape[:lead], -1, x.shape[-1])
                if x.dim() == record.attn.dim() + lead
                else x.reshape(*x.shape[:lead], -1)  # (groups, H, n) row masks
                for x, record in zip(parts, records, strict=True)
            ]
            return torch.cat(parts, lead) if len(parts) > 1 else parts[0]
        return torch.cat(parts, axis)

    names = ["attn", "nw", "frame_nw", "other_nw"][: 4 if first.other_nw is not None else 3]
    stack = None
    if flat:  # the attention and every frame's NW logits in one buffer (compare_frames' stack), rows side by side
        stack = first.attn.new_empty(len(names) + 1, segments.ids.shape[0], first.attn.shape[-1])
        for rows, record in zip(stack.split([r.attn.shape[:3].numel() for r in records], 1), records, strict=True):
            for part, name in zip(rows.split([1, 1, 2, 1][: len(names)]), names, strict=True):
                part.view(getattr(record, name).shape).copy_(getattr(record, name))
    logits = [joined(name, int(name != "nw")) for name in names[1:]] if stack is None else [stack[1], stack[2:4]]
    frames = [(logits[0], joined("key_term")), (logits[1], joined("frame_b", 1))]
    if first.other_nw is not None:
        frames.append((logits[2] if stack is None else stack[4:], joined("other_b", 1)))
    scalars = joined("scalars") if not flat else torch.cat([r.scalars.flatten(0, 1) for r in records])
    rest = (joined("key_mask"), joined("row_mask"), joined("copies"), first.tails, replicates, segments, stack)
    rest += (any(record.apart for record in records),)
    return joined("attn") if stack is None else stack[0], frames, rest, scalars, exact


def _segments(records: list[CellInputs], replicates: int | None, cache: dict | None) -> tuple:
    """Each flattened row's cell (and replicate group): records' rows side by side, ``(groups, H, n)`` each in order;
    and where sampled and exact records mix, ``(cells, 1)`` True at the exact cells (else ``None``); made on the
    device once per shape (kept in ``cache``; for a run of shapes repeated, as a call's passes, once for the run)."""
    shapes = tuple((*record.attn.shape[:3], record.sampled) for record in records)
    device = records[0].attn.device
    key = ("segments", shapes, replicates, device)
    if cache is not None and key in cache:
        return cache[key]
    period = next(p for p in range(1, len(shapes) + 1) if shapes == shapes[:p] * (len(shapes) // p))
    ids, groups, exact, offset = [], [], [], 0
    for cells_h, heads, rows, sampled in shapes[:period]:
        position = torch.arange(cells_h * heads * rows, device=device)
        cell = position // rows + offset
        ids.append(cell)
        if replicates is not None:
            groups.append(cell * replicates + position % rows % replicates)
        exact.append(torch.full((cells_h * heads, 1), not sampled, device=device))
        offset += cells_h * heads
    exact = exact if len({shape[-1] for shape in shapes}) > 1 else []  # sampled and exact cells mixed
    ids, groups, exact = (torch.cat(x) if x else None for x in (ids, groups, exact))
    if (repeats := len(shapes) // period) > 1:  # the run's ids, each repeat's cells after the one before
        shift = torch.arange(0, offset * repeats, offset, device=device)[:, None]
        ids, offset = (ids + shift).flatten(), offset * repeats
        groups = None if groups is None else (groups + shift * replicates).flatten()
        exact = None if exact is None else exact.repeat(repeats, 1)
    segments = Segments(ids, offset, groups, replicates)
    if cache is not None:
        cache[key] = segments, exact
    return segments, exact


def _count_lost_rows(stats: torch.Tensor, frame: torch.Tensor, keys: int) -> None:
    """Every non-finite statistic counted in ``nonfinite`` (in place, on the estimates): the share of rows any frame
    (stored, query exact, query Gaussian) left out for non-finite weights, and all of a cell's rows where a rank
    correlation could be formed from none of them (with more than one key, a NaN rho means every row's weights were
    tied or lost: float32 rounding under a far row shift, for one), so that a NaN rho never reads "0 rows lost". A
    query frame whose NW rows are uniform by construction (one query) is undefined, not lost, and is not counted.
    ``stats``: ``(groups, H, 2, S)`` the stored frame's estimates and errors; ``frame``: ``(2, groups, H, 2, S)`` the
    query frames'; ``keys``: the keys per row."""
    lost, rho, neff = (STAT_NAMES.index(name) for name in ("nonfinite", "spearman", "neff_nw"))
    share = torch.maximum(stats[..., 0, lost], frame[..., 0, lost].amax(0))
    if keys > 1:
        # a query frame whose NW rows are all uniform (n_eff = K: a frame of one query, as in a 1 x 1 mid block) has
        # no rho by construction: undefined, not lost (1e-4: float32 rounding of a Kish sum of K equal weights)
        uniform = frame[..., 0, neff] >= keys * (1 - 1e-4)
        # lost where rho is NaN in the stored frame, or in a query frame not uniform (NaN > uniform: NaN & ~uniform)
        share.masked_fill_(stats[..., 0, rho].isnan() | (frame[..., 0, rho].isnan() > uniform).any(0), 1.0)
    stats[..., 0, lost] = share  # (no `out=`: a strided view breaks a compiled graph)


def frame_terms(
    attn: torch.Tensor,
    key_mask: torch.Tensor | None,
    row_mask: torch.Tensor | None,
    pools: int,
    form: str = "both",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query frames of cells, in two parts whose difference is their NW logits: each row's centred logits and each
    frame's key term, both forms from one pass over the logits.

    Per pool of queries (the frame) and head, ``b_i`` is key ``i``'s log-partition over the frame's rows
    (:func:`~ipa_probe.statistics.kernels.query_frame_terms`, exact and Gaussian); a row's query-frame NW logits are
    its centred logits minus ``b``, compared as :func:`~ipa_probe.statistics.agreement.compare_weights` with
    ``key_term=b``, so every statistic (``logit_ratio``, its baseline, the nulls) means what it means in the stored
    frame. Rows outside the IP-Adapter mask or with non-finite logits take no part; a frame of one row gives uniform
    NW weights (no rank correlation: NaN), as in exact arithmetic.

    Args:
        attn: ``(groups, H, R, K)`` attention logits of every row (stacked records' groups side by side), reduced
            along the rows (key-major memory, the probe's, is read contiguously).
        key_mask: ``(groups, H, R, K)`` kept keys, or ``None``.
        row_mask: ``(groups, H, R)`` rows inside an IP-Adapter mask, or ``None``.
        pools: how many frames the groups form, contiguous and of equal size: ``groups`` (one item each) or the
            pass's number of CFG branches (each branch's items pooled).
        form: ``"both"``, or one form (``"exact"`` or ``"gaussian"``) alone.

    Returns:
        ``(rows, b)``: ``(groups, H, R, K)`` centred logits (left-out keys 0) and ``(F, groups, H, 1, K)`` key terms
        (each group its frame's), the exact form's, then the Gaussian form's (``F = 1`` for one form); the NW logits
        of any rows are ``rows[..., some, :] - b``.
    """
    groups, n_heads, n_rows, n_keys = attn.shape
    finite = finite_rows(attn if key_mask is None else torch.where(key_mask, attn, 0.0))  # (groups, H, R)
    rows = finite if row_mask is None else finite & row_mask
    if pools == groups:
        return query_frame_terms(attn, rows, key_mask, form=form)

    def pooled(x: torch.Tensor) -> torch.Tensor:
        # (groups, H, R, ...) -> (pools, H, groups / pools * R, ...): the frame's rows side by side
        x = x.reshape(pools, groups // pools, *x.shape[1:]).transpose(1, 2)
        return x.flatten(2, 3)

    rows_p = pooled(rows.unsqueeze(-1)).squeeze(-1)
    key_mask_p = pooled(key_mask) if key_mask is not None else None
    centred, b = query_frame_terms(pooled(attn), rows_p, key_mask_p, form=form)  # (pools, H, n * R, K), (F, ...)
    # (pools, H, n * R, K) -> (groups, H, R, K): back to the groups' rows
    centred = centred.unflatten(2, (groups // pools, n_rows)).transpose(1, 2).reshape(groups, n_heads, n_rows, n_keys)
    return centred, b.repeat_interleave(groups // pools, dim=1)


def joint_frames(records: list[Cell], pools: list[int], cache: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`frame_terms` (both forms) of records without a key mask and of equal ``K``, ``(groups, H, R, K)`` logits
    and ``pools`` frames each, in one pass: their logits side by side, every frame's terms by segment
    (:func:`~ipa_probe.statistics.kernels.segment_query_frame_terms`), so a pass's records of every layer size cost the
    operations of one. Each record's ``(rows, b)`` are those of its own :func:`frame_terms` up to float rounding (the
    sums run in another order); the entries' ids depend on the shapes only and are kept in ``cache``."""
    shapes, device = tuple(tuple(cell.attn.shape) for cell in records), records[0].attn.device
    keys, key = shapes[0][-1], ("frames", shapes, tuple(pools), device)
    if key not in cache:  # entry (g, h, k, r) of each record: row (g, h, r), frame (g // (groups / pools), h)
        row_ids, segment_ids, cell_frames, row_offset, frame_offset = [], [], [], 0, 0
        for (groups, heads, n_rows, _), n_pools in zip(shapes, pools, strict=True):
            g, h, k, r = torch.meshgrid(
                *(torch.arange(n, device=device) for n in (groups, heads, keys, n_rows)), indexing="ij"
            )
            row_ids.append((row_offset + (g * heads + h) * n_rows + r).reshape(-1))
            frame = frame_offset + g // (groups // n_pools) * heads + h
            segment_ids.append((frame * keys + k).reshape(-1))
            cell_frames.append(frame[:, :, 0, 0].reshape(-1))
            row_offset, frame_offset = row_offset + groups * heads * n_rows, frame_offset + n_pools * heads
        rows, frames = Segments(torch.cat(row_ids), row_offset), Segments(torch.cat(segment_ids), frame_offset * keys)
        cache[key] = rows, frames, torch.cat(cell_frames)
    rows, frames, cell_frames = cache[key]
    logits = torch.cat([cell.attn.transpose(-1, -2).reshape(-1) for cell in records])  # (N,) key-major
    inside = rows.sum(logits * 0) == 0  # the rows that form their frame: finite, and inside the IP-Adapter mask
    if any(cell.row_mask is not None for cell in records):
        masks = [
            torch.ones(c.attn.shape[:3], dtype=torch.bool, device=device) if c.row_mask is None else c.row_mask
            for c in records
        ]
        inside &= torch.cat([mask.reshape(-1) for mask in masks])
    centred, b = segment_query_frame_terms(logits, rows, inside, frames, "both")  # (N,), (2, frames * K)
    b = b.unflatten(1, (-1, keys)).index_select(1, cell_frames)  # (2, cells, K)
    parts = zip(
        centred.split([math.prod(x) for x in shapes]), b.split([x[0] * x[1] for x in shapes], 1), shapes, strict=True
    )
    # (groups, H, K, R) key-major -> (groups, H, R, K) views; (2, groups, H, 1, K)
    return [
        (x.view(g, h, keys, r).transpose(-1, -2), y.unflatten(1, (g, h)).unsqueeze(-2)) for x, y, (g, h, r, _) in parts
    ]


def take_rows(x: torch.Tensor, sample: torch.Tensor, axis: int) -> torch.Tensor:
    """``x``'s rows (along ``axis``) at ``sample``: ``(n,)`` indices for every slice of the leading dimension, or
    ``(L, n)`` for records stacked along it (``x``'s leading dimension ``L`` equal blocks, block ``l`` read at
    ``sample[l]``), one gather either way."""
    if sample.dim() == 1:
        return x.index_select(axis, sample)
    axis = axis % x.dim()
    blocks = x.unflatten(0, (sample.shape[0], -1))  # (L, lead / L, ...)
    shape = [1] * blocks.dim()
    shape[0], shape[axis + 1] = sample.shape
    size = list(blocks.shape)
    size[axis + 1] = sample.shape[1]
    return blocks.gather(axis + 1, sample.reshape(shape).expand(size)).flatten(0, 1)


def image_share(processor: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Share of a joint softmax on the image columns, ``sigmoid(LSE(image logits) - LSE(other logits))``,
    ``(B, H, Q)``.

    The logits of both column sets come from one call of the processor's logits on the joint keys, so any
    per-row constant the processor's logits drop (the NW head centres its keys) is the same for both. Queries
    are taken in chunks of at most :data:`CHUNK_ELEMENTS` logits (SD3 has as many latent keys as queries).
    """
    joint = torch.cat([k, other], dim=2)  # (B, H, K + N, D)
    n_image = k.shape[2]
    rows = max(1, CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * joint.shape[2]))
    parts = []
    for start in range(0, q.shape[2], rows):
        logits = image_branch_logits(processor, q[:, :, start : start + rows], joint)  # (B, H, rows, K + N)
        image, rest = logits[..., :n_image], logits[..., n_image:]
        parts.append(torch.sigmoid(torch.logsumexp(image, -1) - torch.logsumexp(rest, -1)))
    return torch.cat(parts, dim=2)
