"""Sweeps: a manifest of rows run through one pipeline, stored as a resumable Parquet dataset and aggregated.

The implementation lives in ``core``.
"""

from .core import (
    MANIFEST_KEYS,
    Manifest,
    ManifestError,
    ManifestRow,
    RowDefaults,
    RowInputError,
    RowSettings,
    SkippedRow,
    SweepLayout,
    SweepResult,
    SweepRunner,
    aggregate,
    bootstrap_ci,
    load_table,
    parse_bandwidth,
    plot_aggregate,
    read_manifest,
    row_summary,
    run_sweep,
    write_part,
)

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
