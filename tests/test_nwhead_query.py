"""The query-frame NW head (``nw_head(pipe, frame="query")``): the same images under every per-head q/k basis change,
equal to a float64 reference built from the test's own hooks, and a pipeline restored bit for bit.

The reference implementations here use numpy and scipy on tensors read by forward hooks; they never call
:func:`ipa_probe.statistics.kernels.query_frame_bias`.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxIPAdapterAttnProcessor
from helpers import CountScalarReads, generate_dit, masks_for
from scipy.special import logsumexp, softmax

import ipa_probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.nwhead import (
    FluxNWHeadAttnProcessor,
    NWHeadAttnProcessor,
    NWHeadConfig,
    SD3NWHeadAttnProcessor,
    apply_nw_head,
    nw_head,
)
from ipa_probe.tiny.digits import digits_pipeline, digits_reference_images
from ipa_probe.tiny.dit import SD3_IP_TOKENS
from ipa_probe.tiny.sd import tiny_pipeline

STEPS = 4


# --------------------------------------------------------------------------- the test's own gauge and reference


def random_basis(dim: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    """``U diag(s) V^T`` in float64: random orthogonal ``U, V`` (QR of Gaussian matrices), singular values log-spaced
    from 1 to ``cond`` and rescaled to ``|det| = 1``, so the condition number is exactly ``cond``."""
    u, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    s = torch.logspace(0.0, float(np.log10(cond)), dim, dtype=torch.float64)
    s = s / s.prod() ** (1.0 / dim)
    return u @ torch.diag(s) @ v.T


@contextlib.contextmanager
def per_head_basis_change(pipe, cond: float = 30.0, seed: int = 0):
    """``q -> A_h q`` and ``k -> A_h^-T k`` for each head ``h`` of every IP-Adapter layer: the head's rows of ``to_q``
    (weight and bias) by ``A_h``, of ``to_k`` and every ``to_k_ip`` by ``A_h^-T``. Every ``q·k`` is unchanged (to
    float32 rounding); the weights are put back bit for bit on exit."""
    gen = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for layer in find_ip_layers(pipe):
            attn = layer.attention
            dim = attn.to_q.weight.shape[0] // attn.heads
            queries, keys = [attn.to_q], [attn.to_k, *layer.processor.to_k_ip]
            for module in queries + keys:
                bias = None if module.bias is None else module.bias.detach().clone()
                saved.append((module, module.weight.detach().clone(), bias))
            for head in range(attn.heads):
                a = random_basis(dim, cond, gen)
                assert abs(float(torch.linalg.det(a))) > 0.5  # invertible: |det| = 1 by construction
                a_inv_t = torch.linalg.inv(a).T
                rows = slice(head * dim, (head + 1) * dim)
                for module, matrix in [(m, a) for m in queries] + [(m, a_inv_t) for m in keys]:
                    module.weight[rows] = (matrix @ module.weight[rows].double()).to(module.weight.dtype)
                    if module.bias is not None:
                        module.bias[rows] = (matrix @ module.bias[rows].double()).to(module.bias.dtype)
    try:
        yield
    finally:
        with torch.no_grad():
            for module, weight, bias in saved:
                module.weight.copy_(weight)
                if bias is not None:
                    module.bias.copy_(bias)


def reference_query_frame(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, form: str, rows: np.ndarray | None = None
) -> np.ndarray:
    """Query-frame NW attention in float64 numpy, from the formula: ``L = q k^T / sqrt(d)`` row-centred over the keys,
    ``b_i = log mean_q exp(L_qi)`` (exact) or ``mean_q L_qi + var_q(L_qi) / 2`` (gaussian) over the rows of the frame,
    weights ``softmax_i(q k_i / sqrt(d) - b_i)``.

    Args:
        q: ``(B, H, Q, D)``; k: ``(B, H, K, D)``; v: ``(B, H, K, Dv)``; rows: optional bool ``(B, Q)``.

    Returns:
        ``(B, H, Q, Dv)``.
    """
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (B, H, Q, K)
    centred = logits - logits.mean(-1, keepdims=True)
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for item in range(q.shape[0]):
        frame = centred[item] if rows is None else centred[item][:, rows[item]]  # (H, R, K)
        if form == "exact":
            b = logsumexp(frame, axis=1, keepdims=True) - np.log(frame.shape[1])  # (H, 1, K)
        else:
            b = frame.mean(1, keepdims=True) + frame.var(1, keepdims=True) / 2
        out[item] = softmax(logits[item] - b, axis=-1) @ v[item]
    return out


def heads_np(x: torch.Tensor, heads: int) -> np.ndarray:
    """``(B, ..., H*D)`` torch -> ``(B, H, N, D)`` float64 numpy (middle dimensions, e.g. images x tokens, -> N)."""
    x = x.detach().double().numpy()
    return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(0, 2, 1, 3)


def merge_np(x: np.ndarray) -> np.ndarray:
    """``(B, H, N, D)`` -> ``(B, N, H*D)``."""
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


# --------------------------------------------------------------------------- (a) the same images in every basis


def _organism():
    pipe = digits_pipeline(recipe="ip-adapter")
    pipe.set_progress_bar_config(disable=True)
    return pipe, "a handwritten digit", digits_reference_images(3, 3), {}


def _sd15(masked: bool):
    from ipa_probe.tiny.sd import default_reference_images

    pipe = tiny_pipeline("sd15")
    refs = default_reference_images(2)
    kwargs = {"cross_attention_kwargs": {"ip_adapter_masks": masks_for(len(refs))}} if masked else {}
    return pipe, "a photo of a flower", refs, kwargs


@pytest.mark.parametrize("model", ["organism", "sd15", "sd15-masked"])
@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_query_frame_images_are_equal_across_per_head_basis_changes(model, form):
    pipe, prompt, refs, kwargs = _organism() if model == "organism" else _sd15(model == "sd15-masked")

    def images(**head):
        generator = torch.Generator().manual_seed(0)
        call = dict(num_inference_steps=STEPS, guidance_scale=3.0, generator=generator, output_type="np", **kwargs)
        if not head:
            return pipe(prompt, ip_adapter_image=[refs], **call).images
        with nw_head(pipe, **head):
            return pipe(prompt, ip_adapter_image=[refs], **call).images

    heads = {"learned": {}, "stored": {"frame": "stored"}, "query": {"frame": "query", "form": form}}
    before = {name: images(**head) for name, head in heads.items()}
    weights = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    for cond, seed in [(10.0, 1), (50.0, 2)]:
        with per_head_basis_change(pipe, cond, seed):
            after = {name: images(**head) for name, head in heads.items()}
        diff = {name: float(np.abs(after[name] - before[name]).max()) for name in heads}
        # Pixels in [0, 1] after 4 steps. The basis change is a symmetry of the model up to float32 rounding of the
        # rotated weights, amplified by cond(A) <= 50: measured 2e-6 (learned) and <= 5e-6 (query frame) on both
        # pipelines; 1e-4 leaves a margin of 20 for other CPUs and thread counts and is far below the stored
        # frame's change (measured 0.38-0.62).
        assert diff["learned"] < 1e-4, diff  # the change is a symmetry of the model itself
        assert diff["query"] < 1e-4, diff
        assert diff["stored"] > 1e-2, diff  # the stored-frame head sees |k|^2, which the basis change moves
    assert all(torch.equal(v, weights[k]) for k, v in pipe.unet.state_dict().items())  # weights back bit for bit


# --------------------------------------------------------------------------- (b) equal to a float64 reference


def _captured_layer_call(masked: bool):
    """A tiny SD 1.5 IP layer and the (args, kwargs) of its call at the second step of a CFG run (batch 2)."""
    pipe, prompt, refs, kwargs = _sd15(masked)
    layer = find_ip_layers(pipe)[1]
    calls = []

    def grab(module, args, kw):
        calls.append(copy.deepcopy((args, kw)))

    handle = layer.attention.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        generator = torch.Generator().manual_seed(0)
        pipe(prompt, ip_adapter_image=[refs], num_inference_steps=2, guidance_scale=5.0, generator=generator,
             output_type="latent", **kwargs)  # fmt: skip
    finally:
        handle.remove()
    args, kw = calls[1]
    return layer, args, kw


def _to_double(value):
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_to_double(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_double(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_unet_query_frame_layer_output_equals_a_float64_reference_from_hooks(masked, form):
    layer, args, kwargs = _captured_layer_call(masked)
    attn = copy.deepcopy(layer.attention).double()  # its IP-Adapter processor is a submodule: copied and cast too
    original = attn.processor
    head = NWHeadAttnProcessor(original, frame="query", form=form)
    args, kwargs = _to_double(args), _to_double(kwargs)
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "out": []}
    hooks = [
        attn.to_q.register_forward_hook(lambda m, a, out: seen["q"].append(out)),
        head.to_k_ip[0].register_forward_hook(lambda m, a, out: seen["k"].append(out)),
        head.to_v_ip[0].register_forward_hook(lambda m, a, out: seen["v"].append(out)),
        attn.register_forward_hook(lambda m, a, out: seen["out"].append(out)),
    ]
    scale = original.scale[0]
    try:
        with torch.no_grad():
            attn.set_processor(head)
            attn(*args, **kwargs)
            original.scale[0] = 0.0  # the same call without its image branch (the shared scale list)
            attn(*args, **kwargs)
    finally:
        original.scale[0] = scale
        for hook in hooks:
            hook.remove()
    out, text_only = seen["out"]
    assert out.dtype == torch.float64 and len(seen["q"]) == 2
    heads = attn.heads
    q = heads_np(seen["q"][0], heads)  # (B, H, Q, D)
    batch, n_queries = q.shape[0], q.shape[2]
    masks = kwargs.get("ip_adapter_masks")
    if masks is None:
        assert len(seen["k"]) == 1  # the two reference images form one support: K = 2 images x 4 tokens
        branch = scale * reference_query_frame(q, heads_np(seen["k"][0], heads), heads_np(seen["v"][0], heads), form)
        branch = merge_np(branch)  # (B, Q, H*D)
    else:
        mask = masks[0]
        assert len(seen["k"]) == mask.shape[1] == 2  # one softmax per masked reference image
        branch = np.zeros((batch, n_queries, q.shape[1] * q.shape[3]))
        for i in range(mask.shape[1]):
            weight = IPAdapterMaskProcessor.downsample(mask[:, i].float(), batch, n_queries, 1)[..., 0].double()
            rows = weight.numpy() != 0  # (B, Q): the queries this image reaches
            assert rows.any() and not rows.all()  # the frame is a proper subset of the queries
            nw = reference_query_frame(q, heads_np(seen["k"][i], heads), heads_np(seen["v"][i], heads), form, rows)
            branch += scale * merge_np(nw) * weight.numpy()[..., None]
    # The image branch enters before the affine output projection: out - out(scale 0) = W_out (scale * branch).
    expected = branch @ attn.to_out[0].weight.detach().double().numpy().T
    got = (out - text_only).numpy()
    if got.ndim == 4:  # a spatial input comes back as (B, C, H, W)
        got = got.reshape(got.shape[0], got.shape[1], -1).transpose(0, 2, 1)
    assert np.abs(expected).max() > 1e-3  # the branch is not negligible: the comparison has teeth
    # float64 throughout (the head's logits, b and SDPA, the reference's numpy): agreement to float64 rounding.
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-11)
    # and the stored-frame head is a different head on the same call
    attn.set_processor(NWHeadAttnProcessor(original))
    with torch.no_grad():
        stored = attn(*args, **kwargs)
    assert (stored - out).abs().max() > 1e-4


def test_an_image_whose_mask_reaches_no_query_falls_back_to_all_rows():
    _, original = _bare()
    head = NWHeadAttnProcessor(original, frame="query")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (6, 5, 5))
    none = torch.zeros(2, 1, 6, dtype=torch.bool)
    torch.testing.assert_close(head.nw_attention(q, k, v, none), head.nw_attention(q, k, v), rtol=0, atol=0)
    some = torch.tensor([[True, True, False, False, True, False]] * 2).unsqueeze(1)
    expected = reference_query_frame(q.numpy(), k.numpy(), v.numpy(), "exact", some[:, 0].numpy())
    np.testing.assert_allclose(head.nw_attention(q, k, v, some).numpy(), expected, rtol=1e-10, atol=1e-12)


def _bare():
    from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=24, heads=2, dim_head=8)
    original = IPAdapterAttnProcessor2_0(hidden_size=16, cross_attention_dim=24, num_tokens=(4,))
    attn.set_processor(original)
    return attn, original


@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_flux_query_frame_head_equals_a_float64_reference(form):
    torch.manual_seed(0)
    attn = FluxAttention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=32, out_dim=32, bias=True).double()
    original = FluxIPAdapterAttnProcessor(hidden_size=32, cross_attention_dim=24, num_tokens=(4, 4), scale=[0.8, 1.3])
    original.double()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 12, 32, generator=gen, dtype=torch.float64),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=gen, dtype=torch.float64),
        ip_hidden_states=[torch.randn(2, 3, 4, 24, generator=gen, dtype=torch.float64),
                          torch.randn(2, 1, 4, 24, generator=gen, dtype=torch.float64)],
    )  # fmt: skip
    attn.set_processor(original)
    with torch.no_grad():
        hidden, context, _ = attn(**inputs)
        head = FluxNWHeadAttnProcessor(original, frame="query", form=form)
        attn.set_processor(head)
        q_seen = []
        hook = attn.norm_q.register_forward_hook(lambda m, a, out: q_seen.append(out))
        nw_hidden, nw_context, nw_ip = attn(**inputs)
        hook.remove()
        q = q_seen[-1].detach().numpy().transpose(0, 2, 1, 3)  # the image query: (B, N, H, D) -> (B, H, N, D)
        expected = np.zeros(nw_ip.shape)
        for states, scale, to_k, to_v in zip(inputs["ip_hidden_states"], original.scale, original.to_k_ip,
                                             original.to_v_ip, strict=True):  # fmt: skip
            k, v = heads_np(to_k(states), 2), heads_np(to_v(states), 2)
            expected += scale * merge_np(reference_query_frame(q, k, v, form))
    assert torch.equal(nw_hidden, hidden) and torch.equal(nw_context, context)
    # float64 throughout: agreement to float64 rounding.
    np.testing.assert_allclose(nw_ip.numpy(), expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_sd3_query_frame_head_equals_a_float64_reference_over_the_joint_keys(sd3, form):
    layer = find_ip_layers(sd3)[0]
    attn = copy.deepcopy(layer.attention).double()
    original = attn.processor
    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 32, generator=gen, dtype=torch.float64),
        encoder_hidden_states=torch.randn(2, 6, 32, generator=gen, dtype=torch.float64),
        ip_hidden_states=torch.randn(2, SD3_IP_TOKENS, 32, generator=gen, dtype=torch.float64),
        temb=torch.randn(2, 64, generator=gen, dtype=torch.float64),
    )
    head = SD3NWHeadAttnProcessor(original, frame="query", form=form)
    with torch.no_grad():
        attn.set_processor(head)
        swapped = attn(**inputs)[0]
        scale, original.scale = original.scale, 0.0
        try:
            base = attn(**inputs)[0]  # the head with scale 0 runs the parent: no image branch
        finally:
            original.scale = scale
        x = inputs["hidden_states"]
        c = original.norm_ip(inputs["ip_hidden_states"], temb=inputs["temb"])
        to_heads = lambda t: t.reshape(2, -1, 2, 16).transpose(1, 2)  # noqa: E731  (B, N, H*D) -> (B, H, N, D)
        q = original.norm_q(to_heads(attn.to_q(x))).numpy()
        keys = torch.cat(
            [original.norm_k(to_heads(attn.to_k(x))), original.norm_ip_k(to_heads(original.to_k_ip(c)))], 2
        )
        values = torch.cat([to_heads(attn.to_v(x)), to_heads(original.to_v_ip(c))], 2)
        branch = merge_np(reference_query_frame(q, keys.numpy(), values.numpy(), form))
    expected = (scale * branch) @ attn.to_out[0].weight.detach().numpy().T
    np.testing.assert_allclose((swapped - base).numpy(), expected, rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- (c) lifecycle


def _snapshot(pipe):
    return dict(pipe.unet.attn_processors), {k: v.clone() for k, v in pipe.unet.state_dict().items()}


def _assert_restored(pipe, snapshot):
    processors, weights = snapshot
    assert all(pipe.unet.attn_processors[k] is v for k, v in processors.items())
    state = pipe.unet.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    assert "_ipa_probe" not in pipe.unet.__dict__ and "_ipa_probe" not in pipe.unet.__dict__
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in pipe.unet.modules())


def _latents(pipe, refs):
    generator = torch.Generator().manual_seed(0)
    return pipe("a photo", ip_adapter_image=[refs], num_inference_steps=2, generator=generator,
                output_type="latent").images  # fmt: skip


def test_query_frame_swap_restores_the_pipeline_bit_for_bit(refs):
    pipe = tiny_pipeline("sd15")
    plain = _latents(pipe, refs)
    snapshot = _snapshot(pipe)
    with nw_head(pipe, frame="query", form="gaussian") as swap:
        assert swap.config.describe()["frame"] == "query" and swap.config.describe()["form"] == "gaussian"
        assert all(isinstance(pipe.unet.attn_processors[f"{n}.processor"], NWHeadAttnProcessor) for n in swap.layers)
        assert all(pipe.unet.attn_processors[f"{n}.processor"].frame == "query" for n in swap.layers)
        swapped = _latents(pipe, refs)
    assert (swapped - plain).abs().max() > 1e-4  # the head was in place
    _assert_restored(pipe, snapshot)
    assert torch.equal(_latents(pipe, refs), plain)
    assert not swap.active


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_query_frame_swap_restores_after_an_exception_inside_the_block(refs, error):
    pipe = tiny_pipeline("sd15")
    plain = _latents(pipe, refs)
    snapshot = _snapshot(pipe)
    with pytest.raises(type(error)):
        with nw_head(pipe, frame="query"):
            _latents(pipe, refs)
            raise error
    _assert_restored(pipe, snapshot)
    assert torch.equal(_latents(pipe, refs), plain)
    with nw_head(pipe, frame="query"):  # and it can be applied again
        pass


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"frame": "query", "bandwidth": 0.5}, "does not apply to frame='query'"),
        ({"frame": "query", "bandwidth": lambda t: 1.0}, "does not apply to frame='query'"),
        ({"frame": "key"}, r"expected one of \('stored', 'query'\), got 'key'"),
        ({"frame": "query", "form": "laplace"}, r"expected one of \('exact', 'gaussian'\), got 'laplace'"),
        ({"form": "gaussian"}, "applies to the query-frame head only"),
    ],
)
def test_bad_frame_settings_raise_before_anything_changes(sd15, kwargs, match):
    snapshot = _snapshot(sd15)
    with pytest.raises(ValueError, match=match):
        apply_nw_head(sd15, **kwargs)
    with pytest.raises(ValueError, match=match):
        NWHeadConfig(**kwargs)
    _assert_restored(sd15, snapshot)


def test_config_describes_the_frame_and_its_gauge():
    stored, query = NWHeadConfig().describe(), NWHeadConfig(frame="query").describe()
    assert (stored["frame"], stored["form"], query["frame"], query["form"]) == ("stored", None, "query", "exact")
    assert stored["gauge"].startswith("dependent") and query["gauge"].startswith("invariant")


def test_list_hooks_names_the_frame(sd15):
    with nw_head(sd15, frame="query"):
        (attached,) = ipa_probe.list_hooks(sd15)
    assert "frame=query" in attached.what
    with nw_head(sd15):
        (attached,) = ipa_probe.list_hooks(sd15)
    assert "frame=stored" in attached.what


def test_the_query_frame_head_adds_no_host_synchronisation(sd15, refs):
    masks = {"cross_attention_kwargs": {"ip_adapter_masks": masks_for(len(refs))}}

    def generate(**kwargs):
        generator = torch.Generator().manual_seed(0)
        sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent", guidance_scale=5.0,
             generator=generator, **kwargs)  # fmt: skip

    for kwargs in ({}, masks):
        generate(**kwargs)  # warm-up
        with CountScalarReads() as plain:
            generate(**kwargs)
        for form in ("exact", "gaussian"):
            with nw_head(sd15, frame="query", form=form), CountScalarReads() as swapped:
                generate(**kwargs)
            assert swapped.count == plain.count, (form, kwargs.keys())


@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_the_logits_the_probe_reads_are_the_heads_own(form):
    """The probe reads ``image_branch_logits`` (:func:`ipa_probe.layers.image_branch_logits`): on a call's own query
    and keys their softmax is the weighting the head applies."""
    _, original = _bare()
    head = NWHeadAttnProcessor(original, frame="query", form=form)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (9, 5, 5))
    weights = torch.softmax(head.image_branch_logits(q, k), -1)
    # float64 on both sides: rounding only
    torch.testing.assert_close(weights @ v, head.nw_attention(q, k, v), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((weights @ v).numpy(), reference_query_frame(q.numpy(), k.numpy(), v.numpy(), form),
                               rtol=1e-10, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_dit_query_frame_swaps_differs_from_the_stored_frame_and_restores(refs, flux, sd3, family):
    pipe = flux if family == "flux" else sd3
    processors = dict(pipe.transformer.attn_processors)
    weights = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    plain = generate_dit(pipe, refs, cfg=True)
    with nw_head(pipe, frame="query"):
        query = generate_dit(pipe, refs, cfg=True)
    with nw_head(pipe):
        stored = generate_dit(pipe, refs, cfg=True)
    assert (query - plain).abs().max() > 1e-4 and (query - stored).abs().max() > 1e-4
    assert all(pipe.transformer.attn_processors[k] is v for k, v in processors.items())
    assert all(torch.equal(v, weights[k]) for k, v in pipe.transformer.state_dict().items())
    assert torch.equal(generate_dit(pipe, refs, cfg=True), plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_query_frame_head_in_half_precision_follows_its_float64_reference(dtype):
    _, original = _bare()
    head = NWHeadAttnProcessor(original, frame="query")
    gen = torch.Generator().manual_seed(0)
    q = 3 * torch.randn(2, 2, 64, 8, generator=gen, dtype=torch.float64)
    k = 3 * torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)  # logits of size ~10: a spread-out b
    v = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)
    out = head.nw_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    # The inputs are rounded to 8 (bf16) or 11 (fp16) significant bits and SDPA runs in that precision, so logits of
    # size ~10 move by ~0.05 (bf16) / ~0.005 (fp16) and the weighted means of values ~1 with them: measured 0.056 and
    # 0.009 here (float32: 3e-6); the bounds leave a factor of about 3.
    expected = reference_query_frame(q.numpy(), k.numpy(), v.numpy(), "exact")
    atol = 0.15 if dtype == torch.bfloat16 else 0.03
    np.testing.assert_allclose(out.double().numpy(), expected, atol=atol)


def test_gauge_inside_a_query_frame_head_changes_no_image():
    """ipa_probe.qk_gauge applied while a query-frame head is swapped in (the order a user reaches first) leaves the
    images as they were; a stored-frame head, whose key term the gauge changes, is refused before anything moves."""
    import ipa_probe
    from ipa_probe.tiny.digits import DIGITS_PROMPT

    pipe = ipa_probe.digits_pipeline(recipe="ip-adapter")
    pipe.set_progress_bar_config(disable=True)
    refs = ipa_probe.digits_reference_images(3, 3)

    def call():
        generator = torch.Generator().manual_seed(0)
        kwargs = {"num_inference_steps": 3, "guidance_scale": 3.0, "output_type": "np"}
        return pipe(DIGITS_PROMPT, ip_adapter_image=[refs], generator=generator, **kwargs).images

    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    with ipa_probe.nw_head(pipe, frame="query"):
        plain = call()
        with ipa_probe.qk_gauge(pipe, "random:0:1"):
            gauged = call()
    # float32 products through A and A^-T (cond ~70): equal to ~1e-6 of a [0, 1] pixel, as the learned model's are
    np.testing.assert_allclose(gauged, plain, rtol=0, atol=1e-4)
    with ipa_probe.nw_head(pipe):
        with pytest.raises(ValueError, match="frame='stored'"):
            with ipa_probe.qk_gauge(pipe, "random:0:1"):
                pass
    assert all(torch.equal(v, before[k]) for k, v in pipe.unet.state_dict().items())
