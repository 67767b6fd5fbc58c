"""Every notebook in notebooks/ runs top to bottom on the embedded defaults, writes nothing into the repository, and is
committed without outputs.

The notebooks of one test process run in one kernel, started once: the heavy third-party imports (torch, diffusers,
pandas, matplotlib: some 5 s of CPU) are paid once instead of once per notebook. Before each notebook the kernel is
made as a fresh one would be for it (:data:`_FRESH`, run as a cell of its own): ipa_probe's modules are dropped from
``sys.modules`` (the notebook imports this checkout's ipa_probe itself, as in a fresh kernel, so a name that only an
earlier notebook's import made reachable fails here as it would there), the working folder is notebooks/, the
figures are closed, torch's thread count and random state are those of a new process, and the namespace is emptied
(``%reset -f``)."""

import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: what the tree may gain while a notebook runs: caches, and what the test machinery itself makes
_NOT_OUTPUTS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".ipynb_checkpoints"}

#: the cell run before each notebook in the shared kernel (see the module docstring)
_FRESH = f"""
import os, sys, matplotlib.pyplot, torch
os.chdir({str(ROOT / "notebooks")!r})
for name in [m for m in sys.modules if m.split(".")[0] == "ipa_probe"]:
    del sys.modules[name]
matplotlib.pyplot.close("all")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
torch.seed()
get_ipython().run_line_magic("reset", "-f")
"""


def _tree() -> set[Path]:
    """Every file and folder under the repository root, caches left out."""
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _NOT_OUTPUTS and not d.endswith(".egg-info")]
        found.update(Path(folder, name).relative_to(ROOT) for name in [*dirs, *files])
    return found


@pytest.fixture(scope="module")
def kernel():
    """One kernel for this process's notebooks: it imports this checkout's ipa_probe (not an installed copy) and
    starts in notebooks/, as Jupyter does; torch on one thread there too (conftest), as in the test processes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        patch.delenv("IPA_PROBE_RESULTS", raising=False)
        km = AsyncKernelManager(kernel_name="python3")
        yield km
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)


def _execute(nb, kernel):
    """Run ``nb`` in the shared kernel after :data:`_FRESH`; a failed or hung notebook's kernel is shut down, so that
    the next notebook starts in a new one instead of behind it."""
    nb.cells.insert(0, nbformat.v4.new_code_cell(_FRESH))
    resources = {"metadata": {"path": str(ROOT / "notebooks")}}
    client = NotebookClient(nb, km=kernel, timeout=600, kernel_name="python3", resources=resources)
    try:
        return client.execute()
    except BaseException:
        run_sync(kernel.shutdown_kernel)(now=True)
        raise
    finally:
        if client.kc is not None:
            client.kc.stop_channels()


def test_a_notebook_sees_nothing_of_the_one_before_it(kernel, tmp_path):
    """What the shared kernel must not carry from one notebook to the next: names, ipa_probe's modules, the working
    folder, the thread count. (Figures: the inline backend closes them after each cell, and the reset closes any
    left.)"""
    cell = nbformat.v4.new_code_cell
    first = nbformat.v4.new_notebook(
        cells=[
            cell(f"""
import os, torch
import ipa_probe.tiny.digits
left_over = 1
torch.set_num_threads(3)
os.chdir({str(tmp_path)!r})""")
        ]
    )
    second = nbformat.v4.new_notebook(
        cells=[
            cell(f"""
import os, sys, torch
assert "left_over" not in globals() and "ipa_probe" not in globals()
assert not [m for m in sys.modules if m.split(".")[0] == "ipa_probe"]
assert os.getcwd() == {str(ROOT / "notebooks")!r}
assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])""")
        ]
    )
    _execute(first, kernel)
    _execute(second, kernel)


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
def test_notebook_executes_and_writes_nothing_into_the_repository(path, kernel):
    before = _tree()
    nb = _execute(nbformat.read(path, as_version=4), kernel)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert sorted(map(str, _tree() - before)) == [], "the notebook wrote into the repository; use a temporary folder"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
