"""Experiment ``shells``: an isotropic kernel on curved data (paper §A.5 Fig 2, §D.2).

ratio = MMD²_plug-in / MMD²_learned (learned = exact head OFF) on concentric spherical shells, with the NW
``n_eff`` at ``t = 0.56`` (not collapsed, so the failure is geometric) and, for the first dimension, the per-head
``n_eff`` of the learned layer-0 attention against the isotropic NW ``n_eff`` across ``t`` (Fig 2b).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .evaluate import head_neff, held_out_tasks, nw_neff  # noqa: E402
from .report import ExperimentResult, Row, format_value, from_record, save_figure  # noqa: E402

NEFF_T = 0.56
HEAD_TS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: Support points per task of the n_eff measurements (n_eff of uniform weights).
SUPPORT = 50
PAPER_RATIO = {8: ("11.2", "6.5"), 16: ("—", "—"), 32: ("6.4", "8.0")}


def shell_model(ctx, dim: int, seed: int):
    """The learned OFF model on shells in ``dim`` dimensions (shared with the ``attention`` experiment)."""
    return ctx.trained("shells", ctx.model_config(dim), ctx.train_config(ctx.tier.shells_steps, seed))


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot`; the rows, the measurements and the
    figure, written under ``ctx.out / "shells"``."""
    folder = ctx.out / "shells"
    folder.mkdir(parents=True, exist_ok=True)
    raw, neff_spread = measure(ctx)
    figures = [plot(raw, folder)]
    return ExperimentResult("shells", table(raw, neff_spread), {"measurements": raw, "neff_t": NEFF_T}, figures)


def measure(ctx) -> tuple[dict[str, dict], dict[int, float]]:
    """The plug-in/learned MMD² ratio and NW ``n_eff`` per dimension; layer-0 head ``n_eff`` against NW across ``t``.

    Returns:
        the measurements ``{"ratio": {d: ...}, "heads": {t: ...}}`` (recorded), and the spread of the NW ``n_eff``
        over tasks per dimension (for the table only).
    """
    tier = ctx.tier
    raw = {"ratio": {}, "heads": {}}
    neff_spread = {}
    for dim in tier.shells_dims:
        tasks = ctx.held_out("shells", dim)
        plugin = ctx.mmd_plugin(tasks)
        learned = [ctx.mmd_learned(shell_model(ctx, dim, seed), tasks).mean for seed in tier.seeds]
        neff_tasks = held_out_tasks(ctx.meta("shells", dim), tier.neff_tasks, SUPPORT, tier.neff_queries, 30_000 + dim)
        neff = nw_neff(neff_tasks, NEFF_T)
        raw["ratio"][dim] = {
            "plugin_mmd": plugin.mean,
            "plugin_sem": plugin.sem,
            "learned_mmd": learned,
            "ratio_per_seed": [plugin.mean / v for v in learned],
            "nw_neff": float(neff.mean()),
        }
        neff_spread[dim] = float(neff.std())

    dim = tier.shells_dims[0]
    model = shell_model(ctx, dim, tier.seeds[0])
    tasks = held_out_tasks(ctx.meta("shells", dim), tier.neff_tasks, SUPPORT, tier.neff_queries, 30_000 + dim)
    for t in HEAD_TS:
        per_head = head_neff(model, tasks, t)[0]  # (H,) layer 0
        raw["heads"][t] = {"head_neff_layer0": per_head.tolist(), "nw_neff": float(nw_neff(tasks, t).mean())}
    return raw, neff_spread


def table(raw: dict[str, dict], neff_spread: dict[int, float]) -> list[Row]:
    """Rows: the ratio and NW ``n_eff`` per dimension beside the paper's, then the layer-0 heads against NW."""
    rows = []
    for dim, entry in raw["ratio"].items():
        ratios, learned = entry["ratio_per_seed"], entry["learned_mmd"]
        ratio = sum(ratios) / len(ratios)
        spread = math.sqrt(sum((r - ratio) ** 2 for r in ratios) / (len(ratios) - 1)) if len(ratios) > 1 else None
        paper_ratio, paper_neff = PAPER_RATIO.get(dim, ("—", "—"))
        rows.append(
            Row(
                "MMD² plug-in / learned",
                f"d={dim}",
                format_value(ratio, spread, digits=3),
                paper_ratio,
                f"plug-in {entry['plugin_mmd']:.4g}, learned {sum(learned) / len(learned):.4g}; "
                f"{len(ratios)} seed(s); > 1 means learned better",
            )
        )
        rows.append(
            Row(
                f"NW n_eff at t={NEFF_T}",
                f"d={dim}",
                format_value(entry["nw_neff"], neff_spread[dim]),
                paper_neff,
                "not collapsed (≫ 1) means the failure is geometric",
            )
        )
    dim = next(iter(raw["ratio"]))
    for t, entry in raw["heads"].items():
        per_head, nw = entry["head_neff_layer0"], entry["nw_neff"]
        rows.append(
            Row(
                "layer-0 head n_eff (min–max) vs NW n_eff",
                f"d={dim}, t={t}",
                f"{min(per_head):.3g}–{max(per_head):.3g} vs {nw:.3g}",
                "heads above NW at late t",
                "learned heads resist collapse if heads > NW",
            )
        )
    return rows


def plot(raw: dict[str, dict], folder: Path) -> Path:
    """MMD² plug-in against learned per dimension (log scale, with their ratio written beside), and the layer-0
    heads' ``n_eff`` against NW across ``t`` beside the ``n_eff`` of uniform weights."""
    from ..figstyle import DOUBLE_COLUMN, fit_ylim, label_log_axis, legend_below, paper_style

    with paper_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(DOUBLE_COLUMN, 4.6), layout="constrained")
        dims = list(raw["ratio"])
        x = range(len(dims))
        plugin = [raw["ratio"][d]["plugin_mmd"] for d in dims]
        learned = [raw["ratio"][d]["learned_mmd"] for d in dims]  # per seed
        seeds = max(len(v) for v in learned)
        means = [sum(v) / len(v) for v in learned]
        # markers on a log axis, not bars: the learned MMD² is 2-16x below the plug-in's, and a bar's length on a
        # log axis would depend on where the axis starts
        ax1.plot(x, plugin, "s", ms=8, color="C0", label="plug-in")
        label = f"learned (OFF), mean of {seeds} seeds" if seeds > 1 else "learned (OFF)"
        ax1.plot(x, means, "o", ms=8, color="C1", label=label)
        if seeds > 1:
            points = [(i, v) for i, values in zip(x, learned, strict=True) for v in values]
            ax1.scatter(*zip(*points, strict=True), color="C1", alpha=0.45, s=16, label="learned, each seed")
        for i, p, m in zip(x, plugin, means, strict=True):
            if p > 0 and m > 0:  # an unbiased MMD² estimate can fall to 0 or below: no ratio, no point on a log axis
                ax1.annotate(f"ratio\n{p / m:.3g}×", (i, (p * m) ** 0.5), xytext=(8, 0),
                             textcoords="offset points", va="center")  # fmt: skip
        ax1.set_xticks(list(x), [f"d={d}" for d in dims])
        ax1.set_xlim(-0.5, len(dims) - 0.3)
        ax1.set(yscale="log", xlabel="dimension of the shells", ylabel="MMD², generated vs reference samples",
                title="shells: plug-in against learned\nMMD² per dimension (ratio: plug-in / learned)")  # fmt: skip
        fit_ylim(ax1, [*plugin, *(v for values in learned for v in values)], pad=0.3, log=True)
        label_log_axis(ax1)
        legend_below(ax1)
        ts = list(raw["heads"])
        heads = list(zip(*[raw["heads"][t]["head_neff_layer0"] for t in ts], strict=True))
        for h, series in enumerate(heads):
            ax2.plot(ts, series, marker="o", alpha=0.7, label=f"layer-0 head {h}")
        ax2.plot(ts, [raw["heads"][t]["nw_neff"] for t in ts], "k--", marker="s", label="isotropic NW")
        ax2.axhline(SUPPORT, color="grey", lw=0.8, ls=":", label=f"uniform weights (n_eff = {SUPPORT})")
        ax2.set(yscale="log", xlabel="flow time t", ylabel=f"n_eff (of {SUPPORT} support points)",
                title=f"shells d={dims[0]}: n_eff of learned\nheads against NW")  # fmt: skip
        label_log_axis(ax2)
        legend_below(ax2)  # inside, it covers the NW line
        return save_figure(fig, folder / "shells.png", (plot, fit_ylim, label_log_axis), raw)


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no training, no evaluation)."""
    return [plot(from_record(record["measurements"]), folder)]
