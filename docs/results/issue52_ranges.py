"""Issue #52: every committed interval of a bounded statistic cut to the statistic's range, and the verdict per cell
decided by its one test, from the committed records (no generation but the verdicts observed again).

Run from the repository root (seconds; the figures are redrawn after it, see docs/results/README.md)::

    PYTHONPATH=$PWD python docs/results/issue52_ranges.py [--verdicts DIR] [FOLDER ...]

A bootstrap-t interval of a mean of a few skewed values can reach far outside the values the mean can take (the
posterior's n_eff over 4 references up to 66.6, a TV down to -16.8, a difference of two n_eff up to 1,324). The code
now cuts every such interval to the statistic's range (:func:`ipa_probe.attribution.value_range`; a difference to
``±(high - low)``), which loses no coverage: the true value lies inside. The cut is the same operation on the
committed ends, so it is applied to them here:

- ``ip-adapter/attribution_<label>_<population>.csv`` and the same tables in ``record.json``'s measurements: the
  ``_low`` / ``_high`` of each statistic :func:`~ipa_probe.attribution.summarize_attribution` reports with an
  interval; the record's ``verdict_rule`` set to the code's. Every committed verdict is checked to be the new rule's
  (:func:`~ipa_probe.attribution.verdict` of the committed TV bound and p): the rule dropped its second test, the
  Spearman's two-sided interval above 0, and every committed row is ``pooling``, decided before it.
- ``attribution/controls_<label>.csv``: each difference's ``low`` / ``high`` cut to ``±(high - low)`` of its
  statistic's range over 4 references (no ``counts`` moves: every range holds 0); the ``posterior - attention`` rows
  of ``comparisons_<label>.csv`` (a difference of two Spearman) to ``[-2, 2]``.
- With ``--verdicts DIR``: ``attribution/verdicts_<label>.csv`` copied from ``DIR/<folder>/``, a copy of the folder
  observed again by the code (``python -m ipa_probe.experiments.attribution_aggregate DIR/<folder> RECIPE``), whose
  per-cell verdicts are the one-test rule's; its ``cells`` and bounds are checked equal to the committed ones.

Every other column's text is checked unchanged. Then per attribution folder the record's ``control_rule`` is set to
the code's, ``table.md``, ``table.csv`` and ``record.json`` are written from the CSVs
(:func:`~ipa_probe.experiments.attribution.retable`) and the folder's section of ``summary.md`` from ``table.md``.
Prints per file the ends cut and the verdict shares that moved.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
from issue52_bootstrap_t import FOLDERS, summary_section

from ipa_probe._io import write_json, write_table
from ipa_probe.attribution import value_range, verdict
from ipa_probe.experiments.attribution import CONTROL_RULE, retable
from ipa_probe.experiments.ip_adapter import verdict_rule

STATISTICS = (
    "share_spearman",
    "layer_agreement",
    "tv_attention_posterior",
    "attention_tv",
    "attention_neff",
    "posterior_neff",
)
REFERENCES = 4  # every attribution folder's sets, controls included
GAP = "posterior - attention"
REVISION = (
    "issue #52: every interval cut to its statistic's range (ipa_probe.attribution.value_range; a difference to "
    "+-(high - low)), from the committed ends; the verdict per cell decided by its one test, the one-sided "
    "permutation p (verdicts observed again by attribution_aggregate); control_rule restated "
    "(docs/results/issue52_ranges.py)"
)


def _cut(values: pd.Series, low, high) -> tuple[pd.Series, int]:
    """``values`` cut to ``[low, high]`` (numbers, or one per value; NaN kept), and how many moved."""
    cut = values.clip(low, high)
    return cut, int(((cut != values) & values.notna()).sum())


def _rewrite(path: Path, change) -> int:
    """Apply ``change(table) -> (table, ends cut, columns it may touch)`` to the CSV at ``path``; check every other
    column's text is unchanged. Returns the ends cut."""
    before = pd.read_csv(path, dtype=str, keep_default_na=False)
    table, moved, touched = change(pd.read_csv(path, dtype={"timestep": str} if "timestep" in before else None))
    write_table(table, path)
    after = pd.read_csv(path, dtype=str, keep_default_na=False)
    others = [c for c in before.columns if c not in touched]
    assert list(after.columns) == list(before.columns) and after[others].equals(before[others]), path
    return moved


def _summary_ends(rows: pd.DataFrame) -> tuple[pd.DataFrame, int, list[str]]:
    """One :func:`summarize_attribution` table's ends cut; its verdicts checked against the one-test rule."""
    moved, touched = 0, []
    for name in STATISTICS:
        for end in ("low", "high"):
            column = f"{name}_{end}"
            low, high = np.array([value_range(name, int(r)) for r in rows["references"]]).T
            rows[column], cut = _cut(rows[column], low, high)
            moved, touched = moved + cut, [*touched, column]
    rule = [verdict(h, p) for h, p in zip(rows["attention_tv_high"], rows["share_spearman_p"], strict=True)]
    assert rule == rows["verdict"].tolist(), "a committed verdict is not the one-test rule's"
    return rows, moved, touched


def ip_adapter(folder: Path) -> dict[str, int]:
    """Cut the ``ip-adapter`` folder's per-timestep intervals, in its CSVs and its record; ``{file: ends cut}``."""
    moved = {}
    for path in sorted(folder.glob("attribution_*.csv")):
        moved[path.name] = _rewrite(path, _summary_ends)
    record_path = folder / "record.json"
    record = json.loads(record_path.read_text())
    for key, rows in record["measurements"]["attribution"].items():
        frame = pd.DataFrame(rows).astype({f"{s}_{e}": float for s in STATISTICS for e in ("low", "high")})
        frame, cut, _ = _summary_ends(frame)
        for row, new in zip(rows, frame.to_dict(orient="records"), strict=True):
            row.update({c: (None if np.isnan(new[c]) else new[c]) for c in new if c.endswith(("_low", "_high"))
                        and c.rsplit("_", 1)[0] in STATISTICS})  # fmt: skip
        moved[f"record.json: {key}"] = cut
    record["verdict_rule"] = verdict_rule()
    write_json(record_path, record)
    return moved


def _controls(table: pd.DataFrame) -> tuple[pd.DataFrame, int, list[str]]:
    width = np.array([np.subtract(*value_range(s, REFERENCES)[::-1]) for s in table["statistic"]])
    (table["low"], low), (table["high"], high) = _cut(table["low"], -width, width), _cut(table["high"], -width, width)
    assert (((table["low"] > 0) | (table["high"] < 0)) == table["counts"]).all(), "a count moved"
    return table, low + high, ["low", "high"]


def _gap(table: pd.DataFrame) -> tuple[pd.DataFrame, int, list[str]]:
    rows = table["predictor"] == GAP
    moved = 0
    for end in ("low", "high"):
        table.loc[rows, end], cut = _cut(table.loc[rows, end], -2.0, 2.0)
        moved += cut
    return table, moved, ["low", "high"]


def attribution(folder: Path, verdicts: Path | None) -> dict[str, object]:
    """Cut the attribution folder's control and gap intervals; copy the verdicts observed again; ``{file: change}``."""
    changes: dict[str, object] = {}
    for label in ("trained", "untrained"):
        changes[f"controls_{label}.csv"] = _rewrite(folder / f"controls_{label}.csv", _controls)
        changes[f"comparisons_{label}.csv"] = _rewrite(folder / f"comparisons_{label}.csv", _gap)
        if verdicts is not None:
            name = f"verdicts_{label}.csv"
            old, new = pd.read_csv(folder / name), pd.read_csv(verdicts / name)
            keys = ["timestep", "resolution", "population", "cells"]
            bounds = [c for c in old.columns if c.endswith(("_low", "_high"))]
            assert old[keys].equals(new[keys]), name
            pd.testing.assert_frame_equal(old[bounds], new[bounds], check_exact=False, atol=1e-12)
            shares = ["pooling", "tracks_posterior", "undecided"]
            delta = (new[shares] - old[shares]).abs().max(axis=1)
            changes[name] = [
                f"{r.population}, {r.resolution}, t={r.timestep:g}: tracks {o:.3f} -> {n:.3f}"
                for r, o, n in zip(new[delta > 0].itertuples(), old.loc[delta > 0, "tracks_posterior"],
                                   new.loc[delta > 0, "tracks_posterior"], strict=True)
            ]  # fmt: skip
            shutil.copyfile(verdicts / name, folder / name)
    record_path = folder / "record.json"
    record = json.loads(record_path.read_text())
    record["control_rule"] = CONTROL_RULE
    write_json(record_path, record)
    return changes


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    observed = None
    if "--verdicts" in args:
        at = args.index("--verdicts")
        observed, args = Path(args[at + 1]), args[:at] + args[at + 2 :]
    for name in args or FOLDERS:
        root = Path(__file__).parent / name
        print(name, "ip-adapter", ip_adapter(root / "ip-adapter"))
        folder = root / "attribution"
        before = (folder / "table.md").read_text()
        print(name, "attribution", attribution(folder, None if observed is None else observed / name))
        retable(folder, REVISION)
        summary_section(folder, before)
