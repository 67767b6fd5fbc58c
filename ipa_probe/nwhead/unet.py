"""The NW head for SD 1.5 / SDXL UNets: an ``IPAdapterAttnProcessor2_0`` whose image branch is Gaussian NW smoothing.

In every selected IP-Adapter cross-attention layer the image branch's dot-product softmax
``softmax_i(q·k_i / sqrt(d_head)) v_i`` becomes ``softmax_i(-|q - k_i|^2 / (2 h^2)) v_i`` over the same keys (stored
frame), or ``softmax_i(q·k_i / sqrt(d_head) - b_i) v_i`` with ``b`` each key's log-partition over the call's queries
(query frame; the kernel is :mod:`.kernel`'s). Values, ``scale``, masks and the text branch are untouched; with zero
parameters of its own, this is the paper's frozen baseline inside the very pipeline that the learned IP-Adapter runs
in.

The processor subclasses diffusers' ``IPAdapterAttnProcessor2_0`` and *shares* the original's ``to_k_ip``/``to_v_ip``
modules, ``scale`` list and ``num_tokens`` (no copies), so ``set_ip_adapter_scale`` and ``unload_ip_adapter`` keep
working while it is installed, and probe hooks on ``to_k_ip`` still fire. Install it with :func:`ipa_probe.nw_head`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

from ..capture.taps.base import normalise_masks
from ..statistics.bandwidth import BandwidthSpec
from ..statistics.kernels import merge_heads, split_heads
from .kernel import NWKernel, TimestepClock

__all__ = ["NWHeadAttnProcessor"]


class NWHeadAttnProcessor(NWKernel, IPAdapterAttnProcessor2_0):
    """IP-Adapter processor whose image branch is a Gaussian NW smoother over the image-token keys.

    Text branch: unchanged scaled dot-product attention. Image branch, per adapter (paper §C.3):

        stored frame:  out = softmax(q k_ip^T / h^2 + c) v_ip,        c_i = -|k_ip,i|^2 / (2 h^2),
        query frame:   out = softmax(q k_ip^T / sqrt(d) - b) v_ip,    b_i = log mean_q exp(L_qi)  (or mean + var / 2),

    ``L`` the row-centred logits ``q k_ip^T / sqrt(d)`` of one batch item and head over the call's queries (for a
    masked reference image, the queries inside its mask), computed by ``F.scaled_dot_product_attention`` with the key
    term as a float mask of shape ``(B, H, 1, K)``.

    It shares ``to_k_ip``, ``to_v_ip``, ``scale`` and ``num_tokens`` with the processor it replaces (the same
    objects), so loading tools that find IP-Adapter processors by ``isinstance`` see it, and scale changes reach the
    original too.

    Args:
        original: the IP-Adapter processor to mirror (``IPAdapterAttnProcessor2_0`` or ``IPAdapterAttnProcessor``).
        bandwidth, clock, frame, form: as :class:`~.kernel.NWKernel`'s attributes (a callable bandwidth needs
            ``clock``; ``form`` defaults to ``"exact"`` for the query frame).
    """

    def __init__(
        self,
        original: torch.nn.Module,
        bandwidth: BandwidthSpec = "matched",
        clock: TimestepClock | None = None,
        *,
        frame: str = "stored",
        form: str | None = None,
    ) -> None:
        for name in ("to_k_ip", "to_v_ip", "scale", "num_tokens"):
            if not hasattr(original, name):
                raise TypeError(
                    f"expected an IP-Adapter attention processor with `{name}`, got {type(original).__name__}; "
                    "load an IP-Adapter with `pipe.load_ip_adapter(...)` and wrap the processors it installs"
                )
        self._set_bandwidth(bandwidth, clock, frame, form)
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

    # ------------------------------------------------------------------ forward
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
        keyword arguments that ``inspect.signature`` finds); ``scale`` is unused (the adapter scales live in
        ``self.scale``). ``encoder_hidden_states``: ``(text_states (B, T, C_ctx), [image_states per adapter])``, each
        image state ``(B, [images,] tokens, C_ctx)``; ``ip_adapter_masks``: per adapter ``(1, images, H, W)``, as from
        ``IPAdapterMaskProcessor``.
        """
        text_states, image_states = self._split_context(encoder_hidden_states)
        masks = self._checked_masks(ip_adapter_masks, self.scale, image_states)
        tokens, spatial_shape = self._input_tokens(attn, hidden_states, temb)  # (B, Q, C)
        query = attn.to_q(tokens)  # (B, Q, H*D)
        out = self._text_branch(attn, query, text_states, attention_mask)  # (B, Q, H*D)
        for term in self._image_terms(split_heads(query, attn.heads), image_states, masks):
            out = out + term
        out = attn.to_out[1](attn.to_out[0](out))  # output projection, dropout
        if spatial_shape is not None:
            out = out.transpose(-1, -2).reshape(spatial_shape)  # (B, HW, C) -> (B, C, H, W)
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor

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
        masks = normalise_masks(masks)  # the legacy (adapters, 1, H, W) tensor: one entry per adapter
        if masks is None:
            return [None] * len(scales)
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

    @staticmethod
    def _input_tokens(
        attn: Attention, hidden_states: torch.Tensor, temb: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Size | None]:
        """The layer's normalised input as tokens ``(B, Q, C)``, and its spatial shape ``(B, C, H, W)`` if it had
        one."""
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        spatial_shape = hidden_states.shape if hidden_states.ndim == 4 else None
        if spatial_shape is not None:
            batch, channels, height, width = spatial_shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)  # (B, HW, C)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        return hidden_states, spatial_shape

    @staticmethod
    def _text_branch(
        attn: Attention, query: torch.Tensor, text_states: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The learned text cross-attention, as diffusers computes it: ``(B, Q, H*D)`` queries -> ``(B, Q, H*D)``."""
        batch = text_states.shape[0]
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, text_states.shape[1], batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])  # (B, H, Q|1, T)
        if attn.norm_cross:
            text_states = attn.norm_encoder_hidden_states(text_states)
        key, value = split_heads(attn.to_k(text_states), attn.heads), split_heads(attn.to_v(text_states), attn.heads)
        out = F.scaled_dot_product_attention(split_heads(query, attn.heads), key, value, attn_mask=attention_mask)
        return merge_heads(out).to(query.dtype)  # (B, H, Q, D) -> (B, Q, H*D)

    def _image_terms(
        self, query: torch.Tensor, image_states: list[torch.Tensor], masks: list
    ) -> Iterator[torch.Tensor]:
        """The image branch's contributions to the output, ``(B, Q, H*D)`` each: one per adapter, or one per
        reference image of a masked adapter (added in this order). ``query``: ``(B, H, Q, D)``; per adapter,
        ``image_states`` ``(B, [images,] tokens, C_ctx)`` and ``masks`` its ``(1, images, H, W)`` mask or ``None``."""
        batch, heads, n_queries = query.shape[0], query.shape[1], query.shape[2]

        def smooth(
            states: torch.Tensor, to_k_ip: torch.nn.Module, to_v_ip: torch.nn.Module, rows: torch.Tensor | None = None
        ) -> torch.Tensor:
            key, value = split_heads(to_k_ip(states), heads), split_heads(to_v_ip(states), heads)  # (B, H, K, D)
            return merge_heads(self.nw_attention(query, key, value, rows)).to(query.dtype)  # (B, Q, H*D)

        adapters = zip(image_states, self.scale, self.to_k_ip, self.to_v_ip, masks, strict=False)
        for states, adapter_scale, to_k_ip, to_v_ip, mask in adapters:
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
                yield adapter_scale * smooth(states, to_k_ip, to_v_ip)
                continue
            scales = scales * mask.shape[1] if len(scales) == 1 else scales
            for i in range(mask.shape[1]):
                weight = IPAdapterMaskProcessor.downsample(mask[:, i], batch, n_queries, 1)  # (B, Q, 1)
                weight = weight.to(dtype=query.dtype, device=query.device)
                rows = (weight[..., 0] != 0).unsqueeze(1)  # (B, 1, Q): the queries this image reaches
                image_out = smooth(states[:, i], to_k_ip, to_v_ip, rows)  # (B, Q, H*D)
                yield scales[i] * (image_out * weight)
