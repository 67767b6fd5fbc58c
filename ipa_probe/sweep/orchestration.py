"""The sweep: split rows between processes, run those not yet written, merge and aggregate on the main process."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._io import versions, write_json
from .aggregate import aggregate, plot_aggregate, row_summary
from .manifest import Manifest, RowInputError, SkippedRow
from .runner import SweepRunner
from .storage import SweepLayout, _part_metadata, write_part

logger = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """What a sweep did. Complete on the main process; elsewhere only ``out``, ``rows``, ``resumed``, ``processes``
    and ``seconds`` are filled in (``done``, ``ran`` are 0 and the tables ``None``).

    Attributes:
        out: the output folder.
        rows: valid manifest rows.
        done: rows with results now.
        ran: rows computed by this call (all processes).
        resumed: rows already written before this call.
        skipped: rows not run (manifest problems and rows skipped at run time), in row order.
        processes: how many processes shared the rows.
        seconds: wall time of the row loop (from the split to the last process finishing).
        rows_by_process: process index -> rows it computed in this call (main process only).
    """

    out: Path
    rows: int
    done: int
    ran: int
    resumed: int
    skipped: list[SkippedRow]
    processes: int
    seconds: float
    rows_by_process: dict[int, list[int]] = field(default_factory=dict)
    row_summary: pd.DataFrame | None = None
    aggregate: pd.DataFrame | None = None
    threshold: float = 0.9

    def describe(self) -> str:
        """One line: rows done, resumed, skipped, and the statistics at the last timestep of the cond branch."""
        line = f"sweep: {self.done}/{self.rows} rows done ({self.ran} now, {self.resumed} resumed"
        line += f", {self.processes} process{'es' if self.processes > 1 else ''}"
        if self.ran and self.seconds > 0:
            line += f", {60 * self.ran / self.seconds:.1f} rows/min"
        line += ")"
        if self.skipped:
            lines = ", ".join(str(s.line) for s in self.skipped[:10]) + (", ..." if len(self.skipped) > 10 else "")
            line += f", {len(self.skipped)} skipped (line {lines})"
        line += f" -> {self.out}"
        agg = self.aggregate
        if agg is not None and not agg.empty:
            part = agg[agg["branch"] == "cond"] if (agg["branch"] == "cond").any() else agg
            last = part.sort_values("timestep").iloc[0]
            frac = f"frac_rho_gt_{self.threshold:g}"
            line += f"; last timestep t={last['timestep']:g}: spearman {last['spearman']:.3f}"
            if math.isfinite(last["spearman_ci_low"]):
                line += f" [{last['spearman_ci_low']:.3f}, {last['spearman_ci_high']:.3f}]"
            line += f", pearson {last['pearson']:.3f}, rho>{self.threshold:g} {last[frac]:.2f}"
            line += f", null {last['spearman_null']:.3f}"
        return line


class _OneProcess:
    """The part of accelerate's ``PartialState`` a sweep uses, for one process without accelerate."""

    num_processes = 1
    process_index = 0
    local_process_index = 0
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass

    @contextmanager
    def split_between_processes(self, inputs):
        yield inputs


def _scan(manifest: Manifest, runner: SweepRunner, layout: SweepLayout) -> tuple[set[int], list[str]]:
    """Rows whose part is present with the same fingerprint, and descriptions of parts with another one."""
    done: set[int] = set()
    stale: list[str] = []
    for row in manifest.rows:
        path = layout.part(row.row)
        if not path.is_file():
            continue
        meta = _part_metadata(path)
        if meta is None:
            stale.append(f"row {row.row} (line {row.line}): {path.name} is not a readable sweep part")
        elif meta.get("fingerprint") != runner.fingerprint(row):
            old = meta.get("settings", {})
            new = json.loads(json.dumps(asdict(runner.resolve(row)), default=str))
            changed = sorted(k for k in new if old.get(k, new[k]) != new[k]) or ["model or probe options"]
            stale.append(f"row {row.row} (line {row.line}): {', '.join(changed)} differ")
        else:
            done.add(row.row)
    return done, stale


def run_sweep(
    manifest: Manifest,
    runner: SweepRunner,
    out: str | os.PathLike,
    *,
    state=None,
    restart: bool = False,
    progress: bool = True,
    threshold: float = 0.9,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    extra: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SweepResult:
    """Run every manifest row not yet written, one Parquet part per row, then merge and aggregate on the main process.

    With several processes (``accelerate launch``), every process calls this with the same manifest: the rows still
    to run are split between processes with ``state.split_between_processes`` (contiguous blocks in row order),
    each process writes its own parts, and after ``state.wait_for_everyone()`` the main process reads the parts,
    writes ``row_summary.parquet``, ``aggregate.parquet``, ``summary.json`` and the plot. Every row's table depends
    only on the row (its seed, settings and the model), so any split gives the same dataset.

    Resuming: a row whose part exists with the same fingerprint (:meth:`SweepRunner.fingerprint`) is not run again.
    A part written under other settings stops the sweep before anything runs, unless ``restart`` (which discards
    all parts first). An interrupt (Ctrl-C) or error leaves every finished part intact and no partial file behind.

    Args:
        manifest: from :func:`read_manifest`.
        runner: runs one row.
        out: output folder (created).
        state: accelerate's ``PartialState`` (or ``None`` for one process).
        restart: discard results already in ``out`` and run every row.
        progress: a tqdm bar per process (on stderr).
        threshold, confidence, n_resamples: see :func:`aggregate`.
        extra: JSON-able record added to ``summary.json``.
        clock: time source for ``seconds``.

    Returns:
        a :class:`SweepResult` (its tables only on the main process).

    Raises:
        ValueError: ``out`` holds rows written with other settings (pass ``restart=True`` or another folder).
    """
    from tqdm.auto import tqdm

    state = state if state is not None else _OneProcess()
    layout = SweepLayout(Path(out))
    if state.is_main_process:
        for skip in manifest.skipped:
            logger.warning("manifest %s line %d (row %d) skipped: %s", manifest.path, skip.line, skip.row, skip.reason)
        layout.rows.mkdir(parents=True, exist_ok=True)
        layout.skipped.mkdir(parents=True, exist_ok=True)
        for temp in layout.temp_files():  # left by a process that was killed mid-write
            temp.unlink(missing_ok=True)
        for record in layout.skipped.glob("*.json"):  # rows skipped at run time are tried again
            record.unlink()
        for merged in (layout.row_summary, layout.aggregate, layout.summary, layout.plot):
            merged.unlink(missing_ok=True)  # written again at the end: present only after a complete merge
        if restart:
            for part in layout.parts():
                part.unlink()
    state.wait_for_everyone()

    done, stale = _scan(manifest, runner, layout)
    if stale:
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        raise ValueError(
            f"{layout.rows} already holds rows made with other settings ({'; '.join(stale[:3])}{more}). "
            "Use another output folder, or restart to discard them"
        )
    pending = [row for row in manifest.rows if row.row not in done]
    state.wait_for_everyone()  # everyone has scanned before anyone writes

    start = clock()
    with state.split_between_processes(pending) as mine:
        bar = tqdm(
            total=len(mine),
            desc=f"sweep [process {state.process_index + 1}/{state.num_processes}]",
            unit="row",
            position=state.local_process_index,
            disable=not progress,
            leave=True,
        )
        try:
            for row in mine:
                row_start = clock()
                try:
                    table = runner.run_row(row)
                except RowInputError as err:
                    logger.warning("manifest line %d (row %d) skipped: %s", row.line, row.row, err)
                    write_json(layout.skip_record(row.row), {"row": row.row, "line": row.line, "reason": str(err)})
                else:
                    metadata = {
                        "fingerprint": runner.fingerprint(row),
                        "settings": asdict(runner.resolve(row)),
                        "line": row.line,
                        "process": state.process_index,
                        "seconds": clock() - row_start,
                    }
                    write_part(table, layout.part(row.row), metadata)
                bar.update(1)
        finally:
            bar.close()
    state.wait_for_everyone()
    seconds = clock() - start

    if not state.is_main_process:
        return SweepResult(layout.root, len(manifest.rows), 0, 0, len(done), [], state.num_processes, seconds)
    return _merge(
        manifest,
        runner,
        layout,
        ran_now={row.row for row in pending},
        resumed=done,
        processes=state.num_processes,
        seconds=seconds,
        threshold=threshold,
        confidence=confidence,
        n_resamples=n_resamples,
        extra=extra,
    )


def _merge(
    manifest: Manifest,
    runner: SweepRunner,
    layout: SweepLayout,
    *,
    ran_now: set[int],
    resumed: set[int],
    processes: int,
    seconds: float,
    threshold: float,
    confidence: float,
    n_resamples: int,
    extra: dict[str, Any] | None,
) -> SweepResult:
    """Read the parts of the manifest's rows one at a time, reduce each to per-timestep means, aggregate, write."""
    import matplotlib.pyplot as plt
    import pyarrow.parquet as pq

    summaries, by_process, row_seconds = [], {}, []
    run_skipped: list[SkippedRow] = []
    for row in manifest.rows:
        path = layout.part(row.row)
        if not path.is_file():
            record = layout.skip_record(row.row)
            if record.is_file():
                data = json.loads(record.read_text())
                run_skipped.append(SkippedRow(row.row, row.line, data["reason"]))
            else:
                logger.warning("row %d (line %d) has no results: did a process stop early?", row.row, row.line)
            continue
        meta = _part_metadata(path) or {}
        if row.row in ran_now:
            by_process.setdefault(int(meta.get("process", 0)), []).append(row.row)
            row_seconds.append(float(meta.get("seconds", math.nan)))
        summaries.append(row_summary(pq.read_table(path).to_pandas(), threshold))
    extra_parts = sorted({p.name for p in layout.parts()} - {layout.part(r.row).name for r in manifest.rows})
    if extra_parts:
        logger.warning(
            "%d part file(s) in %s are not valid rows of this manifest; left out", len(extra_parts), layout.rows
        )
    per_row = pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame()
    agg = aggregate(per_row, threshold=threshold, confidence=confidence, n_resamples=n_resamples)
    skipped = sorted([*manifest.skipped, *run_skipped], key=lambda s: s.row)
    done = len(summaries)
    result = SweepResult(
        out=layout.root,
        rows=len(manifest.rows),
        done=done,
        ran=len(ran_now) - len(run_skipped),
        resumed=len(resumed),
        skipped=skipped,
        processes=processes,
        seconds=seconds,
        rows_by_process=dict(sorted(by_process.items())),
        row_summary=per_row,
        aggregate=agg,
        threshold=threshold,
    )
    if not per_row.empty:
        per_row.to_parquet(layout.row_summary, index=False)
    agg.to_parquet(layout.aggregate, index=False)
    record = {
        "manifest": {"path": str(manifest.path), "format": manifest.format, "rows": manifest.total},
        "settings": {**runner.settings, "defaults": asdict(runner.defaults), "layers": runner.layers},
        "versions": versions(),
        **(extra or {}),
        "rows": {"valid": result.rows, "done": done, "ran": result.ran, "resumed": result.resumed},
        "skipped": [asdict(s) for s in skipped],
        "processes": processes,
        "rows_by_process": {str(k): v for k, v in result.rows_by_process.items()},
        "seconds": {"loop": seconds, "rows_total": float(np.nansum(row_seconds)) if row_seconds else 0.0},
        "aggregate": agg.to_dict(orient="records"),
    }
    write_json(layout.summary, record)
    fig = plot_aggregate(agg, confidence=confidence)
    fig.savefig(layout.plot, dpi=120)
    plt.close(fig)
    return result
