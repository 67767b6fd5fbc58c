"""Arguments and loading shared by the subcommands that run a pipeline (``probe``, ``compare``, ``sweep``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from .._checks import (
    DEFAULT_DIGITS_RECIPE,
    DIGITS_RECIPES,
    MAX_SEED,
    check_device,
    check_steps,
    parse_bandwidth,
    parse_float,
    parse_int,
)
from . import CLIError

DTYPES = ("float32", "float16", "bfloat16")


def bandwidth_type(*names: str):
    """An argparse ``type`` accepting the given keywords (e.g. ``"matched"``, ``"fit"``) or a bandwidth number in
    :data:`~.._checks.BANDWIDTH_RANGE` (where float32 NW weights stay finite). Imports no torch, unlike
    :mod:`ipa_probe.bandwidth`, so that arguments are checked before torch loads."""

    def bandwidth(value: str) -> str | float:
        try:
            return parse_bandwidth(value, keywords=names)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix("bandwidth: ")) from None

    return bandwidth


def _argument_type(check, name: str):
    def parse(value: str):
        try:
            return check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None

    parse.__name__ = name  # argparse names the type in its messages
    return parse


#: argparse types: a seed in [0, 2**63 - 1]; a positive step count; a finite non-negative scale; 1-256 images.
seed_type = _argument_type(lambda v: parse_int(v, "seed", 0, MAX_SEED), "seed")
steps_type = _argument_type(lambda v: parse_int(v, "steps", 1), "steps")
scale_type = _argument_type(lambda v: parse_float(v, "scale", 0.0), "scale")
images_type = _argument_type(lambda v: parse_int(v, "num-images", 1, 256), "num-images")


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
        f"ip-adapter: adapter only on a frozen base, as IP-Adapter is; default: {DEFAULT_DIGITS_RECIPE}; "
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
        type=int,
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


@dataclass
class Loaded:
    """A ready pipeline and what to call it with."""

    pipe: object
    references: list
    call_kwargs: dict
    description: dict


def _local_or_hub(value: str) -> str:
    path = Path(value).expanduser()
    return str(path) if path.exists() else value


def load_pipeline(args: argparse.Namespace, require_images: bool = True) -> Loaded:
    """Build the embedded pipeline or load real weights as the arguments say; errors become :class:`CLIError`.

    ``require_images=False`` lets real weights load without ``--image`` (a sweep's rows bring their own).
    """
    check_recipe_flag(args)
    import torch

    check_size(args)
    device = _device(args)
    dtype = getattr(torch, args.dtype)
    references = _references(args)
    if args.model is None:
        pipe, steps, size, description = _embedded_pipeline(args, device, dtype)
        references = references or _default_references(args)
    else:
        has_images = references is not None or not require_images
        pipe, steps, size, description = _pretrained_pipeline(args, device, dtype, has_images)
    try:
        check_steps(pipe.scheduler, steps)
    except ValueError as err:
        raise CLIError(f"--{err}") from None
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

    try:
        check_device(args.device)
    except ValueError as err:
        raise CLIError(f"--{err}") from None
    return torch.device(args.device)


def _references(args: argparse.Namespace) -> list | None:
    """The ``--image`` reference images, or ``None`` when none were given."""
    from ..images import load_images

    try:
        return load_images(args.image) if args.image else None
    except (OSError, ValueError, TypeError) as err:
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

    if args.variant != "base":
        raise CLIError("the digits organism has a base IP-Adapter only; drop --variant or pass --kind sd15")
    if not 0 <= args.digit <= 9:
        raise CLIError(f"--digit must be in 0..9, got {args.digit}")
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
    if args.ip_adapter is not None:
        raise CLIError("--ip-adapter needs --model (the pipeline it belongs to)")
    if args.kind == "digits":
        return _digits_organism(args, device, dtype)
    from ..tiny.sd import tiny_pipeline

    pipe = tiny_pipeline(kind=args.kind, ip_adapter=args.variant, seed=args.seed, device=device, dtype=dtype)
    description = {"model": f"embedded tiny {args.kind}", "ip_adapter": f"embedded {args.variant}"}
    return pipe, args.steps or 10, args.size or (64, 64), description


def _pretrained_pipeline(
    args: argparse.Namespace, device, dtype, has_images: bool
) -> tuple[object, int, tuple[int, int] | None, dict]:
    """``--model`` with ``--ip-adapter`` loaded from the hub or local folders: ``(pipe, steps, size, description)``.

    ``has_images``: whether reference images are given or not needed (checked after ``--ip-adapter``).
    """
    if args.ip_adapter is None:
        raise CLIError("--model needs --ip-adapter (a hub id or folder with IP-Adapter weights)")
    if not has_images:
        raise CLIError("--model needs at least one --image (a reference image file or folder)")
    for value, flag in ((args.model, "--model"), (args.ip_adapter, "--ip-adapter")):
        if value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
            raise CLIError(f"{flag} {value!r} does not exist; pass an existing folder or a hub id")
    from diffusers import AutoPipelineForText2Image

    try:
        pipe = AutoPipelineForText2Image.from_pretrained(_local_or_hub(args.model), torch_dtype=dtype)
    except (OSError, ValueError) as err:
        raise CLIError(f"could not load --model {args.model!r}: {str(err).splitlines()[0]}") from None
    encoder = None if args.image_encoder_folder.lower() == "none" else args.image_encoder_folder
    if getattr(pipe, "image_encoder", None) is not None:
        encoder = None
    try:
        pipe.load_ip_adapter(
            _local_or_hub(args.ip_adapter),
            subfolder=args.subfolder,
            weight_name=args.weight_name,
            image_encoder_folder=encoder,
            torch_dtype=dtype,
        )
    except (OSError, ValueError, KeyError) as err:
        raise CLIError(f"could not load --ip-adapter {args.ip_adapter!r}: {str(err).splitlines()[0]}") from None
    pipe.to(device)
    description = {"model": args.model, "ip_adapter": args.ip_adapter, "weight_name": args.weight_name}
    return pipe, args.steps or 30, args.size, description


def check_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check that ``path`` can be created and written, without creating it (it is made when the work starts).

    Raises:
        CLIError: ``path`` or a parent is a file, or the nearest existing parent is not writable.
    """
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
    return out


def output_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and parents) when the work starts, or fail with a clear message."""
    out = check_output_dir(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = err.strerror or err
        raise CLIError(f"cannot write to --out {str(out)!r} ({reason}); choose a writable folder") from None
    return out
