"""Embedded tiny Flux and Stable Diffusion 3 pipelines with IP-Adapters: built from configs, seeded, offline.

:func:`tiny_flux_pipeline` returns a real diffusers ``FluxPipeline`` and :func:`tiny_sd3_pipeline` a real
``StableDiffusion3Pipeline``, with tiny, randomly initialised components and IP-Adapter weights made here as state
dicts and loaded through diffusers' own loaders (``FluxIPAdapterMixin.load_ip_adapter`` and
``SD3IPAdapterMixin.load_ip_adapter``). So the processors the probe meets are diffusers' own
``FluxIPAdapterAttnProcessor`` (in every double-stream block) and ``SD3IPAdapterJointAttnProcessor2_0`` (in every
joint block), fed by diffusers' own image projections (``ImageProjection`` for Flux, the timestep-aware resampler
``IPAdapterTimeImageProjection`` for SD3) and image encoders (CLIP for Flux, SigLIP for SD3).

Tokenizers are offline: CLIP's from :mod:`ipa_probe.tiny.tokenizer`, and a small T5 tokenizer
(:func:`tiny_t5_tokenizer`): a ``transformers.T5Tokenizer`` whose Unigram vocabulary is written here (T5's special
tokens at ids 0-2, then single characters, word-initial characters and a few common words, with fixed log-probability
scores), so prompts tokenize deterministically without a SentencePiece file or a download.

Sizes: images default to 64 x 64 through a 4x VAE, so both denoisers see 64 latent tokens (Flux packs 2 x 2 latent
patches, SD3 uses 2 x 2 patches); attention layers have 2 heads of width 16. Weights are drawn under
``torch.random.fork_rng`` from seeds derived from ``seed`` and a component name (the caller's RNG is untouched).
"""

from __future__ import annotations

import string
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.embeddings import ImageProjection, IPAdapterTimeImageProjection
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from .._checks import check_int, check_seed
from .._quiet import quiet_known_messages
from .sd import (
    _adapter_seed,
    _adapter_state,
    _base_to_checkpoint_layout,
    _feature_extractor,
    _image_encoder,
    _move,
    _renamed_layers,
    _resolve_dtype,
    _seeded,
    _text_config,
)
from .tokenizer import clip_tokenizer

__all__ = [
    "FLUX_IP_TOKENS",
    "SD3_IP_TOKENS",
    "tiny_flux_components",
    "tiny_flux_ip_adapter_state_dict",
    "tiny_flux_pipeline",
    "tiny_sd3_components",
    "tiny_sd3_ip_adapter_state_dict",
    "tiny_sd3_pipeline",
    "tiny_t5_tokenizer",
]

FLUX_IP_TOKENS = 4
"""Image tokens per reference image in Flux IP-Adapters (diffusers' loader infers 4 unless the projection is 16x)."""
SD3_IP_TOKENS = 8
"""Image tokens of the tiny SD3 resampler (the learned queries of ``IPAdapterTimeImageProjection``; 64 in the
published SD3.5 adapter)."""

_TEXT_WIDTH = 32  # CLIP width, as in ipa_probe.tiny.sd
_HEADS = 2
_HEAD_DIM = 16
_INNER = _HEADS * _HEAD_DIM
_LATENT_CHANNELS = 4
_IMAGE_SIZE = 64
_VAE_FACTOR = 4  # three VAE levels
_T5_MAX_LENGTH = 32

# The T5 vocabulary: specials at T5's ids, then pieces. Scores are log-probabilities for the Unigram model: a
# known word beats spelling it, a word-initial character beats a bare one, so segmentations are stable.
_T5_WORDS = (
    "a an the of and with in on at by for from to is photo picture image painting drawing render style portrait "
    "landscape cat dog flower flowers tree house city sky sea mountain person woman man red blue green yellow white "
    "black bright dark blurry detailed high quality"
).split()


def tiny_t5_tokenizer(model_max_length: int = _T5_MAX_LENGTH) -> T5Tokenizer:
    """A small offline T5 tokenizer (Unigram vocabulary written here, about 250 pieces).

    Layout as in T5: ``<pad>`` = 0, ``</s>`` = 1 (appended to every sequence), ``<unk>`` = 2; then ``"▁"``, the
    printable ASCII characters, the same characters word-initially (``"▁c"``), and common prompt words (``"▁photo"``).
    Any ASCII prompt tokenizes without ``<unk>``; no sentinel (``<extra_id_*>``) tokens. ``model_max_length`` is
    the default maximum length (the pipelines pass their own ``max_sequence_length``); ``len(tokenizer)`` is the
    vocabulary size for the text encoder.

    Example:
        ```py
        >>> tok = tiny_t5_tokenizer()
        >>> tok.convert_ids_to_tokens(tok("a photo of a cat").input_ids)
        ['▁a', '▁photo', '▁of', '▁a', '▁cat', '</s>']
        ```
    """
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces: dict[str, float] = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -3.0}
    pieces.update({c: -8.0 for c in chars})
    pieces.update({"▁" + c: -7.0 for c in chars})
    for word in _T5_WORDS:
        pieces.setdefault("▁" + word, -4.0)
    return T5Tokenizer(vocab=list(pieces.items()), extra_ids=0, model_max_length=model_max_length)


def _t5_encoder(width: int, vocab_size: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=vocab_size,
        d_model=width,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in Flux and SD3
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def _vae(shift: float, scale: float) -> AutoencoderKL:
    # Three levels: a 4x downsampling factor; no quant convs, as in the Flux and SD3 VAEs.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=_LATENT_CHANNELS,
        sample_size=_IMAGE_SIZE,
        shift_factor=shift,
        scaling_factor=scale,
        use_quant_conv=False,
        use_post_quant_conv=False,
        force_upcast=False,
    )


# --- Flux -----------------------------------------------------------------------------------------------------------


def tiny_flux_components(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny Flux.1-dev-like pipeline, without IP-Adapter, on CPU in float32.

    Two double-stream blocks (where Flux IP-Adapters act) and one single-stream block, 2 heads of width 16 with
    rotary axes (4, 6, 6), guidance embedding (as in Flux.1-dev); CLIP (pooled, width 32) and T5 (width 32) text
    encoders; a CLIP image encoder with 32-wide ``image_embeds``. Returns the keyword arguments for ``FluxPipeline``;
    ``seed``: a non-negative int.
    """
    check_seed(seed)
    tokenizer_2 = tiny_t5_tokenizer()
    with _seeded(seed, "flux/transformer"):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * _LATENT_CHANNELS,  # 2 x 2 packed latent patches
            num_layers=2,
            num_single_layers=1,
            attention_head_dim=_HEAD_DIM,
            num_attention_heads=_HEADS,
            joint_attention_dim=_TEXT_WIDTH,
            pooled_projection_dim=_TEXT_WIDTH,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    with _seeded(seed, "flux/vae"):
        vae = _vae(shift=0.1159, scale=0.3611)
    with _seeded(seed, "flux/text_encoder"):
        text_encoder = CLIPTextModel(_text_config(projection=False))
    with _seeded(seed, "flux/text_encoder_2"):
        text_encoder_2 = _t5_encoder(_TEXT_WIDTH, len(tokenizer_2))
    with _seeded(seed, "flux/image_encoder"):
        image_encoder = _image_encoder()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return dict(
        scheduler=scheduler,
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tokenizer(),
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer_2,
        transformer=transformer.eval(),
        image_encoder=image_encoder.eval(),
        feature_extractor=_feature_extractor(),
    )


def tiny_flux_ip_adapter_state_dict(
    transformer: FluxTransformer2DModel, image_encoder: torch.nn.Module, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """Random Flux IP-Adapter weights in the layout ``FluxIPAdapterMixin.load_ip_adapter`` takes as a dict.

    ``image_proj``: ``proj.{weight,bias}`` (``image_embeds`` -> 4 tokens of ``joint_attention_dim``) and
    ``norm.{weight,bias}`` (diffusers' ``ImageProjection``). ``ip_adapter``: for each double-stream block ``n``,
    ``{n}.to_k_ip.{weight,bias}`` and ``{n}.to_v_ip.{weight,bias}``, shape ``(heads * head_dim, joint_attention_dim)``
    and ``(heads * head_dim,)``: Flux's image keys have a bias (and no normalisation). Only the transformer's
    configuration is read; float32 CPU tensors.
    """
    check_seed(seed)
    cross_dim = transformer.config.joint_attention_dim
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    with _seeded(seed, "flux_ip_adapter/image_proj"):
        proj = ImageProjection(
            image_embed_dim=image_encoder.config.projection_dim,
            cross_attention_dim=cross_dim,
            num_image_text_embeds=FLUX_IP_TOKENS,
        )
        image_proj = _base_to_checkpoint_layout(proj)
    layers: dict[str, torch.Tensor] = {}
    with _seeded(seed, "flux_ip_adapter/layers"):
        for n in range(transformer.config.num_layers):
            for name in ("to_k_ip", "to_v_ip"):
                linear = torch.nn.Linear(cross_dim, inner, bias=True)
                torch.nn.init.normal_(linear.bias, std=0.5)  # a visible bias: keys are affine in the image tokens
                layers[f"{n}.{name}.weight"] = linear.weight.detach()
                layers[f"{n}.{name}.bias"] = linear.bias.detach()
    return _adapter_state(image_proj, layers)


def tiny_flux_pipeline(
    num_adapters: int = 1,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> FluxPipeline:
    """A tiny, seeded ``FluxPipeline`` with IP-Adapter(s) loaded through ``FluxIPAdapterMixin.load_ip_adapter``.

    The two double-stream blocks hold ``FluxIPAdapterAttnProcessor`` processors (one ``to_k_ip``/``to_v_ip`` pair per
    adapter); ``pipe(..., ip_adapter_image=[refs])`` takes one entry per adapter, a list of images in an entry being
    that adapter's support set (4 tokens per image). Classifier-free guidance in Flux is "true CFG": pass
    ``negative_prompt`` and ``true_cfg_scale > 1`` and the transformer runs a separate unconditional pass per step.
    Default image size 64 x 64 (64 latent tokens). Arguments as in :func:`ipa_probe.tiny.sd.tiny_pipeline`.

    Example:
        ```py
        >>> pipe = tiny_flux_pipeline()
        >>> refs = ipa_probe.default_reference_images(2)
        >>> out = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=2, max_sequence_length=16)
        ```
    """
    check_int(num_adapters, "num_adapters", 1)
    torch_dtype = _resolve_dtype(dtype)
    pipe = FluxPipeline(**tiny_flux_components(seed))
    pipe.default_sample_size = _IMAGE_SIZE // _VAE_FACTOR  # 64 x 64 images by default
    states = [
        tiny_flux_ip_adapter_state_dict(pipe.transformer, pipe.image_encoder, _adapter_seed(seed, i))
        for i in range(num_adapters)
    ]
    # the loader's default inits must not draw from the caller's RNG
    with _seeded(seed, "flux/load_ip_adapter"), quiet_known_messages():
        pipe.load_ip_adapter(states, weight_name=[""] * num_adapters, subfolder=[""] * num_adapters)
    pipe.set_progress_bar_config(disable=True)
    return _move(pipe, device, torch_dtype)


# --- SD3 ------------------------------------------------------------------------------------------------------------

_SD3_RESAMPLER_WIDTH = 64  # diffusers' loader derives the resampler's heads as width // 64
_SD3_TIME_WIDTH = 32


def _siglip_encoder() -> SiglipVisionModel:
    config = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,  # the pipeline reads the penultimate hidden states
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
    )
    return SiglipVisionModel(config)


def tiny_sd3_components(seed: int = 0) -> dict[str, Any]:
    """The components of a tiny SD3.5-like pipeline, without IP-Adapter, on CPU in float32.

    Two joint blocks with RMS query/key norms (SD3.5), 2 heads of width 16; two CLIP text encoders with projection
    (pooled width 2 x 32) and a T5 encoder of width 64 (the joint attention width); a SigLIP image encoder
    (``SiglipVisionModel``, 64 patch tokens of width 32) with its ``SiglipImageProcessor``. Returns the keyword
    arguments for ``StableDiffusion3Pipeline``; ``seed``: a non-negative int.
    """
    check_seed(seed)
    tokenizer_3 = tiny_t5_tokenizer()
    with _seeded(seed, "sd3/transformer"):
        transformer = SD3Transformer2DModel(
            sample_size=_IMAGE_SIZE // _VAE_FACTOR,
            patch_size=2,
            in_channels=_LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=_HEAD_DIM,
            num_attention_heads=_HEADS,
            joint_attention_dim=2 * _TEXT_WIDTH,
            caption_projection_dim=_INNER,
            pooled_projection_dim=2 * _TEXT_WIDTH,
            out_channels=_LATENT_CHANNELS,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        )
    with _seeded(seed, "sd3/vae"):
        vae = _vae(shift=0.0609, scale=1.5305)
    with _seeded(seed, "sd3/text_encoder"):
        text_encoder = CLIPTextModelWithProjection(_text_config(projection=True))
    with _seeded(seed, "sd3/text_encoder_2"):
        text_encoder_2 = CLIPTextModelWithProjection(_text_config(projection=True))
    with _seeded(seed, "sd3/text_encoder_3"):
        text_encoder_3 = _t5_encoder(2 * _TEXT_WIDTH, len(tokenizer_3))
    with _seeded(seed, "sd3/image_encoder"):
        image_encoder = _siglip_encoder()
    feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return dict(
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=clip_tokenizer(),
        text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=clip_tokenizer(pad_token="!"),
        text_encoder_3=text_encoder_3.eval(),
        tokenizer_3=tokenizer_3,
        image_encoder=image_encoder.eval(),
        feature_extractor=feature_extractor,
    )


#: the published SD3.5 adapter's (InstantX) ``image_proj`` key parts for diffusers' ``IPAdapterTimeImageProjection``'s
_SD3_RESAMPLER_RENAMES = (
    (".ln0.", ".0.norm1."),
    (".ln1.", ".0.norm2."),
    (".attn.to_q.", ".0.to_q."),
    (".attn.to_kv.", ".0.to_kv."),
    (".attn.to_out.0.", ".0.to_out."),
    (".adaln_norm.", ".1.0."),
    (".ff.net.0.proj.", ".1.1."),
    (".ff.net.2.", ".1.3."),
    (".adaln_proj.", ".2.1."),
)


def tiny_sd3_ip_adapter_state_dict(
    transformer: SD3Transformer2DModel, image_encoder: torch.nn.Module, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """Random SD3 IP-Adapter weights in the layout ``SD3IPAdapterMixin.load_ip_adapter`` takes as a dict.

    ``image_proj``: the timestep-aware resampler (``IPAdapterTimeImageProjection``: :data:`SD3_IP_TOKENS` learned
    queries of width 64 over the SigLIP patch tokens, four blocks, 32 timestep features), in the published
    checkpoint's key names. ``ip_adapter``: for each joint-attention processor ``n`` (in ``attn_processors`` order),
    the state of an ``SD3IPAdapterJointAttnProcessor2_0``: ``norm_ip`` (AdaLayerNorm of the image tokens on the
    resampler's timestep embedding), ``to_k_ip``/``to_v_ip`` (no bias), and the RMS norms ``norm_q``, ``norm_k``,
    ``norm_ip_k``. The RMS gains are drawn around 1 (``1 + 0.3 * N(0, 1)``, as trained gains are): with all gains at
    1 every normalised key would have norm ``sqrt(d_head)`` and the Gaussian NW weights would equal the attention
    exactly. ``image_encoder``: the SigLIP encoder whose penultimate hidden states the resampler consumes; float32
    CPU tensors.
    """
    check_seed(seed)
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    with _seeded(seed, "sd3_ip_adapter/image_proj"):
        resampler = IPAdapterTimeImageProjection(
            embed_dim=image_encoder.config.hidden_size,
            output_dim=inner,
            hidden_dim=_SD3_RESAMPLER_WIDTH,
            depth=4,  # what diffusers' loader builds
            dim_head=64,
            heads=_SD3_RESAMPLER_WIDTH // 64,
            num_queries=SD3_IP_TOKENS,
            timestep_in_dim=_SD3_TIME_WIDTH,
        )
        image_proj = _renamed_layers(resampler.state_dict(), _SD3_RESAMPLER_RENAMES)
    layers: dict[str, torch.Tensor] = {}
    with _seeded(seed, "sd3_ip_adapter/layers"):
        for n, _ in enumerate(transformer.attn_processors):
            processor = SD3IPAdapterJointAttnProcessor2_0(
                hidden_size=inner,
                ip_hidden_states_dim=inner,
                head_dim=transformer.config.attention_head_dim,
                timesteps_emb_dim=_SD3_RESAMPLER_WIDTH,
            )
            with torch.no_grad():
                for norm in (processor.norm_q, processor.norm_k, processor.norm_ip_k):
                    norm.weight.add_(0.3 * torch.randn_like(norm.weight))
            layers.update({f"{n}.{k}": v.detach() for k, v in processor.state_dict().items()})
    return _adapter_state(image_proj, layers)


def tiny_sd3_pipeline(
    seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32
) -> StableDiffusion3Pipeline:
    """A tiny, seeded ``StableDiffusion3Pipeline`` with an IP-Adapter loaded through
    ``SD3IPAdapterMixin.load_ip_adapter``.

    Every joint-attention layer holds an ``SD3IPAdapterJointAttnProcessor2_0`` (SD3 supports one adapter, scale 0.5
    by default); ``pipe(..., ip_adapter_image=image)`` takes one reference image per prompt. Classifier-free
    guidance concatenates ``[uncond, cond]`` in one transformer pass, as in SD 1.5. Default image size 64 x 64 (64
    latent tokens). Arguments as in :func:`tiny_flux_pipeline` (one adapter: no ``num_adapters``).
    """
    torch_dtype = _resolve_dtype(dtype)
    pipe = StableDiffusion3Pipeline(**tiny_sd3_components(seed))
    state = tiny_sd3_ip_adapter_state_dict(pipe.transformer, pipe.image_encoder, seed)
    with _seeded(seed, "sd3/load_ip_adapter"), quiet_known_messages():
        pipe.load_ip_adapter(state, low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    return _move(pipe, device, torch_dtype)
