"""Issue #52: the attribution folders' BCa intervals replaced by bootstrap-t ones, from the committed records.

Run from the repository root (a minute on one core); with ``--controls`` after copying back ``verdicts_<label>.csv``
and ``controls_<label>.csv`` from the folders observed again (docs/results/README.md), only the tables and record::

    PYTHONPATH=$PWD python docs/results/issue52_bootstrap_t.py [--controls] [FOLDER ...]

Per folder and organism: the ``posterior - attention`` rows of ``comparisons_<label>.csv`` get the bootstrap-t interval
(:func:`ipa_probe.sweep.aggregation.bootstrap_ci`) of the per-set Spearman differences, which are recomputed from
``effects_<label>.csv`` and ``aggregates_<label>.csv`` and must equal the committed mean; no other value of the file
changes. Then ``table.md``, ``table.csv`` and ``record.json`` are written from the CSVs
(:func:`~ipa_probe.experiments.attribution.retable`: the one-reference ablation's interval over sets is computed
there) and the folder's section of ``summary.md`` from ``table.md``.
"""

from pathlib import Path

import numpy as np
import pandas as pd

from ipa_probe._io import write_table
from ipa_probe.experiments.attribution import compare, retable
from ipa_probe.experiments.attribution_setup import STEP_PREDICTORS

GAP = "posterior - attention"
FOLDERS = ("full", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke", "smoke_recipe_ip_adapter")
REVISION = (
    "issue #52: BCa intervals (20 sets and fewer undercover) replaced by bootstrap-t ones, none below 8 sets: the "
    "comparisons' posterior - attention rows and the one-reference ablation re-derived from the committed effects "
    "and aggregates (docs/results/issue52_bootstrap_t.py); the example generated again with medians and "
    "order-statistic intervals (docs/results/issue52_example.py)"
)
#: ``--controls``: after copying back the observed-again verdicts and controls (the smoke folders had both at once).
CONTROLS = (
    "issue #52: verdicts_*.csv and controls_*.csv observed again (paired controls bootstrap-t, unpaired Welch's t, "
    "none below 8 sets a side; per-cell decisions from 8 sets)"
)


def fresh_comparisons(folder: Path, label: str) -> pd.DataFrame:
    """``compare`` of one organism again from the committed effects and aggregates (1 permutation: its p is not
    the record's; the means, set counts and intervals are)."""
    effects, aggregates = (
        pd.read_csv(folder / f"effects_{label}.csv"),
        pd.read_csv(folder / f"aggregates_{label}.csv"),
    )
    keys = ["set", "reference", *STEP_PREDICTORS]
    steps = aggregates[(aggregates["group"] == "all") & aggregates["steps"].str.startswith("t=")]
    per_step = steps.assign(timestep=steps["steps"].str[2:].astype(float))[[*keys, "timestep"]]
    return compare(effects.drop(columns=list(STEP_PREDICTORS)), effects[keys], per_step, permutations=1)


def gap_intervals(folder: Path) -> list[Path]:
    """Rewrite the ``posterior - attention`` rows' ``low`` / ``high`` of each ``comparisons_<label>.csv``."""
    written = []
    for label in ("trained", "untrained"):
        path = folder / f"comparisons_{label}.csv"
        if not path.exists():
            continue
        fresh = fresh_comparisons(folder, label)
        fresh = fresh[fresh["predictor"] == GAP].set_index(["timestep", "effect"])
        table = pd.read_csv(path, dtype={"timestep": str})
        rows = table.index[table["predictor"] == GAP]
        for i in rows:
            new = fresh.loc[(table.at[i, "timestep"], table.at[i, "effect"])]
            assert np.isclose(new["spearman"], table.at[i, "spearman"], rtol=0, atol=1e-12), (path, i)
            assert new["sets"] == table.at[i, "sets"], (path, i)
            table.loc[i, ["low", "high"]] = [new["low"], new["high"]]
        write_table(table, path)
        written.append(path)
    return written


def summary_section(folder: Path, before: str) -> None:
    """Replace ``before`` (the old ``table.md``'s table) in the tier's ``summary.md`` by the new one."""
    summary = folder.parent / "summary.md"
    after = (folder / "table.md").read_text()
    old, new = before.split("\n", 2)[2], after.split("\n", 2)[2]
    text = summary.read_text()
    assert text.count(old) == 1, f"{summary}: the old attribution table is not there exactly once"
    summary.write_text(text.replace(old, new))


if __name__ == "__main__":
    import sys

    controls = "--controls" in sys.argv
    for name in [a for a in sys.argv[1:] if a != "--controls"] or FOLDERS:
        folder = Path(__file__).parent / name / "attribution"
        before = (folder / "table.md").read_text()
        written = retable(folder, revision=CONTROLS) if controls else gap_intervals(folder) + retable(folder, REVISION)
        summary_section(folder, before)
        print(name, [p.name for p in written])
