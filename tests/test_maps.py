"""Reference maps (probe(..., maps=True)) against an independent float64 recomputation from the test's own hooks."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from helpers import PIPELINE_CASES, CountScalarReads, case_call, masks_for

from ipa_probe.capture.maps import MAP_TABLE_COLUMNS
from ipa_probe.capture.run import probe
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline

STEPS = 2


def generate(pipe, refs, adapters=1, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "np")
    generator = torch.Generator().manual_seed(0)
    return pipe("a photo", ip_adapter_image=[refs] * adapters, generator=generator, **kwargs).images


class OwnHooks:
    """The test's own forward hooks: per denoiser call, each layer's query and each adapter's image-token keys."""

    def __init__(self, pipe):
        self.pipe, self.handles, self.calls = pipe, [], []
        self.layers = {
            name[: -len(".processor")]: (module, proc)
            for name, proc in pipe.unet.attn_processors.items()
            if hasattr(proc, "to_k_ip")
            for module in [pipe.unet.get_submodule(name[: -len(".processor")])]
        }

    def __enter__(self):
        self.handles.append(self.pipe.unet.register_forward_pre_hook(lambda m, a: self.calls.append({})))
        for name, (attn, proc) in self.layers.items():
            self.handles.append(attn.to_q.register_forward_hook(self._save(name, "q")))
            for a, to_k_ip in enumerate(proc.to_k_ip):
                self.handles.append(to_k_ip.register_forward_hook(self._save(name, a)))
        return self

    def _save(self, name, what):
        def hook(module, args, output):
            self.calls[-1].setdefault((name, what), []).append(output.detach().double())

        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def shares(self, step, name, adapter, tokens, regions=None, h2=None):
        """float64 ``(B, Q, R, T)`` shares of each image token (attention, or NW with bandwidth^2 ``h2``)."""
        attn = self.layers[name][0]
        heads = attn.heads
        q = self.calls[step][(name, "q")][0]  # (B, Q, H*D)
        keys = self.calls[step][(name, adapter)]  # one (B, R, T, H*D), or one (B, T, H*D) per reference (masks)
        batch, queries, inner = q.shape
        d = inner // heads
        qh = q.reshape(batch, queries, heads, d).transpose(1, 2)  # (B, H, Q, D)
        per_ref = []
        for k in keys:
            kh = k.reshape(batch, -1, heads, d).transpose(1, 2)  # (B, [R,] T, H*D) -> (B, H, K, D)
            if h2 is None:
                logits = qh @ kh.transpose(-1, -2) / math.sqrt(d)
            else:
                logits = -((qh[..., :, None, :] - kh[..., None, :, :]) ** 2).sum(-1) / (2 * h2)
            per_ref.append(torch.softmax(logits, -1).mean(1))  # (B, Q, K)
        w = torch.cat(per_ref, -1).reshape(batch, queries, -1, tokens)  # (B, Q, R, T)
        if regions is not None:  # (R, B, Q) mask weights: one softmax per reference, weighted by its region
            w = w * regions.permute(1, 2, 0)[..., None]
            w = w / w.sum((-1, -2), keepdim=True).clamp(min=1e-300)
        return w


def _side(queries):
    side = math.isqrt(queries)
    assert side * side == queries
    return side


# --------------------------------------------------------------------------- exactness


CASES = [
    ("sd15", "base", 1, 5.0, 1),
    ("sd15", "base", 1, 1.0, 2),
    ("sd15", "base", 2, 5.0, 1),
    ("sd15", "plus", 1, 5.0, 2),
    ("sdxl", "base", 1, 5.0, 1),
    ("sdxl", "plus", 2, 1.0, 1),
]


@pytest.mark.parametrize("kind, variant, adapters, guidance, per_prompt", CASES)
def test_one_layer_one_step_equals_own_recomputation(refs, kind, variant, adapters, guidance, per_prompt):
    pipe = tiny_pipeline(kind, ip_adapter=variant, num_adapters=adapters)
    with probe(pipe, maps=True) as run, OwnHooks(pipe) as own:
        generate(pipe, refs, adapters, guidance_scale=guidance, num_images_per_prompt=per_prompt)
    branches = ["uncond", "cond"] if guidance > 1 else ["cond"]
    tokens = 16 if variant == "plus" else 4
    h2 = None
    for step in range(STEPS):
        for name, (attn, _) in own.layers.items():
            for adapter in range(adapters):
                for b, branch in enumerate(branches):
                    for item in range(per_prompt):
                        row = b * per_prompt + item
                        for kind_, h2 in (("attention", None), ("nw", math.sqrt(attn.inner_dim // attn.heads))):
                            expected = own.shares(step, name, adapter, tokens, h2=h2)[row]  # (Q, R, T)
                            side = _side(expected.shape[0])
                            got = run.token_maps(
                                0, item, adapter, kind_, branch, [re.escape(name) + "$"], [step], (side, side)
                            )  # (R, T, side, side)
                            assert got.dtype == torch.float32 and got.shape == (len(refs), tokens, side, side)
                            want = expected.permute(1, 2, 0).reshape(len(refs), tokens, side, side)
                            torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
                            ref_map = run.reference_maps(
                                0, item, adapter, kind_, branch, [re.escape(name) + "$"], [step], (side, side)
                            )
                            torch.testing.assert_close(ref_map.double(), want.sum(1), atol=2e-6, rtol=0)


def test_shares_sum_to_one_over_references_everywhere(sd15, refs):
    with probe(sd15, maps=True) as run:
        generate(sd15, refs + refs[:1], guidance_scale=5.0)
    for kind in ("attention", "nw"):
        for size in ("image", "latent", (13, 21)):
            for branch in ("cond", "uncond"):
                maps = run.reference_maps(kind=kind, size=size, branch=branch)
                assert maps.shape[0] == 3 and (maps >= 0).all()
                torch.testing.assert_close(maps.sum(0), torch.ones(maps.shape[1:]), atol=1e-5, rtol=0)
    assert run.reference_maps(size="image").shape[1:] == (64, 64)
    assert run.reference_maps(size="latent").shape[1:] == (8, 8)


def test_one_reference_gives_all_ones(sd15, refs):
    with probe(sd15, maps=True) as run:
        generate(sd15, refs[:1])
    for kind in ("attention", "nw"):
        # a share s/s = 1 exactly, but resizing and averaging it sums weights (1 - x) + x that another kernel (FMA or
        # not, another vector width) may round to 1 - 1 ulp: 1e-6 is a few float32 ulps
        torch.testing.assert_close(run.reference_maps(kind=kind), torch.ones(1, 64, 64), atol=1e-6, rtol=0)


def test_masks_zero_a_reference_outside_its_region(sd15, refs):
    masks = masks_for(len(refs))
    with probe(sd15, maps=True) as run, OwnHooks(sd15) as own:
        generate(sd15, refs, guidance_scale=5.0, cross_attention_kwargs={"ip_adapter_masks": masks})
    for name in own.layers:
        expected_any = own.shares(0, name, 0, 4)  # (B, Q, R, T) unmasked per-reference softmaxes
        batch, queries = expected_any.shape[:2]
        regions = torch.stack(
            [IPAdapterMaskProcessor.downsample(masks[0][:, r], batch, queries, 1)[..., 0] for r in range(len(refs))]
        ).double()  # (R, B, Q), diffusers' own downsampling
        regions = regions.clamp(min=0)
        expected = own.shares(0, name, 0, 4, regions=regions)[1]  # cond row: (Q, R, T)
        side = _side(queries)
        got = run.token_maps(0, 0, 0, "attention", "cond", [re.escape(name) + "$"], [0], (side, side))
        want = expected.permute(1, 2, 0).reshape(len(refs), 4, side, side)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
        outside = (regions[:, 1] <= 0).reshape(len(refs), side, side)  # (R, side, side)
        ref_map = got.sum(1)
        assert outside.any() and (ref_map[outside] == 0).all()
    # at image size, each reference's share lies in its half (left: reference 0, right: reference 1)
    full = run.reference_maps(size="image")
    assert full[0, :, :8].min() > 0.99 and full[0, :, 56:].max() < 0.01
    assert full[1, :, 56:].min() > 0.99


def test_map_table_against_own_recomputation(sd15):
    refs = default_reference_images(3)  # three different images: no two references tie by construction
    with probe(sd15, maps=True) as run, OwnHooks(sd15) as own:
        generate(sd15, refs, guidance_scale=5.0)
    table = run.map_table()
    assert len(table) == STEPS * len(own.layers) * 2
    for _, row in table[table.branch == "cond"].iterrows():
        name, step = row["layer"], row["step"]
        attn = own.layers[name][0]
        a = own.shares(step, name, 0, 4)[1].sum(-1)  # (Q, R)
        n = own.shares(step, name, 0, 4, h2=math.sqrt(attn.inner_dim // attn.heads))[1].sum(-1)
        # Which reference float32 calls dominant where two shares nearly tie is the rounding's choice (with a
        # reference given twice it changed with the thread count). A position whose two largest shares on either
        # side lie within 1e-6 (float32 rounding of shares summing to 1) is undecided: only those may disagree.
        top2 = [x.topk(2, dim=-1).values for x in (a, n)]
        undecided = ((top2[0][:, 0] - top2[0][:, 1] < 1e-6) | (top2[1][:, 0] - top2[1][:, 1] < 1e-6)).double().mean()
        expected = (a.argmax(-1) == n.argmax(-1)).double().mean().item()
        assert undecided < 0.05  # the check below is a real one
        assert row["dominant_agree"] == pytest.approx(expected, abs=undecided.item() + 1e-9)
        assert row["tv"] == pytest.approx((0.5 * (a - n).abs().sum(-1)).mean().item(), abs=1e-6)
        assert row["positions"] == a.shape[0] and row["references"] == 3
    assert np.isfinite(table["timestep"]).all()


def test_branch_selection_against_own_recomputation(sd15):
    """map_table / reference_mass / summary(branch="cond"): the cond rows, whose means the test recomputes; the
    uncond rows are uniform by construction (zero image embeddings: every reference's tokens are equal)."""
    refs = default_reference_images(3)
    with probe(sd15, maps=True) as run, OwnHooks(sd15) as own:
        generate(sd15, refs, guidance_scale=5.0)
    cond, uncond = run.map_table(branch="cond"), run.map_table(branch="uncond")
    assert set(cond["branch"]) == {"cond"} and set(uncond["branch"]) == {"uncond"}
    assert cond.attrs["mean_over"] == ("head",) and len(cond) + len(uncond) == len(run.map_table())
    assert (uncond["dominant_agree"] == 1).all() and (uncond["tv"] < 1e-7).all()  # by construction
    tv, mass = [], np.zeros(3)
    for _, row in cond.iterrows():
        name, step = row["layer"], row["step"]
        attn = own.layers[name][0]
        a = own.shares(step, name, 0, 4)[1].sum(-1)  # (Q, R): batch item 1 is the cond branch
        n = own.shares(step, name, 0, 4, h2=math.sqrt(attn.inner_dim // attn.heads))[1].sum(-1)
        tv.append((0.5 * (a - n).abs().sum(-1)).mean().item())
        mass += a.mean(0).numpy() / len(cond)
        uniform = own.shares(step, name, 0, 4)[0].sum(-1)  # the uncond item
        torch.testing.assert_close(uniform, torch.full_like(uniform, 1 / 3), atol=1e-6, rtol=0)  # float32 shares
    assert cond["tv"].mean() == pytest.approx(np.mean(tv), abs=1e-6)  # float32 shares against float64 ones
    assert run.map_table()["tv"].mean() < cond["tv"].mean()  # what averaging over both branches hid
    per_ref = run.reference_mass(branch="cond").groupby("reference")["attention"].mean().to_numpy()
    np.testing.assert_allclose(per_ref, mass, atol=1e-6)
    summary = run.summary(branch="cond")
    assert summary.attrs["mean_over"] == ("layer", "head", "adapter") and set(summary["branch"]) == {"cond"}
    raw = run.to_dataframe()
    expected = raw[(raw["branch"] == "cond") & (raw["kind"] == "image")].groupby("step")["spearman"].mean()
    got = summary[summary["kind"] == "image"].set_index("step")["spearman"]
    np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match=r"branch='text'.*expected one of \['cond', 'uncond'\]"):
        run.map_table(branch="text")


def test_averages_over_selected_layers_and_steps(sd15, refs):
    with probe(sd15, maps=True) as run:
        generate(sd15, refs, num_inference_steps=3)
    names = [layer.name for layer in run.layers]
    single = [run.reference_maps(layers=[re.escape(n) + "$"], steps=[s]) for n in names for s in range(3)]
    torch.testing.assert_close(run.reference_maps(), torch.stack(single).mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(run.reference_maps(steps=[2]), torch.stack(single[2::3]).mean(0), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- parity, sync, memory


@pytest.mark.parametrize("kind, variant, adapters, guidance, masks", PIPELINE_CASES)
def test_output_bit_identical_with_maps(refs, kind, variant, adapters, guidance, masks):
    pipe, kwargs = case_call((kind, variant, adapters, guidance, masks), len(refs))
    plain = generate(pipe, refs, adapters, **kwargs)
    with probe(pipe, maps=True) as run:
        probed = generate(pipe, refs, adapters, **kwargs)
    assert np.abs(plain - probed).max() == 0
    maps = run.reference_maps(adapter=adapters - 1)
    torch.testing.assert_close(maps.sum(0), torch.ones(maps.shape[1:]), atol=1e-5, rtol=0)


def test_maps_leave_the_table_as_it_is(sd15, refs):
    """The maps are made from the records' logits when their pass ends, and the records wait for the call's one
    statistics pass as without maps: the table, its nulls' draws included, is the one ``maps=False`` gives."""
    tables = []
    for maps in (False, True):
        with probe(sd15, maps=maps) as run:
            generate(sd15, refs, output_type="latent", guidance_scale=5.0, num_inference_steps=3)
        tables.append(run.to_dataframe())
    assert tables[0]["spearman_null"].notna().any()
    pd.testing.assert_frame_equal(tables[0], tables[1])


@pytest.mark.parametrize("masks", [False, True])
def test_no_host_synchronisation_with_maps(sd15, refs, masks):
    kwargs = {"output_type": "latent", "guidance_scale": 5.0}
    if masks:
        kwargs["cross_attention_kwargs"] = {"ip_adapter_masks": masks_for(len(refs))}
    generate(sd15, refs, **kwargs)  # warm-up
    with CountScalarReads() as plain:
        generate(sd15, refs, **kwargs)
    with probe(sd15, maps=True) as run:
        with CountScalarReads() as probed:
            generate(sd15, refs, **kwargs)
    assert probed.count == plain.count
    assert run.map_steps() == list(range(STEPS))


def test_memory_as_estimated_and_independent_of_heads(sd15, refs):
    with probe(sd15, maps=True, max_map_bytes=10**9) as run:
        generate(sd15, refs, guidance_scale=5.0, num_images_per_prompt=2)
    kept = sum(t.numel() * t.element_size() for entries in run._maps.store.values() for _, t in entries)
    kept += sum(t.numel() * t.element_size() for entries in run._maps.contribution_store.values() for _, t in entries)
    # 2 kinds x float32 x (B = 4, Q, R x T = 8) per step and layer, and the contributions' norm and projection
    # 2 x float32 x (B, Q, R = 2): no head dimension
    queries = sum(e[0][1].shape[3] for (c, s, i, a), e in run._maps.store.items() if s == 0)
    assert kept == (2 * 8 + 2 * 2) * 4 * STEPS * 4 * queries == run._maps.estimated_bytes
    with pytest.raises(ValueError, match=r"maps=True would keep about .* raise max_map_bytes"):
        with probe(sd15, maps=True, max_map_bytes=kept - 1):
            generate(sd15, refs, guidance_scale=5.0, num_images_per_prompt=2)
    with probe(sd15, maps=True, max_map_bytes=kept):
        generate(sd15, refs, guidance_scale=5.0, num_images_per_prompt=2)


@pytest.mark.parametrize("guidance", [1.0, 5.0])
def test_per_head_shares_equal_own_recomputation_and_are_in_the_estimate(sd15, refs, guidance):
    """keep_heads: each head's softmax shares per reference against the test's own float64 hooks; their head mean is
    the averaged map; the kept bytes are what the estimate says; asking once maps are recorded is refused."""
    with probe(sd15, maps=True, max_map_bytes=10**9) as run, OwnHooks(sd15) as own:
        run._maps.keep_heads()
        generate(sd15, refs, guidance_scale=guidance, num_images_per_prompt=2)
    maps = run._maps
    branches = ["uncond", "cond"] if guidance > 1 else ["cond"]
    names = [layer.name for layer in run.layers]
    for b, branch in enumerate(branches):
        for item in range(2):
            heads = maps.head_weights(0, item, 0, branch, range(len(names)), range(STEPS))  # (H, Q, R) each
            averaged = maps.reference_weights(0, item, 0, "attention", branch, range(len(names)), range(STEPS))
            assert set(heads) == set(averaged) and len(heads) == STEPS * len(names)
            for (step, index), got in heads.items():
                attn = own.layers[names[index]][0]
                q = own.calls[step][(names[index], "q")][0][b * 2 + item]  # (Q, H*D)
                k = own.calls[step][(names[index], 0)][0][b * 2 + item]  # (R, T, H*D)
                d = q.shape[-1] // attn.heads
                qh = q.reshape(-1, attn.heads, d).transpose(0, 1)  # (H, Q, D)
                kh = k.reshape(-1, attn.heads, d).transpose(0, 1)  # (H, R*T, D)
                want = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(d), -1)  # (H, Q, R*T)
                want = want.reshape(attn.heads, q.shape[0], len(refs), -1).sum(-1)  # (H, Q, R)
                # 2e-6: the probe's softmax runs in float32 (shares ~0.5, eps 1.2e-7, summed over 4 tokens)
                torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
                torch.testing.assert_close(got.mean(0), averaged[(step, index)], atol=2e-7, rtol=0)
    kept = sum(t.numel() * t.element_size() for entries in maps.store.values() for _, t in entries)
    kept += sum(t.numel() * t.element_size() for entries in maps.head_store.values() for _, t in entries)
    for store in (maps.contribution_store, maps.contribution_head_store):
        kept += sum(t.numel() * t.element_size() for entries in store.values() for _, t in entries)
    heads = run.layers[0].heads
    assert all(layer.heads == heads for layer in run.layers)
    # float32 x (B, Q, R x T = 8) per step and layer: 2 kinds without heads, and H per-head attention shares; and
    # float32 x (B, Q, R = 2) for the contributions' norm and projection, on the head sum and per head
    queries = sum(e[0][1].shape[3] for (c, s, i, a), e in maps.store.items() if s == 0)
    batch = 2 * len(branches)
    expected = ((2 + heads) * 8 + 2 * (1 + heads) * 2) * 4 * STEPS * batch * queries
    assert kept == expected == maps.estimated_bytes
    with pytest.raises(ValueError, match="keep_heads: call it before the probed pipeline runs"):
        maps.keep_heads()
    with pytest.raises(ValueError, match="per-head weights need MapAccumulator.keep_heads"):
        with probe(sd15, maps=True) as plain:
            generate(sd15, refs)
        plain._maps.head_weights(0, 0, 0, "cond", [0], [0])


# --------------------------------------------------------------------------- figure and bad input


def test_plot_reference_maps(sd15, refs):
    with probe(sd15, maps=True) as run:
        image = generate(sd15, refs, num_inference_steps=3)[0]
    fig = run.plot_reference_maps(image=image, references=refs)
    assert len(fig.axes) == (1 + len(refs)) * (1 + 2 * 3) + 2  # the panels and two colorbars
    assert "early" in fig.axes[1].get_title() and "late" in fig.axes[5].get_title()
    fig = run.plot_reference_maps(ranges=1)  # without images: maps only
    assert len(fig.axes) == (1 + len(refs)) * 3 + 2


def test_bad_input(sd15, refs):
    with probe(sd15) as plain:
        generate(sd15, refs)
    with pytest.raises(ValueError, match="maps=True"):
        plain.reference_maps()
    with pytest.raises(TypeError, match="maps: expected True or False"):
        probe(sd15, maps="yes").__enter__()
    with probe(sd15, maps=True) as run:
        with pytest.raises(RuntimeError, match="still running"):
            run.reference_maps()
        generate(sd15, refs, guidance_scale=1.0)
    for kwargs, match in [
        ({"kind": "softmax"}, "kind"),
        ({"branch": "uncond"}, "branch"),
        ({"layers": "nope"}, "matched none"),
        ({"steps": [99]}, "none recorded"),
        ({"size": (0, 4)}, "size"),
        ({"call": 1}, "call"),
        ({"adapter": 1}, "adapter"),
        ({"item": 3}, "item=3"),
    ]:
        with pytest.raises(ValueError, match=match):
            run.reference_maps(**kwargs)


# --------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_probe_and_sweep_write_reference_maps(tmp_path, capsys):
    from ipa_probe.cli import main

    args = ["--kind", "sd15", "--steps", "2", "--size", "64", "64"]
    assert main(["probe", "--maps", "--out", str(tmp_path / "probe"), *args]) == 0
    assert (tmp_path / "probe" / "reference_maps.png").stat().st_size > 0
    table = pd.read_parquet(tmp_path / "probe" / "map_table.parquet")
    assert list(table.columns) == list(MAP_TABLE_COLUMNS) and table["step"].nunique() == 2

    manifest = tmp_path / "rows.jsonl"
    manifest.write_text('{"prompt": "a"}\n{"prompt": "b", "seed": 3}\n{"prompt": "c"}\n')
    base = ["sweep", str(manifest), "--no-progress", "--resamples", "99", *args]
    assert main([*base, "--out", str(tmp_path / "sweep"), "--maps"]) == 0
    drawn = sorted(p.parent.name for p in (tmp_path / "sweep" / "maps").glob("*/reference_maps.png"))
    assert len(drawn) == 1
    first = drawn[0]
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "sweep"), "--maps-rows", "99"]) == 2
    assert "--maps-rows 99: not rows of the manifest" in capsys.readouterr().err
    number = int(first.split("-")[1]) + 1
    assert main([*base, "--out", str(tmp_path / "sweep"), "--maps-rows", str(number)]) == 0
    assert (tmp_path / "sweep" / "maps" / f"row-{number:06d}" / "map_table.parquet").exists()


def test_map_items_are_the_batch_items_diffusers_gives_each_branch(sd15, refs):
    # diffusers' SD pipeline concatenates [negative prompts, prompts], each num_images_per_prompt items long
    with probe(sd15, maps=True) as run:
        generate(sd15, refs, guidance_scale=5.0, num_images_per_prompt=2)
    for step in run.map_steps():
        assert run.map_items(0, step, "uncond") == [0, 1] and run.map_items(0, step, "cond") == [2, 3]
    with pytest.raises(ValueError, match="branch"):
        run.map_items(0, 0, "nope")
    # the former name: the same items, with a DeprecationWarning naming the new one
    with pytest.warns(DeprecationWarning, match="map_items"):
        assert run.map_rows(0, 0, branch="cond") == [2, 3]
