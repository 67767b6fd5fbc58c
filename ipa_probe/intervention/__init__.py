"""Interventions on the reference images' tokens and on named hook points, to test what the attention maps suggest.

``config`` and ``hooks``: :func:`intervene` (ablate, swap or scale references; claimed as :data:`INTERVENE`);
``points``: :func:`list_hook_points` and the hooks that form them; ``custom``: ``intervene(pipe, hooks=...)`` and
``mode="scale"``; ``cache``: :func:`run_with_cache`; ``patch``: :func:`patch_hooks`; ``effect``:
:func:`measure_intervention` (one seeded generation with and without, compared); ``grid``: :func:`ablation_grid`.
"""

from .._checks import Timesteps
from .cache import HookCache, cache_hook_points, run_with_cache
from .config import INTERVENE, MODES, InterventionConfig
from .custom import HookIntervention, apply_hooks
from .effect import Generation, InterventionEffect, decode_latents, generate, measure_intervention
from .grid import GRID_COLUMNS, LAYER_GROUPS, ablation_grid, step_ranges, summarize_grid
from .hooks import Intervention, apply_intervention, intervene, remove_intervention
from .patch import patch_hooks
from .points import POINTS, HookContext, list_hook_points

__all__ = [
    "GRID_COLUMNS",
    "INTERVENE",
    "LAYER_GROUPS",
    "MODES",
    "POINTS",
    "Timesteps",
    "Generation",
    "HookCache",
    "HookContext",
    "HookIntervention",
    "Intervention",
    "InterventionConfig",
    "InterventionEffect",
    "apply_hooks",
    "ablation_grid",
    "apply_intervention",
    "cache_hook_points",
    "decode_latents",
    "generate",
    "intervene",
    "list_hook_points",
    "measure_intervention",
    "patch_hooks",
    "remove_intervention",
    "run_with_cache",
    "step_ranges",
    "summarize_grid",
]
