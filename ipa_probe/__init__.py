"""ipa_probe: IP-Adapter attention against Gaussian Nadaraya–Watson kernel smoothing.

Explicit re-exports only, imported lazily; the code lives in the modules named in ``_EXPORTS``.
"""

import importlib

#: name -> module (relative to this package) that defines it; imported on first use, so that `import ipa_probe`
#: and the command line's argument parsing stay fast (torch and diffusers load only when a name needs them).
_EXPORTS = {
    "ProbeConfig": ".capture.config",
    "ProbeRun": ".capture.run",
    "probe": ".capture.run",
    "plot_overlay": ".capture.mapplots",
    "ExactNWDenoiser": ".exact",
    "ExactNWPipeline": ".exact",
    "exact_pipeline": ".exact",
    "dot_logits": ".kernels",
    "key_norm_bias": ".kernels",
    "matched_bandwidth": ".kernels",
    "n_eff": ".kernels",
    "nw_logits": ".kernels",
    "nw_weights": ".kernels",
    "Intervention": ".intervention",
    "InterventionConfig": ".intervention",
    "InterventionEffect": ".intervention",
    "apply_intervention": ".intervention",
    "intervene": ".intervention",
    "measure_intervention": ".intervention",
    "remove_intervention": ".intervention",
    "find_ip_layers": ".layers",
    "list_hooks": ".layers",
    "FluxNWHeadAttnProcessor": ".nwhead",
    "NWHeadAttnProcessor": ".nwhead",
    "NWHeadConfig": ".nwhead",
    "SD3NWHeadAttnProcessor": ".nwhead",
    "apply_nw_head": ".nwhead",
    "nw_head": ".nwhead",
    "remove_nw_head": ".nwhead",
    "STAT_NAMES": ".stats",
    "compare_weights": ".stats",
    "SweepRunner": ".sweep",
    "read_manifest": ".sweep",
    "run_sweep": ".sweep",
    "ExactNWHead": ".theory",
    "OTSchedule": ".theory",
    "VPSchedule": ".theory",
    "nw_velocity": ".theory",
    "tiny_flux_pipeline": ".tiny.dit",
    "tiny_sd3_pipeline": ".tiny.dit",
    "digits_pipeline": ".tiny.digits",
    "digits_reference_images": ".tiny.digits",
    "default_reference_images": ".tiny.sd",
    "save_tiny_pipeline": ".tiny.sd",
    "tiny_pipeline": ".tiny.sd",
}

#: subpackages and modules reachable as attributes (``ipa_probe.sweep``), imported on first use.
_SUBMODULES = ("attribution", "capture", "images", "intervention", "layers", "nwhead", "sweep", "theory", "tiny")

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
    "plot_overlay",
    "capture",
    "save_tiny_pipeline",
    "tiny_pipeline",
    "__version__",
    "compare_weights",
    "default_reference_images",
    "digits_pipeline",
    "digits_reference_images",
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
    "Intervention",
    "InterventionConfig",
    "InterventionEffect",
    "apply_intervention",
    "intervene",
    "intervention",
    "measure_intervention",
    "remove_intervention",
    "attribution",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
