"""Experiment ``ip-adapter``: the paper's IP-Adapter analysis (§A.5 S5, §D.4), in kind, on the trained digits organism.

For many reference sets (4 held-out images of one digit each), the trained organism
(:func:`ipa_probe.tiny.digits.digits_pipeline`, recipe ``--recipe``) generates with the 50-step DDIM schedule of SD 1.x
while the probe (:func:`ipa_probe.probe`, matched bandwidth ``h^2 = sqrt(d_head)``) records, at the paper's timesteps
981, 761, 501, 261 and 1, every image-branch head's per-row Spearman and raveled Pearson against Gaussian NW weights
on the same ``q, k``, and the permutation null. Per timestep the table gives the mean per-row Spearman over reference
sets (mean over layers and heads within a set) with a 95 % bootstrap interval over sets, the mean Pearson and the
fraction of (set, layer, head) entries with rho > 0.9, beside the paper's figures (and the probe's gauge columns
``logit_ratio``, ``rho_baseline``, ``rho_excess`` where the probe has them). Control: the same architecture with its
initial (untrained) weights, on the same reference sets.

That rho depends on the q/k gauge (issue #18); beside it, from the same generations, the comparisons that do not
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

from ..figstyle import fit_ylim  # noqa: E402
from ..schema import GAUGE_COLUMNS  # noqa: E402
from .report import ExperimentResult, Row, as_records, from_record  # noqa: E402

#: The paper's timesteps: the 50-step SD 1.x grid (steps_offset=1: 981, 961, ..., 1) at these step indices.
PAPER_TIMESTEPS = (981, 761, 501, 261, 1)
NUM_STEPS = 50
REFS_PER_SET = 4
#: The paper's mean per-row Spearman at the last timestep; it reports no value at the other timesteps.
PAPER_LAST_SPEARMAN = 0.89


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
    """Per timestep: mean over sets of the per-set mean Spearman, its bootstrap CI, Pearson, null, rho > 0.9 share,
    and the means of the probe's gauge columns where its table has them.

    Args:
        per_set: the probe tables of all sets with a ``set`` column.
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
    last = PAPER_TIMESTEPS[-1]
    for label, summary in summaries.items():
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
                    "per-row Spearman (mean of set means)",
                    f"{label} organism, t={t}",
                    f"{rec['spearman']:.3f} [{rec['ci_low']:.3f}, {rec['ci_high']:.3f}]",
                    paper if label == "trained" else "— (control)",
                    f"Pearson {rec['pearson']:.3f}; {100 * rec['frac_rho_gt_0.9']:.0f}% of heads ρ>0.9; "
                    f"permutation null {rec['null']:+.3f}; {rec['sets']} reference sets{gauge}",
                )
            )
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
            handle = (line, ax.fill_between(x, low, high, color=colour, alpha=0.2, linewidth=0, label="_band"))
            drawn += [low, high]
            line.set_label(label := f"{label} (band: 95% CI)")
    entries.append((handle, label))
    return drawn


def _legend(ax, entries, columns: int = 1) -> None:
    from ..figstyle import MIN_FONT_PT

    ax.legend(*zip(*entries, strict=True), fontsize=MIN_FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              ncol=columns, frameon=False)  # fmt: skip


def _rho_panels(axes, summaries, x) -> None:
    """(a) per-row Spearman, Pearson and the rho a logit ratio alone gives; (b) rho minus that baseline beside the
    permutation null: the differences (~0.003) that panel (a)'s range cannot show."""
    entries, drawn = [], []
    for label, summary in summaries.items():
        colour, name = POPULATIONS[label]
        drawn += _series(axes[0], entries, x, summary, "spearman", colour, "o-", f"{name}: Spearman ρ")
        drawn += _series(axes[0], entries, x, summary, "pearson", colour, "s:", f"{name}: Pearson", band=False)
        if "rho_baseline" in summary.columns:
            text = f"{name}: ρ from the logit ratio r alone"
            drawn += _series(axes[0], entries, x, summary, "rho_baseline", colour, "^--", text, band=False)
    timesteps = next(iter(summaries.values()))["timestep"].tolist()
    include = []
    if timesteps[-1] == PAPER_TIMESTEPS[-1]:
        paper = axes[0].scatter([x[-1]], [PAPER_LAST_SPEARMAN], marker="x", color="C3", s=60, zorder=3,
                                label="paper (SD 1.5, t=1)")  # fmt: skip
        entries.append((paper, "paper (SD 1.5, t=1)"))
        include.append(PAPER_LAST_SPEARMAN)
    fit_ylim(axes[0], np.concatenate(drawn), include)
    axes[0].set(ylabel="statistic", title="(a) attention vs NW weights on the same q, k")
    _legend(axes[0], entries)

    entries, drawn = [], [[0.0]]
    for label, summary in summaries.items():
        colour, name = POPULATIONS[label]
        if "rho_excess" in summary.columns:
            drawn += _series(axes[1], entries, x, summary, "rho_excess", colour, "o-", f"{name}: ρ − ρ from r alone")
        drawn += _series(axes[1], entries, x, summary, "null", colour, "s:", f"{name}: permutation null of ρ")
    entries.append((axes[1].axhline(0, color="black", linewidth=0.8, label="zero", zorder=1), "zero"))
    fit_ylim(axes[1], np.concatenate(drawn))
    axes[1].set(ylabel="ρ difference", title="(b) ρ beyond its logit-ratio baseline, and the null")
    _legend(axes[1], entries)


def _attribution_panel(ax, attribution, x, column, title, ylabel, reference=None, extra=None) -> None:
    """One gauge-invariant statistic per population with its 95% band; ``reference``: a labelled horizontal line
    ``(value, label)``; ``extra``: a second column drawn dotted without a band ``(column, label suffix)``."""
    entries, drawn = [], []
    for label, summary in attribution.items():
        colour, name = POPULATIONS[label]
        drawn += _series(ax, entries, x, summary, column, colour, "o-", name)
        if extra is not None:
            text = f"{name}: {extra[1]} (open)"
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
    """The fitted data-space bandwidth h* against the exact denoiser's h(t), log scale; h* = ∞ (uniform weights
    closest) as a triangle at the top edge, an interval reaching ∞ cut there."""
    frames = {label: _bandwidths(s) for label, s in attribution.items()}
    columns = ("fitted_bandwidth", "fitted_bandwidth_low", "fitted_bandwidth_high", "bandwidth")
    finite = [v for f in frames.values() for c in columns for v in f[c].to_numpy(float) if np.isfinite(v) and v > 0]
    top = 10 ** math.ceil(math.log10(max(finite) * 3))
    entries = []
    for index, (label, frame) in enumerate(frames.items()):
        colour, name = POPULATIONS[label]
        fitted = frame["fitted_bandwidth"].to_numpy(float)
        infinite = np.isinf(fitted)
        (line,) = ax.plot(x, np.where(infinite, np.nan, fitted), "o-", color=colour, label=f"{name}: fitted h*")
        handle, text = line, f"{name}: fitted h*"
        low, high = (np.clip(frame[f"fitted_bandwidth_{e}"].to_numpy(float), 0, top) for e in ("low", "high"))
        if np.isfinite(low).any():
            text += " (band: 95% CI)"
            line.set_label(text)
            handle = (line, ax.fill_between(x, low, high, color=colour, alpha=0.2, linewidth=0, label="_band"))
        entries.append((handle, text))
        if infinite.any():
            edge = top / 1.6**index  # one row of triangles per population, so that none hides another
            text = f"{name}: h* = ∞ (uniform closest)"
            (marker,) = ax.plot(
                x[infinite], np.full(infinite.sum(), edge), "^", color=colour, markersize=8, label=text
            )
            entries.append((marker, text))
    first = next(iter(frames.values()))
    text = "exact denoiser's h(t) = σ_t/α_t"
    entries.append((ax.plot(x, first["bandwidth"], "k.--", label=text)[0], text))
    ax.set_yscale("log")
    fit_ylim(ax, finite, [top], log=True)
    ax.set(ylabel="data-space bandwidth (log)", title="(h) fitted temperature (∞: drawn at the top)")
    _legend(ax, entries)


def plot(summaries: dict[str, pd.DataFrame], attribution: dict[str, pd.DataFrame], recipe: str, folder) -> Path:
    """The experiment's figure, eight panels against the timestep, every line named in its panel's legend and every
    range fitted to the data drawn: (a) per-row Spearman and Pearson of attention vs NW weights with the ρ a logit
    ratio alone gives and (b) ρ minus that baseline beside the permutation null (gauge-dependent); then the
    gauge-invariant statistics of :mod:`ipa_probe.attribution` per population: (c) rank agreement of attention share
    with the exact posterior, (d) between-layer agreement, (e) attention n_eff, (f) the exact posterior's n_eff,
    (g) attention TV from uniform against the pooling threshold, (h) the fitted data-space temperature against h(t).

    Args:
        summaries: ``"trained"`` / ``"untrained"`` -> :func:`summarize_sets` tables.
        attribution: ``"<label>, <population> refs"`` -> :func:`ipa_probe.attribution.summarize_attribution` tables.
        recipe: the organism's recipe (for the title).
        folder: where ``ip_adapter.png`` goes.
    """
    from .._io import code_digest, data_digest, write_figure
    from ..attribution import POOLING_TV
    from ..figstyle import paper_style

    shown = {k: v for k, v in attribution.items() if k != "untrained, one digit refs"}
    timesteps = next(iter(summaries.values()))["timestep"].tolist()
    x = np.arange(len(timesteps))
    refs = int(max(s["references"].max() for s in shown.values()))
    with paper_style():
        fig, axes = plt.subplots(4, 2, figsize=(11, 17), layout="constrained")
        _rho_panels(axes[0], summaries, x)
        _attribution_panel(
            axes[1, 0], shown, x, "share_spearman", "(c) attention share vs exact posterior (ranks)",
            "mean per-set Spearman", (0.0, "chance (permutation null mean)"),
        )  # fmt: skip
        _attribution_panel(
            axes[1, 1], shown, x, "layer_agreement", "(d) agreement between layers", "mean per-set Spearman",
            (0.0, "chance (permutation null mean)"),
        )  # fmt: skip
        _attribution_panel(
            axes[2, 0], shown, x, "attention_neff", "(e) attention n_eff: per layer, and per position",
            f"effective number of refs (of {refs})", (refs, f"uniform over {refs} references"),
            extra=("position_neff", "per position"),
        )  # fmt: skip
        _attribution_panel(
            axes[2, 1], shown, x, "posterior_neff", "(f) exact posterior n_eff",
            f"effective number of refs (of {refs})", (refs, f"uniform over {refs} references"),
        )  # fmt: skip
        _attribution_panel(
            axes[3, 0], shown, x, "attention_tv", "(g) attention TV from uniform (verdict: pooling below the line)",
            "TV distance", (POOLING_TV, f"pooling threshold {POOLING_TV:g}"),
        )  # fmt: skip
        _temperature_panel(axes[3, 1], shown, x)
        for ax in axes.flat:
            ax.set_xticks(x, [f"{t:g}" for t in timesteps])
            ax.set_xlabel("timestep (noise → data)")
        fig.suptitle(f"IP-Adapter attention on the digits organism (recipe {recipe}); bands: 95% intervals")
    inputs = as_records({"summaries": summaries, "attribution": attribution, "recipe": recipe})
    code = code_digest(plot, _rho_panels, _attribution_panel, _temperature_panel, _series, fit_ylim, _legend,
                       _bandwidths)  # fmt: skip
    stamp = {"code": code, "inputs": data_digest(inputs)}
    return write_figure(fig, Path(folder) / "ip_adapter.png", dpi=110, provenance=stamp)


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    summaries = {label: pd.DataFrame(raw[label]) for label in ("trained", "untrained") if label in raw}
    attribution = {key: pd.DataFrame(values) for key, values in raw.get("attribution", {}).items()}
    return [plot(summaries, attribution, record.get("recipe", "support"), folder)]
