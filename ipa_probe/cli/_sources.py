"""Where ``--model`` and ``--ip-adapter`` come from, checked before torch loads: a local folder (or weight file) that
exists and whose safetensors headers are whole, or a hub id that is in the Hugging Face cache or that the hub
answers for at its first attempt.

Nothing here imports torch or diffusers; ``huggingface_hub`` is imported only for a hub id.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .._io import check_input_file
from ._errors import CLIError, cli_errors

__all__ = ["WeightSource", "check_model_source", "check_safetensors", "ip_adapter_source"]

#: IP-Adapter weight files diffusers' ``load_ip_adapter`` reads (safetensors, or a pickled torch state dict)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _is_local(value: str) -> bool:
    """A value that names a path: it exists, or it is written as one (``./x``, ``/x``, ``~/x``)."""
    return value.startswith((".", "/", "~")) or Path(value).expanduser().exists()


def check_safetensors(path: str | os.PathLike, flag: str, prefixes: tuple[str, ...] = ()) -> list[str]:
    """Read a safetensors file's header and check the file holds every tensor it lists; returns the tensor names.

    A file cut short by an interrupted download, random bytes or an HTML error page saved under the name are caught
    here, without torch (the format: an 8-byte little-endian header length, a JSON header, the tensor bytes).

    ``flag`` named the file on the command line; ``prefixes``: when given, at least one tensor name must start with
    each (IP-Adapter weights: ``image_proj.`` and ``ip_adapter.``).

    Raises:
        CLIError: the file is not a regular file (a FIFO, a device) or not a whole safetensors file, or lacks the
            expected tensors.
        PermissionError: it cannot be read (the path, and the remedy in ``remedy``).
    """
    with cli_errors(FileNotFoundError, ValueError):  # stat only: a FIFO is never opened; no permission passes on
        path = check_input_file(path, f"{flag} weight file", "a safetensors file")
    size = path.stat().st_size

    def bad(reason: str) -> CLIError:
        return CLIError(f"{flag}: {str(path)!r} is not a whole safetensors file ({reason}); download it again")

    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100_000_000:
            raise bad("its header is cut off or is not a safetensors header")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    names, end = [], 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise bad(f"tensor {name!r} has no data offsets") from None
        names.append(name)
    if 8 + length + end > size:
        raise bad(f"{size} bytes, but its tensors need {8 + length + end}: the file is truncated")
    missing = [p for p in prefixes if not any(n.startswith(p) for n in names)]
    if missing:
        raise CLIError(
            f"{flag}: {str(path)!r} holds no {' / '.join(p + '*' for p in missing)} tensors, so it is not IP-Adapter "
            "weights; pass an IP-Adapter file (e.g. h94/IP-Adapter's models/ip-adapter_sd15.safetensors)"
        )
    return names


@dataclass(frozen=True)
class WeightSource:
    """What ``load_ip_adapter`` gets: a folder or hub id, the subfolder and the weight file name inside it."""

    location: str
    subfolder: str
    weight_name: str

    @property
    def local_file(self) -> Path | None:
        path = Path(self.location) / self.subfolder / self.weight_name
        return path if path.is_file() else None


def _refuse_special(path: Path, flag: str) -> None:
    """A FIFO, device or socket given as a model or weights: refused by ``stat``, never opened."""
    if not path.is_dir() and not path.is_file():
        with cli_errors():
            check_input_file(path, flag, "a folder or a weight file")


def check_model_source(value: str) -> str:
    """``--model``: an existing pipeline folder (with ``model_index.json`` and whole safetensors files) or a hub id
    that can be loaded; returns what ``from_pretrained`` gets (a local path expanded, a hub id as given).

    Raises:
        CLIError: a missing folder, a file, a folder that is no diffusers pipeline, a damaged weight file, or a hub id
            that is not cached and cannot be fetched now.
    """
    if not _is_local(value):
        check_hub_file(value, "model_index.json", "--model")
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise CLIError(f"--model {value!r} does not exist; pass an existing folder or a hub id")
    _refuse_special(path, "--model")
    if path.is_file():
        raise CLIError(
            f"--model {value!r} is a file; pass a pipeline folder (saved with save_pretrained, with model_index.json) "
            "or a hub id"
        )
    if not (path / "model_index.json").is_file():
        raise CLIError(
            f"--model {value!r} has no model_index.json, so it is not a diffusers pipeline folder; pass the folder "
            "save_pretrained wrote, or a hub id"
        )
    for weights in sorted(path.glob("*/*.safetensors")):
        check_safetensors(weights, "--model")
    return str(path)


def ip_adapter_source(location: str, subfolder: str, weight_name: str | None) -> WeightSource:
    """``--ip-adapter``, ``--subfolder`` and ``--weight-name`` checked and completed before torch loads.

    ``--ip-adapter`` may name the weight file itself (its folder and name are used); in a local folder holding one
    weight file, ``--weight-name`` may be left out. A local safetensors file is checked whole and to hold IP-Adapter
    tensors; a hub file must be in the cache or reachable.

    Raises:
        CLIError: what is missing or wrong, and what to pass instead.
    """
    if not _is_local(location):
        if weight_name is None:
            raise CLIError(
                f"--ip-adapter {location!r} is a hub id: pass --weight-name too (e.g. --subfolder models "
                "--weight-name ip-adapter_sd15.safetensors for h94/IP-Adapter)"
            )
        check_hub_file(location, f"{subfolder}/{weight_name}" if subfolder else weight_name, "--ip-adapter")
        return WeightSource(location, subfolder, weight_name)
    path = Path(location).expanduser()
    if not path.exists():
        raise CLIError(f"--ip-adapter {location!r} does not exist; pass an existing folder or file, or a hub id")
    _refuse_special(path, "--ip-adapter")
    if path.is_file():
        if subfolder or (weight_name is not None and weight_name != path.name):
            raise CLIError(
                f"--ip-adapter {location!r} is a file: drop --subfolder/--weight-name, or pass its folder with them"
            )
        source = WeightSource(str(path.parent), "", path.name)
    else:
        folder = path / subfolder
        if not folder.is_dir():
            raise CLIError(f"--subfolder {subfolder!r}: {str(folder)!r} is not a folder; check --subfolder")
        if weight_name is None:
            found = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
            if len(found) != 1:
                listed = f"it holds {', '.join(found[:5])}" if found else "it holds no .safetensors or .bin file"
                raise CLIError(f"--ip-adapter {location!r}: pass --weight-name ({listed} in {str(folder)!r})")
            weight_name = found[0]
        source = WeightSource(str(path), subfolder, weight_name)
        if source.local_file is None:
            raise CLIError(f"--weight-name {weight_name!r}: {str(folder / weight_name)!r} does not exist")
    if source.weight_name.endswith(".safetensors"):
        check_safetensors(source.local_file, "--ip-adapter", prefixes=("image_proj.", "ip_adapter."))
    return source


def check_hub_file(repo_id: str, filename: str, flag: str) -> None:
    """A hub file is usable: in the local cache, or (not offline) the hub answers for it at its first attempt.

    One request, with huggingface_hub's own timeout (``HF_HUB_ETAG_TIMEOUT``) and without its retries: diffusers
    would otherwise retry a hub it cannot reach for about a minute before failing. With ``HF_HUB_OFFLINE=1`` no
    request is made.

    Raises:
        CLIError: the id is not a valid hub id, or the file is neither cached nor reachable (the remedy named).
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CLIError(
            f"{flag} {repo_id!r} is neither an existing folder nor a hub id (name or org/name); check the path"
        ) from None
    if isinstance(try_to_load_from_cache(repo_id, filename), str):
        return  # cached: diffusers takes it from the cache
    remedy = (
        f"download it where there is a connection (`hf download {repo_id}`, or `huggingface-cli download {repo_id}` "
        "with an older huggingface_hub) or pass a local folder"
    )
    if constants.is_offline_mode():
        raise CLIError(
            f"{flag} {repo_id!r}: {filename} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {remedy}, "
            "or unset HF_HUB_OFFLINE to download it"
        )
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RepositoryNotFoundError:
        raise CLIError(
            f"{flag} {repo_id!r} is not a hub repository you can read (a typo, or private or gated: log in with "
            "`hf auth login`); or pass a local folder"
        ) from None
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status == 404:
            raise CLIError(
                f"{flag} {repo_id!r} has no file {filename!r}; check the id, --subfolder and --weight-name"
            ) from None
        raise CLIError(f"{flag} {repo_id!r}: the hub answered {status} for {filename}; try again later") from None
    except Exception as err:  # noqa: BLE001 - httpx/requests/socket errors: the hub cannot be reached
        reason = f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
        raise CLIError(
            f"{flag} {repo_id!r}: {filename} is not in the Hugging Face cache and the hub cannot be reached "
            f"({reason}); {remedy}, or set HF_HUB_OFFLINE=1 to use only the cache"
        ) from None
