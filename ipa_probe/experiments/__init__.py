"""The paper's synthetic experiments: failure regimes of the exact NW field and the learned heads' attention.

``ipa-probe experiments NAME --tier quick|smoke|full`` runs them from the command line; :func:`run_experiments`
from Python. Modules: :mod:`.tasks` (meta-distributions), :mod:`.model` (the learned in-context model),
:mod:`.training`, :mod:`.evaluate`, one module per experiment, :mod:`.tiers`, :mod:`.report`, :mod:`.runner`.
"""

from .._lazy import lazy_attributes

#: name -> submodule that defines it, imported on first use: the command line checks tier names and sizes
#: (:mod:`.tiers`, no torch) before torch loads.
_EXPORTS = {
    "MMDResult": ".evaluate",
    "held_out_tasks": ".evaluate",
    "learned_velocity": ".evaluate",
    "nw_neff": ".evaluate",
    "plugin_velocity": ".evaluate",
    "ICFMVelocityNet": ".model",
    "ModelConfig": ".model",
    "ModelOutput": ".model",
    "ExperimentResult": ".report",
    "Row": ".report",
    "EXPERIMENTS": ".runner",
    "ExperimentContext": ".runner",
    "run_experiments": ".runner",
    "META_NAMES": ".tasks",
    "DigitsTasks": ".tasks",
    "GaussianMixtureTasks": ".tasks",
    "MetaDistribution": ".tasks",
    "Mixed2DTasks": ".tasks",
    "PCAFeatureTasks": ".tasks",
    "ShellTasks": ".tasks",
    "TaskBatch": ".tasks",
    "make_meta": ".tasks",
    "TIERS": ".tiers",
    "Tier": ".tiers",
    "get_tier": ".tiers",
    "TrainConfig": ".training",
    "TrainResult": ".training",
    "build_model": ".training",
    "load_model": ".training",
    "train": ".training",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
