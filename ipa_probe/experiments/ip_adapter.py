"""Experiment ``ip-adapter``: the paper's IP-Adapter analysis (§A.5 S5, §D.4), in kind, on the trained digits organism.

For many reference sets (4 held-out images of one digit each), the trained organism
(:func:`ipa_probe.tiny.digits.digits_pipeline`, recipe ``--recipe``) generates with the 50-step DDIM schedule of SD 1.x
while the probe (:func:`ipa_probe.probe`, matched bandwidth ``h^2 = sqrt(d_head)``, query frame ``"item"``) records,
at the paper's timesteps 981, 761, 501, 261 and 1, every image-branch head's per-row comparison of the attention with
Gaussian NW weights in two frames:

- the **query frame** (the headline, docs/gauge.md "The query frame"): NW weights ``softmax_i(L_qi - b_i)`` with
  ``b_i`` each key's log-partition over the item's own queries, exact (``qf_*``) and Gaussian (``qf_gauss_*``) form;
  made from the attention logits alone, so no reparametrisation of q and k that leaves the outputs unchanged moves
  them;
- the **stored frame** (the paper's definition): NW weights on the stored ``q, k``, which a per-head basis change
  of q and k moves at will.

Per timestep the table gives, for the query-frame rho (both forms), its excess over the baseline from its own logit
ratio and K (``qf_rho_excess``, ``qf_gauss_rho_excess``) and the stored-frame rho, the mean over reference sets of
the per-set mean (over layers and heads) with a 95 % bootstrap interval over sets, and the mean Pearson, the
permutation null and the fraction of (set, layer, head) entries with rho > 0.9, beside the paper's figure (a
stored-frame rho on SD 1.5). Set ``i`` generates from seed ``i``, so the interval over sets is over seeds too (the
two vary together). Control: the same architecture with its initial (untrained) weights, on the same reference
sets and seeds.

The stored-frame rho depends on the q/k gauge (issue #18, #28); beside it, from the same generations, the comparisons
that do not
(:mod:`ipa_probe.attribution`): each reference's share of the image-branch attention against the exact posterior over
the references' latents at the same ``x_t`` (rank agreement with a permutation test and bootstrap interval,
between-layer agreement, concentration, n_eff against the bandwidth ``h(t)``, a fitted data-space temperature) and
a verdict by the pre-stated rule of :func:`ipa_probe.attribution.verdict`, for the one-digit sets and for sets that
mix two digits (2 + 2 references, where the posterior has references of another class to rule out).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..schema import GAUGE_COLUMNS, query_frame_column  # noqa: E402
from .report import ExperimentResult, Row, as_records, from_record, save_figure  # noqa: E402

#: The paper's timesteps: the 50-step SD 1.x grid (steps_offset=1: 981, 961, ..., 1) at these step indices.
PAPER_TIMESTEPS = (981, 761, 501, 261, 1)
NUM_STEPS = 50
REFS_PER_SET = 4
#: The paper's mean per-row Spearman at the last timestep; it reports no value at the other timesteps.
PAPER_LAST_SPEARMAN = 0.89

#: The columns :func:`summarize_sets` gives a bootstrap interval over reference sets (``<column>_low``,
#: ``<column>_high``), where the probe's table has them: the query-frame rho (exact, Gaussian) and its excess over
#: its own baseline, first; the stored-frame rho keeps its older interval names ``ci_low`` / ``ci_high``.
INTERVAL_COLUMNS: tuple[str, ...] = (
    query_frame_column("spearman"),
    query_frame_column("spearman", "gaussian"),
    query_frame_column("rho_excess"),
    query_frame_column("rho_excess", "gaussian"),
)

#: Further query-frame columns :func:`summarize_sets` averages over entries (exact form, then Gaussian).
QUERY_FRAME_MEANS: tuple[str, ...] = tuple(
    query_frame_column(name, form)
    for form in ("exact", "gaussian")
    for name in ("pearson", "spearman_null", "logit_ratio", "rho_baseline")
)


def step_indices(num_steps: int = NUM_STEPS) -> list[int]:
    """Indices into the DDIM schedule of :data:`PAPER_TIMESTEPS` (50 steps, steps_offset=1: 0, 11, 24, 36, 49)."""
    from ..tiny.digits.model import _scheduler

    scheduler = _scheduler()
    scheduler.set_timesteps(num_steps)
    timesteps = scheduler.timesteps.tolist()
    missing = [t for t in PAPER_TIMESTEPS if t not in timesteps]
    if missing:
        raise ValueError(f"expected the {num_steps}-step schedule to contain {missing}; use 50 steps")
    return [timesteps.index(t) for t in PAPER_TIMESTEPS]


def organism_pipelines(recipe: str = "support") -> dict:
    """The trained organism of ``recipe`` and its untrained control (same architecture, initial weights), progress
    bars off: ``{"trained": pipe, "untrained": pipe}``.

    Raises:
        ValueError: an unknown recipe (the message lists the recipes).
    """
    from ..tiny.digits import digits_pipeline, untrained_digits_pipeline

    pipes = {"trained": digits_pipeline(recipe=recipe), "untrained": untrained_digits_pipeline(recipe=recipe)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def _reference_sets(count: int, seed: int = 0) -> list[tuple[int, list]]:
    from ..tiny.digits import digits_reference_images

    return [(i % 10, digits_reference_images(i % 10, REFS_PER_SET, seed=seed + i // 10)) for i in range(count)]


def _mixed_sets(count: int) -> list[tuple[tuple[int, int], list]]:
    from ..tiny.digits import digits_reference_images

    sets = []
    for i in range(count):
        a, b = i % 10, (i % 10 + 1 + (i // 10) % 9) % 10
        sets.append(
            ((a, b), digits_reference_images(a, 2, seed=100 + i) + digits_reference_images(b, 2, seed=200 + i))
        )
    return sets


def run_reference_set(pipe, references: list, seed: int, steps: list[int], guidance_scale: float = 1.0):
    """One generation with ``references``: the probe's table (conditional branch, image kind) and the attribution
    table (:func:`ipa_probe.attribution.reference_attribution`) at ``steps``."""
    from ..attribution import reference_attribution
    from ..tiny.digits import DIGITS_PROMPT

    result = reference_attribution(
        pipe,
        steps=steps,
        seed=seed,
        prompt=DIGITS_PROMPT,
        ip_adapter_image=[references],
        num_inference_steps=NUM_STEPS,
        guidance_scale=guidance_scale,
    )
    table = result.run.to_dataframe()
    return table[(table["branch"] == "cond") & (table["kind"] == "image")], result.table


def summarize_sets(per_set: pd.DataFrame) -> pd.DataFrame:
    """Per timestep: the query-frame and stored-frame rho over reference sets with bootstrap intervals, and the means
    of the other columns.

    Each rho is first averaged within a set (over its layers and heads; cells without a value, such as a query frame
    of one query, are left out), then over sets; the interval is a 95 % BCa bootstrap of that mean over sets
    (:func:`ipa_probe.sweep.aggregation.bootstrap_ci`, seeded).

    Args:
        per_set: the probe tables of all sets with a ``set`` column.

    Returns:
        one row per timestep (noise first): ``spearman`` (stored frame) with ``ci_low``, ``ci_high``; ``pearson``,
        ``null``, ``frac_rho_gt_0.9`` (stored frame); ``sets``, ``entries``; the means of :data:`GAUGE_COLUMNS`; and
        where the table has them, each of :data:`INTERVAL_COLUMNS` with ``<column>_low`` / ``<column>_high``,
        ``qf_frac_rho_gt_0.9`` / ``qf_gauss_frac_rho_gt_0.9`` (share of entries with a query-frame rho above 0.9,
        among the entries that have one), ``qf_entries`` (those entries) and the means of
        :data:`QUERY_FRAME_MEANS`.
    """
    from ..sweep.aggregation import bootstrap_ci

    rows = []
    for timestep, frame in per_set.groupby("timestep", sort=False):
        set_means = frame.groupby("set")["spearman"].mean().to_numpy()
        low, high = bootstrap_ci(set_means)
        row = {
            "timestep": int(timestep),
            "spearman": float(set_means.mean()),
            "ci_low": low,
            "ci_high": high,
            "pearson": float(frame["pearson"].mean()),
            "null": float(frame["spearman_null"].mean()),
            "frac_rho_gt_0.9": float((frame["spearman"] > 0.9).mean()),
            "sets": len(set_means),
            "entries": len(frame),
        }
        row.update({c: float(frame[c].mean()) for c in GAUGE_COLUMNS if c in frame.columns})
        for column in INTERVAL_COLUMNS:
            if column not in frame.columns:
                continue
            means = frame.groupby("set")[column].mean().to_numpy(np.float64)  # NaN cells left out per set
            means = means[np.isfinite(means)]
            row[column] = float(means.mean()) if means.size else math.nan
            row[f"{column}_low"], row[f"{column}_high"] = bootstrap_ci(means)
        for form in ("exact", "gaussian"):
            column = query_frame_column("spearman", form)
            if column in frame.columns:
                values = frame[column].to_numpy(np.float64)
                values = values[np.isfinite(values)]
                prefix = column.removesuffix("spearman")
                row[f"{prefix}frac_rho_gt_0.9"] = float((values > 0.9).mean()) if values.size else math.nan
                if form == "exact":
                    row["qf_entries"] = int(values.size)
        row.update({c: float(frame[c].mean()) for c in QUERY_FRAME_MEANS if c in frame.columns})
        rows.append(row)
    return pd.DataFrame(rows).sort_values("timestep", ascending=False).reset_index(drop=True)


def _h(value: float) -> str:
    """A bandwidth for the table: ``∞`` for infinite, else 3 significant digits."""
    return "∞" if math.isinf(value) else ("n/a" if math.isnan(value) else f"{value:.3g}")


def attribution_rows(label: str, summary: pd.DataFrame) -> list[Row]:
    """Table rows of one :func:`ipa_probe.attribution.summarize_attribution` summary (one per timestep)."""
    rows = []
    for r in summary.to_dict(orient="records"):
        rows.append(
            Row(
                "attention vs exact posterior (gauge-invariant)",
                f"{label}, t={r['timestep']:g}",
                f"{r['verdict']}: rank ρ {r['share_spearman']:+.2f} [{r['share_spearman_low']:+.2f}, "
                f"{r['share_spearman_high']:+.2f}], p {r['share_spearman_p']:.2g}; attention TV from uniform "
                f"{r['attention_tv']:.3f} [{r['attention_tv_low']:.3f}, {r['attention_tv_high']:.3f}]",
                "— (not in the paper)",
                f"posterior TV from uniform {r['posterior_tv']:.2f}; between-layer ρ {r['layer_agreement']:+.2f} "
                f"[{r['layer_agreement_low']:+.2f}, {r['layer_agreement_high']:+.2f}] (p "
                f"{r['layer_agreement_p']:.2g}); n_eff of {r['references']} refs: attention {r['attention_neff']:.2f} "
                f"per layer, {r['position_neff']:.2f} per position, posterior {r['posterior_neff']:.2f}; h(t) "
                f"{_h(r['bandwidth'])}, fitted h* {_h(r['fitted_bandwidth'])} [{_h(r['fitted_bandwidth_low'])}, "
                f"{_h(r['fitted_bandwidth_high'])}]; {r['sets']} sets",
            )
        )
    return rows


def _interval(rec: dict, column: str, signed: bool = False) -> str:
    """``value [low, high]`` of one of :data:`INTERVAL_COLUMNS` in a :func:`summarize_sets` record."""
    f = "+.3f" if signed else ".3f"
    return f"{rec[column]:{f}} [{rec[f'{column}_low']:{f}}, {rec[f'{column}_high']:{f}}]"


def query_frame_rows(label: str, summary: pd.DataFrame) -> list[Row]:
    """The headline rows of the table: per timestep, the query-frame rho (exact form, 95 % interval over sets) with
    the Gaussian form, both excesses over their own baselines, and the stored-frame rho beside it for reference.
    Empty when the summary has no query-frame columns (records made before the probe had them)."""
    rows = []
    exact, gauss = query_frame_column("spearman"), query_frame_column("spearman", "gaussian")
    if exact not in summary.columns:
        return rows
    for rec in summary.to_dict(orient="records"):
        t = rec["timestep"]
        paper = "— (the paper reports the stored frame only)" if label == "trained" else "— (control)"
        rows.append(
            Row(
                "query-frame per-row Spearman, exact b (mean of set means; invariant under the q/k group)",
                f"{label} organism, t={t}",
                _interval(rec, exact),
                paper,
                f"Gaussian b {_interval(rec, gauss)}; excess over the ρ its own logit ratio and K give: exact "
                f"{_interval(rec, 'qf_rho_excess', signed=True)}, Gaussian "
                f"{_interval(rec, 'qf_gauss_rho_excess', signed=True)} (baseline {rec['qf_rho_baseline']:.3f} / "
                f"{rec['qf_gauss_rho_baseline']:.3f}, r {rec['qf_logit_ratio']:.2f} / "
                f"{rec['qf_gauss_logit_ratio']:.2f}); Pearson {rec['qf_pearson']:.3f}; "
                f"{100 * rec['qf_frac_rho_gt_0.9']:.0f}% of heads ρ>0.9; "
                f"permutation null {rec['qf_spearman_null']:+.3f}; stored-frame ρ {rec['spearman']:.3f}; "
                f"{rec['sets']} reference sets and seeds, {rec['qf_entries']} of {rec['entries']} entries (a "
                "1 × 1 layer's frame of one query has no ρ)",
            )
        )
    return rows


def stored_frame_rows(label: str, summary: pd.DataFrame) -> list[Row]:
    """The stored-frame rows (the paper's definition, gauge-dependent): per timestep, the per-row Spearman with its
    95 % interval over sets, Pearson, the rho > 0.9 share, the null and the gauge columns."""
    rows = []
    last = PAPER_TIMESTEPS[-1]
    for rec in summary.to_dict(orient="records"):
        t = rec["timestep"]
        paper = f"{PAPER_LAST_SPEARMAN}" if (t == last and label == "trained") else "—"
        gauge = ""
        if all(c in rec for c in GAUGE_COLUMNS):
            gauge = (
                f"; gauge: logit ratio r {rec['logit_ratio']:.2f}, ρ expected from r and K alone "
                f"{rec['rho_baseline']:.3f}, excess {rec['rho_excess']:+.3f}"
            )
        rows.append(
            Row(
                "stored-frame per-row Spearman (mean of set means; moves under a per-head basis change of q, k)",
                f"{label} organism, t={t}",
                f"{rec['spearman']:.3f} [{rec['ci_low']:.3f}, {rec['ci_high']:.3f}]",
                paper if label == "trained" else "— (control)",
                f"Pearson {rec['pearson']:.3f}; {100 * rec['frac_rho_gt_0.9']:.0f}% of heads ρ>0.9; "
                f"permutation null {rec['null']:+.3f}; {rec['sets']} reference sets{gauge}",
            )
        )
    return rows


def run(ctx) -> ExperimentResult:
    from tqdm.auto import tqdm

    from .._io import write_table
    from ..attribution import ALPHA, POOLING_TV, sets_table, summarize_attribution

    tier, folder = ctx.tier, ctx.out / "ip-adapter"
    folder.mkdir(parents=True, exist_ok=True)
    steps = step_indices()
    populations = {
        "one digit": [refs for _, refs in _reference_sets(tier.ip_sets)],
        "2+2 mixed": [refs for _, refs in _mixed_sets(tier.ip_mixed_sets)],
    }
    pipes = organism_pipelines(ctx.recipe)
    summaries, attribution, raw = {}, {}, {"attribution": {}}
    for label, pipe in pipes.items():
        for population, sets in populations.items():
            probes, tables = [], []
            for i, refs in enumerate(tqdm(sets, desc=f"ip-adapter {label}, {population}", disable=not ctx.progress)):
                table, attributed = run_reference_set(pipe, refs, seed=i, steps=steps)
                probes.append(table.assign(set=i))
                tables.append(attributed)
            if population == "one digit":
                summaries[label] = summarize_sets(pd.concat(probes, ignore_index=True))
                raw[label] = summaries[label].to_dict(orient="records")
            key = f"{label}, {population} refs"
            attribution[key] = summarize_attribution(sets_table(tables), seed=0)
            raw["attribution"][key] = attribution[key].to_dict(orient="records")
            write_table(attribution[key], folder / f"attribution_{label}_{population.split()[0]}.csv")

    rows = []
    for label, summary in summaries.items():
        rows.extend(query_frame_rows(label, summary))
    for label, summary in summaries.items():
        rows.extend(stored_frame_rows(label, summary))
    for key, summary in attribution.items():
        rows.extend(attribution_rows(key, summary))

    figures = [plot(summaries, attribution, ctx.recipe, folder)]
    record = {
        "measurements": raw,
        "recipe": ctx.recipe,
        "num_inference_steps": NUM_STEPS,
        "timesteps": list(PAPER_TIMESTEPS),
        "step_indices": steps,
        "references_per_set": REFS_PER_SET,
        "reference_sets": tier.ip_sets,
        "mixed_sets": tier.ip_mixed_sets,
        "guidance_scale": 1.0,
        "bandwidth": "matched (h^2 = sqrt(d_head))",
        "query_frame": "item: b_i over one item's query positions at one step, per layer, head and adapter",
        "seeds_and_sets": "reference set i generates from seed i: intervals over sets are over seeds as well",
        "verdict_rule": (
            f"pooling if the upper end of the 95% interval of the mean per-layer TV distance of the attention shares "
            f"from uniform is below {POOLING_TV}; else tracks posterior if the one-sided permutation p of the mean "
            f"per-set Spearman (attention share vs exact posterior) is below {ALPHA} and its interval is above 0; "
            "else undecided"
        ),
        "fitted_bandwidth_null": "null in fitted_bandwidth* means infinite: uniform weights are KL-closest",
        "differences_from_paper": (
            "a 16x16 digits organism trained here (SD 1.5 block structure scaled down, 10 IP layers of 4 heads, "
            "8x8x4 latents), 4 tokens per reference and 4 references per set, no CFG; the paper used SD 1.5 with a "
            "published IP-Adapter on natural images"
        ),
    }
    return ExperimentResult("ip-adapter", rows, record, figures)


def plot(summaries: dict[str, pd.DataFrame], attribution: dict[str, pd.DataFrame], recipe: str, folder) -> Path:
    """The experiment's figure: rho per timestep in the query frame (invariant; with its intervals) and the stored
    frame (gauge-dependent), and the gauge-invariant panels of
    :mod:`ipa_probe.attribution.plots` (rank agreement, sharpness, fitted temperature).

    Args:
        summaries: ``"trained"`` / ``"untrained"`` -> :func:`summarize_sets` tables.
        attribution: ``"<label>, <population> refs"`` -> :func:`ipa_probe.attribution.summarize_attribution` tables.
        recipe: the organism's recipe (for the title).
        folder: where ``ip_adapter.png`` goes.
    """
    from ..attribution.plots import plot_agreement, plot_sharpness, plot_temperature

    fig, axes = plt.subplots(2, 2, figsize=(13, 13))
    ax = axes[0, 0]
    timesteps = next(iter(summaries.values()))["timestep"].tolist()
    x = np.arange(len(timesteps))
    colours = {"trained": "C0", "untrained": "C1"}
    exact, gauss = query_frame_column("spearman"), query_frame_column("spearman", "gaussian")
    entries, drawn, nulls = [], [], []
    for label, summary in summaries.items():
        colour = colours[label]
        if exact in summary.columns:  # the headline: query-frame rho, both forms, with their intervals
            (line,) = ax.plot(x, summary[exact], marker="o", color=colour, linewidth=2)
            band = ax.fill_between(
                x, summary[f"{exact}_low"], summary[f"{exact}_high"], color=colour, alpha=0.25, linewidth=0
            )
            entries.append(((line, band), f"{label}: query-frame ρ, exact b (band: 95% CI over sets and seeds)"))
            (line,) = ax.plot(x, summary[gauss], marker="^", linestyle="--", color=colour)
            band = ax.fill_between(
                x, summary[f"{gauss}_low"], summary[f"{gauss}_high"], color=colour, alpha=0.15, linewidth=0
            )
            entries.append(((line, band), f"{label}: query-frame ρ, Gaussian b"))
            line = ax.plot(x, summary["qf_rho_baseline"], "-.", color=colour, linewidth=1)[0]
            entries.append((line, f"{label}: query-frame ρ expected from its logit ratio and K alone"))
            drawn += [summary[c] for c in (f"{exact}_low", f"{exact}_high", gauss, "qf_rho_baseline")]
        (line,) = ax.plot(x, summary["spearman"], marker="s", linestyle=":", color=colour, alpha=0.7)
        entries.append((line, f"{label}: stored-frame ρ (the paper's; gauge-dependent)"))
        drawn.append(summary["spearman"])
        nulls.append(summary["qf_spearman_null"] if "qf_spearman_null" in summary.columns else summary["null"])
    if timesteps[-1] == PAPER_TIMESTEPS[-1]:
        paper = ax.scatter([x[-1]], [PAPER_LAST_SPEARMAN], marker="x", color="C3", s=60, zorder=3)
        entries.append((paper, "paper: stored-frame ρ (SD 1.5, t=1)"))
        drawn.append(pd.Series([PAPER_LAST_SPEARMAN]))
    values = pd.concat(drawn).to_numpy(np.float64)
    values = values[np.isfinite(values)]
    low, high = float(values.min()), float(values.max())
    pad = max(0.08 * (high - low), 0.01)
    ax.set_ylim(low - pad, high + pad)  # the data's range: differences of 0.02 stay visible
    null = pd.concat(nulls).to_numpy(np.float64)
    ax.set(xticks=x, xticklabels=timesteps, xlabel="timestep (noise → data)", ylabel="mean per-row Spearman ρ")
    ax.set_title(
        "attention vs Gaussian NW weights: query frame (invariant) and stored frame\n"
        f"permutation null {np.nanmin(null):+.3f} to {np.nanmax(null):+.3f} (below the axis)",
        fontsize=10,
    )
    ax.legend(*zip(*entries, strict=True), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    shown = {k: v for k, v in attribution.items() if k != "untrained, one digit refs"}
    palette = {"trained, one digit refs": "C0", "trained, 2+2 mixed refs": "C2", "untrained, 2+2 mixed refs": "C1"}
    plot_agreement(axes[0, 1], shown, palette)
    plot_sharpness(axes[1, 0], shown, palette)
    plot_temperature(axes[1, 1], shown, palette)
    fig.suptitle(f"IP-Adapter attention on the digits organism (recipe {recipe})", fontsize=10)
    inputs = as_records({"summaries": summaries, "attribution": attribution, "recipe": recipe})
    return save_figure(fig, Path(folder) / "ip_adapter.png", plot, inputs)


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    summaries = {label: pd.DataFrame(raw[label]) for label in ("trained", "untrained") if label in raw}
    attribution = {key: pd.DataFrame(values) for key, values in raw.get("attribution", {}).items()}
    return [plot(summaries, attribution, record.get("recipe", "support"), folder)]
