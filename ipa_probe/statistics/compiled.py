"""``torch.compile`` of the probe's per-step pass (``probe(compile=True)``): each compiled function of the process, and
the eager fallback. Pure torch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_compiled"]

#: The compiled functions of this process by name (``torch.compile(fn, dynamic=False)``: dynamo compiles again for
#: another shape or branch), or ``False`` once compiling or running one failed (eager from then on; warned once).
_COMPILED: dict[str, Callable | bool] = {}


def run_compiled(name: str, eager: Callable[..., Any], *args, undo: Callable[[], None] | None = None) -> Any:
    """``eager(*args)`` through its compiled form, compiled once per process under ``name``, or eagerly where the
    installed torch cannot compile it (no C++ compiler, an unsupported device or operation) or the compiled call
    fails: warned once, ``undo()`` putting back what the failed call changed before the eager run. ``eager`` draws
    nothing (dynamo cannot trace a generator: the caller draws the keys beforehand), so the eager run gives the very
    numbers a fallback promises; the compiled ones equal eager's up to float32 rounding (fused reductions sum in
    another order)."""
    compiled = _COMPILED.get(name)
    if compiled is None:
        try:
            compiled = torch.compile(eager, dynamic=False)
        except Exception as err:  # noqa: BLE001 - any failure of the installed torch's compiler means eager
            compiled = _compile_failed(err)
        _COMPILED[name] = compiled
    if compiled is False:
        return eager(*args)
    try:
        return compiled(*args)
    except Exception as err:  # noqa: BLE001
        _COMPILED[name] = _compile_failed(err)
        if undo is not None:
            undo()
        return eager(*args)


def _compile_failed(err: Exception) -> bool:
    warnings.warn(
        f"compile=True: torch.compile of the probe's per-step pass failed ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}); the pass runs eagerly (the same numbers)",
        RuntimeWarning,
        stacklevel=4,
    )
    return False
