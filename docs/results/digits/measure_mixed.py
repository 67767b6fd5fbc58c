"""The script that made the ``mixed`` column of mixed_references.json and every column of mixed_counts.json.

``PYTHONPATH=$PWD python docs/results/digits/measure_mixed.py RECIPE following|counts OUT.json`` (one thread):
``following`` runs ``mixed_following`` with the settings of mixed_references.json's other columns and adds the
paired one-digit minus mixed difference; ``counts`` generates from sets of two images of d and one of d + 5.
"""

import json
import os
import sys
import time

import numpy as np
import torch

from ipa_probe.experiments.attribution import mixed_following
from ipa_probe.experiments.attribution_setup import _call
from ipa_probe.tiny.digits import classify_digit_images, digits_pipeline, digits_reference_images
from ipa_probe.tiny.digits.following import interval

recipe, what, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
pipe = digits_pipeline(recipe=recipe)
pipe.set_progress_bar_config(disable=True)
load = [os.getloadavg()[0]]
start = time.perf_counter()
if what == "following":
    r = mixed_following(pipe)
    same, any_ = r["same"]["rate"]["values"], r["mixed"]["any"]["values"]
    r["same_minus_any"] = interval([a - b for a, b in zip(same, any_, strict=True)])
else:  # two images of d and one of e = d + 5 (mod 10); the lone image first for odd d, last for even d
    per = {"two": [], "one": [], "neither": []}
    labels_out = []
    for seed in range(5):
        hits = {"two": [], "one": [], "neither": []}
        for d in range(10):
            e = (d + 5) % 10
            pair = digits_reference_images(d, 2, seed=700 + seed)
            lone = digits_reference_images(e, 1, seed=800 + seed)[0]
            refs = [lone, *pair] if d % 2 else [*pair, lone]
            images = pipe(
                **{**_call(refs), "num_images_per_prompt": 2},
                generator=torch.Generator().manual_seed(seed * 1000 + d),
                output_type="np",
            ).images
            labels, _ = classify_digit_images(images)
            labels_out.append({"seed": seed, "digit": d, "lone": e, "labels": labels.tolist()})
            hits["two"] += (labels == d).tolist()
            hits["one"] += (labels == e).tolist()
            hits["neither"] += (~np.isin(labels, [d, e])).tolist()
        for k in per:
            per[k].append(float(np.mean(hits[k])))
    r = {k: interval(v, bounds=(0.0, 1.0)) for k, v in per.items()}
    share = [t / (t + o) if t + o else float("nan") for t, o in zip(per["two"], per["one"], strict=True)]
    r["two_share_of_followed"] = interval(share, bounds=(0.0, 1.0))
    r["labels"] = labels_out
    r["settings"] = {
        "seeds": list(range(5)),
        "samples": 2,
        "n_refs": 3,
        "num_inference_steps": 20,
        "guidance_scale": 3.0,
        "sets": "2 x digits_reference_images(d, 2, seed=700 + s) + "
        "digits_reference_images((d + 5) % 10, 1, seed=800 + s); lone image first for odd d",
    }
r["recipe"] = recipe
r["wall_time_s"] = time.perf_counter() - start
r["load_average_start_end"] = [load[0], os.getloadavg()[0]]
r["threads"] = 1
with open(out, "w") as f:
    json.dump(r, f, indent=1)
print(recipe, what, {k: (v["mean"], v["low"], v["high"]) for k, v in r.items() if isinstance(v, dict) and "mean" in v})
for k in ("same", "mixed"):
    if k in r:
        print(k, {kk: round(vv["mean"], 3) for kk, vv in r[k].items()})
