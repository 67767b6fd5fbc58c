"""Issue #52: the attribution folders' uncorrected rule (``predicts_unadjusted``) decided again with the interval the
code now computes, from the committed records (no generation).

Run from the repository root (a few minutes on one core)::

    PYTHONPATH=$PWD python docs/results/issue52_unadjusted.py [FOLDER ...]

The rule is the one :func:`ipa_probe.experiments.attribution_setup.predictor_test` applies before Holm: the committed
one-sided permutation ``p`` below ``ALPHA`` and the two-sided interval of the per-set Spearman above 0, that interval
now the bootstrap-t (:func:`ipa_probe.sweep.aggregation.bootstrap_ci`, none under 8 sets) instead of BCa. The per-set
values are recomputed from ``effects_<label>.csv`` and ``aggregates_<label>.csv`` (``comparisons_<label>.csv``) and
from ``grid_trained.csv`` (``grid_comparisons_trained.csv``, whose 3 or 5 sets now carry no interval, so no cell
passes), each row's mean and set count checked against the committed ones; only ``predicts_unadjusted`` changes.
Then ``table.md``, ``table.csv`` and ``record.json`` are written from the CSVs
(:func:`~ipa_probe.experiments.attribution.retable`) and the folder's section of ``summary.md`` from ``table.md``.
"""

from pathlib import Path

import numpy as np
import pandas as pd
from issue52_bootstrap_t import FOLDERS, fresh_comparisons, summary_section

from ipa_probe._io import write_table
from ipa_probe.attribution import ALPHA
from ipa_probe.experiments.attribution import retable
from ipa_probe.experiments.attribution_grid import compare_grid
from ipa_probe.experiments.attribution_setup import STEP_PREDICTORS

REVISION = (
    "issue #52: predicts_unadjusted (p < 0.05 and the interval above 0, before Holm) decided again with the "
    "bootstrap-t interval of the per-set Spearman recomputed from the committed effects, aggregates and grid "
    "(none under 8 sets: no grid cell passes) instead of BCa (docs/results/issue52_unadjusted.py)"
)


def redecide(path: Path, fresh: pd.DataFrame, keys: list[str]) -> int:
    """Set ``predicts_unadjusted`` of the tested rows of the CSV at ``path`` from its committed ``p`` and the fresh
    interval (rows matched on ``keys``, their mean and set count checked). Returns how many rows changed."""
    table = pd.read_csv(path, dtype={"timestep": str} if "timestep" in keys else None)
    fresh = fresh.set_index(keys)
    tested = table["p"].notna()
    changed = 0
    for i in table.index[tested]:
        new = fresh.loc[tuple(table.loc[i, keys])]
        assert np.isclose(new["spearman"], table.at[i, "spearman"], rtol=0, atol=1e-12), (path, i)
        assert new["sets"] == table.at[i, "sets"], (path, i)
        decided = bool(table.at[i, "p"] < ALPHA and new["low"] > 0)
        changed += decided != bool(table.at[i, "predicts_unadjusted"])
        table.at[i, "predicts_unadjusted"] = decided
    write_table(table, path)
    return changed


def unadjusted(folder: Path) -> dict[str, int]:
    """Re-decide every comparisons and grid CSV of one attribution folder; ``{file: rows changed}``."""
    changed = {}
    for label in ("trained", "untrained"):
        path = folder / f"comparisons_{label}.csv"
        if not path.exists():
            continue
        changed[path.name] = redecide(path, fresh_comparisons(folder, label), ["timestep", "predictor", "effect"])
    path = folder / "grid_comparisons_trained.csv"
    if path.exists():
        grid = pd.read_csv(folder / "grid_trained.csv")
        cell = ["set", "reference", "group", "steps"]
        table = grid[[*cell, *STEP_PREDICTORS]].drop_duplicates(cell)
        fresh = compare_grid(grid.drop(columns=list(STEP_PREDICTORS)), table, permutations=1)
        changed[path.name] = redecide(path, fresh, ["group", "steps", "mode", "factor", "effect", "predictor"])
    return changed


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or FOLDERS:
        folder = Path(__file__).parent / name / "attribution"
        before = (folder / "table.md").read_text()
        changed = unadjusted(folder)
        retable(folder, revision=REVISION)
        if (folder / "table.md").read_text() != before:
            summary_section(folder, before)
        print(name, changed)
