"""docs/layout.md is held to the tree: every module of the package is named there, and every module it names exists.

The page's block gives each top-level module an entry of its own (``kernels.py ...``) and each folder one entry
(``capture/ ...``) whose text names its modules by their path inside the folder (``run.py``, ``taps/unet.py``), so
``capture/config.py`` and ``intervention/config.py`` are told apart by the entry they are named in."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = {"__init__.py", "__main__.py"}


def named_modules() -> set[str]:
    """The ``.py`` paths the layout block names, relative to ``ipa_probe/`` (a folder entry's modules under it)."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text.split("```", 2)[1]
    named, folder = set(), ""
    for line in block.splitlines()[2:]:  # after "ipa_probe/"
        entry = re.match(r"^  (\S+)", line)
        if entry:
            first = entry.group(1)
            folder = first if first.endswith("/") else ""
            if first.endswith(".py"):
                named.add(first)
        if re.match(r"^\S", line):  # hooks/, notebooks/ ...: outside the package
            break
        for path in re.findall(r"(?<![\w/.])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", line):
            if path == (entry.group(1) if entry else None):
                continue
            named.add(path if folder == "" or path.startswith(folder) else folder + path)
    return named


def package_modules() -> set[str]:
    package = ROOT / "ipa_probe"
    return {path.relative_to(package).as_posix() for path in package.rglob("*.py") if path.name not in EXEMPT}


def test_layout_names_every_module():
    missing = sorted(package_modules() - named_modules())
    assert not missing, f"docs/layout.md does not name: {missing}"


def test_layout_names_no_module_that_is_gone():
    gone = sorted(named_modules() - package_modules())
    assert not gone, f"docs/layout.md names modules that do not exist: {gone}"
