"""Experiment ``scarcity``: with few support points the learned model's amortised prior wins (paper §A.5, §D.3).

One learned OFF model per data set, trained with the support size drawn uniformly from ``{1..50}`` per batch
(the architecture accepts any ``m``; the paper trained one model per ``m`` [ASSUMED deviation, §D.3]), evaluated
with nested supports of each size on the same held-out tasks, against the plug-in (exact NW field). The §D.3 check
of that deviation: one more model per data set of ``tier.scarcity_check_data`` trained at the fixed
``m = tier.scarcity_check_m``, as the paper did, and scored at that ``m`` on the same tasks.
Data sets: synthetic PCA-feature classes and scikit-learn's digits (the paper used DINOv2-ImageNet, d = 16).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import ExperimentResult, Row, format_value, from_record, save_figure  # noqa: E402
from .tasks import TaskBatch  # noqa: E402

DIM = 16
M_TRAIN = (1, 50)
PAPER_GAIN = {10: "+24%", 50: "≈ +1% (ratio 0.99)"}


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot`; the rows, the measurements and the
    figure, written under ``ctx.out / "scarcity"``."""
    folder = ctx.out / "scarcity"
    folder.mkdir(parents=True, exist_ok=True)
    raw, checks = measure(ctx)
    figures = [plot(raw, folder, checks)]
    record = {"measurements": raw, "per_m_check": checks, "dim": DIM, "m_train": M_TRAIN}
    return ExperimentResult("scarcity", table(raw, checks), record, figures)


def measure(ctx) -> tuple[dict[str, dict[int, dict]], dict[str, dict]]:
    """MMD² of the plug-in and of the learned model with nested supports of each size, per data set.

    Returns:
        ``raw``: data set -> ``m`` -> ``{"plugin", "plugin_sem", "learned", "learned_sem", "gain_pct",
        "reference_points"}``; ``checks``: data set -> ``{"m", "learned", "learned_sem", "gain_pct"}`` of the model
        trained at the fixed ``m`` (§D.3 per-m check), for the tier's check data sets.
    """
    tier = ctx.tier
    raw, checks = {}, {}
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
        check_m = tier.scarcity_check_m
        if check_m is not None and check_m in raw[data] and data in tier.scarcity_check_data:
            per_m = ctx.trained(
                data, ctx.model_config(DIM), ctx.train_config(tier.scarcity_steps, tier.seeds[0], m=check_m)
            )
            learned = ctx.mmd_learned(per_m, TaskBatch(tasks.support[:, :check_m], tasks.target))
            plugin = raw[data][check_m]["plugin"]
            checks[data] = {
                "m": check_m,
                "learned": learned.mean,
                "learned_sem": learned.sem,
                "gain_pct": 100 * (plugin - learned.mean) / plugin,
            }
    return raw, checks


def table(raw: dict[str, dict[int, dict]], checks: dict[str, dict] | None = None) -> list[Row]:
    """Rows: the learned model's gain over the plug-in per data set and support size, beside the paper's, each data
    set followed by its §D.3 per-m check."""
    rows = []
    for data, values in raw.items():
        rows.extend(
            Row(
                "learned gain over plug-in",
                f"{data}, m={m}",
                format_value(entry["gain_pct"], percent=True),
                PAPER_GAIN.get(m, "> 0 at small m, ≈ 0 above m≈25"),
                f"MMD² plug-in {format_value(entry['plugin'], entry['plugin_sem'])}, "
                f"learned {format_value(entry['learned'], entry['learned_sem'])} (± s.e. over tasks)",
            )
            for m, entry in values.items()
        )
        if checks and data in checks:
            check = checks[data]
            mixed = format_value(values[check["m"]]["gain_pct"], percent=True)
            rows.append(
                Row(
                    "§D.3 check: model trained at one m",
                    f"{data}, m={check['m']}",
                    format_value(check["gain_pct"], percent=True),
                    PAPER_GAIN.get(check["m"], "> 0 at small m"),
                    f"learned (fixed m) {format_value(check['learned'], check['learned_sem'])}; the model trained on "
                    f"m ~ U{{1..50}} scores {mixed} on the same tasks",
                )
            )
    return rows


def plot(raw: dict[str, dict[int, dict]], folder: Path, checks: dict[str, dict] | None = None) -> Path:
    """One panel per data set: MMD² of the plug-in and of the learned model against the support size (bars: ± 1
    s.e.m. over held-out tasks), and the model trained at one ``m`` (§D.3 check) where there is one; 7 in wide, one key
    under the panels."""
    from ..figstyle import DOUBLE_COLUMN, SINGLE_COLUMN, label_log_axis, paper_style

    checks = checks or {}
    width = DOUBLE_COLUMN if len(raw) > 1 else SINGLE_COLUMN
    with paper_style():
        fig, axes = plt.subplots(1, len(raw), figsize=(width, 3.3), squeeze=False, layout="constrained")
        for ax, (data, values) in zip(axes[0], raw.items(), strict=True):
            ms = list(values)
            for key, label in (("plugin", "plug-in estimate"), ("learned", "learned model (OFF)")):
                ax.errorbar(
                    ms,
                    [max(values[m][key], 1e-6) for m in ms],
                    yerr=[values[m][f"{key}_sem"] for m in ms],
                    marker="o",
                    capsize=3,
                    label=label,
                )
            if data in checks:
                check = checks[data]
                ax.errorbar(
                    [check["m"]],
                    [check["learned"]],
                    yerr=[check["learned_sem"]],
                    marker="s",
                    ls="",
                    capsize=3,
                    label=f"learned, trained at m = {check['m']} only",
                )
            ax.set(xscale="log", yscale="log", xlabel="support size m", ylabel="MMD², generated vs reference",
                   title=f"{data} (d = {DIM})")  # fmt: skip
            label_log_axis(ax)
        entries = {}  # every panel's marks, each label once (the one-m check exists for some data sets only)
        for ax in axes[0]:
            entries.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=2, frameon=False)
        fig.suptitle("MMD² against support size (bars: ± 1 s.e.m. over held-out tasks)")
        return save_figure(fig, folder / "scarcity.png", (plot, label_log_axis), {"raw": raw, "checks": checks})


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no training, no evaluation)."""
    return [plot(from_record(record["measurements"]), folder, from_record(record["per_m_check"]))]
