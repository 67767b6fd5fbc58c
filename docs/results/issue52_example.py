"""Issue #52: the 2 + 2 example generated again with the medians and order-statistic intervals of its RMS changes.

The committed ``example_3s_5s_trained.csv`` held means with Student's t intervals over 8 seeds, which undercover a
skewed positive change, and no per-seed values to derive others from; the example depends only on the organism (the
smoke and full tiers' folders of one recipe hold the same file). Run from the repository root::

    PYTHONPATH=$PWD python docs/results/issue52_example.py

Per recipe the trained organism's example (:func:`~ipa_probe.experiments.attribution_grid.two_plus_two_example`,
8 seeds, then :func:`~ipa_probe.experiments.attribution_tests.example_intervals`) is written to each folder of that
recipe, after checking that its rates and counts (every seed's flip and label) equal the committed ones.
"""

from pathlib import Path

import pandas as pd

from ipa_probe._io import write_table
from ipa_probe.experiments.attribution_grid import two_plus_two_example
from ipa_probe.experiments.attribution_tests import example_intervals
from ipa_probe.tiny.digits import digits_pipeline

FOLDERS = {
    "support": ("full", "smoke"),
    "ip-adapter": ("full_recipe_ip_adapter", "smoke_recipe_ip_adapter"),
    "mixed": ("full_recipe_mixed",),
}
SAME = ["reference", "group", "steps", "mode", "factor", "seeds"]
SAME += [
    f"{rate}{end}" for rate in ("flipped", "baseline_reads_5", "reads_5") for end in ("", "_low", "_high", "_count")
]

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    for recipe, folders in FOLDERS.items():
        pipe = digits_pipeline(recipe=recipe)
        pipe.set_progress_bar_config(disable=True)
        example = example_intervals(two_plus_two_example(pipe, 8))
        for name in folders:
            path = Path(__file__).parent / name / "attribution" / "example_3s_5s_trained.csv"
            committed = pd.read_csv(path)
            pd.testing.assert_frame_equal(example[SAME].reset_index(drop=True), committed[SAME], check_dtype=False)
            write_table(example[committed.columns], path)
            print(recipe, name, "written", flush=True)
