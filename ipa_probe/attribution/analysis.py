"""Gauge-invariant comparisons of the attention with the exact posterior over the references (issue #18 point 3).

Input: the tables of :func:`~.collect.reference_attribution` for many reference sets, stacked with a ``set`` column
(:func:`~.collect.sets_table`). Per timestep, with ``A[s, l, i]`` the attention share of reference ``i`` in layer
``l`` for set ``s``, ``a[s, i] = mean_l A[s, l, i]``, ``w[s, i]`` the exact posterior and ``d[s, i]`` the squared
data-space distance ``|x_t / alpha_t - s_i|^2``: reference attribution (``share_spearman``, ``layer_agreement``,
``tv_attention_posterior``), concentration (``attention_tv``, ``posterior_tv``), sharpness over time (the ``*_neff``
columns) and the fitted data-space temperature (:func:`fit_bandwidth`), each column defined in docs/attribution.md
("The observational comparison"); and the :func:`verdict`, a rule stated before the data were seen
(:data:`POOLING_TV`, :data:`ALPHA`; "The verdict" there), per cell in :func:`cell_verdicts` and :func:`verdict_shares`.

Every quantity is a function of the attention weights and the latents, so it does not move under a q/k gauge
change (``to_q`` times c, ``to_k``/``to_k_ip`` divided by c).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import optimize, stats

from ..sweep.aggregation import MIN_SETS, bootstrap_ci, resample_counts, studentised
from .collect import arrays

__all__ = [
    "ALPHA",
    "POOLING_TV",
    "VERDICTS",
    "cell_shares",
    "cell_verdicts",
    "clopper_pearson",
    "clustered_clopper_pearson",
    "holm",
    "holm_lower_bounds",
    "sign_flip_test",
    "control_difference",
    "simultaneous_band",
    "verdict_shares",
    "fit_bandwidth",
    "layer_agreement_test",
    "neff",
    "paired_rank_test",
    "summarize_attribution",
    "summarize_cells",
    "tv_from_uniform",
    "value_range",
    "verdict",
]

#: Significance level of the verdict's permutation test (one-sided).
ALPHA = 0.05
#: The verdict's pooling threshold: the upper end of the interval of the mean TV distance from uniform.
POOLING_TV = 0.05
#: The verdict's values.
VERDICTS: tuple[str, ...] = ("pooling", "tracks posterior", "undecided")


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjustment of one family of p-values (strong control of the family-wise error rate).

    With the ``m`` finite p-values sorted, ``p_(1) <= ... <= p_(m)``, the adjusted value of ``p_(i)`` is
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``; a hypothesis is rejected at level ``alpha`` exactly when its adjusted
    p is below ``alpha``. NaN entries (no test) stay NaN and do not count towards ``m``. Returns the ``(m,)`` adjusted
    p-values in the input's order.
    """
    values = np.asarray(p, dtype=np.float64)
    out = np.full(values.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(values))
    order = finite[np.argsort(values[finite], kind="stable")]
    m = len(order)
    scaled = np.minimum(1.0, (m - np.arange(m)) * values[order])
    out[order] = np.maximum.accumulate(scaled)
    return out


def holm_bounds(bound_at, p_holm: np.ndarray, null: float = 0.0, alpha: float = ALPHA) -> np.ndarray:
    """Lower bounds compatible with Holm's decisions on one family of one-sided tests of "parameter <= ``null``"
    (Strassburger and Bretz): with ``I`` the hypotheses Holm retains (``p_holm >= alpha``), a retained one's bound is
    its one-sided bound at level ``alpha / |I|`` capped at ``null``, a rejected one's ``null`` (``max(null, bound at
    alpha / m)`` when all are rejected). All hold together with probability at least ``1 - alpha``; a bound above
    ``null`` goes with a rejection only. ``bound_at(level)``: the ``(m,)`` unadjusted bounds at ``level``; ``p_holm``:
    the family's adjusted p (NaN: no test). Returns ``(m,)`` bounds (NaN: no test or no bound)."""
    adjusted = np.asarray(p_holm, dtype=np.float64)
    tested = np.isfinite(adjusted)
    rejected = tested & (adjusted < alpha)
    kept = int((tested & ~rejected).sum())
    bound = np.asarray(bound_at(alpha / (kept or int(tested.sum()) or 1)), dtype=np.float64)
    out = np.where(rejected, null if kept else np.maximum(null, bound), np.minimum(null, bound))
    return np.where(tested & ~np.isnan(bound), out, np.nan)


def sign_flip_test(values, permutations: int = 49999, seed: int = 0) -> tuple[float, np.ndarray]:
    """One-sided sign-flip test of "centre <= 0" over independent values (NaN left out; each symmetric about the
    centre under the null, as a Spearman is under no association) and its null: the sorted means of the flipped values,
    one per sign pattern (-inf: none flipped; all ``2**S`` patterns where at most ``permutations + 1``, else none and
    ``permutations`` random ones). "centre <= d" is rejected at a level above the share of flipped means <= d: ``p``
    is the share at 0; :func:`holm_lower_bounds` inverts the same patterns. ``(nan, empty)``: under 2 values."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if len(v) < 2:
        return math.nan, np.empty(0)
    if 2 ** len(v) <= permutations + 1:
        flips = (np.arange(2 ** len(v))[:, None] >> np.arange(len(v))) & 1
    else:
        flips = np.vstack([np.zeros(len(v)), np.random.default_rng(seed).random((permutations, len(v))) < 0.5])
    means = np.where(flips.any(1), flips @ v / np.maximum(flips.sum(1), 1), -np.inf)
    null = np.sort(np.where(np.abs(means) <= 1e-12, 0.0, means))  # 1e-12: a flipped mean of 0 up to rounding
    return float(np.searchsorted(null, 0.0, side="right") / len(null)), null


def holm_lower_bounds(nulls: list[np.ndarray], p_holm: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """:func:`holm_bounds` of the centres tested by :func:`sign_flip_test` (``nulls``: each test's null): the smallest
    centre the test keeps at a level, its ``k``-th smallest flipped mean with ``k / N`` the first share at or above the
    level: above 0 only where Holm rejects the whole family (NaN: no test; -inf: no pattern can reject)."""

    def bound_at(level: float) -> np.ndarray:
        first = [np.searchsorted(np.arange(len(n) + 1) / max(len(n), 1), level) for n in nulls]
        return np.array([n[k - 1] if len(n) else math.nan for n, k in zip(nulls, first, strict=True)])

    return holm_bounds(bound_at, p_holm, 0.0, alpha)


def exact_lower_bound(successes, trials, level: float = ALPHA) -> np.ndarray:
    """The exact (Clopper-Pearson) one-sided lower bound ``Beta(level; k, n - k + 1)`` (0: k = 0; NaN: n = 0)."""
    k, n = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    if not ((k >= 0) & (k <= n)).all():
        raise ValueError(f"successes: expected counts between 0 and the trials ({n}), got {k}")
    return np.where(n > 0, np.where(k > 0, stats.beta.ppf(level, np.maximum(k, 1), n - k + 1), 0.0), np.nan)


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a binomial proportion, :func:`exact_lower_bound` on each side: inside
    ``[0, 1]`` by construction (Student's t on 0/1 outcomes is not). ``(nan, nan)`` for no trials."""
    low, high = exact_lower_bound([successes, trials - successes], trials, (1 - confidence) / 2)
    return float(low), 1 - float(high)


def clustered_clopper_pearson(successes, trials, confidence: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson interval of a proportion whose trials come in clusters (images that share a reference
    set), by Korn and Graubard's effective sample size: the pooled proportion ``p = sum x_c / sum n_c``, its
    between-cluster variance ``v = C / (C - 1) sum (x_c - p n_c)^2 / N^2``, ``n* = min(N, p (1 - p) / v)`` scaled by
    ``(z / t_{C-1})^2`` for the clusters' degrees of freedom, and the exact interval of ``p n*`` successes in ``n*``
    trials (beta quantiles; ``n*`` need not be whole). Inside ``[0, 1]``, never narrower than the clusters' spread
    allows; with clusters no more alike than independent trials it is about the plain interval. ``(nan, nan)`` for no
    trials or fewer than 2 clusters.

    Args:
        successes, trials: per cluster, equal lengths.
    """
    x = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    total, clusters = n.sum(), len(n)
    if total <= 0 or clusters < 2:
        return math.nan, math.nan
    p = x.sum() / total
    v = clusters / (clusters - 1) * ((x - p * n) ** 2).sum() / total**2
    n_eff = min(total, p * (1 - p) / v) if v > 0 else total
    tail = (1 - confidence) / 2
    n_eff *= (stats.norm.ppf(1 - tail) / stats.t.ppf(1 - tail, clusters - 1)) ** 2
    return clopper_pearson(p * n_eff, n_eff, confidence)


def neff(weights: np.ndarray) -> np.ndarray:
    """Effective number of references ``1 / sum_i w_i^2`` over the last axis."""
    w = np.asarray(weights, dtype=np.float64)
    return 1.0 / (w**2).sum(-1)


def value_range(statistic: str, references: int) -> tuple[float, float]:
    """The range of one set's ``statistic`` over ``references`` references, hence of a mean over sets: every
    interval of such a mean is cut to it (the ``bounds`` of :func:`~ipa_probe.sweep.aggregation.bootstrap_ci`).
    ``*_neff``: ``[1, R]``; ``attention_tv`` / ``posterior_tv`` (from uniform): ``[0, 1 - 1/R]``;
    ``tv_attention_posterior`` and the ``*_tv_above`` shares of cells: ``[0, 1]``; ``share_spearman`` and
    ``layer_agreement``: ``[-1, 1]``. A difference of two values of one statistic ranges over ``±(high - low)``."""
    r = float(references)
    if statistic.endswith("_neff"):
        return 1.0, r
    if statistic in ("attention_tv", "posterior_tv"):
        return 0.0, 1.0 - 1.0 / r
    if statistic == "tv_attention_posterior" or statistic.endswith("_tv_above"):
        return 0.0, 1.0
    if statistic in ("share_spearman", "layer_agreement"):
        return -1.0, 1.0
    raise ValueError(f"value_range: no range known for {statistic!r}")


def tv_from_uniform(weights: np.ndarray) -> np.ndarray:
    """Total-variation distance ``0.5 sum_i |w_i - 1/R|`` of each weight vector (last axis) from uniform."""
    w = np.asarray(weights, dtype=np.float64)
    return 0.5 * np.abs(w - 1.0 / w.shape[-1]).sum(-1)


def _standard_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks along the last axis (ties averaged), centred and scaled to unit norm; rows without spread are NaN."""
    ranks = stats.rankdata(x, axis=-1)
    centred = ranks - ranks.mean(-1, keepdims=True)
    norm = np.sqrt((centred**2).sum(-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norm > 0, centred / norm, np.nan)


def paired_rank_test(x: np.ndarray, y: np.ndarray, permutations: int = 4999, seed: int = 0) -> dict[str, float]:
    """Per set, Spearman between ``x[s]`` and ``y[s]``; their mean, its bootstrap interval and a permutation p-value.

    The null permutes ``y[s]`` independently within every set (the references carry no order), and the p-value is
    one-sided, ``(1 + #{null mean >= observed}) / (1 + permutations)``. ``x``, ``y``: ``(S, R)`` values per set and
    reference; sets where either has no spread are left out. Returns ``{"mean", "low", "high", "p", "sets",
    "values"}``: ``values`` ``(S,)`` the per-set Spearman (NaN for sets left out); the others NaN where fewer than 2
    sets are usable.
    """
    zx, zy = _standard_ranks(x), _standard_ranks(y)
    usable = np.isfinite(zx).all(-1) & np.isfinite(zy).all(-1)
    values = np.where(usable, (np.nan_to_num(zx) * np.nan_to_num(zy)).sum(-1), np.nan)
    zx, zy = zx[usable], zy[usable]
    per_set = values[usable]  # Spearman per usable set
    out = {"mean": math.nan, "low": math.nan, "high": math.nan, "p": math.nan, "sets": int(usable.sum())}
    out["values"] = values
    if len(per_set) < 2:
        return out
    observed = float(per_set.mean())
    rng = np.random.default_rng(seed)
    sets, refs = zx.shape
    exceed = 0
    for start in range(0, permutations, 1000):
        draws = min(1000, permutations - start)
        order = rng.random((draws, sets, refs)).argsort(-1)  # (D, S, R) independent permutations
        null = (zx[None] * np.take_along_axis(np.broadcast_to(zy, order.shape), order, -1)).sum(-1).mean(-1)
        exceed += int((null >= observed - 1e-12).sum())  # 1e-12: the identity permutation reproduces the sum
    out.update(mean=observed, p=(1 + exceed) / (1 + permutations))
    out["low"], out["high"] = bootstrap_ci(per_set, bounds=(-1.0, 1.0))
    return out


def layer_agreement_test(shares: np.ndarray, permutations: int = 4999, seed: int = 0) -> dict[str, float]:
    """Between-layer agreement of the reference ranking of ``shares`` ``(S, L, R)``: per set, the mean Spearman over
    every pair of layers. Returns ``{"mean", "low", "high", "p", "sets"}``: the mean over sets, its bootstrap interval
    and a one-sided permutation p-value (each layer's shares permuted independently within every set)."""
    z = _standard_ranks(shares)  # (S, L, R)
    usable = np.isfinite(z).all((-1, -2))
    z = z[usable]
    out = {"mean": math.nan, "low": math.nan, "high": math.nan, "p": math.nan, "sets": int(usable.sum())}
    sets, layers, refs = z.shape
    if sets < 2 or layers < 2:
        return out

    def pairwise(zz: np.ndarray) -> np.ndarray:  # (..., L, R) -> (...,): mean over l != l' of z_l . z_l'
        total = zz.sum(-2)
        return ((total**2).sum(-1) - layers) / (layers * (layers - 1))

    per_set = pairwise(z)
    observed = float(per_set.mean())
    rng = np.random.default_rng(seed)
    exceed = 0
    for start in range(0, permutations, 200):
        draws = min(200, permutations - start)
        order = rng.random((draws, sets, layers, refs)).argsort(-1)
        null = pairwise(np.take_along_axis(np.broadcast_to(z, order.shape), order, -1)).mean(-1)
        exceed += int((null >= observed - 1e-12).sum())
    out.update(mean=observed, p=(1 + exceed) / (1 + permutations))
    out["low"], out["high"] = bootstrap_ci(per_set, bounds=(-1.0, 1.0))
    return out


def _psi(beta: float, shares: np.ndarray, distance: np.ndarray) -> np.ndarray:
    """Per set ``(a_s - w_s(beta)) . d_s``, the derivative in ``beta`` of ``KL(a_s || w_s(beta))``, ``w_s(beta) =
    softmax(-beta d_s)`` (``d_s`` shifted to 0 at its nearest reference, where ``beta = inf`` puts all weight)."""
    logits = np.where(distance > 0, -beta * distance, 0.0)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return ((shares - w) * distance).sum(-1)


def _kl_gradient(beta: float, shares: np.ndarray, distance: np.ndarray, margin: float = 0.0) -> float:
    """The sum of :func:`_psi` over sets plus ``margin`` standard errors of it (0: the fit's estimating equation)."""
    psi = _psi(beta, shares, distance)
    return float(psi.sum() + margin * psi.std(ddof=1) * math.sqrt(len(psi))) if margin else float(psi.sum())


def _root(shares: np.ndarray, distance: np.ndarray, margin: float = 0.0, low: float = 0.0) -> float:
    """Where :func:`_kl_gradient` turns positive above ``low`` (Brent's method in the first bracket of a doubling
    search): ``low`` where it is not negative there, ``inf`` where it stays negative."""
    if math.isinf(low) or _kl_gradient(low, shares, distance, margin) >= 0:
        return low
    high = max(2 * low, 1.0 / (float(np.median(distance.max(-1))) or 1.0))
    for _ in range(200):
        if _kl_gradient(high, shares, distance, margin) > 0:
            break
        low, high = high, 2 * high
    else:
        return math.inf
    return optimize.brentq(_kl_gradient, low, high, args=(shares, distance, margin), xtol=1e-14 * high, rtol=1e-12)


def fit_bandwidth(shares: np.ndarray, distance: np.ndarray) -> float:
    """The data-space bandwidth ``h*`` whose posterior is closest to the attention shares in KL.

    Minimises ``F(beta) = sum_s KL(a_s || softmax_i(-beta d_s,i))`` over ``beta = 1 / (2 h^2) >= 0``. ``F`` is convex
    in ``beta`` (a log-sum-exp plus a linear term) with derivative ``sum_s (a_s - w_s(beta)) . d_s``, increasing in
    ``beta``; its root is found by Brent's method. ``shares``: ``(S, R)``, rows summing to 1; ``distance``: ``(S, R)``
    squared distances ``|x_t / alpha_t - s_i|^2``. ``h*`` is ``inf`` when ``beta* = 0`` (uniform weights are closest:
    the attention favours the nearer references no more than uniform weights do), ``0`` when the attention puts all its
    mass on the nearest references.
    """
    d = np.asarray(distance, dtype=np.float64)
    return _bandwidth(_root(np.asarray(shares, dtype=np.float64), d - d.min(-1, keepdims=True)))


def _bandwidth(beta: float) -> float:
    """``h = 1 / sqrt(2 beta)``: ``inf`` for ``beta = 0``, ``0`` for ``beta = inf``, NaN for NaN."""
    if math.isnan(beta):
        return math.nan
    return math.inf if beta == 0 else (0.0 if math.isinf(beta) else 1.0 / math.sqrt(2 * beta))


def _fit_interval(shares: np.ndarray, distance: np.ndarray, resamples: int, seed: int) -> tuple[float, ...]:
    """The fitted ``beta = 1 / (2 h*^2)`` (:func:`fit_bandwidth`) and its 95 % interval: every ``beta >= 0`` whose
    estimating equation (the mean over sets of :func:`_psi`, 0 in expectation at the true ``beta``) the bootstrap-t
    interval over sets does not exclude, its quantiles taken at the fit (:func:`studentised`); NaN below
    :data:`~ipa_probe.sweep.aggregation.MIN_SETS` sets. (A percentile bootstrap of the fit undercovered over 10-20.)"""
    d = distance - distance.min(-1, keepdims=True)
    beta, counts = _root(shares, d), resample_counts(np.random.default_rng(seed), resamples, len(d))
    if len(d) < MIN_SETS:
        return beta, math.nan, math.nan
    t_high, t_low = np.quantile(studentised(_psi(beta, shares, d)[:, None], counts)[2], [0.975, 0.025])
    return beta, min(_root(shares, d, -t_low), beta), max(_root(shares, d, -t_high, beta), beta)


def verdict(attention_tv_high: float, share_p: float) -> str:
    """The pre-stated rule (see the module docstring): ``pooling`` when the upper end of the interval of the mean TV
    from uniform is below :data:`POOLING_TV`; else ``tracks posterior`` when the one-sided permutation p of the mean
    Spearman with the posterior is below :data:`ALPHA` (that test alone: the Spearman's two-sided interval is reported
    beside it, not used); else ``undecided``, also where the TV has no interval (too few sets to rule out pooling)."""
    if not attention_tv_high < math.inf:  # NaN: no interval
        return "undecided"
    if attention_tv_high < POOLING_TV:
        return "pooling"
    return "tracks posterior" if share_p < ALPHA else "undecided"


def summarize_attribution(
    frame: pd.DataFrame, permutations: int = 4999, resamples: int = 999, seed: int = 0
) -> pd.DataFrame:
    """Per timestep: the gauge-invariant comparisons of the attention with the exact posterior (module docstring), from
    stacked :func:`~.collect.reference_attribution` tables with a ``set`` column; ``resamples`` is for the fitted
    bandwidth's interval. Returns one row per timestep (noise first) with ``timestep``, ``sets``, ``references``,
    ``layers``, ``share_spearman`` (+ ``_low``, ``_high``, ``_p``), ``layer_agreement`` (+ ``_low``, ``_high``,
    ``_p``), ``tv_attention_posterior`` (+ ``_low``, ``_high``), ``attention_tv`` (+ ``_low``, ``_high``),
    ``posterior_tv``, ``attention_neff`` (+ ``_low``, ``_high``), ``position_neff``, ``posterior_neff`` (+ ``_low``,
    ``_high``), ``bandwidth``, ``fitted_bandwidth`` (+ ``_low``, ``_high``), ``fitted_ratio``, ``fitted_beta`` (+
    ``_low``, ``_high``) and ``verdict``.
    """
    rows = []
    for timestep in sorted(frame["timestep"].unique(), reverse=True):
        data = arrays(frame, timestep)
        shares, posterior, distance = data["shares"], data["posterior"], data["distance"]
        pooled = shares.mean(1)  # (S, R) layer mean
        row = {"timestep": float(timestep), "sets": shares.shape[0], "references": shares.shape[2]}
        row["layers"] = shares.shape[1]
        ranking = paired_rank_test(pooled, -distance, permutations, seed)
        row.update(share_spearman=ranking["mean"], share_spearman_low=ranking["low"])
        row.update(share_spearman_high=ranking["high"], share_spearman_p=ranking["p"])
        layers = layer_agreement_test(shares, permutations, seed)
        row.update(layer_agreement=layers["mean"], layer_agreement_low=layers["low"])
        row.update(layer_agreement_high=layers["high"], layer_agreement_p=layers["p"])
        per_set = {
            "tv_attention_posterior": 0.5 * np.abs(pooled - posterior).sum(-1),
            "attention_tv": tv_from_uniform(shares).mean(1),
            "attention_neff": neff(shares).mean(1),
            "posterior_neff": neff(posterior),
        }
        for name, values in per_set.items():
            low, high = bootstrap_ci(values, bounds=value_range(name, row["references"]))
            row.update({name: float(values.mean()), f"{name}_low": low, f"{name}_high": high})
        row["posterior_tv"] = float(tv_from_uniform(posterior).mean())
        row["position_neff"] = float(data["position_neff"].mean())
        row["bandwidth"] = data["bandwidth"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            beta, beta_low, beta_high = _fit_interval(pooled, distance, resamples, seed)
        fitted = _bandwidth(beta)
        row.update(fitted_bandwidth=fitted, fitted_bandwidth_low=_bandwidth(beta_high))
        row.update(fitted_bandwidth_high=_bandwidth(beta_low), fitted_ratio=fitted / data["bandwidth"])
        row.update(fitted_beta=beta, fitted_beta_low=beta_low, fitted_beta_high=beta_high)
        row["verdict"] = verdict(row["attention_tv_high"], ranking["p"])
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ verdicts per cell, and controls
def _mean_interval(
    values: np.ndarray, counts: np.ndarray, bounds: tuple[float, float] = (-math.inf, math.inf)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``values`` ``(S, C)`` (NaN = left out): the mean over sets and its 95 % bootstrap-t interval
    (:func:`studentised`; columns with fewer than :data:`~ipa_probe.sweep.aggregation.MIN_SETS` usable sets NaN), cut
    to the mean's range ``bounds`` (:func:`value_range`)."""
    mean, se, t = studentised(values, counts)
    se = np.where(np.isfinite(values).sum(0) >= MIN_SETS, se, np.nan)
    upper, lower = np.quantile(t, [0.975, 0.025], axis=0) if len(counts) else (np.nan, np.nan)
    return mean, np.clip(mean - upper * se, *bounds), np.clip(mean - lower * se, *bounds)


def cell_verdicts(
    shares: np.ndarray, distance: np.ndarray, permutations: int = 999, resamples: int = 999, seed: int = 0
) -> pd.DataFrame:
    """The verdict's rule (:func:`verdict`) applied to every cell (a layer's head, or a layer's query position).

    Per cell ``c``: ``attention_tv`` the mean over sets of the TV distance of ``shares[s, c]`` from uniform, with a
    95 % bootstrap-t interval over sets (:func:`_mean_interval`); ``share_spearman`` the mean over sets of
    Spearman(``shares[s, c]``, ``-distance[s]``), its interval and a one-sided permutation p-value (the references
    permuted independently within every set, as :func:`paired_rank_test`). The resamples of the sets and the
    permutations are drawn once and shared by all cells (each cell's test is valid on its own; the cells' tests are
    then not independent). ``shares``: ``(S, C, R)`` per set, cell and reference (rows sum to 1); ``distance``:
    ``(S, R)`` squared data-space distances (the posterior ranks the references as ``-distance``). Returns per cell:
    ``cell``, ``attention_tv`` (``_low``, ``_high``), ``share_spearman`` (``_low``, ``_high``, ``_p``, ``_critical``:
    ``p < ALPHA`` exactly when ``share_spearman > critical``), ``verdict``.
    """
    a = np.asarray(shares, dtype=np.float64)
    sets, cells, refs = a.shape
    rng = np.random.default_rng(seed)
    counts = resample_counts(rng, resamples, sets)
    tv, tv_low, tv_high = _mean_interval(tv_from_uniform(a), counts, value_range("attention_tv", refs))
    zx = _standard_ranks(a)  # (S, C, R)
    zy = _standard_ranks(-np.asarray(distance, dtype=np.float64))  # (S, R)
    usable = np.isfinite(zx).all(-1) & np.isfinite(zy).all(-1)[:, None]  # (S, C)
    zx = np.where(usable[..., None], zx, 0.0)
    zy0 = np.nan_to_num(zy)
    per_set = np.where(usable, (zx * zy0[:, None]).sum(-1), np.nan)  # (S, C) Spearman per set and cell
    rho, rho_low, rho_high = _mean_interval(per_set, counts, value_range("share_spearman", refs))
    n = usable.sum(0)  # (C,)
    flat = zx.transpose(0, 2, 1).reshape(sets * refs, cells)  # (S*R, C)
    nulls = []
    for start in range(0, permutations, 500):
        draws = min(500, permutations - start)
        order = rng.random((draws, sets, refs)).argsort(-1)  # (D, S, R) independent permutations
        null_y = np.take_along_axis(np.broadcast_to(zy0, order.shape), order, -1).reshape(draws, sets * refs)
        with np.errstate(invalid="ignore", divide="ignore"):
            nulls.append((null_y @ flat) / n)  # (D, C) mean over each cell's usable sets
    null = np.concatenate(nulls) if nulls else np.zeros((0, cells))
    exceed = (null >= rho - 1e-12).sum(0)  # 1e-12: the identity permutation reproduces the sum
    p = np.where(n >= 2, (1 + exceed) / (1 + permutations), np.nan)
    # p < ALPHA  <=>  fewer than K = ceil(ALPHA (1 + D) - 1) null means reach rho  <=>  rho - 1e-12 > the K-th largest
    k = math.ceil(ALPHA * (1 + permutations) - 1)
    ranked = -np.sort(-null, axis=0)  # (D, C) descending
    critical = ranked[k - 1] + 1e-12 if 1 <= k <= len(ranked) else np.full(cells, np.inf)
    critical = np.where(n >= 2, critical, np.nan)
    out = pd.DataFrame(
        {
            "cell": np.arange(cells),
            "attention_tv": tv,
            "attention_tv_low": tv_low,
            "attention_tv_high": tv_high,
            "share_spearman": rho,
            "share_spearman_low": rho_low,
            "share_spearman_high": rho_high,
            "share_spearman_p": p,
            "share_spearman_critical": critical,
        }
    )
    out["verdict"] = [verdict(h, q) for h, q in zip(tv_high, p, strict=True)]
    return out


def simultaneous_band(values: np.ndarray, counts: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, ...]:
    """Simultaneous confidence bands for the means over sets of every column of ``values`` ``(S, C)`` (NaN = left
    out): ``mean_c -/+ q se_c``, ``se_c = sd_c / sqrt(n_c)`` and ``q`` the ``confidence`` quantile of the largest
    studentised deviation ``max_c |mean*_c - mean_c| / se*_c`` over the resample counts ``(B, S)``, each resample
    studentised by its own standard error (the max-|t| bootstrap-t, :func:`studentised`): every column's true mean
    lies in its band at once with probability about ``confidence`` (``tests/test_interval_coverage.py``). Columns
    with fewer than 2 usable sets get ``(-inf, inf)``, columns without spread their mean."""
    mean, se, t = studentised(values, counts)
    q = float(np.quantile(np.abs(t).max(1), confidence))
    return np.where(np.isnan(se), -np.inf, mean - q * se), np.where(np.isnan(se), np.inf, mean + q * se)


def verdict_shares(
    shares: np.ndarray,
    distance: np.ndarray,
    permutations: int = 999,
    resamples: int = 999,
    outer: int = 999,
    seed: int = 0,
) -> dict[str, float]:
    """The share of cells on each side of the verdict, with simultaneous 95 % bounds on the true shares.

    The point value applies :func:`cell_verdicts` to the sets as drawn: a count of per-cell decisions. A cell's
    **true** verdict is the rule applied to its population means: ``pooling`` when its mean TV from uniform is below
    :data:`POOLING_TV`, else ``tracks posterior`` when its mean Spearman with the posterior is above 0, else
    ``undecided``. The bounds certify the true shares: a simultaneous band over every cell's mean TV and mean
    Spearman at once (:func:`simultaneous_band`, ``outer`` bootstrap-t resamples of the sets) puts each cell's verdict
    in a set of possible ones; ``<v>_low`` is the share of cells whose only possible verdict is ``v`` and ``<v>_high``
    the share where ``v`` is possible. When every true mean lies in its band (probability about 95 %), all three
    true shares lie between their bounds together (``tests/test_attribution_coverage.py``). ``outer=0``: no bounds
    (NaN). Returns ``{"cells": C, "<v>": share, "<v>_low": ..., "<v>_high": ...}`` for ``v`` in ``pooling``,
        ``tracks_posterior``, ``undecided``.
    """
    a, d = np.asarray(shares, dtype=np.float64), np.asarray(distance, dtype=np.float64)
    point = cell_verdicts(a, d, permutations, resamples, seed)["verdict"].to_numpy()
    cells = a.shape[1]
    out: dict[str, float] = {"cells": int(cells)}
    bounds = {v: (math.nan, math.nan) for v in VERDICTS}
    if outer:
        counts = resample_counts(np.random.default_rng(seed + 1), outer, a.shape[0])  # (B, S)
        zx, zy = _standard_ranks(a), _standard_ranks(-d)
        rho = np.where(np.isfinite(zx).all(-1) & np.isfinite(zy).all(-1)[:, None], (zx * zy[:, None]).sum(-1), np.nan)
        low, high = simultaneous_band(np.concatenate([tv_from_uniform(a), rho], 1), counts)  # (2C,): TV, then rho
        (tv_low, rho_low), (tv_high, rho_high) = np.split(low, 2), np.split(high, 2)
        certain_pool, maybe_pool = tv_high < POOLING_TV, tv_low < POOLING_TV
        possible = {"pooling": maybe_pool, "tracks posterior": ~certain_pool & (rho_high > 0)}
        possible["undecided"] = ~certain_pool & (rho_low <= 0)
        for v in VERDICTS:
            others = np.logical_or.reduce([possible[w] for w in VERDICTS if w != v])
            bounds[v] = (float((possible[v] & ~others).mean()), float(possible[v].mean()))
    for v in VERDICTS:
        key = v.replace(" ", "_")
        out[key] = float((point == v).mean())
        out[f"{key}_low"], out[f"{key}_high"] = bounds[v]
    return out


def cell_shares(cells: pd.DataFrame, timestep: float) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """One timestep of stacked per-cell tables (:attr:`~.collect.ReferenceAttribution.heads` or ``positions`` with a
    ``set`` column) as ``(S, C, R)`` shares, sets in sorted order, and the ``(layer, cell)`` of each ``C``."""
    part = cells[cells["timestep"] == timestep].sort_values(["set", "layer", "cell", "reference"])
    sets, refs = part["set"].nunique(), part["reference"].nunique()
    keys = list(part[part["set"] == part["set"].iloc[0]][["layer", "cell"]].drop_duplicates().itertuples(index=False))
    if len(part) != sets * len(keys) * refs:
        raise ValueError(
            f"timestep {timestep}: expected every set to have the same {len(keys)} cells and {refs} references, got "
            f"{len(part)} rows for {sets} sets"
        )
    return part["attention_share"].to_numpy(np.float64).reshape(sets, len(keys), refs), [tuple(k) for k in keys]


def control_difference(
    values: np.ndarray, control: np.ndarray, paired: bool, bounds: tuple[float, float] = (-math.inf, math.inf)
) -> dict[str, float]:
    """A statistic against its control: the mean of ``values`` minus the mean of ``control`` with a 95 % interval;
    it **counts** only when the interval excludes 0 (per row, unadjusted: not a family's decision).

    ``values``: ``(S,)`` the statistic per set (non-finite entries left out). ``paired=True``: ``control`` ``(S,)``
    is the same statistic on each set's control (e.g. references the generation never saw at the same ``x_t``), the
    per-set difference's bootstrap-t interval (:func:`~ipa_probe.sweep.aggregation.bootstrap_ci`); ``paired=False``:
    ``(S',)`` on independent control sets (e.g. same-digit sets against mixed ones), Welch's t interval. Either is NaN
    with fewer than :data:`~ipa_probe.sweep.aggregation.MIN_SETS` sets a side (``tests/test_interval_coverage.py``).
    ``bounds``: the statistic's range (:func:`value_range`); the interval is cut to the difference's, ``±(high -
    low)``. Returns ``{"value", "control", "difference", "low", "high", "counts"}``.
    """
    x, y = np.asarray(values, dtype=np.float64), np.asarray(control, dtype=np.float64)
    out = {"value": float(np.nanmean(x)) if np.isfinite(x).any() else math.nan}
    out["control"] = float(np.nanmean(y)) if np.isfinite(y).any() else math.nan
    if paired:
        if x.shape != y.shape:
            raise ValueError(f"paired control: expected one control per set, got {y.shape} for {x.shape}")
        difference = x - y
        out["difference"] = float(np.nanmean(difference)) if np.isfinite(difference).any() else math.nan
        low, high = bootstrap_ci(difference)
    else:
        x, y = x[np.isfinite(x)], y[np.isfinite(y)]
        out["difference"] = out["value"] - out["control"]
        low, high = math.nan, math.nan
        if min(len(x), len(y)) >= MIN_SETS:
            low, high = stats.ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
    width = bounds[1] - bounds[0]  # the difference's range
    low, high = np.clip([low, high], -width, width)
    out.update(low=float(low), high=float(high), counts=bool(low > 0 or high < 0))
    return out


def summarize_cells(
    frame: pd.DataFrame,
    cells: pd.DataFrame | None = None,
    permutations: int = 999,
    resamples: int = 999,
    outer: int = 999,
    seed: int = 0,
) -> pd.DataFrame:
    """Per timestep: the share of cells on each side of the verdict (:func:`verdict_shares`).

    ``frame``: stacked :func:`~.collect.reference_attribution` tables with a ``set`` column (the distances; and the
    cells when ``cells`` is None); ``cells``: stacked per-cell tables (``result.heads`` or ``result.positions`` with a
    ``set`` column, sets numbered as in ``frame``), or ``None`` for one cell per layer. Returns one row per timestep
    (noise first): ``timestep``, ``cells`` and ``pooling``, ``tracks_posterior``, ``undecided``, each with ``_low`` and
    ``_high``.
    """
    rows = []
    for timestep in sorted(frame["timestep"].unique(), reverse=True):
        data = arrays(frame, timestep)
        shares = data["shares"] if cells is None else cell_shares(cells, timestep)[0]
        if shares.shape[0] != data["distance"].shape[0]:
            raise ValueError(f"cells: expected the {data['distance'].shape[0]} sets of frame, got {shares.shape[0]}")
        result = verdict_shares(shares, data["distance"], permutations, resamples, outer, seed)
        rows.append({"timestep": float(timestep), **result})
    return pd.DataFrame(rows)
