"""The exact fields against independent closed forms, in float64 (paper §C.2, §C.5), plus shapes and bad input."""

import math

import pytest
import torch

from ipa_probe.theory import (
    kde_log_density,
    n_eff,
    nw_eps,
    nw_log_weights,
    nw_mean,
    nw_v,
    nw_velocity,
    nw_weights,
    nw_x0,
    ot_log_density,
)

SIGMA_MIN = 0.01
TIMES = [1e-4, 0.05, 0.3, 0.56, 0.85, 0.99, 1.0]


def _task(gen, n=16, m=12, d=3, scale=2.0):
    support = scale * torch.randn(m, d, generator=gen, dtype=torch.float64)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, support


def _log_p_t(x, t, support, sigma_min=SIGMA_MIN):
    """log p_t(x) = log (1/m) sum_i N(x; t s_i, sigma_t^2 I), written with torch.distributions."""
    sigma_t = 1 - (1 - sigma_min) * t
    normal = torch.distributions.Normal(t * support, sigma_t)  # batch (m, d)
    return torch.logsumexp(normal.log_prob(x.unsqueeze(-2)).sum(-1), dim=-1) - math.log(support.shape[0])


def _posterior_velocity(x, t, support, sigma_min=SIGMA_MIN):
    """sum_i w_i u_t(x | s_i) with w_i the posterior P(X1 = s_i | X_t = x) from explicit differences."""
    sigma_t = 1 - (1 - sigma_min) * t
    sq = ((x[:, None, :] - t * support[None, :, :]) ** 2).sum(-1)  # (n, m)
    w = torch.softmax(-sq / (2 * sigma_t**2), dim=-1)
    conditional = (support[None, :, :] - (1 - sigma_min) * x[:, None, :]) / sigma_t  # u_t(x | s_i), (n, m, d)
    return (w[..., None] * conditional).sum(1)


@pytest.mark.parametrize("t", TIMES)
def test_velocity_equals_posterior_average(gen, t):
    x, support = _task(gen)
    x = x * (1 - t) + t * support[: 16 % 12].mean(0)  # points near where the flow actually is
    torch.testing.assert_close(nw_velocity(x, t, support), _posterior_velocity(x, t, support), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("t", [0.05, 0.3, 0.56, 0.85, 0.99])
def test_velocity_equals_score_form(gen, t):
    """u_t(x) = x / t + (sigma_t / t) grad log p_t(x), the score by autograd of the mixture density."""
    x, support = _task(gen)
    x = (t * support[torch.arange(16) % 12] + (1 - 0.99 * t) * x).requires_grad_()
    (score,) = torch.autograd.grad(_log_p_t(x, t, support).sum(), x)
    sigma_t = 1 - (1 - SIGMA_MIN) * t
    expected = x.detach() / t + sigma_t / t * score
    torch.testing.assert_close(nw_velocity(x.detach(), t, support), expected, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("t", [0.05, 0.5, 0.99])
def test_form_one_equals_form_two(gen, t):
    """(m_h(x~) - (1 - sigma_min) x) / sigma_t = x~ + (m_h(x~) - x~) / sigma_t with x~ = x / t, h = sigma_t / t."""
    x, support = _task(gen)
    sigma_t = 1 - (1 - SIGMA_MIN) * t
    x_tilde = x / t
    form_two = x_tilde + (nw_mean(x_tilde, support, sigma_t / t) - x_tilde) / sigma_t
    torch.testing.assert_close(nw_velocity(x, t, support), form_two, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("t", [0.1, 0.5, 0.9])
def test_kde_identity(gen, t):
    """t^d p_t(t x~) is the Gaussian KDE of the support at h(t) (paper Prop 4.2)."""
    x_tilde, support = _task(gen, d=4)
    d = x_tilde.shape[-1]
    h = (1 - (1 - SIGMA_MIN) * t) / t
    descaled = d * math.log(t) + _log_p_t(t * x_tilde, t, support)
    kde = torch.logsumexp(
        torch.distributions.Normal(support, h).log_prob(x_tilde.unsqueeze(-2)).sum(-1), dim=-1
    ) - math.log(support.shape[0])
    torch.testing.assert_close(descaled, kde)
    torch.testing.assert_close(kde_log_density(x_tilde, support, h), kde)
    torch.testing.assert_close(ot_log_density(t * x_tilde, t, support) + d * math.log(t), kde)


def test_weights_simplex_hull_and_limits(gen):
    x, support = _task(gen, n=64, m=20)
    for h in [1e-3, 0.1, 1.0, 1e3]:
        w = nw_weights(x, support, h)
        assert w.shape == (64, 20)
        assert bool((w >= 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones(64, dtype=torch.float64))
        torch.testing.assert_close(nw_log_weights(x, support, h).exp(), w)
        # Convex hull: for every direction u, u . m <= max_i u . s_i.
        m = nw_mean(x, support, h)
        directions = torch.randn(32, 3, generator=gen, dtype=torch.float64)
        assert bool(((m @ directions.T) <= (support @ directions.T).amax(0) + 1e-12).all())
    # Broad bandwidth: uniform weights and the global mean; narrow: the nearest neighbour.
    torch.testing.assert_close(n_eff(nw_weights(x, support, 1e6)), torch.full((64,), 20.0, dtype=torch.float64))
    nearest = torch.cdist(x, support).argmin(-1)
    torch.testing.assert_close(nw_mean(x, support, 1e-4), support[nearest])
    torch.testing.assert_close(n_eff(nw_weights(x, support, 1e-4)), torch.ones(64, dtype=torch.float64))


def test_weights_stable_in_float32_far_from_origin(gen):
    """Log-sum-exp and centring keep float32 finite and accurate for large logits and offset data."""
    x, support = _task(gen)
    x32, s32 = (x + 1e3).float(), (support + 1e3).float()
    w32 = nw_weights(x32, s32, 0.05)
    assert bool(w32.isfinite().all())
    # Against float64 on the same (rounded) inputs: the error is the computation's, not the inputs'.
    sq = ((x32.double()[:, None] - s32.double()[None]) ** 2).sum(-1)
    torch.testing.assert_close(w32.double(), torch.softmax(-sq / (2 * 0.05**2), -1), atol=1e-4, rtol=0)


def test_batched_tasks_equal_a_loop(gen):
    B, n, m, d = 3, 8, 5, 2
    x = torch.randn(B, n, d, generator=gen, dtype=torch.float64)
    support = torch.randn(B, m, d, generator=gen, dtype=torch.float64)
    t = torch.rand(B, n, generator=gen, dtype=torch.float64)
    batched = nw_velocity(x, t, support)
    looped = torch.stack([nw_velocity(x[b], t[b], support[b]) for b in range(B)])
    torch.testing.assert_close(batched, looped)
    torch.testing.assert_close(nw_velocity(x, t.unsqueeze(-1), support), batched)  # (B, n, 1)
    # Per-task time (B, 1) and one time for everything (), as floats or tensors.
    per_task = nw_velocity(x, t[:, :1], support)
    torch.testing.assert_close(per_task, torch.stack([nw_velocity(x[b], t[b, 0], support[b]) for b in range(B)]))
    torch.testing.assert_close(nw_velocity(x, 0.3, support), nw_velocity(x, torch.tensor(0.3), support))
    # A 2-D support is shared by every task.
    torch.testing.assert_close(nw_velocity(x, 0.3, support[0]), nw_velocity(x, 0.3, support[:1].expand(B, m, d)))
    # Chunked rows give the same numbers.
    torch.testing.assert_close(nw_velocity(x, t, support, chunk_size=3), batched)
    h = torch.rand(B, n, generator=gen, dtype=torch.float64) + 0.1
    torch.testing.assert_close(nw_mean(x, support, h, chunk_size=3), nw_mean(x, support, h))
    assert nw_weights(x, support, h).shape == (B, n, m)


def test_time_is_clamped_away_from_zero(gen):
    x, support = _task(gen)
    torch.testing.assert_close(nw_velocity(x, 0.0, support), nw_velocity(x, 1e-5, support))
    assert bool(nw_velocity(x, 0.0, support).isfinite().all())


@pytest.mark.parametrize("timestep_h", [(0.9, 0.3), (0.3, 2.0)])
def test_vp_denoisers(gen, timestep_h):
    """x0^ is the posterior mean of the clean point, eps^ matches the score, v^ inverts to x0^ (§C.5)."""
    abar, _ = timestep_h
    alpha, sigma = math.sqrt(abar), math.sqrt(1 - abar)
    x, support = _task(gen)
    x = alpha * support[torch.arange(16) % 12] + sigma * x
    sq = ((x[:, None, :] - alpha * support[None]) ** 2).sum(-1)
    posterior = torch.softmax(-sq / (2 * sigma**2), dim=-1)
    x0 = nw_x0(x, alpha, sigma, support)
    torch.testing.assert_close(x0, posterior @ support)
    # Score of the noisy marginal (1/m) sum_i N(x; alpha s_i, sigma^2 I) is -eps^ / sigma.
    xg = x.clone().requires_grad_()
    log_p = torch.logsumexp(torch.distributions.Normal(alpha * support, sigma).log_prob(xg[:, None]).sum(-1), -1)
    (score,) = torch.autograd.grad(log_p.sum(), xg)
    eps = nw_eps(x, alpha, sigma, support)
    torch.testing.assert_close(-eps / sigma, score)
    v = nw_v(x, alpha, sigma, support)
    torch.testing.assert_close(alpha * x - sigma * v, x0)  # alpha^2 + sigma^2 = 1
    torch.testing.assert_close(alpha * x0 + sigma * eps, x)
    # Per-row coefficients, as tensors.
    rows = torch.full((16,), alpha, dtype=torch.float64)
    torch.testing.assert_close(nw_x0(x, rows, torch.full((16, 1), sigma, dtype=torch.float64), support), x0)


def test_bad_input_names_what_was_expected(gen):
    x, support = _task(gen)
    with pytest.raises(ValueError, match="same dimension"):
        nw_velocity(x, 0.5, support[:, :2])
    with pytest.raises(ValueError, match="non-empty support"):
        nw_velocity(x, 0.5, support[:0])
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        nw_velocity(x, 1.5, support)
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        nw_velocity(x, torch.tensor(float("nan")), support)
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        nw_velocity(x, -0.1, support)
    with pytest.raises(ValueError, match="h > 0"):
        nw_weights(x, support, 0.0)
    with pytest.raises(ValueError, match="h > 0"):
        nw_mean(x, support, torch.full((16,), -1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="broadcastable to the rows"):
        nw_velocity(x, torch.full((5,), 0.5), support)
    with pytest.raises(ValueError, match=r"\(n, d\) or \(B, n, d\)"):
        nw_velocity(x[0], 0.5, support)
    with pytest.raises(ValueError, match="one support per task"):
        nw_velocity(x.expand(3, 16, 3), 0.5, support.expand(2, 12, 3))
    with pytest.raises(TypeError, match="floating-point"):
        nw_weights(x.long(), support, 1.0)
    with pytest.raises(ValueError, match="alpha_t > 0"):
        nw_x0(x, 0.0, 1.0, support)
    with pytest.raises(ValueError, match="sigma_min = 0"):
        nw_velocity(x, 1.0, support, sigma_min=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        nw_mean(x, support, 1.0, chunk_size=0)
    with pytest.raises(ValueError, match=r"m >= 1"):
        n_eff(torch.ones(3, 0))
