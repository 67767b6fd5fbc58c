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

CFG layout: SD/SDXL and SD3 concatenate ``[uncond, cond]`` in one denoiser call (when the pipeline's
``do_classifier_free_guidance`` is true). Flux runs *true CFG* as separate denoiser passes (``"cond"`` first, then
``"uncond"``, under ``transformer.cache_context``); a pass whose ``hidden_states`` is the very tensor of the previous
pass belongs to the same step. SD3's skip-layer-guidance pass (``skip_layers=...``) is not recorded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..kernels import split_heads
from ..layers import IPLayer, denoiser_of, observer

__all__ = ["Capture", "DenoiserPass", "FluxTap", "SD3Tap", "Tap", "UNetTap", "tap_for"]

Handle = torch.utils.hooks.RemovableHandle
RecordFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None], None]


@dataclass
class Capture:
    """What a tap's hooks talk to.

    Attributes:
        record: ``record(layer_index, slot, query, keys, other_keys)`` with ``query`` ``(B, H, Q, D)``, ``keys``
            ``(B, H, K, D)`` (the image tokens of adapter ``slot``, or the text tokens in the text slot) and
            ``other_keys`` ``(B, H, N, D)``, the further keys the same softmax runs over (SD3's latent keys), or
            ``None``.
        recording: whether the current denoiser pass is recorded (set by the probe's step clock).
        stash: per-layer tensors waiting for their partner (a query waiting for its keys), cleared after each layer.
    """

    record: RecordFn
    recording: bool = False
    stash: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class DenoiserPass:
    """How one denoiser call fits the denoising loop.

    Attributes:
        new_step: whether it starts a new denoising step (the first pass of a step).
        branch: the index (into :meth:`Tap.branches`) of the CFG branch the whole batch belongs to, or ``None`` when
            the batch holds every branch, concatenated in :meth:`Tap.branches` order.
        record: ``False`` for passes the probe must not record (e.g. SD3's skip-layer-guidance pass).
    """

    new_step: bool
    branch: int | None = None
    record: bool = True


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


class Tap:
    """The per-family knowledge the probe needs. One instance per probe run (it may keep per-call state).

    Args:
        pipe: the pipeline (read for its CFG setting, scheduler and components).
        layers: the IP-Adapter layers to read, all of this tap's family.
    """

    family: ClassVar[str] = ""
    #: Whether :meth:`install` can read the text cross-attention (``branch="text"``).
    supports_text: ClassVar[bool] = False

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        self.pipe = pipe
        self.layers = layers

    # ------------------------------------------------------------------ the step clock
    def branches(self) -> tuple[str, ...]:
        """The CFG branch names of a pipeline call starting now, in buffer order."""
        cfg = bool(getattr(self.pipe, "do_classifier_free_guidance", False))
        return ("uncond", "cond") if cfg else ("cond",)

    def begin_call(self, args: tuple, kwargs: dict, branches: tuple[str, ...]) -> torch.Tensor | None:
        """A new pipeline call starts with this denoiser call. Returns the text keys' mask ``(B, tokens)`` (bool,
        ``True`` for real prompt tokens) when the tap reads the text branch, else ``None``."""
        return None

    def reset(self) -> None:
        """Forget per-call state (called when the probe ends, so that no tensor outlives the run)."""

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        """Place a denoiser call in the loop (default: every call is a step holding every branch)."""
        return DenoiserPass(new_step=True)

    def sample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The latent input of a denoiser call (its device and batch size are used)."""
        raise NotImplementedError

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor | float | None:
        """The scheduler timestep of a denoiser call, on the scheduler's scale (0-1000 for all families here)."""
        return _argument(args, kwargs, 1, "timestep")

    # ------------------------------------------------------------------ taps
    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Handle]:
        """Register the hooks that deliver ``(q, k)`` pairs to ``capture.record``; return their handles."""
        raise NotImplementedError

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        """Elements per head of the image-branch weights of ``layer`` in one recorded step (all adapters)."""
        raise NotImplementedError

    def _forget(self, capture: Capture, index: int) -> Callable:
        """Forward hook on the attention module: drop what the layer left in the stash."""

        def hook(module, args, output):
            for key in [key for key in capture.stash if key[0] == index]:
                del capture.stash[key]

        return hook

    @staticmethod
    def _keep(capture: Capture, index: int, name: str, transform: Callable | None = None) -> Callable:
        """Forward hook: stash the module's output under ``(index, name)`` while recording."""

        def hook(module, args, output):
            if capture.recording:
                capture.stash[(index, name)] = output if transform is None else transform(output)

        return hook


# ---------------------------------------------------------------------------------------------------------------------
# SD 1.5 / SDXL
# ---------------------------------------------------------------------------------------------------------------------


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
    supports_text = True

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        super().__init__(pipe, layers)
        self._pending_token_masks: list[torch.Tensor] = []

    def sample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return _argument(args, kwargs, 0, "sample")

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
                capture.record(index, slot, split_heads(query, heads), split_heads(output, heads), None)

        return hook

    def reset(self) -> None:
        self._pending_token_masks = []

    # ------------------------------------------------------------------ the text branch's padding mask
    def _on_text_encoder_call(self, module, args, kwargs) -> None:
        """Remember which prompt tokens are real: up to and including the first end-of-text token."""
        ids = _argument(args, kwargs, 0, "input_ids")
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
        context = _argument(args, kwargs, 2, "encoder_hidden_states")
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


# ---------------------------------------------------------------------------------------------------------------------
# Flux
# ---------------------------------------------------------------------------------------------------------------------


class FluxTap(Tap):
    """Flux double-stream blocks: ``q = attn.norm_q(to_q(h))`` per head, before RoPE; ``k = to_k_ip[a](c_ip)`` (with
    bias, no norm). True CFG runs ``"cond"`` then ``"uncond"`` as separate passes of the same step."""

    family = "flux"

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        super().__init__(pipe, layers)
        self._last_input: torch.Tensor | None = None
        self._pass = 0

    def branches(self) -> tuple[str, ...]:
        # Whether a second (unconditional) pass follows is only known once it runs; cells it never fills are left
        # out of the table.
        return ("cond", "uncond")

    def begin_call(self, args: tuple, kwargs: dict, branches: tuple[str, ...]) -> None:
        self.reset()
        return None

    def reset(self) -> None:
        self._last_input, self._pass = None, 0

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        hidden = self.sample(args, kwargs)
        same_step = self._last_input is not None and hidden is self._last_input
        self._pass = self._pass + 1 if same_step else 0
        self._last_input = hidden
        branch = self._pass if self._pass < 2 else None
        return DenoiserPass(new_step=not same_step, branch=branch, record=branch is not None)

    def sample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return _argument(args, kwargs, 0, "hidden_states")

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor | float | None:
        # The transformer gets t / 1000; the pipeline keeps t itself (exact) as `current_timestep`.
        current = getattr(self.pipe, "current_timestep", None)
        if isinstance(current, torch.Tensor | float | int):
            return current
        timestep = _argument(args, kwargs, 3, "timestep")
        return timestep * 1000 if timestep is not None else None

    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Handle]:
        handles: list[Handle] = []
        for index, layer in enumerate(self.layers):
            attn = layer.attention
            # (B, N, H, D) -> (B, H, N, D)
            query_hook = self._keep(capture, index, "q", lambda q: q.transpose(1, 2))
            handles.append(attn.norm_q.register_forward_hook(observer(query_hook)))
            handles.append(attn.register_forward_hook(observer(self._forget(capture, index))))
            for adapter, to_k_ip in enumerate(layer.processor.to_k_ip):
                handles.append(to_k_ip.register_forward_hook(observer(self._keys(capture, index, adapter, layer))))
        return handles

    @staticmethod
    def _keys(capture: Capture, index: int, adapter: int, layer: IPLayer) -> Callable:
        def hook(module, args, output):
            query = capture.stash.get((index, "q"))
            if query is not None:
                capture.record(index, adapter, query, split_heads(output, layer.heads), None)

        return hook

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


# ---------------------------------------------------------------------------------------------------------------------
# SD3
# ---------------------------------------------------------------------------------------------------------------------


class SD3Tap(Tap):
    """SD3 joint blocks: ``q = processor.norm_q(to_q(h))``, latent keys ``processor.norm_k(to_k(h))``, image keys
    ``processor.norm_ip_k(to_k_ip(norm_ip(c_ip, temb)))``, all ``(B, H, N, D)``; one joint softmax over latent and
    image keys. CFG concatenated ``[uncond, cond]``."""

    family = "sd3"

    def sample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return _argument(args, kwargs, 0, "hidden_states")

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor | float | None:
        return _argument(args, kwargs, 3, "timestep")

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        if _argument(args, kwargs, 7, "skip_layers") is not None:
            # skip-layer guidance: an extra conditional pass of the same step with some blocks skipped
            return DenoiserPass(new_step=False, record=False)
        return DenoiserPass(new_step=True)

    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Handle]:
        handles: list[Handle] = []
        for index, layer in enumerate(self.layers):
            processor = layer.processor
            handles.append(processor.norm_q.register_forward_hook(observer(self._keep(capture, index, "q"))))
            handles.append(processor.norm_k.register_forward_hook(observer(self._keep(capture, index, "k"))))
            handles.append(processor.norm_ip_k.register_forward_hook(observer(self._keys(capture, index))))
            handles.append(layer.attention.register_forward_hook(observer(self._forget(capture, index))))
        return handles

    @staticmethod
    def _keys(capture: Capture, index: int) -> Callable:
        def hook(module, args, output):
            query = capture.stash.get((index, "q"))
            if query is not None:
                capture.record(index, 0, query, output, capture.stash.get((index, "k")))

        return hook

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        sample = self.sample(args, kwargs)  # (B, C, H, W)
        denoiser = denoiser_of(self.pipe)
        patch = getattr(getattr(denoiser, "config", None), "patch_size", 2)
        queries = math.ceil(sample.shape[-2] / patch) * math.ceil(sample.shape[-1] / patch)
        latents = getattr(getattr(denoiser, "image_proj", None), "latents", None)
        tokens = latents.shape[1] if isinstance(latents, torch.Tensor) else 64
        return sample.shape[0] * queries * tokens


_TAPS: dict[str, type[Tap]] = {tap.family: tap for tap in (UNetTap, FluxTap, SD3Tap)}


def tap_for(pipe, layers: list[IPLayer]) -> Tap:
    """The tap for a pipeline's IP-Adapter layers (found by :func:`ipa_probe.layers.find_ip_layers`).

    Raises:
        ValueError: the layers are of no single known family.
    """
    families = {layer.family for layer in layers}
    if len(families) != 1:
        raise ValueError(f"expected IP-Adapter layers of one model family, got {sorted(families)}")
    return _TAPS[families.pop()](pipe, layers)
