"""ODE sampling: Euler and adaptive solvers against closed-form flows, and the m = 1 exact flow (paper §D.0 test 8)."""

import math

import pytest
import torch

from ipa_probe.theory import ExactNWHead, euler_sample, nw_velocity, odeint_sample, sample_nw_flow


def test_one_support_point_flow_lands_on_it(gen):
    """With m = 1 every sample is carried to s_1: within 1e-2 for sigma_min = 1e-3, on the exact path for 0.01."""
    s1 = torch.tensor([[2.0, -1.0, 0.5]])
    x0 = torch.randn(500, 3, generator=gen)
    for field in (lambda x, t: nw_velocity(x, t, s1, sigma_min=1e-3), lambda x, t: ExactNWHead(1e-3)(x, t, s1)):
        x1 = euler_sample(field, x0)
        assert (x1 - s1).abs().max() < 1e-2
    x1 = odeint_sample(lambda x, t: nw_velocity(x, t, s1, sigma_min=1e-3), x0)
    assert (x1 - s1).abs().max() < 1e-2
    # sigma_min = 0.01: the exact solution is x_t = t s_1 + sigma_t x_0, so x_1 = s_1 + 0.01 x_0.
    x1 = euler_sample(lambda x, t: nw_velocity(x, t, s1), x0)
    torch.testing.assert_close(x1, s1 + 0.01 * x0, atol=1e-4, rtol=0)


def test_plugin_samples_land_on_the_support(gen):
    support = 3 * torch.randn(2, 5, 2, generator=gen)
    samples = sample_nw_flow(support, 200, generator=gen)
    assert samples.shape == (2, 200, 2)
    nearest = torch.cdist(samples, support).amin(-1)  # (B, n)
    assert nearest.median() < 0.05  # memorisation: samples sit at support points, blurred by ~sigma_min


def test_euler_against_closed_form(gen):
    """dx/dt = -x from t0 to t1: Euler gives x0 (1 - dt)^k; the error to exp(-(t1 - t0)) shrinks like 1/k."""
    x0 = torch.randn(10, 2, generator=gen, dtype=torch.float64)
    dt = (1.0 - 1e-5) / 99
    out = euler_sample(lambda x, t: -x, x0)
    torch.testing.assert_close(out, x0 * (1 - dt) ** 99)
    exact = x0 * math.exp(-(1.0 - 1e-5))
    coarse = (euler_sample(lambda x, t: -x, x0, n_steps=11) - exact).abs().max()
    fine = (euler_sample(lambda x, t: -x, x0, n_steps=101) - exact).abs().max()
    assert 8 < coarse / fine < 12
    # Time-dependent field dx/dt = 2t: x(t) = x0 + t^2 - t0^2, exact for the adaptive solver.
    out = odeint_sample(lambda x, t: 2 * t * torch.ones_like(x), x0, t_min=0.0)
    torch.testing.assert_close(out, x0 + 1.0)


def test_euler_calls_with_grid_times_and_returns_trajectory():
    seen = []

    def field(x, t):
        seen.append(t)
        return torch.zeros_like(x)

    traj = euler_sample(field, torch.zeros(4, 2), n_steps=5, t_min=0.2, t_max=0.6, trajectory=True)
    assert traj.shape == (5, 4, 2)
    assert all(t.ndim == 0 and t.dtype == torch.float32 for t in seen)
    torch.testing.assert_close(torch.stack(seen), torch.tensor([0.2, 0.3, 0.4, 0.5]))


def test_sampling_bad_input():
    x0 = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="n_steps"):
        euler_sample(lambda x, t: x, x0, n_steps=1)
    with pytest.raises(ValueError, match="t_min < t_max"):
        euler_sample(lambda x, t: x, x0, t_min=0.5, t_max=0.5)
    with pytest.raises(ValueError, match="x's shape"):
        euler_sample(lambda x, t: x[:, :1], x0)
    with pytest.raises(ValueError, match="t_min < t_max"):
        odeint_sample(lambda x, t: x, x0, t_max=1.5)
    with pytest.raises(ValueError, match="n_samples"):
        sample_nw_flow(torch.zeros(3, 2), 0)


@pytest.mark.parametrize("method", ["dopri5", "bosh3"])
def test_adaptive_solver_stays_in_range_and_is_the_euler_limit(gen, method):
    support = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    x0 = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    seen = []

    def field(x, t):
        seen.append(float(t))
        return nw_velocity(x, t, support)

    adaptive = odeint_sample(field, x0, t_max=0.9, method=method, rtol=1e-6, atol=1e-6)
    assert 1e-5 <= min(seen) and max(seen) <= 0.9
    # Euler is first order: its error halves with the step, and Richardson's 2 e(2k) - e(k) removes most of it.
    coarse, fine = (
        euler_sample(lambda x, t: nw_velocity(x, t, support), x0, n_steps=k, t_max=0.9) for k in (401, 801)
    )
    error_coarse, error_fine = (adaptive - coarse).abs().max(), (adaptive - fine).abs().max()
    assert 1.7 < error_coarse / error_fine < 2.5
    assert (adaptive - (2 * fine - coarse)).abs().max() < 0.2 * error_fine
