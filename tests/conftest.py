import os

import pytest
import torch
from helpers import pinned_threads

# Tests are small; one thread per process keeps parallel workers from fighting over 2 cores.
torch.set_num_threads(int(os.environ.get("IPA_PROBE_TEST_THREADS", "1")))
# and so do the processes the tests start (notebook kernels, forked children, commands), unless told otherwise: torch's
# default of every core makes two workers' children fight over them
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("IPA_PROBE_TEST_THREADS", "1"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The ``slow`` tests first, after any shuffle (``--random-order``), each group in the order it came (a module's
    slow tests stay together). With pytest-xdist's ``worksteal`` (pyproject.toml) one worker starts on them and the
    other takes the back half of its queue whenever its own runs out, so both end on short tests instead of one
    waiting for a long test that the shuffle put last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module")
def refs():
    """Two real photos (scikit-learn's sample images): one adapter's support set."""
    from ipa_probe.tiny.sd import default_reference_images

    return default_reference_images(2)


@pytest.fixture(scope="module")
def sd15():
    """The embedded tiny SD 1.5 pipeline with one IP-Adapter, shared by a test module."""
    from ipa_probe.tiny.sd import tiny_pipeline

    return tiny_pipeline("sd15")


@pytest.fixture(scope="module")
def flux():
    """The tiny Flux pipeline with one IP-Adapter, shared by a test module."""
    from ipa_probe.tiny.dit import tiny_flux_pipeline

    return tiny_flux_pipeline()


@pytest.fixture(scope="module")
def sd3():
    """The tiny SD3 pipeline with one IP-Adapter, shared by a test module."""
    from ipa_probe.tiny.dit import tiny_sd3_pipeline

    return tiny_sd3_pipeline()


@pytest.fixture(scope="module")
def organism():
    """The shipped digits organism (progress bar off), shared by a test module."""
    from ipa_probe.tiny.digits import digits_pipeline

    pipe = digits_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """Tables are bit-identical across processes only at equal torch thread counts: pin one, restore after."""
    yield from pinned_threads(1)


@pytest.fixture
def fresh_dynamo():
    """An empty torch.compile cache before and after the test: a graph compiled by another test in the same process
    (with or without ipa_probe's hooks) would otherwise be reused and decide whether hooks run."""
    import torch

    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture(autouse=True)
def seeded_global_rng():
    """Every test starts from the same global torch and numpy random state, so that a test drawing unseeded inputs
    gets the same ones whichever tests ran before it (a test's result must not depend on the order of the suite)."""
    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def close_figures():
    """The figures a test's plotting calls returned are the test's to close: close what is left after it, so that the
    suite does not hold hundreds of open figures (matplotlib warns above 20, and each holds its canvas's memory)."""
    yield
    import sys

    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """Fresh processes forked from one interpreter that has imported torch and diffusers (tests/forked.py)."""
    from pathlib import Path

    from forked import Zygote

    forker = Zygote(tmp_path_factory.mktemp("zygote"), Path(__file__).parents[1])
    yield forker
    forker.close()
