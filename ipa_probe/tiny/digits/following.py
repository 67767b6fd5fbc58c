"""Does the organism follow *its* references, or only their class? Retrieval among same-class images and a swap test.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring). For every seed and digit, ``n_refs + 1`` held-out images of
the digit: ``n_refs`` references and a swap-in; the pipeline draws ``samples`` images from the references, and again
from the same latents with the first reference swapped. Images are compared as 16 x 16 grey pixels in [0, 1]
(Euclidean), with no learned features. The scores (retrieval, percentile, gap, swap toward; averaged over digits and
samples per seed, Student's t 95% over seeds) and their chance levels: docs/organism.md ("Does it follow its own
reference, or only the class?").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import StableDiffusionPipeline

from .classifier import classify_digit_images
from .data import DIGITS_PROMPT, TRAIN_SIZE, _to_pil, digit_images

__all__ = ["FOLLOWING_METRICS", "interval", "reference_following"]

#: the metrics :func:`reference_following` reports, with their chance level (``None``: depends on the pool)
FOLLOWING_METRICS = {"rate": 0.1, "retrieval": None, "percentile": 0.5, "gap": 0.0, "swap_toward": 0.5}


def interval(
    values: Sequence[float], level: float = 0.95, bounds: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Mean and Student's t interval of ``values`` (one per seed): ``{"mean", "low", "high", "n", "values"}``.

    ``bounds``: the range the quantity lives in (a rate: ``(0, 1)``); the interval is cut to it.
    """
    from ...intervention.grid import t_interval

    x = np.asarray(values, dtype=float)
    mean, low, high = t_interval(x, level)  # NaN bounds for one value, left NaN by the cut
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return {"mean": mean, "low": low, "high": high, "n": len(x), "values": x.tolist()}


def _draw(digit: int, n_refs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The held-out pool of ``digit`` (indices) and ``n_refs + 1`` of them drawn without replacement."""
    _, labels = digit_images()
    pool = np.flatnonzero(labels[TRAIN_SIZE:] == digit) + TRAIN_SIZE
    rng = np.random.default_rng([seed, digit, n_refs])
    return pool, rng.choice(pool, size=n_refs + 1, replace=False)


def _generate(pipe, indices, samples, seed, digit, guidance_scale, steps) -> np.ndarray:
    """``samples`` grey images ``(samples, 16, 16)`` in [0, 1] from the held-out images ``indices``."""
    grey, _ = digit_images()
    out = pipe(
        DIGITS_PROMPT,
        ip_adapter_image=[[_to_pil(grey[i]) for i in indices]],
        num_images_per_prompt=samples,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        generator=torch.Generator().manual_seed(seed * 1000 + digit),
        output_type="np",
    )
    return out.images.mean(-1)  # (samples, 16, 16)


def _distances(images: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Euclidean distances ``(len(images), len(indices))`` between grey images and held-out digits, in [0, 1]."""
    grey, _ = digit_images()
    refs = grey[indices].reshape(len(indices), -1).astype(np.float64) / 255.0  # (P, 256)
    flat = images.reshape(len(images), -1).astype(np.float64)  # (S, 256)
    return np.sqrt(((flat[:, None, :] - refs[None, :, :]) ** 2).sum(-1))


def _scores(images: np.ndarray, swapped: np.ndarray, pool: np.ndarray, drawn: np.ndarray) -> dict[str, np.ndarray]:
    """Per-sample retrieval, percentile, gap and swap-toward (see the module docstring)."""
    refs, new = drawn[:-1], drawn[-1]
    dist = _distances(images, pool)  # (S, P)
    own = np.isin(pool, refs)  # (P,)
    retrieval = own[dist.argmin(1)].astype(float)
    others = dist[:, ~own]  # (S, P - n)
    percentile = np.mean([(others > dist[:, [j]]).mean(1) for j in np.flatnonzero(own)], axis=0)
    gap = others.mean(1) - dist[:, own].mean(1)
    old = refs[0]
    before = _distances(images, np.array([old, new]))  # (S, 2)
    after = _distances(swapped, np.array([old, new]))
    a, b = before[:, 0] - before[:, 1], after[:, 0] - after[:, 1]
    toward = np.where(b > a, 1.0, np.where(b == a, 0.5, 0.0))
    return {"retrieval": retrieval, "percentile": percentile, "gap": gap, "swap_toward": toward}


def reference_following(
    pipe: StableDiffusionPipeline,
    n_refs: int = 1,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    samples: int = 4,
    guidance_scale: float = 3.0,
    num_inference_steps: int = 20,
    ip_adapter_scale: float = 1.0,
    digits: Sequence[int] = tuple(range(10)),
) -> dict[str, Any]:
    """Measure whether the organism's outputs follow their own references (see the module docstring).

    Args:
        pipe: a digits organism (:func:`~.model.digits_pipeline`).
        n_refs: references per call.
        seeds: one reference draw and one set of latents per seed and digit; intervals are over seeds.
        samples: images per call.
        guidance_scale, num_inference_steps, ip_adapter_scale: the generation settings.
        digits: which digits.

    Returns:
        ``{"metrics": {name: interval(...)}, "chance": {...}, "per_sample": {...}, ...settings}``: per metric the
        mean over seeds with its 95% t interval (``rate`` is the digit classifier's right-digit rate on the same
        images); ``per_sample`` holds the images (``images``, ``swapped``: ``(N, 16, 16)``), the ``pool`` and
        ``drawn`` held-out indices of each call, and the per-sample scores, for independent recomputation.
    """
    pipe.set_ip_adapter_scale(ip_adapter_scale)
    rows: dict[str, list] = {k: [] for k in ("seed", "digit", "images", "swapped", "pool", "drawn", "label")}
    per_sample: dict[str, list] = {k: [] for k in ("retrieval", "percentile", "gap", "swap_toward")}
    try:
        for seed in seeds:
            for digit in digits:
                pool, drawn = _draw(digit, n_refs, seed)
                settings = (samples, seed, digit, guidance_scale, num_inference_steps)
                images = _generate(pipe, drawn[:-1], *settings)
                swapped = _generate(pipe, np.concatenate([drawn[-1:], drawn[1:-1]]), *settings)
                for key, value in _scores(images, swapped, pool, drawn).items():
                    per_sample[key].append(value)
                labels, _ = classify_digit_images(np.repeat(images[..., None], 3, axis=-1))
                rows["label"].append(labels)
                rows["images"].append(images)
                rows["swapped"].append(swapped)
                rows["pool"].append(pool)
                rows["drawn"].append(drawn)
                rows["seed"].append(np.full(samples, seed))
                rows["digit"].append(np.full(samples, digit))
    finally:
        pipe.set_ip_adapter_scale(1.0)
    seed_of = np.concatenate(rows["seed"])
    scores = {k: np.concatenate(v) for k, v in per_sample.items()}
    scores["rate"] = (np.concatenate(rows["label"]) == np.concatenate(rows["digit"])).astype(float)
    metrics = {
        k: interval([scores[k][seed_of == s].mean() for s in seeds], bounds=None if k == "gap" else (0.0, 1.0))
        for k in FOLLOWING_METRICS
    }
    chance = dict(FOLLOWING_METRICS)
    chance["retrieval"] = float(np.mean([n_refs / len(p) for p in rows["pool"]]))
    return {
        "metrics": metrics,
        "chance": chance,
        "per_sample": {
            **scores,
            "seed": seed_of,
            "digit": np.concatenate(rows["digit"]),
            "images": np.concatenate(rows["images"]),
            "swapped": np.concatenate(rows["swapped"]),
            "pool": rows["pool"],
            "drawn": rows["drawn"],
        },
        "n_refs": n_refs,
        "seeds": list(seeds),
        "samples": samples,
        "guidance_scale": guidance_scale,
        "num_inference_steps": num_inference_steps,
        "ip_adapter_scale": ip_adapter_scale,
    }
