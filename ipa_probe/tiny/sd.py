"""Embedded tiny Stable Diffusion pipelines with IP-Adapters: built from configs, seeded, offline.

:func:`tiny_pipeline` returns a real diffusers ``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline`` whose
components are tiny (a two-level UNet with cross-attention at both levels, a four-level VAE so that 64 x 64 images
have 8 x 8 latents, two-layer CLIP encoders) and randomly initialised from a seed. IP-Adapter weights are made here
as state dicts in the layout of the published checkpoints (``image_proj.*`` and ``ip_adapter.<id>.to_{k,v}_ip.*``)
and loaded through diffusers' own ``pipe.load_ip_adapter``, so every code path the probe meets on real weights
(``IPAdapterAttnProcessor2_0``, ``MultiIPAdapterImageProjection``, the CLIP image encoder that turns PIL images into
embeddings) is the one diffusers runs. Prompts are tokenized offline with CLIP's vocabulary from ``open_clip``
(:mod:`ipa_probe.tiny.tokenizer`).

Nothing here touches the network or the caller's random state: weights are drawn under ``torch.random.fork_rng``
from seeds derived from ``seed`` and a component name, so the same seed gives bit-identical weights on any machine.

:func:`save_tiny_pipeline` writes the same pipeline the way real weights come: ``save_pretrained`` for the model and
one ``ip-adapter.safetensors`` file for the adapter, for testing the from-path loading code.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import PIL.Image
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.models.embeddings import ImageProjection, IPAdapterPlusImageProjection
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from .._checks import check_choice, check_int, check_seed
from .._quiet import quiet_known_messages
from .tokenizer import CLIP_MODEL_MAX_LENGTH, CLIP_VOCAB_SIZE, clip_tokenizer

__all__ = [
    "IP_ADAPTER_KINDS",
    "IP_ADAPTER_NUM_TOKENS",
    "IP_ADAPTER_WEIGHT_NAME",
    "PIPELINE_KINDS",
    "SavedTinyPipeline",
    "default_reference_images",
    "realign_weights",
    "save_tiny_pipeline",
    "tiny_components",
    "tiny_ip_adapter_state_dict",
    "tiny_pipeline",
]

PipelineKind = Literal["sd15", "sdxl"]
AdapterKind = Literal["base", "plus"]
PIPELINE_KINDS: tuple[str, ...] = ("sd15", "sdxl")
IP_ADAPTER_KINDS: tuple[str, ...] = ("base", "plus")
IP_ADAPTER_NUM_TOKENS: Mapping[str, int] = MappingProxyType({"base": 4, "plus": 16})
"""Image tokens per reference image: 4 for IP-Adapter (``ImageProjection``), 16 for Plus (the resampler)."""

IP_ADAPTER_WEIGHT_NAME = "ip-adapter.safetensors"
"""File name :func:`save_tiny_pipeline` gives the adapter weights."""

# Tiny sizes. Text encoders: width 32 (SDXL: two of them, concatenated to 64). Image encoder: 32 x 32 inputs in
# 4 x 4 patches, so Plus sees 64 patch tokens + 1 class token.
_TEXT_WIDTH = 32
_VISION_WIDTH = 32
_VISION_IMAGE_SIZE = 32
_LATENT_SIZE = 8  # default 64 x 64 images through the 8x VAE
_SDXL_TIME_EMBED_DIM = 8


def _derived_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one component, stable across processes and Python versions (unlike ``hash``)."""
    digest = hashlib.sha256(f"ipa_probe:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def _seeded(seed: int, name: str) -> Iterator[None]:
    """Run a block with torch's CPU generator seeded for ``name``; the caller's RNG state is restored on exit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_derived_seed(seed, name))
        yield


def _text_config(projection: bool) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=_TEXT_WIDTH,
        intermediate_size=37,
        num_hidden_layers=2,  # SDXL reads the penultimate layer
        num_attention_heads=4,
        max_position_embeddings=CLIP_MODEL_MAX_LENGTH,
        projection_dim=_TEXT_WIDTH if projection else 512,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    )


def _unet(kind: str) -> UNet2DConditionModel:
    common = dict(
        sample_size=_LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=32,
    )
    if kind == "sd15":
        # SD 1.5 keeps the number of heads fixed across levels (diffusers' legacy name ``attention_head_dim``
        # means heads here): 2 heads of width 16 at level 0 and of width 32 at level 1. 7 cross-attention layers.
        return UNet2DConditionModel(**common, cross_attention_dim=_TEXT_WIDTH, attention_head_dim=2)
    # SDXL keeps the head width fixed (16 here) and stacks more transformer layers deeper; the added conditioning
    # is "text_time": pooled text embedding (32) + 6 micro-conditioning values x 8 Fourier features. 11 layers.
    return UNet2DConditionModel(
        **common,
        cross_attention_dim=2 * _TEXT_WIDTH,
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_SDXL_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * _SDXL_TIME_EMBED_DIM + _TEXT_WIDTH,
    )


def _vae(kind: str) -> AutoencoderKL:
    # Four levels: a downsampling factor of 8, as in the real VAEs.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=4,
        sample_size=_LATENT_SIZE * 8,
        # The real VAEs' factors (0.18215, 0.13025) give their latents unit spread; this random tiny VAE's raw latents
        # of the reference photos have std ~0.26, so 3.85 does the same here (measured for both kinds).
        scaling_factor=3.85,
        force_upcast=False,
    )


def _scheduler(kind: str) -> DDIMScheduler | EulerDiscreteScheduler:
    # The schedules of the real models: SD 1.5 ships PNDM (DDIM is its usual few-step replacement), SDXL Euler.
    betas = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if kind == "sd15":
        return DDIMScheduler(**betas, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return EulerDiscreteScheduler(**betas, steps_offset=1, timestep_spacing="leading")


def _image_encoder() -> CLIPVisionModelWithProjection:
    config = CLIPVisionConfig(
        hidden_size=_VISION_WIDTH,
        projection_dim=_VISION_WIDTH,
        intermediate_size=37,
        num_hidden_layers=2,  # Plus reads the penultimate layer
        num_attention_heads=4,
        image_size=_VISION_IMAGE_SIZE,
        patch_size=4,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    return CLIPVisionModelWithProjection(config)


def _feature_extractor() -> CLIPImageProcessor:
    # CLIP's preprocessing (resize the short side, centre crop, normalise) at the tiny encoder's input size.
    return CLIPImageProcessor(
        size={"shortest_edge": _VISION_IMAGE_SIZE},
        crop_size={"height": _VISION_IMAGE_SIZE, "width": _VISION_IMAGE_SIZE},
    )


def tiny_components(kind: PipelineKind = "sd15", seed: int = 0) -> dict[str, Any]:
    """The components of a tiny pipeline, without IP-Adapter, on CPU in float32.

    Each module is initialised under its own seed derived from ``seed`` and its name, so changing one component's
    configuration does not change the others' weights. The caller's global RNG is untouched. Returns keyword
    arguments for ``StableDiffusionPipeline`` (``kind="sd15"``, with ``safety_checker=None``) or
    ``StableDiffusionXLPipeline`` (``"sdxl"``), ``image_encoder`` and ``feature_extractor`` included.
    """
    check_choice(kind, "kind", PIPELINE_KINDS)
    check_seed(seed)
    with _seeded(seed, f"{kind}/unet"):
        unet = _unet(kind)
    with _seeded(seed, f"{kind}/vae"):
        vae = _vae(kind)
    with _seeded(seed, f"{kind}/text_encoder"):
        text_encoder = CLIPTextModel(_text_config(projection=False))
    with _seeded(seed, f"{kind}/image_encoder"):
        image_encoder = _image_encoder()
    components: dict[str, Any] = dict(
        unet=unet.eval(),
        vae=vae.eval(),
        scheduler=_scheduler(kind),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tokenizer(),
        image_encoder=image_encoder.eval(),
        feature_extractor=_feature_extractor(),
    )
    if kind == "sd15":
        components.update(safety_checker=None, requires_safety_checker=False)
    else:
        with _seeded(seed, f"{kind}/text_encoder_2"):
            text_encoder_2 = CLIPTextModelWithProjection(_text_config(projection=True))
        components.update(text_encoder_2=text_encoder_2.eval(), tokenizer_2=clip_tokenizer(pad_token="!"))
    return components


def _ip_layer_widths(unet: UNet2DConditionModel) -> list[int]:
    """Key width (heads x head width) of every cross-attention layer, in ``unet.attn_processors`` order, the order
    in which IP-Adapter checkpoints number them. ``to_k_ip`` maps the image tokens to that width, as ``to_k`` does
    the text tokens."""
    widths = []
    for name in unet.attn_processors:
        if not name.endswith("attn2.processor"):
            continue
        attn = unet.get_submodule(name.removesuffix(".processor"))
        widths.append(attn.to_k.out_features)
    return widths


def _base_to_checkpoint_layout(proj: ImageProjection) -> dict[str, torch.Tensor]:
    """An ``ImageProjection``'s weights under the published base adapters' ``image_proj.{proj,norm}.*`` keys."""
    sd = proj.state_dict()
    keys = ("proj.weight", "image_embeds.weight"), ("proj.bias", "image_embeds.bias")
    return {new: sd[old] for new, old in (*keys, ("norm.weight", "norm.weight"), ("norm.bias", "norm.bias"))}


def _renamed_layers(state: dict[str, torch.Tensor], renames: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """A resampler's state dict with each ``layers.*`` key's first matching ``renames`` part replaced: diffusers'
    names to the published checkpoints', which ``load_ip_adapter`` converts back."""
    out = {}
    for key, value in state.items():
        if key.startswith("layers."):
            new = next((key.replace(old, checkpoint) for old, checkpoint in renames if old in key), None)
            if new is None:
                raise RuntimeError(f"unexpected key {key!r} in the image projection; diffusers changed its layout")
            key = new
        out[key] = value
    return out


def _plus_to_checkpoint_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An ``IPAdapterPlusImageProjection`` state dict under the published Plus checkpoints' ``image_proj`` keys (the
    Resampler of tencent-ailab/IP-Adapter), whose attention fuses keys and values: ``to_kv = cat([to_k, to_v])``."""
    fused = {}
    for key, value in state.items():
        if key.endswith(".attn.to_k.weight"):
            key, value = key.replace(".to_k.", ".to_kv."), torch.cat([value, state[key.replace("_k.", "_v.")]])
        if not key.endswith(".attn.to_v.weight"):
            fused[key] = value
    renames = (".ln0.", ".0.norm1."), (".ln1.", ".0.norm2."), (".attn.to_out.0.", ".0.to_out."), (".attn.", ".0.")
    return _renamed_layers(
        fused, (*renames, (".ff.0.", ".1.0."), (".ff.1.net.0.proj.", ".1.1."), (".ff.1.net.2.", ".1.3."))
    )


def _adapter_state(image_proj: dict[str, torch.Tensor], layers: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The ``{"image_proj": ..., "ip_adapter": ...}`` dict the loaders take, of contiguous copies."""
    return {
        "image_proj": {k: v.detach().clone().contiguous() for k, v in image_proj.items()},
        "ip_adapter": {k: v.clone().contiguous() for k, v in layers.items()},
    }


def tiny_ip_adapter_state_dict(
    unet: UNet2DConditionModel,
    image_encoder: CLIPVisionModelWithProjection,
    ip_adapter: AdapterKind = "base",
    seed: int = 0,
) -> dict[str, dict[str, torch.Tensor]]:
    """Random IP-Adapter weights for ``unet`` in the published checkpoints' layout.

    ``"base"``: ``image_proj`` is an ``ImageProjection`` (Linear from the image encoder's ``image_embeds``,
    ``projection_dim`` wide, to 4 tokens of ``cross_attention_dim``, then LayerNorm). ``"plus"``: ``image_proj`` is
    the Plus resampler (``IPAdapterPlusImageProjection``: 16 learned queries attending over the encoder's penultimate
    hidden states, ``hidden_size`` wide; diffusers fixes depth 4 and head width 64 when loading). For every
    cross-attention layer ``n`` (counted as diffusers does: ``1, 3, 5, ...`` over ``unet.attn_processors``),
    ``ip_adapter`` holds ``{n}.to_k_ip.weight`` and ``{n}.to_v_ip.weight``, shape ``(hidden, cross_attention_dim)``.
    Only the UNet's configuration and layer widths are read; the float32 CPU weights are a deterministic function of
    the seed and the shapes, for
    ``pipe.load_ip_adapter([state_dict], subfolder=[""], weight_name=[""], image_encoder_folder=None)``.
    """
    check_choice(ip_adapter, "ip_adapter", IP_ADAPTER_KINDS)
    check_seed(seed)
    cross_dim = unet.config.cross_attention_dim
    with _seeded(seed, f"ip_adapter/{ip_adapter}/image_proj"):
        if ip_adapter == "base":
            proj = ImageProjection(
                image_embed_dim=image_encoder.config.projection_dim,
                cross_attention_dim=cross_dim,
                num_image_text_embeds=IP_ADAPTER_NUM_TOKENS["base"],
            )
            image_proj = _base_to_checkpoint_layout(proj)
        else:
            proj = IPAdapterPlusImageProjection(
                embed_dims=image_encoder.config.hidden_size,
                output_dims=cross_dim,
                hidden_dims=32,
                depth=4,
                dim_head=64,
                heads=1,
                num_queries=IP_ADAPTER_NUM_TOKENS["plus"],
                ffn_ratio=4,
            )
            image_proj = _plus_to_checkpoint_layout(proj.state_dict())
    ip_layers: dict[str, torch.Tensor] = {}
    with _seeded(seed, f"ip_adapter/{ip_adapter}/layers"):
        for n, width in enumerate(_ip_layer_widths(unet)):
            key_id = 2 * n + 1
            # nn.Linear's default init, as a freshly built IPAdapterAttnProcessor would have.
            to_k = torch.nn.Linear(cross_dim, width, bias=False)
            to_v = torch.nn.Linear(cross_dim, width, bias=False)
            ip_layers[f"{key_id}.to_k_ip.weight"] = to_k.weight.detach()
            ip_layers[f"{key_id}.to_v_ip.weight"] = to_v.weight.detach()
    return _adapter_state(image_proj, ip_layers)


def _adapter_seed(seed: int, index: int) -> int:
    return seed if index == 0 else _derived_seed(seed, f"adapter/{index}") % (2**31)


def _pipeline_class(kind: str) -> type[StableDiffusionPipeline] | type[StableDiffusionXLPipeline]:
    return StableDiffusionPipeline if kind == "sd15" else StableDiffusionXLPipeline


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if isinstance(resolved, torch.dtype):
            return resolved
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"expected dtype to be a torch.dtype or a name such as 'float16', got {dtype!r}")


def tiny_pipeline(
    kind: PipelineKind = "sd15",
    ip_adapter: AdapterKind = "base",
    num_adapters: int = 1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> StableDiffusionPipeline | StableDiffusionXLPipeline:
    """A tiny, seeded Stable Diffusion 1.5 or SDXL pipeline with IP-Adapter(s), built offline from configs.

    The IP-Adapter weights (:func:`tiny_ip_adapter_state_dict`) go through diffusers' ``load_ip_adapter``, so the
    UNet's cross-attention layers hold ``IPAdapterAttnProcessor2_0`` processors with one ``to_k_ip``/``to_v_ip``
    pair per adapter, and ``pipe(..., ip_adapter_image=...)`` accepts PIL images (one entry per adapter; a list of
    images in an entry is that adapter's support set, their tokens concatenated). Adapter ``i`` is drawn from its
    own seed, so two adapters differ. Generating 64 x 64 images (the default size; 8 x 8 latents) with a few steps
    takes a fraction of a second on a CPU.

    Args:
        kind: ``"sd15"`` (7 IP-Adapter layers, 2 heads each, head width 16 or 32) or ``"sdxl"`` (11 layers, 2 or 4
            heads of width 16, ``addition_embed_type="text_time"``).
        ip_adapter: ``"base"`` (4 tokens per image, from the image encoder's ``image_embeds``) or ``"plus"`` (16
            tokens per image, from its penultimate hidden states).
        num_adapters: how many IP-Adapters of that kind to load (>= 1).
        seed: non-negative int. The same seed gives bit-identical weights; the caller's RNG is untouched.
        device: where the pipeline is moved after building (it is built on CPU).
        dtype: its parameter dtype (a ``torch.dtype`` or its name).

    Example:
        ```py
        >>> from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline
        >>> pipe = tiny_pipeline("sd15", ip_adapter="plus")
        >>> refs = default_reference_images()
        >>> out = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="np")
        >>> out.images.shape
        (1, 64, 64, 3)
        ```
    """
    check_choice(kind, "kind", PIPELINE_KINDS)
    check_choice(ip_adapter, "ip_adapter", IP_ADAPTER_KINDS)
    check_seed(seed)
    check_int(num_adapters, "num_adapters", 1)
    torch_dtype = _resolve_dtype(dtype)
    pipe = _pipeline_class(kind)(**tiny_components(kind, seed))
    state_dicts = [
        tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, ip_adapter, _adapter_seed(seed, i))
        for i in range(num_adapters)
    ]
    # diffusers builds the processors and projections with their default (random) init before copying our weights
    # in: those draws must not advance the caller's RNG.
    with _seeded(seed, "load_ip_adapter"), quiet_known_messages():
        pipe.load_ip_adapter(
            state_dicts,
            subfolder=[""] * num_adapters,
            weight_name=[""] * num_adapters,
            image_encoder_folder=None,
            low_cpu_mem_usage=False,
        )
    pipe.set_progress_bar_config(disable=True)
    return _move(pipe, device, torch_dtype)


def _move(pipe: Any, device: str | torch.device, dtype: torch.dtype) -> Any:
    # Built on CPU in float32: skip a no-op ``to`` (diffusers logs a warning on every dtype cast).
    if torch.device(device) != torch.device("cpu"):
        pipe = pipe.to(device=device)
    if dtype != torch.float32:
        with quiet_known_messages():
            pipe = pipe.to(dtype=dtype)
    return pipe


# --- reference images ---------------------------------------------------------------------------------------------

_GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0  # crop positions follow a low-discrepancy (Weyl) sequence: spread, never equal
_SILVER = np.sqrt(2.0) - 1.0


def default_reference_images(n: int = 2, size: int | tuple[int, int] | None = None) -> list[PIL.Image.Image]:
    """Real photographs for ``ip_adapter_image``, shipped with scikit-learn (no download).

    The first two are ``china.jpg`` and ``flower.jpg`` (640 x 427) from ``sklearn.datasets.load_sample_images``;
    further ones are square crops (60 % of the short side) of the two photos, alternating, at positions
    ``(frac(k * 0.618), frac(k * 0.414))`` of the free range for the ``k``-th crop of a photo: deterministic and
    all different. ``size``: ``None`` keeps each image's own size; an int ``s`` centre-crops to a square and resizes
    to ``s x s``; a pair ``(width, height)`` resizes to exactly that.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"expected n to be an int >= 1, got {n!r}")
    if size is not None:
        if isinstance(size, int) and not isinstance(size, bool):
            ok = size > 0
        else:
            ok = isinstance(size, tuple) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)
        if not ok:
            raise ValueError(f"expected size to be None, a positive int or a (width, height) pair, got {size!r}")
    from sklearn.datasets import load_sample_images

    photos = [PIL.Image.fromarray(np.asarray(a)).convert("RGB") for a in load_sample_images().images]
    images = []
    for i in range(n):
        photo = photos[i % len(photos)]
        k = i // len(photos)
        if k > 0:
            side = int(0.6 * min(photo.size))
            x = int((k * _GOLDEN) % 1.0 * (photo.width - side))
            y = int((k * _SILVER) % 1.0 * (photo.height - side))
            photo = photo.crop((x, y, x + side, y + side))
        images.append(_resize(photo, size))
    return images


def _resize(image: PIL.Image.Image, size: int | tuple[int, int] | None) -> PIL.Image.Image:
    if size is None:
        return image.copy()
    if isinstance(size, int):
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side))
        size = (size, size)
    return image.resize(size, PIL.Image.Resampling.BICUBIC)


# --- saving -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTinyPipeline:
    """Where :func:`save_tiny_pipeline` wrote a tiny pipeline (``model_dir``: the ``save_pretrained`` folder;
    ``ip_adapter_dir``: the folder holding the adapter file ``weight_file``), and how to load it back."""

    model_dir: Path
    ip_adapter_dir: Path
    weight_name: str
    weight_file: Path
    kind: str
    ip_adapter: str
    seed: int

    @property
    def load_ip_adapter_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``pipe.load_ip_adapter(**kwargs)`` that load the saved adapter by path."""
        return {
            "pretrained_model_name_or_path_or_dict": str(self.ip_adapter_dir),
            "subfolder": "",
            "weight_name": self.weight_name,
            "image_encoder_folder": None,
        }

    def load(
        self, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32
    ) -> StableDiffusionPipeline | StableDiffusionXLPipeline:
        """Load the pipeline and its adapter back by path, offline (``local_files_only=True``).

        The weights are copied out of the memory-mapped files (:func:`realign_weights`), so on CPU the output is
        bit-identical to ``tiny_pipeline(kind, ip_adapter, seed=seed)``'s.
        """
        pipe = _pipeline_class(self.kind).from_pretrained(self.model_dir, local_files_only=True)
        with quiet_known_messages():
            pipe.load_ip_adapter(**self.load_ip_adapter_kwargs, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        return _move(realign_weights(pipe), device, _resolve_dtype(dtype))


def realign_weights(pipe: Any) -> Any:
    """Copy every parameter and buffer of a pipeline's torch modules into freshly allocated memory, in place.

    ``from_pretrained`` on CPU can leave weights inside the memory-mapped safetensors file, at addresses that are
    not 64-byte aligned. CPU BLAS kernels pick a different code path for unaligned operands, so a loaded model can
    differ from the same weights built in memory in the last bits (about 1e-7 relative). After this call the
    weights live in ordinary (aligned) allocations and the two agree exactly; the files are no longer referenced.
    Returns ``pipe`` (any object with a ``components`` dict) itself.
    """
    for component in pipe.components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        with torch.no_grad():
            for param in component.parameters():
                param.data = param.data.clone()
            for module in component.modules():
                for name, buffer in module.named_buffers(recurse=False):  # setattr: the registered buffer
                    setattr(module, name, buffer.clone())
    return pipe


def save_tiny_pipeline(
    directory: str | os.PathLike,
    kind: PipelineKind = "sd15",
    ip_adapter: AdapterKind = "base",
    seed: int = 0,
) -> SavedTinyPipeline:
    """Write the tiny pipeline the way real weights come, for testing loading by path.

    ``<directory>/model`` is the pipeline *without* IP-Adapter, from ``save_pretrained``, including the image encoder
    and feature extractor (so ``from_pretrained`` brings them back and ``load_ip_adapter`` needs
    ``image_encoder_folder=None``). ``<directory>/ip_adapter/ip-adapter.safetensors`` holds the adapter weights of
    ``tiny_pipeline(kind, ip_adapter, seed=seed)`` as one file with ``image_proj.*`` and ``ip_adapter.*`` keys, the
    layout ``load_ip_adapter`` reads from a local folder. Loaded back, the pipeline's output is bit-identical to
    ``tiny_pipeline(kind, ip_adapter, seed=seed)``'s once the weights are copied out of the memory-mapped files
    (:func:`realign_weights`; :meth:`SavedTinyPipeline.load` does it). ``directory`` is created if missing;
    existing files of the same names are overwritten.

    Example:
        ```py
        >>> saved = save_tiny_pipeline("/tmp/tiny")
        >>> pipe = StableDiffusionPipeline.from_pretrained(saved.model_dir)
        >>> pipe.load_ip_adapter(**saved.load_ip_adapter_kwargs)
        ```
    """
    from safetensors.torch import save_file

    check_choice(kind, "kind", PIPELINE_KINDS)
    check_choice(ip_adapter, "ip_adapter", IP_ADAPTER_KINDS)
    check_seed(seed)
    root = Path(directory)
    model_dir, adapter_dir = root / "model", root / "ip_adapter"
    pipe = _pipeline_class(kind)(**tiny_components(kind, seed))
    pipe.save_pretrained(model_dir, safe_serialization=True)
    state = tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, ip_adapter, _adapter_seed(seed, 0))
    flat = {f"{group}.{key}": value for group, tensors in state.items() for key, value in tensors.items()}
    adapter_dir.mkdir(parents=True, exist_ok=True)
    weight_file = adapter_dir / IP_ADAPTER_WEIGHT_NAME
    save_file(flat, str(weight_file), metadata={"format": "pt", "ipa_probe": f"{kind}/{ip_adapter}/seed={seed}"})
    return SavedTinyPipeline(
        model_dir=model_dir,
        ip_adapter_dir=adapter_dir,
        weight_name=IP_ADAPTER_WEIGHT_NAME,
        weight_file=weight_file,
        kind=kind,
        ip_adapter=ip_adapter,
        seed=seed,
    )
