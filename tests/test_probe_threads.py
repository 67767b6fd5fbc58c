"""ProbeConfig.threads: torch's CPU threads set around each record's statistics, the caller's restored after (also
when a record fails), and the statistics the same as with the caller's threads."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import pinned_threads

from ipa_probe.capture.config import ProbeConfig
from ipa_probe.capture.run import probe

PROMPT = "a photo of a flower"


@pytest.fixture
def two_threads():
    """The caller runs at 2 torch threads (restored after), so that a probe at 1 thread is visible."""
    yield from pinned_threads(2)


def generate(pipe, refs):
    generator = torch.Generator().manual_seed(0)
    pipe(PROMPT, ip_adapter_image=[refs], num_inference_steps=2, output_type="latent", generator=generator)


def spy(run, seen: list[int], fail: bool = False):
    """Wrap the run's statistics: note torch's thread count inside each record (and fail there with ``fail``)."""
    inner = run._record_stats

    def wrapped(*args):
        seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("boom inside a record")
        return inner(*args)

    run._record_stats = wrapped


def test_threads_are_set_around_each_record_and_the_callers_restored(sd15, refs, two_threads):
    seen, outside = [], []
    hook = sd15.unet.register_forward_pre_hook(lambda module, args: outside.append(torch.get_num_threads()))
    try:
        with probe(sd15, threads=1) as run:
            spy(run, seen)
            generate(sd15, refs)
    finally:
        hook.remove()
    assert seen and set(seen) == {1}, "every record's statistics run at the probe's thread count"
    assert outside and set(outside) == {2}, "the denoiser keeps the caller's threads between records"
    assert torch.get_num_threads() == 2
    with probe(sd15) as plain:  # threads=None: the caller's 2 threads
        generate(sd15, refs)
    # the same q and k reach both runs (the denoiser ran at 2 threads in both); the statistics' reductions may split
    # over 2 threads differently from 1, so float32 rounding (a few ulp) is all that may differ
    table, reference = run.to_dataframe(), plain.to_dataframe()
    numeric = reference.select_dtypes("number").columns
    pd.testing.assert_frame_equal(table[numeric], reference[numeric], rtol=1e-5, atol=1e-6)


def test_the_callers_threads_come_back_when_a_record_fails(sd15, refs, two_threads):
    seen = []
    with pytest.raises(RuntimeError, match="boom inside a record"):
        with probe(sd15, threads=1) as run:
            spy(run, seen, fail=True)
            generate(sd15, refs)
    assert seen == [1] and torch.get_num_threads() == 2


@pytest.mark.parametrize(
    "bad, error", [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError), ("1", TypeError)]
)
def test_bad_threads_are_refused_naming_the_argument(bad, error):
    # out of range: ValueError; the wrong type: TypeError (docs/failures.md, "The Python API")
    with pytest.raises(error, match="threads: expected None"):
        ProbeConfig(threads=bad)
