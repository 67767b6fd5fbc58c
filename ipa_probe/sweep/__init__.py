"""Sweeps: run the probe once per manifest row, keep every row's table, and aggregate over rows per timestep.

A *manifest* lists runs, one per row: a prompt, reference images, a seed and, optionally, the IP-Adapter scale, the
number of denoising steps and the NW bandwidth. :func:`read_manifest` parses JSON Lines or CSV and sets aside rows
it cannot run (unknown key, missing or unreadable image, bad value), each with its line number.

:func:`run_sweep` runs the rows with a :class:`SweepRunner` and writes one Parquet part file per row into
``OUT/rows/`` (atomically: a hidden temp file, then a rename), so the folder is one Parquet dataset that pandas,
pyarrow, polars or DuckDB read whole, with a ``row`` column. Rows already written are skipped when a sweep is run
again, so an interrupted sweep resumes where it stopped. Each row's seed is fixed by the manifest (or by the base seed
plus the row index), so the table does not depend on which process ran which row: under ``accelerate launch`` the
rows are split between processes with accelerate's ``PartialState.split_between_processes`` and the main process
merges the parts after ``wait_for_everyone``.

The merge reads one part at a time (memory stays bounded by one row's table) and reduces each to its per-timestep
means (:func:`~.capture.report.summarize`). :func:`aggregate` then averages those over rows, per CFG branch and
timestep, with a bootstrap confidence interval over rows for the mean per-row Spearman (paper §A.5, §D.4: the
statistic of a sweep is a mean over images, layers and heads at each timestep).
"""

from .._lazy import lazy_attributes

#: name -> submodule that defines it, imported on first use: the command line reads and checks a manifest
#: (:mod:`.manifest`, no torch, no pandas) before anything heavy loads.
_EXPORTS = {
    "aggregate": ".aggregation",
    "bootstrap_ci": ".aggregation",
    "plot_aggregate": ".aggregation",
    "row_summary": ".aggregation",
    "MANIFEST_KEYS": ".manifest",
    "Manifest": ".manifest",
    "ManifestError": ".manifest",
    "ManifestRow": ".manifest",
    "RowInputError": ".manifest",
    "SkippedRow": ".manifest",
    "parse_bandwidth": ".manifest",
    "read_manifest": ".manifest",
    "SweepResult": ".orchestration",
    "run_sweep": ".orchestration",
    "RowDefaults": ".runner",
    "RowSettings": ".runner",
    "SweepRunner": ".runner",
    "SweepLayout": ".storage",
    "load_table": ".storage",
    "write_part": ".storage",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
