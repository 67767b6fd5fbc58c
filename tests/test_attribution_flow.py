"""reference_attribution and posterior_at under flow matching (issue #49), on the tiny Flux (packed latents, a
non-square image) and SD3 (CFG, its one reference) pipelines: every column against the test's own float64
recomputation. Shares, position n_eff and Flux's contributions come from the test's own forward hooks on the branch's
query, image keys and values; ``x_t`` from its own pre-hook on the transformer; the posterior is
``softmax_i(-|x_t - (1 - sigma) x_i|^2 / (2 sigma^2))`` with ``sigma`` the scheduler's at the loop index and ``x_i``
the VAE's own encoding (Flux's packed by diffusers' own ``_pack_latents``). Also: SD3's readings where an edit leaves
a query no image mass (NaN, and said so), the decoded images, and the scheduler it refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import EDMEulerScheduler, FluxPipeline

import ipa_probe
from ipa_probe.attribution import posterior_at, reference_attribution
from ipa_probe.capture.spine import spine_of
from ipa_probe.intervention import generate, intervene
from ipa_probe.tiny.sd import default_reference_images

STEPS = 3


def flux_call():
    refs = [image.resize((64, 32)) for image in default_reference_images(3)]  # the generation's size
    return dict(prompt="a", ip_adapter_image=[refs[:2]], num_inference_steps=STEPS, height=32, width=64), refs[2]


def sd3_call():
    refs = [default_reference_images(1)[0].resize((64, 64))]  # the generation's size
    return dict(prompt="a", ip_adapter_image=[refs], num_inference_steps=STEPS)


def own_passes(pipe, call):
    """Per denoiser pass: ``x`` (the transformer's ``hidden_states``) and per layer ``q`` ``(B, H, Q, D)``, ``k`` and
    ``v`` ``(B, H, K, D)`` (Flux: ``attn.norm_q``, ``to_k_ip[0]``, ``to_v_ip[0]``), float64 from the test's hooks."""
    passes, handles, heads = [], [], ipa_probe.find_ip_layers(pipe)[0].heads

    def keep(name, what):
        def hook(module, args, output):
            x = output.double()  # q (B, Q, H, D); keys and values (B, R, T, H D): the images' tokens
            x = x if what == "q" else x.flatten(1, -2).unflatten(-1, (heads, -1))  # (B, N, H, D)
            passes[-1][name, what] = x.transpose(1, 2)

        return hook

    handles.append(
        pipe.transformer.register_forward_pre_hook(
            lambda m, a, k: passes.append({"x": k["hidden_states"].double()}), with_kwargs=True
        )
    )
    for layer in ipa_probe.find_ip_layers(pipe):
        if layer.family == "flux":
            handles.append(layer.attention.norm_q.register_forward_hook(keep(layer.name, "q")))
            handles.append(layer.processor.to_k_ip[0].register_forward_hook(keep(layer.name, "k")))
            handles.append(layer.processor.to_v_ip[0].register_forward_hook(keep(layer.name, "v")))
    try:
        pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        for handle in handles:
            handle.remove()
    return passes


def own_posterior(pipe, refs, samples, height, width):
    """Per step ``(sq_distance, bandwidth, posterior)``, float64, at the loop index's sigma."""
    vae = pipe.vae
    with torch.no_grad():
        pixels = torch.cat([pipe.image_processor.preprocess(r, height=height, width=width) for r in refs])
        z = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    if isinstance(pipe, FluxPipeline):
        z = FluxPipeline._pack_latents(z, *z.shape)
    support = z.double().flatten(1)  # (R, D)
    out = {}
    for step, x in samples.items():
        sigma = float(pipe.scheduler.sigmas[step])
        logits = -((x - (1 - sigma) * support) ** 2).sum(-1) / (2 * sigma**2)
        distance = ((x / (1 - sigma) - support) ** 2).sum(-1) if sigma < 1 else torch.full_like(logits, math.inf)
        out[step] = (distance, sigma / (1 - sigma) if sigma < 1 else math.inf, logits.softmax(-1))
    return out


def assert_posterior(table, own):
    """``table``'s posterior columns (one row per step and reference) against ``own_posterior``."""
    for step, (distance, bandwidth, weight) in own.items():
        at = table[table.step == step]
        for _, part in at.groupby("layer") if "layer" in at else [(None, at)]:  # each layer's rows alike
            part = part.sort_values("reference")
            # 1e-9 relative: the same float32 x_t and latents on both sides, float64 after, in another order
            torch.testing.assert_close(torch.tensor(part.sq_distance.to_numpy()), distance, rtol=1e-9, atol=0)
            np.testing.assert_allclose(part.bandwidth, bandwidth, rtol=1e-12)
            torch.testing.assert_close(torch.tensor(part.posterior_weight.to_numpy()), weight, rtol=0, atol=1e-9)


def test_flux_attribution_against_its_own_hooks(flux):
    call, other = flux_call()
    result = reference_attribution(flux, **call)
    passes = own_passes(flux, call)
    table = result.table
    assert len(passes) == STEPS and len(table) == STEPS * 2 * 2  # no true CFG: a pass a step; 2 layers, 2 references
    assert torch.equal(result.generation.latents, generated(flux, call))  # the probe reads without changing
    samples = {step: passes[step]["x"][0].flatten() for step in range(STEPS)}
    assert all(torch.equal(result.samples[step], samples[step]) for step in range(STEPS))
    assert_posterior(table, own_posterior(flux, call["ip_adapter_image"][0], samples, 32, 64))
    steps = table.drop_duplicates("step")
    np.testing.assert_array_equal(steps.timestep, flux.scheduler.timesteps.double().numpy())  # the loop's, in order
    assert math.isinf(steps.bandwidth.iloc[0]) and (table[table.step == 0].posterior_weight == 0.5).all()
    scale = float(ipa_probe.find_ip_layers(flux)[0].processor.scale[0])
    for (step, name), part in table.groupby(["step", "layer"]):
        q, k, v = (passes[step][name, what][0] for what in ("q", "k", "v"))  # (H, Q, D), (H, K, D)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1).unflatten(-1, (2, -1))  # (H, Q, R, T)
        positions = w.sum(-1).mean(0)  # (Q, R)
        c = scale * torch.einsum("hqrt,hrtd->rqhd", w, v.unflatten(1, (2, -1))).flatten(2)  # (R, Q, H D)
        norm, total = c.norm(dim=-1), c.sum(0)  # (R, Q), (Q, H D)
        own = {
            "attention_share": positions.mean(0),
            "position_neff": (1 / (positions**2).sum(-1)).mean().expand(2),
            "contribution_norm": norm.mean(1),
            "contribution_share": (norm / norm.sum(0)).mean(1),
            "contribution_projection": (c * total / total.norm(dim=-1, keepdim=True)).sum(-1).mean(1),
        }
        part = part.sort_values("reference")
        for column, expected in own.items():  # the probe's float32 softmax and contributions: 1e-5 relative
            torch.testing.assert_close(torch.tensor(part[column].to_numpy()), expected, rtol=1e-5, atol=1e-6)
        heads = result.heads[(result.heads.step == step) & (result.heads.layer == name)].sort_values(
            ["cell", "reference"]
        )
        torch.testing.assert_close(
            torch.tensor(heads.attention_share.to_numpy()), w.sum(-1).mean(1).flatten(), rtol=0, atol=1e-6
        )
    # another reference set at the same x_t; and none once the scheduler has left that loop
    others = [other, call["ip_adapter_image"][0][0]]
    timesteps = dict(zip(steps.step, steps.timestep, strict=True))
    got = posterior_at(flux, others, result.samples, timesteps, height=32, width=64)
    assert_posterior(got, own_posterior(flux, others, samples, 32, 64))
    with (
        pytest.warns(UserWarning, match="resized to 64x64"),
        pytest.raises(ValueError, match="pass the call's height, width"),
    ):
        posterior_at(flux, others, result.samples, timesteps)  # encoded at the default 64 x 64
    flux.scheduler.set_timesteps(2, mu=1.0)
    with pytest.raises(ValueError, match="last loop had no timestep .*: call right after the generation"):
        posterior_at(flux, others, result.samples, timesteps, height=32, width=64)


def generated(pipe, call):
    return pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)).images


def test_sd3_attribution_against_its_own_formula(sd3):
    """SD3 takes one reference: its share of the renormalised image columns and its posterior are 1 wherever defined
    (the first step's posterior too: x_t is pure noise there); the distances and bandwidth are the test's own, at the
    conditional row of the CFG batch ``[uncond, cond]``; SD3 has no contribution columns (NaN)."""
    call = sd3_call()
    result = reference_attribution(sd3, **call)
    passes = own_passes(sd3, call)  # the pipeline's default guidance (7): CFG
    samples = {step: passes[step]["x"][1].flatten() for step in range(STEPS)}
    assert all(torch.equal(result.samples[step], samples[step]) for step in range(STEPS))
    table = result.table
    assert len(table) == STEPS * len(ipa_probe.find_ip_layers(sd3))
    assert_posterior(table, own_posterior(sd3, call["ip_adapter_image"][0], samples, 64, 64))
    np.testing.assert_allclose(table[["attention_share", "position_neff"]], 1.0, rtol=0, atol=1e-6)
    assert table[["contribution_norm", "contribution_share", "contribution_projection"]].isna().all().all()
    assert torch.equal(
        result.generation.latents, generated(sd3, {**call, "ip_adapter_image": call["ip_adapter_image"][0][0]})
    )


@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_sd3_readings_where_an_edit_leaves_no_image_mass(sd3, factor):
    """Scaling SD3's one reference by 0 adds log 0 to its image logits: the layer puts no weight on the image tokens
    (``ip_mass`` exactly 0: the image share ``f m / (f m + 1 - m)`` of a mass ``m`` scaled by ``f = 0``), so a query
    has no share over references: NaN in the maps, ``reference_mass``, attribution's ``attention_share``, and counted
    in ``nonfinite``; the posterior stays defined. At 0.5 every reading is finite."""
    call = sd3_call()
    with intervene(sd3, 0, mode="scale", factor=factor), ipa_probe.probe(sd3, maps=True, keep_maps=True) as run:
        result = reference_attribution(sd3, **call)
    table, mass = run.to_dataframe(), run.reference_mass()
    maps = torch.cat([torch.cat(m).double().flatten() for m in run.maps.values()])
    assert len(table) and len(mass) and len(maps)
    empty = factor == 0
    assert (table.ip_mass == 0).all() if empty else (table.ip_mass > 0).all()
    assert (table.nonfinite == float(empty)).all()
    assert maps.isnan().all() if empty else maps.isfinite().all()
    assert mass.attention.isna().all() if empty else mass.attention.notna().all()
    assert result.table.attention_share.isna().all() if empty else result.table.attention_share.notna().all()
    np.testing.assert_array_equal(result.table.posterior_weight, 1.0)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_generate_decodes_as_the_pipeline(family, request):
    """``generate``'s images equal the pipeline's own ``output_type="np"`` (Flux: unpacked at the call's height;
    both: less the VAE's shift)."""
    pipe = request.getfixturevalue(family)
    call = flux_call()[0] if family == "flux" else sd3_call()
    own = pipe(**call, output_type="np", generator=torch.Generator().manual_seed(0)).images
    got = generate(pipe, seed=0, **call)
    assert got.images.shape == own.shape
    np.testing.assert_allclose(got.images, own, rtol=0, atol=1e-6)


def test_refuses_a_scheduler_with_no_posterior(flux):
    """Neither VP nor flow matching (EDM's ``x_t = x_0 + sigma eps``): refused before anything attaches, naming both
    kinds it takes; the pipeline is left as it was."""
    scheduler, flux.scheduler = flux.scheduler, EDMEulerScheduler()
    try:
        with pytest.raises(
            TypeError, match=r"VP scheduler .*or FlowMatchEulerDiscreteScheduler, got EDMEulerScheduler"
        ):
            reference_attribution(flux, **flux_call()[0])
        with pytest.raises(TypeError, match="EDMEulerScheduler"):
            posterior_at(flux, flux_call()[0]["ip_adapter_image"][0], {}, {})
        assert ipa_probe.list_hooks(flux) == [] and spine_of(flux) is None
    finally:
        flux.scheduler = scheduler
