"""Flux and SD3: the probe's tap points and CFG layouts, parity, tiny pipelines (the NW head: test_nwhead)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import (
    FluxIPAdapterAttnProcessor,
)
from helpers import CountScalarReads, near_ties
from helpers import generate_dit as generate
from scipy import stats as sps

from ipa_probe.capture.run import probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.nwhead import apply_nw_head
from ipa_probe.statistics.schema import GAUGE_COLUMNS, NULL_COLUMNS
from ipa_probe.tiny.dit import (
    FLUX_IP_TOKENS,
    SD3_IP_TOKENS,
    tiny_flux_components,
    tiny_flux_pipeline,
    tiny_sd3_components,
    tiny_sd3_pipeline,
    tiny_t5_tokenizer,
)

STEPS = 2


def _denoiser(pipe):
    return pipe.transformer


def _hooks(module):
    return [(m._forward_hooks.copy(), m._forward_pre_hooks.copy()) for m in module.modules()]


@contextlib.contextmanager
def capturing(modules: dict):
    """Forward hooks of our own that keep the first output of each named module."""
    seen, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: seen.setdefault(n, o)))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- parity and CFG layouts


@pytest.mark.parametrize(
    "family, adapters, cfg",
    [("flux", 1, False), ("flux", 2, True), ("sd3", 1, False), ("sd3", 1, True)],
)
def test_probe_output_is_bit_identical(refs, family, adapters, cfg):
    pipe = tiny_flux_pipeline(num_adapters=adapters) if family == "flux" else tiny_sd3_pipeline()
    plain = generate(pipe, refs, adapters, cfg)
    with probe(pipe) as run:
        probed = generate(pipe, refs, adapters, cfg)
    assert torch.equal(plain, probed)
    df = run.to_dataframe()
    assert set(df["branch"]) == ({"cond", "uncond"} if cfg else {"cond"})
    assert set(df["adapter"]) == set(range(adapters))
    assert df["step"].nunique() == STEPS and df["spearman"].notna().all()
    assert set(df["layer"]) == {"transformer_blocks.0.attn", "transformer_blocks.1.attn"}
    np.testing.assert_allclose(df.groupby("step")["timestep"].first(), pipe.scheduler.timesteps.numpy(), rtol=1e-6)
    if family == "flux":
        assert df["ip_mass"].isna().all()  # Flux's image branch is a softmax of its own
    else:
        assert df["ip_mass"].between(0, 1, inclusive="neither").all()
    assert _hooks(_denoiser(pipe)) == [({}, {})] * len(list(_denoiser(pipe).modules()))


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_cfg_branches_are_labelled_by_what_they_condition_on(refs, family):
    """At step 0 both runs see the same noise: the cond rows of a CFG run equal those of a run without CFG."""
    pipe = tiny_flux_pipeline() if family == "flux" else tiny_sd3_pipeline()
    tables = {}
    for cfg in (False, True):
        with probe(pipe, steps=[0]) as run:
            generate(pipe, refs, cfg=cfg)
        tables[cfg] = run.to_dataframe()
    cols = ["spearman", "pearson", "kl", "q_norm", "k_norm_spread"]
    cond = tables[True][tables[True]["branch"] == "cond"]
    np.testing.assert_allclose(cond[cols].to_numpy(), tables[False][cols].to_numpy(), rtol=1e-4, atol=1e-5)
    uncond = tables[True][tables[True]["branch"] == "uncond"]
    assert len(uncond) == len(cond) and not np.allclose(uncond["pearson"], cond["pearson"], atol=1e-4)


def test_sd3_skip_layer_guidance_pass_is_not_recorded(refs, sd3):
    slg = {"skip_guidance_layers": [1], "skip_layer_guidance_start": 0.0, "skip_layer_guidance_stop": 1.0}
    with probe(sd3) as plain_run:
        generate(sd3, refs, cfg=True)
    plain = generate(sd3, refs, cfg=True, **slg)
    with probe(sd3) as run:
        probed = generate(sd3, refs, cfg=True, **slg)
    assert torch.equal(plain, probed)
    df, ref = run.to_dataframe(), plain_run.to_dataframe()
    assert df["step"].nunique() == STEPS
    # step 1's extra (skip-layer) pass changes what comes after it only: the recorded passes are the same
    numeric = df.select_dtypes("number").columns
    np.testing.assert_allclose(df[numeric].to_numpy(), ref[numeric].to_numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("maps", [False, True])
def test_no_host_synchronisation_added(refs, flux, sd3, family, maps):
    pipe = flux if family == "flux" else sd3
    generate(pipe, refs, cfg=True)  # warm-up
    with CountScalarReads() as plain:
        generate(pipe, refs, cfg=True)
    with probe(pipe, bandwidth=lambda t: 1.0 + t / 1000, maps=maps) as run:
        with CountScalarReads() as probed:
            generate(pipe, refs, cfg=True)
    assert probed.count == plain.count
    assert run.to_dataframe()[list(GAUGE_COLUMNS + NULL_COLUMNS)].notna().any().all()  # computed in the counted call


def _same_numbers(a, b):
    numeric = a.select_dtypes("number").columns
    np.testing.assert_allclose(a[numeric].to_numpy(), b[numeric].to_numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_cpu_offload_and_low_precision(refs, flux, sd3, family):
    """Under accelerate's offload hooks the step clock and taps see the same calls; bf16 keeps parity."""
    make, reference = (tiny_flux_pipeline, flux) if family == "flux" else (tiny_sd3_pipeline, sd3)
    with probe(reference) as run:
        expected = generate(reference, refs, cfg=True)
    offloaded = make()
    offloaded.enable_model_cpu_offload(device="cpu")
    with probe(offloaded) as offloaded_run:
        assert torch.equal(generate(offloaded, refs, cfg=True), expected)
    _same_numbers(offloaded_run.to_dataframe(), run.to_dataframe())
    low = make(dtype=torch.bfloat16)
    plain = generate(low, refs, cfg=True)
    with probe(low) as low_run:
        assert torch.equal(generate(low, refs, cfg=True), plain)
    df = low_run.to_dataframe()
    assert len(df) == len(run.to_dataframe()) and df["spearman"].notna().all() and (df["nonfinite"] == 0).all()


@pytest.mark.slow
def test_torch_compile_flux_transformer(refs, flux, fresh_dynamo):
    with probe(flux) as run:
        expected = generate(flux, refs, cfg=True)
    pipe = tiny_flux_pipeline()
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    with probe(pipe) as compiled_run:
        assert torch.equal(generate(pipe, refs, cfg=True), expected)
    _same_numbers(compiled_run.to_dataframe(), run.to_dataframe())


# --------------------------------------------------------------------------- the tap points


def test_flux_tap_reads_the_query_before_rope_that_the_image_branch_uses(refs, flux):
    """Rebuild the processor's image-branch output from the tapped q (norm_q, pre-RoPE) and k_ip, v_ip; then
    recompute the probe's statistics with scipy."""
    layer = find_ip_layers(flux, r"blocks\.1\.")[0]
    attn, proc = layer.attention, layer.processor
    modules = {"q": attn.norm_q, "k": proc.to_k_ip[0], "v": proc.to_v_ip[0], "out": attn}
    with capturing(modules) as seen, probe(flux, layers=layer.name, steps=[0]) as run:
        generate(flux, refs)
    batch, heads = seen["q"].shape[0], attn.heads
    q = seen["q"].transpose(1, 2).double()  # (B, N, H, D) -> (B, H, N, D)
    d = q.shape[-1]
    k = seen["k"].reshape(batch, -1, heads, d).transpose(1, 2).double()  # (B, H, images * 4, D)
    v = seen["v"].reshape(batch, -1, heads, d).transpose(1, 2).double()
    assert k.shape[2] == len(refs) * FLUX_IP_TOKENS
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    rebuilt = proc.scale[0] * (a @ v).transpose(1, 2).reshape(batch, -1, heads * d)
    torch.testing.assert_close(rebuilt, seen["out"][2].double(), rtol=1e-5, atol=1e-6)
    w = torch.softmax(-(torch.cdist(q, k) ** 2) / (2 * math.sqrt(d)), -1)
    tied = near_ties(q @ k.transpose(-1, -2) / math.sqrt(d), k)[0].double().mean(-1)  # (B, H) rows float32 may swap
    df = run.to_dataframe()
    for head in range(heads):
        row = df[df["head"] == head].iloc[0]
        rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(a[0, head], w[0, head], strict=True)])
        # 1e-4: float32 against float64; a near-tied row may also swap two ranks (rho of a row lies in [-1, 1])
        assert row["spearman"] == pytest.approx(rho, abs=1e-4 + 2 * tied[0, head].item())
        assert row["pearson"] == pytest.approx(sps.pearsonr(a[0, head].ravel(), w[0, head].ravel()).statistic, 1e-4)
        norms = k[0, head].norm(dim=-1)
        assert row["k_norm_spread"] == pytest.approx((norms.std(correction=0) / norms.mean()).item(), rel=1e-4)


def test_sd3_tap_reports_the_joint_softmax_restricted_to_image_tokens(refs, sd3):
    layer = find_ip_layers(sd3, r"blocks\.0\.")[0]
    proc = layer.processor
    modules = {"q": proc.norm_q, "k_lat": proc.norm_k, "k_ip": proc.norm_ip_k}
    with capturing(modules) as seen, probe(sd3, layers=layer.name, steps=[0]) as run:
        generate(sd3, refs)
    q, k_lat, k_ip = (seen[n].double()[0] for n in ("q", "k_lat", "k_ip"))  # (H, N, D)
    d = q.shape[-1]
    assert k_ip.shape[1] == SD3_IP_TOKENS and k_lat.shape[1] == q.shape[1]
    joint = torch.softmax(q @ torch.cat([k_lat, k_ip], 1).transpose(-1, -2) / math.sqrt(d), -1)
    on_images = joint[..., k_lat.shape[1] :]
    restricted = on_images / on_images.sum(-1, keepdim=True)
    w = torch.softmax(-(torch.cdist(q, k_ip) ** 2) / (2 * math.sqrt(d)), -1)
    tied = near_ties(q @ k_ip.transpose(-1, -2) / math.sqrt(d), k_ip)[0].double().mean(-1)  # (H,) rows may swap
    df = run.to_dataframe()
    for head in range(layer.heads):
        row = df[df["head"] == head].iloc[0]
        a = restricted[head]
        rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(a, w[head], strict=True)])
        # 1e-4: float32 against float64; a near-tied row may also swap two ranks (rho of a row lies in [-1, 1])
        assert row["spearman"] == pytest.approx(rho, abs=1e-4 + 2 * tied[head].item())
        assert row["kl"] == pytest.approx((a * (a.log() - w[head].log())).sum(-1).mean().item(), rel=1e-3)
        assert row["ip_mass"] == pytest.approx(on_images[head].sum(-1).mean().item(), rel=1e-5)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_keep_maps_and_their_budget(refs, flux, sd3, family):
    pipe = flux if family == "flux" else sd3
    with probe(pipe, keep_maps=True, steps=[0], layers=r"blocks\.0\.") as run:
        generate(pipe, refs, cfg=True)
    if family == "flux":
        # one map per pass: cond (two reference images), then uncond (Flux's default negative: one blank image)
        shapes = [(1, 2, 64, len(refs) * FLUX_IP_TOKENS), (1, 2, 64, FLUX_IP_TOKENS)]
    else:
        shapes = [(2, 2, 64, SD3_IP_TOKENS)]  # (B, H, latent tokens, image tokens), [uncond, cond] in one batch
    assert len(run.maps) == 1  # (call, step, layer, adapter)
    (maps,) = run.maps.values()
    assert [tuple(w.shape) for w in maps] == shapes
    for weights in maps:
        assert weights.dtype == torch.float16
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(weights.shape[:3]), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="max_map_bytes"):
        with probe(pipe, keep_maps=True, max_map_bytes=1000):
            generate(pipe, refs)


def test_flux_callable_bandwidth_sees_the_0_to_1000_timestep(refs, flux):
    with probe(flux, bandwidth=lambda t: 0.5 + t / 500) as run:
        generate(flux, refs)
    df = run.to_dataframe()
    assert df["timestep"].max() == pytest.approx(1000.0)
    np.testing.assert_allclose(df["bandwidth"], 0.5 + df["timestep"] / 500, rtol=1e-6)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_pipeline_without_ip_adapter_raises_naming_the_remedy(family):
    if family == "flux":
        pipe = FluxPipeline(**tiny_flux_components())
    else:
        pipe = StableDiffusion3Pipeline(**tiny_sd3_components())
    processors = dict(pipe.transformer.attn_processors)
    for apply in (lambda: probe(pipe).__enter__(), lambda: apply_nw_head(pipe)):
        with pytest.raises(ValueError, match=r"load_ip_adapter"):
            apply()
    assert all(pipe.transformer.attn_processors[k] is v for k, v in processors.items())
    assert "_ipa_probe" not in pipe.transformer.__dict__
    assert _hooks(pipe.transformer) == [({}, {})] * len(list(pipe.transformer.modules()))


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("branch", ["text", "both"])
def test_text_branch_is_refused_before_anything_changes(flux, sd3, family, branch):
    pipe = flux if family == "flux" else sd3
    with pytest.raises(ValueError, match="joint self-attention"):
        with probe(pipe, branch=branch):
            pass
    assert "_ipa_probe" not in pipe.transformer.__dict__


# --------------------------------------------------------------------------- tiny pipelines


def test_t5_tokenizer_is_offline_deterministic_and_covers_ascii():
    tok = tiny_t5_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a photo of a Cat, 42!").input_ids
    assert tok.convert_ids_to_tokens(ids)[:3] == ["▁a", "▁photo", "▁of"] and ids[-1] == 1
    assert tok.unk_token_id not in tok("Any ASCII text: ~{}[]|\\ 0123").input_ids
    assert tiny_t5_tokenizer()("a photo of a Cat, 42!").input_ids == ids


def test_tiny_dit_pipelines_are_seeded_and_leave_the_callers_rng_alone(flux, sd3):
    state = torch.random.get_rng_state()
    again = tiny_flux_pipeline()
    assert torch.equal(torch.random.get_rng_state(), state)
    for a, b in zip(flux.transformer.state_dict().values(), again.transformer.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert isinstance(find_ip_layers(flux)[0].processor, FluxIPAdapterAttnProcessor)
    assert all(isinstance(layer.processor, SD3IPAdapterJointAttnProcessor2_0) for layer in find_ip_layers(sd3))
    assert find_ip_layers(sd3)[0].processor.to_k_ip.bias is None  # SD3 image keys: no bias, RMS-normalised
    assert find_ip_layers(flux)[0].processor.to_k_ip[0].bias is not None  # Flux image keys: bias, no norm


# --------------------------------------------------------------------------- reference maps


@pytest.mark.parametrize("family, size", [("flux", (64, 64)), ("flux", (64, 96)), ("sd3", (64, 64))])
def test_reference_maps_equal_own_recomputation(refs, flux, sd3, family, size):
    """maps=True on the DiT families: one layer at step 0 against float64 shares rebuilt from our own hooks (Flux:
    its image branch's own softmax on the pre-RoPE query, two reference images, on a non-square grid too; SD3: the
    joint softmax restricted to the image tokens)."""
    pipe = flux if family == "flux" else sd3
    layer = find_ip_layers(pipe, r"blocks\.1\.")[0]
    attn, proc = layer.attention, layer.processor
    if family == "flux":
        modules, references, tokens = {"q": attn.norm_q, "k": proc.to_k_ip[0]}, len(refs), FLUX_IP_TOKENS
    else:
        modules, references, tokens = {"q": proc.norm_q, "k": proc.norm_k, "k_ip": proc.norm_ip_k}, 1, SD3_IP_TOKENS
    with capturing(modules) as seen, probe(pipe, layers=layer.name, steps=[0], maps=True) as run:
        generate(pipe, refs, height=size[0], width=size[1])
    if family == "flux":
        q = seen["q"].transpose(1, 2).double()[0]  # (H, N, D)
        d = q.shape[-1]
        k = seen["k"].reshape(1, -1, attn.heads, d).transpose(1, 2).double()[0]  # (H, R * T, D)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    else:
        q, k_lat, k = (seen[n].double()[0] for n in ("q", "k", "k_ip"))  # (H, N, D)
        d = q.shape[-1]
        joint = torch.softmax(q @ torch.cat([k_lat, k], 1).transpose(-1, -2) / math.sqrt(d), -1)
        on_images = joint[..., k_lat.shape[1] :]
        attention = on_images / on_images.sum(-1, keepdim=True)
    nw = torch.softmax(-(torch.cdist(q, k) ** 2) / (2 * math.sqrt(d)), -1)
    # one query per latent token, row-major: Flux packs 2 x 2 latent pixels into a token, SD3 patches them
    factor = pipe.vae_scale_factor * (2 if family == "flux" else pipe.transformer.config.patch_size)
    grid = (size[0] // factor, size[1] // factor)
    assert grid[0] * grid[1] == q.shape[1]
    for kind, weights in (("attention", attention), ("nw", nw)):
        want = weights.mean(0).reshape(*grid, references, tokens).permute(2, 3, 0, 1)  # (R, T, h, w)
        got = run.token_maps(0, 0, 0, kind, "cond", [layer.name], [0], grid)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
        by_reference = run.reference_maps(0, 0, 0, kind, "cond", [layer.name], [0], grid)
        torch.testing.assert_close(by_reference.double(), want.sum(1), atol=2e-6, rtol=0)
    assert run.reference_maps(0, 0, 0, size="image").shape == (references, *size)  # the default size too
