"""The NW head for SD3: Gaussian NW weights over the joint (latent + image) keys of the image branch.

SD3's image branch is one joint softmax over the latent keys and the image keys; the NW head replaces it by Gaussian
NW weights over that same joint key set, ``softmax_j(-|q - k_j|^2 / (2 h^2)) v_j`` for ``j`` in
``[latent tokens; image tokens]`` (queries and keys after the processor's RMS norms). Restricted to the image columns
and renormalised this is NW over the image keys, which is what the probe reports (:mod:`~ipa_probe.capture.taps`).
The forward is written here (SD3 adds the image branch before the output projection, so the parent's code cannot be
reused around it); with the NW kernel replaced by dot-product attention it reproduces diffusers' processor bit for
bit (tested). The head is a view of the original processor (:class:`~.kernel.ProcessorView`) and its kernel is
:mod:`.kernel`'s.

With ``frame="query"`` the joint weights are ``softmax_j(q·K_j / sqrt(d) - b_j)``, ``b`` estimated per batch item and
head from the joint logits this processor forms (all ``N`` latent queries against the ``N + K`` joint keys). That
materialises a ``(B, H, N, N + K)`` float32 logit block per layer call (and so does a probe's record of the layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, SD3IPAdapterJointAttnProcessor2_0

from ..statistics.kernels import merge_heads, split_heads
from .kernel import ProcessorView

__all__ = ["SD3NWHeadAttnProcessor"]


class SD3NWHeadAttnProcessor(ProcessorView, SD3IPAdapterJointAttnProcessor2_0):
    """SD3 IP-Adapter processor whose image branch is Gaussian NW weights over the joint (latent + image) keys.

    Image branch (paper §C.3, over the joint key set ``K = [k_lat; k_ip]`` with values ``V = [v_lat; v_ip]``):

        out = scale * softmax(q K^T / h^2 + b) V,    b_j = -|K_j|^2 / (2 h^2),

    with ``q = norm_q(to_q(h))``, ``k_lat = norm_k(to_k(h))``, ``v_lat = to_v(h)`` (latent tokens, the processor's
    own RMS norms) and ``k_ip = norm_ip_k(to_k_ip(c))``, ``v_ip = to_v_ip(c)``, ``c = norm_ip(c_ip, temb)``. The joint
    text-latent attention is unchanged. With ``scale == 0`` or no image prompt the parent runs as is.

    Arguments as in :class:`~.kernel.ProcessorView`; ``original``: the ``SD3IPAdapterJointAttnProcessor2_0``.
    """

    _mirrored = SD3IPAdapterJointAttnProcessor2_0

    def image_branch_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The image branch's smoother over the joint keys: :meth:`nw_attention` (``(B, H, Q, D)`` queries,
        ``(B, H, N + K, D)`` keys and values -> ``(B, H, Q, D)``)."""
        return self.nw_attention(query, key, value)

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        ip_hidden_states: torch.FloatTensor = None,
        temb: torch.FloatTensor = None,
    ) -> torch.FloatTensor:
        """Joint attention and the NW image branch; same signature and outputs as the parent.

        Args:
            attn: the joint ``Attention`` module.
            hidden_states: latent tokens ``(B, N, C)``.
            encoder_hidden_states: text tokens ``(B, T, C)``, or ``None`` (dual-attention ``attn2``).
            attention_mask: unused (as by the parent).
            ip_hidden_states: image tokens from the resampler ``(B, K, C)``.
            temb: the resampler's timestep embedding, for ``norm_ip``.

        Returns:
            ``(hidden_states, encoder_hidden_states)``, or ``hidden_states`` alone without text tokens.
        """
        if self.scale == 0 or ip_hidden_states is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, ip_hidden_states, temb)
        n_latent, heads = hidden_states.shape[1], attn.heads
        # (B, N, H*D) -> (B, H, N, D)
        query, key, value = (split_heads(proj(hidden_states), heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
        joint_q = attn.norm_q(query) if attn.norm_q is not None else query
        joint_k = attn.norm_k(key) if attn.norm_k is not None else key
        joint_v = value
        if encoder_hidden_states is not None:
            text_q = split_heads(attn.add_q_proj(encoder_hidden_states), heads)
            text_k = split_heads(attn.add_k_proj(encoder_hidden_states), heads)
            text_v = split_heads(attn.add_v_proj(encoder_hidden_states), heads)
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            joint_q = torch.cat([joint_q, text_q], dim=2)  # (B, H, N + T, D)
            joint_k = torch.cat([joint_k, text_k], dim=2)
            joint_v = torch.cat([joint_v, text_v], dim=2)
        out = F.scaled_dot_product_attention(joint_q, joint_k, joint_v, dropout_p=0.0, is_causal=False)
        out = merge_heads(out).to(joint_q.dtype)  # (B, N + T, H*D)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :n_latent], out[:, n_latent:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)

        # The image branch: one smoother over the latent keys and the image keys together.
        image_tokens = self.norm_ip(ip_hidden_states, temb=temb)
        ip_key = split_heads(self.to_k_ip(image_tokens), heads)  # (B, H, K, D)
        ip_value = split_heads(self.to_v_ip(image_tokens), heads)
        image_q = self.norm_q(query)
        latent_k = self.norm_k(key)
        ip_key = self.norm_ip_k(ip_key)
        image_out = self.image_branch_attention(
            image_q, torch.cat([latent_k, ip_key], dim=2), torch.cat([value, ip_value], dim=2)
        )  # (B, H, N, D)
        out = out + merge_heads(image_out).to(image_q.dtype) * self.scale
        out = attn.to_out[1](attn.to_out[0](out))  # output projection, dropout
        return (out, context) if encoder_hidden_states is not None else out
