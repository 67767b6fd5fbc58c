"""The exact empirical fields of a finite support and their realisation as attention. Pure torch.

Under the Gaussian OT path the exact velocity induced by a support ``S`` is a Gaussian Nadaraya–Watson smoother at
the bandwidth ``h(t) = sigma_t / t`` (paper §C.2), and one zero-parameter attention head computes it exactly
(§C.3). Modules:

- :mod:`.schedules`: :class:`OTSchedule` and :class:`VPSchedule` returning coefficient dataclasses;
- :mod:`.smoothing`: NW weights, means, ``n_eff`` and the Gaussian KDE;
- :mod:`.fields`: the exact OT velocity and the VP denoisers (``x0``, ``eps``, ``v``);
- :mod:`.attention`: :class:`ExactNWHead`, the field through ``scaled_dot_product_attention``;
- :mod:`.blockwise`: multi-head blockwise smoothers (§C.4) and Mahalanobis kernels;
- :mod:`.sampling`: Euler and adaptive ODE sampling for any velocity callable;
- :mod:`.metrics`: MMD², energy distance and the classifier two-sample test.

Explicit re-exports only.
"""

from .attention import ExactNWHead, lifted_keys, lifted_queries
from .blockwise import (
    blockwise_nw_mean,
    blockwise_nw_velocity,
    blockwise_nw_weights,
    mahalanobis_nw_velocity,
    mahalanobis_nw_weights,
)
from .fields import T_EPS, nw_eps, nw_v, nw_velocity, nw_x0, ot_log_density
from .metrics import c2st, energy_distance, median_bandwidth, mmd2
from .sampling import VelocityFn, euler_sample, odeint_sample, sample_nw_flow
from .schedules import OTPathCoefficients, OTSchedule, VPCoefficients, VPSchedule
from .smoothing import kde_log_density, n_eff, nw_log_weights, nw_mean, nw_weights

__all__ = [
    "T_EPS",
    "ExactNWHead",
    "OTPathCoefficients",
    "OTSchedule",
    "VPCoefficients",
    "VPSchedule",
    "VelocityFn",
    "blockwise_nw_mean",
    "blockwise_nw_velocity",
    "blockwise_nw_weights",
    "c2st",
    "energy_distance",
    "euler_sample",
    "kde_log_density",
    "lifted_keys",
    "lifted_queries",
    "mahalanobis_nw_velocity",
    "mahalanobis_nw_weights",
    "median_bandwidth",
    "mmd2",
    "n_eff",
    "nw_eps",
    "nw_log_weights",
    "nw_mean",
    "nw_v",
    "nw_velocity",
    "nw_weights",
    "nw_x0",
    "odeint_sample",
    "ot_log_density",
    "sample_nw_flow",
]
