"""``probe(compile=True)``: the per-step pass (forming and statistics, two compiled regions with the nulls' keys drawn
between) gives eager's numbers, and any failure of the compiler falls back to eager with one warning and the very
numbers (the same random draws).

The eager statistics themselves are held to float64 recomputations elsewhere (tests/test_stats.py,
tests/test_probe.py, tests/test_query_frame.py); here the compiled path is held to the eager one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ipa_probe.capture.config import ProbeConfig
from ipa_probe.capture.run import probe
from ipa_probe.statistics import compiled as stats_compile


@pytest.fixture
def fresh_compile(monkeypatch):
    """Each test starts without a compiled function (and leaves the process's as it was)."""
    monkeypatch.setattr(stats_compile, "_COMPILED", {})


def _table(pipe, refs, steps: int = 2, **options):
    """A probed call's table (the numbers), its output latents and how many records each cell's means hold."""
    with probe(pipe, **options) as run:
        out = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=steps, height=64, width=64,
                   output_type="latent", generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    table = run.to_dataframe()
    return (
        table[table.select_dtypes("number").columns],
        out,
        torch.cat([c["counts"].flatten() for c in run._result["calls"]]),
    )


def test_probe_compile_setting_is_checked():
    assert ProbeConfig(compile=True).describe()["compile"] is True
    with pytest.raises(TypeError, match="compile"):
        ProbeConfig(compile="yes")


def test_compile_failure_falls_back_to_eager_once(sd15, refs, monkeypatch, fresh_compile):
    """torch.compile raising (no compiler): one warning, then eager, the table identical (not merely close) from call
    to call, and to the default eager run's but for the nulls' draws."""
    eager, *_ = _table(sd15, refs)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="compile=True.*no C\\+\\+ compiler.*eagerly"):
        first, *_ = _table(sd15, refs, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is silent
        second, *_ = _table(sd15, refs, compile=True)
    assert first.fillna(-9).equals(second.fillna(-9))
    assert _undrawn(first).equals(_undrawn(eager))


def _undrawn(table):
    """The numbers but the permutation nulls': eager's records wait for one statistics pass per call, compile=True's
    run one per pass (static shapes), so their nulls draw over the rows in another order (the same distribution)."""
    return table.drop(columns=[c for c in table.columns if "spearman_null" in c]).fillna(-9)


def test_failure_inside_the_compiled_call_puts_the_pass_back(sd15, refs, monkeypatch, fresh_compile):
    """A compiled function that fails part-way (the forming has formed the pass's records but not taken them; the
    statistics have run): what it changed is put back, so the eager rerun counts every record once: the counts
    identical to eager's, the table to the eager fallback's (one pass per denoiser pass, the same draws)."""
    calls = []

    def compile_(fn, **kwargs):
        def half_run(*args):
            calls.append(fn.__name__)
            if fn.__name__ == "_join_pass":  # (run, parts, joins): the records formed into the pending list
                args[0]._form_parts(*args[1:])
            else:
                fn(*args)
            raise RuntimeError("inductor failed")

        return half_run

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    eager, _, counts = _table(sd15, refs)
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        per_pass, *_ = _table(sd15, refs, compile=True)  # eager, one statistics pass per denoiser pass
    monkeypatch.setattr(stats_compile, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", compile_)
    with pytest.warns(RuntimeWarning, match="inductor failed"):
        got, _, got_counts = _table(sd15, refs, compile=True)
    assert calls == ["_join_pass", "_compare_pass"]  # each region failed once, then ran eagerly
    assert torch.equal(got_counts, counts)  # no record counted twice
    assert got.fillna(-9).equals(per_pass.fillna(-9)) and _undrawn(got).equals(_undrawn(eager))


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("IPA_PROBE_TEST_COMPILE") != "1",
    reason="the real compile takes 1-2 min on a 2-core CPU, beyond the suite's budget: `make test-compile` runs it",
)
def test_compiled_pass_equals_eager(sd15, refs, monkeypatch, fresh_compile, fresh_dynamo):
    """The real compile (static shapes) of a probed 2-step call: the output latents bit-identical, every number equal
    to eager's to float32 rounding (inductor fuses reductions and sums in another order: 1.1e-5 absolute on fields of
    a few units, the logit ratios, was the most measured; 1e-4 relative and absolute bounds it), the nulls to those of
    eager on the compiled route (one pass per denoiser pass, the same draws: :func:`_undrawn`), NaN in the same
    places; each region compiled once, with no graph break and no recompile from one step to the next."""
    from torch._dynamo.utils import counters

    try:
        torch.compile(lambda x: x + 1)(torch.ones(2))
    except Exception as err:  # noqa: BLE001 - no working compiler here: the fallback tests above cover this case
        pytest.skip(f"torch.compile does not work here: {type(err).__name__}")
    eager, plain, counts = _table(sd15, refs)
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the compiled path ran
        compiled, out, compiled_counts = _table(sd15, refs, compile=True)
    assert all(stats_compile._COMPILED[name] is not False for name in ("join", "compare"))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(out, plain) and torch.equal(compiled_counts, counts)
    assert compiled.isna().equals(eager.isna())
    got, want = (torch.from_numpy(_undrawn(x).to_numpy(float)) for x in (compiled, eager))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(stats_compile, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        per_pass, *_ = _table(sd15, refs, compile=True)
    nulls = [c for c in eager.columns if "spearman_null" in c]
    assert nulls  # the default eager run draws them otherwise (one statistics pass a call)
    got, want = (torch.tensor(x[nulls].fillna(-9).to_numpy(float)) for x in (compiled, per_pass))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
