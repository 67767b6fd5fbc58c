"""Row sampling (``ProbeConfig.rows``): the per-row statistics on a stratified sample of query rows, each with its
standard error, against the exact statistics of the same pipeline call.

The exact run (``rows=None``) is the reference here; that exact mode itself matches a float64 recomputation is
held by tests/test_probe.py, tests/test_query_frame.py and tests/test_gauge_stats.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ipa_probe.capture.config import DEFAULT_ROWS, ROW_KEY_BUDGET, SAMPLE_GROUPS, auto_sample_rows
from ipa_probe.capture.run import probe
from ipa_probe.statistics.agreement import compare_frames, compare_weights
from ipa_probe.statistics.draws import stratified_rows
from ipa_probe.statistics.schema import ROW_SAMPLE_COLUMNS, SAMPLED_COLUMNS, STAT_NAMES, se_column
from ipa_probe.tiny.sd import default_reference_images


def _table(pipe, refs, rows, size=128, **options):
    with probe(pipe, rows=rows, **options) as run:
        pipe(
            "a photo",
            ip_adapter_image=[refs],
            num_inference_steps=2,
            height=size,
            width=size,
            generator=torch.Generator().manual_seed(0),
        )
    return run.to_dataframe()


@pytest.fixture(scope="module")
def exact_and_sampled(sd15, refs):
    return _table(sd15, refs, None), _table(sd15, refs, 64)


@pytest.fixture(scope="module")
def exact_and_auto_many_keys(sd15):
    """The auto sample at many keys (16 references x 4 tokens = 64 keys, 128 px): 64 of the 16 x 16 layers' 256 rows,
    the sample size rows="auto" takes there, against the exact run."""
    many = default_reference_images(16)
    return _table(sd15, many, None), _table(sd15, many, "auto")


def _fractions(pipe, refs, size, rows=DEFAULT_ROWS):
    with probe(pipe, rows=rows) as run:
        pipe("a photo", ip_adapter_image=[refs], num_inference_steps=1, height=size, width=size,
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    return run, run.to_dataframe().groupby("layer", observed=True)["row_fraction"].agg(["min", "max"])


def test_default_is_exact_within_its_row_key_budget(sd15, refs):
    """The default (``rows="auto"``), through ``probe(pipe)`` itself. Two references (8 keys): at 256 px the tiny
    UNet's 32 x 32 layers (1,024 rows x 8 keys, over the 4,096 budget) use a 256-row sample and its 16 x 16 ones
    (2,048) are exact; at 128 px every cell is. Sixteen references (64 keys) at 128 px: the 16 x 16 layers (16,384
    row-keys) use 64 rows (fewer rows when keys are many), the 8 x 8 ones (4,096) are exact; summary() says so."""
    assert DEFAULT_ROWS == "auto" and ROW_KEY_BUDGET == 4096

    _, large = _fractions(sd15, refs, 256)
    assert (large["min"] == large["max"]).all()  # one fraction per layer
    assert set(large["min"]) == {256 / 1024, 1.0}  # the 32 x 32 layers sampled, the 16 x 16 ones exact
    assert (_fractions(sd15, refs, 128)[1]["min"] == 1).all()
    many = default_reference_images(16)  # 16 x 4 = 64 keys
    run, fractions = _fractions(sd15, many, 128)
    assert set(fractions["min"]) == set(fractions["max"]) == {64 / 256, 1.0}
    statement = run.summary().attrs["rows"]
    sampled = fractions.index[fractions["min"] < 1]
    assert f"Sampled in {len(sampled)} layer(s)" in statement and "256 rows x 64 keys = 16,384, 64 rows" in statement
    assert f"Exact in {len(fractions) - len(sampled)} layer(s)" in statement and 'rows="auto"' in statement
    # an explicit int keeps its meaning: exact up to that many rows whatever the keys
    assert (_fractions(sd15, many, 128, rows=256)[1]["min"] == 1).all()


def test_auto_sample_size():
    """The rule itself: exact within the budget or when the sample would hold every row; 256 rows at few keys, the
    budget's rows at many, never below 64; a multiple of the random groups."""
    assert auto_sample_rows(1024, 4) is None and auto_sample_rows(256, 16) is None
    assert auto_sample_rows(4096, 4) == 256 and auto_sample_rows(4096, 16) == 256
    assert auto_sample_rows(4096, 64) == 64 and auto_sample_rows(4096, 40) == 96  # 4,096 // 40 = 102 -> 96
    assert auto_sample_rows(4096, 1000) == 64 and auto_sample_rows(64, 1000) is None  # 64 of 64: every row
    for rows in (100, 257, 1024, 4096, 16384):
        for keys in (1, 3, 8, 16, 50, 64, 77, 300):
            n = auto_sample_rows(rows, keys)
            assert n is None or (n % SAMPLE_GROUPS == 0 and 64 <= n <= 256 and n < rows)
            if rows * keys <= ROW_KEY_BUDGET:
                assert n is None
            elif n is None:  # over the budget, exact only where the sample would hold every row
                assert rows <= min(256, max(64, ROW_KEY_BUDGET // keys))


def test_exact_mode_reports_no_sampling_error(exact_and_sampled):
    exact, _ = exact_and_sampled
    assert (exact["row_fraction"] == 1).all()
    assert (exact[[se_column(c) for c in SAMPLED_COLUMNS]].fillna(0) == 0).all().all()
    assert set(ROW_SAMPLE_COLUMNS) <= set(exact.columns)


@pytest.mark.parametrize("runs", ["exact_and_sampled", "exact_and_auto_many_keys"])
def test_sample_is_within_its_stated_error_of_exact(runs, request):
    exact, sampled = request.getfixturevalue(runs)
    keys = ["call", "step", "layer", "head", "branch", "kind", "adapter"]
    merged = exact.merge(sampled, on=keys, suffixes=("", "_s"))
    large = merged[merged["row_fraction_s"] < 1]
    small = merged[merged["row_fraction_s"] == 1]
    assert len(large) >= 16 and len(small) >= 16  # the 16 x 16 latent's large layers sampled, the others exact
    # exact cells are the same numbers in both runs, but for the permutation nulls: a sampled record draws fewer
    # random numbers from the run's generators, so the records after it draw other permutations
    for name in (c for c in SAMPLED_COLUMNS if not c.endswith("spearman_null")):
        a, b = small[name].to_numpy(), small[f"{name}_s"].to_numpy()
        assert np.array_equal(np.nan_to_num(a, nan=-9), np.nan_to_num(b, nan=-9)), name
    z = []
    for name in SAMPLED_COLUMNS:
        diff = (large[f"{name}_s"] - large[name]).to_numpy()
        se = large[se_column(name) + "_s"].to_numpy()
        ok = np.isfinite(diff) & np.isfinite(se)
        # a column constant over the rows (e.g. a chance level of a fixed number of keys) has se 0: it must then be
        # exact up to float32 rounding of a mean of equal values
        flat = ok & (se == 0)
        assert np.all(np.abs(diff[flat]) <= 1e-5 * np.maximum(1, np.abs(large[name].to_numpy()[flat]))), name
        z.extend((diff[ok & (se > 0)] / se[ok & (se > 0)]).tolist())
    z = np.asarray(z)
    assert len(z) > 500
    # se has G - 1 = 7 degrees of freedom, so z is roughly t with 7 d.f. (and the estimator ignores the finite-
    # population correction, which only shrinks z): P(|t_7| > 3) = 0.02 and E[t_7^2] = 1.4; the bounds leave room
    # for the correlation between columns of one cell
    assert np.mean(np.abs(z) > 3) < 0.06, np.mean(np.abs(z) > 3)
    assert np.mean(z * z) < 2.5, np.mean(z * z)
    # 64 rows of a cell's R query rows: R = 64 / fraction, a whole number above 64
    cell_rows = 64 / large["row_fraction_s"].to_numpy()
    assert np.allclose(cell_rows, np.round(cell_rows)) and (cell_rows > 64).all()


def test_stratified_rows_draws_one_row_per_block():
    g = torch.Generator().manual_seed(0)
    idx = stratified_rows(1000, 64, g, "cpu")
    blocks = torch.arange(65) * 1000 // 64
    assert idx.shape == (64,)
    assert ((idx >= blocks[:-1]) & (idx < blocks[1:])).all()
    assert torch.equal(idx, stratified_rows(1000, 64, torch.Generator().manual_seed(0), "cpu"))
    assert torch.equal(stratified_rows(8, 8, g, "cpu"), torch.arange(8))
    with pytest.raises(ValueError, match="n: expected"):
        stratified_rows(8, 9, g, "cpu")


def test_random_group_errors_against_a_recomputation():
    """compare_frames' standard errors against compare_weights on each interleaved group, reduced with numpy."""
    torch.manual_seed(0)
    groups, rows, keys = SAMPLE_GROUPS, 96, 6
    attn = torch.randn(2, 3, rows, keys)
    nw = attn - torch.rand(2, 3, 1, keys) * 2
    term = torch.rand(2, 3, 1, keys)
    both = compare_frames(attn, [(nw, term, torch.Generator().manual_seed(1))], replicates=groups)[0]
    estimate, se = both[..., 0, :], both[..., 1, :]
    whole = compare_weights(attn, nw, torch.Generator().manual_seed(1), key_term=term)
    assert torch.equal(estimate.nan_to_num(-9), whole.nan_to_num(-9))
    per_group = np.stack(
        [
            compare_weights(attn[:, :, g::groups], nw[:, :, g::groups], key_term=term).double().numpy()
            for g in range(groups)
        ]
    )  # (G, 2, 3, S): group g holds rows g, g + G, ...
    expected = per_group.std(0, ddof=1) / math.sqrt(groups)
    drawn = STAT_NAMES.index("spearman_null")  # the null's draws differ between the two layouts
    keep = [i for i in range(len(STAT_NAMES)) if i != drawn]
    # shares of rows take the larger of this and a binomial floor: the recomputation must not exceed theirs
    shares = [STAT_NAMES.index(n) for n in ("top1", "nonfinite", "rows_rho_gt_0.9", "rows_rho_pos1", "rows_rho_neg1")]
    plain = [i for i in keep if i not in shares]
    # float32 statistics reduced in float64 here: 1e-4 relative
    np.testing.assert_allclose(se.double().numpy()[..., plain], expected[..., plain], rtol=1e-4, atol=1e-6)
    assert (se.double().numpy()[..., shares] >= expected[..., shares] - 1e-6).all()
    assert (se[..., shares] > 0).all()


def test_rows_setting_is_checked(sd15):
    # a value out of range is a ValueError, one of the wrong type a TypeError (docs/failures.md, "The Python API")
    for bad, error in (
        (0, ValueError),
        (15, ValueError),
        (2.5, TypeError),
        (True, TypeError),
        ("all", ValueError),
        (b"auto", TypeError),
    ):
        with pytest.raises(error, match="rows: expected"):
            with probe(sd15, rows=bad):
                pass
