"""``ipa-probe train-digits``: train the digits organism (SD 1.5-architecture pipeline + IP-Adapter) from scratch."""

from __future__ import annotations

import argparse

from .._checks import parse_int
from . import CLIError
from ._common import add_threads_argument, argument_type, check_output_dir, output_dir, quiet_diffusers

#: argparse types of the training sizes (checked before torch loads; DigitsTrainConfig checks the rest)
count_type = argument_type(lambda v: parse_int(v, "count", 1), "count")
seed_type = argument_type(lambda v: parse_int(v, "seed", 0), "seed")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-digits",
        help="train the digits model organism (the shipped weights are this command's output)",
        description=(
            "Train the digits organism on scikit-learn's handwritten digits, deterministically on CPU: the VAE, then "
            "the UNet, IP-Adapter and image encoder. Resumes from the checkpoint in --out; writes model/, "
            "ip_adapter/, record.json and loss.png there. Load the result with ipa_probe.digits_pipeline(OUT). "
            "On a machine shared with other jobs, OMP_WAIT_POLICY=PASSIVE stops the two threads spin-waiting."
        ),
    )
    parser.add_argument("--out", default="outputs/digits", help="output folder (default: outputs/digits)")
    # Defaults (None) are DigitsTrainConfig's, the shipped weights' settings; read late (diffusers imports slowly).
    for flag, type_, help_ in (
        ("--seed", seed_type, "seed"),
        ("--steps", count_type, "UNet + adapter training steps"),
        ("--vae-steps", count_type, "VAE training steps"),
        ("--batch", count_type, "batch size"),
        ("--checkpoint-every", count_type, "steps between checkpoints"),
    ):
        parser.add_argument(flag, type=type_, default=None, help=f"{help_} (default: the shipped weights' setting)")
    add_threads_argument(parser, default="2, the shipped weights' setting: the result depends on it at the last bits")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.set_defaults(func=run, check=check)


def check(args: argparse.Namespace) -> None:
    """Before torch loads: ``--out`` (the sizes are checked by their argparse types)."""
    check_output_dir(args.out)


def run(args: argparse.Namespace) -> int:
    from ..tiny.digits import DigitsTrainConfig, train_digits

    if not args.verbose:
        quiet_diffusers()

    try:
        names = ("seed", "threads", "steps", "vae_steps", "batch", "checkpoint_every")
        config = DigitsTrainConfig(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
    except ValueError as err:
        raise CLIError(str(err)) from None
    out = output_dir(args.out)
    try:
        record = train_digits(out, config, progress=not args.no_progress)
    except ValueError as err:
        raise CLIError(str(err)) from None
    wall = record["wall_s"]["total"]
    print(
        f"wrote {out}: model/, ip_adapter/, record.json, loss.png; trained in {wall / 60:.1f} min "
        f"(VAE {record['wall_s']['vae']:.0f} s, UNet {record['wall_s']['unet']:.0f} s) on {config.threads} threads; "
        f"final UNet loss (mean of the last 100 steps) {record['final_losses']['unet']:.4f}"
    )
    return 0
