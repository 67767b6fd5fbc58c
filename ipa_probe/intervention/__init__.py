"""Interventions on one reference image's tokens, to test what the attention maps suggest (issue #21 point 4).

``config`` holds the settings (:class:`InterventionConfig`), ``hooks`` the lifecycle (:func:`intervene`,
:func:`apply_intervention`, :func:`remove_intervention`, claimed on the denoiser as :data:`INTERVENE` and shown by
:func:`ipa_probe.list_hooks`), ``effect`` the measurement (:func:`measure_intervention`: the same seeded generation
with and without the intervention, compared in latent and pixel space and, given a classifier, by its verdict).

Issue #30 point 5 adds TransformerLens-style tools on named hook points of every layer's image branch: ``points`` (the
names, :func:`list_hook_points`, and the hooks that compute ``weights``, ``contribution``, ``output``), ``custom``
(user callbacks, ``intervene(pipe, hooks=...)``, and ``mode="scale"``), ``cache`` (:func:`run_with_cache`,
:func:`cache_hook_points`) and ``patch`` (:func:`patch_hooks`: one run's values into another). Issue #29 point 4:
``grid`` (:func:`ablation_grid`: references x layer groups x step ranges x modes, one clean run per seed, and
:func:`summarize_grid`: means with intervals over seeds).
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
