"""Training checkpoints as safetensors (every tensor) plus JSON (everything else): loading one runs no code.

A checkpoint is a nested record (model, optimiser and scheduler state dicts, the generator state, the step, the
losses, the configurations). :func:`save_checkpoint` stores each tensor under a dotted key in one safetensors file
and the record's structure, with ``{"__tensor__": key}`` where each tensor was, as JSON in the file's metadata;
:func:`load_checkpoint` rebuilds the record. Python floats go through JSON's shortest round-trip form, so a resumed
run continues bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._io import atomic_path

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

_META_KEY = "ipa_probe.checkpoint"
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INT_KEYS = "__int_keys__"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back; the message names the file and what to do."""


def _flatten(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = value.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(value, dict):
        int_keys = all(isinstance(k, int) for k in value) and bool(value)  # optimiser state is keyed by int
        body = {str(k): _flatten(v, f"{prefix}.{k}" if prefix else str(k), tensors) for k, v in value.items()}
        return {_INT_KEYS: body} if int_keys else body
    if isinstance(value, tuple):
        return {_TUPLE: [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"checkpoint: cannot store a {type(value).__name__} at {prefix!r}; store tensors and JSON values")


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(_unflatten(v, tensors) for v in value[_TUPLE])
        if set(value) == {_INT_KEYS}:
            return {int(k): _unflatten(v, tensors) for k, v in value[_INT_KEYS].items()}
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def save_checkpoint(record: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``record`` (tensors and JSON values, nested in dicts, lists and tuples) to ``path``, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(record, "", tensors)
    with atomic_path(path) as temp:
        save_file(tensors, str(temp), metadata={_META_KEY: json.dumps(structure)})
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: the file is truncated, empty, not a checkpoint or otherwise unreadable; the message names it.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open has no iter
        structure = json.loads(metadata[_META_KEY])
        return _unflatten(structure, tensors)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types; all mean "unreadable"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({reason}); delete it to train that model again"
        ) from None
