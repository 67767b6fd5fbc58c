"""``torch.compile`` of the per-row statistics (``probe(compile=True)``): the switch, the one compiled function of the
process, and the eager fallback that redraws nothing. Pure torch."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["compiled_statistics", "compiling", "run_compiled", "run_once_compiled"]


#: Whether :func:`~ipa_probe.statistics.agreement.compare_frames` runs through ``torch.compile``
#: (:func:`compiled_statistics`).
_COMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("ipa_probe_compile", default=False)
#: The compiled :func:`~ipa_probe.statistics.agreement.compare_frames` of this process (one, for every shape:
# ``dynamic=True``),  or ``False`` once compiling or running it failed (eager from then on; warned once).
_COMPILED: dict[str, Callable | bool] = {}


@contextlib.contextmanager
def compiled_statistics(enabled: bool = True) -> Iterator[None]:
    """Within the block, :func:`~ipa_probe.statistics.agreement.compare_frames` runs as ``torch.compile(compare_frames,
    dynamic=True)`` (one compile per process for every shape: inductor fuses the statistics' some 300 small
    operations; the random draws of the nulls stay eager, at a graph break, from the same generators). Where the
    installed torch cannot compile (no C++ compiler, an unsupported device or operation), the first failure warns
    once and the eager function runs from then on, from the generators' states before the failed call: the numbers
    equal eager's up to float32 rounding (fused reductions may sum in another order; tests/test_stats_compile.py
    holds them to 1e-6). Used by ``probe(compile=True)`` (:attr:`~ipa_probe.capture.config.ProbeConfig.compile`)."""
    token = _COMPILE.set(enabled)
    try:
        yield
    finally:
        _COMPILE.reset(token)


def compiling() -> bool:
    """Whether the caller is inside :func:`compiled_statistics`."""
    return _COMPILE.get()


def run_compiled(eager: Callable[..., list[torch.Tensor]], *args) -> list[torch.Tensor]:
    """``eager(*args)`` (the statistics of :func:`~ipa_probe.statistics.agreement.compare_frames`) through its compiled
    form (``dynamic=True``), or eagerly (warned once) where compiling or running it fails."""
    generators = [draws for _, _, draws in args[1] if isinstance(draws, torch.Generator)]  # not keys drawn before
    return run_once_compiled("compare_frames", eager, generators, *args, dynamic=True)


def run_once_compiled(
    name: str,
    eager: Callable[..., Any],
    generators: Sequence[torch.Generator],
    *args,
    dynamic: bool = False,
    undo: Callable[[], None] | None = None,
) -> Any:
    """``eager(*args)`` through ``torch.compile(eager, dynamic=dynamic)``, compiled once per process under ``name``
    (dynamo recompiles it for other shapes or branches), or eagerly where compiling or running it fails: warned once,
    ``generators`` put back to their states before the failed call (the eager run draws what eager would have drawn)
    and ``undo`` called to put back what the failed call changed."""
    compiled = _COMPILED.get(name)
    if compiled is None:
        try:
            compiled = torch.compile(eager, dynamic=dynamic)
        except Exception as err:  # noqa: BLE001 - any failure of the installed torch's compiler means eager
            compiled = _compile_failed(err)
        _COMPILED[name] = compiled
    if compiled is False:
        return eager(*args)
    states = [g.get_state() for g in generators]
    try:
        return compiled(*args)
    except Exception as err:  # noqa: BLE001
        _COMPILED[name] = _compile_failed(err)
        for g, state in zip(generators, states, strict=True):  # the draws eager would have made
            g.set_state(state)
        if undo is not None:
            undo()
        return eager(*args)


def _compile_failed(err: Exception) -> bool:
    warnings.warn(
        f"compile=True: torch.compile of the probe's statistics failed ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}); the statistics run eagerly (the same numbers)",
        RuntimeWarning,
        stacklevel=4,
    )
    return False
