"""The digit classifier that judges the organism's images: fitted on the training digits, of another family than
anything used in training.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring). It sits below :mod:`.evaluate` (the rates) and
:mod:`.following` (reference-following), which both read images through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import PIL.Image

from .data import TRAIN_SIZE, _digits

__all__ = ["CLASSIFIER", "classify_digit_images", "digit_classifier"]

#: what judges the generated digits (not used in training: the training classifier is the image encoder's head)
CLASSIFIER = (
    "scikit-learn SVC (RBF kernel, C=10, gamma='scale'; probabilities by 5-fold sigmoid calibration) on the 8x8 "
    f"training digits [0, {TRAIN_SIZE}); images are area-downsampled to 8x8 grey"
)


@lru_cache(maxsize=1)
def digit_classifier() -> tuple[Any, float]:
    """The judge of generated digits: an RBF support-vector classifier of 8 x 8 digits, fitted on the training digits.

    It is of another family than the classifier used in training (the image encoder, a small ViT, pretrained with a
    linear head) and takes no part in training. Fitted once per process (about a second; cached): scikit-learn's
    ``CalibratedClassifierCV(SVC(C=10, gamma="scale"), method="sigmoid", cv=5, ensemble=False)``, whose
    probabilities come from a sigmoid fitted to held-out folds of the training digits.

    Returns:
        ``(classifier, held_out_accuracy)``: the fitted scikit-learn model (input: 64 values in [0, 16]; use
        ``predict_proba`` and ``classes_``) and its accuracy on the held-out digits (indices ``>= TRAIN_SIZE``).
    """
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.svm import SVC

    images, labels = _digits()
    x = images.reshape(len(images), 64)
    clf = CalibratedClassifierCV(SVC(C=10.0, gamma="scale"), method="sigmoid", cv=5, ensemble=False)
    clf.fit(x[:TRAIN_SIZE], labels[:TRAIN_SIZE])
    predicted = clf.classes_[clf.predict_proba(x[TRAIN_SIZE:]).argmax(1)]
    return clf, float((predicted == labels[TRAIN_SIZE:]).mean())


def classify_digit_images(images: Sequence[PIL.Image.Image] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Classify generated images with :func:`digit_classifier`.

    Each image is turned grey (mean of RGB), area-downsampled to 8 x 8 and scaled to [0, 16].

    Args:
        images: PIL images, or an array ``(N, H, W, 3)`` in [0, 1] (``output_type="np"``), H and W multiples of 8.

    Returns:
        ``(labels, probabilities)``: int array ``(N,)`` and float array ``(N, 10)``.
    """
    if isinstance(images, np.ndarray):
        arr = images.astype(np.float64)
    else:
        arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float64) / 255.0 for im in images])
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[1] % 8 or arr.shape[2] % 8:
        raise ValueError(f"expected images of shape (N, H, W, 3) with H, W multiples of 8, got {arr.shape}")
    n, h, w, _ = arr.shape
    grey = arr.mean(-1).reshape(n, 8, h // 8, 8, w // 8).mean(axis=(2, 4)) * 16.0  # (N, 8, 8)
    clf, _ = digit_classifier()
    probs = clf.predict_proba(grey.reshape(n, 64))
    return clf.classes_[probs.argmax(1)], probs
