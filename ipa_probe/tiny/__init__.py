"""Offline pipelines built from configs (seeded, no downloads) and the CLIP tokenizer they share.

``sd`` holds SD 1.5 / SDXL (``tiny_pipeline``, ``save_tiny_pipeline``, ``default_reference_images``); ``dit`` Flux
and SD3; ``tokenizer`` the CLIP BPE tokenizer built from open_clip's vocabulary.
"""

from .dit import tiny_flux_pipeline, tiny_sd3_pipeline
from .sd import default_reference_images, save_tiny_pipeline, tiny_pipeline

__all__ = [
    "default_reference_images",
    "save_tiny_pipeline",
    "tiny_flux_pipeline",
    "tiny_pipeline",
    "tiny_sd3_pipeline",
]
