"""Forming records: :class:`RecordForming`, the :class:`~.run.ProbeRun` methods that hold each record its hook
delivers (:class:`_Held`) until the call ends or a budget (:meth:`~.run.ProbeRun._end_pass`), then form those of equal
shape stacked along the batch (their logits, cells, row samples and query frames, :mod:`.cells`) and keep their
weights and reference maps. The step clock, the hooks and the buffers the statistics are added to live in :mod:`.run`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..statistics.agreement import null_tail_table
from ..statistics.draws import stratified_rows, uniform_keys
from . import cells
from .buffers import CallBuffers
from .cells import cell_inputs, group_cell, record_logits
from .spine import expand_references, kept_tokens

__all__ = ["FRAME_ELEMENTS", "PENDING_BYTES", "RecordForming"]

#: Bytes of float32 query-frame logits the records waiting for their statistics (formed, or held: their row samples'
#: size) may reach before every record so far is compared (:meth:`~.run.ProbeRun._flush`) instead of at the call's
#: end: 64 MiB (about 600 MiB of working tensors in the batched pass) bounds memory when rows are many or steps long.
PENDING_BYTES = 2**26

#: Queries (elements) the held records may hold before they are formed early (:meth:`RecordForming._held_parts`;
#: compared later): 2^25 float32 (128 MiB, with about as much again of logits and working tensors while a stack is
#: formed) keeps a 512 px SD 1.5 pass in one batch and bounds memory at 1024 px.
FRAME_ELEMENTS = 2**25


@dataclass
class _Held:
    """One record as its hook delivered it, held until it is formed (:meth:`RecordForming._held_parts`)."""

    call: CallBuffers
    step: int
    index: int  # the layer's position in ProbeRun.layers
    slot: int  # the adapter, or the text slot
    labels: torch.Tensor  # (groups,) each group's branch label
    chunks: int  # the pass's CFG branches
    q: torch.Tensor  # (B, H, Q, D)
    k: torch.Tensor  # (B, H, K, D)
    other: torch.Tensor | None  # (B, H, N, D) SD3's latent keys
    inside: torch.Tensor | None  # (B, Q) bool
    used: torch.Tensor | None  # (B, H, Q, K) the edited weights, every reference (those removed at 0)
    share: torch.Tensor | None  # (B, H, Q) SD3's image share under an edit, else None (formed from the keys)
    kept: tuple | None  # the references an ablation kept (Spine.kept)
    text: bool
    processor: torch.nn.Module
    h: tuple[torch.Tensor, torch.Tensor]  # 0-d bandwidth, sqrt(d) / h^2 (ProbeRun._bandwidth)
    rows: tuple[int, int] | None  # (rows, n) of the record's row sample, or None for every row
    text_mask: torch.Tensor | None  # (B, tokens)
    keys: torch.Tensor | None = None  # (n,) the row sample's uniform keys (:meth:`RecordForming._draw_rows`)
    mapped: bool = False  # its maps formed when its pass ended (:meth:`RecordForming._map_pass`)

    def signature(self) -> tuple:
        """Records with equal signatures are formed in one pass, stacked along the batch."""

        def form(x: torch.Tensor | None) -> tuple | None:
            return None if x is None else (tuple(x.shape), x.dtype, x.device)

        tensors = (self.q, self.k, self.inside)
        return (*(form(x) for x in tensors), self.rows, self.slot, self.text, id(self.h), id(self.labels), self.chunks)


class RecordForming:
    """Record forming of :class:`~.run.ProbeRun` (it provides ``_state``, ``_held``, ``_pending``, ``_maps``,
    ``config``, ``layers``, ``_constant``, ``_threads``, ``_flush`` and ``_keep_map``)."""

    @torch.no_grad()
    def _record_stats(
        self,
        index: int,
        slot: int,
        query: torch.Tensor,
        key: torch.Tensor,
        other: torch.Tensor | None,
        inside: torch.Tensor | None = None,
        used: torch.Tensor | None = None,
    ) -> None:
        """Hold one layer's record for one adapter (or the text slot) until the records of equal shape are formed
        together (:meth:`_held_parts`); a record that cannot join others is formed at once.

        Args:
            index, slot: the layer's position in :attr:`layers`; the adapter index, or :attr:`text_slot`.
            query, key: ``(B, H, Q, D)``, the query the branch's softmax uses; ``(B, H, K, D)``, the image-token (or
                text-token) keys.
            other: ``(B, H, N, D)``, further keys of the same softmax (SD3's latent keys), or ``None``.
            inside: ``(B, Q)`` bool, the queries inside the branch's IP-Adapter mask, or ``None`` for all.
            used: ``(B, H, Q, K)``, the weights the layer used when an edit changed them (the statistics read their
                logits ``log w`` instead of ``q·k``, the maps the weights as they are), or ``None``.
        """
        state = self._state
        state.records += 1
        labels = state.layout.items  # (items,): a statistic per batch item (frames of one item pooled)
        chunks = state.layout.chunks  # the pass's CFG branches, contiguous and of equal size
        if query.shape[0] % labels.shape[0]:  # a batch the layout does not describe: one unlabelled group
            labels = self.evidence.layout(None, query.device).items
            chunks = 1
        head_index = self._heads(query.device)
        if head_index is not None:
            query, key = query.index_select(1, head_index), key.index_select(1, head_index)
            other = other.index_select(1, head_index) if other is not None else None
        text = slot == self.text_slot
        processor = self.layers[index].attention.processor
        # an edit removed references from the keys: the maps put them back at weight 0 (kept, total)
        kept = None if text or self._spine is None else self._spine.kept.get((self.layers[index].name, slot))
        share = None  # SD3 under an edit: the image columns' mass in its joint softmax (B, H, Q)
        if used is not None:  # the edited weights (the weights point holds every reference)
            used = (used if head_index is None else used.index_select(1, head_index)).float()  # (B, H, Q, K)
            if other is not None:  # SD3's image columns: renormalised, as the probe reads them unedited
                share = used.sum(-1)
                used = used / share.unsqueeze(-1)
        groups = labels.shape[0]
        n_rows, n_keys = query.shape[-2] * (query.shape[0] // groups), key.shape[-2]
        size = self.config.sample_rows(n_rows, n_keys)  # from shapes: no device read
        self._row_plan[(self.layers[index].name, "text" if text else "image")] = (n_rows, n_keys, size)
        held = _Held(
            call=state.call,
            step=state.step,
            index=index,
            slot=slot,
            labels=labels,
            chunks=chunks,
            q=query,
            k=key,
            other=other,
            inside=inside,
            used=used,
            share=share,
            kept=kept,
            text=text,
            processor=processor,
            h=self._bandwidth(query.shape[-1], query.device),
            rows=None if size is None else (n_rows, size),
            text_mask=state.text_mask,
        )
        # a masked adapter's maps are formed per reference image in the layer (one softmax each): at once
        joins = (
            used is None
            and kept is None
            and other is None
            and self.config.bandwidth != "fit"
            and getattr(processor, "image_branch_logits", None) is None
            and (self._maps is None or text or not self._maps.masks_adapter(slot))
        )
        if not joins:
            self._draw_rows([held])
            self._finish(*self._begin([held]))
            return
        self._held.append(held)
        self._held_elements += query.numel()
        self._held_pending += (2 + (chunks != groups)) * groups * query.shape[1] * (size or n_rows) * n_keys  # formed
        self._bound()

    def _bound(self, margin: int = 1) -> None:
        """Compare every record so far past ``1 / margin`` of :data:`PENDING_BYTES`, else form the held ones past that
        of :data:`FRAME_ELEMENTS` (``margin=2`` at a pass's end: room for one more pass like it, not to split one)."""
        if over := self._over(margin):
            self._flush() if over == 2 else self._form_parts(*self._held_parts())

    def _over(self, margin: int) -> int:
        """What :meth:`_bound` does now: 2 compare every record, 1 form the held ones, 0 nothing."""
        if 4 * margin * (self._pending_elements + self._held_pending) > PENDING_BYTES:
            return 2
        return int(margin * self._held_elements > FRAME_ELEMENTS)

    def _held_parts(self) -> tuple[list[list[_Held]], bool]:
        """The held records taken (:attr:`_held` emptied), in stacks of equal :meth:`_Held.signature`, those of a stack
        formed in one pass (the per-record work of a pass then costs one pass per layer size; on a CPU, each
        within :data:`~.cells.JOIN_ELEMENTS_CPU` logits: a larger one leaves the cache; see there), and whether the
        stacks' query frames are formed jointly (:func:`~.cells.joint_frames`); no tensor is formed but the row
        samples' keys (:meth:`_draw_rows`)."""
        held, self._held, self._held_elements, self._held_pending = self._held, [], 0, 0
        self._draw_rows(held)
        batches: dict[tuple, list[_Held]] = {}
        for entry in held:
            batches.setdefault(entry.signature(), []).append(entry)
        parts, logits = [], 0
        for same in batches.values():
            first = same[0]
            size = first.q.shape[0] * first.q.shape[1] * first.q.shape[2] * first.k.shape[2]
            step = len(same)
            if first.q.device.type == "cpu":
                step = max(1, cells.JOIN_ELEMENTS_CPU // (2 * size))
            parts += [same[start : start + step] for start in range(0, len(same), step)]
            logits += size * len(same)
        # the sizes' query frames joined too (cells.joint_frames; on a CPU within JOIN_FRAMES_CPU), where the records
        # have equal keys and no key mask (the text branch's are formed apart)
        first = parts[0][0] if parts else None
        joins = len(parts) > 1 and not first.text and len({(p[0].text, p[0].k.shape[2]) for p in parts}) == 1
        return parts, joins and not (first.q.device.type == "cpu" and logits > cells.JOIN_FRAMES_CPU)

    def _draw_rows(self, held: list[_Held]) -> None:
        """The uniform keys of the records' row samples (:attr:`ProbeConfig.rows`; stratified in :meth:`_begin`) not
        drawn yet, one draw for all in record order, from the run's row generator (outside a compiled pass)."""
        sampled = [entry for entry in held if entry.rows is not None and entry.keys is None]
        if not sampled:
            return
        device = sampled[0].q.device
        if self._row_generator is None or self._row_generator.device != device:
            self._row_generator = torch.Generator(device=device).manual_seed(self.config.seed)
        sizes = [entry.rows[1] for entry in sampled]
        keys = uniform_keys((sum(sizes),), self._row_generator, device).split(sizes)
        for entry, entry_keys in zip(sampled, keys, strict=True):
            entry.keys = entry_keys

    def _form_parts(self, parts: list[list[_Held]], joins: bool) -> None:
        """Form the stacks of :meth:`_held_parts`: their query frames jointly where ``joins``."""
        if not joins:
            for part in parts:
                self._threads(part[0].q.device, lambda x: self._finish(*self._begin(x)), part)
            return
        first = parts[0][0]
        cache = {} if torch.compiler.is_compiling() else self._constants  # a compiled pass caches nothing
        formed = [self._threads(first.q.device, self._begin, part) for part in parts]
        cells_of, pools = [entry[2] for entry in formed], [entry[3]["pools"] for entry in formed]
        frames = self._threads(first.q.device, cells.joint_frames, cells_of, pools, cache)
        for entry, frame in zip(formed, frames, strict=True):
            self._threads(first.q.device, self._finish, *entry, frame)

    @torch.no_grad()
    def _begin(self, held: list[_Held]) -> tuple:
        """Records of one :meth:`_Held.signature` stacked along the batch (record ``l`` at items ``l * B ..``; every
        step per item or group: a record's values are its own pass's) up to the query frames: the records, their
        logits and cell, and the rest of :func:`~.cells.cell_inputs`' arguments."""
        first, stacked = held[0], lambda name: _stacked(held, name)
        q, k = stacked("q").float(), stacked("k").float()  # (L * B, H, Q, D), (L * B, H, K, D)
        other = first.other.float() if first.other is not None else None
        attn, q_norms = record_logits(first.processor, q, k, first.text, other)  # (L * B, H, Q, K), (L * B, H, Q)
        if first.used is not None:  # the edited weights' logits over the keys, a zero weight at float32's smallest
            used, kept = first.used, first.kept
            if kept is not None:  # the keys hold the kept references only
                used = used.index_select(-1, kept_tokens(kept[0], used.shape[-1] // kept[1], used.device))
            attn = used.clamp_min(torch.finfo(torch.float32).tiny).log()  # (B, H, Q, K)
            # a row the edit zeroed has no weighting to compare: NaN, counted in nonfinite (not read as uniform)
            attn = attn.masked_fill((used.sum(-1, keepdim=True) > 0).logical_not_(), math.nan)
        groups = len(held) * first.labels.shape[0]
        text_mask = stacked("text_mask")  # (L * B, tokens)
        sample = None  # (n,), or (L, n) for stacked records: cells.take_rows reads block l at row l
        if first.rows is not None:  # the stratified row sample (ProbeConfig.rows) from the keys drawn for it
            keys = first.keys if len(held) == 1 else torch.stack([entry.keys for entry in held])
            sample = stratified_rows(*first.rows, keys)
        nw_rows = None if self._maps is not None and not (first.text or first.mapped) else sample  # maps: every row
        cell = group_cell(
            groups=groups,
            q=q,
            k=k,
            attn=attn,
            text=first.text,
            rows=stacked("inside"),
            processor=first.processor,
            text_mask=text_mask,
            h=first.h[0],
            nw_scale=first.h[1],
            fit=self.config.bandwidth == "fit",
            nw_rows=nw_rows,
            dot=first.used is None,
        )
        tails = None
        if cell.key_mask is not None:
            n_keys, device = cell.attn.shape[-1], q.device
            tails = self._constant(f"tails{n_keys}", device, lambda: null_tail_table(n_keys, device))
        # the query frame's pools: each group (a batch item), or each chunk of the pass (one CFG branch's items)
        per_record = first.labels.shape[0]
        pools = per_record if self.config.query_frame == "item" else first.chunks
        # and the other pool's (schema.QUERY_POOL_OTHER_COLUMN): formed only where a branch holds several items
        other_pools = first.chunks if pools == per_record else per_record
        inputs = dict(groups=groups, q=q, k=k, other=other, text=first.text, processor=first.processor, tails=tails)
        inputs.update(share=first.share, cache={} if torch.compiler.is_compiling() else self._constants)
        inputs.update(text_mask=text_mask, pools=pools * len(held), q_norms=q_norms, sample=sample)
        return held, attn, cell, dict(inputs, other_pools=other_pools * len(held))

    @torch.no_grad()
    def _finish(self, held: list[_Held], attn: torch.Tensor, cell: cells.Cell, inputs: dict, frame=None) -> None:
        """:meth:`_begin`'s records from the query frames on (``frame``: formed with others', or ``None``): inputs
        kept for the pass's statistics, their weights (``keep_maps``) and maps."""
        first, labels = held[0], held[0].labels
        inputs = cell_inputs(cell=cell, frame=frame, **inputs)
        inputs.apart = first.used is not None  # the weights an edit left
        self._pending.append((held, inputs))
        self._pending_elements += inputs.pending_elements()
        if 4 * self._pending_elements > PENDING_BYTES:  # bounded memory: compare what is kept so far
            self._flush()
        for entry, logits in zip(held, attn.chunk(len(held)), strict=True) if self.config.keep_maps else ():
            # the weights the layer used: an edit's as they are (unnormalised where it left so)
            key = (entry.call.index, entry.step, self.layers[entry.index].name, entry.slot)
            kept_logits = logits if entry.kept is None else expand_references(logits, *entry.kept, -1, -math.inf)
            self._keep_map(key, entry.used if entry.used is not None else kept_logits.softmax(-1))
            self._map_labels.setdefault(key, []).append(labels.repeat_interleave(len(logits) // len(labels)))
        if self._maps is not None and not (first.text or first.mapped):
            self._add_maps(held, cell)

    def _map_pass(self) -> None:
        """The maps of the ending pass's held image records (its values are in :attr:`_maps` now), a stack per layer
        size, from their logits alone: the records wait for their statistics (:meth:`_flush`) as without maps."""
        batches: dict[tuple, list[_Held]] = {}
        for entry in self._held:
            if not (entry.mapped or entry.text):
                entry.mapped = True
                batches.setdefault(entry.signature(), []).append(entry)
        for held in batches.values():
            first, q, k = held[0], _stacked(held, "q").float(), _stacked(held, "k").float()
            attn, _ = record_logits(first.processor, q, k, False)
            kw = dict(text=False, rows=None, processor=first.processor, text_mask=None, fit=False, key_copies=False)
            cell = group_cell(len(held) * first.labels.shape[0], q, k, attn, h=first.h[0], nw_scale=first.h[1], **kw)
            self._add_maps(held, cell)  # the maps read no copies' ids

    def _add_maps(self, held: list[_Held], cell: cells.Cell) -> None:
        """A stack's maps at once (:meth:`~.maps.MapAccumulator.add`); apart where an edit acted (formed alone)."""
        labels, spine = held[0].labels, {} if self._spine is None else self._spine.used
        edited = [spine.get((self.layers[entry.index].name, entry.slot, "contribution")) for entry in held]
        parts = zip(([e] for e in held), cell.attn.chunk(len(held)), cell.nw.chunk(len(held)), edited, strict=True)
        for part, maps_attn, maps_nw, contribution in (
            parts if any(x is not None for x in edited) else [(held, cell.attn, cell.nw, None)]
        ):
            kept, used = part[0].kept, part[0].used
            if kept is not None:
                maps_attn, maps_nw = (expand_references(x, *kept, -1, -math.inf) for x in (maps_attn, maps_nw))
            if used is not None:  # (B, H, Q, K) -> (groups, items, H, Q, K) -> (groups, H, items * Q, K), the cells'
                used = used.unflatten(0, (labels.shape[0], -1)).transpose(1, 2).flatten(2, 3)
            where = [(entry.call.index, entry.step, entry.index, entry.slot) for entry in part]
            self._maps.add(where, labels, maps_attn, maps_nw, used, contribution)


def _stacked(held: list[_Held], name: str) -> torch.Tensor | None:
    """The records' ``name`` stacked along the batch ``(L * B, ...)``; one record's as the tap gave it (a view)."""
    parts = [getattr(entry, name) for entry in held]
    return parts[0] if parts[0] is None or len(parts) == 1 else torch.cat(parts)
