"""The attribution experiment's aggregation chosen on held-out sets (issue #40 point 5), and its observations made
again for a committed folder.

A predictor read per (layer, recorded step) becomes one number per reference by a mean over a **layer group** (all
IP-Adapter layers, the down blocks, the mid block, the up blocks: :data:`ipa_probe.intervention.LAYER_GROUPS`) and a
**step selection** (every recorded step; the first third of the 20 steps, loop indices 0-6: t = 951, 701; the last
third, 14-19: t = 201, 1; each recorded timestep alone). Every (predictor, group, steps) is a candidate
(:func:`candidates`; the posterior, one number per step whatever the layer, only with all layers), and so is each
whole-run predictor (:data:`~.attribution_setup.WHOLE_RUN_PREDICTORS`, aggregation ``"whole run"``).
:func:`held_out_aggregations` chooses the candidate on half of the sets and tests it on the other half
(:mod:`.attribution_tests`' rule, one Holm family per organism).

:func:`observe_again` regenerates a committed folder's observations (one generation per set, no ablation: the
experiment's sets and seeds, checked against the digits ``effects_<label>.csv`` holds and against its predictor
columns) and writes from them ``aggregates_<label>.csv`` (every candidate per set and reference), the controls
(``verdicts_<label>.csv``, ``controls_<label>.csv``, ``shuffled_<label>.csv``) and ``held_out_<label>.csv``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from .attribution_setup import EFFECTS, SHUFFLE_LATENT_RTOL, STEP_PREDICTORS, WHOLE_RUN_PREDICTORS, _matrix

__all__ = [
    "GROUPS",
    "STEP_SELECTIONS",
    "aggregate",
    "candidates",
    "held_out_aggregations",
    "observe_again",
    "regenerated",
]

#: Layer groups of the aggregation (the ablation grid's, :data:`ipa_probe.intervention.LAYER_GROUPS`, and all).
GROUPS = ("all", "down", "mid", "up")

#: Step selections, as ranges of loop indices of the 20-step schedule (the grid's thirds: 0-6, 7-13, 14-19), and
#: each recorded step alone (:data:`~.attribution_setup.RECORDED_STEPS`; named by timestep in :func:`aggregate`).
STEP_SELECTIONS: dict[str, tuple[int, int] | None] = {
    "all steps": None,
    "first third": (0, 6),
    "last third": (14, 19),
}

#: The aggregation of a whole-run predictor (one number per reference from one backward pass).
WHOLE_RUN = "whole run"


def aggregate(table: pd.DataFrame) -> pd.DataFrame:
    """Every aggregation of the step predictors.

    ``table``: the sets' stacked attribution tables (``set``, ``step``, ``timestep``, ``layer``, ``reference`` and
    :data:`~.attribution_setup.STEP_PREDICTORS`). One row per (set, reference, group, steps): the predictors' means
    over the group's layers and the selection's recorded steps (``steps`` is a name of :data:`STEP_SELECTIONS` or
    ``"t=<timestep>"``).
    """
    from ..intervention import LAYER_GROUPS

    selections = dict(STEP_SELECTIONS)
    for step, timestep in table[["step", "timestep"]].drop_duplicates().sort_values("step").itertuples(index=False):
        selections[f"t={timestep:g}"] = (int(step), int(step))
    layers = table["layer"].astype(str)
    rows = []
    for group in GROUPS:
        in_group = np.ones(len(table), bool) if group == "all" else layers.str.contains(LAYER_GROUPS[group]).to_numpy()
        for name, span in selections.items():
            keep = in_group.copy()
            if span is not None:
                keep &= table["step"].between(*span).to_numpy()
            if not keep.any():
                continue
            part = table[keep]
            # every selected step holds every layer of the group, so the mean over rows is the mean of step means
            means = part.groupby(["set", "reference"], as_index=False)[list(STEP_PREDICTORS)].mean()
            rows.append(means.assign(group=group, steps=name))
    return pd.concat(rows, ignore_index=True)


def _label(predictor: str, group: str, steps: str) -> str:
    return f"{predictor} | {group} layers, {steps}"


def candidates(effects: pd.DataFrame, aggregates: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every candidate as a column beside the effects.

    ``effects``: one organism's ``effects_<label>.csv``; ``aggregates``: :func:`aggregate` of the same sets, or None
    (the candidates are then the predictors as ``effects`` holds them: all layers, all steps). ``(wide, names)``: the
    effects with one column per candidate, and per candidate ``column``, ``predictor``, ``group``, ``steps``.
    """
    names, columns = [], {}
    base = effects[["set", "reference", *[e for e in EFFECTS if e in effects.columns]]].reset_index(drop=True)
    if aggregates is None:
        for predictor in STEP_PREDICTORS:
            if predictor in effects.columns:
                column = _label(predictor, "all", "all steps")
                columns[column] = effects[predictor].to_numpy()
                names.append((column, predictor, "all", "all steps"))
    else:
        index = pd.MultiIndex.from_frame(base[["set", "reference"]])
        for (group, steps), part in aggregates.groupby(["group", "steps"], sort=False):
            part = part.set_index(["set", "reference"]).reindex(index)  # the effects' rows, NaN where a set lacks
            for predictor in STEP_PREDICTORS:
                if predictor == "posterior_weight" and group != "all":
                    continue  # the posterior is one number per step whatever the layer
                column = _label(predictor, group, steps)
                columns[column] = part[predictor].to_numpy()
                names.append((column, predictor, group, steps))
    for predictor in WHOLE_RUN_PREDICTORS:
        if predictor in effects.columns:
            column = _label(predictor, "all", WHOLE_RUN)
            columns[column] = effects[predictor].to_numpy()
            names.append((column, predictor, "all", WHOLE_RUN))
    wide = pd.concat([base, pd.DataFrame(columns)], axis=1)
    return wide, pd.DataFrame(names, columns=["column", "predictor", "group", "steps"])


def _means(frame: pd.DataFrame, column: str, effect: str) -> float:
    from ..attribution import paired_rank_test

    values = paired_rank_test(_matrix(frame, column), _matrix(frame, effect), permutations=0)["values"]
    return float(np.nanmean(values)) if np.isfinite(values).any() else np.nan


def held_out_aggregations(
    effects: pd.DataFrame, aggregates: pd.DataFrame | None, permutations: int = 4999, seed: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Choose a (predictor, aggregation) on half of the sets and test it on the other half.

    Sets with an even index choose, among every candidate of :func:`candidates`, the one (and its sign: a candidate
    that ranks the references backwards is read negated) with the largest absolute mean per-set Spearman with the
    effect; the odd sets test it (one-sided sign-flip p of the per-set Spearman, :func:`ipa_probe.attribution.
    sign_flip_test`); then the roles swap. The held-out tests of one organism (effects x 2 folds) are one Holm family;
    ``agrees`` is ``p_holm < ALPHA``, its interval ``[low, 1]`` the same tests' Holm-compatible one-sided bounds
    (:func:`ipa_probe.attribution.holm_lower_bounds`). Nothing chosen on a half is tested on it.

    Returns:
        ``(held_out, scores)``. ``held_out``: one row per (effect, fold) with ``effect``, ``fold``, ``chosen`` (the
        candidate's predictor), ``group``, ``steps``, ``candidates``, ``sign``, ``selection_spearman``,
        ``spearman``, ``low``, ``high``, ``p``, ``sets``, ``p_holm``, ``agrees``. ``scores``: every candidate's mean
        per-set Spearman on the choosing half and on the held-out half, per (effect, fold) (descriptive).
    """
    from ..attribution import ALPHA, holm, holm_lower_bounds, paired_rank_test, sign_flip_test

    wide, names = candidates(effects, aggregates)
    if names.empty:
        raise ValueError("no predictor columns to choose from: give effects with the experiment's predictor columns")
    sets = np.sort(wide["set"].unique())
    if len(sets) < 4:
        raise ValueError(f"{len(sets)} sets: the held-out split needs two sets on each side at least")
    halves = {"even": sets[::2], "odd": sets[1::2]}
    rows, scores, values = [], [], []
    for effect in EFFECTS:
        if effect not in wide.columns:
            continue
        for chooser, tester in (("even", "odd"), ("odd", "even")):
            choose, test = (wide[wide["set"].isin(halves[half])] for half in (chooser, tester))
            fold = f"{chooser} chooses"
            chosen_scores, held_scores = (
                np.array([_means(f, c, effect) for c in names["column"]]) for f in (choose, test)
            )
            scores.append(names.drop(columns="column").assign(
                effect=effect, fold=fold, choosing_spearman=chosen_scores, held_out_spearman=held_scores))  # fmt: skip
            best = int(np.nanargmax(np.where(np.isfinite(chosen_scores), np.abs(chosen_scores), -1.0)))
            sign = 1.0 if chosen_scores[best] >= 0 else -1.0
            column = names["column"].iloc[best]
            result = paired_rank_test(sign * _matrix(test, column), _matrix(test, effect), permutations=0)
            result["p"], null = sign_flip_test(result["values"], permutations, seed)
            chosen = names.iloc[best]
            rows.append(
                {"effect": effect, "fold": fold, "chosen": chosen["predictor"], "group": chosen["group"],
                 "steps": chosen["steps"], "candidates": len(names), "sign": sign,
                 "selection_spearman": chosen_scores[best], "spearman": result["mean"], "low": result["low"],
                 "high": result["high"], "p": result["p"], "sets": result["sets"]}
            )  # fmt: skip
            values.append(null)
    out = pd.DataFrame(rows)
    out["p_holm"] = holm(out["p"].to_numpy(np.float64))
    out["low"], out["high"] = np.maximum(holm_lower_bounds(values, out["p_holm"]), -1.0), 1.0  # the decision's
    out["agrees"] = out["p_holm"] < ALPHA
    return out, pd.concat(scores, ignore_index=True)


#: Largest difference allowed between a regenerated set's overall predictors and the committed effects file's, as a
#: fraction of the column's largest absolute value (at least 1): the same sets and seeds through the same code path,
#: so only float32 summation order differs, which the denoising loop carries to later steps' ``x_t``. The shuffled
#: order control measured that drift at up to 1.06e-3 of the final latent's largest value on the untrained
#: organism (random weights amplify rounding; :data:`~.attribution_setup.SHUFFLE_LATENT_RTOL`), so the same bound;
#: the regeneration reports its largest difference, and anything above this names the file.
AGREEMENT_RTOL = SHUFFLE_LATENT_RTOL


def regenerated(committed: pd.DataFrame, again: pd.DataFrame, on: list[str], predictors, path) -> float:
    """The largest difference between committed predictors and their regeneration (``again``: :func:`aggregate` rows,
    whose all-layers, all-steps rows are compared), as a fraction of each column's largest absolute value (at least
    1); a ``ValueError`` naming ``path`` above :data:`AGREEMENT_RTOL`."""
    overall = again[(again["group"] == "all") & (again["steps"] == "all steps")]
    merged = committed.merge(overall, on=on, suffixes=("", "_again"), validate="one_to_one")
    worst = max(
        float((merged[p] - merged[f"{p}_again"]).abs().max() / max(1.0, merged[p].abs().max())) for p in predictors
    )
    if not worst <= AGREEMENT_RTOL:
        raise ValueError(
            f"{path}: the regenerated predictors differ from the committed ones by {worst:.3g} of their scale "
            f"(> {AGREEMENT_RTOL}); the organism or the code changed since the records were written"
        )
    return worst


def observe_again(
    folder: str | Path,
    recipe: str,
    progress: bool = False,
    outer: int = 999,
    checks: bool = True,
    labels: tuple[str, ...] = ("trained", "untrained"),
) -> tuple[list[Path], dict[str, float]]:
    """Observe a committed attribution folder's sets again (module docstring) and write what derives from the
    observations: ``aggregates_<label>.csv``, ``held_out_<label>.csv`` (with ``held_out_scores_<label>.csv``),
    ``verdicts_<label>.csv``, ``controls_<label>.csv`` and ``shuffled_<label>.csv``. The effects, comparisons, grid
    and example (which need the ablations) are left as they are.

    ``outer``: the verdicts' bootstrap resamples (the experiment's 999); ``checks=False`` writes the aggregates and the
    held-out choice only, without the controls. Returns the files written, and per organism the largest absolute
    difference between the regenerated overall predictors and the committed ones.
    """
    from tqdm.auto import tqdm

    from .._io import write_table
    from .attribution_controls import control_sets, observed_checks
    from .attribution_setup import observe
    from .ip_adapter_setup import _mixed_sets, organism_pipelines

    folder = Path(folder)
    record = json.loads((folder / "record.json").read_text())
    control_count = int(record["control_sets"])
    populations = control_sets(control_count)
    written, agreement = [], {}
    for label, pipe in organism_pipelines(recipe).items():
        path = folder / f"effects_{label}.csv"
        if label not in labels or not path.exists():
            continue
        effects = pd.read_csv(path)
        sets = _mixed_sets(int(effects["set"].max()) + 1)
        observed, tables = {"2+2 digits": []}, []
        for i in tqdm(sorted(effects["set"].unique()), desc=f"observe {label}", disable=not progress):
            (a, b), refs = sets[i]
            digits = effects[effects["set"] == i].sort_values("reference")["digit"].tolist()
            if digits != [a, a, b, b]:
                raise ValueError(f"{path}: set {i} holds digits {digits}, the experiment's set {i} is {[a, a, b, b]}")
            result = observe(pipe, refs, seed=int(i))
            observed["2+2 digits"].append((digits, refs, result))
            tables.append(result.table.assign(set=int(i)))
        aggregates = aggregate(pd.concat(tables, ignore_index=True))
        agreement[label] = regenerated(effects, aggregates, ["set", "reference"], STEP_PREDICTORS, path)
        held, scores = held_out_aggregations(effects, aggregates)
        for name, frame in (("aggregates", aggregates), ("held_out", held), ("held_out_scores", scores)):
            write_table(frame, folder / f"{name}_{label}.csv")
            written.append(folder / f"{name}_{label}.csv")
        if not checks:
            continue
        for population, members in populations.items():
            observed[population] = [
                (digits, refs, observe(pipe, refs, seed=i))
                for i, (digits, refs) in enumerate(
                    tqdm(members, desc=f"controls {label}: {population}", disable=not progress)
                )
            ]
        verdicts, control_table, shuffled = observed_checks(pipe, observed, control_count, outer)
        for name, frame in (("verdicts", verdicts), ("controls", control_table), ("shuffled", shuffled)):
            write_table(frame, folder / f"{name}_{label}.csv")
            written.append(folder / f"{name}_{label}.csv")
    return written, agreement


def _main() -> None:
    import argparse
    import time

    import torch

    parser = argparse.ArgumentParser(description=observe_again.__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("recipe")
    parser.add_argument("--no-checks", action="store_true", help="aggregates and held-out choice only")
    parser.add_argument("--labels", nargs="+", default=["trained", "untrained"], help="organisms to observe")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    written, agreement = observe_again(
        args.folder, args.recipe, progress=True, checks=not args.no_checks, labels=tuple(args.labels)
    )
    print(args.folder, args.recipe, [str(p) for p in written], agreement, f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    _main()
