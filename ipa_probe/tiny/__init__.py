"""Offline pipelines built from configs (seeded, no downloads) and the CLIP tokenizer they share.

``digits`` holds the trained model organism (``digits_pipeline``, ``digits_reference_images``, ``train_digits``);
``sd`` holds the random SD 1.5 / SDXL (``tiny_pipeline``, ``save_tiny_pipeline``, ``default_reference_images``);
``dit`` Flux and SD3; ``tokenizer`` the CLIP BPE tokenizer built from open_clip's vocabulary; ``zoo`` a tiny build of
every diffusers pipeline class that takes an IP-Adapter (imported on demand: ``ipa_probe.tiny.zoo``).
"""

from .digits import digits_pipeline, digits_reference_images, train_digits
from .dit import tiny_flux_pipeline, tiny_sd3_pipeline
from .sd import default_reference_images, save_tiny_pipeline, tiny_pipeline

__all__ = [
    "default_reference_images",
    "digits_pipeline",
    "digits_reference_images",
    "save_tiny_pipeline",
    "tiny_flux_pipeline",
    "tiny_pipeline",
    "tiny_sd3_pipeline",
    "train_digits",
]
