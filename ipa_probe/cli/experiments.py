"""``ipa-probe experiments NAME --tier quick|smoke|full``: the paper's failure regimes and attention analysis."""

from __future__ import annotations

import argparse
import os

from .._checks import DIGITS_RECIPES, MAX_SEED
from ._common import (
    add_overwrite_argument,
    add_threads_argument,
    add_tracker_arguments,
    check_output_dir,
    check_run_folder,
    check_tracker_arguments,
    claimed_output,
    logging_dir,
    seed_type,
)
from ._errors import CLIError, cli_errors

COMMAND = "ipa-probe experiments"
#: experiments resume and add to a folder by their own records (the tier check, the checkpoints under OUT/runs)
KEY: dict = {}


NAMES = ("collapse", "shells", "scarcity", "heads", "attention", "ip-adapter", "attribution", "all")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "experiments",
        help="reproduce the paper's failure regimes (collapse, shells, scarcity, heads) and attention analysis",
        description="Train and evaluate the in-context flow-matching experiments of the paper on CPU. Interrupted "
        "runs resume from their checkpoints under OUT/runs when the same command is started again.",
    )
    parser.add_argument("name", help=f"experiment: one of {', '.join(NAMES)}")
    parser.add_argument(
        "--tier",
        default="quick",
        help="quick (< 2 min), smoke (< 10 min) or full (< 60 min) on a CPU; paper: the paper's sizes, for a CUDA GPU",
    )
    parser.add_argument("--out", default=None, help="output folder (default outputs/experiments-TIER)")
    for flag, kind, what in (
        ("--seeds", seed_type, f"training seeds, distinct, each in [0, {MAX_SEED}]"),
        ("--dims", int, "dimensions d of collapse and shells, distinct, each in [2, 64]"),
        ("--ms", int, "support sizes m of scarcity and heads, distinct, each in [1, 100]"),
    ):
        parser.add_argument(flag, type=kind, nargs="+", default=None, help=f"{what} (default: the tier's)")
    parser.add_argument(
        "--recipe",
        default="support",
        choices=DIGITS_RECIPES,
        help="the digits organism's recipe that ip-adapter and attribution load: support (default), ip-adapter or "
        "mixed",
    )
    add_threads_argument(
        parser,
        "OMP_NUM_THREADS if set, else 1 on the CPU tiers (their models are tiny: two threads doubled the quick "
        "tier's time), else the CPUs this process may use",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_overwrite_argument(parser)
    add_tracker_arguments(parser)
    parser.set_defaults(func=run, check=check, writes=lambda args: [args.out])


def check(args: argparse.Namespace) -> None:
    """Before torch loads: the name, the tier, sizes and seeds, the tracker, and that ``--out`` holds no other
    tier's results."""
    from ..experiments.tiers import ALL_TIERS, DIM_RANGE, M_RANGE, TierMismatch, check_folder_tier

    if args.name not in NAMES:
        raise CLIError(f"unknown experiment {args.name!r}; expected one of {', '.join(NAMES)}")
    if args.tier not in ALL_TIERS:
        raise CLIError(f"unknown tier {args.tier!r}; expected one of {', '.join(ALL_TIERS)}")
    for d in args.dims or ():
        if not DIM_RANGE[0] <= d <= DIM_RANGE[1]:
            raise CLIError(f"dimension d={d} out of range; expected {DIM_RANGE[0]} <= d <= {DIM_RANGE[1]}")
    for m in args.ms or ():
        if not M_RANGE[0] <= m <= M_RANGE[1]:
            raise CLIError(f"support size m={m} out of range; expected {M_RANGE[0]} <= m <= {M_RANGE[1]}")
    for flag, values in (("--seeds", args.seeds), ("--dims", args.dims), ("--ms", args.ms)):
        repeated = sorted({v for v in values or () if values.count(v) > 1})
        if repeated:  # a repeat would train the same model twice and count it twice in the statistics
            raise CLIError(f"{flag} has repeated values {repeated}; give each value once")
    args.out = check_output_dir(args.out or f"outputs/experiments-{args.tier}")  # made when the run starts
    check_tracker_arguments(args)  # after --out is known: the logs go to OUT/logs by default
    args.tier_sizes = ALL_TIERS[args.tier].with_overrides(seeds=args.seeds, dims=args.dims, ms=args.ms)
    if args.threads is None and args.tier_sizes.device == "cpu" and not os.environ.get("OMP_NUM_THREADS", "").strip():
        # The CPU tiers' models are tiny (d_model 16-64, the 16 px digits organism): their kernels are too small to
        # share between threads, and every parallel region hands work to a sleeping thread. Measured on a quiet
        # 2-core machine, the quick tier took 217 s of wall time (208 s CPU) at 2 threads and 107 s at 1.
        args.threads = 1
    if not args.overwrite:  # the more telling refusal first: another tier's results
        with cli_errors(TierMismatch):
            check_folder_tier(args.out, args.tier_sizes)
    check_run_folder(args.out, COMMAND, KEY, args.overwrite)


def run(args: argparse.Namespace) -> int:
    import torch

    from .._io import OutputLocked
    from ..experiments import run_experiments
    from ..experiments.checkpoint import CheckpointError
    from ..experiments.tiers import TierMismatch

    tier, out = args.tier_sizes, args.out
    if tier.device == "auto":
        if not torch.cuda.is_available():
            raise CLIError(
                f"tier {args.tier!r} has the paper's sizes and needs a CUDA GPU (tens of GPU-hours), and none is "
                "visible; use --tier full on a CPU"
            )
    lines = []
    with claimed_output(out, COMMAND, args, KEY, resumable=True) as folder:  # written aside, renamed in when whole
        staging = folder.staging
        try:
            threads = args.threads or torch.get_num_threads()  # OMP_NUM_THREADS, set before torch loaded
            results = run_experiments(
                [args.name], tier, staging, progress=not args.no_progress, threads=threads, recipe=args.recipe
            )
        except (CheckpointError, OutputLocked, TierMismatch) as err:
            raise CLIError(str(err)) from None
        for name, result in results.items():
            lines.append(f"{name}: {out / name / 'table.md'} ({result.record['wall_time_s']:.0f} s)")
        lines.append(f"summary: {out / 'summary.md'}")
        if args.log_with:
            from ..trackers import log_experiments

            skip = ("func", "check", "tier", "tier_sizes", "writes")
            settings = {"tier": tier.name, **{k: v for k, v in vars(args).items() if k not in skip}}
            logs = log_experiments(results, staging, settings, args.log_with, logging_dir(args, staging))
            shown = out / logs.relative_to(staging) if logs.is_relative_to(staging) else logs
            lines.append(f"{args.log_with} logs in {shown}")
    print("\n".join(lines))  # once the run is in place
    return 0
