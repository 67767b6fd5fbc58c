"""The gauge-invariant comparisons of attention with the exact posterior: every number against an independent float64
recomputation (the test's own hooks, numpy, scipy), invariance under a q/k gauge change, and the verdict's rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import inverted_bound, sign_flip_p
from scipy import optimize, special, stats

import ipa_probe
from ipa_probe.attribution import (
    POOLING_TV,
    cell_shares,
    cell_verdicts,
    control_difference,
    fit_bandwidth,
    holm_lower_bounds,
    layer_agreement_test,
    neff,
    paired_rank_test,
    posterior_at,
    reference_attribution,
    sets_table,
    sign_flip_test,
    summarize_attribution,
    summarize_cells,
    tv_from_uniform,
    verdict,
    verdict_shares,
)
from ipa_probe.sweep.aggregation import MIN_SETS
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

NUM_STEPS = 6
STEPS = [0, 3, 5]


@pytest.fixture(scope="module")
def refs():
    return digits_reference_images(2, 2, seed=100) + digits_reference_images(6, 2, seed=200)


def attribution(pipe, refs, seed=0, guidance=3.0, whole=False, steps=STEPS):
    result = reference_attribution(
        pipe,
        steps=steps,
        seed=seed,
        prompt=DIGITS_PROMPT,
        ip_adapter_image=[list(refs)],
        num_inference_steps=NUM_STEPS,
        guidance_scale=guidance,
    )
    return result if whole else (result.table, result.generation)


# ------------------------------------------------------------------------------- collection vs the test's own hooks


def own_recomputation(pipe, refs, seed=0, guidance=3.0):
    """Attention shares, position n_eff and posterior from the test's own hooks on to_q / to_k_ip, in float64."""
    layers = ipa_probe.find_ip_layers(pipe)
    queries, keys, samples, calls = {}, {}, {}, [0]

    def on_unet(module, args, kwargs):
        samples[calls[0]] = (args[0] if args else kwargs["sample"])[-1].double().flatten()
        calls[0] += 1

    handles = [pipe.unet.register_forward_pre_hook(on_unet, with_kwargs=True)]
    for layer in layers:
        attn = layer.attention

        def keep_q(module, args, output, name=layer.name):
            queries[(calls[0] - 1, name)] = output[-1].double()  # (Q, H*d): the conditional row

        def keep_k(module, args, output, name=layer.name):
            keys[(calls[0] - 1, name)] = output[-1].double()  # (images, T, H*d)

        handles.append(attn.to_q.register_forward_hook(keep_q))
        handles.append(layer.processor.to_k_ip[0].register_forward_hook(keep_k))
    try:
        pipe(
            DIGITS_PROMPT,
            ip_adapter_image=[list(refs)],
            num_inference_steps=NUM_STEPS,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(seed),
            output_type="latent",
        )
    finally:
        for handle in handles:
            handle.remove()
    # the support: the VAE's posterior mode of each reference, times the scaling factor (not encode_references)
    with torch.no_grad():
        pixels = torch.cat([pipe.image_processor.preprocess(r, height=16, width=16) for r in refs])
        support = (pipe.vae.encode(pixels).latent_dist.mode() * pipe.vae.config.scaling_factor).double().flatten(1)
    abar = pipe.scheduler.alphas_cumprod.double().numpy()
    timesteps = pipe.scheduler.timesteps.tolist()
    rows, per_head = [], {}
    for step in STEPS:
        t = int(timesteps[step])
        alpha, h = math.sqrt(abar[t]), math.sqrt((1 - abar[t]) / abar[t])
        distance = ((samples[step].numpy() / alpha - support.numpy()) ** 2).sum(-1)
        logits = -distance / (2 * h * h)
        posterior = np.exp(logits - special.logsumexp(logits))
        for layer in layers:
            q, k = queries[(step, layer.name)], keys[(step, layer.name)]
            heads = layer.heads
            d = q.shape[-1] // heads
            qh = q.reshape(-1, heads, d).permute(1, 0, 2).numpy()  # (H, Q, d)
            kh = k.reshape(-1, heads, d).permute(1, 0, 2).numpy()  # (H, R*T, d)
            heads_weights = special.softmax(qh @ kh.transpose(0, 2, 1) / math.sqrt(d), -1)  # (H, Q, R*T)
            per_head[(step, layer.name)] = heads_weights.reshape(heads, qh.shape[1], len(refs), -1).sum(-1)
            weights = heads_weights.mean(0)  # (Q, R*T)
            per_ref = weights.reshape(weights.shape[0], len(refs), -1).sum(-1)  # (Q, R)
            share = per_ref.mean(0)
            position_neff = (1.0 / (per_ref**2).sum(-1)).mean()
            for i in range(len(refs)):
                rows.append((step, t, layer.name, i, share[i], position_neff, distance[i], h, posterior[i]))
    columns = ["step", "timestep", "layer", "reference", "attention_share", "position_neff"]
    frame = pd.DataFrame(rows, columns=columns + ["sq_distance", "bandwidth", "posterior_weight"])
    frame.attrs["samples"] = samples
    frame.attrs["per_head"] = per_head  # (step, layer) -> (H, Q, R) float64
    return frame


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_collection_matches_the_tests_own_hooks(organism, refs, guidance):
    table, generation = attribution(organism, refs, guidance=guidance)
    expected = own_recomputation(organism, refs, guidance=guidance)
    key = ["step", "layer", "reference"]
    merged = table.merge(expected, on=key, suffixes=("", "_expected"), validate="one_to_one")
    assert len(merged) == len(expected) == len(STEPS) * 10 * len(refs)
    # 2e-6: the probe's softmax runs in float32 (shares ~0.25, float32 epsilon 1.2e-7, summed over 4 tokens, 10 heads)
    np.testing.assert_allclose(merged["attention_share"], merged["attention_share_expected"], atol=2e-6)
    np.testing.assert_allclose(merged["position_neff"], merged["position_neff_expected"], rtol=2e-6)
    # 1e-6: both start from the same float32 latents; the rest is float64 on both sides
    np.testing.assert_allclose(merged["sq_distance"], merged["sq_distance_expected"], rtol=1e-6)
    np.testing.assert_allclose(merged["bandwidth"], merged["bandwidth_expected"], rtol=1e-12)
    np.testing.assert_allclose(merged["posterior_weight"], merged["posterior_weight_expected"], atol=1e-6)
    np.testing.assert_allclose(merged["timestep"], merged["timestep_expected"])
    plain = organism(
        DIGITS_PROMPT,
        ip_adapter_image=[list(refs)],
        num_inference_steps=NUM_STEPS,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images
    torch.testing.assert_close(generation.latents, plain, rtol=0, atol=0)  # the probe reads without changing


def test_steps_by_timestep_record_the_steps_whose_timesteps_match(organism, refs):
    """``steps=`` takes a ``Timesteps`` or a predicate: the steps recorded are those whose scheduler timestep (the
    pipeline's own schedule) matches, and their rows are the ones the loop indices give (checked above)."""
    from ipa_probe.intervention import Timesteps

    table, _ = attribution(organism, refs)
    timesteps = organism.scheduler.timesteps.tolist()
    assert len(timesteps) == NUM_STEPS
    chosen = {timesteps[s] for s in STEPS}
    for steps in (Timesteps(sorted(chosen)), lambda step, t: t in chosen):
        by_time, _ = attribution(organism, refs, steps=steps)
        assert sorted(by_time["step"].unique()) == STEPS
        assert by_time.groupby("step")["timestep"].first().tolist() == [timesteps[s] for s in STEPS]
        pd.testing.assert_frame_equal(by_time, table)
    early = Timesteps(low=timesteps[2])  # the first three steps (the timesteps fall)
    assert sorted(attribution(organism, refs, steps=early)[0]["step"].unique()) == [0, 1, 2]


def test_per_head_and_per_position_shares_match_the_tests_own_hooks(organism, refs):
    result = attribution(organism, refs, whole=True)
    per_head = own_recomputation(organism, refs).attrs["per_head"]
    heads, positions = result.heads, result.positions
    assert len(heads) == sum(w.shape[0] * w.shape[2] for w in per_head.values())
    assert len(positions) == sum(w.shape[1] * w.shape[2] for w in per_head.values())
    for (step, layer), w in per_head.items():  # w: (H, Q, R)
        got = heads[(heads["step"] == step) & (heads["layer"] == layer)].sort_values(["cell", "reference"])
        # 2e-6: as the layer shares above (float32 softmax in the probe)
        np.testing.assert_allclose(got["attention_share"], w.mean(1).ravel(), atol=2e-6)
        got = positions[(positions["step"] == step) & (positions["layer"] == layer)].sort_values(["cell", "reference"])
        np.testing.assert_allclose(got["attention_share"], w.mean(0).ravel(), atol=2e-6)
        # the finest resolution the TV rule runs at (#40.6): one head at one position, cell = head * Q + position
        finest = result.head_positions
        got = finest[(finest["step"] == step) & (finest["layer"] == layer)].sort_values(["cell", "reference"])
        np.testing.assert_allclose(got["attention_share"], w.reshape(-1, w.shape[-1]).ravel(), atol=2e-6)


def test_posterior_at_other_references_against_the_tests_own_recomputation(organism, refs):
    """posterior_at evaluates the exact posterior of any references at the x_t the generation passed through."""
    own = own_recomputation(organism, refs)
    others = digits_reference_images(2, 2, seed=7) + digits_reference_images(6, 2, seed=8)
    samples = {step: own.attrs["samples"][step] for step in STEPS}
    timesteps = dict(zip(own["step"], own["timestep"], strict=False))
    got = posterior_at(organism, others, samples, timesteps).sort_values(["step", "reference"])
    assert len(got) == len(STEPS) * 4
    with torch.no_grad():  # the support as own_recomputation makes it: the VAE's posterior mode times the factor
        pixels = torch.cat([organism.image_processor.preprocess(r, height=16, width=16) for r in others])
        latents = organism.vae.encode(pixels).latent_dist.mode() * organism.vae.config.scaling_factor
    support = latents.double().flatten(1).numpy()
    abar = organism.scheduler.alphas_cumprod.double().numpy()
    for step in STEPS:
        t = int(timesteps[step])
        alpha, h = math.sqrt(abar[t]), math.sqrt((1 - abar[t]) / abar[t])
        distance = ((samples[step].numpy() / alpha - support) ** 2).sum(-1)
        logits = -distance / (2 * h * h)
        part = got[got["step"] == step]
        # 1e-6: the same float32 x_t and latents on both sides, float64 after (as in the collection test)
        np.testing.assert_allclose(part["sq_distance"], distance, rtol=1e-6)
        np.testing.assert_allclose(part["posterior_weight"], np.exp(logits - special.logsumexp(logits)), atol=1e-6)
        np.testing.assert_allclose(part["bandwidth"], h, rtol=1e-12)


def test_posterior_is_the_exact_denoisers(organism, refs):
    """sum_i w_i s_i with the table's weights is the exact denoiser's x0 prediction at the same x_t."""
    table, _ = attribution(organism, refs)
    support = ipa_probe.exact.encode_references(organism, refs)  # (R, 4, 8, 8)
    denoiser = ipa_probe.ExactNWDenoiser(support, organism.scheduler)
    samples = own_recomputation(organism, refs).attrs["samples"]
    for step in STEPS:
        part = table[(table["step"] == step) & (table["layer"] == table["layer"].iloc[0])]
        weights = torch.tensor(part["posterior_weight"].to_numpy())  # (R,)
        x0_table = (weights[:, None] * support.double().flatten(1)).sum(0)
        x_t = samples[step].float().reshape(1, *support.shape[1:])
        x0_exact = denoiser.predict_x0(x_t, torch.tensor(part["timestep"].iloc[0])).double().flatten()
        # 1e-3: the exact denoiser's logits are float32, up to |x / alpha - s|^2 / (2 h^2) ~ 1e4 at the last step
        torch.testing.assert_close(x0_table, x0_exact, rtol=0, atol=1e-3)


def test_refuses_calls_it_cannot_pair(organism, refs):
    with pytest.raises(ValueError, match="ip_adapter_image"):
        reference_attribution(organism, prompt=DIGITS_PROMPT, num_inference_steps=2)
    with pytest.raises(ValueError, match="num_images_per_prompt=1"):
        reference_attribution(
            organism, prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=2, num_images_per_prompt=2
        )
    with pytest.raises(TypeError, match="per_head: expected True or False"):
        reference_attribution(organism, per_head="yes", prompt=DIGITS_PROMPT, ip_adapter_image=[refs])
    masks = [torch.ones(1, len(refs), 16, 16)]
    with pytest.raises(ValueError, match="does not support ip_adapter_masks: pass per_head=False"):
        reference_attribution(
            organism, prompt=DIGITS_PROMPT, ip_adapter_image=[refs], cross_attention_kwargs={"ip_adapter_masks": masks}
        )


# ------------------------------------------------------------------------------------------ invariance under the gauge


def probe_spearman(pipe, refs) -> float:
    with ipa_probe.probe(pipe, steps=STEPS) as run:
        pipe(
            DIGITS_PROMPT,
            ip_adapter_image=[list(refs)],
            num_inference_steps=NUM_STEPS,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    table = run.to_dataframe()
    return float(table.loc[table["kind"] == "image", "spearman"].mean())


@pytest.fixture(scope="module")
def gauge_baseline(organism, refs):
    """Two reference sets at c = 1: their tables, outputs, and the probe's rho on the first."""
    sets = [refs, digits_reference_images(4, 2, seed=7) + digits_reference_images(9, 2, seed=8)]
    runs = [attribution(organism, r, seed=i) for i, r in enumerate(sets)]
    return sets, sets_table([t for t, _ in runs]), [g.latents for _, g in runs], probe_spearman(organism, refs)


@pytest.mark.parametrize("c", [0.5, 2.0])
def test_invariant_metrics_do_not_move_under_a_gauge_change(organism, refs, gauge_baseline, c):
    sets, base, base_outputs, rho = gauge_baseline
    before = {k: v.clone() for k, v in organism.unet.state_dict().items()}
    with ipa_probe.qk_gauge(organism, c):  # to_q (weight, bias) times c, to_k and every to_k_ip divided by c
        moved = [attribution(organism, r, seed=i) for i, r in enumerate(sets)]
        rho_moved = probe_spearman(organism, refs)
    assert all(torch.equal(v, organism.unet.state_dict()[k]) for k, v in before.items())  # back bit for bit
    assert abs(rho_moved - rho) > 0.05  # the probe's rho is not a property of the model: it moved
    for (_, generation), output in zip(moved, base_outputs, strict=True):
        # 1e-5: a power-of-two factor is exact in float32, so the outputs agree to rounding (here: bitwise)
        torch.testing.assert_close(generation.latents, output, rtol=1e-5, atol=1e-5)
    gauged = sets_table([table for table, _ in moved])
    numeric = ["attention_share", "position_neff", "sq_distance", "posterior_weight"]
    # 1e-5: unchanged attention weights and latents up to float32 rounding (the tolerance)
    np.testing.assert_allclose(gauged[numeric].to_numpy(), base[numeric].to_numpy(), rtol=1e-5, atol=1e-5)
    summary = summarize_attribution(base, permutations=199, resamples=49)
    summary_gauged = summarize_attribution(gauged, permutations=199, resamples=49)
    columns = [c for c in summary.columns if c != "verdict"]
    np.testing.assert_allclose(summary_gauged[columns].to_numpy(float), summary[columns].to_numpy(float), rtol=1e-5)
    assert list(summary_gauged["verdict"]) == list(summary["verdict"])


# ------------------------------------------------------------------------------------- the statistics, on their own


def test_neff_and_tv_from_uniform():
    w = np.random.default_rng(0).dirichlet(np.ones(5), size=7)
    np.testing.assert_allclose(neff(w), [1 / sum(x * x for x in row) for row in w.tolist()], rtol=1e-12)
    expected = [0.5 * sum(abs(x - 0.2) for x in row) for row in w.tolist()]
    np.testing.assert_allclose(tv_from_uniform(w), expected, rtol=1e-12)
    assert tv_from_uniform(np.full(4, 0.25)) == 0 and neff(np.eye(3)[0]) == 1


def test_paired_rank_test_against_scipy_and_exact_enumeration():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    y += 0.8 * x  # some agreement
    result = paired_rank_test(x, y, permutations=4999, seed=0)
    per_set = [stats.spearmanr(a, b).statistic for a, b in zip(x, y, strict=True)]
    assert result["mean"] == pytest.approx(np.mean(per_set), abs=1e-12) and result["sets"] == 3
    per_permutation = [  # scipy's Spearman of each set under each of the 24 orders of its y
        [stats.spearmanr(x[s], y[s][list(p)]).statistic for p in itertools.permutations(range(4))] for s in range(3)
    ]
    null = [np.mean(values) for values in itertools.product(*per_permutation)]  # all 24^3 joint permutations
    exact = np.mean(np.asarray(null) >= np.mean(per_set) - 1e-12)
    # 0.03: four standard errors of a Monte-Carlo p-value from 4999 permutations (sd <= sqrt(0.25 / 4999))
    assert result["p"] == pytest.approx(exact, abs=0.03)
    more, noise = rng.normal(size=(12, 4)), rng.normal(size=(12, 4))
    result = paired_rank_test(more, more + noise, seed=0)
    values = np.array([stats.spearmanr(a, a + b).statistic for a, b in zip(more, noise, strict=True)])
    # the interval is the test's own bootstrap-t of scipy's per-set Spearman values (the library's draws)
    mean, se, t = bootstrap_t(values[:, None], np.random.default_rng(0).integers(0, 12, (9999, 12)))
    upper, lower = np.quantile(t[:, 0], [0.975, 0.025])
    assert (result["low"], result["high"]) == pytest.approx((mean[0] - upper * se[0], mean[0] - lower * se[0]))
    constant = paired_rank_test(np.ones((3, 4)), y)
    assert constant["sets"] == 0 and math.isnan(constant["mean"]) and math.isnan(constant["p"])


def test_sign_flip_test_and_its_bounds_against_enumeration_and_bisection():
    """The decision's test of the attribution tables against the test's own enumeration of all 2^n sign patterns
    (exact where 2^n <= permutations + 1), with tied, Spearman-like values too, and its lower bound at several levels
    against its own bisection of that p: the smallest centre the test keeps, above 0 exactly where it rejects."""
    rng = np.random.default_rng(8)
    cases = [rng.normal(0.3, 1.0, 5), rng.normal(0.1, 1.0, 9), rng.choice(np.linspace(-1, 1, 11), 12)]
    for values in cases + [np.full(6, 0.4), np.array([0.2, -0.2, 0.2, -0.2, 0.6])]:
        p, null = sign_flip_test(values, permutations=9999)
        assert len(null) == 2 ** len(values) and p == pytest.approx(sign_flip_p(values), abs=1e-12)
        for level in (0.2, 0.05, 0.01, 0.05 / 64):
            decided = np.array([0.0 if p < level else 1.0])  # one test: Holm at level is the test at level
            (bound,) = holm_lower_bounds([null], decided, alpha=level)
            assert bound == pytest.approx(inverted_bound(values, level), abs=1e-12)
            assert (bound > 0) == (p < level)
    p, null = sign_flip_test(rng.normal(0.2, 1.0, 40), permutations=999, seed=3)  # drawn: the identity and 999
    assert len(null) == 1000 and null[0] == -np.inf and p == np.mean(null <= 0)
    assert np.isnan(sign_flip_test([0.3, np.nan])[0])  # one value: no test


def test_layer_agreement_against_scipy_and_exact_enumeration():
    rng = np.random.default_rng(2)
    shares = rng.dirichlet(np.ones(3), size=(2, 2))  # (S=2, L=2, R=3)
    result = layer_agreement_test(shares, permutations=4999, seed=0)
    observed = np.mean([stats.spearmanr(s[0], s[1]).statistic for s in shares])
    assert result["mean"] == pytest.approx(observed, abs=1e-12)
    perms = list(itertools.permutations(range(3)))
    null = [
        np.mean([stats.spearmanr(shares[s, 0][list(p[2 * s])], shares[s, 1][list(p[2 * s + 1])]).statistic
                 for s in range(2)])
        for p in itertools.product(perms, repeat=4)
    ]  # fmt: skip
    exact = np.mean(np.asarray(null) >= observed - 1e-12)
    assert result["p"] == pytest.approx(exact, abs=0.03)  # 4 Monte-Carlo standard errors, as above
    wide = rng.dirichlet(np.ones(4), size=(6, 5))  # (S=6, L=5, R=4)
    expected = [
        np.mean([stats.spearmanr(s[i], s[j]).statistic for i, j in itertools.combinations(range(5), 2)]) for s in wide
    ]
    assert layer_agreement_test(wide, permutations=99)["mean"] == pytest.approx(np.mean(expected), abs=1e-12)


def _kl_objective(log_h: float, shares: np.ndarray, distance: np.ndarray) -> float:
    logits = -distance / (2 * np.exp(2 * log_h))
    log_w = logits - special.logsumexp(logits, axis=-1, keepdims=True)
    return float((shares * (np.log(shares) - log_w)).sum())


def test_fitted_bandwidth_interval_resamples_sets_whole():
    """Every set's shares are the posterior at h = 3: any resample of sets fits 3, so the interval is [3, 3]."""
    rng = np.random.default_rng(7)
    distance = rng.uniform(0, 50, size=(12, 4))
    exact = special.softmax(-distance / (2 * 3.0**2), axis=-1)
    row = summarize_attribution(synthetic_frame(exact[:, None], distance, 3.0), permutations=99, resamples=99).iloc[0]
    assert row["fitted_bandwidth_low"] == pytest.approx(3.0, rel=1e-6)
    assert row["fitted_bandwidth_high"] == pytest.approx(3.0, rel=1e-6)
    assert row["fitted_ratio"] == pytest.approx(1.0, rel=1e-6)


def test_fit_bandwidth_against_scipy():
    rng = np.random.default_rng(3)
    distance = rng.uniform(0, 50, size=(10, 4))
    exact = special.softmax(-distance / (2 * 3.0**2), axis=-1)
    assert fit_bandwidth(exact, distance) == pytest.approx(3.0, rel=1e-6)
    shares = rng.dirichlet(np.ones(4), size=10) * 0.5 + exact * 0.5
    expected = optimize.minimize_scalar(_kl_objective, bounds=(-5, 10), args=(shares, distance), method="bounded",
                                        options={"xatol": 1e-10})  # fmt: skip
    # 1e-4: scipy's bounded Brent stops at xatol in log h; ours solves the convex problem's gradient root
    assert fit_bandwidth(shares, distance) == pytest.approx(math.exp(expected.x), rel=1e-4)
    far = special.softmax(distance / 20, axis=-1)  # more weight on the farther references than uniform
    assert math.isinf(fit_bandwidth(far, distance))
    nearest = np.eye(4)[distance.argmin(-1)]
    assert fit_bandwidth(nearest, distance) == 0.0


def test_verdict_rule():
    assert verdict(POOLING_TV - 1e-3, 0.001) == "pooling"
    assert verdict(0.2, 0.001) == "tracks posterior"
    assert verdict(0.2, 0.049) == "tracks posterior"  # one test: the permutation p alone, no interval beside it
    assert verdict(0.2, 0.05) == verdict(0.2, 0.2) == verdict(0.2, math.nan) == "undecided"
    assert (
        verdict(math.nan, 0.001) == verdict(math.nan, math.nan) == "undecided"
    )  # no TV interval: pooling not ruled out


def synthetic_frame(shares: np.ndarray, distance: np.ndarray, h: float, timestep: float = 500.0) -> pd.DataFrame:
    """A collected-table look-alike: shares (S, L, R), distances (S, R)."""
    sets, layers, refs = shares.shape
    posterior = special.softmax(-distance / (2 * h * h), axis=-1)
    rows = [
        (0, timestep, f"layer{j}", i, shares[s, j, i], 3.5, distance[s, i], h, posterior[s, i], s)
        for s in range(sets)
        for j in range(layers)
        for i in range(refs)
    ]
    columns = ["step", "timestep", "layer", "reference", "attention_share", "position_neff", "sq_distance"]
    return pd.DataFrame(rows, columns=columns + ["bandwidth", "posterior_weight", "set"])


def test_summary_columns_against_an_independent_recomputation():
    rng = np.random.default_rng(4)
    sets, layers, refs, h = 9, 3, 4, 4.0
    distance = rng.uniform(0, 40, size=(sets, refs))
    shares = rng.dirichlet(np.full(refs, 3.0), size=(sets, layers))
    row = summarize_attribution(synthetic_frame(shares, distance, h), permutations=999, resamples=99).iloc[0]
    posterior = special.softmax(-distance / (2 * h * h), axis=-1)
    pooled = shares.mean(1)
    assert row["sets"] == sets and row["layers"] == layers and row["references"] == refs
    rank = np.mean([stats.spearmanr(a, -d).statistic for a, d in zip(pooled, distance, strict=True)])
    assert row["share_spearman"] == pytest.approx(rank, abs=1e-12)
    pairs = list(itertools.combinations(range(layers), 2))
    agree = np.mean([np.mean([stats.spearmanr(s[i], s[j]).statistic for i, j in pairs]) for s in shares])
    assert row["layer_agreement"] == pytest.approx(agree, abs=1e-12)
    assert row["tv_attention_posterior"] == pytest.approx(0.5 * np.abs(pooled - posterior).sum(-1).mean(), rel=1e-12)
    assert row["attention_tv"] == pytest.approx(0.5 * np.abs(shares - 0.25).sum(-1).mean(), rel=1e-12)
    assert row["posterior_tv"] == pytest.approx(0.5 * np.abs(posterior - 0.25).sum(-1).mean(), rel=1e-12)
    assert row["attention_neff"] == pytest.approx((1 / (shares**2).sum(-1)).mean(), rel=1e-12)
    assert row["posterior_neff"] == pytest.approx((1 / (posterior**2).sum(-1)).mean(), rel=1e-12)
    assert row["position_neff"] == 3.5 and row["bandwidth"] == h
    fitted = optimize.minimize_scalar(_kl_objective, bounds=(-5, 12), args=(pooled, distance), method="bounded",
                                      options={"xatol": 1e-10})  # fmt: skip
    if math.isfinite(row["fitted_bandwidth"]):
        assert row["fitted_bandwidth"] == pytest.approx(math.exp(fitted.x), rel=1e-4)  # as in the test above
        assert row["fitted_ratio"] == pytest.approx(row["fitted_bandwidth"] / h, rel=1e-12)
    else:
        assert fitted.x > 11  # scipy runs to the upper bound: uniform is closest
    h_star = row["fitted_bandwidth"]
    assert row["fitted_beta"] == (0.0 if math.isinf(h_star) else pytest.approx(1 / (2 * h_star**2), rel=1e-12))
    assert row["fitted_beta_low"] <= row["fitted_beta"] <= row["fitted_beta_high"]
    assert row["fitted_bandwidth_low"] <= h_star <= row["fitted_bandwidth_high"]
    for name in ("share_spearman", "layer_agreement", "attention_tv", "attention_neff", "posterior_neff"):
        assert row[f"{name}_low"] <= row[name] <= row[f"{name}_high"]
    assert row["verdict"] == verdict(row["attention_tv_high"], row["share_spearman_p"])


def test_summary_verdicts_on_clear_cases():
    rng = np.random.default_rng(5)
    sets, layers, refs, h = 20, 4, 4, 5.0
    distance = rng.uniform(0, 60, size=(sets, refs))
    posterior = special.softmax(-distance / (2 * h * h), axis=-1)
    tracking = np.repeat(posterior[:, None], layers, 1) * 0.9 + 0.1 / refs
    row = summarize_attribution(synthetic_frame(tracking, distance, h), permutations=999, resamples=99).iloc[0]
    assert row["verdict"] == "tracks posterior" and row["share_spearman"] > 0.9 and row["share_spearman_p"] < 0.01
    assert row["fitted_bandwidth"] > h  # 10 % of the mass spread evenly: a broader kernel than the posterior's
    pooled = 0.25 + 0.004 * rng.uniform(-1, 1, size=(sets, layers, refs))
    pooled /= pooled.sum(-1, keepdims=True)
    row = summarize_attribution(synthetic_frame(pooled, distance, h), permutations=999, resamples=99).iloc[0]
    assert row["verdict"] == "pooling" and row["attention_tv_high"] < POOLING_TV
    elsewhere = np.repeat(special.softmax(distance / (2 * h * h), axis=-1)[:, None], layers, 1)  # the far ones
    row = summarize_attribution(synthetic_frame(elsewhere, distance, h), permutations=999, resamples=99).iloc[0]
    assert row["verdict"] == "undecided" and row["share_spearman"] < 0 and math.isinf(row["fitted_bandwidth"])


def test_infinite_fitted_bandwidth_survives_a_json_record(tmp_path):
    """A JSON record turns h* = inf into null; the figure reads it back from the finite beta columns."""
    import json

    from ipa_probe._io import jsonable
    from ipa_probe.experiments import ip_adapter

    rng = np.random.default_rng(6)
    distance = rng.uniform(0, 60, size=(6, 4))
    far = np.repeat(special.softmax(distance / 50, axis=-1)[:, None], 2, 1)  # favours the far references: h* = inf
    summary = summarize_attribution(synthetic_frame(far, distance, 5.0), permutations=99, resamples=49)
    assert math.isinf(summary["fitted_bandwidth"].iloc[0])
    back = pd.DataFrame(json.loads(json.dumps(jsonable(summary.to_dict(orient="records")))))
    assert back["fitted_bandwidth"].isna().all()
    record = {"measurements": {"attribution": {"trained, 2+2 mixed refs": back.to_dict(orient="records")}}}
    rho = pd.DataFrame({"timestep": [500], "spearman": [0.8], "ci_low": [0.7], "ci_high": [0.9], "pearson": [0.8],
                        "null": [0.0]})  # fmt: skip
    record["measurements"]["trained"] = rho.to_dict(orient="records")
    (path,) = ip_adapter.redraw(record, tmp_path)
    assert path.exists() and path.stat().st_size > 10_000


# ------------------------------------------------------------------------------- verdicts per cell, and controls
def exact_rank_p(shares: np.ndarray, distance: np.ndarray) -> float:
    """One-sided p of the mean per-set Spearman by enumerating every within-set permutation (scipy ranks)."""
    observed = np.mean([stats.spearmanr(a, -d).statistic for a, d in zip(shares, distance, strict=True)])
    refs = shares.shape[-1]
    per_set = [
        [stats.spearmanr(a, -d[list(order)]).statistic for order in itertools.permutations(range(refs))]
        for a, d in zip(shares, distance, strict=True)
    ]
    means = np.array([np.mean(combo) for combo in itertools.product(*per_set)])
    return float((means >= observed - 1e-12).mean())


def test_cell_verdicts_against_scipy_and_exact_enumeration():
    rng = np.random.default_rng(11)
    sets, cells, refs = 4, 6, 3
    distance = rng.uniform(0, 30, size=(sets, refs))
    shares = rng.dirichlet(np.full(refs, 2.0), size=(sets, cells))
    shares[:, 0] = special.softmax(-distance / 10, -1) * 0.5 + 0.5 / refs  # a cell that ranks as the posterior
    table = cell_verdicts(shares, distance, permutations=4999, resamples=999, seed=3)
    assert list(table["cell"]) == list(range(cells))
    for c in range(cells):
        row = table.iloc[c]
        tv = 0.5 * np.abs(shares[:, c] - 1 / refs).sum(-1)
        assert row["attention_tv"] == pytest.approx(tv.mean(), rel=1e-12)
        rho = [stats.spearmanr(a, -d).statistic for a, d in zip(shares[:, c], distance, strict=True)]
        assert row["share_spearman"] == pytest.approx(np.mean(rho), abs=1e-12)
        # 0.03: 4999 random permutations estimate a p-value with standard error <= 0.007
        assert row["share_spearman_p"] == pytest.approx(exact_rank_p(shares[:, c], distance), abs=0.03)
        # 4 sets, under MIN_SETS: no interval (the bootstrap-t covers less there), so no verdict but undecided
        assert np.isnan(row[["attention_tv_low", "attention_tv_high", "share_spearman_low"]].to_numpy(float)).all()
        assert row["verdict"] == verdict(row["attention_tv_high"], row["share_spearman_p"])
    assert table.iloc[0]["share_spearman"] == pytest.approx(1.0, abs=1e-12)
    assert table.iloc[0]["share_spearman_p"] == pytest.approx(1 / 6**sets, abs=0.002)  # 0.002: as above
    assert (table["verdict"] == "undecided").all()


def bootstrap_t(values: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The test's own bootstrap-t over the resampled sets ``index`` ``(B, S)`` of ``values`` ``(S, C)``, one resample
    at a time: the mean, its standard error ``sd / sqrt(S)`` and each resample's ``(mean* - mean) / se*`` ``(B, C)``
    (``se*`` the resample's own; the column's where the resample has no spread)."""
    mean, se = values.mean(0), values.std(0, ddof=1) / np.sqrt(len(values))
    t = []
    for draw in index:
        x = values[draw]
        own = x.std(0, ddof=1) / np.sqrt(len(x))
        t.append((x.mean(0) - mean) / np.where(own > 1e-9 * se, own, se))
    return mean, se, np.nan_to_num(np.array(t))


def test_cell_intervals_against_the_tests_own_bootstrap_t():
    rng = np.random.default_rng(12)
    sets, cells, refs = 15, 3, 4
    shares = rng.dirichlet(np.full(refs, 4.0), size=(sets, cells))
    distance = rng.uniform(0, 30, size=(sets, refs))
    table = cell_verdicts(shares, distance, permutations=99, resamples=4999, seed=0)
    index = np.random.default_rng(0).integers(0, sets, (4999, sets))  # the library's draws
    tv = 0.5 * np.abs(shares - 1 / refs).sum(-1)  # (S, C)
    mean, se, t = bootstrap_t(tv, index)
    high, low = np.quantile(t, [0.025, 0.975], axis=0)
    np.testing.assert_allclose(table["attention_tv_low"], mean - low * se, rtol=1e-9)
    np.testing.assert_allclose(table["attention_tv_high"], mean - high * se, rtol=1e-9)


def test_verdict_shares_on_clear_cells():
    rng = np.random.default_rng(13)
    sets, refs, h = 20, 4, 5.0
    distance = rng.uniform(0, 60, size=(sets, refs))
    posterior = special.softmax(-distance / (2 * h * h), axis=-1)
    pooled = 0.25 + 0.004 * rng.uniform(-1, 1, size=(sets, 5, refs))
    pooled /= pooled.sum(-1, keepdims=True)
    tracking = np.repeat(posterior[:, None], 3, 1) * 0.9 + 0.1 / refs
    elsewhere = np.repeat(special.softmax(distance / (2 * h * h), axis=-1)[:, None], 2, 1)
    shares = np.concatenate([pooled, tracking, elsewhere], 1)  # 5 pooling, 3 tracking, 2 undecided cells
    result = verdict_shares(shares, distance, permutations=999, resamples=999, outer=200)
    assert result["cells"] == 10
    assert (result["pooling"], result["tracks_posterior"], result["undecided"]) == (0.5, 0.3, 0.2)
    for key in ("pooling", "tracks_posterior", "undecided"):
        assert result[f"{key}_low"] <= result[key] <= result[f"{key}_high"]
    # per timestep from the tables: one cell per layer (frame) or per row of a cells table
    frame = synthetic_frame(shares, distance, h)
    layers = summarize_cells(frame, outer=0).iloc[0]
    assert (layers["cells"], layers["pooling"], layers["tracks_posterior"]) == (10, 0.5, 0.3)
    cells = frame.rename(columns={"layer": "cell"}).assign(layer="l")[["set", "step", "timestep", "layer", "cell",
                                                                         "reference", "attention_share"]]  # fmt: skip
    assert summarize_cells(frame, cells, outer=0).iloc[0]["undecided"] == 0.2


def test_verdict_share_bounds_against_a_direct_loop():
    """The bounds certify the true shares from a max-|t| simultaneous band over every cell's mean TV and mean
    Spearman: recomputed here by indexing the resampled sets directly (scipy ranks, float64), with the library's
    resample draws, and each cell's possible verdicts counted by the test's own rule."""
    rng = np.random.default_rng(15)
    sets, cells, refs = 12, 8, 4
    distance = rng.uniform(0, 30, size=(sets, refs))
    shares = rng.dirichlet(np.full(refs, 40.0), size=(sets, cells))
    shares[:, :3] = 0.6 * shares[:, :3] + 0.4 * special.softmax(-distance / 5, -1)[:, None]  # lean to the posterior
    outer = 300
    got = verdict_shares(shares, distance, permutations=999, resamples=999, outer=outer, seed=2)
    table = cell_verdicts(shares, distance, permutations=999, resamples=999, seed=2)
    assert got["pooling"] == np.mean(table["verdict"] == "pooling")
    index = np.random.default_rng(3).integers(0, sets, (outer, sets))  # the library's draws: seed + 1
    tv = 0.5 * np.abs(shares - 1 / refs).sum(-1)  # (S, C)
    rho = np.array(
        [[stats.spearmanr(shares[s, c], -distance[s]).statistic for c in range(cells)] for s in range(sets)]
    )
    mean, se, t = bootstrap_t(np.concatenate([tv, rho], 1), index)  # (S, 2C)
    q = np.quantile(np.abs(t).max(1), 0.95)
    low, high = mean - q * se, mean + q * se
    maybe = {
        "pooling": low[:cells] < POOLING_TV,
        "tracks_posterior": (high[:cells] >= POOLING_TV) & (high[cells:] > 0),
        "undecided": (high[:cells] >= POOLING_TV) & (low[cells:] <= 0),
    }
    for key, possible in maybe.items():
        only = possible & ~np.logical_or.reduce([v for k, v in maybe.items() if k != key])
        assert got[f"{key}_low"] == pytest.approx(only.mean()) and got[f"{key}_high"] == pytest.approx(possible.mean())
    # the critical value is the permutation test's: p < 0.05 exactly where the mean Spearman exceeds it
    assert ((table["share_spearman_p"] < 0.05) == (table["share_spearman"] > table["share_spearman_critical"])).all()


def independent_verdict(shares: np.ndarray, distance: np.ndarray) -> str | None:
    """The rule decided where the data leave no doubt, else None: pooling when the mean TV plus the largest
    studentised deviation of any resample of the sets (every one enumerated) times its standard error is below the
    threshold (every bootstrap-t upper end is then below it) and not pooling when the mean is above it;
    tracks posterior when the exact p is below 0.04 and every set's Spearman is above 0, not when p > 0.07 or no set's
    Spearman is above 0; undecided under ``MIN_SETS`` sets, where no interval is given (it would cover less)."""
    if len(shares) < MIN_SETS:
        return "undecided"
    tv = 0.5 * np.abs(shares - 1 / shares.shape[-1]).sum(-1)
    mean, se, t = bootstrap_t(tv[:, None], np.array(list(itertools.product(range(len(tv)), repeat=len(tv)))))
    if mean[0] + np.abs(t).max() * se[0] < POOLING_TV:
        return "pooling"
    if tv.mean() <= POOLING_TV:
        return None
    rho = np.array([stats.spearmanr(a, -d).statistic for a, d in zip(shares, distance, strict=True)])
    p = exact_rank_p(shares, distance)
    if p < 0.04 and rho.min() > 0:
        return "tracks posterior"
    if p > 0.07 or rho.max() <= 0:
        return "undecided"
    return None


def test_per_head_and_per_position_verdict_shares_from_the_tests_own_hooks(organism):
    """Three sets on the organism: the per-head and per-position shares read by the test's own hooks, the rule
    decided independently where it is unambiguous, against verdict_shares on the library's tables."""
    sets = [
        digits_reference_images(a, 2, seed=100 + i) + digits_reference_images(b, 2, seed=200 + i)
        for i, (a, b) in enumerate([(2, 6), (1, 7), (3, 5)])
    ]
    results = [attribution(organism, refs, seed=i, whole=True) for i, refs in enumerate(sets)]
    owns = [own_recomputation(organism, refs, seed=i) for i, refs in enumerate(sets)]
    for timestep in sorted(results[0].table["timestep"].unique()):
        step = int(results[0].table.loc[results[0].table["timestep"] == timestep, "step"].iloc[0])
        layers = sorted({layer for (s, layer) in owns[0].attrs["per_head"] if s == step})
        distance = np.stack(
            [o[(o["step"] == step) & (o["layer"] == layers[0])].sort_values("reference")["sq_distance"] for o in owns]
        )  # (S, R)
        for name, axis in (("heads", 1), ("positions", 0)):
            own = np.stack(
                [np.concatenate([o.attrs["per_head"][(step, layer)].mean(axis) for layer in layers]) for o in owns]
            )  # (S, C, R): per head (mean over positions) or per position (mean over heads), layers in sorted order
            library, keys = cell_shares(sets_table([getattr(r, name) for r in results]), timestep)
            assert [k[0] for k in keys] == sorted(k[0] for k in keys)
            np.testing.assert_allclose(library, own, atol=2e-6)  # 2e-6: float32 softmax, as above
            got = cell_verdicts(library, distance, permutations=4999, resamples=999)["verdict"].to_numpy()
            expected = [independent_verdict(own[:, c], distance) for c in range(own.shape[1])]
            decided = [c for c, v in enumerate(expected) if v is not None]
            assert len(decided) >= own.shape[1] // 2, "most cells must be decidable without resampling"
            assert [got[c] for c in decided] == [expected[c] for c in decided]
            result = verdict_shares(library, distance, permutations=4999, resamples=999, outer=0)
            assert result["pooling"] == pytest.approx(np.mean(got == "pooling"))


def test_control_difference_rule():
    rng = np.random.default_rng(14)
    values, control = rng.normal(1.0, 0.3, 30), rng.normal(0.0, 0.3, 30)
    paired = control_difference(values, values - 0.5 + rng.normal(0, 0.01, 30), paired=True)
    assert paired["counts"] and paired["low"] > 0 and paired["difference"] == pytest.approx(0.5, abs=0.01)
    diff = values - (values - 0.5 + rng.normal(0, 0.01, 30))
    independent = stats.bootstrap((diff,), np.mean, n_resamples=9999, method="BCa", rng=np.random.default_rng(0))
    # 2e-3: two BCa estimates from different resamples of the same 30 differences (spread 0.01)
    assert paired["low"] == pytest.approx(independent.confidence_interval.low, abs=2e-3)
    same = control_difference(values, values + rng.normal(0, 0.3, 30), paired=True)
    assert not same["counts"] and same["low"] < 0 < same["high"]
    apart = control_difference(values, control, paired=False)
    assert apart["counts"] and apart["difference"] == pytest.approx(values.mean() - control.mean(), rel=1e-12)
    draws = np.random.default_rng(5)
    boot = [draws.choice(values, 30).mean() - draws.choice(control, 30).mean() for _ in range(20000)]
    low, high = np.quantile(boot, [0.025, 0.975])
    # 0.02: two percentile estimates (9999 and 20000 resamples) of the same interval, width ~0.3
    assert apart["low"] == pytest.approx(low, abs=0.02) and apart["high"] == pytest.approx(high, abs=0.02)
    assert not control_difference(values, values[::-1] + 0.01, paired=False)["counts"]
    with pytest.raises(ValueError, match="paired control"):
        control_difference(values, control[:5], paired=True)


def test_intervals_stay_inside_the_statistics_range():
    # n_eff of 4 references, mostly 1 and one set near 4: the bootstrap-t's upper end runs past 30 uncut
    neff = np.array([1.0, 1.0, 1.01, 1.02, 1.0, 1.03, 1.0, 1.01, 1.02, 3.9])
    wide = control_difference(neff, np.ones(10), paired=True)
    cut = control_difference(neff, np.ones(10), paired=True, bounds=(1.0, 4.0))
    assert wide["high"] > 30 and (cut["low"], cut["high"]) == (wide["low"], 3.0)  # a difference: within +-(4 - 1)
    assert cut["counts"] == wide["counts"]  # the range holds 0: no decision moves
    welch = control_difference(np.r_[neff, neff], np.full(20, 3.5), paired=False, bounds=(1.0, 4.0))
    assert -3.0 <= welch["low"] <= welch["high"] <= 3.0
    # per timestep: every interval within the range written out here, and n_eff's cut where it would leave it
    rng = np.random.default_rng(3)
    sets, layers, refs = 10, 3, 4
    far = np.c_[np.zeros(sets), rng.uniform(8, 12, sets), np.full(sets, 60.0), np.full(sets, 80.0)]  # n_eff ~1.01
    distance = np.where(np.arange(sets)[:, None] == 9, [0.0, 0.1, 0.2, 0.3], far)
    shares = rng.dirichlet(np.ones(refs) * 50, size=(sets, layers))
    row = summarize_attribution(synthetic_frame(shares, distance, h=1.0), permutations=99, resamples=99).iloc[0]
    ranges = {"share_spearman": (-1, 1), "layer_agreement": (-1, 1), "tv_attention_posterior": (0, 1),
              "attention_tv": (0, 1 - 1 / refs), "attention_neff": (1, refs), "posterior_neff": (1, refs)}  # fmt: skip
    for name, (low, high) in ranges.items():
        assert low <= row[f"{name}_low"] <= row[name] <= row[f"{name}_high"] <= high, name
    assert row["posterior_neff_high"] == refs  # cut: one set of ten near 4, the rest near 1
    cells = cell_verdicts(shares, distance, permutations=99, resamples=999)
    assert (cells["attention_tv_low"] >= 0).all() and (cells["attention_tv_high"] <= 1 - 1 / refs).all()
    assert (cells["share_spearman_low"] >= -1).all() and (cells["share_spearman_high"] <= 1).all()
