"""``ipa-probe compare``: the learned IP-Adapter, the NW head and the exact denoiser from the same seeds, scored."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .._checks import MAX_SEED, NW_FRAMES
from ._common import (
    add_model_arguments,
    add_overwrite_argument,
    bandwidth_type,
    check_model_arguments,
    check_output_dir,
    check_run_folder,
    claimed_output,
    load_pipeline,
    run_key,
    seed_type,
)
from ._errors import CLIError, cli_errors

COMMAND = "ipa-probe compare"


logger = logging.getLogger(__name__)

DEFAULT_NUM_SEEDS = 3

#: The digits organism's right-digit rates per head (learned, NW head in both frames, adapter off), in ``--out``.
RATES_FILE = "digit_rates.csv"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="learned IP-Adapter vs NW head vs exact NW denoiser: image grid and CLIP-I / memorisation table",
        description=(
            "Generate from the same seeds with the learned IP-Adapter, the zero-parameter NW head and the exact "
            "empirical denoiser of the references, and score them with open_clip image embeddings. With no model "
            "arguments it runs the trained digits organism shipped in the package (--kind digits) offline, and adds "
            "the digit classifier's scores; offline, the CLIP model has random weights (--clip-pretrained takes a "
            "checkpoint)."
        ),
    )
    add_model_arguments(parser, default_kind="digits")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=seed_type, nargs="+", help="generator seeds, one grid column each")
    seeds.add_argument(
        "--num-seeds",
        type=int,
        default=None,
        help=f"use the seeds --seed, --seed + 1, ... (default: {DEFAULT_NUM_SEEDS})",
    )
    bandwidth = bandwidth_type("matched")
    parser.add_argument(
        "--bandwidth",
        type=bandwidth,
        default="matched",
        help="NW head bandwidth: 'matched' or h > 0 (stored frame only)",
    )
    parser.add_argument(
        "--nw-frame",
        choices=NW_FRAMES,
        default="stored",
        help="the NW head's key term: 'stored' (|k|^2 of the stored keys; changes under a q/k basis change that "
        "leaves the model's outputs equal) or 'query' (each key's log-partition over the pass's own queries; the "
        "same under every such change; takes no --bandwidth). Default: stored",
    )
    parser.add_argument("--clip-model", default="ViT-B-32", help="open_clip model name (default: ViT-B-32)")
    parser.add_argument(
        "--clip-pretrained",
        default=None,
        help="open_clip weights: a local checkpoint file or a pretrained tag already in the open_clip cache "
        "(default: random weights built from the config, offline)",
    )
    parser.add_argument("--out", default="outputs/compare", help="output folder (default: outputs/compare)")
    add_overwrite_argument(parser)
    parser.set_defaults(func=run, check=check, writes=lambda args: [Path(args.out)])


def _seeds(args: argparse.Namespace) -> list[int]:
    if args.seeds:
        if len(set(args.seeds)) != len(args.seeds):
            raise CLIError(f"--seeds has repeated values {args.seeds}; pass distinct seeds")
        return list(args.seeds)
    count = DEFAULT_NUM_SEEDS if args.num_seeds is None else args.num_seeds
    if count < 1:
        raise CLIError(f"--num-seeds must be at least 1, got {count}")
    if args.seed + count - 1 > MAX_SEED:
        raise CLIError(f"--seed {args.seed} + {count} seeds passes the largest seed {MAX_SEED}; lower --seed")
    return [args.seed + i for i in range(count)]


def check(args: argparse.Namespace) -> None:
    """Before torch loads: the seeds, ``--nw-frame`` against ``--bandwidth``, the model arguments, the references,
    ``--clip-pretrained`` and ``--out``."""
    args.seed_list = _seeds(args)
    if args.nw_frame == "query" and args.bandwidth != "matched":
        raise CLIError(
            f"--bandwidth {args.bandwidth} does not apply to --nw-frame query (its logits carry the model's own "
            "temperature); drop --bandwidth or use --nw-frame stored"
        )
    check_output_dir(args.out)
    pretrained = args.clip_pretrained
    looks_like_path = pretrained is not None and pretrained.startswith((".", "/", "~"))
    if looks_like_path and not Path(pretrained).expanduser().exists():
        raise CLIError(f"--clip-pretrained {pretrained!r} does not exist; pass a checkpoint file or a cached tag")
    check_model_arguments(args)
    check_run_folder(args.out, COMMAND, run_key(args), args.overwrite)


def run(args: argparse.Namespace) -> int:
    with claimed_output(args.out, COMMAND, args, run_key(args)) as folder:  # before the work: conflicts answer now
        lines = _compare(args, folder.staging)
    print("\n".join(lines))  # once the run is in place
    return 0


def _compare(args: argparse.Namespace, staging: Path) -> list[str]:
    """Generate, score and write into ``staging`` (renamed into ``--out`` when the run is whole); returns the lines
    to print."""
    from ..compare import RANDOM_WEIGHTS_NOTE, ClipScorer, compare_methods

    seeds = args.seed_list
    loaded = load_pipeline(args)
    with cli_errors():
        scorer = ClipScorer(args.clip_model, args.clip_pretrained, device=loaded.pipe.device)
    try:
        result = compare_methods(
            loaded.pipe,
            loaded.references,
            seeds,
            loaded.call_kwargs,
            bandwidth=args.bandwidth,
            nw_frame=args.nw_frame,
            scorer=scorer,
            settings={"run": loaded.description},
        )
    except ValueError as err:
        raise CLIError(str(err)) from None
    if "digit" in loaded.description:  # the digits organism: score the methods with the digit classifier too
        from ..tiny.digits import add_digit_scores

        add_digit_scores(result, loaded.description["digit"])
    out = Path(args.out)
    paths = result.save(staging)
    lines = [result.markdown()]
    if "digit" in loaded.description:
        from .._io import write_table
        from ..compare_rates import digit_rate_line, label_rates
        from ..tiny.digits import classify_digit_images
        from ..tiny.digits.evaluate import digit_readings_line

        lines.append(digit_readings_line(result))
        # the NW baseline's quality beside the learned head and the adapter off, from the same seeds (#40 point 7)
        digit = int(loaded.description["digit"])
        rates = label_rates(
            loaded.pipe, [(digit, loaded.references)], seeds, classify_digit_images, loaded.call_kwargs
        )
        write_table(rates.assign(digit=digit), staging / RATES_FILE)
        lines.append(digit_rate_line(rates, digit))
    if scorer.random_weights:
        lines.append(f"note: {RANDOM_WEIGHTS_NOTE}")
    lines.append(
        f"wrote {out}: {paths['grid'].name} (references, VAE round trip, {len(result.images)} methods x "
        f"{len(seeds)} seeds), "
        f"{paths['table'].name}, {paths['markdown'].name}, {paths['per_image'].name}, {paths['record'].name}, "
        + (f"{RATES_FILE}, " if "digit" in loaded.description else "")
        + f"images/ ({sum(len(v) for v in result.images.values())} PNGs), ipa_probe_manifest.json"
    )
    return lines
