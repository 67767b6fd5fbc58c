"""Aggregation over rows: per-row summaries averaged per CFG branch and timestep, a bootstrap interval, a plot."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .._checks import MAX_RESAMPLES, check_fraction, check_int, check_seed, check_threshold
from ..capture.report import style_timestep_axes, summarize
from ..statistics.schema import (
    SUMMARY_GAUGE_MEANS,
    SUMMARY_HEADLINE,
    SUMMARY_KEYS,
    SUMMARY_MAX,
    SUMMARY_MEANS,
    SUMMARY_QUERY_FRAME_MEANS,
    frac_column,
    frac_null_column,
)

#: Resamples drawn at once by :func:`bootstrap_ci` (one batch up to the default 9,999); with
#: :data:`~ipa_probe._checks.MAX_RESAMPLES` this bounds the merge's memory and time.
RESAMPLE_BATCH = 10_000
#: The fewest values given a bootstrap-t interval of their mean: below 8 a skewed mean's interval covers less than
#: 95 % (6 sets: 0.938 simulated; ``tests/test_interval_coverage.py``), so fewer get NaN.
MIN_SETS = 8


def resample_counts(rng: np.random.Generator, resamples: int, sets: int) -> np.ndarray:
    """``(B, S)`` how often each set is drawn in each of ``resamples`` bootstrap resamples of the sets."""
    index = rng.integers(0, sets, (resamples, sets))
    counts = np.zeros((resamples, sets))
    np.add.at(counts, (np.arange(resamples)[:, None], index), 1.0)
    return counts


def studentised(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per column of ``values`` ``(S, C)`` (NaN = left out): the mean over sets, its standard error ``sd / sqrt(n)``
    and the bootstrap-t deviations ``(mean* - mean) / se*`` ``(B, C)`` over the resample counts ``(B, S)`` (shared by
    every column), ``se*`` each resample's own standard error (the column's where a resample has no spread)."""
    usable = np.isfinite(values)
    n = usable.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(usable, values, 0.0).sum(0) / n
        centred = np.where(usable, values - mean, 0.0)
        se = np.sqrt((centred**2).sum(0) / (n - 1) / n)
        drawn = counts @ usable  # (B, C)
        deviation = (counts @ centred) / drawn
        se_star = np.sqrt(((counts @ centred**2) / drawn - deviation**2).clip(0) / (drawn - 1))
        t = deviation / np.where(se_star > 1e-6 * se, se_star, se)
    return np.where(n > 0, mean, np.nan), np.where(n >= 2, se, np.nan), np.nan_to_num(t, posinf=0.0, neginf=0.0)


def bootstrap_ci(
    values: np.ndarray,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    rng: np.random.Generator | None = None,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[float, float]:
    """Bootstrap-t confidence interval of the mean of ``values``: ``mean - t*_hi se``, ``mean - t*_lo se`` with
    ``t*`` the quantiles of :func:`studentised`'s deviations over ``n_resamples`` resamples (BCa undercovered over
    20 values and fewer). Non-finite values are dropped; ``(nan, nan)`` for fewer than :data:`MIN_SETS`, ``(v, v)``
    when all equal ``v``; ``confidence`` is two-sided; ``rng`` defaults to one seeded with 0 (reproducible).
    ``bounds``: the range the mean can take (a Spearman's ``(-1, 1)``); the interval is cut to it, which loses no
    coverage since the true mean lies inside (a bootstrap-t of a few skewed values can reach far beyond it)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a level in (0, 1), e.g. 0.95, got {confidence}")
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)][:, None]
    if len(x) < MIN_SETS:
        return math.nan, math.nan
    if np.ptp(x) == 0:
        return float(x[0, 0]), float(x[0, 0])
    if not bounds[0] <= bounds[1]:
        raise ValueError(f"bounds: expected (low, high) with low <= high, got {bounds}")
    rng = rng if rng is not None else np.random.default_rng(0)
    batches = [min(RESAMPLE_BATCH, n_resamples - start) for start in range(0, n_resamples, RESAMPLE_BATCH)]
    mean, se, t = zip(*(studentised(x, resample_counts(rng, size, len(x))) for size in batches), strict=True)
    upper, lower = np.quantile(np.concatenate(t), [(1 + confidence) / 2, (1 - confidence) / 2])
    low, high = np.clip([mean[0] - upper * se[0], mean[0] - lower * se[0]], *bounds).ravel()
    return low.item(), high.item()


def row_summary(table: pd.DataFrame, threshold: float = 0.9) -> pd.DataFrame:
    """Per-timestep means of one row's table (:func:`~.capture.report.summarize`) plus ``row``, ``seed``, ``scale``
    and ``cells_nonfinite``: how many layer x head cells at that timestep have a non-finite Spearman or Pearson
    (the means skip those cells, so :func:`aggregate` leaves such a row out instead of counting it as a full one;
    ``nonfinite`` still gives the largest fraction of latent pixels whose weights were not finite)."""
    summary = summarize(table, threshold=threshold)
    if summary.empty:
        return summary
    keys = list(SUMMARY_KEYS)
    bad = ~np.isfinite(table["spearman"].to_numpy(np.float64)) | ~np.isfinite(table["pearson"].to_numpy(np.float64))
    counts = pd.Series(bad, index=table.index).groupby([table[k] for k in keys], observed=True).sum()
    summary = summary.merge(counts.rename("cells_nonfinite").reset_index(), on=keys, how="left")
    for position, key in enumerate(("row", "seed", "scale")):
        summary.insert(position, key, table[key].iloc[0])
    return summary


def aggregate(
    per_row: pd.DataFrame,
    *,
    threshold: float = 0.9,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> pd.DataFrame:
    """Average per-row summaries over rows, per CFG branch and timestep.

    Each manifest row counts once: its Spearman is the mean over its layers, heads and adapters of the per-row
    (per latent pixel) Spearman rho between the attention weights and the NW weights (paper §D.4,
    ``per_row_spearman_mean``), and the interval is a bootstrap over rows of the mean of those values.

    ``per_row``: rows of :func:`row_summary` for many manifest rows, made with the rho ``threshold``; ``seed`` seeds
    the bootstrap group by group (the result does not depend on the order of ``per_row``). Returns one row per
    (branch, timestep), timesteps in denoising order (high to low): ``rows`` (the manifest rows
        whose every cell is finite there), ``rows_partial`` (those left out, see :func:`row_summary`), ``spearman``
        with ``spearman_ci_low`` / ``_high`` / ``_std`` over rows, ``frac_rho_gt_<threshold>`` and its ``_null``, then
        the means over rows of :data:`~ipa_probe.statistics.schema.SUMMARY_MEANS`,
        :data:`~ipa_probe.statistics.schema.SUMMARY_GAUGE_MEANS` and the query-frame columns
        (:data:`~ipa_probe.statistics.schema.SUMMARY_HEADLINE`,
        :data:`~ipa_probe.statistics.schema.SUMMARY_QUERY_FRAME_MEANS`; NaN where the summaries lack one) and the
        maxima of :data:`~ipa_probe.statistics.schema.SUMMARY_MAX` over every row. The unprefixed statistics are the
        stored frame's.
    """
    check_threshold(threshold)
    check_fraction(confidence, "confidence")
    check_int(n_resamples, "n_resamples", 1, MAX_RESAMPLES)
    check_seed(seed)
    frac = frac_column(threshold)
    means = [frac, *(name for name in SUMMARY_MEANS if name != "spearman")]
    appended = [*SUMMARY_GAUGE_MEANS, frac_null_column(threshold), *SUMMARY_HEADLINE, *SUMMARY_QUERY_FRAME_MEANS]
    columns = ["branch", "timestep", "rows", "rows_partial", "spearman"]
    columns += ["spearman_ci_low", "spearman_ci_high", "spearman_std"]
    columns += [*means, *SUMMARY_MAX, *appended]
    if per_row.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
    missing = [c for c in ("row", "branch", "timestep", "spearman", frac) if c not in per_row.columns]
    if missing:
        raise ValueError(f"per_row: missing column(s) {missing}; make it with row_summary(..., threshold={threshold})")
    records = []
    ordered = per_row.sort_values(["branch", "timestep", "row"], ascending=[True, False, True], kind="stable")
    for index, ((branch, timestep), both) in enumerate(ordered.groupby(["branch", "timestep"], sort=False)):
        if "cells_nonfinite" in both:
            partial = both["cells_nonfinite"].fillna(0).to_numpy(np.float64) > 0
        else:  # summaries made elsewhere: every row counts
            partial = np.zeros(len(both), dtype=bool)
        group = both[~partial]
        rho = group["spearman"].to_numpy(np.float64)
        low, high = bootstrap_ci(rho, confidence, n_resamples, np.random.default_rng([seed, index]), (-1.0, 1.0))
        finite = rho[np.isfinite(rho)]
        record = {
            "branch": branch,
            "timestep": float(timestep),
            "rows": int(group["row"].nunique()),
            "rows_partial": int(both["row"][partial].nunique()),
            "spearman": float(finite.mean()) if finite.size else math.nan,
            "spearman_ci_low": low,
            "spearman_ci_high": high,
            "spearman_std": float(finite.std(ddof=1)) if finite.size > 1 else math.nan,
        }
        record.update({key: float(group[key].mean()) if len(group) and key in group else math.nan for key in means})
        record.update({key: float(both[key].max()) if key in both else math.nan for key in SUMMARY_MAX})
        record.update({key: float(group[key].mean()) if len(group) and key in group else math.nan for key in appended})
        records.append(record)
    return pd.DataFrame.from_records(records, columns=columns)


def plot_aggregate(agg: pd.DataFrame, ax=None, branch: str = "cond", confidence: float = 0.95):
    """Mean per-row Spearman over rows with its bootstrap interval as a band, its gauge baseline (docs/gauge.md),
    Pearson, rho > 0.9 and the null.

    The x axis runs in the denoising direction (high timestep on the left). Falls back to the only branch present
    when ``branch`` is absent (a sweep without CFG has only ``"cond"``).
    """
    import matplotlib.pyplot as plt

    from ..figstyle import DOUBLE_COLUMN, legend_below

    if ax is None:
        fig, ax = plt.subplots(figsize=(DOUBLE_COLUMN, 4.4), layout="constrained")
    else:
        fig = ax.figure
    part = agg[agg["branch"] == branch] if not agg.empty else agg
    if part.empty and not agg.empty:
        branch = str(agg["branch"].iloc[0])
        part = agg[agg["branch"] == branch]
    if not part.empty:
        part = part.sort_values("timestep", ascending=False)
        x = part["timestep"].to_numpy(np.float64)
        frac = next((c for c in part.columns if c.startswith("frac_rho_gt_") and not c.endswith("_null")), None)
        ax.plot(x, part["spearman"], marker="o", label="Spearman ρ (mean over rows)")
        ax.fill_between(
            x,
            part["spearman_ci_low"].to_numpy(np.float64),
            part["spearman_ci_high"].to_numpy(np.float64),
            alpha=0.25,
            label=f"{confidence:.0%} bootstrap CI",
        )
        if "rho_baseline" in part and part["rho_baseline"].notna().any():
            ax.plot(x, part["rho_baseline"], color="C0", linestyle="-.", label="ρ baseline from r and K")
        ax.plot(x, part["pearson"], marker=".", linestyle="--", label="Pearson r")
        if frac is not None:
            ax.plot(x, part[frac], linestyle="-.", label=f"fraction ρ > {frac.removeprefix('frac_rho_gt_')}")
        ax.plot(x, part["spearman_null"], color="grey", linestyle=":", label="permutation null")
        rows = int(part["rows"].max())
        ax.set_title(f"IP-Adapter attention vs Gaussian NW, {rows} row(s) ({branch} branch)")
        columns = ["spearman", "spearman_ci_low", "spearman_ci_high", "pearson", "spearman_null"]
        columns += [frac] if frac else []
        columns += ["rho_baseline"] if "rho_baseline" in part else []
        drawn = part[columns].to_numpy(np.float64).ravel()
    else:
        ax.set_title("IP-Adapter attention vs Gaussian NW (no rows)")
        drawn = None
    style_timestep_axes(ax, drawn)
    legend_below(ax, fontsize=8, ncol=2)  # inside, "best" still covers a line of 20 points
    return fig
