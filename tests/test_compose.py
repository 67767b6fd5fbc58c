"""Features composed on one pipeline (issues 38, 49): the probe measures the weights the layer used inside an
intervention, under an NW head it reads that head's weights, nested interventions compose as if given at once, the
denoiser carries one pre-hook however many features are attached, and a generated matrix of every pair of features
in both orders and of triples on SD 1.5, SDXL, Flux and SD3 computes in every order what its edits compute alone,
reads what the test's own q, keys and values say (the probe's maps, contribution columns and, maps off, its table of
statistics; the cache's weights and contributions; attribution's shares; gauge_sweep's reference masses; SD3's image
share) and restores the pipeline bit for bit; attribution and gauge_sweep inside an open probe return what they
return alone, and the open probe reads their calls as alone.

Triples: the thirteen features of each pipeline (the probe with maps on and off, the cache, ablate, scale, a custom
hook, swap, patch, the NW head in both frames, the q/k gauge, and two calls, gauge_sweep and attribution, only
innermost) allow 1,066 ordered triples on each, each a test of several pipeline calls. Pairs already show each
feature beside each other one; what a third adds is position: a feature wrapped by another with a third between
them, or standing between two (the nested-ablation bug of issue 49 showed with a probe between two ablations). So the
default run takes a covering array: each ordered pair of features that may run together stands in each of the three
position pairs (outer-middle, outer-inner, middle-inner) of some triple. The greedy construction takes 138 of the
1,066 on SD 1.5, SDXL and Flux and 142 on SD3 (its features in another order), the same every run: 556 triples.
``IPA_PROBE_FULL_MATRIX=1`` (``make test-matrix``) runs every one of the 4,264 instead, about eight times the
default's triples; all passed, one process per pipeline, two or three at once on a 2-core machine at load average 7
to 11: SD 1.5's 1,066 in 2,173 s, SDXL's in 1,635 s, SD3's in 1,546 s, Flux's in 1,205 s. A case costs about 2.6
pipeline calls (the order, the order failing after its first step, the plain call); a tiny pipeline's call is bound
by the per-module cost of eager PyTorch, not by its size, so an SDXL case (CFG, two text encoders, added time ids)
costs most. The maps-off probe on Flux and SD3 added 11 pairs and 24 triples to each, and with the readings of the
cache, the contributions and the maps-off table the default run of this module took 1,914 s against 1,755 s before them
(+9 %, the two side by side in one process each on that machine; 523 s before them at load 1.5). With the query-frame
columns read too, its 865 tests took 1,633 s in one process at load average 10 to 28 (not set against a run without
them: the machine's load moved too much to tell their cost); every ordered triple with them passed on all four:
Flux's 1,066 in 1,169 s (load 14 to 18), SD3's in 730 s (load 8 to 12), SD 1.5's in 968 s and SDXL's in 1,125 s (one
process each, beside a CI run). With the test's own references computed once per distinct inputs, two processes at
a time at load about 2: SD 1.5's in 208 s, SDXL's in 242 s, Flux's in 189 s, SD3's in 195 s.

Features a pipeline lacks are no features there. The patch on Flux and SD3 comes from a cache of the call with other
references (Flux: the two swapped; SD3: the swap image), as on the UNets. SD3's scale acts on its one reference, and
its readings under it are the test's own joint softmax with ``log f`` added to the image logits. Pairs refused by
design (the stored-frame NW head and a gauge, one gauge inside another) are checked to raise, in either order.

The reference weights are the test's own: forward hooks on the modules that return the image branch's query, keys
and values (after the intervention's edit of the tokens, i.e. the very keys the layer's softmax runs over: UNets
``attn.to_q``, ``to_k_ip`` and ``to_v_ip``; Flux ``attn.norm_q``, ``to_k_ip`` and ``to_v_ip``; SD3 the processor's
``norm_q``, ``norm_k``, ``norm_ip_k`` and ``to_v_ip``), the softmax (or an NW head's kernel) taken here in float64; on
SD3 over the latent and image keys together, as the layer does, the image columns renormalised (what the probe keeps)
and their mass (its ``ip_mass``). The contributions are ``s W_o sum_{i in j} w_i v_i`` from those weights and values
(Flux: no ``W_o``), the patched reference's from the test's own hooks in the patch's source run; the maps-off probe's
table is held to ``test_probe_matrix.reference_cell`` (numpy and scipy) of the same q, keys and weights, and its
every ``qf_*`` column to ``test_query_frame.frame_cells`` of those weights' logarithm (the query frame depends on the
logits alone): inside the query-frame NW head, whose weights are already that frame's, the frame's exact key term is
constant, so ``qf_logit_ratio`` is undefined (NaN) and the baseline 1, which the probe read as float32 rounding
(r ~2e7) before issue 49's matrix held it here."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import math
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
from test_contributions import CONTRIBUTION_COLUMNS, own_numbers
from test_probe_matrix import reference_cell
from test_query_frame import check as check_frame
from test_query_frame import frame_cells

import ipa_probe
from ipa_probe.capture.spine import spine_of
from ipa_probe.intervention import intervene
from ipa_probe.layers import find_ip_layers
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

STEPS = 2


@pytest.fixture(scope="module")
def refs():
    return refs_of(3, 5)


def latents(pipe, refs, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("guidance_scale", 1.0)
    return pipe(
        DIGITS_PROMPT,
        ip_adapter_image=[list(refs)],
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        **kwargs,
    ).images


def dot_softmax(q, k):  # (B, H, Q, D), (B, H, K, D) -> (B, H, Q, K): the layer's own weights
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)


def stored_frame(q, k):
    """The stored-frame NW head's weights at its matched bandwidth ``h^2 = sqrt(d)``: softmax of -|q - k|^2 / 2h^2."""
    distances = ((q.unsqueeze(-2) - k.unsqueeze(-3)) ** 2).sum(-1)  # (B, H, Q, K)
    return (-distances / (2 * math.sqrt(q.shape[-1]))).softmax(-1)


def query_frame(q, k):
    """The query-frame NW head's weights: ``softmax_i(L_qi - b_i)`` with ``L`` the logits centred per row and
    ``b_i = log mean_q exp(L_qi)`` over the item's queries (the head's "exact" form)."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    centred = logits - logits.mean(-1, keepdim=True)
    b = centred.logsumexp(-2, keepdim=True) - math.log(centred.shape[-2])  # (B, H, 1, K)
    return (centred - b).softmax(-1)


class Readings(list):
    """The test's own weights of one layer, one ``(B, H, Q, K)`` per pass that ran its image branch, with that pass's
    index among the denoiser's calls in ``passes``, its query and image keys ``(B, H, Q, D)``, ``(B, H, K, D)`` in
    ``qk``, its image values ``(B, H, K, D)`` in ``values`` and, on SD3, the joint softmax's mass on the image tokens
    ``(B, H, Q)`` in ``shares``."""

    def __init__(self):
        super().__init__()
        self.passes, self.shares, self.qk, self.values = [], [], [], []


def restricted(joint, tokens):  # (B, H, Q, N + K) -> the image columns renormalised, and their mass (B, H, Q)
    image = joint[..., -tokens:]
    mass = image.sum(-1)
    return image / mass.unsqueeze(-1), mass


@contextlib.contextmanager
def own_weights(pipe, name, kernel=dot_softmax):
    """The test's own reading of one layer's image-branch weights, float64 ``kernel(q, k)`` (by default the softmax of
    ``q k^T / sqrt(d)``) over the keys the branch's softmax runs over, read by forward hooks on the modules that
    return them (after any edit of the tokens). UNets: ``attn.to_q`` and ``to_k_ip[0]``; Flux: ``attn.norm_q`` (the
    branch's query, before RoPE) and ``to_k_ip[0]``; SD3: the processor's ``norm_q``, ``norm_k`` (the latent keys)
    and ``norm_ip_k``: one joint kernel over ``[latent keys; image keys]`` as the layer forms it, whose image columns,
    renormalised, are the weights (and their mass the image share)."""
    layer = next(found for found in find_ip_layers(pipe) if found.name == name)
    attn, processor, heads = layer.attention, layer.processor, layer.heads
    seen, found = {"pass": -1}, Readings()

    def split(x):  # (B, N, H * D) -> (B, H, N, D)
        return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2).double()

    def count(module, args, kwargs):
        seen["pass"] += 1

    def keep(key, shape):
        def hook(module, args, output):
            seen[key] = shape(output)

        return hook

    def keys(module, args, output):
        q = seen["q"]
        found.passes.append(seen["pass"])
        if layer.family == "sd3":  # (B, H, K, D) image keys after the processor's norm
            k = output.double()
            weights, mass = restricted(kernel(q, torch.cat([seen["k"], k], dim=2)), k.shape[2])
            found.shares.append(mass)
        else:
            k = split(output.reshape(q.shape[0], -1, output.shape[-1]))
            weights = kernel(q, k)
        found.append(weights)
        found.qk.append((q, k))

    def values(module, args, output):  # (B, K, H * D), before the heads are split
        found.values.append(split(output))

    if layer.family == "sd3":
        taps = [(processor.norm_q, keep("q", torch.Tensor.double)), (processor.norm_k, keep("k", torch.Tensor.double))]
        taps += [(processor.norm_ip_k, keys), (processor.to_v_ip, values)]
    else:
        shape = (lambda x: x.transpose(1, 2).double()) if layer.family == "flux" else split  # (B, N, H, D) on Flux
        taps = [(attn.norm_q if layer.family == "flux" else attn.to_q, keep("q", shape))]
        taps += [(processor.to_k_ip[0], keys), (processor.to_v_ip[0], values)]
    handles = [module.register_forward_hook(hook) for module, hook in taps]
    handles.append(denoiser(pipe).register_forward_pre_hook(count, with_kwargs=True))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


LAYER = "up_blocks.1.attentions.0.transformer_blocks.0.attn2"


def probe_weights(run, step, name=LAYER, call=0):
    """The probe's kept map (float16 weights) of one layer at one step, as float64."""
    return torch.cat([m.double() for m in run.maps[(call, step, name, 0)]])


# ------------------------------------------------------------------------------------------------------ the probe


@pytest.mark.parametrize("reference", [0, 1])
@pytest.mark.parametrize("probe_first", [True, False])
def test_probe_inside_an_ablation_reads_the_weights_the_layer_used(organism, refs, reference, probe_first):
    probe = ipa_probe.probe(organism, keep_maps=True, maps=True)
    ablation = intervene(organism, reference, steps=[1])
    with own_weights(organism, LAYER) as own:
        with contextlib.ExitStack() as stack:
            first, second = (probe, ablation) if probe_first else (ablation, probe)
            entered = [stack.enter_context(first), stack.enter_context(second)]
            latents(organism, refs)
    run = entered[0] if probe_first else entered[1]
    tokens = own[0].shape[-1] // 2
    # step 0: untouched, both references in the keys; step 1: the ablated one is gone from the layer's softmax
    assert own[0].shape[-1] == 2 * tokens and own[1].shape[-1] == tokens
    expected = own[1].new_zeros(*own[1].shape[:-1], 2 * tokens)
    kept = 1 - reference
    expected[..., kept * tokens : (kept + 1) * tokens] = own[1]
    # 2e-3: the probe keeps its maps in float16 (11-bit mantissa: 5e-4 relative on weights below 1)
    torch.testing.assert_close(probe_weights(run, 1), expected, rtol=0, atol=2e-3)
    torch.testing.assert_close(probe_weights(run, 0), own[0], rtol=0, atol=2e-3)
    mass = run.reference_mass()
    ablated = mass[(mass.step == 1) & (mass.reference == reference)]
    assert len(ablated) and (ablated.attention == 0).all() and (ablated.nw == 0).all()
    assert (mass[(mass.step == 0) & (mass.reference == reference)].attention > 0).all()


@pytest.mark.parametrize("factor", [0.0, 0.5, 3.0])
def test_probe_inside_a_scale_reads_the_scaled_weights(organism, refs, factor):
    with own_weights(organism, LAYER) as own:
        with ipa_probe.probe(organism, keep_maps=True) as run, intervene(organism, 0, mode="scale", factor=factor):
            latents(organism, refs)
    tokens = own[0].shape[-1] // 2
    scale = torch.ones(2 * tokens, dtype=torch.float64)
    scale[:tokens] = factor
    for step in range(STEPS):
        expected = own[step] * scale
        expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(probe_weights(run, step), expected, rtol=0, atol=2e-3)  # float16 maps


def test_probe_table_records_the_active_edits(organism, refs):
    with ipa_probe.probe(organism) as run:
        with intervene(organism, 1, steps=[1]), intervene(organism, 0, mode="scale", factor=2.0):
            latents(organism, refs)
    table = run.to_dataframe()
    by_step = table.groupby("step")["edits"].unique()
    assert list(by_step[0]) == ["scale:0:0:2"]
    assert list(by_step[1]) == ["ablate:0:1;scale:0:0:2"]


@pytest.mark.parametrize("frame", ["query", "stored"])
@pytest.mark.parametrize("probe_first", [True, False])
def test_probe_under_an_nw_head_reads_rho_1(organism, refs, frame, probe_first):
    probe = ipa_probe.probe(organism, rows=None)
    head = ipa_probe.nw_head(organism, frame=frame)
    with contextlib.ExitStack() as stack:
        first, second = (probe, head) if probe_first else (head, probe)
        entered = [stack.enter_context(first), stack.enter_context(second)]
        latents(organism, refs)
    run = entered[0] if probe_first else entered[1]
    table = run.to_dataframe()
    column = "qf_spearman" if frame == "query" else "spearman"
    # the mid block's grid is one query per item: the query frame's key term is then that query's own logits, every
    # weight equal and rho undefined (NaN in both frames' columns there, with or without the head)
    defined = table[~table["layer"].astype(str).str.startswith("mid_block")]
    # 1e-6: float32 ranks of equal weights (the head's logits are the probe's NW logits up to a per-row constant)
    assert len(defined) and (defined[column] > 1 - 1e-6).all(), defined[column].min()


# ------------------------------------------------------------------------------------------------------ nesting


def test_nested_scales_apply_in_order(organism, refs):
    with intervene(organism, 0, mode="scale", factor=0.25):
        once = latents(organism, refs)
    seen = []

    def read(weights, ctx):
        seen.append(weights[..., ctx.reference_tokens(0)].sum(-1).mean().item())

    name = f"{LAYER}.ip.weights"
    with ipa_probe.probe(organism):
        with intervene(organism, 0, mode="scale", factor=0.5), intervene(organism, 0, mode="scale", factor=0.5):
            with intervene(organism, hooks={name: read}):
                twice = latents(organism, refs)
    # 1e-5: two renormalisations in float32 against one (same weights up to rounding)
    torch.testing.assert_close(twice, once, rtol=1e-5, atol=1e-5)
    with intervene(organism, hooks={name: read}):
        latents(organism, refs)
    plain_share, scaled_share = seen[STEPS], seen[0]
    assert scaled_share < plain_share  # the reader attached last sees both scales applied


@pytest.fixture(scope="module")
def three():
    return refs_of(3, 5, 7)


def refs_of(*digits):
    return [digits_reference_images(d, 1, seed=100 * i)[0] for i, d in enumerate(digits, 1)]


@pytest.mark.parametrize(
    ("outer", "inner", "together"),
    [(0, 1, [0, 1]), (1, 0, [0, 1]), (0, 2, [0, 2]), (2, [0, 1], [0, 1, 2]), ([0, 1], 1, [0, 1])],
)
def test_nested_ablations_compose_as_given_at_once(organism, three, outer, inner, together):
    """References are the call's whatever the nesting: the inner block removes what its index names in the call's
    list, not in what the outer block left; a probe between them reports the references the layer kept."""
    with intervene(organism, together):
        expected = latents(organism, three)
    with intervene(organism, outer), ipa_probe.probe(organism, maps=True) as run, intervene(organism, inner):
        got = latents(organism, three)
    assert torch.equal(got, expected)
    removed = set(together)
    if len(removed) == 3:  # every reference removed: the branch's values are zero, its weights read nothing
        return
    mass = run.reference_mass()
    assert sorted(mass.reference.unique()) == [0, 1, 2]  # every reference of the call, the removed ones at 0
    assert (mass[mass.reference.isin(removed)].attention == 0).all()
    left = mass[~mass.reference.isin(removed)].groupby(["step", "layer"], observed=True).attention.sum()
    # 1e-5: float32 sums of the shares the probe formed over the kept keys
    assert len(left) and ((left - 1).abs() < 1e-5).all()


def test_nested_swap_indexes_the_calls_references(organism, three):
    other = digits_reference_images(8, 1, seed=900)[0]
    with intervene(organism, 0), intervene(organism, 2, mode="swap", other=other):
        nested = latents(organism, three)
    swapped = [three[0], three[1], other]
    with intervene(organism, 0):
        expected = latents(organism, swapped)
    # 1e-5: the pipeline encodes the swapped-in image in a batch of one here and of three there
    torch.testing.assert_close(nested, expected, rtol=1e-5, atol=1e-5)


def test_steps_take_timesteps_or_a_predicate(organism, refs):
    """``steps=`` by timestep (a predicate or ``Timesteps``) acts where the loop indices with those timesteps do."""
    from ipa_probe.intervention import Timesteps

    organism.scheduler.set_timesteps(3)
    timesteps = [float(t) for t in organism.scheduler.timesteps]
    late = [i for i, t in enumerate(timesteps) if t > 500]
    assert 0 < len(late) < 3
    with intervene(organism, 0, steps=late):
        expected = latents(organism, refs, num_inference_steps=3)
    with intervene(organism, 0, steps=lambda step, t: t > 500) as state:
        by_predicate = latents(organism, refs, num_inference_steps=3)
    with intervene(organism, 0, steps=Timesteps([timesteps[i] for i in late])):
        by_values = latents(organism, refs, num_inference_steps=3)
    with intervene(organism, 0, steps=Timesteps(low=math.nextafter(500, 1000))):
        by_bounds = latents(organism, refs, num_inference_steps=3)
    assert sorted({step for step, _ in state.acted}) == late
    assert all(torch.equal(got, expected) for got in (by_predicate, by_values, by_bounds))
    name = f"{LAYER}.ip.weights"
    with ipa_probe.cache_hook_points(organism, [name], steps=Timesteps(low=501)) as cache:
        latents(organism, refs, num_inference_steps=3)
    assert cache.steps() == late
    with pytest.raises(ValueError, match="selected no pass"):
        with intervene(organism, 0, steps=Timesteps(high=-1)):
            latents(organism, refs)
    with ipa_probe.probe(organism, steps=lambda step, t: t > 500) as run:  # the probe takes them too
        latents(organism, refs, num_inference_steps=3)
    assert sorted(run.to_dataframe()["step"].unique()) == late
    with pytest.raises(ValueError, match="Timesteps"):
        Timesteps()
    assert ipa_probe.list_hooks(organism) == []


def test_hook_blocks_nest_as_one(organism, refs):
    """Two ``intervene(hooks=...)`` blocks (a patch, then a custom hook) run their callbacks as one block given both
    in that order; and a cache block spans two pipeline calls."""
    name = f"{LAYER}.ip.contribution"
    with ipa_probe.cache_hook_points(organism, [name]) as cache:
        latents(organism, refs[::-1])  # the source run: the references the other way round
        source = latents(organism, refs[::-1])
    assert cache.calls == 2 and cache[name].shape[0] == 2 * STEPS
    assert torch.equal(cache.get(name, 1, call=0), cache.get(name, 1, call=1))  # one seed, one computation

    def halve(c, ctx):
        return c * 0.5

    patch = ipa_probe.patch_hooks(cache, [name], references=0)
    with intervene(organism, hooks={name: [patch[name], halve]}):
        together = latents(organism, refs)
    with intervene(organism, hooks=patch), intervene(organism, hooks={name: halve}):
        nested = latents(organism, refs)
    assert torch.equal(nested, together) and not torch.equal(nested, source)
    assert ipa_probe.list_hooks(organism) == []


def test_gauge_tools_inside_a_cache_block(organism, refs):
    from ipa_probe.gauge import gauge_sweep

    name, gauges = f"{LAYER}.ip.k", "1,adversarial:down:4"
    alone = gauge_sweep(organism, lambda: latents(organism, refs), gauges, layers=LAYER)
    with ipa_probe.cache_hook_points(organism, [name]) as plain:
        latents(organism, refs)
    with ipa_probe.cache_hook_points(organism, [name]) as cache:
        table = gauge_sweep(organism, lambda: latents(organism, refs), gauges, layers=LAYER)
    pd.testing.assert_frame_equal(table, alone, check_exact=True)
    # the reference call (the plain call's keys), the adversarial search's call, the gauged call (gauged keys)
    assert cache.calls == 3 and ipa_probe.list_hooks(organism) == []
    assert all(torch.equal(cache.get(name, step, call=0), plain.get(name, step)) for step in range(STEPS))
    assert not torch.equal(cache.get(name, 0, call=2), plain.get(name, 0))


# attribution and gauge_sweep open a probe of their own; inside an open probe it is a second client of the same core:
# what they return is what they return alone, and the open probe records the calls they run as a probe alone would


def attribute(pipe, refs, **extra):
    from ipa_probe.attribution import reference_attribution

    call = dict(prompt=DIGITS_PROMPT, ip_adapter_image=[list(refs)], num_inference_steps=STEPS, guidance_scale=3.0)
    return reference_attribution(pipe, steps=[0, 1], **call, **extra), call


def denoiser(pipe):
    return getattr(pipe, "unet", None) or pipe.transformer


def parameters(pipe):
    """The denoiser's parameters, flattened into one new tensor (one comparison checks them all)."""
    return torch.cat([p.detach().reshape(-1) for p in denoiser(pipe).parameters()])


def assert_same_run(run, alone):
    """Two probes read the same: their tables and kept maps, bit for bit."""
    pd.testing.assert_frame_equal(run.to_dataframe(), alone.to_dataframe(), check_exact=True)
    assert run.maps.keys() == alone.maps.keys()
    assert all(torch.equal(torch.cat(run.maps[k]), torch.cat(alone.maps[k])) for k in run.maps)


def test_attribution_joins_an_open_probe(organism, refs):
    from ipa_probe.intervention import generate

    alone, call = attribute(organism, refs)
    before = snapshot(organism)
    with own_weights(organism, LAYER) as own, ipa_probe.probe(organism, keep_maps=True) as outer:
        joined, _ = attribute(organism, refs)
    assert_unchanged(organism, before)
    for name in ("table", "heads", "positions", "head_positions"):
        pd.testing.assert_frame_equal(getattr(joined, name), getattr(alone, name), check_exact=True)
    assert torch.equal(joined.generation.latents, alone.generation.latents)
    assert all(torch.equal(joined.samples[step], alone.samples[step]) for step in alone.samples)
    assert_same_run(joined.run, alone.run)
    with ipa_probe.probe(organism, keep_maps=True) as single:
        generate(organism, seed=0, **call)
    assert_same_run(outer, single)
    for step in range(STEPS):  # the open probe's maps against the test's own float64 softmax (float16 maps: 2e-3)
        torch.testing.assert_close(probe_weights(outer, step), own[step], rtol=0, atol=2e-3)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_probe_and_gauge_sweep_join_an_open_probe_on_dits(family, refs, request, one_thread):
    """On Flux (true CFG) and SD3: a probe and gauge_sweep inside an open probe read and return what they do alone,
    and the open probe reads every call as a probe alone around them."""
    from helpers import generate_dit

    from ipa_probe.gauge import gauge_sweep

    pipe = request.getfixturevalue(family)

    def call():
        return generate_dit(pipe, refs, cfg=True)

    call()  # diffusers' Flux pipeline leaves its own hook registry on the transformer at its first call
    before = snapshot(pipe)
    with ipa_probe.probe(pipe, maps=True) as outer:
        with ipa_probe.probe(pipe, seed=2) as inner:
            call()
        joined = gauge_sweep(pipe, call, "1,2")
    assert_unchanged(pipe, before)
    with ipa_probe.probe(pipe, maps=True) as outer_alone:
        call()
        call()
        with ipa_probe.qk_gauge(pipe, 2.0):
            call()
    with ipa_probe.probe(pipe, seed=2) as inner_alone:
        call()
    pd.testing.assert_frame_equal(joined, gauge_sweep(pipe, call, "1,2"), check_exact=True)
    assert_same_run(inner, inner_alone)
    assert_same_run(outer, outer_alone)
    assert set(outer.to_dataframe()["branch"]) == {"cond", "uncond"}


def test_an_open_probe_reads_gauge_sweeps_calls_as_alone_on_the_unet(organism, refs):
    """The UNet twin of the test above (the matrix checks the sweep's own table and one layer's maps): the open probe's
    whole table and maps are those of a probe alone around the sweep's two calls; when the gauged call raises, the
    open probe keeps both calls that ran and the pipeline comes back."""
    from ipa_probe.gauge import gauge_sweep

    calls = []

    def call(fail=False):  # with CFG; ``fail``: the gauged call (the second) raises after its first step
        calls.append(1)
        return latents(organism, refs, guidance_scale=3.0, **({"callback_on_step_end": boom} if fail else {}))

    with ipa_probe.probe(organism, keep_maps=True) as outer:
        gauge_sweep(organism, call, "1,2", layers=LAYER)
    with ipa_probe.probe(organism, keep_maps=True) as single:
        call()
        with ipa_probe.qk_gauge(organism, 2.0, layers=LAYER):
            call()
    assert_same_run(outer, single)
    before, calls[:] = snapshot(organism), []
    with pytest.raises(Boom), ipa_probe.probe(organism, maps=True) as outer:
        gauge_sweep(organism, lambda: call(fail=len(calls) > 0), "2", layers=LAYER)
    assert_unchanged(organism, before)
    assert len(calls) == 2 and sorted(outer.to_dataframe()["call"].unique()) == [0, 1]  # what ran is kept


def test_a_failure_inside_a_joined_probe_gives_the_pipeline_back(organism, refs):
    """Attribution with CFG raising inside an open probe (gauge_sweep's gauged call raising inside each feature:
    the matrix below)."""
    before, weights = snapshot(organism), parameters(organism)
    with pytest.raises(Boom), ipa_probe.probe(organism, maps=True) as outer:
        attribute(organism, refs, callback_on_step_end=boom)
    assert_unchanged(organism, before)
    assert torch.equal(parameters(organism), weights)
    assert outer.to_dataframe()["call"].nunique() == 1  # what ran is kept


def test_points_inside_an_ablation_index_references_as_the_call_passed_them(organism, refs):
    shapes = []

    def read(weights, ctx):
        shapes.append((ctx.references, weights[..., ctx.reference_tokens(1)].abs().max().item()))

    with intervene(organism, 1), intervene(organism, hooks={f"{LAYER}.ip.weights": read}):
        latents(organism, refs)
    assert shapes and all(references == 2 and largest == 0 for references, largest in shapes)


# ------------------------------------------------------------------------------------------------------ the spine


def snapshot(pipe):
    """What a feature could leave behind on a pipeline: hook counts per module, the denoiser's and the pipeline's
    attributes, the processors (the test's own reading; the UNet, or Flux's transformer)."""
    return {
        "hooks": {
            name: tuple(len(getattr(m, attr)) for attr in ("_forward_pre_hooks", "_forward_hooks"))
            for name, m in denoiser(pipe).named_modules()
        },
        "attributes": set(denoiser(pipe).__dict__),
        "pipe": set(vars(pipe)),
        "processors": dict(denoiser(pipe).attn_processors),
    }


def assert_unchanged(pipe, before):
    after = snapshot(pipe)
    assert after["hooks"] == before["hooks"]
    assert after["attributes"] == before["attributes"]
    assert after["pipe"] == before["pipe"]
    assert all(after["processors"][k] is v for k, v in before["processors"].items())
    assert ipa_probe.list_hooks(pipe) == []
    assert spine_of(pipe) is None


FEATURES = {
    "probe": lambda pipe: ipa_probe.probe(pipe, maps=True),
    "ablate": lambda pipe: intervene(pipe, 0, steps=[1]),
    "scale": lambda pipe: intervene(pipe, 1, mode="scale", factor=2.0),
    "hooks": lambda pipe: intervene(pipe, hooks={f"{LAYER}.ip.output": lambda t, c: t * 0.5}),
    "cache": lambda pipe: ipa_probe.cache_hook_points(pipe, [f"{LAYER}.ip.weights"]),
    "nw_head": lambda pipe: ipa_probe.nw_head(pipe, bandwidth=lambda t: 1.0 + t / 1000),
}


def test_everything_attached_adds_one_denoiser_pre_hook(organism, refs):
    before = len(organism.unet._forward_pre_hooks)
    with contextlib.ExitStack() as stack:
        for make in FEATURES.values():
            stack.enter_context(make(organism))
        assert len(organism.unet._forward_pre_hooks) == before + 1
        # one count of users: probe, the two interventions (ablate, scale), the three users of the hook points
        # (scale's, hooks, cache: one set of the points' hooks among them) and the NW head's timestep clock
        assert len(spine_of(organism).clients) == 7 and spine_of(organism).points is not None
        latents(organism, refs)
    assert len(organism.unet._forward_pre_hooks) == before


# ------------------------------------------------------------------------------------------------------ the matrix
# Every pair of features, generated from one table per pipeline, in both nesting orders, and a covering set of ordered
# triples (below): every order computes the latents of its edits given alone in the table's order (token edits act on
# the keys, point edits in the order the points are computed, the NW head in the processor, whatever the nesting; a
# reader changes nothing; the scalar gauge 2 changes no bit, it scales q and k by powers of two); the probe's maps of
# one layer, attribution's shares and gauge_sweep's reference masses there are the test's own float64 weights under
# the edits (the softmax, or an NW head's Gaussian kernel in its frame); a call feature among readers returns what it
# returns alone; and the pipeline comes back bit for bit (hooks, attributes, processors, parameters, and the plain
# call's latents), also after an exception inside the innermost block. Attribution and gauge_sweep are calls, not
# blocks: they run innermost, one at a time.


class Boom(Exception):
    pass


PATCHES, SOURCES = {}, {}


def first_point(pipe, point):
    """The image branch's hook point ``point`` of the first layer the denoiser runs."""
    return next(name for name in ipa_probe.list_hook_points(pipe) if name.endswith(f".ip.{point}"))


def patch_from(pipe, source, layer):
    """``patch_hooks`` that put reference 0's contribution at the first layer from a cache of ``source()`` (the
    call's references the other way round), recorded once per pipeline and outside every block, with the test's own
    readings of ``layer`` in that run (``SOURCES``)."""
    if id(pipe) not in PATCHES:
        name = first_point(pipe, "contribution")
        with own_weights(pipe, layer) as own, ipa_probe.cache_hook_points(pipe, [name]) as cache:
            source()
        PATCHES[id(pipe)], SOURCES[id(pipe)] = ipa_probe.patch_hooks(cache, [name], references=0), own
    return PATCHES[id(pipe)]


def matrix_features(pipe, generate, other, layer, swapped=1, call=None, source=None):
    """name -> (kind, make): ``"read"`` features compute nothing, ``"gauge"`` ones are output symmetries, the
    ``"call"`` ones run the pipeline and return (the latents of each call, their result): ``sweep`` (``gauge_sweep``
    of ``generate`` over the gauges 1 and 2 at ``layer``: the reference call and one gauged) and ``attribution``
    (``reference_attribution`` of ``call``'s arguments, where given); ``swap`` puts ``other`` in reference
    ``swapped``'s place; ``patch`` (where ``source`` is given) patches from its run."""
    from ipa_probe.attribution import reference_attribution
    from ipa_probe.gauge import gauge_sweep

    def sweep(**extra):  # ``extra`` (the failing callback) to the gauged call: it raises with the gauge applied
        outputs = []

        def once():
            outputs.append(generate(**(extra if outputs else {})))
            return outputs[-1]

        return outputs, gauge_sweep(pipe, once, "1,2", layers=f"^{layer}$")

    def attribution(**extra):
        result = reference_attribution(pipe, **call, **extra)
        return [result.generation.latents], result

    features = {
        "probe": ("read", lambda: ipa_probe.probe(pipe, maps=True, keep_maps=True)),
        "probe_nomaps": ("read", lambda: ipa_probe.probe(pipe)),
        "cache": ("read", lambda: ipa_probe.cache_hook_points(pipe, r"\.ip\.(weights|contribution)$")),
        "ablate": ("edit", lambda: intervene(pipe, 0, steps=[1])),
        "scale": ("edit", lambda: intervene(pipe, 1, mode="scale", factor=SCALE)),
        "hooks": ("edit", lambda: intervene(pipe, hooks={first_point(pipe, "output"): lambda t, c: t * 0.5})),
        "nw_query": ("edit", lambda: ipa_probe.nw_head(pipe, frame="query")),
        "nw_stored": ("edit", lambda: ipa_probe.nw_head(pipe, frame="stored")),
        "gauge": ("gauge", lambda: ipa_probe.qk_gauge(pipe, 2.0)),
        "sweep": ("call", sweep),
    }
    if other is not None:
        features["swap"] = ("edit", lambda: intervene(pipe, swapped, mode="swap", other=other))
    if source is not None:
        patch = patch_from(pipe, source, layer)
        features["patch"] = ("edit", lambda: intervene(pipe, hooks=patch))
    if call is not None:
        features["attribution"] = ("call", attribution)
    return features


SCALE = 2.0  # the matrix's scale of reference 1


def boom(pipe, step, timestep, kwargs):
    raise Boom  # inside the pipeline call, after its first step


CALLS = {"sweep": 2, "attribution": 1}  # the pipeline calls of each call feature


def run_nested(pipe, generate, features, order, fail=False):
    """The blocks of ``order`` entered outermost first, the call inside (a call feature, innermost, or ``generate``):
    (the latents of each pipeline call, the call feature's result, the blocks' values by name)."""
    blocks = [name for name in order if name not in CALLS]
    call = features[order[-1]][1] if order[-1] in CALLS else lambda **extra: ([generate(**extra)], None)
    with contextlib.ExitStack() as stack:
        entered = {name: stack.enter_context(features[name][1]()) for name in blocks}
        outputs, result = call(callback_on_step_end=boom) if fail else call()
    return outputs, result, entered


def expected_weights(own, order, references):
    """The test's own weights of every pass, laid out over every reference of the call: the kernel over the keys
    the layer kept (``ablate`` removes reference 0 at step 1), a removed reference at 0; ``scale`` multiplies
    the last reference's weights (reference 1; SD3's one) by its factor and renormalises the rows."""
    tokens = own[0].shape[-1] // references  # step 0 keeps every reference
    out = []
    for index, w in zip(own.passes, own, strict=True):
        kept = [r for r in range(references) if not ("ablate" in order and index % STEPS == 1 and r == 0)]
        full = w.new_zeros(*w.shape[:-1], references, tokens)  # (B, H, Q, R, T)
        full[..., kept, :] = w.reshape(*w.shape[:-1], len(kept), tokens)
        if "scale" in order:
            full[..., -1, :] *= SCALE
        full = full.flatten(-2)
        out.append(full / full.sum(-1, keepdim=True))
    return out


def branch_rows(table, weights):
    """``table``'s rows of one pass, one per batch row of ``weights`` (``[uncond, cond]`` under CFG)."""
    labels = ["uncond", "cond"][-weights.shape[0] :]
    return [table[table.branch == label] for label in labels]


def as_float64(column):
    return torch.tensor(column.to_numpy(), dtype=torch.float64)


@dataclass(frozen=True)
class Reading:
    """Where a matrix reads: ``layer``, with ``references`` references; its adapter scale and ``W_o`` (float64;
    ``None`` on Flux, whose branch has none) for the contributions; whether the ``hooks`` feature edits its output
    (the probe's contribution columns NaN there); the test's own contributions ``(B, R, Q, C)`` of the patch's source
    run per step where the patch acts at ``layer`` (``None`` elsewhere)."""

    layer: str
    references: int
    scale: float
    w_o: torch.Tensor | None
    output_edited: bool
    patched: list[torch.Tensor] | None


def reading_of(pipe, layer, references):
    """The :class:`Reading` of ``layer`` on ``pipe`` (after :func:`patch_from`, which records the source run)."""
    found = next(found for found in find_ip_layers(pipe) if found.name == layer)
    sd3, flux = found.family == "sd3", found.family == "flux"
    scale = float(found.processor.scale if sd3 else found.processor.scale[0])
    w_o = None if flux else found.attention.to_out[0].weight.detach().double().clone()
    reading = Reading(layer, references, scale, w_o, first_point(pipe, "output").startswith(layer + "."), None)
    if id(pipe) not in SOURCES or not first_point(pipe, "contribution").startswith(layer + "."):
        return reading
    source = SOURCES[id(pipe)]
    patched = [own_contributions(joint(source, i), source.values[i], reading) for i in range(len(source))]
    return dataclasses.replace(reading, patched=patched)


def joint(own, position):
    """The weights the layer's softmax put on the image keys in one pass: SD3's image columns times their mass."""
    return own[position] * own.shares[position].unsqueeze(-1) if own.shares else own[position]


def own_contributions(weights, values, reading):
    """Each reference's contribution ``(B, R, Q, C)``, ``s W_o sum_{i in j} w_i v_i`` (Flux: no ``W_o``, the heads'
    blocks side by side), from ``weights`` ``(B, H, Q, R * T)`` over every reference and the values the layer used
    ``(B, H, K, D)`` (an ablated reference 0's values missing: zeros under its zero weights)."""
    batch, heads, _, keys = weights.shape
    missing = keys - values.shape[2]
    values = torch.cat([values.new_zeros(batch, heads, missing, values.shape[-1]), values], 2)
    per_head = torch.einsum(
        "bhqrt,bhrtd->bhrqd",
        weights.unflatten(-1, (reading.references, -1)),
        values.unflatten(2, (reading.references, -1)),
    )  # (B, H, R, Q, D)
    if reading.w_o is None:
        return reading.scale * per_head.permute(0, 2, 3, 1, 4).flatten(-2)
    return reading.scale * torch.einsum("bhrqd,chd->brqc", per_head, reading.w_o.unflatten(1, (heads, -1)))


#: The maps-off probe's statistics that depend only on the weights the layer used and its q and k (the gauge
#: diagnostics, from the dot-product logits, are read where the weights are the layer's softmax: below)
TABLE_COLUMNS = ["spearman", "rows_rho_gt_0.9", "rows_rho_pos1", "rows_rho_neg1", "pearson", "kl", "top1"]
TABLE_COLUMNS += ["neff_attn", "neff_nw", "q_norm", "k_norm_spread", "keys"]
DOT_COLUMNS = ["logit_ratio", "rho_baseline", "rho_excess"]


def copies(k):
    """Whether keys ``(..., K, D)`` hold copies of one token (equal to 1e-6 of the largest norm: SDXL's unconditional
    image tokens, one copy per reference)."""
    close = torch.cdist(k, k) <= 1e-6 * k.norm(dim=-1).amax()
    return bool((close.sum(-1) > 1).any())


def computed_once(fn):
    """``fn`` of arrays, computed once per distinct input: the orders that share their edits read the same q, keys
    and weights (bit for bit), and the test's own recomputations are pure functions of them; each order's table is
    still compared with them. The key: the arrays' shapes, dtypes and bytes."""
    results = {}

    def call(*arrays):
        digest = hashlib.blake2b(repr([(a.shape, a.dtype) for a in arrays]).encode())
        for a in arrays:
            digest.update(np.ascontiguousarray(a).tobytes())
        if digest.digest() not in results:
            results[digest.digest()] = fn(*arrays)
        return results[digest.digest()]

    return call


own_cell = computed_once(lambda q, k, weights: reference_cell(q, k, None, attention=weights))
own_frame_cells = computed_once(lambda logits, k, keep, rows: frame_cells(logits, k, keep, rows, 1))


def check_table(rows, q, k, weights, dot):
    """One branch's rows of the maps-off probe's table at one layer and pass against :func:`reference_cell` (float64,
    numpy and scipy) of the test's own ``q`` ``(1, H, Q, D)``, keys ``(1, H, K, D)`` (those the layer kept) and
    ``weights`` ``(1, H, Q, K)`` over them (its ranks of each key's own weight: copies of one token tie where the
    weights do, e.g. without an edit, and rank apart where an edit weights them apart)."""
    expected = own_cell(q.numpy(), k.numpy(), weights.numpy())
    rows = rows.sort_values("head")
    for name in TABLE_COLUMNS + DOT_COLUMNS * dot:
        # float32 against float64 (rtol 1e-4, atol 2e-4), plus what near-tied rows may move rho / top-1 by
        slack = np.max(expected.get(f"{name}_slack", 0.0))
        np.testing.assert_allclose(rows[name].to_numpy(), expected[name], rtol=1e-4, atol=2e-4 + slack, err_msg=name)
    check_query_frame(rows, k, weights)


def check_query_frame(rows, k, weights):
    """Every query-frame column of one branch's rows (one item, its queries its frame) against
    ``test_query_frame.frame_cells`` (float64, numpy and scipy) of the log of ``weights`` (the frame depends on the
    logits alone, up to a per-row constant: an edit's weights are its logits' softmax): the statistics it recomputes,
    NaN where they are undefined; no row sample (errors 0); the other pool the same rows (``qf_spearman`` again); the
    null's draws NaN where rho is and a rho elsewhere."""
    heads, queries, keys = weights.shape[1:]
    cells = own_frame_cells(weights.log().numpy(), k.numpy(), np.ones((1, keys), bool), np.ones((1, queries), bool))
    assert check_frame(rows, {(rows.step.iloc[0], rows.branch.iloc[0]): cells[0]}, heads)
    assert (rows.row_fraction == 1).all() and (rows.filter(regex=r"^qf_.*_se$") == 0).all().all()
    for rho, null in (("qf_spearman", "qf_spearman_null"), ("qf_gauss_spearman", "qf_gauss_spearman_null")):
        assert (rows[rho].isna() == rows[null].isna()).all() and (rows[null].dropna().abs() <= 1).all()
    np.testing.assert_array_equal(rows.qf_spearman_other_pool.to_numpy(), rows.qf_spearman.to_numpy())


def check_readings(own, order, entered, result, reading):
    """At one layer, against the test's own float64 weights, keys and values: the probe's kept maps (none where the
    layer skipped its branch: SD3 with its one reference ablated), its contribution columns (NaN where the ``hooks``
    feature edits the layer's output, and on SD3, which has none) and, on SD3, its image share; the maps-off probe's
    table (:func:`check_table`); the cache's weights and contributions (SD3's weights: the joint softmax's image
    columns); attribution's shares; gauge_sweep's reference masses (and SD3 image share) of its reference call (gauge
    1) and its gauged one (gauge 2)."""
    layer, references = reading.layer, reading.references
    expected = dict(zip(own.passes, expected_weights(own, order, references), strict=True))
    position = {index: i for i, index in enumerate(own.passes)}
    shares = dict(zip(own.passes, own.shares, strict=False))  # SD3 only
    if "scale" in order:  # SD3's one reference: log SCALE added to the image logits of the joint softmax
        shares = {index: SCALE * m / (SCALE * m + 1 - m) for index, m in shares.items()}
    run, passes = entered.get("probe"), CALLS.get(order[-1], 1) * STEPS
    nomaps, cache = entered.get("probe_nomaps"), entered.get("cache")
    skipped = {i for i in range(passes) if references == 1 and "ablate" in order and i % STEPS == 1}
    assert set(expected) == set(range(passes)) - skipped, (sorted(expected), passes)
    assert len(own.values) == len(own.qk) == len(own), (len(own.values), len(own))
    read = {name: probe.to_dataframe() for name, probe in (("probe", run), ("probe_nomaps", nomaps)) if probe}
    mass = run.reference_mass() if run is not None else None
    names = {point: f"{layer}.ip.{point}" for point in ("weights", "contribution")}
    for index in range(passes):
        call, step = divmod(index, STEPS)
        weights = expected.get(index)
        if weights is None:  # no image branch ran (SD3, its one reference ablated): no map, no record either
            assert run is None or not run.maps.get((call, step, layer, 0)), (call, step)
            for name in names.values() if cache is not None else ():
                with pytest.raises(KeyError, match="has no record"):
                    cache.get(name, step, call=call)
            continue
        used = weights * shares[index].unsqueeze(-1) if index in shares else weights  # SD3: the joint's columns
        c = own_contributions(used, own.values[position[index]], reading)  # (B, R, Q, C)
        if "patch" in order and reading.patched is not None:  # the source run's reference 0 at this step
            c[:, 0] = reading.patched[step][:, 0]
        # the cache (float32 against float64): 1e-6 on weights below 1, 1e-5 of the largest contribution
        if cache is not None:
            got = cache.get(names["weights"], step, call=call).double()
            torch.testing.assert_close(got, used, rtol=0, atol=1e-6)
            got = cache.get(names["contribution"], step, call=call).double()
            torch.testing.assert_close(got, c, rtol=0, atol=1e-5 * float(c.abs().max()))
        if run is not None:  # float16 maps (11-bit mantissa: 5e-4 relative on weights below 1)
            torch.testing.assert_close(probe_weights(run, step, layer, call), weights, rtol=0, atol=2e-3)
            at = mass[(mass.call == call) & (mass.step == step) & (mass.layer == layer)]
            numbers = own_numbers(c.unsqueeze(1))  # (B, R, Q) each; means over queries below
            for row, rows in enumerate(branch_rows(at, weights)):
                rows = rows.sort_values("reference")
                got = rows[list(CONTRIBUTION_COLUMNS)]
                if reading.output_edited and "hooks" in order or index in shares:  # no split of the output
                    assert len(got) == references and got.isna().all().all(), got
                    continue
                atol = 1e-5 * float(numbers["norm"][row].max())  # float32 contributions: 1e-5 of the largest norm
                for column, number, tolerance in zip(CONTRIBUTION_COLUMNS, ("norm", "share", "projection"),
                                                     (atol, 1e-5, atol), strict=True):  # fmt: skip
                    want = numbers[number][row].mean(-1)  # (R,)
                    torch.testing.assert_close(as_float64(got[column]), want, rtol=0, atol=tolerance)
        masses = weights.reshape(*weights.shape[:-1], references, -1).sum(-1).mean(dim=(1, 2))  # (B, R)
        q, k = own.qk[position[index]]
        tokens = weights.shape[-1] // references
        kept = weights.unflatten(-1, (references, tokens))[..., references - k.shape[2] // tokens :, :]  # (.., R', T)
        for name, table in read.items():  # 1e-5 below: the layer's float32 softmax against the test's float64 one
            at = table[(table.call == call) & (table.step == step) & (table.layer == layer)]
            for row, rows in enumerate(branch_rows(at, weights)):
                if index in shares:
                    share = shares[index][row].mean(-1)  # (H,)
                    torch.testing.assert_close(as_float64(rows.sort_values("head").ip_mass), share, rtol=0, atol=1e-5)
                if name == "probe_nomaps":
                    dot, item = not ({"scale", "nw_query", "nw_stored"} & set(order)), slice(row, row + 1)
                    check_table(rows, q[item], k[item], kept[item].flatten(-2), dot)
        if order[-1] == "attribution":  # the conditional row (the last), means over heads and queries
            table = result.table[(result.table.step == step) & (result.table.layer == layer)]
            got = as_float64(table.sort_values("reference").attention_share)
            torch.testing.assert_close(got, masses[-1], rtol=0, atol=1e-5)
        if order[-1] == "sweep":
            at = result[(result.step == step) & (result.factor == 2.0**call)]
            for row, rows in enumerate(branch_rows(at, weights)):
                got = as_float64(rows[[f"ref_mass_0_{r}" for r in range(references)]].iloc[0])
                torch.testing.assert_close(got, masses[row], rtol=0, atol=1e-5)
                if index in shares:  # the summary's mean over heads and queries
                    share = shares[index][row].mean().reshape(1)
                    torch.testing.assert_close(as_float64(rows.ip_mass), share, rtol=0, atol=1e-5)


PLAIN, ALONE = {}, {}


def assert_same_result(name, result, alone):
    """A call feature's results, bit for bit: gauge_sweep's table; attribution's tables, latents and samples."""
    if name == "sweep":
        pd.testing.assert_frame_equal(result, alone, check_exact=True)
        return
    for table in ("table", "heads", "positions", "head_positions"):
        pd.testing.assert_frame_equal(getattr(result, table), getattr(alone, table), check_exact=True)
    assert torch.equal(result.generation.latents, alone.generation.latents)
    assert all(torch.equal(result.samples[step], alone.samples[step]) for step in alone.samples)


def check_nesting(pipe, generate, features, orders, reading=None):
    """Each order of one set of features (outermost first) computes what its edits compute alone, in the table's
    order (every pipeline call of a call feature); its readings are the test's own (``reading``: a :class:`Reading`);
    a call feature among readers only (a probe, the cache) returns what it returns alone; the pipeline comes back bit
    for bit after each order and after an exception inside it."""
    if id(pipe) not in PLAIN:  # once per pipeline (``setdefault`` would run the call every time): its latents and
        PLAIN[id(pipe)] = generate(), parameters(pipe)  # parameters, which every feature must leave as they were
    before, (plain, weights) = snapshot(pipe), PLAIN[id(pipe)]
    edits = tuple(name for name, (kind, _) in features.items() if kind == "edit" and name in orders[0])
    if (id(pipe), edits) not in ALONE:
        with contextlib.ExitStack() as stack:
            for name in edits:
                stack.enter_context(features[name][1]())
            ALONE[id(pipe), edits] = generate()
    kernel = query_frame if "nw_query" in orders[0] else stored_frame if "nw_stored" in orders[0] else dot_softmax
    for order in orders:
        with own_weights(pipe, reading.layer, kernel) if reading else contextlib.nullcontext([]) as own:
            outputs, result, entered = run_nested(pipe, generate, features, order)
        assert len(outputs) == CALLS.get(order[-1], 1), order
        assert all(torch.equal(latents, ALONE[id(pipe), edits]) for latents in outputs), order
        if reading:
            check_readings(own, order, entered, result, reading)
        if order[-1] in CALLS and all(features[name][0] == "read" for name in order[:-1]):
            if (id(pipe), order[-1]) not in ALONE:
                ALONE[id(pipe), order[-1]] = features[order[-1]][1]()[1]
            assert_same_result(order[-1], result, ALONE[id(pipe), order[-1]])
        with pytest.raises(Boom):
            run_nested(pipe, generate, features, order, fail=True)
        assert_unchanged(pipe, before)
    assert torch.equal(parameters(pipe), weights)
    assert torch.equal(generate(), plain)


def check_pair(pipe, generate, features, a, b, reading=None):
    """Both nesting orders of two features (a call feature only inside the other)."""
    orders = [(a, b)] if b in CALLS else [(a, b), (b, a)]
    if refused({a, b}):
        before = snapshot(pipe)
        error, match = REFUSED[frozenset({a, b})]
        for order in orders:
            with pytest.raises(error, match=match):
                run_nested(pipe, generate, features, order)
            assert_unchanged(pipe, before)
        return
    check_nesting(pipe, generate, features, orders, reading)


#: Pairs refused (in either order, before anything runs) and the error that says why: the stored-frame NW head's key
#: term ``|k|^2`` is no gauge invariant; one gauge per pipeline (``gauge_sweep`` applies its own).
REFUSED = {
    frozenset({"nw_stored", "gauge"}): (ValueError, r"\|k\|\^2.*frame='query'"),
    frozenset({"nw_stored", "sweep"}): (ValueError, "frame='stored'"),
    frozenset({"gauge", "sweep"}): (RuntimeError, "already active"),
}


def refused(names):
    return any(pair <= set(names) for pair in REFUSED)


def allowed(names):
    """An ordered set of features that runs together: one NW head per pipeline; no refused pair (checked in the pair
    matrix); at most one call feature, innermost."""
    heads = sum(name.startswith("nw_") for name in names)
    calls = [name for name in names if name in CALLS]
    return heads < 2 and not refused(names) and calls in ([], [names[-1]])


def covering_triples(names):
    """Ordered triples (outer, middle, inner) in which every ordered pair of features that may run together stands in
    each of the three positions of a triple (outer-middle, outer-inner, middle-inner): each feature outside and inside
    each other one, next to it and with a third between. Built greedily (the triple that covers most of what is left
    first, ties to the first in ``itertools.permutations`` order), so the set is fixed; about ``N**2`` triples where
    every order is ``N (N - 1) (N - 2)``."""
    candidates = [t for t in itertools.permutations(names, 3) if allowed(t)]
    covers = {t: {(t[p], t[q], p, q) for p, q in ((0, 1), (0, 2), (1, 2))} for t in candidates}
    left, chosen = set().union(*covers.values()), []
    while left:
        best = max(candidates, key=lambda t: len(covers[t] & left))
        chosen.append(best)
        left -= covers[best]
    return chosen


def sample_photos():
    """Three of the tiny pipelines' default reference images: two references and one to swap in."""
    from ipa_probe.tiny.sd import default_reference_images

    return default_reference_images(3)


def organism_matrix(pipe):
    refs, other = refs_of(3, 5), digits_reference_images(8, 1, seed=900)[0]
    call = dict(prompt=DIGITS_PROMPT, ip_adapter_image=[list(refs)], num_inference_steps=STEPS, guidance_scale=1.0)

    def generate(**extra):
        return latents(pipe, refs, **extra)

    source = lambda: latents(pipe, refs[::-1])  # noqa: E731
    features = matrix_features(pipe, generate, other, LAYER, call=call, source=source)
    return generate, features, reading_of(pipe, LAYER, len(refs))


def sdxl_matrix(pipe):
    """SDXL (two text encoders, added time ids) with CFG, attribution among the features."""
    refs = [image.resize((64, 64)) for image in sample_photos()]  # the generation's size
    call = dict(prompt="a", ip_adapter_image=[refs[:2]], num_inference_steps=STEPS)

    def generate(**extra):
        return pipe(**{**call, **extra}, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    layer = find_ip_layers(pipe)[0].name
    source = lambda: generate(ip_adapter_image=[refs[1::-1]])  # noqa: E731
    features = matrix_features(pipe, generate, refs[2], layer, call=call, source=source)
    return generate, features, reading_of(pipe, layer, 2)


def flux_matrix(pipe):
    """Flux (no true CFG: one pass per step), two references."""
    refs = sample_photos()

    def generate(**extra):
        kwargs = dict(prompt="a", ip_adapter_image=[refs[:2]], num_inference_steps=STEPS, height=64, width=64)
        return pipe(**{**kwargs, **extra}, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    layer = find_ip_layers(pipe)[0].name
    call = dict(prompt="a", ip_adapter_image=[refs[:2]], num_inference_steps=STEPS, height=64, width=64)
    source = lambda: generate(ip_adapter_image=[refs[1::-1]])  # noqa: E731
    features = matrix_features(pipe, generate, refs[2], layer, call=call, source=source)
    return generate, features, reading_of(pipe, layer, 2)


def sd3_matrix(pipe):
    """SD3 with CFG: one reference image per prompt (``refs[1]`` is the one swapped in)."""
    refs = sample_photos()

    def generate(**extra):
        kwargs = dict(prompt="a", ip_adapter_image=refs[0], num_inference_steps=STEPS, height=64, width=64)
        return pipe(**{**kwargs, **extra}, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    layer = find_ip_layers(pipe)[0].name
    source = lambda: generate(ip_adapter_image=refs[1])  # noqa: E731
    call = dict(prompt="a", ip_adapter_image=[refs[:1]], num_inference_steps=STEPS, height=64, width=64)
    features = matrix_features(pipe, generate, refs[1], layer, swapped=0, call=call, source=source)
    features["scale"] = ("edit", lambda: intervene(pipe, 0, mode="scale", factor=SCALE))  # its one reference
    return generate, features, reading_of(pipe, layer, 1)


#: The features of each pipeline's matrix (call features last).
BLOCKS = ["probe", "cache", "ablate", "scale", "hooks", "nw_query", "nw_stored", "gauge", "swap", "probe_nomaps"]
FEATURES_OF = dict.fromkeys(("organism", "sdxl", "flux"), [*BLOCKS, "patch", "sweep", "attribution"])
FEATURES_OF["sd3"] = [*BLOCKS[:5], "swap", *BLOCKS[5:8], "probe_nomaps", "patch", "sweep", "attribution"]
MATRIX_OF = {"organism": organism_matrix, "sdxl": sdxl_matrix, "flux": flux_matrix, "sd3": sd3_matrix}


MATRICES = {}


def matrix_of(request, family):
    """The pipeline fixture of ``family`` and its matrix (the call, the features, the reading), built once per
    pipeline."""
    pipe = request.getfixturevalue(family)
    if id(pipe) not in MATRICES:
        MATRICES[id(pipe)] = MATRIX_OF[family](pipe)
    return pipe, MATRICES[id(pipe)]


def generated(cases, families=tuple(FEATURES_OF), leave_out=None):
    """``cases(names)`` for each of ``families`` (``leave_out``: pipeline -> a feature left out there), as test
    parameters ``(pipeline, case)``."""
    return [
        pytest.param(family, case, id=f"{family}-{'-'.join(case)}")
        for family in families
        for case in cases([name for name in FEATURES_OF[family] if name != (leave_out or {}).get(family)])
    ]


def pairs(names):
    """Every unordered pair (both orders are checked in one test), but two NW heads (one head per pipeline) or two
    call features; a call feature second (the call features stand last in ``names``). Attribution's pairs on the
    organism, Flux and SD3 stand in their triples."""
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if not (a.startswith("nw_") and b.startswith("nw_")) and not (a in CALLS and b in CALLS)
    ]


@pytest.mark.parametrize(
    ("family", "pair"), generated(pairs, leave_out=dict.fromkeys(("organism", "flux", "sd3"), "attribution"))
)
def test_every_pair_composes_and_restores(family, pair, request, one_thread):
    pipe, (generate, features, reading) = matrix_of(request, family)
    check_pair(pipe, generate, features, *pair, reading=reading)


def every_triple(names):
    """Every ordered triple of features that may run together (:func:`allowed`)."""
    return [order for order in itertools.permutations(names, 3) if allowed(order)]


#: ``IPA_PROBE_FULL_MATRIX=1`` (``make test-matrix``): every ordered triple instead of the covering set
FULL_MATRIX = os.environ.get("IPA_PROBE_FULL_MATRIX") == "1"


@pytest.mark.parametrize(("family", "order"), generated(every_triple if FULL_MATRIX else covering_triples))
def test_triples_compose_and_restore(family, order, request, one_thread):
    """The covering set of ordered triples above on each pipeline (every ordered triple with
    ``IPA_PROBE_FULL_MATRIX=1``), each in its one order."""
    pipe, (generate, features, reading) = matrix_of(request, family)
    check_nesting(pipe, generate, features, [order], reading=reading)


def test_rank_statistics_of_copies_under_a_scale(request, one_thread):
    """The maps-off probe's rank correlations where the keys hold copies of one token that a scale weights apart
    (SDXL's unconditional image tokens, one copy per reference, reference 1's doubled), against the test's own
    per-key ranks of the weights the layer used (a probe that ranked every copy on its first copy's weight read
    spearman 0.634 / 0.344 where these give 0.415 / 0.204); top-1 still counts either copy as the token."""
    pipe, (generate, features, reading) = matrix_of(request, "sdxl")
    with own_weights(pipe, reading.layer) as own:
        _, _, entered = run_nested(pipe, generate, features, ("scale", "probe_nomaps"))
    table = entered["probe_nomaps"].to_dataframe()
    for step, weights in enumerate(expected_weights(own, ("scale",), reading.references)):
        (q, k), at = own.qk[step], table[(table.step == step) & (table.layer == reading.layer)]
        assert copies(k[:1]) and not copies(k[1:])  # the unconditional row (the first) holds copies
        assert not copies(weights[:1].transpose(-1, -2))  # which the scale weights apart
        check_table(branch_rows(at, weights)[0], q[:1], k[:1], weights[:1], dot=False)


# ------------------------------------------------------------------------------------------------------ edits kept


def ablate_zero(w, ctx):
    return ctx.where(w, 0.0, references=[0])


def in_place_then_view(w, ctx):
    w[..., ctx.reference_tokens(0)] = 0.0
    return w[:]  # a view of the edited tensor


def contribution_in_place_then_clone(c, ctx):
    c[:, 0] = 0.0
    return c.clone()


def contribution_zero(c, ctx):
    return ctx.where(c, 0.0, references=[0])


@pytest.mark.parametrize(
    ("point", "in_place", "copy"),
    [
        ("weights", in_place_then_view, ablate_zero),
        ("contribution", contribution_in_place_then_clone, contribution_zero),
    ],
)
def test_an_edit_in_place_is_honoured(organism, refs, point, in_place, copy):
    name = f"{LAYER}.ip.{point}"
    plain = latents(organism, refs)
    with intervene(organism, hooks={name: copy}):
        expected = latents(organism, refs)
    with intervene(organism, hooks={name: in_place}):
        got = latents(organism, refs)
    assert not torch.equal(expected, plain)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same edit, formed the same way: bitwise


def test_nan_from_a_hook_is_counted_and_warned_once(organism, refs):
    def nan(w, ctx):
        return torch.full_like(w, math.nan)

    names = [f"{LAYER}.ip.weights", f"{LAYER.replace('up_blocks.1', 'up_blocks.2')}.ip.output"]
    with pytest.warns(RuntimeWarning, match="NaN") as record:
        with intervene(organism, hooks={names[0]: nan, names[1]: lambda t, c: t * math.nan}):
            latents(organism, refs)
    assert len([w for w in record if "NaN" in str(w.message)]) == 1


# ------------------------------------------------------------------------------------------------------ tiny SDXL


@pytest.fixture(scope="module")
def sdxl():
    from ipa_probe.tiny.sd import tiny_pipeline

    pipe = tiny_pipeline("sdxl")
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------------------------------ tiny Flux


FLUX_FACTOR = 4.0  # reference 0's weights scaled by this and the rows renormalised, in the hook and in the test


def flux_edit(weights, ctx):
    scaled = weights.clone()
    scaled[..., ctx.reference_tokens(0)] *= FLUX_FACTOR
    return scaled / scaled.sum(-1, keepdim=True)


@pytest.mark.parametrize("probe_first", [True, False])
def test_flux_probe_reads_the_weights_a_hook_edited(flux, probe_first, one_thread):
    """On Flux the hook points edit in a forward hook on the attention module, where the probe's record waits for
    the weights the layer used: whichever is attached first, the probe's maps and reference shares are the test's
    own float64 softmax with the same edit, and the pipeline comes back bit for bit."""
    from ipa_probe.tiny.sd import default_reference_images

    refs = default_reference_images(2)
    kwargs = dict(prompt="a", ip_adapter_image=[refs], num_inference_steps=2, height=64, width=64)

    def generate():
        return flux(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    layer = find_ip_layers(flux)[0]
    plain = generate()
    before = snapshot(flux)  # after a first call: the pipeline keeps its call settings as attributes
    probe = ipa_probe.probe(flux, keep_maps=True, maps=True, layers=f"^{layer.name}$")
    edit = intervene(flux, hooks={f"{layer.name}.ip.weights": flux_edit})
    with own_weights(flux, layer.name) as own:
        with contextlib.ExitStack() as stack:
            entered = [stack.enter_context(f) for f in ((probe, edit) if probe_first else (edit, probe))]
            edited = generate()
    run = entered[0] if probe_first else entered[1]
    assert not torch.equal(edited, plain)  # the edit acted
    tokens = own[0].shape[-1] // 2
    mass = run.reference_mass()
    assert len(own) == STEPS and len(mass) == 2 * STEPS  # one pass per step (no true CFG), two references
    for step, weights in enumerate(own):
        expected = weights.clone()
        expected[..., :tokens] *= FLUX_FACTOR
        expected = expected / expected.sum(-1, keepdim=True)
        # 2e-3: the probe keeps its maps in float16 (11-bit mantissa: 5e-4 relative on weights below 1)
        got = torch.cat([m.double() for m in run.maps[(0, step, layer.name, 0)]])
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)
        shares = expected.reshape(*expected.shape[:-1], 2, tokens).sum(-1).mean(dim=(0, 1, 2))  # (references,)
        at_step = mass[mass.step == step].sort_values("reference")
        # 1e-5: the layer forms its weights in float32 (~1e-7 relative); the probe's shares are float32 means
        torch.testing.assert_close(torch.tensor(at_step.attention.to_numpy(), dtype=torch.float64), shares,
                                   rtol=0, atol=1e-5)  # fmt: skip
        unedited = weights.reshape(*weights.shape[:-1], 2, tokens).sum(-1).mean(dim=(0, 1, 2))
        assert shares[0] - unedited[0] > 0.05  # the edit moved the share far beyond the tolerance
    after = snapshot(flux)
    assert after["hooks"] == before["hooks"] and after["attributes"] == before["attributes"]
    assert after["pipe"] == before["pipe"]
    assert all(after["processors"][k] is v for k, v in before["processors"].items())
    assert ipa_probe.list_hooks(flux) == [] and spine_of(flux) is None
    assert torch.equal(generate(), plain)


@pytest.mark.parametrize(("outer", "inner"), [(0, 1), (1, 0)])
def test_flux_ablations_nest_and_equal_leaving_the_reference_out(flux, outer, inner, one_thread):
    """On Flux ``intervene(reference=...)`` ablates as on UNets: nested blocks equal the edits given at once, a probe
    inside reads the ablated reference at share 0, and ablating reference 2 of three equals the call without it."""
    from ipa_probe.tiny.sd import default_reference_images

    refs = default_reference_images(3)

    def generate(images):
        kwargs = dict(prompt="a", ip_adapter_image=[images], num_inference_steps=STEPS, height=64, width=64)
        return flux(**kwargs, output_type="latent", generator=torch.Generator().manual_seed(0)).images

    plain = generate(refs)
    before = snapshot(flux)
    with intervene(flux, [0, 1]):
        together = generate(refs)
    with intervene(flux, outer), ipa_probe.probe(flux, maps=True) as run, intervene(flux, inner):
        nested = generate(refs)
    assert torch.equal(nested, together) and not torch.equal(nested, plain)
    mass = run.reference_mass()
    assert len(mass) and (mass[mass.reference < 2].attention == 0).all()
    assert ((mass[mass.reference == 2].attention - 1).abs() < 1e-6).all()  # float32 softmax sums, as above
    with intervene(flux, 2):
        ablated = generate(refs)
    # 1e-5: the image encoder runs on a batch of three there and of two here
    torch.testing.assert_close(ablated, generate(refs[:2]), rtol=1e-5, atol=1e-5)
    with intervene(flux, 0, mode="scale", factor=0.0):
        scaled = generate(refs)
    with intervene(flux, 0):
        # 1e-5: the scale renormalises the float32 weights the softmax gave; the ablation's softmax runs without them
        torch.testing.assert_close(scaled, generate(refs), rtol=1e-5, atol=1e-5)
    assert_unchanged(flux, before)
    assert torch.equal(generate(refs), plain)


def test_flux_true_cfg_labels_agree_with_the_probe(flux):
    """One labeller: the hook context labels Flux's true-CFG negative pass as the probe's table does."""
    from ipa_probe.tiny.sd import default_reference_images

    layer = find_ip_layers(flux)[0]
    kwargs = dict(prompt="a", negative_prompt="b", true_cfg_scale=2.0, ip_adapter_image=[default_reference_images(1)],
                  negative_ip_adapter_image=[default_reference_images(1)], num_inference_steps=STEPS, height=64,
                  width=64, output_type="latent")  # fmt: skip
    seen = []
    with ipa_probe.probe(flux, layers=f"^{layer.name}$") as run:
        with intervene(flux, hooks={f"{layer.name}.ip.weights": lambda w, ctx: seen.append((ctx.step, ctx.cfg))}):
            flux(**kwargs, generator=torch.Generator().manual_seed(0))
    table = run.to_dataframe()
    expected = [(step, (branch,)) for step in range(STEPS) for branch in table[table.step == step].branch.unique()]
    assert seen == expected == [(0, ("cond",)), (0, ("uncond",)), (1, ("cond",)), (1, ("uncond",))]
