"""The gauge diagnostics and the rows' nulls of ipa_probe.statistics against simulation, enumeration and float64 numpy.

Every expected value here is computed by the test itself (numpy, scipy, itertools), never through ipa_probe.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from ipa_probe.statistics.agreement import compare_weights
from ipa_probe.statistics.nulls import EXACT_NULL_KEYS, null_tail, rho_baseline, rho_null
from ipa_probe.statistics.schema import STAT_NAMES


def _stat(s, name):
    return s[..., STAT_NAMES.index(name)]


def _moran(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Moran (1948), written out here: E[rho_s] of k bivariate-normal pairs of correlation c = r / sqrt(1 + r^2)."""
    c = np.sign(r) if np.isinf(r).all() else r / np.sqrt(1 + r * r)
    return 6 / (np.pi * (k + 1)) * (np.arcsin(c) + (k - 2) * np.arcsin(c / 2))


# --------------------------------------------------------------------------- the baseline against simulation


@pytest.mark.parametrize("keys", [4, 16, 64])
@pytest.mark.parametrize("ratio", [0.25, 1.0, 2.4, 6.0])
def test_rho_baseline_matches_a_monte_carlo_simulation_of_its_model(keys, ratio):
    """Rows of K keys with attention logits x ~ N(0, r^2) and an independent key-norm term y ~ N(0, 1): the mean
    Spearman rho of x against x - y over 20,000 rows equals the baseline within 4 of the simulation's standard errors
    (a correct formula fails that 6 times in 100,000; the seed makes the check deterministic)."""
    rng = np.random.default_rng([keys, int(ratio * 100)])
    rows = 20_000
    x = ratio * rng.standard_normal((rows, keys))
    y = rng.standard_normal((rows, keys))
    rx, rxy = sps.rankdata(x, axis=1), sps.rankdata(x - y, axis=1)
    rx, rxy = rx - rx.mean(1, keepdims=True), rxy - rxy.mean(1, keepdims=True)
    rho = (rx * rxy).sum(1) / np.sqrt((rx * rx).sum(1) * (rxy * rxy).sum(1))
    standard_error = rho.std(ddof=1) / math.sqrt(rows)
    expected = rho_baseline(torch.tensor(ratio, dtype=torch.float64), keys).item()
    assert abs(rho.mean() - expected) < 4 * standard_error, (rho.mean(), expected, standard_error)
    assert expected == pytest.approx(_moran(np.float64(ratio), np.float64(keys)), abs=1e-12)


def test_rho_baseline_limits():
    r = torch.tensor([0.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    out = rho_baseline(r, torch.tensor(16))
    assert out[0].item() == 0.0 and out[1].item() == pytest.approx(1.0) and out[2].item() == pytest.approx(-1.0)
    assert out[3].isnan()
    # two keys: rho is the sign of the rank agreement, E = (2 / pi) asin(c)
    c = 2.0 / math.sqrt(5.0)
    assert rho_baseline(torch.tensor(2.0, dtype=torch.float64), 2).item() == pytest.approx(2 / math.pi * math.asin(c))


# --------------------------------------------------------------------------- the null of rho


def _scipy_null(keys: int) -> dict[float, float]:
    """rho of every permutation of ``keys`` distinct values against the identity, by scipy: value -> probability."""
    base = np.arange(keys)
    out: dict[float, float] = {}
    for perm in itertools.permutations(range(keys)):
        value = round(sps.spearmanr(base, perm).statistic, 9)
        out[value] = out.get(value, 0) + 1 / math.factorial(keys)
    return out


@pytest.mark.parametrize("keys", [2, 3, 4, 5])
def test_exact_null_equals_scipy_over_every_permutation(keys):
    null = rho_null(keys)
    expected = _scipy_null(keys)
    assert null.exact and null.samples is None
    got = {round(v, 9): p for v, p in zip(null.values, null.probs, strict=True)}
    assert got.keys() == expected.keys()
    for value, prob in expected.items():
        assert got[value] == pytest.approx(prob, abs=1e-15)
    assert null.sd == pytest.approx(1 / math.sqrt(keys - 1), abs=1e-12)  # the closed form under H0


def test_four_keys_null_has_eleven_values_and_rho_one_once_in_twenty_four():
    null = rho_null(4)
    assert len(null.values) == 11
    np.testing.assert_allclose(null.values, np.linspace(-1, 1, 11), atol=1e-12)
    assert null.tail(0.9) == pytest.approx(1 / 24) and null.prob(1.0) == pytest.approx(1 / 24)
    assert null.prob(-1.0) == pytest.approx(1 / 24)
    assert null_tail(4) == pytest.approx(1 / 24)


def test_simulated_null_agrees_with_an_independent_numpy_simulation():
    """Above the exact range: rho_null's simulation and numpy's own permutations give P(rho > 0.9) within 4 combined
    standard errors, and the tabulated chance levels (2**24 permutations each) agree with numpy's too."""
    keys = EXACT_NULL_KEYS + 1
    rng = np.random.default_rng(11)
    n = 2**19
    perms = rng.permuted(np.tile(np.arange(keys), (n, 1)), axis=1)
    rho = 1 - 6 * ((perms - np.arange(keys)) ** 2).sum(1) / (keys**3 - keys)
    p_numpy = (rho > 0.9).mean()
    ours = rho_null(keys, samples=2**19)
    assert not ours.exact and ours.samples == 2**19
    se = math.sqrt(p_numpy * (1 - p_numpy) / n) * math.sqrt(2)
    assert abs(ours.tail(0.9) - p_numpy) < 4 * se
    assert abs(null_tail(keys) - p_numpy) < 4 * math.sqrt(p_numpy / n)
    assert ours.sd == pytest.approx(1 / math.sqrt(keys - 1), rel=0.01)  # 2**19 draws: relative error ~0.1%


def test_null_tail_is_exact_up_to_the_enumeration_limit_and_tiny_beyond_the_table():
    for keys in range(2, EXACT_NULL_KEYS + 1):
        perms = np.array(list(itertools.permutations(range(keys))))
        rho = 1 - 6 * ((perms - np.arange(keys)) ** 2).sum(1) / (keys**3 - keys)
        assert null_tail(keys) == pytest.approx((rho > 0.9).mean(), abs=1e-15), keys
    assert math.isnan(null_tail(1))
    assert null_tail(64) == 0.0 and 0 < null_tail(16) < 1e-5


# --------------------------------------------------------------------------- compare_weights' new columns, float64


def _reference(attn: np.ndarray, nw: np.ndarray, term: np.ndarray | None, keep: np.ndarray) -> dict[str, float]:
    """The new statistics of one group of rows ``(R, K)`` in float64, ``keep`` ``(R, K)`` the kept keys."""
    values: dict[str, list[float]] = {}
    for a, w, kept, y in zip(attn, nw, keep, term if term is not None else [None] * len(attn), strict=True):
        a, w = a[kept], w[kept]
        k = len(a)
        if k < 2 or np.ptp(a) == 0 or np.ptp(w) == 0:
            continue  # no rank correlation
        rho = sps.spearmanr(a, w).statistic
        if y is not None:
            r = a.std() / y[kept].std()
        else:
            c = sps.pearsonr(a, w).statistic
            # documented: logits linear in each other to float32 precision (two keys) have r = +-inf
            r = math.copysign(math.inf, c) if abs(c) >= 1 - 1e-6 else c / math.sqrt(1 - c * c)
        perms = np.array(list(itertools.permutations(range(k))))
        null = 1 - 6 * ((perms - np.arange(k)) ** 2).sum(1) / (k**3 - k)
        row = {
            "rho": rho,
            "rho_baseline": _moran(r, k),
            "rows_rho_gt_0.9": float(rho > 0.9 + 1e-5),  # a row at exactly 0.9 is not above it (stats.ROW_TIE)
            "rows_rho_gt_0.9_null": (null > 0.9).mean(),
            "rows_rho_pos1": float(abs(rho - 1) < 1e-9),
            "rows_rho_neg1": float(abs(rho + 1) < 1e-9),
            "rows_rho_pos1_null": 1 / math.factorial(k),
        }
        if np.isfinite(r):
            values.setdefault("logit_ratio", []).append(r)
        for name, value in row.items():
            values.setdefault(name, []).append(value)
    out = {name: float(np.mean(v)) for name, v in values.items()}
    out["rho_excess"] = float(np.mean(np.subtract(values["rho"], values["rho_baseline"])))
    return out


@pytest.mark.parametrize("with_term", [True, False])
def test_new_columns_match_a_float64_recomputation_with_ragged_key_masks(with_term):
    g = torch.Generator().manual_seed(12)
    groups, rows, keys, dim = 3, 40, 6, 8
    q = torch.randn(groups, rows, dim, generator=g, dtype=torch.float64)
    k = torch.randn(groups, keys, dim, generator=g, dtype=torch.float64) * torch.rand(
        groups, keys, 1, generator=g, dtype=torch.float64
    )
    attn = q @ k.transpose(-1, -2) / math.sqrt(dim)
    term = ((k * k).sum(-1) / (2 * math.sqrt(dim))).unsqueeze(-2)  # (G, 1, K)
    nw = attn - term  # the NW ranks at any bandwidth
    keep = torch.ones(groups, rows, keys, dtype=torch.bool)
    keep[:, :15, 4:] = False  # rows of 4 keys: rho = +-1 is common
    keep[:, 15:25, 3:] = False  # rows of 3 keys
    keep[:, 25:30, 2:] = False  # rows of 2 keys
    s = compare_weights(attn, nw, key_mask=keep, key_term=term if with_term else None)
    for i in range(groups):
        expected = _reference(
            attn[i].numpy(), nw[i].numpy(), term[i].expand(rows, keys).numpy() if with_term else None, keep[i].numpy()
        )
        for name, value in expected.items():
            if name == "rho":
                name = "spearman"
            # float32 statistics of O(1) values: 1e-5
            assert _stat(s[i], name).item() == pytest.approx(value, abs=1e-5), (name, i)


def test_rows_at_plus_and_minus_one_are_counted_exactly():
    attn = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    nw = torch.tensor([[0.1, 0.2, 0.3, 0.4], [4.0, 3.0, 2.0, 1.0], [1.0, 3.0, 2.0, 4.0]])
    s = compare_weights(attn, nw)
    assert _stat(s, "rows_rho_pos1").item() == pytest.approx(1 / 3)
    assert _stat(s, "rows_rho_neg1").item() == pytest.approx(1 / 3)
    assert _stat(s, "rows_rho_gt_0.9").item() == pytest.approx(1 / 3)  # the third row has rho = 0.8
    assert _stat(s, "rows_rho_pos1_null").item() == pytest.approx(1 / 24)


def test_logit_ratio_scales_with_the_square_of_the_gauge_and_ignores_the_bandwidth():
    """Under q -> c q, k -> k / c the attention logits stay and the key-norm term scales by 1 / c^2, so r scales by
    c^2; the NW logits' bandwidth does not enter r."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 30, 8, generator=g)
    k = torch.randn(2, 5, 8, generator=g)

    def ratio(q, k, h):
        attn = q @ k.transpose(-1, -2) / math.sqrt(8)
        term = ((k * k).sum(-1) / (2 * math.sqrt(8))).unsqueeze(-2)
        nw = (q @ k.transpose(-1, -2) - (k * k).sum(-1).unsqueeze(-2) / 2) / h**2
        return _stat(compare_weights(attn, nw, key_term=term), "logit_ratio")

    base = ratio(q, k, 1.0)
    torch.testing.assert_close(ratio(q, k, 3.0), base, rtol=1e-6, atol=0)  # float32 sd of equal inputs
    torch.testing.assert_close(ratio(2 * q, k / 2, 1.0), 4 * base, rtol=1e-5, atol=0)  # float32 rounding of q·k
