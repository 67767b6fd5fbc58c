"""Issue #52: every decision of the attribution tables and of the init-adapter control made with the test whose
inversion is its interval, from the committed records (no generation).

Run from the repository root (minutes on one core; the figures are redrawn after it, see docs/results/README.md)::

    PYTHONPATH=$PWD python docs/results/issue52_signflip.py [FOLDER ...]

Before, the comparisons, grid and held-out tables decided by a permutation test of "no association" (each set's
effect ranks permuted within the set) while their interval ``[low, 1]`` was a Holm-compatible bound built from
Student's t: not the same test, so 8 retained rows carried ``[0, 1]`` where the t bound cleared 0. The
init-adapter control decided by scipy's sign-flip test beside the same t bounds. Now each p is the one-sided
sign-flip test of the per-set values (:func:`ipa_probe.attribution.sign_flip_test`: exact under the same null, a
per-set Spearman being symmetric about 0 under no association) and each bound is that test inverted
(:func:`ipa_probe.attribution.holm_lower_bounds`), so a bound is above 0 only where its test rejects.

- ``attribution/``: comparisons, grid and held-out tables re-derived by ``issue52_rederive.rewrite`` (the
  experiment's own functions on its committed effects, aggregates and grid; 49,999 sign patterns for the tables,
  4,999 for the held-out tests, as the experiment draws), the record's ``rule`` set to the code's, ``table.md``,
  ``table.csv`` and ``record.json`` written from the CSVs and the tier's ``summary.md`` section from ``table.md``.
- ``ip-adapter/init_adapter_tests.csv`` (and the record's copy): ``p_above``, ``p_below``, their Holm values,
  ``low``, ``high`` and ``decision`` from :func:`~ipa_probe.experiments.matched_control.paired_tests` of the
  committed ``init_adapter_per_set.csv``; every other column is checked unchanged; each test's cell in the folder's
  ``table.md`` and ``table.csv`` and the tier's ``summary.md`` written again from it (:func:`replace_cells`).

Not here: ``matched_control.csv``, whose per-set differences no record holds (``issue52_matched.py`` generates the
twins again for it). Prints per folder the decisions before and after.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from issue52_bootstrap_t import FOLDERS, summary_section
from issue52_rederive import rewrite

from ipa_probe._io import write_json, write_table
from ipa_probe.experiments.attribution import RULE, retable
from ipa_probe.experiments.matched_control import _decided, paired_tests

REVISION = (
    "issue #52: comparisons, grid and held-out tests decided by the one-sided sign-flip test of the per-set "
    "Spearman, each interval [low, 1] that test inverted (Holm-compatible), from the committed effects, aggregates "
    "and grid (docs/results/issue52_signflip.py)"
)
TESTED = ["p_above", "p_below", "p_holm_above", "p_holm_below", "low", "high", "decision"]
DECIDED = {
    "comparisons_trained.csv": "predicts",
    "comparisons_untrained.csv": "predicts",
    "grid_comparisons_trained.csv": "predicts",
    "held_out_trained.csv": "agrees",
    "held_out_untrained.csv": "agrees",
}


def attribution(folder: Path) -> dict[str, str]:
    """Re-derive one attribution folder's tests; ``{file: decisions before -> after}``."""
    before = {name: pd.read_csv(folder / name)[column] for name, column in DECIDED.items() if (folder / name).exists()}
    table = (folder / "table.md").read_text()
    rewrite(folder, permutations=49999)
    record = json.loads((folder / "record.json").read_text())
    record["rule"] = RULE
    write_json(folder / "record.json", record)
    retable(folder, REVISION)
    summary_section(folder, table)
    after = {name: pd.read_csv(folder / name)[DECIDED[name]] for name in before}
    return {name: f"{int(before[name].sum())} -> {int(after[name].sum())} of {len(after[name])}" for name in before}


def replace_cells(folder: Path, old: pd.DataFrame, new: pd.DataFrame) -> None:
    """Each paired test's cell (``_decided``: decision, bounds, p) of ``old`` replaced by ``new``'s, row for row, in
    the ``ip-adapter`` folder's ``table.md`` and ``table.csv`` and the tier's ``summary.md`` (each old cell found)."""
    for path in (folder / "table.md", folder / "table.csv", folder.parent / "summary.md"):
        text = path.read_text()
        for before, after in zip(old.to_dict(orient="records"), new.to_dict(orient="records"), strict=True):
            cell = _decided(before)
            assert cell in text, (path, cell)
            text = text.replace(cell, _decided(after))
        path.write_text(text)


def init_adapter(folder: Path) -> str:
    """Re-derive ``init_adapter_tests.csv`` and the record's copy; the decisions before and after."""
    path = folder / "init_adapter_tests.csv"
    old = pd.read_csv(path)
    new = paired_tests(pd.read_csv(folder / "init_adapter_per_set.csv")).set_index(["statistic", "timestep"])
    keys = pd.MultiIndex.from_frame(old[["statistic", "timestep"]])
    table = old.copy()
    for column in TESTED:
        table[column] = new.loc[keys, column].to_numpy()
    assert np.allclose(new.loc[keys, "difference"], old["difference"], rtol=1e-12, atol=0), path
    write_table(table, path)
    replace_cells(folder, old, table)
    others = [c for c in old.columns if c not in TESTED]
    assert pd.read_csv(path)[others].equals(old[others]), path
    record = json.loads((folder / "record.json").read_text())
    rows = record["init_adapter"]["tests"]
    assert len(rows) == len(table), folder
    for row, fresh in zip(rows, table.to_dict(orient="records"), strict=True):
        assert (row["statistic"], row["timestep"]) == (fresh["statistic"], fresh["timestep"]), folder
        row.update({c: fresh[c] for c in TESTED})
    write_json(folder / "record.json", record)
    return f"{old['decision'].value_counts().to_dict()} -> {table['decision'].value_counts().to_dict()}"


if __name__ == "__main__":
    for name in sys.argv[1:] or FOLDERS:
        root = Path(__file__).parent / name
        print(name, "attribution", attribution(root / "attribution"), flush=True)
        if (root / "ip-adapter" / "init_adapter_per_set.csv").exists():
            print(name, "init-adapter", init_adapter(root / "ip-adapter"), flush=True)
