"""What the hook points computed, kept on the device: :func:`cache_hook_points` (a context manager) and
:func:`run_with_cache` (calls the pipeline inside it), in the manner of TransformerLens' ``run_with_cache``.

The cache stays small (TransformerLens' ``ActivationCache`` habit): a mapping from hook point name to the tensors of
the recorded steps, with lookups; analysis (patching, statistics) lives in free functions (:mod:`.patch`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from .._checks import check_steps_ran, parse_step_selection, step_selected
from .points import HookContext, PointUser, attach_points, choose_points, list_hook_points

__all__ = ["CACHE", "HookCache", "cache_hook_points", "run_with_cache"]

logger = logging.getLogger(__name__)

#: The feature's claim on the denoiser (:func:`ipa_probe.list_hooks`).
CACHE = "cache_hook_points"


class HookCache:
    """The tensors the selected hook points computed, per denoiser pass, on the device where they were computed.

    A record is one pass: ``(call, step, pass_index)``, the pipeline call (counted from 0 by the cache: one block may
    span several calls), the denoising loop index and the pass within the step (Flux's true-CFG negative pass is 1).
    Values are what the layer used at the point: what every edit there left, whichever block was entered first.

    - ``cache[name]``: the point's records stacked in that order, ``(N, *shape)`` (one call with one pass per step:
      ``N`` steps);
    - ``cache[point, layer]``: as TransformerLens reads ``cache["pattern", 3]``: ``point`` a point of the first
      adapter's image branch (``"weights"``, or ``"text.k"``, ``"ip1.weights"``), ``layer`` the index of its layer
      among the recorded ones in the order the denoiser runs them; the same stack as ``cache[name]``;
    - ``cache.get(name, step, call=0, pass_index=0)``: one record.

    Attributes:
        names: the recorded hook point names.
        timesteps: ``{(call, step): timestep}`` as the denoiser got it.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.timesteps: dict[tuple[int, int], Any] = {}
        self._store: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {name: {} for name in names}
        self._calls: dict[int, int] = {}  # the pipeline's call index -> the cache's

    def _record(self, name: str, tensor: torch.Tensor, ctx: HookContext) -> None:
        call = self._calls.setdefault(ctx.call, len(self._calls))
        self._store[name][(call, ctx.step, ctx.pass_index)] = tensor.detach().clone()
        self.timesteps.setdefault((call, ctx.step), ctx.timestep)

    @property
    def calls(self) -> int:
        """How many pipeline calls recorded something."""
        return len(self._calls)

    def steps(self, name: str | None = None) -> list[int]:
        """The recorded loop indices (of ``name``, or of any point), in order, over every call."""
        names = [self._check(name)] if name is not None else self.names
        return sorted({key[1] for n in names for key in self._store[n]})

    def get(self, name: str, step: int, call: int = 0, pass_index: int = 0) -> torch.Tensor:
        """One record of hook point ``name``: loop index ``step`` of the cache's ``call`` (0 for the first),
        pass ``pass_index`` of the step."""
        records = self._store[self._check(name)]
        if (call, step, pass_index) not in records:
            raise KeyError(
                f"cache: {name!r} has no record of call {call}, step {step}, pass {pass_index}; recorded "
                f"(call, step, pass): {sorted(records)}"
            )
        return records[(call, step, pass_index)]

    def __getitem__(self, key: str | tuple[str, int]) -> torch.Tensor:
        """``cache[name]`` or ``cache[point, layer]``: the point's records stacked, ``(N, *shape)``."""
        name = self._layer_point(*key) if isinstance(key, tuple) else key
        records = self._store[self._check(name)]
        if not records:
            raise KeyError(f"cache: {name!r} recorded nothing (did the pipeline run inside the block?)")
        shapes = {tuple(r.shape) for r in records.values()}  # several: other references, Flux's negative pass
        if len(shapes) > 1:
            raise ValueError(
                f"cache[{name!r}]: records of shapes {sorted(shapes)} do not stack; use cache.get(name, step)"
            )
        return torch.stack([records[k] for k in sorted(records)])  # (N, *shape)

    def _layer_point(self, point: str, layer: int) -> str:
        """The name ``cache[point, layer]`` reads (TransformerLens' ``(name, layer)`` indexing)."""
        if point in self._store:
            raise TypeError(
                f"cache[{point!r}, {layer!r}]: a tuple key is (point, layer index) as in TransformerLens, e.g. "
                "cache['weights', 3]; one step of a named point is cache.get(name, step)"
            )
        suffix = "." + (point if "." in str(point) else f"ip.{point}")
        layers = [name[: -len(suffix)] for name in self.names if name.endswith(suffix)]
        if isinstance(layer, bool) or not isinstance(layer, int) or not -len(layers) <= layer < len(layers):
            raise KeyError(f"cache[{point!r}, {layer!r}]: {len(layers)} recorded layer(s) have a {suffix[1:]!r} point")
        return layers[layer] + suffix

    def _check(self, name: str) -> str:
        if name not in self._store:
            shown = f"{self.names[:3]}{'...' * (len(self.names) > 3)}"
            raise KeyError(f"cache: {name!r} was not recorded; recorded names: {shown}")
        return name

    def __contains__(self, name: object) -> bool:
        return name in self._store

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def keys(self) -> list[str]:
        return list(self.names)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, cache[name])`` for every name that recorded a step, in the order the points are computed."""
        return ((name, self[name]) for name in self.names if self._store[name])

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for records in self._store.values() for t in records.values())

    def __repr__(self) -> str:
        return f"HookCache({len(self.names)} point(s), {self.calls} call(s), {self.nbytes / 2**20:.1f} MiB)"


@contextlib.contextmanager
def cache_hook_points(pipe, names: Any = None, *, steps=None, max_bytes: int = 2 * 2**30) -> Iterator[HookCache]:
    """Record what the selected hook points compute while the block runs.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter.
        names: ``None`` for every hook point (:func:`~.points.list_hook_points`), a name, a regex searched in the
            names (a string, ``r"up_blocks.*\\.contribution$"``, or compiled), a filter ``name -> bool``, or a list of
            them: as ``intervene(hooks=...)`` takes names.
        steps: denoising loop indices to record (ints or a ``slice``), a :class:`~ipa_probe._checks.Timesteps` or a
            predicate ``fn(step, timestep) -> bool``; ``None`` for all.
        max_bytes: refuse a pipeline call whose recording is estimated above this, at its first denoiser pass (from
            the call's latent size, reference count and planned steps), before anything is stored.

    Yields the :class:`HookCache` (filled as the pipeline runs; tensors stay on the device). Raises ``ValueError``
    for unknown names, a bad step selection, a budget below the estimate.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int | float) or not max_bytes > 0:
        raise ValueError(f"max_bytes: expected a positive byte count, got {max_bytes!r}")
    chosen = choose_points(list_hook_points(pipe), names)
    selection = parse_step_selection(steps)
    cache = HookCache(chosen)

    def on_call(planned: int | None, sizes) -> None:
        steps = range(planned or 1)
        recorded = planned or 1 if callable(selection) else sum(step_selected(selection, s) for s in steps)
        total = 0
        for name in chosen:
            size = sizes(name)
            if size is not None:
                shape, dtype = size
                total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total = total * recorded + cache.nbytes  # with what earlier calls of the block keep
        if total > max_bytes:
            raise ValueError(
                f"cache_hook_points would keep about {total / 2**30:.2f} GiB after this call ({len(chosen)} point(s), "
                f"{recorded} step(s)), above max_bytes={max_bytes / 2**30:.2f} GiB; select fewer names or steps, or "
                "raise max_bytes"
            )
        logger.info("cache: about %.1f MiB for this call", total / 2**20)

    def record(name: str):
        def fn(tensor: torch.Tensor, ctx: HookContext) -> None:
            cache._record(name, tensor, ctx)

        return fn

    user = PointUser({name: [record(name)] for name in chosen}, selection, on_call, edits=False)
    detach = attach_points(pipe, user, CACHE, f"cache of {len(chosen)} hook point(s)")
    try:
        yield cache
        # steps the calls never had: an error, not an empty cache
        check_steps_ran(selection, user.steps_run, selected=user.selected)
    finally:
        detach()


def run_with_cache(
    pipe, names: Any = None, *, steps=None, max_bytes: int = 2 * 2**30, **call: Any
) -> tuple[Any, HookCache]:
    """Call ``pipe(**call)`` while recording the selected hook points (see :func:`cache_hook_points`); returns
    ``(the pipeline's output, the HookCache)``.

    Example:
        ```py
        >>> out, cache = ipa_probe.run_with_cache(pipe, r"\\.ip\\.contribution$", prompt=..., ip_adapter_image=[refs])
        >>> cache[name].shape  # (steps, B, R, Q, C)
        ```
    """
    with cache_hook_points(pipe, names, steps=steps, max_bytes=max_bytes) as cache:
        output = pipe(**call)
    return output, cache
