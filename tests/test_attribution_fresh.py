"""The fresh-set attribution experiment (issue #52 point 1): the deciding-pair rule on constructed sets, and its
agreement and calibration against a recomputation from the raw per-set records (numpy / scipy, float64)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ipa_probe.experiments.attribution_fresh import (
    FRESH_SEED,
    PAIR_PREDICTORS,
    deciding_pairs,
    fresh_set,
    fresh_sets,
    summaries,
    summarize,
    third_digit,
)


def _constructed() -> pd.DataFrame:
    """Seven sets of digits 3 (``a``) and 5 (``b``): only ``a`` flips (sets 0, 4, 5), only ``b`` (1), both (2),
    neither (3), only ``a`` but the clean output reads 8, a third digit (6); every predictor scores ``a`` above ``b``
    but attention share, which scores ``b`` above ``a``."""
    flips = [(True, False), (False, True), (True, True), (False, False), (True, False), (True, False), (True, False)]
    rng = np.random.default_rng(0)
    rows = []
    for s, pair_flips in enumerate(flips):
        for pair, flipped, high in zip("ab", pair_flips, (True, False), strict=True):
            scores = {p: rng.uniform(0.6, 1.0) if high else rng.uniform(0.0, 0.4) for p in PAIR_PREDICTORS}
            scores["attention_share"] = 1.0 - scores["attention_share"]
            rows.append({"set": s, "pair": pair, "a": 3, "b": 5, "clean_label": 8 if s == 6 else 3 if s % 2 else 5,
                         "flipped": flipped, "real_drop": rng.uniform(), **scores})  # fmt: skip
    return pd.DataFrame(rows)


def _recomputed(records: pd.DataFrame, predictor: str) -> dict:
    """Agreement and calibration from the raw rows, written apart from the module: dictionaries and loops."""
    by_set: dict[int, dict[str, dict]] = {}
    for r in records.to_dict(orient="records"):
        by_set.setdefault(int(r["set"]), {})[r["pair"]] = r
    hits = decided = 0
    for pairs in by_set.values():
        flipped = [p for p in ("a", "b") if bool(pairs[p]["flipped"])]
        if len(flipped) != 1 or pairs["a"]["clean_label"] not in (pairs["a"]["a"], pairs["a"]["b"]):
            continue  # no single deciding pair, or the output is a third digit: set aside
        decided += 1
        chosen = "a" if pairs["a"][predictor] >= pairs["b"][predictor] else "b"
        hits += chosen == flipped[0]
    x = np.array([pairs[p][predictor] for pairs in by_set.values() for p in "ab"], np.float64)
    y = np.array([pairs[p]["real_drop"] for pairs in by_set.values() for p in "ab"], np.float64)
    slope = np.polyfit(x, y, 1)[0]
    rank = np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1]
    out = {"hits": hits, "decided": decided, "slope": slope, "spearman": rank}
    if decided:  # one-sided Clopper-Pearson bound from the beta quantile, the p from the binomial tail
        out["agreement_low"] = stats.beta.ppf(0.05, hits, decided - hits + 1) if hits else 0.0
        out["p"] = stats.binom.sf(hits - 1, decided, 0.5)
    return out


def test_deciding_pair_rule_on_constructed_sets():
    records = _constructed()
    deciding = deciding_pairs(records)
    assert deciding.isna().tolist() == [False, False, True, True, False, False, True]
    assert deciding.dropna().tolist() == ["a", "b", "a", "a"]
    assert third_digit(records).tolist() == [False] * 6 + [True]
    summary = summarize(records).set_index("predictor")
    for predictor in PAIR_PREDICTORS:
        expected = _recomputed(records, predictor)
        row = summary.loc[predictor]
        assert (row["decided"], row["hits"]) == (4, 1 if predictor == "attention_share" else 3)
        assert (row["hits"], row["decided"]) == (expected["hits"], expected["decided"])
        for key in ("slope", "spearman", "agreement_low", "p"):
            assert row[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), (predictor, key)
    aside = summaries(records.assign(organism="o")).iloc[0]
    assert (aside["set_aside"], aside["third_digit"]) == (3, 1)


def test_fresh_sets_use_an_unused_range():
    sets = fresh_sets(40)
    seeds = [s[k] for s in sets for k in ("draw_a", "draw_b", "seed")]
    assert min(seeds) >= FRESH_SEED > 10_000
    assert len({(s["draw_a"], s["draw_b"]) for s in sets}) == 40 and all(s["a"] != s["b"] for s in sets)


def test_tiny_run_matches_recomputation(organism):
    """Two fresh sets at 4 steps and one integration point: the summary equals the recomputation from its records,
    and each record is self-consistent (the output-reading score is the clean P(digit), so the real drop cannot
    exceed it; a flip changes the label)."""
    records = pd.concat([fresh_set(organism, spec, points=1, steps=4)[0] for spec in fresh_sets(2)], ignore_index=True)
    assert len(records) == 4 and set(records["pair"]) == {"a", "b"}
    assert (records["real_drop"] <= records["output_digit"] + 1e-12).all()
    assert (records["flipped"] == (records["clean_label"] != records["ablated_label"])).all()
    assert np.isfinite(records[list(PAIR_PREDICTORS)].to_numpy(np.float64)).all()
    summary = summarize(records).set_index("predictor")
    for predictor in PAIR_PREDICTORS:
        expected = _recomputed(records, predictor)
        row = summary.loc[predictor]
        assert (row["hits"], row["decided"]) == (expected["hits"], expected["decided"])
        for key in ("slope", "spearman"):
            assert row[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12)


def test_cheap_ablation_is_the_pairs_ablation_in_a_quarter_of_the_steps(organism):
    """The sizing predictor: the drop of P(pair's digit) when the pair is removed from a generation of a quarter of
    the steps (8 -> 2 here), against the test's own generations: its own weight hooks (the pair's attention weights
    zeroed, the others renormalised), its own decode, grey and call of the judge."""
    import torch

    import ipa_probe
    from ipa_probe.experiments.attribution_setup import _call
    from ipa_probe.intervention.points import hook_point_layers, point_name
    from ipa_probe.tiny.digits import digit_classifier, digits_reference_images

    spec = fresh_sets(1)[0]
    records, _ = fresh_set(organism, spec, points=1, steps=8)
    refs = [image for d in "ab" for image in digits_reference_images(spec[d], 2, seed=spec[f"draw_{d}"])]
    call = {**_call(refs), "num_inference_steps": 2}
    clf, _ = digit_classifier()

    def probabilities() -> np.ndarray:
        generator = torch.Generator().manual_seed(spec["seed"])
        latents = organism(**call, generator=generator, output_type="latent").images
        with torch.no_grad():
            pixels = organism.vae.decode(latents / organism.vae.config.scaling_factor).sample
        grey = (pixels / 2 + 0.5).clamp(0, 1).double().mean(1).reshape(1, 8, 2, 8, 2).mean((2, 4)) * 16.0
        return clf.predict_proba(grey.reshape(1, 64).numpy())[0]

    clean = probabilities()
    for row in records.itertuples():
        members = [0, 1] if row.pair == "a" else [2, 3]

        def without(weights, ctx, members=members):  # (B, H, Q, R * T): the pair's keys out, the rest renormalised
            keep = torch.ones(ctx.references, dtype=weights.dtype)
            keep[members] = 0.0
            kept = weights * keep.repeat_interleave(ctx.tokens)
            return kept / kept.sum(-1, keepdim=True)

        names = [point_name(layer.name, "weights") for layer in hook_point_layers(organism)]
        with ipa_probe.intervene(organism, hooks={name: without for name in names}):
            ablated = probabilities()
        column = int(np.flatnonzero(clf.classes_ == row.digit)[0])
        # 1e-6: the pipeline's postprocess and this test's decode round the same float32 pixels differently
        assert row.cheap_ablation == pytest.approx(clean[column] - ablated[column], abs=1e-6)
    assert records["cheap_ablation"].abs().max() > 1e-3, records["cheap_ablation"]  # an effect to compare


def test_held_out_choice_finds_a_planted_aggregation_and_tests_it_on_the_other_half():
    """Eight constructed sets: one aggregation (contribution norm, up layers, t = 1) is the real drop, so it scores
    the deciding pair higher in every set and ranks the drops best (the ties' rule); every other candidate is noise.
    Each fold chooses it on its half, and the held-out summary is the recomputation's on the other half alone; the
    aggregates must be the records' sets (checked on the whole-run means)."""
    from ipa_probe.experiments.attribution_fresh import held_out
    from ipa_probe.experiments.attribution_setup import STEP_PREDICTORS

    rng = np.random.default_rng(1)
    flips = [(True, False), (False, True), (True, False), (True, True), (False, True), (True, False), (False, False),
             (False, True)]  # fmt: skip
    rows, aggregates = [], []
    for s, pair_flips in enumerate(flips):
        for pair, flipped in zip("ab", pair_flips, strict=True):
            drop = rng.uniform(0.8, 1.0) if flipped else rng.uniform(0, 0.2)
            for group in ("all", "up"):
                for steps in ("all steps", "t=1"):
                    values = {p: rng.uniform() for p in STEP_PREDICTORS}
                    if (group, steps) == ("up", "t=1"):
                        values["contribution_norm"] = drop
                    aggregates.append(
                        {"organism": "o", "set": s, "pair": pair, "group": group, "steps": steps, **values}
                    )
            whole = aggregates[-4]  # (all, all steps): the records' whole-run means
            rows.append({"organism": "o", "set": s, "pair": pair, "a": 1, "b": 2, "clean_label": 1,
                         "flipped": flipped, "real_drop": drop,
                         **{p: rng.uniform() for p in PAIR_PREDICTORS},
                         **{p: whole[p] for p in ("contribution_norm", "attention_share")}})  # fmt: skip
    records, aggregates = pd.DataFrame(rows), pd.DataFrame(aggregates)
    table = held_out(records, aggregates)
    planted = "contribution_norm | up layers, t=1"
    assert set(table["chosen"]) == {planted} and len(table) == 8  # 2 pools x 2 folds x (held out, output digit)
    assert set(table["pool"]) == {"every candidate", "without the posterior"}
    held = table[table["predictor"] == "held out"]
    order = np.argsort(held["p"].to_numpy())  # Holm by hand: sorted p times (m - i), running maximum, capped at 1
    steps = np.maximum.accumulate(held["p"].to_numpy()[order] * (len(held) - np.arange(len(held))))
    np.testing.assert_allclose(held["p_holm"].to_numpy()[order], np.minimum(steps, 1.0), rtol=1e-12)
    assert table.loc[table["predictor"] == "output_digit", "p_holm"].isna().all()
    table = table[table["pool"] == "without the posterior"]
    for fold, tested in (("even sets choose", [1, 3, 5, 7]), ("odd sets choose", [0, 2, 4, 6])):
        half = records[records["set"].isin(tested)].merge(
            aggregates.query("group == 'up' and steps == 't=1'")[["organism", "set", "pair", "contribution_norm"]]
            .rename(columns={"contribution_norm": "planted"}), on=["organism", "set", "pair"])  # fmt: skip
        for predictor, column in (("held out", "planted"), ("output_digit", "output_digit")):
            row = table[(table["fold"] == fold) & (table["predictor"] == predictor)].iloc[0]
            expected = _recomputed(half, column)
            assert (row["hits"], row["decided"]) == (expected["hits"], expected["decided"])
            assert row["spearman"] == pytest.approx(expected["spearman"], abs=1e-12)
    moved = aggregates.assign(attention_share=aggregates["attention_share"] + 0.5)
    with pytest.raises(ValueError, match="records.csv"):
        held_out(records, moved)
