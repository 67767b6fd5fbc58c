"""Named hook points on the image branch (issue #30 point 5): names, bit-identity without edits, the per-reference
contribution against the test's own float64 recomputation (from forward hooks on ``to_q``, ``to_k_ip``, ``to_v_ip``
and ``to_out``), its invariance under the q/k and v/o basis changes, ``mode="scale"``, patching one run into another,
and refusals that leave the pipeline as it was."""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_intervention import assert_unchanged, snapshot

import ipa_probe
from ipa_probe.capture.layer_order import network_order
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images
from ipa_probe.tiny.sd import default_reference_images

STEPS = 3
CONTRIBUTIONS = r"\.ip\.contribution$"


@pytest.fixture(scope="module")
def refs():
    return digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)


@pytest.fixture(scope="module")
def other_refs():
    return digits_reference_images(7, 2, seed=300) + digits_reference_images(1, 2, seed=400)


def call(refs, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("guidance_scale", 3.0)  # CFG on: the batch holds both branches
    return dict(prompt=DIGITS_PROMPT, ip_adapter_image=[list(refs)], output_type="latent", **kwargs)


def run(pipe, seed=0, **kwargs):
    return pipe(**kwargs, generator=torch.Generator().manual_seed(seed)).images


def layers_of(pipe):
    return ipa_probe.find_ip_layers(pipe)


# ----------------------------------------------------------------------------------------- the test's own hooks


class Recorder:
    """The test's own forward hooks on every IP layer: ``to_q``'s output, ``to_k_ip[0]``'s and ``to_v_ip[0]``'s
    outputs, ``to_out[0]``'s input, and the attention module's output, one entry per layer call (= per step)."""

    def __init__(self, pipe):
        self.layers = layers_of(pipe)
        self.seen: dict[str, dict[str, list[torch.Tensor]]] = {
            layer.name: {"q": [], "k": [], "v": [], "x": [], "out": []} for layer in self.layers
        }
        self.handles = []

    def __enter__(self):
        for layer in self.layers:
            seen = self.seen[layer.name]
            attn, processor = layer.attention, layer.processor

            def keep(key, seen=seen):
                return lambda module, args, output: seen[key].append(output.detach().clone())

            self.handles += [
                attn.to_q.register_forward_hook(keep("q")),
                processor.to_k_ip[0].register_forward_hook(keep("k")),
                processor.to_v_ip[0].register_forward_hook(keep("v")),
                attn.to_out[0].register_forward_pre_hook(
                    lambda module, args, seen=seen: seen["x"].append(args[0].detach().clone())
                ),
                attn.register_forward_hook(keep("out")),
            ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, N, H*D)`` -> ``(B, H, N, D)`` in float64."""
    batch, n, channels = x.shape
    return x.double().reshape(batch, n, heads, channels // heads).permute(0, 2, 1, 3)


def branch64(layer, seen: dict, step: int) -> dict[str, torch.Tensor]:
    """The image branch recomputed in float64 from the test's hooks: weights ``(B, H, Q, K)``, per-reference
    contributions ``(B, R, Q, C)`` after ``to_out[0]``'s weight (no bias), times the adapter scale."""
    heads = layer.heads
    q = heads_first(seen["q"][step], heads)
    k_out, v_out = seen["k"][step], seen["v"][step]  # (B, R, T, C)
    batch, references, tokens = k_out.shape[:3]
    k = heads_first(k_out.reshape(batch, references * tokens, -1), heads)
    v = heads_first(v_out.reshape(batch, references * tokens, -1), heads)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, Q, K)
    w_o = layer.attention.to_out[0].weight.double()
    scale = float(layer.processor.scale[0])
    contributions = []
    for j in range(references):
        part = slice(j * tokens, (j + 1) * tokens)
        y = weights[..., part] @ v[:, :, part]  # (B, H, Q, D)
        y = y.permute(0, 2, 1, 3).reshape(batch, y.shape[2], -1)  # (B, Q, H*D)
        contributions.append(scale * y @ w_o.T)  # (B, Q, C)
    return {"weights": weights, "contribution": torch.stack(contributions, 1), "tokens": tokens}


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> bool:
    """``|actual - expected| <= rel * max|expected|`` elementwise (a scale-aware float32-vs-float64 check)."""
    expected = expected.double()
    return bool(((actual.double() - expected).abs() <= rel * expected.abs().max().clamp_min(1e-12)).all())


# ------------------------------------------------------------------------------------------------------ the names


def test_names_listed_per_layer_and_point(organism):
    names = ipa_probe.list_hook_points(organism)
    layers = network_order(layer.name for layer in layers_of(organism))  # forward order: down, mid, up
    points = ("q", "k", "logits", "weights", "contribution", "output")
    assert names == [f"{layer}.{branch}.{point}" for layer in layers for branch in ("text", "ip") for point in points]
    assert len(set(names)) == len(names) == 12 * len(layers)
    assert layers.index(next(n for n in layers if n.startswith("mid_block"))) < layers.index(
        next(n for n in layers if n.startswith("up_blocks"))
    )


SD3_FACTOR = 3.0


def test_sd3_points_scale_and_cache_match_a_float64_recomputation(sd3, one_thread):
    """SD3's image branch is one softmax over ``[image keys; latent keys]`` (the processor's ``norm_ip_k``,
    ``norm_k``) with values ``[to_v_ip; to_v]``: under ``mode="scale"`` (``log f`` added to the image logits) the
    cached ``weights`` are the image columns of the test's own float64 joint softmax, ``output`` is ``s W_o`` times
    its mix of the values, and ``to_out[0]`` returns what it computes plus the change of that output; the cache's
    estimate of every point is what it then holds."""
    layer = ipa_probe.find_ip_layers(sd3)[0]
    attn, proc, heads = layer.attention, layer.processor, layer.heads
    modules = {"q": proc.norm_q, "k": proc.norm_ip_k, "k_lat": proc.norm_k, "v": proc.to_v_ip, "v_lat": attn.to_v}
    seen = []

    def keep(key):
        def hook(module, args, output):
            seen[-1][key] = output.detach().double()
            if key == "out":
                seen[-1]["x"] = args[0].detach().double()

        return hook

    points = rf"^{layer.name}\.ip\.(weights|output)$"
    kwargs = dict(prompt="a", ip_adapter_image=default_reference_images(1)[0], height=64, width=64)
    with (
        ipa_probe.intervene(sd3, 0, mode="scale", factor=SD3_FACTOR),
        ipa_probe.cache_hook_points(sd3, points) as cache,
    ):
        handles = [m.register_forward_hook(keep(key)) for key, m in [*modules.items(), ("out", attn.to_out[0])]]
        handles.append(sd3.transformer.register_forward_pre_hook(lambda module, args: seen.append({})))
        try:
            run(sd3, num_inference_steps=2, output_type="latent", **kwargs)
        finally:
            for handle in handles:
                handle.remove()
    weights, output = (cache[f"{layer.name}.ip.{point}"].double() for point in ("weights", "output"))
    w_o, bias = attn.to_out[0].weight.double(), attn.to_out[0].bias.double()
    for step, got in enumerate(seen):
        q = got["q"]  # (B, H, Q, D); keys: (B, H, K, D) and (B, H, N, D)
        split = lambda x: x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)  # noqa: E731
        keys, values = torch.cat([got["k"], got["k_lat"]], 2), torch.cat([split(got["v"]), split(got["v_lat"])], 2)
        logits = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Q, K + N)
        image = got["k"].shape[2]
        shift = torch.zeros(logits.shape[-1], dtype=torch.float64)
        shift[:image] = math.log(SD3_FACTOR)

        def branch(w, values=values):  # (B, H, Q, K + N) -> s W_o (w V): (B, Q, C)
            mixed = (w @ values).transpose(1, 2).flatten(2)
            return float(proc.scale) * mixed @ w_o.T

        plain, scaled = logits.softmax(-1), (logits + shift).softmax(-1)
        assert not torch.allclose(plain[..., :image], scaled[..., :image], atol=1e-3)  # the factor moves them
        torch.testing.assert_close(weights[step], scaled[..., :image], rtol=0, atol=1e-6)
        torch.testing.assert_close(output[step], branch(scaled), rtol=0, atol=1e-5)
        expected = got["x"] @ w_o.T + bias + branch(scaled) - branch(plain)
        torch.testing.assert_close(got["out"], expected, rtol=0, atol=1e-5)
    with ipa_probe.cache_hook_points(sd3) as every:  # every point: the estimate is exactly what the cache holds
        run(sd3, num_inference_steps=1, output_type="latent", **kwargs)
    with ipa_probe.cache_hook_points(sd3, max_bytes=every.nbytes):
        run(sd3, num_inference_steps=1, output_type="latent", **kwargs)
    with pytest.raises(ValueError, match="max_bytes="), ipa_probe.cache_hook_points(sd3, max_bytes=every.nbytes - 1):
        run(sd3, num_inference_steps=1, output_type="latent", **kwargs)


def test_flux_points(flux, one_thread):
    """Flux's branch: q after norm_q (before RoPE), no output projection, the attention's third output. Identity
    callbacks are bit-identical, the points match a float64 recomputation from the test's hooks, the third output
    is their sum, zeroing it equals adapter scale 0, and the cache's estimate is what it holds."""
    from ipa_probe.tiny.sd import default_reference_images

    layers = layers_of(flux)
    names = ipa_probe.list_hook_points(flux)
    points = ("q", "k", "logits", "weights", "contribution", "output")
    assert names == [f"{name}.ip.{p}" for name in network_order(layer.name for layer in layers) for p in points]
    kwargs = dict(
        prompt="a",
        ip_adapter_image=[default_reference_images(2)],
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="latent",
    )
    plain = run(flux, **kwargs)
    seen = {layer.name: {"q": [], "k": [], "v": [], "out": []} for layer in layers}
    handles = []
    for layer in layers:
        s = seen[layer.name]
        handles += [
            layer.attention.norm_q.register_forward_hook(lambda m, a, o, s=s: s["q"].append(o.detach().clone())),
            layer.processor.to_k_ip[0].register_forward_hook(lambda m, a, o, s=s: s["k"].append(o.detach().clone())),
            layer.processor.to_v_ip[0].register_forward_hook(lambda m, a, o, s=s: s["v"].append(o.detach().clone())),
            layer.attention.register_forward_hook(lambda m, a, o, s=s: s["out"].append(o[2].detach().clone())),
        ]
    try:
        with ipa_probe.intervene(flux, hooks={n: lambda t, ctx: None for n in names}):
            with ipa_probe.cache_hook_points(flux, names, max_bytes=2**40) as cache:
                hooked = run(flux, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(hooked, plain)
    for layer in layers:
        s = seen[layer.name]
        for step in range(2):
            q = s["q"][step].double().transpose(1, 2)  # (B, H, Q, D)
            batch, references, tokens = s["k"][step].shape[:3]
            k = heads_first(s["k"][step].reshape(batch, references * tokens, -1), layer.heads)
            v = heads_first(s["v"][step].reshape(batch, references * tokens, -1), layer.heads)
            w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
            c = torch.stack(
                [
                    (w[..., j * tokens : (j + 1) * tokens] @ v[:, :, j * tokens : (j + 1) * tokens])
                    .permute(0, 2, 1, 3)
                    .reshape(batch, q.shape[2], -1)
                    for j in range(references)
                ],
                1,
            ) * float(layer.processor.scale[0])
            # float32 against float64 over a few dozen terms: 1e-5 of the largest entry
            assert close(cache.get(f"{layer.name}.ip.weights", step), w, 1e-5)
            assert close(cache.get(f"{layer.name}.ip.contribution", step), c, 1e-5)
            assert close(s["out"][step], c.sum(1), 1e-5)  # the branch's output as the processor returned it
    with ipa_probe.cache_hook_points(flux, names, max_bytes=cache.nbytes):  # the estimate is exactly what it holds
        run(flux, **kwargs)
    outputs = {n: lambda t, ctx: torch.zeros_like(t) for n in names if n.endswith(".output")}
    with ipa_probe.intervene(flux, hooks=outputs):
        zeroed = run(flux, **kwargs)
    scale = float(layers[0].processor.scale[0])
    flux.set_ip_adapter_scale(0.0)
    try:
        without = run(flux, **kwargs)
    finally:
        flux.set_ip_adapter_scale(scale)
    assert close(zeroed, without, 1e-5)  # two steps of a float32 transformer
    assert not close(plain, without, 1e-2)
    assert ipa_probe.list_hooks(flux) == []


# ------------------------------------------------------------------------------------------- bit-identity


def test_identity_callbacks_leave_the_generation_bit_identical(organism, refs, one_thread):
    before = snapshot(organism)
    plain = run(organism, **call(refs))
    names = ipa_probe.list_hook_points(organism)
    keep = {name: [lambda t, ctx: None, lambda t, ctx: t] for name in names}
    with ipa_probe.intervene(organism, hooks=keep) as state:
        assert [a.feature for a in ipa_probe.list_hooks(organism)] == ["hook_points"]
        with ipa_probe.cache_hook_points(organism, names) as cache:
            hooked = run(organism, **call(refs))
    assert torch.equal(hooked, plain)  # same process and threads: bitwise
    assert len(state.calls) == 2 * len(names) * STEPS and cache.steps() == list(range(STEPS))
    assert_unchanged(organism, before)


# ------------------------------------------------------------------------------- the points against float64


def test_points_match_a_float64_recomputation_from_the_tests_hooks(organism, refs):
    with Recorder(organism) as rec, ipa_probe.cache_hook_points(organism, ipa_probe.list_hook_points(organism)) as c:
        run(organism, **call(refs))
    for layer in rec.layers:
        for step in range(STEPS):
            expected = branch64(layer, rec.seen[layer.name], step)
            weights = c.get(f"{layer.name}.ip.weights", step)
            contribution = c.get(f"{layer.name}.ip.contribution", step)
            output = c.get(f"{layer.name}.ip.output", step)
            # float32 softmax and matmuls over <= 128 channels against float64: ~1e-6 relative; 1e-5 leaves margin
            assert close(weights, expected["weights"], 1e-5)
            assert close(contribution, expected["contribution"], 1e-5)
            # the output is the sum of the references' contributions (float32 sum of R terms), and the branch's
            # output s W_o y recomputed in float64
            assert close(output, contribution.double().sum(1), 1e-6)
            assert close(output, expected["contribution"].sum(1), 1e-5)
            assert contribution.shape[1] == len(refs)


def _basis_changes(layer, generator, kind: str) -> list[tuple[torch.nn.Linear, torch.Tensor]]:
    """New weights for a per-head basis change, as ``(module, new weight)`` pairs.

    ``"qk"``: per head h, ``q_h -> A_h^T q_h`` and every key ``k_h -> A_h^-1 k_h`` (text and image keys: both
    softmaxes keep their logits). ``"vo"``: per head, ``v_h -> B_h v_h`` (text and image values) and
    ``W_o[:, h] -> W_o[:, h] B_h^-1`` (to_out is shared by both branches). A and B are well conditioned (a random
    orthogonal matrix times scales in [0.5, 2])."""
    attn, heads = layer.attention, layer.heads
    head_dim = attn.to_q.weight.shape[0] // heads

    def matrix():
        orthogonal, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return orthogonal * torch.empty(head_dim, dtype=torch.float64).uniform_(0.5, 2.0, generator=generator)

    mats = [matrix() for _ in range(heads)]
    inverse = [torch.linalg.inv(m) for m in mats]

    def rows(weight, per_head):  # (H*D, C): row block h -> M_h @ block
        blocks = weight.double().reshape(heads, head_dim, -1)
        return torch.stack([m @ b for m, b in zip(per_head, blocks, strict=True)]).reshape(weight.shape)

    if kind == "qk":
        changes = [(attn.to_q, rows(attn.to_q.weight, [m.T for m in mats]))]
        changes += [(attn.to_k, rows(attn.to_k.weight, inverse))]
        changes += [(lin, rows(lin.weight, inverse)) for lin in layer.processor.to_k_ip]
        return changes
    changes = [(attn.to_v, rows(attn.to_v.weight, mats))]
    changes += [(lin, rows(lin.weight, mats)) for lin in layer.processor.to_v_ip]
    w_o = attn.to_out[0].weight.double().reshape(-1, heads, head_dim)  # (C, H, D): column block h
    new_o = torch.stack([w_o[:, h] @ inverse[h] for h in range(heads)], 1).reshape(attn.to_out[0].weight.shape)
    return changes + [(attn.to_out[0], new_o)]


@pytest.mark.parametrize("kind", ["qk", "vo"])
def test_contribution_is_invariant_under_per_head_basis_changes(organism, refs, kind):
    for module in [m for layer in layers_of(organism) for m in (layer.attention.to_q, layer.attention.to_k)]:
        assert module.bias is None  # the changes below are linear maps of bias-free projections
    names = [
        n for n in ipa_probe.list_hook_points(organism) if n.rsplit(".", 1)[1] in ("logits", "weights", "contribution")
    ]
    with Recorder(organism) as before, ipa_probe.cache_hook_points(organism, names) as plain:
        run(organism, **call(refs))
    generator = torch.Generator().manual_seed(7)
    saved = {}
    try:
        for layer in layers_of(organism):
            for module, weight in _basis_changes(layer, generator, kind):
                saved.setdefault(module, module.weight.detach().clone())
                with torch.no_grad():
                    module.weight.copy_(weight.to(module.weight.dtype))
        with Recorder(organism) as after, ipa_probe.cache_hook_points(organism, names) as changed:
            run(organism, **call(refs))
    finally:
        with torch.no_grad():
            for module, weight in saved.items():
                module.weight.copy_(weight)
    for name in names:
        # the changed weights are rounded to float32 (relative 6e-8 per entry) and that rounding travels through
        # 3 steps of the UNet: 1e-4 relative to the tensor's largest entry is far above it and far below any change
        # a non-invariant quantity shows (below: the projections themselves move by far more)
        assert close(changed[name], plain[name], 1e-4), name
    moved = "q" if kind == "qk" else "v"  # the gauge did act: the raw queries (values) are not what they were
    layer = layers_of(organism)[0].name
    assert not close(after.seen[layer][moved][0], before.seen[layer][moved][0], 1e-2)


# ------------------------------------------------------------------------------------------------ scale mode


def test_scale_zero_is_ablate_and_one_is_nothing(organism, refs, one_thread):
    plain = run(organism, **call(refs))
    with ipa_probe.intervene(organism, 1, layers="up_blocks", mode="scale", factor=1.0):
        assert torch.equal(run(organism, **call(refs)), plain)
    with ipa_probe.intervene(organism, [1, 2], layers="up_blocks", mode="ablate"):
        ablated = run(organism, **call(refs))
    with ipa_probe.intervene(organism, [1, 2], layers="up_blocks", mode="scale", factor=0.0) as state:
        scaled = run(organism, **call(refs))
    assert state.acted and {layer for _, layer in state.acted} == set(state.layers)
    # renormalising the other weights vs dropping the tokens before the softmax: float32 rounding, amplified by three
    # steps of the UNet; the ablation itself moves the latents by > 1e-2
    assert (ablated - plain).abs().max() > 1e-2
    assert close(scaled, ablated, 1e-4)


def test_scale_weights_match_a_float64_recomputation(organism, refs):
    layer = layers_of(organism)[-1]
    name = f"{layer.name}.ip.weights"
    factor = 0.25
    with ipa_probe.intervene(organism, 0, layers=layer.name, steps=[1], mode="scale", factor=factor):
        with Recorder(organism) as rec, ipa_probe.cache_hook_points(organism, [name]) as cache:
            run(organism, **call(refs))
    seen = rec.seen[layer.name]
    expected = branch64(layer, seen, 1)
    tokens = expected["tokens"]
    weights = expected["weights"].clone()
    weights[..., :tokens] *= factor
    weights /= weights.sum(-1, keepdim=True)
    assert close(cache.get(name, 1), weights, 1e-5)  # float32 softmax and renormalisation: ~1e-7
    assert close(cache.get(name, 0), expected_weights(layer, seen, 0), 1e-5)  # step 0 untouched
    # the layer's output: its unedited output plus s W_o (y' - y), recomputed in float64 from the test's hooks
    assert close(seen["out"][1], expected_out(layer, seen, 1, weights), 1e-5)


def expected_weights(layer, seen, step):
    return branch64(layer, seen, step)["weights"]


def expected_out(layer, seen, step, new_weights=None, new_contributions=None) -> torch.Tensor:
    """The attention module's output with the image branch's weights (or per-reference contributions) replaced,
    in float64: ``W_o (x - s y) + b + sum_j c'_j``, from the test's hooks."""
    expected = branch64(layer, seen, step)
    heads, out = layer.heads, layer.attention.to_out[0]
    w_o, bias = out.weight.double(), out.bias.double()
    x = seen["x"][step].double()  # (B, Q, H*D): text part + s y
    q = heads_first(seen["q"][step], heads)
    v_out = seen["v"][step]
    batch = v_out.shape[0]
    v = heads_first(v_out.reshape(batch, -1, v_out.shape[-1]), heads)
    scale = float(layer.processor.scale[0])
    y = (expected["weights"] @ v).permute(0, 2, 1, 3).reshape(batch, q.shape[2], -1)  # (B, Q, H*D)
    base = (x - scale * y) @ w_o.T + bias  # the text branch and the bias
    if new_contributions is not None:
        return base + new_contributions.double().sum(1)
    y_new = (new_weights @ v).permute(0, 2, 1, 3).reshape(batch, q.shape[2], -1)
    return base + scale * y_new @ w_o.T


# --------------------------------------------------------------------------------------------------- patching


def test_patching_a_contribution_reproduces_the_source_runs_branch(organism, refs, other_refs):
    layer = layers_of(organism)[4]
    name = f"{layer.name}.ip.contribution"
    with Recorder(organism) as rec_a:
        out_a, cache_a = ipa_probe.run_with_cache(organism, CONTRIBUTIONS, **call(refs), generator=gen())
    plain_b = run(organism, **call(other_refs))
    with ipa_probe.intervene(organism, hooks=ipa_probe.patch_hooks(cache_a, [name]), steps=[0]) as state:
        with Recorder(organism) as rec_b:
            patched_b = run(organism, **call(other_refs))
    assert state.calls == [(0, name)]
    a_step0 = branch64(layer, rec_a.seen[layer.name], 0)["contribution"]
    # after patching, the layer's output in run B is B's text part and bias plus run A's image branch (float64 from
    # the test's own hooks in both runs; float32 rounding of the layer: 1e-5 of its largest entry)
    assert close(rec_b.seen[layer.name]["out"][0], expected_out(layer, rec_b.seen[layer.name], 0, None, a_step0), 1e-5)
    assert (patched_b - plain_b).abs().max() > 1e-4  # the image changes

    # one reference's slot only: B's output gains c_A0 - c_B0
    with ipa_probe.intervene(organism, hooks=ipa_probe.patch_hooks(cache_a, [name], steps=[0], references=0)):
        with Recorder(organism) as rec_c:
            run(organism, **call(other_refs))
    seen = rec_c.seen[layer.name]
    mixed = branch64(layer, seen, 0)["contribution"].clone()
    mixed[:, 0] = a_step0[:, 0]
    assert close(seen["out"][0], expected_out(layer, seen, 0, None, mixed), 1e-5)

    # every layer at every step: run B computes what run A computed (same seed, same prompt: only the image branch
    # differed); float32 rounding through three steps, 1e-4 of the largest entry
    with ipa_probe.intervene(organism, hooks=ipa_probe.patch_hooks(cache_a)):
        everywhere = run(organism, **call(other_refs))
    assert close(everywhere, out_a.images, 1e-4)
    assert not close(plain_b, out_a.images, 1e-2)
    # names as run_with_cache takes them: a point's own name, a regex string, a compiled regex, a filter, a list
    for names in (name, re.escape(layer.name) + r"\.ip\.", re.compile(re.escape(name)), lambda n: n == name, [name]):
        assert list(ipa_probe.patch_hooks(cache_a, names)) == [name]
    with pytest.raises(ValueError, match="list_hook_points"):
        ipa_probe.patch_hooks(cache_a, "nothing_cached_here$")


@pytest.mark.parametrize(("family", "points"), [("flux", ["contribution", "output"]), ("sd3", ["output"])])
def test_patching_every_layer_reproduces_the_source_run_on_dits(family, points, request, one_thread):
    """Run A's cached points patched into run B (another reference set, same seed and prompt) at every layer and step
    make B compute A's latents. On SD3 the ``output`` point (the whole branch, the latent tokens' part included): its
    ``contribution`` is the image tokens' part only, and the latent part's joint softmax runs over B's image keys."""
    pipe = request.getfixturevalue(family)
    photos = default_reference_images(3)

    def generate(images):  # Flux: both references; SD3: one image per prompt, the first
        image = [images] if family == "flux" else images[0]
        kwargs = dict(prompt="a", ip_adapter_image=image, num_inference_steps=2, height=64, width=64)
        return run(pipe, **kwargs, output_type="latent")

    plain_b = generate(photos[:2])
    for point in points:
        with ipa_probe.cache_hook_points(pipe, rf"\.ip\.{point}$") as cache:
            a = generate(photos[:0:-1])
        with ipa_probe.intervene(pipe, hooks=ipa_probe.patch_hooks(cache)):
            patched_b = generate(photos[:2])
        # float32 rounding through two steps, 1e-5 of the largest entry; the reference sets' latents differ
        assert close(patched_b, a, 1e-5) and not close(plain_b, a, 1e-2)


def gen():
    return torch.Generator().manual_seed(0)


# ------------------------------------------------------------------------------------------------ refusals


def test_bad_names_and_callbacks_are_refused_before_attaching(organism):
    before = snapshot(organism)
    name = next(n for n in ipa_probe.list_hook_points(organism) if n.endswith(".ip.weights"))
    with pytest.raises(ValueError, match=r"^hooks: unknown hook point 'nope\.ip\.weights'"):
        ipa_probe.intervene(organism, hooks={"nope.ip.weights": lambda t, c: None}).__enter__()
    with pytest.raises(ValueError, match="did you mean"):
        ipa_probe.intervene(organism, hooks={name.replace("weights", "weight"): lambda t, c: None}).__enter__()
    with pytest.raises(TypeError, match=r"^hooks\["):
        ipa_probe.intervene(organism, hooks={name: "not callable"}).__enter__()
    with pytest.raises(ValueError, match="drop \\['reference'\\]"):
        ipa_probe.intervene(organism, 0, hooks={name: lambda t, c: None}).__enter__()
    with pytest.raises(ValueError, match="^factor"):
        ipa_probe.intervene(organism, 0, mode="scale", factor=-0.5).__enter__()
    with pytest.raises(ValueError, match="^factor"):
        ipa_probe.intervene(organism, 0, factor=0.5).__enter__()
    with pytest.raises(ValueError, match="^names"):
        ipa_probe.cache_hook_points(organism, r"no_such_point").__enter__()
    assert_unchanged(organism, before)


@pytest.mark.parametrize(
    ("point", "edit", "match"),
    [
        ("weights", lambda t, c: t[:, :1], "returned a tensor of shape"),
        ("contribution", lambda t, c: t.double(), "torch.float64"),
        ("output", lambda t, c: 1.0, "returned float"),
    ],
)
def test_a_wrong_callback_result_is_refused_and_the_pipeline_restored(organism, refs, point, edit, match):
    before = snapshot(organism)
    name = f"{layers_of(organism)[0].name}.ip.{point}"
    with pytest.raises((ValueError, TypeError), match=match) as err:
        with ipa_probe.intervene(organism, hooks={name: edit}):
            run(organism, **call(refs))
    assert repr(name) in str(err.value) and "\n" not in str(err.value)
    assert_unchanged(organism, before)


def test_pipeline_restored_after_an_exception_in_a_callback(organism, refs, one_thread):
    before = snapshot(organism)
    plain = run(organism, **call(refs))

    def fail_at_step_one(tensor, ctx):
        if ctx.step == 1:
            raise KeyboardInterrupt
        return ctx.where(tensor, 0.0, heads=[0], positions=slice(0, 8), references=[1])

    name = f"{layers_of(organism)[-1].name}.ip.weights"
    with pytest.raises(KeyboardInterrupt):
        with ipa_probe.intervene(organism, hooks={name: fail_at_step_one}):
            with ipa_probe.cache_hook_points(organism, [name]):
                run(organism, **call(refs))
    assert_unchanged(organism, before)
    assert torch.equal(run(organism, **call(refs)), plain)


def test_cache_budget_is_checked_before_anything_is_stored(organism, refs):
    before = snapshot(organism)
    names = ipa_probe.list_hook_points(organism)
    with pytest.raises(ValueError, match="max_bytes=") as err:
        with ipa_probe.cache_hook_points(organism, names, max_bytes=1024) as cache:
            run(organism, **call(refs))
    assert cache.nbytes == 0 and "\n" not in str(err.value)
    assert_unchanged(organism, before)
    # the estimate is what the cache then holds (the sizes come from the call's arguments before step 0)
    estimate = {}
    with ipa_probe.cache_hook_points(organism, names, steps=[0, 2], max_bytes=2**40) as cache:
        run(organism, **call(refs))
        estimate = cache.nbytes
    assert cache.steps() == [0, 2] and estimate > 0
    with ipa_probe.cache_hook_points(organism, names, steps=[0, 2], max_bytes=estimate):  # exactly enough
        run(organism, **call(refs))
    with pytest.raises(ValueError, match="max_bytes="):
        with ipa_probe.cache_hook_points(organism, names, steps=[0, 2], max_bytes=estimate - 1):
            run(organism, **call(refs))


@pytest.mark.parametrize("steps", [[1, STEPS + 2], slice(STEPS, None)])
def test_steps_the_call_never_reached_are_an_error(organism, refs, steps):
    """A selection of loop indices a call never had would act on (or record) nothing: both the callbacks and the cache
    refuse it when the block ends, naming the steps the call ran; the pipeline comes back as it was."""
    before = snapshot(organism)
    name = f"{layers_of(organism)[-1].name}.ip.weights"
    seen = []
    with pytest.raises(ValueError, match=rf"selects loop indices the call did not have \(it ran {STEPS} steps"):
        with ipa_probe.intervene(organism, hooks={name: lambda t, ctx: seen.append(ctx.step)}, steps=steps):
            run(organism, **call(refs))
    assert set(seen) <= {1}
    with pytest.raises(ValueError, match=rf"it ran {STEPS} steps"):
        with ipa_probe.cache_hook_points(organism, [name], steps=steps):
            run(organism, **call(refs))
    assert_unchanged(organism, before)
    # within the call's steps, both accept, and a block without a call checks nothing
    with ipa_probe.intervene(organism, hooks={name: lambda t, ctx: None}, steps=[STEPS - 1]) as state:
        run(organism, **call(refs))
    assert state.steps_run == STEPS
    with ipa_probe.cache_hook_points(organism, [name], steps=[STEPS + 5]):
        pass


def test_selection_helpers(organism, refs):
    layer = layers_of(organism)[0]
    seen = {}

    def look(tensor, ctx):
        seen[ctx.point] = (tensor, ctx)

    names = {f"{layer.name}.ip.{point}": look for point in ("weights", "contribution", "output")}
    with ipa_probe.intervene(organism, hooks=names, steps=[0]):
        run(organism, **call(refs))
    weights, ctx = seen["weights"]
    assert ctx.step == 0 and ctx.references == len(refs) and ctx.heads == layer.heads
    assert ctx.grid[0] * ctx.grid[1] == weights.shape[2] and ctx.tokens * ctx.references == weights.shape[3]
    mask = ctx.select(heads=[1], positions=[0, 3], references=[2])
    assert mask.shape == (1, *weights.shape[1:])
    expected = torch.zeros(weights.shape[1:], dtype=torch.bool)
    expected[1, [0, 3], ctx.reference_tokens(2)] = True
    assert torch.equal(mask[0], expected)
    grid = torch.zeros(ctx.grid, dtype=torch.bool)
    grid[0, :2] = True
    assert torch.equal(ctx.select(positions=grid)[0, 0, :, 0], grid.reshape(-1))
    contribution, cctx = seen["contribution"]
    assert cctx.select(references=1).shape == (1, contribution.shape[1], contribution.shape[2], 1)
    with pytest.raises(ValueError, match="heads= selects heads of the q, k, logits and weights points"):
        cctx.select(heads=[0])
    with pytest.raises(ValueError, match="out of range"):
        ctx.select(heads=[layer.heads])


def test_measure_intervention_takes_the_scale_mode(organism, refs, one_thread):
    kwargs = {k: v for k, v in call(refs).items() if k != "output_type"}
    kwargs["num_inference_steps"] = 2
    nothing = ipa_probe.measure_intervention(organism, 1, mode="scale", factor=1.0, **kwargs)
    assert nothing.latent_distance.max() == 0 and nothing.config.factor == 1.0
    ablated = ipa_probe.measure_intervention(organism, 1, baseline=nothing.baseline, **kwargs)
    scaled = ipa_probe.measure_intervention(organism, 1, mode="scale", factor=0.0, baseline=nothing.baseline, **kwargs)
    # two routes to the same removal (float32 rounding through two steps and the VAE, see the test above)
    assert ablated.latent_distance.max() > 1e-2
    assert abs(scaled.latent_distance - ablated.latent_distance).max() < 1e-4 * ablated.latent_distance.max()


def test_zeroing_every_output_point_removes_the_image_branch(organism, refs):
    """The output point is all the branch adds: replacing it by zeros everywhere generates what the pipeline does with
    the adapter scale at 0 (computed by diffusers itself, which then skips the branch)."""
    names = [n for n in ipa_probe.list_hook_points(organism) if n.endswith(".ip.output")]
    with ipa_probe.intervene(organism, hooks={n: lambda t, ctx: torch.zeros_like(t) for n in names}):
        zeroed = run(organism, **call(refs))
    scale = float(layers_of(organism)[0].processor.scale[0])
    assert all(float(layer.processor.scale[0]) == scale for layer in layers_of(organism))
    organism.set_ip_adapter_scale(0.0)
    try:
        without = run(organism, **call(refs))
    finally:
        organism.set_ip_adapter_scale(scale)
    # W_o (x - s y) + b computed as W_o x + b - s W_o y: float32 rounding through three steps
    assert close(zeroed, without, 1e-4)
    assert not close(run(organism, **call(refs)), without, 1e-2)


def test_flux_true_cfg_passes_share_a_step(flux):
    from ipa_probe.tiny.sd import default_reference_images

    name = ipa_probe.list_hook_points(flux)[0]
    seen = []
    kwargs = dict(
        prompt="a",
        negative_prompt="b",
        true_cfg_scale=2.0,
        ip_adapter_image=[default_reference_images(1)],
        negative_ip_adapter_image=[default_reference_images(1)],
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="latent",
    )
    tensors = []

    def note(t, ctx):
        seen.append((ctx.step, ctx.pass_index))
        tensors.append(t.clone())

    with ipa_probe.intervene(flux, hooks={name: note}):
        run(flux, **kwargs)
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the cache keeps both passes of a step, and spans two calls of one block
    with ipa_probe.cache_hook_points(flux, [name]) as cache:
        run(flux, **kwargs)
        run(flux, **kwargs)
    assert cache.calls == 2 and cache[name].shape[0] == 8
    for call in (0, 1):
        for (step, pass_index), tensor in zip(seen, tensors, strict=True):
            assert torch.equal(cache.get(name, step, call=call, pass_index=pass_index), tensor)
    assert ipa_probe.list_hooks(flux) == []
