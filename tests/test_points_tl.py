"""Hook points the way TransformerLens users write them (issue 38 point 3): hooks as a list of (name, fn) pairs or a
dict, names chosen by a regex or a filter, a cache of every point read as ``cache[name]``, ``cache[point, layer]``,
``cache.get(name, step)`` and ``.items()``, the q, k and logits points and the text branch, checked against the
test's own float64 hooks."""

from __future__ import annotations

import math
import re

import pytest
import torch

import ipa_probe
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

STEPS = 2
LAYER = "up_blocks.1.attentions.0.transformer_blocks.0.attn2"


@pytest.fixture(scope="module")
def refs():
    return digits_reference_images(3, 1, seed=100) + digits_reference_images(5, 1, seed=200)


def call(refs, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("guidance_scale", 1.0)
    return dict(prompt=DIGITS_PROMPT, ip_adapter_image=[list(refs)], output_type="latent", **kwargs)


def latents(pipe, refs, **kwargs):
    return pipe(**call(refs, **kwargs), generator=torch.Generator().manual_seed(0)).images


def test_hooks_as_pairs_regex_and_filter(organism, refs):
    seen = []

    def note(tag):
        def fn(t, ctx):
            seen.append((tag, ctx.name))

        return fn

    hooks = [
        (f"{LAYER}.ip.weights", note("name")),
        (re.compile(r"mid_block.*\.ip\.output$"), note("regex")),
        (lambda name: name.endswith(".text.logits") and name.startswith("down_blocks.0"), note("filter")),
    ]
    with ipa_probe.intervene(organism, hooks=hooks) as state:
        latents(organism, refs)
    tags = {tag for tag, _ in seen}
    assert tags == {"name", "regex", "filter"}
    assert all(name.startswith("mid_block") for tag, name in seen if tag == "regex")
    assert len(state.calls) == len(seen)
    with pytest.raises(ValueError, match="selects no hook point"):
        ipa_probe.intervene(organism, hooks=[(re.compile("nothing_here"), note("x"))]).__enter__()
    with pytest.raises(TypeError, match="list of \\(name, fn\\) pairs"):
        ipa_probe.intervene(organism, hooks=[f"{LAYER}.ip.weights"]).__enter__()
    assert ipa_probe.list_hooks(organism) == []


def test_cache_of_everything(organism, refs):
    out, cache = ipa_probe.run_with_cache(organism, **call(refs))
    names = ipa_probe.list_hook_points(organism)
    assert cache.keys() == names
    items = dict(cache.items())
    assert list(items) == names
    name = f"{LAYER}.text.weights"
    assert cache[name].shape[0] == STEPS
    assert torch.equal(cache.get(name, 1), cache[name][1])
    # a tuple key is TransformerLens' (point, layer): the layer's index in the order the denoiser runs them
    layers = [n.removesuffix(".ip.weights") for n in names if n.endswith(".ip.weights")]
    assert torch.equal(cache["weights", 2], cache[f"{layers[2]}.ip.weights"])
    assert torch.equal(cache["text.k", -1], cache[f"{layers[-1]}.text.k"])
    with pytest.raises(TypeError, match=r"cache.get\(name, step\)"):
        cache[name, 1]
    with pytest.raises(KeyError, match="recorded layer"):
        cache["weights", len(layers)]


def test_records_of_other_shapes_are_refused_naming_get(organism, refs):
    """A cache over calls with other references (or Flux's true-CFG negative pass) holds records of two shapes:
    ``cache[name]`` refuses to stack them and names ``cache.get``, which reads each."""
    name = f"{LAYER}.ip.weights"
    with ipa_probe.cache_hook_points(organism, name, steps=[0]) as cache:
        organism(**call(refs))
        organism(**call(refs[:1]))
    assert cache.get(name, 0, call=0).shape[-1] == 2 * cache.get(name, 0, call=1).shape[-1]
    with pytest.raises(ValueError, match=r"do not stack; use cache\.get\(name, step\)"):
        cache[name]


def test_names_are_strings_or_patterns_everywhere(organism, refs):
    """A plain string that is no point's name is a regex searched in the names, in hooks= as in the cache."""
    seen = []
    with ipa_probe.intervene(organism, hooks={r"\.ip\.weights$": lambda w, c: seen.append(c.name)}, steps=[0]):
        _, cache = ipa_probe.run_with_cache(organism, re.compile(r"\.ip\.weights$"), steps=[0], **call(refs))
    expected = [n for n in ipa_probe.list_hook_points(organism) if n.endswith(".ip.weights")]
    assert seen == expected and cache.keys() == expected
    with pytest.raises(ValueError, match="unknown hook point"):
        ipa_probe.intervene(organism, hooks={"no_such_layer.ip.weights": lambda w, c: None}).__enter__()
    assert ipa_probe.list_hooks(organism) == []


def own_branch(pipe, name):
    """The test's own float64 reading of one layer: q, text keys, image keys and values, per pass."""
    attn = pipe.unet.get_submodule(name)
    heads = attn.heads
    seen = {"q": [], "k": [], "v": [], "k_ip": []}

    def split(x):  # (B, N, H * D) -> (B, H, N, D)
        return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2).double()

    def keep(key):
        def hook(module, args, output):
            seen[key].append(split(output.reshape(output.shape[0], -1, output.shape[-1])))

        return hook

    handles = [
        attn.to_q.register_forward_hook(keep("q")),
        attn.to_k.register_forward_hook(keep("k")),
        attn.to_v.register_forward_hook(keep("v")),
        attn.processor.to_k_ip[0].register_forward_hook(keep("k_ip")),
    ]
    return seen, handles


def test_q_k_logits_and_text_points_match_the_tests_own_hooks(organism, refs):
    seen, handles = own_branch(organism, LAYER)
    try:
        with ipa_probe.cache_hook_points(organism, re.escape(LAYER)) as cache:
            latents(organism, refs)
    finally:
        for handle in handles:
            handle.remove()

    def close(a, b, tol):
        return (a.double() - b).abs().max() <= tol * b.abs().max()

    for step in range(STEPS):
        q, k, v, k_ip = (seen[key][step] for key in ("q", "k", "v", "k_ip"))
        scale = 1 / math.sqrt(q.shape[-1])
        # float32 projections and products over <= 64 channels against float64: ~1e-6 relative; 1e-5 is margin
        assert close(cache.get(f"{LAYER}.ip.q", step), q, 1e-5)
        assert close(cache.get(f"{LAYER}.ip.k", step), k_ip, 1e-5)
        assert close(cache.get(f"{LAYER}.text.k", step), k, 1e-5)
        assert close(cache.get(f"{LAYER}.ip.logits", step), q @ k_ip.transpose(-1, -2) * scale, 1e-5)
        text = (q @ k.transpose(-1, -2) * scale).softmax(-1)  # (B, H, Q, 77)
        assert close(cache.get(f"{LAYER}.text.weights", step), text, 1e-5)
        w_o = organism.unet.get_submodule(LAYER).to_out[0].weight.double()  # (C, H * D)
        y = (text @ v).transpose(1, 2).flatten(2)  # (B, Q, H * D)
        assert close(cache.get(f"{LAYER}.text.output", step), y @ w_o.T, 1e-5)


def test_text_branch_edits_reach_the_output(organism, refs):
    plain = latents(organism, refs)
    same_weights = {f"{LAYER}.text.logits": lambda t, ctx: t + 3.0}  # a per-row constant: the same softmax
    with ipa_probe.intervene(organism, hooks=same_weights):
        shifted = latents(organism, refs)
    # 1e-4: the edited path re-forms the text branch's output in float32 (different summation order)
    torch.testing.assert_close(shifted, plain, rtol=1e-4, atol=1e-4)
    with ipa_probe.intervene(organism, hooks={f"{LAYER}.text.output": lambda t, ctx: torch.zeros_like(t)}):
        silenced = latents(organism, refs)
    with ipa_probe.intervene(organism, hooks={f"{LAYER}.text.q": lambda t, ctx: 4 * t}):
        sharper = latents(organism, refs)
    assert not torch.allclose(silenced, plain, atol=1e-3) and not torch.allclose(sharper, plain, atol=1e-3)


def test_context_carries_the_cfg_labels(organism, refs):
    labels = []

    def read(t, ctx):
        labels.append((ctx.cfg, t.shape[0], ctx.adapter))

    with ipa_probe.intervene(organism, hooks={f"{LAYER}.ip.weights": read, f"{LAYER}.text.q": read}):
        latents(organism, refs, guidance_scale=3.0)
        latents(organism, refs, guidance_scale=1.0)
    guided, plain = labels[: 2 * STEPS], labels[2 * STEPS :]
    assert {entry[:2] for entry in guided} == {(("uncond", "cond"), 2)}
    assert {entry[:2] for entry in plain} == {(("cond",), 1)}
    assert {entry[2] for entry in labels} == {0, "text"}
