"""ipa_probe: IP-Adapter attention against Gaussian Nadaraya–Watson kernel smoothing.

Explicit re-exports only; the code lives in the modules named below.
"""

from .kernels import dot_logits, key_norm_bias, matched_bandwidth, n_eff, nw_logits, nw_weights
from .stats import STAT_NAMES, compare_weights

__version__ = "0.1.0"

__all__ = [
    "STAT_NAMES",
    "__version__",
    "compare_weights",
    "dot_logits",
    "key_norm_bias",
    "matched_bandwidth",
    "n_eff",
    "nw_logits",
    "nw_weights",
]
