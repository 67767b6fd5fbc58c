"""Experiment ``scarcity``: with few support points the learned model's amortised prior wins (paper §A.5, §D.3).

One learned OFF model per data set, trained with the support size drawn uniformly from ``{1..50}`` per batch
(the architecture accepts any ``m``; the paper trained one model per ``m`` [ASSUMED deviation, §D.3]), evaluated
with nested supports of each size on the same held-out tasks, against the plug-in (exact NW field).
Data sets: synthetic PCA-feature classes and scikit-learn's digits (the paper used DINOv2-ImageNet, d = 16).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import ExperimentResult, Row, format_value, save_figure  # noqa: E402
from .tasks import TaskBatch  # noqa: E402

DIM = 16
M_TRAIN = (1, 50)
PAPER_GAIN = {10: "+24%", 50: "≈ +1% (ratio 0.99)"}


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot` of the measurements.

    Returns:
        the rows, the measurements and the figure, written under ``ctx.out / "scarcity"``.
    """
    folder = ctx.out / "scarcity"
    folder.mkdir(parents=True, exist_ok=True)
    raw = measure(ctx)
    figures = [plot(raw, folder)]
    record = {"measurements": raw, "dim": DIM, "m_train": M_TRAIN}
    return ExperimentResult("scarcity", table(raw), record, figures)


def measure(ctx) -> dict[str, dict[int, dict]]:
    """MMD² of the plug-in and of the learned model with nested supports of each size, per data set.

    Returns:
        data set -> ``m`` -> ``{"plugin", "plugin_sem", "learned", "learned_sem", "gain_pct", "reference_points"}``.
    """
    tier = ctx.tier
    raw = {}
    m_max = max(tier.scarcity_ms)
    for data in tier.scarcity_data:
        model = ctx.trained(
            data,
            ctx.model_config(DIM),
            ctx.train_config(tier.scarcity_steps, tier.seeds[0], m=M_TRAIN[0], m_max=max(M_TRAIN[1], m_max)),
        )
        tasks = ctx.held_out(data, DIM, m=m_max)
        raw[data] = {}
        for m in tier.scarcity_ms:
            sub = TaskBatch(tasks.support[:, :m], tasks.target)
            plugin, learned = ctx.mmd_plugin(sub), ctx.mmd_learned(model, sub)
            raw[data][m] = {
                "plugin": plugin.mean,
                "plugin_sem": plugin.sem,
                "learned": learned.mean,
                "learned_sem": learned.sem,
                "gain_pct": 100 * (plugin.mean - learned.mean) / plugin.mean,
                "reference_points": tasks.target.shape[1],
            }
    return raw


def table(raw: dict[str, dict[int, dict]]) -> list[Row]:
    """Rows: the learned model's gain over the plug-in per data set and support size, beside the paper's."""
    return [
        Row(
            "learned gain over plug-in",
            f"{data}, m={m}",
            format_value(entry["gain_pct"], percent=True),
            PAPER_GAIN.get(m, "> 0 at small m, ≈ 0 above m≈25"),
            f"MMD² plug-in {format_value(entry['plugin'], entry['plugin_sem'])}, "
            f"learned {format_value(entry['learned'], entry['learned_sem'])} (± s.e. over tasks)",
        )
        for data, values in raw.items()
        for m, entry in values.items()
    ]


def plot(raw: dict[str, dict[int, dict]], folder: Path) -> Path:
    """One panel per data set: MMD² of the plug-in and of the learned model against the support size."""
    fig, axes = plt.subplots(1, len(raw), figsize=(4.5 * len(raw), 3.5), squeeze=False)
    for ax, (data, values) in zip(axes[0], raw.items(), strict=True):
        ms = list(values)
        for key, label in (("plugin", "plug-in"), ("learned", "learned (OFF)")):
            ax.errorbar(
                ms,
                [max(values[m][key], 1e-6) for m in ms],
                yerr=[values[m][f"{key}_sem"] for m in ms],
                marker="o",
                capsize=3,
                label=label,
            )
        ax.set(xscale="log", yscale="log", xlabel="support size m", ylabel="MMD²", title=f"{data} (d={DIM})")
        ax.legend()
    return save_figure(fig, folder / "scarcity.png")
