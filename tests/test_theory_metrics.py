"""Two-sample metrics against brute-force double loops, and their behaviour on equal and shifted laws."""

import math

import pytest
import torch

from ipa_probe.theory import c2st, energy_distance, median_bandwidth, mmd2


def _brute_mmd2(x, y):
    """The paper's MMD² (§A.4) with Python loops: lower median of all pooled distances, unbiased U-statistic."""
    z = [list(map(float, row)) for row in torch.cat([x, y])]
    dist = [[math.dist(a, b) for b in z] for a in z]
    flat = sorted(v for row in dist for v in row)
    sigma = flat[(len(flat) - 1) // 2]  # lower median of N^2 entries, zero diagonal included
    sigma = 1.0 if sigma < 1e-8 else sigma
    n, k = len(x), lambda i, j: math.exp(-(dist[i][j] ** 2) / (2 * sigma**2))
    ny = len(z) - n
    xx = sum(k(i, j) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    yy = sum(k(i, j) for i in range(n, n + ny) for j in range(n, n + ny) if i != j) / (ny * (ny - 1))
    xy = sum(k(i, j) for i in range(n) for j in range(n, n + ny)) / (n * ny)
    return xx + yy - 2 * xy, sigma


def _brute_energy(x, y):
    rx, ry = [list(map(float, r)) for r in x], [list(map(float, r)) for r in y]
    cross = sum(math.dist(a, b) for a in rx for b in ry) / (len(rx) * len(ry))
    within_x = sum(math.dist(a, b) for i, a in enumerate(rx) for j, b in enumerate(rx) if i != j)
    within_y = sum(math.dist(a, b) for i, a in enumerate(ry) for j, b in enumerate(ry) if i != j)
    return 2 * cross - within_x / (len(rx) * (len(rx) - 1)) - within_y / (len(ry) * (len(ry) - 1))


@pytest.mark.parametrize(("n", "n_y", "d"), [(7, 7, 2), (9, 6, 3), (12, 10, 1)])
def test_mmd2_matches_brute_force(gen, n, n_y, d):
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n_y, d, generator=gen, dtype=torch.float64) + 0.5
    expected, sigma = _brute_mmd2(x, y)
    assert mmd2(x, y).item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert median_bandwidth(x, y).item() == pytest.approx(sigma, rel=1e-10)
    # An explicit bandwidth replaces the median heuristic.
    assert mmd2(x, y, bandwidth=sigma).item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert energy_distance(x, y).item() == pytest.approx(_brute_energy(x, y), rel=1e-10, abs=1e-12)


def test_median_fallback_for_identical_points():
    x = torch.zeros(4, 2, dtype=torch.float64)
    assert median_bandwidth(x, x).item() == 1.0
    assert mmd2(x, x).item() == pytest.approx(0.0, abs=1e-12)


def test_batched_tasks_equal_a_loop(gen):
    x = torch.randn(4, 30, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 25, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 1.5, 2.0, 3.0])[:, None, None]
    for metric in (mmd2, energy_distance, median_bandwidth):
        batched = metric(x, y)
        assert batched.shape == (4,)
        torch.testing.assert_close(batched, torch.stack([metric(x[b], y[b]) for b in range(4)]))
    sigma = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(
        mmd2(x, y, bandwidth=sigma), torch.stack([mmd2(x[b], y[b], sigma[b]) for b in range(4)])
    )


def test_equal_laws_near_zero_shifted_laws_positive(gen):
    same = mmd2(torch.randn(300, 2, generator=gen), torch.randn(300, 2, generator=gen))
    shifted = mmd2(torch.randn(300, 2, generator=gen), torch.randn(300, 2, generator=gen) + 1.0)
    assert abs(same) < 0.01 and shifted > 0.1
    same_e = energy_distance(torch.randn(300, 2, generator=gen), torch.randn(300, 2, generator=gen))
    shifted_e = energy_distance(torch.randn(300, 2, generator=gen), torch.randn(300, 2, generator=gen) + 1.0)
    assert abs(same_e) < 0.05 and shifted_e > 0.5
    # MMD² grows with the shift.
    values = [
        mmd2(torch.randn(200, 2, generator=gen), torch.randn(200, 2, generator=gen) + s).item() for s in (0.5, 1, 2)
    ]
    assert values == sorted(values)


def test_c2st_chance_and_separable(gen):
    x = torch.randn(200, 2, generator=gen)
    same = c2st(x, torch.randn(200, 2, generator=gen))
    apart = c2st(x, torch.randn(200, 2, generator=gen) + 4.0)
    assert isinstance(same, float) and 0.35 < same < 0.65
    assert apart > 0.95
    batched = c2st(torch.stack([x, x]), torch.stack([x + 4.0, torch.randn(200, 2, generator=gen)]))
    assert batched.shape == (2,) and batched[0] > 0.95 and batched[1] < 0.7


def test_metrics_bad_input(gen):
    x = torch.randn(10, 2, generator=gen)
    with pytest.raises(ValueError, match="same dimension"):
        mmd2(x, torch.randn(10, 3, generator=gen))
    with pytest.raises(ValueError, match="at least 2 points"):
        mmd2(x, x[:1])
    with pytest.raises(ValueError, match="bandwidth > 0"):
        mmd2(x, x, bandwidth=0.0)
    with pytest.raises(ValueError, match="same dimension and task count"):
        energy_distance(x.expand(2, 10, 2), x.expand(3, 10, 2))
    with pytest.raises(ValueError, match="folds"):
        c2st(x, x, folds=1)
    with pytest.raises(ValueError, match="at least 5 points"):
        c2st(x, x[:3])
