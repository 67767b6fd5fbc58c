"""Data: scikit-learn's digits rendered as the organism sees them, the held-out reference pool, constants.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from ..._checks import check_seed

DIGITS_PROMPT = "a handwritten digit"
IMAGE_SIZE = 16
LATENT_SIZE = 8
TRAIN_SIZE = 1500
"""Digits ``[0, TRAIN_SIZE)`` train the organism and the classifier; ``[TRAIN_SIZE, 1797)`` are held out."""
NUM_IP_TOKENS = 4
WEIGHT_NAME = "ip-adapter.safetensors"
DIGITS_WEIGHTS = Path(__file__).parent.parent / "digits_weights"
"""The ``support`` recipe as shipped, the output of ``ipa-probe train-digits``: ``model/``, ``ip_adapter/``,
``record.json``, ``loss.png``. Its VAE, text encoder and tokenizer serve the ``ip-adapter`` recipe too."""
IP_ADAPTER_WEIGHTS = Path(__file__).parent.parent / "digits_ip_adapter_weights"
"""The ``ip-adapter`` recipe as shipped: ``base/`` (``ipa-probe train-digits --recipe ip-adapter --stage base``:
``unet/``, ``image_encoder/``, ``record.json``, ``loss.png``) and ``adapter/`` (``ipa-probe train-digits --recipe
ip-adapter``: ``ip_adapter/``, ``record.json``, ``loss.png``)."""
DIGITS_MIXED_WEIGHTS = Path(__file__).parent.parent / "digits_mixed_weights"
"""The ``mixed`` recipe as shipped (``ipa-probe train-digits --recipe mixed``), laid out as :data:`DIGITS_WEIGHTS`."""
_TEXT_WIDTH = 32
_VISION_WIDTH = 32


def shipped_folder(recipe: str) -> Path:
    """The shipped folder whose ``record.json`` is ``recipe``'s training record (``ip-adapter``: its adapter stage)."""
    return {"support": DIGITS_WEIGHTS, "mixed": DIGITS_MIXED_WEIGHTS, "ip-adapter": IP_ADAPTER_WEIGHTS / "adapter"}[
        recipe
    ]


# --- data ---------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)  # (1797, 8, 8) in [0, 16], (1797,)


@lru_cache(maxsize=1)
def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as the organism sees them: 16 x 16 uint8 grey images, and their labels.

    Rendering: the 8 x 8 values in [0, 16] are upsampled bilinearly (``F.interpolate``, ``align_corners=False``) to
    16 x 16, scaled by 255 / 16 and rounded to uint8. Ink is bright on a black ground, as in the data.

    Returns:
        ``(images, labels)``: uint8 array ``(1797, 16, 16)`` and int64 array ``(1797,)``.
    """
    images, labels = _digits()
    up = F.interpolate(torch.from_numpy(images)[:, None], size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
    grey = torch.round(up[:, 0] * (255.0 / 16.0)).clamp(0, 255).to(torch.uint8)  # (N, 16, 16)
    return grey.numpy(), labels


def _to_pil(grey: np.ndarray) -> PIL.Image.Image:
    return PIL.Image.fromarray(grey, mode="L").convert("RGB")


def digits_reference_images(digit: int, n: int, seed: int = 0) -> list[PIL.Image.Image]:
    """``n`` different held-out images of ``digit``, rendered exactly as in training (16 x 16 RGB).

    They come from the digits the organism never trained on (indices ``>= TRAIN_SIZE``, about 30 per class), drawn
    without replacement by a generator seeded with ``seed``.

    Args:
        digit: 0-9.
        n: how many (1 to the number of held-out images of that digit).
        seed: the draw's seed.

    Returns:
        ``n`` RGB ``PIL.Image.Image`` of size 16 x 16.
    """
    if isinstance(digit, bool) or not isinstance(digit, int | np.integer) or not 0 <= digit <= 9:
        raise ValueError(f"expected digit to be an int in 0..9, got {digit!r}")
    images, labels = digit_images()
    pool = np.flatnonzero(labels[TRAIN_SIZE:] == digit) + TRAIN_SIZE
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(pool):
        raise ValueError(f"expected n to be an int in 1..{len(pool)} (held-out images of {digit}), got {n!r}")
    rng = np.random.default_rng(check_seed(seed))
    return [_to_pil(images[i]) for i in rng.choice(pool, size=n, replace=False)]
