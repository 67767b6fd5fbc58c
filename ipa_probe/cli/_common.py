"""Arguments and loading shared by the subcommands that run a pipeline (``probe``, ``compare``, ``sweep``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from . import CLIError

DTYPES = ("float32", "float16", "bfloat16")


def bandwidth_type(*names: str):
    """An argparse ``type`` accepting the given keywords (e.g. ``"matched"``, ``"fit"``) or a positive number."""

    def parse(value: str) -> str | float:
        if value in names:
            return value
        try:
            h = float(value)
        except ValueError:
            h = math.nan
        if not (math.isfinite(h) and h > 0):
            accepted = " or ".join(repr(n) for n in names)
            raise argparse.ArgumentTypeError(f"expected {accepted} or a positive number, got {value!r}")
        return h

    return parse


#: the embedded pipelines: the trained digits organism and the random tiny SD 1.5 / SDXL ones.
EMBEDDED_KINDS = ("digits", "sd15", "sdxl")
#: the embedded digits organism's generation defaults (the settings of its README rates)
DIGITS_DEFAULTS = {"steps": 20, "digit": 3, "references": 4, "guidance_scale": 1.0}


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
        "--steps", type=int, default=None, help="denoising steps (default: 30; embedded: digits 20, sd15/sdxl 10)"
    )
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

    from ..images import load_images

    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps must be at least 1, got {args.steps}")
    if args.size is not None and any(s < 8 or s % 8 for s in args.size):
        raise CLIError(f"--size must be two multiples of 8 (at least 8), got {args.size}")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise CLIError(f"--device {args.device!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    dtype = getattr(torch, args.dtype)
    try:
        references = load_images(args.image) if args.image else None
    except (OSError, ValueError, TypeError) as err:
        raise CLIError(str(err)) from None

    if args.model is None and args.ip_adapter is not None:
        raise CLIError("--ip-adapter needs --model (the pipeline it belongs to)")
    if args.model is None and args.kind == "digits":
        from ..tiny.digits import DIGITS_PROMPT, digits_pipeline, digits_reference_images

        if args.variant != "base":
            raise CLIError("the digits organism has a base IP-Adapter only; drop --variant or pass --kind sd15")
        if not 0 <= args.digit <= 9:
            raise CLIError(f"--digit must be in 0..9, got {args.digit}")
        pipe = digits_pipeline()
        if device.type != "cpu" or dtype != torch.float32:
            pipe = pipe.to(device=device, dtype=dtype)
        references = references or digits_reference_images(args.digit, DIGITS_DEFAULTS["references"], seed=args.seed)
        args.prompt = args.prompt or DIGITS_PROMPT
        steps = args.steps or DIGITS_DEFAULTS["steps"]
        if args.guidance_scale is None:
            args.guidance_scale = DIGITS_DEFAULTS["guidance_scale"]
        size = args.size
        description = {"model": "embedded digits organism (trained)", "ip_adapter": "embedded digits (trained)"}
        if not args.image:
            description["digit"] = args.digit
    elif args.model is None:
        from ..tiny.sd import default_reference_images, tiny_pipeline

        pipe = tiny_pipeline(kind=args.kind, ip_adapter=args.variant, seed=args.seed, device=device, dtype=dtype)
        references = references or default_reference_images()
        steps = args.steps or 10
        size = args.size or (64, 64)
        description = {"model": f"embedded tiny {args.kind}", "ip_adapter": f"embedded {args.variant}"}
    else:
        if args.ip_adapter is None:
            raise CLIError("--model needs --ip-adapter (a hub id or folder with IP-Adapter weights)")
        if references is None and require_images:
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
        steps = args.steps or 30
        size = args.size
        description = {"model": args.model, "ip_adapter": args.ip_adapter, "weight_name": args.weight_name}
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
        }
    )
    return Loaded(pipe, references, call_kwargs, description)


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
