"""The NW head for Flux and SD3: Gaussian NW weights in place of the image branch's dot-product softmax.

Same idea, kernel and lifecycle as :mod:`ipa_probe.nwhead.unet` (SD 1.5 / SDXL): the swapped-in processor is a
*subclass* of diffusers' processor that shares the original's weights (``to_k_ip``, ``to_v_ip``, and for SD3 the
``norm_ip``/``norm_q``/``norm_k``/``norm_ip_k`` modules) and forwards ``scale`` to the original, so
``set_ip_adapter_scale`` (which *assigns* ``processor.scale`` in both families) and ``unload_ip_adapter`` keep
working while it is installed, the original is restored exactly by :func:`ipa_probe.nw_head` /
:func:`ipa_probe.remove_nw_head`, and probe hooks on the shared modules still fire. The kernel is the one of
:class:`ipa_probe.nwhead.unet.NWHeadAttnProcessor` (``F.scaled_dot_product_attention`` with temperature ``h^2`` and
the key-norm bias ``-|k_i|^2 / (2 h^2)`` as a float mask, paper §C.3), shared as is.

- **Flux** (:class:`FluxNWHeadAttnProcessor`): the image branch is its own softmax over the image tokens, so it
  becomes ``softmax_i(-|q - k_i|^2 / (2 h^2)) v_i`` with ``q`` the latent query after ``attn.norm_q`` and before
  RoPE, and ``k_i = to_k_ip(c_ip)_i`` (with bias). The joint text-image attention is diffusers' own code (the parent
  processor called with no image prompts, which returns the image branch separately in Flux); the image query is
  formed again with the same modules (one extra ``to_q`` projection per IP layer, a few percent of a double block).
- **SD3** (:class:`SD3NWHeadAttnProcessor`): the image branch is one joint softmax over the latent keys and the
  image keys; the NW head replaces it by Gaussian NW weights over that same joint key set,
  ``softmax_j(-|q - k_j|^2 / (2 h^2)) v_j`` for ``j`` in ``[latent tokens; image tokens]`` (queries and keys after
  the processor's RMS norms). Restricted to the image columns and renormalised this is NW over the image keys,
  which is what the probe reports (:mod:`~.capture.taps`). The forward is written here (SD3 adds the image branch
  before the output projection, so the parent's code cannot be reused around it); with the NW kernel replaced by
  dot-product attention it reproduces diffusers' processor bit for bit (tested).

A callable bandwidth receives the scheduler timestep on the 0-1000 scale in both families (Flux's transformer is
called with ``t / 1000``; the head rescales it), the same value the probe reports in its ``timestep`` column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from .unet import BandwidthSpec, NWHeadAttnProcessor, NWHeadConfig, TimestepClock

__all__ = ["NW_PROCESSORS", "FluxNWHeadAttnProcessor", "SD3NWHeadAttnProcessor"]


class _ScaledClock:
    """A view of a :class:`TimestepClock` on another scale (Flux's transformer sees ``t / 1000``)."""

    def __init__(self, clock: TimestepClock, factor: float) -> None:
        self.clock = clock
        self.factor = factor

    @property
    def timestep(self) -> torch.Tensor | None:
        t = self.clock.timestep
        return None if t is None else t * self.factor


class _NWMirror:
    """What the Flux and SD3 NW heads share: construction as a view of the original processor and the NW kernel.

    The kernel methods are :class:`ipa_probe.nwhead.unet.NWHeadAttnProcessor`'s own functions (one implementation of
    the bandwidth, the NW logits and the SDPA-with-bias kernel for every family).
    """

    bandwidth_for = NWHeadAttnProcessor.bandwidth_for
    image_branch_logits = NWHeadAttnProcessor.image_branch_logits
    nw_attention = NWHeadAttnProcessor.nw_attention
    extra_repr = NWHeadAttnProcessor.extra_repr

    #: diffusers' processor class this head mirrors.
    _mirrored: type = torch.nn.Module
    #: factor from the timestep the denoiser receives to the scheduler's 0-1000 scale.
    _timestep_factor: float = 1.0

    def _mirror(self, original: torch.nn.Module, bandwidth: BandwidthSpec, clock: TimestepClock | None) -> None:
        bandwidth = NWHeadConfig(bandwidth).bandwidth  # validated, ints made floats
        if not isinstance(original, self._mirrored):
            raise TypeError(
                f"expected a {self._mirrored.__name__} (loaded by `pipe.load_ip_adapter(...)`), got "
                f"{type(original).__name__}; use ipa_probe.nw_head(pipe), which picks the NW head for each layer"
            )
        if callable(bandwidth) and clock is None:
            raise ValueError(
                "a callable bandwidth needs a TimestepClock to read the timestep from; use ipa_probe.nw_head / "
                "apply_nw_head, which install one on the denoiser, or pass clock=TimestepClock()"
            )
        torch.nn.Module.__init__(self)
        # A view, not a copy: the original's submodules (weights, norms) and settings, the very same objects.
        self.__dict__["_original"] = original  # kept out of the module tree (its weights are already shared)
        for name, module in original.named_children():
            setattr(self, name, module)
        for name, value in vars(original).items():
            if not name.startswith("_") and name not in ("training", "scale"):
                setattr(self, name, value)
        for name in ("_attention_backend", "_parallel_config"):
            if name in vars(original):
                setattr(self, name, vars(original)[name])
        self.training = original.training
        self.bandwidth = bandwidth
        self.clock = (
            clock if clock is None or self._timestep_factor == 1 else _ScaledClock(clock, self._timestep_factor)
        )

    @property
    def original(self) -> torch.nn.Module:
        """The diffusers processor this head stands in for (restored on removal)."""
        return self.__dict__["_original"]

    @property
    def scale(self):
        """The original's ``scale``: read and assigned through, so ``set_ip_adapter_scale`` persists after removal."""
        return self.original.scale

    @scale.setter
    def scale(self, value) -> None:
        self.original.scale = value


class FluxNWHeadAttnProcessor(_NWMirror, FluxIPAdapterAttnProcessor):
    """Flux IP-Adapter processor whose image branch is a Gaussian NW smoother over the image-token keys.

    Per adapter ``a`` with scale ``s_a`` (paper §C.3):

        ip_out = sum_a s_a softmax(q k_a^T / h^2 + b_a) v_a,    b_a,i = -|k_a,i|^2 / (2 h^2),

    with ``q = attn.norm_q(to_q(h))`` of the latent tokens (``(B, H, N, D)``, before RoPE, as diffusers' processor
    uses), ``k_a = to_k_ip[a](c_a)`` and ``v_a = to_v_ip[a](c_a)`` over all reference images of the adapter. The
    joint text-image attention is the parent's. ``ip_adapter_masks`` are accepted and ignored, as by the parent.

    Args:
        original: the ``FluxIPAdapterAttnProcessor`` to stand in for.
        bandwidth: ``"matched"`` (``h^2 = sqrt(d_head)``), a positive float or a callable of the timestep (0-1000).
        clock: where a callable bandwidth reads the timestep; required for a callable bandwidth.
    """

    _mirrored = FluxIPAdapterAttnProcessor
    _timestep_factor = 1000.0  # the Flux transformer is called with t / 1000

    def __init__(
        self, original: torch.nn.Module, bandwidth: BandwidthSpec = "matched", clock: TimestepClock | None = None
    ) -> None:
        self._mirror(original, bandwidth, clock)

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
        """Joint attention (the parent's) and the NW image branch; same signature and outputs as the parent.

        Args:
            attn: the ``FluxAttention`` module.
            hidden_states: latent tokens ``(B, N, C)``.
            encoder_hidden_states: text tokens ``(B, T, C)`` (double-stream blocks), or ``None``.
            attention_mask: optional mask of the joint attention.
            image_rotary_emb: RoPE tables of the joint attention (not used by the image branch).
            ip_hidden_states: per adapter, the projected image tokens ``(B, [images,] tokens, C_ctx)``.
            ip_adapter_masks: ignored (as by diffusers' processor).

        Returns:
            ``(hidden_states, encoder_hidden_states, ip_out)`` with ``ip_out`` ``(B, N, H*D)``, or ``hidden_states``
            alone when there are no text tokens (as the parent).
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
        batch, heads = hidden_states.shape[0], attn.heads
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, (heads, -1)))  # (B, N, H, D), before RoPE
        head_dim = query.shape[-1]
        query = query.transpose(1, 2)  # (B, H, N, D)
        for states, scale, to_k_ip, to_v_ip in zip(
            ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip, strict=False
        ):
            if scale == 0:
                continue
            # (B, [images,] tokens, H*D) -> (B, H, images * tokens, D)
            key = to_k_ip(states).reshape(batch, -1, heads, head_dim).transpose(1, 2)
            value = to_v_ip(states).reshape(batch, -1, heads, head_dim).transpose(1, 2)
            out = self.nw_attention(query, key, value)  # (B, H, N, D)
            ip_out += scale * out.transpose(1, 2).reshape(batch, -1, heads * head_dim).to(query.dtype)
        return hidden, context, ip_out


class SD3NWHeadAttnProcessor(_NWMirror, SD3IPAdapterJointAttnProcessor2_0):
    """SD3 IP-Adapter processor whose image branch is Gaussian NW weights over the joint (latent + image) keys.

    Image branch (paper §C.3, over the joint key set ``K = [k_lat; k_ip]`` with values ``V = [v_lat; v_ip]``):

        out = scale * softmax(q K^T / h^2 + b) V,    b_j = -|K_j|^2 / (2 h^2),

    with ``q = norm_q(to_q(h))``, ``k_lat = norm_k(to_k(h))``, ``v_lat = to_v(h)`` (latent tokens, the processor's
    own RMS norms) and ``k_ip = norm_ip_k(to_k_ip(c))``, ``v_ip = to_v_ip(c)``, ``c = norm_ip(c_ip, temb)``. The joint
    text-latent attention is unchanged. With ``scale == 0`` or no image prompt the parent runs as is.

    Args:
        original: the ``SD3IPAdapterJointAttnProcessor2_0`` to stand in for.
        bandwidth: ``"matched"`` (``h^2 = sqrt(d_head)``), a positive float or a callable of the timestep (0-1000).
        clock: where a callable bandwidth reads the timestep; required for a callable bandwidth.
    """

    _mirrored = SD3IPAdapterJointAttnProcessor2_0

    def __init__(
        self, original: torch.nn.Module, bandwidth: BandwidthSpec = "matched", clock: TimestepClock | None = None
    ) -> None:
        self._mirror(original, bandwidth, clock)

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
        batch, n_latent = hidden_states.shape[:2]
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, head_dim).transpose(1, 2)  # (B, N, H*D) -> (B, H, N, D)

        def heads_last(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)  # (B, H, N, D) -> (B, N, H*D)

        query, key, value = heads_first(query), heads_first(key), heads_first(value)
        joint_q = attn.norm_q(query) if attn.norm_q is not None else query
        joint_k = attn.norm_k(key) if attn.norm_k is not None else key
        joint_v = value
        if encoder_hidden_states is not None:
            text_q = heads_first(attn.add_q_proj(encoder_hidden_states))
            text_k = heads_first(attn.add_k_proj(encoder_hidden_states))
            text_v = heads_first(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            joint_q = torch.cat([joint_q, text_q], dim=2)  # (B, H, N + T, D)
            joint_k = torch.cat([joint_k, text_k], dim=2)
            joint_v = torch.cat([joint_v, text_v], dim=2)
        out = F.scaled_dot_product_attention(joint_q, joint_k, joint_v, dropout_p=0.0, is_causal=False)
        out = heads_last(out).to(joint_q.dtype)  # (B, N + T, H*D)
        context = None
        if encoder_hidden_states is not None:
            out, context = out[:, :n_latent], out[:, n_latent:]
            if not attn.context_pre_only:
                context = attn.to_add_out(context)

        # The image branch: one smoother over the latent keys and the image keys together.
        image_tokens = self.norm_ip(ip_hidden_states, temb=temb)
        ip_key = heads_first(self.to_k_ip(image_tokens))  # (B, H, K, D)
        ip_value = heads_first(self.to_v_ip(image_tokens))
        image_q = self.norm_q(query)
        latent_k = self.norm_k(key)
        ip_key = self.norm_ip_k(ip_key)
        image_out = self.image_branch_attention(
            image_q, torch.cat([latent_k, ip_key], dim=2), torch.cat([value, ip_value], dim=2)
        )  # (B, H, N, D)
        out = out + heads_last(image_out).to(image_q.dtype) * self.scale
        out = attn.to_out[1](attn.to_out[0](out))  # output projection, dropout
        return (out, context) if encoder_hidden_states is not None else out


#: The NW head of each model family, for :func:`ipa_probe.nw_head` (SD 1.5 / SDXL: ``processors.NWHeadAttnProcessor``).
NW_PROCESSORS: dict[str, type] = {"flux": FluxNWHeadAttnProcessor, "sd3": SD3NWHeadAttnProcessor}
