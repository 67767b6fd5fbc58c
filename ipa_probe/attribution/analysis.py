"""Gauge-invariant comparisons of the attention with the exact posterior over the references (issue #18 point 3).

Input: the tables of :func:`~.collect.reference_attribution` for many reference sets, stacked with a ``set`` column
(:func:`~.collect.sets_table`). Per timestep, with ``A[s, l, i]`` the attention share of reference ``i`` in layer
``l`` for set ``s``, ``a[s, i] = mean_l A[s, l, i]``, ``w[s, i]`` the exact posterior and ``d[s, i]`` the squared
data-space distance ``|x_t / alpha_t - s_i|^2``:

- **reference attribution**: ``share_spearman``, the mean over sets of Spearman(``a[s]``, ``w[s]``); the posterior
  ranks the references as ``-d`` does at every bandwidth, so ``-d`` is what is ranked (no ties from underflow at
  small ``h``). Its 95 % bootstrap interval over sets (BCa, :func:`ipa_probe.sweep.bootstrap_ci`) and a one-sided
  permutation p-value (references permuted independently within every set; :func:`paired_rank_test`).
  ``layer_agreement``: the mean over sets of the mean Spearman between every two layers' shares ``A[s, l]``, with
  its interval and a permutation p-value (each layer's shares permuted independently): do the layers rank the
  references alike? ``tv_attention_posterior``: mean total-variation distance between ``a[s]`` and ``w[s]``.
- **concentration**: ``attention_tv`` (mean over sets and layers of the TV distance of ``A[s, l]`` from uniform,
  ``0`` = perfect pooling, ``1 - 1/R`` = all on one reference) and ``posterior_tv`` (the same for ``w[s]``).
- **sharpness over time**: ``attention_neff`` (mean over sets and layers of ``1 / sum_i A[s, l, i]^2``),
  ``position_neff`` (the same per query position, then averaged: attention may pick different references at
  different positions), ``posterior_neff`` (``1 / sum_i w[s, i]^2``) and the exact denoiser's bandwidth
  ``h(t) = sigma_t / alpha_t``.
- **fitted data-space temperature**: ``fitted_bandwidth`` ``h*`` minimising ``sum_s KL(a[s] || softmax(-d[s] /
  (2 h^2)))`` (:func:`fit_bandwidth`; ``inf`` when the uniform weights are closest, i.e. the attention favours the
  nearer references no more than uniform weights do), with a 95 % percentile bootstrap interval over sets, and
  ``fitted_ratio = h* / h(t)``; the same as an inverse temperature ``fitted_beta = 1 / (2 h*^2)`` (0 for
  ``h* = inf``: finite, so that JSON records keep it).
- **verdict** (:func:`verdict`), decided by a rule stated before the data were seen (:data:`POOLING_TV`,
  :data:`ALPHA`):

  1. ``pooling`` when the upper end of the interval of ``attention_tv`` is below :data:`POOLING_TV` (0.05): in every
     layer the attention moves less than 5 % of its mass away from uniform, whatever the ranking does;
  2. else ``tracks posterior`` when ``share_spearman`` has a permutation p-value below :data:`ALPHA` (0.05) and its
     interval lies above 0;
  3. else ``undecided`` (the attention concentrates, but not on the references the posterior favours, or too few
     sets to tell).

Every quantity is a function of the attention weights and the latents, so it does not move under a q/k gauge
change (``to_q`` times c, ``to_k``/``to_k_ip`` divided by c).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import optimize, stats

from ..sweep.aggregation import bootstrap_ci
from .collect import arrays

__all__ = [
    "ALPHA",
    "POOLING_TV",
    "VERDICTS",
    "fit_bandwidth",
    "layer_agreement_test",
    "neff",
    "paired_rank_test",
    "summarize_attribution",
    "tv_from_uniform",
    "verdict",
]

#: Significance level of the verdict's permutation test (one-sided).
ALPHA = 0.05
#: The verdict's pooling threshold: the upper end of the interval of the mean TV distance from uniform.
POOLING_TV = 0.05
#: The verdict's values.
VERDICTS: tuple[str, ...] = ("pooling", "tracks posterior", "undecided")


def neff(weights: np.ndarray) -> np.ndarray:
    """Effective number of references ``1 / sum_i w_i^2`` over the last axis."""
    w = np.asarray(weights, dtype=np.float64)
    return 1.0 / (w**2).sum(-1)


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


def _interval(values: np.ndarray) -> tuple[float, float]:
    return bootstrap_ci(values) if np.isfinite(values).sum() >= 2 else (math.nan, math.nan)


def paired_rank_test(x: np.ndarray, y: np.ndarray, permutations: int = 4999, seed: int = 0) -> dict[str, float]:
    """Per set, Spearman between ``x[s]`` and ``y[s]``; their mean, its bootstrap interval and a permutation p-value.

    The null permutes ``y[s]`` independently within every set (the references carry no order), and the p-value is
    one-sided, ``(1 + #{null mean >= observed}) / (1 + permutations)``.

    Args:
        x, y: ``(S, R)`` values per set and reference. Sets where either has no spread are left out.
        permutations: random permutations drawn.
        seed: the generator's seed.

    Returns:
        ``{"mean", "low", "high", "p", "sets", "values"}``: ``values`` ``(S,)`` the per-set Spearman (NaN for sets
        left out); the others NaN where fewer than 2 sets are usable.
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
    out["low"], out["high"] = _interval(per_set)
    return out


def layer_agreement_test(shares: np.ndarray, permutations: int = 4999, seed: int = 0) -> dict[str, float]:
    """Between-layer agreement of the reference ranking: per set, the mean Spearman over every pair of layers.

    Args:
        shares: ``(S, L, R)`` attention shares per set, layer and reference.
        permutations: random permutations drawn for the p-value (each layer's shares permuted independently
            within every set; one-sided).
        seed: the generator's seed.

    Returns:
        ``{"mean", "low", "high", "p", "sets"}`` (mean over sets, its bootstrap interval, the p-value).
    """
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
    out["low"], out["high"] = _interval(per_set)
    return out


def _kl_gradient(beta: float, shares: np.ndarray, distance: np.ndarray) -> float:
    """d/d beta of sum_s KL(a_s || softmax(-beta d_s)) = sum_s (a_s . d_s - w_s(beta) . d_s)."""
    logits = -beta * distance
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return float(((shares - w) * distance).sum())


def fit_bandwidth(shares: np.ndarray, distance: np.ndarray) -> float:
    """The data-space bandwidth ``h*`` whose posterior is closest to the attention shares in KL.

    Minimises ``F(beta) = sum_s KL(a_s || softmax_i(-beta d_s,i))`` over ``beta = 1 / (2 h^2) >= 0``. ``F`` is convex
    in ``beta`` (a log-sum-exp plus a linear term) with derivative ``sum_s (a_s - w_s(beta)) . d_s``, increasing in
    ``beta``; its root is found by Brent's method.

    Args:
        shares: ``(S, R)`` attention shares (rows sum to 1).
        distance: ``(S, R)`` squared distances ``|x_t / alpha_t - s_i|^2``.

    Returns:
        ``h*``: ``inf`` when ``beta* = 0`` (uniform weights are closest: the attention favours the nearer references
        no more than uniform weights do), ``0`` when the attention puts all its mass on the nearest references.
    """
    a = np.asarray(shares, dtype=np.float64)
    d = np.asarray(distance, dtype=np.float64)
    d = d - d.min(-1, keepdims=True)  # softmax is shift invariant per set; keeps exp() in range
    if _kl_gradient(0.0, a, d) >= 0:
        return math.inf
    spread = float(np.median(d.max(-1))) or 1.0
    low, high = 0.0, 1.0 / spread
    for _ in range(200):
        if _kl_gradient(high, a, d) > 0:
            break
        low, high = high, 2 * high
    else:
        return 0.0
    beta = optimize.brentq(_kl_gradient, low, high, args=(a, d), xtol=1e-14 * high, rtol=1e-12)
    return 1.0 / math.sqrt(2.0 * beta)


def _beta(h: float) -> float:
    """``beta = 1 / (2 h^2)``: 0 for ``h = inf``, ``inf`` for ``h = 0``."""
    return 0.0 if math.isinf(h) else (math.inf if h == 0 else 1.0 / (2 * h * h))


def _bandwidth(beta: float) -> float:
    """``h = 1 / sqrt(2 beta)``: ``inf`` for ``beta = 0``, ``0`` for ``beta = inf``, NaN for NaN."""
    if math.isnan(beta):
        return math.nan
    return math.inf if beta == 0 else (0.0 if math.isinf(beta) else 1.0 / math.sqrt(2 * beta))


def _fit_interval(shares: np.ndarray, distance: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """95 % percentile bootstrap interval over sets of the fitted ``beta = 1 / (2 h*^2)`` (:func:`fit_bandwidth`)."""
    sets = shares.shape[0]
    if sets < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    betas = np.empty(resamples)
    for i in range(resamples):
        index = rng.integers(0, sets, sets)  # one resample of the sets: shares and distances stay paired
        betas[i] = _beta(fit_bandwidth(shares[index], distance[index]))
    low, high = np.quantile(betas, [0.025, 0.975])
    return float(low), float(high)


def verdict(attention_tv_high: float, share_p: float, share_low: float) -> str:
    """The pre-stated rule (see the module docstring): ``pooling``, ``tracks posterior`` or ``undecided``."""
    if attention_tv_high < POOLING_TV:
        return "pooling"
    if share_p < ALPHA and share_low > 0:
        return "tracks posterior"
    return "undecided"


def summarize_attribution(
    frame: pd.DataFrame, permutations: int = 4999, resamples: int = 999, seed: int = 0
) -> pd.DataFrame:
    """Per timestep: the gauge-invariant comparisons of the attention with the exact posterior (module docstring).

    Args:
        frame: stacked :func:`~.collect.reference_attribution` tables with a ``set`` column.
        permutations: random permutations of each permutation test.
        resamples: bootstrap resamples of the fitted bandwidth's interval.
        seed: seed of the permutation and bootstrap generators.

    Returns:
        one row per timestep (noise first) with ``timestep``, ``sets``, ``references``, ``layers``,
        ``share_spearman`` (+ ``_low``, ``_high``, ``_p``), ``layer_agreement`` (+ ``_low``, ``_high``, ``_p``),
        ``tv_attention_posterior`` (+ ``_low``, ``_high``), ``attention_tv`` (+ ``_low``, ``_high``),
        ``posterior_tv``, ``attention_neff`` (+ ``_low``, ``_high``), ``position_neff``, ``posterior_neff``
        (+ ``_low``, ``_high``), ``bandwidth``, ``fitted_bandwidth`` (+ ``_low``, ``_high``), ``fitted_ratio``,
        ``fitted_beta`` (+ ``_low``, ``_high``) and ``verdict``.
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
            low, high = _interval(values)
            row.update({name: float(values.mean()), f"{name}_low": low, f"{name}_high": high})
        row["posterior_tv"] = float(tv_from_uniform(posterior).mean())
        row["position_neff"] = float(data["position_neff"].mean())
        row["bandwidth"] = data["bandwidth"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            fitted = fit_bandwidth(pooled, distance)
        beta_low, beta_high = _fit_interval(pooled, distance, resamples, seed)
        row.update(fitted_bandwidth=fitted, fitted_bandwidth_low=_bandwidth(beta_high))
        row.update(fitted_bandwidth_high=_bandwidth(beta_low), fitted_ratio=fitted / data["bandwidth"])
        row.update(fitted_beta=_beta(fitted), fitted_beta_low=beta_low, fitted_beta_high=beta_high)
        row["verdict"] = verdict(row["attention_tv_high"], ranking["p"], ranking["low"])
        rows.append(row)
    return pd.DataFrame(rows)
