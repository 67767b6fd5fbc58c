"""The zero-parameter attention head equals the exact field (paper §C.3, Thm 5.2 / Cor 5.3)."""

import pytest
import torch

from ipa_probe.theory import ExactNWHead, lifted_keys, lifted_queries, nw_mean, nw_velocity

TIMES = [1e-5, 0.01, 0.2, 0.5, 0.85, 0.99, 1.0]


def _task(gen, dtype, n=64, m=50, d=4, batch=()):
    support = torch.randn(*batch, m, d, generator=gen, dtype=dtype)
    x = torch.randn(*batch, n, d, generator=gen, dtype=dtype)
    return x, support


def test_head_has_no_parameters():
    head = ExactNWHead()
    assert list(head.parameters()) == [] and list(head.buffers()) == []
    assert "sigma_min=0.01" in repr(head)


@pytest.mark.parametrize("t", TIMES)
def test_head_equals_nw_velocity_float64(gen, t):
    x, support = _task(gen, torch.float64)
    torch.testing.assert_close(ExactNWHead()(x, t, support), nw_velocity(x, t, support), atol=1e-10, rtol=0)


@pytest.mark.parametrize("t", [1e-5, 0.01, 0.2, 0.5])
def test_head_equals_nw_velocity_float32(gen, t):
    x, support = _task(gen, torch.float32, d=2)
    torch.testing.assert_close(ExactNWHead()(x, t, support), nw_velocity(x, t, support), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [0.85, 0.99, 1.0])
def test_head_float32_near_data_end(gen, t):
    """Near t = 1 the field is stiff (1 / sigma_t up to 100): float32 holds 1e-2 absolute, 1e-5 relative to |u|."""
    x, support = _task(gen, torch.float32, d=2)
    reference = nw_velocity(x.double(), t, support.double())
    out = ExactNWHead()(x, t, support).double()
    torch.testing.assert_close(out, reference, atol=1e-2, rtol=0)
    assert (out - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_head_batched_and_per_row_times(gen):
    x, support = _task(gen, torch.float64, batch=(3,))
    t = torch.rand(3, 64, generator=gen, dtype=torch.float64)
    head = ExactNWHead(sigma_min=0.05)
    out = head(x, t, support)
    torch.testing.assert_close(out, nw_velocity(x, t, support, sigma_min=0.05), atol=1e-10, rtol=0)
    torch.testing.assert_close(head(x, t.unsqueeze(-1), support), out)
    shared = nw_velocity(x, 0.4, support[0], sigma_min=0.05)
    torch.testing.assert_close(head(x, 0.4, support[0]), shared, atol=1e-10, rtol=0)
    sigma_t = 1 - 0.95 * t
    torch.testing.assert_close(head.local_mean(x, t, support), nw_mean(x / t[..., None], support, (sigma_t / t)))


def test_lifted_dot_product_is_the_gaussian_logit(gen):
    """q(x, t) . k_i = -|x~ - s_i|^2 / (2 h^2) + a per-row constant (the feature lift of §C.3)."""
    x, support = _task(gen, torch.float64, n=10, m=7)
    t = torch.tensor(0.3, dtype=torch.float64)
    sigma_t = 1 - 0.99 * t
    h = sigma_t / t
    dots = lifted_queries(x, t) @ lifted_keys(support).T  # (n, m)
    gaussian = -torch.cdist(x / t, support).square() / (2 * h**2)
    difference = dots - gaussian
    torch.testing.assert_close(difference, difference[:, :1].expand_as(difference))  # constant along each row
    torch.testing.assert_close(difference[:, 0], (x / t).square().sum(-1) / (2 * h**2))


def test_head_bad_input(gen):
    x, support = _task(gen, torch.float32)
    head = ExactNWHead()
    with pytest.raises(ValueError, match="same dimension"):
        head(x, 0.5, support[:, :3])
    with pytest.raises(ValueError, match="non-empty support"):
        head(x, 0.5, support[:0])
    with pytest.raises(ValueError, match=r"t in \[0, 1\]"):
        head(x, 2.0, support)
    with pytest.raises(ValueError, match=r"sigma_min in \[0, 1\)"):
        ExactNWHead(sigma_min=-0.1)


def test_head_runs_a_fused_kernel(gen):
    """The padded lifted inputs dispatch to SDPA's fused (flash) CPU kernel, which never forms the n x m matrix."""
    x, support = _task(gen, torch.float32, d=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ExactNWHead()(x, 0.5, support)
    names = {event.key for event in prof.key_averages()}
    assert any("flash_attention" in name for name in names), sorted(names)
    assert not any(name == "aten::_softmax" for name in names)
