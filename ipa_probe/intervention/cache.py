"""What the hook points computed, kept on the device: :func:`cache_hook_points` (a context manager) and
:func:`run_with_cache` (calls the pipeline inside it), in the manner of TransformerLens' ``run_with_cache``.

The cache stays small (TransformerLens' ``ActivationCache`` habit): a mapping from hook point name to the tensors of
the recorded steps, with lookups; analysis (patching, statistics) lives in free functions (:mod:`.patch`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch

from .._checks import check_steps_ran, parse_step_selection
from ..layers import claim, release
from .points import HookContext, PointUser, attach_points, list_hook_points, select_points

__all__ = ["CACHE", "HookCache", "cache_hook_points", "run_with_cache"]

logger = logging.getLogger(__name__)

#: The feature's claim on the denoiser (:func:`ipa_probe.list_hooks`).
CACHE = "cache_hook_points"


class HookCache:
    """The tensors the selected hook points computed, per denoising step, on the device where they were computed.

    ``cache[name]`` stacks a point's steps, ``(S, *shape)`` in the order of :meth:`steps`; ``cache.get(name, step)``
    gives one step's tensor. Values are what the point held after the callbacks attached before the cache (an
    ``intervene`` block entered first); ``timesteps`` maps each recorded step to its timestep.

    Attributes:
        names: the recorded hook point names.
        timesteps: ``{step: timestep}`` as the denoiser got it.
    """

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self.timesteps: dict[int, Any] = {}
        self._store: dict[str, dict[int, torch.Tensor]] = {name: {} for name in names}

    def _record(self, name: str, tensor: torch.Tensor, ctx: HookContext) -> None:
        steps = self._store[name]
        if ctx.step in steps:
            raise ValueError(
                f"cache: hook point {name!r} ran twice in step {ctx.step} (a second denoiser pass of one step: a "
                "panorama's views or a guidance pass); cache one pass per step, e.g. a plain pipeline call"
            )
        steps[ctx.step] = tensor.detach().clone()
        self.timesteps.setdefault(ctx.step, ctx.timestep)

    def steps(self, name: str | None = None) -> list[int]:
        """The recorded steps (of ``name``, or of any point), in order."""
        if name is not None:
            return sorted(self._store[self._check(name)])
        return sorted({step for steps in self._store.values() for step in steps})

    def get(self, name: str, step: int) -> torch.Tensor:
        """One step's tensor of hook point ``name``."""
        steps = self._store[self._check(name)]
        if step not in steps:
            raise KeyError(f"cache: {name!r} has no step {step}; recorded steps: {sorted(steps)}")
        return steps[step]

    def __getitem__(self, key: str | tuple[str, int]) -> torch.Tensor:
        """``cache[name]``: the point's steps stacked, ``(S, *shape)``; ``cache[name, step]``: one step's tensor."""
        if isinstance(key, tuple):
            return self.get(*key)
        name = key
        steps = self._store[self._check(name)]
        if not steps:
            raise KeyError(f"cache: {name!r} recorded no step (did the pipeline run inside the block?)")
        return torch.stack([steps[s] for s in sorted(steps)])  # (S, *shape)

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
        return sum(t.numel() * t.element_size() for steps in self._store.values() for t in steps.values())

    def __repr__(self) -> str:
        return f"HookCache({len(self.names)} point(s), steps {self.steps()}, {self.nbytes / 2**20:.1f} MiB)"


def _select(pipe, names: Any) -> list[str]:
    """The points ``names`` selects, in the order they are computed: ``None`` every one, a string or compiled
    regex every one it searches, a callable filter ``name -> bool``, or a list of names (or of regexes, filters)."""
    known = list_hook_points(pipe)
    if names is None:
        return known
    if isinstance(names, str):
        names = re.compile(names)
    items = [names] if isinstance(names, re.Pattern) or callable(names) else list(names)
    if not items:
        raise ValueError("names: expected at least one hook point name (see ipa_probe.list_hook_points(pipe))")
    chosen = {point for item in items for point in select_points(known, item, "names")}
    return [point for point in known if point in chosen]


@contextlib.contextmanager
def cache_hook_points(pipe, names: Any = None, *, steps=None, max_bytes: int = 2 * 2**30) -> Iterator[HookCache]:
    """Record what the selected hook points compute while the block runs.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter.
        names: ``None`` for every hook point (:func:`~.points.list_hook_points`), one regex searched in the names
            (``r"up_blocks.*\\.contribution$"``), a filter ``name -> bool``, or a list of names.
        steps: denoising loop indices to record (ints or a ``slice``); ``None`` for all.
        max_bytes: refuse a pipeline call whose recording is estimated above this, at its first denoiser pass (from
            the call's latent size, reference count and planned steps), before anything is stored.

    Yields:
        the :class:`HookCache` (filled as the pipeline runs; tensors stay on the device).

    Raises:
        ValueError: unknown names, a bad step selection, a budget below the estimate.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int | float) or not max_bytes > 0:
        raise ValueError(f"max_bytes: expected a positive byte count, got {max_bytes!r}")
    chosen = _select(pipe, names)
    selection = parse_step_selection(steps)
    cache = HookCache(chosen)

    def on_call(planned: int | None, sizes) -> None:
        recorded = sum(step_is_recorded(s) for s in range(planned or 1))
        total = 0
        for name in chosen:
            size = sizes(name)
            if size is not None:
                shape, dtype = size
                total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total *= recorded
        if total > max_bytes:
            raise ValueError(
                f"cache_hook_points would keep about {total / 2**30:.2f} GiB for this call ({len(chosen)} point(s), "
                f"{recorded} step(s)), above max_bytes={max_bytes / 2**30:.2f} GiB; select fewer names or steps, or "
                "raise max_bytes"
            )
        logger.info("cache: about %.1f MiB for this call", total / 2**20)

    def step_is_recorded(step: int) -> bool:
        return user.acts_at(step)

    def record(name: str):
        def fn(tensor: torch.Tensor, ctx: HookContext) -> None:
            cache._record(name, tensor, ctx)

        return fn

    user = PointUser({name: [record(name)] for name in chosen}, selection, on_call, edits=False)
    claim(pipe, CACHE, sorted({name.rsplit(".", 2)[0] for name in chosen}), f"cache of {len(chosen)} hook point(s)")
    try:
        detach = attach_points(pipe, user)
    except BaseException:
        release(pipe, CACHE)
        raise
    try:
        yield cache
        check_steps_ran(selection, user.steps_run)  # steps the calls never had: an error, not an empty cache
    finally:
        try:
            detach()
        finally:
            release(pipe, CACHE)


def run_with_cache(
    pipe, names: Any = None, *, steps=None, max_bytes: int = 2 * 2**30, **call: Any
) -> tuple[Any, HookCache]:
    """Call ``pipe(**call)`` while recording the selected hook points (see :func:`cache_hook_points`).

    Returns:
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
