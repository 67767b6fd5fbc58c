"""``ipa-probe sweep MANIFEST``: run the probe once per manifest row, on one process or several (accelerate)."""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
from pathlib import Path

from .._checks import MAX_RESAMPLES, parse_int
from ..runfolder import STAGING_NAME
from . import EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, CLIError
from ._common import (
    add_model_arguments,
    add_overwrite_argument,
    add_tracker_arguments,
    argument_type,
    bandwidth_type,
    check_model_arguments,
    check_output_dir,
    check_run_folder,
    check_tracker_arguments,
    claimed_output,
    load_pipeline,
    logging_dir,
)
from ._errors import cli_errors

COMMAND = "ipa-probe sweep"
#: a sweep resumes in its folder by its own record (each row's fingerprint; --restart for rows of other settings)
KEY: dict = {}


logger = logging.getLogger(__name__)

#: How long a process waits for the others at a barrier (the last one waits for the slowest process's rows).
BARRIER_TIMEOUT = timedelta(hours=12)

EPILOG = """\
manifest: JSON Lines (one object per line) or CSV (a header row, then one row per run). Keys, all optional:
  prompt     text prompt (default: --prompt)
  images     reference image file(s) or folder(s); JSON: a string or a list; CSV: separated by ';' or '|'.
             Relative paths start at the manifest's folder. Default: --image, or the embedded reference images.
  seed       generator seed (default: --seed + the row's index, so each row is reproducible on its own)
  scale      IP-Adapter scale (default: --scale, else 1.0)
  steps      denoising steps (default: --steps)
  bandwidth  'matched', 'fit' or a positive h (default: --bandwidth)
A row with an unknown key, a missing or unreadable image or a bad value is not run: it fails with its line
number and reason; an empty manifest, or one that is neither JSON Lines nor CSV, is an error (exit code 2). A row
that fails while running (an image that cannot be decoded, values the pipeline rejects, an error inside the
pipeline) fails alone. Failed rows go to summary.json ("failed": line, reason, stage), the other rows run, and the
exit code is 3. A finished row whose images went missing keeps its part and fails until they are back.

output (--out): rows/row-NNNNNN.parquet (one Parquet dataset, one part per row of this manifest, with a `row`
column), row_summary.parquet, aggregate.parquet (per timestep over rows, with a bootstrap CI), summary.json,
rho_by_timestep.png; skipped/ (rows that failed), set_aside/ (parts moved out of rows/: damaged, images changed,
row no longer in the manifest, --restart). Run the same command again to resume: rows already written are kept,
failed and damaged rows run again. One sweep at a time per --out (a lock file); Ctrl-C stops with exit code 130.
ipa_probe_manifest.json lists the run's files; a folder holding another command's files (or files no manifest
lists) is refused unless --overwrite, which removes exactly the files the previous manifest lists (docs/cli.md).

device: by default the one accelerate gives each process (cuda:N), else cuda when present, else cpu.
several processes (one device each; --out must be a folder they all see):
  accelerate launch --multi_gpu --num_processes 4 -m ipa_probe sweep MANIFEST --out DIR ...
on CPU, the same with --device cpu (each process gets OMP_NUM_THREADS threads; accelerate's
--num_cpu_threads_per_process sets it). `accelerate launch --cpu` starts a single process.
"""


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def _confidence(value: str) -> float:
    try:
        level = float(value)
    except ValueError:
        level = float("nan")
    if not 0 < level < 1:
        raise argparse.ArgumentTypeError(f"expected a level in (0, 1) such as 0.95, got {value!r}")
    return level


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run the probe once per manifest row and aggregate over rows (one process or several)",
        description="Run the probe once per manifest row; with no model arguments the embedded tiny pipeline runs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("manifest", help="JSON Lines or CSV file, one row per run (see below)")
    add_model_arguments(parser)
    # "auto": the device accelerate gives this process (one GPU per process), else cuda when present, else cpu.
    parser.set_defaults(device="auto")
    bandwidth = bandwidth_type("matched", "fit")
    parser.add_argument("--bandwidth", type=bandwidth, default="matched", help="default NW bandwidth of a row")
    parser.add_argument("--layers", action="append", help="regex selecting layer ids (repeatable; default: all)")
    parser.add_argument("--out", default="outputs/sweep", help="output folder (default: outputs/sweep)")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="replace rows in --out made with other settings (moved to set_aside/) instead of stopping",
    )
    parser.add_argument("--confidence", type=_confidence, default=0.95, help="bootstrap CI level (default 0.95)")
    parser.add_argument(
        "--resamples",
        type=argument_type(lambda v: parse_int(v, "resamples", 1, MAX_RESAMPLES), "resamples"),
        default=9999,
        help=f"bootstrap resamples, 1 to {MAX_RESAMPLES} (default 9999)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--maps",
        type=_positive_int,
        nargs="?",
        const=1,
        help="write reference_maps.png for the first N rows (default 1) under OUT/maps/row-NNNNNN/ (reruns them)",
    )
    parser.add_argument("--maps-rows", type=int, nargs="+", help="manifest rows to draw reference maps for")
    add_overwrite_argument(parser)
    add_tracker_arguments(parser)
    parser.set_defaults(func=run, check=check, writes=lambda args: [Path(args.out)])


def _device(args: argparse.Namespace, state) -> str:
    """The device of this process: accelerate's under several processes, else what --device says."""
    import torch

    from .._checks import check_device

    if state.num_processes > 1:
        if args.device not in ("auto", "cpu", "cuda"):
            raise CLIError(
                f"--device {args.device!r} with {state.num_processes} processes: each process takes its own device; "
                "pass --device cuda or cpu, or leave --device out"
            )
        device = state.device
        return "cpu" if device.type == "cpu" else str(device)
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    with cli_errors(prefix="--"):
        check_device(args.device)
    return args.device


def _settings(args: argparse.Namespace) -> dict:
    """What, besides each row, shapes the rows' tables: part of every row's fingerprint."""
    embedded = args.model is None
    return {
        "model": f"embedded tiny {args.kind}" if embedded else args.model,
        "ip_adapter": f"embedded {args.variant}" if embedded else args.ip_adapter,
        "subfolder": None if embedded else args.weights.subfolder,
        "weight_name": None if embedded else args.weights.weight_name,
        "model_seed": args.seed if embedded else None,
        "dtype": args.dtype,
        "default_images": list(args.image) if args.image else ("embedded" if embedded else None),
    }


def check(args: argparse.Namespace) -> None:
    """Before torch loads: the manifest, ``--out`` and the model arguments (under ``accelerate launch`` only the
    main process prints the one line; the others exit with the same code)."""
    try:
        args.manifest_rows = _read_and_check(args)
        check_model_arguments(args, require_images=False)  # rows bring their own images
    except CLIError:
        if os.environ.get("RANK", "0") == "0":
            raise
        raise CLIError("another process reports the error", silent=True) from None


def run(args: argparse.Namespace) -> int:
    manifest = args.manifest_rows
    state = _state(args)

    def fail(message: str) -> int:
        if state.is_main_process:  # one line, not one per process
            raise CLIError(message)
        return EXIT_USAGE

    load_args = argparse.Namespace(**vars(args))
    load_args.device = _device(args, state)
    loaded = load_pipeline(load_args, require_images=False)  # rows bring their own images
    loaded.pipe.set_progress_bar_config(disable=True)
    runner = _runner(args, loaded)
    if not state.is_main_process:  # the main process holds the folder; every process writes into its staging folder
        return _sweep(args, manifest, state, runner, load_args, fail, Path(args.out) / STAGING_NAME, [])
    lines: list[str] = []
    with claimed_output(args.out, COMMAND, args, KEY, resumable=True) as folder:
        code = _sweep(args, manifest, state, runner, load_args, fail, folder.staging, lines)
    print("\n".join(lines))  # once the run is in place
    return code


def _sweep(args: argparse.Namespace, manifest, state, runner, load_args, fail, staging: Path, lines: list) -> int:
    """Run the rows into ``staging``, then the maps and tracker; the lines to print go to ``lines``."""
    from .._io import OutputLocked
    from ..sweep import run_sweep

    try:
        result = run_sweep(
            manifest,
            runner,
            staging,
            state=state,
            restart=args.restart,
            progress=not args.no_progress,
            confidence=args.confidence,
            n_resamples=args.resamples,
            extra={"run": _run_record(args, load_args)},
        )
    except (ValueError, OutputLocked) as err:
        message = str(err).replace("or restart to replace them", "or pass --restart to replace them")
        return fail(message)
    if state.is_main_process:
        if args.maps or args.maps_rows:
            _write_maps(args, manifest, runner, staging, lines)
        if args.log_with:
            from ..trackers import log_sweep

            settings = {k: v for k, v in vars(args).items() if k not in ("func", "check", "writes")}
            folder = log_sweep(result, staging, settings, args.log_with, logging_dir(args, staging))
            shown = Path(args.out) / folder.relative_to(staging) if folder.is_relative_to(staging) else folder
            lines.append(f"{args.log_with} logs in {shown}")
        result.out = Path(args.out)
        lines.insert(0, result.describe())
    return EXIT_ROWS_FAILED if result.failed else EXIT_OK  # rows the manifest check rejected count as failed


def _read_and_check(args: argparse.Namespace):
    """Everything that needs no model, checked before torch and the pipeline load: the manifest and --out."""
    from ..sweep.manifest import ManifestError, read_manifest

    check_output_dir(args.out)
    if os.environ.get("RANK", "0") == "0":  # the main process holds the folder; the others write into its staging
        check_run_folder(args.out, COMMAND, KEY, args.overwrite)
    check_tracker_arguments(args)
    with cli_errors(ManifestError):
        manifest = read_manifest(args.manifest, require_images=args.model is not None and not args.image)
    if not manifest.rows:
        reasons = "; ".join(s.describe() for s in manifest.skipped[:3])
        more = f"; and {len(manifest.skipped) - 3} more" if len(manifest.skipped) > 3 else ""
        raise CLIError(f"manifest {args.manifest!r}: none of its {manifest.total} rows can run ({reasons}{more})")
    missing = sorted(set(args.maps_rows or ()) - {row.row for row in manifest.rows})
    if missing:
        runnable = _ranges(sorted(row.row for row in manifest.rows))
        raise CLIError(
            f"--maps-rows {_few(missing)}: not rows of the manifest that can run (rows that can: {runnable})"
        )
    return manifest


def _few(values: list, shown: int = 5) -> str:
    """At most ``shown`` values, then how many more: an error line stays one short line."""
    text = ", ".join(map(str, values[:shown]))
    return text + (f" and {len(values) - shown} more" if len(values) > shown else "")


def _ranges(values: list[int], shown: int = 5) -> str:
    """Sorted integers as runs (``0-99, 120``), at most ``shown`` runs, then how many more."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    words = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return _few(words, shown) if len(words) > shown else ", ".join(words)


def _state(args: argparse.Namespace):
    """accelerate's state of this process (one process without ``accelerate launch``)."""
    import torch
    from accelerate import PartialState

    cpu = args.device.startswith("cpu") or (args.device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=cpu, timeout=BARRIER_TIMEOUT)
    if args.threads is not None:  # after PartialState, which may set its own count on CPU
        torch.set_num_threads(args.threads)
    if state.num_processes == 1 and os.environ.get("MASTER_ADDR") and os.environ.get("WORLD_SIZE") is None:
        logger.warning(
            "one process only: `accelerate launch --cpu` starts a single process whatever --num_processes says; "
            "for several CPU processes use `accelerate launch --multi_gpu --num_processes N ... --device cpu`"
        )
    return state


def _runner(args: argparse.Namespace, loaded):
    """The row runner: the loaded pipeline, the defaults rows leave to the command line, the settings they share."""
    from ..sweep import RowDefaults, SweepRunner

    embedded_or_given = args.model is None or bool(args.image)
    call_kwargs = {k: v for k, v in loaded.call_kwargs.items() if k not in ("prompt", "num_inference_steps")}
    defaults = RowDefaults(
        prompt=args.prompt,
        seed=args.seed,
        scale=1.0 if args.scale is None else args.scale,
        steps=loaded.call_kwargs["num_inference_steps"],
        bandwidth=args.bandwidth,
    )
    return SweepRunner(
        loaded.pipe,
        defaults,
        default_images=loaded.references if embedded_or_given else None,
        layers=args.layers,
        call_kwargs=call_kwargs,
        settings=_settings(args),
    )


def _run_record(args: argparse.Namespace, load_args: argparse.Namespace) -> dict:
    """Every command-line setting, for ``summary.json``."""
    import torch

    arguments = {k: v for k, v in vars(args).items() if k != "func"}
    return {"device": load_args.device, "threads": torch.get_num_threads(), "arguments": arguments}


def _write_maps(args: argparse.Namespace, manifest, runner, staging: Path, lines: list) -> None:
    """Reference-map figures for the rows --maps / --maps-rows choose (each row generated once more, with maps)."""
    by_number = {row.row: row for row in manifest.rows}
    numbers = args.maps_rows if args.maps_rows else [row.row for row in manifest.rows[: args.maps]]
    for number in numbers:
        folder = staging / "maps" / f"row-{number:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        paths = runner.write_maps(by_number[number], folder)
        lines.append(f"wrote {Path(args.out) / paths['figure'].relative_to(staging)}")
