"""ipa_probe: IP-Adapter attention against Gaussian Nadaraya–Watson kernel smoothing.

The front door holds the names the README and the notebooks call; everything else stays in its submodule
(``ipa_probe.statistics.kernels``, ``ipa_probe.statistics``, ``ipa_probe.gauge``, ...; the notebook pairs
``apply_intervention`` / ``remove_intervention`` and ``apply_nw_head`` / ``remove_nw_head`` in
``ipa_probe.intervention`` and ``ipa_probe.nwhead``). Explicit re-exports only, imported lazily.
"""

from ._lazy import lazy_attributes as _lazy_attributes

#: name -> module (relative to this package) that defines it; imported on first use, so that `import ipa_probe`
#: and the command line's argument parsing stay fast (torch and diffusers load only when a name needs them).
_EXPORTS = {
    # the probe
    "probe": ".capture.run",
    "ProbeConfig": ".capture.config",
    "ProbeRun": ".capture.run",
    "plot_overlay": ".capture.overlays",
    # the NW head and the exact NW denoiser
    "nw_head": ".nwhead",
    "exact_pipeline": ".exact",
    "ExactNWDenoiser": ".exact",
    # interventions and hook points
    "intervene": ".intervention",
    "measure_intervention": ".intervention",
    "list_hook_points": ".intervention",
    "run_with_cache": ".intervention",
    "cache_hook_points": ".intervention",
    "patch_hooks": ".intervention",
    # gauges
    "qk_gauge": ".gauge",
    "gauge_sweep": ".gauge",
    # what is attached, and where
    "list_hooks": ".layers",
    "find_ip_layers": ".layers",
    # offline pipelines
    "tiny_pipeline": ".tiny.sd",
    "default_reference_images": ".tiny.sd",
    "digits_pipeline": ".tiny.digits",
    "digits_reference_images": ".tiny.digits",
}

#: subpackages and modules reachable as attributes (``ipa_probe.sweep``), imported on first use.
_SUBMODULES = (
    "attribution",
    "capture",
    "exact",
    "gauge",
    "images",
    "intervention",
    "layers",
    "nwhead",
    "statistics",
    "sweep",
    "theory",
    "tiny",
)

__version__ = "0.1.0"

#: the names a user calls (at most 25); the subpackages are reachable as attributes too, but not star-imported
__all__ = [*_EXPORTS, "__version__"]

__getattr__, __dir__ = _lazy_attributes(__name__, _EXPORTS, _SUBMODULES)
