"""A run folder's manifest (``ipa_probe_manifest.json``) read as untrusted input: a regular file, opened without
following a link and without blocking, at most :data:`MAX_MANIFEST_BYTES`, parsed against the manifest's schema
(types, file names without NUL or ``..``, nesting depth). Anything else is one line (:class:`RunConflict`).

Apart from :mod:`ipa_probe.sweep.manifest`, which reads a sweep's list of rows. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from ._io import MAX_READ_BYTES, Unreadable, parse_json, read_bounded

__all__ = ["MANIFEST_NAME", "MAX_MANIFEST_BYTES", "RunConflict", "file_digest", "read_run_manifest", "safe_name"]

#: The manifest's file name in an output folder.
MANIFEST_NAME = "ipa_probe_manifest.json"

#: The largest manifest read (a sweep of 100,000 rows lists about 15 MB); a larger file is refused unread.
MAX_MANIFEST_BYTES = MAX_READ_BYTES

#: The statuses a manifest may carry.
STATUSES = ("running", "committing", "finished", "failed", "interrupted", "staged")


class RunConflict(ValueError):
    """The output folder holds another run's files, files no manifest lists, or a manifest that cannot be trusted;
    the message is one line and nothing in the folder changed."""


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a regular file's bytes, read without following a final symlink (``OSError`` else)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def safe_name(name: Any) -> bool:
    """A listed name that stays inside the folder: text, relative, no NUL, no ``..``/``.``/empty part."""
    if not isinstance(name, str) or not name or "\0" in name or len(name) > 4096 or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and all(part not in ("", ".", "..") for part in name.split("/"))


def _schema_problem(record: Any) -> str | None:
    """What is wrong with a parsed manifest, or ``None``."""
    if not isinstance(record, dict):
        return f"is {type(record).__name__}, not a JSON object"
    for name, kind in (("run_id", str), ("command", str), ("status", str)):
        if not isinstance(record.get(name), kind):
            return f"field {name!r} is {record.get(name)!r:.40}, expected text"
    if record["status"] not in STATUSES:
        return f"field 'status' is {record['status']!r:.40}, expected one of {', '.join(STATUSES)}"
    started = record.get("started_ns", 0)
    if not isinstance(started, int) or isinstance(started, bool) or started < 0:
        return f"field 'started_ns' is {started!r:.40}, expected a non-negative integer"
    files = record.get("files")
    if not isinstance(files, dict):
        return "field 'files' is not an object of file name -> {size, sha256}"
    for name, entry in files.items():
        if not safe_name(name):
            return f"lists a file name {name!r:.60} that is not a plain relative path (NUL, '..', absolute or empty)"
        ok = isinstance(entry, dict) and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool)
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if not (ok and entry["size"] >= 0 and isinstance(sha, str) and len(sha) == 64):
            return f"lists {name!r:.60} with {entry!r:.60}, expected {{'size': bytes, 'sha256': 64 hex digits}}"
        if any(c not in "0123456789abcdef" for c in sha):
            return f"lists {name!r:.60} with a sha256 that is not 64 hex digits"
    for name in ("folders", "foreign"):
        names = record.get(name, [])
        if not isinstance(names, list) or not all(safe_name(n) for n in names):
            return f"field {name!r} is not a list of plain relative paths"
    for name in ("remove", "replace"):
        shas = record.get(name, {})
        if not isinstance(shas, dict) or not all(safe_name(n) and isinstance(v, str) for n, v in shas.items()):
            return f"field {name!r} is not an object of plain relative path -> sha256"
    return None


def read_run_manifest(folder: str | os.PathLike, name: str = MANIFEST_NAME) -> dict[str, Any] | None:
    """The manifest of ``folder``, read as untrusted input, or ``None`` when it has none.

    The file is opened without following a symbolic link and without blocking (a FIFO cannot hang the read), must be a
    regular file of at most :data:`MAX_MANIFEST_BYTES`, and must parse to the manifest's schema (types, names without
    NUL or ``..``, nesting depth).

    Raises:
        RunConflict: one line naming the manifest and what is wrong with it.
    """
    path = Path(folder) / name
    fix = "it does not say which files are whose: choose a fresh --out, or remove the folder"
    try:
        data = read_bounded(path, limit=MAX_MANIFEST_BYTES)
        record = None if data is None else parse_json(data.decode("utf-8"))
    except PermissionError as err:
        raise RunConflict(f"{path} is unreadable ({err.strerror}); {fix}") from None
    except Unreadable as err:
        raise RunConflict(f"{err}; {fix}") from None
    except ValueError as err:  # not UTF-8, not JSON, or nested past the cap
        bad = isinstance(err, json.JSONDecodeError | UnicodeDecodeError)
        reason = f"is not JSON ({str(err)[:80]})" if bad else str(err)
        raise RunConflict(f"{path} {reason}; {fix}") from None
    problem = None if record is None else _schema_problem(record)
    if problem:
        raise RunConflict(f"{path} {problem}; {fix}")
    return record
