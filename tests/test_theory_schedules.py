"""Schedules: closed-form OT coefficients, the h <-> t inverse, and the VP schedule read from diffusers schedulers."""

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler

from ipa_probe.theory import OTSchedule, VPSchedule, nw_mean, nw_velocity, nw_x0


@pytest.mark.parametrize("sigma_min", [0.0, 0.01, 0.2])
def test_ot_coefficients_closed_form(sigma_min):
    t = torch.linspace(0.05, 1.0, 20, dtype=torch.float64)
    c = OTSchedule(sigma_min)(t)
    torch.testing.assert_close(c.alpha_t, t)
    torch.testing.assert_close(c.sigma_t, 1 - (1 - sigma_min) * t)
    torch.testing.assert_close(c.h, 1 / t - (1 - sigma_min))  # h = sigma_t / t = 1/t - (1 - sigma_min)
    torch.testing.assert_close(c.d_alpha_t, torch.ones_like(t))
    torch.testing.assert_close(c.d_sigma_t, torch.full_like(t, -(1 - sigma_min)))
    # Derivatives against finite differences of the coefficients.
    eps = 1e-6
    fd = (OTSchedule(sigma_min)(t - eps).sigma_t - c.sigma_t) / -eps
    torch.testing.assert_close(fd, c.d_sigma_t, atol=1e-6, rtol=0)


def test_ot_endpoints_and_inverse():
    schedule = OTSchedule(0.01)
    assert schedule.h(0.0).item() == float("inf")
    assert schedule.h(1.0).item() == pytest.approx(0.01)
    assert schedule.sigma(0.0).item() == 1.0
    t = torch.rand(50, dtype=torch.float64).clamp(min=1e-3)
    torch.testing.assert_close(schedule.t_from_h(schedule.h(t)), t)
    h = torch.logspace(-2, 3, 30, dtype=torch.float64)
    torch.testing.assert_close(schedule.h(schedule.t_from_h(h)), h)
    # h(1) rounded in float32 still maps back to t = 1 instead of raising.
    assert schedule.t_from_h(schedule.h(torch.tensor(1.0))).item() == 1.0


def test_ot_bad_input():
    with pytest.raises(ValueError, match=r"sigma_min in \[0, 1\)"):
        OTSchedule(1.0)
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        OTSchedule()(torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        OTSchedule().h(-0.1)
    with pytest.raises(ValueError, match="h >= sigma_min"):
        OTSchedule(0.01).t_from_h(0.001)


def _sd_scheduler(cls=DDIMScheduler):
    return cls(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)


def test_vp_schedule_matches_sd_table():
    """The paper's table (§C.5): h_t at SD-1.x's IP-Adapter timesteps."""
    c = VPSchedule.from_scheduler(_sd_scheduler())(torch.tensor([981, 761, 501, 261, 1]))
    torch.testing.assert_close(
        c.h, torch.tensor([13.1, 4.30, 1.62, 0.725, 0.041], dtype=torch.float64), rtol=1e-2, atol=0
    )
    torch.testing.assert_close(c.alpha_t**2 + c.sigma_t**2, torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(c.snr, 1 / c.h**2)


def test_vp_schedule_shapes_and_dtypes():
    scheduler = _sd_scheduler(DDPMScheduler)
    schedule = VPSchedule.from_scheduler(scheduler)
    assert schedule.num_train_timesteps == 1000
    abar = scheduler.alphas_cumprod.double()
    ts = torch.tensor([[0, 10], [500, 999]])
    c = schedule(ts)
    assert c.h.shape == (2, 2)
    torch.testing.assert_close(c.alpha_t, abar[ts].sqrt())
    torch.testing.assert_close(schedule(ts.float()).h, c.h)  # integer-valued floats are accepted
    assert schedule(7).h.shape == ()


def test_vp_bad_input():
    schedule = VPSchedule.from_scheduler(_sd_scheduler())
    with pytest.raises(ValueError, match=r"timesteps in \[0, 999\]"):
        schedule(torch.tensor([1000]))
    with pytest.raises(ValueError, match="integer timesteps"):
        schedule(torch.tensor([10.5]))
    with pytest.raises(TypeError, match="alphas_cumprod"):
        VPSchedule.from_scheduler(FlowMatchEulerDiscreteScheduler())
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        VPSchedule(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"shape \(T,\)"):
        VPSchedule(torch.ones(2, 2) * 0.5)


def test_vp_and_ot_meet_through_the_bandwidth(gen):
    """A VP timestep and the OT time with the same h give the same NW weights (the paper's h_to_t)."""
    support = torch.randn(20, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(10, 3, generator=gen, dtype=torch.float64)
    c = VPSchedule.from_scheduler(_sd_scheduler())(torch.tensor(501))
    t = OTSchedule(0.01).t_from_h(c.h)
    # The VP denoiser at x is the NW mean of x / alpha_t; the OT field at y = t x / alpha_t uses the same query.
    y = t * x / c.alpha_t
    m_ot = (nw_velocity(y, t, support) * (1 - 0.99 * t) + 0.99 * y).double()  # invert the affine output map
    torch.testing.assert_close(nw_x0(x, c.alpha_t, c.sigma_t, support), m_ot)
    torch.testing.assert_close(nw_x0(x, c.alpha_t, c.sigma_t, support), nw_mean(x / c.alpha_t, support, c.h))
