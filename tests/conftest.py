import os

import pytest
import torch

# Tests are small; one thread per process keeps parallel workers from fighting over 2 cores.
torch.set_num_threads(int(os.environ.get("IPA_PROBE_TEST_THREADS", "1")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
