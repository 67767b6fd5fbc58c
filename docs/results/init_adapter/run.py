"""The control that isolates training (issue #52 point 2; docs/findings.md, section 2), on the three organisms.

Each organism against itself with the adapter at its starting weights, compared at equal logit ratio
(``ipa_probe.experiments.matched_control.init_adapter_control``); writes ``<recipe>_tests.csv``,
``<recipe>_per_set.csv``, ``<recipe>_means.csv`` and ``record.json`` beside this script (or into ``--out``):

    PYTHONPATH=. python docs/results/init_adapter/run.py --sets 20
"""

import argparse
import os
import subprocess
import time
from pathlib import Path

import torch

from ipa_probe._io import write_json, write_table
from ipa_probe.experiments.matched_control import DIRECTIONS, init_adapter_control

parser = argparse.ArgumentParser()
parser.add_argument("--sets", type=int, default=20)
parser.add_argument("--out", type=Path, default=Path(__file__).parent)
parser.add_argument("--recipes", nargs="+", default=["support", "ip-adapter", "mixed"])
args = parser.parse_args()
torch.set_num_threads(1)
args.out.mkdir(parents=True, exist_ok=True)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
record = {"sets": args.sets, "directions": list(DIRECTIONS), "git_commit": commit, "threads": 1, "organisms": {}}
for recipe in args.recipes:
    start, load = time.perf_counter(), os.getloadavg()
    result = init_adapter_control(recipe, sets=args.sets)
    for name, frame in result.items():
        write_table(frame, args.out / f"{recipe}_{name}.csv")
    record["organisms"][recipe] = {
        "tests": result["tests"].to_dict(orient="records"),
        "wall_s": time.perf_counter() - start,
        "load_average_at_start": list(load),
    }
    print(recipe, f"{time.perf_counter() - start:.0f} s", flush=True)
write_json(args.out / "record.json", record)
