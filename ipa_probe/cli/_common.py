"""Arguments and loading shared by the subcommands that run a pipeline (``probe``, ``compare``, ``sweep``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from . import CLIError

DTYPES = ("float32", "float16", "bfloat16")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--ip-adapter``, ... : with none of them the embedded tiny pipeline runs offline."""
    group = parser.add_argument_group("model (default: the embedded tiny pipeline, offline)")
    group.add_argument("--model", help="diffusers pipeline: hub id or local folder (from_pretrained)")
    group.add_argument("--ip-adapter", help="IP-Adapter weights: hub id or local folder (load_ip_adapter)")
    group.add_argument("--subfolder", default="", help="subfolder of --ip-adapter holding the weights (h94: 'models')")
    group.add_argument("--weight-name", help="weights file inside --ip-adapter, e.g. ip-adapter_sd15.safetensors")
    group.add_argument(
        "--image-encoder-folder",
        default="image_encoder",
        help="image encoder subfolder of --ip-adapter, or 'none' when --model already has an image_encoder",
    )
    group.add_argument("--kind", choices=("sd15", "sdxl"), default="sd15", help="embedded pipeline family")
    group.add_argument("--variant", choices=("base", "plus"), default="base", help="embedded IP-Adapter variant")
    group.add_argument("--image", action="append", default=[], help="reference image or folder (repeatable)")
    group.add_argument("--prompt", default="a photo", help="text prompt")
    group.add_argument("--steps", type=int, default=None, help="denoising steps (default: 30, embedded: 10)")
    group.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the pipeline's)")
    group.add_argument("--scale", type=float, default=None, help="IP-Adapter scale (set_ip_adapter_scale)")
    group.add_argument("--size", type=int, nargs=2, metavar=("H", "W"), help="output height and width")
    group.add_argument("--seed", type=int, default=0, help="generator seed")
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
    import torch

    _check_sizes(args)
    device = _device(args)
    dtype = getattr(torch, args.dtype)
    references = _references(args)
    if args.model is None:
        pipe, steps, size, description = _embedded_pipeline(args, device, dtype)
        references = references or _default_references()
    else:
        has_images = references is not None or not require_images
        pipe, steps, size, description = _pretrained_pipeline(args, device, dtype, has_images)
    pipe.set_progress_bar_config(disable=False, desc="denoising")
    if args.scale is not None:
        pipe.set_ip_adapter_scale(args.scale)
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
        }
    )
    return Loaded(pipe, references, call_kwargs, description)


def _check_sizes(args: argparse.Namespace) -> None:
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps must be at least 1, got {args.steps}")
    if args.size is not None and any(s < 8 or s % 8 for s in args.size):
        raise CLIError(f"--size must be two multiples of 8 (at least 8), got {args.size}")


def _device(args: argparse.Namespace):
    """The torch device of ``--device``, checked to exist."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise CLIError(f"--device {args.device!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    return device


def _references(args: argparse.Namespace) -> list | None:
    """The ``--image`` reference images, or ``None`` when none were given."""
    from ..images import load_images

    try:
        return load_images(args.image) if args.image else None
    except (OSError, ValueError, TypeError) as err:
        raise CLIError(str(err)) from None


def _default_references() -> list:
    from ..tiny.sd import default_reference_images

    return default_reference_images()


def _embedded_pipeline(args: argparse.Namespace, device, dtype) -> tuple[object, int, tuple[int, int], dict]:
    """The embedded tiny pipeline (offline): ``(pipe, steps, size, description)``."""
    if args.ip_adapter is not None:
        raise CLIError("--ip-adapter needs --model (the pipeline it belongs to)")
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


def output_dir(path: str) -> Path:
    """Create ``path`` (and parents) or fail with a clear message."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe_file = out / ".ipa_probe_write_test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as err:
        raise CLIError(
            f"cannot write to --out {str(out)!r} ({err.strerror or err}); choose a writable folder"
        ) from None
    return out
