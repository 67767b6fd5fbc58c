"""Issue #52: the committed fresh sets observed again, for the held-out choice of predictor and aggregation.

``records.csv`` was written before the experiment recorded every aggregation of its step predictors; this script
generates each of its sets once more (no ablation: :func:`ipa_probe.experiments.attribution_fresh.observe`, the
experiment's own first generation of a set), writes ``aggregates.csv`` and then
:func:`~ipa_probe.experiments.attribution_fresh.derive` (``summary.csv``, ``held_out.csv``), which checks the
aggregates against the records' whole-run means. Run from the repository root, one torch thread::

    PYTHONPATH=$PWD python docs/results/attribution_fresh/observe.py docs/results/attribution_fresh
"""

import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from ipa_probe._io import write_table
from ipa_probe.experiments.attribution_fresh import derive, fresh_sets, observe
from ipa_probe.tiny.digits import digits_pipeline


def observations(out: Path) -> dict:
    """Observe every set of ``out``'s ``records.csv`` again, write ``aggregates.csv``, derive; CPU s per organism."""
    records, parts, cpu = pd.read_csv(out / "records.csv"), [], {}
    specs = {s["set"]: s for s in fresh_sets(int(records["set"].max()) + 1)}
    for recipe, frame in records.groupby("organism", sort=False):
        pipe, start = digits_pipeline(recipe=recipe), time.process_time()
        pipe.set_progress_bar_config(disable=True)
        parts += [observe(pipe, specs[i])[2].assign(organism=recipe) for i in sorted(frame["set"].unique())]
        cpu[recipe] = round(time.process_time() - start, 1)
    write_table(pd.concat(parts, ignore_index=True), out / "aggregates.csv")
    derive(out)
    return cpu


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(observations(Path(sys.argv[1]))))
