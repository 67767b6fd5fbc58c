"""The builders of :mod:`ipa_probe.tiny.zoo`: one per diffusers pipeline class that takes ``ip_adapter_image``.

Each builder takes the :class:`~ipa_probe.tiny.zoo_base.ZooBases` (for its shared bases) and returns a
:class:`~ipa_probe.tiny.zoo_base.ZooEntry`. Extra components (ControlNets, motion adapters, T2I adapters) are built
from configs under seeds derived from the zoo's seed and the component's name; classes that need another denoiser (8 or
9 input channels, no attention at full resolution) get their own, with a tiny IP-Adapter loaded through diffusers'
``load_ip_adapter``. The labels of each run are written here from diffusers' source, not read from the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import diffusers
import torch
from transformers import BatchEncoding

from .dit import tiny_flux_components, tiny_flux_ip_adapter_state_dict
from .sd import _seeded, tiny_components, tiny_ip_adapter_state_dict, tiny_pipeline
from .tokenizer import CLIP_VOCAB_SIZE, clip_tokenizer
from .zoo_base import (
    _FRAMES,
    _NEGATIVE,
    CFG,
    NO_CFG,
    SIZE,
    Run,
    ZooBases,
    ZooEntry,
    _image,
    _mask,
    _with,
    ip_adapter_pipeline_classes,
)

__all__ = ["BUILDERS"]

Builder = Callable[[ZooBases], ZooEntry]
BUILDERS: dict[str, Builder] = {}


def builds(*names: str) -> Callable[[Callable[[ZooBases, str], ZooEntry]], Callable[[ZooBases, str], ZooEntry]]:
    """Register a builder for the classes ``names`` (it gets the zoo and the class name)."""

    def register(fn: Callable[[ZooBases, str], ZooEntry]) -> Callable[[ZooBases, str], ZooEntry]:
        for name in names:
            BUILDERS[name] = lambda zoo, fn=fn, name=name: fn(zoo, name)
        return fn

    return register


def _cls(name: str) -> type:
    """The class ``name`` from diffusers (from its own module when diffusers' namespace holds a dummy)."""
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):  # a dummy: dependency missing
        cls = ip_adapter_pipeline_classes()[name]
    return cls


def _load_adapter(pipe: Any, seed: int) -> Any:
    """Load a tiny IP-Adapter for ``pipe.unet`` through diffusers' own loader."""
    state = tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, seed=seed)
    with _seeded(seed, "zoo/load_ip_adapter"):
        pipe.load_ip_adapter(
            [state], subfolder=[""], weight_name=[""], image_encoder_folder=None, low_cpu_mem_usage=False
        )
    return pipe


def _config(model: torch.nn.Module, **overrides) -> dict[str, Any]:
    """A model's configuration with ``overrides`` (diffusers would reset the keys it lists as defaults taken)."""
    config = {key: value for key, value in model.config.items() if key != "_use_default_values"}
    return {**config, **overrides}


def _unet(kind: str, seed: int, **overrides) -> diffusers.UNet2DConditionModel:
    """The tiny ``kind`` UNet with its configuration changed (input channels, block types)."""
    base = tiny_components(kind, seed)["unet"]
    with _seeded(seed, f"zoo/unet/{sorted(overrides.items())}"):
        return diffusers.UNet2DConditionModel.from_config(_config(base, **overrides)).eval()


def _controlnet(kind: str, seed: int, cls: type = diffusers.ControlNetModel, **overrides) -> Any:
    """A ControlNet copied from the tiny ``kind`` UNet before any IP-Adapter is loaded (a loaded one changes the UNet's
    ``encoder_hid_dim_type``, which ``from_unet`` cannot copy), its configuration changed by ``overrides``."""
    unet = tiny_components(kind, seed)["unet"]
    with _seeded(seed, f"zoo/{cls.__name__}"):
        controlnet = cls.from_unet(unet, conditioning_embedding_out_channels=(8, 8, 8, 8))
        if overrides:
            controlnet = cls.from_config(_config(controlnet, **overrides))
        return controlnet.eval()


def _motion_adapter(seed: int, **kwargs) -> diffusers.MotionAdapter:
    with _seeded(seed, f"zoo/motion_adapter/{sorted(kwargs.items())}"):
        return diffusers.MotionAdapter(
            block_out_channels=(32, 64),
            motion_layers_per_block=1,
            motion_norm_num_groups=32,
            motion_num_attention_heads=2,
            motion_max_seq_length=8,
            **kwargs,
        )


def _frames(n: int = _FRAMES) -> list:
    return [_image((40 * i, 80, 120)) for i in range(n)]


def _image_inputs(name: str, key: str = "image", **extra: Any) -> dict[str, Any]:
    """``extra`` and what the class ``name`` takes besides: an init image under ``key`` (Img2Img, Inpaint), with
    ``strength=1.0``, and a mask (Inpaint)."""
    if "Img2Img" in name or "Inpaint" in name:
        extra.update({key: _image(), "strength": 1.0})
    if "Inpaint" in name:
        extra["mask_image"] = _mask()
    return extra


# --------------------------------------------------------------------------- Stable Diffusion 1.5


def _kind(name: str) -> str:
    return "sdxl" if "XL" in name else "sd15"


@builds("StableDiffusionPipeline", "StableDiffusionXLPipeline")
def _sd(zoo: ZooBases, name: str) -> ZooEntry:
    return ZooEntry(zoo.base(_kind(name)), [CFG, NO_CFG])


@builds(
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionInpaintPipeline",
    "StableDiffusionXLImg2ImgPipeline",
    "StableDiffusionXLInpaintPipeline",
)
def _sd_image(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base(_kind(name)))
    return ZooEntry(pipe, _with([CFG, NO_CFG], **_image_inputs(name)))


@builds("StableDiffusionInstructPix2PixPipeline")
def _ip2p(zoo: ZooBases, name: str) -> ZooEntry:
    components = tiny_components("sd15", zoo.seed)
    pipe = _cls(name)(**{**components, "unet": _unet("sd15", zoo.seed, in_channels=8)})
    runs = [Run("cfg", {"image": _image()}, ("uncond", "cond", "uncond_text"))]
    return ZooEntry(_load_adapter(pipe, zoo.seed), runs, "UNet with 8 input channels (latents + image latents)")


_PAG = Run("pag cfg", {"negative_prompt": _NEGATIVE, "pag_scale": 3.0}, ("uncond", "cond", "perturbed"))
_PAG_NO_CFG = Run("pag no cfg", {"guidance_scale": 1.0, "pag_scale": 3.0}, ("cond", "perturbed"))


@builds(
    "StableDiffusionPAGPipeline",
    "StableDiffusionPAGImg2ImgPipeline",
    "StableDiffusionPAGInpaintPipeline",
    "StableDiffusionXLPAGPipeline",
    "StableDiffusionXLPAGImg2ImgPipeline",
    "StableDiffusionXLPAGInpaintPipeline",
)
def _sd_pag(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base(_kind(name)), pag_applied_layers=["mid"])
    return ZooEntry(pipe, _with([_PAG, _PAG_NO_CFG], **_image_inputs(name)))


@builds(
    "StableDiffusionControlNetPipeline",
    "StableDiffusionControlNetImg2ImgPipeline",
    "StableDiffusionControlNetInpaintPipeline",
    "StableDiffusionControlNetPAGPipeline",
    "StableDiffusionControlNetPAGInpaintPipeline",
    "StableDiffusionXLControlNetPipeline",
    "StableDiffusionXLControlNetImg2ImgPipeline",
    "StableDiffusionXLControlNetInpaintPipeline",
    "StableDiffusionXLControlNetPAGPipeline",
    "StableDiffusionXLControlNetPAGImg2ImgPipeline",
)
def _sd_controlnet(zoo: ZooBases, name: str) -> ZooEntry:
    kind, pag = _kind(name), "PAG" in name
    options = {"pag_applied_layers": ["mid"]} if pag else {}
    pipe = _cls(name).from_pipe(zoo.base(kind), controlnet=_controlnet(kind, zoo.seed), **options)
    extra = _image_inputs(name, "control_image", image=_image())  # ``image`` is the control image here
    return ZooEntry(pipe, _with([_PAG, _PAG_NO_CFG] if pag else [CFG, NO_CFG], **extra))


@builds("StableDiffusionSAGPipeline")
def _sag(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base("sd15"))
    runs = [
        Run("sag cfg", {"negative_prompt": _NEGATIVE, "sag_scale": 0.75}, ("uncond", "cond", "sag")),
        Run("sag no cfg", {"guidance_scale": 1.0, "sag_scale": 0.75}, ("cond", "sag")),
    ]
    return ZooEntry(pipe, runs, "SAG's pass on degraded latents is recorded at its step as `sag`")


@builds("StableDiffusionPanoramaPipeline")
def _panorama(zoo: ZooBases, name: str) -> ZooEntry:
    # Panorama views are 64 x 64 latents: a UNet without attention at full resolution keeps the runs cheap
    unet = _unet(
        "sd15",
        zoo.seed,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )
    pipe = _cls(name)(**{**tiny_components("sd15", zoo.seed), "unet": unet})
    runs = _with([CFG], height=512, width=576, output_type="latent")
    notes = "512 x 576: 2 views per step (each a denoiser pass), aggregated as one step"
    return ZooEntry(_load_adapter(pipe, zoo.seed), runs, notes)


@builds("StableDiffusionLDM3DPipeline")
def _ldm3d(zoo: ZooBases, name: str) -> ZooEntry:
    sd = zoo.base("sd15")
    with _seeded(zoo.seed, "zoo/ldm3d_vae"):
        vae = diffusers.AutoencoderKL.from_config(_config(sd.vae, in_channels=4, out_channels=4)).eval()
    pipe = _cls(name).from_pipe(sd, vae=vae)
    return ZooEntry(pipe, [CFG, NO_CFG], "VAE with 4 channels (RGB + depth)")


@builds("StableDiffusionPipelineSafe")
def _safe(zoo: ZooBases, name: str) -> ZooEntry:
    # Safe passes its image embeddings as one tensor, hidden states unless the projection is an ImageProjection
    # (never, once loaded): an IP-Adapter Plus (a resampler over hidden states) and one reference image
    pipe = _cls(name).from_pipe(zoo.base("sd15-plus"), safety_checker=None, requires_safety_checker=False)
    runs = [
        Run("safety cfg", {"negative_prompt": _NEGATIVE, "sld_guidance_scale": 1000.0}, ("uncond", "cond", "safety")),
        Run("cfg", {"negative_prompt": _NEGATIVE, "sld_guidance_scale": 0.0}, ("uncond", "cond")),
        NO_CFG,
    ]
    notes = "IP-Adapter Plus and one reference image (Safe passes hidden states); its safety chunk is `safety`"
    return ZooEntry(pipe, runs, notes, images="single")


@builds("AltDiffusionPipeline", "AltDiffusionImg2ImgPipeline")
def _alt(zoo: ZooBases, name: str) -> ZooEntry:
    from diffusers.pipelines.deprecated.alt_diffusion.modeling_roberta_series import (
        RobertaSeriesConfig,
        RobertaSeriesModelWithTransformation,
    )

    sd = zoo.base("sd15-plus")  # AltDiffusion passes hidden states, as Safe does
    config = RobertaSeriesConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        project_dim=sd.unet.config.cross_attention_dim,
        max_position_embeddings=80,  # RoBERTa numbers positions from pad_token_id + 1
    )
    with _seeded(zoo.seed, "zoo/alt_text_encoder"):
        text_encoder = RobertaSeriesModelWithTransformation(config).eval()
    pipe = _cls(name).from_pipe(sd, text_encoder=text_encoder, tokenizer=clip_tokenizer())
    extra = {"image": _image(), "strength": 1.0} if "Img2Img" in name else {}
    notes = "XLM-R tokenizer stand-in: the offline CLIP tokenizer; IP-Adapter Plus and one reference image"
    return ZooEntry(pipe, _with([CFG, NO_CFG], **extra), notes, images="single")


@builds("LatentConsistencyModelPipeline", "LatentConsistencyModelImg2ImgPipeline")
def _lcm(zoo: ZooBases, name: str) -> ZooEntry:
    components = tiny_components("sd15", zoo.seed)
    unet = _unet("sd15", zoo.seed, time_cond_proj_dim=32)  # LCM embeds its guidance scale
    scheduler = diffusers.LCMScheduler.from_config(components["scheduler"].config)
    pipe = _load_adapter(_cls(name)(**{**components, "unet": unet, "scheduler": scheduler}), zoo.seed)
    extra = {"image": _image(), "strength": 1.0} if "Img2Img" in name else {}
    notes = "UNet with a guidance embedding (time_cond_proj_dim); LCM has no CFG batch"
    return ZooEntry(pipe, [Run("lcm", extra, ("cond",))], notes)


@builds("PIAPipeline")
def _pia(zoo: ZooBases, name: str) -> ZooEntry:
    components = tiny_components("sd15", zoo.seed)
    components.pop("safety_checker")
    components.pop("requires_safety_checker")
    unet = _load_adapter(
        diffusers.StableDiffusionPipeline(
            **{**tiny_components("sd15", zoo.seed), "unet": _unet("sd15", zoo.seed, in_channels=9)}
        ),
        zoo.seed,
    ).unet
    pipe = _cls(name)(**{**components, "unet": unet, "motion_adapter": _motion_adapter(zoo.seed)})
    runs = _with([CFG], image=_image(), num_frames=_FRAMES)
    return ZooEntry(pipe, runs, "UNet with 9 input channels (latents + mask + image latents)")


# --------------------------------------------------------------------------- AnimateDiff


@builds("AnimateDiffPipeline")
def _animatediff(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base("sd15"), motion_adapter=_motion_adapter(zoo.seed))
    runs = _with([CFG, NO_CFG], num_frames=_FRAMES)
    return ZooEntry(pipe, runs, "2 frames")


@builds("AnimateDiffVideoToVideoPipeline")
def _animatediff_v2v(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base("sd15"), motion_adapter=_motion_adapter(zoo.seed))
    return ZooEntry(pipe, _with([CFG, NO_CFG], video=_frames(), strength=1.0), "2 frames")


@builds("AnimateDiffControlNetPipeline", "AnimateDiffVideoToVideoControlNetPipeline")
def _animatediff_controlnet(zoo: ZooBases, name: str) -> ZooEntry:
    sd = zoo.base("sd15")
    controlnet = _controlnet("sd15", zoo.seed)
    pipe = _cls(name).from_pipe(sd, motion_adapter=_motion_adapter(zoo.seed), controlnet=controlnet)
    extra = {"conditioning_frames": _frames()}
    extra.update({"video": _frames(), "strength": 1.0} if "VideoToVideo" in name else {"num_frames": _FRAMES})
    return ZooEntry(pipe, _with([CFG, NO_CFG], **extra), "2 frames")


@builds("AnimateDiffSparseControlNetPipeline")
def _animatediff_sparse(zoo: ZooBases, name: str) -> ZooEntry:
    sd = zoo.base("sd15")
    with _seeded(zoo.seed, "zoo/sparse_controlnet"):
        controlnet = diffusers.SparseControlNetModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            in_channels=4,
            conditioning_channels=3,
            down_block_types=("CrossAttnDownBlockMotion", "CrossAttnDownBlockMotion"),
            cross_attention_dim=sd.unet.config.cross_attention_dim,
            attention_head_dim=2,
            conditioning_embedding_out_channels=(8, 8, 8, 8),  # 8x down to the latents
            norm_num_groups=32,
            use_simplified_condition_embedding=False,
        ).eval()
    pipe = _cls(name).from_pipe(sd, motion_adapter=_motion_adapter(zoo.seed), controlnet=controlnet)
    extra = {"conditioning_frames": [_image()], "controlnet_frame_indices": [0], "num_frames": _FRAMES}
    return ZooEntry(pipe, _with([CFG, NO_CFG], **extra), "2 frames, one sparse control frame")


@builds("AnimateDiffPAGPipeline")
def _animatediff_pag(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base("sd15"), motion_adapter=_motion_adapter(zoo.seed), pag_applied_layers=["mid"])
    runs = _with([_PAG, _PAG_NO_CFG], num_frames=3)
    return ZooEntry(pipe, runs, "3 frames: each of uncond, cond, perturbed repeated per frame")


@builds("AnimateDiffSDXLPipeline")
def _animatediff_sdxl(zoo: ZooBases, name: str) -> ZooEntry:
    adapter = _motion_adapter(zoo.seed, use_motion_mid_block=False)
    pipe = _cls(name).from_pipe(zoo.base("sdxl"), motion_adapter=adapter)
    return ZooEntry(pipe, _with([CFG, NO_CFG], num_frames=_FRAMES), "2 frames")


# --------------------------------------------------------------------------- SDXL


@builds(
    "StableDiffusionXLControlNetUnionPipeline",
    "StableDiffusionXLControlNetUnionImg2ImgPipeline",
    "StableDiffusionXLControlNetUnionInpaintPipeline",
)
def _sdxl_controlnet_union(zoo: ZooBases, name: str) -> ZooEntry:
    sdxl = zoo.base("sdxl")
    pipe = _cls(name).from_pipe(
        sdxl,
        controlnet=_controlnet(
            "sdxl",
            zoo.seed,
            diffusers.ControlNetUnionModel,
            num_trans_channel=32,  # the control-type transformer works at the first block's width
            num_trans_head=2,
            num_proj_channel=32,
        ),
    )
    extra = _image_inputs(name, control_image=[_image()], control_mode=[0])
    return ZooEntry(pipe, _with([CFG, NO_CFG], **extra))


@builds("StableDiffusionXLAdapterPipeline")
def _sdxl_t2i_adapter(zoo: ZooBases, name: str) -> ZooEntry:
    with _seeded(zoo.seed, "zoo/t2i_adapter"):
        adapter = diffusers.T2IAdapter(
            in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=8, adapter_type="full_adapter"
        ).eval()
    pipe = _cls(name).from_pipe(zoo.base("sdxl"), adapter=adapter)
    notes = "a `full_adapter` T2I-Adapter (features at the tiny UNet's two levels)"
    return ZooEntry(pipe, _with([CFG, NO_CFG], image=_image()), notes)


@builds("LEditsPPPipelineStableDiffusionXL")
def _ledits(zoo: ZooBases, name: str) -> ZooEntry:
    sdxl = tiny_pipeline("sdxl", seed=zoo.seed)  # its own UNet: the adapter is unloaded and loaded again
    scheduler = diffusers.DPMSolverMultistepScheduler.from_config(
        sdxl.scheduler.config, algorithm_type="sde-dpmsolver++"
    )
    pipe = _cls(name).from_pipe(sdxl, scheduler=scheduler)

    def invert(pipe: Any) -> None:
        # LEdits++ inverts without image embeddings, which a UNet with an IP-Adapter refuses: invert without it
        encoder, extractor = pipe.image_encoder, pipe.feature_extractor
        pipe.unload_ip_adapter()
        pipe.invert(image=_image(), num_inversion_steps=2, skip=0.0, generator=torch.Generator().manual_seed(0))
        pipe.register_modules(image_encoder=encoder, feature_extractor=extractor)
        _load_adapter(pipe, zoo.seed)

    runs = [Run("edit", {"editing_prompt": ["a flower"], "reverse_editing_direction": [False]}, ("uncond", "batch"))]
    notes = (
        "inverts a 64 x 64 image first, with the IP-Adapter unloaded (LEdits++ inverts without image embeddings); "
        "its `__call__` passes `ip_adapter_image` to its own VAE `encode_image`, so it cannot run with one"
    )
    return ZooEntry(pipe, runs, notes, images="single", prepare=invert)


# --------------------------------------------------------------------------- Kolors


class _ChatGLMTokenizerStandIn:
    """Kolors' tokenizer is ChatGLM's sentencepiece model; this stand-in tokenizes with the offline CLIP tokenizer
    and adds the ``position_ids`` ChatGLM reads."""

    def __init__(self) -> None:
        self.clip = clip_tokenizer()

    def __call__(self, text, padding="max_length", max_length=256, truncation=True, return_tensors="pt", **kwargs):
        encoded = self.clip(text, padding=padding, max_length=max_length, truncation=truncation, return_tensors="pt")
        positions = torch.arange(encoded.input_ids.shape[-1]).expand_as(encoded.input_ids)
        return BatchEncoding({**encoded, "position_ids": positions})


@builds("KolorsPipeline", "KolorsImg2ImgPipeline", "KolorsPAGPipeline")
def _kolors(zoo: ZooBases, name: str) -> ZooEntry:
    from diffusers.pipelines.kolors.text_encoder import ChatGLMConfig, ChatGLMModel

    components = tiny_components("sdxl", zoo.seed)
    config = ChatGLMConfig(
        num_layers=2,
        padded_vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=32,
        ffn_hidden_size=37,
        kv_channels=8,
        num_attention_heads=4,
        seq_length=256,
        multi_query_attention=True,
        multi_query_group_num=2,
        original_rope=True,
        use_cache=False,
    )
    with _seeded(zoo.seed, "zoo/chatglm"):
        text_encoder = ChatGLMModel(config, empty_init=False).eval()  # empty_init leaves weights uninitialised
        for module in text_encoder.modules():  # and ChatGLM's RMSNorm allocates its weight with torch.empty
            if type(module).__name__ == "RMSNorm":
                torch.nn.init.ones_(module.weight)
    # Kolors' UNet projects the ChatGLM states itself (encoder_hid_proj, "text_proj"); the pooled embedding (ChatGLM's
    # last state, 32 wide) has the width of the tiny SDXL's, so the added conditioning keeps its size
    unet = _unet("sdxl", zoo.seed, encoder_hid_dim=32, encoder_hid_dim_type="text_proj")
    parts = {k: components[k] for k in ("vae", "scheduler", "image_encoder", "feature_extractor")}
    pipe = _cls(name)(**parts, unet=unet, text_encoder=text_encoder, tokenizer=_ChatGLMTokenizerStandIn())
    _load_adapter(pipe, zoo.seed)
    if "PAG" in name:
        pipe = _cls(name).from_pipe(pipe, pag_applied_layers=["mid"])
        # diffusers' KolorsPAGPipeline iterates `ip_adapter_image_embeds` even when it is None (an image was given),
        # and hands the UNet the last adapter's tensor instead of the list (read as one image per item)
        notes = (
            "ChatGLM tokenizer stand-in; `ip_adapter_image` fails in diffusers' KolorsPAGPipeline: runs pass "
            "`ip_adapter_image_embeds` of one reference image"
        )
        return ZooEntry(pipe, [_PAG, _PAG_NO_CFG], notes, images="embeds", references=1)
    else:
        extra = {"image": _image(), "strength": 1.0} if "Img2Img" in name else {}
        runs = _with([CFG, NO_CFG], **extra)
    return ZooEntry(pipe, runs, "ChatGLM tokenizer stand-in (offline CLIP BPE with position_ids)")


# --------------------------------------------------------------------------- Flux and Chroma

_TRUE_CFG = Run("true cfg", {"negative_prompt": _NEGATIVE, "true_cfg_scale": 4.0}, ("uncond", "cond"))
_FLUX_NO_CFG = Run("no cfg", {}, ("cond",))
_DIT = {"max_sequence_length": 16, "output_type": "latent"}


@builds("FluxPipeline")
def _flux(zoo: ZooBases, name: str) -> ZooEntry:
    return ZooEntry(zoo.base("flux"), _with([_TRUE_CFG, _FLUX_NO_CFG], **_DIT))


@builds("FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline", "FluxKontextInpaintPipeline")
def _flux_image(zoo: ZooBases, name: str) -> ZooEntry:
    pipe = _cls(name).from_pipe(zoo.base("flux"))
    extra: dict[str, Any] = {"image": _image(), **_DIT}
    if "Kontext" not in name:
        extra["strength"] = 1.0
    if "Inpaint" in name:
        extra["mask_image"] = _mask()
    if "Kontext" in name:
        extra.update(height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False)
    return ZooEntry(pipe, _with([_TRUE_CFG, _FLUX_NO_CFG], **extra))


@builds("FluxControlNetPipeline")
def _flux_controlnet(zoo: ZooBases, name: str) -> ZooEntry:
    flux = zoo.base("flux")
    config = _config(flux.transformer, num_layers=1, num_single_layers=1)
    with _seeded(zoo.seed, "zoo/flux_controlnet"):
        controlnet = diffusers.FluxControlNetModel.from_config(config).eval()
    pipe = _cls(name).from_pipe(flux, controlnet=controlnet)
    return ZooEntry(pipe, _with([_TRUE_CFG, _FLUX_NO_CFG], control_image=_image(), **_DIT))


@builds("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline")
def _chroma(zoo: ZooBases, name: str) -> ZooEntry:
    flux = tiny_flux_components(zoo.seed)
    with _seeded(zoo.seed, "zoo/chroma"):
        transformer = diffusers.ChromaTransformer2DModel(
            patch_size=1,
            in_channels=flux["transformer"].config.in_channels,
            num_layers=2,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
            approximator_hidden_dim=32,
            approximator_layers=1,
            approximator_num_channels=16,
        ).eval()
    # ChromaInpaintPipeline reads `transformer.config.guidance_embeds`, which Chroma's transformer does not define
    transformer.register_to_config(guidance_embeds=False)
    parts = {k: flux[k] for k in ("scheduler", "vae", "image_encoder", "feature_extractor")}
    pipe = _cls(name)(
        **parts, transformer=transformer, text_encoder=flux["text_encoder_2"], tokenizer=flux["tokenizer_2"]
    )
    state = tiny_flux_ip_adapter_state_dict(transformer, pipe.image_encoder, seed=zoo.seed)
    with _seeded(zoo.seed, "zoo/chroma/load_ip_adapter"):
        pipe.load_ip_adapter([state], weight_name=[""], subfolder=[""])
    extra: dict[str, Any] = dict(_DIT)
    if "Img2Img" in name or "Inpaint" in name:
        extra.update(image=_image(), strength=1.0)
    if "Inpaint" in name:
        extra["mask_image"] = _mask()
    runs = [
        Run("cfg", {"negative_prompt": _NEGATIVE, "guidance_scale": 4.0, **extra}, ("uncond", "cond")),
        Run("no cfg", {"guidance_scale": 1.0, **extra}, ("cond",)),
    ]
    return ZooEntry(pipe, runs, "encode_prompt returns a 6-tuple, the negative embeddings at index 3")


# --------------------------------------------------------------------------- SD3

_SD3_CFG = Run("cfg", {"negative_prompt": _NEGATIVE, "guidance_scale": 5.0, **_DIT}, ("uncond", "cond"))
_SD3_NO_CFG = Run("no cfg", {"guidance_scale": 1.0, **_DIT}, ("cond",))


@builds("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline")
def _sd3(zoo: ZooBases, name: str) -> ZooEntry:
    sd3 = zoo.base("sd3")
    pipe = sd3 if name == "StableDiffusion3Pipeline" else _cls(name).from_pipe(sd3)
    extra = {} if name == "StableDiffusion3Pipeline" else {"image": _image(), "strength": 1.0}
    return ZooEntry(pipe, _with([_SD3_CFG, _SD3_NO_CFG], **extra), images="single")


@builds("StableDiffusion3InpaintPipeline")
def _sd3_inpaint(zoo: ZooBases, name: str) -> ZooEntry:
    from .dit import tiny_sd3_components, tiny_sd3_ip_adapter_state_dict

    components = tiny_sd3_components(zoo.seed)
    with _seeded(zoo.seed, "zoo/sd3_16"):  # SD3 inpainting takes 16 latent channels (or 33)
        transformer = diffusers.SD3Transformer2DModel.from_config(
            _config(components["transformer"], in_channels=16, out_channels=16)
        ).eval()
        vae = diffusers.AutoencoderKL.from_config(_config(components["vae"], latent_channels=16)).eval()
    pipe = _cls(name)(**{**components, "transformer": transformer, "vae": vae})
    state = tiny_sd3_ip_adapter_state_dict(transformer, pipe.image_encoder, zoo.seed)
    with _seeded(zoo.seed, "zoo/sd3_16/load_ip_adapter"):
        pipe.load_ip_adapter(state, low_cpu_mem_usage=False)
    runs = _with([_SD3_CFG, _SD3_NO_CFG], image=_image(), mask_image=_mask(), strength=1.0)
    return ZooEntry(pipe, runs, "transformer and VAE with 16 latent channels", images="single")


@builds("StableDiffusion3ControlNetPipeline", "StableDiffusion3ControlNetInpaintingPipeline")
def _sd3_controlnet(zoo: ZooBases, name: str) -> ZooEntry:
    sd3 = zoo.base("sd3")
    inpaint = "Inpaint" in name
    # from the config: `SD3ControlNetModel.from_transformer` writes into the transformer's own config; the
    # inpainting ControlNet reads the mask as one more channel
    config = _config(sd3.transformer, num_layers=1, extra_conditioning_channels=int(inpaint))
    with _seeded(zoo.seed, f"zoo/sd3_controlnet/{inpaint}"):
        controlnet = diffusers.SD3ControlNetModel.from_config(config).eval()
    pipe = _cls(name).from_pipe(sd3, controlnet=controlnet)
    extra: dict[str, Any] = {"control_image": _image()}
    if inpaint:
        extra["control_mask"] = _mask()
    return ZooEntry(pipe, _with([_SD3_CFG, _SD3_NO_CFG], **extra), images="single")
