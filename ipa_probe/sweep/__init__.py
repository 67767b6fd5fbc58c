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

from .aggregation import aggregate, bootstrap_ci, plot_aggregate, row_summary
from .manifest import (
    MANIFEST_KEYS,
    Manifest,
    ManifestError,
    ManifestRow,
    RowInputError,
    SkippedRow,
    parse_bandwidth,
    read_manifest,
)
from .orchestration import SweepResult, run_sweep
from .runner import RowDefaults, RowSettings, SweepRunner
from .storage import SweepLayout, load_table, write_part

__all__ = [
    "MANIFEST_KEYS",
    "Manifest",
    "ManifestError",
    "ManifestRow",
    "RowDefaults",
    "RowInputError",
    "RowSettings",
    "SkippedRow",
    "SweepLayout",
    "SweepResult",
    "SweepRunner",
    "aggregate",
    "bootstrap_ci",
    "load_table",
    "parse_bandwidth",
    "plot_aggregate",
    "read_manifest",
    "row_summary",
    "run_sweep",
    "write_part",
]
