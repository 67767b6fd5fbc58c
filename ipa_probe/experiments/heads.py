"""Experiment ``heads``: MMD² against support size for H learned heads, and the fitted exponent (paper §A.5, §D.1).

Learned OFF models at ``d = 8`` (Gaussian mixtures), ``d_model`` fixed so ``d_k = d_model / H``, trained with the
support size drawn uniformly from the tier's range per batch and evaluated at each ``m``. The exponent ``alpha``
of ``MMD² ~ m^(-alpha)`` is the negative slope of a least-squares line through ``(log m, log mean MMD²)``, with a
95% t-interval from the slope's standard error [INFERRED protocol, §D.5]. The blockwise-NW plug-in with ``H``
coordinate blocks (paper §C.4, no training) is fitted the same way as a reference.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats as sstats  # noqa: E402

from .. import theory  # noqa: E402
from .report import ExperimentResult, Row, format_value, from_record, save_figure  # noqa: E402
from .tasks import TaskBatch  # noqa: E402

DIM = 8


def fit_exponent(ms: list[int], mmd: list[float]) -> dict:
    """``alpha`` in ``MMD² ~ m^(-alpha)`` with a 95% interval; points with MMD² <= 0 are left out.

    Returns:
        ``{"alpha", "low", "high", "points"}`` (NaN where fewer than 2 usable points, no interval below 3).
    """
    pts = [(math.log(m), math.log(v)) for m, v in zip(ms, mmd, strict=True) if v > 0]
    if len(pts) < 2:
        return {"alpha": math.nan, "low": math.nan, "high": math.nan, "points": len(pts)}
    x, y = np.array(pts).T
    fit = sstats.linregress(x, y)
    half = sstats.t.ppf(0.975, len(pts) - 2) * fit.stderr if len(pts) > 2 else math.nan
    return {"alpha": -fit.slope, "low": -fit.slope - half, "high": -fit.slope + half, "points": len(pts)}


def run(ctx) -> ExperimentResult:
    """Run the experiment: :func:`measure`, then :func:`table` and :func:`plot`; the rows, the measurements and the
    figure, written under ``ctx.out / "heads"``."""
    folder = ctx.out / "heads"
    folder.mkdir(parents=True, exist_ok=True)
    raw = measure(ctx)
    figures = [plot(raw, folder)]
    return ExperimentResult("heads", table(raw, ctx.tier.d_model), {"measurements": raw, "dim": DIM}, figures)


def measure(ctx) -> dict[int, dict]:
    """MMD² at each support size for one learned model per head count (and the blockwise plug-in), with the fits.

    Returns:
        heads ``H`` -> ``{"ms", "learned", "blockwise_plugin", "fit", "fit_blockwise"}`` (see :func:`fit_exponent`;
        the blockwise entries are empty / ``None`` where ``H`` does not divide the dimension).
    """
    tier = ctx.tier
    raw = {}
    ms = list(tier.heads_ms)
    tasks = ctx.held_out("gmm", DIM, m=max(ms))
    for n_heads in tier.heads_list:
        model = ctx.trained(
            "gmm",
            ctx.model_config(DIM, n_heads=n_heads),
            ctx.train_config(tier.heads_steps, tier.seeds[0], m=tier.heads_m_range[0], m_max=tier.heads_m_range[1]),
        )
        learned, blockwise = [], []
        for m in ms:
            sub = TaskBatch(tasks.support[:, :m], tasks.target)
            learned.append(ctx.mmd_learned(model, sub).mean)
            if DIM % n_heads == 0:
                velocity = lambda x, t, s=sub.support, h=n_heads: theory.blockwise_nw_velocity(x, t, s, n_heads=h)
                blockwise.append(ctx.mmd_of(velocity, sub).mean)
        raw[n_heads] = {
            "ms": ms,
            "learned": learned,
            "blockwise_plugin": blockwise,
            "fit": fit_exponent(ms, learned),
            "fit_blockwise": fit_exponent(ms, blockwise) if blockwise else None,
        }
    return raw


def table(raw: dict[int, dict], d_model: int) -> list[Row]:
    """Rows per head count: the fitted exponent (learned, and the blockwise plug-in's) and MMD² at each ``m``."""
    rows = []
    for n_heads, entry in raw.items():
        fit, fit_block, ms, learned = entry["fit"], entry["fit_blockwise"], entry["ms"], entry["learned"]
        interval = f"[{fit['low']:.2f}, {fit['high']:.2f}]" if not math.isnan(fit["low"]) else "no interval"
        rows.append(
            Row(
                "alpha (MMD² ~ m^-alpha), learned",
                f"H={n_heads}, d_k={d_model // n_heads}",
                f"{fit['alpha']:.3f} {interval}",
                "in 0.45–0.72",
                "95% t-interval over the m grid; paper's plot range, rising with H [INFERRED]",
            )
        )
        if fit_block is not None:
            rows.append(
                Row(
                    "alpha, blockwise-NW plug-in",
                    f"H={n_heads}, block dim={DIM // n_heads}",
                    format_value(fit_block["alpha"], digits=3),
                    "rate 4/(4+d/H) for velocity MSE",
                    "no training (§C.4)",
                )
            )
        rows.append(
            Row(
                "MMD² learned at each m",
                f"H={n_heads}",
                ", ".join(f"{m}: {v:.3g}" for m, v in zip(ms, learned, strict=True)),
                "—",
                "",
            )
        )
    return rows


def plot(raw: dict[int, dict], folder: Path) -> Path:
    """MMD² against ``m`` per head count, and the fitted exponent (with its 95% interval) against ``H`` beside the
    paper's range; 7 in wide, the right panel's key under the figure where it hides no interval."""
    from ..figstyle import DOUBLE_COLUMN, label_log_axis, paper_style

    with paper_style():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(DOUBLE_COLUMN, 3.4), layout="constrained")
        for n_heads, values in raw.items():
            ax1.plot(values["ms"], [max(v, 1e-6) for v in values["learned"]], marker="o", label=f"H = {n_heads}")
        ax1.set(xscale="log", yscale="log", xlabel="support size m", ylabel="MMD² (learned model)",
                title=f"MMD² against support size\nper head count H (d = {DIM})")  # fmt: skip
        label_log_axis(ax1)
        ax1.legend(title="heads")
        hs = list(raw)
        alphas = [raw[h]["fit"]["alpha"] for h in hs]
        err = [
            [0 if math.isnan(raw[h]["fit"]["low"]) else raw[h]["fit"]["alpha"] - raw[h]["fit"]["low"] for h in hs],
            [0 if math.isnan(raw[h]["fit"]["high"]) else raw[h]["fit"]["high"] - raw[h]["fit"]["alpha"] for h in hs],
        ]
        ax2.errorbar(hs, alphas, yerr=err, marker="o", capsize=3, label="ours: fitted α (bars: 95% CI of the fit)")
        ax2.axhspan(0.45, 0.72, color="C3", alpha=0.15, label="paper's range of α")
        ax2.set(xscale="log", xlabel="heads H", ylabel="α", title=f"fitted exponent α of MMD² ∝ m^(−α)\n(d = {DIM})")
        ax2.set_xticks(hs, [str(h) for h in hs])
        ax2.minorticks_off()
        # the right panel's key under the figure, where it hides no interval
        fig.legend(*ax2.get_legend_handles_labels(), loc="outside lower center", ncols=2, frameon=False)
        return save_figure(fig, folder / "heads.png", (plot, label_log_axis), raw)


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no training, no evaluation)."""
    return [plot(from_record(record["measurements"]), folder)]
