"""The learned in-context flow-matching model of paper §A.3, with the exact-NW branch switchable.

Queries are noisy points ``x_t`` with their flow time ``t``; the support set enters only as keys and values of
cross-attention. Queries never attend to each other and support tokens are projected once (no self-attention
over the support), so the model accepts any support size ``m`` and any number of queries ``n``.

With ``exact_head=True`` the exact empirical velocity of the support (paper §C.2, form 2,
``u_t(x) = x~ + (m_h(x~) - x~)/sigma_t`` with ``x~ = x/t`` and NW bandwidth ``h(t) = sigma_t/t``) is computed
without gradient by :func:`ipa_probe.theory.nw_velocity`, embedded by a linear map, and fused into the output MLP:
a parallel branch, not one of the ``H`` learned heads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..statistics.kernels import merge_heads, split_heads

__all__ = ["CrossAttention", "ICFMVelocityNet", "ModelConfig", "ModelOutput", "time_embedding"]


@dataclass
class ModelConfig:
    """Architecture of :class:`ICFMVelocityNet` (paper §A.3; CPU sizes of §D.0 by default).

    Args:
        dim: data dimension ``d``.
        d_model: token width (paper 128, CPU 64).
        n_heads: learned attention heads ``H`` per layer (paper 4); ``d_model`` must be divisible by it.
        n_layers: pre-norm cross-attention blocks (paper 3, CPU 2).
        ffn_mult: feed-forward width as a multiple of ``d_model`` (paper 4).
        exact_head: fuse the exact-NW velocity branch into the output MLP (paper's "ON" arm).
        sigma_min: the OT path's final noise level (paper 0.01).
    """

    dim: int
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    ffn_mult: int = 4
    exact_head: bool = False
    sigma_min: float = 0.01

    def __post_init__(self):
        for name in ("dim", "d_model", "n_heads", "n_layers", "ffn_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected a positive integer {name}, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"expected d_model divisible by n_heads, got d_model={self.d_model}, "
                f"n_heads={self.n_heads}; pick n_heads among the divisors of d_model"
            )
        if self.d_model % 2:
            raise ValueError(f"expected an even d_model for the sinusoidal time embedding, got {self.d_model}")
        if not 0 < self.sigma_min < 1:
            raise ValueError(f"expected sigma_min in (0, 1), got {self.sigma_min}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelOutput:
    """Velocity and, when asked for, the attention logits of every layer.

    Attributes:
        velocity: predicted velocity, shape ``(B, n, d)``.
        attn_logits: one tensor per layer, shape ``(B, H, n, m)``: ``q k^T / sqrt(d_k)`` (their softmax over the last
            dimension is the attention), or ``None`` when not requested.
    """

    velocity: torch.Tensor
    attn_logits: list[torch.Tensor] | None = None


def time_embedding(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal embedding of the raw flow time ``t`` in ``[0, 1]`` (not multiplied by 1000; paper §A.3).

    ``freqs_k = exp(-ln(10000) k / half)`` for ``k < half = width / 2`` and ``emb = [sin(t f), cos(t f)]``.

    Args:
        t: times, shape ``(...)``.
        width: embedding width (even).

    Returns:
        embedding, shape ``(..., width)``.
    """
    half = width // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=t.dtype) / half)
    angles = t.unsqueeze(-1) * freqs  # (..., half)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class CrossAttention(nn.Module):
    """Multi-head cross-attention with biased ``W_q, W_k, W_v, W_o`` and SDPA scale ``1/sqrt(d_k)``."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.to_q = nn.Linear(d_model, d_model)
        self.to_k = nn.Linear(d_model, d_model)
        self.to_v = nn.Linear(d_model, d_model)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(
        self, queries: torch.Tensor, keys: torch.Tensor, return_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``queries (B, n, D)`` to ``keys (B, m, D)`` (which are also the values' input).

        Returns:
            output ``(B, n, D)`` and, if ``return_logits``, the logits ``(B, H, n, m)``.
        """
        q, k, v = (split_heads(x, self.n_heads) for x in (self.to_q(queries), self.to_k(keys), self.to_v(keys)))
        if return_logits:
            logits = q @ k.transpose(-1, -2) / math.sqrt(self.d_k)  # (B, H, n, m)
            out = torch.softmax(logits, dim=-1) @ v
        else:
            logits = None
            out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(merge_heads(out)), logits  # (B, H, n, d_k) -> (B, n, D)


class _Block(nn.Module):
    """Pre-norm block: ``q <- q + MHA(LN(q), S)``, ``q <- q + FFN(LN(q))``; LN on the queries only."""

    def __init__(self, d_model: int, n_heads: int, ffn_mult: int):
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = CrossAttention(d_model, n_heads)
        self.norm_ffn = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(
            nn.Linear(d_model, ffn_mult * d_model), nn.GELU(), nn.Linear(ffn_mult * d_model, d_model)
        )

    def forward(self, q: torch.Tensor, s: torch.Tensor, return_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = self.attn(self.norm_attn(q), s, return_logits)
        q = q + out
        return q + self.ffn(self.norm_ffn(q)), logits


class ICFMVelocityNet(nn.Module):
    """In-context flow-matching velocity ``v_theta(x, t; S)`` (paper §A.3).

    - query token: ``Linear(d + d_model -> d_model)([x_t, temb(t)])``;
    - support tokens: ``Linear(d -> d_model)(s_i)`` (no time information);
    - ``n_layers`` pre-norm blocks of cross-attention (``H`` heads) and feed-forward;
    - head: ``MLP(d_model -> d_model -> d)``, or with the exact branch
      ``MLP(2 d_model -> d_model -> d)([q, Linear(d -> d_model)(u_exact)])``.

    Args:
        config: the architecture.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d, w = config.dim, config.d_model
        self.query_in = nn.Linear(d + w, w)
        self.support_in = nn.Linear(d, w)
        self.blocks = nn.ModuleList(_Block(w, config.n_heads, config.ffn_mult) for _ in range(config.n_layers))
        self.norm_out = nn.LayerNorm(w)
        head_in = 2 * w if config.exact_head else w
        self.exact_in = nn.Linear(d, w) if config.exact_head else None
        self.head = nn.Sequential(nn.Linear(head_in, w), nn.GELU(), nn.Linear(w, d))

    def exact_velocity(self, x: torch.Tensor, t: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        """The exact empirical field of the support, no gradient: ``(B, n, d)``, ``t (B, n, 1)``, ``(B, m, d)``."""
        from ..theory import nw_velocity

        dtype = torch.promote_types(x.dtype, torch.float32)  # at least float32: the field is stiff near t = 1
        with torch.no_grad():
            u = nw_velocity(x.to(dtype), t.to(dtype), support.to(dtype), sigma_min=self.config.sigma_min)
        return u.to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,
        t: float | torch.Tensor,
        support: torch.Tensor,
        return_attention: bool = False,
    ) -> ModelOutput:
        """Velocity at noisy points ``x`` and time ``t`` given the support.

        Args:
            x: noisy queries, shape ``(B, n, d)``.
            t: flow time in ``[0, 1]``: a float or a tensor of shape ``()``, ``(B,)``, ``(B, n)`` or ``(B, n, 1)``.
            support: support sets, shape ``(B, m, d)``, any ``m >= 1``.
            return_attention: also return every layer's attention logits.

        Returns:
            :class:`ModelOutput` with the velocity ``(B, n, d)``.
        """
        if x.dim() != 3 or support.dim() != 3:
            raise ValueError(
                f"expected x (B, n, d) and support (B, m, d), got {tuple(x.shape)} and {tuple(support.shape)}"
            )
        b, n, d = x.shape
        if d != self.config.dim or support.shape[-1] != d or support.shape[0] != b:
            raise ValueError(
                f"expected x and support of dimension {self.config.dim} and equal batch, got "
                f"{tuple(x.shape)} and {tuple(support.shape)}"
            )
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
        if t.dim() == 1:
            t = t.view(b, 1, 1)
        elif t.dim() == 2:
            t = t.unsqueeze(-1)
        t = t.expand(b, n, 1)  # (B, n, 1)
        q = self.query_in(torch.cat([x, time_embedding(t.squeeze(-1), self.config.d_model)], dim=-1))  # (B, n, D)
        s = self.support_in(support)  # (B, m, D)
        logits = []
        for block in self.blocks:
            q, layer_logits = block(q, s, return_attention)
            logits.append(layer_logits)
        q = self.norm_out(q)
        if self.exact_in is not None:
            u = self.exact_velocity(x, t.clamp_min(1e-5), support)
            q = torch.cat([q, self.exact_in(u)], dim=-1)  # (B, n, 2D)
        return ModelOutput(self.head(q), logits if return_attention else None)
