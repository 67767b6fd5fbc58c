"""Issue #52: every attribution folder's tests re-derived from its committed records, without generating anything.

Run from the repository root (about 20 min on one core)::

    PYTHONPATH=$PWD python docs/results/issue52_rederive.py

Per folder: ``comparisons_<label>.csv`` from ``effects_<label>.csv`` and ``aggregates_<label>.csv``, and
``grid_comparisons_trained.csv`` from ``grid_trained.csv``, with 49,999 permutations (Holm's floor over a 52-test table
falls from 0.0104 to 0.00104) and each tested row's interval the one its decision uses, ``[low, 1]`` with ``low`` the
family's Holm-compatible one-sided bound; ``held_out_<label>.csv`` the same way; the 2 + 2 example's RMS intervals cut
at 0 (:func:`ipa_probe.experiments.attribution_tests.rewrite`). ``verdicts_<label>.csv`` loses its percentile
intervals: the simultaneous bounds that replace them need the per-cell shares of every set, which no record holds, so
these records carry none. ``table.md``, ``table.csv`` and ``record.json`` are then written from the CSVs.
"""

from pathlib import Path

import numpy as np
import pandas as pd

from ipa_probe._io import write_table
from ipa_probe.experiments.attribution import retable
from ipa_probe.experiments.attribution_tests import rewrite

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
