"""A trained model organism: a small Stable Diffusion 1.5-architecture pipeline with an IP-Adapter, trained on digits.

The data are scikit-learn's handwritten digits (1,797 grey 8 x 8 images, 10 classes, shipped with the package),
rendered as 16 x 16 RGB images (bilinear upsampling, :func:`digit_images`). Every component is a diffusers or
transformers class, so a real pipeline's code paths all run:

- ``vae``: ``AutoencoderKL`` with two levels (16 x 16 x 3 images <-> 8 x 8 x 4 latents), trained first
  (reconstruction + a small KL term), then frozen; its ``scaling_factor`` gives the training latents unit spread.
- ``text_encoder``: a two-layer ``CLIPTextModel`` with the project's offline CLIP tokenizer, random and frozen (the
  prompt is always ``"a handwritten digit"``, or ``""`` for classifier-free guidance), stored in float16.
- ``image_encoder``: a two-layer ``CLIPVisionModelWithProjection`` on 16 x 16 inputs in 4 x 4 patches, trained
  jointly with the adapter (a random one would throw away what a digit looks like).
- ``unet``: ``UNet2DConditionModel`` with SD 1.5's block structure scaled down (three cross-attention down blocks
  and a plain one, the mirror image going up, a cross-attention mid block, a fixed number of heads per layer).
- the IP-Adapter: ``ImageProjection`` (4 tokens per reference image) and ``to_k_ip`` / ``to_v_ip`` in every
  cross-attention layer, saved in the published checkpoints' layout and loaded by ``pipe.load_ip_adapter``.

Training task (support-conditioned generation, as in the paper): the adapter sees 1-4 reference images of one class
(their tokens concatenated, as diffusers does for a list of images per adapter) and the target is another image of
that class, with the DDPM epsilon loss on SD 1.5's noise schedule. The image condition is dropped part of the time
in the two ways the pipeline drops it: zero image embeddings (what ``pipe(..., guidance_scale > 1)`` uses as the
unconditional branch) and zero image tokens (exactly ``set_ip_adapter_scale(0)``, since ``to_k_ip``/``to_v_ip`` have
no bias); the prompt is replaced by ``""`` part of the time. The organism trains on the first
:data:`TRAIN_SIZE` digits; the rest are the held-out pool that :func:`digits_reference_images` draws from and on
which the evaluation classifier's accuracy is stated.

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
