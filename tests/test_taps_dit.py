"""Flux and SD3: the probe's tap points and CFG layouts, parity, the NW head and its lifecycle, tiny pipelines."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0, SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxIPAdapterAttnProcessor,
)
from helpers import CountScalarReads
from scipy import stats as sps

from ipa_probe.capture.run import probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.nwhead.dit import FluxNWHeadAttnProcessor, SD3NWHeadAttnProcessor
from ipa_probe.nwhead.unet import apply_nw_head, nw_head, remove_nw_head
from ipa_probe.tiny.dit import (
    FLUX_IP_TOKENS,
    SD3_IP_TOKENS,
    tiny_flux_components,
    tiny_flux_pipeline,
    tiny_sd3_components,
    tiny_sd3_pipeline,
    tiny_t5_tokenizer,
)

PROMPT = "a photo of a flower"
STEPS = 2


@pytest.fixture(scope="module")
def flux():
    return tiny_flux_pipeline()


@pytest.fixture(scope="module")
def sd3():
    return tiny_sd3_pipeline()


def generate(pipe, refs, adapters=1, cfg=False, **kwargs):
    """2 steps, latents out. Flux: one entry of ``refs`` per adapter, true CFG on request; SD3: one image."""
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "latent")
    kwargs.setdefault("max_sequence_length", 16)
    kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    if isinstance(pipe, FluxPipeline):
        if cfg:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=4.0)
        return pipe(PROMPT, ip_adapter_image=[refs] * adapters, **kwargs).images
    kwargs.setdefault("guidance_scale", 5.0 if cfg else 1.0)
    return pipe(PROMPT, ip_adapter_image=refs[0], **kwargs).images


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
def test_no_host_synchronisation_added(refs, flux, sd3, family):
    pipe = flux if family == "flux" else sd3
    generate(pipe, refs, cfg=True)  # warm-up
    with CountScalarReads() as plain:
        generate(pipe, refs, cfg=True)
    with probe(pipe, bandwidth=lambda t: 1.0 + t / 1000):
        with CountScalarReads() as probed:
            generate(pipe, refs, cfg=True)
    assert probed.count == plain.count


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
def test_torch_compile_flux_transformer(refs, flux):
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
    df = run.to_dataframe()
    for head in range(heads):
        row = df[df["head"] == head].iloc[0]
        rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(a[0, head], w[0, head], strict=True)])
        assert row["spearman"] == pytest.approx(rho, abs=1e-4)
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
    df = run.to_dataframe()
    for head in range(layer.heads):
        row = df[df["head"] == head].iloc[0]
        a = restricted[head]
        rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(a, w[head], strict=True)])
        assert row["spearman"] == pytest.approx(rho, abs=1e-4)
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
    assert "_ipa_probe_claims" not in pipe.transformer.__dict__
    assert _hooks(pipe.transformer) == [({}, {})] * len(list(pipe.transformer.modules()))


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("branch", ["text", "both"])
def test_text_branch_is_refused_before_anything_changes(flux, sd3, family, branch):
    pipe = flux if family == "flux" else sd3
    with pytest.raises(ValueError, match="joint self-attention"):
        with probe(pipe, branch=branch):
            pass
    assert "_ipa_probe_claims" not in pipe.transformer.__dict__


def test_nw_processors_check_what_they_wrap(flux, sd3):
    flux_proc = find_ip_layers(flux)[0].processor
    sd3_proc = find_ip_layers(sd3)[0].processor
    with pytest.raises(TypeError, match="FluxIPAdapterAttnProcessor"):
        FluxNWHeadAttnProcessor(sd3_proc)
    with pytest.raises(TypeError, match="SD3IPAdapterJointAttnProcessor2_0"):
        SD3NWHeadAttnProcessor(flux_proc)
    with pytest.raises(ValueError, match="TimestepClock"):
        FluxNWHeadAttnProcessor(flux_proc, lambda t: 1.0)
    with pytest.raises(ValueError, match="positive"):
        SD3NWHeadAttnProcessor(sd3_proc, -1.0)


# --------------------------------------------------------------------------- the NW head: kernels


def _flux_attention(seed=0):
    torch.manual_seed(seed)
    attn = FluxAttention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=32, out_dim=32, bias=True)
    original = FluxIPAdapterAttnProcessor(hidden_size=32, cross_attention_dim=24, num_tokens=(4, 4), scale=[0.8, 1.3])
    attn.set_processor(original)
    inputs = dict(
        hidden_states=torch.randn(2, 12, 32),
        encoder_hidden_states=torch.randn(2, 5, 32),
        ip_hidden_states=[torch.randn(2, 3, 4, 24), torch.randn(2, 1, 4, 24)],
    )
    return attn, original, inputs


def test_flux_nw_head_is_the_parent_with_gaussian_weights():
    attn, original, inputs = _flux_attention()
    with torch.no_grad():
        hidden, context, ip_out = attn(**inputs)
        nw = FluxNWHeadAttnProcessor(original, 0.9)
        attn.set_processor(nw)
        nw_hidden, nw_context, nw_ip = attn(**inputs)
    assert torch.equal(nw_hidden, hidden) and torch.equal(nw_context, context)  # the joint attention is the parent's
    assert (nw_ip - ip_out).abs().max() > 1e-3
    # closed form in float64: sum_a s_a softmax_i(-|q - k_a,i|^2 / (2 h^2)) v_a,i, q after norm_q and before RoPE
    a64, p64 = copy.deepcopy(attn).double(), copy.deepcopy(original).double()
    with torch.no_grad():
        q = a64.norm_q(a64.to_q(inputs["hidden_states"].double()).unflatten(-1, (2, 16))).transpose(1, 2)
        expected = torch.zeros_like(ip_out, dtype=torch.float64)
        adapters = zip(inputs["ip_hidden_states"], original.scale, p64.to_k_ip, p64.to_v_ip, strict=True)
        for states, scale, to_k, to_v in adapters:
            k = to_k(states.double()).reshape(2, -1, 2, 16).transpose(1, 2)  # (B, H, images * 4, D)
            v = to_v(states.double()).reshape(2, -1, 2, 16).transpose(1, 2)
            w = torch.softmax(-torch.cdist(q, k).square() / (2 * 0.9**2), -1)
            expected += scale * (w @ v).transpose(1, 2).reshape(2, -1, 32)
    torch.testing.assert_close(nw_ip.double(), expected, rtol=1e-5, atol=1e-6)
    # FluxAttention.forward passes the keyword arguments the processor's signature names
    assert inspect.signature(FluxNWHeadAttnProcessor.__call__).parameters.keys() == (
        inspect.signature(FluxIPAdapterAttnProcessor.__call__).parameters.keys()
    )


class _DotProductSD3Head(SD3NWHeadAttnProcessor):
    """The SD3 head's forward with diffusers' own kernel: must reproduce the original processor."""

    def image_branch_attention(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)


@pytest.mark.parametrize("last_block", [False, True])
def test_sd3_nw_head_forward_matches_diffusers_and_the_closed_form(sd3, last_block):
    layer = find_ip_layers(sd3)[-1 if last_block else 0]  # the last block has context_pre_only
    attn, original = layer.attention, layer.processor
    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 32, generator=gen),
        encoder_hidden_states=torch.randn(2, 6, 32, generator=gen),
        ip_hidden_states=torch.randn(2, SD3_IP_TOKENS, 32, generator=gen),
        temb=torch.randn(2, 64, generator=gen),
    )

    def run(processor):
        attn.set_processor(processor)
        try:
            with torch.no_grad():
                out = attn(**inputs)
        finally:
            attn.set_processor(original)
        return out if isinstance(out, tuple) else (out,)

    reference = run(original)
    assert all(torch.equal(a, b) for a, b in zip(reference, run(_DotProductSD3Head(original)), strict=True))
    nw = SD3NWHeadAttnProcessor(original, 1.7)
    swapped = run(nw)
    assert torch.equal(swapped[1], reference[1])  # the text tokens' output does not see the image branch
    assert (swapped[0] - reference[0]).abs().max() > 1e-4
    # closed form in float64: NW weights over the joint keys [latent; image], values [latent; image]
    a64, p64 = copy.deepcopy(attn).double(), copy.deepcopy(original).double()
    with torch.no_grad():
        x = inputs["hidden_states"].double()
        c = p64.norm_ip(inputs["ip_hidden_states"].double(), temb=inputs["temb"].double())

        def heads(t):
            return t.reshape(2, -1, 2, 16).transpose(1, 2)  # (B, N, H*D) -> (B, H, N, D)

        q = p64.norm_q(heads(a64.to_q(x)))
        keys = torch.cat([p64.norm_k(heads(a64.to_k(x))), p64.norm_ip_k(heads(p64.to_k_ip(c)))], 2)
        values = torch.cat([heads(a64.to_v(x)), heads(p64.to_v_ip(c))], 2)
        w = torch.softmax(-torch.cdist(q, keys).square() / (2 * 1.7**2), -1)  # (B, H, N, N + K)
        torch.testing.assert_close(torch.softmax(nw.image_branch_logits(q, keys), -1), w, rtol=1e-9, atol=1e-9)
        branch = (w @ values).transpose(1, 2).reshape(2, -1, 32)
    # the image branch enters before the (affine) output projection: swapped - (scale 0) = W_out (scale * branch)
    scale = original.scale
    try:
        original.scale = 0.0
        base = run(original)[0]
    finally:
        original.scale = scale
    expected = F.linear(scale * branch, a64.to_out[0].weight)
    torch.testing.assert_close(swapped[0].double() - base.double(), expected, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the NW head: lifecycle in pipelines


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_nw_head_swaps_restores_and_composes_with_the_probe(refs, family):
    pipe = tiny_flux_pipeline() if family == "flux" else tiny_sd3_pipeline()
    processors = dict(pipe.transformer.attn_processors)
    plain = generate(pipe, refs, cfg=True)
    with nw_head(pipe) as swap:
        assert swap.layers == [layer.name for layer in find_ip_layers(pipe)]
        with pytest.raises(RuntimeError, match="already active"):
            apply_nw_head(pipe)
        swapped = generate(pipe, refs, cfg=True)
        with probe(pipe) as run:
            probed = generate(pipe, refs, cfg=True)
    assert (swapped - plain).abs().max() > 1e-4
    assert torch.equal(probed, swapped)  # parity holds with the NW head in place
    df = run.to_dataframe()
    np.testing.assert_allclose(df["spearman"], 1.0, atol=1e-5)  # the probe reads the head's own (NW) logits
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)
    assert all(pipe.transformer.attn_processors[k] is v for k, v in processors.items())
    assert torch.equal(generate(pipe, refs, cfg=True), plain)
    assert "_ipa_probe_claims" not in pipe.transformer.__dict__
    with pytest.raises(RuntimeError, match="boom"), nw_head(pipe):
        raise RuntimeError("boom")
    assert all(pipe.transformer.attn_processors[k] is v for k, v in processors.items())


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_set_ip_adapter_scale_works_through_the_swap(refs, flux, sd3, family):
    pipe = flux if family == "flux" else sd3
    originals = [layer.processor for layer in find_ip_layers(pipe)]
    before = [p.scale for p in originals]
    try:
        pipe.set_ip_adapter_scale(0.0)
        text_only = generate(pipe, refs)
        with nw_head(pipe, bandwidth=0.4):
            assert torch.equal(generate(pipe, refs), text_only)  # scale 0: the swap changes nothing
            pipe.set_ip_adapter_scale(0.6)
            assert (generate(pipe, refs) - text_only).abs().max() > 1e-4
        assert all(p.scale in (0.6, [0.6]) for p in originals)  # the setting persists on the restored processors
        assert [layer.processor for layer in find_ip_layers(pipe)] == originals
    finally:
        for p, scale in zip(originals, before, strict=True):
            p.scale = scale


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_unload_inside_the_block_is_respected(refs, family):
    pipe = tiny_flux_pipeline() if family == "flux" else tiny_sd3_pipeline()
    with nw_head(pipe):
        pipe.unload_ip_adapter()
    default = FluxAttnProcessor if family == "flux" else JointAttnProcessor2_0
    processors = [p for name, p in pipe.transformer.attn_processors.items() if name.startswith("transformer_blocks")]
    assert all(type(p) is default for p in processors)
    with pytest.raises(ValueError, match="no NW head"):
        remove_nw_head(pipe)


def test_flux_nw_head_callable_bandwidth_gets_the_0_to_1000_timestep(refs, flux):
    seen = []

    def bandwidth(t):
        seen.append(float(t))
        return 1.0

    with nw_head(flux, bandwidth=bandwidth):
        generate(flux, refs)
    np.testing.assert_allclose(sorted(set(seen), reverse=True), flux.scheduler.timesteps.numpy(), rtol=1e-5)


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
