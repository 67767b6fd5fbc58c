"""The attribution experiment's pieces and the ip-adapter experiment's summary, against independent recomputations;
the --recipe option."""

from __future__ import annotations

import inspect

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import ipa_probe
from ipa_probe.experiments import attribution as experiment
from ipa_probe.experiments.ip_adapter import organism_pipelines, summarize_sets
from ipa_probe.schema import GAUGE_COLUMNS
from ipa_probe.tiny.digits import DIGITS_PROMPT, digit_classifier, digits_reference_images


def test_organism_recipes():
    from ipa_probe.tiny.digits import digits_pipeline as make

    if "recipe" in inspect.signature(make).parameters:
        pytest.skip("the organism has its recipes: test_digits covers digits_pipeline(recipe=...)")
    with pytest.raises(ValueError, match="use --recipe support"):
        organism_pipelines("ip-adapter")


def synthetic(sets=7, refs=4, steps=(901.0, 1.0), seed=0):
    """Per (set, reference, timestep) predictors and per (set, reference) effects."""
    rng = np.random.default_rng(seed)
    per_step = pd.DataFrame(
        [
            (s, r, t, rng.dirichlet(np.ones(refs))[0], rng.uniform())
            for s in range(sets)
            for r in range(refs)
            for t in steps
        ],
        columns=["set", "reference", "timestep", "attention_share", "posterior_weight"],
    )
    effects = pd.DataFrame(
        [(s, r, rng.uniform(), rng.normal()) for s in range(sets) for r in range(refs)],
        columns=["set", "reference", "latent_effect", "class_drop"],
    )
    return per_step, effects


def test_predictors_and_comparisons_against_scipy():
    per_step, effects = synthetic()
    table = per_step.copy()
    table["layer"] = "l0"
    overall, by_step = experiment.predictors(table)
    for column in ("attention_share", "posterior_weight"):
        expected = [
            per_step[(per_step["set"] == s) & (per_step["reference"] == r)][column].to_numpy().mean()
            for s, r in zip(overall["set"], overall["reference"], strict=True)
        ]
        np.testing.assert_allclose(overall[column], expected, rtol=1e-12)
    result = experiment.compare(effects, overall, by_step)
    assert list(result["timestep"].unique()) == ["all", "901", "1"]  # noise first

    def per_set(frame, predictor, effect):
        merged = frame.merge(effects, on=["set", "reference"])
        return np.array([stats.spearmanr(g[predictor], g[effect]).statistic for _, g in merged.groupby("set")])

    for when, frame in [("all", overall), ("901", by_step[by_step["timestep"] == 901.0])]:
        for effect in experiment.EFFECTS:
            rows = result[(result["timestep"] == when) & (result["effect"] == effect)].set_index("predictor")
            values = {p: per_set(frame, p, effect) for p in experiment.PREDICTORS}
            for predictor, v in values.items():
                assert rows.loc[predictor, "spearman"] == pytest.approx(v.mean(), abs=1e-12)
                r = rows.loc[predictor]
                assert r["predicts"] == (r["p"] < 0.05 and r["low"] > 0)
            gap = values["posterior_weight"] - values["attention_share"]
            assert rows.loc["posterior - attention", "spearman"] == pytest.approx(gap.mean(), abs=1e-12)


def test_ip_adapter_summary_against_numpy():
    rng = np.random.default_rng(1)
    frame = pd.DataFrame(
        {
            "set": np.repeat(np.arange(6), 8),
            "timestep": np.tile([981, 1], 24),
            "spearman": rng.uniform(0.5, 1, 48),
            "pearson": rng.uniform(0.5, 1, 48),
            "spearman_null": rng.normal(0, 0.05, 48),
            **{c: rng.normal(size=48) for c in GAUGE_COLUMNS},
        }
    )
    summary = summarize_sets(frame)
    assert list(summary["timestep"]) == [981, 1]
    for _, row in summary.iterrows():
        part = frame[frame["timestep"] == row["timestep"]]
        set_means = np.array([part[part["set"] == s]["spearman"].mean() for s in range(6)])
        assert row["spearman"] == pytest.approx(set_means.mean(), rel=1e-12)
        assert row["ci_low"] <= row["spearman"] <= row["ci_high"]
        assert row["frac_rho_gt_0.9"] == pytest.approx(np.mean(part["spearman"].to_numpy() > 0.9))
        for c in GAUGE_COLUMNS:
            assert row[c] == pytest.approx(part[c].to_numpy().mean(), rel=1e-12)
    assert not set(GAUGE_COLUMNS) & set(summarize_sets(frame.drop(columns=list(GAUGE_COLUMNS))).columns)


def test_ablation_effects_against_the_tests_own_generations(organism):
    pipe = organism
    refs = digits_reference_images(1, 2, seed=100) + digits_reference_images(7, 2, seed=200)
    table, effects = experiment.ablation_effects(pipe, [1, 1, 7, 7], refs, seed=4)
    assert set(table["step"]) == set(experiment.RECORDED_STEPS) and len(effects) == 4
    classifier, _ = digit_classifier()

    def generate():
        return pipe(
            DIGITS_PROMPT,
            ip_adapter_image=[refs],
            num_inference_steps=experiment.NUM_STEPS,
            guidance_scale=experiment.GUIDANCE_SCALE,
            generator=torch.Generator().manual_seed(4),
            output_type="latent",
        ).images

    def probabilities(latents):
        with torch.no_grad():
            pixels = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
        images = (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).double().numpy()  # (N, 16, 16, 3)
        grey = images.mean(-1).reshape(1, 8, 2, 8, 2).mean(axis=(2, 4)) * 16.0
        return classifier.predict_proba(grey.reshape(1, 64))[0]

    base = generate()
    base_probabilities = probabilities(base)
    for row in effects.itertuples():
        with ipa_probe.intervene(pipe, row.reference):
            ablated = generate()
        expected = np.sqrt(((ablated.double() - base.double()) ** 2).mean().item())
        assert row.latent_effect == pytest.approx(expected, rel=1e-9)  # the same float32 latents, float64 RMS
        drop = base_probabilities[row.digit] - probabilities(ablated)[row.digit]
        # 1e-6: the pipeline's postprocess and this test's decode round the same float32 pixels differently
        assert row.class_drop == pytest.approx(drop, abs=1e-6)
        assert row.flipped == (int(np.argmax(probabilities(ablated))) != int(np.argmax(base_probabilities)))
