"""``ipa-probe train-digits``: train the digits organism (SD 1.5-architecture pipeline + IP-Adapter), any recipe."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._checks import (
    DEFAULT_DIGITS_RECIPE,
    DIGITS_BASE_FILES,
    DIGITS_MIXED_FRACTION,
    DIGITS_RECIPES,
    DIGITS_SMALLEST_CLASS,
    MAX_SEED,
    max_refs_limit,
    parse_int,
)
from ._common import (
    add_overwrite_argument,
    argument_type,
    check_output_dir,
    check_run_folder,
    claimed_output,
    threads_type,
)
from ._errors import CLIError, cli_errors

COMMAND = "ipa-probe train-digits"

#: flag -> (config field, which trainings take it: "support" (recipes support and mixed), "base", "adapter")
_FLAGS = {
    "--seed": ("seed", "seed", ("support", "base", "adapter")),
    "--threads": ("threads", "torch threads", ("support", "base", "adapter")),
    "--steps": ("steps", "training steps of the UNet (support, base) or the adapter", ("support", "base", "adapter")),
    "--vae-steps": ("vae_steps", "VAE training steps", ("support",)),
    "--encoder-steps": ("encoder_steps", "image encoder pretraining steps", ("support", "base")),
    "--batch": ("batch", "batch size", ("support", "base", "adapter")),
    "--max-refs": ("max_refs", "image conditions per target, 1..N", ("support", "adapter")),
    "--checkpoint-every": ("checkpoint_every", "steps between checkpoints", ("support", "base", "adapter")),
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-digits",
        help="train the digits model organism (the shipped weights are this command's output)",
        description=(
            "Train the digits organism on scikit-learn's handwritten digits, deterministically on CPU. --recipe "
            "support: the VAE, then the UNet, IP-Adapter and image encoder together on support sets of the target's "
            "class. --recipe mixed: the same, with half of each UNet batch on mixed reference sets (each reference's "
            "digit drawn at random, the target's digit one reference's). --recipe ip-adapter, as IP-Adapter is "
            "trained: --stage base trains the image-free base UNet (16 cross-attention layers, 8 heads) and pretrains"
            " the image encoder; --stage adapter (the default) trains only ImageProjection and to_k_ip/to_v_ip on the"
            " frozen base (--base, default the shipped one), each image reconstructed from its own embedding. Resumes"
            " from the checkpoint in --out; writes the weights, record.json and loss.png there. Load the result with "
            "ipa_probe.digits_pipeline(OUT). One training per --out at a time. On a machine shared with other jobs, "
            "OMP_WAIT_POLICY=PASSIVE stops the threads spin-waiting. See docs/organism.md."
        ),
    )
    parser.add_argument("--out", default="outputs/digits", help="output folder (default: outputs/digits)")
    parser.add_argument(
        "--recipe",
        choices=DIGITS_RECIPES,
        default=DEFAULT_DIGITS_RECIPE,
        help=f"how to train (default: {DEFAULT_DIGITS_RECIPE}, the recipe ipa_probe.digits_pipeline() loads)",
    )
    parser.add_argument(
        "--stage",
        choices=("base", "adapter"),
        default=None,
        help="--recipe ip-adapter: train the base (stage 1) or the adapter on a base (stage 2, the default)",
    )
    parser.add_argument("--base", default=None, help="--recipe ip-adapter --stage adapter: the base folder "
                        "(from --stage base; default: the shipped base)")  # fmt: skip
    # Defaults (None) are the config classes', the shipped weights' settings; read late (diffusers imports slowly).
    for flag, (field, help_, takers) in _FLAGS.items():
        minimum = 0 if field == "seed" else 1
        kind = (
            threads_type
            if field == "threads"
            else argument_type(
                lambda v, f=flag, m=minimum: parse_int(v, f, m, MAX_SEED if m == 0 else None), flag.lstrip("-")
            )
        )
        which = "" if len(takers) == 3 else f"; {', '.join(takers)} only"
        parser.add_argument(flag, type=kind, default=None, help=f"{help_} (default: the shipped weights'{which})")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    add_overwrite_argument(parser)
    parser.set_defaults(func=run, check=check, writes=lambda args: [Path(args.out)])


def check(args: argparse.Namespace) -> None:
    """Before torch loads, so that nothing (no folder, no lock) is made for a run that cannot start: the recipe's
    flags, ``--max-refs`` against the data, ``--base`` (a folder holding a base's files) and ``--out`` (the other
    sizes are checked by their argparse types)."""
    training = _training(args)
    limit = max_refs_limit(training)
    if args.max_refs is not None and args.max_refs > limit:
        raise CLIError(
            f"--max-refs {args.max_refs}: the {args.recipe if training == 'support' else training} training draws a "
            "target's references from its class, and "
            f"the rarest digit has {DIGITS_SMALLEST_CLASS} training images; use at most {limit}"
        )
    if args.base is not None:
        _check_base(args.base)
    check_output_dir(args.out)
    check_run_folder(args.out, COMMAND, _key(args, training), args.overwrite)


def _key(args: argparse.Namespace, training: str) -> dict:
    """A training resumes in a folder holding the same recipe and stage (its checkpoint checks the rest)."""
    return {"recipe": args.recipe, "training": training}


def _check_base(base: str) -> None:
    """``--base``: a folder holding an ``ip-adapter`` base's files, each a regular file (read by ``stat`` only)."""
    from pathlib import Path

    from .._io import check_input_file

    folder = Path(base)
    if not folder.is_dir():
        state = "is not a folder" if folder.exists() else "does not exist"
        raise CLIError(
            f"--base {base!r} {state}; pass the --out folder of `ipa-probe train-digits --recipe ip-adapter "
            "--stage base`, or leave --base out for the shipped base"
        )
    for relative in DIGITS_BASE_FILES.values():
        try:
            check_input_file(folder / relative, "--base file")
        except (FileNotFoundError, ValueError) as err:
            files = ", ".join(DIGITS_BASE_FILES.values())
            raise CLIError(f"{err} (--base must hold an ip-adapter base: {files})") from None


def _training(args: argparse.Namespace) -> str:
    """``support``, ``base`` or ``adapter``; a flag that does not apply to it is a usage error."""
    if args.recipe in ("support", "mixed"):
        if args.stage is not None or args.base is not None:
            raise CLIError("--stage and --base apply to --recipe ip-adapter only")
        training = "support"
    else:
        training = args.stage or "adapter"
        if training == "base" and args.base is not None:
            raise CLIError("--base names the base an adapter starts from; it does not apply to --stage base")
    for flag, (field, _, takers) in _FLAGS.items():
        if getattr(args, field) is not None and training not in takers:
            raise CLIError(f"{flag} does not apply to the {training} training (it applies to: {', '.join(takers)})")
    return training


def run(args: argparse.Namespace) -> int:
    training = _training(args)
    check(args)
    from .._io import OutputLocked
    from ..tiny.digits import CheckpointError, DigitsAdapterConfig, DigitsBaseConfig, DigitsTrainConfig, train_digits

    kinds = {"support": DigitsTrainConfig, "base": DigitsBaseConfig, "adapter": DigitsAdapterConfig}
    settings = {field: getattr(args, field) for field, *_ in _FLAGS.values() if getattr(args, field) is not None}
    if training == "adapter" and args.base is not None:
        settings["base"] = args.base
    if args.recipe == "mixed":
        settings["mixed"] = DIGITS_MIXED_FRACTION
    with cli_errors(ValueError, TypeError):
        config = kinds[training](**settings)
    out = Path(args.out)
    try:
        with claimed_output(out, COMMAND, args, _key(args, training), resumable=True) as folder:
            record = train_digits(folder.staging, config, progress=not args.no_progress)  # renamed in when whole
    except (CheckpointError, OutputLocked, FileNotFoundError) as err:  # with what the folder holds now
        raise CLIError("; ".join([str(err), *getattr(err, "__notes__", [])])) from None
    wall = record["wall_s"]
    stages = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in wall.items() if stage != "total")
    written = {
        "support": "model/, ip_adapter/",
        "base": "unet/ (float16), image_encoder/",
        "adapter": "ip_adapter/",
    }[training]
    final = {"support": "unet", "base": "unet", "adapter": "adapter"}[training]
    print(
        f"wrote {out}: {written}, record.json, loss.png; trained in {wall['total'] / 60:.1f} min ({stages}) "
        f"on {config.threads} threads; final {final} loss (mean of the last 100 steps) "
        f"{record['final_losses'][final]:.4f}"
    )
    return 0
