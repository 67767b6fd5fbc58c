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

from ..._checks import DEFAULT_DIGITS_RECIPE as DEFAULT_RECIPE
from ..._checks import DIGITS_BASE_FILES, check_recipe
from ..._quiet import quiet_known_messages
from ..sd import _base_to_checkpoint_layout, _seeded, realign_weights
from ..tokenizer import CLIP_MODEL_MAX_LENGTH, CLIP_VOCAB_SIZE, clip_tokenizer
from .data import (
    _TEXT_WIDTH,
    _VISION_WIDTH,
    DIGITS_WEIGHTS,
    IMAGE_SIZE,
    IP_ADAPTER_WEIGHTS,
    LATENT_SIZE,
    NUM_IP_TOKENS,
    WEIGHT_NAME,
    shipped_folder,
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


def _unet(layers_per_block: int = 1, heads: int = 4) -> UNet2DConditionModel:
    # SD 1.5's layout: CrossAttnDown x 3 + Down, mid with cross-attention, Up + CrossAttnUp x 3, a fixed number of
    # heads (diffusers' legacy ``attention_head_dim`` means heads for SD 1.5). ``support``: one layer per block (10
    # cross-attention layers), 4 heads of width 8 or 16; ``ip-adapter``: SD 1.5's two layers per block (16
    # cross-attention layers), SD 1.5's 8 heads, of width 4 or 8.
    return UNet2DConditionModel(
        sample_size=LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=layers_per_block,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=_TEXT_WIDTH,
        attention_head_dim=heads,
        norm_num_groups=32,
    )


def _base_unet() -> UNet2DConditionModel:
    """The ``ip-adapter`` recipe's base UNet: SD 1.5's blocks at ``layers_per_block=2`` and 8 heads."""
    return _unet(layers_per_block=2, heads=8)


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


def organism_scheduler() -> DDIMScheduler:
    """The organism's DDIM scheduler (SD 1.x's betas, ``steps_offset=1``), as it trains and samples."""
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _install_ip_processors(
    unet: UNet2DConditionModel, from_text_projections: bool = False
) -> list[IPAdapterAttnProcessor2_0]:
    """Give every cross-attention layer a fresh ``IPAdapterAttnProcessor2_0`` (self-attention keeps the default).

    With ``from_text_projections`` each layer's ``to_k_ip`` / ``to_v_ip`` start as copies of its ``to_k`` / ``to_v``
    (as IP-Adapter's training does); otherwise they keep ``nn.Linear``'s random initialisation.
    """
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
            if from_text_projections:
                with torch.no_grad():
                    proc.to_k_ip[0].weight.copy_(attn.to_k.weight)
                    proc.to_v_ip[0].weight.copy_(attn.to_v.weight)
            processors[name] = proc
            ip.append(proc)
        else:
            processors[name] = AttnProcessor2_0()
    unet.set_attn_processor(processors)
    return ip


def untrained_digits_pipeline(seed: int = 0, recipe: str = DEFAULT_RECIPE) -> StableDiffusionPipeline:
    """The organism's architecture with its initial (untrained) weights: the control of the experiments.

    The VAE and image encoder are untrained too; the scaling factor is the trained run's (the shipped ``support``
    one's for ``ip-adapter``, whose VAE that is). Built the way :func:`train_digits` initialises them (``support``
    and ``mixed`` share the architecture and initial weights; for ``recipe="ip-adapter"``: the 16-layer UNet, an
    adapter whose ``to_k_ip`` / ``to_v_ip`` are copies of ``to_k`` / ``to_v``), then loaded through
    ``load_ip_adapter`` like the trained one. ``recipe``: ``"support"``, ``"mixed"`` or ``"ip-adapter"``.
    """
    recipe = check_recipe(recipe)
    parts = _init_modules(seed) if recipe != "ip-adapter" else _init_base_modules(seed, with_adapter=True)
    if recipe == "ip-adapter":
        with _seeded(seed, "digits/vae"):
            parts["vae"] = _vae()
    pipe = StableDiffusionPipeline(
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        tokenizer=clip_tokenizer(),
        unet=parts["unet"],
        scheduler=organism_scheduler(),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=parts["image_encoder"],
        requires_safety_checker=False,
    )
    record = json.loads((shipped_folder("mixed" if recipe == "mixed" else "support") / "record.json").read_text())
    pipe.vae.register_to_config(scaling_factor=record["scaling_factor"])
    return _load_initial_adapter(pipe, parts, seed)


def init_adapter_pipeline(recipe: str = DEFAULT_RECIPE, seed: int = 0) -> StableDiffusionPipeline:
    """The trained organism of ``recipe`` with only its adapter (``ImageProjection``, every ``to_k_ip`` / ``to_v_ip``)
    back at the tensors its training started from, built by the recipe's seeded initialiser (``support``, ``mixed``:
    :func:`_init_modules`; ``ip-adapter``: :func:`_init_adapter` on the trained base); every other weight is the
    trained one's. The control that isolates training (docs/findings.md, section 2); ``seed``: the training's."""
    recipe = check_recipe(recipe)
    pipe = digits_pipeline(recipe=recipe)
    parts = _init_adapter(pipe.unet, seed) if recipe == "ip-adapter" else _init_modules(seed)
    return _load_initial_adapter(pipe, parts, seed)


def _load_initial_adapter(pipe: StableDiffusionPipeline, parts: dict[str, Any], seed: int) -> StableDiffusionPipeline:
    """Load the adapter of ``parts`` (``image_proj``, ``ip_processors``) into ``pipe`` through ``load_ip_adapter``,
    replacing any it had (the image encoder stays)."""
    state = _adapter_state_dict(pipe.unet, parts["ip_processors"], parts["image_proj"])
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


def _init_base_modules(seed: int, with_adapter: bool = False) -> dict[str, Any]:
    """The ``ip-adapter`` recipe's initial base UNet, image encoder and text encoder (the shipped one's init), and
    with ``with_adapter`` an adapter initialised as stage 2 initialises it."""
    with _seeded(seed, "digits/text_encoder"):
        text_encoder = _text_encoder()
    with _seeded(seed, "digits/ip-adapter/image_encoder"):
        image_encoder = _image_encoder()
    with _seeded(seed, "digits/ip-adapter/unet"):
        unet = _base_unet()
    parts: dict[str, Any] = dict(
        text_encoder=text_encoder.eval().requires_grad_(False), image_encoder=image_encoder, unet=unet
    )
    if with_adapter:
        parts.update(_init_adapter(unet, seed))
    return parts


def _init_adapter(unet: UNet2DConditionModel, seed: int) -> dict[str, Any]:
    """Stage 2's starting adapter on ``unet``: a seeded ``ImageProjection`` and ``to_k_ip`` / ``to_v_ip`` copied
    from each cross-attention layer's ``to_k`` / ``to_v``."""
    with _seeded(seed, "digits/ip-adapter/image_proj"):
        image_proj = ImageProjection(
            image_embed_dim=_VISION_WIDTH, cross_attention_dim=_TEXT_WIDTH, num_image_text_embeds=NUM_IP_TOKENS
        )
    return dict(image_proj=image_proj, ip_processors=_install_ip_processors(unet, from_text_projections=True))


def _adapter_state_dict(
    unet: UNet2DConditionModel, ip_processors: Sequence[IPAdapterAttnProcessor2_0], image_proj: ImageProjection
) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter in the published checkpoints' layout: ``image_proj.{proj,norm}.*`` and, for the ``n``-th
    cross-attention layer in ``unet.attn_processors`` order, ``ip_adapter.{2n+1}.to_{k,v}_ip.weight``."""
    proj = _base_to_checkpoint_layout(image_proj)
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


def digits_pipeline(path: str | os.PathLike | None = None, recipe: str | None = None) -> StableDiffusionPipeline:
    """The trained digits organism: a ``StableDiffusionPipeline`` on CPU in float32, progress bar on.

    Loaded offline through diffusers' ``from_pretrained`` and ``load_ip_adapter``: ``"support"`` and ``"mixed"`` from
    ``<path>/model`` and ``<path>/ip_adapter/ip-adapter.safetensors``; ``"ip-adapter"`` from its frozen base's
    ``unet/`` and ``image_encoder/``, the support folder's other components and its own ``ip_adapter/``. How each
    recipe was trained: docs/organism.md. Call it with ``ip_adapter_image=[digits_reference_images(d, n)]`` (one
    support set).

    Args:
        path: a folder written by ``ipa-probe train-digits`` (for ``ip-adapter``: its adapter stage, whose
            ``record.json`` names the base); ``None`` loads the weights shipped with the package.
        recipe: ``"support"``, ``"mixed"`` or ``"ip-adapter"``; ``None``: the folder's own recipe, or for the
            shipped weights :data:`ipa_probe._checks.DEFAULT_DIGITS_RECIPE`.

    Raises:
        ValueError: an unknown recipe, or a folder of the other recipe.
        FileNotFoundError: no trained organism in ``path``, or its base is missing or changed.

    Example:
        ```py
        >>> pipe = digits_pipeline()
        >>> refs = digits_reference_images(3, 2)
        >>> image = pipe("a handwritten digit", ip_adapter_image=[refs], num_inference_steps=20).images[0]
        ```
    """
    if recipe is not None:
        check_recipe(recipe)
    root = Path(path) if path is not None else None
    found = _folder_recipe(root) if root is not None else None
    if recipe is None:
        recipe = found or DEFAULT_RECIPE
    elif found is not None and found != recipe:
        raise ValueError(f"expected a {recipe!r} organism in {root}, got a {found!r} one; pass recipe={found!r}")
    if recipe == "ip-adapter":
        return _ip_adapter_pipeline(root)
    root = root if root is not None else shipped_folder(recipe)
    if not (root / "model" / "model_index.json").exists():
        raise FileNotFoundError(
            f"expected a digits organism in {root} (model/model_index.json); "
            "train one with `ipa-probe train-digits --out DIR` or pass path=None for the shipped weights"
        )
    with _quiet_loading(), quiet_known_messages():
        pipe = StableDiffusionPipeline.from_pretrained(root / "model", local_files_only=True)
        _load_adapter(pipe, root)
    return _ready(pipe)


def _folder_recipe(root: Path) -> str | None:
    """The recipe a training folder's ``record.json`` names (records before the recipes existed: ``support``)."""
    try:
        record = json.loads((root / "record.json").read_text())
    except (OSError, ValueError):
        return None
    recipe = record.get("recipe", "support") if isinstance(record, dict) else None
    return recipe.split("/")[0] if isinstance(recipe, str) else None


def _load_adapter(pipe: StableDiffusionPipeline, root: Path) -> None:
    pipe.load_ip_adapter(
        str(root / "ip_adapter"),
        subfolder="",
        weight_name=WEIGHT_NAME,
        image_encoder_folder=None,
        local_files_only=True,
    )


def _ready(pipe: StableDiffusionPipeline) -> StableDiffusionPipeline:
    pipe.text_encoder.float()  # stored in float16 (the rest in float32); it ran in float32 during training
    pipe.set_progress_bar_config(disable=False)
    return realign_weights(pipe)


#: the files of a base (stage 1 of the ``ip-adapter`` recipe) that stage 2 and the pipeline load
BASE_FILES = DIGITS_BASE_FILES


def base_digest(base: str | os.PathLike) -> str:
    """SHA-256 of a base's tensors (UNet and image encoder, :func:`~.checkpoint.tensors_digest`): what an adapter
    records as the base it was trained on."""
    from safetensors.torch import load_file

    from .checkpoint import tensors_digest

    tensors = {}
    for name, rel in BASE_FILES.items():
        tensors.update({f"{name}/{k}": v for k, v in load_file(str(Path(base) / rel)).items()})
    return tensors_digest(tensors)


def load_base(base: str | os.PathLike) -> tuple[UNet2DConditionModel, CLIPVisionModelWithProjection]:
    """A base written by ``train-digits --recipe ip-adapter --stage base``: its UNet (stored in float16, returned in
    float32) and its image encoder, in eval mode with gradients off. A missing file raises ``FileNotFoundError``
    naming it and the remedy.
    """
    base = Path(base)
    for rel in BASE_FILES.values():
        if not (base / rel).is_file():
            raise FileNotFoundError(
                f"expected an ip-adapter base in {base} ({rel} is missing); train one with `ipa-probe train-digits "
                "--recipe ip-adapter --stage base --out DIR`, or use the shipped base"
            )
    with _quiet_loading():  # the UNet is stored in float16; loaded in float32 (exact: every float16 is a float32)
        unet = UNet2DConditionModel.from_pretrained(base / "unet", torch_dtype=torch.float32, local_files_only=True)
        image_encoder = CLIPVisionModelWithProjection.from_pretrained(base / "image_encoder", local_files_only=True)
    for module in (unet, image_encoder):
        module.eval().requires_grad_(False)
        with torch.no_grad():  # out of the memory-mapped file (see realign_weights)
            for param in module.parameters():
                param.data = param.data.clone()
    return unet, image_encoder


def resolve_base(base: str | None) -> Path:
    """The base folder an adapter's ``config["base"]`` names (``None``: the shipped base)."""
    return IP_ADAPTER_WEIGHTS / "base" if base is None else Path(base).expanduser()


def _ip_adapter_pipeline(path: Path | None) -> StableDiffusionPipeline:
    adapter = path if path is not None else IP_ADAPTER_WEIGHTS / "adapter"
    try:
        record = json.loads((adapter / "record.json").read_text())
        base = resolve_base(record["config"]["base"])
        expected = record["base_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise FileNotFoundError(
            f"expected an ip-adapter organism in {adapter} (record.json of its adapter stage); train one with "
            "`ipa-probe train-digits --recipe ip-adapter --out DIR` or pass path=None for the shipped weights"
        ) from None
    unet, image_encoder = load_base(base)
    if base_digest(base) != expected:
        raise FileNotFoundError(
            f"the base in {base} is not the one the adapter in {adapter} was trained on (their digests differ); "
            "train the adapter again on this base, or restore that base"
        )
    with _quiet_loading():
        pipe = StableDiffusionPipeline.from_pretrained(
            DIGITS_WEIGHTS / "model", unet=unet, image_encoder=image_encoder, local_files_only=True
        )
        _load_adapter(pipe, adapter)
    return _ready(pipe)
