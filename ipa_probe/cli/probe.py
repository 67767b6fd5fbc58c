"""``ipa-probe probe``: generate once with the probe on and write the image, table, summary and plot."""

from __future__ import annotations

import argparse
import logging

from . import CLIError
from ._common import (
    DIGITS_DEFAULTS,
    add_model_arguments,
    bandwidth_type,
    check_output_dir,
    images_type,
    load_pipeline,
    output_dir,
)

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="record IP-Adapter attention vs Gaussian NW weights during one generation",
        description="Generate with the probe on. With no model arguments the embedded tiny pipeline runs offline.",
    )
    add_model_arguments(parser, default_kind="digits")
    bandwidth = bandwidth_type("matched", "fit")
    parser.add_argument("--bandwidth", type=bandwidth, default="matched", help="'matched' (default), 'fit' or h > 0")
    parser.add_argument("--layers", action="append", help="regex selecting layer ids (repeatable; default: all)")
    parser.add_argument("--keep-maps", action="store_true", help="also save the full attention maps (fp16, .pt)")
    parser.add_argument("--maps", action="store_true", help="also write reference_maps.png and map_table.parquet")
    parser.add_argument(
        "--num-images",
        type=images_type,
        default=None,
        help="images per prompt, one seeded batch (default: 8 on the digits organism, so that the demo shows a rate "
        "and not one lucky or unlucky draw; else 1)",
    )
    parser.add_argument("--out", default="outputs/probe", help="output folder (default: outputs/probe)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from .._io import atomic_path, write_image
    from ..capture.run import probe
    from ..images import image_row

    check_output_dir(args.out)
    loaded = load_pipeline(args)
    generator = torch.Generator(device=loaded.pipe.device).manual_seed(args.seed)
    organism = args.model is None and args.kind == "digits"
    num_images = args.num_images or (DIGITS_DEFAULTS["images"] if organism else 1)
    loaded.description["num_images"] = num_images
    try:
        options = {"layers": args.layers, "keep_maps": args.keep_maps, "maps": args.maps}
        with probe(loaded.pipe, bandwidth=args.bandwidth, **options) as run_:
            result = loaded.pipe(
                ip_adapter_image=[loaded.references],
                generator=generator,
                num_images_per_prompt=num_images,
                **loaded.call_kwargs,
            )
    except ValueError as err:
        raise CLIError(str(err)) from None
    out = output_dir(args.out)  # created only now that there is something to write
    for i, image in enumerate(result.images):
        write_image(image, out / f"image_{i}.png")
    write_image(image_row(loaded.references, result.images), out / "references_and_output.png")
    paths = run_.save(out, extra={"run": loaded.description})
    if args.keep_maps:
        with atomic_path(out / "maps.pt") as temp:
            torch.save({"|".join(map(str, key)): value for key, value in run_.maps.items()}, temp)
    if args.maps:
        from ..capture.maps import save_reference_maps

        save_reference_maps(run_, out, result.images[0], [loaded.references])
    verdict = _digit_verdict(result.images, args.digit, out) if organism and not args.image else ""
    summary = run_.summary()
    cond = summary[summary["branch"] == "cond"]
    last = cond.iloc[-1] if len(cond) else None
    line = f"wrote {out}: {len(result.images)} image(s), references_and_output.png, {paths['table'].name}, "
    line += f"{paths['summary'].name}, "
    line += f"{paths['plot'].name}"
    if last is not None:
        line += f"; last step (t={last['timestep']:g}): spearman {last['spearman']:.3f}, pearson {last['pearson']:.3f}"
    print(line + verdict)
    return 0


def _digit_verdict(images: list, digit: int, out) -> str:
    """Classify the organism's images with the digit classifier; write ``digits.json``; return a line's tail."""
    from .._io import write_json
    from ..tiny.digits import classify_digit_images, digit_classifier
    from ..tiny.digits.evaluate import CLASSIFIER

    labels, probs = classify_digit_images(images)
    right = int((labels == digit).sum())
    write_json(
        out / "digits.json",
        {
            "digit": digit,
            "right": right,
            "images": len(labels),
            "predicted": labels.tolist(),
            "confidence_in_digit": probs[:, digit].tolist(),
            "classifier": f"{CLASSIFIER} (ipa_probe.tiny.digits.digit_classifier)",
            "classifier_held_out_accuracy": digit_classifier()[1],
        },
    )
    listed = " ".join(map(str, labels.tolist()))
    return f"\ndigit classifier: {right} of {len(labels)} images drawn as {digit} (read as: {listed}; digits.json)"
