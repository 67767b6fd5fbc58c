"""The attribution experiment's causal ground truth (#29.4): the ablation grid over references x layer groups x step
ranges, which predictor tracks its effects, and the 2+2 example."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .attribution_setup import EFFECTS, PREDICTORS, STEP_PREDICTORS, _call, _interval_text, _matrix, predictor_test
from .report import Row

__all__ = ["compare_grid", "grid_effects", "grid_predictors", "grid_rows", "two_plus_two_example"]

#: Grid cells per pipeline call (:func:`ipa_probe.intervention.ablation_grid`'s ``batch``): on the digits organism's
#: tiny UNet a call's cost is mostly per-layer overhead, so 64 cells as rows of one call cost about a quarter of 64
#: calls (CPU time, one set's 32 cells: 2.9 s against 11.2 s), with the same effects to float32 rounding (at most
#: 3.4e-7 apart in ``latent_effect``, 1e-8 in the classifier's probabilities, the same labels).
GRID_BATCH = 64


def grid_effects(pipe, digits: list[int], refs: list, seed: int, baseline) -> pd.DataFrame:
    """One set's references ablated per layer group (down / mid / up / all) and step range (thirds / all), and scaled
    by 0.5 in every layer and step (:func:`ipa_probe.intervention.ablation_grid`, the set's generation as the clean
    run). Returns the grid with ``digit`` (the reference's digit) and ``class_drop`` (the drop of the classifier's
    probability of that digit)."""
    from ..intervention import ablation_grid
    from ..tiny.digits import classify_digit_images

    call, units = _call(refs), list(range(len(refs)))
    common = dict(seeds=(seed,), classify=classify_digit_images, baselines={seed: baseline}, batch=GRID_BATCH, **call)
    grid = pd.concat(
        [
            ablation_grid(pipe, units, steps=3, **common),
            ablation_grid(
                pipe, units, groups={"all": None}, steps={"all": None}, modes=("scale",), factors=(0.5,), **common
            ),  # fmt: skip
        ],
        ignore_index=True,
    )
    grid["digit"] = np.asarray(digits)[grid["reference"].to_numpy(int)]
    base = grid[[f"baseline_probability_{d}" for d in range(10)]].to_numpy()
    after = grid[[f"probability_{d}" for d in range(10)]].to_numpy()
    rows = np.arange(len(grid))
    grid["class_drop"] = base[rows, grid["digit"]] - after[rows, grid["digit"]]
    return grid


def grid_predictors(table: pd.DataFrame, grid: pd.DataFrame) -> pd.DataFrame:
    """Per (set, reference, group, steps) of the grid: each predictor averaged over the group's layers and the
    recorded steps inside the range (the posterior over those steps only).

    Args:
        table: the sets' stacked attribution tables (with ``set``).
        grid: the stacked :func:`grid_effects` (with ``set``).
    """
    from ..intervention import LAYER_GROUPS

    rows = []
    cells = grid[["group", "steps", "first_step", "last_step"]].drop_duplicates()
    for cell in cells.itertuples():
        part = table
        if cell.group != "all":
            part = part[part["layer"].astype(str).str.contains(LAYER_GROUPS[cell.group], regex=True)]
        if cell.first_step >= 0:
            part = part[(part["step"] >= cell.first_step) & (part["step"] <= cell.last_step)]
        if not len(part):
            continue
        means = part.groupby(["set", "reference"], as_index=False)[list(STEP_PREDICTORS)].mean()
        rows.append(means.assign(group=cell.group, steps=cell.steps))
    return pd.concat(rows, ignore_index=True)


def compare_grid(
    grid: pd.DataFrame, predictors_table: pd.DataFrame, permutations: int = 49999, seed: int = 0
) -> pd.DataFrame:
    """Per (group, steps, mode, factor), effect and predictor: the mean over sets of the per-set Spearman over the
    references (:func:`.attribution_setup.predictor_test`: 95 % bootstrap interval over sets, one-sided sign-flip p)
    and ``predicts`` (p < ALPHA, before Holm: :func:`.attribution_tests.adjust_grid`)."""
    from ..attribution import paired_rank_test

    rows = []
    merged = grid.merge(predictors_table, on=["set", "reference", "group", "steps"])
    for (group, steps, mode, factor), part in merged.groupby(["group", "steps", "mode", "factor"], sort=False):
        for effect in EFFECTS:
            for predictor in STEP_PREDICTORS:
                t = paired_rank_test(_matrix(part, predictor), _matrix(part, effect), 0)
                rows.append(
                    {
                        "group": group,
                        "steps": steps,
                        "mode": mode,
                        "factor": factor,
                        "effect": effect,
                        "predictor": predictor,
                        **predictor_test(t, permutations, seed),
                    }  # fmt: skip
                )
    return pd.DataFrame(rows)


def two_plus_two_example(pipe, seeds: int) -> pd.DataFrame:
    """The note's example: two 3s and two 5s (held-out images), both 3s or both 5s ablated together per layer group
    (every step) and per step third (every layer), ``seeds`` seeds; :func:`ipa_probe.intervention.summarize_grid`
    of the grid over seeds (the RMS changes, skewed and positive: medians with the order-statistic interval; the rates
    means), with the rate at which the output reads 5 before and after."""
    from ..intervention import ablation_grid, generate, summarize_grid
    from ..tiny.digits import classify_digit_images, digits_reference_images

    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    call = _call(refs)
    baselines = {seed: generate(pipe, seed=seed, **call) for seed in range(seeds)}  # one clean run per seed, shared
    common = dict(
        seeds=list(range(seeds)), classify=classify_digit_images, baselines=baselines, batch=GRID_BATCH, **call
    )
    grid = pd.concat(
        [
            ablation_grid(pipe, [(0, 1), (2, 3)], steps={"all": None}, **common),
            ablation_grid(pipe, [(0, 1), (2, 3)], groups={"all": None}, steps=3, whole=False, **common),
        ],
        ignore_index=True,
    )
    grid["baseline_reads_5"] = grid["baseline_label"] == 5
    grid["reads_5"] = grid["label"] == 5
    grid["reference"] = grid["reference"].map({"0+1": "both 3s", "2+3": "both 5s"})
    columns = ["latent_effect", "pixel_effect", "flipped", "baseline_reads_5", "reads_5"]
    drawn = grid.drop_duplicates(["seed", "reference", "group", "steps", "mode", "factor"])
    return summarize_grid(drawn, columns, medians=("latent_effect", "pixel_effect"))


def grid_rows(label: str, comparison: pd.DataFrame, example: pd.DataFrame, sets: int) -> list[Row]:
    """Table rows: per layer group and step range, each predictor's Spearman with the ablation effect; the 2 + 2
    example's effects per group and range."""
    rows = []
    for (group, steps, mode, factor), part in comparison.groupby(["group", "steps", "mode", "factor"], sort=False):
        for effect in EFFECTS:
            by = {r["predictor"]: r for r in part[part["effect"] == effect].to_dict(orient="records")}
            best = [p for p in STEP_PREDICTORS if by[p]["predicts"]]
            family = by[STEP_PREDICTORS[0]].get("family", "grid")
            where = f"{mode}" + (f" x{factor:g}" if mode == "scale" else "")
            rows.append(
                Row(
                    "which predicts the ablation effect (per layer group, step range)?"
                    + (" [mid block: reported apart, effects below 0.001]" if family == "mid block" else ""),
                    f"{label} organism, {where} in {group} layers, steps {steps}, effect = {EFFECTS[effect]}",
                    ", ".join(best) if best else "none",
                    "—",
                    "; ".join(
                        f"{PREDICTORS[p]} {_interval_text(by[p])} (p {by[p]['p']:.2g}"
                        + (f", Holm {by[p]['p_holm']:.2g})" if "p_holm" in by[p] else ")")
                        for p in STEP_PREDICTORS
                    )
                    + f"; mean per-set Spearman over the 4 references, {sets} sets; one-sided p, Holm within the "
                    f"{family} family",
                )
            )
    for row in example.to_dict(orient="records"):
        rows.append(
            Row(
                "two 3s and two 5s: ablating a pair",
                f"{label} organism, {row['reference']} ablated in {row['group']} layers, steps {row['steps']}",
                f"RMS latent change {row['latent_effect']:.3f} [{row['latent_effect_low']:.3f}, "
                f"{row['latent_effect_high']:.3f}]; outputs flipped {100 * row['flipped']:.0f}% "
                f"[{100 * row['flipped_low']:.0f}, {100 * row['flipped_high']:.0f}]",
                "—",
                f"reads 5: {100 * row['baseline_reads_5']:.0f}% before, {100 * row['reads_5']:.0f}% after; "
                f"{row['seeds']} seeds of one reference set; latent: Student's t 95%, rates: Clopper-Pearson 95%",
            )
        )
    return rows
