"""The probe on tiny SD 1.5 / SDXL pipelines: parity, lifecycle, statistics wiring, selections and bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from helpers import PIPELINE_CASES, CaptureQK, CountScalarReads, masks_for, near_ties
from scipy import stats as sps

import ipa_probe
import ipa_probe.capture.cells
import ipa_probe.images
import ipa_probe.layers
from ipa_probe.capture.run import probe
from ipa_probe.statistics.schema import GAUGE_COLUMNS, NULL_COLUMNS
from ipa_probe.tiny.sd import tiny_pipeline

STEPS = 3


def generate(pipe, refs, adapters=1, **kwargs):
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "np")
    images = [refs] * adapters if adapters > 1 else [refs]
    generator = torch.Generator().manual_seed(0)
    return pipe("a photo of a flower", ip_adapter_image=images, generator=generator, **kwargs).images


def _hook_snapshot(pipe):
    return {
        (component, name): (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._forward_hooks_with_kwargs))
        for component, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for name, m in module.named_modules()
    }


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("kind, variant, adapters, guidance, masks", PIPELINE_CASES)
def test_probe_output_is_bit_identical(refs, kind, variant, adapters, guidance, masks):
    pipe = tiny_pipeline(kind, ip_adapter=variant, num_adapters=adapters)
    kwargs = {"guidance_scale": guidance}
    if masks:
        kwargs["cross_attention_kwargs"] = {"ip_adapter_masks": masks_for(len(refs))}
    plain = generate(pipe, refs, adapters, **kwargs)
    with probe(pipe) as run:
        probed = generate(pipe, refs, adapters, **kwargs)
    assert np.abs(plain - probed).max() == 0
    df = run.to_dataframe()
    assert set(df["branch"]) == ({"cond", "uncond"} if guidance > 1 else {"cond"})
    assert set(df["adapter"]) == set(range(adapters))
    assert df["step"].nunique() == STEPS
    assert df["spearman"].notna().all()


# --------------------------------------------------------------------------- lifecycle


def test_restores_pipeline_exactly_after_normal_exit(sd15, refs):
    processors = dict(sd15.unet.attn_processors)
    hooks = _hook_snapshot(sd15)
    with probe(sd15):
        generate(sd15, refs)
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert _hook_snapshot(sd15) == hooks
    assert "_ipa_probe" not in sd15.unet.__dict__
    assert "encode_prompt" not in vars(sd15)  # the evidence wrapper lived on the instance only while probing


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_restores_pipeline_after_exception(sd15, refs, error):
    processors = dict(sd15.unet.attn_processors)
    hooks = _hook_snapshot(sd15)
    with pytest.raises(type(error)):
        with probe(sd15) as run:
            generate(sd15, refs, num_inference_steps=2)
            raise error
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert _hook_snapshot(sd15) == hooks
    assert len(run.to_dataframe()) > 0  # what was recorded before the error is kept
    with probe(sd15):  # and the pipeline can be probed again
        pass


def test_a_probe_inside_a_probe_reads_as_each_does_alone(sd15, refs):
    """Two probes with their own options on one pipeline: each table equals that of a probe alone around the same
    calls (its own null draws, its own steps), bit for bit; the outer one also records the inner block's call."""
    hooks = _hook_snapshot(sd15)
    with probe(sd15, maps=True) as outer:
        generate(sd15, refs)
        with probe(sd15, steps=[1], rows=None, seed=3) as inner:
            generate(sd15, refs)
    assert _hook_snapshot(sd15) == hooks and ipa_probe.list_hooks(sd15) == []
    with probe(sd15, maps=True) as outer_alone:
        generate(sd15, refs)
        generate(sd15, refs)
    with probe(sd15, steps=[1], rows=None, seed=3) as inner_alone:
        generate(sd15, refs)
    for run, alone in ((outer, outer_alone), (inner, inner_alone)):
        pd.testing.assert_frame_equal(run.to_dataframe(), alone.to_dataframe(), check_exact=True)
    assert outer.to_dataframe()["call"].nunique() == 2 and set(inner.to_dataframe()["step"]) == {1}


def test_set_ip_adapter_scale_and_unload_work_while_probing(refs):
    pipe = tiny_pipeline("sd15")
    with probe(pipe) as run:
        pipe.set_ip_adapter_scale(0.5)
        assert all(p.scale == [0.5] for p in pipe.unet.attn_processors.values() if hasattr(p, "scale"))
        generate(pipe, refs, num_inference_steps=1)
        pipe.unload_ip_adapter()
        pipe("a photo", num_inference_steps=1, output_type="np")
    assert not any(isinstance(p, IPAdapterAttnProcessor2_0) for p in pipe.unet.attn_processors.values())
    assert all(isinstance(p, AttnProcessor2_0) for p in pipe.unet.attn_processors.values())
    assert len(run.to_dataframe()) > 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pipe.unet.modules())


def test_results_are_only_available_after_the_block(sd15):
    with probe(sd15) as run:
        with pytest.raises(RuntimeError, match="after"):
            run.to_dataframe()


# --------------------------------------------------------------------------- statistics wiring


def test_statistics_match_an_independent_recomputation(refs):
    """Capture q and k_ip with our own hooks and recompute Spearman/Pearson per head with scipy."""
    pipe = tiny_pipeline("sd15")
    layer = ipa_probe.layers.find_ip_layers(pipe, r"^up_blocks\.1")[0].name
    attn = pipe.unet.get_submodule(layer)
    captured = {}
    h1 = attn.to_q.register_forward_hook(lambda m, a, o: captured.setdefault("q", o.detach().clone()))
    h2 = attn.processor.to_k_ip[0].register_forward_hook(lambda m, a, o: captured.setdefault("k", o.detach().clone()))
    try:
        with probe(pipe, layers=layer, steps=[0]) as run:
            generate(pipe, refs, guidance_scale=5.0)
    finally:
        h1.remove()
        h2.remove()
    df = run.to_dataframe()
    heads, batch = attn.heads, captured["q"].shape[0]
    d = captured["q"].shape[-1] // heads
    q = captured["q"].double().reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, Q, D)
    k = captured["k"].double().reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, K, D)
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    w = torch.softmax(-(torch.cdist(q, k) ** 2) / (2 * math.sqrt(d)), -1)
    any_tie, _ = near_ties(q @ k.transpose(-1, -2) / math.sqrt(d), k)  # (B, H, Q): rows float32 may rank otherwise
    # Tolerances: the probe works in float32, the reference in float64; 1e-4 (abs) or rel=1e-4 covers float32 sums
    # over a few hundred entries. A near-tied row may also swap two ranks in float32: rho of a row lies in [-1, 1].
    for b, branch in enumerate(["uncond", "cond"]):
        for head in range(heads):
            row = df[(df["branch"] == branch) & (df["head"] == head)].iloc[0]
            ab, wb = a[b, head], w[b, head]
            rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(ab, wb, strict=True)])
            r = sps.pearsonr(ab.ravel(), wb.ravel()).statistic
            kl = (ab * (ab.log() - wb.log())).sum(-1).mean().item()
            assert row.spearman == pytest.approx(rho, abs=1e-4 + 2 * any_tie[b, head].double().mean().item())
            assert row.pearson == pytest.approx(r, abs=1e-4)
            assert row.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)  # a difference of two nearly equal log-weights
            assert row.bandwidth == pytest.approx(d**0.25)  # h = d^(1/4) in float32
            assert row.neff_attn == pytest.approx((1 / (ab * ab).sum(-1)).mean().item(), rel=1e-4)
            norms = k[b, head].norm(dim=-1)
            assert row.k_norm_spread == pytest.approx((norms.std(correction=0) / norms.mean()).item(), rel=1e-4)
            assert row.q_norm == pytest.approx(q[b, head].norm(dim=-1).mean().item(), rel=1e-4)


@pytest.mark.parametrize("noise", [0.0, 1e-6], ids=["as-computed", "nw-logits-perturbed"])
def test_equal_key_norms_give_rho_one_at_matched_bandwidth(refs, noise, monkeypatch):
    """With keys of equal norm, NW and attention differ by a constant per row: same ranks, same weights.

    Exact in exact arithmetic; in float32 the two logit computations round differently, so two keys whose logits lie
    within rounding of each other may swap (a near-tie) on one CPU and not on another. The test recomputes every row in
    float64 from its own hooks and decides near-ties with the stated tolerance ``NEAR_TIE``: a cell with no near-tied
    row must give rho = 1 and top-1 = 1; in the others only the near-tied rows may fall short. The ``noise`` case adds
    Gaussian noise of 1e-6 of each row's largest |logit| to the probe's NW logits (several times the rounding a
    different kernel or thread count makes), to show the assertions hold whatever the machine's rounding.
    """
    if noise:
        original = ipa_probe.capture.cells.nw_logits
        gen = torch.Generator().manual_seed(1)  # seed 1 swaps a near-tied pair in this setup (the case on issue #20)

        def perturbed(q, k, h):
            x = original(q, k, h)
            return x + noise * x.abs().amax(-1, keepdim=True) * torch.randn(x.shape, generator=gen, dtype=x.dtype)

        monkeypatch.setattr(ipa_probe.capture.cells, "nw_logits", perturbed)
    pipe = tiny_pipeline("sd15", ip_adapter="plus")
    heads = 2  # tiny pipelines have 2 heads

    def normalise(module, args, output):
        per_head = output.reshape(output.shape[0], -1, heads, output.shape[-1] // heads)  # (B, K, H, D)
        return (per_head / per_head.norm(dim=-1, keepdim=True)).reshape(output.shape)

    with CaptureQK(pipe, key_hook=normalise) as capture, probe(pipe) as run:
        generate(pipe, refs)
    df = run.to_dataframe()
    strict = 0
    for (layer, step), cell in df.groupby(["layer", "step"]):
        any_tie, top_tie = capture.ties(layer, step, heads)  # (B, H, Q)
        for b, branch in enumerate(["uncond", "cond"]):  # CFG's batch layout
            for head in range(heads):
                row = cell[(cell["branch"] == branch) & (cell["head"] == head)].iloc[0]
                tied, top = any_tie[b, head].double().mean().item(), top_tie[b, head].double().mean().item()
                # rho of a row lies in [-1, 1]: only the near-tied share of the rows can pull the mean below 1;
                # 1e-6: float32 rounding of the rank correlation's own sums
                assert 1 - 2 * tied - 1e-6 <= row.spearman <= 1 + 1e-6, (layer, step, branch, head, tied)
                assert row.top1 >= 1 - top, (layer, step, branch, head, top)
                strict += tied == 0
                if tied == 0:
                    assert row.spearman == pytest.approx(1.0, abs=1e-6)  # float32 sums of ranks, no rank swaps
    assert strict >= 0.8 * len(df), f"only {strict} of {len(df)} cells are free of near-ties: the test checks little"
    # KL of two softmaxes whose logits differ by the key norms' float32 rounding (and the added noise): ~1e-7
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)
    assert df["k_norm_spread"].max() < 1e-5  # std/mean of norms that are 1 up to float32 rounding (~1e-7)


_first = torch.tensor([0])


@pytest.mark.parametrize("kernel_passes_nan", [False, True], ids=["as-run", "nan-output"])
def test_nonfinite_weights_are_flagged_not_raised(sd15, refs, kernel_passes_nan):
    """NaN keys in one batch item are counted in ``nonfinite``, never raised, and never reach another item's rows.

    Two images of one prompt without CFG, so the items never mix (CFG would mix a poisoned branch into the shared
    latents). Whether NaN keys make the attention's *output* NaN, and so the item's later queries, depends on the
    CPU's attention kernel (some kernels' softmax drops them), so the test reads each layer's queries from the
    pipeline itself and asserts exactly the rows that follow from them. The ``nan-output`` case makes the poisoned
    layer's output NaN for that item, as a kernel that passes NaN on does, so both behaviours are checked here.
    """
    layers = ipa_probe.layers.find_ip_layers(sd15)
    poisoned_layer = layers[0].name
    nan_queries: dict[str, list[bool]] = {layer.name: [] for layer in layers}  # per layer, per pass: item 0's q

    def poison(module, args, output):
        output = output.clone()
        output[0] = math.nan  # the first image's keys, at every pass
        return output

    handles = [layers[0].attention.processor.to_k_ip[0].register_forward_hook(poison)]
    if kernel_passes_nan:
        handles.append(layers[0].attention.register_forward_hook(lambda m, a, o: o.index_fill(0, _first, math.nan)))
    for layer in layers:
        record = nan_queries[layer.name]
        handles.append(
            layer.attention.to_q.register_forward_hook(
                lambda m, a, o, r=record: r.append(not o[0].isfinite().all().item())
            )
        )
    try:
        with probe(sd15, branches=("poisoned", "clean")) as run:
            latents = generate(sd15, refs, output_type="latent", guidance_scale=1.0, num_images_per_prompt=2)
    finally:
        for h in handles:
            h.remove()
    df = run.to_dataframe()
    assert set(df.branch) == {"poisoned", "clean"}
    clean, poisoned = df[df.branch == "clean"], df[df.branch == "poisoned"]
    assert (clean["nonfinite"] == 0).all() and clean["spearman"].notna().all()
    assert latents[1].isfinite().all()
    expected = [
        1.0 if layer == poisoned_layer or nan_queries[layer][step] else 0.0
        for layer, step in zip(poisoned.layer, poisoned.step, strict=True)
    ]
    np.testing.assert_array_equal(poisoned["nonfinite"], expected)  # a fraction of rows that is 0 or 1 exactly
    assert poisoned[poisoned.layer == poisoned_layer]["spearman"].isna().all()  # no finite row left: NaN, no error
    if kernel_passes_nan:  # the item is NaN from the poisoned layer on: every later step is all non-finite
        assert (poisoned[poisoned.step > 0]["nonfinite"] == 1).all() and not latents[0].isfinite().any()


def test_no_host_synchronisation_inside_the_denoising_loop(sd15, refs):
    """The probe adds no scalar read to the pipeline call (it only enqueues device work)."""
    kwargs = {"output_type": "latent", "guidance_scale": 5.0}
    generate(sd15, refs, **kwargs)  # warm-up
    with CountScalarReads() as plain:
        generate(sd15, refs, **kwargs)
    for bandwidth in ("matched", "fit", 1.5, lambda t: 1.0 + t / 1000):
        with probe(sd15, bandwidth=bandwidth) as run:
            with CountScalarReads() as probed:
                generate(sd15, refs, **kwargs)
        assert probed.count == plain.count, bandwidth
        cond = run.to_dataframe().query("branch == 'cond'")
        assert cond[list(GAUGE_COLUMNS + NULL_COLUMNS)].notna().all().all()  # computed inside the counted call


# --------------------------------------------------------------------------- options


def test_bandwidth_options(sd15, refs):
    tables = {}
    bandwidths = {"matched": "matched", "float": 0.7, "callable": lambda t: 0.5 + t / 500, "fit": "fit"}
    with CaptureQK(sd15) as capture:
        for name, bw in bandwidths.items():
            with probe(sd15, bandwidth=bw) as run:
                generate(sd15, refs)
            tables[name] = run.to_dataframe()
    np.testing.assert_allclose(tables["float"]["bandwidth"], 0.7, rtol=1e-6)  # a float32 copy of 0.7
    callable_bw = tables["callable"].groupby("timestep")["bandwidth"].first()
    np.testing.assert_allclose(callable_bw.to_numpy(), 0.5 + callable_bw.index.to_numpy() / 500, rtol=1e-6)
    # Rank statistics do not depend on h: each h rounds the NW logits differently, so only keys within rounding of
    # each other (near-ties, recomputed in float64 from the first run's q and k: every run is the same generation)
    # may swap; a cell without near-tied rows must agree to the float32 rounding of the rank sums (1e-6).
    matched = tables["matched"].set_index(["step", "layer", "branch", "head"])
    heads = sd15.unet.get_submodule(capture.layers[0].name).heads
    for name in ("float", "callable", "fit"):
        other = tables[name].set_index(matched.index.names).loc[matched.index]
        for (step, layer, branch, head), row in other.iterrows():
            any_tie, top_tie = capture.ties(layer, step, heads)
            b = ["uncond", "cond"].index(branch)  # CFG's batch layout
            tied, top = any_tie[b, head].double().mean().item(), top_tie[b, head].double().mean().item()
            ref = matched.loc[(step, layer, branch, head)]
            assert abs(row.spearman - ref.spearman) <= 2 * tied + 1e-6, (name, step, layer, branch, head)
            assert abs(row.top1 - ref.top1) <= top + 1e-6, (name, step, layer, branch, head)
            # rho_excess is rho minus a baseline that does not depend on h: the same allowance (float32 sums: 1e-5)
            assert abs(row.rho_excess - ref.rho_excess) <= 2 * tied + 1e-5, (name, step, layer, branch, head)
        # the logit ratio is taken in the vectors' own units, so h does not enter it either (float32 sums: 1e-5)
        for column in ("logit_ratio", "rho_baseline"):
            np.testing.assert_allclose(tables[name][column], tables["matched"][column], rtol=1e-5, atol=1e-6)
    # the fitted h never does worse in KL than the matched one, which is on its grid; 1e-6: the two compute the
    # logits in a different order (energy / h^2 against centred dot products), float32 rounding of the KL
    assert (tables["fit"]["kl"] <= tables["matched"]["kl"] + 1e-6).all()
    assert tables["fit"]["bandwidth"].nunique() > 1


def test_layer_step_and_head_selection(sd15, refs):
    with probe(sd15, layers=[r"^up_blocks\.1"], steps=[0, 2], heads=[1]) as run:
        generate(sd15, refs)
    df = run.to_dataframe()
    assert df["layer"].str.startswith("up_blocks.1").all()
    assert sorted(df["step"].unique()) == [0, 2]
    assert set(df["head"]) == {1}
    with probe(sd15, steps=slice(1, None)) as run:
        generate(sd15, refs)
    assert sorted(run.to_dataframe()["step"].unique()) == [1, 2]


def test_batch_nonsquare_and_two_calls(sd15, refs):
    with probe(sd15) as run:
        generate(sd15, refs, num_images_per_prompt=2, height=64, width=96)
        generate(sd15, refs, num_inference_steps=2)
    df = run.to_dataframe()
    assert sorted(df["call"].unique()) == [0, 1]
    assert df[df.call == 0]["step"].nunique() == STEPS and df[df.call == 1]["step"].nunique() == 2
    summary = run.summary()
    assert {"spearman", "pearson", "spearman_null", "frac_rho_gt_0.9"} <= set(summary.columns)


def test_keep_maps_shapes_and_budget(sd15, refs):
    with probe(sd15, keep_maps=True, steps=[0]) as run:
        generate(sd15, refs, guidance_scale=5.0)
    assert run.maps
    (call, step, layer, adapter), (weights,) = next(iter(run.maps.items()))
    assert weights.dtype == torch.float16 and weights.device.type == "cpu"
    b, h, q, k = weights.shape
    assert (b, k) == (2, 2 * 4)  # CFG doubles the batch; two reference images of 4 tokens
    # float16 maps: 8 weights each rounded to 2^-11 relative, so a row sums to 1 within ~8 * 2^-12 < 2e-3
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(b, h, q), atol=2e-3, rtol=0)
    assert run.map_branches[(call, step, layer, adapter)] == [("uncond", "cond")]
    with pytest.raises(ValueError, match="max_map_bytes"):
        with probe(sd15, keep_maps=True, max_map_bytes=1000):
            generate(sd15, refs)


def test_save_and_plot(sd15, refs, tmp_path, monkeypatch):
    with probe(sd15) as run:
        generate(sd15, refs)
    paths = run.save(tmp_path / "out")
    import json

    import pandas as pd

    assert len(pd.read_parquet(paths["table"])) == len(run.to_dataframe())
    record = json.loads(paths["summary"].read_text())
    assert record["settings"]["bandwidth"] == "matched" and "torch" in record["versions"]
    assert paths["plot"].stat().st_size > 0
    assert run.plot().axes
    # a save that fails half-way (here: while drawing the plot) leaves the earlier files whole and no temp file
    before = {name: path.read_bytes() for name, path in paths.items()}

    def broken_savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"half a png")
        raise OSError("disk full")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        run.save(tmp_path / "out")  # the same run again: allowed, and written aside until whole
    assert {name: path.read_bytes() for name, path in paths.items()} == before  # the previous save, exactly
    listed = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != ".ipa_probe-staging")
    assert listed == sorted([*(p.name for p in paths.values()), ".ipa_probe.lock", "ipa_probe_manifest.json"])
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_save_writes_a_manifest_and_obeys_the_folder_rules(sd15, refs, tmp_path):
    """Issue 39: ProbeRun.save wrote no manifest, so runs mixed through the Python API."""
    import hashlib
    import json

    from ipa_probe.runfolder import RunConflict

    with probe(sd15) as run:
        generate(sd15, refs)
    out = tmp_path / "out"
    paths = run.save(out)
    record = json.loads((out / "ipa_probe_manifest.json").read_text())
    assert record["status"] == "finished" and record["command"] == "ipa_probe ProbeRun.save"
    assert set(record["files"]) == {p.name for p in paths.values()}
    for name, entry in record["files"].items():
        assert entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    with probe(sd15, bandwidth=0.5) as other:
        generate(sd15, refs)
    with pytest.raises(RunConflict, match="another run"):  # a ValueError: other settings, same folder
        other.save(out)
    other.save(out, overwrite=True)
    assert json.loads((out / "ipa_probe_manifest.json").read_text())["settings"]["bandwidth"] == 0.5


# --------------------------------------------------------------------------- bad input


def test_no_ip_adapter_raises_before_anything_changes(refs):
    pipe = tiny_pipeline("sd15")
    pipe.unload_ip_adapter()
    processors = dict(pipe.unet.attn_processors)
    with pytest.raises(ValueError, match="load_ip_adapter"):
        with probe(pipe):
            pass
    assert all(pipe.unet.attn_processors[k] is v for k, v in processors.items())


def test_unsupported_processor_is_named(sd15):
    from diffusers.models.attention_processor import IPAdapterXFormersAttnProcessor

    pipe = tiny_pipeline("sd15")
    name = next(k for k, v in pipe.unet.attn_processors.items() if isinstance(v, IPAdapterAttnProcessor2_0))
    old = pipe.unet.attn_processors[name]
    xf = IPAdapterXFormersAttnProcessor(old.hidden_size, old.cross_attention_dim, old.num_tokens, old.scale)
    pipe.unet.get_submodule(name.removesuffix(".processor")).set_processor(xf)
    with pytest.raises(ValueError, match="IPAdapterXFormersAttnProcessor.*Supported processor classes"):
        with probe(pipe):
            pass


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": "no_such_layer"}, "matched none"),
        ({"layers": "("}, "not a valid regular expression"),
        ({"bandwidth": 0.0}, "positive"),
        ({"bandwidth": -1.0}, "positive"),
        ({"bandwidth": "wide"}, "matched"),
        ({"heads": [7]}, "heads"),
        ({"steps": [-1]}, "steps"),
    ],
)
def test_bad_settings_raise_before_anything_changes(sd15, kwargs, match):
    hooks = _hook_snapshot(sd15)
    with pytest.raises((ValueError, TypeError), match=match):
        with probe(sd15, **kwargs):
            pass
    assert _hook_snapshot(sd15) == hooks
    assert "_ipa_probe" not in sd15.unet.__dict__


def test_not_an_image_is_a_clear_error(tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with pytest.raises(ValueError, match="not an image"):
        ipa_probe.images.load_image(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ipa_probe.images.load_image(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="PIL"):
        ipa_probe.images.load_image(np.zeros((4, 4, 3)))
