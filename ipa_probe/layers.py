"""Which attention layers carry an IP-Adapter, and the contracts we keep with diffusers' processors.

diffusers stores IP-Adapter weights inside the attention *processor* (``to_k_ip``/``to_v_ip``), and its loaders find
those processors with ``isinstance``. So ipa_probe never replaces a user's processor class behind their back: the
probe only hooks modules the processor already calls, and the NW head swaps in a *subclass* sharing the same weights.

Layer ids are diffusers' ``attn_processors`` keys without ``.processor``, e.g.
``down_blocks.0.attentions.0.transformer_blocks.0.attn2``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from diffusers.models.attention_processor import (
    Attention,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    IPAdapterXFormersAttnProcessor,
)

from .kernels import dot_logits

__all__ = [
    "SUPPORTED_PROCESSORS",
    "IPLayer",
    "LayerSelection",
    "claim",
    "denoiser_of",
    "find_ip_layers",
    "image_branch_logits",
    "release",
]

#: Processor classes (and their subclasses) whose image branch ipa_probe understands.
SUPPORTED_PROCESSORS: tuple[type, ...] = (IPAdapterAttnProcessor2_0, IPAdapterAttnProcessor)

#: Image-prompt processors we recognise but cannot probe (yet), with the reason given to the user.
_UNSUPPORTED_REASONS: dict[str, str] = {
    IPAdapterXFormersAttnProcessor.__name__: "xformers computes the image branch inside one fused call; "
    "switch back with `pipe.unet.set_attn_processor(AttnProcessor2_0())` before `load_ip_adapter`, or call "
    "`pipe.disable_xformers_memory_efficient_attention()`",
}

LayerSelection = str | re.Pattern | Iterable[str] | None

_CLAIM_ATTRIBUTE = "_ipa_probe_claims"


def _supported_names() -> str:
    return ", ".join(cls.__name__ for cls in SUPPORTED_PROCESSORS)


@dataclass(frozen=True)
class IPLayer:
    """One IP-Adapter cross-attention layer.

    Attributes:
        name: the layer id (``attn_processors`` key without ``.processor``).
        attention: the diffusers ``Attention`` module that owns the processor.
        processor: the processor installed when the layer was found.
    """

    name: str
    attention: Attention
    processor: torch.nn.Module

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def num_adapters(self) -> int:
        return len(self.processor.to_k_ip)


def denoiser_of(pipe) -> torch.nn.Module:
    """The denoising network of a diffusers pipeline (``pipe.unet``), or the module itself if one is passed."""
    if isinstance(pipe, torch.nn.Module):
        return pipe
    unet = getattr(pipe, "unet", None)
    if isinstance(unet, torch.nn.Module):
        return unet
    raise TypeError(
        f"expected a diffusers Stable Diffusion / SDXL pipeline with a `unet`, got {type(pipe).__name__}; "
        "pass a pipeline such as StableDiffusionPipeline (see ipa_probe.pipelines.tiny_pipeline for a small one)"
    )


def _compile_selection(layers: LayerSelection) -> list[re.Pattern] | None:
    if layers is None:
        return None
    if isinstance(layers, str | re.Pattern):
        layers = [layers]
    patterns = []
    for item in layers:
        if isinstance(item, re.Pattern):
            patterns.append(item)
        elif isinstance(item, str):
            try:
                patterns.append(re.compile(item))
            except re.error as err:
                raise ValueError(f"layers: {item!r} is not a valid regular expression ({err})") from None
        else:
            raise TypeError(f"layers: expected a regex string, a compiled pattern or a list of them, got {item!r}")
    return patterns


def find_ip_layers(pipe, layers: LayerSelection = None) -> list[IPLayer]:
    """Find the IP-Adapter cross-attention layers of a pipeline (or denoiser), optionally selected by regex.

    Nothing is modified. Errors name the remedy.

    Args:
        pipe: a diffusers pipeline with a ``unet``, or the denoiser module itself.
        layers: ``None`` for all IP layers; a regex (``re.search`` on the layer id) or a list of them (union).

    Returns:
        the selected layers in module order.

    Raises:
        ValueError: no IP-Adapter is loaded, a processor class is not supported, or the selection matches nothing.
    """
    denoiser = denoiser_of(pipe)
    patterns = _compile_selection(layers)
    found: list[IPLayer] = []
    for name, module in denoiser.named_modules():
        if not isinstance(module, Attention):
            continue
        processor = module.processor
        if isinstance(processor, SUPPORTED_PROCESSORS):
            found.append(IPLayer(name, module, processor))
        elif hasattr(processor, "to_k_ip") or type(processor).__name__ in _UNSUPPORTED_REASONS:
            cls = type(processor).__name__
            reason = _UNSUPPORTED_REASONS.get(cls, "its image branch is not one ipa_probe knows how to read")
            raise ValueError(
                f"layer {name!r} uses the unsupported processor class {cls}: {reason}. "
                f"Supported processor classes: {_supported_names()}."
            )
    if not found:
        raise ValueError(
            "this pipeline has no IP-Adapter loaded (no attention layer uses an IP-Adapter processor); call "
            "`pipe.load_ip_adapter(...)` first (ipa_probe.pipelines.tiny_pipeline() gives a small pipeline with one). "
            f"Supported processor classes: {_supported_names()}."
        )
    if patterns is None:
        return found
    selected = [layer for layer in found if any(p.search(layer.name) for p in patterns)]
    if not selected:
        shown = ", ".join(layer.name for layer in found[:4])
        raise ValueError(
            f"layers={[p.pattern for p in patterns]} matched none of the {len(found)} IP-Adapter layers "
            f"(e.g. {shown}); pass a regex that `re.search` finds in one of these ids, or None for all"
        )
    return selected


def image_branch_logits(processor: torch.nn.Module, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The logits whose softmax over image tokens a processor actually uses in its image branch.

    diffusers' IP-Adapter processors use scaled dot-product attention, ``q k^T / sqrt(d_head)``. A processor may
    declare otherwise by defining ``image_branch_logits(query, key)`` (ipa_probe's NW head does).

    Args:
        processor: the layer's processor.
        query: ``(B, H, Q, D)``.
        key: image-token keys ``(B, H, K, D)``.

    Returns:
        logits ``(B, H, Q, K)``.
    """
    custom = getattr(processor, "image_branch_logits", None)
    if custom is not None:
        return custom(query, key)
    return dot_logits(query, key, 1.0 / math.sqrt(query.shape[-1]))


def claim(pipe, feature: str) -> torch.nn.Module:
    """Mark a pipeline's denoiser as being modified by ``feature`` (e.g. ``"probe"``); raise if it already is.

    Returns:
        the denoiser.
    """
    denoiser = denoiser_of(pipe)
    claims = denoiser.__dict__.get(_CLAIM_ATTRIBUTE, ())
    if feature in claims:
        raise RuntimeError(
            f"ipa_probe.{feature} is already active on this pipeline; leave the running "
            f"`with ipa_probe.{feature}(...)` block (or remove it) before applying it again"
        )
    denoiser.__dict__[_CLAIM_ATTRIBUTE] = (*claims, feature)
    return denoiser


def release(pipe, feature: str) -> None:
    """Undo :func:`claim`; the denoiser is left without any ipa_probe attribute once nothing claims it."""
    denoiser = denoiser_of(pipe)
    claims = tuple(c for c in denoiser.__dict__.get(_CLAIM_ATTRIBUTE, ()) if c != feature)
    if claims:
        denoiser.__dict__[_CLAIM_ATTRIBUTE] = claims
    else:
        denoiser.__dict__.pop(_CLAIM_ATTRIBUTE, None)
