"""Run manifests: which files of an output folder each command run produced, so that runs never mix.

Every command that writes into an output folder (``ipa-probe probe``, ``compare``, ``sweep``, ``experiments``,
``train-digits``) claims it with :func:`claim_folder` and leaves ``ipa_probe_manifest.json`` there: a run id, the
command, its settings, the package versions, and every file the run produced (path relative to the folder, size,
SHA-256). The manifest is written atomically when the claim starts (``status: "running"``) and again when it ends,
whether the run finished, failed or was interrupted (``"finished"``, ``"failed"``, ``"interrupted"``).

Before a run writes, :func:`check_folder` reads the folder:

- empty, missing, or holding the files of *the same run* (the same command and resume key): fine; the new manifest
  keeps the old one's files that are still there. The resume key is what the command's own resume logic needs to be
  the same (a sweep and an experiments folder resume by their own records; ``probe`` and ``compare`` are the same run
  only with every setting equal).
- holding another run's files, or files no manifest lists: :class:`RunConflict` (one line naming ``--overwrite`` and
  a fresh ``--out``); a command that resumes by its own records (``sweep``, ``experiments``, ``train-digits``) takes
  a folder with no manifest at all (made by the Python API, or before manifests) as it always did, leaving its
  files unlisted.
- with ``overwrite=True``: the files the previous manifest lists are removed, each only if it is still the file the
  manifest describes (same SHA-256, or, for a run that never finished, changed after that run started), and nothing
  else: symlinks are never followed nor removed, files no manifest lists are left (and named in
  :attr:`FolderClaim.left`), folders are removed only when the run made them and they are empty.

A resumable command that finds a folder with no manifest records the files it found there as ``foreign``: its
own later runs accept them, nothing removes them. A run killed without a chance to write its last manifest
(SIGKILL, power loss) leaves ``status: "running"``; the same run started again adopts the files changed after that
start time into its manifest, while ``--overwrite`` leaves them (no manifest lists them) and names them.

Torch-free: the command line checks a folder before torch loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ._io import LOCK_NAME, OutputLocked, jsonable, versions, write_json

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_NAME",
    "FolderClaim",
    "FolderState",
    "RunConflict",
    "check_folder",
    "claim_folder",
    "file_digest",
    "read_run_manifest",
]

#: The manifest's file name in an output folder.
MANIFEST_NAME = "ipa_probe_manifest.json"

#: Files that belong to the folder's machinery, never to a run (the lock, the manifest itself).
_MACHINERY = frozenset({LOCK_NAME, MANIFEST_NAME})

#: How many file names a refusal or a note lists before "and N more".
_SHOWN = 3


class RunConflict(ValueError):
    """The output folder holds another run's files, or files no manifest lists; the message is one line."""


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a file's bytes, read without following a final symlink."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_run_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of ``folder``, or ``None`` when it has none.

    Raises:
        RunConflict: the manifest exists but is not one (unreadable JSON, no file list, or a symlink).
    """
    path = Path(folder) / MANIFEST_NAME
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    problem = "is a symlink" if stat.S_ISLNK(mode) else None
    if problem is None:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
                problem = "has no file list"
        except (OSError, ValueError) as err:
            problem = f"cannot be read ({err})"
    if problem:
        raise RunConflict(
            f"{path} {problem}; it does not say which files are whose: choose a fresh --out, or remove the folder"
        )
    return record


def _safe_relative(name: str) -> bool:
    """A manifest entry that names a file inside the folder: relative, no ``..``, no empty part."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not PurePosixPath(name).is_absolute() and all(p not in ("", ".", "..") for p in parts)


def _scan(folder: Path) -> tuple[dict[str, os.stat_result], set[str], list[str]]:
    """Every regular file under ``folder`` (relative POSIX path -> lstat), every sub-folder, and every symlink or
    special file; symlinks are listed, never followed."""
    files: dict[str, os.stat_result] = {}
    dirs: set[str] = set()
    odd: list[str] = []
    if not folder.is_dir():
        return files, dirs, odd
    for root, subdirs, names in os.walk(folder, followlinks=False):
        rel_root = Path(root).relative_to(folder)
        for name in list(subdirs):
            rel = (rel_root / name).as_posix()
            if os.path.islink(os.path.join(root, name)):
                odd.append(rel)
                subdirs.remove(name)  # os.walk would not follow it, but it must not be counted as a folder either
            else:
                dirs.add(rel)
        for name in names:
            rel = (rel_root / name).as_posix()
            info = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(info.st_mode):
                if rel not in _MACHINERY:
                    files[rel] = info
            else:
                odd.append(rel)
    return files, dirs, sorted(odd)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


@dataclass
class FolderState:
    """What :func:`check_folder` found.

    Attributes:
        previous: the folder's manifest (``None``: none).
        same_run: the manifest is this run's (same command and resume key): its files are kept and carried over.
        previous_files: the files the manifest lists that are still there.
        adopted: files no manifest lists, changed after an unfinished run of the same key started (that run's).
        unlisted: files (and symlinks) no manifest lists.
    """

    previous: dict[str, Any] | None
    same_run: bool
    previous_files: list[str]
    adopted: list[str]
    unlisted: list[str]


def check_folder(
    folder: str | os.PathLike,
    command: str,
    key: dict[str, Any],
    overwrite: bool = False,
    flag: str = "--out",
    resumable: bool = False,
) -> FolderState:
    """Read ``folder`` and refuse, in one line, a run that would mix with another's files.

    Args:
        folder: the output folder (need not exist).
        command: the command (``"ipa-probe probe"``).
        key: what must be equal for a run to be the same run resumed or redone (JSON-able).
        overwrite: the user passed ``--overwrite``: nothing is refused.
        flag: the option that named the folder, for the message.
        resumable: the command resumes by its own records (a sweep's rows, an experiment's or a training's
            checkpoints): in a folder with no manifest at all (written by the Python API, or before manifests
            existed), its files are left to those records to judge instead of refused; they stay unlisted.

    Returns:
        A :class:`FolderState`.

    Raises:
        RunConflict: without ``overwrite``, the folder holds another run's files or files no manifest lists.
    """
    folder = Path(folder)
    previous = read_run_manifest(folder)
    files, _, odd = _scan(folder)
    listed = set(previous["files"]) if previous else set()
    same = previous is not None and previous.get("command") == command and previous.get("key") == jsonable(key)
    unlisted = sorted(set(files) - listed) + odd
    if same:  # files this run found in the folder and left alone (see claim_folder's "foreign")
        unlisted = [name for name in unlisted if name not in set(previous.get("foreign", []))]
    adopted: list[str] = []
    if same and previous.get("status") != "finished":
        started = int(previous.get("started_ns", 0))
        adopted = [name for name in unlisted if name in files and files[name].st_mtime_ns >= started]
        unlisted = [name for name in unlisted if name not in adopted]
    state = FolderState(previous, same, sorted(listed & set(files)), adopted, unlisted)
    if overwrite:
        return state
    fresh = f"pass --overwrite to replace them, or choose a fresh {flag}"
    if previous is not None and not same and state.previous_files:
        what = previous.get("command", "another command")
        raise RunConflict(
            f"{flag} {folder} holds the {len(state.previous_files)} files of another run ({what}, run "
            f"{previous.get('run_id', '?')}, other settings); {fresh}"
        )
    if unlisted and not (resumable and previous is None):
        raise RunConflict(
            f"{flag} {folder} holds {len(unlisted)} file(s) no ipa_probe run manifest lists ({_listed(unlisted)}); "
            f"pass --overwrite to write beside them (they are kept), or choose a fresh {flag}"
        )
    return state


def _refuse_if_held(folder: Path) -> None:
    """Raise :class:`~ipa_probe._io.OutputLocked` when a live run holds ``folder``'s lock; create nothing.

    The command takes the lock itself once it writes (:func:`~ipa_probe._io.output_lock`); a lock cannot be held
    here across that (a second ``flock`` in the same process is refused), so the claim only looks before it changes
    anything, and a folder a running sweep or training holds is never touched.
    """
    import fcntl

    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # no lock file (or not one to open): no one holds the folder through it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(path)
        raise OutputLocked(
            f"{folder} is in use by {who}; wait for it to finish, or use another output folder"
        ) from None
    finally:
        os.close(fd)  # closing releases a lock taken here


def _holder(path: Path) -> str:
    """Who holds a lock file, from the record :func:`~ipa_probe._io.output_lock` writes in it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(data["started"])))
        return f"process {int(data['pid'])} on {data['host']}, started {started} ({data['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _inside(folder: Path, name: str) -> Path | None:
    """``folder / name`` when ``name`` is a plain relative path whose every parent inside ``folder`` is a real
    folder (no symlink on the way), else ``None``."""
    if not _safe_relative(name):
        return None
    path = folder
    for part in PurePosixPath(name).parts[:-1]:
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # a symlink (or a file) where the run made a folder
                return None
        except OSError:
            return None
    return path / PurePosixPath(name).name


def _removable(folder: Path, name: str, entry: dict[str, Any], previous: dict[str, Any]) -> bool:
    """``name`` is still the file the manifest describes, reached without a symlink on the way."""
    path = _inside(folder, name)
    if path is None:
        return False
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    unfinished = previous.get("status") != "finished"
    if unfinished and info.st_mtime_ns >= int(previous.get("started_ns", 0)):
        return True  # changed by that run after it started: its file, whatever the last manifest it wrote says
    return info.st_size == entry.get("size") and file_digest(path) == entry.get("sha256")


@dataclass
class FolderClaim:
    """A run's hold on its output folder (from :func:`claim_folder`).

    Attributes:
        folder: the output folder.
        run_id: this run's id (in the manifest).
        removed: files of the previous run removed (``--overwrite``).
        left: files left in place: listed by no manifest, or changed since the previous manifest described them.
        resumed: the folder held this same run's files, kept.
    """

    folder: Path
    run_id: str
    removed: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    resumed: bool = False

    def note(self) -> str | None:
        """One line on what ``--overwrite`` did, or ``None`` when it did nothing worth saying."""
        parts = []
        if self.removed:
            parts.append(f"removed the previous run's {len(self.removed)} file(s)")
        if self.left:
            parts.append(f"left {len(self.left)} file(s) no run manifest lists ({_listed(self.left)})")
        return f"{self.folder}: " + "; ".join(parts) if parts else None


@contextmanager
def claim_folder(
    folder: str | os.PathLike,
    command: str,
    settings: dict[str, Any],
    key: dict[str, Any],
    overwrite: bool = False,
    flag: str = "--out",
    resumable: bool = False,
) -> Iterator[FolderClaim]:
    """Claim ``folder`` for one run and write its manifest when the block ends, however it ends.

    Refuses a folder a live run holds (:class:`~ipa_probe._io.OutputLocked`), checks the folder
    (:func:`check_folder`; a conflict raises :class:`RunConflict` before anything changes), removes
    the previous run's files under ``overwrite`` (see the module docstring), writes a ``"running"`` manifest, runs the
    block, then writes the manifest with every file the run produced: the files created or changed during the block,
    plus, for the same run resumed, the previous manifest's files still present. The folder is created.

    Args:
        folder: the output folder.
        command: the command (``"ipa-probe probe"``).
        settings: the run's settings, recorded as they are (JSON-able).
        key: what must be equal for a later run to be this run resumed (see :func:`check_folder`).
        overwrite: replace another run's files.
        flag: the option that named the folder, for messages.
        resumable: as in :func:`check_folder`.

    Yields:
        A :class:`FolderClaim`.
    """
    folder = Path(folder)
    _refuse_if_held(folder)
    state = check_folder(folder, command, key, overwrite=overwrite, flag=flag, resumable=resumable)
    claim = FolderClaim(folder, f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    previous = state.previous
    carried: dict[str, Any] = {}
    if previous is not None and state.same_run and not overwrite:
        claim.resumed = True
        carried = {name: previous["files"][name] for name in state.previous_files}
        carried.update({name: None for name in state.adopted})
    elif previous is not None and overwrite:
        for name, entry in sorted(previous["files"].items()):
            if _removable(folder, name, entry if isinstance(entry, dict) else {}, previous):
                os.unlink(folder / name)
                claim.removed.append(name)
            elif name in state.previous_files:
                claim.left.append(name)
        for name in sorted(previous.get("folders", []), key=lambda n: -len(PurePosixPath(n).parts)):
            path = _inside(folder, name)
            try:
                if path is not None and stat.S_ISDIR(os.lstat(path).st_mode):  # a real folder, not a symlink
                    os.rmdir(path)  # only when empty: a folder holding anything not removed stays
            except OSError:
                pass
    if overwrite or (resumable and previous is None):
        claim.left = sorted(set(claim.left) | set(state.unlisted) | set(state.adopted))
    folder.mkdir(parents=True, exist_ok=True)
    before, dirs_before, _ = _scan(folder)
    started_ns = time.time_ns()
    record: dict[str, Any] = {
        "run_id": claim.run_id,
        "command": command,
        "key": jsonable(key),
        "settings": jsonable(settings),
        "versions": versions(),
        "status": "running",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_ns": started_ns,
        "resumed_from": previous.get("run_id") if claim.resumed else None,
        "files": {},
        "folders": sorted(previous.get("folders", [])) if claim.resumed else [],
        # files that were in the folder before this run and are not its own: never removed by --overwrite
        "foreign": sorted(
            (set(previous.get("foreign", [])) if claim.resumed else set())
            | (set(state.unlisted) if resumable and previous is None else set())
        ),
    }
    write_json(folder / MANIFEST_NAME, record)
    status = "failed"
    try:
        yield claim
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        after, dirs_after, _ = _scan(folder)
        produced = {
            name
            for name, info in after.items()
            if name not in before
            or (info.st_mtime_ns, info.st_size, info.st_ino)
            != (before[name].st_mtime_ns, before[name].st_size, before[name].st_ino)
        }
        entries = {}
        for name in sorted(produced | (set(carried) & set(after))):
            try:
                entries[name] = {"size": after[name].st_size, "sha256": file_digest(folder / name)}
            except OSError:  # gone (or replaced by a symlink) since the scan: not a file this run leaves
                continue
        record.update(
            foreign=sorted(set(record["foreign"]) & set(after) - set(entries)),
            status=status,
            ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            files=entries,
            folders=sorted(set(record["folders"]) | (dirs_after - dirs_before)),
        )
        try:
            write_json(folder / MANIFEST_NAME, record)
        except OSError as err:  # a full disk: the run's own error (if any) is the one to report
            logger.warning("could not write the run manifest of %s (%s)", folder, err)
