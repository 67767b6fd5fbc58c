"""Input validation shared by the theory modules: shapes of points, supports and per-row parameters.

Conventions: a *point set* is ``(n, d)`` (one task) or ``(B, n, d)`` (``B`` tasks); a *support* is ``(m, d)`` or
``(B, m, d)``. A *per-row parameter* (flow time ``t``, bandwidth ``h``, ``alpha_t``, ``sigma_t``) is a float or a
tensor that broadcasts to the rows of the point set: ``()``, ``(n,)``, ``(B, n)``, ``(B, 1)`` or any of them with a
trailing singleton. It is returned as a column of shape ``x.shape[:-1] + (1,)`` ready to multiply ``(..., n, d)`` or
``(..., n, m)`` tensors.
"""

from __future__ import annotations

import torch


def check_points(x: torch.Tensor, name: str) -> torch.Tensor:
    """Raise unless ``x`` is a floating tensor of shape ``(n, d)`` or ``(B, n, d)`` with ``n, d >= 1``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}; wrap it with torch.as_tensor")
    if x.ndim not in (2, 3):
        raise ValueError(
            f"expected {name} of shape (n, d) or (B, n, d), got {tuple(x.shape)}; "
            "flatten image-like points to vectors first"
        )
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point {name}, got {x.dtype}; convert it with .float() or .double()")
    if x.shape[-1] == 0:
        raise ValueError(f"expected {name} with at least one coordinate, got shape {tuple(x.shape)}")
    return x


def check_support(support: torch.Tensor, x: torch.Tensor, name: str = "support") -> torch.Tensor:
    """Raise unless ``support`` is ``(m, d)`` or ``(B, m, d)`` with ``m >= 1``, matching ``x`` in ``d`` and ``B``.

    Returns the support cast to ``x``'s dtype.
    """
    check_points(support, name)
    if support.shape[-2] == 0:
        raise ValueError(f"expected a non-empty {name} (m >= 1 points), got shape {tuple(support.shape)}")
    if support.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"expected {name} points of the same dimension as the queries, got d = {support.shape[-1]} "
            f"for {name} {tuple(support.shape)} and d = {x.shape[-1]} for queries {tuple(x.shape)}"
        )
    if support.ndim == 3 and x.ndim == 3 and support.shape[0] not in (1, x.shape[0]):
        raise ValueError(
            f"expected one {name} per task (same batch size B), got {support.shape[0]} supports "
            f"for {x.shape[0]} query tasks"
        )
    if support.device != x.device:
        raise ValueError(f"expected {name} on the queries' device {x.device}, got {support.device}")
    return support.to(x.dtype)


def row_param(value: float | torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    """Broadcast a per-row parameter to a column of shape ``x.shape[:-1] + (1,)`` in ``x``'s dtype and device."""
    value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if value.is_complex():
        raise TypeError(f"expected a real {name}, got {value.dtype}")
    # A trailing singleton marks a column already; otherwise the value is per row and gains one.
    column = value if (value.ndim == x.ndim and value.shape[-1] == 1) else value.unsqueeze(-1)
    target = x.shape[:-1] + (1,)
    try:
        return column.broadcast_to(target)
    except RuntimeError:
        raise ValueError(
            f"expected {name} as a float or a tensor broadcastable to the rows of the points "
            f"(shape (), {tuple(x.shape[-2:-1])}, {tuple(x.shape[:-1])} or {tuple(target)}), "
            f"got shape {tuple(value.shape)} for points {tuple(x.shape)}"
        ) from None


def check_positive(value: torch.Tensor, name: str) -> torch.Tensor:
    """Raise unless every entry of ``value`` is > 0 (NaN fails too)."""
    if not bool((value > 0).all()):
        bad = value[~(value > 0)].flatten()[0].item()
        raise ValueError(f"expected {name} > 0 everywhere, got {bad}; a bandwidth must be strictly positive")
    return value


def check_unit_interval(t: torch.Tensor, name: str = "t") -> torch.Tensor:
    """Raise unless every entry of ``t`` lies in ``[0, 1]`` (NaN fails too)."""
    inside = (t >= 0) & (t <= 1)
    if not bool(inside.all()):
        bad = t[~inside].flatten()[0].item()
        raise ValueError(f"expected flow time {name} in [0, 1] (0 = noise, 1 = data), got {bad}")
    return t
