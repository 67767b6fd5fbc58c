"""The digit classifier and the right-digit rates of the organism (``python -m ipa_probe.tiny.digits``).

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import StableDiffusionPipeline

from ..._io import versions, write_json
from .data import DIGITS_PROMPT, DIGITS_WEIGHTS, TRAIN_SIZE, _digits, digits_reference_images
from .model import digits_pipeline, untrained_digits_pipeline

# --- evaluation ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def digit_classifier() -> tuple[Any, float]:
    """A logistic-regression classifier of 8 x 8 digits, fitted on the training digits.

    Returns:
        ``(classifier, held_out_accuracy)``: the fitted scikit-learn model (input: 64 values in [0, 16]) and its
        accuracy on the held-out digits (indices ``>= TRAIN_SIZE``).
    """
    from sklearn.linear_model import LogisticRegression

    images, labels = _digits()
    x = images.reshape(len(images), 64)
    clf = LogisticRegression(max_iter=2000, C=1.0)
    clf.fit(x[:TRAIN_SIZE], labels[:TRAIN_SIZE])
    accuracy = float((clf.predict(x[TRAIN_SIZE:]) == labels[TRAIN_SIZE:]).mean())
    return clf, accuracy


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


def evaluate_digits(
    pipe: StableDiffusionPipeline,
    samples_per_digit: int = 10,
    n_refs: int = 3,
    ref_sets: int = 1,
    num_inference_steps: int = 20,
    guidance_scale: float = 1.0,
    ip_adapter_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """How often the organism draws the digit of its references, judged by :func:`digit_classifier`.

    For each digit and each of ``ref_sets`` reference sets (``digits_reference_images(d, n_refs, seed=seed + s)``),
    ``samples_per_digit`` images are generated from seeded latents.

    Returns:
        ``{"rate", "confidence", "per_digit", "labels", "targets", "classifier_accuracy", ...settings}``: the fraction
        classified as the references' digit, the mean probability the classifier gives that digit.
    """
    pipe.set_ip_adapter_scale(ip_adapter_scale)
    predicted, confidence, targets = [], [], []
    try:
        for digit in range(10):
            for s in range(ref_sets):
                refs = digits_reference_images(digit, n_refs, seed=seed + s)
                gen = torch.Generator().manual_seed(seed * 1000 + digit * 10 + s)
                out = pipe(
                    DIGITS_PROMPT,
                    ip_adapter_image=[refs],
                    num_images_per_prompt=samples_per_digit,
                    num_inference_steps=num_inference_steps,
                    guidance_scale=guidance_scale,
                    generator=gen,
                    output_type="np",
                )
                labels, probs = classify_digit_images(out.images)
                predicted.extend(labels.tolist())
                confidence.extend(probs[:, digit].tolist())
                targets.extend([digit] * len(labels))
    finally:
        pipe.set_ip_adapter_scale(1.0)
    predicted_arr, targets_arr = np.array(predicted), np.array(targets)
    hits = predicted_arr == targets_arr
    return {
        "rate": float(hits.mean()),
        "confidence": float(np.mean(confidence)),
        "per_digit": {d: float(hits[targets_arr == d].mean()) for d in range(10)},
        "labels": predicted_arr,
        "targets": targets_arr,
        "classifier_accuracy": digit_classifier()[1],
        "samples": len(hits),
        "n_refs": n_refs,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "ip_adapter_scale": ip_adapter_scale,
    }


def add_digit_scores(comparison: Any, digit: int) -> None:
    """Score a :class:`ipa_probe.compare.Comparison` of the organism with :func:`digit_classifier`, in place.

    Adds ``digit_right`` (1 if the image is classified as ``digit``) and ``digit_confidence`` (the probability the
    classifier gives ``digit``) to ``comparison.per_image``, and their means and standard deviations over seeds
    (``*_std``) to ``comparison.table``, for every method and the VAE round trip of the references.

    Args:
        comparison: the result of :func:`ipa_probe.compare.compare_methods` on the digits organism.
        digit: the references' digit.
    """
    from ...compare import ROUNDTRIP

    per = comparison.per_image
    right = np.full(len(per), np.nan)
    confidence = np.full(len(per), np.nan)
    groups = [*comparison.images.items(), (ROUNDTRIP, comparison.roundtrip or [])]
    for method, items in groups:
        rows = np.flatnonzero((per["method"] == method).to_numpy())  # in the order the images were scored
        if len(items) == 0 or len(rows) != len(items):
            continue
        labels, probs = classify_digit_images(items)
        right[rows] = labels == digit
        confidence[rows] = probs[:, digit]
    per["digit_right"], per["digit_confidence"] = right, confidence
    stats = per.groupby("method", sort=False)[["digit_right", "digit_confidence"]].agg(
        ["mean", lambda x: x.std(ddof=0)]
    )
    for name in ("digit_right", "digit_confidence"):
        comparison.table[name] = comparison.table["method"].map(stats[(name, "mean")])
        comparison.table[f"{name}_std"] = comparison.table["method"].map(stats[(name, "<lambda_0>")])
    comparison.settings["digit"] = digit
    comparison.settings["digit_classifier"] = {
        "model": "sklearn LogisticRegression on 8x8 digits (area-downsampled grey images)",
        "held_out_accuracy": digit_classifier()[1],
    }


#: the settings of the README's rates: ``python -m ipa_probe.tiny.digits --out docs/results/digits``
EVALUATION_SETTINGS: dict[str, dict[str, Any]] = {
    "adapter on": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0},
    "adapter on, CFG 3": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0},
    "adapter scale 0": {"ip_adapter_scale": 0.0, "guidance_scale": 1.0},
    "untrained weights": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0, "untrained": True},
    # how the rate depends on the size of the support set (training drew 1-4 references)
    "adapter on, CFG 3, 1 reference": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 1},
    "adapter on, CFG 3, 2 references": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 2},
    "adapter on, CFG 3, 4 references": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 4},
}


def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - a script; tests run evaluate_digits
    import argparse

    parser = argparse.ArgumentParser(description="Rates of the right digit (README), written to OUT/rates.{md,json}.")
    parser.add_argument("--out", default="outputs/digits-eval")
    parser.add_argument("--weights", help="a folder from `ipa-probe train-digits` (default: the shipped weights)")
    parser.add_argument("--samples", type=int, default=10, help="samples per digit and reference set")
    parser.add_argument("--ref-sets", type=int, default=3, help="reference sets per digit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trained, untrained = digits_pipeline(args.weights), None
    rows, raw = [], {}
    for name, settings in EVALUATION_SETTINGS.items():
        settings = dict(settings)
        if settings.pop("untrained", False):
            untrained = untrained or untrained_digits_pipeline()
            pipe = untrained
        else:
            pipe = trained
        pipe.set_progress_bar_config(disable=True)
        start = time.perf_counter()
        settings.setdefault("n_refs", 3)
        result = evaluate_digits(
            pipe, samples_per_digit=args.samples, ref_sets=args.ref_sets, num_inference_steps=args.steps, **settings
        )
        seconds = time.perf_counter() - start
        raw[name] = {k: v for k, v in result.items() if k not in ("labels", "targets")} | {"seconds": seconds}
        rows.append(
            {
                "setting": name,
                "right digit": f"{result['rate']:.1%}",
                "confidence": f"{result['confidence']:.3f}",
                "references": result["n_refs"],
                "samples": result["samples"],
                "most frequent label": f"{np.bincount(result['labels'], minlength=10).argmax()}",
            }
        )
        print(rows[-1], flush=True)
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    table = "\n".join(lines)
    accuracy = digit_classifier()[1]
    note = (
        f"\n\nClassifier: logistic regression on the 8x8 digits [0, {TRAIN_SIZE}), held-out accuracy {accuracy:.3f}. "
        f"{args.ref_sets} held-out reference sets per digit (3 images unless the row says otherwise), "
        f"{args.samples} samples each, "
        f"DDIM {args.steps} steps.\n"
    )
    (out / "rates.md").write_text(table + note)
    record = {"rates": raw, "args": vars(args), "versions": versions()}
    record_path = Path(args.weights) / "record.json" if args.weights else DIGITS_WEIGHTS / "record.json"
    if record_path.exists():  # which training run these rates belong to
        record["weights_record"] = json.loads(record_path.read_text())
    write_json(out / "rates.json", record)
    print(table + note)


if __name__ == "__main__":  # pragma: no cover
    _main()
