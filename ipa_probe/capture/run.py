"""Record IP-Adapter image-prompt attention at every denoising step and compare it with Gaussian NW weights.

How it reads the attention without touching the computation: an IP-Adapter processor forms an image-branch query
and image-token keys with modules it owns or borrows (``attn.to_q`` and ``processor.to_k_ip[i]`` in SD/SDXL; see
:mod:`~.taps` for Flux and SD3). Forward hooks on exactly those modules see the tensors the processor uses;
the image branch's weights are ``softmax(q k_ip^T / sqrt(d_head))`` per head, a small ``(B, H, Q, K_ip)`` block. The
processor keeps running its own fused path, so the pipeline's output is bit-identical with the probe on or off, and
the processors stay the very same objects. The probe is a client of the pipeline's attachment core
(:mod:`~.spine`: the step clock, the denoiser's one pre-hook): inside an intervention or under edited hook points it
reads the weights the layer used (the references an ablation kept, the weights an edit published), and its table's
``edits`` column names the edits that acted at each step.

This module is family-agnostic: a :class:`~.taps.Tap` says where the tensors are, how heads are split and how
denoiser calls map to steps and CFG branches; here they become statistics. The statistics of each (step, layer,
adapter, CFG branch, head) are computed on the pipeline's device and added into preallocated buffers; nothing is
copied to the host until the ``with`` block ends (one transfer). Each record is held from its hook until the call ends
(the next call starts, or the block ends) or the records pass a memory budget (:mod:`.forming`); then the records of
one layer size are formed stacked, every step's (logits, row samples, query frames), and the per-row statistics of
every record run in one pass (:func:`~.cells.compare_cells`), instead of one each per record or pass.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.utils.torch_utils import is_compiled_module

from .._checks import check_steps_ran
from ..layers import (
    IPLayer,
    LayerSelection,
    claim,
    denoiser_of,
    find_ip_layers,
    refind_ip_layers,
    release,
)
from ..statistics import bandwidth as bw
from ..statistics.bandwidth import BandwidthSpec
from ..statistics.compiled import run_compiled
from ..statistics.schema import CELL_FIELDS
from . import spine
from .branches import Layout, PromptEvidence, label_vocabulary
from .buffers import CallBuffers, grow, new_buffers
from .cells import CellInputs, compare_cells, join_cells, null_keys
from .config import DEFAULT_ROWS, ProbeConfig
from .forming import RecordForming, _Held
from .map_views import MapViews
from .maps import MapAccumulator
from .run_views import RunViews
from .spine import Spine
from .taps import Capture, Tap, tap_for

__all__ = ["FIELDS", "ProbeConfig", "ProbeRun", "probe"]

logger = logging.getLogger(__name__)


#: Per-cell values kept in the buffers (see :data:`ipa_probe.statistics.schema.CELL_FIELDS`).
FIELDS: tuple[str, ...] = CELL_FIELDS

_FEATURE = "probe"


@dataclass
class _StepState:
    call: CallBuffers | None = None
    step: int = -1
    timestep: torch.Tensor | None = None
    layout: Layout | None = None
    text_mask: torch.Tensor | None = None  # (B, tokens) bool: prompt tokens up to the first end-of-text
    in_pass: bool = False  # a denoiser pass started and has not returned
    records: int = 0  # (q, k) pairs recorded in the current pass
    bandwidth: dict[int, torch.Tensor] = field(default_factory=dict)  # head_dim -> h of the current step


def _filled(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``(n,)`` int64 holding ``values``, built on the host and copied once, from pinned memory without waiting (a
    plain ``torch.tensor(values, device=...)`` waits for the device: a sync); one copy whatever the pattern."""
    return torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda").to(device, non_blocking=True)


class ProbeRun(RecordForming, RunViews, MapViews):
    """A running (then finished) probe. Create it with :func:`probe`.

    After the ``with`` block: :meth:`to_dataframe`, :meth:`summary`, :meth:`plot`, :meth:`save`, and :attr:`maps`
    when ``keep_maps=True``.
    """

    def __init__(self, pipe, config: ProbeConfig) -> None:
        self.pipe = pipe
        self.config = config
        denoiser = denoiser_of(pipe)
        self.layers: list[IPLayer] = find_ip_layers(denoiser, config.layers)
        self.compiled = is_compiled_module(denoiser)  # or in place: told by the first pass (PassInfo.compiled)
        self.tap: Tap = tap_for(pipe, self.layers)
        if config.kind != "image" and not self.tap.supports_text:
            raise ValueError(
                f'kind="{config.kind}" reads a text cross-attention, which {self.tap.family} models do not have: '
                'their text tokens share one joint self-attention with the image latents; use kind="image"'
            )
        if config.heads is not None:
            fewest = min(layer.heads for layer in self.layers)
            if max(config.heads) >= fewest:
                raise ValueError(
                    f"heads={list(config.heads)} names a head the selected layers lack (they have {fewest} heads); "
                    f"pick indices below {fewest}"
                )
        self.num_heads = len(config.heads) if config.heads is not None else max(layer.heads for layer in self.layers)
        self.num_adapters = max(layer.num_adapters for layer in self.layers)
        self.images = config.kind in ("image", "both")
        self.text_slot = self.num_adapters if config.kind in ("text", "both") else None
        self.labels: tuple[str, ...] = label_vocabulary(config.branches)
        self.evidence = PromptEvidence(pipe, self.labels, config.branches, on_encode=self.tap.on_encode)
        self.maps: dict[tuple[int, int, str, int], list[torch.Tensor]] = {}
        #: per key of :attr:`maps`, each map's branch label per batch item (filled when the block ends)
        self.map_branches: dict[tuple[int, int, str, int], list[tuple[str, ...]]] = {}
        self._map_labels: dict[tuple[int, int, str, int], list[torch.Tensor]] = {}
        self._calls: list[CallBuffers] = []
        self._state = _StepState()
        self._capture = Capture(record=self._record)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._tap_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._spine: Spine | None = None
        self._processors = [layer.processor for layer in self.layers]  # as last seen at a pass
        #: the nulls' random sources (the stored frame's, the query frame's, the other pool's), made at the first pass
        self._generators: tuple[torch.Generator, ...] = ()
        self._row_generator: torch.Generator | None = None
        #: (layer, kind) -> (rows, keys, sample size or None): what ProbeConfig.rows chose per cell (shapes only)
        self._row_plan: dict[tuple[str, str], tuple[int, int, int | None]] = {}
        #: formed records of the running call whose per-row statistics are still to run: (the records stacked, their
        #: inputs), compared together by :meth:`_flush`
        self._pending: list[tuple[list[_Held], CellInputs]] = []
        self._pending_elements = 0
        #: records held until formed (:meth:`_held_parts`), their queries' elements and their waiting rows' (at most)
        self._held: list[_Held] = []
        self._held_elements = self._held_pending = 0
        self._constants: dict[tuple, torch.Tensor] = {}
        self._result: dict[str, Any] | None = None
        self._claim = None
        self._maps = MapAccumulator(pipe, self.layers, self.tap, self.labels) if config.maps else None

    # ------------------------------------------------------------------ lifecycle
    def _install(self) -> None:
        what = f"read-only forward hooks ({self.config.kind} branch), bandwidth={bw.describe(self.config.bandwidth)}"
        self._claim = claim(self.pipe, _FEATURE, [layer.name for layer in self.layers], what, exclusive=False)
        try:
            self._spine = spine.attach(self.pipe, self)  # its clock, then on_pass / on_return (not on a raise)
            self._capture.spine = self._spine
            self._tap_handles = self.tap.install(self._capture, self.images, self.text_slot)
            self.evidence.install()
            if self._maps is not None:
                self._handles.extend(self._maps.install(denoiser_of(self.pipe), self._spine))
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self, interrupted: bool = False) -> None:
        """Remove every hook and finalise the results. ``interrupted``: the run was stopped by Ctrl-C, so cut-short
        steps are logged at debug level only."""
        try:
            self._flush()  # a pass that raised or was interrupted keeps the records it made
        finally:
            self._close(interrupted)

    def _close(self, interrupted: bool) -> None:
        self._pending.clear()
        self._held.clear()
        self.evidence.remove()
        for handle in [*self._handles, *self._tap_handles]:
            handle.remove()
        self._handles.clear()
        self._tap_handles.clear()
        spine.detach(self.pipe, self)
        self._spine = None
        self.tap.running = self.pipe
        if self._state.in_pass and self._state.call is not None:
            self._state.call.incomplete.add(self._state.step)
        self._state = _StepState()
        self._capture.recording = False
        self.tap.reset()
        if self._claim is not None:
            release(self.pipe, _FEATURE, self._claim)
            self._claim = None
        self._finalize(interrupted)

    def _finalize(self, interrupted: bool = False) -> None:
        """The one device-to-host transfer of the run."""
        if self._result is not None:
            return
        if any(t.device.type == "cuda" for m in self.maps.values() for t in m) and torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._maps is not None:
            self._maps.finalize()
        self._result = {
            "calls": [
                {
                    "index": call.index,
                    "branches": self.labels,
                    "sums": call.sums[: call.steps_seen].cpu(),
                    "counts": call.counts[: call.steps_seen].cpu(),
                    "timesteps": call.timesteps[: call.steps_seen].cpu(),
                    "incomplete": sorted(call.incomplete),
                    "edits": {step: ";".join(edits) for step, edits in call.edits.items()},
                }
                for call in self._calls
            ]
        }
        for key, labels in self._map_labels.items():
            self.map_branches[key] = [tuple(self.labels[i] for i in item.tolist()) for item in labels]
        self._map_labels.clear()
        for call in self._calls:
            if call.incomplete:
                (logger.debug if interrupted else logger.warning)(
                    "probe: call %d, step(s) %s were cut short (the denoiser raised or was interrupted); their rows "
                    "are partial and have complete=False",
                    call.index,
                    sorted(call.incomplete),
                )
        self._calls.clear()

    # ------------------------------------------------------------------ the step clock
    def on_pass(self, spine: Spine, args: tuple, kwargs: dict) -> None:
        """A denoiser pass starts (the spine's clock has placed it)."""
        self._end_pass(spine.now.new_call)  # the previous pass's records, when it raised before returning
        self.compiled = self.compiled or spine.now.compiled
        state, tap = self._state, self.tap
        if state.in_pass and state.call is not None:  # the previous pass raised before returning
            state.call.incomplete.add(state.step)
        self._follow_processors()
        self._start_call_if_new(spine, args, kwargs)
        denoiser_pass = spine.now.denoiser_pass
        if denoiser_pass.new_step or state.step < 0:
            self._advance_step(args, kwargs)
        context = tap.argument("encoder_hidden_states", args, kwargs)
        sample = tap.sample(args, kwargs)
        state.layout = self.evidence.layout(context, sample.device, denoiser_pass.label)
        state.text_mask = tap.text_mask(state.layout, context) if self.text_slot is not None else None
        state.in_pass, state.records = True, 0
        self._capture.recording = denoiser_pass.record and self.config.records_step(state.step, spine.now.timestep)
        self.evidence.pass_seen()
        if self._maps is not None:
            self._maps.on_pass(args, kwargs, spine.now.masks)

    def on_return(self, spine: Spine, output) -> None:
        """The denoiser pass returned (the edits that acted in it are known now: :attr:`PassInfo.edits`)."""
        self.compiled = self.compiled or spine.hooks.compiled  # blocks compiled in place (regional compile)
        self._end_pass(False)
        if self._maps is not None:
            self._maps.end_pass()  # the maps' contributions, every layer's values in
        state = self._state
        if state.call is not None and spine.now.edits:
            edits = state.call.edits.setdefault(state.step, [])
            edits.extend(e for e in spine.now.edits if e not in edits)
        state.in_pass = False
        if self.compiled and self._capture.recording and state.records == 0 and self._ip_branch_runs():
            self._capture.recording = False
            raise RuntimeError(
                "ipa_probe.probe: the compiled denoiser ran without the probe's hooks (it was compiled and run before "
                "the probe was attached, and dynamo does not recompile when hooks are added); attach the probe "
                "before the first compiled call, set `torch._dynamo.config.skip_nnmodule_hook_guards = False` "
                "before compiling, or call `torch.compiler.reset()` before probing"
            )

    def _ip_branch_runs(self) -> bool:
        """Whether some layer runs its image branch: diffusers skips an adapter whose scales are all 0, and then even
        an eager denoiser leaves nothing to record."""
        for layer in self.layers:
            scales = getattr(layer.attention.processor, "scale", 1.0)
            for scale in scales if isinstance(scales, (list, tuple)) else [scales]:
                if any(value != 0 for value in (scale if isinstance(scale, (list, tuple)) else [scale])):
                    return True
        return False

    def _follow_processors(self) -> None:
        """Re-attach to IP-Adapter processors replaced inside the block (``load_ip_adapter`` again, the NW head): their
        image branch runs modules the hooks are not on. Refused with the remedy when the layers, adapters or heads
        changed (the buffers are sized by them); processors without an image branch leave nothing to record."""
        current = [layer.attention.processor for layer in self.layers]
        if all(now is seen for now, seen in zip(current, self._processors, strict=True)):
            return
        self._processors = current
        found = refind_ip_layers(self.pipe, self.layers, self.config.layers)
        if found is None:
            return
        for handle in self._tap_handles:
            handle.remove()
        self.layers[:] = found  # the list the tap and the maps read
        self._processors = [layer.processor for layer in found]
        self._tap_handles = self.tap.install(self._capture, self.images, self.text_slot)
        if self._maps is not None:
            self._maps.read_projections(denoiser_of(self.pipe))
        logger.info("probe: re-attached to the IP-Adapter processors replaced inside the block")

    def _start_call_if_new(self, spine: Spine, args: tuple, kwargs: dict) -> None:
        """Start a new call's buffers when the pass starts a new pipeline call (see :mod:`~.clock`)."""
        state = self._state
        new = spine.now.new_call
        self.tap.running = self.evidence.running = spine.running
        if state.call is not None and not new:
            return
        planned = spine.planned_steps()
        state.call = self._new_call(self.tap.sample(args, kwargs).device, planned or 64)
        state.step = -1
        self.tap.begin_call(args, kwargs)
        planned = planned or 1
        if self.config.keep_maps:
            self._check_map_budget(args, kwargs, planned)
        if self._maps is not None:
            self._maps.begin_call(state.call.index, self.tap.sample(args, kwargs), kwargs)
            recorded = sum(self.config.records_step(s) for s in range(planned))
            self._maps.check_budget(args, kwargs, recorded, self.config.max_map_bytes)

    def _advance_step(self, args: tuple, kwargs: dict) -> None:
        state, call = self._state, self._state.call
        state.step += 1
        state.bandwidth = {}
        if state.step >= call.sums.shape[0]:
            grow(call)
        call.steps_seen = state.step + 1
        timestep = self.tap.timestep(args, kwargs)
        if isinstance(timestep, torch.Tensor):
            t = timestep.reshape(-1)[0].to(device=call.timesteps.device, dtype=call.timesteps.dtype)
            call.timesteps[state.step] = t
        else:
            call.timesteps[state.step] = math.nan if timestep is None else float(timestep)
        state.timestep = call.timesteps[state.step]

    # ------------------------------------------------------------------ buffers
    def _new_call(self, device: torch.device, capacity: int) -> CallBuffers:
        slots = self.num_adapters + (self.text_slot is not None)  # image adapters, then the text branch
        shape = (max(capacity, 1), len(self.layers), slots, len(self.labels), self.num_heads)
        call = new_buffers(len(self._calls), device, shape)
        self._calls.append(call)
        return call

    def _check_map_budget(self, args: tuple, kwargs: dict, steps: int) -> None:
        """Estimate the bytes ``keep_maps`` will hold for this call and refuse above the limit, before step 0 runs."""
        recorded = sum(self.config.records_step(s) for s in range(steps))
        total = 0
        for layer in self.layers:
            heads = len(self.config.heads) if self.config.heads is not None else layer.heads
            total += self.tap.map_elements(layer, args, kwargs) * heads * 2  # fp16
        total *= recorded
        if total > self.config.max_map_bytes:
            raise ValueError(
                f"keep_maps=True would keep about {total / 2**30:.2f} GiB of attention maps for this call, above "
                f"max_map_bytes={self.config.max_map_bytes / 2**30:.2f} GiB; select fewer layers, steps or heads, or "
                f"raise max_map_bytes"
            )
        logger.info("keep_maps: about %.1f MiB of attention maps for this call", total / 2**20)

    def _constant(self, name: str, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device constant made once per run."""
        key = (name, device)
        if key not in self._constants:
            self._constants[key] = make()
        return self._constants[key]

    def _heads(self, device: torch.device) -> torch.Tensor | None:
        heads = self.config.heads
        if heads is None:
            return None
        return self._constant("heads", device, lambda: _filled(heads, device))

    def _bandwidth(self, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bandwidth ``h`` (0-d float32 on the device) and the NW logits' factor ``sqrt(d) / h^2``
        (:func:`~.cells.group_cell`): once per run if fixed, per step if a callable (a tensor it returns as is)."""
        spec = self.config.bandwidth
        with_factor = lambda h: (h, math.sqrt(head_dim) / (h * h))
        if not callable(spec):
            # "fit": the statistics start from the matched bandwidth (the fit itself is per cell)
            value = bw.resolve("matched" if spec == "fit" else spec, head_dim)
            return self._constant(f"h{head_dim}", device, lambda: with_factor(torch.full((), value, device=device)))
        if head_dim not in self._state.bandwidth:
            self._state.bandwidth[head_dim] = with_factor(bw.resolve(spec, head_dim, self._state.timestep, device))
        return self._state.bandwidth[head_dim]

    # ------------------------------------------------------------------ the statistics
    def _record(self, index: int, slot: int, query: torch.Tensor, *rest) -> None:
        """:meth:`_record_stats` (same arguments) with :meth:`_threads`."""
        return self._threads(query.device, self._record_stats, index, slot, query, *rest)

    def _threads(self, device: torch.device, fn: Callable, *args) -> Any:
        """``fn(*args)`` with torch's CPU threads set to :attr:`ProbeConfig.threads` (on a CPU device), the caller's
        restored after, also on an exception."""
        threads = self.config.threads
        if threads is None or device.type != "cpu":
            return fn(*args)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(before)

    @torch.no_grad()
    def _end_pass(self, call_ends: bool) -> None:
        """Its records wait for :meth:`_flush` (the call's end, a budget), rows drawn, maps made (:meth:`_map_pass`);
        formed now for a compiled denoiser (a CUDA graph may overwrite them), compared with ``compile``."""
        if call_ends or self.config.compile:
            return self._flush()
        self._draw_rows(self._held)
        if self.compiled:
            return self._form_parts(*self._held_parts())
        if self._maps is not None and self._held and not self._over(margin=2):  # else formed now, maps read theirs
            self._threads(self._held[0].q.device, self._map_pass)
        self._bound(margin=2)

    @torch.no_grad()
    def _flush(self) -> None:
        """Form the held records (:meth:`_join_pass`), run the per-row statistics of every waiting record
        (:func:`_compare_pass`) and add them into the buffers. With :attr:`ProbeConfig.compile` the two run compiled
        (:func:`~ipa_probe.statistics.compiled.run_compiled`, static shapes), the nulls' keys drawn between."""
        device = next((x.q.device for x in self._held), None) or next((x[-1].attn.device for x in self._pending), None)
        if device is None:
            return
        if not self._generators or self._generators[0].device != device:
            # each frame draws its nulls from a generator of the run's seed of its own, so the stored-frame columns
            # draw what they drew before the query frames existed
            self._generators = tuple(torch.Generator(device=device).manual_seed(self.config.seed) for _ in range(3))

        def run(name: str, fn: Callable, *args) -> Any:  # compiled: static shapes
            if not self.config.compile or torch.compiler.is_compiling():
                return self._threads(device, fn, *args)
            kept = self._pending[:], self._pending_elements  # what a failed call changed, put back before eager
            return self._threads(device, lambda: run_compiled(name, fn, *args, undo=lambda: self._put_back(*kept)))

        batches = run("join", type(self)._join_pass, self, *self._held_parts())
        draws = [null_keys(joined, self._generators) for _, _, joined in batches]  # a compiled region draws nothing
        self._accumulate(run("compare", _compare_pass, batches, draws))

    def _put_back(self, pending: list, elements: int) -> None:
        self._pending, self._pending_elements = pending, elements

    def _join_pass(self, parts: list[list[_Held]], joins: bool) -> list[tuple[list[list[_Held]], list, tuple]]:
        """:meth:`_form_parts` (:meth:`_held_parts`), then the waiting records by signature (in order), each batch's
        tensors joined for one statistics pass (:func:`~.cells.join_cells`): ``(record stacks, inputs, joined)``."""
        self._form_parts(parts, joins)
        pending, self._pending, self._pending_elements = self._pending, [], 0
        batches: dict[tuple, list] = {}
        for entry in pending:
            batches.setdefault(entry[-1].signature(), []).append(entry)
        cache = {} if torch.compiler.is_compiling() else self._constants  # a compiled pass caches nothing
        joined = []
        for batch in batches.values():
            records = [inputs for _, inputs in batch]
            joined.append(([held for held, _ in batch], records, join_cells(records, cache)))
        return joined

    def _accumulate(self, done: list[tuple[list[_Held], torch.Tensor]]) -> None:
        """Add each stack's values ``(L * groups, H, fields)`` into the call's buffers (waiting records are one call's:
        :meth:`on_pass` flushes at a new one) at each record's step, layer, slot and group's label: one indexed add."""
        if not done:
            return
        (call, device), index = (done[0][0][0].call, done[0][1].device), []
        *_, slots, labels, heads = call.counts.shape
        for held, values in done:  # each record's layer, slot and head (kept), each group's label, each record's step
            at = tuple((x.index * slots + x.slot) * labels * heads for x in held)
            make = lambda at=at: _filled(at, device)[:, None, None] + torch.arange(heads, device=device)  # (L, 1, H)
            cells = self._constant(("cells", at), device, make)[..., : values.shape[1]]
            cells = torch.add(cells, held[0].labels.view(1, -1, 1), alpha=heads)  # (L, groups, H)
            steps = [x.step * call.counts[0].numel() for x in held]
            cells += steps[0] if len(set(steps)) == 1 else _filled(steps, device)[:, None, None]
            index.append(cells.flatten())
        values, index = torch.cat([values.flatten(0, 1) for _, values in done]), torch.cat(index)
        call.sums.view(-1, values.shape[-1]).index_add_(0, index, values)
        one = self._constant("one", values.device, lambda: torch.ones((), device=values.device))
        call.counts.view(-1).index_add_(0, index, one.expand(index.shape[0]))

    def _keep_map(self, key: tuple[int, int, str, int], weights: torch.Tensor) -> None:
        weights = weights.half()
        pinned = weights.device.type == "cuda"
        host = torch.empty(weights.shape, dtype=torch.float16, device="cpu", pin_memory=pinned)
        host.copy_(weights, non_blocking=pinned)
        self.maps.setdefault(key, []).append(host)


def _compare_pass(batches: list[tuple], draws: list[list[torch.Tensor]]) -> list[tuple[list[_Held], torch.Tensor]]:
    """The per-row statistics of :meth:`ProbeRun._join_pass`' batches (:func:`~.cells.compare_cells`), the nulls'
    keys drawn beforehand: each stack of records with its values."""
    done = []
    for (held, records, joined), keys in zip(batches, draws, strict=True):
        done += zip(held, compare_cells(records, keys, joined=joined), strict=True)
    return done


@contextlib.contextmanager
def probe(
    pipe,
    bandwidth: BandwidthSpec = "matched",
    *,
    layers: LayerSelection = None,
    steps: Iterable[int] | slice | Callable[[int, float | None], bool] | None = None,
    heads: Sequence[int] | None = None,
    keep_maps: bool = False,
    max_map_bytes: int = 4 * 2**30,
    seed: int = 0,
    kind: str = "image",
    branches: Sequence[str] | None = None,
    maps: bool = False,
    query_frame: str = "item",
    rows: int | str | None = DEFAULT_ROWS,
    threads: int | None = None,
    compile: bool = False,
    log_with: str | None = None,
    logging_dir: str | os.PathLike = "runs",
    run_name: str = "probe",
    branch: str | None = None,
) -> Iterator[ProbeRun]:
    """Record the IP-Adapter attention of every denoising step and compare it with Gaussian NW weights.

    Args:
        pipe: a diffusers pipeline with an IP-Adapter loaded: Stable Diffusion 1.5 / SDXL, Flux or SD3 (see
            :mod:`ipa_probe.capture.taps` for what the image-branch weights are in each).
        bandwidth, layers, steps, heads, keep_maps, max_map_bytes, seed, kind, branches, maps, query_frame, rows,
            threads, compile: see :class:`ProbeConfig`.
        branch: the former name of ``kind`` (accepted with a DeprecationWarning).
        log_with: ``"tensorboard"``, ``"wandb"`` or ``"mlflow"`` to send the run (rho with its baseline and null,
            per-layer rho, histograms, overlays per step with ``maps=True``, settings with end-of-run metrics) to
            that tracker when the block ends normally (after the denoising loop and the one device-to-host
            transfer: nothing is logged, and nothing synchronises, inside the loop); ``None`` (default) for none.
            See :mod:`ipa_probe.probe_log` and docs/logging.md; :meth:`ProbeRun.log` also takes the images.
        logging_dir, run_name: where the tracker writes (TensorBoard: ``logging_dir/run_name``, or
            ``run_name-2``, ... when that folder already holds a run).

    Yields:
        the :class:`ProbeRun`; read its results after the block. Inside another probe's block it reads as it does
        alone, and the other one records the same calls too (docs/api.md, "Features together").

    Raises:
        ValueError / TypeError: bad settings or a pipeline without a supported IP-Adapter, before anything changes.
        ImportError: ``log_with`` names a tracker whose client is not installed (the message names the extra).

    Example:
        ```py
        >>> pipe = ipa_probe.tiny.sd.tiny_pipeline()
        >>> refs = ipa_probe.tiny.sd.default_reference_images()
        >>> with ipa_probe.probe(pipe, bandwidth="matched") as run:
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]
        >>> df = run.to_dataframe()
        ```
    """
    config = ProbeConfig(
        bandwidth=bandwidth,
        layers=layers,
        steps=steps,
        heads=heads,
        keep_maps=keep_maps,
        max_map_bytes=max_map_bytes,
        seed=seed,
        kind=kind,
        branches=branches,
        maps=maps,
        query_frame=query_frame,
        rows=rows,
        threads=threads,
        compile=compile,
        branch=branch,
    )
    if log_with is not None:
        from ..trackers import check_tracker

        check_tracker(log_with)
    run = ProbeRun(pipe, config)
    run._install()
    interrupted = False
    try:
        yield run
    except KeyboardInterrupt:  # Ctrl-C: the caller stops and says so; no warning about the partial step
        interrupted = True
        raise
    finally:
        run._uninstall(interrupted)
    # steps the calls never had: an error naming them, not an empty table (issue 31)
    ran = [c["timesteps"].tolist() for c in run._result["calls"]]
    selected = sum(config.records_step(s, t) for timesteps in ran for s, t in enumerate(timesteps))
    check_steps_ran(config.steps, max(map(len, ran), default=0), selected=selected)
    if log_with is not None:  # only when the block ended normally: a failed run is not logged as a result
        run.log(log_with, logging_dir, run_name)
