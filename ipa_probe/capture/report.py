"""Tables, summaries, plots and files made from a finished probe. Analysis lives here, apart from the capture code."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._io import versions, write_figure, write_json, write_table
from ..schema import (
    CELL_FIELDS,
    COLUMNS,
    FEW_KEYS,
    SUMMARY_GAUGE_MEANS,
    SUMMARY_KEYS,
    SUMMARY_MAX,
    SUMMARY_MEANS,
    frac_column,
    frac_null_column,
)

logger = logging.getLogger(__name__)

__all__ = [
    "COLUMNS",
    "plot_run",
    "run_table",
    "save_run",
    "style_timestep_axes",
    "summarize",
    "versions",
]


def run_table(result: dict[str, Any], layer_names: list[str], config, text_slot: int | None = None) -> pd.DataFrame:
    """Turn a finished probe's host buffers into the tidy table (one row per recorded cell).

    ``text_slot`` is the adapter index under which the text branch was recorded, if it was.
    """
    frames = []
    heads = list(config.heads) if config.heads is not None else None
    for call in result["calls"]:
        sums, counts = call["sums"].double(), call["counts"].double()
        if sums.numel() == 0:
            continue
        steps, n_layers, n_adapters, n_branches, n_heads = counts.shape
        grid = np.indices(counts.shape).reshape(len(counts.shape), -1)  # (5, cells)
        seen = counts.reshape(-1).numpy() > 0
        values = (sums / counts.clamp(min=1).unsqueeze(-1)).reshape(-1, len(CELL_FIELDS)).numpy()[seen]
        step, layer, adapter, branch, head = (g[seen] for g in grid)
        frame = pd.DataFrame(values, columns=list(CELL_FIELDS))
        frame.insert(0, "call", call["index"])
        frame.insert(1, "step", step)
        frame.insert(2, "timestep", call["timesteps"].double().numpy()[step])
        frame.insert(3, "layer", pd.Categorical(np.asarray(layer_names)[layer], categories=layer_names))
        frame.insert(4, "head", np.asarray(heads)[head] if heads is not None else head)
        frame.insert(5, "branch", np.asarray(call["branches"])[branch])
        text = adapter == text_slot if text_slot is not None else np.zeros_like(adapter, dtype=bool)
        frame.insert(6, "kind", np.where(text, "text", "image"))
        frame.insert(7, "adapter", np.where(text, -1, adapter))
        frame["few_keys"] = frame["keys"] < FEW_KEYS
        frame["complete"] = ~np.isin(step, call.get("incomplete", []))
        frames.append(frame)
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in COLUMNS})
    table = pd.concat(frames, ignore_index=True)
    few = table.loc[table["few_keys"] & (table["kind"] == "image")]
    if len(few):
        logger.warning(
            "probe: %d cells compare rows of fewer than %d keys (e.g. %s); their per-row Spearman is degenerate "
            "(+-1 or undefined): see the few_keys column",
            len(few),
            FEW_KEYS,
            few["layer"].iloc[0],
        )
    table = table[list(COLUMNS)].sort_values(
        ["call", "step", "layer", "kind", "adapter", "branch", "head"], kind="stable"
    )
    return table.reset_index(drop=True)


def summarize(table: pd.DataFrame, threshold: float = 0.9) -> pd.DataFrame:
    """Per-timestep aggregates over layers, heads and adapters (one row per call × step × kind × branch).

    Columns: the group (:data:`~ipa_probe.schema.SUMMARY_KEYS`), the means of
    :data:`~ipa_probe.schema.SUMMARY_MEANS` (``spearman``, ``pearson``, ``spearman_null``, ``kl``, ``top1``,
    ``neff_attn``, ``neff_nw``, ``q_norm``, ``k_norm_spread``, ``ip_mass``, ``bandwidth``), ``spearman_std``,
    ``frac_rho_gt_<threshold>`` (fraction of the layer × head × adapter cells with a finite rho whose rho is above
    ``threshold``), ``rho_cells`` (how many finite-rho cells that fraction counts), the max of ``nonfinite``,
    ``cells`` (how many cells were averaged), then the means of :data:`~ipa_probe.schema.SUMMARY_GAUGE_MEANS` (the
    gauge diagnostics ``logit_ratio``, ``rho_baseline``, ``rho_excess`` and the per-row shares against chance) and
    ``frac_rho_gt_<threshold>_null``: the same fraction of cells over their permutation-null rho (``spearman_null``),
    the chance level of ``frac_rho_gt_<threshold>`` (see docs/gauge.md).
    """
    if table.empty:
        return pd.DataFrame()
    grouped = table.groupby(list(SUMMARY_KEYS), observed=True, sort=True)
    aggregations = {name: (name, "mean") for name in SUMMARY_MEANS if name in table.columns}
    aggregations["spearman_std"] = ("spearman", "std")
    aggregations.update({name: (name, "max") for name in SUMMARY_MAX if name in table.columns})
    aggregations["cells"] = ("spearman", "size")
    aggregations.update({name: (name, "mean") for name in SUMMARY_GAUGE_MEANS if name in table.columns})
    out = grouped.agg(**aggregations)
    keys = [table[k] for k in SUMMARY_KEYS]
    finite = table["spearman"].notna()
    above = (table["spearman"] > threshold).where(finite)  # NaN where rho is undefined: left out of the fraction
    out.insert(2, frac_column(threshold), above.groupby(keys, observed=True).mean())
    out.insert(3, "rho_cells", finite.groupby(keys, observed=True).sum())
    if "spearman_null" in table.columns:
        null = table["spearman_null"]
        chance = (null > threshold).where(null.notna())
        out[frac_null_column(threshold)] = chance.groupby(keys, observed=True).mean()
    return out.reset_index()


def plot_run(table: pd.DataFrame, ax=None, branch: str = "cond", kind: str = "image"):
    """Mean per-row Spearman (band: ± one std over layers and heads) beside its gauge baseline (the rho expected from
    the logit ratio and the number of keys alone, docs/gauge.md), raveled Pearson and the null, by timestep.

    The x axis runs in the denoising direction (high timestep on the left).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
    else:
        fig = ax.figure
    summary = summarize(table)
    if not summary.empty:
        summary = summary[(summary["branch"] == branch) & (summary["kind"] == kind)]
        if summary.empty:  # e.g. a text-only probe
            kind = table["kind"].iloc[0]
            summary = summarize(table)
            summary = summary[(summary["branch"] == branch) & (summary["kind"] == kind)]
    for call, part in summary.groupby("call") if not summary.empty else ():
        suffix = f" (call {call})" if summary["call"].nunique() > 1 else ""
        x = part["timestep"].to_numpy()
        rho = part["spearman"].to_numpy()
        std = part["spearman_std"].fillna(0).to_numpy()
        line = ax.plot(x, rho, marker="o", label=f"Spearman ρ{suffix}")[0]
        ax.fill_between(x, rho - std, rho + std, alpha=0.2)
        if "rho_baseline" in part and part["rho_baseline"].notna().any():
            baseline = part["rho_baseline"].to_numpy()
            ax.plot(x, baseline, color=line.get_color(), linestyle="-.", label=f"ρ baseline from r and K{suffix}")
        ax.plot(x, part["pearson"], marker=".", linestyle="--", label=f"Pearson r{suffix}")
        ax.plot(x, part["spearman_null"], color="grey", linestyle=":", label=f"permutation null{suffix}")
    style_timestep_axes(ax)
    what = "IP-Adapter" if kind == "image" else "text"
    ax.set_title(f"{what} attention vs Gaussian NW ({branch} branch)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def style_timestep_axes(ax) -> None:
    """Axes of a correlation-by-timestep plot: y in [-1, 1] with a zero line, x in the denoising direction."""
    ax.set_xlabel("timestep (denoising →)")
    ax.set_ylabel("attention vs NW")
    ax.set_ylim(-1.05, 1.05)
    ax.axhline(0, color="black", linewidth=0.5)
    if not ax.xaxis_inverted():
        ax.invert_xaxis()


def save_run(table: pd.DataFrame, directory, settings: dict | None = None, extra: dict | None = None) -> dict:
    """Write ``probe.parquet``, ``summary.json`` and ``rho_by_timestep.png`` into ``directory``; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "table": directory / "probe.parquet",
        "summary": directory / "summary.json",
        "plot": directory / "rho_by_timestep.png",
    }
    write_table(table, paths["table"])
    summary = summarize(table)
    record = {
        "settings": settings or {},
        "versions": versions(),
        **(extra or {}),
        "rows": len(table),
        "summary": summary.to_dict(orient="records"),
    }
    write_json(paths["summary"], record)
    write_figure(plot_run(table), paths["plot"], dpi=120)
    return paths
