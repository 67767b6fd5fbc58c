"""Every notebook in notebooks/ runs top to bottom on the embedded defaults, writes nothing into the repository, and is
committed without outputs."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: what the tree may gain while a notebook runs: caches, and what the test machinery itself makes
_NOT_OUTPUTS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".ipynb_checkpoints"}


def _tree() -> set[Path]:
    """Every file and folder under the repository root, caches left out."""
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _NOT_OUTPUTS and not d.endswith(".egg-info")]
        found.update(Path(folder, name).relative_to(ROOT) for name in [*dirs, *files])
    return found


def test_every_notebook_is_listed():
    assert [p.name for p in NOTEBOOKS] == [
        "01_probe_quickstart.ipynb",
        "02_swap_nw_head.ipynb",
        "03_nw_identity.ipynb",
        "04_failure_regimes.ipynb",
        "05_digits_organism.ipynb",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_and_writes_nothing_into_the_repository(path, monkeypatch):
    # the kernel imports this checkout's ipa_probe (not an installed copy) and starts in notebooks/, as Jupyter does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("IPA_PROBE_RESULTS", raising=False)
    before = _tree()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert sorted(map(str, _tree() - before)) == [], "the notebook wrote into the repository; use a temporary folder"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
