"""Flux transformers: ``FluxIPAdapterAttnProcessor`` in the double-stream blocks."""

from __future__ import annotations

import torch

from ...layers import IPLayer, denoiser_of
from .base import DenoiserPass, Tap


class FluxTap(Tap):
    """Flux double-stream blocks: ``q = attn.norm_q(to_q(h))`` per head, before RoPE; ``k = to_k_ip[a](c_ip)`` (with
    bias, no norm). True CFG runs the prompt, then the negative prompt, as separate passes of the same step (a pass
    whose ``hidden_states`` is the very tensor of the previous pass belongs to the same step)."""

    family = "flux"
    ARGUMENTS = {"hidden_states": 0, "encoder_hidden_states": 1, "pooled_projections": 2, "timestep": 3}

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        super().__init__(pipe, layers)
        self._last_input: torch.Tensor | None = None

    def begin_call(self, args: tuple, kwargs: dict) -> None:
        self.reset()

    def reset(self) -> None:
        self._last_input = None

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        hidden = self.sample(args, kwargs)
        same_step = self._last_input is not None and hidden is self._last_input
        self._last_input = hidden
        return DenoiserPass(new_step=not same_step)

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor | float | None:
        # The transformer gets t / 1000; the pipeline keeps t itself (exact) as `current_timestep`.
        current = getattr(self.running, "current_timestep", None)
        if isinstance(current, torch.Tensor | float | int):
            return current
        timestep = self.argument("timestep", args, kwargs)
        return timestep * 1000 if timestep is not None else None

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        sample = self.sample(args, kwargs)  # (B, N, C) packed latent tokens
        embeds = (kwargs.get("joint_attention_kwargs") or {}).get("ip_adapter_image_embeds") or []
        projections = getattr(getattr(denoiser_of(self.pipe), "encoder_hid_proj", None), "image_projection_layers", [])
        total = 0
        for adapter in range(layer.num_adapters):
            images = embeds[adapter].shape[1] if adapter < len(embeds) and embeds[adapter].ndim == 3 else 1
            tokens = getattr(projections[adapter], "num_image_text_embeds", 4) if adapter < len(projections) else 4
            total += sample.shape[0] * sample.shape[1] * images * tokens
        return 2 * total  # true CFG may add an unconditional pass per step
