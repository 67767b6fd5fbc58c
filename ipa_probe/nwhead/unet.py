"""The NW head: swap a pipeline's IP-Adapter image branch for an exact Gaussian Nadaraya–Watson kernel smoother.

In every selected IP-Adapter cross-attention layer the image branch's dot-product softmax

    softmax_i(q·k_i / sqrt(d_head)) v_i

is replaced by Gaussian NW weights over the same keys (paper §C.3):

    softmax_i(-|q - k_i|^2 / (2 h^2)) v_i = softmax_i(q·k_i / h^2 - |k_i|^2 / (2 h^2)) v_i,

i.e. the same scaled dot-product attention with temperature ``h^2`` and a per-key *key-norm bias*. It runs through
``F.scaled_dot_product_attention`` with that bias as a float mask, so no weight matrix is materialised. Values,
``scale``, masks and the text branch are untouched; with zero parameters of its own, this is the paper's frozen
baseline inside the very pipeline that the learned IP-Adapter runs in.

The swapped-in processor subclasses diffusers' ``IPAdapterAttnProcessor2_0`` and *shares* the original's
``to_k_ip``/``to_v_ip`` modules, ``scale`` list and ``num_tokens`` (no copies), so ``set_ip_adapter_scale`` and
``unload_ip_adapter`` keep working while it is installed, and probe hooks on ``to_k_ip`` still fire.

Example:
    ```py
    >>> with ipa_probe.nw_head(pipe, bandwidth="matched"):
    ...     image = pipe(prompt, ip_adapter_image=refs).images[0]
    ```
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

from ..kernels import check_bandwidth, key_norm_bias, matched_bandwidth, nw_logits
from ..layers import LayerSelection, claim, denoiser_of, find_ip_layers, release

__all__ = [
    "NWHeadAttnProcessor",
    "NWHeadConfig",
    "NWHeadSwap",
    "TimestepClock",
    "apply_nw_head",
    "nw_head",
    "remove_nw_head",
]

logger = logging.getLogger(__name__)

BandwidthSpec = str | float | Callable[[torch.Tensor], Any]

_FEATURE = "nw_head"
#: Where the active swap is kept on the denoiser (in its ``__dict__``, not as a module attribute).
_STATE_ATTRIBUTE = "_ipa_probe_nw_head"


def _check_bandwidth(bandwidth: Any) -> None:
    if bandwidth == "fit":
        raise ValueError(
            'bandwidth="fit" is a probe setting, not a head: run `ipa_probe.probe(pipe, bandwidth="fit")`, read '
            "the fitted h from its `bandwidth` column and pass that float (or a callable of the timestep) here"
        )
    check_bandwidth(bandwidth)


@dataclass(frozen=True)
class NWHeadConfig:
    """Settings of the NW-head swap, validated on construction (nothing about a pipeline is touched here).

    Args:
        bandwidth: the Gaussian bandwidth ``h`` of the image branch: ``"matched"`` (``h^2 = sqrt(d_head)``, the
            learned head's own temperature, so the two heads differ only by the key-norm bias), a positive float,
            or a callable of the timestep. The callable receives the denoiser's current timestep as a 0-d tensor on
            the device and returns a float or a tensor (0-d); keep it free of ``.item()`` / ``float()`` so that the
            denoising loop never waits for the device.
        layers: a regex (``re.search`` on the layer id), a list of them, or ``None`` for every IP-Adapter layer.
    """

    bandwidth: BandwidthSpec = "matched"
    layers: LayerSelection = None

    def __post_init__(self) -> None:
        _check_bandwidth(self.bandwidth)
        if isinstance(self.bandwidth, int):
            object.__setattr__(self, "bandwidth", float(self.bandwidth))

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        bw = self.bandwidth
        layers = self.layers
        return {
            "bandwidth": bw if isinstance(bw, str | float) else getattr(bw, "__name__", repr(bw)),
            "layers": layers if isinstance(layers, str | None) else [getattr(p, "pattern", p) for p in layers],
        }


class TimestepClock:
    """Holds the denoiser's current timestep for processors whose bandwidth is a function of it.

    A forward pre-hook on the denoiser stores the timestep tensor it is called with (a reference, no copy and no
    host synchronisation); the processors read it during the same forward.
    """

    def __init__(self) -> None:
        self.timestep: torch.Tensor | None = None

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if timestep is None:
            self.timestep = None
        elif isinstance(timestep, torch.Tensor):
            self.timestep = timestep.reshape(-1)[0]  # 0-d view: the pipelines pass one timestep per call
        else:
            sample = args[0] if args else kwargs.get("sample")
            device = sample.device if isinstance(sample, torch.Tensor) else None
            self.timestep = torch.tensor(float(timestep), device=device)


class NWHeadAttnProcessor(IPAdapterAttnProcessor2_0):
    """IP-Adapter processor whose image branch is a Gaussian NW smoother over the image-token keys.

    Text branch: unchanged scaled dot-product attention. Image branch, per adapter (paper §C.3):

        out = softmax(q k_ip^T / h^2 + b) v_ip,    b_i = -|k_ip,i|^2 / (2 h^2),

    computed by ``F.scaled_dot_product_attention`` with ``b`` as a float mask of shape ``(B, H, 1, K)``.

    It shares ``to_k_ip``, ``to_v_ip``, ``scale`` and ``num_tokens`` with the processor it replaces (the same
    objects), so loading tools that find IP-Adapter processors by ``isinstance`` see it, and scale changes reach the
    original too.

    Args:
        original: the IP-Adapter processor to mirror (``IPAdapterAttnProcessor2_0`` or ``IPAdapterAttnProcessor``).
        bandwidth: ``"matched"``, a positive float or a callable of the timestep (see :class:`NWHeadConfig`).
        clock: where a callable bandwidth reads the timestep; required for a callable bandwidth.
    """

    def __init__(
        self, original: torch.nn.Module, bandwidth: BandwidthSpec = "matched", clock: TimestepClock | None = None
    ) -> None:
        _check_bandwidth(bandwidth)
        for name in ("to_k_ip", "to_v_ip", "scale", "num_tokens"):
            if not hasattr(original, name):
                raise TypeError(
                    f"expected an IP-Adapter attention processor with `{name}`, got {type(original).__name__}; "
                    "load an IP-Adapter with `pipe.load_ip_adapter(...)` and wrap the processors it installs"
                )
        if callable(bandwidth) and clock is None:
            raise ValueError(
                "a callable bandwidth needs a TimestepClock to read the timestep from; use ipa_probe.nw_head / "
                "apply_nw_head, which install one on the denoiser, or pass clock=TimestepClock()"
            )
        # The parent builds fresh to_k_ip/to_v_ip layers; build them on the meta device (no memory, no init cost)
        # and replace them by the original's modules right away.
        with torch.device("meta"):
            super().__init__(
                original.hidden_size,
                original.cross_attention_dim,
                num_tokens=original.num_tokens,
                scale=original.scale,
            )
        self.to_k_ip = original.to_k_ip
        self.to_v_ip = original.to_v_ip
        self.scale = original.scale
        self.num_tokens = original.num_tokens
        self.bandwidth = float(bandwidth) if isinstance(bandwidth, int) else bandwidth
        self.clock = clock

    def extra_repr(self) -> str:
        bw = self.bandwidth
        return f"bandwidth={bw if isinstance(bw, str | float) else getattr(bw, '__name__', 'callable')}"

    # ------------------------------------------------------------------ bandwidth
    def bandwidth_for(self, head_dim: int, device: torch.device | None = None) -> float | torch.Tensor:
        """The bandwidth ``h`` used now: a float, or a 0-d float32 tensor for a callable of the timestep."""
        spec = self.bandwidth
        if spec == "matched":
            return matched_bandwidth(head_dim)
        if callable(spec):
            if self.clock is None or self.clock.timestep is None:
                raise RuntimeError(
                    "the NW head's bandwidth is a callable of the timestep, but no timestep was seen: call the "
                    "processor through the denoiser (ipa_probe.nw_head installs the timestep hook), or set "
                    "processor.clock.timestep"
                )
            h = torch.as_tensor(spec(self.clock.timestep), dtype=torch.float32, device=device)
            if h.numel() != 1:
                raise ValueError(
                    f"the bandwidth callable returned a tensor of shape {tuple(h.shape)}; return a float or a 0-d "
                    "tensor (one bandwidth per timestep)"
                )
            return h.reshape(())
        return spec

    def image_branch_logits(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """The logits whose softmax this processor applies to the image tokens: Gaussian NW logits.

        Args:
            query: ``(B, H, Q, D)``.
            key: image-token keys ``(B, H, K, D)``.

        Returns:
            ``(q·k_i - |k_i|^2/2) / h^2``, shape ``(B, H, Q, K)`` (equal to ``-|q - k_i|^2 / (2 h^2)`` up to a
            per-row constant).
        """
        return nw_logits(query, key, self.bandwidth_for(query.shape[-1], query.device))

    def nw_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Gaussian NW smoothing of ``value`` over ``key`` for each query, without materialising the weights.

        Args:
            query: ``(B, H, Q, D)``.
            key: ``(B, H, K, D)``.
            value: ``(B, H, K, Dv)``.

        Returns:
            ``sum_i w_i(q) v_i`` with ``w = softmax_i(-|q - k_i|^2 / (2 h^2))``, shape ``(B, H, Q, Dv)``.
        """
        h = self.bandwidth_for(query.shape[-1], query.device)
        bias = key_norm_bias(key.to(torch.promote_types(key.dtype, torch.float32)), h)  # (B, H, 1, K), >= float32
        # A per-row constant does not change a softmax: shift the largest bias to 0 so that the mask stays in range
        # in half precision and at least one key keeps a finite logit.
        bias = (bias - bias.amax(-1, keepdim=True)).to(query.dtype)
        if isinstance(h, torch.Tensor):
            # SDPA's `scale` must be a Python float; fold a tensor temperature into the query instead (no sync).
            query = query * (1.0 / (h * h)).to(query.dtype)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=1.0)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=1.0 / (h * h))

    # ------------------------------------------------------------------ forward
    def _split_context(self, encoder_hidden_states) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if isinstance(encoder_hidden_states, tuple):
            text, image = encoder_hidden_states
            return text, list(image)
        if isinstance(encoder_hidden_states, torch.Tensor):
            # Legacy layout: the image tokens of the first adapter are appended to the text tokens.
            end = encoder_hidden_states.shape[1] - self.num_tokens[0]
            return encoder_hidden_states[:, :end], [encoder_hidden_states[:, end:]]
        raise ValueError(
            "the NW head needs image-prompt embeddings: call the pipeline with `ip_adapter_image=` or "
            "`ip_adapter_image_embeds=` (the UNet then passes (text_states, image_states) to this processor)"
        )

    @staticmethod
    def _checked_masks(masks, scales: list, image_states: list[torch.Tensor]) -> list:
        if masks is None:
            return [None] * len(scales)
        if not isinstance(masks, list):
            masks = list(masks.unsqueeze(1))  # (adapters, H, W) tensor -> one (1, H, W) mask per adapter
        if not len(masks) == len(scales) == len(image_states):
            raise ValueError(
                f"got {len(masks)} ip_adapter_masks for {len(scales)} IP-Adapters and {len(image_states)} image "
                "embeddings; pass one mask (or None) per loaded adapter"
            )
        for index, (mask, scale, states) in enumerate(zip(masks, scales, image_states, strict=True)):
            if mask is None:
                continue
            if not isinstance(mask, torch.Tensor) or mask.ndim != 4:
                raise ValueError(
                    "expected each ip_adapter_mask as a tensor of shape (1, num_images, height, width), got "
                    f"{getattr(mask, 'shape', type(mask).__name__)}; build masks with IPAdapterMaskProcessor"
                )
            if mask.shape[1] != states.shape[1]:
                raise ValueError(
                    f"adapter {index}: {mask.shape[1]} masks for {states.shape[1]} reference images; "
                    "pass one mask per reference image"
                )
            if isinstance(scale, list) and len(scale) != mask.shape[1]:
                raise ValueError(
                    f"adapter {index}: {len(scale)} scales for {mask.shape[1]} masks; pass one scale per image"
                )
        return masks

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        scale: float = 1.0,
        ip_adapter_masks: torch.Tensor | None = None,
    ):
        """Cross-attention with a learned text branch and a Gaussian NW image branch.

        The signature is exactly the parent's, return annotation included (``Attention.forward`` passes only the
        keyword arguments that ``inspect.signature`` finds).

        Args:
            attn: the ``Attention`` module.
            hidden_states: ``(B, N, C)`` or ``(B, C, H, W)``.
            encoder_hidden_states: ``(text_states (B, T, C_ctx), [image_states per adapter])``; each image state is
                ``(B, tokens, C_ctx)`` or ``(B, images, tokens, C_ctx)``.
            attention_mask: optional text attention mask.
            temb: time embedding for a spatial norm, if the layer has one.
            scale: unused (kept for signature compatibility; the adapter scales live in ``self.scale``).
            ip_adapter_masks: optional per-adapter masks ``(1, images, H, W)``, as from ``IPAdapterMaskProcessor``.

        Returns:
            the layer output, shaped like ``hidden_states``.
        """
        text_states, image_states = self._split_context(encoder_hidden_states)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        spatial_shape = hidden_states.shape if hidden_states.ndim == 4 else None
        if spatial_shape is not None:
            batch, channels, height, width = spatial_shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)  # (B, HW, C)
        batch = text_states.shape[0]

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, text_states.shape[1], batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])  # (B, H, Q|1, T)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)  # (B, Q, H*D)
        if attn.norm_cross:
            text_states = attn.norm_encoder_hidden_states(text_states)
        key = attn.to_k(text_states)
        value = attn.to_v(text_states)
        head_dim = key.shape[-1] // attn.heads

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, head_dim).transpose(1, 2)  # (B, N, H*D) -> (B, H, N, D)

        def heads_last(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)  # -> (B, N, H*D)

        query = heads_first(query)
        out = F.scaled_dot_product_attention(query, heads_first(key), heads_first(value), attn_mask=attention_mask)
        out = heads_last(out)  # text branch, (B, Q, H*D)

        masks = self._checked_masks(ip_adapter_masks, self.scale, image_states)
        for states, adapter_scale, to_k_ip, to_v_ip, mask in zip(
            image_states, self.scale, self.to_k_ip, self.to_v_ip, masks, strict=False
        ):
            scales = adapter_scale if isinstance(adapter_scale, list) else [adapter_scale]
            if all(s == 0 for s in scales):
                continue
            if mask is None:
                if isinstance(adapter_scale, list):
                    raise ValueError(
                        "per-image IP-Adapter scales (a list per adapter) need `ip_adapter_masks`; pass masks or "
                        "a single float scale per adapter"
                    )
                # All reference images of the adapter together form the support: (B, [images,] tokens, C) keys.
                image_out = self.nw_attention(query, heads_first(to_k_ip(states)), heads_first(to_v_ip(states)))
                out = out + adapter_scale * heads_last(image_out)
                continue
            scales = scales * mask.shape[1] if len(scales) == 1 else scales
            for i in range(mask.shape[1]):
                image_out = heads_last(
                    self.nw_attention(query, heads_first(to_k_ip(states[:, i])), heads_first(to_v_ip(states[:, i])))
                )  # (B, Q, H*D)
                weight = IPAdapterMaskProcessor.downsample(mask[:, i], batch, image_out.shape[1], image_out.shape[2])
                out = out + scales[i] * (image_out * weight.to(dtype=query.dtype, device=query.device))

        out = attn.to_out[1](attn.to_out[0](out))  # output projection, dropout
        if spatial_shape is not None:
            out = out.transpose(-1, -2).reshape(spatial_shape)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


# ---------------------------------------------------------------------------------------------------------------------
# The swap
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class NWHeadSwap:
    """An installed NW head: what was replaced, so that it can be put back.

    Attributes:
        config: the settings.
        originals: processor key (``<layer id>.processor``) -> the processor object that was there.
        installed: processor key -> the :class:`NWHeadAttnProcessor` put in its place.
        clock: the timestep holder (hooked to the denoiser only for a callable bandwidth).
    """

    config: NWHeadConfig
    originals: dict[str, torch.nn.Module]
    installed: dict[str, NWHeadAttnProcessor]
    clock: TimestepClock = field(default_factory=TimestepClock)
    _denoiser: torch.nn.Module | None = field(default=None, repr=False)
    _handle: Any = field(default=None, repr=False)

    @property
    def layers(self) -> list[str]:
        """The swapped layer ids."""
        return [key.removesuffix(".processor") for key in self.installed]

    @property
    def active(self) -> bool:
        return self._denoiser is not None

    def remove(self) -> None:
        """Put the original processors back where the NW head still sits; idempotent.

        Layers that no longer hold the NW processor (e.g. after ``pipe.unload_ip_adapter()`` inside the block) are
        left as they are, so an unloaded adapter is not resurrected.
        """
        denoiser = self._denoiser
        if denoiser is None:
            return
        try:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            current = denoiser.attn_processors
            restore = {key: self.originals[key] for key, nw in self.installed.items() if current.get(key) is nw}
            if restore:
                processors = {**current, **restore}
                denoiser.set_attn_processor(dict(processors))  # set_attn_processor pops what it is given: a copy
            skipped = len(self.installed) - len(restore)
            if skipped:
                logger.info("nw_head: %d layer(s) no longer held the NW head and were left as they are", skipped)
        finally:
            denoiser.__dict__.pop(_STATE_ATTRIBUTE, None)
            release(denoiser, _FEATURE)
            self._denoiser = None


def _nw_processor_class(layer) -> type:
    """The NW head for a layer's model family: this module's for SD 1.5 / SDXL, ``dit``'s for Flux/SD3."""
    if layer.family == "unet":
        return NWHeadAttnProcessor
    from .dit import NW_PROCESSORS  # imported here: dit builds on this module

    return NW_PROCESSORS[layer.family]


def apply_nw_head(pipe, bandwidth: BandwidthSpec = "matched", *, layers: LayerSelection = None) -> NWHeadSwap:
    """Swap the NW head into a pipeline's IP-Adapter layers (until :func:`remove_nw_head`).

    Prefer the context manager :func:`nw_head` in scripts; this pair is for notebooks.

    Args:
        pipe: a diffusers SD 1.5 / SDXL pipeline with an IP-Adapter loaded, or its UNet.
        bandwidth: ``"matched"``, a positive float or a callable of the timestep (see :class:`NWHeadConfig`).
        layers: a regex or list of regexes selecting layer ids; ``None`` for every IP-Adapter layer.

    Returns:
        the :class:`NWHeadSwap` (its ``layers`` lists the swapped layer ids).

    Raises:
        ValueError / TypeError: bad settings, no IP-Adapter, an unsupported processor, a selection matching nothing:
            raised before anything is modified.
        RuntimeError: the NW head is already applied to this pipeline.
    """
    config = NWHeadConfig(bandwidth, layers)
    found = find_ip_layers(pipe, config.layers)
    denoiser = claim(pipe, _FEATURE)
    swap = NWHeadSwap(config=config, originals={}, installed={})
    try:
        for layer in found:
            key = f"{layer.name}.processor"
            swap.originals[key] = layer.processor
            swap.installed[key] = _nw_processor_class(layer)(layer.processor, config.bandwidth, swap.clock)
        processors = {**denoiser.attn_processors, **swap.installed}
        swap._denoiser = denoiser
        denoiser.__dict__[_STATE_ATTRIBUTE] = swap
        denoiser.set_attn_processor(dict(processors))  # set_attn_processor pops what it is given: a copy
        if callable(config.bandwidth):
            swap._handle = denoiser.register_forward_pre_hook(swap.clock.hook, with_kwargs=True)
    except BaseException:
        if swap.active:
            swap.remove()
        else:
            release(denoiser, _FEATURE)
        raise
    logger.info("nw_head: swapped %d IP-Adapter layer(s), bandwidth=%s", len(found), config.describe()["bandwidth"])
    return swap


def remove_nw_head(pipe) -> None:
    """Undo :func:`apply_nw_head`: put the original processor objects back (see :meth:`NWHeadSwap.remove`).

    Raises:
        ValueError: no NW head is applied to this pipeline.
    """
    swap = denoiser_of(pipe).__dict__.get(_STATE_ATTRIBUTE)
    if swap is None:
        raise ValueError("no NW head is applied to this pipeline; call ipa_probe.apply_nw_head(pipe) first")
    swap.remove()


@contextlib.contextmanager
def nw_head(pipe, bandwidth: BandwidthSpec = "matched", *, layers: LayerSelection = None) -> Iterator[NWHeadSwap]:
    """Run a pipeline with the NW head in its IP-Adapter layers; the original processors come back on exit.

    On exit (normal, exception or KeyboardInterrupt) every layer that still holds the NW head gets its original
    processor object back; ``set_ip_adapter_scale`` inside the block acts on the shared ``scale`` lists and so
    persists, and ``unload_ip_adapter`` inside the block is respected.

    Args:
        pipe: a diffusers SD 1.5 / SDXL pipeline with an IP-Adapter loaded, or its UNet.
        bandwidth: ``"matched"`` (``h^2 = sqrt(d_head)``), a positive float, or a callable of the timestep (0-d
            tensor on the device -> float or tensor).
        layers: a regex or list of regexes selecting layer ids; ``None`` for every IP-Adapter layer.

    Yields:
        the :class:`NWHeadSwap`.

    Example:
        ```py
        >>> with ipa_probe.nw_head(pipe, bandwidth="matched"):
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]
        ```
    """
    swap = apply_nw_head(pipe, bandwidth, layers=layers)
    try:
        yield swap
    finally:
        swap.remove()
