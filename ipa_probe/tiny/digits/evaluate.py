"""The right-digit rates of the organism (``python -m ipa_probe.tiny.digits``), judged by :mod:`.classifier`.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import StableDiffusionPipeline

from ..._io import versions, write_atomic, write_json
from ...compare import ROUNDTRIP, vae_roundtrip
from .classifier import CLASSIFIER, classify_digit_images, digit_classifier
from .data import DIGITS_PROMPT, digits_reference_images
from .following import FOLLOWING_METRICS, interval, reference_following
from .model import digits_pipeline, untrained_digits_pipeline

__all__ = [
    "CLASSIFIER",
    "EVALUATION_SETTINGS",
    "add_digit_scores",
    "classify_digit_images",
    "digit_readings_line",
    "digit_classifier",
    "evaluate_digits",
    "rates_over_seeds",
]


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
        classified as the references' digit, the mean probability the classifier gives that digit; beside them what
        the classifier makes of the references themselves and of their VAE round trip (a generation can be no more
        legible than these): ``references_read_right`` / ``roundtrip_read_right`` (fractions of references read as
        their digit), their ``*_per_digit`` versions, and the labels (``reference_labels``, ``roundtrip_labels``,
        ``reference_targets``), one per reference in the order drawn.
    """
    pipe.set_ip_adapter_scale(ip_adapter_scale)
    predicted, confidence, targets = [], [], []
    read: dict[str, list] = {"references": [], ROUNDTRIP: [], "reference_targets": []}
    try:
        for digit in range(10):
            for s in range(ref_sets):
                refs = digits_reference_images(digit, n_refs, seed=seed + s)
                size = refs[0].size
                for name, images in (("references", refs), (ROUNDTRIP, vae_roundtrip(pipe, refs, size[1], size[0]))):
                    read[name].extend(classify_digit_images(images)[0].tolist())
                read["reference_targets"].extend([digit] * len(refs))
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
    ref_targets = np.array(read["reference_targets"])
    ref_hits = {name: np.array(read[name]) == ref_targets for name in ("references", ROUNDTRIP)}
    return {
        "rate": float(hits.mean()),
        "confidence": float(np.mean(confidence)),
        "per_digit": {d: float(hits[targets_arr == d].mean()) for d in range(10)},
        # the classifier's reading of what the rate is measured against: the references and their VAE round trip
        "references_read_right": float(ref_hits["references"].mean()),
        "roundtrip_read_right": float(ref_hits[ROUNDTRIP].mean()),
        **{
            f"{key}_per_digit": {d: float(ref_hits[name][ref_targets == d].mean()) for d in range(10)}
            for key, name in (("references_read_right", "references"), ("roundtrip_read_right", ROUNDTRIP))
        },
        "reference_labels": np.array(read["references"]),
        "roundtrip_labels": np.array(read[ROUNDTRIP]),
        "reference_targets": ref_targets,
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
    """Score a :class:`ipa_probe.compare.Comparison` (from :func:`ipa_probe.compare.compare_methods` on the organism,
    references of ``digit``) with :func:`digit_classifier`, in place.

    Adds ``digit_right`` (1 if the image is classified as ``digit``) and ``digit_confidence`` (the probability the
    classifier gives ``digit``) to ``comparison.per_image``, and their means and standard deviations over seeds
    (``*_std``) to ``comparison.table``, for every method and the VAE round trip of the references. Beside them, on
    every row of the table, ``references_read_right`` and ``roundtrip_read_right``: the fraction of the references,
    and of their VAE round trips, that the classifier itself reads as ``digit`` (the ceiling of a method that copies
    its references); each reading (label, probability of ``digit``) is in ``comparison.settings["digit_readings"]``
    and :func:`digit_readings_line` puts them in one line.
    """
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
    # beside every score, what the classifier makes of the references and of their VAE round trip: a method that
    # copies a reference cannot score above the fraction of references the classifier reads as the digit
    readings = {}
    for name, items in (("references", comparison.references), (ROUNDTRIP, comparison.roundtrip or [])):
        if len(items):
            labels, probs = classify_digit_images(items)
            readings[name] = {"labels": labels.tolist(), "p_digit": probs[:, digit].tolist()}
            column = "references_read_right" if name == "references" else "roundtrip_read_right"
            comparison.table[column] = float(np.mean(labels == digit))
    comparison.settings["digit_readings"] = readings
    stats = per.groupby("method", sort=False)[["digit_right", "digit_confidence"]].agg(
        ["mean", lambda x: x.std(ddof=0)]
    )
    for name in ("digit_right", "digit_confidence"):
        comparison.table[name] = comparison.table["method"].map(stats[(name, "mean")])
        comparison.table[f"{name}_std"] = comparison.table["method"].map(stats[(name, "<lambda_0>")])
    comparison.settings["digit"] = digit
    comparison.settings["digit_classifier"] = {
        "model": CLASSIFIER,
        "held_out_accuracy": digit_classifier()[1],
    }


def digit_readings_line(comparison: Any) -> str:
    """One line: how the digit classifier reads the references and their VAE round trip (after
    :func:`add_digit_scores`), e.g. ``references read as [3, 3, 5] (P(3) 0.98 0.97 0.40); ...``."""
    digit = comparison.settings["digit"]
    parts = []
    for name, what in (("references", "references"), (ROUNDTRIP, "their VAE round trip")):
        reading = comparison.settings["digit_readings"].get(name)
        if reading:
            p = " ".join(f"{v:.2f}" for v in reading["p_digit"])
            parts.append(f"{what} read as {reading['labels']} (P({digit}) {p})")
    return "digit classifier: " + "; ".join(parts) + " - a score is read against these"


#: the settings of the rates in docs/organism.md: ``python -m ipa_probe.tiny.digits --recipe R --out DIR``
EVALUATION_SETTINGS: dict[str, dict[str, Any]] = {
    "adapter on, CFG 3": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0},
    "adapter on, no CFG": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0},
    "adapter scale 0, CFG 3": {"ip_adapter_scale": 0.0, "guidance_scale": 3.0},
    "adapter scale 0, no CFG": {"ip_adapter_scale": 0.0, "guidance_scale": 1.0},
    "untrained weights, no CFG": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0, "untrained": True},
    # how the rate depends on the size of the support set
    "adapter on, CFG 3, 1 reference": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 1},
    "adapter on, CFG 3, 2 references": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 2},
    "adapter on, CFG 3, 4 references": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0, "n_refs": 4},
}


def rates_over_seeds(pipe: StableDiffusionPipeline, seeds: Sequence[int], **settings: Any) -> dict[str, Any]:
    """:func:`evaluate_digits` once per seed (one reference set per digit and seed): the right-digit rate, the
    classifier's probability of the digit and each digit's own rate (``per_digit``), each with its mean and Student's
    t 95% interval over seeds."""
    runs = [evaluate_digits(pipe, seed=seed, ref_sets=1, **settings) for seed in seeds]
    return {
        "rate": interval([r["rate"] for r in runs], bounds=(0.0, 1.0)),
        "confidence": interval([r["confidence"] for r in runs], bounds=(0.0, 1.0)),
        "per_digit": {
            d: interval([r["per_digit"][d] for r in runs], bounds=(0.0, 1.0)) for d in range(10)
        },  # each digit's right-digit rate: samples_per_digit images per seed, interval over seeds
        "references_read_right": interval([r["references_read_right"] for r in runs], bounds=(0.0, 1.0)),
        "roundtrip_read_right": interval([r["roundtrip_read_right"] for r in runs], bounds=(0.0, 1.0)),
        "references_read_right_per_digit": {
            d: float(np.mean([r["references_read_right_per_digit"][d] for r in runs])) for d in range(10)
        },
        "roundtrip_read_right_per_digit": {
            d: float(np.mean([r["roundtrip_read_right_per_digit"][d] for r in runs])) for d in range(10)
        },
        "samples": sum(r["samples"] for r in runs),
        "n_refs": runs[0]["n_refs"],
        "most_frequent_label": int(np.bincount(np.concatenate([r["labels"] for r in runs]), minlength=10).argmax()),
    }


def _percent(result: dict[str, Any]) -> str:
    return f"{result['mean']:.1%} [{result['low']:.1%}, {result['high']:.1%}]"


def _table(rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows])


def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - a script; tests run its parts
    import argparse

    from ..._checks import DEFAULT_DIGITS_RECIPE, DIGITS_RECIPES

    parser = argparse.ArgumentParser(
        description="The organism's right-digit rates and reference-following, with 95%% intervals over seeds, "
        "written to OUT/rates.{md,json} and OUT/following.{md,json}."
    )
    parser.add_argument("--out", default="outputs/digits-eval")
    parser.add_argument("--recipe", choices=DIGITS_RECIPES, default=DEFAULT_DIGITS_RECIPE)
    parser.add_argument("--weights", help="a folder from `ipa-probe train-digits` (default: the shipped weights)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1: one reference set per digit and seed")
    parser.add_argument("--samples", type=int, default=10, help="samples per digit and seed (rates)")
    parser.add_argument("--following-samples", type=int, default=4, help="samples per digit and seed (following)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(EVALUATION_SETTINGS),
        default=list(EVALUATION_SETTINGS),
        metavar="NAME",
        help="which rows of EVALUATION_SETTINGS to measure (default: all)",
    )
    parser.add_argument("--no-following", action="store_true", help="skip reference-following")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds))
    trained = digits_pipeline(args.weights, recipe=args.recipe)
    untrained = None
    rows, raw = [], {}
    per_digit_rows = []
    for name in args.settings:
        settings = dict(EVALUATION_SETTINGS[name])
        if settings.pop("untrained", False):
            untrained = untrained or untrained_digits_pipeline(recipe=args.recipe)
            pipe = untrained
        else:
            pipe = trained
        pipe.set_progress_bar_config(disable=True)
        start = time.perf_counter()
        settings.setdefault("n_refs", 3)
        result = rates_over_seeds(
            pipe, seeds, samples_per_digit=args.samples, num_inference_steps=args.steps, **settings
        )
        raw[name] = {**result, "settings": settings, "seconds": time.perf_counter() - start}
        rows.append(
            {
                "setting": name,
                "right digit [95% interval over seeds]": _percent(result["rate"]),
                "classifier's probability of the digit": f"{result['confidence']['mean']:.3f}",
                "references read right": f"{result['references_read_right']['mean']:.0%}",
                "VAE round trip read right": f"{result['roundtrip_read_right']['mean']:.0%}",
                "references": result["n_refs"],
                "samples": result["samples"],
                "most frequent label": result["most_frequent_label"],
            }
        )
        per_digit_rows.append(
            {"setting": name, **{str(d): f"{result['per_digit'][d]['mean']:.0%}" for d in range(10)}}
        )
        for what, key in (("references", "references_read_right"), ("VAE round trip", "roundtrip_read_right")):
            per_digit = result[f"{key}_per_digit"]
            cells = {str(d): f"{per_digit[d]:.0%}" for d in range(10)}
            per_digit_rows.append({"setting": f"{name}: {what} read right", **cells})
        print(rows[-1], flush=True)
    accuracy = digit_classifier()[1]
    note = (
        f"\n\nRecipe `{args.recipe}`. Judge: {CLASSIFIER}; held-out accuracy {accuracy:.3f}. Seeds {seeds}: one "
        f"held-out reference set per digit and seed (3 images unless the row says otherwise), {args.samples} samples "
        f"each, DDIM {args.steps} steps; intervals are Student's t 95% over the {len(seeds)} seeds' rates, cut to "
        "[0, 100%].\n"
    )
    per_digit_note = (
        f"\n\nPer digit: the right-digit rate of each digit's {args.samples * len(seeds)} images ({args.samples} per "
        f"seed, seeds {seeds}), same settings as above.\n"
    )
    write_atomic(out / "rates.md", _table(rows) + note + "\n" + _table(per_digit_rows) + per_digit_note)
    record = {"recipe": args.recipe, "rates": raw, "args": vars(args), "versions": versions()}
    record["classifier"] = {"model": CLASSIFIER, "held_out_accuracy": accuracy}
    record["weights_record"] = _weights_record(args.weights, args.recipe)
    write_json(out / "rates.json", record)
    print(_table(rows))
    print(_table(per_digit_rows))
    if args.no_following:
        return
    following, frows = {}, []
    for n_refs in (1, 3):
        result = reference_following(
            trained, n_refs=n_refs, seeds=seeds, samples=args.following_samples, num_inference_steps=args.steps
        )
        following[n_refs] = {k: v for k, v in result.items() if k != "per_sample"}
    for metric in FOLLOWING_METRICS:
        row = {"metric": metric}
        for n_refs in (1, 3):
            m = following[n_refs]["metrics"][metric]
            fmt = "{:.3f}"
            row[f"{n_refs} reference{'s' if n_refs > 1 else ''}"] = (
                f"{fmt.format(m['mean'])} [{fmt.format(m['low'])}, {fmt.format(m['high'])}]"
            )
            row[f"chance ({n_refs})"] = f"{following[n_refs]['chance'][metric]:.3f}"
        frows.append(row)
    note = (
        f"\n\nRecipe `{args.recipe}`, CFG 3, DDIM {args.steps} steps, {args.following_samples} samples per digit and "
        f"seed, seeds {seeds}; mean [Student's t 95% interval over seeds]. Metrics: "
        "ipa_probe.tiny.digits.following (16 x 16 grey pixel distances among the held-out images of the digit).\n"
    )
    write_atomic(out / "following.md", _table(frows) + note)
    write_json(out / "following.json", {"recipe": args.recipe, "following": following, "versions": versions()})
    print(_table(frows))


def _weights_record(weights: str | None, recipe: str) -> dict[str, Any] | None:
    """The ``record.json`` of the training run the rates belong to (the adapter stage's, for ``ip-adapter``)."""
    from .data import shipped_folder

    path = (Path(weights) if weights is not None else shipped_folder(recipe)) / "record.json"
    return json.loads(path.read_text()) if path.exists() else None


if __name__ == "__main__":  # pragma: no cover
    _main()
