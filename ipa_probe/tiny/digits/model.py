"""The organism's components (diffusers / transformers classes), its IP-Adapter layout, loading the shipped weights.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from diffusers.models.embeddings import ImageProjection
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from ..._quiet import quiet_known_messages
from ..sd import _seeded, realign_weights
from ..tokenizer import CLIP_MODEL_MAX_LENGTH, CLIP_VOCAB_SIZE, clip_tokenizer
from .data import (
    _TEXT_WIDTH,
    _VISION_WIDTH,
    DIGITS_WEIGHTS,
    IMAGE_SIZE,
    LATENT_SIZE,
    NUM_IP_TOKENS,
    WEIGHT_NAME,
)

# --- components ---------------------------------------------------------------------------------------------------


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        norm_num_groups=16,
        latent_channels=4,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,  # set from the training latents' spread after the VAE is trained
        force_upcast=False,
    )


def _unet() -> UNet2DConditionModel:
    # SD 1.5's layout: CrossAttnDown x 3 + Down, mid with cross-attention, Up + CrossAttnUp x 3, a fixed number of
    # heads (diffusers' legacy ``attention_head_dim`` means heads for SD 1.5): 4 heads of width 8 or 16.
    return UNet2DConditionModel(
        sample_size=LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=_TEXT_WIDTH,
        attention_head_dim=4,
        norm_num_groups=32,
    )


def _text_encoder() -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=_TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MODEL_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    )
    model = CLIPTextModel(config)
    # Shipped in float16 (the 49k-token embedding is most of its size): train with exactly the shipped values.
    return model.half().float()


def _image_encoder() -> CLIPVisionModelWithProjection:
    config = CLIPVisionConfig(
        hidden_size=_VISION_WIDTH,
        projection_dim=_VISION_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=4,
        hidden_act="quick_gelu",
    )
    return CLIPVisionModelWithProjection(config)


def _feature_extractor() -> CLIPImageProcessor:
    return CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def _scheduler() -> DDIMScheduler:
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _install_ip_processors(unet: UNet2DConditionModel) -> list[IPAdapterAttnProcessor2_0]:
    """Give every cross-attention layer a fresh ``IPAdapterAttnProcessor2_0`` (self-attention keeps the default)."""
    processors: dict[str, Any] = {}
    ip = []
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            attn = unet.get_submodule(name.removesuffix(".processor"))
            proc = IPAdapterAttnProcessor2_0(
                hidden_size=attn.to_k.out_features,
                cross_attention_dim=_TEXT_WIDTH,
                num_tokens=(NUM_IP_TOKENS,),
                scale=1.0,
            )
            processors[name] = proc
            ip.append(proc)
        else:
            processors[name] = AttnProcessor2_0()
    unet.set_attn_processor(processors)
    return ip


def untrained_digits_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """The organism's architecture with its initial (untrained) weights: the control of the experiments.

    The VAE and image encoder are untrained too; the scaling factor is the trained run's. Built the way
    :func:`train_digits` initialises them, then loaded through ``load_ip_adapter`` like the trained one.
    """
    parts = _init_modules(seed)
    pipe = StableDiffusionPipeline(
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        tokenizer=clip_tokenizer(),
        unet=parts["unet"],
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=parts["image_encoder"],
        requires_safety_checker=False,
    )
    record = json.loads((DIGITS_WEIGHTS / "record.json").read_text())
    pipe.vae.register_to_config(scaling_factor=record["scaling_factor"])
    state = _adapter_state_dict(parts["unet"], parts["ip_processors"], parts["image_proj"])
    _restore_default_processors(pipe.unet)
    with _seeded(seed, "digits/load_ip_adapter"), quiet_known_messages():
        pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None)
    return pipe


def _init_modules(seed: int) -> dict[str, Any]:
    with _seeded(seed, "digits/vae"):
        vae = _vae()
    with _seeded(seed, "digits/text_encoder"):
        text_encoder = _text_encoder()
    with _seeded(seed, "digits/image_encoder"):
        image_encoder = _image_encoder()
    with _seeded(seed, "digits/unet"):
        unet = _unet()
    with _seeded(seed, "digits/ip_adapter"):
        image_proj = ImageProjection(
            image_embed_dim=_VISION_WIDTH, cross_attention_dim=_TEXT_WIDTH, num_image_text_embeds=NUM_IP_TOKENS
        )
        ip_processors = _install_ip_processors(unet)
    return dict(
        vae=vae,
        text_encoder=text_encoder.eval().requires_grad_(False),
        image_encoder=image_encoder,
        unet=unet,
        image_proj=image_proj,
        ip_processors=ip_processors,
    )


def _adapter_state_dict(
    unet: UNet2DConditionModel, ip_processors: Sequence[IPAdapterAttnProcessor2_0], image_proj: ImageProjection
) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter in the published checkpoints' layout: ``image_proj.{proj,norm}.*`` and, for the ``n``-th
    cross-attention layer in ``unet.attn_processors`` order, ``ip_adapter.{2n+1}.to_{k,v}_ip.weight``."""
    sd = image_proj.state_dict()
    proj = {
        "proj.weight": sd["image_embeds.weight"],
        "proj.bias": sd["image_embeds.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    layers = {}
    for n, proc in enumerate(ip_processors):
        layers[f"{2 * n + 1}.to_k_ip.weight"] = proc.to_k_ip[0].weight
        layers[f"{2 * n + 1}.to_v_ip.weight"] = proc.to_v_ip[0].weight
    clean = lambda d: {k: v.detach().clone().contiguous() for k, v in d.items()}
    return {"image_proj": clean(proj), "ip_adapter": clean(layers)}


def _restore_default_processors(unet: UNet2DConditionModel) -> None:
    unet.set_attn_processor({name: AttnProcessor2_0() for name in unet.attn_processors})


# --- loading ------------------------------------------------------------------------------------------------------


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """No loading progress bars from diffusers and transformers (local files load in a blink); restored on exit."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    states = [(lib, lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)]
    for lib, _ in states:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, enabled in states:
            if enabled:
                lib.enable_progress_bar()


def digits_pipeline(path: str | os.PathLike | None = None) -> StableDiffusionPipeline:
    """The trained digits organism: a ``StableDiffusionPipeline`` on CPU in float32, progress bar on.

    Loaded through diffusers' ``from_pretrained`` (``<path>/model``) and ``load_ip_adapter``
    (``<path>/ip_adapter/ip-adapter.safetensors``), offline.

    Args:
        path: a folder written by ``ipa-probe train-digits``; ``None`` loads the weights shipped with the package.

    Returns:
        the pipeline; call it with ``ip_adapter_image=[digits_reference_images(d, n)]`` (one support set).

    Example:
        ```py
        >>> pipe = digits_pipeline()
        >>> refs = digits_reference_images(3, 2)
        >>> image = pipe("a handwritten digit", ip_adapter_image=[refs], num_inference_steps=20).images[0]
        ```
    """
    root = Path(path) if path is not None else DIGITS_WEIGHTS
    if not (root / "model" / "model_index.json").exists():
        raise FileNotFoundError(
            f"expected a digits organism in {root} (model/model_index.json); "
            "train one with `ipa-probe train-digits --out DIR` or pass path=None for the shipped weights"
        )
    with _quiet_loading(), quiet_known_messages():
        pipe = StableDiffusionPipeline.from_pretrained(root / "model", local_files_only=True)
        pipe.load_ip_adapter(
            str(root / "ip_adapter"),
            subfolder="",
            weight_name=WEIGHT_NAME,
            image_encoder_folder=None,
            local_files_only=True,
        )
    pipe.text_encoder.float()  # stored in float16 (the rest in float32); it ran in float32 during training
    pipe.set_progress_bar_config(disable=False)
    return realign_weights(pipe)
