"""The sweep: split rows between processes, run those not yet written, merge and aggregate on the main process."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._checks import MAX_RESAMPLES, check_flag, check_fraction, check_int, check_threshold
from .._io import (
    OutputLocked,
    check_launch_holds,
    output_lock,
    versions,
    write_figure,
    write_json,
    write_table,
)
from ..statistics.schema import frac_column
from .aggregation import aggregate, plot_aggregate, row_summary
from .manifest import Manifest, ManifestRow, RowInputError, SkippedRow
from .runner import SweepRunner
from .storage import DamagedPart, SweepLayout, _part_metadata, read_part, write_part

logger = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """What a sweep did. Complete on the main process; elsewhere only ``out``, ``rows``, ``resumed``, ``processes``
    and ``seconds`` are filled in (``done``, ``ran`` are 0 and the tables ``None``).

    Attributes:
        rows: valid manifest rows; ``total``: rows in the manifest, valid or not.
        ran: rows computed by this call (all processes); ``resumed``: rows already written before it.
        skipped: rows the manifest check rejected (a bad value, a missing or unreadable image), in row order.
        seconds: wall time of the row loop (from the split to the last process finishing).
        rows_by_process: process index -> rows it computed in this call (main process only).
        failed: every row of the manifest without results: those in ``skipped`` and those that failed while running
            or whose finished part could not be checked (``stage`` says which); a rerun tries them again.
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
    failed: list[SkippedRow] = field(default_factory=list)
    total: int | None = None

    def describe(self) -> str:
        """One line: rows done, resumed, failed, and the statistics at the last timestep of the cond branch."""
        total = self.total if self.total is not None else self.rows
        line = f"sweep: {self.done}/{total} rows done ({self.ran} now, {self.resumed} resumed"
        line += f", {self.processes} process{'es' if self.processes > 1 else ''}"
        if self.ran and self.seconds > 0:
            line += f", {60 * self.ran / self.seconds:.1f} rows/min"
        line += ")"
        if self.failed:
            lines = ", ".join(str(s.line) for s in self.failed[:10]) + (", ..." if len(self.failed) > 10 else "")
            running = sum(s.stage == "run" for s in self.failed)
            kinds = []
            if running:
                kinds.append(f"{running} failed while running")
            if len(self.failed) - running:
                kinds.append(f"{len(self.failed) - running} rejected by the checks before running")
            kept = sum(s.kept_part for s in self.failed)
            if kept:
                kinds.append(f"{kept} with finished parts kept")
            line += f", {len(self.failed)} failed (line {lines}: {', '.join(kinds)}; reasons in summary.json; "
            line += "run again to retry)"
        line += f" -> {self.out}"
        agg = self.aggregate
        if agg is not None and not agg.empty:
            part = agg[agg["branch"] == "cond"] if (agg["branch"] == "cond").any() else agg
            last = part.sort_values("timestep").iloc[0]
            frac = frac_column(self.threshold)
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


@dataclass
class _Scan:
    """What ``rows/`` holds for the manifest's rows, read from the parts' metadata only (nothing is changed)."""

    current: set[int] = field(default_factory=set)  # part made with these settings from these images
    stale: list[str] = field(default_factory=list)  # parts made with other settings: descriptions
    set_aside: dict[Path, str] = field(default_factory=dict)  # part -> why it leaves rows/ (if the sweep goes on)
    unreadable: dict[int, str] = field(default_factory=dict)  # row -> why its part's images cannot be checked


def _scan(manifest: Manifest, runner: SweepRunner, layout: SweepLayout, restart: bool, log: bool = True) -> _Scan:
    """Sort the parts in ``rows/``: current, made with other settings, to set aside (damaged, changed images, not a
    row of this manifest), or kept unchecked (the row's images cannot be read now). ``log``: warn about the rows
    that will run again (the main process does).

    A finished row whose inputs became unreadable keeps its part: the manifest check rejected the row (an image
    missing) or its images cannot be hashed; the row fails with that reason, and its part counts again, without
    running, once the images are back unchanged.
    """
    warn = logger.warning if log else logger.debug
    scan = _Scan()
    rows = {layout.part(row.row): row for row in manifest.rows}
    rejected = {layout.part(skip.row) for skip in manifest.skipped}
    for path in layout.parts():
        if path in rejected:
            continue  # its row fails with the manifest check's reason; the part stays
        row = rows.get(path)
        if row is None:
            scan.set_aside[path] = "not-in-manifest"
            continue
        meta = _part_metadata(path)
        if meta is None:
            warn("row %d (line %d): %s is damaged; running the row again", row.row, row.line, path.name)
            scan.set_aside[path] = "damaged"
        elif meta.get("fingerprint") != runner.fingerprint(row):
            if restart:
                scan.set_aside[path] = "other-settings"
                continue
            old = meta.get("settings", {})
            new = json.loads(json.dumps(asdict(runner.resolve(row)), default=str))
            changed = sorted(k for k in new if old.get(k, new[k]) != new[k]) or ["model or probe options"]
            scan.stale.append(f"row {row.row} (line {row.line}): {', '.join(changed)} differ")
        else:
            try:
                inputs = runner.inputs(row)
            except RowInputError as err:
                scan.unreadable[row.row] = str(err)
                continue
            if meta.get("inputs") != inputs:
                warn("row %d (line %d): its images changed since it ran; running it again", row.row, row.line)
                scan.set_aside[path] = "images-changed"
            else:
                scan.current.add(row.row)
    return scan


def _refuse_stale(scan: _Scan, layout: SweepLayout) -> None:
    """Stop, before anything in the folder is touched, if it holds rows made with other settings."""
    if scan.stale:
        more = f" and {len(scan.stale) - 3} more" if len(scan.stale) > 3 else ""
        raise ValueError(
            f"{layout.rows} already holds rows made with other settings ({'; '.join(scan.stale[:3])}{more}). "
            "Nothing was changed. Use another output folder, or restart to replace them"
        )


def _tidy(manifest: Manifest, layout: SweepLayout, scan: _Scan, threshold: float) -> dict[int, pd.DataFrame]:
    """Main process, before any row runs: leave ``rows/`` holding only current, readable parts of this manifest.

    Temp files of killed writers are removed (the folder lock says no writer is alive); parts that do not belong
    are moved to ``set_aside/``; every current part is read back whole (page checksums verified) and reduced to its
    per-timestep summary, so a damaged one is found now and its row alone runs again. Returns row -> its
    :func:`row_summary`, for the current parts (the merge reuses them)."""
    layout.rows.mkdir(parents=True, exist_ok=True)
    layout.skipped.mkdir(parents=True, exist_ok=True)
    for temp in layout.temp_files():
        temp.unlink(missing_ok=True)
    for path, why in scan.set_aside.items():
        layout.set_part_aside(path, why)
    valid = {layout.skip_record(row.row).name for row in manifest.rows if row.row not in scan.current}
    for record in layout.skipped.glob("*.json"):  # failure records of rows now done or no longer in the manifest
        if record.name not in valid:
            record.unlink()
    summaries: dict[int, pd.DataFrame] = {}
    lines = {row.row: row.line for row in manifest.rows}
    for row in sorted(scan.current):
        path = layout.part(row)
        try:
            summaries[row] = row_summary(read_part(path), threshold)
        except DamagedPart as err:
            logger.warning("row %d (line %d): %s; running the row again", row, lines[row], err)
            layout.set_part_aside(path, "damaged")
    return summaries


@contextmanager
def _folder_lock(layout: SweepLayout, state) -> Iterator[None]:
    """Hold ``layout.root``'s lock on the main process; the other processes check that their launch holds it."""
    with ExitStack() as stack:
        error: OutputLocked | None = None
        if state.is_main_process:
            try:
                stack.enter_context(output_lock(layout.root, "ipa-probe sweep"))
            except OutputLocked as err:
                error = err
        if state.num_processes > 1:
            state.wait_for_everyone()
            if not state.is_main_process:
                try:
                    check_launch_holds(layout.root)
                except OutputLocked as err:
                    error = err
        if error is not None:
            raise error
        yield


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
    only on the row (its seed, settings, images and the model), so any split gives the same dataset.

    What is on disk is never lost to a run that does not finish (docs/failures.md, "Sweeps"): one writer per folder
    (:func:`~.._io.output_lock`); a row whose part exists with the same fingerprint (:meth:`SweepRunner.fingerprint`)
    and image bytes (:meth:`SweepRunner.inputs`) is not run again, and a damaged, outdated or orphaned part moves to
    ``set_aside/``; parts written under other settings stop the sweep untouched unless ``restart``; rows fail alone
    (``skipped/``, :attr:`SweepResult.failed`, manifest rejections with ``stage="manifest"``); and the derived files
    are replaced atomically after a complete merge only.

    ``state``: accelerate's ``PartialState`` (``None``: one process); ``restart``: replace rows written with other
    settings instead of stopping; ``threshold``, ``confidence``, ``n_resamples``: see :func:`aggregate`; ``extra``: a
    JSON-able record added to ``summary.json``; ``clock``: the time source of ``seconds``. The result's tables are
    filled in on the main process only.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range (named), before anything is touched.
        ValueError: ``out`` holds rows written with other settings (pass ``restart=True`` or another folder).
        OutputLocked: another live sweep holds ``out``.
    """
    _check_arguments(manifest, runner, out, state, restart, progress, threshold, confidence, n_resamples, extra, clock)
    state = state if state is not None else _OneProcess()
    layout = SweepLayout(Path(out))
    if state.is_main_process:
        for skip in manifest.skipped:
            logger.warning("manifest %s line %d (row %d) skipped: %s", manifest.path, skip.line, skip.row, skip.reason)
    with _folder_lock(layout, state):
        # every process scans (reads only), so all refuse alike; only the main process changes anything
        check_start = clock()
        scan = _scan(manifest, runner, layout, restart, log=state.is_main_process)
        _refuse_stale(scan, layout)
        summaries = _tidy(manifest, layout, scan, threshold) if state.is_main_process else {}
        check_seconds = clock() - check_start
        state.wait_for_everyone()
        pending = [row for row in manifest.rows if not layout.part(row.row).is_file()]
        resumed = {row.row for row in manifest.rows} - {row.row for row in pending} - set(scan.unreadable)
        state.wait_for_everyone()  # everyone has listed the pending rows before anyone writes
        seconds = _run_rows(pending, runner, layout, state, progress, clock)
        if not state.is_main_process:
            return SweepResult(
                out=layout.root,
                rows=len(manifest.rows),
                done=0,
                ran=0,
                resumed=len(resumed),
                skipped=[],
                processes=state.num_processes,
                seconds=seconds,
            )
        return _merge(
            manifest,
            runner,
            layout,
            summaries,
            ran_now={row.row for row in pending},
            resumed=resumed,
            unreadable=scan.unreadable,
            processes=state.num_processes,
            seconds=seconds,
            threshold=threshold,
            confidence=confidence,
            n_resamples=n_resamples,
            extra=extra,
            check_seconds=check_seconds,
        )


def _check_arguments(
    manifest, runner, out, state, restart, progress, threshold, confidence, n_resamples, extra, clock
) -> None:
    """:func:`run_sweep`'s arguments, checked before the folder is locked or any row runs."""
    if not isinstance(manifest, Manifest):
        raise TypeError(f"manifest: expected a Manifest from read_manifest(path), got {type(manifest).__name__}")
    if not isinstance(runner, SweepRunner):
        raise TypeError(f"runner: expected a SweepRunner(pipe, ...), got {type(runner).__name__}")
    if not isinstance(out, str | os.PathLike):
        raise TypeError(f"out: expected a folder path (str or Path), got {type(out).__name__}")
    if state is not None and not all(hasattr(state, a) for a in ("num_processes", "is_main_process")):
        raise TypeError(f"state: expected accelerate's PartialState or None, got {type(state).__name__}")
    check_flag(restart, "restart")
    check_flag(progress, "progress")
    check_threshold(threshold)
    check_fraction(confidence, "confidence")
    check_int(n_resamples, "n_resamples", 1, MAX_RESAMPLES)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict (added to summary.json) or None, got {type(extra).__name__}")
    if not callable(clock):
        raise TypeError(f"clock: expected a function returning seconds, got {type(clock).__name__}")


def _run_rows(rows: list[ManifestRow], runner: SweepRunner, layout: SweepLayout, state, progress, clock) -> float:
    """Run this process's share of ``rows``, each alone; returns the seconds until every process is done."""
    from tqdm.auto import tqdm

    start = clock()
    with state.split_between_processes(rows) as mine:
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
                _run_row(row, runner, layout, state.process_index, clock)
                bar.update(1)
        finally:
            bar.close()
    state.wait_for_everyone()
    return clock() - start


def _run_row(row: ManifestRow, runner: SweepRunner, layout: SweepLayout, process: int, clock) -> None:
    """Run one row and write its part; any error fails this row alone and is recorded in ``skipped/``."""
    row_start = clock()
    try:
        inputs = runner.inputs(row)
        table = runner.run_row(row)
    except Exception as err:  # noqa: BLE001 - whatever the pipeline raises fails this row, not the sweep
        reason = str(err) if isinstance(err, RowInputError) else f"{type(err).__name__}: {str(err).strip()}"
        reason = reason.splitlines()[0] if reason.strip() else type(err).__name__
        logger.warning("manifest line %d (row %d) failed: %s", row.line, row.row, reason)
        write_json(layout.skip_record(row.row), {"row": row.row, "line": row.line, "reason": reason})
        return
    metadata = {
        "fingerprint": runner.fingerprint(row),
        "inputs": inputs,
        "settings": asdict(runner.resolve(row)),
        "line": row.line,
        "process": process,
        "seconds": clock() - row_start,
    }
    write_part(table, layout.part(row.row), metadata)
    layout.skip_record(row.row).unlink(missing_ok=True)


def _merge(
    manifest: Manifest,
    runner: SweepRunner,
    layout: SweepLayout,
    summaries: dict[int, pd.DataFrame],
    *,
    ran_now: set[int],
    resumed: set[int],
    unreadable: dict[int, str],
    processes: int,
    seconds: float,
    threshold: float,
    confidence: float,
    n_resamples: int,
    extra: dict[str, Any] | None,
    check_seconds: float,
) -> SweepResult:
    """Summarise the new parts one at a time, aggregate with the resumed ones, and replace the derived files."""
    per_row, by_process, row_seconds, failed = _collect(manifest, layout, summaries, ran_now, unreadable, threshold)
    agg = aggregate(per_row, threshold=threshold, confidence=confidence, n_resamples=n_resamples)
    rejected = [replace(s, kept_part=layout.part(s.row).is_file()) for s in manifest.skipped]
    failed = sorted([*rejected, *failed], key=lambda s: s.row)
    result = SweepResult(
        out=layout.root,
        rows=len(manifest.rows),
        done=int(per_row["row"].nunique()) if not per_row.empty else 0,
        ran=len([row for row in ran_now if layout.part(row).is_file()]),
        resumed=len(resumed),
        skipped=rejected,
        processes=processes,
        seconds=seconds,
        rows_by_process=dict(sorted(by_process.items())),
        row_summary=per_row,
        aggregate=agg,
        threshold=threshold,
        failed=failed,
        total=manifest.total,
    )
    record = {
        "manifest": {"path": str(manifest.path), "format": manifest.format, "rows": manifest.total},
        "settings": {
            **runner.settings,
            "defaults": asdict(runner.defaults),
            "layers": runner.layers,
            "heads": runner.heads,
            "call_kwargs": runner.call_kwargs,
            "threshold": threshold,
            "confidence": confidence,
            "resamples": n_resamples,
        },
        "versions": versions(),
        **(extra or {}),
        "rows": {
            "manifest": manifest.total,
            "valid": result.rows,
            "done": result.done,
            "ran": result.ran,
            "resumed": result.resumed,
            "failed": len(failed),
        },
        "failed": [asdict(s) for s in failed],  # every row without results, with its stage and reason
        "processes": processes,
        "rows_by_process": {str(k): v for k, v in result.rows_by_process.items()},
        "seconds": {
            "check": check_seconds,  # scanning rows/ and reading back every finished part before the rows run
            "loop": seconds,
            "rows_total": float(np.nansum(row_seconds)) if row_seconds else 0.0,
        },
        "aggregate": agg.to_dict(orient="records"),
    }
    _write_derived(layout, per_row, agg, record, confidence)
    return result


def _collect(
    manifest: Manifest,
    layout: SweepLayout,
    summaries: dict[int, pd.DataFrame],
    ran_now: set[int],
    unreadable: dict[int, str],
    threshold: float,
) -> tuple[pd.DataFrame, dict[int, list[int]], list[float], list[SkippedRow]]:
    """Per-row summaries of every row with a current part (reading only the parts not summarised yet), which process
    ran the new rows and in how long, and the valid rows without results (failed while running, or whose part's
    images cannot be checked)."""
    collected, by_process, row_seconds, failed = [], {}, [], []
    for row in manifest.rows:
        path = layout.part(row.row)
        if row.row in unreadable:
            failed.append(SkippedRow(row.row, row.line, unreadable[row.row], stage="manifest", kept_part=True))
            continue
        if not path.is_file():
            record = layout.skip_record(row.row)
            if record.is_file():
                failed.append(SkippedRow(row.row, row.line, json.loads(record.read_text())["reason"], stage="run"))
            else:
                logger.warning("row %d (line %d) has no results: did a process stop early?", row.row, row.line)
            continue
        if row.row in ran_now:
            meta = _part_metadata(path) or {}
            by_process.setdefault(int(meta.get("process", 0)), []).append(row.row)
            row_seconds.append(float(meta.get("seconds", math.nan)))
        summary = summaries.get(row.row)
        if summary is None:
            summary = row_summary(read_part(path), threshold)
        collected.append(summary)
    per_row = pd.concat(collected, ignore_index=True) if collected else pd.DataFrame()
    return per_row, by_process, row_seconds, failed


def _write_derived(layout: SweepLayout, per_row: pd.DataFrame, agg: pd.DataFrame, record: dict, confidence: float):
    """Replace the row summary, the aggregate, ``summary.json`` and the plot, each atomically."""
    if per_row.empty:
        layout.row_summary.unlink(missing_ok=True)
    else:
        write_table(per_row, layout.row_summary)
    write_table(agg, layout.aggregate)
    write_json(layout.summary, record)
    write_figure(plot_aggregate(agg, confidence=confidence), layout.plot)
