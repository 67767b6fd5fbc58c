"""Experiment ``ip-adapter``: the paper's IP-Adapter analysis (§A.5 S5, §D.4), in kind, on the trained digits organism.

For many reference sets (4 held-out images of one digit each; set ``i`` from seed ``i``) the trained organism
(:func:`ipa_probe.tiny.digits.digits_pipeline`, recipe ``--recipe``, 50-step DDIM) generates while the probe records,
at the paper's timesteps 981, 761, 501, 261 and 1, every image-branch head's comparison of the attention with
Gaussian NW weights in the query frame (the headline, gauge-invariant, docs/gauge.md "The query frame") and the
stored frame (the paper's definition, gauge-dependent). Per timestep: each rho and its excess over its own logit-ratio
baseline, means over sets with a 95 % bootstrap interval, Pearson, the null and the rho > 0.9 fractions. Controls
(:mod:`~.matched_control`, also the query pool): the untrained twin, the twin matched to the trained logit ratio and
the trained organism with its adapter at its starting weights, compared at equal ratio, each ratio recorded;
beside them, from the same generations, the gauge-invariant reference attribution of :mod:`ipa_probe.attribution`
for one-digit and 2 + 2 sets. The findings: docs/findings.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..figstyle import fit_ylim, label_log_axis, legend_below  # noqa: E402
from ..statistics.schema import GAUGE_COLUMNS, query_frame_column  # noqa: E402
from .ip_adapter_setup import (  # noqa: E402, F401 (re-exported: the experiment's surface)
    NUM_STEPS,
    PAPER_LAST_SPEARMAN,
    PAPER_TIMESTEPS,
    REFS_PER_SET,
    _mixed_sets,
    _reference_sets,
    organism_pipelines,
    run_reference_set,
    step_indices,
)
from .report import ExperimentResult, Row, as_records, from_record  # noqa: E402

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
    for name in ("pearson", "top1", "spearman_null", "logit_ratio", "rho_baseline")
)


def verdict_rule() -> str:
    """The verdict's rule (:func:`ipa_probe.attribution.verdict`) in words, as each record states it."""
    from ..attribution import ALPHA, POOLING_TV

    return (
        f"pooling if the upper end of the 95% interval of the mean per-layer TV distance of the attention shares "
        f"from uniform is below {POOLING_TV}; else tracks posterior if the one-sided permutation p of the mean "
        f"per-set Spearman (attention share vs exact posterior) is below {ALPHA} (that test alone); else "
        "undecided, also where the TV has no interval"
    )


def summarize_sets(per_set: pd.DataFrame) -> pd.DataFrame:
    """Per timestep: the query-frame and stored-frame rho over reference sets with bootstrap intervals, and the means
    of the other columns, from the probe tables of all sets (``per_set``, with a ``set`` column).

    Each rho is first averaged within a set (over its layers and heads; cells without a value, such as a query frame
    of one query, are left out), then over sets; the interval is a 95 % bootstrap-t of that mean over sets
    (:func:`ipa_probe.sweep.aggregation.bootstrap_ci`, seeded), cut to the mean's range.

    Returns:
        one row per timestep (noise first): ``spearman`` (stored frame) with ``ci_low``, ``ci_high``; ``pearson``,
        ``null``, ``frac_rho_gt_0.9`` (stored frame); ``sets``, ``entries``; the means of :data:`GAUGE_COLUMNS`; and
        where the table has them, each of :data:`INTERVAL_COLUMNS` with ``<column>_low`` / ``<column>_high``,
        ``qf_frac_rho_gt_0.9`` / ``qf_gauss_frac_rho_gt_0.9`` (share of entries with a query-frame rho above 0.9,
        among the entries that have one), ``qf_entries`` (those entries), ``qf_undefined`` (the entries without
        one: NaN, left out of every mean) and the NaN-skipping means of :data:`QUERY_FRAME_MEANS`.
    """
    from ..sweep.aggregation import bootstrap_ci

    rows = []
    for timestep, frame in per_set.groupby("timestep", sort=False):
        set_means = frame.groupby("set")["spearman"].mean().to_numpy()
        low, high = bootstrap_ci(set_means, bounds=(-1.0, 1.0))
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
            bounds = (-2.0, 2.0) if "excess" in column else (-1.0, 1.0)  # a Spearman; its excess over another
            row[f"{column}_low"], row[f"{column}_high"] = bootstrap_ci(means, bounds=bounds)
        for form in ("exact", "gaussian"):
            column = query_frame_column("spearman", form)
            if column in frame.columns:
                values = frame[column].to_numpy(np.float64)
                values = values[np.isfinite(values)]
                prefix = column.removesuffix("spearman")
                row[f"{prefix}frac_rho_gt_0.9"] = float((values > 0.9).mean()) if values.size else math.nan
                if form == "exact":
                    row["qf_entries"] = int(values.size)
                    row["qf_undefined"] = int(len(frame) - values.size)  # no variation: NaN, left out, counted
        # NaN (undefined: a frame of one query, all-tied rows) is left out of every mean (pandas skips it)
        row.update({c: float(frame[c].mean(skipna=True)) for c in QUERY_FRAME_MEANS if c in frame.columns})
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
    from ..attribution import sets_table, summarize_attribution
    from .matched_control import per_set_means, run_controls

    tier, folder = ctx.tier, ctx.out / "ip-adapter"
    folder.mkdir(parents=True, exist_ok=True)
    steps = step_indices()
    populations = {
        "one digit": [refs for _, refs in _reference_sets(tier.ip_sets)],
        "2+2 mixed": [refs for _, refs in _mixed_sets(tier.ip_mixed_sets)],
    }
    pipes = organism_pipelines(ctx.recipe)
    summaries, attribution, raw, per_set, cells = {}, {}, {"attribution": {}}, {}, {}
    for label, pipe in pipes.items():
        for population, sets in populations.items():
            probes, tables = [], []
            for i, refs in enumerate(tqdm(sets, desc=f"ip-adapter {label}, {population}", disable=not ctx.progress)):
                table, attributed = run_reference_set(pipe, refs, seed=i, steps=steps)
                probes.append(table.assign(set=i))
                tables.append(attributed.assign(set=i))
            if population == "one digit":
                cells[label] = pd.concat(probes, ignore_index=True)
                summaries[label] = summarize_sets(cells[label])
                raw[label] = summaries[label].to_dict(orient="records")
                per_set[label] = per_set_means(cells[label], pd.concat(tables))
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
    control_rows, controls = run_controls(ctx, pipes, per_set, cells, populations["one digit"], steps, folder)
    rows.extend(control_rows)

    figures = [plot(summaries, attribution, ctx.recipe, folder)]
    record = {
        "measurements": raw,
        **controls,
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
        "verdict_rule": verdict_rule(),
        "fitted_bandwidth_null": "null in fitted_bandwidth* means infinite: uniform weights are KL-closest",
        "differences_from_paper": (
            "a 16x16 digits organism trained here (SD 1.5 block structure scaled down, 10 IP layers of 4 heads, "
            "8x8x4 latents), 4 tokens per reference and 4 references per set, no CFG; the paper used SD 1.5 with a "
            "published IP-Adapter on natural images"
        ),
    }
    return ExperimentResult("ip-adapter", rows, record, figures)


#: Colour and legend name of each population the figure draws (one colour per population in every panel).
POPULATIONS = {
    "trained": ("C0", "trained"),
    "untrained": ("C1", "untrained"),
    "trained, one digit refs": ("C0", "trained, one-digit sets"),
    "trained, 2+2 mixed refs": ("C2", "trained, 2+2 mixed sets"),
    "untrained, 2+2 mixed refs": ("C1", "untrained, 2+2 mixed sets"),
}


def _series(ax, entries, x, frame, column, colour, style, label, band=True):
    """Draw ``frame[column]`` as one labelled line, its ``_low``/``_high`` (or ``ci_``) band behind it; one legend
    entry names both. Returns the values drawn (line and band) for the axis range."""
    values = frame[column].to_numpy(float)
    (line,) = ax.plot(x, values, style, color=colour, label=label)
    drawn, handle = [values], line
    bounds = ("ci_low", "ci_high") if column == "spearman" else (f"{column}_low", f"{column}_high")
    if band and all(b in frame.columns for b in bounds):
        low, high = (frame[b].to_numpy(float) for b in bounds)
        if np.isfinite(low).any():
            # a pale fill with its own edges: overlapping bands stay told apart by their outlines
            band = ax.fill_between(x, low, high, facecolor=colour, alpha=0.12, edgecolor=colour, linewidth=0.8,
                                   label="_band")  # fmt: skip
            handle = (line, band)
            drawn += [low, high]
            line.set_label(label := f"{label} (band)")
    entries.append((handle, label))
    return drawn


def _legend(ax, entries, columns: int = 1) -> None:
    """The panel's legend: one entry per statistic, drawn in black (colour names the population, once for the whole
    figure), under the panel."""
    from matplotlib.lines import Line2D

    from ..figstyle import MIN_FONT_PT

    handles, labels = [], []
    for handle, label in entries:
        if label in labels:
            continue
        line = handle[0] if isinstance(handle, tuple) else handle
        if isinstance(line, Line2D):
            proxy = Line2D(
                [],
                [],
                color="black",
                linestyle=line.get_linestyle(),
                marker=line.get_marker(),
                markerfacecolor=line.get_markerfacecolor() if line.get_markerfacecolor() == "white" else "black",
            )
            handle = (proxy, handle[1]) if isinstance(handle, tuple) else proxy
        handles.append(handle)
        labels.append(label)
    legend = legend_below(ax, handles, labels, fontsize=MIN_FONT_PT, ncol=columns, handlelength=2.0)
    legend.set_in_layout(False)  # the rows are spaced for it: the panels keep their width


def _rho_panels(axes, summaries, x) -> None:
    """(a) the query-frame rho (exact and Gaussian b; invariant under every per-head basis change) with the rho its
    logit ratio alone gives; (b) the stored-frame rho (the paper's; gauge-dependent), Pearson and its baseline;
    (c) each rho minus its baseline beside the permutation null: the differences (~0.003) the others cannot show."""
    exact, gauss = query_frame_column("spearman"), query_frame_column("spearman", "gaussian")
    entries, drawn = [], []
    for label, summary in summaries.items():
        colour, name = POPULATIONS[label]
        if exact in summary.columns:
            drawn += _series(axes[0], entries, x, summary, exact, colour, "o-", "query-frame ρ, exact b")
            text = "query-frame ρ, Gaussian b"
            drawn += _series(axes[0], entries, x, summary, gauss, colour, "^--", text, band=False)
            text = "its ρ from the logit ratio alone"
            drawn += _series(axes[0], entries, x, summary, "qf_rho_baseline", colour, "s:", text, band=False)
    if drawn:
        fit_ylim(axes[0], np.concatenate(drawn))
        axes[0].set(ylabel="mean per-row ρ", title="(a) query frame (invariant)")
        _legend(axes[0], entries)
    else:  # a record from before the query-frame columns
        axes[0].text(0.5, 0.5, "no query-frame columns in this record", ha="center", va="center")
        axes[0].set(title="(a) query frame (invariant)")

    entries, drawn = [], []
    for label, summary in summaries.items():
        colour, name = POPULATIONS[label]
        drawn += _series(axes[1], entries, x, summary, "spearman", colour, "o-", "stored-frame ρ")
        drawn += _series(axes[1], entries, x, summary, "pearson", colour, "s:", "Pearson r", band=False)
        if "rho_baseline" in summary.columns:
            text = "ρ from the logit ratio r alone"
            drawn += _series(axes[1], entries, x, summary, "rho_baseline", colour, "^--", text, band=False)
    timesteps = next(iter(summaries.values()))["timestep"].tolist()
    include = []
    if timesteps[-1] == PAPER_TIMESTEPS[-1]:
        paper = axes[1].scatter([x[-1]], [PAPER_LAST_SPEARMAN], marker="x", color="C3", s=60, zorder=3,
                                label="paper (SD 1.5, t=1)")  # fmt: skip
        entries.append((paper, "paper (SD 1.5, t=1)"))
        include.append(PAPER_LAST_SPEARMAN)
    fit_ylim(axes[1], np.concatenate(drawn), include)
    axes[1].set(ylabel="statistic", title="(b) stored frame (the paper's)")
    _legend(axes[1], entries)

    entries, drawn = [], [[0.0]]
    for label, summary in summaries.items():
        colour, name = POPULATIONS[label]
        excess = query_frame_column("rho_excess")
        if excess in summary.columns:
            text = "query-frame ρ − baseline"
            drawn += _series(axes[2], entries, x, summary, excess, colour, "o-", text)
        if "rho_excess" in summary.columns:
            text = "stored-frame ρ − baseline"
            drawn += _series(axes[2], entries, x, summary, "rho_excess", colour, "^--", text, band=False)
    entries.append((axes[2].axhline(0, color="black", linewidth=0.8, label="zero", zorder=1), "zero"))
    fit_ylim(axes[2], np.concatenate(drawn))
    axes[2].set(ylabel="ρ − its baseline", title="(c) ρ beyond its baseline")
    _legend(axes[2], entries)
    if len(axes) > 3:  # the permutation null: a ρ, not a difference, in a panel of its own
        entries, drawn = [], [[0.0]]
        for label, summary in summaries.items():
            colour, name = POPULATIONS[label]
            text = "stored-frame ρ, NW shuffled"
            drawn += _series(axes[3], entries, x, summary, "null", colour, "s:", text, band=False)
        fit_ylim(axes[3], np.concatenate(drawn))
        axes[3].set(ylabel="ρ under the null", title="(c′) chance: permutation null")
        _legend(axes[3], entries)


def _attribution_panel(ax, attribution, x, column, title, ylabel, reference=None, extra=None) -> None:
    """One gauge-invariant statistic per population with its 95% band; ``reference``: a labelled horizontal line
    ``(value, label)``; ``extra``: a second column drawn dotted without a band ``(column, label suffix)``."""
    entries, drawn = [], []
    for label, summary in attribution.items():
        colour, name = POPULATIONS[label]
        drawn += _series(ax, entries, x, summary, column, colour, "o-", "mean over sets")
        if extra is not None:
            text = f"{extra[1]} (open)"
            drawn += _series(ax, entries, x, summary, extra[0], colour, "^:", text, band=False)
            ax.lines[-1].set(markerfacecolor="white", zorder=3)  # open markers: seen over the line they may equal
    include = []
    if reference is not None:
        line = ax.axhline(reference[0], color="black", linewidth=0.8, linestyle="--", label=reference[1], zorder=1)
        entries.append((line, reference[1]))
        include.append(reference[0])
    fit_ylim(ax, np.concatenate(drawn), include)
    ax.set(ylabel=ylabel, title=title)
    _legend(ax, entries)


def _population_key(ax, populations) -> None:
    """The one legend of colours: which population each colour is, in a panel of its own."""
    from matplotlib.patches import Patch

    from ..figstyle import MIN_FONT_PT

    seen = {}
    for label in populations:
        colour, name = POPULATIONS[label]
        seen.setdefault(colour, []).append(name)
    handles = [Patch(color=colour, label=" / ".join(names)) for colour, names in seen.items()]
    ax.set_axis_off()
    ax.set_title("colour: population", fontsize=MIN_FONT_PT)
    ax.legend(handles=handles, loc="upper left", fontsize=MIN_FONT_PT, frameon=False)


def _bandwidths(summary: pd.DataFrame) -> pd.DataFrame:
    """The fitted bandwidth and its interval from ``fitted_beta`` (a record turns an infinite bandwidth into null):
    ``h = 1 / sqrt(2 beta)``, infinite at ``beta = 0``; the interval's ends swap (h falls as beta grows)."""
    if "fitted_beta" not in summary.columns:
        return summary
    out = summary.copy()
    with np.errstate(divide="ignore"):
        for suffix, other in (("", ""), ("_low", "_high"), ("_high", "_low")):
            beta = out[f"fitted_beta{other}"].to_numpy(float)
            out[f"fitted_bandwidth{suffix}"] = np.where(beta == 0, np.inf, 1.0 / np.sqrt(2 * beta))
    return out


def _temperature_panel(ax, attribution, x) -> None:
    """The fitted data-space bandwidth h* against the exact denoiser's h(t), log scale, on the range of the finite
    values only: h* = ∞ (uniform weights closest) is an arrow at the top edge marked ∞, and an interval whose upper end
    is ∞ is drawn as an arrow up from its lower end, never as a band to a made-up finite value."""
    frames = {label: _bandwidths(s) for label, s in attribution.items()}
    columns = ("fitted_bandwidth", "fitted_bandwidth_low", "fitted_bandwidth_high", "bandwidth")
    finite = [v for f in frames.values() for c in columns for v in f[c].to_numpy(float) if np.isfinite(v) and v > 0]
    entries, any_infinite = [], False
    for index, (label, frame) in enumerate(frames.items()):
        colour, name = POPULATIONS[label]
        shift = 0.28 * (index - (len(frames) - 1) / 2)  # the populations' marks side by side, clear of each other
        fitted = frame["fitted_bandwidth"].to_numpy(float)
        infinite = np.isinf(fitted)
        (line,) = ax.plot(x, np.where(infinite, np.nan, fitted), "o-", color=colour, label="fitted h*")
        handle, text = line, "fitted h*"
        low, high = (frame[f"fitted_bandwidth_{e}"].to_numpy(float) for e in ("low", "high"))
        closed = np.isfinite(low) & np.isfinite(high)
        if closed.any():
            text += " (band)"
            line.set_label(text)
            band = ax.fill_between(x, np.where(closed, low, np.nan), np.where(closed, high, np.nan), color=colour,
                                   alpha=0.2, linewidth=0, label="_band")  # fmt: skip
            handle = (line, band)
        entries.append((handle, text))
        open_ended = np.isfinite(low) & np.isinf(high)
        for i in np.flatnonzero(open_ended):  # the interval reaches ∞: an arrow from its lower end, below the ∞ marks
            ax.annotate("", xy=(x[i] + shift, 0.76), xycoords=("data", "axes fraction"),
                        xytext=(x[i] + shift, low[i]), textcoords="data",
                        arrowprops={"arrowstyle": "->", "color": colour, "alpha": 0.6})  # fmt: skip
        if open_ended.any():  # named in the line's own entry: a legend of at most 7 entries
            text += ", arrow: CI to ∞"
            line.set_label(text)
            entries[-1] = (handle, text)
        for i in np.flatnonzero(infinite):  # h* = ∞: at the top edge (two rows, clear of each other), not at a value
            ax.annotate("∞", xy=(x[i] + shift, 0.97 - 0.12 * (index % 2)), xycoords=("data", "axes fraction"),
                        ha="center", va="top", color=colour)  # fmt: skip
        any_infinite |= bool(infinite.any())
    if any_infinite:  # one entry for every population's ∞ marks (their colour names the population)
        (proxy,) = ax.plot([], [], linestyle="none", marker="$∞$", color="k", label="_proxy")
        entries.append((proxy, "h* = ∞ (uniform closest): ∞ at the top"))
    text = "exact h(t) = σ_t/α_t"
    entries.append((ax.plot(x, next(iter(frames.values()))["bandwidth"], "k.--", label=text)[0], text))
    ax.set_yscale("log")
    fit_ylim(ax, finite, include=[max(finite) * (max(finite) / min(finite)) ** 0.6], log=True)  # room for the ∞ row
    label_log_axis(ax)
    ax.set(ylabel="bandwidth (log)", title="(i) fitted temperature", xlim=(x[0] - 0.5, x[-1] + 0.5))  # room for shifts
    _legend(ax, entries)


def plot(summaries: dict[str, pd.DataFrame], attribution: dict[str, pd.DataFrame], recipe: str, folder) -> Path:
    """The experiment's figure, nine panels against the timestep, every line named in its panel's legend and every
    range fitted to the data drawn: (a) the query-frame ρ (exact and Gaussian b, invariant under every per-head basis
    change; the headline) with its logit-ratio baseline, (b) the stored-frame per-row Spearman and Pearson with the ρ a
    logit ratio alone gives (gauge-dependent; the paper's), (c) each ρ minus its baseline beside the permutation null;
    then the gauge-invariant statistics of :mod:`ipa_probe.attribution` per population: (d) rank agreement of attention
    share with the exact posterior, (e) between-layer agreement, (f) attention n_eff, (g) the exact posterior's n_eff,
    (h) attention TV from uniform against the pooling threshold, (i) the fitted data-space temperature against h(t).
    ``summaries``: ``"trained"`` / ``"untrained"`` -> :func:`summarize_sets` tables; ``attribution``: ``"<label>,
    <population> refs"`` -> :func:`ipa_probe.attribution.summarize_attribution` tables; written to
    ``folder/ip_adapter.png``.
    """
    from .._io import code_digest, data_digest, write_figure
    from ..attribution import POOLING_TV
    from ..figstyle import DOUBLE_COLUMN, MAX_HEIGHT, paper_style

    shown = {k: v for k, v in attribution.items() if k != "untrained, one digit refs"}
    timesteps = next(iter(summaries.values()))["timestep"].tolist()
    x = np.arange(len(timesteps))
    refs = int(max(s["references"].max() for s in shown.values()))
    with paper_style():
        fig = plt.figure(figsize=(DOUBLE_COLUMN, MAX_HEIGHT))  # a page: 4 rows of 3 panels
        gaps = [1.3, 1.0, 1.15]  # inches under a row: its x labels, its legends (4, 2, 3 entries), the next titles
        rows = (MAX_HEIGHT - 0.55 - 1.2 - sum(gaps)) / 4  # a suptitle over them, 5 legend entries under them
        spec = fig.add_gridspec(
            7,
            3,
            height_ratios=[rows, gaps[0], rows, gaps[1], rows, gaps[2], rows],
            hspace=0,
            left=0.11,
            right=0.92,
            top=1 - 0.55 / MAX_HEIGHT,
            bottom=1.2 / MAX_HEIGHT,
            wspace=0.62,
        )
        grid = np.array([[fig.add_subplot(spec[2 * r, c]) for c in range(3)] for r in range(4)])
        for ax in grid.flat[:10]:  # before the legends, which sit under the x labels
            ax.tick_params(axis="x", labelrotation=0)
            ax.set_xticks(x, [f"{t:g}" for t in timesteps])
            ax.set_xlabel("timestep (noise → data)")
        _rho_panels(grid.flat[:4], summaries, x)
        axes = grid.flat[4:]
        _attribution_panel(
            axes[0], shown, x, "share_spearman", "(d) attention share vs posterior",
            "Spearman ρ", (0.0, "chance (null mean)"),
        )  # fmt: skip
        _attribution_panel(
            axes[1], shown, x, "layer_agreement", "(e) between layers", "Spearman ρ",
            (0.0, "chance (null mean)"),
        )  # fmt: skip
        _attribution_panel(
            axes[2], shown, x, "attention_neff", "(f) attention n_eff",
            f"effective number of refs (of {refs})", (refs, f"uniform over {refs} references"),
            extra=("position_neff", "per position"),
        )  # fmt: skip
        _attribution_panel(
            axes[3], shown, x, "posterior_neff", "(g) exact posterior n_eff",
            f"effective number of refs (of {refs})", (refs, f"uniform over {refs} references"),
        )  # fmt: skip
        _attribution_panel(
            axes[4], shown, x, "attention_tv", "(h) TV from uniform",
            "TV distance", (POOLING_TV, f"pooling threshold {POOLING_TV:g}"),
        )  # fmt: skip
        _temperature_panel(axes[5], shown, x)
        _population_key(grid.flat[10], {**summaries, **shown})
        grid.flat[11].set_visible(False)
        fig.suptitle(f"IP-Adapter attention on the digits organism (recipe {recipe}); bands: 95% intervals",
                     fontsize=9, y=1 - 0.06 / MAX_HEIGHT)  # fmt: skip
    inputs = as_records({"summaries": summaries, "attribution": attribution, "recipe": recipe})
    code = code_digest(plot, _rho_panels, _attribution_panel, _temperature_panel, _series, fit_ylim, _legend,
                       _bandwidths, label_log_axis, _population_key)  # fmt: skip
    stamp = {"code": code, "inputs": data_digest(inputs)}
    return write_figure(fig, Path(folder) / "ip_adapter.png", provenance=stamp)


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    summaries = {label: pd.DataFrame(raw[label]) for label in ("trained", "untrained") if label in raw}
    attribution = {key: pd.DataFrame(values) for key, values in raw.get("attribution", {}).items()}
    return [plot(summaries, attribution, record.get("recipe", "support"), folder)]
