"""Experiment ``attribution``: does a reference's attention share predict its causal influence? (issue #21 point 4)

On the digits organism (recipe ``--recipe``) with sets of 2 + 2 references of two digits, each set generates once
(DDIM 20 steps, CFG 3: the organism's working setting, where the references decide the digit) while
:func:`ipa_probe.attribution.reference_attribution` records each reference's attention share and exact posterior
weight at five steps, and once more per reference with that reference ablated in every IP-Adapter layer at every
step (:func:`ipa_probe.measure_intervention`, ``mode="ablate"``: its tokens leave the image branch's softmax).
Causal effect of reference ``i``: the root-mean-square change of the final latent (``latent_effect``) and the drop in
the classifier's probability of reference ``i``'s digit (``class_drop``). Predictors per set and reference: the
attention share (mean over layers and recorded steps) and the exact posterior weight (mean over recorded steps),
and each at every recorded step. Per predictor and effect: the mean over sets of the per-set Spearman over the four
references, a 95 % bootstrap interval over sets and a one-sided permutation p-value
(:func:`ipa_probe.attribution.paired_rank_test`); the answer "predicts" needs p < 0.05 and an interval above 0.
Control: the untrained organism (same architecture, initial weights).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .report import ExperimentResult, Row, as_records, from_record, save_figure  # noqa: E402

NUM_STEPS = 20
GUIDANCE_SCALE = 3.0
#: loop indices of the 20-step schedule where shares and posterior are recorded (timesteps 951, 701, 451, 201, 1)
RECORDED_STEPS = (0, 5, 10, 15, 19)
#: the effects compared, with their table names
EFFECTS = {"latent_effect": "RMS change of the final latent", "class_drop": "drop of P(reference's digit)"}
PREDICTORS = {"attention_share": "attention share", "posterior_weight": "exact posterior weight"}


def ablation_effects(pipe, digits: list[int], refs: list, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One set: the attribution table of its generation and, per reference, the effect of ablating it.

    Returns:
        ``(attribution table, effects)``; effects has one row per reference: ``reference``, ``digit``,
        ``latent_effect``, ``pixel_effect``, ``class_drop``, ``flipped``, ``baseline_label``, ``ablated_label``.
    """
    from ..attribution import reference_attribution
    from ..intervention import measure_intervention
    from ..tiny.digits import DIGITS_PROMPT, classify_digit_images

    call = dict(
        prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=NUM_STEPS, guidance_scale=GUIDANCE_SCALE
    )
    result = reference_attribution(pipe, steps=RECORDED_STEPS, seed=seed, **call)
    rows = []
    for reference, digit in enumerate(digits):
        effect = measure_intervention(
            pipe, reference, seed=seed, classify=classify_digit_images, baseline=result.generation, **call
        )
        rows.append(
            {
                "reference": reference,
                "digit": digit,
                "latent_effect": float(effect.latent_distance[0]),
                "pixel_effect": float(effect.pixel_distance[0]),
                "class_drop": float(
                    effect.baseline_probabilities[0, digit] - effect.intervened_probabilities[0, digit]
                ),
                "flipped": bool(effect.flipped[0]),
                "baseline_label": int(effect.baseline_labels[0]),
                "ablated_label": int(effect.intervened_labels[0]),
            }
        )
    return result.table, pd.DataFrame(rows)


def predictors(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (set, reference): the attention share (mean over layers and recorded steps) and the posterior weight (mean
    over recorded steps); and per (set, reference, timestep) the same at that step."""
    per_step = table.groupby(["set", "reference", "timestep"], as_index=False)[list(PREDICTORS)].mean()
    overall = per_step.groupby(["set", "reference"], as_index=False)[list(PREDICTORS)].mean()
    return overall, per_step


def _matrix(frame: pd.DataFrame, column: str) -> np.ndarray:
    """``(S, R)`` values of ``column`` by set and reference."""
    return frame.pivot(index="set", columns="reference", values=column).sort_index().to_numpy(np.float64)


def compare(effects: pd.DataFrame, overall: pd.DataFrame, per_step: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Per predictor, effect and timestep (``"all"`` for the step mean): mean per-set Spearman, interval, p-value,
    and whether the predictor predicts the effect (p < ALPHA and interval above 0)."""
    from ..attribution import ALPHA, paired_rank_test
    from ..sweep.aggregation import bootstrap_ci

    rows = []
    by_step = sorted(per_step.groupby("timestep"), key=lambda item: -item[0])  # noise first
    groups = [("all", overall)] + [(f"{t:g}", g) for t, g in by_step]
    for when, frame in groups:
        merged = frame.merge(effects, on=["set", "reference"])
        for effect in EFFECTS:
            tests = {}
            for predictor in PREDICTORS:
                tests[predictor] = paired_rank_test(_matrix(merged, predictor), _matrix(merged, effect), seed=seed)
                t = tests[predictor]
                rows.append(
                    {
                        "timestep": when,
                        "predictor": predictor,
                        "effect": effect,
                        "spearman": t["mean"],
                        "low": t["low"],
                        "high": t["high"],
                        "p": t["p"],
                        "sets": t["sets"],
                        "predicts": bool(t["p"] < ALPHA and t["low"] > 0),
                    }
                )
            difference = tests["posterior_weight"]["values"] - tests["attention_share"]["values"]
            low, high = bootstrap_ci(difference)
            rows.append(
                {
                    "timestep": when,
                    "predictor": "posterior - attention",
                    "effect": effect,
                    "spearman": float(np.nanmean(difference)) if np.isfinite(difference).any() else np.nan,
                    "low": low,
                    "high": high,
                    "p": np.nan,
                    "sets": int(np.isfinite(difference).sum()),
                    "predicts": False,
                }
            )
    return pd.DataFrame(rows)


def _interval_text(r: dict) -> str:
    return f"{r['spearman']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"


def run(ctx) -> ExperimentResult:
    from tqdm.auto import tqdm

    from .._io import write_table
    from ..sweep.aggregation import bootstrap_ci
    from .ip_adapter import _mixed_sets, organism_pipelines

    tier, folder = ctx.tier, ctx.out / "attribution"
    folder.mkdir(parents=True, exist_ok=True)
    sets = _mixed_sets(tier.attribution_sets)
    pipes = organism_pipelines(ctx.recipe)
    comparisons, effects_by, raw = {}, {}, {}
    for label, pipe in pipes.items():
        tables, effects = [], []
        for i, ((a, b), refs) in enumerate(tqdm(sets, desc=f"attribution {label}", disable=not ctx.progress)):
            table, effect = ablation_effects(pipe, [a, a, b, b], refs, seed=i)
            tables.append(table.assign(set=i))
            effects.append(effect.assign(set=i))
        effects = pd.concat(effects, ignore_index=True)
        overall, per_step = predictors(pd.concat(tables, ignore_index=True))
        comparisons[label] = compare(effects, overall, per_step)
        effects = effects.merge(overall, on=["set", "reference"])  # the predictors beside the effects
        effects_by[label] = effects
        write_table(effects, folder / f"effects_{label}.csv")
        write_table(comparisons[label], folder / f"comparisons_{label}.csv")
        raw[label] = {
            "comparisons": comparisons[label].to_dict(orient="records"),
            "effects": effects.to_dict(orient="records"),
        }

    rows = []
    for label, table in comparisons.items():
        overall = table[table["timestep"] == "all"]
        for effect, effect_name in EFFECTS.items():
            part = {r["predictor"]: r for r in overall[overall["effect"] == effect].to_dict(orient="records")}
            attention, posterior, gap = (
                part["attention_share"],
                part["posterior_weight"],
                part["posterior - attention"],
            )
            answer = "yes" if attention["predicts"] else "no"
            rows.append(
                Row(
                    "does attention share predict causal influence?",
                    f"{label} organism, effect = {effect_name}",
                    f"{answer}: Spearman {_interval_text(attention)}, p {attention['p']:.2g}",
                    "— (not in the paper)",
                    f"exact posterior weight: {_interval_text(posterior)}, p {posterior['p']:.2g} "
                    f"({'predicts' if posterior['predicts'] else 'does not predict'}); posterior minus attention "
                    f"{_interval_text(gap)}; mean per-set Spearman over the 4 references, {attention['sets']} sets",
                )
            )
        effects = effects_by[label]
        latent = effects["latent_effect"].to_numpy()
        low, high = bootstrap_ci(latent)
        baseline = effects.drop_duplicates("set")
        on_refs = float((baseline["baseline_label"].to_numpy()[:, None] == _set_digits(effects)).any(1).mean())
        rows.append(
            Row(
                "ablating one reference (every layer and step)",
                f"{label} organism",
                f"RMS latent change {latent.mean():.3f} [{low:.3f}, {high:.3f}]; label flips "
                f"{100 * effects['flipped'].mean():.0f}%",
                "—",
                f"pixel change {effects['pixel_effect'].mean():.3f}; un-ablated outputs read as one of their "
                f"references' digits {100 * on_refs:.0f}%; attention shares "
                f"{effects['attention_share'].min():.3f}–{effects['attention_share'].max():.3f}; "
                f"{len(baseline)} sets x 4 references",
            )
        )
    trained = comparisons["trained"]
    for when in [w for w in trained["timestep"].unique() if w != "all"]:
        part = trained[(trained["timestep"] == when) & (trained["effect"] == "latent_effect")]
        by = {r["predictor"]: r for r in part.to_dict(orient="records")}
        rows.append(
            Row(
                "predictor at one step vs ablation effect (latent)",
                f"trained organism, t={when}",
                f"attention share {_interval_text(by['attention_share'])} (p {by['attention_share']['p']:.2g})",
                "—",
                f"exact posterior weight {_interval_text(by['posterior_weight'])} "
                f"(p {by['posterior_weight']['p']:.2g})",
            )
        )

    figures = [plot(effects_by, comparisons["trained"], ctx.recipe, folder)]
    record = {
        "measurements": raw,
        "recipe": ctx.recipe,
        "sets": tier.attribution_sets,
        "num_inference_steps": NUM_STEPS,
        "guidance_scale": GUIDANCE_SCALE,
        "recorded_steps": list(RECORDED_STEPS),
        "intervention": "ablate one reference in every IP-Adapter layer at every step (removed from the softmax)",
        "rule": "predicts: one-sided permutation p < 0.05 and the 95% bootstrap interval of the mean above 0",
    }
    return ExperimentResult("attribution", rows, record, figures)


def _set_digits(effects: pd.DataFrame) -> np.ndarray:
    """``(S, R)`` the digit of each set's references, in set order."""
    return effects.pivot(index="set", columns="reference", values="digit").sort_index().to_numpy()


def plot(effects_by: dict[str, pd.DataFrame], trained: pd.DataFrame, recipe: str, folder) -> Path:
    """The experiment's figure: each reference's ablation effect against its attention share and against its exact
    posterior weight (one point per set and reference), and per recorded step the mean per-set Spearman of each
    predictor with the effect (trained organism).

    Args:
        effects_by: ``"trained"`` / ``"untrained"`` -> effects with the predictors beside them.
        trained: the trained organism's :func:`compare` table.
        recipe: the organism's recipe (for the title).
        folder: where ``attribution.png`` goes.
    """
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for index, (label, effects) in enumerate(effects_by.items()):
        colour = f"C{index}"
        refs = effects["reference"].nunique()
        axes[0].scatter(effects["attention_share"] - 1 / refs, effects["latent_effect"], s=12, color=colour,
                        label=f"{label}: one point per (set, reference)")  # fmt: skip
        axes[1].scatter(effects["posterior_weight"], effects["latent_effect"], s=12, color=colour,
                        label=f"{label}: one point per (set, reference)")  # fmt: skip
    axes[0].axvline(0, color="black", linewidth=0.8, linestyle=":", label="uniform share (1/R)")
    axes[0].set(xlabel="attention share − 1/R (mean over layers, steps)", ylabel="ablation effect (RMS latent change)")
    axes[0].set_title("attention share vs causal effect")
    axes[1].set(xlabel="exact posterior weight (mean over steps)", ylabel="ablation effect (RMS latent change)")
    axes[1].set_title("exact posterior vs causal effect")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    ax = axes[2]
    steps = trained[(trained["timestep"] != "all") & (trained["effect"] == "latent_effect")]
    for index, predictor in enumerate(PREDICTORS):
        part = steps[steps["predictor"] == predictor]
        x = np.arange(len(part))
        ax.plot(x, part["spearman"], "o-", color=f"C{index + 2}", label=f"trained: {PREDICTORS[predictor]}")
        ax.fill_between(x, part["low"], part["high"], color=f"C{index + 2}", alpha=0.2, linewidth=0,
                        label=f"trained: 95% CI ({PREDICTORS[predictor]})")  # fmt: skip
        ax.set_xticks(x, list(part["timestep"]))
    ax.axhline(0, color="black", linewidth=0.8, linestyle=":", label="chance (permutation null mean)")
    ax.set(ylim=(-1.05, 1.05), xlabel="timestep of the predictor (noise → data)", ylabel="mean per-set Spearman")
    ax.set_title("which predicts the ablation effect?")
    ax.legend(fontsize=7)
    fig.suptitle(f"Attribution by intervention on the digits organism (recipe {recipe}, CFG 3, 20 steps)")
    inputs = as_records({"effects": effects_by, "trained": trained, "recipe": recipe})
    return save_figure(fig, Path(folder) / "attribution.png", plot, inputs)


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    effects_by = {label: pd.DataFrame(values["effects"]) for label, values in raw.items()}
    trained = pd.DataFrame(raw["trained"]["comparisons"])
    return [plot(effects_by, trained, record.get("recipe", "support"), folder)]
