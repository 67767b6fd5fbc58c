"""Shared by the benchmarks: a pipeline whose UNet has Stable Diffusion 1.5's architecture, and its call inputs.

The UNet (block_out_channels (320, 640, 1280, 1280), cross-attention dim 768, 8 heads, 16 IP-Adapter layers) has
random weights; the other components are the embedded tiny ones, and prompts and image prompts go in as embeddings,
so nothing is downloaded.
"""

from __future__ import annotations

import time

import torch


def sd15_pipeline(device: str, dtype: torch.dtype, seed: int = 0, narrow: int = 1):
    """A StableDiffusionPipeline whose UNet has SD 1.5's architecture (random weights) and one IP-Adapter;
    ``narrow=8`` divides its channel widths by 8 (the same layers, heads and tokens: the same operations, cheaper)."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from ipa_probe.tiny.sd import tiny_components, tiny_ip_adapter_state_dict

    components = tiny_components("sd15", seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        components["unet"] = UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            block_out_channels=tuple(width // narrow for width in (320, 640, 1280, 1280)),
            layers_per_block=2,
            norm_num_groups=32 // narrow,
            cross_attention_dim=768,
            attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        ).eval()
    pipe = StableDiffusionPipeline(**components)
    state = tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, "base", seed)
    pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def call_inputs(pipe, latent: int, steps: int, n_images: int, device: str, dtype: torch.dtype) -> dict:
    """Keyword arguments of one CFG pipeline call from random prompt and image embeddings (seeded)."""
    g = torch.Generator().manual_seed(1)
    embed_dim = pipe.image_encoder.config.projection_dim
    prompt = torch.randn(1, 77, 768, generator=g)
    image_embeds = torch.randn(2, n_images, embed_dim, generator=g)  # [negative, positive] for CFG
    return {
        "prompt_embeds": prompt.to(device, dtype),
        "negative_prompt_embeds": torch.zeros_like(prompt).to(device, dtype),
        "ip_adapter_image_embeds": [image_embeds.to(device, dtype)],
        "num_inference_steps": steps,
        "height": latent * 8,
        "width": latent * 8,
        "output_type": "latent",
        "guidance_scale": 7.5,
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Wall time of ``fn()`` in seconds, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start
