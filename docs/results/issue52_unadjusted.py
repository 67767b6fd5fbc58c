"""Issue #52: the attribution folders' uncorrected rule (``predicts_unadjusted``) made the same one-sided test as
``predicts``, only without Holm, from the committed records (no generation).

Run from the repository root (seconds)::

    PYTHONPATH=$PWD python docs/results/issue52_unadjusted.py [FOLDER ...]

The rule is the one :func:`ipa_probe.experiments.attribution_tests.adjust_comparisons` and ``adjust_grid`` now apply:
``predicts_unadjusted`` = the committed one-sided permutation ``p`` below ``ALPHA`` (no interval; ``predicts`` =
``p_holm`` below ``ALPHA``, so ``predicts`` implies it). It replaces "``p`` below ``ALPHA`` and a two-sided
bootstrap-t interval of the per-set Spearman above 0", an interval no CSV holds (the tested rows' ``low`` / ``high``
are the Holm-compatible one-sided bound). Every ``comparisons_<label>.csv`` and ``grid_comparisons_trained.csv`` is
rewritten with only that column changed (every other column's text checked unchanged); ``record.json``'s ``rule`` is
set to the code's (:data:`~ipa_probe.experiments.attribution.RULE`); then ``table.md``, ``table.csv`` and
``record.json`` are written from the CSVs (:func:`~ipa_probe.experiments.attribution.retable`) and the folder's
section of ``summary.md`` from ``table.md`` where it moved. Prints per folder the rows changed per file.
"""

import json
from pathlib import Path

import pandas as pd
from issue52_bootstrap_t import FOLDERS, summary_section

from ipa_probe._io import write_json, write_table
from ipa_probe.attribution import ALPHA
from ipa_probe.experiments.attribution import RULE, retable

REVISION = (
    "issue #52: predicts_unadjusted is the same one-sided permutation test as predicts without Holm (p < 0.05, no "
    "interval), no longer p < 0.05 and a two-sided bootstrap-t interval above 0 that no CSV holds; re-decided from "
    "the committed p, every other column unchanged (docs/results/issue52_unadjusted.py)"
)


def redecide(path: Path) -> int:
    """Set ``predicts_unadjusted`` of the CSV at ``path`` to ``p < ALPHA``, checking that every other column's text
    is unchanged. Returns how many rows changed."""
    before = pd.read_csv(path, dtype=str, keep_default_na=False)
    table = pd.read_csv(path, dtype={"timestep": str} if "timestep" in before.columns else None)
    decided = (table["p"] < ALPHA).to_numpy()
    changed = int((decided != table["predicts_unadjusted"].astype(bool).to_numpy()).sum())
    table["predicts_unadjusted"] = decided
    write_table(table, path)
    after = pd.read_csv(path, dtype=str, keep_default_na=False)
    others = [c for c in before.columns if c != "predicts_unadjusted"]
    assert list(after.columns) == list(before.columns) and after[others].equals(before[others]), path
    return changed


def unadjusted(folder: Path) -> dict[str, int]:
    """Re-decide every comparisons and grid CSV of one attribution folder; ``{file: rows changed}``."""
    names = ["comparisons_trained.csv", "comparisons_untrained.csv", "grid_comparisons_trained.csv"]
    return {name: redecide(folder / name) for name in names if (folder / name).exists()}


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or FOLDERS:
        folder = Path(__file__).parent / name / "attribution"
        before = (folder / "table.md").read_text()
        changed = unadjusted(folder)
        record = json.loads((folder / "record.json").read_text())
        write_json(folder / "record.json", {**record, "rule": RULE})
        retable(folder, revision=REVISION)
        if (folder / "table.md").read_text() != before:
            summary_section(folder, before)
        print(name, changed)
