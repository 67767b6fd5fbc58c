"""Golden tables: every statistic the probe reports on three fixed calls (the digits organism with maps, a tiny SD 1.5
with the fitted bandwidth and both branches, a tiny SDXL with the per-branch query frame) stays what the probe reported
before the attachment core was rebuilt (tests/golden_calls.py wrote the fixtures).

Two intentional changes merged beside the rebuild rewrote only their own columns of the fixtures, every other value
kept as first written: the permutation nulls beyond K = 8 draw by Fisher-Yates swaps (``*_null``: other draws, the same
distribution; later the nulls at K <= 8 too, when the table of all K! permutations went, and later again every null by
one sort of random keys, a few kernel launches instead of four per key, and once more when a call's records waited for
one statistics pass, and when the maps' records waited too: the rows drawn in another order), and an all-tied row's
top-1 is undefined (``qf_top1`` / ``qf_gauss_top1`` NaN in the organism's one-query mid block). A column added later
(``qf_spearman_other_pool``) is checked against the fixture's own ``qf_spearman``, which it must repeat in these
one-item-per-branch calls. Every value is held to 1e-6 but two float32 families that move across CPUs (see
:func:`tolerance`), and the rank statistics of a few cells whose near-tied keys rank otherwise there
(:data:`RANKED`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from golden_calls import DATA, golden_tables


@pytest.fixture(scope="module")
def tables():
    return golden_tables()


@pytest.mark.parametrize("name", ["digits", "digits_references", "sd15", "sdxl"])
def test_golden_table(tables, name):
    expected = pd.read_csv(DATA / f"golden_{name}.csv.gz")
    got = tables[name].reset_index(drop=True)
    if "edits" in got:  # added with the attachment core: no edit acts in these calls
        assert (got.pop("edits") == "").all()
    if "qf_spearman_other_pool" in got:  # added with the query pool's effect (#40); every call here has one item per
        # CFG branch, so the other pool is the same rows and the column repeats qf_spearman, NaN where it is NaN
        other = got.pop("qf_spearman_other_pool").to_numpy(float)
        assert np.array_equal(other, got["qf_spearman"].to_numpy(float), equal_nan=True)
    assert list(got.columns) == list(expected.columns)
    assert len(got) == len(expected)
    for column in expected.columns:
        want = expected[column]
        if pd.api.types.is_numeric_dtype(want) and pd.api.types.is_numeric_dtype(got[column]):
            rtol, atol = tolerance(column)
            have, want = got[column].to_numpy(float), want.to_numpy(float)
            moved = ~np.isclose(have, want, rtol=rtol, atol=atol, equal_nan=True)
            if column.endswith(RANKED) and "keys" in expected:  # a near-tie ranked the other way (see RANKED)
                keys = expected["keys"].to_numpy(float)
                swapped = moved & (np.abs(have - want) <= 12 / (keys * (keys + 1)))
                assert swapped.sum() <= max(1, len(want) // 100), f"{column}: {swapped.sum()} cells' ranks moved"
                moved &= ~swapped
            np.testing.assert_allclose(have[moved], want[moved], rtol=rtol, atol=atol, equal_nan=True, err_msg=column)
        else:
            assert got[column].astype(str).tolist() == want.astype(str).tolist(), column


def tolerance(column: str) -> tuple[float, float]:
    """``(rtol, atol)`` for one column of the golden tables.

    1e-6 (the fixtures hold 9 significant digits) for every statistic but two families whose float32 value depends on
    the CPU the pipeline ran on: the denoiser's float32 kernels reduce in another order on another instruction set
    (the fixtures' machine against an AVX2 one) or thread count, which moves q and k by about 1e-7 relatively, and
    these statistics amplify that:

    - ``*logit_ratio``: a ratio of two logit spreads, the lower one near zero in near-degenerate query frames (values
      up to about 1,200 in these calls); measured 0.5% apart between two CPUs, so rtol 1e-2. A mis-assigned setting or
      a changed definition moves it by far more.
    - ``*rho_baseline``, ``*rho_excess`` (the baseline is a function of the logit ratio) and the raveled ``*pearson``
      (a correlation of float32 weights whose spread is near zero in some cells): measured up to 2.3e-5 apart, so
      atol 1e-4 (``qf_pearson`` 2.3e-6 apart on an AVX-512 Xeon).

    Apart from these, :data:`RANKED` columns may move in a few cells by a swap of two near-tied keys' ranks.
    """
    if column.endswith("logit_ratio"):
        return 1e-2, 1e-6
    if column.endswith(("rho_baseline", "rho_excess", "pearson")):
        return 1e-6, 1e-4
    return 1e-6, 1e-6


#: The per-row rank statistics whose cells may move by a swap of two keys' ranks: two keys whose float32 logits agree
#: to rounding rank either way on another CPU. Measured on an AVX-512 Xeon against the fixtures: one of the 240
#: organism cells (a query-frame row of 16 keys) moved by 7.35e-4 in ``qf_spearman``, its null and ``qf_rho_excess``,
#: a quarter of 12 / (K^3 - K), one adjacent swap in one of four rows. A swap moves a row's rho by 12 / (K^3 - K) and
#: its null by at most 12 / (K (K + 1)); at most 1% of a table's cells (at least one) may move so, by no more.
RANKED = ("spearman", "spearman_null", "rho_excess")
