"""Experiment ``attribution``: does a reference's attention share predict its causal influence? (issue #21 point 4)

On the digits organism (recipe ``--recipe``, DDIM 20 steps, CFG 3) each 2 + 2 set generates once while
:func:`ipa_probe.attribution.reference_attribution` records the per-reference predictors, and once more per reference
ablated everywhere (:func:`ipa_probe.measure_intervention`); each predictor's per-set Spearman with the effect
(``latent_effect``, ``class_drop``) is tested over sets (:func:`ipa_probe.attribution.sign_flip_test`) against the
untrained organism. Beside them: the verdicts per cell and their controls (issue #29 points 2 and 3: unseen references,
mixed against same-digit sets, shuffled reference order held to :data:`SHUFFLE_LATENT_RTOL` and
:data:`SHUFFLE_SHARE_ATOL`), and the causal ground truth per layer group and step range (point 4:
:func:`compare_grid`, :func:`two_plus_two_example`). What each file holds and what was measured: docs/attribution.md
("Verdicts per cell and controls", "Causal ground truth per layer group and step range").
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .attribution_aggregate import aggregate, held_out_aggregations  # noqa: E402
from .attribution_controls import (
    control_rows,
    control_sets,
    controls,
    mixed_following,
    observed_checks,
    resolution_verdicts,
    set_statistics,
    shuffle_check,
    unseen_references,
)  # noqa: E402
from .attribution_grid import compare_grid, grid_effects, grid_predictors, grid_rows, two_plus_two_example  # noqa: E402
from .attribution_setup import (
    EFFECTS,
    GUIDANCE_SCALE,
    NUM_STEPS,
    POPULATIONS,
    PREDICTORS,
    RECORDED_STEPS,
    RESOLUTIONS,
    SHUFFLE_LATENT_RTOL,
    SHUFFLE_SHARE_ATOL,
    STEP_PREDICTORS,
    WHOLE_RUN_PREDICTORS,
    _call,
    _interval_text,
    _matrix,
    observe,
    predictor_test,
)  # noqa: E402
from .attribution_tests import adjust_comparisons, adjust_grid, example_intervals  # noqa: E402
from .report import ExperimentResult, Row, as_records, from_record, save_figure  # noqa: E402

#: The experiment's whole surface, its parts (setup, controls, grid) included, as one module's.
__all__ = [
    "EFFECTS",
    "GUIDANCE_SCALE",
    "NUM_STEPS",
    "POPULATIONS",
    "PREDICTORS",
    "RECORDED_STEPS",
    "RESOLUTIONS",
    "SHUFFLE_LATENT_RTOL",
    "SHUFFLE_SHARE_ATOL",
    "STEP_PREDICTORS",
    "WHOLE_RUN_PREDICTORS",
    "ablation_effects",
    "compare",
    "compare_grid",
    "control_rows",
    "control_sets",
    "controls",
    "grid_effects",
    "grid_predictors",
    "grid_rows",
    "mixed_following",
    "observe",
    "plot",
    "predictors",
    "redraw",
    "resolution_verdicts",
    "retable",
    "run",
    "set_statistics",
    "shuffle_check",
    "table_rows",
    "two_plus_two_example",
    "unseen_references",
]


def ablation_effects(pipe, digits: list[int], refs: list, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One set: the attribution table of its generation and, per reference, the effect of ablating it.

    Returns:
        ``(attribution table, effects)``; effects has one row per reference: ``reference``, ``digit``,
        ``latent_effect``, ``pixel_effect``, ``class_drop``, ``flipped``, ``baseline_label``, ``ablated_label``.
    """
    result, effects = _ablated(pipe, digits, refs, seed)
    return result.table, effects


def _ablated(pipe, digits: list[int], refs: list, seed: int):
    """:func:`ablation_effects` with the whole :class:`~ipa_probe.attribution.ReferenceAttribution`."""
    from ..attribution import digit_probability_gradients
    from ..intervention import measure_intervention
    from ..tiny.digits import classify_digit_images

    call = _call(refs)
    result = observe(pipe, refs, seed)
    patching = digit_probability_gradients(pipe, digits, seed=seed, **call)  # one forward and one backward pass
    rows = []
    for reference, digit in enumerate(digits):
        effect = measure_intervention(
            pipe, reference, seed=seed, classify=classify_digit_images, baseline=result.generation, **call
        )
        drop = effect.baseline_probabilities[0, digit] - effect.intervened_probabilities[0, digit]
        rows.append(
            {"reference": reference, "digit": digit, "latent_effect": float(effect.latent_distance[0]),
             "pixel_effect": float(effect.pixel_distance[0]), "class_drop": float(drop),
             "flipped": bool(effect.flipped[0]), "baseline_label": int(effect.baseline_labels[0]),
             "ablated_label": int(effect.intervened_labels[0])}
        )  # fmt: skip
    return result, pd.DataFrame(rows).merge(patching, on="reference")


def predictors(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (set, reference): the attention share (mean over layers and recorded steps) and the posterior weight (mean
    over recorded steps); and per (set, reference, timestep) the same at that step."""
    columns = list(STEP_PREDICTORS)
    per_step = table.groupby(["set", "reference", "timestep"], as_index=False)[columns].mean()
    overall = per_step.groupby(["set", "reference"], as_index=False)[columns].mean()
    return overall, per_step


def compare(
    effects: pd.DataFrame, overall: pd.DataFrame, per_step: pd.DataFrame, permutations: int = 49999, seed: int = 0
) -> pd.DataFrame:
    """Per predictor, effect and timestep (``"all"`` for the step mean): :func:`.attribution_setup.predictor_test`
    (``permutations`` sign patterns: the table's 52 tests put Holm's floor at 52 / (1 + permutations)); predicting is
    decided after Holm in :func:`.attribution_tests._decide`."""
    from ..attribution import paired_rank_test
    from ..sweep.aggregation import bootstrap_ci

    rows = []
    by_step = sorted(per_step.groupby("timestep"), key=lambda item: -item[0])  # noise first
    groups = [("all", overall)] + [(f"{t:g}", g) for t, g in by_step]
    for when, frame in groups:
        merged = frame.merge(effects, on=["set", "reference"])
        for effect in EFFECTS:
            tests = {}
            for predictor in PREDICTORS:
                if predictor not in merged.columns or (when != "all" and predictor in WHOLE_RUN_PREDICTORS):
                    continue  # the whole run's predictors once; effects without them (older records) skip them
                t = tests[predictor] = paired_rank_test(_matrix(merged, predictor), _matrix(merged, effect), 0)
                test = predictor_test(t, permutations, seed)
                rows.append({"timestep": when, "predictor": predictor, "effect": effect, **test})
            difference = tests["posterior_weight"]["values"] - tests["attention_share"]["values"]
            low, high = bootstrap_ci(difference, bounds=(-2.0, 2.0))  # a difference of two Spearman
            rows.append(
                {"timestep": when, "predictor": "posterior - attention", "effect": effect,
                 "spearman": float(np.nanmean(difference)) if np.isfinite(difference).any() else np.nan,
                 "low": low, "high": high, "p": np.nan, "sets": int(np.isfinite(difference).sum()), "predicts": False}
            )  # fmt: skip
    return pd.DataFrame(rows)


def run(ctx) -> ExperimentResult:
    from tqdm.auto import tqdm

    from .._io import write_table
    from .ip_adapter_setup import _mixed_sets, organism_pipelines

    tier, folder = ctx.tier, ctx.out / "attribution"
    folder.mkdir(parents=True, exist_ok=True)
    sets = _mixed_sets(tier.attribution_sets)
    populations = control_sets(tier.attribution_control_sets)
    pipes = organism_pipelines(ctx.recipe)
    outer = 999  # bootstrap resamples of the sets for the per-cell verdict shares' intervals (cheap: no inner loop)
    comparisons, effects_by, raw, checks, held = {}, {}, {}, {}, {}
    for label, pipe in pipes.items():
        tables, effects, observed = [], [], {population: [] for population in POPULATIONS}
        for i, ((a, b), refs) in enumerate(tqdm(sets, desc=f"attribution {label}", disable=not ctx.progress)):
            result, effect = _ablated(pipe, [a, a, b, b], refs, seed=i)
            observed["2+2 digits"].append(([a, a, b, b], refs, result))
            tables.append(result.table.assign(set=i))
            effects.append(effect.assign(set=i))
        for population, members in populations.items():
            bar = tqdm(members, desc=f"controls {label}: {population}", disable=not ctx.progress)
            observed[population] += [
                (digits, refs, observe(pipe, refs, seed=i)) for i, (digits, refs) in enumerate(bar)
            ]
        verdicts, control_table, shuffled = observed_checks(pipe, observed, tier.attribution_control_sets, outer)
        checks[label] = {"verdicts": verdicts, "controls": control_table, "shuffled": shuffled}
        write_table(verdicts, folder / f"verdicts_{label}.csv")
        write_table(control_table, folder / f"controls_{label}.csv")
        write_table(shuffled, folder / f"shuffled_{label}.csv")
        if label == "trained" and tier.attribution_grid_sets:
            grids = []
            members = observed["2+2 digits"][: tier.attribution_grid_sets]
            for i, (digits, refs, result) in enumerate(tqdm(members, desc="ablation grid", disable=not ctx.progress)):
                grids.append(grid_effects(pipe, digits, refs, i, result.generation).assign(set=i))
            grid = pd.concat(grids, ignore_index=True)
            grid_table = grid_predictors(pd.concat(tables, ignore_index=True), grid)
            grid_comparison = adjust_grid(compare_grid(grid, grid_table))
            write_table(grid.merge(grid_table, on=["set", "reference", "group", "steps"]), folder / "grid_trained.csv")
            write_table(grid_comparison, folder / "grid_comparisons_trained.csv")
            example = example_intervals(two_plus_two_example(pipe, tier.attribution_example_seeds))
            write_table(example, folder / "example_3s_5s_trained.csv")
            checks[label]["grid"] = grid_comparison
            checks[label]["example"] = example
        effects = pd.concat(effects, ignore_index=True)
        overall, per_step = predictors(pd.concat(tables, ignore_index=True))
        comparisons[label] = adjust_comparisons(compare(effects, overall, per_step))
        effects = effects.merge(overall, on=["set", "reference"])  # the predictors beside the effects
        effects_by[label] = effects
        if effects["set"].nunique() >= 4:  # two sets on each side at least
            aggregates = aggregate(pd.concat(tables, ignore_index=True))
            held[label], scores = held_out_aggregations(effects, aggregates)
            write_table(aggregates, folder / f"aggregates_{label}.csv")
            write_table(held[label], folder / f"held_out_{label}.csv")
            write_table(scores, folder / f"held_out_scores_{label}.csv")
        write_table(effects, folder / f"effects_{label}.csv")
        write_table(comparisons[label], folder / f"comparisons_{label}.csv")
        raw[label] = as_records({"comparisons": comparisons[label], "effects": effects})

    rows = table_rows(comparisons, held, effects_by, checks, tier.attribution_grid_sets)
    figures = [plot(effects_by, comparisons["trained"], ctx.recipe, folder)]
    record = {
        "measurements": raw, "recipe": ctx.recipe, "sets": tier.attribution_sets, "num_inference_steps": NUM_STEPS,
        "guidance_scale": GUIDANCE_SCALE, "recorded_steps": list(RECORDED_STEPS),
        "intervention": "ablate one reference in every IP-Adapter layer at every step (removed from the softmax)",
        "rule": RULE,
        "control_sets": tier.attribution_control_sets,
        "control_rule": CONTROL_RULE,
        "verdict_intervals": {"bootstrap_resamples_of_sets": outer},
        "shuffle_tolerance": {"latent_rtol": SHUFFLE_LATENT_RTOL, "share_atol": SHUFFLE_SHARE_ATOL},
        "controls": {label: as_records(check) for label, check in checks.items()},
        "grid": {
            "sets": tier.attribution_grid_sets, "organism": "trained",
            "groups": "down / mid / up blocks and all layers (ipa_probe.intervention.LAYER_GROUPS)",
            "step_ranges": "thirds of the 20 steps (0-6, 7-13, 14-19) and all",
            "modes": "ablate in every (group, range); scale x0.5 in all layers at all steps",
            "predictors": "means over the group's layers and the recorded steps inside the range",
            "example_seeds": tier.attribution_example_seeds,
        },
    }  # fmt: skip
    return ExperimentResult("attribution", rows, record, figures)


def _aggregation_text(r: dict) -> str:
    """Where a held-out row's predictor was read (older rows without the aggregation: every layer and step)."""
    group, steps = r.get("group", "all"), r.get("steps", "all steps")
    if steps == "whole run":
        return "the whole run"
    return f"{group} layers, {steps}"


def table_rows(
    comparisons: dict[str, pd.DataFrame],
    held: dict[str, pd.DataFrame],
    effects_by: dict[str, pd.DataFrame],
    checks: dict[str, dict],
    grid_sets: int,
) -> list[Row]:
    """The experiment's table (``table.md``) from its tables: per organism the comparisons
    (``comparisons_<label>.csv``), the held-out choice (``held_out_<label>.csv``), the effects
    (``effects_<label>.csv``) and the checks (``verdicts``, ``controls``, ``shuffled``; ``grid`` and ``example`` for
    the trained one); ``grid_sets`` the grid's set count."""
    from ..sweep.aggregation import bootstrap_ci

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
            others = "; ".join(
                f"{PREDICTORS[p]} {_interval_text(part[p])}, p {part[p]['p']:.2g} (Holm {part[p]['p_holm']:.2g})"
                for p in ("contribution_norm", "contribution_projection", *WHOLE_RUN_PREDICTORS)
                if p in part
            )
            rows.append(Row(
                "does attention share predict causal influence? (one-sided p, Holm over the table)",
                f"{label} organism, effect = {effect_name}",
                f"{answer}: Spearman {_interval_text(attention)}, p {attention['p']:.2g} (Holm "
                f"{attention['p_holm']:.2g})",
                "— (not in the paper)",
                f"{others}; exact posterior weight (mean over every step: near-circular) "
                f"{_interval_text(posterior)}, p {posterior['p']:.2g} (Holm {posterior['p_holm']:.2g}); "
                f"posterior minus attention {_interval_text(gap)}; mean per-set Spearman over the 4 references, "
                f"{attention['sets']} sets; intervals two-sided 95%, descriptive",
            ))  # fmt: skip
        if label in held:
            for r in held[label].to_dict(orient="records"):
                rows.append(Row(
                    "predictor and aggregation chosen on half the sets, tested on the other half (held out)",
                    f"{label} organism, effect = {EFFECTS[r['effect']]}, {r['fold']}",
                    f"{'agrees' if r['agrees'] else 'does not agree'}: {PREDICTORS[r['chosen']]}"
                    f"{' (negated)' if r['sign'] < 0 else ''} over {_aggregation_text(r)} "
                    f"{_interval_text(r)}, p {r['p']:.2g} (Holm {r['p_holm']:.2g})",
                    "—",
                    f"chosen among {r.get('candidates', len(PREDICTORS))} candidates at "
                    f"{r['selection_spearman']:+.2f} on the other half; {r['sets']} held-out sets; one-sided p, "
                    "Holm over the organism's held-out tests",
                ))  # fmt: skip
        effects = effects_by[label]
        latent = effects["latent_effect"].to_numpy()
        # over sets (4 references share one); an RMS change is not negative
        low, high = bootstrap_ci(effects.groupby("set")["latent_effect"].mean(), bounds=(0.0, np.inf))
        baseline = effects.drop_duplicates("set")
        on_refs = float((baseline["baseline_label"].to_numpy()[:, None] == _set_digits(effects)).any(1).mean())
        rows.append(Row(
            "ablating one reference (every layer and step)",
            f"{label} organism",
            f"RMS latent change {latent.mean():.3f} [{low:.3f}, {high:.3f}]; label flips "
            f"{100 * effects['flipped'].mean():.0f}%",
            "—",
            f"pixel change {effects['pixel_effect'].mean():.3f}; un-ablated outputs read as one of their "
            f"references' digits {100 * on_refs:.0f}%; attention shares "
            f"{effects['attention_share'].min():.3f}–{effects['attention_share'].max():.3f}; "
            f"{len(baseline)} sets x 4 references",
        ))  # fmt: skip
    for label, check in checks.items():
        rows.extend(control_rows(label, check))
        if "grid" in check:
            rows.extend(grid_rows(label, check["grid"], check["example"], grid_sets))
    trained = comparisons["trained"]
    for when in [w for w in trained["timestep"].unique() if w != "all"]:
        part = trained[(trained["timestep"] == when) & (trained["effect"] == "latent_effect")]
        by = {r["predictor"]: r for r in part.to_dict(orient="records")}
        rows.append(Row(
            "predictor at one step vs ablation effect (latent)",
            f"trained organism, t={when}",
            f"attention share {_interval_text(by['attention_share'])} (p {by['attention_share']['p']:.2g}, "
            f"Holm {by['attention_share']['p_holm']:.2g})",
            "—",
            f"exact posterior weight {_interval_text(by['posterior_weight'])} "
            f"(p {by['posterior_weight']['p']:.2g}, Holm {by['posterior_weight']['p_holm']:.2g}"
            f"{CIRCULAR if by['posterior_weight']['near_circular'] else ''})",
        ))  # fmt: skip
    return rows


def retable(folder: str | Path, revision: str | None = None) -> list[Path]:
    """Write ``table.md`` and ``table.csv`` of a committed attribution folder again from its CSVs and
    ``record.json`` (:func:`table_rows`; no generation). With ``revision`` (what changed the CSVs, and how), the
    record's measurements (effects, comparisons) and controls (verdicts, controls, shuffled, grid, example) are
    replaced by the CSVs' and ``revision`` is appended to its ``revisions`` (so that :func:`redraw` draws what the
    CSVs hold). Returns the files written."""
    import csv
    import json

    from .._io import atomic_path, write_atomic, write_json
    from .report import TABLE_COLUMNS, markdown_table

    folder = Path(folder)
    record = json.loads((folder / "record.json").read_text())
    comparisons, held, effects_by, checks = {}, {}, {}, {}
    for label in ("trained", "untrained"):
        if not (folder / f"comparisons_{label}.csv").exists():
            continue
        comparisons[label] = pd.read_csv(folder / f"comparisons_{label}.csv", dtype={"timestep": str})
        effects_by[label] = pd.read_csv(folder / f"effects_{label}.csv")
        if (folder / f"held_out_{label}.csv").exists():
            held[label] = pd.read_csv(folder / f"held_out_{label}.csv")
        check = {name: pd.read_csv(folder / f"{name}_{label}.csv") for name in ("verdicts", "controls", "shuffled")}
        if label == "trained" and (folder / "grid_comparisons_trained.csv").exists():
            check["grid"] = pd.read_csv(folder / "grid_comparisons_trained.csv")
            check["example"] = pd.read_csv(folder / "example_3s_5s_trained.csv")
        checks[label] = check
    rows = table_rows(comparisons, held, effects_by, checks, int(record["grid"]["sets"]))
    write_atomic(folder / "table.md", "### attribution\n\n" + markdown_table(rows))
    with atomic_path(folder / "table.csv") as temp, temp.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TABLE_COLUMNS)
        for row in rows:
            writer.writerow([getattr(row, c) for c in TABLE_COLUMNS])
    written = [folder / "table.md", folder / "table.csv"]
    if revision is not None:
        for label in comparisons:
            record["measurements"][label] = as_records(
                {"comparisons": comparisons[label], "effects": effects_by[label]}
            )
        record["controls"] = as_records(checks)
        record["revisions"] = [*record.get("revisions", []), revision]
        written.append(write_json(folder / "record.json", record))
    return written


#: How a statistic is read against its control (``controls_<label>.csv``: ``counts``), and the verdict per cell.
CONTROL_RULE = (
    "a statistic counts only where its difference from its control has a 95% interval excluding 0 (paired by set "
    "against unseen references: the bootstrap-t of the per-set differences; same-digit sets, an independent "
    "population: Welch's t), each cut to the difference's range (+-(high - low) of the statistic's range; "
    "ipa_probe.attribution.value_range); the verdict per cell: pooling if the upper end of the mean TV's interval is "
    "below 0.05, else tracks posterior if the one-sided permutation p of the mean Spearman is below 0.05 (that test "
    "alone), else undecided"
)
#: The record's ``rule``: how each decision of the tables is taken.
RULE = (
    "predicts: the one-sided sign-flip p of the per-set Spearman after Holm's adjustment over the organism's table "
    "below 0.05, its interval [low, 1] the same test's Holm-compatible one-sided bound; predicts_unadjusted: the same "
    "p below 0.05 before Holm (no interval); the posterior read at t < 651 or averaged over every step is labelled "
    "near-circular; held out: even sets choose the predictor and its aggregation (layer group x steps, "
    "attribution_aggregate), odd sets test it, and back"
)


#: The label of a posterior read after the output is decided (:data:`~.attribution_tests.DECIDED_BELOW`).
CIRCULAR = ", near-circular: read after the output is decided"


def _set_digits(effects: pd.DataFrame) -> np.ndarray:
    """``(S, R)`` the digit of each set's references, in set order."""
    return effects.pivot(index="set", columns="reference", values="digit").sort_index().to_numpy()


def _stacked(values: np.ndarray, row: float, height: float) -> tuple[np.ndarray, np.ndarray]:
    """Dots of equal ``values`` stacked upwards from ``row`` within ``height`` (a dot plot of a statistic that takes
    a few values: R references give per-set Spearman values 2 / (R (R² - 1) / 6) apart), NaN left out."""
    values = np.round(values[np.isfinite(values)], 9)  # 1e-9: equal Spearman values differ in the last float digits
    if not values.size:
        return values, values
    step = height / np.unique(values, return_counts=True)[1].max()
    counts: dict[float, int] = {}
    ys = []
    for value in values:
        ys.append(row + step * counts.get(value, 0))
        counts[value] = counts.get(value, 0) + 1
    return values, np.asarray(ys)


def plot(effects_by: dict[str, pd.DataFrame], trained: pd.DataFrame, recipe: str, folder) -> Path:
    """The experiment's figure, 7 in wide, drawing what the statistic uses: (a) per predictor and organism, the
    per-set Spearman of the predictor with the ablation effect (RMS latent change) over the set's references, one dot
    per set, and their mean (the statistic); (b) per recorded step, that mean on the trained organism, filled where
    the table's decision (one-sided, Holm) says it predicts, one marker and colour per predictor, set side by side.

    Args:
        effects_by: ``"trained"`` / ``"untrained"`` -> effects with the predictors beside them.
        trained: the trained organism's :func:`compare` table.
        recipe: the organism's recipe (for the title).
        folder: where ``attribution.png`` goes.
    """
    from ..attribution.analysis import paired_rank_test
    from ..figstyle import DOUBLE_COLUMN, fit_ylim, paper_style

    effect = "latent_effect"
    names = [p for p in PREDICTORS if p in next(iter(effects_by.values())).columns]
    with paper_style():
        fig, (left, right) = plt.subplots(1, 2, figsize=(DOUBLE_COLUMN, 4.4), layout="constrained")
        for index, (label, effects) in enumerate(effects_by.items()):
            for row, predictor in zip(range(len(names) - 1, -1, -1), names, strict=True):  # the first on top
                # the statistic's own per-set values (no permutations needed for them)
                values = paired_rank_test(_matrix(effects, predictor), _matrix(effects, effect), permutations=0)
                xs, ys = _stacked(values["values"], row + 0.06 + 0.45 * index, 0.36)
                left.scatter(xs, ys, s=7, color=f"C{index}", label=f"{label}: one dot per set")
                mean = np.nanmean(values["values"]) if np.isfinite(values["values"]).any() else np.nan
                left.plot([mean, mean], [row + 0.45 * index, row + 0.45 * index + 0.42], color="black", lw=1.6,
                          label="mean over sets (the statistic)")  # fmt: skip
        left.axvline(0, color="grey", lw=0.8, ls=":", label="chance (permutation null mean)")
        short = {**PREDICTORS, "output_projection": "output-gradient projection"}  # the panel's width
        left.set_yticks([r + 0.45 for r in range(len(names))], [short[p] for p in reversed(names)])
        left.set_ylim(-0.1, len(names) - 0.05)
        left.set_xlim(-1.08, 1.08)
        sets = next(iter(effects_by.values()))["set"].nunique()
        refs = next(iter(effects_by.values()))["reference"].nunique()
        left.set(
            xlabel="per-set Spearman with the ablation effect",
            ylabel="predictor",
            title="(a) each predictor over all steps",
        )
        steps = trained[(trained["timestep"] != "all") & (trained["effect"] == effect)]
        drawn = [[0.0]]
        markers = "osD^"
        for index, predictor in enumerate(names):
            part = steps[steps["predictor"] == predictor]
            if part.empty:  # a record from before this predictor
                continue
            x = np.arange(len(part)) + (index - (len(names) - 1) / 2) * 0.14
            mean, decided = part["spearman"].to_numpy(float), part["predicts"].to_numpy(bool)
            color = f"C{index + 2}"
            right.scatter(x, mean, marker=markers[index % 4], color=color, facecolors=np.where(decided, color, "none"),
                          label=PREDICTORS[predictor])  # fmt: skip
            drawn += [mean]
            right.set_xticks(np.arange(len(part)), list(part["timestep"]))
        right.axhline(0, color="grey", lw=0.8, ls=":", label="chance (permutation null mean)")
        fit_ylim(right, np.concatenate([np.asarray(d, float) for d in drawn]))
        right.set(xlabel="timestep of the predictor (noise → data)", ylabel="mean per-set Spearman",
                  title="(b) trained, per recorded step")  # fmt: skip
        for ax, title in ((left, None), (right, "trained (filled: predicts after Holm)")):  # each panel's key under
            entries = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))  # it, each label once
            ax.legend(list(entries.values()), list(entries), loc="upper center", bbox_to_anchor=(0.5, -0.16),
                      frameon=False, title=title)  # fmt: skip
        fig.suptitle(
            f"Which predicts a reference's ablation effect (RMS latent change)?\n"
            f"recipe {recipe}, {sets} sets of {refs} references, CFG 3, 20 steps"
        )
    inputs = as_records({"effects": effects_by, "trained": trained, "recipe": recipe})
    return save_figure(fig, Path(folder) / "attribution.png", (plot, _stacked, paired_rank_test), inputs)


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    effects_by = {label: pd.DataFrame(values["effects"]) for label, values in raw.items()}
    trained = pd.DataFrame(raw["trained"]["comparisons"])
    return [plot(effects_by, trained, record.get("recipe", "support"), folder)]
