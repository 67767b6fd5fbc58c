"""The probe across diffusers' pipelines that take an IP-Adapter, against an independent float64 recomputation.

Each case runs a tiny pipeline (built with ``from_pipe`` from :func:`ipa_probe.tiny_pipeline`, or from its components)
with the probe off and on and checks: the output is bit-identical, every batch chunk has the label its pipeline gives
it, and the statistics of one layer (the gauge diagnostics and the rows' nulls included) equal a float64
recomputation (numpy/scipy, the nulls by enumerating the keys' permutations) from the test's own forward hooks on
``attn.to_q`` and ``to_k_ip``: never through the probe's code. The layout each pipeline uses is written here from
diffusers' source (SD/SDXL/Img2Img/Inpaint/ControlNet/AnimateDiff ``[uncond, cond]``, PAG ``[uncond, cond,
perturbed]``, InstructPix2Pix ``[cond, uncond_text, uncond]``), not read from the probe.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from helpers import masks_for, near_ties
from PIL import Image
from scipy import special, stats

from ipa_probe.capture.run import probe
from ipa_probe.layers import find_ip_layers
from ipa_probe.tiny.sd import tiny_components, tiny_ip_adapter_state_dict, tiny_pipeline

PROMPT = "a photo of a flower"
STEPS = 2

diffusers.utils.logging.set_verbosity_error()


# --------------------------------------------------------------------------- the pipelines


def _ip2p() -> diffusers.StableDiffusionInstructPix2PixPipeline:
    components = tiny_components("sd15")
    unet = diffusers.UNet2DConditionModel.from_config({**components["unet"].config, "in_channels": 8})
    pipe = diffusers.StableDiffusionInstructPix2PixPipeline(**{**components, "unet": unet})
    state = tiny_ip_adapter_state_dict(unet, pipe.image_encoder)
    pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None, low_cpu_mem_usage=False)
    return pipe


def _controlnet(sd):
    controlnet = diffusers.ControlNetModel.from_unet(
        tiny_components("sd15")["unet"], conditioning_embedding_out_channels=(8, 8, 8, 8)
    )
    return diffusers.StableDiffusionControlNetPipeline.from_pipe(sd, controlnet=controlnet)


def _animatediff(sd):
    adapter = diffusers.MotionAdapter(
        block_out_channels=(32, 64),
        motion_layers_per_block=1,
        motion_norm_num_groups=32,
        motion_num_attention_heads=2,
        motion_max_seq_length=8,
    )
    return diffusers.AnimateDiffPipeline.from_pipe(sd, motion_adapter=adapter)


BUILDERS = {
    "sd15": lambda p: tiny_pipeline("sd15"),
    "sdxl": lambda p: tiny_pipeline("sdxl"),
    "img2img": lambda p: diffusers.StableDiffusionImg2ImgPipeline.from_pipe(p("sd15")),
    "inpaint": lambda p: diffusers.StableDiffusionInpaintPipeline.from_pipe(p("sd15")),
    "controlnet": lambda p: _controlnet(p("sd15")),
    "sdxl_img2img": lambda p: diffusers.StableDiffusionXLImg2ImgPipeline.from_pipe(p("sdxl")),
    "animatediff": lambda p: _animatediff(p("sd15")),
    "pag": lambda p: diffusers.StableDiffusionPAGPipeline.from_pipe(p("sd15"), pag_applied_layers=["mid"]),
    "ip2p": lambda p: _ip2p(),
}


@pytest.fixture(scope="module")
def pipes():
    built: dict[str, Any] = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = BUILDERS[kind](get)
            built[kind].set_progress_bar_config(disable=True)
        return built[kind]

    return get


_IMAGE = Image.new("RGB", (64, 64), (120, 80, 40))
_MASK = Image.new("L", (64, 64), 0)
_MASK.paste(255, (0, 0, 32, 64))


def _turn_cfg_off(pipe, step, timestep, tensors):
    """diffusers' documented recipe: stop classifier-free guidance after the first step."""
    if step == 0:
        pipe._guidance_scale = 0.0
        tensors["prompt_embeds"] = tensors["prompt_embeds"].chunk(2)[-1]
    return tensors


@dataclass
class Case:
    kind: str
    layout: tuple[str, ...]  # chunk labels of every step, as diffusers' source orders the batch
    kwargs: dict = field(default_factory=dict)
    later: tuple[str, ...] | None = None  # the layout from step 1 on, when it changes mid-run
    images: int = 1  # num_images_per_prompt
    masks: bool = False


CASES = {
    "sd15-cfg": Case("sd15", ("uncond", "cond")),
    "sd15-nocfg": Case("sd15", ("cond",), {"guidance_scale": 1.0}),
    "sd15-cfg-2img": Case("sd15", ("uncond", "cond"), images=2),
    "sd15-nocfg-2img": Case("sd15", ("cond",), {"guidance_scale": 1.0}, images=2),
    "sd15-cfg-masks": Case("sd15", ("uncond", "cond"), masks=True),
    "sd15-cfg-2img-masks": Case("sd15", ("uncond", "cond"), images=2, masks=True),
    "sdxl-cfg": Case("sdxl", ("uncond", "cond"), {"negative_prompt": "blurry"}),
    "sdxl-nocfg-2img": Case("sdxl", ("cond",), {"guidance_scale": 1.0}, images=2),
    "sdxl-cfg-masks": Case("sdxl", ("uncond", "cond"), {"negative_prompt": "blurry"}, masks=True),
    "img2img": Case("img2img", ("uncond", "cond"), {"image": _IMAGE, "strength": 0.9, "num_inference_steps": 3}),
    "inpaint": Case("inpaint", ("uncond", "cond"), {"image": _IMAGE, "mask_image": _MASK}),
    "controlnet": Case("controlnet", ("uncond", "cond"), {"image": _IMAGE}),
    "controlnet-guess": Case("controlnet", ("uncond", "cond"), {"image": _IMAGE, "guess_mode": True}),
    "sdxl_img2img": Case(
        "sdxl_img2img", ("uncond", "cond"), {"image": _IMAGE, "strength": 0.9, "negative_prompt": "blurry"}
    ),
    "animatediff": Case("animatediff", ("uncond", "cond"), {"num_frames": 2}),
    "pag-cfg": Case("pag", ("uncond", "cond", "perturbed"), {"pag_scale": 3.0}),
    "pag-cfg-2img": Case("pag", ("uncond", "cond", "perturbed"), {"pag_scale": 3.0}, images=2),
    "pag-nocfg": Case("pag", ("cond", "perturbed"), {"pag_scale": 3.0, "guidance_scale": 1.0}),
    "ip2p": Case("ip2p", ("cond", "uncond_text", "uncond"), {"image": _IMAGE}),
    "ip2p-2img": Case("ip2p", ("cond", "uncond_text", "uncond"), {"image": _IMAGE}, images=2),
    "cfg-off-mid-run": Case(
        "sd15",
        ("uncond", "cond"),
        {
            "num_inference_steps": 3,
            "callback_on_step_end": _turn_cfg_off,
            "callback_on_step_end_tensor_inputs": ["prompt_embeds"],
        },
        later=("cond",),
    ),
}


# --------------------------------------------------------------------------- the test's own hooks


class Recorder:
    """Forward hooks on one IP-Adapter layer: its query, every ``to_k_ip`` call's keys and the masks it was given."""

    def __init__(self, attention: torch.nn.Module) -> None:
        self.passes: list[dict] = []
        self.handles = [
            attention.register_forward_pre_hook(self._start, with_kwargs=True),
            attention.to_q.register_forward_hook(self._query),
            attention.processor.to_k_ip[0].register_forward_hook(self._keys),
        ]

    def _start(self, module, args, kwargs):
        self.passes.append({"masks": kwargs.get("ip_adapter_masks"), "keys": []})

    def _query(self, module, args, output):
        self.passes[-1]["q"] = output.detach().double().numpy().copy()

    def _keys(self, module, args, output):
        self.passes[-1]["keys"].append(output.detach().double().numpy().copy())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _softmax(x: np.ndarray) -> np.ndarray:
    return special.softmax(x, axis=-1)


@functools.cache
def _null_rho(keys: int) -> np.ndarray:
    """rho of every permutation of ``keys`` distinct ranks against the identity (the null under independence); above
    8 keys of 2**18 random permutations (numpy, seeded): P(rho > 0.9) is then below 7e-4 with a standard error below
    5e-5, inside the comparison's 2e-4."""
    if keys <= 8:
        perms = np.array(list(itertools.permutations(range(keys))))
    else:
        perms = np.random.default_rng(keys).permuted(np.tile(np.arange(keys), (2**18, 1)), axis=1)
    return 1 - 6 * ((perms - np.arange(keys)) ** 2).sum(1) / (keys**3 - keys)


def reference_cell(
    q: np.ndarray, k: np.ndarray, rows: np.ndarray | None, attention: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Statistics per head of one group of batch items, in float64 with numpy and scipy.

    Args:
        q: ``(N, H, Q, D)`` queries of the group's items; k: ``(N, H, K, D)`` their keys; rows: ``(N, Q)`` bool, the
            queries inside the image's mask, or ``None``; attention: ``(N, H, Q, K)`` the weights the layer used where
            an edit or an NW head made them (``None``: the softmax of ``q k^T / sqrt(d)``).
    """
    n, heads, queries, d = q.shape
    a = _softmax(q @ k.swapaxes(-1, -2) / math.sqrt(d)) if attention is None else attention  # (N, H, Q, K)
    sq_dist = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2).sum(-1)
    w = _softmax(-sq_dist / (2 * math.sqrt(d)))
    keep = np.ones((n, queries), bool) if rows is None else rows
    # rows where float32 may order two keys otherwise than float64 does (near-ties, helpers.NEAR_TIE)
    any_tie, top_tie = (x.numpy() for x in near_ties(torch.from_numpy(q @ k.swapaxes(-1, -2)), torch.from_numpy(k)))
    out: dict[str, list] = {}
    for h in range(heads):
        rows_a = a[:, h][keep]  # (rows, K)
        rows_w = w[:, h][keep]
        ranks_a, ranks_w = (stats.rankdata(x, axis=1) for x in (rows_a, rows_w))
        ranks_a, ranks_w = ranks_a - ranks_a.mean(-1, keepdims=True), ranks_w - ranks_w.mean(-1, keepdims=True)
        with np.errstate(invalid="ignore"):  # each row's Pearson r of the ranks; NaN where a row's weights are equal
            rho = np.clip((ranks_a * ranks_w).sum(-1) / np.sqrt((ranks_a**2).sum(-1) * (ranks_w**2).sum(-1)), -1, 1)
        keys = k[:, h]  # (N, K, D)
        item = np.repeat(np.arange(n), queries)[keep.ravel()]
        top_a, top_w = keys[item, rows_a.argmax(-1)], keys[item, rows_w.argmax(-1)]  # (rows, D) each
        same = (np.abs(top_a - top_w) <= 1e-6 + 1e-4 * np.abs(top_w)).all(-1)  # np.allclose(rtol=1e-4, atol=1e-6)
        norms = np.linalg.norm(keys, axis=-1).ravel()
        # the gauge diagnostics per row: r = sd(q·k) / sd(|k|^2 / 2) over the row's keys, Moran's E[rho] from r and K
        dots = (q[:, h] @ keys.swapaxes(-1, -2))[keep]  # (rows, K)
        half_sq = np.repeat((keys**2).sum(-1) / 2, queries, axis=0)[keep.ravel()]  # (rows, K): each row's item
        r = dots.std(-1) / half_sq.std(-1)
        n_keys = k.shape[2]
        c = r / np.sqrt(1 + r * r)
        baseline = 6 / (np.pi * (n_keys + 1)) * (np.arcsin(c) + (n_keys - 2) * np.arcsin(c / 2))
        rho = np.asarray(rho)
        ranked = ~np.isnan(rho)
        null = _null_rho(n_keys)
        values = {
            "spearman": np.nanmean(rho),
            "pearson": stats.pearsonr(rows_a.ravel(), rows_w.ravel()).statistic,
            "kl": np.mean((rows_a * (np.log(rows_a) - np.log(rows_w))).sum(-1)),
            "top1": np.mean(same),
            "neff_attn": np.mean(1 / (rows_a**2).sum(-1)),
            "neff_nw": np.mean(1 / (rows_w**2).sum(-1)),
            "q_norm": np.linalg.norm(q[:, h], axis=-1)[keep].mean(),
            "k_norm_spread": norms.std() / norms.mean(),
            "keys": k.shape[2],
            "logit_ratio": r[ranked & np.isfinite(r)].mean(),
            "rho_baseline": baseline[ranked].mean(),
            "rho_excess": (rho - baseline)[ranked].mean(),
            # a row at exactly 0.9 (a value rho takes for some K) is not above it, whatever the float rounding
            "rows_rho_gt_0.9": (rho[ranked] > 0.9 + 1e-5).mean(),
            "rows_rho_gt_0.9_null": (null > 0.9).mean(),
            "rows_rho_pos1": (np.abs(rho[ranked] - 1) < 1e-9).mean(),
            "rows_rho_neg1": (np.abs(rho[ranked] + 1) < 1e-9).mean(),
            "rows_rho_pos1_null": 1 / math.factorial(n_keys),
            # rho of a row lies in [-1, 1] and top-1 in {0, 1}: what near-tied rows may move each by
            "spearman_slack": 2 * any_tie[:, h][keep].mean(),
            "rho_excess_slack": 2 * any_tie[:, h][keep].mean(),
            "top1_slack": top_tie[:, h][keep].mean(),
            "rows_rho_gt_0.9_slack": any_tie[:, h][keep].mean(),
            "rows_rho_pos1_slack": any_tie[:, h][keep].mean(),
            "rows_rho_neg1_slack": any_tie[:, h][keep].mean(),
        }
        for name, value in values.items():
            out.setdefault(name, []).append(value)
    return {name: np.asarray(v) for name, v in out.items()}


def reference_table(recorder: Recorder, heads: int, layouts: list[tuple[str, ...]]) -> dict:
    """``(step, label) -> statistics per head``: per batch item (and per image where masks give each image its own
    softmax), averaged over the label's items and images."""
    expected = {}
    for step, (record, layout) in enumerate(zip(recorder.passes, layouts, strict=True)):
        q = record["q"]  # (B, Q, H*D)
        batch, queries = q.shape[:2]
        d = q.shape[-1] // heads
        q = q.reshape(batch, queries, heads, d).transpose(0, 2, 1, 3)
        masks = record["masks"]
        cells = []
        for image, keys in enumerate(record["keys"]):
            k = keys.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3)  # the processor's view: (B, H, K, D)
            rows = None
            if masks is not None:
                weights = IPAdapterMaskProcessor.downsample(masks[0][:, image], batch, queries, 1)[..., 0]
                rows = weights.numpy() != 0
            per_chunk = batch // len(layout)
            for item in range(batch):  # every statistic is taken per batch item, then averaged over a label's items
                label, part = layout[item // per_chunk], slice(item, item + 1)
                cells.append((label, reference_cell(q[part], k[part], None if rows is None else rows[part])))
        for label in dict.fromkeys(layout):
            group = [cell for name, cell in cells if name == label]
            expected[(step, label)] = {n: np.mean([cell[n] for cell in group], axis=0) for n in group[0]}
    return expected


def generate(pipe, case: Case, refs):
    kwargs = {"num_inference_steps": STEPS, "output_type": "np", **case.kwargs}
    if case.masks:
        kwargs["cross_attention_kwargs"] = {"ip_adapter_masks": masks_for(len(refs))}
    generator = torch.Generator().manual_seed(0)
    out = pipe(PROMPT, ip_adapter_image=[refs], num_images_per_prompt=case.images, generator=generator, **kwargs)
    return np.asarray(out[0])


def check_against_reference(df, expected, heads: int, tolerance: float = 2e-4) -> None:
    assert set(zip(df["step"], df["branch"], strict=True)) == set(expected)
    for (step, label), values in expected.items():
        cell = df[(df["step"] == step) & (df["branch"] == label)].sort_values("head")
        assert len(cell) == heads, (step, label)
        for name, reference in values.items():
            if name.endswith("_slack"):
                continue
            # float32 against float64 (rtol 1e-4, atol `tolerance`), plus what near-tied rows may move rho / top-1 by
            slack = values.get(f"{name}_slack", 0.0)
            np.testing.assert_allclose(
                cell[name].to_numpy(),
                reference,
                rtol=1e-4,
                atol=tolerance + np.max(slack),
                err_msg=f"{name} at {(step, label)}",
            )


# --------------------------------------------------------------------------- the matrix


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_labels_and_statistics_match_an_independent_recomputation(pipes, refs, name):
    case = CASES[name]
    pipe = pipes(case.kind)
    plain = generate(pipe, case, refs)
    layer = find_ip_layers(pipe)[0]
    recorder = Recorder(layer.attention)
    try:
        with probe(pipe, layers=f"^{layer.name}$") as run:
            probed = generate(pipe, case, refs)
    finally:
        recorder.remove()
    assert np.array_equal(plain, probed)
    df = run.to_dataframe()
    steps = len(recorder.passes)
    layouts = [case.layout if step == 0 or case.later is None else case.later for step in range(steps)]
    expected = reference_table(recorder, layer.heads, layouts)
    check_against_reference(df, expected, layer.heads)
    assert df["complete"].all() and not df["few_keys"].any()


# --------------------------------------------------------------------------- loops the probe cannot read the layout of


def _hand_written_loop(pipe, refs, embeds, guidance: float = 5.0):
    """A research-code CFG loop calling ``pipe.unet`` directly with a ``[uncond, cond]`` batch."""
    negative, positive = embeds
    image_embeds = pipe.prepare_ip_adapter_image_embeds([refs], None, "cpu", 1, True)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 8, 8, generator=generator)
    pipe.scheduler.set_timesteps(STEPS)
    for t in pipe.scheduler.timesteps:
        x = pipe.scheduler.scale_model_input(torch.cat([latents] * 2), t)
        noise = pipe.unet(
            x,
            t,
            encoder_hidden_states=torch.cat([negative, positive]),
            added_cond_kwargs={"image_embeds": image_embeds},
        ).sample
        uncond, cond = noise.chunk(2)
        latents = pipe.scheduler.step(uncond + guidance * (cond - uncond), t, latents).prev_sample
    return latents


@pytest.mark.parametrize("declared", [None, ("uncond", "cond")])
def test_hand_written_loop_is_labelled_honestly_or_as_declared(pipes, refs, declared):
    pipe = pipes("sd15")
    positive, negative = pipe.encode_prompt(PROMPT, "cpu", 1, True, "blurry")
    plain = _hand_written_loop(pipe, refs, (negative, positive))
    layer = find_ip_layers(pipe)[0]
    recorder = Recorder(layer.attention)
    try:
        with probe(pipe, layers=f"^{layer.name}$", branches=declared) as run:
            probed = _hand_written_loop(pipe, refs, (negative, positive))
    finally:
        recorder.remove()
    assert torch.equal(plain, probed)
    layout = declared or ("batch",)
    expected = reference_table(recorder, layer.heads, [layout] * STEPS)
    check_against_reference(run.to_dataframe(), expected, layer.heads)


def test_hand_written_loop_with_the_pipelines_encoder_is_labelled_from_evidence(pipes, refs):
    pipe = pipes("sd15")
    with probe(pipe) as run:
        positive, negative = pipe.encode_prompt(PROMPT, "cpu", 1, True, "blurry")
        _hand_written_loop(pipe, refs, (negative, positive))
    assert set(run.to_dataframe()["branch"]) == {"uncond", "cond"}


def test_from_pipe_sibling_sharing_the_unet_is_never_called_cond(pipes, refs):
    pipe = pipes("sd15")
    sibling = diffusers.StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    with probe(pipe) as run:
        sibling(PROMPT, image=_IMAGE, ip_adapter_image=[refs], num_inference_steps=STEPS, output_type="np")
    assert set(run.to_dataframe()["branch"]) == {"batch"}
    with probe(pipe, branches=("uncond", "cond")) as run:
        sibling(PROMPT, image=_IMAGE, ip_adapter_image=[refs], num_inference_steps=STEPS, output_type="np")
    assert set(run.to_dataframe()["branch"]) == {"uncond", "cond"}
