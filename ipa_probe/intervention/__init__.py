"""Interventions on one reference image's tokens, to test what the attention maps suggest (issue #21 point 4).

``config`` holds the settings (:class:`InterventionConfig`), ``hooks`` the lifecycle (:func:`intervene`,
:func:`apply_intervention`, :func:`remove_intervention`, claimed on the denoiser as :data:`INTERVENE` and shown by
:func:`ipa_probe.list_hooks`), ``effect`` the measurement (:func:`measure_intervention`: the same seeded generation
with and without the intervention, compared in latent and pixel space and, given a classifier, by its verdict).
"""

from .config import INTERVENE, MODES, InterventionConfig
from .effect import Generation, InterventionEffect, decode_latents, generate, measure_intervention
from .hooks import Intervention, apply_intervention, intervene, remove_intervention

__all__ = [
    "INTERVENE",
    "MODES",
    "Generation",
    "Intervention",
    "InterventionConfig",
    "InterventionEffect",
    "apply_intervention",
    "decode_latents",
    "generate",
    "intervene",
    "measure_intervention",
    "remove_intervention",
]
