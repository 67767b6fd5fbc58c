"""The probe's device buffers of one pipeline call: per-cell sums and counts, grown by doubling, never synced."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..statistics.schema import CELL_FIELDS

__all__ = ["CallBuffers", "grow", "new_buffers"]


@dataclass
class CallBuffers:
    """Buffers of one pipeline call, on the device until the run ends."""

    index: int
    sums: torch.Tensor  # (steps, layers, slots, labels, heads, fields)
    counts: torch.Tensor  # (steps, layers, slots, labels, heads)
    timesteps: torch.Tensor  # (steps,)
    steps_seen: int = 0
    incomplete: set[int] = field(default_factory=set)  # steps whose denoiser pass did not finish
    edits: dict[int, list[str]] = field(default_factory=dict)  # step -> the edits that acted in it, in order


def new_buffers(index: int, device: torch.device, shape: tuple[int, ...]) -> CallBuffers:
    """Zeroed buffers of ``shape`` ``(steps, layers, slots, labels, heads)`` cells of :data:`CELL_FIELDS` each."""
    return CallBuffers(
        index=index,
        sums=torch.zeros(*shape, len(CELL_FIELDS), device=device),
        counts=torch.zeros(shape, device=device),
        timesteps=torch.full((shape[0],), math.nan, device=device),
    )


def grow(call: CallBuffers) -> None:
    """Double the step capacity (a pipeline ran more steps than it announced)."""
    call.sums = torch.cat([call.sums, torch.zeros_like(call.sums)])
    call.counts = torch.cat([call.counts, torch.zeros_like(call.counts)])
    call.timesteps = torch.cat([call.timesteps, torch.full_like(call.timesteps, math.nan)])
