"""A trained model organism: a small Stable Diffusion 1.5-architecture pipeline with an IP-Adapter, trained on digits.

The data are scikit-learn's handwritten digits (shipped with the package), rendered as 16 x 16 RGB images
(:func:`digit_images`). Every component is a diffusers or transformers class (``AutoencoderKL``, ``CLIPTextModel``,
``CLIPVisionModelWithProjection``, ``UNet2DConditionModel`` with SD 1.5's block structure scaled down, and an
IP-Adapter in the published checkpoints' layout loaded by ``pipe.load_ip_adapter``), so a real pipeline's code paths
all run. It is trained on support-conditioned generation (1-4 reference images of one class, the target another image
of that class) on the first :data:`TRAIN_SIZE` digits; the rest are the held-out pool :func:`digits_reference_images`
draws from. Each component, each recipe and its dropped conditions: docs/organism.md.

:func:`train_digits` (``ipa-probe train-digits``) is seeded and resumable; the weights shipped in
``ipa_probe/tiny/digits_weights/`` are its output, with their ``record.json`` and loss curve (recipe ``mixed``:
``digits_mixed_weights/``; recipe ``ip-adapter``: ``digits_ip_adapter_weights/``).
"""

from __future__ import annotations

from ..._checks import DEFAULT_DIGITS_RECIPE as DEFAULT_RECIPE
from ..._checks import DIGITS_RECIPES as RECIPES
from .checkpoint import CheckpointError
from .data import (
    DIGITS_MIXED_WEIGHTS,
    DIGITS_PROMPT,
    DIGITS_WEIGHTS,
    IP_ADAPTER_WEIGHTS,
    TRAIN_SIZE,
    WEIGHT_NAME,
    digit_images,
    digits_reference_images,
)
from .evaluate import add_digit_scores, classify_digit_images, digit_classifier, digit_readings_line, evaluate_digits
from .model import digits_pipeline, untrained_digits_pipeline
from .train import DigitsTrainConfig, train_digits
from .train_ip import DigitsAdapterConfig, DigitsBaseConfig

__all__ = [
    "DEFAULT_RECIPE",
    "DIGITS_MIXED_WEIGHTS",
    "DIGITS_PROMPT",
    "DIGITS_WEIGHTS",
    "IP_ADAPTER_WEIGHTS",
    "RECIPES",
    "CheckpointError",
    "DigitsAdapterConfig",
    "DigitsBaseConfig",
    "DigitsTrainConfig",
    "TRAIN_SIZE",
    "WEIGHT_NAME",
    "add_digit_scores",
    "classify_digit_images",
    "digit_classifier",
    "digit_images",
    "digit_readings_line",
    "digits_pipeline",
    "digits_reference_images",
    "evaluate_digits",
    "train_digits",
    "untrained_digits_pipeline",
]
