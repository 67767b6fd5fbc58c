"""The chance levels of a per-row Spearman rho and its gauge baseline. Pure torch (and the standard library).

:func:`rho_null` is the distribution of rho between two independent rankings of ``K`` keys (exact by enumeration up to
:data:`EXACT_NULL_KEYS`, simulated beyond), :func:`null_tail` its tail above the rows' threshold, and
:func:`rho_baseline` the rho a row of a given logit ratio and number of keys gives when its key-norm term is
independent of its attention logits (docs/gauge.md). :mod:`ipa_probe.statistics` reads them.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

from .schema import ROW_THRESHOLD

__all__ = ["EXACT_NULL_KEYS", "RhoNull", "null_tail", "rho_baseline", "rho_null"]


#: Rows of at most this many keys get the null of their rho by enumerating all ``K!`` rankings; longer ones by
#: simulation.
EXACT_NULL_KEYS = 8


@dataclass(frozen=True)
class RhoNull:
    """The distribution of the per-row Spearman rho between two independent rankings of ``keys`` distinct keys.

    Under independence every permutation of one ranking against the other is equally likely, and rho takes the values
    ``1 - 6 S / (K^3 - K)``, ``S = sum_i d_i^2`` the sum of squared rank differences: mean 0, variance ``1 / (K - 1)``.

    Attributes:
        keys: the number of keys ``K``.
        values: the values rho takes with non-zero probability, ascending.
        probs: their probabilities (summing to 1).
        exact: whether ``probs`` come from enumerating all ``K!`` permutations, else from ``samples`` random ones.
        samples: how many random permutations were drawn (``None`` when exact).
    """

    keys: int
    values: tuple[float, ...]
    probs: tuple[float, ...]
    exact: bool
    samples: int | None = None

    def tail(self, threshold: float) -> float:
        """``P(rho > threshold)``."""
        return math.fsum(p for v, p in zip(self.values, self.probs, strict=True) if v > threshold)

    def prob(self, value: float) -> float:
        """``P(rho = value)`` (0 for a value rho does not take)."""
        return math.fsum(p for v, p in zip(self.values, self.probs, strict=True) if abs(v - value) < 1e-12)

    @property
    def sd(self) -> float:
        """The distribution's standard deviation (``1 / sqrt(K - 1)`` up to the simulation's error)."""
        mean = math.fsum(v * p for v, p in zip(self.values, self.probs, strict=True))
        return math.sqrt(math.fsum((v - mean) ** 2 * p for v, p in zip(self.values, self.probs, strict=True)))


@functools.lru_cache(maxsize=256)
def rho_null(keys: int, samples: int = 2**20, seed: int = 0) -> RhoNull:
    """The null distribution of the per-row Spearman rho for ``keys`` distinct keys (computed once, then cached).

    Exact for ``keys <= EXACT_NULL_KEYS`` (all ``K!`` permutations, pure Python); above, from ``samples`` uniformly
    random permutations (``argsort`` of uniform noise from a generator seeded with ``seed``), whose probabilities have
    the standard error ``sqrt(p (1 - p) / samples)``.

    Example:
        ```py
        >>> rho_null(4).tail(0.9)  # rho = 1 exactly: one ranking in 4! = 24
        0.041666666666666664
        ```
    """
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 2:
        raise ValueError(f"keys: expected an integer >= 2 (a row of fewer keys has no rank correlation), got {keys!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: expected a positive integer, got {samples!r}")
    counts: dict[int, int] = {}
    if keys <= EXACT_NULL_KEYS:
        for perm in itertools.permutations(range(keys)):
            s = sum((p - i) ** 2 for i, p in enumerate(perm))
            counts[s] = counts.get(s, 0) + 1
        total, exact = math.factorial(keys), True
    else:
        generator = torch.Generator().manual_seed(seed)
        position = torch.arange(keys)
        chunk = max(1, 2**22 // keys)
        bins = torch.zeros((keys**3 - keys) // 3 + 1, dtype=torch.int64)
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            perm = torch.rand(n, keys, generator=generator).argsort(-1)  # (n, K) uniform random permutations
            bins += torch.bincount(((perm - position) ** 2).sum(-1), minlength=bins.numel())
        counts = {s: c for s, c in enumerate(bins.tolist()) if c}
        total, exact = samples, False
    denominator = keys**3 - keys
    ordered = sorted(counts.items(), reverse=True)  # large S first: rho ascending
    values = tuple(1 - 6 * s / denominator for s, _ in ordered)
    probs = tuple(c / total for _, c in ordered)
    return RhoNull(keys, values, probs, exact, None if exact else samples)


#: Random permutations per number of keys behind :data:`_TAIL_HITS`.
_TAIL_SAMPLES = 2**24

#: How many of :data:`_TAIL_SAMPLES` uniformly random permutations of ``K`` keys have rho > 0.9, for
#: ``EXACT_NULL_KEYS < K <= 22``: the chance level ``hits / 2**24`` has the standard error ``sqrt(hits) / 2**24``
#: (6e-6 at K = 9, under 1e-6 from K = 15). Tabulated once by ``python -m ipa_probe.devtools.rho_null_table``
#: (:func:`rho_null` with seed 0), which stops at the first ``K`` (23) where no permutation reached 0.9; beyond the
#: table the chance is below about 1e-7 and is taken as 0.
_TAIL_HITS: dict[int, int] = {
    9: 11215,
    10: 6826,
    11: 2304,
    12: 1345,
    13: 598,
    14: 251,
    15: 95,
    16: 40,
    17: 27,
    18: 11,
    19: 3,
    20: 1,
    21: 1,
    22: 2,
}


@torch.compiler.assume_constant_result  # a compiled pass reads the number, not the simulation behind it
def null_tail(keys: int) -> float:
    """The chance that a row of ``keys`` distinct keys has rho above :data:`~ipa_probe.statistics.schema.ROW_THRESHOLD`
    (0.9) under independent rankings: exact up to :data:`EXACT_NULL_KEYS` keys, tabulated from a simulation above (see
    :data:`_TAIL_HITS`), 0 beyond the table (no simulated row got there), NaN for fewer than 2 keys."""
    if keys < 2:
        return math.nan
    if keys <= EXACT_NULL_KEYS:
        return rho_null(keys).tail(ROW_THRESHOLD)
    return _TAIL_HITS.get(keys, 0) / _TAIL_SAMPLES


def rho_baseline(ratio: torch.Tensor, keys: torch.Tensor | int) -> torch.Tensor:
    """The per-row Spearman rho expected from the logit ratio ``r`` and the number of keys ``K`` alone.

    Model: a row's attention logits ``x_i`` and the NW logits' key-norm term ``y_i = |k_i|^2 / 2`` (in the same
    units) are independent Gaussians with ``sd(x) / sd(y) = r``; the NW ranks follow ``x - y``, whose correlation
    with ``x`` is ``c = r / sqrt(1 + r^2)``, and ``K`` samples of a bivariate normal with correlation ``c`` have the
    expected Spearman rho (Moran 1948)

        E[rho] = 6 / (pi (K + 1)) * (asin(c) + (K - 2) asin(c / 2)).

    ``ratio`` of any shape (``inf`` gives ``c = 1``, a negative ``r`` a negative ``c``), ``keys`` an int or
    broadcastable to it; the result in ``ratio``'s floating dtype.
    """
    ratio = ratio if ratio.is_floating_point() else ratio.float()
    c = torch.sign(ratio) * (1 + ratio.pow(-2)).rsqrt()  # r / sqrt(1 + r^2), finite for r = inf
    if not isinstance(keys, torch.Tensor):  # asin(c) + (K - 2) asin(c / 2) in one add
        return torch.add(torch.asin(c), torch.asin(c / 2), alpha=keys - 2) * (6 / (math.pi * (keys + 1)))
    keys = keys.to(ratio.dtype)
    return 6 / (math.pi * (keys + 1)) * (torch.asin(c) + (keys - 2) * torch.asin(c / 2))
