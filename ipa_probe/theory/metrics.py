"""Two-sample distances between generated and reference points: MMD², energy distance and a classifier test.

The definitions follow the authors' evaluation code (paper §A.4), so that numbers compare with theirs. Every
function takes one task, ``x`` of shape ``(n, d)`` and ``y`` of shape ``(n', d)``, or a batch of ``B`` tasks,
``(B, n, d)`` and ``(B, n', d)``, evaluated independently (each with its own bandwidth).
"""

from __future__ import annotations

import torch

from ._checks import check_points

__all__ = ["c2st", "energy_distance", "median_bandwidth", "mmd2"]


def _check_pair(x: torch.Tensor, y: torch.Tensor, min_points: int) -> None:
    check_points(x, "x")
    check_points(y, "y")
    if x.ndim != y.ndim or x.shape[-1] != y.shape[-1] or (x.ndim == 3 and x.shape[0] != y.shape[0]):
        raise ValueError(
            f"expected two samples of the same dimension and task count, (n, d) and (n', d) or (B, n, d) and "
            f"(B, n', d), got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if min(x.shape[-2], y.shape[-2]) < min_points:
        raise ValueError(f"expected at least {min_points} points in each sample, got {x.shape[-2]} and {y.shape[-2]}")
    if x.device != y.device:
        raise ValueError(f"expected both samples on one device, got {x.device} and {y.device}")


def _offdiag_mean(a: torch.Tensor) -> torch.Tensor:
    """Mean of the off-diagonal entries of square matrices ``(..., n, n)`` -> ``(...)``."""
    n = a.shape[-1]
    return (a.sum((-2, -1)) - a.diagonal(dim1=-2, dim2=-1).sum(-1)) / (n * (n - 1))


def median_bandwidth(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The median-heuristic bandwidth of :func:`mmd2`: the lower median of all pooled pairwise distances.

    With ``z = concat(x, y)`` (``N = n + n'`` points), ``sigma`` is the lower median of the ``N x N`` matrix
    ``torch.cdist(z, z)``, zero diagonal included (``N^2`` entries); values below ``1e-8`` become 1. Shape ``()`` or
    ``(B,)``.
    """
    _check_pair(x, y, 1)
    z = torch.cat([x, y.to(x.dtype)], dim=-2)  # (..., N, d)
    return _median_of(torch.cdist(z, z))


def _median_of(dist: torch.Tensor) -> torch.Tensor:
    sigma = dist.flatten(-2).median(dim=-1).values  # lower median of N^2 entries, per task
    return torch.where(sigma < 1e-8, torch.ones_like(sigma), sigma)


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidth: float | torch.Tensor | None = None) -> torch.Tensor:
    """Unbiased squared maximum mean discrepancy with a Gaussian kernel (Gretton et al. 2012).

    With ``k(a, b) = exp(-|a - b|^2 / (2 sigma^2))``, the U-statistic is

        MMD² = 1/(n(n-1)) sum_{i != j} k(x_i, x_j) + 1/(n'(n'-1)) sum_{i != j} k(y_i, y_j)
               - 2/(n n') sum_{i, j} k(x_i, y_j).

    Its expectation is the population MMD², 0 when both samples come from one law, so estimates scatter around
    0 (negative values included) for equal laws. ``sigma`` defaults to the median heuristic of
    :func:`median_bandwidth`: the lower median of the ``(n + n')^2`` pooled ``torch.cdist`` distances, zero
    diagonal included, replaced by 1 below 1e-8 (exactly the authors' ``metrics.py``), per task; a given ``bandwidth``
    is a float or ``(B,)``. ``n, n' >= 2``; shape ``()`` or ``(B,)``, in ``x``'s dtype.
    """
    _check_pair(x, y, 2)
    n = x.shape[-2]
    z = torch.cat([x, y.to(x.dtype)], dim=-2)  # (..., N, d)
    dist = torch.cdist(z, z)  # (..., N, N)
    if bandwidth is None:
        sigma = _median_of(dist)
    else:
        sigma = torch.as_tensor(bandwidth, dtype=x.dtype, device=x.device)
        if not bool((sigma > 0).all()):
            raise ValueError(f"expected a bandwidth > 0, got {bandwidth}")
    gram = torch.exp(-dist.square() / (2 * sigma[..., None, None] ** 2))  # (..., N, N)
    k_xx, k_yy, k_xy = gram[..., :n, :n], gram[..., n:, n:], gram[..., :n, n:]
    return _offdiag_mean(k_xx) + _offdiag_mean(k_yy) - 2 * k_xy.mean((-2, -1))


def energy_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Unbiased energy distance ``2 E|X - Y| - E|X - X'| - E|Y - Y'|`` (Székely & Rizzo).

    The cross term is the mean over all ``n n'`` pairs; the within-sample terms are U-statistics (means over the
    ``n(n-1)`` pairs ``i != j``), so the estimate is unbiased and scatters around 0 for equal laws. Arguments as in
    :func:`mmd2` (``n, n' >= 2``); returns shape ``()`` or ``(B,)``.
    """
    _check_pair(x, y, 2)
    y = y.to(x.dtype)
    return 2 * torch.cdist(x, y).mean((-2, -1)) - _offdiag_mean(torch.cdist(x, x)) - _offdiag_mean(torch.cdist(y, y))


def c2st(x: torch.Tensor, y: torch.Tensor, folds: int = 5, seed: int = 0) -> float | torch.Tensor:
    """Classifier two-sample test: cross-validated accuracy of a logistic regression telling ``x`` from ``y``.

    scikit-learn's ``LogisticRegression(max_iter=1000)`` (lbfgs) on the raw coordinates, labels 0 for ``x`` and
    1 for ``y``, scored by the mean accuracy over ``folds`` shuffled stratified folds (as in the authors' code).
    About 0.5 means the classifier cannot tell the samples apart; 1.0 means they are separable. A linear
    classifier only sees differences that a hyperplane separates (means, not variances). ``folds``: >= 2 and at most
    the smaller sample size; ``seed`` shuffles them. A float for one task, a float64 ``(B,)`` tensor for a batch.
    """
    from sklearn.linear_model import LogisticRegression  # optional at import time: only this function needs it
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ValueError(f"expected folds an int >= 2, got {folds!r}")
    _check_pair(x, y, folds)
    if x.ndim == 3:
        return torch.tensor([c2st(a, b, folds=folds, seed=seed) for a, b in zip(x, y, strict=True)])
    features = torch.cat([x, y.to(x.dtype)]).detach().cpu().double().numpy()
    labels = [0] * x.shape[0] + [1] * y.shape[0]
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    scores = cross_val_score(LogisticRegression(max_iter=1000), features, labels, cv=splitter, scoring="accuracy")
    return float(scores.mean())
