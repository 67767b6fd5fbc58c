"""The NW bandwidth setting shared by the probe, the NW head and the command line: parse, check, resolve, describe.

A bandwidth *spec* is what a user passes: a keyword (``"matched"``: ``h^2 = sqrt(d_head)``, the attention's own
temperature; the probe also accepts ``"fit"``), a positive float ``h``, or a callable of the timestep. The callable
receives the denoiser's current timestep as a 0-d tensor on the device (scheduler scale, 0-1000) and returns a float
or a 0-d tensor; keep it free of ``.item()`` / ``float()`` so that the denoising loop never waits for the device.
A float it returns is range-checked (outside :data:`~ipa_probe._checks.BANDWIDTH_RANGE`: ``ValueError``); a tensor is
not read back, so a non-positive one shows up as non-finite weights, counted in the ``nonfinite`` column.

- :func:`parse`: a command-line string or manifest cell -> spec (:func:`argument_type` for argparse);
- :func:`check`: validate a spec (the one validator), ints become floats;
- :func:`resolve`: the ``h`` a spec gives for a head width and a timestep, one value per timestep (shape checked);
- :func:`describe`: a JSON-friendly form (a callable by its name).
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from .._checks import BANDWIDTH_RANGE, parse_bandwidth
from .kernels import matched_bandwidth

__all__ = ["BandwidthSpec", "argument_type", "check", "describe", "parse", "resolve"]

#: A bandwidth setting: a keyword, a positive float ``h`` or a callable of the timestep.
BandwidthSpec = str | float | Callable[[torch.Tensor], Any]


def _expected(keywords: tuple[str, ...]) -> str:
    return f"expected {', '.join(repr(k) for k in keywords)}, a positive float or a callable of the timestep"


def check(spec: Any, keywords: tuple[str, ...] = ("matched",)) -> BandwidthSpec:
    """Validate a bandwidth spec.

    Args:
        spec: the setting to check.
        keywords: the keywords this caller accepts (the probe: ``("matched", "fit")``).

    Returns:
        the spec, with an int made a float.

    Raises:
        ValueError: an unknown keyword or a number that is not positive and finite.
        TypeError: anything else.
    """
    if isinstance(spec, str):
        if spec not in keywords:
            raise ValueError(f"bandwidth: {_expected(keywords)}, got {spec!r}")
        return spec
    if isinstance(spec, bool) or not (callable(spec) or isinstance(spec, int | float)):
        raise TypeError(f"bandwidth: {_expected(keywords)}, got {spec!r}")
    if callable(spec):
        return spec
    return _check_value(spec)


def _check_value(h: float) -> float:
    """A numeric bandwidth inside :data:`BANDWIDTH_RANGE` (outside it float32 NW weights overflow or go uniform)."""
    low, high = BANDWIDTH_RANGE
    if not (math.isfinite(h) and low <= h <= high):
        raise ValueError(
            f"bandwidth: expected a positive number h in [{low:g}, {high:g}], got {h}; e.g. 1.0 or 'matched' "
            "(outside this range float32 NW weights overflow or become uniform)"
        )
    return float(h)


def parse(value: str | float, keywords: tuple[str, ...] = ("matched",)) -> str | float:
    """A spec from text or a plain number (a command-line argument, a manifest cell): one of ``keywords`` or a
    positive number in :data:`ipa_probe._checks.BANDWIDTH_RANGE`, where float32 NW weights stay finite (a numeric
    string is converted; surrounding spaces are ignored). The parser itself lives in :mod:`ipa_probe._checks`,
    which imports no torch, so the command line checks ``--bandwidth`` before torch loads.

    Raises:
        ValueError: anything else, with the accepted forms in the message.
    """
    return parse_bandwidth(value, keywords)


def argument_type(*keywords: str) -> Callable[[str], str | float]:
    """An argparse ``type`` accepting ``keywords`` (e.g. ``"matched"``, ``"fit"``) or a positive number."""

    def bandwidth(text: str) -> str | float:
        try:
            return parse(text, keywords)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return bandwidth


def resolve(
    spec: BandwidthSpec, head_dim: int, timestep: torch.Tensor | None = None, device: torch.device | None = None
) -> float | torch.Tensor:
    """The bandwidth ``h`` a checked spec gives now: ``"matched"`` (``h = head_dim ** 0.25``), a positive float, or
    a callable of the 0-d ``timestep`` (required then), whose value is a 0-d float32 tensor on ``device``. Callers
    map their own keywords, such as the probe's ``"fit"``, before resolving.

    Raises:
        RuntimeError: a callable spec but no timestep.
        ValueError: an unknown keyword, a callable that returns something other than a number or a tensor (a string,
            ``None``), more than one value, or a float outside the range; each names ``bandwidth``.
    """
    if isinstance(spec, str):
        if spec != "matched":
            raise ValueError(f"bandwidth: cannot resolve the keyword {spec!r}; expected 'matched'")
        return matched_bandwidth(head_dim)
    if not callable(spec):
        return float(spec)
    if timestep is None:
        raise RuntimeError(
            "the bandwidth is a callable of the timestep, but no timestep was seen: call the pipeline (or its "
            "denoiser) so that the timestep hook sees it"
        )
    value = spec(timestep)
    # a tensor stays where it is; a Python number becomes a device fill (no blocking host-to-device copy)
    if not isinstance(value, torch.Tensor) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(
            f"bandwidth: the callable {describe(spec)!r} returned {value!r} ({type(value).__name__}); expected it "
            "to return a positive float or a 0-d tensor (the bandwidth h at that timestep)"
        )
    if isinstance(value, torch.Tensor):
        h = value.to(device=device, dtype=torch.float32)
    else:  # a number is checked on the host for free; a tensor is not read back (that would synchronise)
        h = torch.full((), _check_value(float(value)), dtype=torch.float32, device=device)
    if h.numel() != 1:
        raise ValueError(
            f"the bandwidth callable returned a tensor of shape {tuple(h.shape)}; return a float or a 0-d tensor "
            "(one bandwidth per timestep)"
        )
    return h.reshape(())


def describe(spec: BandwidthSpec) -> str | float:
    """A JSON-friendly form of a spec: the keyword or number itself, a callable by its ``__name__``."""
    if isinstance(spec, str | float | int):
        return spec
    return getattr(spec, "__name__", repr(spec))
