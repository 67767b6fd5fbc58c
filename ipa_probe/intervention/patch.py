"""Activation patching: one run's hook point values put into another run (:func:`patch_hooks`).

Typical use: record run A's per-reference contributions (:func:`~.cache.run_with_cache`), then run B (same seed,
another reference set) with ``intervene(pipe, hooks=patch_hooks(cache_a, ...))``: at the chosen layers and steps, B's
image branch adds what A's did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._checks import parse_step_selection, step_selected
from .cache import HookCache
from .points import HookContext, HookFn, choose_points

__all__ = ["patch_hooks"]


def patch_hooks(
    cache: HookCache,
    names: Any = None,
    *,
    steps=None,
    references: Sequence[int] | int | None = None,
) -> dict[str, HookFn]:
    """Callbacks that replace hook points' values by those recorded in ``cache``, for ``intervene(pipe, hooks=...)``.

    Args:
        cache: a :class:`~.cache.HookCache` of the source run.
        names: the cached points to patch, as ``run_with_cache`` takes names (names, regexes, filters); ``None``: all.
        steps: the steps to patch (loop indices, ``Timesteps`` or a predicate); ``None``: every one the cache holds.
            A selected step the cache lacks is refused when the run reaches it.
        references: patch only these references' slots (``contribution`` points) or their tokens' weights
            (``weights`` points: those tokens get the source's weights, the others keep this run's, and the rows are
            not renormalised); ``None`` for the whole tensor. Refused for ``output`` points (they sum the references).

    Returns:
        ``{name: fn}``. A source tensor whose shape differs from the target's (another reference count, image size or
        batch) is refused with one line when the run reaches it.
    """
    if not isinstance(cache, HookCache):
        raise TypeError(f"cache: expected a HookCache (from ipa_probe.run_with_cache), got {type(cache).__name__}")
    chosen = choose_points(list(cache.names), names)  # as run_with_cache takes them, among the cached points
    selection = parse_step_selection(steps)
    if references is not None:
        references = [references] if isinstance(references, int) else list(references)
        if not references or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in references):
            raise ValueError(f"references: expected reference indices (ints >= 0), got {references!r}")
        outputs = [name for name in chosen if name.endswith(".output")]
        if outputs:
            raise ValueError(
                f"references= selects slots of contribution or weights points; {outputs[0]!r} sums the references: "
                "patch its '.contribution' instead"
            )

    def patch(name: str) -> HookFn:
        def fn(tensor: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            if not step_selected(selection, ctx.step, ctx.timestep):
                return None
            if ctx.step not in cache.steps(name):
                raise ValueError(
                    f"patch: the cache has no step {ctx.step} of {name!r} (recorded: {cache.steps(name)}); pass "
                    "steps= within them"
                )
            source = cache.get(name, ctx.step)
            if source.shape != tensor.shape:
                raise ValueError(
                    f"patch: {name!r} was cached with shape {tuple(source.shape)}, this run computes "
                    f"{tuple(tensor.shape)}; patch between runs with the same batch, image size and reference count"
                )
            source = source.to(device=tensor.device, dtype=tensor.dtype)
            if references is None:
                return source
            return torch.where(ctx.select(references=references), source, tensor)

        return fn

    return {name: patch(name) for name in chosen}
