"""The random draws of the per-row statistics, made on the device from seeded generators (no host sync): the
permutation nulls' shuffles of each row's keys and the stratified samples of query rows. Pure torch."""

from __future__ import annotations

import torch

__all__ = ["Draws", "shuffle_rows", "stratified_rows"]

#: A null's random source: one generator, or per block of the leading dimension ``(generator, slices)``.
Draws = torch.Generator | list[tuple[torch.Generator, int]]


def shuffle_rows(w: torch.Tensor, generator: Draws, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` with an independent uniformly random permutation of the last dimension in every row.

    With a boolean ``prefix`` mask (kept entries first in every row), only the kept entries are shuffled. With
    several ``(generator, n)`` draws, the first ``n`` slices of ``w``'s leading dimension draw from the first
    generator, and so on: each generator draws what it would draw for its slices alone. Every row costs ``K - 1``
    Fisher-Yates swaps driven by ``K`` uniform draws (:func:`_fisher_yates`, ``O(K)``), whatever ``K``: no table of
    permutations, no sort.
    """
    if isinstance(generator, torch.Generator):
        noise = torch.rand(w.shape, generator=generator, device=w.device, dtype=torch.float32)
    else:
        # (F, ...): one draw per generator of its frames' shape, stacked
        parts = [torch.rand((n, *w.shape[1:]), generator=g, device=w.device) for g, n in generator]
        noise = torch.cat(parts) if len(parts) > 1 else parts[0]
    kept = prefix.sum(-1, keepdim=True) if prefix is not None else None
    return _fisher_yates(w, noise, kept)


def _fisher_yates(w: torch.Tensor, noise: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """``w`` shuffled along its last dimension by the Fisher-Yates (Durstenfeld) swaps: for ``i = K-1 .. 1`` entry
    ``i`` is swapped with entry ``j_i = floor(u_i (i + 1))``, uniform on ``0..i``; every permutation has probability
    ``1 / K!`` (up to the float32 resolution of ``u``, as for sorting random keys). Each swap is one pass over the
    rows, so a row costs ``O(K)`` instead of the ``O(K log K)`` of an argsort of ``K`` random keys (8x fewer
    operations' worth of CPU time at 64 keys). With ``kept`` (``(..., 1)`` counts of a prefix), swaps at ``i >= kept``
    are skipped (``j_i = i``): only the first ``kept`` entries of a row are shuffled.

    Args:
        w: ``(..., K)`` values.
        noise: ``(..., K)`` uniform on ``[0, 1)``, ``u_i`` for position ``i``.
        kept: optional ``(..., 1)`` integers.
    """
    k = w.shape[-1]
    position = torch.arange(k, device=w.device)
    j = (noise * (position + 1)).long().minimum(position)  # (..., K): j_i in 0..i
    if kept is not None:
        j = torch.where(position < kept, j, position)
    out = w.clone()
    for i in range(k - 1, 0, -1):
        j_i = j[..., i : i + 1]  # (..., 1)
        here = out[..., i : i + 1].clone()
        out[..., i : i + 1] = out.gather(-1, j_i)
        out.scatter_(-1, j_i, here)
    return out


def stratified_rows(rows: int, n: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """A seeded stratified sample of ``n`` of ``rows`` row indices: the rows (query positions in raster order) are cut
    into ``n`` contiguous strata of ``rows // n`` or ``rows // n + 1`` rows (spatial blocks: runs of neighbouring
    positions) and one row is drawn uniformly in each. Made on ``device`` from ``generator`` (no host sync).

    Args:
        rows: how many rows there are.
        n: how many to draw, ``1 <= n <= rows``.
        generator: the random source, on ``device``.
        device: where the indices live.

    Returns:
        ``(n,)`` int64 indices, ascending (one per stratum, in stratum order).
    """
    if not 1 <= n <= rows:
        raise ValueError(f"n: expected 1 <= n <= rows ({rows}), got {n}")
    stratum = torch.arange(n + 1, device=device) * rows // n  # (n + 1,) stratum boundaries
    start, size = stratum[:-1], stratum[1:] - stratum[:-1]
    offset = (torch.rand(n, generator=generator, device=device) * size).long().clamp(max=size - 1)
    return start + offset
