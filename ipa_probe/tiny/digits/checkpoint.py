"""Training checkpoints of the digits organism: one file, written atomically, checked before use.

``OUT/checkpoint.safetensors`` holds every tensor of a run (model weights and optimizer moments, under
``model/<module>/<key>`` and ``optim/<optimizer>/<index>/<field>``) and, in its metadata, the run's state as JSON
(recipe, identity, stage, step, losses, wall times) with a SHA-256 digest of the tensors. Tensors and state are one
unit: the file is written under a unique temporary name, flushed to disk and renamed into place
(:func:`ipa_probe._io.atomic_path`), so a kill at any moment leaves the previous checkpoint or the new one, whole.

On resume everything is checked before any of it is used: the file reads (not truncated, a safetensors file), the
state has every field with the right type, the tensors hash to the recorded digest, every key, shape and dtype is the
one the freshly built modules and optimizers expect, the losses and the optimizers' own step counters agree with the
recorded step, and the identity (settings, and for the adapter the base it started from) is the current run's. Any
failure is a :class:`CheckpointError` whose one line names the file and the remedy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..._io import atomic_path, check_input_file

__all__ = ["CHECKPOINT_NAME", "CheckpointError", "TrainingCheckpoint", "flat_state", "tensors_digest"]

CHECKPOINT_NAME = "checkpoint.safetensors"
#: the older, non-atomic pair (``checkpoint.safetensors`` replaced, then ``checkpoint.json`` written)
LEGACY_META_NAME = "checkpoint.json"
_META_KEY = "ipa_probe.digits_checkpoint"
_FORMAT = 2
_ADAM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A training checkpoint that cannot be used; the message names the file and what to do."""


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in key order: each key, dtype, shape and the raw bytes.

    Args:
        tensors: name -> CPU tensor (any shape).

    Returns:
        the hex digest.
    """
    digest = hashlib.sha256()
    for key in sorted(tensors):
        value = tensors[key].detach().cpu().contiguous().reshape(-1)  # (numel,): 0-d tensors too
        digest.update(f"{key}|{tensors[key].dtype}|{tuple(tensors[key].shape)}|".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def flat_state(
    modules: Mapping[str, torch.nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, torch.Tensor]:
    """Every module's ``state_dict`` and every optimizer's per-parameter state as one flat name -> tensor dict."""
    flat: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        for key, value in module.state_dict().items():
            flat[f"model/{name}/{key}"] = value.detach().clone().contiguous()
    for name, opt in optimizers.items():
        for index, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                flat[f"optim/{name}/{index}/{key}"] = torch.as_tensor(value).detach().clone().contiguous()
    return flat


def _load_flat_state(
    flat: Mapping[str, torch.Tensor],
    modules: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> None:
    for name, module in modules.items():
        prefix = f"model/{name}/"
        module.load_state_dict({k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)})
    for name, opt in optimizers.items():
        prefix = f"optim/{name}/"
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            if key.startswith(prefix):
                index, field = key.removeprefix(prefix).split("/")
                state.setdefault(int(index), {})[field] = value.clone()
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)


class TrainingCheckpoint:
    """The checkpoint of one training run in ``out``.

    Args:
        out: the run's output folder.
        recipe: which training this is (``"support"``, ``"mixed"``, ``"ip-adapter/base"``, ``"ip-adapter/adapter"``).
        identity: what a resumed run must share with the checkpoint (the settings, the base's digest, ...); JSON.
        stages: stage name -> its number of steps, in order.
    """

    def __init__(self, out: str | os.PathLike, recipe: str, identity: dict[str, Any], stages: Mapping[str, int]):
        self.out = Path(out)
        self.path = self.out / CHECKPOINT_NAME
        self.recipe = recipe
        self.identity = json.loads(json.dumps(identity))  # as it reads back from JSON (tuples become lists)
        self.stages = dict(stages)

    # --- writing ------------------------------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        modules: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
    ) -> Path:
        """Write the modules, optimizers and run ``state`` (stage, step, losses, ...) as one file, atomically."""
        from safetensors.torch import save_file

        tensors = flat_state(modules, optimizers)
        meta = {
            "format": _FORMAT,
            "recipe": self.recipe,
            "identity": self.identity,
            "state": state,
            "tensors_sha256": tensors_digest(tensors),
        }
        with atomic_path(self.path) as temp:
            save_file(tensors, str(temp), metadata={_META_KEY: json.dumps(meta)})
        return self.path

    # --- reading ------------------------------------------------------------------------------------------------

    def _fail(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(self.path)!r} {problem}; delete it to train from scratch, or choose another --out"
        )

    def load(
        self, modules: Mapping[str, torch.nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
    ) -> dict[str, Any] | None:
        """Check the checkpoint and load it into ``modules`` and ``optimizers``; return its run state.

        Returns:
            the state dict saved with it, or ``None`` if there is no checkpoint (a fresh run).

        Raises:
            CheckpointError: an older ipa_probe's checkpoint pair, or a file that is unreadable, inconsistent, of
                another run, or of another structure; nothing is loaded then.
            PermissionError: the checkpoint cannot be read (the path, and the remedy in ``remedy``).
        """
        legacy = self.out / LEGACY_META_NAME
        if legacy.exists():
            raise CheckpointError(
                f"{str(legacy)!r} and {str(self.path)!r} are an older ipa_probe's checkpoint pair, which cannot be "
                "verified as one unit; delete both to train from scratch, or choose another --out"
            )
        if not os.path.lexists(self.path):
            return None
        try:  # stat only (a FIFO is never opened); no permission is a fault of the environment, not of the file
            check_input_file(self.path, "checkpoint")
        except (FileNotFoundError, ValueError):
            raise self._fail("is not a regular file") from None
        meta, tensors = self._read()
        state = self._check_meta(meta)
        if tensors_digest(tensors) != meta["tensors_sha256"]:
            raise self._fail("does not match its own digest (its tensors changed after it was written)")
        self._check_structure(tensors, modules, optimizers, state)
        _load_flat_state(tensors, modules, optimizers)
        return state

    def _read(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as handle:
                metadata = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - no iteration
        except Exception as err:  # noqa: BLE001 - safetensors raises its own types; every one means unreadable
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise self._fail(f"cannot be read ({reason})") from None
        if _META_KEY not in metadata:
            raise self._fail("is not an ipa_probe training checkpoint (no run state in its metadata)")
        try:
            meta = json.loads(metadata[_META_KEY])
        except ValueError:
            raise self._fail("has an unreadable run state") from None
        return meta, tensors

    def _check_meta(self, meta: Any) -> dict[str, Any]:
        fields = {"format": int, "recipe": str, "identity": dict, "state": dict, "tensors_sha256": str}
        for name, kind in fields.items():
            if not isinstance(meta, dict) or not isinstance(meta.get(name), kind):
                raise self._fail(f"has no valid {name!r} field")
        if meta["format"] != _FORMAT:
            raise self._fail(f"has format {meta['format']}, expected {_FORMAT}")
        if meta["recipe"] != self.recipe:
            raise self._fail(f"is of the {meta['recipe']!r} training, not {self.recipe!r}")
        if meta["identity"] != self.identity:
            differ = sorted(
                k for k in {*meta["identity"], *self.identity} if meta["identity"].get(k) != self.identity.get(k)
            )
            raise self._fail(f"is of a run with other settings ({', '.join(differ)} differ)")
        state = meta["state"]
        stage, step = state.get("stage"), state.get("step")
        if stage not in self.stages:
            raise self._fail(f"has stage {stage!r}, expected one of {list(self.stages)}")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self.stages[stage]:
            raise self._fail(f"has step {step!r}, expected an int in 0..{self.stages[stage]} for stage {stage!r}")
        losses, wall = state.get("losses"), state.get("wall_s")
        for name in self.stages:
            done = self._done(name, state)
            series = losses.get(name) if isinstance(losses, dict) else None
            if not isinstance(series, list) or len(series) != done or not all(_finite(v) for v in series):
                raise self._fail(f"records {_count(series)} losses for stage {name!r}, expected {done} finite ones")
            if not isinstance(wall, dict) or not _finite(wall.get(name)):
                raise self._fail(f"has no wall time for stage {name!r}")
        if isinstance(state.get("resumed"), bool) or not isinstance(state.get("resumed"), int):
            raise self._fail("has no valid 'resumed' count")
        return state

    def _check_structure(
        self,
        tensors: Mapping[str, torch.Tensor],
        modules: Mapping[str, torch.nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
        state: dict[str, Any],
    ) -> None:
        expected = {
            f"model/{name}/{key}": value
            for name, module in modules.items()
            for key, value in module.state_dict().items()
        }
        for key, value in expected.items():
            if key not in tensors:
                raise self._fail(f"lacks the tensor {key!r}")
            got = tensors[key]
            if got.shape != value.shape or got.dtype != value.dtype:
                raise self._fail(
                    f"holds {key!r} as {got.dtype} {tuple(got.shape)}, expected {value.dtype} {tuple(value.shape)}"
                )
        for key, value in tensors.items():
            if key in expected:
                continue
            parts = key.split("/")
            if len(parts) != 4 or parts[0] != "optim" or parts[1] not in optimizers or parts[3] not in _ADAM_FIELDS:
                raise self._fail(f"holds an unexpected tensor {key!r}")
            params = [p for group in optimizers[parts[1]].param_groups for p in group["params"]]
            index = int(parts[2]) if parts[2].isdigit() else -1
            if not 0 <= index < len(params):
                raise self._fail(f"holds {key!r} for a parameter its optimizer does not have")
            shape = () if parts[3] == "step" else params[index].shape
            if value.shape != shape or not value.dtype.is_floating_point:
                raise self._fail(f"holds {key!r} as {value.dtype} {tuple(value.shape)}, expected float {shape}")
            if parts[3] == "step" and parts[1] in self.stages:  # the optimizer's own count of its steps
                done = self._done(parts[1], state)
                if float(value) != done:
                    raise self._fail(
                        f"records {done} steps of stage {parts[1]!r} but its optimizer took {float(value):g}"
                    )

    def _done(self, name: str, state: dict[str, Any]) -> int:
        """Steps of stage ``name`` done in a run at ``state["stage"]``, ``state["step"]``."""
        order = list(self.stages)
        if order.index(name) < order.index(state["stage"]):
            return self.stages[name]
        return state["step"] if name == state["stage"] else 0


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(series: Sequence | None) -> str:
    return str(len(series)) if isinstance(series, list) else "no"
