"""Run folders: a run writes aside, then is swapped into place whole, so that an output folder never loses work.

Every writer of an output folder (the commands, :meth:`ipa_probe.ProbeRun.save`, ``Comparison.save``) enters a
:class:`RunFolder`. It

1. takes the folder's lock (:func:`~ipa_probe._io.output_lock`; the command line takes it before torch loads);
2. finishes what a stopped commit left (:func:`recover`), then reads the folder's manifest as untrusted input
   (:func:`read_run_manifest`) and refuses, in one line and before the work, a run that would mix with another's
   files or that the commit could not finish (:func:`check_folder`);
3. gives the run a staging folder, ``OUT/.ipa_probe-staging`` (same file system, hidden); the run writes only there.
   One a killed run left is resumed by the same resumable run (same command and settings) and otherwise removed;
4. when the block ends without an error, commits (Ctrl-C held back): every staged file gets its size and SHA-256, a
   file of ``OUT`` it would replace must be the previous run's own, byte for byte; the staging manifest is marked
   ``"committing"`` (the journal) and :mod:`ipa_probe.run_commit` swaps the new run in whole, by one exchange where
   Linux allows it, else by the journal's renames.

A file is a run's own only if that run created it: nothing found in ``OUT`` is ever adopted into a manifest, and
nothing is removed or replaced unless its bytes equal the SHA-256 a manifest lists. An interrupted, killed or failed
run leaves ``OUT`` as it was plus the staging folder; :attr:`RunFolder.outcome` says so in one line. Torch-free.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ._io import LOCK_NAME, OutputLocked, jsonable, lock_holder, output_lock, swap_folder, versions, write_json
from .run_commit import (
    FINAL_NAME,
    STAGING_NAME,
    Unsupported,
    clear,
    inside,
    own_folder,
    record_final,
    remove_staging,
    roll_forward,
    still_listed,
    swap_in,
    twins,
)
from .run_manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, RunConflict, file_digest, read_run_manifest

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "STAGING_NAME",
    "TRACKER_STORES",
    "FolderState",
    "RunConflict",
    "RunFolder",
    "check_folder",
    "file_digest",
    "pending_commit",
    "read_run_manifest",
    "recover",
    "save_into",
]

#: How many file names a refusal or a note lists before "and N more".
_SHOWN = 3


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


# ---------------------------------------------------------------- what a folder holds


#: The stores of the trackers that keep many runs in one store (MLflow's database and artifacts, wandb's runs) under
#: the default ``OUT/logs``. A store is written where it lives, never staged: it records absolute paths (MLflow's
#: artifact locations) that a rename would break, and it is append-only, so a run adds to it and never replaces it.
#: Not a run's file: never listed in a manifest, never removed, not "a file no manifest lists".
TRACKER_STORES = ("logs/mlflow.db", "logs/mlartifacts", "logs/wandb")


def _machinery(rel: str) -> bool:
    """An entry of the folder's machinery, never a run's file: the lock, the manifest, the staging folder (and the
    temp folder it is made in) at the top, and the trackers' stores (:data:`TRACKER_STORES`, SQLite's side files
    with them)."""
    return (
        rel in (LOCK_NAME, MANIFEST_NAME, STAGING_NAME, FINAL_NAME, *TRACKER_STORES)
        or rel.startswith(STAGING_NAME + ".")
        or rel.startswith("logs/mlflow.db-")
    )


def _scan(folder: Path) -> tuple[dict[str, os.stat_result], set[str], list[str]]:
    """Every regular file under ``folder`` (relative POSIX path -> lstat), every sub-folder, and every symlink or
    special file; symlinks are listed, never followed; the folder's machinery is left out."""
    files: dict[str, os.stat_result] = {}
    dirs: set[str] = set()
    odd: list[str] = []
    if not folder.is_dir():
        return files, dirs, odd
    for root, subdirs, names in os.walk(folder, followlinks=False):
        rel_root = Path(root).relative_to(folder)
        for name in list(subdirs):
            rel = (rel_root / name).as_posix()
            if _machinery(rel):
                subdirs.remove(name)
            elif os.path.islink(os.path.join(root, name)):
                odd.append(rel)
                subdirs.remove(name)
            else:
                dirs.add(rel)
        for name in names:
            rel = (rel_root / name).as_posix()
            if _machinery(rel):
                continue
            info = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(info.st_mode):
                files[rel] = info
            else:
                odd.append(rel)
    return files, dirs, sorted(odd)


@dataclass
class FolderState:
    """What :func:`check_folder` found.

    Attributes:
        previous: the folder's manifest (``None``: none).
        same_run: the manifest is this run's (same command and key).
        ours: the files the manifest lists whose bytes still equal what it lists: the only files a run replaces.
        changed: files the manifest lists whose bytes differ (edited since, or replaced): never removed or replaced.
        unlisted: files (and symlinks) no manifest lists: never removed or replaced.
    """

    previous: dict[str, Any] | None
    same_run: bool
    ours: list[str]
    changed: list[str]
    unlisted: list[str]


def check_folder(
    folder: str | os.PathLike,
    command: str,
    key: dict[str, Any],
    overwrite: bool = False,
    flag: str = "--out",
) -> FolderState:
    """Read ``folder`` and refuse, in one line, a run that would mix with another's files or lose a file not its own.

    Refused (:class:`RunConflict`):

    - a manifest that cannot be trusted (:func:`read_run_manifest`);
    - a file the manifest lists whose bytes changed since (a hand edit): a rerun would write the same name, and
      only a run's own bytes are ever replaced; with or without ``overwrite``; also one with a hard link elsewhere
      (``st_nlink > 1``, its twin in a resumable run's staging folder not counted; call after :func:`recover`,
      which clears the links a stopped commit made);
    - without ``overwrite``: another run's files (another command or other settings), or files no manifest lists.

    With ``overwrite``, files no manifest lists are kept and named; a staged file that would land on one stops the
    commit (:class:`RunFolder`).

    Returns:
        A :class:`FolderState`.
    """
    folder = Path(folder)
    previous = read_run_manifest(folder)
    files, dirs, odd = _scan(folder)
    for name in sorted(dirs):  # what the commit needs of every folder it may write in or clear, checked now
        mounted = os.lstat(folder / name).st_dev != os.lstat(folder).st_dev
        if mounted or not os.access(folder / name, os.W_OK | os.X_OK):
            raise RunConflict(
                f"{flag} {folder}: its folder {name} is {'another file system' if mounted else 'not writable'}; a "
                f"commit links, renames and removes files in it: fix that, or choose a fresh {flag}"
            )
    listed = previous["files"] if previous else {}
    same = previous is not None and previous["command"] == command and previous.get("key") == jsonable(key)
    ours, changed = [], []
    for name in sorted(set(listed) & (set(files) | set(odd))):  # a link or a FIFO at a listed name: changed
        (ours if still_listed(folder, name, listed[name]["sha256"]) else changed).append(name)
    unlisted = sorted(set(files) - set(listed)) + [name for name in odd if name not in listed]
    state = FolderState(previous, same, ours, changed, unlisted)
    if changed:
        raise RunConflict(
            f"{flag} {folder}: {_listed(changed)} changed after run {previous['run_id']} wrote "
            f"{'them' if len(changed) > 1 else 'it'} (the sha256 its manifest lists differs); a run never replaces a "
            f"file that is not byte for byte its own: move {'them' if len(changed) > 1 else 'it'} away, or choose a "
            f"fresh {flag}"
        )
    # a second name of a file the run replaces or removes, but its twin in a resumable run's staging folder
    linked = [n for n in ours if files[n].st_nlink > 1 + twins(folder / n, folder / STAGING_NAME / n)]
    if linked:
        raise RunConflict(
            f"{flag} {folder}: a hard link elsewhere shares {_listed(linked)} of run {previous['run_id']}; a run "
            f"never replaces or removes a file another name shares: move that link away or make it a copy (cp), or "
            f"choose a fresh {flag}"
        )
    if overwrite:
        return state
    fresh = f"pass --overwrite to replace them, or choose a fresh {flag}"
    if previous is not None and not same and ours:
        raise RunConflict(
            f"{flag} {folder} holds the {len(ours)} files of another run ({previous['command']}, run "
            f"{previous['run_id']}, other settings); {fresh}"
        )
    if unlisted:
        raise RunConflict(
            f"{flag} {folder} holds {len(unlisted)} file(s) no ipa_probe run manifest lists ({_listed(unlisted)}); "
            f"they are never replaced: move them away, pass --overwrite to write beside them (they are kept), or "
            f"choose a fresh {flag}"
        )
    return state


# ---------------------------------------------------------------- the commit and its journal


@contextmanager
def _signals_held() -> Any:
    """Hold back SIGINT and SIGTERM for the block: they are recorded and raised again when it ends. (Masking the
    main thread would not do: the kernel hands a process's signal to any thread that does not block it, torch's
    among them, and Python then runs its handler in the main thread at once.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    held = [n for n in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(n) is not None]  # None: not Python's
    previous = {number: signal.signal(number, lambda number, frame: pending.append(number)) for number in held}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in pending:
            signal.raise_signal(number)


def _apply(folder: Path, record: dict[str, Any], previous: dict[str, Any] | None, verify: bool) -> list[str]:
    """Carry out the commit journal ``record``: by the swap where the system allows it, else by the journal's
    renames (:mod:`ipa_probe.run_commit`). Returns the paths the swap's clearing kept aside."""
    try:
        return swap_in(folder, record, previous, verify)
    except Unsupported as why:
        logger.info("%s: committing by renames (%s)", folder, why.strerror)
        roll_forward(folder, record)
        return []


def pending_commit(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds what a stopped commit left: the swap's sibling, a staging folder's temp folder (it
    may hold hard links of ``OUT``'s files), or a journal (:func:`recover`)."""
    staging = Path(folder) / STAGING_NAME
    if os.path.lexists(swap_folder(folder)) or any(Path(folder).glob(f"{STAGING_NAME}.*.tmp")):
        return True
    try:
        record = read_run_manifest(staging) if own_folder(staging) else None
    except RunConflict:
        return False
    return record is not None and record["status"] == "committing"


def recover(folder: str | os.PathLike) -> str | None:
    """Finish what a stopped commit left in ``folder``, as carefully as a first commit: clear the swap's sibling
    (:func:`~ipa_probe.run_commit.clear`), carry out a journal (a staging manifest marked ``"committing"``) after
    checking it against the manifest it replaces, clear the temp folders a killed run left while making its staging
    folder. Call with the folder's lock held.

    Returns:
        One line on what was finished, or ``None`` when there was nothing to do.

    Raises:
        RunConflict: something there is not what the commit left (named); it is left as it is.
    """
    folder = Path(os.path.abspath(Path(folder).expanduser()))
    if not folder.is_dir():
        return None
    kept = []
    with _signals_held():
        for entry in folder.iterdir():
            if entry.name.startswith(STAGING_NAME + ".") and entry.name.endswith(".tmp"):
                kept += clear(folder, entry)
        kept += clear(folder)
        staging = folder / STAGING_NAME
        record = read_run_manifest(staging) if own_folder(staging) else None
        if record is not None and record["status"] == "committing":
            previous = read_run_manifest(folder)
            if (previous or {}).get("run_id") == record["run_id"]:  # in place: stopped while removing the staging
                remove_staging(staging)
            elif (previous or {}).get("run_id") != record.get("previous_run"):
                raise RunConflict(
                    f"{folder}: the commit journal in {staging} replaces run {record.get('previous_run')}, but the "
                    "folder holds another; move the staging folder away"
                )
            elif all(os.path.lexists(staging / name) for name in record["files"]):
                kept += _apply(folder, record, previous, verify=True)
            else:  # a journal under way: finished by its renames
                roll_forward(folder, record)
    words = f"; kept what was not the commit's: {_listed(kept)}" if kept else ""
    if record is not None and record["status"] == "committing":
        return f"{folder}: finished the commit of run {record['run_id']} that a stopped process had begun{words}"
    return f"{folder}: cleared what a stopped commit left{words}" if kept else None


# ---------------------------------------------------------------- one run's hold on its folder

#: The staging folders this process's runs hold (resolved): a writer handed one of them writes straight into it
#: (:func:`save_into`), the run that holds it commits it.
_ACTIVE: set[str] = set()


@dataclass
class RunFolder:
    """A run's hold on its output folder: the lock, the staging folder it writes into, the commit when it ends.

    Use as a context manager; write every file under :attr:`staging`. See the module docstring for the rules.

    Args:
        command: the command (``"ipa-probe probe"``), recorded and compared with the previous run's.
        key: what must be equal for a later run to be this run redone or resumed (JSON-able).
        overwrite: replace another run's files (only those byte for byte as its manifest lists them).
        resumable: the command resumes by its own records (a sweep's rows, checkpoints): a rerun with the same key
            starts from a copy of the previous run's files, and a staging folder a killed run of it left is resumed.
        holder: what the lock records as holding the folder (default: ``command``).

    Attributes:
        state: what :func:`check_folder` found.
        removed: the previous run's files the commit removed (the new run did not write them again).
        kept: files no manifest lists, left in place (``overwrite``).
        outcome: after the block, one line on what the folder holds.
    """

    folder: Path
    command: str
    settings: dict[str, Any]
    key: dict[str, Any]
    overwrite: bool = False
    flag: str = "--out"
    resumable: bool = False
    holder: str | None = None
    staging: Path = field(init=False)
    run_id: str = field(init=False)
    state: FolderState | None = field(init=False, default=None)
    removed: list[str] = field(init=False, default_factory=list)
    kept: list[str] = field(init=False, default_factory=list)
    resumed: bool = field(init=False, default=False)
    outcome: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder).expanduser()
        self.staging = self.folder / STAGING_NAME
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._stack = ExitStack()
        self._journal = False
        self._committed = False

    def __enter__(self) -> RunFolder:
        self._stack.enter_context(output_lock(self.folder, self.holder or self.command, reentrant=True))
        try:
            note = recover(self.folder)
            if note:
                logger.warning("%s", note)
            self.state = check_folder(self.folder, self.command, self.key, self.overwrite, self.flag)
            self.kept = list(self.state.unlisted)
            self._stage()
            _ACTIVE.add(str(self.staging.resolve()))
        except BaseException as err:
            try:  # an interrupt after the staging folder was made: say what the folder holds, as __exit__ would
                if self._staging_is_this_runs():
                    _ACTIVE.discard(str(self.staging.resolve()))
                    self._failed(err)
            finally:
                self._stack.close()
            raise
        return self

    def _staging_is_this_runs(self) -> bool:
        with suppress(OSError, RunConflict):
            record = read_run_manifest(self.staging) if own_folder(self.staging) else None
            return record is not None and record["run_id"] == self.run_id
        return False

    def _record(self, status: str) -> dict[str, Any]:
        previous = self.state.previous if self.state else None
        return {
            "run_id": self.run_id,
            "command": self.command,
            "key": jsonable(self.key),
            "settings": jsonable(self.settings),
            "versions": versions(),
            "status": status,
            "mode": self._mode(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "started_ns": time.time_ns(),
            "previous_run": previous["run_id"] if previous else None,
            "resumed_from": previous["run_id"] if previous and self._mode() == "resume" else None,
            "files": {},
            "folders": [],
        }

    def _mode(self) -> str:
        """How the staging folder started: empty, or a copy of the same run's previous files (a resume)."""
        same = self.state is not None and self.state.same_run
        return "resume" if self.resumable and same and not self.overwrite else "fresh"

    def _stage(self) -> None:
        """Resume the staging folder a killed run of this same resumable run left, or make a new one."""
        if own_folder(self.staging):  # a link, a file or another user's folder there is refused by name
            old = read_run_manifest(self.staging)
            same = old is not None and old["command"] == self.command and old.get("key") == jsonable(self.key)
            if self.resumable and same and old.get("mode") == self._mode() and old["status"] != "committing":
                self.resumed = True
                self.run_id = old["run_id"]
                old.update(status="running", started_ns=time.time_ns())
                write_json(self.staging / MANIFEST_NAME, old)
                return
            remove_staging(self.staging)
        temp = self.folder / f"{STAGING_NAME}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        temp.mkdir()
        try:
            if self._mode() == "resume":  # the same run's files, so that the run's own records resume it
                listed = self.state.previous["files"]
                for name in self.state.ours:
                    target = temp / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    _link_or_copy(self.folder / name, target)
                    if file_digest(target) != listed[name]["sha256"]:  # changed while it was copied
                        raise RunConflict(f"{self.flag} {self.folder}: {name} changed while it was read; run again")
                self.resumed = bool(self.state.ours)
            write_json(temp / MANIFEST_NAME, self._record("running"))
            os.rename(temp, self.staging)  # whole or not there: a staging folder always carries its manifest
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

    def __exit__(self, kind, err, traceback) -> bool:
        _ACTIVE.discard(str(self.staging.resolve()))
        try:
            if kind is None:
                try:
                    self._commit()
                except BaseException as error:  # a fault (or Ctrl-C, held back until the renames ended) in the commit
                    self._failed(error)
                    raise
            else:
                self._failed(err)
        finally:
            self._stack.close()
        return False

    def _failed(self, err: BaseException | None) -> None:
        """Record a run that did not end well, and say in :attr:`outcome` (and a note on ``err``) what the folder
        holds."""
        if self._committed:
            pass  # the interrupt came after the renames: the outcome says the folder holds this run, whole
        elif self._journal:
            self.outcome = (
                f"{self.folder}: the commit of run {self.run_id} was cut short; the next run into the folder "
                "finishes it before anything else (its journal is in the staging folder)"
            )
        elif self.outcome is None and not _scan(self.staging)[0]:  # it wrote nothing: nothing to keep or resume
            remove_staging(self.staging)
            self.outcome = f"{self.folder} is as it was before this run ({self._previous_words()}); it wrote nothing"
        elif self.outcome is None:
            self._mark("interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
            self.outcome = (
                f"{self.folder} is as it was before this run ({self._previous_words()}); this run's files so far "
                f"are in {self.staging} ({self._next_words()})"
            )
        if isinstance(err, BaseException) and self.outcome and self.outcome not in str(err):
            err.add_note(self.outcome)

    def _previous_words(self) -> str:
        previous = self.state.previous if self.state else None
        if previous is None:
            return "no run of ipa_probe"
        return f"run {previous['run_id']}, {previous['status']}"

    def _next_words(self) -> str:
        if self.resumable:
            return "the same command resumes from them; any other run into the folder removes them"
        return "the next run into the folder removes them"

    def _mark(self, status: str) -> None:
        """Record a failed or interrupted run in its staging manifest (best effort: the disk may be full)."""
        try:
            record = read_run_manifest(self.staging)
            if record is not None and record["status"] != "committing":
                record.update(status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                write_json(self.staging / MANIFEST_NAME, record)
        except (OSError, RunConflict) as error:
            logger.warning("could not record the run's status in %s (%s)", self.staging, error)

    def _commit(self) -> None:
        """Check, journal, rename into place, manifest last (see the module docstring)."""
        files, dirs, odd = _scan(self.staging)
        if odd:
            logger.warning("%s: not committed (not regular files): %s", self.staging, _listed(odd))
        entries = {
            name: {"size": info.st_size, "sha256": file_digest(self.staging / name)} for name, info in files.items()
        }
        previous = self.state.previous
        listed = previous["files"] if previous else {}
        blocked = []
        for name in sorted(entries):
            target = inside(self.folder, name)
            if target is None:
                blocked.append(name)
            elif os.path.lexists(target) and not (
                name in listed and still_listed(self.folder, name, listed[name]["sha256"])
            ):
                blocked.append(name)
        if blocked:
            self._mark("staged")
            self.outcome = (
                f"{self.folder} is as it was before this run; this run is whole in {self.staging}, not committed"
            )
            raise RunConflict(
                f"{self.flag} {self.folder}: this run writes {_listed(blocked)}, where files stand that are not the "
                "previous run's own (no manifest lists them, or they changed, or a symbolic link is on the way): move "
                f"them away and run again, or choose a fresh {self.flag}; {self.outcome}"
            )
        remove = {
            name: entry["sha256"] for name, entry in listed.items() if name not in entries and name in self.state.ours
        }
        old_folders = previous.get("folders", []) if previous else []
        _, out_dirs, _ = _scan(self.folder)
        made = {p for name in entries for p in map(str, PurePosixPath(name).parents) if p != "."}
        record = read_run_manifest(self.staging) or self._record("running")
        record.update(
            status="committing",
            files=dict(sorted(entries.items())),
            remove=remove,
            replace={name: listed[name]["sha256"] for name in entries if name in listed},
            folders=sorted((made - out_dirs) | (made & set(old_folders))),
            old_folders=sorted(old_folders),
        )
        del dirs
        with _signals_held():
            write_json(self.staging / FINAL_NAME, record_final(record))
            write_json(self.staging / MANIFEST_NAME, record)  # the journal: from here the commit goes on, if need be
            self._journal = True  # by the next writer of the folder
            aside = _apply(Path(os.path.abspath(self.folder)), record, previous, verify=False)
            self._committed = True
            self.removed = sorted(remove)  # said before the held-back Ctrl-C, if any, is delivered
            kept = f"; kept {len(self.kept)} file(s) no run manifest lists ({_listed(self.kept)})" if self.kept else ""
            kept += f"; kept aside files made during the commit: {_listed(aside)}" if aside else ""
            self.outcome = f"{self.folder} holds run {self.run_id}, finished ({len(entries)} files){kept}"

    def note(self) -> str | None:
        """One line on the files ``overwrite`` left in place, or ``None``."""
        if self.kept:
            return f"{self.folder}: kept {len(self.kept)} file(s) no run manifest lists ({_listed(self.kept)})"
        return None


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link of ``source`` at ``target`` (no copy of a paper-sized experiment's checkpoints), or a copy with its
    times where the file system has no links. A link is safe because every writer of a resumable command replaces a
    file (a temp file renamed over it: :func:`~ipa_probe._io.atomic_path`) and never writes into one, so the file in
    ``OUT`` never changes through its twin in staging; renaming a twin over its original at the commit does nothing."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)  # its times too: some records are checked by mtime


def held_staging(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the staging folder of a run this process holds."""
    try:
        return str(Path(path).expanduser().resolve()) in _ACTIVE
    except OSError:
        return False


def save_into(
    path: str | os.PathLike,
    command: str,
    settings: dict[str, Any],
    write,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write a run's files into the folder ``path`` by the folder rules (:class:`RunFolder`), for the Python API.

    ``write(folder)`` writes the files into ``folder`` and returns ``{label: path}``; the paths returned point into
    ``path``. Where ``path`` is already the staging folder of a run this process holds (the command line's), ``write``
    writes straight into it.

    Raises:
        RunConflict: the folder holds another run's files, or files no manifest lists (without ``overwrite``).
        OutputLocked: another live process holds the folder.
    """
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite: expected True or False, got {type(overwrite).__name__}")
    if held_staging(path):
        return write(Path(path))
    with RunFolder(Path(path), command, settings, settings, overwrite=overwrite, flag="path") as run:
        paths = write(run.staging)
    return {label: run.folder / Path(p).relative_to(run.staging) for label, p in paths.items()}


def refuse_if_held(folder: str | os.PathLike) -> None:
    """Raise :class:`~ipa_probe._io.OutputLocked` when a live process other than this one holds ``folder``."""
    who = lock_holder(folder)
    if who is not None:
        raise OutputLocked(f"{folder} is in use by {who}; wait for it to finish, or use another output folder")
