"""Invariances of the NW smoother and the exact field, as hypothesis property tests (float64)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ipa_probe.theory import ExactNWHead, mmd2, n_eff, nw_mean, nw_velocity, nw_weights

SETTINGS = settings(max_examples=25, deadline=None)

sizes = st.tuples(st.integers(1, 12), st.integers(1, 10), st.integers(1, 5))  # n, m, d
seeds = st.integers(0, 2**31 - 1)
bandwidths = st.floats(0.05, 20.0)
scales = st.floats(0.1, 10.0)


def _draw(seed, n, m, d, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    support = scale * torch.randn(m, d, generator=gen, dtype=torch.float64)
    x = scale * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, support, gen


@SETTINGS
@given(seed=seeds, size=sizes, h=bandwidths)
def test_permuting_the_support_changes_nothing(seed, size, h):
    x, support, gen = _draw(seed, *size)
    perm = torch.randperm(support.shape[0], generator=gen)
    torch.testing.assert_close(nw_mean(x, support[perm], h), nw_mean(x, support, h))
    torch.testing.assert_close(nw_weights(x, support[perm], h), nw_weights(x, support, h)[:, perm])
    torch.testing.assert_close(nw_velocity(x, 0.7, support[perm]), nw_velocity(x, 0.7, support))


@SETTINGS
@given(seed=seeds, size=sizes, h=bandwidths, shift=st.floats(-50.0, 50.0))
def test_translating_queries_and_support_translates_the_mean(seed, size, h, shift):
    x, support, gen = _draw(seed, *size)
    offset = shift * torch.randn(size[2], generator=gen, dtype=torch.float64)
    torch.testing.assert_close(nw_mean(x + offset, support + offset, h), nw_mean(x, support, h) + offset)
    torch.testing.assert_close(nw_weights(x + offset, support + offset, h), nw_weights(x, support, h))


@SETTINGS
@given(seed=seeds, size=sizes, h=bandwidths, c=scales)
def test_scaling_everything_scales_the_mean(seed, size, h, c):
    """w(c x; c S, c h) = w(x; S, h), hence m(c x; c S, c h) = c m(x; S, h)."""
    x, support, _ = _draw(seed, *size)
    torch.testing.assert_close(nw_mean(c * x, c * support, c * h), c * nw_mean(x, support, h))


@SETTINGS
@given(seed=seeds, size=sizes, h=bandwidths, scale=scales)
def test_weights_in_simplex_and_mean_in_hull(seed, size, h, scale):
    x, support, gen = _draw(seed, *size, scale=scale)
    w = nw_weights(x, support, h)
    assert bool((w >= 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(size[0], dtype=torch.float64))
    neff = n_eff(w)
    assert bool(((neff >= 1 - 1e-9) & (neff <= size[1] + 1e-9)).all())
    m = nw_mean(x, support, h)
    directions = torch.randn(16, size[2], generator=gen, dtype=torch.float64)
    slack = 1e-9 * (1 + support.abs().max())
    assert bool(((m @ directions.T) <= (support @ directions.T).amax(0) + slack).all())


@SETTINGS
@given(seed=seeds, size=sizes, t=st.floats(1e-4, 1.0))
def test_head_equals_field(seed, size, t):
    x, support, _ = _draw(seed, *size)
    torch.testing.assert_close(ExactNWHead()(x, t, support), nw_velocity(x, t, support), atol=1e-9, rtol=1e-9)


@settings(max_examples=15, deadline=None)
@given(seed=seeds, n=st.integers(2, 20), d=st.integers(1, 4))
def test_mmd2_symmetric(seed, n, d):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n + 3, d, generator=gen, dtype=torch.float64) + 0.3
    torch.testing.assert_close(mmd2(x, y), mmd2(y, x))
    torch.testing.assert_close(mmd2(x[torch.randperm(n, generator=gen)], y), mmd2(x, y))
