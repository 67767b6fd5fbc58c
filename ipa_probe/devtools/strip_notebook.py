"""Strip outputs and execution counts from notebooks in place.

Usage: ``python -m ipa_probe.devtools.strip_notebook NB...``.
"""

from __future__ import annotations

import sys

import nbformat


def strip(path: str) -> bool:
    """Remove outputs from ``path``; returns whether the file changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.get("outputs") or cell.get("execution_count") is not None:
            changed = True
        cell["outputs"] = []
        cell["execution_count"] = None
    if changed:
        nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        strip(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
