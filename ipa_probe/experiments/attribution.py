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

**Verdicts at the resolution they claim, and their controls** (issue #29 points 2 and 3). Beside the 2 + 2 sets
(``attribution_sets``), each organism generates ``attribution_control_sets`` sets of four images of one digit and as
many of four different digits (one generation each, no ablation). For every population and recorded step the rule
of :func:`ipa_probe.attribution.verdict` is applied on the average
(:func:`~ipa_probe.attribution.summarize_attribution`) and per cell (:func:`~ipa_probe.attribution.verdict_shares`):
per layer, per (layer, head) and per (layer, query position), with the share of cells on each side and 95 %
intervals over reference sets. Controls:

- **unseen references**: other held-out images of the same digits, in the same places, never given to the
  generation; their exact posterior at the same ``x_t`` (:func:`~ipa_probe.attribution.posterior_at`). The
  posterior's own collapse (``posterior_neff``) and the attention's rank agreement with the posterior
  (``share_spearman``) are compared with the same statistic on the unseen references, set by set;
- **mixed against same-digit sets**: ``attention_tv``, ``share_spearman`` and the per-set share of (layer, head) and
  (layer, position) cells whose TV from uniform exceeds :data:`~ipa_probe.attribution.POOLING_TV`, for the 2 + 2 and
  the four-digit sets against the one-digit sets;
- **shuffled reference order**: the first ``attribution_control_sets`` 2 + 2 sets again with their references
  permuted: the outputs must agree to :data:`SHUFFLE_LATENT_RTOL` and the shares, permuted back, to
  :data:`SHUFFLE_SHARE_ATOL`.

A statistic counts only where it differs from its control (:func:`~ipa_probe.attribution.control_difference`: the
difference's 95 % bootstrap interval excludes 0).

**Causal ground truth with resolution** (issue #29 point 4). The predictors are the attention share, the
contribution norm and projection (each reference's part of the layer output after ``to_out``, see
:data:`ipa_probe.attribution.CONTRIBUTION_COLUMNS`) and the exact posterior weight. On the first
``attribution_grid_sets`` 2 + 2 sets of the trained organism each reference is also ablated per layer group (down /
mid / up blocks, all) and step third (and all steps), and scaled by 0.5 everywhere
(:func:`ipa_probe.intervention.ablation_grid`, the set's generation as the clean run); :func:`compare_grid` gives,
per (group, range), each predictor's mean per-set Spearman with the effect (predictors averaged over the group's
layers and the recorded steps in the range). :func:`two_plus_two_example` ablates both 3s or both 5s of a two-3s,
two-5s set per group and per third over ``attribution_example_seeds`` seeds.
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
PREDICTORS = {
    "attention_share": "attention share",
    "contribution_norm": "contribution norm",
    "contribution_projection": "contribution projection",
    "posterior_weight": "exact posterior weight",
}
#: Reordering the references permutes the image tokens, so every softmax normaliser and every weighted sum of values
#: adds the same float32 terms in another order (relative error ~1e-7 each), and the denoising loop carries those
#: differences to the end. Measured on the 20-step CFG-3 setting (smoke tier, 6 sets): the trained organism's final
#: latent moved by at most 1.4e-6 of its largest |value| (4.7e-6 at |x| ~ 3.3), the untrained one's by up to 2e-4
#: (7.1e-3 at |x| ~ 35: its random weights amplify rounding); in float64 the two orders gave the same latents (the
#: test checks 1e-10). 2e-3 of the largest |value| leaves 10x room above the untrained organism's drift.
SHUFFLE_LATENT_RTOL = 2e-3
#: The same reordering in the shares, permuted back (float32 softmax, shares ~0.25; measured: 1.7e-7 trained, 2.1e-5
#: untrained, where the drifted latent feeds later steps): 1e-4 leaves 5x room and is 500x below the 0.05 pooling
#: threshold.
SHUFFLE_SHARE_ATOL = 1e-4
#: The populations of reference sets: the ablated 2 + 2 sets and the two controls.
POPULATIONS = ("2+2 digits", "same digit", "4 digits")
#: Resolutions at which the verdict's rule is applied.
RESOLUTIONS = ("average", "layer", "layer x head", "layer x position")


def observe(pipe, refs: list, seed: int):
    """One generation of the experiment's setting with ``refs``: its
    :class:`~ipa_probe.attribution.ReferenceAttribution` (shares on average, per head and per position; posterior;
    ``x_t``) at :data:`RECORDED_STEPS`."""
    from ..attribution import reference_attribution

    return reference_attribution(pipe, steps=RECORDED_STEPS, seed=seed, **_call(refs))


def _call(refs: list) -> dict:
    from ..tiny.digits import DIGITS_PROMPT

    return dict(
        prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=NUM_STEPS, guidance_scale=GUIDANCE_SCALE
    )


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
    from ..intervention import measure_intervention
    from ..tiny.digits import classify_digit_images

    call = _call(refs)
    result = observe(pipe, refs, seed)
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
    return result, pd.DataFrame(rows)


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


# ------------------------------------------------------------------------------------ the ablation grid (#29.4)
def grid_effects(pipe, digits: list[int], refs: list, seed: int, baseline) -> pd.DataFrame:
    """One set's references ablated per layer group (down / mid / up / all) and step range (thirds / all), and scaled
    by 0.5 in every layer and step (:func:`ipa_probe.intervention.ablation_grid`, the set's generation as the clean
    run). Returns the grid with ``digit`` (the reference's digit) and ``class_drop`` (the drop of the classifier's
    probability of that digit)."""
    from ..intervention import ablation_grid
    from ..tiny.digits import classify_digit_images

    call, units = _call(refs), list(range(len(refs)))
    common = dict(seeds=(seed,), classify=classify_digit_images, baselines={seed: baseline}, **call)
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
        means = part.groupby(["set", "reference"], as_index=False)[list(PREDICTORS)].mean()
        rows.append(means.assign(group=cell.group, steps=cell.steps))
    return pd.concat(rows, ignore_index=True)


def compare_grid(grid: pd.DataFrame, predictors_table: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Per (group, steps, mode, factor), effect and predictor: the mean over sets of the per-set Spearman over the
    references (:func:`ipa_probe.attribution.paired_rank_test`: 95 % bootstrap interval over sets, one-sided
    permutation p) and ``predicts`` (p < ALPHA and the interval above 0)."""
    from ..attribution import ALPHA, paired_rank_test

    rows = []
    merged = grid.merge(predictors_table, on=["set", "reference", "group", "steps"])
    for (group, steps, mode, factor), part in merged.groupby(["group", "steps", "mode", "factor"], sort=False):
        for effect in EFFECTS:
            for predictor in PREDICTORS:
                t = paired_rank_test(_matrix(part, predictor), _matrix(part, effect), seed=seed)
                rows.append(
                    {
                        "group": group,
                        "steps": steps,
                        "mode": mode,
                        "factor": factor,
                        "effect": effect,
                        "predictor": predictor,
                        "spearman": t["mean"],
                        "low": t["low"],
                        "high": t["high"],
                        "p": t["p"],
                        "sets": t["sets"],
                        "predicts": bool(t["p"] < ALPHA and t["low"] > 0),
                    }
                )
    return pd.DataFrame(rows)


def two_plus_two_example(pipe, seeds: int) -> pd.DataFrame:
    """The note's example: two 3s and two 5s (held-out images), both 3s or both 5s ablated together per layer group
    (every step) and per step third (every layer), ``seeds`` seeds; :func:`ipa_probe.intervention.summarize_grid`
    of the grid (means with Student's t intervals over seeds), with the rate at which the output reads 5 before and
    after."""
    from ..intervention import ablation_grid, summarize_grid
    from ..tiny.digits import classify_digit_images, digits_reference_images

    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    common = dict(seeds=list(range(seeds)), classify=classify_digit_images, **_call(refs))
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
    return summarize_grid(grid.drop_duplicates(["seed", "reference", "group", "steps", "mode", "factor"]), columns)


# ------------------------------------------------------------------------------------------------ controls
def control_sets(count: int) -> dict[str, list[tuple[list[int], list]]]:
    """The two control populations, ``count`` sets each: four held-out images of one digit (``"same digit"``) and
    one image each of four different digits (``"4 digits"``), as ``(digits, images)``."""
    from ..tiny.digits import digits_reference_images

    same, mixed = [], []
    for i in range(count):
        digit = i % 10
        same.append(([digit] * 4, digits_reference_images(digit, 4, seed=300 + i)))
        digits = [(i + 3 * k) % 10 for k in range(4)]  # 3 is prime to 10: four different digits
        mixed.append((digits, [digits_reference_images(d, 1, seed=400 + i)[0] for d in digits]))
    return {"same digit": same, "4 digits": mixed}


def unseen_references(digits: list[int], refs: list, seed: int) -> list:
    """Other held-out images of the same digits, one per reference and in its place, none equal to a reference of
    the set (compared pixel for pixel) and none repeated: references the generation never saw."""
    from ..tiny.digits import digits_reference_images

    taken = {np.asarray(image).tobytes() for image in refs}
    out = []
    for i, digit in enumerate(digits):
        pool = digits_reference_images(digit, len(_pool(digit)), seed=seed * 10 + i)  # the whole pool, shuffled
        image = next(image for image in pool if np.asarray(image).tobytes() not in taken)
        taken.add(np.asarray(image).tobytes())
        out.append(image)
    return out


def _pool(digit: int) -> np.ndarray:
    from ..tiny.digits.data import TRAIN_SIZE, digit_images

    _, labels = digit_images()
    return np.flatnonzero(labels[TRAIN_SIZE:] == digit)


def set_statistics(result, unseen: pd.DataFrame) -> pd.DataFrame:
    """One set's statistics per recorded timestep, with their unseen-reference controls.

    Args:
        result: the set's :class:`~ipa_probe.attribution.ReferenceAttribution`.
        unseen: :func:`~ipa_probe.attribution.posterior_at` of its unseen references at its ``x_t``.

    Returns:
        one row per timestep: ``attention_tv`` (mean over layers of the TV of ``A[l]`` from uniform),
        ``share_spearman`` (Spearman of the layer-mean shares with ``-d``), ``posterior_neff``, the same two against
        the unseen references (``share_spearman_unseen``, ``posterior_neff_unseen``: the attention's shares paired
        with the unseen reference in the same place), and ``head_tv_above`` / ``position_tv_above``, the share of
        (layer, head) / (layer, position) cells whose TV from uniform exceeds ``POOLING_TV``.
    """
    from scipy import stats

    from ..attribution import POOLING_TV, neff, tv_from_uniform

    rows = []
    for timestep, part in result.table.groupby("timestep"):
        shares = part.pivot(index="layer", columns="reference", values="attention_share").to_numpy(np.float64)
        first = part[part["layer"] == part["layer"].iloc[0]].sort_values("reference")
        other = unseen[unseen["timestep"] == timestep].sort_values("reference")
        mean = shares.mean(0)  # (R,) layer mean

        def spearman(distance, mean=mean):
            return float(stats.spearmanr(mean, -np.asarray(distance)).statistic)

        def above(cells, timestep=timestep):
            part = cells[cells["timestep"] == timestep]
            values = part.pivot_table(index=["layer", "cell"], columns="reference", values="attention_share")
            return float((tv_from_uniform(values.to_numpy(np.float64)) > POOLING_TV).mean())

        rows.append(
            {
                "timestep": float(timestep),
                "attention_tv": float(tv_from_uniform(shares).mean()),
                "share_spearman": spearman(first["sq_distance"]),
                "share_spearman_unseen": spearman(other["sq_distance"]),
                "posterior_neff": float(neff(first["posterior_weight"].to_numpy())),
                "posterior_neff_unseen": float(neff(other["posterior_weight"].to_numpy())),
                "head_tv_above": above(result.heads) if len(result.heads) else np.nan,
                "position_tv_above": above(result.positions),
            }
        )
    return pd.DataFrame(rows)


def resolution_verdicts(results: list, outer: int, seed: int = 0) -> pd.DataFrame:
    """The verdict's rule at every resolution for one population of sets.

    Args:
        results: the sets' :class:`~ipa_probe.attribution.ReferenceAttribution`.
        outer: :func:`~ipa_probe.attribution.verdict_shares`' bootstrap resamples of the sets for the intervals.
        seed: the generator's seed.

    Returns:
        one row per (timestep, resolution): ``cells`` and, for each verdict, the share of cells
        (``pooling``, ``tracks_posterior``, ``undecided``, each with ``_low``, ``_high``); at ``"average"`` one cell,
        decided by :func:`~ipa_probe.attribution.summarize_attribution` (intervals NaN).
    """
    from ..attribution import VERDICTS, sets_table, summarize_attribution, summarize_cells

    table = sets_table([r.table for r in results])
    summary = summarize_attribution(table, permutations=999, resamples=199, seed=seed)
    average = []
    for row in summary.to_dict(orient="records"):
        entry = {"timestep": row["timestep"], "cells": 1}
        for v in VERDICTS:
            key = v.replace(" ", "_")
            entry.update({key: float(row["verdict"] == v), f"{key}_low": np.nan, f"{key}_high": np.nan})
        average.append(entry)
    parts = [pd.DataFrame(average).assign(resolution="average")]
    cells = {"layer": None, "layer x head": "heads", "layer x position": "positions"}
    for resolution, name in cells.items():
        stacked = None if name is None else sets_table([getattr(r, name) for r in results])
        if stacked is not None and not len(stacked):
            continue  # per_head=False
        shares = summarize_cells(table, stacked, outer=outer, seed=seed)
        parts.append(shares.assign(resolution=resolution))
    out = pd.concat(parts, ignore_index=True)
    order = {r: i for i, r in enumerate(RESOLUTIONS)}
    out = out.sort_values(["timestep", "resolution"], key=lambda c: c.map(order) if c.name == "resolution" else -c)
    first = ["timestep", "resolution"]
    return out.reset_index(drop=True)[first + [c for c in out.columns if c not in first]]


def controls(statistics: dict[str, pd.DataFrame], seed: int = 0) -> pd.DataFrame:
    """Every statistic against its control, per population and timestep
    (:func:`~ipa_probe.attribution.control_difference`).

    Args:
        statistics: population -> stacked :func:`set_statistics` with a ``set`` column.

    Returns:
        one row per (population, timestep, statistic, control): ``value``, ``control_value``, ``difference``,
        ``low``, ``high``, ``counts`` (the interval excludes 0).
    """
    from ..attribution import control_difference

    rows = []

    def add(population, timestep, statistic, control, result):
        rows.append(
            {
                "population": population,
                "timestep": float(timestep),
                "statistic": statistic,
                "control": control,
                "value": result["value"],
                "control_value": result["control"],
                "difference": result["difference"],
                "low": result["low"],
                "high": result["high"],
                "counts": result["counts"],
            }
        )

    for population, frame in statistics.items():
        for timestep, part in frame.groupby("timestep"):
            for statistic in ("posterior_neff", "share_spearman"):
                values, control = part[statistic].to_numpy(), part[f"{statistic}_unseen"].to_numpy()
                add(population, timestep, statistic, "unseen references", control_difference(values, control, True))
    same = statistics.get("same digit")
    for population, frame in statistics.items():
        if population == "same digit" or same is None:
            continue
        for timestep, part in frame.groupby("timestep"):
            base = same[same["timestep"] == timestep]
            for statistic in ("attention_tv", "share_spearman", "head_tv_above", "position_tv_above"):
                result = control_difference(part[statistic], base[statistic], False, seed)
                add(population, timestep, statistic, "same-digit sets", result)
    return pd.DataFrame(rows).sort_values(
        ["population", "statistic", "control", "timestep"], ascending=[True, True, True, False]
    )


def shuffle_check(pipe, result, refs: list, seed: int, order: list[int]) -> dict:
    """Generate again with the references in ``order`` (reference ``j`` of the new call is ``refs[order[j]]``) and
    compare: the largest absolute difference of the final latents, and of the shares (average, per head, per
    position) with the new references put back in their old places."""
    again = observe(pipe, [refs[i] for i in order], seed)
    before = result.generation.latents.double()
    latent = float((again.generation.latents.double() - before).abs().max())
    scale = float(before.abs().max())
    share = 0.0
    for name in ("table", "heads", "positions"):
        old, new = getattr(result, name), getattr(again, name).copy()
        if not len(old):
            continue
        new["reference"] = np.asarray(order)[new["reference"].to_numpy()]  # back to the original numbering
        keys = [k for k in ("step", "layer", "cell", "reference") if k in old.columns]
        merged = old.merge(new, on=keys, suffixes=("", "_shuffled"), validate="one_to_one")
        if len(merged) != len(old):
            raise ValueError(f"shuffled order: the {name} tables do not pair ({len(merged)} of {len(old)} rows)")
        share = max(share, float((merged["attention_share"] - merged["attention_share_shuffled"]).abs().max()))
    return {
        "order": list(order),
        "latent_max_diff": latent,
        "latent_max_abs": scale,
        "share_max_diff": share,
        "bit_equal": latent == 0.0 and share == 0.0,
        "within_tolerance": latent <= SHUFFLE_LATENT_RTOL * scale and share <= SHUFFLE_SHARE_ATOL,
    }


def _order(index: int, refs: int) -> list[int]:
    """A seeded permutation of ``refs`` references that moves at least one."""
    order = np.random.default_rng(index).permutation(refs)
    return [int(i) for i in (order if (order != np.arange(refs)).any() else np.roll(order, 1))]


def _share_text(row: dict, key: str) -> str:
    if not np.isfinite(row[f"{key}_low"]):
        return f"{100 * row[key]:.0f}%"
    return f"{100 * row[key]:.0f}% [{100 * row[f'{key}_low']:.0f}, {100 * row[f'{key}_high']:.0f}]"


def control_rows(label: str, check: dict) -> list[Row]:
    """Table rows of one organism's verdicts per resolution, controls and shuffled-order check."""
    rows = []
    verdicts = check["verdicts"]
    for population in POPULATIONS:
        part = verdicts[verdicts["population"] == population]
        if not len(part):
            continue
        for resolution in RESOLUTIONS:
            chosen = part[part["resolution"] == resolution].to_dict(orient="records")
            if not chosen:
                continue
            first, last = chosen[0], chosen[-1]  # noise first
            text = "; ".join(
                f"t={r['timestep']:g}: pooling {_share_text(r, 'pooling')}, "
                f"tracks {_share_text(r, 'tracks_posterior')}"
                for r in (first, last)
            )
            rows.append(
                Row(
                    "verdict per cell (share of cells)",
                    f"{label}, {population} sets, {resolution} ({first['cells']} cells)",
                    text,
                    "—",
                    "the rule of ipa_probe.attribution.verdict per cell; 95% interval over reference sets "
                    "(each cell's decision re-taken on bootstrap resamples of the sets); first and last timestep",
                )
            )
    table = check["controls"]
    for (population, statistic, control), part in table.groupby(["population", "statistic", "control"], sort=False):
        counted = int(part["counts"].sum())
        values = ", ".join(
            f"{r['value']:.3g} vs {r['control_value']:.3g} "
            f"({r['difference']:+.3g} [{r['low']:+.3g}, {r['high']:+.3g}])"
            for r in part.to_dict(orient="records")
        )
        rows.append(
            Row(
                "statistic against its control",
                f"{label}, {population}: {statistic} vs {control}",
                f"differs at {counted} of {len(part)} timesteps",
                "—",
                f"t = {', '.join(f'{t:g}' for t in part['timestep'])}: {values}",
            )
        )
    shuffled = check["shuffled"]
    if len(shuffled):
        rows.append(
            Row(
                "shuffled reference order",
                f"{label}, {len(shuffled)} sets",
                f"max |Δ latent| {shuffled['latent_max_diff'].max():.2g} (|latent| up to "
                f"{shuffled['latent_max_abs'].max():.2g}), max |Δ share| {shuffled['share_max_diff'].max():.2g}; "
                f"within tolerance: {'yes' if shuffled['within_tolerance'].all() else 'NO'}"
                f"{'; bit-equal' if shuffled['bit_equal'].all() else ''}",
                "—",
                f"tolerances {SHUFFLE_LATENT_RTOL:g} x max |latent|, {SHUFFLE_SHARE_ATOL:g} on the shares permuted "
                "back: float32 sums in another order",
            )
        )
    return rows


# ------------------------------------------------------------------------------ reference-following, mixed sets
def mixed_following(pipe, seeds=(0, 1, 2, 3, 4), samples: int = 2, n_refs: int = 3) -> dict:
    """How often each reference's digit appears in the output, for sets of ``n_refs`` different digits against sets
    of one digit (issue #29 point 5; neither recipe was trained on mixed references).

    Per seed ``s`` and digit ``d``: a one-digit set (``digits_reference_images(d, n_refs, seed=500 + s)``) and a mixed
    set of the digits ``d, d + 3, d + 6, ...`` (mod 10; one held-out image each, ``seed=600 + 10 s + j``), each
    generating ``samples`` images from the same seeded latents (``s * 1000 + d``), DDIM 20 steps, CFG 3, judged by
    :func:`~ipa_probe.tiny.digits.classify_digit_images`. Rates per seed, then mean and Student's t 95 % interval
    over seeds (:func:`ipa_probe.tiny.digits.following.interval`).

    Returns:
        ``{"same": {"rate"}, "mixed": {"position_0", ..., "any", "none"}, "settings": ...}``, each an interval dict
        (``mean``, ``low``, ``high``, ``n``, ``values``); ``position_j``: the output is reference ``j``'s digit;
        ``any``: one of the set's digits (chance 0.3 for 3 digits); ``none``: none of them.
    """
    import torch

    from ..tiny.digits import classify_digit_images, digits_reference_images
    from ..tiny.digits.following import interval

    per_seed: dict[str, list[float]] = {"same": [], "any": [], "none": []}
    per_seed.update({f"position_{j}": [] for j in range(n_refs)})
    labels_out = []
    for seed in seeds:
        same_hits, positions, any_hits = [], [], []
        for digit in range(10):
            mixed_digits = [(digit + 3 * j) % 10 for j in range(n_refs)]
            sets = {
                "same": digits_reference_images(digit, n_refs, seed=500 + seed),
                "mixed": [
                    digits_reference_images(d, 1, seed=600 + 10 * seed + j)[0] for j, d in enumerate(mixed_digits)
                ],
            }
            for kind, refs in sets.items():
                out = pipe(
                    **{**_call(refs), "num_images_per_prompt": samples},
                    generator=torch.Generator().manual_seed(seed * 1000 + digit),
                    output_type="np",
                )
                labels, _ = classify_digit_images(out.images)
                labels_out.append({"seed": seed, "digit": digit, "kind": kind, "labels": labels.tolist()})
                if kind == "same":
                    same_hits.extend((labels == digit).tolist())
                else:
                    positions.append(labels[:, None] == np.asarray(mixed_digits)[None])  # (samples, n_refs)
                    any_hits.extend(np.isin(labels, mixed_digits).tolist())
        per_seed["same"].append(float(np.mean(same_hits)))
        hits = np.concatenate(positions)  # (10 * samples, n_refs)
        for j in range(n_refs):
            per_seed[f"position_{j}"].append(float(hits[:, j].mean()))
        per_seed["any"].append(float(np.mean(any_hits)))
        per_seed["none"].append(1.0 - float(np.mean(any_hits)))
    bounds = (0.0, 1.0)
    return {
        "same": {"rate": interval(per_seed["same"], bounds=bounds)},
        "mixed": {key: interval(values, bounds=bounds) for key, values in per_seed.items() if key != "same"},
        "labels": labels_out,
        "settings": {
            "seeds": list(seeds),
            "samples": samples,
            "n_refs": n_refs,
            "num_inference_steps": NUM_STEPS,
            "guidance_scale": GUIDANCE_SCALE,
        },  # fmt: skip
    }


def _interval_text(r: dict) -> str:
    return f"{r['spearman']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"


def run(ctx) -> ExperimentResult:
    from tqdm.auto import tqdm

    from .._io import write_table
    from ..attribution import posterior_at
    from ..sweep.aggregation import bootstrap_ci
    from .ip_adapter import _mixed_sets, organism_pipelines

    tier, folder = ctx.tier, ctx.out / "attribution"
    folder.mkdir(parents=True, exist_ok=True)
    sets = _mixed_sets(tier.attribution_sets)
    populations = control_sets(tier.attribution_control_sets)
    pipes = organism_pipelines(ctx.recipe)
    outer = 999  # bootstrap resamples of the sets for the per-cell verdict shares' intervals (cheap: no inner loop)
    comparisons, effects_by, raw, checks = {}, {}, {}, {}
    for label, pipe in pipes.items():
        tables, effects, observed = [], [], {population: [] for population in POPULATIONS}
        for i, ((a, b), refs) in enumerate(tqdm(sets, desc=f"attribution {label}", disable=not ctx.progress)):
            result, effect = _ablated(pipe, [a, a, b, b], refs, seed=i)
            observed["2+2 digits"].append(([a, a, b, b], refs, result))
            tables.append(result.table.assign(set=i))
            effects.append(effect.assign(set=i))
        for population, members in populations.items():
            for i, (digits, refs) in enumerate(
                tqdm(members, desc=f"controls {label}: {population}", disable=not ctx.progress)
            ):
                observed[population].append((digits, refs, observe(pipe, refs, seed=i)))
        statistics, verdicts = {}, []
        for population, members in observed.items():
            per_set = []
            for i, (digits, refs, result) in enumerate(members):
                timesteps = dict(zip(result.table["step"], result.table["timestep"], strict=True))
                unseen = posterior_at(pipe, unseen_references(digits, refs, seed=i), result.samples, timesteps)
                per_set.append(set_statistics(result, unseen).assign(set=i))
            statistics[population] = pd.concat(per_set, ignore_index=True)
            by_resolution = resolution_verdicts([result for *_, result in members], outer)
            verdicts.append(by_resolution.assign(population=population))
        verdicts = pd.concat(verdicts, ignore_index=True)
        control_table = controls(statistics)
        shuffled = [
            shuffle_check(pipe, result, refs, i, _order(i, len(refs)))
            for i, (_, refs, result) in enumerate(observed["2+2 digits"][: tier.attribution_control_sets])
        ]
        checks[label] = {"verdicts": verdicts, "controls": control_table, "shuffled": pd.DataFrame(shuffled)}
        write_table(verdicts, folder / f"verdicts_{label}.csv")
        write_table(control_table, folder / f"controls_{label}.csv")
        write_table(pd.DataFrame(shuffled), folder / f"shuffled_{label}.csv")
        if label == "trained" and tier.attribution_grid_sets:
            grids = []
            members = observed["2+2 digits"][: tier.attribution_grid_sets]
            for i, (digits, refs, result) in enumerate(tqdm(members, desc="ablation grid", disable=not ctx.progress)):
                grids.append(grid_effects(pipe, digits, refs, i, result.generation).assign(set=i))
            grid = pd.concat(grids, ignore_index=True)
            grid_table = grid_predictors(pd.concat(tables, ignore_index=True), grid)
            grid_comparison = compare_grid(grid, grid_table)
            write_table(grid.merge(grid_table, on=["set", "reference", "group", "steps"]), folder / "grid_trained.csv")
            write_table(grid_comparison, folder / "grid_comparisons_trained.csv")
            example = two_plus_two_example(pipe, tier.attribution_example_seeds)
            write_table(example, folder / "example_3s_5s_trained.csv")
            checks[label]["grid"] = grid_comparison
            checks[label]["example"] = example
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
    for label, check in checks.items():
        rows.extend(control_rows(label, check))
        if "grid" in check:
            rows.extend(grid_rows(label, check["grid"], check["example"], tier.attribution_grid_sets))
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
        "control_sets": tier.attribution_control_sets,
        "control_rule": "a statistic counts only where its difference from its control has a 95% bootstrap interval "
        "excluding 0 (paired by set for unseen references, two populations resampled apart for same-digit sets)",
        "verdict_intervals": {"bootstrap_resamples_of_sets": outer},
        "shuffle_tolerance": {"latent_rtol": SHUFFLE_LATENT_RTOL, "share_atol": SHUFFLE_SHARE_ATOL},
        "controls": {label: as_records(check) for label, check in checks.items()},
        "grid": {
            "sets": tier.attribution_grid_sets,
            "organism": "trained",
            "groups": "down / mid / up blocks and all layers (ipa_probe.intervention.LAYER_GROUPS)",
            "step_ranges": "thirds of the 20 steps (0-6, 7-13, 14-19) and all",
            "modes": "ablate in every (group, range); scale x0.5 in all layers at all steps",
            "predictors": "means over the group's layers and the recorded steps inside the range",
            "example_seeds": tier.attribution_example_seeds,
        },
    }
    return ExperimentResult("attribution", rows, record, figures)


def grid_rows(label: str, comparison: pd.DataFrame, example: pd.DataFrame, sets: int) -> list[Row]:
    """Table rows: per layer group and step range, each predictor's Spearman with the ablation effect; the 2 + 2
    example's effects per group and range."""
    rows = []
    for (group, steps, mode, factor), part in comparison.groupby(["group", "steps", "mode", "factor"], sort=False):
        for effect in EFFECTS:
            by = {r["predictor"]: r for r in part[part["effect"] == effect].to_dict(orient="records")}
            best = [p for p in PREDICTORS if by[p]["predicts"]]
            where = f"{mode}" + (f" x{factor:g}" if mode == "scale" else "")
            rows.append(
                Row(
                    "which predicts the ablation effect (per layer group, step range)?",
                    f"{label} organism, {where} in {group} layers, steps {steps}, effect = {EFFECTS[effect]}",
                    ", ".join(best) if best else "none",
                    "—",
                    "; ".join(f"{PREDICTORS[p]} {_interval_text(by[p])} (p {by[p]['p']:.2g})" for p in PREDICTORS)
                    + f"; mean per-set Spearman over the 4 references, {sets} sets",
                )
            )
    for row in example.to_dict(orient="records"):
        rows.append(
            Row(
                "two 3s and two 5s: ablating a pair",
                f"{label} organism, {row['reference']} ablated in {row['group']} layers, steps {row['steps']}",
                f"RMS latent change {row['latent_effect']:.3f} [{row['latent_effect_low']:.3f}, "
                f"{row['latent_effect_high']:.3f}]; outputs flipped {100 * row['flipped']:.0f}%",
                "—",
                f"reads 5: {100 * row['baseline_reads_5']:.0f}% before, {100 * row['reads_5']:.0f}% after; "
                f"{row['seeds']} seeds, Student's t 95% intervals",
            )
        )
    return rows


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
