"""Where each model family forms its image-branch query and keys, and how it lays out classifier-free guidance.

The probe (:mod:`ipa_probe.capture.run`) is family-agnostic: it runs a step clock on the denoiser and turns ``(q, k)``
pairs into statistics. A *tap* knows one family: which modules to hook so that forward hooks see exactly the tensors
the IP-Adapter processor feeds its image-branch softmax, how to split them into heads, and how a denoiser call maps
to denoising steps and CFG branches. Hooks only observe (they return nothing), so the pipeline's output is
bit-identical with the probe on or off.

What "attention weights over the image tokens" means in each family (``d`` is the head width):

- **SD 1.5 / SDXL** (``IPAdapterAttnProcessor2_0``): the image branch is its own softmax,
  ``softmax_i(q·k_i / sqrt(d))`` with ``q = attn.to_q(h)`` (no norm) and ``k_i = to_k_ip[a](c_ip)_i``. Tap points:
  ``attn.to_q`` and ``processor.to_k_ip[a]`` (and ``attn.to_k`` for the text branch).
- **Flux** (``FluxIPAdapterAttnProcessor``, double-stream blocks): the image branch is its own softmax over the image
  tokens, with the query of the latent (image-stream) tokens taken *after* ``attn.norm_q`` (RMS norm per head) and
  *before* the rotary embedding, and keys ``to_k_ip[a](c_ip)`` (a Linear *with bias*, no norm, no RoPE). Tap points:
  ``attn.norm_q`` (output ``(B, N, H, D)``) and ``processor.to_k_ip[a]``.
- **SD3** (``SD3IPAdapterJointAttnProcessor2_0``, joint blocks): there is no separate image softmax. The image
  branch is one *joint* softmax over the latent tokens' keys and the image tokens' keys,
  ``softmax_j(q·k_j / sqrt(d))`` over ``j in [latent tokens; image tokens]``, with ``q = processor.norm_q(to_q(h))``,
  latent keys ``processor.norm_k(to_k(h))`` and image keys ``processor.norm_ip_k(to_k_ip(norm_ip(c_ip, temb)))``
  (the processor's own RMS norms, not the attention's). The probe reports the joint softmax *restricted to the image
  columns and renormalised*, which equals ``softmax_i(q·k_i / sqrt(d))`` over the image tokens alone (a softmax's
  restriction, renormalised, is the softmax of the restricted logits), and adds the column ``ip_mass``: the share
  of the joint softmax mass on the image tokens, ``sigmoid(LSE_i(l_i) - LSE_j(l_j))`` with ``i`` over image and
  ``j`` over latent columns, averaged over queries. Tap points: ``processor.norm_q``, ``processor.norm_k``,
  ``processor.norm_ip_k``.

Steps and branches: SD/SDXL and SD3 run one denoiser call per step with their CFG branches concatenated; a UNet
call whose ``timestep`` is the very tensor of the previous call belongs to the same step (a panorama's views, and
self-attention guidance's pass on degraded latents, recorded under the label ``"sag"``). Flux runs *true CFG* as
separate denoiser passes (the prompt first, then the negative prompt, under ``transformer.cache_context``), and a
pass whose ``hidden_states`` is the very tensor of the previous pass belongs to the same step. Which label each batch
item gets is decided from evidence, the same way for every family (:mod:`ipa_probe.capture.branches`). SD3's
skip-layer-guidance pass (``skip_layers=...``) is not recorded. Which pipeline call a pass belongs to is decided by
:mod:`ipa_probe.capture.clock`.
"""

from __future__ import annotations

from ...layers import IPLayer
from .base import Capture, DenoiserPass, Tap
from .flux import FluxTap
from .sd3 import SD3Tap
from .unet import UNetTap

__all__ = ["Capture", "DenoiserPass", "FluxTap", "SD3Tap", "Tap", "UNetTap", "tap_for", "tap_class"]

_TAPS: dict[str, type[Tap]] = {tap.family: tap for tap in (UNetTap, FluxTap, SD3Tap)}


def tap_class(family: str) -> type[Tap]:
    """The tap class of a model family (``"unet"``, ``"flux"`` or ``"sd3"``; see :data:`ipa_probe.layers.FAMILIES`).

    Its class methods answer questions about a family's denoiser call without a probe, e.g.
    ``tap_class("flux").argument("timestep", args, kwargs)``.
    """
    if family not in _TAPS:
        raise ValueError(f"expected a model family in {sorted(_TAPS)}, got {family!r}")
    return _TAPS[family]


def tap_for(pipe, layers: list[IPLayer]) -> Tap:
    """The tap for a pipeline's IP-Adapter layers (found by :func:`ipa_probe.layers.find_ip_layers`).

    Raises:
        ValueError: the layers are of no single known family.
    """
    families = {layer.family for layer in layers}
    if len(families) != 1:
        raise ValueError(f"expected IP-Adapter layers of one model family, got {sorted(families)}")
    return _TAPS[families.pop()](pipe, layers)
