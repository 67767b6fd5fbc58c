"""SD3 transformers: ``SD3IPAdapterJointAttnProcessor2_0`` in the joint blocks."""

from __future__ import annotations

import math

import torch

from ...layers import IPLayer, denoiser_of
from .base import DenoiserPass, Tap


class SD3Tap(Tap):
    """SD3 joint blocks: ``q = processor.norm_q(to_q(h))``, latent keys ``processor.norm_k(to_k(h))``, image keys
    ``processor.norm_ip_k(to_k_ip(norm_ip(c_ip, temb)))``, all ``(B, H, N, D)``; one joint softmax over latent and
    image keys. CFG concatenated ``[uncond, cond]``."""

    family = "sd3"
    ARGUMENTS = {
        "hidden_states": 0,
        "encoder_hidden_states": 1,
        "pooled_projections": 2,
        "timestep": 3,
        "skip_layers": 7,
    }

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        if self.argument("skip_layers", args, kwargs) is not None:
            # skip-layer guidance: an extra conditional pass of the same step with some blocks skipped
            return DenoiserPass(new_step=False, record=False)
        return DenoiserPass(new_step=True)

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        sample = self.sample(args, kwargs)  # (B, C, H, W)
        denoiser = denoiser_of(self.pipe)
        patch = getattr(getattr(denoiser, "config", None), "patch_size", 2)
        queries = math.ceil(sample.shape[-2] / patch) * math.ceil(sample.shape[-1] / patch)
        latents = getattr(getattr(denoiser, "image_proj", None), "latents", None)
        tokens = latents.shape[1] if isinstance(latents, torch.Tensor) else 64
        return sample.shape[0] * queries * tokens
