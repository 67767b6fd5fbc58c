"""The attribution experiment's tests after correction (issue #40 points 5 and 6): one-sided decisions, Holm across
each table, the mid block apart, the posterior labelled where it is read after the output is decided, exact flip-rate
intervals, and a predictor chosen on one half of the reference sets and tested on the other.

Conventions, stated before the numbers:

- **one side**: every test asks whether a predictor ranks the references as the ablation effect does (larger
  predictor, larger effect); its p-value is the one-sided permutation p of
  :func:`ipa_probe.attribution.paired_rank_test`, and the decision is that p after Holm's adjustment below
  :data:`~ipa_probe.attribution.ALPHA`. The 95 % bootstrap intervals stay in the tables as descriptions; they
  decide nothing.
- **families**: one organism's whole comparison table (every timestep, predictor and effect) is one Holm family;
  the ablation grid is one family without the mid block and the mid block (one 1 x 1 layer, effects below 0.001)
  is a family of its own, reported apart.
- **near-circular**: the exact posterior is a function of the un-ablated ``x_t``. Read at a step after the output
  is decided it partly restates the output; the grid puts the effect in the first third of the 20 steps (t >= 651),
  so the posterior read at ``t <`` :data:`DECIDED_BELOW` (and its mean over every recorded step) is labelled
  ``near_circular``.
- **held out**: sets with an even index choose the predictor (and its sign: a predictor that ranks the references
  backwards is read negated) with the largest mean per-set Spearman with the effect; the odd sets test it, and then
  the roles swap. The held-out tests of one organism (effects x 2 folds) are one Holm family.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .attribution_setup import EFFECTS, PREDICTORS, _matrix

__all__ = [
    "DECIDED_BELOW",
    "adjust_comparisons",
    "adjust_grid",
    "example_intervals",
    "held_out",
    "rewrite",
]

#: Timesteps below this are read after the output is decided (the grid: the effect lives in steps 0-6, t >= 651).
DECIDED_BELOW = 651.0


def _decide(frame: pd.DataFrame, family: pd.Series | None = None) -> pd.DataFrame:
    """``p_holm`` per family (one family when ``family`` is None) and ``predicts`` = ``p_holm < ALPHA``; the old
    rule (unadjusted p and the interval above 0) stays as ``predicts_unadjusted``."""
    from ..attribution import ALPHA, holm

    out = frame.copy()
    if "predicts" in out.columns:
        # rows that joined an adjusted table (add_patching's) still carry the old rule in ``predicts``
        before = out["predicts"].astype(bool)
        kept = out["predicts_unadjusted"] if "predicts_unadjusted" in out.columns else pd.Series(np.nan, out.index)
        out["predicts_unadjusted"] = kept.where(kept.notna(), before).astype(bool)
    out["p_holm"] = np.nan
    keys = pd.Series(0, index=out.index) if family is None else family
    for _, index in out.groupby(keys.to_numpy()).groups.items():
        out.loc[index, "p_holm"] = holm(out.loc[index, "p"].to_numpy(np.float64))
    out["predicts"] = (out["p_holm"] < ALPHA).to_numpy()
    return out


def adjust_comparisons(table: pd.DataFrame) -> pd.DataFrame:
    """One organism's :func:`~ipa_probe.experiments.attribution.compare` table after correction: ``p_holm`` over the
    whole table, ``predicts`` on it, and ``near_circular`` for the posterior read at or after the decided steps."""
    out = _decide(table)
    when = pd.to_numeric(out["timestep"], errors="coerce")  # "all": the mean over every recorded step
    late = when.isna() | (when < DECIDED_BELOW)
    out["near_circular"] = (out["predictor"].isin(["posterior_weight", "posterior - attention"]) & late).to_numpy()
    return out


def adjust_grid(table: pd.DataFrame) -> pd.DataFrame:
    """The grid's comparisons (:func:`~ipa_probe.experiments.attribution_grid.compare_grid`) after correction: a
    ``family`` column (``"mid block"`` apart, ``"grid"`` for the rest), ``p_holm`` within each, ``predicts`` on it."""
    out = table.copy()
    out["family"] = np.where(out["group"] == "mid", "mid block", "grid")
    return _decide(out, out["family"])


def example_intervals(example: pd.DataFrame) -> pd.DataFrame:
    """The 2 + 2 example's rates (``flipped``, ``baseline_reads_5``, ``reads_5``) with Clopper-Pearson intervals over
    its seeds in place of Student's t, and the counts they come from (``<rate>_count`` of ``seeds``)."""
    from ..attribution import clopper_pearson

    out = example.copy()
    for column in ("flipped", "baseline_reads_5", "reads_5"):
        if column not in out.columns:
            continue
        counts = np.rint(out[column].to_numpy(np.float64) * out["seeds"].to_numpy()).astype(int)
        bounds = [clopper_pearson(k, n) for k, n in zip(counts, out["seeds"].to_numpy(int), strict=True)]
        out[f"{column}_count"] = counts
        out[f"{column}_low"], out[f"{column}_high"] = (np.array(b) for b in zip(*bounds, strict=True))
    return out


def _mean_spearman(frame: pd.DataFrame, predictor: str, effect: str) -> float:
    from ..attribution import paired_rank_test

    return paired_rank_test(_matrix(frame, predictor), _matrix(frame, effect), permutations=0)["values"]


def held_out(effects: pd.DataFrame, permutations: int = 4999, seed: int = 0) -> pd.DataFrame:
    """Choose a predictor on half of the sets and test it on the other half (module docstring).

    Args:
        effects: one organism's effects with the predictors beside them (``set``, ``reference``, the columns of
            :data:`EFFECTS` and :data:`PREDICTORS`).
        permutations, seed: of the held-out permutation test.

    Returns:
        one row per (effect, fold): ``effect``, ``fold`` (``"even chooses"`` / ``"odd chooses"``), ``chosen``,
        ``sign``, ``selection_spearman`` (its mean per-set Spearman on the choosing half), ``spearman``, ``low``,
        ``high``, ``p`` (one-sided) and ``sets`` on the held-out half, ``p_holm`` (over the organism's rows),
        ``agrees`` (``p_holm < ALPHA``), and ``<predictor>_held_out`` every candidate's held-out mean (descriptive).
    """
    from ..attribution import ALPHA, holm, paired_rank_test

    candidates = [p for p in PREDICTORS if p in effects.columns]  # a record from before a predictor lacks it
    sets = np.sort(effects["set"].unique())
    halves = {"even": sets[::2], "odd": sets[1::2]}
    rows = []
    for effect in EFFECTS:
        for chooser, tester in (("even", "odd"), ("odd", "even")):
            choose = effects[effects["set"].isin(halves[chooser])]
            test = effects[effects["set"].isin(halves[tester])]
            scores = {}
            for predictor in candidates:
                values = _mean_spearman(choose, predictor, effect)
                scores[predictor] = float(np.nanmean(values)) if np.isfinite(values).any() else np.nan
            chosen = max(scores, key=lambda k: abs(scores[k]) if np.isfinite(scores[k]) else -1.0)
            sign = 1.0 if scores[chosen] >= 0 else -1.0
            result = paired_rank_test(
                sign * _matrix(test, chosen), _matrix(test, effect), permutations=permutations, seed=seed
            )
            row = {
                "effect": effect,
                "fold": f"{chooser} chooses",
                "chosen": chosen,
                "sign": sign,
                "selection_spearman": scores[chosen],
                "spearman": result["mean"],
                "low": result["low"],
                "high": result["high"],
                "p": result["p"],
                "sets": result["sets"],
            }
            for predictor in candidates:
                values = _mean_spearman(test, predictor, effect)
                row[f"{predictor}_held_out"] = float(np.nanmean(values)) if np.isfinite(values).any() else np.nan
            rows.append(row)
    out = pd.DataFrame(rows)
    out["p_holm"] = holm(out["p"].to_numpy(np.float64))
    out["agrees"] = out["p_holm"] < ALPHA
    return out


def rewrite(folder: str | Path) -> list[Path]:
    """Correct one attribution folder's committed tables in place (no generation): ``comparisons_<label>.csv`` and
    ``grid_comparisons_trained.csv`` gain ``p_holm``, ``predicts`` (on it) and ``predicts_unadjusted``;
    ``example_3s_5s_trained.csv`` gets Clopper-Pearson intervals; ``held_out_<label>.csv`` and
    ``held_out_scores_<label>.csv`` are written from ``effects_<label>.csv`` and, where the folder has it,
    ``aggregates_<label>.csv`` (:func:`~.attribution_aggregate.held_out_aggregations`; without it the candidates are
    the predictors over every layer and step). Returns the files written."""
    from .._io import write_table

    folder = Path(folder)
    written = []
    for label in ("trained", "untrained"):
        path = folder / f"comparisons_{label}.csv"
        if path.exists():
            write_table(adjust_comparisons(pd.read_csv(path, dtype={"timestep": str})), path)
            written.append(path)
        path = folder / f"effects_{label}.csv"
        if path.exists():
            from .attribution_aggregate import held_out_aggregations

            aggregates = folder / f"aggregates_{label}.csv"
            aggregates = pd.read_csv(aggregates) if aggregates.exists() else None
            held, scores = held_out_aggregations(pd.read_csv(path), aggregates)
            for name, frame in (("held_out", held), ("held_out_scores", scores)):
                write_table(frame, folder / f"{name}_{label}.csv")
                written.append(folder / f"{name}_{label}.csv")
    corrections = {"grid_comparisons_trained.csv": adjust_grid, "example_3s_5s_trained.csv": example_intervals}
    for name, correct in corrections.items():
        path = folder / name
        if path.exists():
            write_table(correct(pd.read_csv(path)), path)
            written.append(path)
    return written
