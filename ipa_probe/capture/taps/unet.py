"""SD 1.5 / SDXL UNets: ``IPAdapterAttnProcessor2_0`` in the cross-attention layers (``attn2``)."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch
from diffusers.image_processor import IPAdapterMaskProcessor

from ...layers import IPLayer, denoiser_of, observer
from .base import Capture, DenoiserPass, Tap


def unet_resolution_factor(denoiser: torch.nn.Module, layer_name: str) -> int:
    """Downsampling factor of a UNet layer's feature map relative to the latent."""
    levels = len(getattr(denoiser, "down_blocks", ())) or 1
    match = re.search(r"(down|up)_blocks\.(\d+)\.", layer_name)
    if match:
        index = int(match.group(2))
        return 2 ** (index if match.group(1) == "down" else levels - 1 - index)
    return 2 ** (levels - 1)


class UNetTap(Tap):
    """SD 1.5 / SDXL cross-attention: ``q = attn.to_q(h)``, ``k = processor.to_k_ip[a](c_ip)``, text keys
    ``attn.to_k(c_text)``; a denoiser call's batch is the CFG branches concatenated (see
    :mod:`~ipa_probe.capture.branches`).

    Steps: a call whose ``timestep`` is the very tensor of the previous call belongs to the same step (the loop's
    ``t``): a panorama's views (``StableDiffusionPanoramaPipeline``) are passes of one step, and so is the pass of
    self-attention guidance on degraded latents (``StableDiffusionSAGPipeline``), labelled ``"sag"``. A loop that
    repeats a timestep value (Heun's second-order steps) passes a new tensor each iteration: new steps.
    """

    family = "unet"
    ARGUMENTS = {"sample": 0, "timestep": 1, "encoder_hidden_states": 2}
    SAMPLE = "sample"
    supports_text = True

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        super().__init__(pipe, layers)
        self._pending_token_masks: list[torch.Tensor] = []
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        self._last_timestep: torch.Tensor | None = None  # held, so that its id cannot be reused by another tensor

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        timestep = self.timestep(args, kwargs)
        same_step = isinstance(timestep, torch.Tensor) and timestep is self._last_timestep
        self._last_timestep = timestep if isinstance(timestep, torch.Tensor) else None
        if same_step and callable(getattr(self.running, "sag_masking", None)):
            # self-attention guidance: after the step's pass, one more on latents degraded where the model attends
            return DenoiserPass(new_step=False, label="sag")
        return DenoiserPass(new_step=not same_step)

    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Any]:
        handles = super().install(capture, images, text_slot)
        if text_slot is not None:
            candidates = (getattr(self.pipe, "text_encoder", None), getattr(self.pipe, "text_encoder_2", None))
            encoder = next((m for m in candidates if m is not None), None)
            if encoder is not None:
                hook = observer(self._on_text_encoder_call)
                handles.append(encoder.register_forward_pre_hook(hook, with_kwargs=True))
        return handles

    def _rows(self, capture: Capture, index: int, adapter: int, query: torch.Tensor) -> torch.Tensor | None:
        """With masks, diffusers calls ``to_k_ip[adapter]`` once per reference image, in order, and gives each image
        its own softmax; the rows are then the queries inside that image's mask."""
        masks, seen = capture.spine.now.masks, capture.spine.hooks.seen
        mask = masks[adapter] if masks is not None and adapter < len(masks) else None
        if mask is None:
            return None
        key = self._held(capture, index, f"image{adapter}")  # dropped when the layer is called again
        image = seen[key] = seen.get(key, -1) + 1
        return self._mask_rows(mask, image, query.shape[0], query.shape[2], query.device)

    def _mask_rows(
        self, mask: torch.Tensor, image: int, batch: int, queries: int, device: torch.device
    ) -> torch.Tensor:
        """The queries ``(B, Q)`` an image's mask lets its branch output through, by diffusers' own downsampling
        (:meth:`IPAdapterMaskProcessor.downsample`, bicubic) to the layer's grid; kept for the call (one transfer per
        mask and grid, not one per step)."""
        key = (id(mask), image, batch, queries, device)
        rows = self._mask_cache.get(key)
        if rows is None:
            with warnings.catch_warnings():  # diffusers' aspect-ratio warning is the pipeline's to give, not ours
                warnings.simplefilter("ignore")
                weights = IPAdapterMaskProcessor.downsample(mask[:, image], batch, queries, 1)  # (B, Q, 1)
            rows = weights[..., 0].to(device) != 0
            self._mask_cache[key] = rows
        return rows

    def reset(self) -> None:
        self._pending_token_masks = []
        self._mask_cache = {}
        self._last_timestep = None

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self._mask_cache = {}
        self._last_timestep = None

    def on_encode(self) -> None:
        self._pending_token_masks = []

    # ------------------------------------------------------------------ the text branch's padding mask
    def _on_text_encoder_call(self, module, args, kwargs) -> None:
        """Remember which prompt tokens are real: up to and including the first end-of-text token."""
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return
        eos = getattr(getattr(module, "config", None), "eos_token_id", None)
        tokenizer = getattr(self.pipe, "tokenizer", None)
        eos = getattr(tokenizer, "eos_token_id", eos)
        if eos is None:
            return
        is_eos = ids == eos
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), ids.shape[-1] - 1)  # (B,)
        positions = torch.arange(ids.shape[-1], device=ids.device)
        self._pending_token_masks.append(positions[None, :] <= first[:, None])

    def text_mask(self, layout, context: torch.Tensor | None) -> torch.Tensor | None:
        """Token mask ``(B, tokens)`` of a pass's text keys, chunk by chunk: the prompt's tokens where the chunk
        matched the prompt, the negative prompt's where it matched that, all tokens elsewhere.

        The pipeline encodes the prompt first and the negative prompt second; a prompt not encoded here
        (``prompt_embeds`` passed in, or SDXL's zeroed empty negative prompt) keeps all its tokens.
        """
        if not isinstance(context, torch.Tensor):
            return None
        batch, tokens = context.shape[:2]
        per_chunk = batch // layout.chunks
        every = torch.ones(per_chunk, tokens, dtype=torch.bool, device=context.device)
        if layout.is_cond is None:
            return every.repeat(layout.chunks, 1)
        pending = self._pending_token_masks

        def source(i: int) -> torch.Tensor:
            mask = pending[i] if len(pending) > i else None
            if mask is None or mask.shape[-1] != tokens or per_chunk % mask.shape[0]:
                return every
            return mask.to(context.device).repeat_interleave(per_chunk // mask.shape[0], dim=0)

        cond, uncond = source(0), source(1)
        parts = [
            torch.where(is_cond, cond, torch.where(is_uncond, uncond, every))
            for is_cond, is_uncond in zip(layout.is_cond, layout.is_uncond, strict=True)
        ]
        return torch.cat(parts)

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        sample = self.sample(args, kwargs)
        height, width = sample.shape[-2:]
        factor = unet_resolution_factor(denoiser_of(self.pipe), layer.name)
        queries = math.ceil(height / factor) * math.ceil(width / factor)
        embeds = (kwargs.get("added_cond_kwargs") or {}).get("image_embeds") or []
        total = 0
        for adapter, tokens in enumerate(layer.processor.num_tokens):
            images = embeds[adapter].shape[1] if adapter < len(embeds) else 1
            total += sample.shape[0] * queries * images * tokens
        return total
