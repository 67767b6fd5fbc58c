"""The probe's text branch and its compatibility with offload, torch.compile, low precision, callbacks and kwargs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import near_ties
from scipy import stats as sps

import ipa_probe.layers
from ipa_probe.capture.run import probe
from ipa_probe.tiny.sd import tiny_pipeline

PROMPT = "a photo of a flower"


def generate(pipe, refs, **kwargs):
    kwargs.setdefault("num_inference_steps", 3)
    kwargs.setdefault("output_type", "np")
    return pipe(PROMPT, ip_adapter_image=[refs], generator=torch.Generator().manual_seed(0), **kwargs).images


def probed_run(pipe, refs, probe_kwargs=None, **kwargs):
    with probe(pipe, **(probe_kwargs or {})) as run:
        images = generate(pipe, refs, **kwargs)
    return images, run.to_dataframe()


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_text_and_both_branches_keep_parity(refs, kind):
    pipe = tiny_pipeline(kind)
    # a real negative prompt: SDXL zeroes an empty one, whose identical keys leave rank statistics undefined
    kwargs = {"guidance_scale": 5.0, "negative_prompt": "blurry"}
    plain = generate(pipe, refs, **kwargs)
    images, df = probed_run(pipe, refs, {"branch": "both"}, **kwargs)
    assert np.abs(images - plain).max() == 0
    assert set(df["kind"]) == {"image", "text"}
    assert (df.loc[df["kind"] == "text", "adapter"] == -1).all()
    assert (df.loc[df["kind"] == "image", "adapter"] == 0).all()
    assert df["spearman"].notna().all()
    _, text_only = probed_run(pipe, refs, {"branch": "text"}, **kwargs)
    assert set(text_only["kind"]) == {"text"}
    cols = ["spearman", "pearson", "kl", "top1", "neff_attn", "k_norm_spread"]
    np.testing.assert_allclose(
        text_only[cols].to_numpy(), df[df["kind"] == "text"][cols].to_numpy(), rtol=1e-5, atol=1e-6
    )


def test_text_branch_leaves_padding_out(refs):
    """Recompute one layer's text-branch statistics with scipy on the real prompt tokens only."""
    pipe = tiny_pipeline("sd15")
    n_tokens = len(pipe.tokenizer(PROMPT).input_ids)  # start, words, end-of-text
    layer = ipa_probe.layers.find_ip_layers(pipe, r"^down_blocks\.1")[0].name
    attn = pipe.unet.get_submodule(layer)
    captured = {}
    h1 = attn.to_q.register_forward_hook(lambda m, a, o: captured.setdefault("q", o.detach().clone()))
    h2 = attn.to_k.register_forward_hook(lambda m, a, o: captured.setdefault("k", o.detach().clone()))
    try:
        _, df = probed_run(pipe, refs, {"branch": "text", "layers": layer, "steps": [0]}, guidance_scale=1.0)
    finally:
        h1.remove()
        h2.remove()
    heads = attn.heads
    d = captured["q"].shape[-1] // heads
    q = captured["q"].double().reshape(1, -1, heads, d).transpose(1, 2)[0]  # (H, Q, D)
    k = captured["k"].double().reshape(1, -1, heads, d).transpose(1, 2)[0, :, :n_tokens]  # (H, tokens, D)
    assert captured["k"].shape[1] == 77 > n_tokens
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    w = torch.softmax(-(torch.cdist(q, k) ** 2) / (2 * math.sqrt(d)), -1)
    tied = near_ties(q @ k.transpose(-1, -2) / math.sqrt(d), k)[0].double().mean(-1)  # (H,) rows float32 may swap
    for head in range(heads):
        row = df[df["head"] == head].iloc[0]
        rho = np.mean([sps.spearmanr(x, y).statistic for x, y in zip(a[head], w[head], strict=True)])
        # 1e-4: float32 against float64; a near-tied row may also swap two ranks (rho of a row lies in [-1, 1])
        assert row["spearman"] == pytest.approx(rho, abs=1e-4 + 2 * tied[head].item())
        assert row["pearson"] == pytest.approx(sps.pearsonr(a[head].ravel(), w[head].ravel()).statistic, abs=1e-4)
        assert row["neff_attn"] == pytest.approx((1 / (a[head] ** 2).sum(-1)).mean().item(), rel=1e-4)


def test_prompt_embeds_without_text_encoder_use_all_tokens(refs):
    pipe = tiny_pipeline("sd15")
    embeds, negative = pipe.encode_prompt(PROMPT, "cpu", 1, True)
    with probe(pipe, kind="text") as run:
        pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            ip_adapter_image=[refs],
            num_inference_steps=2,
            output_type="latent",
        )
    df = run.to_dataframe()
    assert df["spearman"].notna().all() and len(df) > 0


@pytest.fixture(scope="module")
def reference_run(refs):
    return probed_run(tiny_pipeline("sd15"), refs)


def _same_numbers(a, b, drawn: bool = True):
    """Every number equal; with ``drawn=False`` but the permutation nulls' (drawn on another schedule)."""
    numeric = [c for c in a.select_dtypes("number").columns if drawn or "spearman_null" not in c]
    np.testing.assert_allclose(a[numeric].to_numpy(), b[numeric].to_numpy(), rtol=1e-6, atol=1e-7)


def test_model_cpu_offload(refs, reference_run):
    pipe = tiny_pipeline("sd15")
    pipe.enable_model_cpu_offload(device="cpu")
    images, df = probed_run(pipe, refs)
    assert np.abs(images - reference_run[0]).max() == 0
    _same_numbers(df, reference_run[1])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["wrapped", "in_place", "regional"])
def test_torch_compile_denoiser(refs, reference_run, fresh_dynamo, how):
    pipe = tiny_pipeline("sd15")
    if how == "in_place":
        pipe.unet.compile(backend="eager")  # module.compile(): no wrapper, the module's own call compiled
    elif how == "regional":  # each transformer block compiled in place: the layers' hooks are traced, not the UNet's
        pipe.unet.compile_repeated_blocks(backend="eager")
    else:
        pipe.unet = torch.compile(pipe.unet, backend="eager")
    with probe(pipe) as run:
        images = generate(pipe, refs)
    df = run.to_dataframe()
    assert run.compiled  # told, so its records were formed at each pass
    assert np.abs(images - reference_run[0]).max() == 0
    # a compiled denoiser's records are formed at each pass (a CUDA graph may overwrite its outputs), an eager one's
    # when the call ends: the nulls draw over the rows in another order, their distribution the same
    _same_numbers(df, reference_run[1], drawn=False)
    assert df.filter(like="spearman_null").abs().max().max() <= 1 and df["spearman_null"].notna().all()


def test_callback_on_step_end_and_cross_attention_scale(refs):
    pipe = tiny_pipeline("sd15")

    def damp(pipe_, step, timestep, tensors):
        return {"latents": tensors["latents"] * 0.9}

    kwargs = {"callback_on_step_end": damp, "cross_attention_kwargs": {"scale": 0.5}}
    plain = generate(pipe, refs, **kwargs)
    images, df = probed_run(pipe, refs, **kwargs)
    assert np.abs(images - plain).max() == 0
    assert df["step"].nunique() == 3 and df["spearman"].notna().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_keeps_parity_and_float32_statistics(refs, reference_run, dtype):
    pipe = tiny_pipeline("sd15", dtype=dtype)
    plain = generate(pipe, refs, output_type="latent")
    images, df = probed_run(pipe, refs, output_type="latent")
    assert torch.equal(images, plain)
    assert df["spearman"].notna().all() and (df["nonfinite"] == 0).all()
    # the first step sees the same latents up to rounding: its statistics agree with float32 ones
    first, ref = df[df["step"] == 0], reference_run[1][reference_run[1]["step"] == 0]
    np.testing.assert_allclose(first["pearson"], ref["pearson"], atol=0.05)
