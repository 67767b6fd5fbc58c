"""How a run folder's commit changes the file system (the policy is :mod:`ipa_probe.runfolder`'s). Torch-free.

**The swap** (Linux, where the file system has hard links and ``renameat2(RENAME_EXCHANGE)``): the new ``OUT`` is
built whole in the sibling folder ``.OUT.ipa_probe-swap`` (:func:`~ipa_probe._io.swap_folder`): a hard link of every
entry of ``OUT`` that stays (the lock, files no manifest lists, the trackers' stores), a hard link of every staged
file, the new manifest; no byte is copied. One ``renameat2(..., RENAME_EXCHANGE)`` then swaps the two folders: a
reader of ``OUT`` sees the old folder or the new one, never a mix. The old folder, now the sibling, is cleared
(:func:`clear`): names with a twin in ``OUT`` (the same inode) and the previous run's files (bytes as its manifest
lists) are unlinked; anything else, a file made during the commit, is moved back into ``OUT`` without replacing
anything, or kept, visibly, beside ``OUT``.

**The journal** (elsewhere: not Linux, no hard links, no exchange, ``OUT`` a mount point or its parent not writable):
the staged files are renamed into place one by one, the manifest last; a run stopped between two renames leaves the
journal, carried out by the next writer (:func:`roll_forward`). A reader in that window sees a mixed folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any

from ._io import TEMP_NAME, swap_folder, write_json
from .run_manifest import MANIFEST_NAME, RunConflict, file_digest, read_run_manifest, safe_name

__all__ = ["FINAL_NAME", "STAGING_NAME", "Unsupported", "clear", "roll_forward", "swap_in", "still_listed", "twins"]

#: The staging folder inside an output folder, where a run writes until it is whole.
STAGING_NAME = ".ipa_probe-staging"

#: The finished manifest a commit journal carries, renamed into place as the journal's last step.
FINAL_NAME = ".ipa_probe_manifest.final.json"

_EXCHANGE, _NOREPLACE = 2, 1  # renameat2 flags (linux/fs.h)
_AT_FDCWD = -100


class Unsupported(OSError):
    """The swap cannot be used here (no ``renameat2``, no exchange or no hard links on this file system): the
    journal is used instead."""


def rename2(source: Path, target: Path, flags: int) -> None:
    """``renameat2(source, target, flags)``; ``OSError(ENOSYS)`` where the C library has no ``renameat2``."""
    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if call is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), str(source))
    if call(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(source), None, str(target))


def twins(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are names of one inode (links are not followed)."""
    try:
        x, y = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def inside(folder: Path, name: str) -> Path | None:
    """``folder / name`` when ``name`` is a plain relative path whose every parent inside ``folder`` is a real
    folder or absent (no symlink, no file on the way), else ``None``."""
    if not safe_name(name):
        return None
    path = folder
    for part in PurePosixPath(name).parts[:-1]:
        path = path / part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return None
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return folder / name


def still_listed(folder: Path, name: str, sha: str) -> bool:
    """``folder/name`` is a regular file, reached without a symlink, whose bytes have SHA-256 ``sha``."""
    path = inside(folder, name)
    try:
        return path is not None and stat.S_ISREG(os.lstat(path).st_mode) and file_digest(path) == sha
    except OSError:
        return False


def own_folder(path: Path) -> bool:
    """``path`` is a real folder (not a link) this user owns; ``False`` when absent; :class:`RunConflict` else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise RunConflict(
            f"{path} is not a folder ipa_probe made (a file, a symbolic link, or another user's); move it away"
        )
    return True


def _link(source: Path, target: Path) -> None:
    """Hard-link ``source`` at ``target`` (never following a link), making the folders on the way; a file system
    without hard links raises :class:`Unsupported`."""
    os.makedirs(target.parent, exist_ok=True)
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as err:
        if err.errno in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.ENOSYS):
            raise Unsupported(err.errno, err.strerror, str(source)) from err
        raise


def swap_in(folder: Path, record: dict[str, Any], previous: dict[str, Any] | None, verify: bool) -> list[str]:
    """Commit the run staged in ``folder``/:data:`STAGING_NAME` by the swap (module docstring).

    ``record``: the journal, whose ``files`` (name -> size, sha256) are the staged files; its finished form is
    written. ``previous``: the manifest of the run replaced. ``verify``: check each staged file's sha256 against
    ``record`` (a replay: the folder may have changed since). Returns what :func:`clear` kept (files made during the
    commit that could not go back).

    Raises:
        Unsupported: no swap here; nothing changed (the sibling is removed again).
        RunConflict: a target is not what the manifest it replaces lists, a staged file changed, a folder of
            ``OUT`` is on another file system; nothing changed.
    """
    if sys.platform != "linux" or os.path.islink(folder) or not os.access(folder.parent, os.W_OK | os.X_OK):
        raise Unsupported(errno.ENOSYS, "no swap here", str(folder))
    if os.lstat(folder).st_dev != os.lstat(folder.parent).st_dev:
        raise Unsupported(errno.EXDEV, "a mount point", str(folder))
    staging, swap = folder / STAGING_NAME, swap_folder(folder)
    listed = previous["files"] if previous else {}
    os.mkdir(swap)
    try:
        os.chmod(swap, stat.S_IMODE(os.lstat(folder).st_mode))
        for root, dirs, names in os.walk(folder):
            rel = Path(root).relative_to(folder)
            for name in list(dirs):
                entry = Path(root, name)
                if rel == Path(".") and name.startswith(STAGING_NAME):
                    dirs.remove(name)
                elif os.path.islink(entry):  # a link to a folder: an entry like any other, never descended
                    dirs.remove(name)
                    names.append(name)
                elif os.lstat(entry).st_dev != os.lstat(folder).st_dev:
                    raise RunConflict(f"{entry} is another file system (a mount point) inside {folder}; unmount it")
                elif not os.listdir(entry) and (rel / name).as_posix() not in (previous or {}).get("folders", []):
                    os.makedirs(swap / rel / name)  # an empty folder of the user's (others are made as filled)
            for name in names:
                key = (rel / name).as_posix()
                if key in (MANIFEST_NAME, FINAL_NAME):
                    continue
                if key in listed:  # the commit checked them just now; a replay checks them here
                    if verify and not still_listed(folder, key, listed[key]["sha256"]):
                        raise RunConflict(
                            f"{folder}: {key} changed after run {previous['run_id']} wrote it; a run never replaces a "
                            "file that is not byte for byte its own: move it away and run again"
                        )
                    continue  # the previous run's own: replaced or removed by the swap
                if key in record["files"]:
                    raise RunConflict(
                        f"{folder}: the run writes {key} where a file no manifest lists stands; move it away"
                    )
                _link(Path(root, name), swap / key)
        for name, entry in record["files"].items():
            if verify and not still_listed(staging, name, entry["sha256"]):
                raise RunConflict(f"{staging}: {name} is not the file the commit journal lists; nothing committed")
            if inside(swap, name) is None:
                raise RunConflict(f"{folder}: a file or a symbolic link stands on the way to {name}")
            _link(staging / name, swap / name)
        write_json(swap / MANIFEST_NAME, record_final(record))
        rename2(swap, folder, _EXCHANGE)
    except BaseException as err:
        if os.path.lexists(swap) and not _exchanged(folder):
            clear(folder)
        if isinstance(err, OSError) and err.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
            raise Unsupported(err.errno, err.strerror, str(folder)) from err
        raise
    return clear(folder)


def _exchanged(folder: Path) -> bool:
    """The sibling holds the old folder (its staging folder went with it): the swap took place."""
    return os.path.isdir(swap_folder(folder) / STAGING_NAME)


def record_final(record: dict[str, Any]) -> dict[str, Any]:
    """The manifest a commit leaves in the folder."""
    final = {k: v for k, v in record.items() if k not in ("remove", "replace", "old_folders")}
    final.update(status="finished", ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return final


def clear(folder: Path, swap: Path | None = None) -> list[str]:
    """Empty and remove ``swap`` (default: the sibling :func:`~ipa_probe._io.swap_folder` of ``folder``, whichever
    side of the swap a stop left it on; or the temp folder a staging folder is made in), removing only what is
    provably a commit's own:

    - a name with a twin (the same inode) at the same place in ``folder`` or in its staging folder, or (after the
      swap) a staged file's twin in ``folder``: a link the swap made;
    - a file the sibling's manifest lists, its bytes as listed (after the swap: the previous run's own);
    - the staging folder that went with the old folder (its manifest says it is a run's), the manifests, and the
      temp files of :func:`~ipa_probe._io.atomic_path` (made new, ``O_EXCL``, in this folder of ipa_probe's).

    Anything else (a file made in ``OUT`` during the commit) is moved back into ``folder`` without replacing
    anything, or, where its name is taken, kept: the sibling is then renamed ``OUT.ipa_probe-kept-N`` beside ``OUT``.

    Returns:
        The paths kept.
    """
    swap = swap_folder(folder) if swap is None else swap
    if not own_folder(swap):
        return []
    theirs = read_run_manifest(swap) or {"files": {}}
    staged = swap / STAGING_NAME
    ours = own_folder(staged) and read_run_manifest(staged) is not None
    kept = []
    for root, dirs, names in os.walk(swap, topdown=False):
        rel = Path(root).relative_to(swap)
        for name in names + [d for d in dirs if os.path.islink(Path(root, d))]:
            key, path = (rel / name).as_posix(), Path(root, name)
            mine = key.removeprefix(STAGING_NAME + "/")
            if key in (MANIFEST_NAME, f"{STAGING_NAME}/{MANIFEST_NAME}"):
                continue  # removed last: until then they say whose the rest is
            if (
                twins(path, folder / key)
                or twins(path, folder / mine)
                or twins(path, folder / STAGING_NAME / key)
                or (ours and mine != key)
                or TEMP_NAME.fullmatch(name)  # a temp file a killed write left (O_EXCL: made by ipa_probe)
                or (key in theirs["files"] and still_listed(swap, key, theirs["files"][key]["sha256"]))
            ):
                os.unlink(path)
            elif not _move_back(path, folder / key):
                kept.append(key)
        for name in dirs:
            with contextlib.suppress(OSError):  # a link (unlinked above), the staging folder, a folder of kept files
                os.rmdir(Path(root, name))
    if kept:
        aside = folder.parent / f"{folder.name}.ipa_probe-kept-{os.getpid()}-{time.time_ns()}"
        os.rename(swap, aside)
        return [str(aside / k) for k in kept]
    for name in (f"{STAGING_NAME}/{MANIFEST_NAME}", MANIFEST_NAME):
        if os.path.lexists(swap / name):
            os.unlink(swap / name)
    for path in (staged, swap):
        if os.path.lexists(path):
            os.rmdir(path)
    return []


def _move_back(path: Path, target: Path) -> bool:
    """Move ``path`` to ``target`` without replacing anything; ``False`` where the name is taken or cannot be made."""
    try:
        os.makedirs(target.parent, exist_ok=True)
        rename2(path, target, _NOREPLACE)
        return True
    except OSError:
        return False


def roll_forward(folder: Path, record: dict[str, Any]) -> None:
    """Carry out a commit journal (a staging manifest marked ``"committing"``) by renames: every staged file still
    in staging goes into place where its target is absent or still the previous run's own (``record["replace"]``,
    else refused by name), the previous run's files the journal names are removed (only when their bytes are still
    the listed ones), its folders left empty are removed, the manifest is written, the staging folder removed."""
    staging = folder / STAGING_NAME
    for name in sorted(record["files"]):
        source, target = staging / name, inside(folder, name)
        if target is None:
            raise RunConflict(f"{folder}: a symbolic link or a file stands on the way to {name}; nothing more renamed")
        if not os.path.lexists(source) or twins(source, target):
            continue
        old = record.get("replace", {}).get(name)
        if os.path.lexists(target) and not (old and still_listed(folder, name, old)):
            raise RunConflict(
                f"{folder}: {name} is not the file the commit journal replaces (changed, or not the previous run's); "
                "move it away, then run again to finish the commit"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
    for name, sha in sorted(record.get("remove", {}).items()):
        if still_listed(folder, name, sha):
            os.unlink(folder / name)
    keep = set(record.get("folders", []))
    for name in sorted(record.get("old_folders", []), key=lambda n: -len(PurePosixPath(n).parts)):
        path = inside(folder, name)
        if name not in keep and path is not None and os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only when empty: a folder holding anything else stays
    if os.path.lexists(staging / FINAL_NAME):  # written beside the journal, so that the last step needs no space
        read_run_manifest(staging, FINAL_NAME)  # a regular file of the manifest's schema, or refused by name
        os.replace(staging / FINAL_NAME, folder / MANIFEST_NAME)
    remove_staging(staging)


def remove_staging(staging: Path) -> None:
    """Remove a staging folder: ours only by its manifest (a folder without one is refused by name); never through a
    symbolic link."""
    if not own_folder(staging):
        return
    if read_run_manifest(staging) is None:
        with contextlib.suppress(OSError):
            return os.rmdir(staging)  # empty: a removal stopped after its manifest
        raise RunConflict(f"{staging} holds no ipa_probe manifest, so its files are not a run's; move it away")
    for entry in os.scandir(staging):  # the manifest last: a removal cut short still says whose the rest is
        if entry.name != MANIFEST_NAME:
            shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    os.unlink(staging / MANIFEST_NAME)
    os.rmdir(staging)
