"""ipa_probe: IP-Adapter attention against Gaussian Nadaraya–Watson kernel smoothing.

Explicit re-exports only; the code lives in the modules named below.
"""

from . import images, layers, pipelines, pipelines_dit, report, sweep, taps, theory
from .exact import ExactNWDenoiser, ExactNWPipeline, exact_pipeline
from .kernels import dot_logits, key_norm_bias, matched_bandwidth, n_eff, nw_logits, nw_weights
from .layers import find_ip_layers
from .pipelines import default_reference_images, save_tiny_pipeline, tiny_pipeline
from .pipelines_dit import tiny_flux_pipeline, tiny_sd3_pipeline
from .probe import ProbeConfig, ProbeRun, probe
from .processors import NWHeadAttnProcessor, NWHeadConfig, apply_nw_head, nw_head, remove_nw_head
from .processors_dit import FluxNWHeadAttnProcessor, SD3NWHeadAttnProcessor
from .stats import STAT_NAMES, compare_weights
from .sweep import SweepRunner, read_manifest, run_sweep
from .theory import ExactNWHead, OTSchedule, VPSchedule, nw_velocity

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
    "images",
    "layers",
    "pipelines",
    "probe",
    "report",
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
    "pipelines_dit",
    "taps",
    "tiny_flux_pipeline",
    "tiny_sd3_pipeline",
]
