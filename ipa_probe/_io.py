"""Small I/O helpers every writer of results shares: one JSON conversion, one version record, one atomic write, and
one lock per output folder.

Nothing here imports torch or pandas at module level, so the command line can import it before parsing arguments.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import logging
import math
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "LOCK_NAME",
    "OutputLocked",
    "PROVENANCE_KEY",
    "NotOurs",
    "Unreadable",
    "atomic_path",
    "check_launch_holds",
    "check_input_file",
    "refuse_not_ours",
    "code_digest",
    "data_digest",
    "jsonable",
    "os_error_of",
    "holds_lock",
    "lock_holder",
    "output_lock",
    "parse_json",
    "read_bounded",
    "read_provenance",
    "versions",
    "write_atomic",
    "write_figure",
    "write_image",
    "write_json",
    "write_table",
]

#: Packages whose versions shape the numbers (those not installed are left out of :func:`versions`).
VERSIONED_PACKAGES = ("torch", "diffusers", "transformers", "numpy", "pandas", "scipy", "scikit-learn", "pyarrow")

#: The lock file of an output folder (hidden: Parquet dataset readers skip it).
LOCK_NAME = ".ipa_probe.lock"


def swap_folder(folder: str | os.PathLike) -> Path:
    """The sibling ``.OUT.ipa_probe-swap`` where a commit builds the new ``OUT`` (:mod:`ipa_probe.run_commit`)."""
    folder = Path(os.path.abspath(Path(folder).expanduser()))
    return folder.parent / f".{folder.name}.ipa_probe-swap"


#: The PNG text chunk holding a figure's provenance (:func:`write_figure`, :func:`write_image`,
#: :func:`read_provenance`): JSON with the digest of the code that drew it and of its inputs.
PROVENANCE_KEY = "ipa_probe:provenance"


def jsonable(value: Any) -> Any:
    """``value`` with every part JSON can hold as it is, the rest converted.

    Dict keys become strings, tuples lists, numpy scalars and arrays (anything with ``tolist``) Python values,
    paths strings, non-finite floats ``None`` (JSON has no NaN); any other object becomes its ``str``.
    """
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return jsonable(value.tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def versions() -> dict[str, Any]:
    """Versions of Python, this package and the numerical libraries, the platform, and the git commit if any.

    Package versions come from the installed distributions' metadata, so nothing heavy is imported.
    """
    import platform
    import subprocess
    from importlib import metadata  # imported here: it takes a noticeable part of the command line's start-up

    from . import __version__

    info: dict[str, Any] = {"python": platform.python_version(), "ipa_probe": __version__}
    for name in VERSIONED_PACKAGES:
        with suppress(metadata.PackageNotFoundError):
            info[name] = metadata.version(name)
    info["platform"] = platform.platform()
    with suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
    return info


#: ``os.open`` flags that never follow a symbolic link in the last component (0 where the system has none)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

#: what :func:`_kind` calls each kind of file that is not a regular file or a folder
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def _kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a regular file"`` for one)."""
    return next((name for test, name in _KINDS if test(mode)), "a regular file")


class NotOurs(OSError):
    """Something that is not a regular file of ours (a symbolic link, a FIFO, a device, a socket) stands where an
    output file of ours belongs; it is never opened for writing. An ``OSError`` (``EEXIST``) with the path, so the
    command line reports it as a fault of the environment (exit 1) with the remedy."""

    remedy = "it is not a file ipa_probe wrote, so it is left alone: move it away or write to another --out"

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        super().__init__(errno.EEXIST, f"{what} stands where an output file belongs", os.fspath(path))


def refuse_not_ours(path: Path) -> None:
    """Raise :class:`NotOurs` when ``path`` exists and is a symbolic link, a FIFO, a device or a socket (``lstat``:
    a link is not followed). A folder passes: writing onto it fails with the system's own ``EISDIR``."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # a folder gets the system's own EISDIR from the rename
        raise NotOurs(path, _kind(mode))


#: The name of :func:`atomic_path`'s temp files: a killed writer's, in a folder of its own, are its own.
TEMP_NAME = re.compile(r"\..+\.\d+-[0-9a-f]{8}\.tmp")


def _create_new(path: Path) -> None:
    """Create ``path`` as a new empty regular file: never through a symbolic link, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden temp path beside ``path``; on success flush it to disk and rename it onto ``path``.

    Readers see the old file or the whole new one, never a part. The temp name carries the process id and a random
    token, and the temp file is created here, new (``O_EXCL``, never through a symbolic link), before the writer
    opens it, so two writers never share a temp file and a link planted under that name is never followed; on any
    error or interrupt the temp file is removed. Where ``path`` itself is a symbolic link, a FIFO, a device or a
    socket, nothing is written: :class:`NotOurs` is raised (the rename would replace what the user put there).
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")  # matches TEMP_NAME
    created = False
    try:
        refuse_not_ours(path)
        _create_new(temp)
        created = True
        yield temp
        with open(temp, "rb+") as handle:  # flushed to disk before the rename makes it visible
            os.fsync(handle.fileno())
        refuse_not_ours(path)  # planted while the file was written
        os.replace(temp, path)
    except NotOurs:
        raise
    except Exception as err:
        fault = os_error_of(err)
        if fault is None:
            raise
        raise OSError(fault.errno, fault.strerror, str(path)) from err  # names the file, not its temp copy
    finally:
        if created:
            _remove_quietly(temp)


def _remove_quietly(temp: Path) -> None:
    """Remove a temp file; a failure (a read-only folder) is logged, never raised over the error being handled."""
    try:
        temp.unlink(missing_ok=True)
    except OSError as err:  # a read-only file system refuses even to unlink a file that is not there
        if os.path.lexists(temp):
            logger.warning("could not remove the temp file %s (%s)", temp, err.strerror or err)


#: how Rust writers (safetensors) name an OS error in their messages
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(err: BaseException) -> OSError | None:
    """The operating-system fault behind ``err`` as an ``OSError`` with its errno, or ``None`` when it is not one.

    Writers report the same fault differently: Python and PIL raise ``OSError`` with an errno, pyarrow an ``OSError``
    with an errno but no file name, safetensors its own error with ``(os error 28)`` in the message.
    """
    if isinstance(err, NotOurs):
        return err
    if isinstance(err, OSError) and err.errno is not None:
        return OSError(err.errno, os.strerror(err.errno), err.filename)
    match = _RUST_OS_ERROR.search(str(err))
    if match:
        number = int(match.group(1))
        return OSError(number, os.strerror(number))
    return None


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write text or bytes to ``path`` through :func:`atomic_path`. Returns ``path``."""
    path = Path(path)
    with atomic_path(path) as temp:
        if isinstance(data, bytes):
            temp.write_bytes(data)
        else:
            temp.write_text(data, encoding="utf-8")
    return path


def write_json(path: str | os.PathLike, record: Any) -> Path:
    """``record`` (through :func:`jsonable`) as indented JSON, written atomically. Returns ``path``."""
    return write_atomic(path, json.dumps(jsonable(record), indent=2) + "\n")


def write_table(table: Any, path: str | os.PathLike) -> Path:
    """A pandas frame as ``.parquet`` or ``.csv`` (by the suffix, without the index), written atomically."""
    path = Path(path)
    writers = {".parquet": table.to_parquet, ".csv": table.to_csv}
    if path.suffix not in writers:
        raise ValueError(f"write_table writes .parquet or .csv, got {path.name}")
    with atomic_path(path) as temp:
        writers[path.suffix](temp, index=False)
    return path


def code_digest(*functions: Any) -> str:
    """A short SHA-256 of the source text of ``functions`` (in order): changes when any of them is edited."""
    digest = hashlib.sha256()
    for function in functions:
        digest.update(f"{function.__module__}.{function.__qualname__}\n".encode())
        digest.update(inspect.getsource(function).encode())
    return digest.hexdigest()[:16]


def data_digest(value: Any) -> str:
    """A short SHA-256 of ``value`` as canonical JSON (through :func:`jsonable`, keys sorted)."""
    text = json.dumps(jsonable(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _png_text(provenance: dict | None) -> dict[str, str]:
    return {} if provenance is None else {PROVENANCE_KEY: json.dumps(jsonable(provenance), sort_keys=True)}


def write_figure(fig: Any, path: str | os.PathLike, dpi: int | None = None, provenance: dict | None = None) -> Path:
    """A matplotlib figure in the format its suffix names, written atomically at ``dpi`` (default a printer's,
    :data:`ipa_probe.figstyle.SAVE_DPI`); the figure is closed.

    ``provenance`` (a JSON-able dict, e.g. ``{"code": code_digest(plot), "inputs": data_digest(data)}``) goes into a
    PNG text chunk (:data:`PROVENANCE_KEY`), read back by :func:`read_provenance`, with the figure's layout facts
    (its size in inches and what :func:`ipa_probe.figstyle.drawn_problems` finds) under ``"layout"``.
    """
    import matplotlib.pyplot as plt

    from .figstyle import SAVE_DPI

    path = Path(path)
    fmt = path.suffix.lstrip(".")
    if fmt == "png":  # what a reviewer measures (size, overlaps, small text, legends), read back by figstyle
        from .figstyle import drawn_problems

        width, height = (round(float(v), 3) for v in fig.get_size_inches())
        facts = {"width_in": width, "height_in": height, "problems": drawn_problems(fig)}
        provenance = {**(provenance or {}), "layout": facts}
    metadata = _png_text(provenance) if fmt == "png" else {}
    try:
        with atomic_path(path) as temp:
            fig.savefig(temp, dpi=dpi or SAVE_DPI, format=fmt, metadata=metadata or None)
    finally:
        plt.close(fig)
    return path


def write_image(image: Any, path: str | os.PathLike, provenance: dict | None = None, **options: Any) -> Path:
    """A PIL image in the format its suffix names (``options`` go to ``Image.save``), written atomically; a PNG
    carries ``provenance`` as :func:`write_figure` does."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").upper().replace("JPG", "JPEG")
    if provenance is not None and fmt == "PNG":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for key, text in _png_text(provenance).items():
            info.add_text(key, text)
        options["pnginfo"] = info
    with atomic_path(path) as temp:
        image.save(temp, format=fmt, **options)
    return path


def read_provenance(path: str | os.PathLike) -> dict | None:
    """The provenance :func:`write_figure` / :func:`write_image` stored in a PNG, or ``None`` when it has none."""
    from PIL import Image

    with Image.open(path) as image:
        text = getattr(image, "text", {}).get(PROVENANCE_KEY)
    return json.loads(text) if text else None


class OutputLocked(RuntimeError):
    """Another live run holds the output folder."""


@dataclass
class _Holder:
    pid: int
    host: str
    launch: str
    started: float
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"process {self.pid} on {self.host}, started {when} ({self.command})"


def launch_id() -> str:
    """Identifies the processes of one launch: ``accelerate launch`` / torchrun give them one rendezvous address."""
    if os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_PORT"):
        return f"{socket.gethostname()}:{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f"{socket.gethostname()}:pid{os.getpid()}"


#: The most of a lock file read to name its holder (a record is about 200 bytes; a planted huge file is not read).
_HOLDER_BYTES = 1 << 16


def _read_holder(path: Path) -> _Holder | None:
    """The holder a lock file names; ``None`` when it names none (empty, not a regular file, not a record)."""
    try:
        data = parse_json(read_bounded(path, limit=_HOLDER_BYTES) or b"null")
        fields = (int(data["pid"]), str(data["host"]), str(data["launch"]), float(data["started"]))
        return _Holder(*fields, str(data["command"])[:300])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _busy_holder(path: Path, wait: float = 1.0) -> str:
    """Who holds the taken lock ``path``, read again for ``wait`` s (a new holder writes its record just after)."""
    deadline = time.monotonic() + wait
    while (holder := _read_holder(path)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return holder.describe() if holder else "another process"


@contextmanager
def output_lock(
    folder: str | os.PathLike, command: str, tidy: bool = False, reentrant: bool = False
) -> Iterator[Path]:
    """Hold the lock of an output folder for the duration of the block: one writer per folder.

    The lock is ``folder/.ipa_probe.lock``, opened without following a symbolic link and refused unless it is a
    regular file (a link, FIFO, device or socket planted there raises :class:`NotOurs`; nothing is truncated or
    opened), held with ``fcntl.flock`` (the kernel releases it when the holder dies, so the lock of a killed run is
    stale at once and taken over) and holding the holder's pid, host, launch and
    command, to name it when another run is refused. The folder is created.

    Args:
        folder: the output folder.
        command: what holds it (e.g. ``"ipa-probe sweep"``), for the refusal message.
        reentrant: when this process holds the lock already (the command line takes it before torch loads), enter
            without taking it again; otherwise a second hold in one process is refused like any other.
        tidy: when the block ends, a folder this call made that holds nothing but the lock is removed again, and in a
            folder that was there, a lock file this call made is removed when it is all the folder holds (a run that
            failed before writing leaves no trace), while the lock is still held.

    Raises:
        OutputLocked: a live run holds the folder; the message names it.
    """
    import fcntl

    folder = Path(folder).expanduser()
    made = not os.path.lexists(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    made_lock = not os.path.lexists(path)
    if reentrant and _held_key(folder) in _HELD:  # this process holds it already (the command line's)
        held = _held_key(folder)
        _HELD[held] += 1
        try:
            yield path
        finally:  # a block an interrupt left unclosed is closed by the collector, maybe after the outer hold ended
            if held in _HELD:
                _HELD[held] -= 1
        return
    fd = _open_lock(path)
    try:
        info = os.fstat(fd)
        held = (info.st_dev, info.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _busy_holder(path)
            raise OutputLocked(
                f"{folder} is in use by {who}; wait for it to finish, or use another output folder"
            ) from None
        previous = _read_holder(path)
        if previous is not None:  # its holder died without releasing it
            logger.warning("%s: taking over the lock of %s, which is no longer running", folder, previous.describe())
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "launch": launch_id(),
            "started": time.time(),
            "command": command,
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError as err:  # a full disk: name the lock file (os.pwrite knows only the descriptor)
            raise OSError(err.errno, os.strerror(err.errno), str(path)) from err
        _HELD[held] = 1
        try:
            yield path
        finally:
            _HELD.pop(held, None)
            os.ftruncate(fd, 0)  # released cleanly: an empty lock file is free
            if tidy and made_lock:
                _remove_if_only_lock(folder, path, remove_folder=made)
    finally:
        os.close(fd)  # closing releases the flock


#: The output folders this process holds the lock of (the lock file's (device, inode) -> how many blocks hold it: the
#: lock file, unlike the folder, is the same inode on both sides of a commit's swap). A second ``flock``
#: on a new descriptor of the same file is refused even within one process, so a block nested in another that holds
#: the folder (the command line holds it from before torch loads; the run folder and the sweep take it again) re-enters
#: instead: per-process state by nature, like the kernel's own lock table.
_HELD: dict[tuple[int, int], int] = {}


def _held_key(folder: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(Path(folder) / LOCK_NAME)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def holds_lock(folder: str | os.PathLike) -> bool:
    """Whether this process holds the lock of ``folder`` (through :func:`output_lock`)."""
    try:
        return _held_key(Path(folder)) in _HELD
    except OSError:
        return False


def lock_holder(folder: str | os.PathLike) -> str | None:
    """Who holds the lock of ``folder``, in words, when a live process other than this one holds it; else ``None``.
    Takes nothing: the lock is tried and released at once."""
    import fcntl

    if holds_lock(folder):
        return None
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:  # no lock file (or not one to open): no one holds the folder through it
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _busy_holder(path)
    finally:
        os.close(fd)  # closing releases a lock taken here
    return None


def _remove_if_only_lock(folder: Path, path: Path, remove_folder: bool = True) -> None:
    """Remove the lock ``path`` (and ``folder`` itself, with ``remove_folder``) when the folder holds nothing but the
    lock (called with the lock held): a run that never wrote into it."""
    with suppress(OSError):
        if [entry.name for entry in os.scandir(folder)] == [LOCK_NAME]:
            path.unlink()
            if remove_folder:
                folder.rmdir()  # fails, harmlessly, if anything appeared meanwhile


def _open_lock(path: Path) -> int:
    """Open (or create) the lock file for reading and writing: never through a symbolic link, never a FIFO (opened
    non-blocking, so that one cannot hang the open), a device or a socket."""
    refuse_not_ours(path)  # before any open: opening a device can have effects of its own
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):  # a link (O_NOFOLLOW), a FIFO or a socket
            with suppress(FileNotFoundError):
                raise NotOurs(path, _kind(path.lstat().st_mode)) from None
        raise
    info = os.fstat(fd)
    problem = None if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)
    if info.st_nlink > 1 and not _swap_twin(path, info):
        problem = "a hard link to another file"
    elif info.st_uid != os.geteuid():
        problem = "another user's file"
    if problem:
        os.close(fd)
        raise NotOurs(path, problem)
    os.set_blocking(fd, True)
    return fd


def _swap_twin(path: Path, info: os.stat_result) -> bool:
    """The lock's second name is the one a commit's swap made (:func:`swap_folder`, cleared by the next writer)."""
    try:
        twin = os.lstat(swap_folder(path.parent) / LOCK_NAME)
    except OSError:
        return False
    return info.st_nlink == 2 and (twin.st_dev, twin.st_ino) == (info.st_dev, info.st_ino)


#: The most of a file the project reads back (a manifest, a record, a sweep's rows) that is read: a sweep manifest of
#: 100,000 rows lists about 15 MB; a larger file is refused unread.
MAX_READ_BYTES = 64 << 20

#: The deepest nesting of lists and objects a JSON file read back may hold (settings are flat; 32 is generous).
MAX_DEPTH = 32


class Unreadable(ValueError):
    """A file read back is not one to read (not a regular file, too large, not UTF-8 JSON, nested too deep): the
    message is one line naming it."""


def read_bounded(path: str | os.PathLike, follow: bool = False, limit: int | None = None) -> bytes | None:
    """The bytes of ``path``, read as untrusted input; ``None`` when it does not exist.

    Opened without blocking (a FIFO cannot hang the read) and, unless ``follow``, without following a symbolic link;
    it must be a regular file (not a FIFO, a device such as ``/dev/zero``, a socket or a folder) of at most ``limit``
    bytes (default :data:`MAX_READ_BYTES`); a file that grows while it is read is cut at the limit and refused.

    Raises:
        Unreadable: one line naming the file and what it is (a ``PermissionError`` stays one: a fault of the
            environment, with its remedy).
    """
    limit = MAX_READ_BYTES if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | (0 if follow else _NOFOLLOW) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except PermissionError as err:
        raise _unreadable(Path(path), err.errno) from None
    except OSError as err:  # ELOOP: a symbolic link; ENXIO: a socket
        kind = "a symbolic link" if os.path.islink(path) else f"unreadable ({err.strerror})"
        raise Unreadable(f"{path} is {kind}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{path} is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise Unreadable(f"{path} is {info.st_size} bytes, more than the {limit} bytes read back")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise Unreadable(f"{path} cannot be read ({err.strerror})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise Unreadable(f"{path} grew past the {limit} bytes read back while it was read")
    return b"".join(chunks)


def nesting(value: Any) -> int:
    """The nesting depth of lists and dicts in ``value``, iteratively (no recursion limit to hit), counted up to
    one past :data:`MAX_DEPTH`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` with the nesting capped at :data:`MAX_DEPTH`.

    Raises:
        ValueError: ``json.JSONDecodeError`` for text that is not JSON; a plain ``ValueError`` ("nests deeper than
            32 levels") for nesting past the cap, however deep (the parser's own recursion limit included).
    """
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        if nesting(value) <= MAX_DEPTH:
            return value
    raise ValueError(f"nests deeper than {MAX_DEPTH} levels")


def check_input_file(path: str | os.PathLike, what: str, expected: str = "an existing file") -> Path:
    """``path`` if it is a regular file this process may read; checked with ``stat``, so that nothing is opened (a
    FIFO would block the open until someone writes to it).

    A leading ``~`` is expanded; ``what`` it is (e.g. ``"reference image"``) and what to pass instead (``expected``)
    go into the messages.

    Raises:
        FileNotFoundError: it does not exist (the message names it and what to pass).
        ValueError: it is a folder, a FIFO, a device or a socket.
        PermissionError: it cannot be read (errno ``EACCES``, the path, and a ``remedy`` naming ``chmod``).
    """
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist; pass {expected}") from None
    except PermissionError as err:  # a folder on the way cannot be searched
        raise _unreadable(path, err.errno) from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {str(path)!r} is {_kind(mode)}, not a regular file; pass {expected}")
    if not os.access(path, os.R_OK):
        raise _unreadable(path, errno.EACCES)
    return path


def _unreadable(path: Path, code: int | None) -> PermissionError:
    err = PermissionError(code or errno.EACCES, os.strerror(code or errno.EACCES), str(path))
    err.remedy = "no permission to read it: grant it (chmod u+r, or ask its owner) or pass another file"
    return err


def check_launch_holds(folder: str | os.PathLike) -> None:
    """Raise :class:`OutputLocked` unless the lock of ``folder`` was taken by this process's launch.

    Under ``accelerate launch`` only the main process takes the lock; the others call this after a barrier, so that
    the processes of a second launch on the same folder stop instead of writing beside the first.
    """
    path = Path(folder) / LOCK_NAME
    holder = _read_holder(path)
    if holder is None or holder.launch != launch_id():
        who = holder.describe() if holder else "no one"
        raise OutputLocked(f"{folder} is held by {who}, not by this launch; use another output folder")
