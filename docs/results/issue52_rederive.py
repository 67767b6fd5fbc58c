"""Issue #52: every attribution folder's tests re-derived from its committed records, without generating anything.

Run from the repository root (about 20 min on one core)::

    PYTHONPATH=$PWD python docs/results/issue52_rederive.py

Per folder: ``comparisons_<label>.csv`` from ``effects_<label>.csv`` and ``aggregates_<label>.csv``, and
``grid_comparisons_trained.csv`` from ``grid_trained.csv``, with 49,999 permutations (Holm's floor over a 52-test table
falls from 0.0104 to 0.00104) and each tested row's interval the one its decision uses, ``[low, 1]`` with ``low`` the
family's Holm-compatible one-sided bound; ``held_out_<label>.csv`` the same way; the 2 + 2 example's RMS intervals cut
at 0 (:func:`rewrite` below). ``verdicts_<label>.csv`` loses its percentile
intervals: the simultaneous bounds that replace them need the per-cell shares of every set, which no record holds, so
these records carry none. ``table.md``, ``table.csv`` and ``record.json`` are then written from the CSVs.
"""

from pathlib import Path

import numpy as np
import pandas as pd

from ipa_probe._io import write_table
from ipa_probe.experiments.attribution import compare, retable
from ipa_probe.experiments.attribution_aggregate import held_out_aggregations
from ipa_probe.experiments.attribution_grid import compare_grid
from ipa_probe.experiments.attribution_setup import STEP_PREDICTORS
from ipa_probe.experiments.attribution_tests import adjust_comparisons, adjust_grid, example_intervals


def rewrite(folder: str | Path, permutations: int = 49999) -> list[Path]:
    """Re-derive one attribution folder's tests in place from its committed records (no generation): comparisons
    from ``effects_<label>.csv`` and ``aggregates_<label>.csv`` (all layers per recorded timestep; without them the
    committed table is only adjusted), the grid's from ``grid_trained.csv``, each with ``permutations`` permutations
    and the decision's interval; the held-out choice (``held_out_aggregations``); the example's intervals
    (``example_intervals``). Returns the files written."""
    folder = Path(folder)
    written = []
    for label in ("trained", "untrained"):
        path, effects_path = folder / f"comparisons_{label}.csv", folder / f"effects_{label}.csv"
        aggregates = folder / f"aggregates_{label}.csv"
        aggregates = pd.read_csv(aggregates) if aggregates.exists() else None
        effects = pd.read_csv(effects_path) if effects_path.exists() else None
        if path.exists() and effects is not None and aggregates is not None:
            keys = ["set", "reference", *STEP_PREDICTORS]
            steps = aggregates[(aggregates["group"] == "all") & aggregates["steps"].str.startswith("t=")]
            per_step = steps.assign(timestep=steps["steps"].str[2:].astype(float))[[*keys, "timestep"]]
            table = compare(effects.drop(columns=list(STEP_PREDICTORS)), effects[keys], per_step, permutations)
            write_table(adjust_comparisons(table), path)
            written.append(path)
        elif path.exists():
            write_table(adjust_comparisons(pd.read_csv(path, dtype={"timestep": str})), path)
            written.append(path)
        if effects is not None:
            held, scores = held_out_aggregations(effects, aggregates)
            for name, frame in (("held_out", held), ("held_out_scores", scores)):
                write_table(frame, folder / f"{name}_{label}.csv")
                written.append(folder / f"{name}_{label}.csv")
    grid = folder / "grid_trained.csv"
    if grid.exists():
        grid = pd.read_csv(grid)
        keys = ["set", "reference", "group", "steps"]
        table = grid[[*keys, *STEP_PREDICTORS]].drop_duplicates(keys)
        comparison = compare_grid(grid.drop(columns=list(STEP_PREDICTORS)), table, permutations=permutations)
        write_table(adjust_grid(comparison), folder / "grid_comparisons_trained.csv")
        written.append(folder / "grid_comparisons_trained.csv")
    path = folder / "example_3s_5s_trained.csv"
    if path.exists():
        write_table(example_intervals(pd.read_csv(path)), path)
        written.append(path)
    return written


FOLDERS = ("full", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke", "smoke_recipe_ip_adapter")
REVISION = (
    "issue #52: comparisons, grid and held-out tests re-derived from the committed effects, aggregates and grid "
    "with 49,999 permutations and Holm-compatible one-sided bounds; the example's RMS intervals cut at 0; the "
    "verdict shares' percentile intervals removed (docs/results/issue52_rederive.py)"
)

if __name__ == "__main__":
    for name in FOLDERS:
        folder = Path(__file__).parent / name / "attribution"
        rewrite(folder, permutations=49999)
        for path in sorted(folder.glob("verdicts_*.csv")):
            table = pd.read_csv(path)
            table[[c for c in table.columns if c.endswith(("_low", "_high"))]] = np.nan
            write_table(table, path)
        print(name, [p.name for p in retable(folder, revision=REVISION)])
