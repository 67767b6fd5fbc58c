"""When a denoiser pass starts a new pipeline call: the call boundaries of a probe run, from evidence.

The evidence is what the pass itself shows, never a pipeline's local variables:

- **which pipeline runs.** The nearest ``DiffusionPipeline.__call__`` frame on the Python stack above the
  denoiser's forward, and the pipeline it belongs to, are identified (by identity only): a new frame is a new call.
  That pipeline may be the probed one or a ``from_pipe`` sibling sharing its denoiser with its own scheduler.
- **a loop that starts over inside one call.** diffusers' loops run their timesteps in decreasing order, so a pass
  whose timestep rises above the previous pass's starts the loop again (AnimateDiff's FreeInit re-runs the whole loop
  per iteration): a new call, so that ``step`` stays the loop index. The timestep is compared only when it is on the
  host (a Python number or a CPU tensor, read without a device sync). A device tensor is not read; there a restart
  shows as a timestep that is an element of another tensor than the previous pass's (the loop iterates a new
  ``timesteps`` tensor, as ``set_timesteps`` makes one) or as the running scheduler's ``step_index`` going back.
- **outside any pipeline call** (research code calling ``pipe.unet`` itself) a new call starts when the probed
  pipeline's ``scheduler.timesteps`` is a new tensor (``set_timesteps`` ran).

A pipeline that restores its scheduler's state between passes of one step (``StableDiffusionPanoramaPipeline``
deep-copies it per view) shows none of these: its views repeat the step's timestep and step index in one frame.

The planned number of steps is the running pipeline's own ``num_timesteps`` where the pipeline sets it, else its
scheduler's ``timesteps`` past ``begin_index``.

Nothing here synchronises with the device: frames, pipelines and tensors are compared by identity, and a timestep's
value only when it already is on the host.
"""

from __future__ import annotations

import inspect
from types import FrameType
from typing import Any

import torch
from diffusers import DiffusionPipeline

__all__ = ["CallClock", "host_timestep", "running_pipeline_frame"]


def running_pipeline_frame(start: FrameType | None = None) -> FrameType | None:
    """The nearest frame on the stack (from ``start``, or the caller) running a ``DiffusionPipeline.__call__``."""
    frame = start if start is not None else inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__call__" and code.co_argcount and code.co_varnames[0] == "self":
            if isinstance(frame.f_locals.get("self"), DiffusionPipeline):
                return frame
        frame = frame.f_back
    return None


def host_timestep(timestep: Any) -> float | None:
    """A denoiser pass's timestep as a float when that needs no device sync (a Python number or a CPU tensor, its
    first element for a per-item tensor), else ``None``."""
    if isinstance(timestep, bool):
        return None
    if isinstance(timestep, int | float):
        return float(timestep)
    if isinstance(timestep, torch.Tensor) and timestep.device.type == "cpu" and timestep.numel() > 0:
        # through numpy: a view of the host memory, no dispatched scalar read
        return float(timestep.detach().reshape(-1)[:1].double().numpy()[0])  # bfloat16 has no numpy type
    return None


def _iterated(timestep: Any) -> torch.UntypedStorage | None:
    """The storage of the tensor a timestep tensor is an element of (the loop's ``timesteps`` when the loop passes its
    element: the storage holds more than the timestep spans), else ``None``."""
    if not isinstance(timestep, torch.Tensor) or timestep.numel() == 0:
        return None
    extent = sum((n - 1) * s for n, s in zip(timestep.shape, timestep.stride(), strict=True))
    storage = timestep.untyped_storage()
    return storage if storage.nbytes() > (extent + 1) * timestep.element_size() else None  # a part of it


def _step_index(pipe) -> int | None:
    """The running scheduler's ``step_index`` (``None`` before its first step, or for a scheduler without one)."""
    index = getattr(getattr(pipe, "scheduler", None), "step_index", None)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


class CallClock:
    """Tells whether each denoiser pass starts a new pipeline call, and which pipeline is running.

    It holds the running call's frame until the next call or :meth:`reset`, so that an identity can never be reused
    by a later object.

    Args:
        pipe: the probed pipeline (its scheduler is the evidence outside any pipeline call).
    """

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        #: the pipeline whose ``__call__`` is running (the probed pipeline outside any call)
        self.running = pipe
        self._frame: FrameType | None = None
        self._timesteps: Any = None  # the probed scheduler's timesteps, outside any pipeline call
        self._timestep: float | None = None  # the previous pass's timestep, when it was on the host
        self._step_index: int | None = None  # the running scheduler's step index at the previous pass
        # the storage the previous pass's timestep was an element of (held: its memory cannot be reused meanwhile)
        self._iterated: torch.UntypedStorage | None = None

    def new_call(self, timestep: Any = None) -> bool:
        """Called at the start of every denoiser pass: whether it starts a new call (updates :attr:`running`).

        Args:
            timestep: the pass's timestep as the denoiser got it (:meth:`~.taps.Tap.timestep`).
        """
        frame = running_pipeline_frame()
        value = host_timestep(timestep)
        if frame is not None:
            running = frame.f_locals["self"]
            index, iterated = _step_index(running), _iterated(timestep)
            new = frame is not self._frame or self._restarts(value, iterated, index)
            self._frame, self._timesteps, self.running = frame, None, running
            self._timestep, self._step_index, self._iterated = value, index, iterated
            return new
        timesteps = getattr(getattr(self.pipe, "scheduler", None), "timesteps", None)
        new = self._frame is not None or timesteps is not self._timesteps
        self._frame, self._timesteps, self.running = None, timesteps, self.pipe
        self._timestep, self._step_index, self._iterated = value, None, None
        return new

    def _restarts(self, value: float | None, iterated: torch.Tensor | None, index: int | None) -> bool:
        """Whether a pass in the running call's frame starts its loop over: its timestep rose above the previous
        pass's (both on the host); else (a device timestep) it is an element of another tensor than the previous
        pass's, or the scheduler's step index went back."""
        if value is not None and self._timestep is not None:
            return value > self._timestep
        if iterated is not None and self._iterated is not None and iterated.data_ptr() != self._iterated.data_ptr():
            return True
        return self._step_index is not None and (index is None or index < self._step_index)

    def planned_steps(self) -> int | None:
        """How many steps the running call's loop has, or ``None`` when unknown: the pipeline's ``num_timesteps``
        where it sets one (inside its call), else its scheduler's ``timesteps`` past ``begin_index``."""
        planned = getattr(self.running, "num_timesteps", None) if self._frame is not None else None
        if isinstance(planned, int) and not isinstance(planned, bool):
            return planned
        scheduler = getattr(self.running, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        try:
            total = len(timesteps)
        except TypeError:
            return None
        begin = getattr(scheduler, "begin_index", None)
        return total - begin if isinstance(begin, int) and not isinstance(begin, bool) else total

    def reset(self) -> None:
        """Forget the call (drops the frame, and with it the call's locals)."""
        self._frame, self._timesteps, self.running = None, None, self.pipe
        self._timestep = self._step_index = self._iterated = None
