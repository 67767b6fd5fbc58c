"""When a denoiser pass starts a new pipeline call: the call boundaries of a probe run.

A pipeline call is the running ``__call__`` of a diffusers pipeline, found on the Python stack above the denoiser's
forward (the nearest frame of a ``DiffusionPipeline.__call__``). That pipeline may be the probed one or a
``from_pipe`` sibling sharing its denoiser with its own scheduler, and a pipeline may restore its scheduler's state
between passes of one step (``StableDiffusionPanoramaPipeline`` deep-copies it per view): the call follows the
pipeline that runs, never a scheduler object. Inside one call, a loop that starts over with a new ``timesteps``
sequence (AnimateDiff's FreeInit re-runs the whole loop per iteration) starts a new call, so that ``step`` stays the
loop index.

A loop that is no pipeline's ``__call__`` (research code calling ``pipe.unet`` itself) has no such frame; there a new
call starts when the probed pipeline's ``scheduler.timesteps`` is a new tensor (``set_timesteps`` ran).

Nothing here synchronises with the device: frames and tensors are compared by identity.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from diffusers import DiffusionPipeline

__all__ = ["CallClock", "running_pipeline_frame"]


def running_pipeline_frame(start: FrameType | None = None) -> FrameType | None:
    """The nearest frame on the stack (from ``start``, or the caller) running a ``DiffusionPipeline.__call__``."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__call__" and code.co_argcount and code.co_varnames[0] == "self":
            if isinstance(frame.f_locals.get("self"), DiffusionPipeline):
                return frame
        frame = frame.f_back
    return None


class CallClock:
    """Tells whether each denoiser pass starts a new pipeline call, and which pipeline is running.

    It holds the running call's frame (and its ``timesteps``) until the next call or :meth:`reset`, so that an
    identity can never be reused by a later object.

    Args:
        pipe: the probed pipeline (its scheduler is the fallback outside any pipeline call).
    """

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        #: the pipeline whose ``__call__`` is running (the probed pipeline outside any call)
        self.running = pipe
        self._frame: FrameType | None = None
        self._timesteps: Any = None

    def new_call(self) -> bool:
        """Called at the start of every denoiser pass: whether it starts a new call (updates :attr:`running`)."""
        frame = running_pipeline_frame(sys._getframe(1))
        if frame is not None:
            timesteps = frame.f_locals.get("timesteps")
            new = frame is not self._frame or timesteps is not self._timesteps
            self._frame, self._timesteps, self.running = frame, timesteps, frame.f_locals["self"]
            return new
        timesteps = getattr(getattr(self.pipe, "scheduler", None), "timesteps", None)
        new = self._frame is not None or timesteps is not self._timesteps
        self._frame, self._timesteps, self.running = None, timesteps, self.pipe
        return new

    def planned_steps(self) -> int | None:
        """How many steps the running call's loop has (its ``timesteps``), or ``None`` when unknown."""
        timesteps = self._timesteps
        if timesteps is None:
            timesteps = getattr(getattr(self.running, "scheduler", None), "timesteps", None)
        try:
            return len(timesteps)
        except TypeError:
            return None

    def reset(self) -> None:
        """Forget the call (drops the frame, and with it the call's locals)."""
        self._frame, self._timesteps, self.running = None, None, self.pipe
