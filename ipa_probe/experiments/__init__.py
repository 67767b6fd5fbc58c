"""The paper's synthetic experiments: failure regimes of the exact NW field and the learned heads' attention.

``ipa-probe experiments NAME --tier quick|smoke|full`` runs them from the command line; :func:`run_experiments`
from Python. Modules: :mod:`.tasks` (meta-distributions), :mod:`.model` (the learned in-context model),
:mod:`.training`, :mod:`.evaluate`, one module per experiment, :mod:`.tiers`, :mod:`.report`, :mod:`.runner`.
"""

from .evaluate import MMDResult, held_out_tasks, learned_velocity, nw_neff, plugin_velocity
from .model import ICFMVelocityNet, ModelConfig, ModelOutput
from .report import ExperimentResult, Row
from .runner import EXPERIMENTS, ExperimentContext, run_experiments
from .tasks import (
    META_NAMES,
    DigitsTasks,
    GaussianMixtureTasks,
    MetaDistribution,
    Mixed2DTasks,
    PCAFeatureTasks,
    ShellTasks,
    TaskBatch,
    make_meta,
)
from .tiers import TIERS, Tier, get_tier
from .training import TrainConfig, TrainResult, build_model, load_model, train

__all__ = [
    "EXPERIMENTS",
    "META_NAMES",
    "TIERS",
    "DigitsTasks",
    "ExperimentContext",
    "ExperimentResult",
    "GaussianMixtureTasks",
    "ICFMVelocityNet",
    "MMDResult",
    "MetaDistribution",
    "Mixed2DTasks",
    "ModelConfig",
    "ModelOutput",
    "PCAFeatureTasks",
    "Row",
    "ShellTasks",
    "TaskBatch",
    "Tier",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "get_tier",
    "held_out_tasks",
    "learned_velocity",
    "load_model",
    "make_meta",
    "nw_neff",
    "plugin_velocity",
    "run_experiments",
    "train",
]
