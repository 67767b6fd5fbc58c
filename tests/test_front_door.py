"""The front door stays small: the README within 1,500 words, the top level within 25 names a user calls, each of
them documented where a user looks for it (the README, a notebook or a page of docs/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ipa_probe

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_at_most_1500_words():
    words = len((ROOT / "README.md").read_text().split())  # as `wc -w` counts them
    assert words <= 1500, f"README.md has {words} words; move detail to docs/ (the README links each page)"


def test_top_level_names_are_few_and_documented():
    assert len(ipa_probe.__all__) <= 25, ipa_probe.__all__
    exports = [name for name in ipa_probe.__all__ if name != "__version__"]
    assert all(hasattr(ipa_probe, name) for name in ipa_probe._SUBMODULES)  # reachable, though not star-imported
    assert "lazy_attributes" not in dir(ipa_probe)
    text = "".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        text += "".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"])
    undocumented = [name for name in exports if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not undocumented, f"top-level names no page documents: {undocumented}"
