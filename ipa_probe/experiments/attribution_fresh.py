"""Attribution validated on fresh reference sets (issue #52 point 1): which predictor names the references that drive
the output, and which sizes their effect?

The experiment draws its own 2 + 2 sets (two held-out images of digit ``a``, two of ``b``; the digits, the image draws
and the generation's seed all from :data:`FRESH_SEED` on, a range no other experiment uses) and generates each once
(DDIM :data:`~.attribution_setup.NUM_STEPS` steps, CFG 3). Ground truth by exact ablation: each same-digit pair
(both ``a``, both ``b``) is removed in every IP-Adapter layer at every step (``mode="ablate"``); the deciding pair is
the one whose removal alone flips the classifier's digit. Sets where both or neither flip have no deciding pair, and
sets whose clean output is a third digit (neither ``a`` nor ``b``: which pair lowers its own digit does not say what
drives that output) are ill-posed: both are counted apart and set aside from the agreement (not from the calibration,
which needs no decision).

Each predictor scores both pairs (:data:`PAIR_PREDICTORS`), chooses the higher, and its score is its predicted size
of the pair's effect, the drop of ``P(pair's digit)`` under the ablation (``real_drop``). Per predictor
(:func:`summarize`): agreement of its choice with the deciding pair, with chance 1/2, the one-sided binomial p of
agreement above chance and its exact (Clopper-Pearson) one-sided 95 % lower bound (one generation per set, so sets
are independent); and calibration over every (set, pair): the least-squares slope of the real drop on the predicted
one and their Spearman correlation (no interval: a percentile bootstrap over 10-20 sets covers less than 95 %,
``tests/test_interval_coverage.py``).

The same generation gives every aggregation of the step predictors per pair (:func:`observe`), from which
:func:`held_out` chooses a predictor and its aggregation on half of the sets and tests it on the other half.

Run: ``python -m ipa_probe.experiments.attribution_fresh --sets 32 --points 2 --out docs/results/attribution_fresh``
(``--resummarize``: :func:`derive` only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from .attribution_aggregate import _label, aggregate, regenerated
from .attribution_setup import STEP_PREDICTORS, _call

__all__ = [
    "FRESH_SEED",
    "PAIR_PREDICTORS",
    "deciding_pairs",
    "derive",
    "fresh_set",
    "fresh_sets",
    "held_out",
    "observe",
    "run",
    "summaries",
    "summarize",
    "third_digit",
]

#: First seed of the fresh range: digits of set ``i`` from ``default_rng(FRESH_SEED + i)``, its images drawn with
#: seeds ``FRESH_SEED + 2 i`` (digit ``a``) and ``FRESH_SEED + 2 i + 1`` (``b``), its generation seeded
#: ``FRESH_SEED + i`` (every other experiment's seeds are below 10,000).
FRESH_SEED = 520_000

#: Per pair, the score each predictor gives (its predicted drop of ``P(pair's digit)``).
PAIR_PREDICTORS = {
    "output_digit": "reading the output's digit (P(digit) in the clean output)",
    "contribution_norm": "contribution norm (sum over the pair, mean over layers and every step)",
    "attention_share": "attention share (sum over the pair, mean over layers and every step)",
    "attribution_patching": "attribution patching (first order at the clean run)",
    "integrated_patching": "integrated patching (the ablation path, midpoint rule)",
    "cheap_ablation": "the exact ablation in a generation of a quarter of the steps (5 of 20)",
}


def fresh_sets(count: int, start: int = FRESH_SEED) -> list[dict]:
    """``count`` fresh 2 + 2 sets: ``set``, digits ``a`` != ``b``, the draws' seeds and the generation's ``seed``."""
    out = []
    for i in range(count):
        a, b = np.random.default_rng(start + i).choice(10, size=2, replace=False)
        out.append({"set": i, "a": int(a), "b": int(b), "draw_a": start + 2 * i, "draw_b": start + 2 * i + 1,
                    "seed": start + i})  # fmt: skip
    return out


def observe(pipe, spec: dict, steps: int | None = None) -> tuple:
    """One generation of a :func:`fresh_sets` entry (its two draws of each digit), no ablation: ``(call, result,
    pairs)``, the pipeline's call, :func:`ipa_probe.attribution.reference_attribution`'s result and every aggregation
    of its step predictors (:func:`.attribution_aggregate.aggregate`: layer group x step selection) summed over each
    same-digit pair (``set``, ``pair``, ``group``, ``steps``, :data:`~.attribution_setup.STEP_PREDICTORS`)."""
    from ..attribution import reference_attribution
    from ..tiny.digits import digits_reference_images

    refs = [image for d in "ab" for image in digits_reference_images(spec[d], 2, seed=spec[f"draw_{d}"])]
    call = {**_call(refs), **({} if steps is None else {"num_inference_steps": steps})}
    result = reference_attribution(pipe, steps=None, seed=spec["seed"], per_head=False, **call)
    rows = aggregate(result.table.assign(set=spec["set"])).assign(
        pair=lambda f: np.where(f["reference"] < 2, "a", "b")
    )
    pairs = rows.groupby(["set", "pair", "group", "steps"], as_index=False, sort=False)[list(STEP_PREDICTORS)].sum()
    return call, result, pairs


def fresh_set(pipe, spec: dict, points: int = 2, steps: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One set (a :func:`fresh_sets` entry): one row per pair (``pair`` ``"a"`` / ``"b"``) with ``digit``, the
    clean and ablated labels, ``flipped``, ``real_drop`` and every :data:`PAIR_PREDICTORS` score; and its
    :func:`observe` aggregates.

    Args:
        points: the midpoint rule's points per pair for ``integrated_patching`` (one forward and backward pass each).
        steps: denoising steps (default :data:`~.attribution_setup.NUM_STEPS`; fewer for tests).
    """
    from ..attribution import digit_probability_gradients, integrated_patching
    from ..attribution.patching import digit_metrics
    from ..intervention import generate, measure_intervention
    from ..tiny.digits import classify_digit_images

    a, b, seed = spec["a"], spec["b"], spec["seed"]
    call, result, pairs = observe(pipe, spec, steps)
    whole = pairs[(pairs["group"] == "all") & (pairs["steps"] == "all steps")].set_index("pair")  # layers x steps
    first = digit_probability_gradients(pipe, [a, a, b, b], seed=seed, **call)["attribution_patching"].to_numpy()
    quarter = {**call, "num_inference_steps": max(1, call["num_inference_steps"] // 4)}
    cheap = generate(pipe, seed=seed, **quarter)
    rows = []
    for pair, digit, members in (("a", a, [0, 1]), ("b", b, [2, 3])):
        effect, quick = (
            measure_intervention(pipe, members, seed=seed, classify=classify_digit_images, baseline=base, **how)
            for base, how in ((result.generation, call), (cheap, quarter))
        )
        real, fewer = (
            float(e.baseline_probabilities[0, digit] - e.intervened_probabilities[0, digit]) for e in (effect, quick)
        )
        path = integrated_patching(pipe, digit_metrics(pipe, [digit]), members, points=points, seed=seed, **call)
        rows.append(
            {**spec, "pair": pair, "digit": digit, "clean_label": int(effect.baseline_labels[0]),
             "ablated_label": int(effect.intervened_labels[0]), "flipped": bool(effect.flipped[0]),
             "real_drop": real, "output_digit": float(effect.baseline_probabilities[0, digit]),
             "contribution_norm": float(whole.loc[pair, "contribution_norm"]),
             "attention_share": float(whole.loc[pair, "attention_share"]),
             "attribution_patching": float(first[members].sum()), "integrated_patching": -float(path[0]),
             "cheap_ablation": fewer}
        )  # fmt: skip
    return pd.DataFrame(rows), pairs


def third_digit(records: pd.DataFrame) -> pd.Series:
    """Per set, whether its clean output reads a third digit, neither its ``a`` nor its ``b``."""
    clean = records.groupby("set")[["clean_label", "a", "b"]].first()
    return (clean["clean_label"] != clean["a"]) & (clean["clean_label"] != clean["b"])


def deciding_pairs(records: pd.DataFrame) -> pd.Series:
    """Per set, the deciding pair: the one pair whose ablation alone flips the digit; missing (NaN) where both or
    neither flip, or where the clean output is a third digit (:func:`third_digit`)."""
    flips = records.pivot(index="set", columns="pair", values="flipped").astype(bool)  # (S, 2)
    return flips.idxmax(axis=1).where((flips.sum(axis=1) == 1) & ~third_digit(records))


def _calibration(predicted: np.ndarray, real: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    if np.ptp(predicted) == 0 or np.ptp(real) == 0:
        return np.nan, np.nan
    return float(stats.linregress(predicted, real).slope), float(stats.spearmanr(predicted, real).statistic)


def summarize(records: pd.DataFrame, predictors=PAIR_PREDICTORS) -> pd.DataFrame:
    """Per predictor (``predictors``: columns of ``records``): agreement with the deciding pair (``hits`` of
    ``decided`` sets, ``agreement``, its one-sided 95 % Clopper-Pearson lower bound ``agreement_low``, ``chance`` 0.5
    and the one-sided binomial ``p`` of agreement above chance), and calibration over every (set, pair): ``slope`` of
    the real drop on the predicted one and ``spearman``; deciding pairs' ``median_predicted``, ``median_real``."""
    from scipy import stats

    from ..attribution.analysis import exact_lower_bound

    deciding = deciding_pairs(records)
    rows = records.sort_values(["set", "pair"])
    sets = rows["set"].unique()
    real = rows["real_drop"].to_numpy(np.float64).reshape(len(sets), 2)  # (S, 2) pairs a, b
    chosen = (rows["pair"] == rows["set"].map(deciding)).to_numpy()  # the deciding pairs' rows
    out = []
    for predictor in predictors:
        score = rows[predictor].to_numpy(np.float64).reshape(len(sets), 2)  # (S, 2)
        choice = np.where(score[:, 0] >= score[:, 1], "a", "b")
        decided = deciding.loc[sets].notna().to_numpy()
        hits = int((choice[decided] == deciding.loc[sets].to_numpy()[decided]).sum())
        n = int(decided.sum())
        entry = {"predictor": predictor, "sets": len(sets), "decided": n, "hits": hits,
                 "agreement": hits / n if n else np.nan, "chance": 0.5}  # fmt: skip
        p = stats.binomtest(hits, n, 0.5, alternative="greater").pvalue if n else np.nan  # against chance, one-sided
        entry.update({"agreement_low": float(exact_lower_bound(hits, n)), "p": p})  # > 0.5 exactly when p < 0.05
        entry["slope"], entry["spearman"] = _calibration(score.ravel(), real.ravel())
        entry["median_predicted"] = float(rows.loc[chosen, predictor].median()) if chosen.any() else np.nan
        entry["median_real"] = float(rows.loc[chosen, "real_drop"].median()) if chosen.any() else np.nan
        out.append(entry)
    return pd.DataFrame(out)


def summaries(records: pd.DataFrame) -> pd.DataFrame:
    """:func:`summarize` per ``organism`` of ``records`` (``records.csv``), with the counts of sets set aside:
    ``set_aside`` all of them, ``third_digit`` those whose output is a third digit."""
    parts = []
    for organism, frame in records.groupby("organism", sort=False):
        aside = {"set_aside": int(deciding_pairs(frame).isna().sum()), "third_digit": int(third_digit(frame).sum())}
        parts.append(summarize(frame).assign(organism=organism, **aside))
    return pd.concat(parts, ignore_index=True)


def held_out(records: pd.DataFrame, aggregates: pd.DataFrame) -> pd.DataFrame:
    """The predictor and its aggregation chosen on half of the sets and tested on the other half, then swapped.

    Candidates: every (step predictor, layer group, step selection) of ``aggregates`` (:func:`observe` per set, with
    ``organism``) and the two patching scores of ``records``, each also read negated (``-`` before its name); again
    without the posterior (``pool``), which reads the un-ablated ``x_t``: near-circular once the output is decided.
    Per organism and pool, the even-numbered sets choose the candidate with the most hits on their deciding pairs
    (ties: the larger calibration Spearman); the odd ones test it by :func:`summarize` (``predictor`` ``"held
    out"``), beside reading the output's digit on the same sets; then the odd sets choose. Rows as
    :func:`summarize`'s, with ``organism``, ``pool``, ``fold``, the ``chosen`` candidate, its ``choosing_hits`` of
    ``choosing_decided``; ``p_holm``: Holm over the table's held-out tests, ``agreement_low_holm`` the decision's
    one-sided exact bound, Holm-compatible (:func:`~ipa_probe.attribution.analysis.holm_bounds`, null 1/2)."""
    from ..attribution.analysis import exact_lower_bound, holm, holm_bounds

    keys = ["organism", "set", "pair"]
    regenerated(records, aggregates, keys, ("contribution_norm", "attention_share"), "records.csv")
    long = aggregates.melt([*keys, "group", "steps"], list(STEP_PREDICTORS), "predictor").dropna(subset="value")
    long["candidate"] = [_label(*key) for key in long[["predictor", "group", "steps"]].itertuples(index=False)]
    wide = records.merge(long.pivot(index=keys, columns="candidate", values="value").reset_index(), on=keys)
    names = [*long["candidate"].unique(), "attribution_patching", "integrated_patching"]
    wide = pd.concat([wide, (-wide[names]).add_prefix("-")], axis=1)
    pools = {"every candidate": names, "without the posterior": [n for n in names if not n.startswith("posterior")]}
    out = []
    for (organism, frame), (pool, allowed) in itertools.product(wide.groupby("organism", sort=False), pools.items()):
        sets = np.sort(frame["set"].unique())
        for fold, half in (("even sets choose", sets[::2]), ("odd sets choose", sets[1::2])):
            choose, test = frame[frame["set"].isin(half)], frame[~frame["set"].isin(half)]
            ranked = summarize(choose, predictors=[*allowed, *(f"-{n}" for n in allowed)])
            best = ranked.sort_values(["hits", "spearman"], ascending=False, kind="stable").iloc[0]
            tested = summarize(test.assign(**{"held out": test[best["predictor"]]}), ["held out", "output_digit"])
            out.append(tested.assign(organism=organism, pool=pool, fold=fold, chosen=best["predictor"],
                                     candidates=len(ranked), choosing_hits=best["hits"],
                                     choosing_decided=best["decided"]))  # fmt: skip
    out = pd.concat(out, ignore_index=True)
    tested = out["predictor"] == "held out"  # one Holm family: every held-out test of the table
    family = out[tested].assign(p_holm=holm(out.loc[tested, "p"].to_numpy(np.float64)))
    low = holm_bounds(lambda level: exact_lower_bound(family["hits"], family["decided"], level), family["p_holm"], 0.5)
    return out.join(family[["p_holm"]].assign(agreement_low_holm=low))


def run(recipes: list[str], sets: int, out: Path, points: int = 2, steps: int | None = None) -> dict:
    """:func:`fresh_set` on ``sets`` fresh sets per recipe's trained organism: ``records.csv`` (one row per
    organism, set and pair), ``aggregates.csv`` (:func:`observe`'s), :func:`derive`'s tables and ``record.json``."""
    import torch

    from .._io import versions, write_json, write_table
    from ..tiny.digits import digits_pipeline

    out.mkdir(parents=True, exist_ok=True)
    records, aggregates, cpu = [], [], {}
    for recipe in recipes:
        pipe = digits_pipeline(recipe=recipe)
        pipe.set_progress_bar_config(disable=True)
        start = time.process_time()
        frames, pairs = zip(*(fresh_set(pipe, spec, points, steps) for spec in fresh_sets(sets)), strict=True)
        cpu[recipe] = round(time.process_time() - start, 1)
        records.append(pd.concat(frames, ignore_index=True).assign(organism=recipe))
        aggregates.append(pd.concat(pairs, ignore_index=True).assign(organism=recipe))
        write_table(pd.concat(records, ignore_index=True), out / "records.csv")
    write_table(pd.concat(aggregates, ignore_index=True), out / "aggregates.csv")
    derive(out)
    record = {"command": f"python -m ipa_probe.experiments.attribution_fresh --sets {sets} --points {points} "
              f"--recipes {' '.join(recipes)} --out {out}", "fresh_seed": FRESH_SEED, "sets": fresh_sets(sets),
              "points": points, "num_inference_steps": steps or _call([])["num_inference_steps"],
              "threads": torch.get_num_threads(), "cpu_seconds": cpu, "versions": versions()}  # fmt: skip
    write_json(out / "record.json", record)
    return record


def derive(out: Path) -> None:
    """Write ``summary.csv`` (:func:`summaries`) and ``held_out.csv`` (:func:`held_out`) from ``out``'s
    ``records.csv`` and ``aggregates.csv``: what the experiment derives, rerun from its records alone."""
    from .._io import write_table

    records = pd.read_csv(out / "records.csv")
    write_table(summaries(records), out / "summary.csv")
    write_table(held_out(records, pd.read_csv(out / "aggregates.csv")), out / "held_out.csv")


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a script
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sets", type=int, default=16)
    parser.add_argument("--points", type=int, default=2, help="integrated patching's midpoint-rule points")
    parser.add_argument("--recipes", nargs="+", default=["support", "ip-adapter", "mixed"])
    parser.add_argument("--resummarize", action="store_true", help="rewrite summary.csv and held_out.csv (derive)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.resummarize:
        derive(args.out)
    elif args.sets < 1 or args.points < 1:
        parser.error(f"--sets and --points must be at least 1, got {args.sets} and {args.points}")
    else:
        print(json.dumps(run(args.recipes, args.sets, args.out, args.points)["cpu_seconds"]))


if __name__ == "__main__":  # pragma: no cover
    main()
