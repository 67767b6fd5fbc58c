"""SD 1.5 / SDXL UNets: ``IPAdapterAttnProcessor2_0`` in the cross-attention layers (``attn2``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from ...layers import IPLayer, denoiser_of
from .base import Capture, Handle, Tap, heads_first, observer


def _unet_resolution_factor(denoiser: torch.nn.Module, layer_name: str) -> int:
    """Downsampling factor of a UNet layer's feature map relative to the latent."""
    levels = len(getattr(denoiser, "down_blocks", ())) or 1
    match = re.search(r"(down|up)_blocks\.(\d+)\.", layer_name)
    if match:
        index = int(match.group(2))
        return 2 ** (index if match.group(1) == "down" else levels - 1 - index)
    return 2 ** (levels - 1)


class UNetTap(Tap):
    """SD 1.5 / SDXL cross-attention: ``q = attn.to_q(h)``, ``k = processor.to_k_ip[a](c_ip)``, text keys
    ``attn.to_k(c_text)``; CFG concatenated ``[uncond, cond]``; every denoiser call is one step."""

    family = "unet"
    ARGUMENTS = {"sample": 0, "timestep": 1, "encoder_hidden_states": 2}
    SAMPLE = "sample"
    supports_text = True

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        super().__init__(pipe, layers)
        self._pending_token_masks: list[torch.Tensor] = []

    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Handle]:
        handles: list[Handle] = []
        if text_slot is not None:
            candidates = (getattr(self.pipe, "text_encoder", None), getattr(self.pipe, "text_encoder_2", None))
            encoder = next((m for m in candidates if m is not None), None)
            if encoder is not None:
                hook = observer(self._on_text_encoder_call)
                handles.append(encoder.register_forward_pre_hook(hook, with_kwargs=True))
        for index, layer in enumerate(self.layers):
            attn, heads = layer.attention, layer.heads
            handles.append(attn.to_q.register_forward_hook(observer(self._keep(capture, index, "q"))))
            handles.append(attn.register_forward_hook(observer(self._forget(capture, index))))
            if images:
                for adapter, to_k_ip in enumerate(layer.processor.to_k_ip):
                    hook = observer(self._keys(capture, index, adapter, heads))
                    handles.append(to_k_ip.register_forward_hook(hook))
            if text_slot is not None:
                hook = observer(self._keys(capture, index, text_slot, heads))
                handles.append(attn.to_k.register_forward_hook(hook))
        return handles

    @staticmethod
    def _keys(capture: Capture, index: int, slot: int, heads: int) -> Callable:
        def hook(module, args, output):
            query = capture.stash.get((index, "q"))
            if query is not None:
                capture.record(index, slot, heads_first(query, heads), heads_first(output, heads), None)

        return hook

    def reset(self) -> None:
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

    def begin_call(self, args: tuple, kwargs: dict, branches: tuple[str, ...]) -> torch.Tensor | None:
        """Token mask for this call's text keys, ``(B, tokens)``, in the pipeline's batch order (uncond, cond).

        The pipeline encodes the prompt first and the negative prompt second; a branch whose prompt was not encoded
        here (``prompt_embeds`` passed in, or SDXL's zeroed empty negative prompt) keeps all its tokens.
        """
        pending, self._pending_token_masks = self._pending_token_masks, []
        context = self.argument("encoder_hidden_states", args, kwargs)
        if not isinstance(context, torch.Tensor):
            return None
        batch, tokens = context.shape[:2]
        per_branch = batch // len(branches)
        sources = {"cond": pending[0] if pending else None, "uncond": pending[1] if len(pending) > 1 else None}
        parts = []
        for branch in branches:
            source = sources[branch]
            if source is None or source.shape[-1] != tokens or per_branch % source.shape[0]:
                parts.append(torch.ones(per_branch, tokens, dtype=torch.bool, device=context.device))
            else:
                parts.append(source.to(context.device).repeat_interleave(per_branch // source.shape[0], dim=0))
        return torch.cat(parts)

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        sample = self.sample(args, kwargs)
        height, width = sample.shape[-2:]
        factor = _unet_resolution_factor(denoiser_of(self.pipe), layer.name)
        queries = math.ceil(height / factor) * math.ceil(width / factor)
        embeds = (kwargs.get("added_cond_kwargs") or {}).get("image_embeds") or []
        total = 0
        for adapter, tokens in enumerate(layer.processor.num_tokens):
            images = embeds[adapter].shape[1] if adapter < len(embeds) else 1
            total += sample.shape[0] * queries * images * tokens
        return total
