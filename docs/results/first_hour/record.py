"""The README's first-hour blocks run as written, and what they print kept as a record (issue #52 point 4).

README.md's first three ```python blocks (probe, table, maps) run in order in one namespace, in a temporary folder,
on one torch thread; ``record.json`` keeps the cond branch's image means per timestep (``run.summary``) and the map
table's means that the README's comments and findings.md quote. Run from the repository root::

    PYTHONPATH=$PWD python docs/results/first_hour/record.py
"""

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def main() -> None:
    torch.set_num_threads(1)
    blocks = BLOCK.findall((ROOT / "README.md").read_text())[:3]  # 1. Probe, 2. Table, 3. Maps
    namespace = {"__name__": "__main__"}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            for code in blocks:
                exec(compile(code, "README.md", "exec"), namespace)
        finally:
            os.chdir(here)
    summary = namespace["run"].summary(branch="cond")
    summary = summary[summary["kind"] == "image"]
    columns = ["qf_spearman", "qf_gauss_spearman", "spearman"]
    maps = namespace["table"][["dominant_agree", "tv"]].mean()
    record = {
        "blocks": blocks,
        "summary": {
            f"{t:g}": {c: float(row[c]) for c in columns} for t, row in summary.set_index("timestep").iterrows()
        },
        "maps": {c: float(maps[c]) for c in maps.index},
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    (Path(__file__).parent / "record.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
