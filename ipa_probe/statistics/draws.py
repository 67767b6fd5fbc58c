"""The random draws of the per-row statistics, made on the device from seeded generators (no host sync): the
permutation nulls' shuffles of each row's keys and the stratified samples of query rows (a CPU sorts in numpy)."""

from __future__ import annotations

import torch

from .rows import numpy_sorts, sort_packed

__all__ = ["Draws", "shuffle_rows", "stratified_rows", "uniform_keys"]

#: A null's random source: one generator, or per block of the leading dimension ``(generator, slices)``; in place of a
#: generator, the uniform keys it would draw, drawn beforehand (:func:`uniform_keys`: a compiled pass draws nothing).
Draws = torch.Generator | torch.Tensor | list[tuple[torch.Generator | torch.Tensor, int]]


def shuffle_rows(w: torch.Tensor, generator: Draws, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` with an independent uniformly random permutation of the last dimension in every row.

    With a boolean ``prefix`` mask (kept entries first in every row), only the kept entries are shuffled. With
    several ``(generator, n)`` draws, the first ``n`` slices of ``w``'s leading dimension draw from the first
    generator, and so on: each generator draws what it would draw for its slices alone. Every row is permuted by
    sorting ``K`` uniform keys (:func:`_sort_keys`): one sort and one gather for all rows, whatever ``K`` (a few
    kernel launches on a GPU, where a loop of swaps would cost four per key).
    """
    draws = generator if isinstance(generator, list) else [(generator, w.shape[0])]
    parts = [uniform_keys((n, *w.shape[1:]), g, w.device) for g, n in draws]  # one draw per generator, stacked
    noise = torch.cat(parts) if len(parts) > 1 else parts[0]
    return w.gather(-1, _sort_keys(noise, prefix))


def uniform_keys(shape: tuple[int, ...], generator: torch.Generator | torch.Tensor, device) -> torch.Tensor:
    """``shape`` float32 keys uniform on ``[0, 1)`` drawn from ``generator``, or ``generator`` itself when it holds
    keys drawn beforehand (any shape of as many elements: a draw of the same number of keys is the same stream)."""
    if isinstance(generator, torch.Tensor):
        return generator.reshape(shape)
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def _sort_keys(noise: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
    """The permutation of each row that sorts its random keys: ``argsort(u)``, uniform over the ``K!`` orders (ties
    among float32 keys, below ``K^2 / 2^25`` a row, kept in place order). With a ``prefix`` mask, a left-out entry
    ``i`` gets the key ``1 + i`` (every kept entry's key is below 1): the kept entries are permuted among the first
    places and the rest stay where they are. ``noise``: ``(..., K)`` uniform on ``[0, 1)``; ``prefix``: optional
    ``(..., K)`` bool, kept entries first in every row."""
    if prefix is not None:
        noise = noise.where(prefix, torch.arange(1, noise.shape[-1] + 1, device=noise.device, dtype=noise.dtype))
    if not numpy_sorts(noise):
        return noise.argsort(dim=-1, stable=True)
    packed, shift = sort_packed(noise.view(torch.int32))  # non-negative float32 keys sort as their bits do
    return packed.bitwise_and_((1 << shift) - 1)


def stratified_rows(rows: int, n: int, generator: torch.Generator | torch.Tensor, device=None) -> torch.Tensor:
    """A seeded stratified sample of ``n`` of ``rows`` row indices: the rows (query positions in raster order) are cut
    into ``n`` contiguous strata of ``rows // n`` or ``rows // n + 1`` rows (spatial blocks: runs of neighbouring
    positions) and one row is drawn uniformly in each. Made on ``device`` from ``generator`` (no host sync).

    Args:
        rows: how many rows there are.
        n: how many to draw, ``1 <= n <= rows``.
        generator: the random source, on ``device``; or ``(..., n)`` uniform keys drawn from one beforehand
            (:func:`uniform_keys`), a sample for each.
        device: where the indices live (with a generator).

    Returns:
        ``(n,)`` int64 indices (``(..., n)`` from keys), ascending (one per stratum, in stratum order).
    """
    if not 1 <= n <= rows:
        raise ValueError(f"n: expected 1 <= n <= rows ({rows}), got {n}")
    keys = generator if isinstance(generator, torch.Tensor) else uniform_keys((n,), generator, device)
    stratum = torch.arange(n + 1, device=keys.device) * rows // n  # (n + 1,) stratum boundaries
    start, size = stratum[:-1], stratum[1:] - stratum[:-1]
    offset = (keys * size).long().clamp(max=size - 1)
    return start + offset
