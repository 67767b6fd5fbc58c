"""Coverage of every interval kind the project reports, simulated from a known truth (issue #52).

Each kind is drawn many times from a population whose parameter is written out here, at the sizes where the
project reports it, through the project's own function; its coverage must reach the nominal level less a Monte Carlo
allowance of three binomial standard errors of the replicate count. The same check runs on intervals known to fall
short (unadjusted bounds on a family, one standard error as a bound, Wald's interval near the edge, the percentile
bootstrap and the max-|z| band the cells' verdicts used before their bootstrap-t, the BCa bootstrap and the two-sample
percentile bootstrap the controls used before, Student's t over 8 seeds of a skewed change, the bootstrap-t below
``MIN_SETS``): there it must fail.
Simulated elsewhere (``tests/test_attribution_coverage.py``): the verdict shares' bounds, the Holm-compatible sign-flip
bounds (``holm_lower_bounds``: the aggregation table's and the matched controls'), the clustered Clopper-Pearson rate.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ipa_probe.attribution.analysis import (
    _fit_interval,
    _mean_interval,
    clopper_pearson,
    control_difference,
    exact_lower_bound,
    holm,
    holm_bounds,
    simultaneous_band,
)
from ipa_probe.experiments.heads import fit_exponent
from ipa_probe.experiments.matched_control import _pool_summary
from ipa_probe.intervention.grid import median_interval, t_interval
from ipa_probe.sweep.aggregation import MIN_SETS, bootstrap_ci, resample_counts, studentised
from ipa_probe.tiny.digits.following import interval as seed_interval

NOMINAL = 0.95
#: the held-out table's family: 12 binomial tests against 1/2 on the decided sets of each held-out half, as committed
#: (attribution_fresh.held_out over 96 fresh sets an organism: 9-32 decided)
HELD_OUT = Path(__file__).parents[1] / "docs/results/attribution_fresh/held_out.csv"
FAMILY_N = pd.read_csv(HELD_OUT).query("predictor == 'held out'")["decided"].to_numpy()
FAMILY_P = np.array([0.5, 0.5, 0.3, 0.5, 0.9, 0.9, 0.5, 0.7, 0.5, 0.5, 0.95, 0.5])


def check(covered, name: str, nominal: float = NOMINAL) -> float:
    """Coverage of ``covered`` (one bool per replicate) at least ``nominal`` less 3 binomial standard errors."""
    covered = np.asarray(covered, dtype=bool)
    allowance = 3 * math.sqrt(nominal * (1 - nominal) / covered.size)
    rate = float(covered.mean())
    assert rate >= nominal - allowance, (
        f"{name}: covered {rate:.3f} of {covered.size}, below {nominal} - {allowance:.3f}"
    )
    return rate


# ------------------------------------------------------------------------------------------ intervals, by kind
def exact_one_sided(rng, n: int, p: float, reps: int = 4000) -> np.ndarray:
    """The exact one-sided lower bound (attribution_fresh's ``agreement_low``) of ``k ~ Binomial(n, p)``."""
    return exact_lower_bound(rng.binomial(n, p, reps), n) <= p


def exact_two_sided(rng, n: int, p: float, reps: int = 4000) -> np.ndarray:
    """``clopper_pearson`` (the 2 + 2 example's rates, nw_quality's) of ``k ~ Binomial(n, p)``, looked up per ``k``."""
    table = np.array([clopper_pearson(k, n) for k in range(n + 1)])
    low, high = table[rng.binomial(n, p, reps)].T
    return (low <= p) & (p <= high)


def holm_family(rng, adjusted: bool = True, reps: int = 2000) -> np.ndarray:
    """The held-out table's bounds (``holm_bounds`` of exact bounds, null 1/2) cover all 12 true rates at once;
    ``adjusted=False``: each test's own 95 % exact bound instead."""
    k = rng.binomial(FAMILY_N, FAMILY_P, (reps, len(FAMILY_N)))
    covered = np.empty(reps, dtype=bool)
    for r in range(reps):
        p_holm = holm(stats.binom.sf(k[r] - 1, FAMILY_N, 0.5))
        if adjusted:
            low = holm_bounds(lambda level, r=r: exact_lower_bound(k[r], FAMILY_N, level), p_holm, 0.5)
            rejected = p_holm < 0.05  # a bound above 1/2 goes with Holm's rejection only, and a rejection with >= 1/2
            assert ((low > 0.5) <= rejected).all() and (rejected <= (low >= 0.5)).all()
        else:
            low = exact_lower_bound(k[r], FAMILY_N)
        covered[r] = (low <= FAMILY_P).all()
    return covered


def draw_sets(rng, shape: tuple[int, int], skewed: bool) -> np.ndarray:
    """Per-set values of mean 4: normal (sd 2) or, ``skewed``, gamma of shape 4 (skewness 1)."""
    return rng.gamma(4.0, 1.0, shape) if skewed else rng.normal(4.0, 2.0, shape)


def bootstrap_t(rng, sets: int, skewed: bool = False, reps: int = 4000) -> np.ndarray:
    """``_mean_interval`` (the cells' bootstrap-t over sets, 999 resamples) of a mean (4), one column per replicate."""
    _, low, high = _mean_interval(draw_sets(rng, (sets, reps), skewed), resample_counts(rng, 999, sets))
    return (low <= 4.0) & (4.0 <= high)


def percentile(rng, sets: int, reps: int = 4000) -> np.ndarray:
    """The percentile bootstrap over sets (999 resamples) the cells' intervals used before, written out here."""
    counts = resample_counts(rng, 999, sets)
    low, high = np.quantile(counts @ draw_sets(rng, (sets, reps), False) / sets, [0.025, 0.975], axis=0)
    return (low <= 4.0) & (4.0 <= high)


def bootstrap_mean(rng, sets: int, reps: int, skewed: bool = False) -> np.ndarray:
    """``bootstrap_ci`` (bootstrap-t over sets, 999 resamples here, 9,999 in the records) of a mean (4)."""
    x = draw_sets(rng, (reps, sets), skewed)
    bounds = np.array([bootstrap_ci(row, n_resamples=999, rng=np.random.default_rng(i)) for i, row in enumerate(x)])
    return (bounds[:, 0] <= 4.0) & (4.0 <= bounds[:, 1])


def bca(rng, sets: int, reps: int = 1000, skewed: bool = False) -> np.ndarray:
    """The BCa bootstrap over sets (999 resamples) that ``bootstrap_ci`` used before, written out here (scipy)."""
    result = stats.bootstrap(
        (draw_sets(rng, (reps, sets), skewed),), np.mean, axis=-1, n_resamples=999, batch=100, method="BCa", rng=rng
    )
    low, high = result.confidence_interval
    return (low <= 4.0) & (4.0 <= high)


def bootstrap_t_below(rng, sets: int, reps: int = 10_000) -> np.ndarray:
    """The bootstrap-t over ``sets`` < ``MIN_SETS`` skewed sets (``studentised``, 999 resamples), which
    ``bootstrap_ci`` and ``_mean_interval`` refuse (NaN) for its coverage there."""
    values = draw_sets(rng, (sets, reps), True)
    assert np.isnan(_mean_interval(values[:, :2], resample_counts(rng, 9, sets))[1]).all()
    assert np.isnan(bootstrap_ci(values[:, 0]))[0]
    covered = []
    for part in np.array_split(values, 5, axis=1):
        mean, se, t = studentised(part, resample_counts(rng, 999, sets))
        upper, lower = np.quantile(t, [0.975, 0.025], axis=0)
        covered.append((mean - upper * se <= 4.0) & (4.0 <= mean - lower * se))
    return np.concatenate(covered)


def unpaired(rng, sets: tuple[int, int], reps: int = 4000, welch: bool = True) -> np.ndarray:
    """``control_difference(paired=False)`` (Welch's t) of a true difference 0 between a skewed population of
    ``sets[0]`` sets and a normal one of ``sets[1]`` (same mean); ``welch=False``: the two-sample percentile bootstrap
    (999 resamples) it used before, written out here."""
    x, y = draw_sets(rng, (reps, sets[0]), True), rng.normal(4.0, 1.0, (reps, sets[1]))
    if welch:
        bounds = np.array(
            [[control_difference(a, b, False)[k] for k in ("low", "high")] for a, b in zip(x, y, strict=True)]
        )
        return (bounds[:, 0] <= 0) & (0 <= bounds[:, 1])
    draws = [np.take_along_axis(v[:, None], rng.integers(0, v.shape[1], (reps, 999, v.shape[1])), 2) for v in (x, y)]
    low, high = np.quantile(draws[0].mean(2) - draws[1].mean(2), [0.025, 0.975], axis=1)
    return (low <= 0) & (0 <= high)


def order_statistics(rng, seeds: int = 8, reps: int = 4000) -> np.ndarray:
    """``grid.median_interval`` ([min, max] over seeds: the 2 + 2 example's RMS changes) of a lognormal median (1)."""
    bounds = np.array([median_interval(row)[1:] for row in rng.lognormal(0.0, 0.5, (reps, seeds))])
    return (bounds[:, 0] <= 1.0) & (1.0 <= bounds[:, 1])


def over_sets(rng, by_set: bool, sets: int = 40, reps: int = 300) -> np.ndarray:
    """``bootstrap_ci`` (bootstrap-t) of a mean (0) over 4 references per set whose values share their set's effect
    (sd 1, the references' own sd 0.5), as the tables' one-reference ablation: of the set means (``by_set``), or of
    the rows."""
    x = rng.normal(0.0, 1.0, (reps, sets, 1)) + rng.normal(0.0, 0.5, (reps, sets, 4))
    values = x.mean(-1) if by_set else x.reshape(reps, -1)
    bounds = np.array([bootstrap_ci(v, n_resamples=999, rng=np.random.default_rng(i)) for i, v in enumerate(values)])
    return (bounds[:, 0] <= 0) & (0 <= bounds[:, 1])


def student_rates(rng, p: float, seeds: int = 5, reps: int = 2000, images: int = 100) -> np.ndarray:
    """``following.interval`` (Student's t over seeds, cut to [0, 1]) of a rate from ``images`` images a seed."""
    rates = rng.binomial(images, p, (reps, seeds)) / images
    bounds = [seed_interval(row, bounds=(0, 1)) for row in rates]
    return np.array([b["low"] <= p <= b["high"] for b in bounds])


def student_rms(rng, seeds: int, reps: int = 2000) -> np.ndarray:
    """``grid.t_interval`` (Student's t over seeds: the 2 + 2 example's RMS changes) of a lognormal mean."""
    truth = math.exp(0.5**2 / 2)
    bounds = np.array([t_interval(row)[1:] for row in rng.lognormal(0.0, 0.5, (reps, seeds))])
    return (bounds[:, 0] <= truth) & (truth <= bounds[:, 1])


def standard_error(rng, sets: int = 10, reps: int = 500, t_quantile: bool = True) -> np.ndarray:
    """``_pool_summary``'s ``difference`` and ``se`` over sets (query_pool.csv), as the one-sided t bound
    ``difference - t(0.95, sets - 1) se`` that findings.md section 4 decides on (``t_quantile=False``: one standard
    error, the bound the section once used) of a true difference 0.02 (normal per-set differences, sd 0.01)."""
    difference = rng.normal(0.02, 0.01, (reps, sets))
    cells = pd.DataFrame(
        {"organism": "o", "images": 3, "branch": "cond", "timestep": np.repeat(np.arange(reps), sets),
         "set": np.tile(np.arange(sets), reps), "difference": difference.ravel(), "pool_item": 0.7,
         "pool_branch": 0.7 + difference.ravel()}
    )  # fmt: skip
    summary = _pool_summary(cells)
    assert (summary["sets"] == sets).all()
    multiplier = stats.t.ppf(NOMINAL, sets - 1) if t_quantile else 1.0
    return (summary["difference"] - multiplier * summary["se"]).to_numpy() <= 0.02


def band(
    rng, sets: int, columns: int = 30, reps: int = 300, studentised: bool = True, skewed: bool = False
) -> np.ndarray:
    """``simultaneous_band`` (max-|t| bootstrap-t, 499 resamples) covers all ``columns`` true means (0) at once;
    ``studentised=False``: the former band, every resample scaled by the bootstrap standard error (max-|z|)."""
    covered = np.empty(reps, dtype=bool)
    for r in range(reps):
        values, counts = draw_sets(rng, (sets, columns), skewed) - 4.0, resample_counts(rng, 499, sets)
        if studentised:
            low, high = simultaneous_band(values, counts)
        else:
            boot = counts @ values / sets
            se = boot.std(0)
            q = np.quantile((np.abs(boot - values.mean(0)) / se).max(1), NOMINAL)
            low, high = values.mean(0) - q * se, values.mean(0) + q * se
        covered[r] = ((low <= 0) & (0 <= high)).all()
    return covered


def kernel_sets(rng, shape: tuple[int, ...], beta: float, concentration: float) -> tuple[np.ndarray, np.ndarray]:
    """Sets of 4 references ``N(0, I_16)`` and a point ``N(0, I_16)``: squared distances ``d`` and attention shares
    ``Dirichlet(concentration * softmax(-beta d))``. Their mean is ``softmax(-beta d)``, so the expected estimating
    equation ``E[(a - softmax(-b d)) . d]``, increasing in ``b``, is 0 at ``b = beta`` alone: the true fitted beta."""
    refs, x = rng.normal(0.0, 1.0, (*shape, 4, 16)), rng.normal(0.0, 1.0, (*shape, 1, 16))
    d = ((x - refs) ** 2).sum(-1)
    w = np.exp(-beta * (d - d.min(-1, keepdims=True)))
    g = rng.gamma(concentration * w / w.sum(-1, keepdims=True))
    return g / g.sum(-1, keepdims=True), d


def fitted_beta(rng, sets: int, beta: float, concentration: float, reps: int) -> np.ndarray:
    """``_fit_interval`` (summarize_attribution's fitted ``beta`` and its interval, 999 resamples) covers ``beta``."""
    shares, d = kernel_sets(rng, (reps, sets), beta, concentration)
    bounds = np.array([_fit_interval(shares[r], d[r], 999, r) for r in range(reps)])
    assert (bounds[:, 1] <= bounds[:, 0]).all() and (bounds[:, 0] <= bounds[:, 2]).all()
    return (bounds[:, 1] <= beta) & (beta <= bounds[:, 2])


def own_fit(shares: np.ndarray, d: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per leading index, the ``b >= 0`` solving ``sum_s weights_s (a_s - softmax(-b d_s)) . d_s = 0`` (the KL fit
    over sets counted ``weights`` times), by bisection on ``log b``; 0 where the sum is not negative at 0."""
    d = d - d.min(-1, keepdims=True)

    def equation(b: np.ndarray) -> np.ndarray:
        w = np.exp(-b[..., None, None] * d)
        return (weights * ((shares - w / w.sum(-1, keepdims=True)) * d).sum(-1)).sum(-1)

    scale, low, high = (
        1.0 / np.median(d.max(-1), axis=-1),
        np.full(weights.shape[:-1], -12.0),
        np.full(weights.shape[:-1], 6.0),
    )
    for _ in range(32):
        positive = equation(scale * np.exp((low + high) / 2)) > 0
        low, high = np.where(positive, low, (low + high) / 2), np.where(positive, (low + high) / 2, high)
    return np.where(equation(np.zeros_like(low)) >= 0, 0.0, scale * np.exp((low + high) / 2))


def percentile_fit(rng, sets: int, beta: float, concentration: float, reps: int) -> np.ndarray:
    """The percentile bootstrap over sets (199 resamples) of the fitted ``beta`` that ``_fit_interval`` used before,
    written out here (:func:`own_fit`)."""
    shares, d = kernel_sets(rng, (reps, sets), beta, concentration)
    boot = own_fit(shares[:, None], d[:, None], resample_counts(rng, 199, sets)[None].astype(float))  # (reps, B)
    low, high = np.quantile(boot, [0.025, 0.975], axis=1)
    return (low <= beta) & (beta <= high)


def exponent(rng, points: int, reps: int = 1000, normal: bool = False) -> np.ndarray:
    """``heads.fit_exponent`` (least squares of log MMD^2 on log m, Student's t with ``points - 2`` degrees of
    freedom) of the exponent 0.6 in ``MMD^2 = 2 m^-0.6`` times lognormal noise (sd 0.3) at the tiers' support sizes
    (``heads_ms``: 5, 10, 25 and, full tier, 50, 100); ``normal``: 1.96 standard errors instead."""
    ms = np.array([5, 10, 25, 50, 100][:points], dtype=float)
    fits = [fit_exponent(list(ms), list(row)) for row in 2.0 * ms**-0.6 * rng.lognormal(0.0, 0.3, (reps, points))]
    alpha, half = np.array([[f["alpha"], (f["high"] - f["low"]) / 2] for f in fits]).T
    half = half * (1.96 / stats.t.ppf(0.975, points - 2) if normal else 1.0)
    return np.abs(alpha - 0.6) <= half


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("n", [5, 11, 14])
@pytest.mark.parametrize("p", [0.5, 0.75, 0.95])
def test_exact_bounds_cover(n, p):
    rng = np.random.default_rng([n, int(100 * p)])
    check(exact_one_sided(rng, n, p), f"exact one-sided, n={n}, p={p}")
    check(exact_two_sided(rng, n, p), f"Clopper-Pearson, n={n}, p={p}")


def test_exact_lower_bound_is_scipys():
    for n in (1, 5, 14):
        for k in range(n + 1):
            expected = stats.binomtest(k, n, alternative="greater").proportion_ci(method="exact").low
            assert exact_lower_bound(k, n) == pytest.approx(expected, abs=1e-12)
    assert np.isnan(exact_lower_bound(0, 0)) and np.isnan(clopper_pearson(0, 0)).all()
    with pytest.raises(ValueError, match="between 0 and the trials"):
        clopper_pearson(9, 8)


def test_holm_compatible_exact_bounds_cover_the_whole_family():
    check(holm_family(np.random.default_rng(52)), "Holm-compatible exact bounds, all 12 at once")


def test_bootstraps_and_t_intervals_cover_at_the_sizes_decided_on():
    """The cells' bootstrap-t over 8 (``MIN_SETS``), 10, 20 and 40 sets (the attribution folders' populations; normal
    and skewed) and the max-|t| bootstrap-t band over 30 means at 6 (the smoke tier's control populations), 20 and
    100 sets (the verdict shares' bounds); ``bootstrap_ci``'s bootstrap-t (the controls' paired rows, the comparisons'
    gap, the ip-adapter tables) at 8, 10 and 20 sets and 100 (normal), and at 40 sets (the attribution tables) over
    the set means of references that share a set; the BCa bootstrap of the full tier's ip-adapter records at their
    100 sets (at their 40 it falls short: below); Welch's t of the unpaired controls at 20 + 20 and 40 + 20 sets
    (one side skewed); the order-statistic interval of a skewed median over 8 seeds (the 2 + 2 example);
    Student's t over 5 seeds of 100 images and of 20 (mixed_following) covers the rate (organism.md's rates); the
    standard error with its t quantile covers (section 4); the heads' fitted exponent's t interval covers."""
    rng = np.random.default_rng(7)
    for sets in (MIN_SETS, 10, 20, 40):
        check(bootstrap_t(rng, sets), f"bootstrap-t, {sets} sets")
        check(bootstrap_t(rng, sets, skewed=True), f"bootstrap-t, {sets} sets, skewed")
    check(band(rng, 6, skewed=True), "max-|t| band, 30 means, 6 sets, skewed")
    check(band(rng, 20), "max-|t| band, 30 means, 20 sets")
    check(band(rng, 100), "max-|t| band, 30 means, 100 sets")
    for sets in (MIN_SETS, 10, 20):
        check(bootstrap_mean(rng, sets, 1000, skewed=True), f"bootstrap_ci, {sets} sets, skewed")
    check(bootstrap_mean(rng, 100, 600), "bootstrap_ci, 100 sets")
    check(bca(rng, 100, 2000, skewed=True), "BCa, 100 sets, skewed")  # the full tier's ip-adapter records
    check(over_sets(rng, by_set=True), "bootstrap_ci over 40 sets' means, 4 references a set")
    for sets in ((20, 20), (40, 20)):  # the full tier's controls (the smoke tier's 6 + 10 get none)
        check(unpaired(rng, sets, reps=1500), f"Welch's t, {sets[0]} + {sets[1]} sets")
    check(order_statistics(rng), "[min, max] of a median over 8 seeds")
    for p in (0.5, 0.75, 0.96):
        check(student_rates(rng, p), f"Student's t over 5 seeds, rate {p}")
    for p in (0.14, 0.5, 0.87):  # mixed_following: 10 sets x 2 images a seed (organism.md's mixed-reference table)
        check(student_rates(rng, p, images=20), f"Student's t over 5 seeds of 20 images, rate {p}")
    for points in (3, 5):
        check(exponent(rng, points), f"the heads' exponent over {points} support sizes")
    check(standard_error(rng), "one-sided t bound from the standard error, 10 sets")


def test_fitted_bandwidth_interval_covers_at_the_sets_of_the_attribution_tables():
    """The fitted ``beta``'s interval at the ip-adapter tables' 10, 20, 40 and 100 sets (and the controls' 20 and
    40): attention near uniform as in the committed tables (TV from uniform about 0.02) with a true ``beta`` of 0 (the
    usual fit there) and 0.01 (a mild lean to the nearer references), and noisier, sharper shares (``beta`` 0.1).
    The percentile bootstrap of the fit it replaced falls short at 10 sets."""
    rng = np.random.default_rng(52)
    for beta, concentration, reps in ((0.0, 1000.0, 100), (0.01, 1000.0, 200), (0.1, 5.0, 200)):
        for sets in (10, 20, 40, 100):
            check(fitted_beta(rng, sets, beta, concentration, reps), f"fitted beta {beta}, {sets} sets")
    shares, d = kernel_sets(rng, (3, 20), 0.1, 5.0)  # the must-fail control's own fit is the package's
    fits = [_fit_interval(a, x, 9, 0)[0] for a, x in zip(shares, d, strict=True)]
    assert own_fit(shares, d, np.ones((3, 20))) == pytest.approx(fits, rel=1e-6)
    with pytest.raises(AssertionError, match="below 0.95"):
        check(percentile_fit(rng, 10, 0.1, 5.0, 200), "percentile bootstrap of the fitted beta, 10 sets")


@pytest.mark.parametrize(
    "name, draw",
    [
        ("unadjusted exact bounds over the family of 12", lambda rng: holm_family(rng, adjusted=False)),
        ("one standard error as a bound", lambda rng: standard_error(rng, t_quantile=False)),
        ("Wald's interval, n=11, p=0.9", lambda rng: wald(rng, 11, 0.9)),
        ("percentile bootstrap, 10 sets", lambda rng: percentile(rng, 10)),
        ("percentile bootstrap, 20 sets", lambda rng: percentile(rng, 20)),
        ("BCa, 10 sets", lambda rng: bca(rng, 10)),
        ("BCa, 20 sets", lambda rng: bca(rng, 20, 2000)),
        ("BCa, 40 sets, skewed", lambda rng: bca(rng, 40, 4000, skewed=True)),
        ("bootstrap-t, 6 sets, skewed", lambda rng: bootstrap_t_below(rng, 6)),
        ("two-sample percentile bootstrap, 10 + 10 sets", lambda rng: unpaired(rng, (10, 10), welch=False)),
        ("bootstrap-t over the rows of 40 sets, 4 references a set", lambda rng: over_sets(rng, by_set=False)),
        ("Student's t over 8 seeds of a lognormal", lambda rng: student_rms(rng, 8)),
        ("the former max-|z| band, 30 means, 20 sets", lambda rng: band(rng, 20, studentised=False)),
        (
            "1.96 standard errors for the heads' exponent, 3 support sizes",
            lambda rng: exponent(rng, 3, 200, normal=True),
        ),
    ],
)
def test_the_check_fails_where_an_interval_falls_short(name, draw):
    with pytest.raises(AssertionError, match="below 0.95"):
        check(draw(np.random.default_rng(11)), name)


def wald(rng, n: int, p: float, reps: int = 4000) -> np.ndarray:
    """Wald's normal interval ``k/n -/+ 1.96 sqrt(q (1 - q) / n)``: known to fall short near 0 and 1."""
    q = rng.binomial(n, p, reps) / n
    half = 1.96 * np.sqrt(q * (1 - q) / n)
    return (q - half <= p) & (p <= q + half)
