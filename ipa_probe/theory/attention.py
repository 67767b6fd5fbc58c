"""The exact OT-path velocity as one cross-attention head with zero parameters (paper §C.3, Thm 5.2 / Cor 5.3).

The Gaussian logits split into a dot product and terms that a softmax ignores or that depend on one side only:

    -|x~ - s_i|^2 / (2 h^2) = x~·s_i / h^2 - |s_i|^2 / (2 h^2) - |x~|^2 / (2 h^2).

Lifting both sides by one coordinate turns the first two terms into a plain dot product,

    k_i = [ s_i , -|s_i|^2 / 2 ]                                           (time-free keys),
    q(x, t) = [ x~ / h^2 , 1 / h^2 ] = [ t x / sigma_t^2 , t^2 / sigma_t^2 ]   (time enters here only),

so ``softmax_i(q · k_i)`` (scale 1) are the NW weights at ``h(t)``. With values ``v_i = s_i`` the head outputs
``m_h(x~)``, and the affine map ``u = (m_h - (1 - sigma_min) x) / sigma_t``, whose coefficients depend on ``t``
only, turns it into the exact velocity. Time enters through the query alone.

:class:`ExactNWHead` computes this with :func:`torch.nn.functional.scaled_dot_product_attention`, so a fused kernel
(flash attention on CPU, memory-efficient or flash attention on CUDA) runs the softmax blockwise and no ``n x m``
matrix is formed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_points, check_support
from .fields import _ot_time

__all__ = ["ExactNWHead", "lifted_keys", "lifted_queries"]


def lifted_keys(support: torch.Tensor) -> torch.Tensor:
    """The time-free feature-lifted keys ``k_i = [s_i, -|s_i|^2 / 2]``: ``(..., m, d) -> (..., m, d + 1)``."""
    return torch.cat([support, -0.5 * support.square().sum(-1, keepdim=True)], dim=-1)


def lifted_queries(x: torch.Tensor, t: torch.Tensor, sigma_min: float = 0.01) -> torch.Tensor:
    """The feature-lifted queries ``q = [x~ / h^2, 1 / h^2] = [t x / sigma_t^2, t^2 / sigma_t^2]``, ``(..., n, d + 1)``
    for points ``(..., n, d)`` and flow times in ``(0, 1]`` broadcastable to ``(..., n, 1)``: ``q · k_i`` equals the
    Gaussian logit of ``x~`` against ``s_i`` at ``h(t)`` up to a per-row constant.
    """
    sigma_t = 1.0 - (1.0 - sigma_min) * t
    inv_h2 = (t / sigma_t).square()  # 1 / h^2, (..., n, 1)
    return torch.cat([x * (t / sigma_t.square()), inv_h2.expand(x.shape[:-1] + (1,))], dim=-1)


class ExactNWHead(nn.Module):
    """One zero-parameter cross-attention head whose output is the exact OT-path velocity of a support (§C.3).

    Queries come from the points ``x`` and the time ``t``, keys and values from the support alone:

        k_i = [s_i, -|s_i|^2 / 2],   q = [x~ / h^2, 1 / h^2],   v_i = s_i,
        m_h = SDPA(q, k, v, scale=1),   u = (m_h - (1 - sigma_min) x) / sigma_t.

    Queries and support are first centred at the support mean (the mean is added back to ``m_h``): the weights
    are translation invariant, and small coordinates keep float32 accurate. The values are padded with zero
    columns to the key width so that the fused SDPA kernels apply (they want equal head dimensions).

    The output equals :func:`~ipa_probe.theory.nw_velocity` to 1e-10 in float64, and in float32 to about 1e-5 for
    unit-scale data at moderate ``t``. In float32 both lose absolute accuracy as ``t -> 1``, like any dot-product
    form of the logits: rounding errors of size ``eps * |x~| |s| / h^2`` in the logits are divided by ``sigma_t``
    (the relative error of the velocity stays near 1e-5). ``sigma_min``: the noise level at ``t = 1``, in ``[0, 1)``.

    Example:
        >>> head = ExactNWHead()
        >>> support = torch.randn(50, 2)
        >>> x = torch.randn(256, 2)
        >>> torch.allclose(head(x, 0.5, support), nw_velocity(x, 0.5, support), atol=1e-5)
        True
    """

    def __init__(self, sigma_min: float = 0.01) -> None:
        super().__init__()
        if not 0.0 <= float(sigma_min) < 1.0:
            raise ValueError(f"expected sigma_min in [0, 1), got {sigma_min}")
        self.sigma_min = float(sigma_min)

    def extra_repr(self) -> str:
        return f"sigma_min={self.sigma_min}"

    def local_mean(self, x: torch.Tensor, t: float | torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        """The head's attention output ``m_h(x / t)``, the NW mean at ``h(t)``, shape of ``x``.

        Arguments as in :meth:`forward`.
        """
        return self._mean(x, t, support)[0]

    def forward(self, x: torch.Tensor, t: float | torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        """The support's exact velocity ``u_t(x)``, as :func:`~ipa_probe.theory.nw_velocity` takes and returns it."""
        m, t, sigma_t, x = self._mean(x, t, support)
        return (m - (1.0 - self.sigma_min) * x) / sigma_t

    def _mean(
        self, x: torch.Tensor, t: float | torch.Tensor, support: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        check_points(x, "x")
        support = check_support(support, x)
        t, sigma_t = _ot_time(t, x, self.sigma_min)  # (..., n, 1) each
        d = x.shape[-1]
        center = support.mean(-2, keepdim=True)  # (..., 1, d)
        s = support - center
        keys = lifted_keys(s)  # (..., m, d + 1)
        # x~ - c = (x - t c) / t: the centred query without forming x / t, which is huge near t = 0.
        queries = lifted_queries(x - t * center, t, self.sigma_min)  # (..., n, d + 1)
        width = d + 1
        if x.device.type == "cuda":
            width = -(-width // 8) * 8  # fused CUDA kernels want head dims that are multiples of 8
        keys = F.pad(keys, (0, width - d - 1))
        queries = F.pad(queries, (0, width - d - 1))
        values = F.pad(s, (0, width - d))  # (..., m, width)
        batch = torch.broadcast_shapes(queries.shape[:-2], keys.shape[:-2])
        q = queries.expand(batch + queries.shape[-2:]).reshape(-1, 1, *queries.shape[-2:])  # (B, 1, n, width)
        k = keys.expand(batch + keys.shape[-2:]).reshape(-1, 1, *keys.shape[-2:])  # (B, 1, m, width)
        v = values.expand(batch + values.shape[-2:]).reshape(-1, 1, *values.shape[-2:])  # (B, 1, m, width)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)  # (B, 1, n, width)
        m = out[..., :d].reshape(batch + (x.shape[-2], d)) + center  # (..., n, d)
        return m, t, sigma_t, x
