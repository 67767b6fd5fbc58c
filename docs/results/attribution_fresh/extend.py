"""Issue #52: more fresh sets for one organism, appended to the records as sets 16-31 were.

Computes :func:`ipa_probe.experiments.attribution_fresh.fresh_set` on sets ``FIRST`` to ``LAST`` (inclusive) of
``fresh_sets`` (set ``i``'s digits, draws and seed depend on ``i`` alone) with the experiment's defaults (2 midpoint
points, 20 steps) and inserts their rows after the organism's last rows of ``OUT``'s ``records.csv`` and
``aggregates.csv`` (every other line of both files kept as it was; files that do not exist yet are written). Run from
the repository root, one torch thread, then ``--resummarize`` for ``summary.csv`` and ``held_out.csv``::

    PYTHONPATH=$PWD python docs/results/attribution_fresh/extend.py support 16 31 docs/results/attribution_fresh
    python -m ipa_probe.experiments.attribution_fresh --resummarize --out docs/results/attribution_fresh
"""

import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from ipa_probe.experiments.attribution_fresh import fresh_set, fresh_sets
from ipa_probe.tiny.digits import digits_pipeline


def splice(path: Path, rows: pd.DataFrame, organism: str) -> None:
    """Insert ``rows`` (with the file's columns) after ``organism``'s last line of the CSV ``path``."""
    text = rows.to_csv(index=False, lineterminator="\n")
    if not path.exists():
        path.write_text(text)
        return
    lines = path.read_text().splitlines(keepends=True)
    header, new = text.splitlines(keepends=True)[0], text.splitlines(keepends=True)[1:]
    if lines[0] != header:
        raise ValueError(f"{path} has columns {lines[0].strip()!r}, the new rows {header.strip()!r}: a different run")
    old = pd.read_csv(path)
    if ((old["organism"] == organism) & old["set"].isin(rows["set"])).any():
        raise ValueError(f"{path} already holds some of sets {sorted(set(rows['set']))} of {organism}: remove them")
    mine = (old["organism"] == organism).to_numpy().nonzero()[0]
    at = 1 + (int(mine[-1]) + 1 if len(mine) else len(old))  # after the header and the organism's last row
    path.write_text("".join(lines[:at] + new + lines[at:]))


def extend(organism: str, first: int, last: int, out: Path) -> float:
    """Sets ``first``..``last`` of ``organism`` spliced into ``out``; returns the process CPU seconds (no loading)."""
    if not 0 <= first <= last:
        raise ValueError(f"want 0 <= FIRST <= LAST, got {first} and {last}")
    pipe = digits_pipeline(recipe=organism)
    pipe.set_progress_bar_config(disable=True)
    start = time.process_time()
    frames, pairs = zip(*(fresh_set(pipe, spec) for spec in fresh_sets(last + 1)[first:]), strict=True)
    cpu = round(time.process_time() - start, 1)
    out.mkdir(parents=True, exist_ok=True)
    for name, parts in (("records.csv", frames), ("aggregates.csv", pairs)):
        splice(out / name, pd.concat(parts, ignore_index=True).assign(organism=organism), organism)
    return cpu


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: extend.py ORGANISM FIRST LAST OUT (e.g. support 16 31 docs/results/attribution_fresh)")
    torch.set_num_threads(1)
    organism, first, last, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    print(json.dumps({organism: extend(organism, first, last, out)}))
