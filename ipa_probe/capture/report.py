"""Tables, summaries, plots and files made from a finished probe. Analysis lives here, apart from the capture code."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._io import versions, write_figure, write_json, write_table
from ..figstyle import MIN_FONT_PT, regular_ticks
from ..statistics.schema import (
    CELL_FIELDS,
    COLUMNS,
    FEW_KEYS,
    QUERY_FRAME_COLUMN,
    QUERY_FRAMES,
    QUERY_POOL_OTHER_COLUMN,
    SAMPLED_COLUMNS,
    SUMMARY_GAUGE_MEANS,
    SUMMARY_HEADLINE,
    SUMMARY_KEYS,
    SUMMARY_MAX,
    SUMMARY_MEANS,
    SUMMARY_QUERY_FRAME_MEANS,
    frac_column,
    frac_null_column,
    se_column,
)
from .layer_order import network_order

logger = logging.getLogger(__name__)

__all__ = [
    "COLUMNS",
    "HEATMAP_COLUMNS",
    "heatmap_table",
    "plot_heatmap",
    "plot_run",
    "query_pool_note",
    "run_table",
    "save_run",
    "select_branch",
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
        # the buffers sum squared standard errors: the mean of n cells has the root of their sum over n
        errors = [CELL_FIELDS.index(se_column(name)) for name in SAMPLED_COLUMNS]
        values[:, errors] = np.sqrt(values[:, errors] / counts.reshape(-1).numpy()[seen][:, None])  # (copied rows)
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
        frame[QUERY_FRAME_COLUMN] = config.query_frame
        frames.append(frame)
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=object if c == QUERY_FRAME_COLUMN else "float64") for c in COLUMNS})
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

    Columns: the group (:data:`~ipa_probe.statistics.schema.SUMMARY_KEYS`); first the headline, the means of
    :data:`~ipa_probe.statistics.schema.SUMMARY_HEADLINE` (``qf_spearman``, ``qf_gauss_spearman``: the query-frame rho,
    exact and Gaussian, invariant under every per-head basis change of q and k) and ``query_frame`` (the pool of
    queries that defined it); then the stored-frame statistics (NW weights from the stored q and k, gauge-dependent:
    see docs/gauge.md), the means of :data:`~ipa_probe.statistics.schema.SUMMARY_MEANS` (``spearman``, ``pearson``,
    ``spearman_null``, ``kl``, ``top1``, ``neff_attn``, ``neff_nw``, ``q_norm``, ``k_norm_spread``, ``ip_mass``,
    ``bandwidth``), ``spearman_std``,
    ``frac_rho_gt_<threshold>`` (fraction of the layer × head × adapter cells with a finite rho whose rho is above
    ``threshold``), ``rho_cells`` (how many finite-rho cells that fraction counts), the max of ``nonfinite``,
    ``cells`` (how many cells were averaged), then the means of
    :data:`~ipa_probe.statistics.schema.SUMMARY_GAUGE_MEANS` (the gauge diagnostics ``logit_ratio``, ``rho_baseline``,
    ``rho_excess`` and the per-row shares against chance) and ``frac_rho_gt_<threshold>_null``: the same fraction of
    cells over their permutation-null rho (``spearman_null``), the chance level of ``frac_rho_gt_<threshold>`` (see
    docs/gauge.md); last the means of the other query-frame columns
    (:data:`~ipa_probe.statistics.schema.SUMMARY_QUERY_FRAME_MEANS`); then the query pool's effect
    (:data:`POOL_COLUMNS`, from the table's :data:`~ipa_probe.statistics.schema.QUERY_POOL_OTHER_COLUMN`). Tables made
    before the query frame (or the other pool's column) existed give the same summary without those columns.
    """
    if table.empty:
        return pd.DataFrame()
    finite, null = table["spearman"].notna(), table.get("spearman_null")
    flags = {" above": (table["spearman"] > threshold).where(finite), " finite": finite}  # NaN: no rho, left out
    flags.update({" chance": (null > threshold).where(null.notna())} if null is not None else {})
    grouped = table.assign(**flags).groupby(list(SUMMARY_KEYS), observed=True, sort=True)
    headline = {name: (name, "mean") for name in SUMMARY_HEADLINE if name in table.columns}
    if headline and QUERY_FRAME_COLUMN in table.columns:
        headline[QUERY_FRAME_COLUMN] = (QUERY_FRAME_COLUMN, "first")  # one pool per run: its name
    means = {name: (name, "mean") for name in SUMMARY_MEANS if name in table.columns}
    aggregations = {**headline, **dict(list(means.items())[:2])}  # the fraction after spearman and pearson
    aggregations.update({frac_column(threshold): (" above", "mean"), "rho_cells": (" finite", "sum"), **means})
    aggregations["spearman_std"] = ("spearman", "std")
    aggregations.update({name: (name, "max") for name in SUMMARY_MAX if name in table.columns})
    aggregations["cells"] = ("spearman", "size")
    aggregations.update({name: (name, "mean") for name in SUMMARY_GAUGE_MEANS if name in table.columns})
    if null is not None:
        aggregations[frac_null_column(threshold)] = (" chance", "mean")
    aggregations.update({name: (name, "mean") for name in SUMMARY_QUERY_FRAME_MEANS if name in table.columns})
    reductions: dict[str, dict[str, None]] = {}  # one pass per reduction over all its columns, not one per column
    for column, how in aggregations.values():
        reductions.setdefault(how, {})[column] = None
    done = {how: grouped[list(of)].agg(how) for how, of in reductions.items() if how != "size"}
    done["size"] = grouped.size().to_frame("spearman")
    out = pd.concat(done, axis=1)[[pair[::-1] for pair in aggregations.values()]].set_axis(list(aggregations), axis=1)
    if QUERY_POOL_OTHER_COLUMN in table.columns and "qf_spearman" in table.columns:
        out = out.join(_pool_effect(grouped))
    return out.reset_index()


#: The summary's query-pool columns (:func:`summarize`), appended last: ``qf_spearman_other_pool`` (the mean
#: query-frame rho, exact form, had the frame been estimated over the other pool), ``qf_pool_shift`` (that mean minus
#: the mean ``qf_spearman``: each over its own defined cells, as each run would report it), ``qf_pool_shift_shared``
#: (the mean of the per-cell differences over the cells with a rho in both pools: what the pool does to the same
#: cells), ``qf_cells`` and ``qf_other_pool_cells`` (the cells with a rho in each pool: pooling a branch gives a
#: one-query layer a rho it has not per item), ``qf_spearman_sem`` (the standard error of the mean ``qf_spearman``:
#: the sample standard deviation of its defined cells over the square root of their number), ``qf_pools_coincide``
#: (every cell's rho is the same in both pools: each CFG branch held one item, so the pools are the same rows) and
#: ``qf_pool_exceeds_se`` (``|qf_pool_shift| > qf_spearman_sem``).
POOL_COLUMNS: tuple[str, ...] = (
    QUERY_POOL_OTHER_COLUMN,
    "qf_pool_shift",
    "qf_pool_shift_shared",
    "qf_cells",
    "qf_other_pool_cells",
    "qf_spearman_sem",
    "qf_pools_coincide",
    "qf_pool_exceeds_se",
)


def _pool_effect(grouped) -> pd.DataFrame:
    """:data:`POOL_COLUMNS` per group of a table's cells (a ``groupby`` of it)."""
    rows = {}
    for key, part in grouped:
        own, other = part["qf_spearman"].to_numpy(np.float64), part[QUERY_POOL_OTHER_COLUMN].to_numpy(np.float64)
        own_defined, other_defined = own[np.isfinite(own)], other[np.isfinite(other)]
        mean = own_defined.mean() if own_defined.size else np.nan
        other_mean = other_defined.mean() if other_defined.size else np.nan
        shared = np.isfinite(own) & np.isfinite(other)
        sem = own_defined.std(ddof=1) / np.sqrt(own_defined.size) if own_defined.size > 1 else np.nan
        coincide = bool(np.array_equal(own, other, equal_nan=True))
        shift = 0.0 if coincide else other_mean - mean
        shift_shared = (other[shared] - own[shared]).mean() if shared.any() else np.nan
        exceeds = bool(not coincide and abs(shift) > sem)  # False where sem is NaN (fewer than 2 cells)
        rows[key] = (other_mean, shift, shift_shared, own_defined.size, other_defined.size, sem, coincide, exceeds)
    index = pd.MultiIndex.from_tuples(list(rows), names=list(SUMMARY_KEYS))
    return pd.DataFrame(list(rows.values()), index=index, columns=list(POOL_COLUMNS))


def query_pool_note(summary: pd.DataFrame, most: int = 6) -> str:
    """One paragraph on the query pool from a summary's :data:`POOL_COLUMNS` (:meth:`~ipa_probe.ProbeRun.summary`
    puts it in ``attrs["query_pool"]``): "the pools coincide" where every CFG branch held one item; otherwise how
    far the other pool would move the mean query-frame rho, per summary row, and where that exceeds the standard error
    of the mean over cells (``qf_spearman_sem``), the ``most`` largest such rows named. ``""`` for a summary without
    the columns."""
    if summary.empty or "qf_pool_shift" not in summary.columns:
        return ""
    pool = str(summary[QUERY_FRAME_COLUMN].iloc[0]) if QUERY_FRAME_COLUMN in summary.columns else QUERY_FRAMES[0]
    other = next(name for name in QUERY_FRAMES if name != pool)
    if summary["qf_pools_coincide"].all():
        return (
            f"query pool: the pools coincide (each CFG branch held one item): query_frame={other!r} gives the same "
            f"query-frame rho as {pool!r} in every cell."
        )
    shift, shared = summary["qf_pool_shift"], summary["qf_pool_shift_shared"]
    over = summary[summary["qf_pool_exceeds_se"].astype(bool)]
    over = over.loc[over["qf_pool_shift"].abs().sort_values(ascending=False, kind="stable").index]  # largest first
    gained = int((summary["qf_other_pool_cells"] - summary["qf_cells"]).sum())
    text = (
        f"query pool: query_frame={other!r} instead of {pool!r} would move the mean query-frame rho (qf_spearman) by "
        f"{shift.min():+.4f} to {shift.max():+.4f} over {len(summary)} rows (step x kind x branch), "
        f"{shared.min():+.4f} to {shared.max():+.4f} on the cells with a rho in both pools"
    )
    if gained > 0:
        text += f" (the other pool has a rho in {gained} more cells: pooled, a one-query layer's frame has several)"
    elif gained < 0:
        text += f" (the other pool has a rho in {-gained} fewer cells: per item, a one-query layer's frame has one)"
    text += (
        f"; by more than the standard error of the mean (sd of the cells' rho / sqrt(cells), qf_spearman_sem) in "
        f"{len(over)} of {len(summary)} rows"
    )
    if len(over):
        named = [
            f"t={row.timestep:g} {row.kind} {row.branch} {row.qf_pool_shift:+.4f} (SE {row.qf_spearman_sem:.4f})"
            for row in over.head(most).itertuples()
        ]
        text += ": " + "; ".join(named) + ("; ..." if len(over) > most else "")
    return text + "."


def select_branch(table, branch: str | None, what: str):
    """The rows of ``table`` of one CFG branch (all rows for ``None``), for the ``branch=`` argument of
    :meth:`~ipa_probe.ProbeRun.summary`, ``map_table`` and ``reference_mass``; an unrecorded branch is a ValueError
    naming the recorded ones (``what``: the method, for the message)."""
    if branch is None or table.empty:
        if branch is not None:
            raise ValueError(f"{what}(branch={branch!r}): the table is empty (nothing was recorded)")
        return table
    present = sorted(set(table["branch"]))
    if branch not in present:
        raise ValueError(f"{what}(branch={branch!r}): no such branch recorded; expected one of {present} or None")
    return table[table["branch"] == branch].reset_index(drop=True)


#: Columns :func:`plot_run` draws as layer x timestep heat maps beside the lines, those the table has: the
#: query-frame rho (``qf_spearman``, invariant under every per-head basis change of q and k), the stored-frame per-row
#: Spearman and, where the table has it, ``rho_excess`` (stored-frame Spearman minus the rho that the q/k gauge alone
#: predicts).
HEATMAP_COLUMNS: tuple[str, ...] = ("qf_spearman", "spearman", "rho_excess")


def plot_run(
    table: pd.DataFrame,
    ax=None,
    branch: str = "cond",
    kind: str = "image",
    heatmaps: tuple[str, ...] | None = HEATMAP_COLUMNS,
):
    """The query-frame rho (``qf_spearman``, exact form, and ``qf_gauss_spearman``; invariant under every per-head
    basis change of q and k: the headline) with its baseline, and the stored-frame per-row Spearman (band: ± one std
    of the stored-frame rho over layers and heads; gauge-dependent) with its baseline, by timestep; the permutation
    nulls in a panel of their own; and a layer x timestep heat map of each of ``heatmaps`` that the table has
    (:func:`plot_heatmap`). The title states the selection (branch, steps, layers, heads averaged).

    Drawn for a paper: 7 in wide with heat maps, 3.5 in (one column) without; text at 8 pt or more. The x axes run
    in the denoising direction (high timestep on the left); each panel's y range fits what it draws. Falls back to the
    table's only kind when ``kind`` is absent (a text-only probe).

    ``ax``: an axes for the lines alone (nulls on the same axes, no heat maps), or ``None`` for a new figure.
    """
    import matplotlib.pyplot as plt

    from ..figstyle import DOUBLE_COLUMN, SINGLE_COLUMN, paper_style

    if not table.empty and kind not in set(table["kind"]):  # e.g. a text-only probe
        kind = str(table["kind"].iloc[0])
    columns = [c for c in (heatmaps or ()) if c in table.columns and not table.empty] if ax is None else []
    with paper_style():
        if ax is None:
            layers = table["layer"].nunique() if "layer" in table.columns and not table.empty else 0
            if columns:
                fig = plt.figure(figsize=(DOUBLE_COLUMN, 4.6 + 0.16 * layers), layout="constrained")
                grid = fig.add_gridspec(3, len(columns), height_ratios=[2.2, 1.0, 1.0 + 0.16 * layers])
                ax = fig.add_subplot(grid[0, : max(1, len(columns) - 1)])
                null_ax = fig.add_subplot(grid[0, -1]) if len(columns) > 1 else None
                legend_ax = fig.add_subplot(grid[1, :])
                for i, column in enumerate(columns):
                    plot_heatmap(table, column, ax=fig.add_subplot(grid[2, i]), branch=branch, kind=kind,
                                 labels=i == 0)  # fmt: skip
            else:
                fig = plt.figure(figsize=(SINGLE_COLUMN, 5.6), layout="constrained")
                grid = fig.add_gridspec(3, 1, height_ratios=[2.2, 1.2, 1.6])
                ax, null_ax, legend_ax = (fig.add_subplot(grid[i, 0]) for i in range(3))
        else:
            fig, null_ax, legend_ax = ax.figure, None, None
        _draw_lines(table, ax, null_ax, legend_ax, branch, kind)
    return fig


def _draw_lines(table, ax, null_ax, legend_ax, branch: str, kind: str) -> None:
    """The lines of :func:`plot_run`: headline and stored frame on ``ax``, nulls on ``null_ax`` (``ax`` if none), the
    legend on ``legend_ax`` (under ``ax`` if none)."""
    summary = summarize(table)
    if not summary.empty:
        summary = summary[(summary["branch"] == branch) & (summary["kind"] == kind)]
    nulls = null_ax if null_ax is not None else ax
    drawn, drawn_null = [0.0], [0.0]
    for call, part in summary.groupby("call") if not summary.empty else ():
        suffix = f" (call {call})" if summary["call"].nunique() > 1 else ""
        x = part["timestep"].to_numpy()
        frame = f", {part[QUERY_FRAME_COLUMN].iloc[0]} frame" if QUERY_FRAME_COLUMN in part else ""
        for column, style, what in (
            (SUMMARY_HEADLINE[0], {"marker": "s", "linewidth": 2.0, "color": "black"}, "exact"),
            (SUMMARY_HEADLINE[1], {"linestyle": "--", "color": "dimgrey"}, "Gaussian"),
        ):
            if column in part and part[column].notna().any():
                ax.plot(x, part[column], markersize=3, label=f"query-frame ρ ({what}{frame}){suffix}", **style)
                drawn += [*part[column]]
        if "qf_rho_baseline" in part and part["qf_rho_baseline"].notna().any():
            ax.plot(x, part["qf_rho_baseline"], color="black", linestyle=":", label=f"query-frame ρ baseline{suffix}")
            drawn += [*part["qf_rho_baseline"]]
        rho = part["spearman"].to_numpy()
        std = part["spearman_std"].fillna(0).to_numpy()
        line = ax.plot(x, rho, marker="o", markersize=3, color="tab:blue", label=f"stored-frame ρ{suffix}")[0]
        ax.fill_between(x, rho - std, rho + std, color=line.get_color(), alpha=0.15,
                        label=f"stored-frame ρ ± 1 std over layers × heads{suffix}")  # fmt: skip
        if "rho_baseline" in part and part["rho_baseline"].notna().any():
            ax.plot(
                x, part["rho_baseline"], color="tab:blue", linestyle="-.", label=f"stored-frame ρ baseline{suffix}"
            )
            drawn += [*part["rho_baseline"]]
        drawn += [*(rho - std), *(rho + std)]
        if "qf_spearman_null" in part and part["qf_spearman_null"].notna().any():
            nulls.plot(x, part["qf_spearman_null"], color="black", linestyle=":", marker=".",
                       label=f"query-frame ρ, permutation null{suffix}")  # fmt: skip
            drawn_null += [*part["qf_spearman_null"]]
        nulls.plot(x, part["spearman_null"], color="tab:blue", linestyle=":", marker=".",
                   label=f"stored-frame ρ, permutation null{suffix}")  # fmt: skip
        drawn_null += [*part["spearman_null"]]
    if null_ax is None:
        drawn += drawn_null
    # the nulls in a panel of their own: the headline's range fits the headline alone
    style_timestep_axes(ax, drawn[1:] if null_ax is not None else drawn, zero=null_ax is None)
    ax.set_ylabel("ρ (attention vs NW)")
    steps = summary["step"].nunique() if not summary.empty else 0
    layers = table["layer"].nunique() if "layer" in table and not table.empty else 0
    heads = table["head"].nunique() if "head" in table and not table.empty else 0
    span = f", t {summary['timestep'].max():.0f}→{summary['timestep'].min():.0f}" if steps else ""
    what = "IP-Adapter" if kind == "image" else "text"
    ax.set_title(f"{what} attention vs NW: {branch} branch, {steps} steps{span},\nmean over {layers} layers × {heads} "
                 "heads", fontsize=MIN_FONT_PT)  # fmt: skip
    if null_ax is not None:
        style_timestep_axes(null_ax, drawn_null)
        null_ax.set_ylabel("ρ under the null")
        null_ax.set_title("chance: NW shuffled", fontsize=MIN_FONT_PT)
    handles, labels = [], []
    for a in dict.fromkeys([ax, nulls]):
        more, names = a.get_legend_handles_labels()
        handles, labels = handles + more, labels + names
    if legend_ax is not None:
        legend_ax.set_axis_off()
        legend_ax.legend(handles, labels, loc="center", ncol=2 if legend_ax.bbox.width > 400 else 1,
                         frameon=False, fontsize=MIN_FONT_PT)  # fmt: skip
    else:
        ax.legend(handles, labels, fontsize=MIN_FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


#: Where the colour of a heat map of differences (``rho_excess``) saturates: a rho 0.1 above or below its baseline.
EXCESS_RANGE = 0.1

#: Titles of the heat maps' columns (a column name is no title).
_READABLE = {
    "qf_spearman": "query-frame ρ (exact)",
    "qf_gauss_spearman": "query-frame ρ (Gaussian)",
    "spearman": "stored-frame ρ",
    "rho_excess": "stored-frame ρ − baseline",
}


def heatmap_table(table: pd.DataFrame, column: str = "spearman", branch: str = "cond", kind: str = "image"):
    """``column`` averaged over heads, adapters and calls per layer (rows, in network order: down, mid, up) and
    timestep (columns, in the denoising direction: high timestep first)."""
    if column not in table.columns:
        raise ValueError(f"column {column!r} is not in the table; pick one of {list(table.columns)}")
    part = table[(table["branch"] == branch) & (table["kind"] == kind)]
    if part.empty:
        raise ValueError(f"no rows with branch={branch!r} and kind={kind!r}; the table has branches "
                         f"{sorted(set(table['branch']))} and kinds {sorted(set(table['kind']))}")  # fmt: skip
    # dropna=False: a layer where the column is undefined throughout (the query-frame rho of a one-query layer) stays
    # as an empty row, so every heat map of a figure lists the same layers
    grid = part.pivot_table(
        index="layer", columns="timestep", values=column, aggfunc="mean", observed=True, dropna=False
    )
    grid = grid.reindex(network_order([str(name) for name in grid.index]))
    return grid.sort_index(axis=1, ascending=False)


def plot_heatmap(
    table: pd.DataFrame, column: str = "spearman", ax=None, branch: str = "cond", kind: str = "image", labels=True
):
    """A layer x timestep heat map of ``column`` (mean over heads, adapters and calls), with a colorbar.

    Colour: a diverging map centred at 0 with a symmetric range when the values take both signs (``rho_excess``
    does), else a sequential map over the values' range; the colorbar and the title say which.

    Returns:
        the ``matplotlib.figure.Figure``.
    """
    import matplotlib.pyplot as plt

    grid = heatmap_table(table, column, branch, kind)
    values = grid.to_numpy(np.float64)  # (layers, timesteps)
    if ax is None:
        _, ax = plt.subplots(figsize=(3.5, 2.0 + 0.16 * len(grid)), layout="constrained")
    fig = ax.figure
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if low < 0 < high:  # a difference: its colour saturates at a stated effect size, not at the data's extreme
        top = EXCESS_RANGE
        style, scale = (
            {"cmap": "RdBu_r", "vmin": -top, "vmax": top},
            f"saturates at ±{top:g}",
        )
    else:
        high = high if high > low else low + 1e-6
        style, scale = {"cmap": "viridis", "vmin": low, "vmax": high}, f"sequential, {low:.3g} to {high:.3g}"
    image = ax.imshow(values, aspect="auto", interpolation="nearest", **style)
    for row in np.flatnonzero(~np.isfinite(values).any(axis=1)):  # a blank row says why it is blank
        ax.text(values.shape[1] / 2 - 0.5, row, "undefined", ha="center",
                va="center", fontsize=MIN_FONT_PT, color="dimgrey")  # fmt: skip
    timesteps = grid.columns.to_numpy(np.float64)
    ticks = regular_ticks(len(timesteps), most=5)  # one stride, labels clear of each other on a third of a page
    ax.set_xticks(ticks, [f"{timesteps[i]:g}" for i in ticks], fontsize=MIN_FONT_PT)
    names, suffix = short_layer_names([str(name) for name in grid.index])
    ax.set_yticks(range(len(grid)), [_compact(n) for n in names] if labels else [], fontsize=MIN_FONT_PT)
    ax.set_xlabel("timestep (denoising →)", fontsize=MIN_FONT_PT)
    if labels:
        ax.set_ylabel("layer (network order)", fontsize=MIN_FONT_PT)
    what = _READABLE.get(column, column)
    ax.set_title(f"{what}\n({branch}, mean over heads)", fontsize=MIN_FONT_PT)
    bar = fig.colorbar(image, ax=ax, shrink=0.9, location="bottom", extend="both" if low < 0 < high else "neither")
    bar.set_label(f"{column}\n({scale})", fontsize=MIN_FONT_PT)
    bar.ax.tick_params(labelsize=MIN_FONT_PT)
    return fig


def _compact(name: str) -> str:
    """A layer id short enough for a tick label: ``down_blocks.1.attentions.0`` -> ``down1.a0``, ``mid_block...`` ->
    ``mid``, ``transformer_blocks.3`` -> ``block3``."""
    import re

    name = re.sub(r"^down_blocks\.(\d+)", r"down\1", name)
    name = re.sub(r"^up_blocks\.(\d+)", r"up\1", name)
    name = re.sub(r"^mid_block(\.attentions\.0)?", "mid", name)
    name = re.sub(r"\.attentions\.(\d+)", r".a\1", name)
    return re.sub(r"^(single_)?transformer_blocks\.(\d+)", r"\1block\2", name)


def short_layer_names(names: list[str]) -> tuple[list[str], str]:
    """Layer ids without the dotted ending they all share (e.g. ``.transformer_blocks.0.attn2``), and that ending."""
    parts = [name.split(".") for name in names]
    shared = 0
    while len(names) > 1 and shared < min(map(len, parts)) - 1 and len({p[-1 - shared] for p in parts}) == 1:
        shared += 1
    if shared == 0:
        return names, ""
    return [".".join(p[:-shared]) for p in parts], "." + ".".join(parts[0][-shared:])


def style_timestep_axes(ax, values=None, zero: bool = True) -> None:
    """Axes of a correlation-by-timestep plot: x in the denoising direction, a zero line, and y fitting ``values``
    (the numbers drawn; 0 in range unless ``zero=False``) with a margin, within [-1.05, 1.05]; [-1.05, 1.05] without
    values."""
    ax.set_xlabel("timestep (denoising →)")
    ax.set_ylabel("attention vs NW")
    finite = np.asarray([v for v in (values if values is not None else []) if np.isfinite(v)], dtype=np.float64)
    if finite.size:
        low, high = float(finite.min()), float(finite.max())
        if zero:
            low, high = min(low, 0.0), max(high, 0.0)
        pad = max(0.05 * (high - low), 0.02)
        ax.set_ylim(max(low - pad, -1.05), min(high + pad, 1.05))
    else:
        ax.set_ylim(-1.05, 1.05)
    if ax.get_ylim()[0] <= 0 <= ax.get_ylim()[1]:
        ax.axhline(0, color="black", linewidth=0.5)
    if not ax.xaxis_inverted():
        ax.invert_xaxis()


def save_run(table: pd.DataFrame, directory, settings: dict | None = None, extra: dict | None = None) -> dict:
    """Write ``probe.parquet``, ``summary.json`` (with the query pool's effect in words, :func:`query_pool_note`) and
    ``rho_by_timestep.png`` into ``directory``; return their paths."""
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
        "query_pool": query_pool_note(summary),
    }
    write_json(paths["summary"], record)
    write_figure(plot_run(table), paths["plot"])
    return paths
