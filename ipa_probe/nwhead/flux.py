"""The NW head for Flux: Gaussian NW weights in place of the image branch's own dot-product softmax.

Flux's image branch is its own softmax over the image tokens, so it becomes ``softmax_i(-|q - k_i|^2 / (2 h^2)) v_i``
with ``q`` the latent query after ``attn.norm_q`` and before RoPE, and ``k_i = to_k_ip(c_ip)_i`` (with bias). The
joint text-image attention is diffusers' own code (the parent processor called with no image prompts, which returns
the image branch separately in Flux); the image query is formed again with the same modules (one extra ``to_q``
projection per IP layer, a few percent of a double block). The head is a view of the original processor
(:class:`~.kernel.ProcessorView`) and its kernel is :mod:`.kernel`'s. A callable bandwidth receives the scheduler
timestep on the 0-1000 scale (the transformer itself is called with ``t / 1000``), the value the probe reports.

With ``frame="query"`` the image branch is ``softmax_i(q·k_i / sqrt(d) - b_i) v_i``, ``b`` estimated per batch item
and head from the logits this processor forms (``q`` after ``norm_q``, keys from ``to_k_ip``) over all latent queries
of the call (:meth:`~.kernel.NWKernel.query_frame_mask`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from ..statistics.kernels import merge_heads, split_heads
from .kernel import ProcessorView

__all__ = ["FluxNWHeadAttnProcessor"]


class FluxNWHeadAttnProcessor(ProcessorView, FluxIPAdapterAttnProcessor):
    """Flux IP-Adapter processor whose image branch is a Gaussian NW smoother over the image-token keys.

    Per adapter ``a`` with scale ``s_a`` (paper §C.3):

        ip_out = sum_a s_a softmax(q k_a^T / h^2 + b_a) v_a,    b_a,i = -|k_a,i|^2 / (2 h^2),

    with ``q = attn.norm_q(to_q(h))`` of the latent tokens (``(B, H, N, D)``, before RoPE, as diffusers' processor
    uses), ``k_a = to_k_ip[a](c_a)`` and ``v_a = to_v_ip[a](c_a)`` over all reference images of the adapter. The
    joint text-image attention is the parent's. ``ip_adapter_masks`` are accepted and ignored, as by the parent.

    Arguments as in :class:`~.kernel.ProcessorView`; ``original``: the ``FluxIPAdapterAttnProcessor``.
    """

    _mirrored = FluxIPAdapterAttnProcessor

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        ip_hidden_states: list[torch.Tensor] | None = None,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Joint attention (the parent's) and the NW image branch; same signature and outputs as the parent:
        ``(hidden_states, encoder_hidden_states, ip_out)`` with ``ip_out`` ``(B, N, H*D)``, or ``hidden_states`` alone
        when there are no text tokens. ``ip_hidden_states``: per adapter, the projected image tokens ``(B, [images,]
        tokens, C_ctx)``; ``ip_adapter_masks`` is ignored (as by diffusers' processor).
        """
        if encoder_hidden_states is None:
            return super().__call__(attn, hidden_states, None, attention_mask, image_rotary_emb)
        if ip_hidden_states is None:
            raise ValueError(
                "the NW head needs image-prompt embeddings: call the pipeline with `ip_adapter_image=` or "
                "`ip_adapter_image_embeds=` (the transformer then passes `ip_hidden_states` to this processor)"
            )
        hidden, context, ip_out = super().__call__(
            attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, ip_hidden_states=[]
        )  # ip_out: zeros (B, N, H*D)
        heads = attn.heads
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (heads, -1)))  # (B, N, H, D), before RoPE
        query = query.transpose(1, 2)  # (B, H, N, D)
        for states, scale, to_k_ip, to_v_ip in zip(
            ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip, strict=False
        ):
            if scale == 0:
                continue
            # (B, [images,] tokens, H*D) -> (B, H, images * tokens, D)
            key, value = split_heads(to_k_ip(states), heads), split_heads(to_v_ip(states), heads)
            out = self.nw_attention(query, key, value)  # (B, H, N, D)
            ip_out += scale * merge_heads(out).to(query.dtype)  # (B, N, H*D)
        return hidden, context, ip_out
