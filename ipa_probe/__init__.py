"""ipa_probe: IP-Adapter attention against Gaussian Nadaraya–Watson kernel smoothing.

Explicit re-exports only; the code lives in the modules named below.
"""

from . import capture, images, layers, nwhead, sweep, theory, tiny
from .capture.run import ProbeConfig, ProbeRun, probe
from .exact import ExactNWDenoiser, ExactNWPipeline, exact_pipeline
from .kernels import dot_logits, key_norm_bias, matched_bandwidth, n_eff, nw_logits, nw_weights
from .layers import find_ip_layers, list_hooks
from .nwhead import (
    FluxNWHeadAttnProcessor,
    NWHeadAttnProcessor,
    NWHeadConfig,
    SD3NWHeadAttnProcessor,
    apply_nw_head,
    nw_head,
    remove_nw_head,
)
from .stats import STAT_NAMES, compare_weights
from .sweep import SweepRunner, read_manifest, run_sweep
from .theory import ExactNWHead, OTSchedule, VPSchedule, nw_velocity
from .tiny.dit import tiny_flux_pipeline, tiny_sd3_pipeline
from .tiny.sd import default_reference_images, save_tiny_pipeline, tiny_pipeline

__version__ = "0.1.0"

__all__ = [
    "ExactNWDenoiser",
    "ExactNWPipeline",
    "NWHeadAttnProcessor",
    "NWHeadConfig",
    "apply_nw_head",
    "exact_pipeline",
    "nw_head",
    "remove_nw_head",
    "STAT_NAMES",
    "ProbeConfig",
    "ProbeRun",
    "find_ip_layers",
    "list_hooks",
    "images",
    "layers",
    "tiny",
    "probe",
    "capture",
    "save_tiny_pipeline",
    "tiny_pipeline",
    "__version__",
    "compare_weights",
    "default_reference_images",
    "dot_logits",
    "key_norm_bias",
    "matched_bandwidth",
    "n_eff",
    "nw_logits",
    "nw_weights",
    "theory",
    "ExactNWHead",
    "OTSchedule",
    "VPSchedule",
    "nw_velocity",
    "sweep",
    "SweepRunner",
    "read_manifest",
    "run_sweep",
    "FluxNWHeadAttnProcessor",
    "SD3NWHeadAttnProcessor",
    "nwhead",
    "tiny_flux_pipeline",
    "tiny_sd3_pipeline",
]
