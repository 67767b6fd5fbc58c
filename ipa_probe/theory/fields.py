"""Exact fields of a finite support: the OT-path velocity and the VP denoisers, all NW smoothers (paper §C.2, §C.5).

Let ``S = {s_1 .. s_m}`` be the support and ``q_S = (1/m) sum_i delta(s_i)`` the empirical target.

**OT path** (``x_t = t x_1 + sigma_t x_0``, ``sigma_t = 1 - (1 - sigma_min) t``). The marginal density is
``p_t(x) = (1/m) sum_i N(x; t s_i, sigma_t^2 I)`` and the exact (marginal) velocity is the posterior average of
the conditional fields ``u_t(x | s) = (s - (1 - sigma_min) x) / sigma_t``. With ``x~ = x / t`` and ``h = sigma_t / t``
the posterior weights are Gaussian NW weights of ``x~`` at bandwidth ``h``, so

    u_t(x) = ( m_h(x~) - (1 - sigma_min) x ) / sigma_t            (form 1)
           = x~ + ( m_h(x~) - x~ ) / sigma_t                      (form 2, the paper's Prop 4.4)
           = x / t + (sigma_t / t) grad log p_t(x)                (score form, Prop 3.3).

**VP path** (``x_t = alpha_t x_0 + sigma_t eps``). The posterior weights are NW weights of ``x / alpha_t`` at
``h_t = sigma_t / alpha_t``; the optimal denoisers are ``x0^ = m_h(x / alpha_t)``,
``eps^ = (x - alpha_t x0^) / sigma_t`` and ``v^ = alpha_t eps^ - sigma_t x0^``.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_points, check_positive, check_support, check_unit_interval, row_param
from .smoothing import nw_mean

__all__ = ["T_EPS", "nw_eps", "nw_v", "nw_velocity", "nw_x0", "ot_log_density"]

#: Flow times are clamped to at least this value: ``t = 0`` is singular in ``x~ = x / t`` (as in the authors' code).
T_EPS = 1e-5

#: A VP coefficient (``alpha_t``, ``sigma_t``): a float, or a tensor broadcastable to the rows of ``x``.
Coef = float | torch.Tensor


def _ot_time(t: float | torch.Tensor, x: torch.Tensor, sigma_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate per-row flow times and clamp them to ``>= T_EPS``. Returns the columns ``(t, sigma_t)``."""
    if not 0.0 <= float(sigma_min) < 1.0:
        raise ValueError(f"expected sigma_min in [0, 1), got {sigma_min}")
    t = check_unit_interval(row_param(t, x, "flow time t")).clamp(min=T_EPS)  # (..., n, 1)
    sigma_t = 1.0 - (1.0 - sigma_min) * t
    if not bool((sigma_t > 0).all()):
        raise ValueError(
            "t = 1 with sigma_min = 0 makes sigma_t = 0 and the field singular; use sigma_min > 0 or t < 1"
        )
    return t, sigma_t


def nw_velocity(
    x: torch.Tensor,
    t: float | torch.Tensor,
    support: torch.Tensor,
    sigma_min: float = 0.01,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The exact OT-path velocity of a finite support: ``u_t(x) = (m_h(x / t) - (1 - sigma_min) x) / sigma_t``.

    ``m_h`` is the Gaussian NW mean of the support at the bandwidth ``h(t) = sigma_t / t`` (paper §C.2, form 1;
    equal to form 2 ``x~ + (m_h(x~) - x~) / sigma_t`` with ``x~ = x / t``). Integrating it from ``t ~ 0`` to 1
    transports ``N(0, I)`` onto the support, blurred by ``sigma_min`` (the noise level at ``t = 1``, in ``[0, 1)``).
    Shapes as in :mod:`~ipa_probe.theory.smoothing` (``x`` the queries); the flow times ``t`` in ``[0, 1]`` are a
    float or broadcastable to the rows of ``x``, clamped to ``>= T_EPS = 1e-5``. Returns ``x``'s shape.

    Example:
        >>> s = torch.tensor([[1.0, 2.0]])  # m = 1: every point flows to s (up to sigma_min)
        >>> nw_velocity(torch.zeros(1, 2), 0.5, s)
        tensor([[1.9802, 3.9604]])
    """
    check_points(x, "x")
    support = check_support(support, x)
    t, sigma_t = _ot_time(t, x, sigma_min)
    m = nw_mean(x / t, support, sigma_t / t, chunk_size=chunk_size)
    return (m - (1.0 - sigma_min) * x) / sigma_t


def ot_log_density(
    x: torch.Tensor, t: float | torch.Tensor, support: torch.Tensor, sigma_min: float = 0.01
) -> torch.Tensor:
    """Log of the OT-path marginal density ``p_t(x) = (1/m) sum_i N(x; t s_i, sigma_t^2 I)``.

    Its gradient is the score of the score form ``u_t(x) = x / t + (sigma_t / t) grad log p_t(x)``, and
    ``t^d p_t(t x~)`` is the Gaussian KDE of the support at bandwidth ``h(t)`` (paper Prop 4.2). Arguments as in
    :func:`nw_velocity`; shape ``(n,)`` or ``(B, n)``.
    """
    check_points(x, "x")
    support = check_support(support, x)
    t, sigma_t = _ot_time(t, x, sigma_min)
    d, m = x.shape[-1], support.shape[-2]
    # |x - t s_i|^2 directly (no dot-product expansion), so that autograd of this form is independent of nw_mean.
    sq_dist = (x.unsqueeze(-2) - t.unsqueeze(-1) * support.unsqueeze(-3)).square().sum(-1)  # (..., n, m)
    log_kernel = -sq_dist / (2 * sigma_t * sigma_t) - d * torch.log(sigma_t) - 0.5 * d * math.log(2 * math.pi)
    return torch.logsumexp(log_kernel, dim=-1) - math.log(m)


def _vp_mean(
    x: torch.Tensor, alpha_t: Coef, sigma_t: Coef, support: torch.Tensor, chunk_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and return ``(alpha_t, sigma_t, x0^)`` with the coefficients as row columns ``(..., n, 1)``."""
    check_points(x, "x")
    support = check_support(support, x)
    alpha_t = check_positive(row_param(alpha_t, x, "alpha_t"), "alpha_t")
    sigma_t = check_positive(row_param(sigma_t, x, "sigma_t"), "sigma_t")
    x0 = nw_mean(x / alpha_t, support, sigma_t / alpha_t, chunk_size=chunk_size)
    return alpha_t, sigma_t, x0


def nw_x0(
    x: torch.Tensor, alpha_t: Coef, sigma_t: Coef, support: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """The optimal VP denoiser (x0-prediction) of a finite support: ``x0^(x) = m_h(x / alpha_t)``.

    The bandwidth is ``h = sigma_t / alpha_t`` and the weights are the posterior
    ``P(x_0 = s_i | x_t = x) = softmax_i(-|x - alpha_t s_i|^2 / (2 sigma_t^2))``
    (paper §C.5). ``x``: noisy points (latents flattened to vectors), shapes as in :func:`nw_velocity`; ``alpha_t =
    sqrt(abar_t)`` (e.g. ``VPSchedule(...)(timestep).alpha_t``) and ``sigma_t = sqrt(1 - abar_t)``: floats or
    broadcastable to the rows of ``x``, > 0. Returns ``x``'s shape.
    """
    return _vp_mean(x, alpha_t, sigma_t, support, chunk_size)[2]


def nw_eps(
    x: torch.Tensor, alpha_t: Coef, sigma_t: Coef, support: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """The optimal VP noise prediction ``eps^(x) = (x - alpha_t x0^(x)) / sigma_t`` (paper §C.5).

    The score of the noisy marginal is ``-eps^ / sigma_t``. Arguments as in :func:`nw_x0`; returns ``x``'s shape.
    """
    alpha_t, sigma_t, x0 = _vp_mean(x, alpha_t, sigma_t, support, chunk_size)
    return (x - alpha_t * x0) / sigma_t


def nw_v(
    x: torch.Tensor, alpha_t: Coef, sigma_t: Coef, support: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """The optimal VP v-prediction ``v^(x) = alpha_t eps^(x) - sigma_t x0^(x)`` (paper §C.5).

    Arguments as in :func:`nw_x0`; returns ``x``'s shape.
    """
    alpha_t, sigma_t, x0 = _vp_mean(x, alpha_t, sigma_t, support, chunk_size)
    return alpha_t * (x - alpha_t * x0) / sigma_t - sigma_t * x0
