"""Each reference's contribution to the layer output (probe(..., maps=True)): against the test's own float64
recomputation, and invariant under the q/k group and under a per-head basis change of the values (issue #29.1)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from ipa_probe.capture.maps import REFERENCE_MASS_COLUMNS
from ipa_probe.capture.run import probe
from ipa_probe.intervention import intervene
from ipa_probe.statistics.kernels import mixed_sums, orthonormal_coordinates, projected_tokens

STEPS = 2
CONTRIBUTION_COLUMNS = ["contribution_norm", "contribution_share", "contribution_projection"]


def generate(pipe, refs, **kwargs):
    generator = torch.Generator().manual_seed(0)
    kwargs.setdefault("num_inference_steps", STEPS)
    return pipe("a photo", ip_adapter_image=[refs], generator=generator, output_type="latent", **kwargs).images


def ip_layers(pipe):
    return {
        name[: -len(".processor")]: (pipe.unet.get_submodule(name[: -len(".processor")]), proc)
        for name, proc in pipe.unet.attn_processors.items()
        if hasattr(proc, "to_k_ip")
    }


class OwnHooks:
    """The test's own forward hooks: per denoiser pass, each layer's query, image keys and image values."""

    def __init__(self, pipe):
        self.pipe, self.handles, self.calls = pipe, [], []
        self.layers = ip_layers(pipe)

    def __enter__(self):
        self.handles.append(self.pipe.unet.register_forward_pre_hook(lambda m, a: self.calls.append({})))
        for name, (attn, proc) in self.layers.items():
            self.handles.append(attn.to_q.register_forward_hook(self._save(name, "q")))
            self.handles.append(proc.to_k_ip[0].register_forward_hook(self._save(name, "k")))
            self.handles.append(proc.to_v_ip[0].register_forward_hook(self._save(name, "v")))
        return self

    def _save(self, name, what):
        def hook(module, args, output):
            self.calls[-1][(name, what)] = output.detach().double()

        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def weights(self, step, name, edit=None):
        """float64 ``(B, H, Q, K)``: ``softmax(q k^T / sqrt(d))``, then the test's own copy of an edit, ``edit(w)``."""
        heads = self.layers[name][0].heads
        q, k = (self.calls[step][(name, what)] for what in ("q", "k"))
        batch, queries, inner = q.shape
        d = inner // heads
        qh = q.reshape(batch, queries, heads, d).transpose(1, 2)  # (B, H, Q, D)
        kh = k.reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, K, D)
        w = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(d), -1)  # (B, H, Q, K)
        return w if edit is None else edit(w)

    def contributions(self, step, name, references, edit=None):
        """float64 ``(B, H, R, Q, C)``: ``c_{j,h}(q) = s W_o[:, h] sum_{i in j} w_{h,i}(q) v_{h,i}`` (``w`` after
        ``edit``, as in :meth:`weights`)."""
        attn, proc = self.layers[name]
        heads = attn.heads
        w = self.weights(step, name, edit)
        batch, _, queries, _ = w.shape
        v = self.calls[step][(name, "v")]
        d = v.shape[-1] // heads
        vh = v.reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, K, D)
        vh = torch.nn.functional.pad(vh, (0, 0, w.shape[-1] - vh.shape[2], 0))  # ablated reference 0: values 0
        tokens = w.shape[-1] // references
        w = w.reshape(batch, heads, queries, references, tokens)  # (B, H, Q, R, T)
        vr = vh.reshape(batch, heads, references, tokens, d)  # (B, H, R, T, D)
        mixed = torch.einsum("bhqrt,bhrtd->bhrqd", w, vr)  # (B, H, R, Q, D)
        w_o = attn.to_out[0].weight.detach().double().reshape(-1, heads, d)  # (C, H, D)
        return float(proc.scale[0]) * torch.einsum("bhrqd,chd->bhrqc", mixed, w_o)


def own_numbers(per_head):
    """``(B, H, R, Q, C)`` -> norm, share, projection ``(B, R, Q)`` of the head sum, and per head ``(B, H, R, Q)``."""
    c = per_head.sum(1)  # (B, R, Q, C)
    total = c.sum(1)  # (B, Q, C)
    direction = total / total.norm(dim=-1, keepdim=True)
    norm = c.norm(dim=-1)
    head_norm = per_head.norm(dim=-1)
    return {
        "norm": norm,
        "share": norm / norm.sum(1, keepdim=True),
        "projection": (c * direction[:, None]).sum(-1),
        "head_norm": head_norm,
        "head_share": head_norm / head_norm.sum((1, 2), keepdim=True),
        "head_projection": (per_head * direction[:, None, None]).sum(-1),
    }


@pytest.mark.parametrize(("x", "c", "rank"), [(8, 40, 8), (12, 40, 5), (64, 320, 64), (40, 40, 40), (48, 32, 32)])
def test_orthonormal_coordinates_keep_every_norm_and_dot_product(x, c, rank):
    """The contributions are measured in coordinates of the token vectors' span: the coordinates' Gram matrix is the
    vectors' (float64, the test's own), also for vectors of lower rank; with X >= C the vectors come back as they
    are."""
    g = torch.Generator().manual_seed(x + c)
    vectors = torch.randn(2, x, rank, generator=g) @ torch.randn(2, rank, c, generator=g)  # (B, X, C) of rank `rank`
    vectors = vectors * torch.logspace(-2, 1, x)[:, None]  # token vectors of very different sizes
    got = orthonormal_coordinates(vectors)
    assert got.shape == (2, x, min(x, c))
    if x >= c:
        assert got is vectors
    v64 = vectors.double()
    want = v64 @ v64.transpose(-1, -2)
    have = got.double() @ got.double().transpose(-1, -2)
    # Householder QR in float32 is backward stable: each entry <v_i, v_j> within a few float32 epsilons (1.2e-7)
    # times |v_i| |v_j| (sum over up to 320 channels: ~1e-6 relative); 1e-5 leaves 10x room
    sizes = v64.norm(dim=-1)
    torch.testing.assert_close(
        have / (sizes[..., :, None] * sizes[..., None, :]),
        want / (sizes[..., :, None] * sizes[..., None, :]),
        rtol=0,
        atol=1e-5,
    )
    # a combination's norm (what _contribute keeps) against float64 in the full space
    w = torch.rand(2, 7, x, generator=g)
    torch.testing.assert_close(
        (w.double() @ got.double()).norm(dim=-1), (w.double() @ v64).norm(dim=-1), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize(("queries", "channels", "references"), [(300, 40, 16), (256, 320, 16), (64, 24, 3)])
def test_mixed_sums_equal_own_float64_contributions(queries, channels, references):
    """The maps' sums formed without the contributions (|c_j|, c_j . c, |c|) against the test's own float64 c_j,
    within 1e-6 of each position's largest value, also for a reference whose tokens cancel to 1e-4 of their size (its
    norm from the QR's coordinates: a Gram matrix's square root fails here) and one whose values are all 0."""
    g, (batch, heads, tokens) = torch.Generator().manual_seed(queries), (2, 4, 4)
    keys = references * tokens
    weights = torch.softmax(torch.randn(batch, heads, queries, keys, generator=g) * 3, -1)
    values = torch.randn(batch, heads, keys, channels // heads, generator=g)
    # reference 0: tokens 0 and 1, 2 and 3 cancel to 1e-4 of their size (equal weights)
    values[:, :, 1:4:2] = 1e-4 * torch.randn(batch, heads, 2, channels // heads, generator=g) - values[:, :, 0:4:2]
    weights[..., 1:4:2] = weights[..., 0:4:2]
    values[:, :, 4:8] = 0.0  # reference 1: all 0
    w_o = torch.randn(channels, channels, generator=g) / channels**0.5
    got = mixed_sums(weights, projected_tokens([values], tokens, 0.7, w_o))  # (3, B, R, Q)
    # own: c_j = 0.7 sum_{h, i in j} w_{h,i} W_o[:, h] v_{h,i}, float64
    per_head = w_o.double().unflatten(1, (heads, -1))  # (C, H, D)
    vw = torch.einsum("chd,bhkd->bhkc", per_head, values.double())  # (B, H, K, C)
    c = 0.7 * torch.einsum(
        "bhqrt,bhrtc->brqc",
        weights.double().unflatten(-1, (references, tokens)),
        vw.unflatten(2, (references, tokens)),
    )  # (B, R, Q, C)
    total = c.sum(1, keepdim=True)
    want = torch.stack([c.norm(dim=-1), (c * total).sum(-1), total.norm(dim=-1).expand(c.shape[:-1])])
    largest = want.abs().amax((0, 2), keepdim=True)  # per position (batch, query)
    assert ((got.double() - want).abs() <= 1e-6 * largest).all()
    assert float(want[0, :, 1].abs().max()) == 0.0 and float(got[0, :, 1].abs().max()) == 0.0
    assert float(want[0, :, 0].max()) < 1e-3 * float(want[0].max())  # the cancelling reference


@pytest.fixture
def scaled(sd15):
    """The shared tiny pipeline at adapter scales 0.5-0.7, one a layer (so that s enters the numbers, and differs
    between the layers the probe forms together), restored after the test."""
    processors = [p for p in sd15.unet.attn_processors.values() if hasattr(p, "to_k_ip")]
    before = [list(p.scale) for p in processors]
    for index, proc in enumerate(processors):
        proc.scale = [0.7 - 0.1 * (index % 3)]
    yield sd15
    for proc, scale in zip(processors, before, strict=True):
        proc.scale = scale


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_contributions_equal_own_float64_recomputation(scaled, refs, guidance):
    pipe = scaled
    refs = refs + refs[:1]  # three references
    with probe(pipe, maps=True) as run, OwnHooks(pipe) as own:
        run._maps.keep_heads()
        generate(pipe, refs, guidance_scale=guidance)
    maps = run._maps
    names = [layer.name for layer in run.layers]
    branches = ["uncond", "cond"] if guidance > 1 else ["cond"]
    mass = run.reference_mass()
    assert list(mass.columns) == list(REFERENCE_MASS_COLUMNS)
    for row, branch in enumerate(branches):
        got = maps.contribution_weights(0, 0, 0, branch, range(len(names)), range(STEPS))  # (3, Q, R) each
        got_heads = maps.contribution_weights(0, 0, 0, branch, range(len(names)), range(STEPS), heads=True)
        assert len(got) == len(got_heads) == STEPS * len(names)
        for (step, index), values in got.items():
            want = own_numbers(own.contributions(step, names[index], len(refs)))
            norm = want["norm"][row].T  # (Q, R)
            # float32 on the probe's side (the einsums sum over T = 4 tokens and D = 8 channels, then C = 32):
            # relative errors ~1e-6; 1e-5 of the largest norm leaves 10x room on any CPU
            atol = 1e-5 * float(norm.abs().max())
            torch.testing.assert_close(values[0], norm, atol=atol, rtol=0)
            torch.testing.assert_close(values[1], want["share"][row].T, atol=1e-5, rtol=0)  # shares in [0, 1]
            torch.testing.assert_close(values[2], want["projection"][row].T, atol=atol, rtol=0)
            heads = got_heads[(step, index)]  # (3, H, Q, R)
            torch.testing.assert_close(heads[0], want["head_norm"][row].transpose(-1, -2), atol=atol, rtol=0)
            torch.testing.assert_close(heads[1], want["head_share"][row].transpose(-1, -2), atol=1e-5, rtol=0)
            torch.testing.assert_close(heads[2], want["head_projection"][row].transpose(-1, -2), atol=atol, rtol=0)
            # the projections of a position add up to the norm of the total (the head sum's and the heads')
            total = values[2].sum(-1)
            torch.testing.assert_close(heads[2].sum((0, -1)), total, atol=atol, rtol=0)
            # the table: the mean over query positions (one item per branch)
            part = mass[(mass["branch"] == branch) & (mass["step"] == step) & (mass["layer"] == names[index])]
            part = part.sort_values("reference")
            for k, column in enumerate(CONTRIBUTION_COLUMNS):
                want_mean = values[k].mean(0).numpy()
                np.testing.assert_allclose(part[column].to_numpy(), want_mean, rtol=1e-12, atol=1e-12)
            recomputed = want["norm"][row].mean(-1).numpy()  # (R,)
            np.testing.assert_allclose(part["contribution_norm"].to_numpy(), recomputed, rtol=0, atol=atol)


def test_contributions_follow_a_change_of_w_o_between_calls(sd15, refs):
    """The maps stack each layer size's ``W_o`` once a call: one changed in place between two calls of one probe
    (doubled) is read again in the second call, not served from the first call's stack."""
    weight = ip_layers(sd15)[next(iter(ip_layers(sd15)))][0].to_out[0].weight
    before = weight.detach().clone()
    with probe(sd15, maps=True) as run, OwnHooks(sd15) as own:
        names = [layer.name for layer in run.layers]
        want = {}
        try:
            for call in (0, 1):
                generate(sd15, refs, guidance_scale=1.0)
                for step in range(STEPS):  # the test's own numbers, from W_o as it is in this call
                    for index, name in enumerate(names):
                        own_step = call * STEPS + step
                        want[(call, step, index)] = own_numbers(own.contributions(own_step, name, len(refs)))
                with torch.no_grad():
                    weight.mul_(2 if call == 0 else 0.5)
        finally:
            if not torch.equal(weight, before):  # a call raised: the shared pipeline as it was
                with torch.no_grad():
                    weight.copy_(before)
    for call in (0, 1):
        got = run._maps.contribution_weights(call, 0, 0, "cond", range(len(names)), range(STEPS))
        assert len(got) == STEPS * len(names)
        for (step, index), values in got.items():
            norm = want[(call, step, index)]["norm"][0].T  # (Q, R)
            atol = 1e-5 * float(norm.abs().max())
            torch.testing.assert_close(values[0], norm, atol=atol, rtol=0)
            torch.testing.assert_close(values[2], want[(call, step, index)]["projection"][0].T, atol=atol, rtol=0)


def _heads_block(weight, heads, rows):
    """``weight`` split per head along rows (``rows=True``: ``(H, D, in)``) or columns (``(out, H, D)``)."""
    return weight.reshape(heads, -1, weight.shape[-1]) if rows else weight.reshape(weight.shape[0], heads, -1)


@contextlib.contextmanager
def own_transform(pipe, qk: bool, vo: bool, compensate: bool = True, seed: int = 0):
    """The test's own weight edits, per layer and head, restored bit for bit on exit: the q/k group
    (``W_q -> A W_q``, ``W_k -> A^{-T} W_k`` on the text and image keys) and the v/o basis change (``W_v -> B W_v``
    on the text and image values, ``W_o -> W_o B^{-1}``; ``compensate=False`` leaves ``W_o`` alone, which is no
    symmetry: the test's proof that its comparison can fail)."""
    generator = torch.Generator().manual_seed(seed)
    saved = []
    try:
        for attn, proc in ip_layers(pipe).values():
            heads = attn.heads
            d = attn.to_q.weight.shape[0] // heads

            def matrices(heads=heads, d=d):
                # well conditioned: a random rotation times scales in [0.5, 2]
                m = torch.randn(heads, d, d, generator=generator, dtype=torch.float64)
                rotation, _ = torch.linalg.qr(m)
                scales = 0.5 + 1.5 * torch.rand(heads, d, generator=generator, dtype=torch.float64)
                return rotation * scales[:, None, :]

            edits = []
            if qk:
                a = matrices()
                inverse_t = torch.linalg.inv(a).transpose(-1, -2)
                edits += [(attn.to_q, a, True)] + [(m, inverse_t, True) for m in (attn.to_k, *proc.to_k_ip)]
            if vo:
                b = matrices()
                edits += [(m, b, True) for m in (attn.to_v, *proc.to_v_ip)]
                if compensate:
                    edits.append((attn.to_out[0], torch.linalg.inv(b), False))
            for module, m, rows in edits:
                saved.append((module.weight, module.weight.detach().clone()))
                assert module.bias is None or not rows  # tiny SD: no q/k/v biases (to_out's bias is untouched)
                w = _heads_block(module.weight.detach().double(), heads, rows)
                new = torch.einsum("hij,hjk->hik", m, w) if rows else torch.einsum("ohi,hij->ohj", w, m)
                with torch.no_grad():
                    module.weight.copy_(new.reshape(module.weight.shape).float())
        yield
    finally:
        with torch.no_grad():
            for parameter, value in reversed(saved):
                parameter.copy_(value)


def _mass(pipe, refs):
    with probe(pipe, maps=True) as run:
        run._maps.keep_heads()
        generate(pipe, refs, guidance_scale=5.0)
    names = [layer.name for layer in run.layers]
    heads = run._maps.contribution_weights(0, 0, 0, "cond", range(len(names)), range(STEPS), heads=True)
    return run.reference_mass(), heads


def test_contributions_invariant_under_qk_group_and_vo_basis_change(sd15, refs):
    refs = refs + refs[:1]
    before = {name: p.detach().clone() for name, p in sd15.unet.named_parameters()}
    plain, plain_heads = _mass(sd15, refs)
    scale = float(plain["contribution_norm"].abs().max())
    for qk, vo in [(True, False), (False, True), (True, True)]:
        with own_transform(sd15, qk, vo):
            changed, changed_heads = _mass(sd15, refs)
        # the transformed weights are float32 roundings of float64 products (relative 6e-8 per weight, conditions
        # <= 4): the generation moves by float rounding only, ~1e-6 relative over 2 steps; 1e-4 leaves room
        np.testing.assert_allclose(changed["attention"], plain["attention"], rtol=0, atol=1e-5)
        for column in CONTRIBUTION_COLUMNS:
            atol = 1e-5 if column == "contribution_share" else 1e-4 * scale
            np.testing.assert_allclose(changed[column], plain[column], rtol=0, atol=atol)
        for key, values in plain_heads.items():
            torch.testing.assert_close(changed_heads[key][1], values[1], atol=1e-5, rtol=0)
            torch.testing.assert_close(changed_heads[key][[0, 2]], values[[0, 2]], atol=1e-4 * scale, rtol=0)
    # restored bit for bit
    for name, p in sd15.unet.named_parameters():
        assert torch.equal(p, before[name]), name
    # the comparison can fail: W_v -> B W_v without W_o -> W_o B^-1 is no symmetry and moves the columns far more
    with own_transform(sd15, qk=False, vo=True, compensate=False):
        broken, _ = _mass(sd15, refs)
    moved = np.abs(broken["contribution_norm"].to_numpy() - plain["contribution_norm"].to_numpy()).max()
    assert moved > 100 * 1e-4 * scale


def test_flux_contributions_equal_the_hook_points_own_computation(flux, refs):
    """Flux (no W_o: c_j = s sum w v in the inner dimension): the probe's contributions against the hook points'
    ``.ip.contribution`` (ipa_probe.intervention.points: its own hooks on norm_q, to_k_ip and to_v_ip, another
    implementation), recomputed here in float64 into norm, share and projection."""
    import ipa_probe

    call = dict(prompt="a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent")
    with probe(flux, maps=True) as run:
        flux(**call, generator=torch.Generator().manual_seed(0))
    _, cache = ipa_probe.run_with_cache(
        flux, r"\.ip\.contribution$", **call, generator=torch.Generator().manual_seed(0)
    )
    maps = run._maps
    names = [layer.name for layer in run.layers]
    got = maps.contribution_weights(0, 0, 0, "cond", range(len(names)), range(STEPS))
    assert len(got) == STEPS * len(names)
    for (step, index), values in got.items():
        c = cache.get(f"{names[index]}.ip.contribution", step)[0].double()  # (R, Q, C) of batch row 0
        total = c.sum(0)  # (Q, C)
        norm = c.norm(dim=-1).T  # (Q, R)
        projection = (c * (total / total.norm(dim=-1, keepdim=True))).sum(-1).T
        # both sides float32 (the same einsum order is not guaranteed): 1e-5 of the largest norm
        atol = 1e-5 * float(norm.max())
        torch.testing.assert_close(values[0], norm, atol=atol, rtol=0)
        torch.testing.assert_close(values[1], norm / norm.sum(-1, keepdim=True), atol=1e-5, rtol=0)
        torch.testing.assert_close(values[2], projection, atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------------- inside an edit
# Issue #49 points 2 and 3: inside an edit the probe reads what the layer used, the edited weights unnormalised where
# the edit left them so, and the contributions formed from them, or the edited contributions themselves. The test
# applies each edit to its own float64 readings: to the weights ``(B, H, Q, K)``, or (``c_edit``) to the
# contributions ``(B, H, R, Q, C)`` (an edit of the head sum that acts on every head alike).


def _own_scale(factor):
    def edit(w):  # reference 0 (the first half of the keys: two references) times factor, renormalised
        f = torch.ones(w.shape[-1], dtype=w.dtype)
        f[: w.shape[-1] // 2] = factor
        return w * f / (w * f).sum(-1, keepdim=True)

    return edit


def _ablated_first(w):  # the layer's keys held reference 1 only: reference 0 back at weight 0
    return torch.cat([torch.zeros_like(w), w], -1)


def _zero_last_head(w, ctx=None):
    w = w.clone()
    w[:, -1] = 0
    return w


def _zero_reference(c, ctx=None):
    c = c.clone()
    c[:, 0] = 0  # (B, R, Q, C): reference 0's contribution
    return c


def _own_zero_reference(per_head):
    per_head = per_head.clone()
    per_head[:, :, 0] = 0  # (B, H, R, Q, C): reference 0's, in every head
    return per_head


EDITS = {
    "ablate": (lambda pipe: intervene(pipe, 0), _ablated_first, None),
    "scale_0.5": (lambda pipe: intervene(pipe, 0, mode="scale", factor=0.5), _own_scale(0.5), None),
    "scale_1": (lambda pipe: intervene(pipe, 0, mode="scale", factor=1.0), None, None),
    "scale_2": (lambda pipe: intervene(pipe, 0, mode="scale", factor=2.0), _own_scale(2.0), None),
    "zero_head": (lambda pipe: intervene(pipe, hooks={r"\.ip\.weights$": _zero_last_head}), _zero_last_head, None),
    "zero_reference": (
        lambda pipe: intervene(pipe, hooks={r"\.ip\.contribution$": _zero_reference}),
        None,
        _own_zero_reference,
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_readings_inside_an_edit_equal_own_float64_recomputation(sd15, refs, edit):
    make, w_edit, c_edit = EDITS[edit]
    warns = pytest.warns(RuntimeWarning, match="no per-head") if c_edit else contextlib.nullcontext()
    with warns, probe(sd15, maps=True, keep_maps=True) as run, make(sd15), OwnHooks(sd15) as own:
        run.keep_head_maps()
        generate(sd15, refs, guidance_scale=5.0)
    names = [layer.name for layer in run.layers]
    mass = run.reference_mass()
    assert not mass[["attention", *CONTRIBUTION_COLUMNS]].isna().any().any()
    for row, branch in enumerate(["uncond", "cond"]):
        got = run.contributions(0, 0, 0, branch)  # {(step, index): (3, Q, R)}
        got_heads = run.contributions(0, 0, 0, branch, heads=True)
        assert len(got) == STEPS * len(names)
        # per-head contributions are undefined under an edit of their head sum: not recorded there
        assert len(got_heads) == (0 if c_edit else len(got))
        for (step, index), values in got.items():
            name = names[index]
            w = own.weights(step, name, w_edit)  # (B, H, Q, K)
            # the kept map: the edited weights as the layer used them (float16 maps: 5e-4 relative; 2e-3)
            kept = torch.cat([m.double() for m in run.maps[(0, step, name, 0)]])
            torch.testing.assert_close(kept, w, rtol=0, atol=2e-3)
            # the reference shares: head mean of each reference's weight, not renormalised, mean over positions
            shares = w[row].mean(0).reshape(w.shape[-2], 2, -1).sum(-1).mean(0)  # (R,)
            part = mass[(mass["branch"] == branch) & (mass["step"] == step) & (mass["layer"] == name)]
            part = part.sort_values("reference")
            np.testing.assert_allclose(part["attention"].to_numpy(), shares.numpy(), rtol=0, atol=1e-6)
            per_head = own.contributions(step, name, 2, w_edit)
            want = own_numbers(per_head if c_edit is None else c_edit(per_head))
            atol = 1e-5 * float(want["norm"][row].abs().max())
            torch.testing.assert_close(values[0], want["norm"][row].T, atol=atol, rtol=0)
            torch.testing.assert_close(values[1], want["share"][row].T, atol=1e-5, rtol=0)
            torch.testing.assert_close(values[2], want["projection"][row].T, atol=atol, rtol=0)
            np.testing.assert_allclose(part["contribution_norm"], want["norm"][row].mean(-1), rtol=0, atol=atol)
            if not c_edit:
                heads = got_heads[(step, index)]  # (3, H, Q, R)
                torch.testing.assert_close(heads[0], want["head_norm"][row].transpose(-1, -2), atol=atol, rtol=0)
                torch.testing.assert_close(heads[2], want["head_projection"][row].transpose(-1, -2), atol=atol, rtol=0)
    if edit == "zero_head":  # the probe's table before the fix read 1.0 here: the layer used 1 - 1/H
        sums = mass.groupby(["step", "layer", "branch"], observed=True).attention.sum()
        heads = sd15.unet.get_submodule(names[0]).heads
        np.testing.assert_allclose(sums.to_numpy(), 1 - 1 / heads, rtol=0, atol=1e-6)
        # the statistics table: the zeroed head's rows have no weighting to compare (NaN, every row counted lost),
        # where renormalising read them as uniform; the other heads keep their numbers
        table = run.to_dataframe()
        table = table[table["branch"].isin(["cond", "uncond"])]
        zeroed, kept = table[table["head"] == heads - 1], table[table["head"] != heads - 1]
        undefined = ["spearman", "kl", "neff_attn", "neff_nw", "qf_kl", "qf_neff_nw"]  # kl, neff read uniform before
        assert len(zeroed) and zeroed[undefined].isna().all().all() and (zeroed["nonfinite"] == 1).all()
        assert kept[undefined].notna().all().all() and (kept["nonfinite"] == 0).all()


def test_contributions_are_nan_and_said_so_after_an_output_edit(sd15, refs):
    """An edit of ``.ip.output`` leaves no per-reference split of what the layer added: the contribution columns are
    NaN with a warning; the weights, which it did not touch, read as the layer's own."""
    halve = {r"\.ip\.output$": lambda t, ctx: t * 0.5}
    with pytest.warns(RuntimeWarning, match="NaN after an output edit"):
        with probe(sd15, maps=True) as run, intervene(sd15, hooks=halve), OwnHooks(sd15) as own:
            generate(sd15, refs, guidance_scale=1.0)
    mass = run.reference_mass()
    assert len(mass) and mass[CONTRIBUTION_COLUMNS].isna().all().all()
    for (step, name), part in mass.groupby(["step", "layer"], observed=True):
        w = own.weights(step, name)[0].mean(0)  # (Q, K)
        shares = w.reshape(w.shape[0], 2, -1).sum(-1).mean(0)
        np.testing.assert_allclose(part.sort_values("reference")["attention"], shares.numpy(), rtol=0, atol=1e-6)
