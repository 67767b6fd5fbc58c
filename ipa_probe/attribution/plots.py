"""Figures of :func:`~.analysis.summarize_attribution` tables: rank agreement, sharpness and fitted temperature
against the timestep, one colour per labelled summary, each line drawn with its 95 % interval as a band. Every line
and band is named in the legend (a line and its band share one entry), placed under the axes."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = ["plot_agreement", "plot_sharpness", "plot_temperature"]


def _axis(ax, summary: pd.DataFrame) -> np.ndarray:
    x = np.arange(len(summary))
    ax.set_xticks(x, [f"{t:g}" for t in summary["timestep"]])
    ax.set_xlabel("timestep (noise → data)")
    return x


def _colours(summaries: dict, colours: dict | None) -> dict:
    return {label: (colours or {}).get(label, f"C{i}") for i, label in enumerate(summaries)}


def _line(ax, entries, x, summary, name, colour, style, label, band=True):
    """Draw ``summary[name]`` (and its ``_low``/``_high`` band); add one legend entry for both."""
    (line,) = ax.plot(x, summary[name], style, color=colour)
    handle = line
    if band:
        low, high = summary[f"{name}_low"].to_numpy(float), summary[f"{name}_high"].to_numpy(float)
        if np.isfinite(low).any():
            patch = ax.fill_between(x, low, high, color=colour, alpha=0.18, linewidth=0)
            handle, label = (line, patch), f"{label} (band: 95% CI)"
    entries.append((handle, label))


def _legend(ax, entries, columns: int = 1) -> None:
    handles, labels = zip(*entries, strict=True)
    ax.legend(handles, labels, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=columns)


def plot_agreement(ax, summaries: dict[str, pd.DataFrame], colours: dict | None = None) -> None:
    """Mean per-set Spearman of attention share vs exact posterior, and the between-layer agreement, per timestep."""
    entries = []
    for label, colour in _colours(summaries, colours).items():
        summary = summaries[label]
        x = _axis(ax, summary)
        _line(ax, entries, x, summary, "share_spearman", colour, "o-", f"{label}: attention vs posterior ranks")
        _line(ax, entries, x, summary, "layer_agreement", colour, "s--", f"{label}: between-layer agreement")
    entries.append((ax.axhline(0, color="black", linewidth=0.8, linestyle=":"), "chance (permutation null mean)"))
    ax.set(ylim=(-1.05, 1.05), ylabel="mean per-set Spearman", title="which reference? (gauge-invariant)")
    _legend(ax, entries)


def plot_sharpness(ax, summaries: dict[str, pd.DataFrame], colours: dict | None = None) -> None:
    """Attention n_eff over references (per layer and per position) beside the exact posterior's, and h(t)."""
    entries, refs = [], 1
    for label, colour in _colours(summaries, colours).items():
        summary = summaries[label]
        x = _axis(ax, summary)
        refs = max(refs, int(summary["references"].max()))
        _line(ax, entries, x, summary, "attention_neff", colour, "o-", f"{label}: attention n_eff per layer")
        _line(ax, entries, x, summary, "position_neff", colour, "^:", f"{label}: attention n_eff per position", False)
        _line(ax, entries, x, summary, "posterior_neff", colour, "s--", f"{label}: exact posterior n_eff")
    ax.set(ylim=(0.9, refs + 0.1), ylabel="effective number of references", title="sharpness over time")
    first = next(iter(summaries.values()))
    twin = ax.twinx()
    (line,) = twin.plot(_axis(ax, first), first["bandwidth"], "k.-", linewidth=0.8)
    twin.set(yscale="log", ylabel="h(t) (log scale)")
    entries.append((line, "h(t) = σ_t/α_t (right axis)"))
    _legend(ax, entries)


def _from_beta(summary: pd.DataFrame) -> pd.DataFrame:
    """The fitted bandwidth and its interval from the finite ``fitted_beta`` columns (a JSON record turns an
    infinite ``fitted_bandwidth`` into null), ``h = 1 / sqrt(2 beta)``."""
    if "fitted_beta" not in summary.columns:
        return summary
    out = summary.copy()
    with np.errstate(divide="ignore"):
        for suffix, other in (("", ""), ("_low", "_high"), ("_high", "_low")):  # h falls as beta grows
            beta = out[f"fitted_beta{other}"].to_numpy(float)
            out[f"fitted_bandwidth{suffix}"] = np.where(beta == 0, np.inf, 1.0 / np.sqrt(2 * beta))
    return out


def plot_temperature(ax, summaries: dict[str, pd.DataFrame], colours: dict | None = None) -> None:
    """The fitted data-space bandwidth h* (KL-closest posterior to the attention shares) against h(t), log scale;
    h* = inf (uniform weights closest) is drawn as a triangle at the top edge, and an interval reaching inf is cut
    there."""
    summaries = {label: _from_beta(s) for label, s in summaries.items()}
    values = [
        v
        for s in summaries.values()
        for column in ("fitted_bandwidth", "fitted_bandwidth_low", "fitted_bandwidth_high", "bandwidth")
        for v in s[column].to_numpy(float)
        if math.isfinite(v) and v > 0
    ]
    top = 10 ** math.ceil(math.log10(max(values) * 3)) if values else 10.0
    bottom = 10 ** math.floor(math.log10(min(values) / 3)) if values else 0.01
    entries = []
    for index, (label, colour) in enumerate(_colours(summaries, colours).items()):
        summary = summaries[label]
        x = _axis(ax, summary)
        fitted = summary["fitted_bandwidth"].to_numpy(float)
        infinite = np.isinf(fitted)
        (line,) = ax.plot(x, np.where(infinite, np.nan, fitted), "o-", color=colour)
        handle = line
        low = np.clip(summary["fitted_bandwidth_low"].to_numpy(float), bottom, top)
        high = np.clip(summary["fitted_bandwidth_high"].to_numpy(float), bottom, top)
        text = f"{label}: fitted h*"
        if np.isfinite(low).any():
            handle = (line, ax.fill_between(x, low, high, color=colour, alpha=0.18, linewidth=0))
            text += " (band: 95% CI)"
        entries.append((handle, text))
        if infinite.any():
            edge = top / 1.6**index  # one row of triangles per summary, so that none hides another
            (marker,) = ax.plot(x[infinite], np.full(infinite.sum(), edge), "^", color=colour, markersize=8)
            entries.append((marker, f"{label}: h* = ∞ (uniform weights closest; drawn at the top)"))
    first = next(iter(summaries.values()))
    (line,) = ax.plot(_axis(ax, first), first["bandwidth"], "k.--")
    entries.append((line, "exact denoiser's h(t) = σ_t/α_t"))
    ax.set(yscale="log", ylim=(bottom, top * 1.5), ylabel="data-space bandwidth", title="fitted temperature")
    _legend(ax, entries)
