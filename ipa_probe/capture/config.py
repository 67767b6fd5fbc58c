"""The probe's settings: :class:`ProbeConfig`, validated when it is made (before anything touches a pipeline)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

from .._checks import check_flag, check_items, check_seed, parse_step_selection, step_selected
from ..layers import LayerSelection, check_layer_selection
from ..statistics import bandwidth as bw
from ..statistics.bandwidth import BandwidthSpec
from ..statistics.schema import AUTO_SAMPLE_ROWS, QUERY_FRAMES, ROW_KEY_BUDGET, SAMPLE_GROUPS

__all__ = [
    "AUTO_SAMPLE_ROWS",
    "DEFAULT_ROWS",
    "ROW_KEY_BUDGET",
    "SAMPLE_GROUPS",
    "ProbeConfig",
    "auto_sample_rows",
    "rows_statement",
]

#: The default of :class:`ProbeConfig`'s ``rows``: ``"auto"``, a budget in row x key units per cell
#: (:data:`ROW_KEY_BUDGET`): a cell whose query rows times keys fit it is exact, a larger one uses a stratified sample
#: of :func:`auto_sample_rows` rows with standard errors. ``rows=None`` asks for exact everywhere, an int for the old
#: rule (exact up to that many rows, a sample of that many beyond, whatever the keys).
DEFAULT_ROWS: int | str | None = "auto"


def auto_sample_rows(rows: int, keys: int) -> int | None:
    """``rows="auto"``: ``None`` (exact) when a cell's ``rows`` x ``keys`` fit :data:`ROW_KEY_BUDGET` or the sample
    would hold every row, else the sample's size: the budget's rows at ``keys`` keys (fewer rows when keys are many,
    so that the sample's per-row work stays near the budget), within :data:`AUTO_SAMPLE_ROWS`, a multiple of
    :data:`SAMPLE_GROUPS`. Read from shapes only (no device value), so choosing it never synchronises."""
    if rows * keys <= ROW_KEY_BUDGET:
        return None
    fewest, most = AUTO_SAMPLE_ROWS
    size = min(most, max(fewest, ROW_KEY_BUDGET // max(keys, 1)))
    size -= size % SAMPLE_GROUPS
    return None if size >= rows else size


def rows_statement(setting: int | str | None, plan: dict[tuple[str, str], tuple[int, int, int | None]]) -> str:
    """Which cells' per-row statistics were exact and which sampled, and why: one sentence from the probe's plan
    ``(layer, kind) -> (rows, keys, sample size or None)`` under ``setting`` (:attr:`ProbeConfig.rows`)."""
    if setting == "auto":
        rule = f'rows="auto": exact where a cell\'s rows x keys <= {ROW_KEY_BUDGET:,}'
    elif setting is None:
        rule = "rows=None: exact everywhere"
    else:
        rule = f"rows={setting}: exact up to {setting} rows per cell"
    exact = sorted((name, kind, r, k) for (name, kind), (r, k, n) in plan.items() if n is None)
    sampled = sorted((name, kind, r, k, n) for (name, kind), (r, k, n) in plan.items() if n is not None)

    def shape(r: int, k: int) -> str:
        return f"{r:,} rows x {k} keys = {r * k:,}"

    def kinds(name: str, kind: str) -> str:
        return name if kind == "image" else f"{name} ({kind})"

    parts = [f"{rule}."]
    if exact:
        largest = max(exact, key=lambda e: e[2] * e[3])
        parts.append(f"Exact in {len(exact)} layer(s) (largest: {kinds(*largest[:2])}, {shape(*largest[2:])}).")
    if sampled:
        listed = "; ".join(f"{kinds(n, kd)}: {shape(r, k)}, {s} rows sampled" for n, kd, r, k, s in sampled)
        parts.append(f"Sampled in {len(sampled)} layer(s), with standard errors in the _se columns ({listed}).")
    if not plan:
        parts.append("Nothing was recorded.")
    return " ".join(parts)


@dataclass(frozen=True)
class ProbeConfig:
    """What to record. Validated on construction; nothing about a pipeline is touched here. Each option in full:
    docs/api.md ("Options of ``probe(pipe, ...)``").

    Args:
        bandwidth: the NW bandwidth ``h``: ``"matched"`` (``h^2 = sqrt(d_head)``), a positive float, a callable of the
            0-d timestep tensor (keep it free of ``.item()`` to stay sync-free), or ``"fit"`` (the ``h`` minimising
            ``KL(attention || NW)`` per cell, in the ``bandwidth`` column). Rank statistics do not depend on ``h``.
        layers: regex (``re.search`` on the layer id) or list of them; ``None`` for every IP-Adapter layer.
        steps: the steps to record: loop indices (an iterable of ints or a ``slice``), a :class:`~ipa_probe.Timesteps`
            or a predicate ``fn(step, timestep) -> bool``, as ``intervene`` takes them; ``None`` for all. The map
            budgets, checked before step 0, count every step of a call for a timestep selection or predicate.
        heads: head indices to record; ``None`` for all.
        keep_maps: also keep the full attention maps (fp16, off the device without blocking) in :attr:`ProbeRun.maps`
            (``(call, step, layer, adapter)`` -> one ``(B, H, Q, K)`` per record) and their branch labels in
            :attr:`ProbeRun.map_branches`; SD3's are the joint weights restricted to the image tokens, renormalised.
        maps: also keep per-reference attribution maps on the device (:mod:`ipa_probe.capture.maps`).
        max_map_bytes: refuse ``keep_maps`` or ``maps`` when the estimated size of the maps of a call exceeds this.
        seed: seed of the permutation null's random generator (the global RNG is never used).
        kind: ``"image"`` (the IP-Adapter branch), ``"text"`` (the text branch of the same layers, padding left out;
            ``adapter=-1``; SD 1.5 / SDXL only) or ``"both"``; ``branch=`` is its old name (a DeprecationWarning).
        branches: the batch layout, one label per equal chunk; ``None`` to decide it from evidence
            (:mod:`~ipa_probe.capture.branches`).
        query_frame: the pool of queries over which the ``qf_*`` columns' key term
            (:func:`~ipa_probe.statistics.kernels.query_frame_bias`) is estimated: ``"item"`` (default) or
            ``"branch"``.
        rows: query rows per cell for the per-row statistics (:data:`~ipa_probe.statistics.schema.SAMPLED_COLUMNS`):
            ``"auto"`` (:data:`DEFAULT_ROWS`: exact within :data:`ROW_KEY_BUDGET`, else :func:`auto_sample_rows`),
            an int (the most rows per cell), or ``None`` (exact everywhere); a sample is seeded and stratified
            (:func:`~ipa_probe.statistics.draws.stratified_rows`) and each statistic gets its ``<column>_se``.
        threads: torch's CPU threads around each record's statistics on a CPU device (the caller's restored after,
            also on an exception); ``None`` keeps the caller's.
        compile: run each pass's forming and statistics as two ``torch.compile`` regions of static shapes
            (:func:`~ipa_probe.statistics.compiled.run_compiled`); where torch cannot compile, a warning and the
            eager path.
    """

    bandwidth: BandwidthSpec = "matched"
    layers: LayerSelection = None
    steps: Iterable[int] | slice | Callable[[int, float | None], bool] | None = None
    heads: Sequence[int] | None = None
    keep_maps: bool = False
    max_map_bytes: int = 4 * 2**30
    seed: int = 0
    kind: str = "image"
    branches: Sequence[str] | None = None
    maps: bool = False
    query_frame: str = "item"
    rows: int | str | None = DEFAULT_ROWS
    threads: int | None = None
    compile: bool = False
    branch: InitVar[str | None] = None

    def __post_init__(self, branch: str | None) -> None:
        if branch is not None:
            warnings.warn(
                'ProbeConfig(branch=...) is now kind= ("image", "text" or "both"); branch names the CFG branch in '
                "the table",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "kind", branch)
        # a value of the wrong type is a TypeError, one out of range a ValueError (docs/failures.md, "The Python API")
        for name, kinds, what in (
            ("threads", (int, type(None)), "None or an int"),
            ("rows", (int, str, type(None)), '"auto", None or an int'),
            ("max_map_bytes", (int, float), "a number of bytes"),
            ("kind", (str,), "a str"),
            ("query_frame", (str,), "a str"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"{name}: expected {what}, got {value!r} ({type(value).__name__})")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"threads: expected None (the caller's torch threads) or a positive int (torch CPU threads for the "
                f"probe's statistics), got {self.threads!r}"
            )
        if isinstance(self.rows, str) and self.rows != "auto":
            raise ValueError(
                f'rows: expected "auto" (exact within a budget of {ROW_KEY_BUDGET} rows x keys per cell, a sample '
                f"beyond), None (every row) or an int, got {self.rows!r}"
            )
        if isinstance(self.rows, int) and self.rows < 2 * SAMPLE_GROUPS:
            raise ValueError(
                f'rows: expected "auto", None (every row) or an int >= {2 * SAMPLE_GROUPS} (the most query rows per '
                f"cell before the per-row statistics use a stratified sample), got {self.rows!r}"
            )
        if not isinstance(self.query_frame, str) or self.query_frame not in QUERY_FRAMES:
            raise ValueError(
                f"query_frame: expected one of {list(QUERY_FRAMES)} (the pool of queries the query-frame key term "
                f"is estimated over), got {self.query_frame!r}"
            )
        check_flag(self.maps, "maps")
        check_flag(self.compile, "compile")
        check_flag(self.keep_maps, "keep_maps")
        object.__setattr__(self, "seed", check_seed(self.seed))
        check_layer_selection(self.layers)
        if self.maps and self.kind == "text":
            raise ValueError('maps=True attributes the image branch; use kind="image" or "both"')
        if self.kind not in ("image", "text", "both"):
            raise ValueError(f'kind: expected "image", "text" or "both", got {self.kind!r}')
        object.__setattr__(self, "bandwidth", bw.check(self.bandwidth, ("matched", "fit")))
        if self.branches is not None:
            if isinstance(self.branches, str):
                raise TypeError(
                    f'branches: expected a sequence of labels such as ("uncond", "cond"), got {self.branches!r}'
                )
            branches = check_items(self.branches, "branches", "labels")
            if not branches or not all(isinstance(b, str) and b for b in branches):
                raise ValueError(
                    f'branches: expected labels, one per batch chunk, like ("uncond", "cond"); got {branches!r}'
                )
            object.__setattr__(self, "branches", branches)
        object.__setattr__(self, "steps", parse_step_selection(self.steps))
        if self.heads is not None:
            heads = check_items(self.heads, "heads", "head indices (ints)")
            if not heads or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads):
                raise ValueError(f"heads: expected a non-empty list of non-negative head indices, got {heads!r}")
            object.__setattr__(self, "heads", tuple(sorted(set(heads))))
        if (
            isinstance(self.max_map_bytes, bool)
            or not (isinstance(self.max_map_bytes, int | float) and math.isfinite(self.max_map_bytes))
            or self.max_map_bytes <= 0
        ):
            raise ValueError(f"max_map_bytes: expected a positive byte count, got {self.max_map_bytes!r}")

    def sample_rows(self, rows: int, keys: int) -> int | None:
        """The row sample's size for a cell of ``rows`` query rows and ``keys`` keys per row (:attr:`rows`), or
        ``None`` for exact statistics."""
        if self.rows == "auto":
            return auto_sample_rows(rows, keys)
        if self.rows is None or rows <= self.rows:
            return None
        return self.rows - self.rows % SAMPLE_GROUPS

    def records_step(self, step: int, timestep: Any = ...) -> bool:
        """Whether loop index ``step`` at scheduler ``timestep`` is recorded; before the loop (no timestep: ``...``) an
        upper bound, every step for a timestep selection or predicate."""
        before = timestep is ...
        return (before and callable(self.steps)) or step_selected(self.steps, step, None if before else timestep)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        steps = self.steps
        return {
            "bandwidth": bw.describe(self.bandwidth),
            "layers": self.layers
            if isinstance(self.layers, str | None)
            else [getattr(p, "pattern", p) for p in self.layers],
            "steps": repr(steps) if isinstance(steps, slice | Callable) else None if steps is None else sorted(steps),
            "heads": None if self.heads is None else list(self.heads),
            "keep_maps": self.keep_maps,
            "seed": self.seed,
            "kind": self.kind,
            "branches": None if self.branches is None else list(self.branches),
            "maps": self.maps,
            "query_frame": self.query_frame,
            "rows": self.rows,
            "compile": self.compile,
        }
