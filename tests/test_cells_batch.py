"""The probe compares a pass's records in one batched pass (:func:`ipa_probe.capture.cells.compare_cells`): each
record's fields must be what its own pass gives, whatever else shares the batch; only the permutation nulls draw
differently. That the single-record values match a float64 recomputation is held by tests/test_probe.py,
tests/test_query_frame.py and tests/test_gauge_stats.py."""

from __future__ import annotations

import pytest
import torch

from ipa_probe.capture.cells import cell_inputs, compare_cells, group_cell, record_logits
from ipa_probe.statistics.draws import stratified_rows
from ipa_probe.statistics.kernels import split_heads
from ipa_probe.statistics.schema import CELL_FIELDS, QUERY_FRAME_COLUMNS, se_column

#: The nulls' columns and their errors: one draw for a batch, not one per record.
DRAWN = {"spearman_null", *(c for c in QUERY_FRAME_COLUMNS if c.endswith("spearman_null"))}
DRAWN |= {se_column(name) for name in set(DRAWN)}


class _Plain:  # a processor without its own image-branch logits: dot-product attention, as diffusers' IP processors
    pass


def _record(seed: int, queries: int, rows: int | None, heads: int = 2, tokens: int = 6, pools: int = 2):
    """One record's inputs as the probe forms them: heads split off (B, N, H * D) projections, CFG batch of 2; its
    query frames one per item (``pools=2``, the default) or over both items (``pools=1``, the other pool per item)."""
    g = torch.Generator().manual_seed(seed)
    q = split_heads(torch.randn(2, queries, heads * 8, generator=g), heads)
    k = split_heads(1.5 * torch.randn(2, tokens, heads * 8, generator=g), heads)
    attn, norms = record_logits(_Plain(), q, k, False)
    sample = None
    if rows is not None and queries > rows:
        sample = stratified_rows(queries, rows, torch.Generator().manual_seed(seed), "cpu")
    h = torch.full((), 8**0.25)
    cell = group_cell(2, q, k, attn, False, None, _Plain(), None, h, False, sample)
    return cell_inputs(cell, 2, q, k, None, False, _Plain(), None, None, pools, norms, sample, other_pools=2)


def _generators():
    return torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)


# exact, a row sample with its errors, frames pooled over the items (with the other pool's frame), and exact records
# beside sampled ones (one pass: the exact ones' errors 0, as alone)
@pytest.mark.parametrize("queries, rows, pools", [(64, None, 2), (512, 64, 2), (512, 64, 1), ((64, 512, 64), 64, 2)])
def test_a_batched_record_gets_the_fields_of_its_own_pass(queries, rows, pools):
    """Statistics of records compared together equal each record's compared alone."""
    sizes = queries if isinstance(queries, tuple) else (queries,) * 3
    records = [_record(seed, size, rows, pools=pools) for seed, size in enumerate(sizes)]
    assert len({record.signature() for record in records}) == 1
    batched = compare_cells(records, _generators())
    checked = [i for i, name in enumerate(CELL_FIELDS) if name not in DRAWN and name != "ip_mass"]  # NaN: no SD3
    for seed, values in enumerate(batched):
        (alone,) = compare_cells([_record(seed, sizes[seed], rows, pools=pools)], _generators())
        assert values.shape == alone.shape == (2, 2, len(CELL_FIELDS))
        assert alone[..., checked].isfinite().all()
        # Every checked field is a per-row value reduced over the cell's rows: the same operations on the same rows;
        # the tolerance only allows a reduction to vectorise differently over a larger batch (float32, 64 rows).
        torch.testing.assert_close(values[..., checked], alone[..., checked], rtol=1e-6, atol=1e-6)
    # the nulls are chance levels either way (|rho| of shuffled ranks, 6 keys, averaged over 64 rows: small)
    null = torch.cat(batched)[..., CELL_FIELDS.index("spearman_null")]
    assert null.abs().max() < 0.5


def test_records_of_other_shapes_have_other_signatures():
    exact, sampled, other = _record(0, 64, None), _record(0, 512, 64), _record(0, 64, None, tokens=4)
    assert len({exact.signature(), other.signature()}) == 2
    assert exact.signature() == _record(1, 64, None).signature() == sampled.signature()  # one pass, errors masked


def test_nulls_of_a_batch_are_seeded():
    records = [_record(seed, 64, None) for seed in range(2)]
    first, second = compare_cells(records, _generators()), compare_cells(records, _generators())
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # ip_mass is NaN (no joint softmax)
    assert torch.cat(first)[..., CELL_FIELDS.index("spearman_null")].abs().max() > 0  # a draw, not a constant


@pytest.mark.parametrize(
    "rows, query_frame, bound",
    [("auto", "item", "JOIN_ELEMENTS_CPU"), (16, "item", "JOIN_ELEMENTS_CPU"), (16, "branch", "JOIN_ELEMENTS_CPU")]
    + [("auto", "branch", "FRAME_ELEMENTS")],
)
def test_records_stacked_in_one_pass_equal_records_formed_alone(sd15, refs, monkeypatch, rows, query_frame, bound):
    """The probe holds a call's records and forms those of equal shape stacked along the batch (one pass per layer
    size, every step's records in it; the query frames of every size in one pass, cells.joint_frames): with row
    samples (each record its own, drawn in record order), two items per CFG branch and pooled query frames, every
    column equals the run whose records are each formed alone (no stacking on the CPU,
    ``JOIN_ELEMENTS_CPU`` 0, or no room to hold records, ``FRAME_ELEMENTS`` 1: each formed in its hook); only the
    nulls, drawn once per batch of the pass, may draw otherwise (their distribution is held by tests/test_stats.py)."""
    import numpy as np

    import ipa_probe.capture.cells as cells_module
    import ipa_probe.capture.forming as forming_module
    import ipa_probe.capture.run as run_module

    formed = []
    begin = run_module.ProbeRun._begin
    monkeypatch.setattr(
        run_module.ProbeRun, "_begin", lambda self, held: formed.append(len(held)) or begin(self, held)
    )

    joint_frames, joint = cells_module.joint_frames, []
    monkeypatch.setattr(cells_module, "joint_frames", lambda *args: joint.append(1) or joint_frames(*args))

    def table():
        formed.clear()
        joint.clear()
        with run_module.probe(sd15, rows=rows, query_frame=query_frame) as run:
            sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, num_images_per_prompt=2,
                 generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
        return run.to_dataframe(), list(formed)

    monkeypatch.setattr(cells_module, "JOIN_FRAMES_CPU", 2**62)  # the GPU's policy: the sizes' frames joined
    stacked, sizes = table()
    assert max(sizes) > 1, "equal-size layers are formed together"
    assert len(joint) == 1, "the sizes' query frames are joined, every step's in one pass when the call ends"
    monkeypatch.setattr(cells_module, "JOIN_FRAMES_CPU", 0)
    if bound == "JOIN_ELEMENTS_CPU":
        monkeypatch.setattr(cells_module, "JOIN_ELEMENTS_CPU", 0)
    else:
        monkeypatch.setattr(forming_module, "FRAME_ELEMENTS", 1)
    alone, sizes_alone = table()
    assert not joint
    assert set(sizes_alone) == {1} and sum(sizes_alone) == sum(sizes)
    assert list(alone.columns) == list(stacked.columns) and len(alone) == len(stacked)
    if rows == 16:
        assert (stacked["row_fraction"] < 1).any(), "some cells are read on a row sample"
    assert stacked["qf_spearman_other_pool"].notna().any()  # two items per branch: the other pool's frame too
    numbers = [c for c in stacked.select_dtypes("number").columns if c not in DRAWN]
    # 1e-5: the joined query frames sum each frame's rows in another order (float32 rounding; 3e-6 seen)
    np.testing.assert_allclose(
        stacked[numbers].to_numpy(float), alone[numbers].to_numpy(float), rtol=1e-5, atol=1e-6, equal_nan=True
    )


def test_a_call_runs_one_statistics_pass_unless_its_waiting_records_pass_the_budget(sd15, refs, monkeypatch):
    """A call's records wait, unformed, for one statistics pass when the call ends (the next call's start, the block's
    end), the bandwidth of each record's own step kept; when the waiting records pass ``forming.PENDING_BYTES``, the
    probe forms and compares what it holds at once (here: at every record, a budget of 1 byte). Every column but the
    nulls' is the same either way."""
    import numpy as np

    import ipa_probe.capture.forming as forming_module
    import ipa_probe.capture.run as run_module

    passes, compare = [], run_module._compare_pass
    counted = lambda batches, draws: passes.extend([1][: len(batches)]) or compare(batches, draws)  # those not empty
    monkeypatch.setattr(run_module, "_compare_pass", counted)

    def table():
        passes.clear()
        with run_module.probe(sd15, bandwidth=lambda t: 0.5 + float(t) / 1000) as run:  # a bandwidth per step
            for steps in (2, 3):
                sd15("a photo", ip_adapter_image=[refs], num_inference_steps=steps,
                     generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
        return run.to_dataframe(), len(passes)

    deferred, calls = table()
    assert calls == 2, "one statistics pass per call"
    monkeypatch.setattr(forming_module, "PENDING_BYTES", 1)
    early, budgeted = table()
    records = len(deferred[["call", "step", "layer", "kind", "adapter"]].drop_duplicates())
    assert budgeted == records, "a statistics pass at every record, as the budget asks"
    numbers = [c for c in deferred.select_dtypes("number").columns if c not in DRAWN]
    assert len(deferred) == len(early) and len(numbers) > 20
    # 1e-5: each record's query frames formed alone sum its rows in another order (float32 rounding)
    np.testing.assert_allclose(
        deferred[numbers].to_numpy(float), early[numbers].to_numpy(float), rtol=1e-5, atol=1e-6, equal_nan=True
    )
