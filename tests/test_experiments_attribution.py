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
from ipa_probe.experiments import ip_adapter as experiment_ip
from ipa_probe.experiments.ip_adapter import organism_pipelines, summarize_sets
from ipa_probe.statistics.schema import GAUGE_COLUMNS
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
            (s, r, t, rng.dirichlet(np.ones(refs))[0], rng.uniform(), rng.uniform(), rng.normal())
            for s in range(sets)
            for r in range(refs)
            for t in steps
        ],
        columns=[
            "set",
            "reference",
            "timestep",
            "attention_share",
            "posterior_weight",
            "contribution_norm",
            "contribution_projection",
        ],  # fmt: skip
    )
    effects = pd.DataFrame(
        [(s, r, rng.uniform(), rng.normal(), rng.normal(), rng.normal()) for s in range(sets) for r in range(refs)],
        columns=["set", "reference", "latent_effect", "class_drop", "attribution_patching", "output_projection"],
    )  # the whole run's predictors (one backward pass) come with the effects
    return per_step, effects


def test_predictors_and_comparisons_against_scipy():
    per_step, effects = synthetic()
    table = per_step.copy()
    table["layer"] = "l0"
    overall, by_step = experiment.predictors(table)
    for column in experiment.STEP_PREDICTORS:
        expected = [
            per_step[(per_step["set"] == s) & (per_step["reference"] == r)][column].to_numpy().mean()
            for s, r in zip(overall["set"], overall["reference"], strict=True)
        ]
        np.testing.assert_allclose(overall[column], expected, rtol=1e-12)
    result = experiment.compare(effects, overall, by_step, permutations=999)
    assert list(result["timestep"].unique()) == ["all", "901", "1"]  # noise first

    def per_set(frame, predictor, effect):
        merged = frame.merge(effects, on=["set", "reference"])
        return np.array([stats.spearmanr(g[predictor], g[effect]).statistic for _, g in merged.groupby("set")])

    for when, frame in [("all", overall), ("901", by_step[by_step["timestep"] == 901.0])]:
        for effect in experiment.EFFECTS:
            rows = result[(result["timestep"] == when) & (result["effect"] == effect)].set_index("predictor")
            compared = experiment.PREDICTORS if when == "all" else experiment.STEP_PREDICTORS  # whole run: once
            assert set(rows.index) == {*compared, "posterior - attention"}
            values = {p: per_set(frame, p, effect) for p in compared}
            for predictor, v in values.items():
                assert rows.loc[predictor, "spearman"] == pytest.approx(v.mean(), abs=1e-12)
                r = rows.loc[predictor]
                assert r["predicts"] == (r["p"] < 0.05)  # before Holm: the test alone, no interval
            gap = values["posterior_weight"] - values["attention_share"]
            assert rows.loc["posterior - attention", "spearman"] == pytest.approx(gap.mean(), abs=1e-12)


def test_ip_adapter_summary_against_numpy():
    rng = np.random.default_rng(1)
    frame = pd.DataFrame(
        {
            "set": np.repeat(np.arange(8), 6),  # MIN_SETS: fewer get no interval
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
        set_means = np.array([part[part["set"] == s]["spearman"].mean() for s in range(8)])
        assert row["spearman"] == pytest.approx(set_means.mean(), rel=1e-12)
        assert row["ci_low"] <= row["spearman"] <= row["ci_high"]
        assert row["frac_rho_gt_0.9"] == pytest.approx(np.mean(part["spearman"].to_numpy() > 0.9))
        for c in GAUGE_COLUMNS:
            assert row[c] == pytest.approx(part[c].to_numpy().mean(), rel=1e-12)
    assert not set(GAUGE_COLUMNS) & set(summarize_sets(frame.drop(columns=list(GAUGE_COLUMNS))).columns)


def test_ip_adapter_summary_query_frame_against_numpy():
    """The query-frame columns: means of set means with NaN cells left out per set, BCa intervals that hold the
    mean, the share of entries above 0.9 among those with a value, and plain means of the rest."""
    rng = np.random.default_rng(2)
    n = 60
    frame = pd.DataFrame(
        {
            "set": np.repeat(np.arange(10), 6),
            "timestep": np.tile([981, 501, 1], 20),
            "spearman": rng.uniform(0.5, 1, n),
            "pearson": rng.uniform(0.5, 1, n),
            "spearman_null": rng.normal(0, 0.05, n),
            **{c: rng.normal(0.8, 0.1, n) for c in experiment_ip.INTERVAL_COLUMNS},
            **{c: rng.normal(size=n) for c in experiment_ip.QUERY_FRAME_MEANS},
        }
    )
    frame.loc[::7, "qf_spearman"] = np.nan  # a frame of one query has no rho: left out, not counted as 0
    summary = summarize_sets(frame)
    for _, row in summary.iterrows():
        part = frame[frame["timestep"] == row["timestep"]]
        for c in experiment_ip.INTERVAL_COLUMNS:
            per_set = [np.nanmean(g[c].to_numpy()) for _, g in part.groupby("set") if np.isfinite(g[c]).any()]
            assert row[c] == pytest.approx(np.mean(per_set), rel=1e-12)
            assert row[f"{c}_low"] < row[c] < row[f"{c}_high"]
        values = part["qf_spearman"].to_numpy()
        values = values[np.isfinite(values)]
        assert row["qf_entries"] == values.size
        assert row["qf_frac_rho_gt_0.9"] == pytest.approx(np.mean(values > 0.9))
        gauss = part["qf_gauss_spearman"].to_numpy()
        assert row["qf_gauss_frac_rho_gt_0.9"] == pytest.approx(np.mean(gauss > 0.9))
        for c in experiment_ip.QUERY_FRAME_MEANS:
            assert row[c] == pytest.approx(part[c].to_numpy().mean(), rel=1e-12)
    rows = experiment_ip.query_frame_rows("trained", summary)
    assert len(rows) == 3 and rows[0].ours.startswith(f"{summary['qf_spearman'][0]:.3f} [")
    assert not experiment_ip.query_frame_rows("trained", summarize_sets(frame.drop(columns=["qf_spearman"])))


#: The central difference's step along the ablation path in the organism's float32 check (see its tolerance).
PATCH_EPS = 0.05


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
        # attribution patching: dP(digit)/df_j along the ablation path, against the test's own central difference
        # through mode="scale" (factor 1 +- EPS) and this test's decode and classifier
        ends = []
        for factor in (1 + PATCH_EPS, 1 - PATCH_EPS):
            with ipa_probe.intervene(pipe, row.reference, mode="scale", factor=factor):
                ends.append(probabilities(generate())[row.digit])
        slope = (ends[0] - ends[1]) / (2 * PATCH_EPS)
        # tolerance: float32 latents over 20 steps (differences ~1e-7 of P, /2 EPS) and the central difference's
        # truncation (EPS^2 times the third derivative), plus the patching's own central difference in the classifier
        assert row.attribution_patching == pytest.approx(slope, rel=0.05, abs=2e-4)
    assert effects["attribution_patching"].abs().max() > 1e-3  # something to estimate


# ------------------------------------------------------------------------------------ the controls' pieces
def test_shuffled_reference_order_float32_within_tolerance_and_float64_equal(organism):
    """Permuting the references permutes the shares and leaves the output as it was: in float32 up to the summation
    order (the experiment's tolerances), checked here from the two tables directly; in float64 to 1e-10."""
    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    order = [2, 0, 3, 1]
    first = experiment.observe(organism, refs, seed=1)
    again = experiment.observe(organism, [refs[i] for i in order], seed=1)
    before, after = first.generation.latents.double(), again.generation.latents.double()
    assert (after - before).abs().max() <= experiment.SHUFFLE_LATENT_RTOL * before.abs().max()
    first_step, largest = 0.0, {"first": 0.0, "any": 0.0}
    for name in ("table", "heads", "positions"):
        old, new = getattr(first, name), getattr(again, name)
        keys = [k for k in ("step", "layer", "cell") if k in old.columns]
        first_step = old["step"].min()
        for key, part in old.groupby(keys):
            other = new.set_index(keys).loc[key].sort_values("reference")["attention_share"].to_numpy()
            mine = part.sort_values("reference")["attention_share"].to_numpy()
            # reference j of the shuffled call is reference order[j] of the first
            np.testing.assert_allclose(other, mine[order], atol=experiment.SHUFFLE_SHARE_ATOL)
            gap = float(np.abs(other - mine[order]).max())
            largest["any"] = max(largest["any"], gap)
            if part["step"].iloc[0] == first_step:
                largest["first"] = max(largest["first"], gap)
    check = experiment.shuffle_check(organism, first, refs, 1, order)
    assert check["within_tolerance"] and check["latent_max_diff"] == pytest.approx(float((after - before).abs().max()))
    assert check["first_step_share_max_diff"] == pytest.approx(largest["first"], abs=1e-12)  # the same float32 shares
    assert check["share_max_diff"] == pytest.approx(largest["any"], abs=1e-12)
    # every other per-reference column (#40.6), from the average table: the shuffled call's reference j is order[j]
    from ipa_probe.experiments.attribution_controls import SHUFFLED_COLUMNS

    old, new = first.table, again.table.copy()
    new["reference"] = np.asarray(order)[new["reference"].to_numpy()]
    merged = old.merge(new, on=["step", "layer", "reference"], suffixes=("", "_2"))
    for column in SHUFFLED_COLUMNS[1:]:
        gap = (merged[column] - merged[f"{column}_2"]).abs()
        at_first = gap[merged["step"] == merged["step"].min()].max()
        assert check[f"first_step_{column}_max_diff"] >= at_first - 1e-12  # the cell tables can only add to it
        assert check[f"first_step_{column}_max_diff"] <= 1e-4 * max(1.0, merged[column].abs().max())

    wide = ipa_probe.digits_pipeline().to(torch.float64)
    wide.set_progress_bar_config(disable=True)

    def latents(images):
        generator = torch.Generator().manual_seed(1)
        return wide(**experiment._call(images), generator=generator, output_type="latent").images

    # 1e-10: float64 rounding (1e-16 per sum) times the loop's amplification of rounding (float32: <= 2e3) and |x| ~ 4
    torch.testing.assert_close(latents([refs[i] for i in order]), latents(refs), rtol=0, atol=1e-10)


def test_unseen_references_are_other_images_of_the_same_digits():
    from ipa_probe.tiny.digits.data import TRAIN_SIZE, digit_images

    images, labels = digit_images()
    refs = digits_reference_images(4, 2, seed=100) + digits_reference_images(9, 2, seed=200)
    unseen = experiment.unseen_references([4, 4, 9, 9], refs, seed=3)
    as_bytes = [np.asarray(image).tobytes() for image in unseen]
    assert len(set(as_bytes)) == 4 and not set(as_bytes) & {np.asarray(image).tobytes() for image in refs}
    for digit, image in zip([4, 4, 9, 9], unseen, strict=True):
        pool = np.flatnonzero(labels[TRAIN_SIZE:] == digit)
        rendered = {np.asarray(i).tobytes() for i in digits_reference_images(digit, len(pool), seed=0)}
        assert np.asarray(image).tobytes() in rendered  # a held-out image of that digit
    sets = experiment.control_sets(3)
    assert [d for d, _ in sets["same digit"]] == [[0] * 4, [1] * 4, [2] * 4]
    assert all(len(set(d)) == 4 for d, _ in sets["4 digits"])


def test_set_statistics_and_controls_against_numpy(organism):
    from ipa_probe.attribution import POOLING_TV, control_difference, posterior_at

    refs = digits_reference_images(1, 2, seed=100) + digits_reference_images(7, 2, seed=200)
    result = experiment.observe(organism, refs, seed=2)
    timesteps = dict(zip(result.table["step"], result.table["timestep"], strict=False))
    unseen = posterior_at(organism, experiment.unseen_references([1, 1, 7, 7], refs, 2), result.samples, timesteps)
    got = experiment.set_statistics(result, unseen)
    for row in got.itertuples():
        part = result.table[result.table["timestep"] == row.timestep]
        shares = part.pivot(index="layer", columns="reference", values="attention_share").to_numpy()
        assert row.attention_tv == pytest.approx(np.mean(0.5 * np.abs(shares - 0.25).sum(-1)), rel=1e-12)
        first = part[part["layer"] == part["layer"].iloc[0]].sort_values("reference")
        other = unseen[unseen["timestep"] == row.timestep].sort_values("reference")
        mean = shares.mean(0)
        assert row.share_spearman == pytest.approx(stats.spearmanr(mean, -first["sq_distance"]).statistic)
        assert row.share_spearman_unseen == pytest.approx(stats.spearmanr(mean, -other["sq_distance"]).statistic)
        assert row.posterior_neff_unseen == pytest.approx(1 / (other["posterior_weight"] ** 2).sum(), rel=1e-12)
        for name, cells in (
            ("head_tv_above", result.heads),
            ("position_tv_above", result.positions),
            ("head_position_tv_above", result.head_positions),
        ):
            part = cells[cells["timestep"] == row.timestep]
            tv = part.groupby(["layer", "cell"])["attention_share"].apply(lambda s: 0.5 * np.abs(s - 0.25).sum())
            assert getattr(row, name) == pytest.approx(np.mean(tv.to_numpy() > POOLING_TV))
    statistics = {"2+2 digits": got.assign(set=0), "same digit": got.assign(set=1)}
    statistics = {k: pd.concat([v, v.assign(set=v["set"] + 10)]) for k, v in statistics.items()}
    table = experiment.controls(statistics)
    assert set(table["control"]) == {"unseen references", "same-digit sets"}
    row = table[(table["population"] == "2+2 digits") & (table["statistic"] == "posterior_neff")].iloc[0]
    part = statistics["2+2 digits"][statistics["2+2 digits"]["timestep"] == row["timestep"]]
    expected = control_difference(part["posterior_neff"], part["posterior_neff_unseen"], True)
    assert row["difference"] == pytest.approx(expected["difference"]) and row["counts"] == expected["counts"]


def test_resolution_verdicts_and_rows(organism):
    from ipa_probe.attribution import sets_table, summarize_attribution, verdict_shares
    from ipa_probe.attribution.collect import arrays

    sets = [digits_reference_images(d, 4, seed=300 + d) for d in (2, 8)]
    results = [experiment.observe(organism, refs, seed=i) for i, refs in enumerate(sets)]
    table = experiment.resolution_verdicts(results, outer=30)
    heads = results[0].heads
    assert list(table["resolution"].unique()) == list(experiment.RESOLUTIONS)
    assert list(table["timestep"].unique()) == sorted(results[0].table["timestep"].unique(), reverse=True)
    by = {r: table[table["resolution"] == r]["cells"].iloc[0] for r in experiment.RESOLUTIONS}
    n_layers = results[0].table["layer"].nunique()
    assert by == {
        "average": 1,
        "layer": n_layers,
        "layer x head": len(heads.drop_duplicates(["layer", "cell"])),
        "layer x position": len(results[0].positions.drop_duplicates(["layer", "cell"])),
        # one head at one position (#40.6): every head times every position of every layer
        "layer x head x position": sum(
            heads[heads["layer"] == layer]["cell"].nunique() * part["cell"].nunique()
            for layer, part in results[0].positions.groupby("layer")
        ),
    }
    np.testing.assert_allclose(table[["pooling", "tracks_posterior", "undecided"]].sum(1), 1.0, atol=1e-12)
    stacked = sets_table([r.table for r in results])
    summary = summarize_attribution(stacked, permutations=999, resamples=199).set_index("timestep")
    for row in table[table["resolution"] == "average"].itertuples():
        assert row.pooling == float(summary.loc[row.timestep, "verdict"] == "pooling")
    row = table[table["resolution"] == "layer"].iloc[0]
    data = arrays(stacked, row["timestep"])
    assert row["pooling"] == verdict_shares(data["shares"], data["distance"], outer=0)["pooling"]
    rows = experiment.control_rows("trained", {"verdicts": table.assign(population="same digit"),
                                               "controls": pd.DataFrame(columns=["population", "statistic", "control",
                                                                                 "counts", "timestep"]),
                                               "shuffled": pd.DataFrame()})  # fmt: skip
    assert len(rows) == len(experiment.RESOLUTIONS)


def test_mixed_following_rates_from_its_labels_and_the_tests_own_generation(organism):
    from ipa_probe.tiny.digits import classify_digit_images

    result = experiment.mixed_following(organism, seeds=(0,), samples=1)
    labels = {(e["digit"], e["kind"]): np.asarray(e["labels"]) for e in result["labels"]}
    assert len(labels) == 20
    same = np.mean([labels[(d, "same")][0] == d for d in range(10)])
    assert result["same"]["rate"]["mean"] == pytest.approx(same)
    digits = {d: [(d + 3 * j) % 10 for j in range(3)] for d in range(10)}
    for j in range(3):
        hits = np.mean([labels[(d, "mixed")][0] == digits[d][j] for d in range(10)])
        assert result["mixed"][f"position_{j}"]["mean"] == pytest.approx(hits)
    hits = np.mean([labels[(d, "mixed")][0] in digits[d] for d in range(10)])
    assert result["mixed"]["any"]["mean"] == pytest.approx(hits)
    assert result["mixed"]["none"]["mean"] == pytest.approx(1 - hits)
    # one mixed set regenerated by the test: references drawn as documented, the same seeded latents
    refs = [digits_reference_images(d, 1, seed=600 + j)[0] for j, d in enumerate(digits[4])]
    images = organism(
        DIGITS_PROMPT,
        ip_adapter_image=[refs],
        num_inference_steps=experiment.NUM_STEPS,
        guidance_scale=experiment.GUIDANCE_SCALE,
        generator=torch.Generator().manual_seed(4),
        output_type="np",
    ).images
    assert classify_digit_images(images)[0].tolist() == labels[(4, "mixed")].tolist()


# --------------------------------------------------------------------------- the ablation grid (#29.4)


def _own_classifier_probabilities(pipe, latents):
    """The classifier's probabilities from the test's own decode (as in the ablation test above)."""
    classifier, _ = digit_classifier()
    with torch.no_grad():
        pixels = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample
    images = (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).double().numpy()  # (N, 16, 16, 3)
    grey = images.mean(-1).reshape(-1, 8, 2, 8, 2).mean(axis=(2, 4)) * 16.0
    return classifier.predict_proba(grey.reshape(-1, 64))


@pytest.mark.parametrize("batch", [1, 4])
def test_ablation_grid_cells_equal_the_tests_own_ablation_hooks(organism, batch):
    """One cell per unit: the grid's latent change and classifier probabilities equal a run where the test's own
    pre-hook on each up-block attention drops the reference's image tokens from what the layer is given, at the
    cell's steps only; with ``batch=4`` the cells run as rows of two calls (the weights rescaled per row)."""
    from ipa_probe.intervention import LAYER_GROUPS, ablation_grid, summarize_grid
    from ipa_probe.tiny.digits import classify_digit_images

    pipe = organism
    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    call = dict(prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=6, guidance_scale=3.0)
    grid = ablation_grid(
        pipe, [2, (0, 1)], groups={"up": LAYER_GROUPS["up"]}, steps=3, whole=False, seeds=(1,),
        classify=classify_digit_images, batch=batch, **call,
    )  # fmt: skip
    assert len(grid) == 2 * 3 and set(grid["steps"]) == {"0-1", "2-3", "4-5"}
    # one call per cell: the same float32 latents (the processor computes exactly the same softmax over the kept
    # tokens). Rows of one call: batched kernels and the explicit softmax of the weights hook point sum in another
    # order (float32 rounding ~1e-7 relative per op, carried by 6 steps; measured on 20 steps below 4e-7 absolute
    # in the effect, which is ~0.1-1 here), so 1e-5 absolute, and 1e-5 on probabilities from those latents.
    exact = batch == 1
    effect_tolerance = dict(rel=1e-9, abs=1e-12) if exact else dict(rel=0, abs=1e-5)
    probability_atol = 1e-6 if exact else 1e-5
    layers = [m for n, m in pipe.unet.named_modules() if n.startswith("up_blocks") and n.endswith("attn2")]
    assert layers

    def generate(drop=(), steps=()):
        counter = {"step": -1}
        handles = [pipe.unet.register_forward_pre_hook(lambda m, a: counter.update(step=counter["step"] + 1))]

        def hook(module, args, kwargs):
            if counter["step"] not in steps:
                return None
            text, images = kwargs["encoder_hidden_states"]  # images: [(B, R, T, C)] per adapter
            keep = [r for r in range(images[0].shape[1]) if r not in drop]
            return args, {**kwargs, "encoder_hidden_states": (text, [images[0][:, keep]])}

        handles += [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
        try:
            return pipe(**call, generator=torch.Generator().manual_seed(1), output_type="latent").images
        finally:
            for handle in handles:
                handle.remove()

    base = generate()
    base_p = _own_classifier_probabilities(pipe, base)[0]
    for row in grid.itertuples():
        drop = (row.reference,) if isinstance(row.reference, int) else tuple(int(r) for r in row.reference.split("+"))
        ablated = generate(drop, range(row.first_step, row.last_step + 1))
        expected = np.sqrt(((ablated.double() - base.double()) ** 2).mean().item())
        assert row.latent_effect == pytest.approx(expected, **effect_tolerance)
        own_p = _own_classifier_probabilities(pipe, ablated)[0]
        got_p = np.array([getattr(row, f"probability_{k}") for k in range(10)])
        base_got = np.array([getattr(row, f"baseline_probability_{k}") for k in range(10)])
        # 1e-6: the pipeline's postprocess and this test's decode round the same float32 pixels differently
        np.testing.assert_allclose(got_p, own_p, atol=probability_atol)
        np.testing.assert_allclose(base_got, base_p, atol=1e-6)
    assert grid["latent_effect"].max() > 0  # the ablations did something
    summary = summarize_grid(grid)
    assert len(summary) == len(grid) and (summary["seeds"] == 1).all()
    assert np.isnan(summary["latent_effect_low"]).all()  # one seed: no interval


def test_summarize_grid_and_step_ranges_against_scipy():
    from ipa_probe.intervention import step_ranges, summarize_grid

    assert {k: list(v) for k, v in step_ranges(20).items()} == {
        "0-6": list(range(0, 7)), "7-13": list(range(7, 14)), "14-19": list(range(14, 20)),
    }  # fmt: skip
    assert list(step_ranges(4, 4)) == ["0-0", "1-1", "2-2", "3-3"]
    for bad in [(0, 3), (3, 4), (2.0, 1)]:
        with pytest.raises(ValueError):
            step_ranges(*bad)
    rng = np.random.default_rng(0)
    grid = pd.DataFrame(
        [
            {"seed": s, "reference": r, "group": g, "steps": "all", "mode": "ablate", "factor": 0.0,
             "latent_effect": rng.uniform(), "pixel_effect": rng.uniform(), "flipped": bool(rng.uniform() < 0.5)}
            for s in range(5) for r in range(2) for g in ("down", "up")
        ]
    )  # fmt: skip
    summary = summarize_grid(grid)
    assert len(summary) == 4
    for row in summary.itertuples():
        values = grid[(grid["reference"] == row.reference) & (grid["group"] == row.group)]["latent_effect"]
        low, high = stats.t.interval(0.95, len(values) - 1, loc=values.mean(), scale=stats.sem(values))
        assert row.latent_effect == pytest.approx(values.mean(), rel=1e-12)
        assert (row.latent_effect_low, row.latent_effect_high) == pytest.approx((low, high), rel=1e-10)
    # the example's RMS changes: the median with [min, max] over seeds, none under 6 seeds (coverage 1 - 2^(1 - n))
    assert summarize_grid(grid, medians=["latent_effect"])["latent_effect_low"].isna().all()  # 5 seeds
    more = pd.concat([grid, grid.assign(seed=grid["seed"] + 5, latent_effect=rng.uniform(size=len(grid)))])
    for row in summarize_grid(more, medians=["latent_effect"]).itertuples():
        values = more[(more["reference"] == row.reference) & (more["group"] == row.group)]["latent_effect"]
        assert (row.latent_effect, row.latent_effect_low, row.latent_effect_high) == (
            np.median(values),
            values.min(),
            values.max(),
        )


def test_ablation_grid_bad_input(organism):
    from ipa_probe.intervention import ablation_grid

    refs = digits_reference_images(3, 2, seed=100)
    call = dict(prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=3)
    with pytest.raises(TypeError, match="references"):
        ablation_grid(organism, 0, **call)
    with pytest.raises(ValueError, match="modes"):
        ablation_grid(organism, [0], modes=("swap",), **call)
    with pytest.raises(ValueError, match="batch"):
        ablation_grid(organism, [0], batch=0, **call)
    with pytest.raises(ValueError, match="latents"):
        ablation_grid(organism, [0], batch=2, latents=torch.zeros(1, 4, 8, 8), **call)
    with pytest.raises(ValueError, match="factor"):
        ablation_grid(organism, [0], modes=("scale",), factors=(-0.5,), **call)  # > 1 amplifies; < 0 is refused
    with pytest.raises(ValueError, match=r"groups\['x'\]"):
        ablation_grid(organism, [0], groups={"x": "^nowhere"}, **call)
    with pytest.raises(ValueError, match="num_inference_steps"):
        ablation_grid(organism, [0], prompt=DIGITS_PROMPT, ip_adapter_image=[refs])


def test_grid_predictors_and_comparisons_against_scipy():
    """The grid's predictors are the means over the group's layers and the range's recorded steps; each predictor's
    Spearman with the effect is the mean over sets of scipy's per-set Spearman over the references."""
    rng = np.random.default_rng(3)
    layers = ["down_blocks.0.attn2", "mid_block.attn2", "up_blocks.1.attn2", "up_blocks.2.attn2"]
    steps = [0, 5, 10, 15, 19]
    step_predictors = experiment.STEP_PREDICTORS
    table = pd.DataFrame(
        [
            {"set": s, "reference": r, "layer": layer, "step": t, **{p: rng.uniform() for p in step_predictors}}
            for s in range(8) for r in range(4) for layer in layers for t in steps
        ]
    )  # fmt: skip
    cells = [("up", "0-6", 0, 6), ("all", "7-13", 7, 13), ("down", "all", -1, -1)]
    grid = pd.DataFrame(
        [
            {"set": s, "reference": r, "group": g, "steps": n, "first_step": a, "last_step": b, "mode": "ablate",
             "factor": 0.0, "latent_effect": rng.uniform(), "class_drop": rng.normal()}
            for s in range(8) for r in range(4) for g, n, a, b in cells
        ]
    )  # fmt: skip
    predictors = experiment.grid_predictors(table, grid)
    pick = {"up": ["up_blocks.1.attn2", "up_blocks.2.attn2"], "all": layers, "down": ["down_blocks.0.attn2"]}
    chosen = {"0-6": [0, 5], "7-13": [10], "all": steps}
    for row in predictors.itertuples():
        part = table[
            (table["set"] == row.set) & (table["reference"] == row.reference)
            & table["layer"].isin(pick[row.group]) & table["step"].isin(chosen[row.steps])
        ]  # fmt: skip
        for p in experiment.STEP_PREDICTORS:
            assert getattr(row, p) == pytest.approx(part[p].mean(), rel=1e-12)
    result = experiment.compare_grid(grid, predictors, permutations=999)
    merged = grid.merge(predictors, on=["set", "reference", "group", "steps"])
    for g, n, *_ in cells:
        for effect in experiment.EFFECTS:
            for p in experiment.STEP_PREDICTORS:
                part = merged[(merged["group"] == g) & (merged["steps"] == n)]
                want = np.mean([stats.spearmanr(x[p], x[effect]).statistic for _, x in part.groupby("set")])
                got = result[(result["group"] == g) & (result["steps"] == n) & (result["effect"] == effect)]
                got = got.set_index("predictor").loc[p]
                assert got["spearman"] == pytest.approx(want, abs=1e-12)
                assert got["low"] <= got["spearman"] <= got["high"]
                assert got["predicts"] == (got["p"] < 0.05)  # before Holm: the test alone, no interval
