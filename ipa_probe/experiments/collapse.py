"""Experiment ``collapse``: the exact-NW branch helps in low dimension and not in high (paper §A.5, §D.1).

benefit(d) = (MMD²_off − MMD²_on) / MMD²_off × 100, with ON/OFF the learned model with/without the exact head,
trained with the same seeds and data stream; a paired t-test over seeds. ``d = 2`` uses the mixed 2-D family
(as the paper), larger ``d`` Gaussian mixtures. The NW ``n_eff`` panel (no training) is measured at ``t = 0.56``
on Gaussian mixtures for every dimension.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy import stats as sstats  # noqa: E402

from .evaluate import held_out_tasks, nw_neff  # noqa: E402
from .report import ExperimentResult, Row, format_value, from_record, save_figure  # noqa: E402

NEFF_T = 0.56
PAPER_BENEFIT = {2: "+28%", 4: "> 0 (p = 0.026)", 16: "≈ 0% (n.s.)"}
PAPER_NEFF = {2: "≈ 9", 16: "≈ 1", 32: "≈ 1", 64: "≈ 1"}


def meta_for(dim: int) -> str:
    """The paper's meta-distribution at ``dim``: the mixed 2-D family at ``d = 2``, Gaussian mixtures above."""
    return "mixed2d" if dim == 2 else "gmm"


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
    return mean, std


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot`; the rows, the measurements and the
    figure, written under ``ctx.out / "collapse"``."""
    folder = ctx.out / "collapse"
    folder.mkdir(parents=True, exist_ok=True)
    raw = measure(ctx)
    figures = [plot(raw, folder)]
    return ExperimentResult("collapse", table(raw), {"measurements": raw, "neff_t": NEFF_T}, figures)


def measure(ctx) -> dict[str, dict]:
    """The exact head's benefit per dimension (ON/OFF models per seed) and the NW ``n_eff`` per dimension.

    Returns:
        ``{"benefit": {d: {meta, per_seed, plugin_mmd, p_value, benefit_mean, benefit_std}}, "neff": {d: {mean,
        std}}}``.
    """
    tier = ctx.tier
    raw = {"benefit": {}, "neff": {}}
    for dim in tier.collapse_dims:
        meta = meta_for(dim)
        tasks = ctx.held_out(meta, dim)
        plugin = ctx.mmd_plugin(tasks)
        per_seed = []
        for seed in tier.seeds:
            arms = {}
            for arm, exact in (("on", True), ("off", False)):
                model = ctx.trained(
                    meta, ctx.model_config(dim, exact_head=exact), ctx.train_config(tier.collapse_steps, seed)
                )
                arms[arm] = ctx.mmd_learned(model, tasks).mean
            per_seed.append(
                {
                    "seed": seed,
                    "mmd_on": arms["on"],
                    "mmd_off": arms["off"],
                    "benefit_pct": 100 * (arms["off"] - arms["on"]) / arms["off"],
                }
            )
        benefit_mean, benefit_std = _mean_std([r["benefit_pct"] for r in per_seed])
        on = [r["mmd_on"] for r in per_seed]
        off = [r["mmd_off"] for r in per_seed]
        p_value = float(sstats.ttest_rel(off, on).pvalue) if len(per_seed) > 1 else math.nan
        raw["benefit"][dim] = {
            "meta": meta,
            "per_seed": per_seed,
            "plugin_mmd": plugin.mean,
            "p_value": p_value,
            "benefit_mean": benefit_mean,
            "benefit_std": benefit_std,
        }
    for dim in tier.neff_dims:
        # n_eff needs many tasks but no training: its own task set of neff_tasks tasks.
        tasks = held_out_tasks(ctx.meta("gmm", dim), tier.neff_tasks, 50, tier.neff_queries, seed=20_000 + dim)
        neff = nw_neff(tasks, NEFF_T)
        raw["neff"][dim] = {"mean": float(neff.mean()), "std": float(neff.std()) if neff.numel() > 1 else math.nan}
    return raw


def table(raw: dict[str, dict]) -> list[Row]:
    """Rows: benefit and MMD² per dimension beside the paper's, then the NW ``n_eff`` per dimension."""
    rows = []
    for dim, entry in raw["benefit"].items():
        per_seed = entry["per_seed"]
        rows.append(
            Row(
                "benefit of exact head",
                f"d={dim} ({entry['meta']})",
                format_value(entry["benefit_mean"], entry["benefit_std"], percent=True),
                PAPER_BENEFIT.get(dim, "between"),
                f"paired t-test over {len(per_seed)} seeds: p = {entry['p_value']:.3g}"
                if len(per_seed) > 1
                else "1 seed: no test",
            )
        )
        on = [r["mmd_on"] for r in per_seed]
        off = [r["mmd_off"] for r in per_seed]
        rows.append(
            Row(
                "MMD² on / off / plug-in",
                f"d={dim}",
                f"{_mean_std(on)[0]:.4g} / {_mean_std(off)[0]:.4g} / {entry['plugin_mmd']:.4g}",
                "—",
                "mean over seeds of the mean over held-out tasks",
            )
        )
    for dim, neff in raw["neff"].items():
        rows.append(
            Row(
                f"NW n_eff at t={NEFF_T}",
                f"d={dim} (gmm)",
                format_value(neff["mean"], neff["std"]),
                PAPER_NEFF.get(dim, "falling towards 1"),
                "Kish 1/Σw², m=50; spread over tasks",
            )
        )
    return rows


def plot(raw: dict[str, dict], folder: Path) -> Path:
    """Benefit against ``d`` (mean ± std over seeds, and each seed) and ``n_eff`` against ``d``, beside the paper's
    points; every mark in its panel's legend."""
    from ..figstyle import DOUBLE_COLUMN, label_log_axis, legend_below, paper_style

    with paper_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(DOUBLE_COLUMN, 4.0), layout="constrained")
        dims = list(raw["benefit"])
        seeds = max(len(raw["benefit"][d]["per_seed"]) for d in dims)
        ax1.axhline(0, color="grey", lw=0.8, label="no benefit")
        ax1.errorbar(
            dims,
            [raw["benefit"][d]["benefit_mean"] for d in dims],
            yerr=[0 if math.isnan(raw["benefit"][d]["benefit_std"]) else raw["benefit"][d]["benefit_std"]
                  for d in dims],
            marker="o",
            capsize=3,
            label=f"ours: mean ± std over {seeds} seeds" if seeds > 1 else "ours (1 seed)",
        )  # fmt: skip
        if seeds > 1:
            points = [(d, r["benefit_pct"]) for d in dims for r in raw["benefit"][d]["per_seed"]]
            ax1.scatter(*zip(*points, strict=True), color="C0", alpha=0.35, s=14, label="each seed")
        ax1.scatter([2, 16], [28, 0], marker="x", color="C3", label="paper (d = 2, 16)")
        ax1.set(xscale="log", xlabel="dimension d", ylabel="MMD² reduction by the exact head (%)",
                title="benefit of the exact-NW head\n(ON vs OFF)")  # fmt: skip
        ax1.set_xticks(dims, [str(d) for d in dims])
        ax1.minorticks_off()
        legend_below(ax1)  # inside, it covers the widest error bars
        nd = list(raw["neff"])
        ax2.plot(nd, [raw["neff"][d]["mean"] for d in nd], marker="o", label="ours (mean over tasks)")
        ax2.scatter([2, 16], [9, 1], marker="x", color="C3", label="paper (d = 2, 16)")
        ax2.axhline(1, color="grey", ls="--", lw=0.8, label="n_eff = 1 (nearest neighbour)")
        ax2.set(xscale="log", yscale="log", xlabel="dimension d", ylabel=f"NW n_eff at t = {NEFF_T}",
                title="kernel collapse:\nNW n_eff against dimension")  # fmt: skip
        ax2.set_xticks(nd, [str(d) for d in nd])
        ax2.minorticks_off()
        label_log_axis(ax2)
        legend_below(ax2)
        return save_figure(fig, folder / "collapse.png", (plot, label_log_axis), raw)


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no training, no evaluation)."""
    return [plot(from_record(record["measurements"]), folder)]
