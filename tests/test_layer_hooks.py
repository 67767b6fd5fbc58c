"""One set of per-layer hooks (:class:`ipa_probe.capture.spine.LayerHooks`): every feature reads and edits a layer's
modules through the same hooks, at most one forward pre-hook and one forward hook a module, in one order."""

from __future__ import annotations

import torch
from test_intervention import assert_unchanged, call, latents, snapshot

import ipa_probe
from ipa_probe.capture.spine import EDIT, LayerHooks
from ipa_probe.tiny.digits import digits_reference_images


def test_edits_run_before_readers_and_the_hook_goes_with_its_last_callback():
    linear = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    hooks, seen = LayerHooks(), []
    read = hooks.add(linear, lambda module, args, output: seen.append(output.clone()))  # added first, runs last
    twice = hooks.add(linear, lambda module, args, output: output * 2, order=EDIT)
    shifted = hooks.add(linear, lambda module, args, kwargs: ((args[0] + 1,), kwargs), pre=True, order=EDIT)
    assert len(linear._forward_hooks) == 1 and len(linear._forward_pre_hooks) == 1
    with torch.no_grad():
        out = linear(x)
        expected = 2 * ((x + 1) @ linear.weight.T + linear.bias)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=1e-6)  # the reader saw the edited output
    for handle in (twice, shifted, shifted, read):  # removal is idempotent
        handle.remove()
    assert not linear._forward_hooks and not linear._forward_pre_hooks


def test_every_feature_at_once_puts_one_hook_of_each_kind_on_a_module(organism):
    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    before = snapshot(organism)
    weights = r"\.ip\.weights$"
    with (
        ipa_probe.probe(organism, maps=True),
        ipa_probe.intervene(organism, 1),
        ipa_probe.cache_hook_points(organism, weights),
        ipa_probe.intervene(organism, hooks={weights: lambda w, ctx: None}),
    ):
        hooked = [m for m in organism.unet.modules() if m._forward_hooks or m._forward_pre_hooks]
        assert all(len(m._forward_hooks) <= 1 and len(m._forward_pre_hooks) <= 1 for m in hooked)
        layer = ipa_probe.find_ip_layers(organism)[0]
        to_k_ip, to_v_ip = layer.processor.to_k_ip[0], layer.processor.to_v_ip[0]
        # the probe's taps, its maps, the points and the ablation all read or edit these
        for module in (to_k_ip, to_v_ip, layer.attention, layer.attention.to_q, layer.attention.to_out[0]):
            assert module in hooked
        assert to_k_ip._forward_pre_hooks and to_v_ip._forward_pre_hooks  # the ablation's token edits
        latents(organism, **call(refs))
    assert_unchanged(organism, before)
