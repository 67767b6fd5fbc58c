"""ODE sampling along the OT path for any velocity callable: the exact NW field or a learned model (paper §C.2).

The flow runs from noise at ``t ~ 0`` to data at ``t = 1``. ``t = 0`` itself is singular for the exact field
(``x~ = x / t``), so sampling starts at ``t_min = 1e-5``. Near ``t = 1`` the exact field is stiff (``1 / sigma_t``
reaches ``1 / sigma_min = 100``) but contracting, so explicit Euler on 100 grid points is stable; this is the
authors' protocol (``linspace(1e-5, 1, 100)``, i.e. 99 Euler steps). :func:`odeint_sample` integrates the same ODE
with an adaptive solver from torchdiffeq.

A velocity callable has the signature ``velocity_fn(x, t) -> v`` with ``x`` of shape ``(..., n, d)``, ``t`` a
0-dim tensor (one time for every row) in ``x``'s dtype and device, and ``v`` of ``x``'s shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fields import T_EPS, nw_velocity

__all__ = ["VelocityFn", "euler_sample", "odeint_sample", "sample_nw_flow"]

#: torchdiffeq's adaptive Runge–Kutta solvers, which accept the ``step_t`` option.
_ADAPTIVE_METHODS = frozenset({"dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun"})

#: ``velocity_fn(x, t) -> v``: ``x`` and ``v`` of shape ``(..., n, d)``, ``t`` a 0-dim tensor.
VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_interval(t_min: float, t_max: float) -> None:
    if not 0.0 <= t_min < t_max <= 1.0:
        raise ValueError(f"expected 0 <= t_min < t_max <= 1, got t_min = {t_min}, t_max = {t_max}")


def _checked_velocity(velocity_fn: VelocityFn, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    v = velocity_fn(x, t)
    if not isinstance(v, torch.Tensor) or v.shape != x.shape:
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"expected velocity_fn(x, t) to return a tensor of x's shape {tuple(x.shape)}, got {shape}")
    return v


def euler_sample(
    velocity_fn: VelocityFn,
    x0: torch.Tensor,
    n_steps: int = 100,
    t_min: float = T_EPS,
    t_max: float = 1.0,
    trajectory: bool = False,
) -> torch.Tensor:
    """Integrate ``dx/dt = velocity_fn(x, t)`` with explicit Euler on ``linspace(t_min, t_max, n_steps)``.

    ``n_steps`` counts grid points, as in the authors' code: the default makes 99 Euler updates
    ``x <- x + (t_{k+1} - t_k) velocity_fn(x, t_k)``. Gradients flow if the caller's grad mode allows; wrap the
    call in ``torch.no_grad()`` to sample a learned model cheaply. ``x0``: the starting points at ``t_min`` (usually
    ``N(0, I)`` noise); ``0 <= t_min < t_max <= 1``. Returns the points at ``t_max``, or with ``trajectory=True`` the
    states at every grid time, ``(n_steps, *x0.shape)``.

    Example:
        >>> support = torch.randn(50, 2)
        >>> samples = euler_sample(lambda x, t: nw_velocity(x, t, support), torch.randn(500, 2))
    """
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 2:
        raise ValueError(f"expected n_steps (grid points) an int >= 2, got {n_steps!r}")
    _check_interval(t_min, t_max)
    grid = torch.linspace(t_min, t_max, n_steps, dtype=torch.float64).to(dtype=x0.dtype, device=x0.device)
    x = x0
    states = [x0] if trajectory else None
    for k in range(n_steps - 1):
        x = x + (grid[k + 1] - grid[k]) * _checked_velocity(velocity_fn, x, grid[k])
        if states is not None:
            states.append(x)
    return torch.stack(states) if states is not None else x


def odeint_sample(
    velocity_fn: VelocityFn,
    x0: torch.Tensor,
    t_min: float = T_EPS,
    t_max: float = 1.0,
    method: str = "dopri5",
    rtol: float = 1e-5,
    atol: float = 1e-5,
    options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Integrate ``dx/dt = velocity_fn(x, t)`` from ``t_min`` to ``t_max`` with torchdiffeq's ``odeint``.

    The default adaptive Dormand–Prince solver (``dopri5``) takes small steps where the exact field is stiff (near
    ``t = 1``) and large ones elsewhere. Any torchdiffeq method works (``"euler"`` and ``"rk4"`` need
    ``options={"step_size": ...}``, passed to ``odeint`` with ``rtol`` and ``atol``). Returns the points at ``t_max``.
    """
    from torchdiffeq import odeint  # optional at import time: only this function needs it

    _check_interval(t_min, t_max)
    times = torch.tensor([t_min, t_max], dtype=x0.dtype, device=x0.device)
    options = dict(options or {})
    if method in _ADAPTIVE_METHODS:
        # Land a step exactly on t_max: torchdiffeq otherwise steps past the end and interpolates back, which
        # would evaluate the field at t > 1.
        options.setdefault("step_t", times[-1:])

    def func(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # torchdiffeq's argument order
        # The initial step-size heuristic probes f at t_min + h0, which can lie past t_max: keep it in range.
        return _checked_velocity(velocity_fn, x, t.clamp(t_min, t_max))

    return odeint(func, x0, times, method=method, rtol=rtol, atol=atol, options=options)[-1]


def sample_nw_flow(
    support: torch.Tensor,
    n_samples: int,
    n_steps: int = 100,
    sigma_min: float = 0.01,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw samples from the plug-in model: noise ``N(0, I)`` carried to ``t = 1`` by the exact NW field.

    This is the paper's plug-in baseline (Euler on ``linspace(1e-5, 1, n_steps)``); the samples land on the
    support points, blurred by about ``sigma_min``. ``support``: ``(m, d)`` or ``(B, m, d)`` (one per task); returns
    ``(n_samples, d)`` or ``(B, n_samples, d)`` in its dtype, the noise drawn from ``generator`` on its device.
    """
    if not isinstance(support, torch.Tensor) or support.ndim not in (2, 3) or not support.is_floating_point():
        raise ValueError(
            f"expected a floating support of shape (m, d) or (B, m, d), got "
            f"{tuple(support.shape) if isinstance(support, torch.Tensor) else type(support).__name__}"
        )
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"expected n_samples an int >= 1, got {n_samples!r}")
    shape = support.shape[:-2] + (n_samples, support.shape[-1])
    x0 = torch.randn(shape, generator=generator, dtype=support.dtype, device=support.device)
    return euler_sample(lambda x, t: nw_velocity(x, t, support, sigma_min), x0, n_steps=n_steps)
