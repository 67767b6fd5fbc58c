"""The NW-head swap: the processors against closed forms, equality cases, lifecycle, composition with the probe.

SD 1.5 / SDXL first, then Flux and SD3.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor2_0,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    JointAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxIPAdapterAttnProcessor,
)
from helpers import PIPELINE_CASES, CountScalarReads, case_call, generate_dit

import ipa_probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.nwhead import (
    FluxNWHeadAttnProcessor,
    NWHeadAttnProcessor,
    SD3NWHeadAttnProcessor,
    TimestepClock,
    apply_nw_head,
    nw_head,
    remove_nw_head,
)
from ipa_probe.tiny.dit import SD3_IP_TOKENS, tiny_flux_pipeline, tiny_sd3_pipeline
from ipa_probe.tiny.sd import tiny_pipeline

STEPS = 2


def generate(pipe, refs, adapters=1, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "latent")
    images = [refs] * adapters
    generator = torch.Generator().manual_seed(0)
    out = pipe("a photo of a flower", ip_adapter_image=images, generator=generator, **kwargs).images
    return out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))


@contextlib.contextmanager
def equal_norm_keys(pipe, norm=3.0):
    """Make every image-token key of every head have the same norm, by a hook on the shared ``to_k_ip`` modules."""

    def hook_for(heads):
        def hook(module, args, output):
            keys = output.unflatten(-1, (heads, -1))  # (..., H*D) -> (..., H, D)
            return (norm * torch.nn.functional.normalize(keys, dim=-1)).flatten(-2)

        return hook

    handles = [
        to_k.register_forward_hook(hook_for(layer.heads))
        for layer in find_ip_layers(pipe)
        for to_k in layer.processor.to_k_ip
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- the processor on a bare Attention


def bare_attention(heads=2, dim_head=8, tokens=(4,), seed=0):
    torch.manual_seed(seed)
    attn = Attention(query_dim=32, cross_attention_dim=24, heads=heads, dim_head=dim_head)
    original = IPAdapterAttnProcessor2_0(hidden_size=heads * dim_head, cross_attention_dim=24, num_tokens=tokens)
    for linear in [*original.to_k_ip, *original.to_v_ip]:
        torch.nn.init.normal_(linear.weight, std=0.5)
    attn.set_processor(original)
    return attn, original


def test_signature_is_exactly_the_parents():
    assert inspect.signature(NWHeadAttnProcessor.__call__) == inspect.signature(IPAdapterAttnProcessor2_0.__call__)


def test_shares_weights_scale_and_tokens_without_copies():
    _, original = bare_attention(tokens=(4, 16))
    nw = NWHeadAttnProcessor(original)
    assert isinstance(nw, IPAdapterAttnProcessor2_0)
    assert nw.to_k_ip is original.to_k_ip and nw.to_v_ip is original.to_v_ip
    assert nw.scale is original.scale and nw.num_tokens is original.num_tokens
    assert {id(p) for p in nw.parameters()} == {id(p) for p in original.parameters()}
    assert not any(p.is_meta for p in nw.parameters())


@pytest.mark.parametrize("bandwidth", ["matched", 0.7, 3.0, "callable"])
@pytest.mark.parametrize("head_dim", [4, 16])
def test_image_branch_is_gaussian_nw_in_float64(bandwidth, head_dim):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, head_dim, generator=gen, dtype=torch.float64)
    k = 2 * torch.randn(2, 3, 7, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 7, 6, generator=gen, dtype=torch.float64)
    _, original = bare_attention()
    clock = TimestepClock()
    clock.timestep = torch.tensor(500.0)
    spec = (lambda t: 0.5 + t / 1000) if bandwidth == "callable" else bandwidth
    nw = NWHeadAttnProcessor(original, spec, clock)
    h = {"matched": head_dim**0.25, "callable": 1.0}.get(bandwidth, bandwidth)
    # The textbook form: w_i = exp(-|q - k_i|^2 / (2 h^2)) / sum_j exp(-|q - k_j|^2 / (2 h^2)).
    kernel = torch.exp(-torch.cdist(q, k).square() / (2 * h * h))
    expected = (kernel / kernel.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(nw.nw_attention(q, k, v), expected, rtol=1e-10, atol=1e-10)
    # The contract the probe reads: the softmax of image_branch_logits is the weighting actually applied.
    weights = torch.softmax(nw.image_branch_logits(q, k), dim=-1)
    torch.testing.assert_close(weights @ v, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spatial", [False, True])
@pytest.mark.parametrize("heads, dim_head", [(2, 8), (4, 16)])
def test_equal_norm_keys_at_matched_bandwidth_reproduce_the_learned_head(spatial, heads, dim_head):
    attn, original = bare_attention(heads, dim_head)
    x = torch.randn(2, 32, 3, 4) if spatial else torch.randn(2, 12, 32)
    context = (torch.randn(2, 7, 24), [torch.randn(2, 1, 4, 24)])
    with torch.no_grad():
        generic_learned = attn(x, encoder_hidden_states=context)
        attn.set_processor(NWHeadAttnProcessor(original))
        generic_nw = attn(x, encoder_hidden_states=context)
        assert (generic_learned - generic_nw).abs().max() > 1e-3  # unequal norms: the heads differ
        attn.set_processor(original)
        hook = original.to_k_ip[0].register_forward_hook(
            lambda m, a, out: 2.5 * torch.nn.functional.normalize(out.unflatten(-1, (heads, -1)), dim=-1).flatten(-2)
        )
        learned = attn(x, encoder_hidden_states=context)
        attn.set_processor(NWHeadAttnProcessor(original))
        swapped = attn(x, encoder_hidden_states=context)
        hook.remove()
    assert swapped.shape == x.shape
    torch.testing.assert_close(swapped, learned, rtol=1e-5, atol=1e-6)


def test_wraps_the_legacy_ip_adapter_processor_too():
    attn, modern = bare_attention()
    legacy = IPAdapterAttnProcessor(hidden_size=16, cross_attention_dim=24, num_tokens=(4,))
    legacy.load_state_dict(modern.state_dict())
    x, context = torch.randn(2, 12, 32), (torch.randn(2, 7, 24), [torch.randn(2, 1, 4, 24)])
    with torch.no_grad():
        attn.set_processor(NWHeadAttnProcessor(modern))
        expected = attn(x, encoder_hidden_states=context)
        nw = NWHeadAttnProcessor(legacy)
        attn.set_processor(nw)
        got = attn(x, encoder_hidden_states=context)
    assert nw.to_k_ip is legacy.to_k_ip and nw.scale is legacy.scale
    torch.testing.assert_close(got, expected)


def test_a_bandwidth_callable_must_return_one_value():
    _, original = bare_attention()
    clock = TimestepClock()
    clock.timestep = torch.tensor(10)
    nw = NWHeadAttnProcessor(original, lambda t: torch.ones(3), clock)
    with pytest.raises(ValueError, match="0-d"):
        nw.bandwidth_for(8)


def test_large_key_norms_stay_finite_in_low_precision():
    _, original = bare_attention()
    nw = NWHeadAttnProcessor(original, 0.5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=gen).bfloat16()
    k = (200 * torch.randn(1, 2, 6, 8, generator=gen)).bfloat16()  # |k|^2 / (2 h^2) ~ 1e6: overflows if unshifted
    v = torch.randn(1, 2, 6, 8, generator=gen).bfloat16()
    out = nw.nw_attention(q, k, v)
    assert torch.isfinite(out).all()


def test_callable_bandwidth_needs_a_clock_and_a_timestep():
    _, original = bare_attention()
    with pytest.raises(ValueError, match="TimestepClock"):
        NWHeadAttnProcessor(original, lambda t: 1.0)
    nw = NWHeadAttnProcessor(original, lambda t: 1.0, TimestepClock())
    with pytest.raises(RuntimeError, match="no timestep was seen"):
        nw.bandwidth_for(8)


@pytest.mark.parametrize(
    "bandwidth, error, match",
    [
        (0.0, ValueError, "positive"),
        (-1.0, ValueError, "positive"),
        (math.inf, ValueError, "positive"),
        ("fit", ValueError, "probe setting"),
        ("wide", ValueError, "matched"),
        (True, TypeError, "matched"),
        ([1.0], TypeError, "matched"),
    ],
)
def test_bad_bandwidth_raises_before_anything_changes(sd15, bandwidth, error, match):
    processors = dict(sd15.unet.attn_processors)
    with pytest.raises(error, match=match):
        apply_nw_head(sd15, bandwidth)
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert "_ipa_probe" not in sd15.unet.__dict__


# --------------------------------------------------------------------------- in the tiny pipelines


@pytest.mark.parametrize("kind, variant, adapters, guidance, masks", PIPELINE_CASES)
def test_equal_norm_keys_swap_equals_original_and_otherwise_differs(refs, kind, variant, adapters, guidance, masks):
    pipe, kwargs = case_call((kind, variant, adapters, guidance, masks), len(refs))
    plain = generate(pipe, refs, adapters, **kwargs)
    with nw_head(pipe):
        swapped = generate(pipe, refs, adapters, **kwargs)
    assert (plain - swapped).abs().max() > 1e-4  # generic keys: the NW head is a different head
    with equal_norm_keys(pipe):
        learned = generate(pipe, refs, adapters, **kwargs)
        with nw_head(pipe):
            nw = generate(pipe, refs, adapters, **kwargs)
    assert (learned - plain).abs().max() > 1e-4  # the hook did change the keys
    torch.testing.assert_close(nw, learned, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_adapter_scale_zero_makes_the_swap_a_no_op(refs, kind):
    pipe = tiny_pipeline(kind)
    pipe.set_ip_adapter_scale(0.0)
    plain = generate(pipe, refs)
    with nw_head(pipe, bandwidth=0.3):
        swapped = generate(pipe, refs)
    assert torch.equal(plain, swapped)


def test_restores_the_same_processor_objects_and_leaves_no_trace(sd15, refs):
    processors = dict(sd15.unet.attn_processors)
    with nw_head(sd15, bandwidth=lambda t: 1.0 + t / 1000) as swap:
        assert len(swap.layers) == len(find_ip_layers(sd15))
        assert all(isinstance(sd15.unet.attn_processors[f"{n}.processor"], NWHeadAttnProcessor) for n in swap.layers)
        generate(sd15, refs)
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert "_ipa_probe" not in sd15.unet.__dict__ and "_ipa_probe" not in sd15.unet.__dict__
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in sd15.unet.modules())
    assert not swap.active


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_restores_after_an_exception_inside_the_block(sd15, refs, error):
    processors = dict(sd15.unet.attn_processors)
    with pytest.raises(type(error)):
        with nw_head(sd15):
            generate(sd15, refs, num_inference_steps=1)
            raise error
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    with nw_head(sd15):  # and it can be applied again
        pass


def test_double_application_raises_and_keeps_the_first(sd15, refs):
    with nw_head(sd15) as swap:
        installed = dict(sd15.unet.attn_processors)
        with pytest.raises(RuntimeError, match="already active"):
            apply_nw_head(sd15)
        with pytest.raises(RuntimeError, match="already active"):
            with nw_head(sd15):
                pass
        assert all(sd15.unet.attn_processors[k] is v for k, v in installed.items())
        assert swap.active
        generate(sd15, refs, num_inference_steps=1)


def test_apply_and_remove_for_notebooks(sd15):
    processors = dict(sd15.unet.attn_processors)
    swap = ipa_probe.nwhead.apply_nw_head(sd15, bandwidth=2.0, layers="down_blocks")
    assert swap.layers and all(name.startswith("down_blocks") for name in swap.layers)
    untouched = [k for k in processors if not k.startswith("down_blocks")]
    assert all(sd15.unet.attn_processors[k] is processors[k] for k in untouched)
    ipa_probe.nwhead.remove_nw_head(sd15)
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    with pytest.raises(ValueError, match="no NW head is applied"):
        remove_nw_head(sd15)
    swap.remove()  # idempotent


def test_set_ip_adapter_scale_while_swapped_acts_on_the_shared_scales(refs):
    pipe = tiny_pipeline("sd15")
    pipe.set_ip_adapter_scale(0.0)
    text_only = generate(pipe, refs)
    pipe.set_ip_adapter_scale(1.0)
    originals = [layer.processor for layer in find_ip_layers(pipe)]
    with nw_head(pipe):
        pipe.set_ip_adapter_scale(0.0)
        assert torch.equal(generate(pipe, refs), text_only)
        pipe.set_ip_adapter_scale(0.5)
    assert all(p.scale == [0.5] for p in originals)  # the setting persists on the restored processors
    assert [layer.processor for layer in find_ip_layers(pipe)] == originals


def test_unload_ip_adapter_while_swapped_is_not_undone(refs):
    pipe = tiny_pipeline("sd15")
    with nw_head(pipe):
        generate(pipe, refs, num_inference_steps=1)
        pipe.unload_ip_adapter()
        pipe("a photo", num_inference_steps=1, output_type="latent")
    assert all(isinstance(p, AttnProcessor2_0) for p in pipe.unet.attn_processors.values())
    assert "_ipa_probe" not in pipe.unet.__dict__
    with pytest.raises(ValueError, match="no IP-Adapter loaded"):
        apply_nw_head(pipe)


def test_selection_matching_nothing_raises_before_anything_changes(sd15):
    processors = dict(sd15.unet.attn_processors)
    with pytest.raises(ValueError, match="matched none"):
        apply_nw_head(sd15, layers="no_such_block")
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert "_ipa_probe" not in sd15.unet.__dict__


def test_callable_bandwidth_sees_every_timestep_and_matches_the_float_head(sd15, refs):
    seen = []

    def bandwidth(t):
        seen.append(t)
        return torch.full_like(t, 1.7, dtype=torch.float32)

    with nw_head(sd15, bandwidth=bandwidth):
        by_callable = generate(sd15, refs, num_inference_steps=3)
    with nw_head(sd15, bandwidth=1.7):
        by_float = generate(sd15, refs, num_inference_steps=3)
    with nw_head(sd15, bandwidth=1.0):
        other = generate(sd15, refs, num_inference_steps=3)
    # The temperature enters through the query for a tensor h and through SDPA's scale for a float: rounding only.
    torch.testing.assert_close(by_callable, by_float, rtol=1e-4, atol=1e-4)
    assert (other - by_float).abs().max() > 1e-3
    assert all(isinstance(t, torch.Tensor) and t.ndim == 0 for t in seen)
    assert sorted({float(t) for t in seen}, reverse=True) == [float(t) for t in sd15.scheduler.timesteps]


def test_the_nw_head_adds_no_host_synchronisation(sd15, refs):
    kwargs = {"guidance_scale": 5.0}
    generate(sd15, refs, **kwargs)  # warm-up
    with CountScalarReads() as plain:
        generate(sd15, refs, **kwargs)
    for bandwidth in ("matched", 0.8, lambda t: 0.5 + t / 1000):
        with nw_head(sd15, bandwidth=bandwidth):
            with CountScalarReads() as swapped:
                generate(sd15, refs, **kwargs)
        assert swapped.count == plain.count, bandwidth


# --------------------------------------------------------------------------- composition with the probe


@pytest.mark.parametrize(
    "kind, variant, adapters, bandwidth",
    [("sd15", "base", 1, "matched"), ("sd15", "plus", 2, 0.9), ("sdxl", "base", 1, "matched")],
)
def test_probing_the_swapped_pipeline_reports_perfect_agreement(refs, kind, variant, adapters, bandwidth):
    pipe = tiny_pipeline(kind, ip_adapter=variant, num_adapters=adapters)
    with ipa_probe.nw_head(pipe, bandwidth=bandwidth):
        with ipa_probe.probe(pipe, bandwidth=bandwidth) as run:
            generate(pipe, refs, adapters, guidance_scale=5.0)
    df = run.to_dataframe()
    assert len(df) > 0 and set(df["adapter"]) == set(range(adapters))
    np.testing.assert_allclose(df["spearman"], 1.0, atol=1e-6)
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)
    assert (df["top1"] == 1.0).all()
    # The same probe on the learned head does not agree perfectly: the check has teeth.
    with ipa_probe.probe(pipe, bandwidth=bandwidth) as learned:
        generate(pipe, refs, adapters, guidance_scale=5.0)
    assert learned.to_dataframe()["kl"].mean() > 1e-4


# --------------------------------------------------------------------------- Flux and SD3: bad input


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


# --------------------------------------------------------------------------- Flux and SD3: the processors


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


# --------------------------------------------------------------------------- Flux and SD3: the swap in pipelines


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_nw_head_swaps_restores_and_composes_with_the_probe(refs, family):
    pipe = tiny_flux_pipeline() if family == "flux" else tiny_sd3_pipeline()
    processors = dict(pipe.transformer.attn_processors)
    plain = generate_dit(pipe, refs, cfg=True)
    with nw_head(pipe) as swap:
        assert swap.layers == [layer.name for layer in find_ip_layers(pipe)]
        with pytest.raises(RuntimeError, match="already active"):
            apply_nw_head(pipe)
        swapped = generate_dit(pipe, refs, cfg=True)
        with ipa_probe.probe(pipe) as run:
            probed = generate_dit(pipe, refs, cfg=True)
    assert (swapped - plain).abs().max() > 1e-4
    assert torch.equal(probed, swapped)  # parity holds with the NW head in place
    df = run.to_dataframe()
    np.testing.assert_allclose(df["spearman"], 1.0, atol=1e-5)  # the probe reads the head's own (NW) logits
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)
    assert all(pipe.transformer.attn_processors[k] is v for k, v in processors.items())
    assert torch.equal(generate_dit(pipe, refs, cfg=True), plain)
    assert "_ipa_probe" not in pipe.transformer.__dict__
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
        text_only = generate_dit(pipe, refs)
        with nw_head(pipe, bandwidth=0.4):
            assert torch.equal(generate_dit(pipe, refs), text_only)  # scale 0: the swap changes nothing
            pipe.set_ip_adapter_scale(0.6)
            assert (generate_dit(pipe, refs) - text_only).abs().max() > 1e-4
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
        generate_dit(flux, refs)
    np.testing.assert_allclose(sorted(set(seen), reverse=True), flux.scheduler.timesteps.numpy(), rtol=1e-5)


def test_flux_clock_reads_the_timestep_of_a_positional_transformer_call(refs, flux):
    """A positional call passes encoder_hidden_states second: the clock asks the Flux tap where the timestep is."""
    calls = []

    def record(module, args, kwargs):
        extra = dict(kwargs["joint_attention_kwargs"] or {})  # the transformer pops the image embeds from it
        calls.append({**kwargs, "joint_attention_kwargs": extra})

    handle = flux.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        generate_dit(flux, refs, num_inference_steps=1)
    finally:
        handle.remove()
    kwargs = dict(calls[0])
    names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids"]
    assert list(inspect.signature(flux.transformer.forward).parameters)[:6] == names
    args = [kwargs.pop(name) for name in names]
    seen = []

    def bandwidth(t):
        seen.append(float(t))
        return 1.0

    with nw_head(flux.transformer, bandwidth=bandwidth), torch.no_grad():
        flux.transformer(*args, **kwargs)
    assert seen and np.allclose(seen, 1000 * float(args[3].reshape(-1)[0]), rtol=1e-6)


def test_list_hooks_shows_what_is_attached_and_nothing_after_exit(sd15, refs):
    layer_ids = [layer.name for layer in find_ip_layers(sd15)]
    assert ipa_probe.list_hooks(sd15) == []
    with nw_head(sd15, bandwidth=0.8, layers="down_blocks"):
        with ipa_probe.probe(sd15):
            attached = ipa_probe.list_hooks(sd15)
        after_probe = ipa_probe.list_hooks(sd15)
    assert [a.feature for a in attached] == ["nw_head", "probe"]
    assert list(attached[0].layers) == [name for name in layer_ids if "down_blocks" in name]
    assert list(attached[1].layers) == layer_ids
    assert "0.8" in attached[0].what and "read-only" in attached[1].what
    # printed as a table, one line per feature after the header, the layers counted rather than listed
    lines = repr(attached).splitlines()
    assert lines[0].split() == ["feature", "layers", "what"] and len(lines) == 3
    assert lines[1].startswith("nw_head") and f"{len(attached[0].layers)} layers" in lines[1]
    assert "attn2" not in repr(attached) and "attn2" not in repr(attached[1])
    table = attached.to_dataframe()
    assert table["feature"].tolist() == ["nw_head", "probe"] and table["layer_ids"][1] == layer_ids
    assert [a.feature for a in after_probe] == ["nw_head"]
    assert ipa_probe.list_hooks(sd15) == [] and ipa_probe.list_hooks(sd15.unet) == []


@pytest.mark.slow
def test_nw_head_on_a_compiled_unet_equals_the_eager_head_and_is_restored(refs, fresh_dynamo):

    def run(pipe):
        generator = torch.Generator().manual_seed(0)
        return pipe("a cat", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent", generator=generator)

    eager = tiny_pipeline("sd15")
    with nw_head(eager):
        expected = run(eager).images
    pipe = tiny_pipeline("sd15")
    pipe.unet = torch.compile(pipe.unet, backend="eager")
    before = run(pipe).images  # compiled and run before the swap, the usual order
    with nw_head(pipe) as swap:
        assert all(not name.startswith("_orig_mod") for name in swap.layers)  # diffusers' ids
        swapped = run(pipe).images
    assert torch.equal(swapped, expected)
    assert torch.equal(run(pipe).images, before) and ipa_probe.list_hooks(pipe) == []
