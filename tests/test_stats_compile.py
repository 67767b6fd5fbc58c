"""``probe(compile=True)``: the per-row statistics through ``torch.compile`` give eager's numbers, and any failure of
the compiler falls back to eager with one warning and the very numbers (the same random draws).

The eager statistics themselves are held to float64 recomputations elsewhere (tests/test_stats.py,
tests/test_probe.py); here the compiled path is held to the eager one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ipa_probe.capture.cells import cell_inputs, compare_cells, group_cell, record_logits
from ipa_probe.capture.config import ProbeConfig
from ipa_probe.statistics import compiled as stats_compile
from ipa_probe.statistics.compiled import compiled_statistics
from ipa_probe.statistics.draws import stratified_rows


class _Plain:  # a processor without custom image-branch logits (SDPA's)
    pass


def _record(queries: int = 64, tokens: int = 12, sample: int | None = 32):
    """One small synthetic record (CFG batch of 2, 2 heads of width 8), its rows sampled (standard errors on)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, queries, 8, generator=g), torch.randn(2, 2, tokens, 8, generator=g)
    attn, q_norms = record_logits(_Plain(), q, k, False)
    rows = None if sample is None else stratified_rows(queries, sample, torch.Generator().manual_seed(1), "cpu")
    cell = group_cell(2, q, k, attn, False, None, _Plain(), None, torch.full((), 8**0.25), False, rows)
    return cell_inputs(cell, 2, q, k, None, False, _Plain(), None, None, 2, q_norms, rows)


def _values(records, compiled: bool) -> torch.Tensor:
    gens = (torch.Generator().manual_seed(0), torch.Generator().manual_seed(0))
    with compiled_statistics(compiled):
        return torch.cat(compare_cells(records, gens))


@pytest.fixture
def fresh_compile(monkeypatch):
    """Each test starts without a compiled function (and leaves the process's as it was)."""
    monkeypatch.setattr(stats_compile, "_COMPILED", {})


def test_compile_failure_falls_back_to_eager_once(monkeypatch, fresh_compile):
    """torch.compile raising (no compiler): one warning, then eager, numbers identical (not merely close)."""

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    records = [_record(), _record(queries=64, tokens=12, sample=32)]
    eager = _values(records, False)
    with pytest.warns(RuntimeWarning, match="compile=True.*no C\\+\\+ compiler.*eagerly"):
        first = _values(records, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is silent
        second = _values(records, True)
    assert torch.equal(first.nan_to_num(-9), eager.nan_to_num(-9))
    assert torch.equal(second.nan_to_num(-9), eager.nan_to_num(-9))


def test_failure_inside_the_compiled_call_restores_the_draws(monkeypatch, fresh_compile):
    """A compiled function that fails after drawing (a graph compiled past the nulls' draws): the generators are put
    back, so the eager rerun draws what eager would have drawn: identical numbers, the nulls included."""

    def compile_(fn, **kwargs):
        def half_run(attn, frames, *rest):
            for _, _, g in frames:  # draw, as the nulls would, then fail
                torch.rand(100, generator=g)
            raise RuntimeError("inductor failed")

        return half_run

    monkeypatch.setattr(torch, "compile", compile_)
    records = [_record()]
    eager = _values(records, False)
    with pytest.warns(RuntimeWarning, match="inductor failed"):
        got = _values(records, True)
    assert torch.equal(got.nan_to_num(-9), eager.nan_to_num(-9))


def test_probe_compile_setting_is_checked():
    assert ProbeConfig(compile=True).describe()["compile"] is True
    with pytest.raises(TypeError, match="compile"):
        ProbeConfig(compile="yes")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("IPA_PROBE_TEST_COMPILE") != "1",
    reason="the real compile takes 5-20 min on a 2-core CPU, beyond the suite's budget: `make test-compile` runs it",
)
def test_compiled_statistics_equal_eager(fresh_compile):
    """The real compile (torch.compile, dynamic shapes) on two tiny records of different shapes, sampled (standard
    errors) and exact: equal to eager to 1e-6 relative and absolute (the golden fixtures' bound). Why not bit for bit:
    inductor fuses reductions and sums in another order (float32 rounding); the fields run from shares in [0, 1] to
    n_eff and logit ratios of a few units, so the bound is relative (benchmarks/compile_stats.py measured 1.9e-6
    absolute on a 256-row, 16-key record). Slow: the compile took 21 min of wall time on the loaded 2-core machine
    (load 10) and about 4.5 min for the rank alone at load 4 (docs/measured.md, "Compiled statistics"); the records
    are tiny, so the cost is the compile alone."""
    try:
        torch.compile(lambda x: x + 1, dynamic=True)(torch.ones(2))
    except Exception as err:  # noqa: BLE001 - no working compiler here: the fallback tests above cover this case
        pytest.skip(f"torch.compile does not work here: {type(err).__name__}")
    for records in ([_record()], [_record(queries=48, tokens=5, sample=None)]):
        eager = _values(records, False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback: the compiled path ran
            compiled = _values(records, True)
        assert stats_compile._COMPILED["compare_frames"] is not False
        assert torch.equal(compiled.isnan(), eager.isnan())
        torch.testing.assert_close(compiled.nan_to_num(0), eager.nan_to_num(0), rtol=1e-6, atol=1e-6)


def test_probe_compile_runs_the_same_table(sd15, refs, monkeypatch, fresh_compile):
    """probe(compile=True) reaches the statistics: with a compiler that fails, one warning and the eager table."""
    from ipa_probe.capture.run import probe

    def call(**options):
        with probe(sd15, **options) as run:
            sd15("a photo", ip_adapter_image=[refs], num_inference_steps=1, height=64, width=64,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
        return run.to_dataframe()

    eager = call()

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="compile=True"):
        compiled = call(compile=True)
    numbers = eager.select_dtypes("number").columns
    assert compiled[numbers].fillna(-9).equals(eager[numbers].fillna(-9))
