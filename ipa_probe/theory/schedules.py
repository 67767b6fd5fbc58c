"""Noise schedules as small objects that return dataclasses of coefficients (paper §C.1, §C.5).

Both schedules are affine paths ``x_t = alpha_t x_data + sigma_t noise``. On such a path, the exact field induced
by a finite support is a Gaussian Nadaraya–Watson (NW) smoother of the rescaled point ``x / alpha_t`` at the
bandwidth ``h = sigma_t / alpha_t``; the schedules therefore report ``h`` next to ``alpha_t`` and ``sigma_t``.

- :class:`OTSchedule`: the Gaussian OT path of flow matching (Lipman et al. 2023), with flow time ``t`` in
  ``[0, 1]`` running from noise (0) to data (1): ``alpha_t = t``, ``sigma_t = 1 - (1 - sigma_min) t``.
- :class:`VPSchedule`: the variance-preserving (DDPM) path of Stable Diffusion, read from any diffusers
  scheduler's ``alphas_cumprod``: ``alpha_t = sqrt(abar_t)``, ``sigma_t = sqrt(1 - abar_t)``, with the integer
  diffusion timestep running from ``T - 1`` (noise) to 0 (data).

The two meet through the bandwidth: an OT time and a VP timestep with the same ``h`` give the same NW weights, and
``OTSchedule.t_from_h`` maps a VP bandwidth to its OT time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_unit_interval

__all__ = ["OTPathCoefficients", "OTSchedule", "VPCoefficients", "VPSchedule"]


@dataclass(frozen=True)
class OTPathCoefficients:
    """Coefficients of the Gaussian OT path at flow times ``t`` (every field has ``t``'s shape).

    Attributes:
        t: flow time in ``[0, 1]``.
        alpha_t: data coefficient ``alpha_t = t``.
        sigma_t: noise coefficient ``sigma_t = 1 - (1 - sigma_min) t``.
        d_alpha_t: ``d alpha_t / dt = 1``.
        d_sigma_t: ``d sigma_t / dt = -(1 - sigma_min)``.
        h: NW bandwidth ``h(t) = sigma_t / t`` (``inf`` at ``t = 0``).
    """

    t: torch.Tensor
    alpha_t: torch.Tensor
    sigma_t: torch.Tensor
    d_alpha_t: torch.Tensor
    d_sigma_t: torch.Tensor
    h: torch.Tensor


@dataclass(frozen=True)
class OTSchedule:
    """The Gaussian OT path ``x_t = t x_1 + sigma_t x_0`` with ``sigma_t = 1 - (1 - sigma_min) t`` (paper §C.1).

    ``x_0 ~ N(0, I)`` is the noise and ``x_1`` the data, so ``sigma_0 = 1`` and ``sigma_1 = sigma_min``. Under this
    path the exact velocity of a finite support is an NW smoother at the bandwidth

        h(t) = sigma_t / t = 1/t - (1 - sigma_min),

    which decreases from ``+inf`` at ``t = 0`` (uniform weights: the global mean) to ``sigma_min`` at ``t = 1``
    (nearest neighbour). Its inverse is ``t(h) = 1 / (h + 1 - sigma_min)``; ``sigma_min`` is in ``[0, 1)``.

    Example:
        >>> schedule = OTSchedule(sigma_min=0.01)
        >>> c = schedule(torch.tensor([0.5]))
        >>> c.h  # sigma_t / t = 0.505 / 0.5
        tensor([1.0100])
        >>> schedule.t_from_h(c.h)
        tensor([0.5000])
    """

    sigma_min: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.sigma_min) < 1.0:
            raise ValueError(f"expected sigma_min in [0, 1), got {self.sigma_min}")

    def _t(self, t: float | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t)
        if not t.is_floating_point():
            t = t.to(torch.get_default_dtype())
        return check_unit_interval(t)

    def sigma(self, t: float | torch.Tensor) -> torch.Tensor:
        """``sigma_t = 1 - (1 - sigma_min) t`` for flow times ``t`` in ``[0, 1]`` (any shape)."""
        return 1.0 - (1.0 - self.sigma_min) * self._t(t)

    def h(self, t: float | torch.Tensor) -> torch.Tensor:
        """The NW bandwidth ``h(t) = sigma_t / t`` for flow times ``t`` in ``[0, 1]`` (``inf`` at ``t = 0``)."""
        t = self._t(t)
        return (1.0 - (1.0 - self.sigma_min) * t) / t

    def t_from_h(self, h: float | torch.Tensor) -> torch.Tensor:
        """Given bandwidths ``h >= sigma_min``, returns the flow times ``t(h) = 1 / (h + 1 - sigma_min)``.

        Bandwidths below ``sigma_min`` would need ``t > 1``, past the data end of the path, and raise.
        """
        h = torch.as_tensor(h)
        if not h.is_floating_point():
            h = h.to(torch.get_default_dtype())
        # Relative slack so that h(1) computed in float32 maps back to t = 1 instead of raising.
        if not bool((h >= self.sigma_min * (1 - 1e-6)).all()):
            raise ValueError(
                f"expected bandwidths h >= sigma_min = {self.sigma_min} (t <= 1), got min {h.min().item():.6g}; "
                "use an OTSchedule with a smaller sigma_min to reach smaller bandwidths"
            )
        return (1.0 / (h + 1.0 - self.sigma_min)).clamp(max=1.0)

    def __call__(self, t: float | torch.Tensor) -> OTPathCoefficients:
        """Given flow times ``t`` in ``[0, 1]`` (any shape), returns the path coefficients at ``t``."""
        t = self._t(t)
        sigma_t = 1.0 - (1.0 - self.sigma_min) * t
        return OTPathCoefficients(
            t=t,
            alpha_t=t,
            sigma_t=sigma_t,
            d_alpha_t=torch.ones_like(t),
            d_sigma_t=torch.full_like(t, -(1.0 - self.sigma_min)),
            h=sigma_t / t,
        )


@dataclass(frozen=True)
class VPCoefficients:
    """Coefficients of the VP path at integer timesteps (every field has the timesteps' shape, float64).

    Attributes:
        alpha_t: data coefficient ``sqrt(abar_t)``.
        sigma_t: noise coefficient ``sqrt(1 - abar_t)``.
        h: NW bandwidth ``h_t = sigma_t / alpha_t = SNR^(-1/2)``.
    """

    alpha_t: torch.Tensor
    sigma_t: torch.Tensor
    h: torch.Tensor

    @property
    def snr(self) -> torch.Tensor:
        """Signal-to-noise ratio ``alpha_t^2 / sigma_t^2 = 1 / h^2``."""
        return (self.alpha_t / self.sigma_t) ** 2


class VPSchedule:
    """The variance-preserving path ``x_t = alpha_t x_0 + sigma_t eps`` of DDPM and Stable Diffusion (paper §C.5).

    ``alpha_t = sqrt(abar_t)`` and ``sigma_t = sqrt(1 - abar_t)`` come from the cumulative products ``abar`` of a
    discrete schedule. The exact denoiser of a finite support weights support points by Gaussian NW weights of
    ``x / alpha_t`` at the bandwidth ``h_t = sigma_t / alpha_t``, which shrinks about 300-fold over SD-1.x's
    denoising (13.1 at timestep 981, 0.041 at timestep 1). ``alphas_cumprod``: ``(T,)``, each in ``(0, 1)``.

    Example:
        >>> from diffusers import DDIMScheduler
        >>> sd = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
        >>> VPSchedule.from_scheduler(sd)(torch.tensor([981, 1])).h
        tensor([13.1204,  0.0413], dtype=torch.float64)
    """

    def __init__(self, alphas_cumprod: torch.Tensor) -> None:
        abar = torch.as_tensor(alphas_cumprod).detach().to(device="cpu", dtype=torch.float64)
        if abar.ndim != 1 or abar.numel() == 0:
            raise ValueError(f"expected alphas_cumprod of shape (T,) with T >= 1, got {tuple(abar.shape)}")
        if not bool(((abar > 0) & (abar < 1)).all()):
            raise ValueError(
                "expected every alphas_cumprod in (0, 1) (abar = 1 means no noise, abar = 0 no signal), "
                f"got range [{abar.min().item():.3g}, {abar.max().item():.3g}]"
            )
        self.alphas_cumprod = abar

    @classmethod
    def from_scheduler(cls, scheduler: Any) -> VPSchedule:
        """Given a diffusers scheduler with ``alphas_cumprod`` (DDPM, DDIM, PNDM, Euler, ...), returns its schedule."""
        abar = getattr(scheduler, "alphas_cumprod", None)
        if abar is None:
            raise TypeError(
                f"expected a diffusers scheduler with an `alphas_cumprod` attribute (DDPM, DDIM, PNDM, ...), "
                f"got {type(scheduler).__name__}; for flow-matching schedulers use OTSchedule instead"
            )
        return cls(abar)

    @property
    def num_train_timesteps(self) -> int:
        """The number ``T`` of discrete timesteps."""
        return self.alphas_cumprod.numel()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_train_timesteps={self.num_train_timesteps})"

    def __call__(self, timestep: int | torch.Tensor) -> VPCoefficients:
        """Given integer timesteps in ``[0, T-1]`` (an int or a tensor of any shape), returns their coefficients.

        Integer-valued floating timesteps (as some diffusers schedulers hand out) are accepted.
        """
        ts = torch.as_tensor(timestep).detach().cpu()
        if ts.is_floating_point():
            if not bool((ts == ts.round()).all()):
                raise ValueError(
                    f"expected integer timesteps, got non-integer values such as {ts[ts != ts.round()][0].item()}; "
                    "VPSchedule is defined on the scheduler's discrete training timesteps"
                )
            ts = ts.round().long()
        elif ts.dtype == torch.bool or ts.is_complex():
            raise TypeError(f"expected integer timesteps, got {ts.dtype}")
        ts = ts.long()
        if bool(((ts < 0) | (ts >= self.num_train_timesteps)).any()):
            raise ValueError(
                f"expected timesteps in [0, {self.num_train_timesteps - 1}], "
                f"got range [{ts.min().item()}, {ts.max().item()}]"
            )
        abar = self.alphas_cumprod[ts.flatten()].reshape(ts.shape)
        alpha_t, sigma_t = abar.sqrt(), (1.0 - abar).sqrt()
        return VPCoefficients(alpha_t=alpha_t, sigma_t=sigma_t, h=sigma_t / alpha_t)
