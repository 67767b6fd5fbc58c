"""Blockwise multi-head smoothing (§C.4) and the Mahalanobis equivalence (§C.3) against explicit forms."""

import pytest
import torch

from ipa_probe.theory import (
    blockwise_nw_mean,
    blockwise_nw_velocity,
    blockwise_nw_weights,
    mahalanobis_nw_velocity,
    mahalanobis_nw_weights,
    n_eff,
    nw_velocity,
)


def _task(gen, n=20, m=15, d=6, batch=()):
    support = 1.5 * torch.randn(*batch, m, d, generator=gen, dtype=torch.float64)
    x = torch.randn(*batch, n, d, generator=gen, dtype=torch.float64)
    return x, support


def _orthogonal(gen, d):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q


@pytest.mark.parametrize("t", [0.1, 0.6, 0.99])
def test_one_head_is_the_exact_field(gen, t):
    x, support = _task(gen)
    exact = nw_velocity(x, t, support)
    torch.testing.assert_close(blockwise_nw_velocity(x, t, support), exact, atol=1e-10, rtol=0)
    torch.testing.assert_close(blockwise_nw_velocity(x, t, support, n_heads=1), exact, atol=1e-10, rtol=0)
    # One head over any orthonormal basis of R^d: the isotropic kernel is rotation invariant.
    rotation = _orthogonal(gen, 6)
    rotated = blockwise_nw_velocity(x, t, support, projections=rotation[None])
    torch.testing.assert_close(rotated, exact, atol=1e-9, rtol=0)


def _explicit_blockwise_mean(x, support, h, bases):
    """sum_j P_j P_j^T sum_i softmax_i(-|P_j^T (x - s_i)|^2 / (2 h^2)) s_i, with explicit differences."""
    total = torch.zeros_like(x)
    for p in bases:
        diff = (x[:, None, :] - support[None, :, :]) @ p  # (n, m, k)
        w = torch.softmax(-(diff**2).sum(-1) / (2 * h**2), dim=-1)
        total = total + (w @ support) @ p @ p.T
    return total


@pytest.mark.parametrize("n_heads", [2, 3, 6])
def test_coordinate_blocks_against_explicit_heads(gen, n_heads):
    x, support = _task(gen)
    eye = torch.eye(6, dtype=torch.float64)
    bases = list(eye.tensor_split(n_heads, dim=1))
    expected = _explicit_blockwise_mean(x, support, 0.7, bases)
    torch.testing.assert_close(blockwise_nw_mean(x, support, 0.7, n_heads=n_heads), expected)
    torch.testing.assert_close(blockwise_nw_mean(x, support, 0.7, projections=bases), expected)
    weights = blockwise_nw_weights(x, support, 0.7, n_heads=n_heads)
    assert weights.shape == (n_heads, 20, 15)
    torch.testing.assert_close(weights.sum(-1), torch.ones(n_heads, 20, dtype=torch.float64))


def test_rotated_blocks_and_uneven_heads(gen):
    x, support = _task(gen, d=5)
    rotation = _orthogonal(gen, 5)
    bases = [rotation[:, :2], rotation[:, 2:]]  # k = 2 and 3
    torch.testing.assert_close(
        blockwise_nw_mean(x, support, 0.5, projections=bases), _explicit_blockwise_mean(x, support, 0.5, bases)
    )
    assert blockwise_nw_mean(x, support, 0.5, n_heads=2).shape == (20, 5)  # blocks of 3 and 2 coordinates


def test_more_heads_collapse_later(gen):
    """Per-head kernels live in d / H dimensions: their n_eff is larger than the single d-dim kernel's (§C.4)."""
    x, support = _task(gen, n=200, m=50, d=16)
    h = 0.8
    single = n_eff(blockwise_nw_weights(x, support, h, n_heads=1)).mean()
    four = n_eff(blockwise_nw_weights(x, support, h, n_heads=4)).mean()
    assert four > 2 * single


def test_many_heads_is_not_the_exact_field(gen):
    x, support = _task(gen)
    difference = blockwise_nw_velocity(x, 0.6, support, n_heads=3) - nw_velocity(x, 0.6, support)
    assert difference.abs().max() > 1e-3


def test_blockwise_batched(gen):
    x, support = _task(gen, batch=(2,))
    out = blockwise_nw_velocity(x, 0.5, support, n_heads=2)
    torch.testing.assert_close(
        out, torch.stack([blockwise_nw_velocity(x[b], 0.5, support[b], n_heads=2) for b in range(2)])
    )


def test_blockwise_bad_input(gen):
    x, support = _task(gen)
    with pytest.raises(ValueError, match=r"n_heads an int in \[1, d = 6\]"):
        blockwise_nw_velocity(x, 0.5, support, n_heads=7)
    with pytest.raises(ValueError, match="orthonormal basis"):
        blockwise_nw_velocity(x, 0.5, support, projections=[torch.eye(6, dtype=torch.float64)[:, :3]])
    with pytest.raises(ValueError, match="orthonormal basis"):
        blockwise_nw_velocity(x, 0.5, support, projections=2 * torch.eye(6, dtype=torch.float64)[None])
    with pytest.raises(ValueError, match="n_heads = len"):
        blockwise_nw_velocity(x, 0.5, support, n_heads=2, projections=torch.eye(6)[None])
    with pytest.raises(ValueError, match=r"\(H, d, k\)"):
        blockwise_nw_velocity(x, 0.5, support, projections=[torch.eye(5)])


def test_mahalanobis_weights_equal_the_explicit_metric(gen):
    x, support = _task(gen, d=4)
    L = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    M = L @ L.T
    diff = x[:, None, :] - support[None, :, :]  # (n, m, d)
    quad = torch.einsum("nmi,ij,nmj->nm", diff, M, diff)
    expected = torch.softmax(-quad / (2 * 0.9**2), dim=-1)
    torch.testing.assert_close(mahalanobis_nw_weights(x, support, 0.9, L), expected)
    # A rank-deficient factor ignores the directions outside its span.
    low = L[:, :2]
    quad_low = torch.einsum("nmi,ij,nmj->nm", diff, low @ low.T, diff)
    torch.testing.assert_close(
        mahalanobis_nw_weights(x, support, 0.9, low), torch.softmax(-quad_low / (2 * 0.9**2), dim=-1)
    )


@pytest.mark.parametrize("t", [0.2, 0.7, 0.95])
def test_mahalanobis_velocity_is_the_mapped_isotropic_field(gen, t):
    """With y = L^T x, the anisotropic field maps to the isotropic field of the mapped support: u @ L = u_iso(y)."""
    x, support = _task(gen, d=4)
    L = torch.randn(4, 4, generator=gen, dtype=torch.float64) + 2 * torch.eye(4, dtype=torch.float64)
    u = mahalanobis_nw_velocity(x, t, support, L)
    torch.testing.assert_close(u @ L, nw_velocity(x @ L, t, support @ L), atol=1e-9, rtol=1e-9)
    identity = torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close(mahalanobis_nw_velocity(x, t, support, identity), nw_velocity(x, t, support))
    with pytest.raises(ValueError, match=r"L of shape \(d, k\)"):
        mahalanobis_nw_velocity(x, t, support, L[:3])
