"""Coverage of the attribution intervals and of the rates' clustered interval, simulated from a known truth (issue #52
point 3).

Each interval is checked where its decision lives: the verdict shares' simultaneous bounds against the true share
of cells on each side of the rule, and the Holm-compatible one-sided bounds against every true mean of a family at
once. Each check is run on a known-bad interval as well and must fail there: the percentile bootstrap that re-takes
every cell's decision (the verdict shares' former interval), and one-sided bounds unadjusted for the family.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from ipa_probe.attribution import (
    POOLING_TV,
    clopper_pearson,
    clustered_clopper_pearson,
    holm,
    holm_lower_bounds,
    sign_flip_test,
    verdict_shares,
)

SETS, REFS, REPLICATES = 20, 4, 60
#: per cell, the true mean TV from uniform and the true mean Spearman with the posterior's ranking
TRUE_TV = np.repeat([0.03, 0.04, 0.048, 0.052, 0.06, 0.1], 4)
TRUE_RHO = np.tile([0.0, 0.25, 0.6, 1.0], 6)
PROFILE = np.array([3.0, 1.0, -1.0, -3.0]) / 16  # TV of 0.25 + a * PROFILE (any order) is a / 4


def true_shares() -> dict[str, float]:
    """The rule applied to the population means, per cell, then counted (truth written out from the constants)."""
    pooling = TRUE_TV < POOLING_TV
    tracks = ~pooling & (TRUE_RHO > 0)
    return {"pooling": pooling.mean(), "tracks_posterior": tracks.mean(), "undecided": (~pooling & ~tracks).mean()}


def draw(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Shares ``(S, C, R)`` whose cell means are known exactly: TV is ``a / 4`` with ``E a = 4 TRUE_TV``; the shares
    follow the posterior's ranking (Spearman +1) with probability ``TRUE_RHO`` and a uniform random order (Spearman
    0 on average) otherwise."""
    distance = rng.uniform(0, 50, (SETS, REFS))
    nearest_first = np.argsort(distance, -1)  # (S, R)
    cells = len(TRUE_TV)
    shares = np.empty((SETS, cells, REFS))
    for s in range(SETS):
        for c in range(cells):
            a = 4 * TRUE_TV[c] * rng.uniform(0.5, 1.5)
            order = nearest_first[s] if rng.random() < TRUE_RHO[c] else rng.permutation(REFS)
            shares[s, c, order] = 0.25 + a * PROFILE
    return shares, distance


def redecided_interval(shares: np.ndarray, distance: np.ndarray, outer: int, seed: int) -> dict[str, float]:
    """The known-bad interval: each cell's decision re-taken on bootstrap resamples of the sets (here with the
    per-cell percentile rule recomputed inside every resample), percentile interval of the shares."""
    rng = np.random.default_rng(seed)
    tv = 0.5 * np.abs(shares - 0.25).sum(-1)  # (S, C)
    rho = np.array([[stats.spearmanr(shares[s, c], -distance[s]).statistic for c in range(shares.shape[1])]
                    for s in range(SETS)])  # fmt: skip
    decided = []
    for _ in range(outer):
        index = rng.integers(0, SETS, SETS)
        inner = rng.integers(0, SETS, (99, SETS))
        high = np.quantile(tv[index][inner].mean(1), 0.975, axis=0)
        low = np.quantile(rho[index][inner].mean(1), 0.025, axis=0)
        pooling = high < POOLING_TV
        decided.append((pooling.mean(), (~pooling & (low > 0)).mean()))
    decided = np.array(decided)
    out = {}
    for j, key in enumerate(("pooling", "tracks_posterior")):
        out[f"{key}_low"], out[f"{key}_high"] = np.quantile(decided[:, j], [0.025, 0.975])
    return out


def covered(result: dict[str, float], truth: dict[str, float], keys) -> bool:
    return all(result[f"{k}_low"] - 1e-12 <= truth[k] <= result[f"{k}_high"] + 1e-12 for k in keys)


def test_verdict_share_bounds_cover_the_true_shares():
    truth = true_shares()
    assert truth == pytest.approx({"pooling": 0.5, "tracks_posterior": 0.375, "undecided": 0.125})
    rng = np.random.default_rng(52)
    hits, bad_hits = 0, 0
    for replicate in range(REPLICATES):
        shares, distance = draw(rng)
        result = verdict_shares(shares, distance, permutations=199, resamples=199, outer=499, seed=replicate)
        hits += covered(result, truth, ("pooling", "tracks_posterior", "undecided"))
        if replicate < 20:
            bad = redecided_interval(shares, distance, outer=99, seed=replicate)
            bad_hits += covered(bad, truth, ("pooling", "tracks_posterior"))
    # nominal 95 % simultaneous: P(at most 50 of 60 | 0.95) = 0.003
    assert hits >= 51, f"simultaneous bounds covered the true shares in {hits} of {REPLICATES}"
    # the check has power: the re-decided percentile interval covers far less often
    assert bad_hits <= 10, f"the re-decided interval covered in {bad_hits} of 20: the check cannot fail"


def _set_spearman(rng: np.random.Generator, rho: float, sets: int, references: int = 4) -> np.ndarray:
    """Per set, the Spearman over ``references`` of a predictor and an effect drawn with correlation ``rho``: the
    tables' per-set values, discrete and skewed towards -1 where ``rho`` is large."""
    pairs = rng.multivariate_normal([0.0, 0.0], [[1.0, rho], [rho, 1.0]], size=(sets, references))
    ranks = pairs.argsort(1).argsort(1).astype(np.float64)  # (sets, references, 2)
    return 1 - 6 * ((ranks[..., 0] - ranks[..., 1]) ** 2).sum(1) / (references * (references**2 - 1))


def test_holm_lower_bounds_cover_every_mean_of_the_family():
    """A comparisons-shaped family: 6 one-sided sign-flip tests of the per-set Spearman over 40 sets of 4 references,
    3 with no association (mean 0) and 3 with some (mean ~0.25, ~0.5, ~0.75, skewed), decided by Holm on the tests' own
    p: the bounds (each test inverted) cover all 6 true means at once in at least 95 % of families (binomial slack),
    a bound above 0 goes with a rejection only; the unadjusted 95 % one-sided bounds of the same tests miss far more
    often."""
    rhos = [0.0, 0.0, 0.0, 0.35, 0.65, 0.9]
    rng = np.random.default_rng(7)
    means = np.array([_set_spearman(rng, rho, 200_000).mean() if rho else 0.0 for rho in rhos])
    families, hits, naive_hits = 300, 0, 0
    for family in range(families):
        tests = [sign_flip_test(_set_spearman(rng, rho, 40), permutations=1999, seed=family) for rho in rhos]
        p_holm = holm(np.array([p for p, _ in tests]))
        bounds = holm_lower_bounds([null for _, null in tests], p_holm)
        assert ((bounds > 0) <= (p_holm < 0.05)).all() and ((p_holm < 0.05) <= (bounds >= 0)).all()
        hits += bool((bounds <= means).all())
        naive = np.array([null[int(np.ceil(0.05 * len(null))) - 1] for _, null in tests])  # each at 5 %
        naive_hits += bool((naive <= means).all())
    assert hits >= 276, f"{hits} of {families}"  # P(at most 275 | 0.95) = 0.01
    assert naive_hits <= 260, f"unadjusted bounds covered {naive_hits} of {families}: the check cannot fail"


def _clustered_rates(rng: np.random.Generator, p: float, icc: float, clusters: int, size: int) -> np.ndarray:
    """Successes per cluster: each cluster's own rate drawn from a beta of mean ``p`` and intra-cluster correlation
    ``icc`` (the images of one reference set alike), then ``size`` Bernoulli trials at it."""
    a, b = p * (1 - icc) / icc, (1 - p) * (1 - icc) / icc
    return rng.binomial(size, rng.beta(a, b, clusters))


@pytest.mark.parametrize("p", [0.15, 0.5, 0.8])
def test_clustered_rate_interval_covers_where_the_plain_one_does_not(p):
    """nw_quality's shape (10 reference sets x 2 seeds), sets strongly alike: the clustered interval covers the true
    rate at least 95% of the time (Monte Carlo margin), the plain Clopper-Pearson over the 20 images falls short."""
    rng = np.random.default_rng(52)
    reps, clusters, size = 600, 10, 2
    hits = np.zeros(2)
    for _ in range(reps):
        x = _clustered_rates(rng, p, 0.9, clusters, size)
        bounds = (clustered_clopper_pearson(x, np.full(clusters, size)), clopper_pearson(x.sum(), clusters * size))
        hits += [low <= p <= high for low, high in bounds]
    clustered, plain = hits / reps
    assert clustered >= 0.95 - 2 * np.sqrt(0.05 * 0.95 / reps), clustered
    assert plain < clustered - 0.02, (plain, clustered)


def test_clustered_rate_interval_inside_0_1_and_widens_with_clustering():
    assert clustered_clopper_pearson([0, 0, 0], [2, 2, 2])[0] == 0.0
    assert clustered_clopper_pearson([2, 2, 2], [2, 2, 2])[1] == 1.0
    alike = clustered_clopper_pearson([2, 2, 0, 0, 2, 0, 2, 0, 2, 0], [2] * 10)  # 10 of 20, sets all-or-nothing
    mixed = clustered_clopper_pearson([1] * 10, [2] * 10)  # 10 of 20, every set split
    plain = clopper_pearson(10, 20)
    assert 0 <= alike[0] < plain[0] and plain[1] < alike[1] <= 1
    assert alike[1] - alike[0] > mixed[1] - mixed[0]
    assert np.isnan(clustered_clopper_pearson([1], [2])).all()
