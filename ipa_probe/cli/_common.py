"""Arguments, checks and loading shared by the subcommands that run a pipeline (``probe``, ``compare``, ``sweep``).

Every subcommand checks in two phases: :func:`check_model_arguments` and the other ``check_*`` functions here import
neither torch nor diffusers (a wrong argument answers at once), :func:`load_pipeline` then builds or loads the model.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .._checks import (
    DEFAULT_DIGITS_RECIPE,
    DIGITS_RECIPES,
    MAX_SEED,
    check_device,
    check_device_name,
    check_steps,
    parse_bandwidth,
    parse_float,
    parse_int,
)
from .._io import LOCK_NAME, OutputLocked, output_lock, refuse_not_ours
from ..runfolder import (
    MANIFEST_NAME,
    STAGING_NAME,
    RunConflict,
    RunFolder,
    check_folder,
    pending_commit,
    recover,
    refuse_if_held,
)
from ._errors import CLIError, cli_errors
from ._sources import check_model_source, ip_adapter_source

DTYPES = ("float32", "float16", "bfloat16")


def bandwidth_type(*names: str):
    """An argparse ``type`` accepting the given keywords (e.g. ``"matched"``, ``"fit"``) or a bandwidth number in
    :data:`~.._checks.BANDWIDTH_RANGE` (where float32 NW weights stay finite). Imports no torch, unlike
    :mod:`ipa_probe.statistics.bandwidth`, so that arguments are checked before torch loads."""

    def bandwidth(value: str) -> str | float:
        try:
            return parse_bandwidth(value, keywords=names)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix("bandwidth: ")) from None

    return bandwidth


def argument_type(check, name: str):
    def parse(value: str):
        try:
            return check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None

    parse.__name__ = name  # argparse names the type in its messages
    return parse


#: argparse types: a seed in [0, 2**63 - 1]; a positive step count; a finite non-negative scale; 1-256 images.
seed_type = argument_type(lambda v: parse_int(v, "seed", 0, MAX_SEED), "seed")
steps_type = argument_type(lambda v: parse_int(v, "steps", 1), "steps")
scale_type = argument_type(lambda v: parse_float(v, "scale", 0.0), "scale")
images_type = argument_type(lambda v: parse_int(v, "num-images", 1, 256), "num-images")
threads_type = argument_type(lambda v: parse_int(v, "threads", 1, 4096), "threads")
digit_type = argument_type(lambda v: parse_int(v, "digit", 0, 9), "digit")


def add_threads_argument(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--threads``: torch/OpenMP threads, set (as ``OMP_NUM_THREADS``) before torch loads. ``default``: what the
    help names as the default (by default: ``OMP_NUM_THREADS`` if set, else the CPUs this process may use)."""
    default = default or "OMP_NUM_THREADS if set, else the CPUs this process may use"
    parser.add_argument(
        "--threads",
        type=threads_type,
        default=None,
        help=f"CPU threads (default: {default}); waiting threads sleep (OMP_WAIT_POLICY=PASSIVE unless set)",
    )


#: the embedded pipelines: the trained digits organism and the random tiny SD 1.5 / SDXL ones.
EMBEDDED_KINDS = ("digits", "sd15", "sdxl")
#: the embedded digits organism's generation defaults (the settings of its README rates)
DIGITS_DEFAULTS = {"steps": 20, "digit": 3, "references": 3, "guidance_scale": 3.0, "images": 8}


def add_model_arguments(parser: argparse.ArgumentParser, default_kind: str = "sd15") -> None:
    """``--model``, ``--ip-adapter``, ... : with none of them an embedded pipeline runs offline (``default_kind``:
    ``"digits"``, the trained organism, or ``"sd15"``, the random tiny one)."""
    group = parser.add_argument_group(f"model (default: the embedded {default_kind} pipeline, offline)")
    group.add_argument("--model", help="diffusers pipeline: hub id or local folder (from_pretrained)")
    group.add_argument("--ip-adapter", help="IP-Adapter weights: hub id or local folder (load_ip_adapter)")
    group.add_argument("--subfolder", default="", help="subfolder of --ip-adapter holding the weights (h94: 'models')")
    group.add_argument("--weight-name", help="weights file inside --ip-adapter, e.g. ip-adapter_sd15.safetensors")
    group.add_argument(
        "--image-encoder-folder",
        default="image_encoder",
        help="image encoder subfolder of --ip-adapter, or 'none' when --model already has an image_encoder",
    )
    group.add_argument(
        "--kind",
        choices=EMBEDDED_KINDS,
        default=default_kind,
        help=f"embedded pipeline: digits (the trained organism) or a random tiny sd15/sdxl (default: {default_kind})",
    )
    group.add_argument(
        "--recipe",
        choices=DIGITS_RECIPES,
        default=None,
        help="digits organism: how it was trained (support: everything together on support sets of the class; "
        "mixed: support with half of each batch on mixed reference sets; ip-adapter: adapter only on a frozen base, "
        f"as IP-Adapter is; default: {DEFAULT_DIGITS_RECIPE}; "
        "see docs/organism.md)",
    )
    group.add_argument("--variant", choices=("base", "plus"), default="base", help="embedded IP-Adapter variant")
    group.add_argument("--image", action="append", default=[], help="reference image or folder (repeatable)")
    default_prompt = None if default_kind == "digits" else "a photo"
    group.add_argument(
        "--prompt",
        default=default_prompt,
        help="text prompt (default: 'a handwritten digit' for digits, else 'a photo')",
    )
    group.add_argument(
        "--digit",
        type=digit_type,
        default=DIGITS_DEFAULTS["digit"],
        help=f"digits organism: the references' digit, 0-9 (default: {DIGITS_DEFAULTS['digit']})",
    )
    group.add_argument(
        "--steps", type=steps_type, default=None, help="denoising steps (default: 30; embedded: digits 20, tiny 10)"
    )
    group.add_argument(
        "--guidance-scale", type=scale_type, default=None, help="CFG scale >= 0 (default: the pipeline's)"
    )
    group.add_argument("--scale", type=scale_type, default=None, help="IP-Adapter scale >= 0 (set_ip_adapter_scale)")
    group.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="output height and width")
    group.add_argument("--seed", type=seed_type, default=0, help=f"generator seed in [0, {MAX_SEED}]")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    group.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype")
    add_threads_argument(parser)


@dataclass
class Loaded:
    """A ready pipeline and what to call it with."""

    pipe: object
    references: list
    call_kwargs: dict
    description: dict


def check_model_arguments(args: argparse.Namespace, require_images: bool = True) -> None:
    """Everything about the model arguments that needs no torch: combinations, paths, weight-file headers, hub ids
    (cached, or answered at the hub's first attempt), ``--size``, the form of ``--device``, and the reference images
    (decoded here, kept in ``args.references`` for :func:`load_pipeline`).

    ``require_images=False``: real weights may come without ``--image`` (a sweep's rows bring their own).

    Raises:
        CLIError: one line naming the argument and what to pass instead.
    """
    check_size(args)
    check_device_argument(args.device)
    args.weights = None
    if args.model is None:
        for value, flag in ((args.ip_adapter, "--ip-adapter"), (args.weight_name, "--weight-name")):
            if value is not None:
                raise CLIError(f"{flag} needs --model (the pipeline the IP-Adapter belongs to)")
        if args.kind == "digits" and args.variant != "base":
            raise CLIError("the digits organism has a base IP-Adapter only; drop --variant or pass --kind sd15")
    else:
        if args.ip_adapter is None:
            raise CLIError("--model needs --ip-adapter (a hub id, folder or weight file with IP-Adapter weights)")
        if require_images and not args.image:
            raise CLIError("--model needs at least one --image (a reference image file or folder)")
        args.model_source = check_model_source(args.model)
        args.weights = ip_adapter_source(args.ip_adapter, args.subfolder, args.weight_name)
    args.references = _references(args)


def check_device_argument(name: str) -> None:
    """The form of ``--device`` without torch (``auto``: the sweep's default, accelerate's device or the best one)."""
    if name != "auto":
        with cli_errors(prefix="--"):
            check_device_name(name)


def load_pipeline(args: argparse.Namespace, require_images: bool = True) -> Loaded:
    """Build the embedded pipeline or load real weights as the (checked) arguments say; errors become
    :class:`CLIError`. Call :func:`check_model_arguments` first (the command line's check phase does).

    ``require_images=False`` lets real weights load without ``--image`` (a sweep's rows bring their own).
    """
    check_recipe_flag(args)
    import torch

    if not hasattr(args, "references"):  # called without the check phase (e.g. from Python)
        check_model_arguments(args, require_images)
    device = _device(args)
    dtype = getattr(torch, args.dtype)
    references = args.references
    if args.model is None:
        pipe, steps, size, description = _embedded_pipeline(args, device, dtype)
        references = references or _default_references(args)
    else:
        pipe, steps, size, description = _pretrained_pipeline(args, device, dtype)
    with cli_errors(prefix="--"):
        check_steps(pipe.scheduler, steps)
    pipe.set_progress_bar_config(disable=False, desc="denoising")
    if args.scale is not None:
        pipe.set_ip_adapter_scale(args.scale)
    args.prompt = args.prompt or "a photo"
    call_kwargs = {"prompt": args.prompt, "num_inference_steps": steps}
    if size is not None:
        call_kwargs["height"], call_kwargs["width"] = size
    if args.guidance_scale is not None:
        call_kwargs["guidance_scale"] = args.guidance_scale
    description.update(
        {
            "prompt": args.prompt,
            "steps": steps,
            "seed": args.seed,
            "device": str(device),
            "dtype": args.dtype,
            "references": len(references or ()),
            "scale": args.scale,
            "guidance_scale": args.guidance_scale,
            "size": list(size) if size is not None else None,
        }
    )
    return Loaded(pipe, references, call_kwargs, description)


def check_recipe_flag(args: argparse.Namespace) -> None:
    """``--recipe`` names how the digits organism was trained: it needs the organism (``--kind digits``, no
    ``--model``). Fills in the default recipe otherwise."""
    if args.recipe is not None and (args.model is not None or args.kind != "digits"):
        raise CLIError("--recipe applies to the digits organism only (--kind digits without --model)")
    args.recipe = args.recipe or DEFAULT_DIGITS_RECIPE


def check_size(args: argparse.Namespace) -> None:
    """``--size``: two multiples of 8, at least 8 (``--steps`` is checked by its argparse type)."""
    if args.size is not None and any(s < 8 or s % 8 for s in args.size):
        raise CLIError(f"--size must be two multiples of 8 (at least 8), got {args.size}")


def _device(args: argparse.Namespace):
    """The torch device of ``--device``, checked to be present and able to hold data."""
    import torch

    with cli_errors(prefix="--"):
        check_device(args.device)
    return torch.device(args.device)


def _references(args: argparse.Namespace) -> list | None:
    """The ``--image`` reference images, or ``None`` when none were given (PIL only: no torch)."""
    from ..images import load_images

    try:
        return load_images(args.image) if args.image else None
    except (OSError, ValueError, TypeError) as err:
        if isinstance(err, PermissionError):  # a fault of the environment: exit 1, the path and the remedy
            raise
        raise CLIError(str(err)) from None


def _default_references(args: argparse.Namespace) -> list:
    """The embedded pipeline's references: held-out images of ``--digit`` (digits), else two sample photos."""
    if args.kind == "digits":
        from ..tiny.digits import digits_reference_images

        return digits_reference_images(args.digit, DIGITS_DEFAULTS["references"], seed=args.seed)
    from ..tiny.sd import default_reference_images

    return default_reference_images()


def _digits_organism(args: argparse.Namespace, device, dtype) -> tuple[object, int, tuple[int, int] | None, dict]:
    """The trained digits organism: ``(pipe, steps, size, description)``; sets the digits prompt and CFG defaults."""
    import torch

    from ..tiny.digits import DIGITS_PROMPT, digits_pipeline

    pipe = digits_pipeline(recipe=args.recipe)
    if device.type != "cpu" or dtype != torch.float32:
        pipe = pipe.to(device=device, dtype=dtype)
    args.prompt = args.prompt or DIGITS_PROMPT
    if args.guidance_scale is None:
        args.guidance_scale = DIGITS_DEFAULTS["guidance_scale"]
    description = {
        "model": "embedded digits organism (trained)",
        "ip_adapter": "embedded digits (trained)",
        "recipe": args.recipe,
    }
    if not args.image:
        description["digit"] = args.digit
    return pipe, args.steps or DIGITS_DEFAULTS["steps"], args.size, description


def _embedded_pipeline(args: argparse.Namespace, device, dtype) -> tuple[object, int, tuple[int, int], dict]:
    """The embedded tiny pipeline (offline): ``(pipe, steps, size, description)``."""
    if args.kind == "digits":
        return _digits_organism(args, device, dtype)
    from ..tiny.sd import tiny_pipeline

    pipe = tiny_pipeline(kind=args.kind, ip_adapter=args.variant, seed=args.seed, device=device, dtype=dtype)
    description = {"model": f"embedded tiny {args.kind}", "ip_adapter": f"embedded {args.variant}"}
    return pipe, args.steps or 10, args.size or (64, 64), description


def _first_line(err: BaseException) -> str:
    """``Type: first line`` of an error, cut to its first sentence when long (loaders append their advice)."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    line = text.splitlines()[0]
    if len(line) > 160 and ". " in line:
        line = line.split(". ", 1)[0]
    return f"{type(err).__name__}: {line}"


def _pretrained_pipeline(args: argparse.Namespace, device, dtype) -> tuple[object, int, tuple[int, int] | None, dict]:
    """``--model`` with ``--ip-adapter`` loaded from the hub or local folders: ``(pipe, steps, size, description)``.

    Any failure to load (a damaged or foreign weight file, weights of another architecture) is one line naming the
    source: whatever the loaders raise, the file cannot be used.
    """
    from diffusers import AutoPipelineForText2Image

    try:
        with warnings.catch_warnings():  # diffusers >= 0.36 renames torch_dtype to dtype; older ones know only it
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = AutoPipelineForText2Image.from_pretrained(args.model_source, torch_dtype=dtype)
    except Exception as err:  # noqa: BLE001 - diffusers, transformers and safetensors each raise their own types
        raise CLIError(
            f"could not load --model {args.model!r} ({_first_line(err)}); pass a diffusers pipeline folder "
            "(save_pretrained) or hub id whose files are whole"
        ) from None
    weights = args.weights
    encoder = None if args.image_encoder_folder.lower() == "none" else args.image_encoder_folder
    if getattr(pipe, "image_encoder", None) is not None:
        encoder = None
    where = weights.local_file or f"{weights.location}/{weights.subfolder}/{weights.weight_name}".replace("//", "/")
    try:
        pipe.load_ip_adapter(
            weights.location,
            subfolder=weights.subfolder,
            weight_name=weights.weight_name,
            image_encoder_folder=encoder,
            torch_dtype=dtype,
        )
    except Exception as err:  # noqa: BLE001 - as above: a truncated file, a pickle, a size mismatch all mean "unusable"
        raise CLIError(
            f"could not load --ip-adapter weights {str(where)!r} into {args.model!r} ({_first_line(err)}); pass "
            "whole IP-Adapter weights made for this model's family (e.g. ip-adapter_sd15 for SD 1.5, "
            "ip-adapter_sdxl for SDXL)"
        ) from None
    pipe.to(device)
    description = {"model": args.model, "ip_adapter": args.ip_adapter, "weight_name": weights.weight_name}
    return pipe, args.steps or 30, args.size, description


#: argparse dests that name a path, and their flags: normalised and checked by :func:`check_path_arguments`
PATH_ARGUMENTS = {
    "out": "--out",
    "overlays": "--overlays",
    "logging_dir": "--logging-dir",
    "image": "--image",
    "manifest": "MANIFEST",
    "model": "--model",
    "ip_adapter": "--ip-adapter",
    "base": "--base",
    "clip_pretrained": "--clip-pretrained",
}


def check_path_arguments(args: argparse.Namespace) -> None:
    """Every path argument, before anything else: not empty or blank (an unset shell variable must not mean the
    current folder), text this locale can encode (a name holding undecodable bytes would fail only when it is
    written into ``summary.json`` or printed, after the work), and a leading ``~`` expanded, once, here, so that
    every later use (the lock, the outputs, tracker logs) sees the same path.

    Raises:
        CLIError: one line naming the argument and what to pass instead.
    """
    for dest, flag in PATH_ARGUMENTS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        for text in values:
            _check_path_text(text, flag)
        expanded = [os.path.expanduser(v) for v in values]
        setattr(args, dest, expanded if isinstance(value, list) else expanded[0])


def _check_path_text(text: str, flag: str) -> None:
    if not text.strip():
        raise CLIError(f"{flag} is empty ({text!r}); pass a path (is a shell variable unset?)")
    try:
        text.encode("utf-8")  # what the records (summary.json) and the messages are written in
    except UnicodeEncodeError:
        import sys

        raise CLIError(
            f"{flag} {text!r} holds bytes that are not text in this locale's encoding "
            f"({sys.getfilesystemencoding()}); use a name of UTF-8 characters and run under a UTF-8 locale "
            "(e.g. LC_ALL=C.UTF-8)"
        ) from None


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check that ``path`` can be created and written, without creating it (it is made when the work starts).

    Raises:
        CLIError: ``path`` or a parent is a file, or the nearest existing parent is not writable.
        IsADirectoryError: ``path``'s lock file (``.ipa_probe.lock``) is a folder.
    """
    if not str(path).strip():
        raise CLIError(f"{flag} is empty ({str(path)!r}); pass a folder (is a shell variable unset?)")
    out = Path(path).expanduser()
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{str(existing)!r} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{str(existing)!r} is not writable"
    if problem:
        raise CLIError(f"cannot write to output folder {flag} {str(out)!r} ({problem}); choose a writable folder")
    lock = out / LOCK_NAME
    if lock.is_dir() and not lock.is_symlink():  # the lock must be a file: the answer of output_lock (exit 1)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(lock))
    refuse_not_ours(lock)  # a link, FIFO, device or socket there is not ours: exit 1, nothing opened
    return out


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: replace the previous run's files in the output folder (see :mod:`ipa_probe.runfolder`)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"the output folder holds another run's files: replace exactly the files its {MANIFEST_NAME} lists, "
        "byte for byte as listed, once this run is whole (it is written aside, in OUT/.ipa_probe-staging, until "
        "then); files no manifest lists are kept, and named (default: refuse, exit code 2)",
    )


#: arguments that do not change what a run writes: left out of the key that says whether two runs are the same run
#: ``compile`` changes how the statistics run, not the files (the same numbers)
_NOT_IN_KEY = frozenset(
    {"out", "overwrite", "threads", "verbose", "no_progress", "command", "argv", "holder", "compile"}
)


def run_settings(args: argparse.Namespace) -> dict:
    """The command-line settings of a run, for its manifest (plain values only: no parsed manifests or functions)."""
    plain = (str, int, float, bool, type(None))

    def is_plain(value) -> bool:
        if isinstance(value, list | tuple):
            return all(is_plain(v) for v in value)
        return isinstance(value, plain)

    return {k: v for k, v in vars(args).items() if is_plain(v)}


def run_key(args: argparse.Namespace) -> dict:
    """What must be equal for a rerun of ``probe`` or ``compare`` into the same folder to be the same run: every
    setting that shapes the files written, as given on the command line. Taken once, at the check before torch
    loads, and kept on ``args``: loading the model fills defaults into ``args`` (the organism's prompt, recipe,
    guidance), and a key taken after that would never equal the check's, so a rerun of the same command would be
    refused as another run's."""
    key = getattr(args, "_run_key", None)
    if key is None:
        key = {k: v for k, v in run_settings(args).items() if k not in _NOT_IN_KEY}
        args._run_key = key  # a dict: run_settings leaves it out of the manifest's settings
    return key


def check_run_folder(folder, command: str, key: dict, overwrite: bool, flag: str = "--out") -> None:
    """Before torch loads: refuse (exit code 2) a folder a live run holds, or one holding another run's files
    (unless ``--overwrite``), a changed file of the previous run, or a manifest that cannot be trusted. A folder with
    what a stopped commit left is finished first, under the lock, as the next writer would (:func:`recover`)."""
    try:
        refuse_if_held(folder)
        if pending_commit(folder):
            with output_lock(folder, command):
                note = recover(folder)
            if note:
                print(f"{command}: note: {note}", file=sys.stderr)
        check_folder(folder, command, key, overwrite=overwrite, flag=flag)
    except (RunConflict, OutputLocked) as err:
        raise CLIError(str(err)) from None


@contextmanager
def claimed_output(
    folder, command: str, args: argparse.Namespace, key: dict, flag: str = "--out", resumable: bool = False
) -> Iterator[RunFolder]:
    """Hold an output folder for this run (:class:`ipa_probe.runfolder.RunFolder`): the block writes into
    ``run.staging``, which is renamed into place when the block ends without an error. What ``--overwrite`` kept goes
    to stderr as one line; what the folder holds after a fault is a note on the error, which the command line
    prints."""
    run = RunFolder(
        Path(folder),
        command,
        run_settings(args),
        key,
        overwrite=args.overwrite,
        flag=flag,
        resumable=resumable,
        holder=getattr(args, "holder", None),
    )
    try:
        with run:
            note = run.note() if args.overwrite else None
            if note:
                print(f"{command}: note: {note}", file=sys.stderr)
            yield run
    except (RunConflict, OutputLocked) as err:  # one line; the folder is as it was
        raise CLIError("; ".join([str(err), *getattr(err, "__notes__", [])])) from None


#: ``--log-with`` choices (the trackers of :mod:`ipa_probe.trackers`; the list is repeated here so that argument
#: parsing imports nothing heavy).
TRACKER_CHOICES = ("tensorboard", "wandb", "mlflow")


def add_tracker_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-with`` and ``--logging-dir``."""
    parser.add_argument(
        "--log-with",
        choices=TRACKER_CHOICES,
        help="also send the per-step statistics, figures and settings to this tracker when the run ends "
        "(tensorboard ships with ipa_probe; wandb and mlflow need pip install 'ipa_probe[wandb]' / '[mlflow]')",
    )
    parser.add_argument("--logging-dir", help="where the tracker writes (default: OUT/logs)")


def check_tracker_arguments(args: argparse.Namespace) -> None:
    """Before torch loads: the tracker can log (its client installed; wandb logged in or offline) and
    ``--logging-dir`` is writable."""
    if getattr(args, "log_with", None) is None:
        if getattr(args, "logging_dir", None):
            raise CLIError("--logging-dir needs --log-with (tensorboard, wandb or mlflow)")
        return
    from ..trackers import check_tracker

    with cli_errors(ImportError, ValueError):  # not installed; wandb not logged in and not offline
        check_tracker(args.log_with)
    if args.logging_dir:
        check_logging_dir(args)
    check_output_dir(logging_dir(args), "--logging-dir")  # OUT/logs a file: refused now, not after the run


def check_logging_dir(args: argparse.Namespace) -> None:
    """Refuse, before torch loads, a ``--logging-dir`` inside ``--out`` or inside any other run folder, why being
    docs/failures.md's 'Tracker logs'; ``OUT/logs`` itself is the default, and is taken as it."""
    place = Path(args.logging_dir).expanduser().resolve()
    out = Path(args.out).expanduser().resolve() if getattr(args, "out", None) else None
    if out is not None and place == out / "logs":
        args.logging_dir = None  # the default: the logs are the run's own (staged with it)
        return
    remedy = (
        "leave --logging-dir out to log under OUT/logs with the run, or choose a folder outside every ipa_probe "
        "run folder"
    )
    if out is not None and place.is_relative_to(out):
        raise CLIError(f"--logging-dir {args.logging_dir} is inside --out {args.out}: {remedy}")
    for folder in (place, *place.parents):
        marks = [n for n in (MANIFEST_NAME, LOCK_NAME, STAGING_NAME) if os.path.lexists(folder / n)]
        if marks or folder.name == STAGING_NAME:
            why = f"it holds {marks[0]}" if marks else "a run's staging folder"
            raise CLIError(
                f"--logging-dir {args.logging_dir} is inside the run folder '{folder}' ({why}): the tracker's files "
                f"would be files no manifest lists there, and that folder's next run would be refused; {remedy}"
            )


#: Trackers whose local store holds many runs and records absolute paths (see ``runfolder.TRACKER_STORES``): under
#: the default ``OUT/logs`` they write where the store lives, not into the run's staging folder.
STORE_TRACKERS = ("wandb", "mlflow")


def logging_dir(args: argparse.Namespace, root: str | os.PathLike | None = None) -> Path:
    """``--logging-dir``, or ``ROOT/logs`` (``ROOT``: the run's staging folder, by default ``--out``; ``--out`` itself
    for wandb and MLflow, whose stores are never staged; a leading ``~`` expanded)."""
    if args.logging_dir:
        return Path(args.logging_dir).expanduser()
    if getattr(args, "log_with", None) in STORE_TRACKERS:
        root = None
    return Path(root if root is not None else args.out).expanduser() / "logs"
