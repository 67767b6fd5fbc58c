"""Experiment ``attention``: learned heads against data-space NW weights across flow time (paper §A.5 S5, §D.4).

The CPU surrogate of the paper's IP-Adapter analysis: for the learned OFF models of the ``shells`` experiment
(first dimension, first seed) and of the ``collapse`` experiment (largest Gaussian-mixture dimension, first seed),
every (task, layer, head) entry compares the head's attention over the support with the Gaussian NW weights of
``x~ = x_t / t`` at ``h(t)``, through the probe's own statistics
(:func:`ipa_probe.statistics.agreement.compare_weights`): per-row Spearman mean, raveled Pearson, the permutation null,
and the fraction of entries with rho > 0.9. Flow times ``t`` in (0.1 … 0.99) stand for the paper's diffusion timesteps
981 … 1.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from ..statistics.schema import (  # noqa: E402
    GAUGE_COLUMNS,
    NULL_COLUMNS,
    STAT_NAMES,  # noqa: E402
    rows_column,
)
from .evaluate import head_statistics, held_out_tasks  # noqa: E402
from .report import ExperimentResult, Row, from_record, save_figure  # noqa: E402
from .shells import shell_model  # noqa: E402

#: The paper's diffusion timesteps beside our flow times (same ordering: noise to data).
PAPER_TIMESTEPS = (981, 761, 501, 261, 1)
#: Support points per held-out task (the ``m`` of the attention's rows).
SUPPORT = 50
#: Below this mean |rho| a panel says why its lines sit at zero.
FLAT_RHO = 0.1


def _stat(stats: torch.Tensor, name: str) -> torch.Tensor:
    return stats[..., STAT_NAMES.index(name)]


def _models(ctx) -> list[tuple[str, str, int, object]]:
    """(label, meta, d, model): the shells model and, when the collapse grid has a GMM dimension, its OFF model."""
    tier = ctx.tier
    dim = tier.shells_dims[0]
    models = [(f"shells d={dim}", "shells", dim, shell_model(ctx, dim, tier.seeds[0]))]
    gmm_dims = [d for d in tier.collapse_dims if d > 2]
    if gmm_dims:
        d = max(gmm_dims)
        model = ctx.trained("gmm", ctx.model_config(d), ctx.train_config(tier.collapse_steps, tier.seeds[0]))
        models.append((f"gmm d={d}", "gmm", d, model))
    return models


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot`; the rows, the measurements and the
    figure, written under ``ctx.out / "attention"``."""
    folder = ctx.out / "attention"
    folder.mkdir(parents=True, exist_ok=True)
    raw = measure(ctx)
    ts = list(ctx.tier.attention_ts)
    figures = [plot(raw, ts, folder)]
    return ExperimentResult("attention", table(raw, ts), {"measurements": raw}, figures)


def measure(ctx) -> dict[str, dict[float, dict]]:
    """The probe's statistics between each learned model's heads and the NW weights, per flow time.

    Returns:
        model label -> flow time -> means over tasks, layers and heads (``spearman``, ``pearson``, ``null``,
        ``frac_rho_gt_0.9``, ``top1``, ``neff_attn``, ``neff_nw``, the gauge columns ``logit_ratio``,
        ``rho_baseline``, ``rho_excess`` and the per-row shares against chance of
        :data:`~ipa_probe.statistics.schema.NULL_COLUMNS`; ``spearman_layer0``; ``per_head_spearman``, a (layers,
        heads) list). The NW weights here come from the data, not from the heads' own queries and keys, so the logit
        ratio is the estimate from the logits' per-row Pearson correlation (see
        :func:`ipa_probe.statistics.agreement.compare_weights`).
    """
    tier = ctx.tier
    raw = {}
    for label, meta_name, dim, model in _models(ctx):
        tasks = held_out_tasks(ctx.meta(meta_name, dim), tier.eval_tasks, SUPPORT, 64, 40_000 + dim)
        raw[label] = {}
        for t in tier.attention_ts:
            stats = head_statistics(model, tasks, t)  # (B, L, H, S)
            rho = _stat(stats, "spearman")
            raw[label][t] = {
                "spearman": float(rho.nanmean()),
                "spearman_layer0": float(rho[:, 0].nanmean()),
                "pearson": float(_stat(stats, "pearson").nanmean()),
                "null": float(_stat(stats, "spearman_null").nanmean()),
                "frac_rho_gt_0.9": float((rho > 0.9).float().mean()),
                "top1": float(_stat(stats, "top1").nanmean()),
                "neff_attn": float(_stat(stats, "neff_attn").nanmean()),
                "neff_nw": float(_stat(stats, "neff_nw").nanmean()),
                **{name: float(_stat(stats, name).nanmean()) for name in (*GAUGE_COLUMNS, *NULL_COLUMNS)},
                "per_head_spearman": rho.nanmean(0).tolist(),  # (L, H)
            }
    return raw


def table(raw: dict[str, dict[float, dict]], ts: list[float]) -> list[Row]:
    """Rows: the Spearman mean per model and flow time beside the paper's, and whether it rises along ``ts``."""
    rows = []
    for label, values in raw.items():
        for i, t in enumerate(ts):
            entry = values[t]
            # our grid's last point stands for the paper's last timestep (1); earlier ones have no published value.
            paper = "0.89 (timestep 1)" if i == len(ts) - 1 else "rising towards 0.89"
            rows.append(
                Row(
                    "per-row Spearman mean (all heads)",
                    f"{label}, t={t}",
                    f"{entry['spearman']:.3f}",
                    paper,
                    f"Pearson {entry['pearson']:.3f}; {100 * entry['frac_rho_gt_0.9']:.0f}% of heads ρ>0.9; "
                    f"null {entry['null']:+.3f}; layer 0 ρ {entry['spearman_layer0']:.3f}; "
                    f"n_eff heads {entry['neff_attn']:.3g} vs NW {entry['neff_nw']:.3g}; "
                    f"baseline from the logits' correlation {entry['rho_baseline']:.3f} "
                    f"(excess {entry['rho_excess']:+.3f}); rows ρ>0.9 {100 * entry[rows_column()]:.1f}% "
                    f"(chance {100 * entry[rows_column() + '_null']:.2g}%)",
                )
            )
        first, last = values[ts[0]]["spearman"], values[ts[-1]]["spearman"]
        rows.append(
            Row(
                "Spearman rises from first to last t",
                f"{label}: {ts[0]} → {ts[-1]}",
                f"{first:.3f} → {last:.3f} ({'rises' if last > first else 'does not rise'})",
                "rises",
                "permutation null ≈ 0 expected",
            )
        )
    return rows


def plot(raw: dict[str, dict[float, dict]], ts: list[float], folder: Path) -> Path:
    """One panel per model: the statistics across flow time and the paper's last-step value, one legend for the
    figure under the panels, each panel's range fitted to what it draws; returns the file."""
    import numpy as np

    from ..figstyle import DOUBLE_COLUMN, SINGLE_COLUMN, fit_ylim, paper_style

    paper = 0.89  # the paper's per-row Spearman at IP-Adapter's last timestep
    with paper_style():
        width = DOUBLE_COLUMN if len(raw) > 1 else SINGLE_COLUMN
        fig, axes = plt.subplots(1, len(raw), figsize=(width, 3.9), squeeze=False, layout="constrained")
        for ax, (label, values) in zip(axes[0], raw.items(), strict=True):
            series = {key: [values[t][key] for t in ts] for key in ("spearman", "pearson", "frac_rho_gt_0.9", "null")}
            ax.plot(ts, series["spearman"], marker="o", label="per-row Spearman ρ")
            ax.plot(ts, series["pearson"], marker="s", label="Pearson r (weights raveled)")
            ax.plot(ts, series["frac_rho_gt_0.9"], marker="^", label="fraction of heads with ρ > 0.9")
            ax.plot(ts, series["null"], "k--", label="permutation null of ρ")
            ax.set(xlabel="flow time t (noise → data)", ylabel="agreement with NW weights", title=label)
            flat = sum(abs(v) for v in series["spearman"]) / len(ts) < FLAT_RHO
            if not flat:
                named = "paper: IP-Adapter ρ at its last step"
                ax.scatter([ts[-1]], [paper], marker="x", color="C3", s=60, label=named)
            # a flat panel is fitted to its own lines (ρ 0.02 against a null of 0 stays visible); the text gives
            # the paper's value instead of a marker that would stretch the range to 1
            fit_ylim(ax, np.asarray(list(series.values())), include=[] if flat else [paper])
            if flat:  # say why the lines sit at zero, above the panel where no line runs under it
                neff = sum(values[t]["neff_attn"] for t in ts) / len(ts)
                ax.set_title(
                    f"{ax.get_title()}: ρ ≈ 0 (paper's IP-Adapter: {paper})\nheads attend almost uniformly "
                    f"(n_eff {neff:.0f} of {SUPPORT}),\nso their weights have no order to match"
                )
        entries = {}  # every panel's lines, each label once (a flat panel has no paper marker)
        for ax in axes[0]:
            entries.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
        fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=2, frameon=False)
        fig.suptitle("learned heads against data-space NW (ρ: mean over tasks, layers and heads)")
        return save_figure(fig, folder / "attention.png", (plot, fit_ylim), {"raw": raw, "ts": ts})


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no training, no evaluation)."""
    return [plot(from_record(record["measurements"]), list(record["tier"]["attention_ts"]), folder)]
