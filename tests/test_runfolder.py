"""Run folders (ipa_probe/runfolder.py): a run writes aside and renames into place, manifest last; what a rerun
refuses; that nothing but a run's own bytes is ever replaced or removed; manifests read as untrusted input; one writer.

Torch-free and fast: runs here are blocks that write small text files. Digests are recomputed with hashlib on the
bytes the test reads back, never through the module's own digest."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from ipa_probe import run_commit, runfolder
from ipa_probe._io import LOCK_NAME, OutputLocked, lock_holder, output_lock
from ipa_probe.runfolder import (
    MANIFEST_NAME,
    STAGING_NAME,
    RunConflict,
    RunFolder,
    check_folder,
    read_run_manifest,
    recover,
    save_into,
)

CMD = "ipa-probe probe"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(folder, files: dict[str, str], key=None, overwrite=False, command=CMD, resumable=False) -> RunFolder:
    """One run that writes ``files`` (relative name -> text) into its staging folder; returns its hold."""
    with RunFolder(folder, command, {"key": key}, {"k": key}, overwrite=overwrite, resumable=resumable) as run:
        for name, text in files.items():
            (run.staging / name).parent.mkdir(parents=True, exist_ok=True)
            (run.staging / name).write_text(text)
    return run


def _whole(folder) -> dict:
    """The folder's manifest, after checking that it says finished and that every listed file has its listed size
    and sha256 (recomputed here)."""
    record = json.loads((folder / MANIFEST_NAME).read_text())
    assert record["status"] == "finished"
    for name, entry in record["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    return record


def _snapshot(folder) -> dict[str, bytes]:
    """Every regular file under ``folder`` outside the staging folder and the lock, with its bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and STAGING_NAME not in p.parts and p.name != ".ipa_probe.lock"
    }


def test_the_manifest_lists_each_file_with_its_size_and_sha256(tmp_path):
    out = tmp_path / "out"
    run = _run(out, {"a.txt": "alpha", "sub/b.bin": "beta!"}, key=1)
    record = _whole(out)
    assert record["run_id"] == run.run_id and record["command"] == CMD
    assert set(record["files"]) == {"a.txt", "sub/b.bin"} and record["folders"] == ["sub"]
    assert "python" in record["versions"] and not (out / STAGING_NAME).exists()
    assert "finished (2 files)" in run.outcome


def test_another_run_is_refused_in_one_line_and_nothing_changes(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    before = _snapshot(out)
    with pytest.raises(RunConflict) as err:
        _run(out, {"b.txt": "beta"}, key=2)
    message = str(err.value)
    assert "\n" not in message and "--overwrite" in message and "fresh --out" in message
    assert _snapshot(out) == before and not (out / STAGING_NAME).exists()


def test_a_failed_or_interrupted_run_leaves_the_previous_run_exactly_as_it_was(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha", "b.txt": "beta"}, key=1)
    before = _snapshot(out)
    for error in (KeyboardInterrupt, OSError):
        with pytest.raises(error) as caught:
            with RunFolder(out, CMD, {}, {"k": 2}, overwrite=True) as run:
                (run.staging / "a.txt").write_text("half of a new run")
                raise error()
        assert _snapshot(out) == before  # the old run, byte for byte, its manifest included
        _whole(out)
        assert "is as it was before this run" in caught.value.__notes__[0]
        staged = read_run_manifest(out / STAGING_NAME)
        assert staged["status"] == ("interrupted" if error is KeyboardInterrupt else "failed")
    _run(out, {"c.txt": "gamma"}, key=3, overwrite=True)  # the next run cleans the staging folder and replaces
    assert set(_whole(out)["files"]) == {"c.txt"} and not (out / "a.txt").exists()
    assert not (out / STAGING_NAME).exists()


def test_ctrl_c_just_after_the_staging_folder_is_made_still_says_what_the_folder_holds(tmp_path, monkeypatch):
    # the window between the staging folder's rename into place and the block's start: no __exit__ runs there
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    before, old = _snapshot(out), _whole(out)
    real = os.rename

    def interrupted(src, dst, *args, **options):
        real(src, dst, *args, **options)
        if Path(dst).name == STAGING_NAME:
            raise KeyboardInterrupt  # Ctrl-C delivered on the rename's return

    monkeypatch.setattr(runfolder.os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        with RunFolder(out, CMD, {}, {"k": 2}, overwrite=True):
            pytest.fail("the block never starts")
    monkeypatch.setattr(runfolder.os, "rename", real)
    assert caught.value.__notes__ == [
        f"{out} is as it was before this run (run {old['run_id']}, finished); it wrote nothing"
    ]
    assert _snapshot(out) == before and not (out / STAGING_NAME).exists()  # the empty staging folder went too
    assert not runfolder.held_staging(out / STAGING_NAME)
    _run(out, {"b.txt": "beta"}, key=3, overwrite=True)  # and the folder's lock was let go
    assert set(_whole(out)["files"]) == {"b.txt"}


def test_overwrite_replaces_only_the_previous_runs_own_bytes_and_keeps_the_rest(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha", "sub/b.txt": "beta", "keep/c.txt": "gamma"}, key=1)
    (out / "mine.txt").write_text("a user's notes")  # listed by no manifest
    (out / "keep" / "user.txt").write_text("inside a folder the run made")
    run = _run(out, {"new.txt": "new", "a.txt": "alpha 2"}, key=2, overwrite=True)
    assert sorted(run.removed) == ["keep/c.txt", "sub/b.txt"] and run.kept == ["keep/user.txt", "mine.txt"]
    assert "mine.txt" in run.note() and "kept 2 file(s)" in run.outcome
    assert (out / "mine.txt").read_text() == "a user's notes" and (out / "keep" / "user.txt").exists()
    assert not (out / "sub").exists()  # a folder the previous run made, left empty
    assert set(_whole(out)["files"]) == {"new.txt", "a.txt"} and (out / "a.txt").read_text() == "alpha 2"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_hand_edited_file_of_the_previous_run_is_refused_before_the_work(tmp_path, overwrite):
    out = tmp_path / "out"
    _run(out, {"summary.json": "{}", "digits.json": "[]"}, key=1)
    (out / "summary.json").write_text('{"my": "notes"}')
    with pytest.raises(RunConflict, match=r"summary.json changed after run .* move it away") as err:
        check_folder(out, CMD, {"k": 2}, overwrite=overwrite)
    assert "\n" not in str(err.value)
    with pytest.raises(RunConflict):
        _run(out, {"summary.json": "new"}, key=2, overwrite=overwrite)
    assert (out / "summary.json").read_text() == '{"my": "notes"}'  # never replaced


def test_a_users_file_where_the_run_writes_stops_the_commit_and_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("mine")
    with pytest.raises(RunConflict, match="this run writes summary.json") as err:
        _run(out, {"summary.json": "ours", "table.csv": "x"}, key=1, overwrite=True)
    assert "\n" not in str(err.value) and "whole in" in str(err.value)
    assert _snapshot(out) == {"summary.json": b"mine"}  # nothing renamed in, not even the other file
    assert read_run_manifest(out / STAGING_NAME)["status"] == "staged"


def test_files_the_folder_gains_while_a_run_holds_it_are_not_the_runs(tmp_path):
    out = tmp_path / "out"
    with RunFolder(out, CMD, {}, {"k": 1}) as run:
        (run.staging / "ours.txt").write_text("ours")
        (out / "theirs.txt").write_text("another process wrote this meanwhile")
    assert set(_whole(out)["files"]) == {"ours.txt"}
    _run(out, {"x.txt": "x"}, key=2, overwrite=True)
    assert (out / "theirs.txt").exists()  # never listed, so never removed


def test_symlinks_are_never_followed_listed_or_replaced(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep me")
    _run(out, {"a.txt": "alpha"}, key=1)
    (out / "link.txt").symlink_to(elsewhere / "precious.txt")
    (out / "linkdir").symlink_to(elsewhere)
    with pytest.raises(RunConflict, match="no ipa_probe run manifest lists"):
        check_folder(out, CMD, {"k": 1})
    with pytest.raises(RunConflict, match="linkdir/precious.txt"):  # a staged file under a symlinked folder
        _run(out, {"linkdir/precious.txt": "overwritten?"}, key=2, overwrite=True)
    assert (elsewhere / "precious.txt").read_text() == "keep me" and (out / "link.txt").is_symlink()


def test_a_rerun_of_a_resumable_run_starts_from_its_files_and_survives_any_number_of_kills(tmp_path):
    out = tmp_path / "out"
    _run(out, {"rows/row-0.parquet": "row 0"}, key=1, command="ipa-probe sweep", resumable=True)
    for kill in range(3):  # a killed run leaves its staging folder (no manifest update, no cleanup)
        run = RunFolder(out, "ipa-probe sweep", {}, {"k": 1}, resumable=True)
        run.__enter__()
        assert (run.staging / "rows/row-0.parquet").read_text() == "row 0"  # the previous run's rows, to resume
        (run.staging / f"rows/row-{kill + 1}.parquet").write_text(f"row {kill + 1}")
        run._stack.close()  # the lock goes with the process; nothing else happens
        check_folder(out, "ipa-probe sweep", {"k": 1})  # a plain rerun is never refused
    run = _run(out, {}, key=1, command="ipa-probe sweep", resumable=True)
    assert run.resumed and set(_whole(out)["files"]) == {f"rows/row-{i}.parquet" for i in range(4)}


def _no_exchange(monkeypatch) -> None:
    """The system has no renameat2 (not Linux, an old C library): the commit falls back to its journal."""

    def unsupported(source, target, flags):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), str(source))

    monkeypatch.setattr(run_commit, "rename2", unsupported)


def test_a_journal_cut_short_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _no_exchange(monkeypatch)
    _run(out, {"a.txt": "old a", "b.txt": "old b", "gone.txt": "old"}, key=1)
    real = os.replace

    def dies_on_the_second_rename(src, dst):
        if str(src).endswith(f"{STAGING_NAME}/b.txt"):  # a.txt is in place, b.txt is not
            raise SystemExit("killed")  # as SIGKILL would, between two renames
        return real(src, dst)

    monkeypatch.setattr(os, "replace", dies_on_the_second_rename)
    with pytest.raises(SystemExit):
        _run(out, {"a.txt": "new a", "b.txt": "new b"}, key=2, overwrite=True)
    monkeypatch.setattr(os, "replace", real)
    assert (out / "a.txt").read_text() == "new a" and (out / "b.txt").read_text() == "old b"  # half way
    assert "finished the commit" in recover(out)
    record = _whole(out)
    assert set(record["files"]) == {"a.txt", "b.txt"} and record["key"] == {"k": 2}
    assert not (out / "gone.txt").exists() and not (out / STAGING_NAME).exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "is not JSON"),
        (b"[1]", "is list, not a JSON object"),
        (b"[" * 100000 + b"]" * 100000, "nests"),
        (
            json.dumps({"run_id": "r", "command": "c", "status": "finished", "started_ns": "abc", "files": {}}),
            "started_ns",
        ),
        (json.dumps({"run_id": "r", "command": "c", "status": "finished", "files": {"a\0b": {}}}), "not a plain"),
        (json.dumps({"run_id": "r", "command": "c", "status": "finished", "files": {"../x": {}}}), "not a plain"),
        (json.dumps({"run_id": "r", "command": "c", "status": "finished", "files": {}, "foreign": 5}), "foreign"),
        (json.dumps({"run_id": "r", "command": "c", "status": "finished", "files": {"a": {"size": 1}}}), "sha256"),
        (json.dumps({"run_id": "r", "command": "c", "status": "done?", "files": {}}), "status"),
    ],
)
def test_a_tampered_manifest_is_one_line(tmp_path, content, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RunConflict, match=message) as err:
        check_folder(out, CMD, {})
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_a_manifest_that_is_a_fifo_or_a_device_is_refused_without_reading(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / MANIFEST_NAME)  # opened without blocking: no writer needed, no hang
    with pytest.raises(RunConflict, match="not a regular file"):
        check_folder(out, CMD, {})
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).symlink_to("/dev/zero")  # a link is not followed: it would read until memory ran out
    with pytest.raises(RunConflict, match="symbolic link"):
        check_folder(out, CMD, {})


def test_an_oversized_manifest_is_refused_unread(tmp_path, monkeypatch):
    import ipa_probe.run_manifest as run_manifest

    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    monkeypatch.setattr(run_manifest, "MAX_MANIFEST_BYTES", 100)  # the real cap is 64 MiB; the rule is the same
    with pytest.raises(RunConflict, match="more than the 100 bytes read back"):
        check_folder(out, CMD, {"k": 1})


HOLD = textwrap.dedent(
    """
    import sys, time
    from ipa_probe.runfolder import RunFolder
    holder = "ipa-probe sweep m.jsonl --out X"
    with RunFolder(sys.argv[1], "ipa-probe sweep", {}, {}, overwrite=True, holder=holder) as run:
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_a_second_writer_is_refused_naming_the_live_run_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=None, command="ipa-probe sweep")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        with pytest.raises(OutputLocked, match=rf"process {holder.pid} on .*ipa-probe sweep m.jsonl --out X"):
            _run(out, {"b.txt": "beta"}, key=None, command="ipa-probe sweep", overwrite=True)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("how", ["output_lock", "lock_holder"])
def test_a_lock_taken_a_moment_ago_still_names_its_holder_once_it_writes_its_record(tmp_path, how):
    """Two writers started together: the winner has the flock but has not yet written who it is. The loser waits for
    the record instead of saying "another process" (the test takes the flock itself and writes the record late)."""
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    record = {"pid": 4242, "host": "h", "launch": "h:pid4242", "started": 0, "command": "ipa-probe probe --kind x"}
    late = threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(record).encode(), 0))
    late.start()
    try:
        if how == "lock_holder":
            assert lock_holder(out) == "process 4242 on h, started ? (ipa-probe probe --kind x)"
        else:
            with pytest.raises(OutputLocked, match=r"in use by process 4242 on h, .*ipa-probe probe --kind x"):
                with output_lock(out, "ipa-probe probe"):
                    pass
    finally:
        late.join()
        os.close(fd)


def test_save_into_writes_a_manifest_and_obeys_the_folder_rules(tmp_path):
    out = tmp_path / "out"

    def write(folder):
        (folder / "t.txt").write_text("table")
        return {"table": folder / "t.txt"}

    paths = save_into(out, "ipa_probe ProbeRun.save", {"bandwidth": "matched"}, write)
    assert paths == {"table": out / "t.txt"} and set(_whole(out)["files"]) == {"t.txt"}
    with pytest.raises(RunConflict, match="another run"):
        save_into(out, "ipa_probe ProbeRun.save", {"bandwidth": 0.5}, write)
    save_into(out, "ipa_probe ProbeRun.save", {"bandwidth": 0.5}, write, overwrite=True)
    assert _whole(out)["settings"] == {"bandwidth": 0.5}
    with pytest.raises(TypeError, match="overwrite: expected True or False"):
        save_into(out, "ipa_probe ProbeRun.save", {}, write, overwrite="yes")


def test_a_file_edited_after_an_unfinished_run_is_never_removed_whatever_the_status(tmp_path):
    """Issue 39: any listed file newer than an unfinished run's start was removable, its hash unchecked."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("edited by hand after the run failed")
    listed = {"size": 5, "sha256": hashlib.sha256(b"alpha").hexdigest()}
    for status in ("running", "failed", "interrupted"):
        record = {"run_id": "r0", "command": CMD, "key": {"k": 1}, "status": status, "started_ns": 0}
        (out / MANIFEST_NAME).write_text(json.dumps({**record, "files": {"a.txt": listed}}))
        with pytest.raises(RunConflict, match="a.txt changed after run r0"):
            _run(out, {"b.txt": "beta"}, key=2, overwrite=True)
        assert (out / "a.txt").read_text() == "edited by hand after the run failed"


def test_a_file_dropped_in_after_a_killed_run_is_never_adopted(tmp_path):
    out = tmp_path / "out"
    _run(out, {"rows/row-0.parquet": "row 0"}, key=1, command="ipa-probe sweep", resumable=True)
    run = RunFolder(out, "ipa-probe sweep", {}, {"k": 1}, resumable=True)
    run.__enter__()
    (run.staging / "rows/row-1.parquet").write_text("row 1")
    run._stack.close()  # killed: the lock goes with the process, the staging folder stays
    (out / "rows" / "dropped.parquet").write_text("a file someone put here")
    with pytest.raises(RunConflict, match=r"no ipa_probe run manifest lists \(rows/dropped.parquet\)"):
        _run(out, {}, key=1, command="ipa-probe sweep", resumable=True)
    _run(out, {}, key=1, command="ipa-probe sweep", resumable=True, overwrite=True)  # beside it, never listed
    assert "rows/dropped.parquet" not in _whole(out)["files"] and (out / "rows" / "dropped.parquet").exists()
    _run(out, {"x.txt": "x"}, key=2, command="ipa-probe sweep", overwrite=True)  # a later --overwrite keeps it too
    assert (out / "rows" / "dropped.parquet").read_text() == "a file someone put here"


@pytest.mark.parametrize("call", ["link", "replace"])  # the swap links the staged files, the journal renames them
def test_ctrl_c_during_the_commit_is_held_back_until_the_run_is_in_place(tmp_path, monkeypatch, call):
    import signal

    out = tmp_path / "out"
    _run(out, {"a.txt": "old"}, key=1)
    if call == "replace":
        _no_exchange(monkeypatch)
    real = getattr(os, call)

    def interrupted(src, dst, **options):
        if str(src).endswith(f"{STAGING_NAME}/a.txt"):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the commit
        return real(src, dst, **options)

    monkeypatch.setattr(os, call, interrupted)
    # Ctrl-C as at a terminal, also when the suite runs in the background (started with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt) as caught:
        _run(out, {"a.txt": "new", "b.txt": "new b"}, key=2, overwrite=True)
    monkeypatch.setattr(os, call, real)
    signal.signal(signal.SIGINT, previous)
    record = _whole(out)  # delivered once the commit ended: the new run is whole, and the note says so
    assert set(record["files"]) == {"a.txt", "b.txt"} and (out / "a.txt").read_text() == "new"
    assert f"{out} holds run {record['run_id']}, finished (2 files)" in caught.value.__notes__


# ---------------------------------------------------------------- a writer stopped before each of its calls

#: The calls that change the file system during a run (``os.open`` counted only when it creates), and the exchange.
_CALLS = ("mkdir", "link", "unlink", "rmdir", "replace", "rename", "chmod", "open")
_OLD = {"a.txt": "old a", "sub/b.txt": "old b", "gone/c.txt": "old c"}
_NEW = {"a.txt": "new a", "sub/b.txt": "new b", "fresh/d.txt": "new d"}
_USERS = {"mine.txt": "a user's notes", "notes/n.txt": "a user's folder"}


def _whole_run(out) -> str:
    """Check that ``out`` holds one whole run (every listed file with its sha256, recomputed here) and the user's
    files, and nothing else outside the folder's machinery; return the run's key."""
    record = _whole(out)
    files = {
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if (p.is_file() or p.is_symlink())
        and p.name != ".ipa_probe.lock"
        and not any(part.startswith(STAGING_NAME) for part in p.parts)  # the staging folder and its temp folder
    }
    assert files == set(record["files"]) | set(_USERS) | {MANIFEST_NAME}, files
    assert all((out / name).read_text() == text for name, text in _USERS.items())
    assert set(record["files"]) == set(_OLD if record["key"] == {"k": 1} else _NEW)
    return record["key"]["k"]


def _stopped_commit(out, stop: int | None, check: bool, work=None) -> int:
    """Run the new run's commit (or ``work()``) in a child process whose ``stop``-th file-system call ends it on the
    spot (as SIGKILL would: no handler, no ``finally``); with ``check``, the child first asserts before every call
    that ``out`` holds a whole run. Returns the child's exit status (with ``stop=None``: the number of calls made)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        calls = [0]

        def counted(real, name):
            def call(*args, **options):
                if name != "open" or args[1] & os.O_CREAT:
                    calls[0] += 1
                    if calls[0] == stop:
                        os._exit(100)
                    if check:
                        try:
                            _whole_run(out)
                        except BaseException:
                            os._exit(101)
                return real(*args, **options)

            return call

        try:
            for name in _CALLS:
                setattr(os, name, counted(getattr(os, name), name))
            run_commit.rename2 = counted(run_commit.rename2, "rename2")
            work() if work else _run(out, _NEW, key=2, overwrite=True)
            os._exit(min(calls[0], 99))
        except BaseException:
            os._exit(102)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.parametrize("mode", ["swap", "journal"])
def test_a_writer_stopped_before_any_of_its_calls_leaves_a_whole_run_and_the_next_one_recovers(
    tmp_path, monkeypatch, request, mode
):
    """The swap: the folder holds the old run or the new one, whole, before every call of the commit (checked in the
    writer) and wherever it is stopped. The journal (where there is no exchange): whole once the next writer has
    replayed it. Either way the next writer recovers, and the user's files are never lost."""
    monkeypatch.setattr(runfolder, "versions", lambda: {})  # a git subprocess per run: not what is tested here
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # a kill, unlike a power cut, keeps what was written
    if mode == "journal":
        _no_exchange(monkeypatch)
    if os.path.isdir("/dev/shm"):  # tmpfs (renameat2 and hard links as on ext4), where a run takes a few ms
        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm"))
        request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    template = _prepared(tmp_path / "template")
    shutil.copytree(template, tmp_path / "unstopped" / "out")
    total = _stopped_commit(tmp_path / "unstopped" / "out", None, check=mode == "swap")
    assert 20 < total < 99 and _whole_run(tmp_path / "unstopped" / "out") == 2  # how many calls a commit makes
    seen = set()
    for stop in range(1, total + 1):
        out = tmp_path / str(stop) / "out"
        shutil.copytree(template, out)  # the previous run and the user's files, as _prepared leaves them
        assert _stopped_commit(out, stop, check=False) == 100, stop
        if mode == "swap":
            seen.add(_whole_run(out))  # whole at the instant it stopped
        with output_lock(out, "the next writer"):
            recover(out)
        seen.add(_whole_run(out))
        assert [p.name for p in out.parent.iterdir()] == ["out"], stop  # no sibling left beside it
        _run(out, _NEW, key=2, overwrite=True)  # and the next writer commits
        assert _whole_run(out) == 2 and not (out / STAGING_NAME).exists()
        shutil.rmtree(out.parent)
    assert seen == {1, 2}  # stopped before and after the commit's decisive step


def _prepared(parent):
    """``parent/out`` holding the previous run and the user's files."""
    out = parent / "out"
    _run(out, _OLD, key=1)
    for name, text in _USERS.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    return out


# ---------------------------------------------------------------- recovery as careful as a first write


def _journal_left(out, monkeypatch) -> None:
    """A commit of ``a.txt``/``sub/b.txt`` (new) over the previous run, stopped just before its exchange: the journal
    is in the staging folder, ``out`` holds the previous run."""
    real = run_commit.rename2

    def stopped(source, target, flags):
        if flags == run_commit._EXCHANGE:
            raise SystemExit("stopped")
        return real(source, target, flags)

    monkeypatch.setattr(run_commit, "rename2", stopped)
    with pytest.raises(SystemExit):
        _run(out, {"a.txt": "new a", "sub/b.txt": "new b"}, key=2, overwrite=True)
    monkeypatch.setattr(run_commit, "rename2", real)
    assert read_run_manifest(out / STAGING_NAME)["status"] == "committing" and _whole(out)["key"] == {"k": 1}


def test_a_replay_refuses_by_name_a_target_changed_since_and_keeps_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _run(out, {"a.txt": "old a", "sub/b.txt": "old b"}, key=1)
    _journal_left(out, monkeypatch)
    (out / "sub" / "b.txt").write_text("the user's edit")
    with output_lock(out, "the next writer"), pytest.raises(RunConflict, match="sub/b.txt changed after run"):
        recover(out)
    assert (out / "sub" / "b.txt").read_text() == "the user's edit" and (out / "a.txt").read_text() == "old a"
    (out / "sub" / "b.txt").write_text("old b")  # put back: the replay goes through
    with output_lock(out, "the next writer"):
        assert "finished the commit" in recover(out)
    assert _whole(out)["key"] == {"k": 2} and (out / "sub" / "b.txt").read_text() == "new b"


def test_a_pending_journal_is_finished_and_checked_before_torch_loads(tmp_path, monkeypatch):
    from ipa_probe.cli._common import check_run_folder
    from ipa_probe.cli._errors import CLIError

    out = tmp_path / "out"
    _run(out, {"a.txt": "old a"}, key=1)
    _journal_left(out, monkeypatch)
    with pytest.raises(CLIError, match="holds the 2 files of another run"):  # the finished commit, then the check
        check_run_folder(out, CMD, {"k": 3}, overwrite=False)
    assert _whole(out)["key"] == {"k": 2} and not (out / STAGING_NAME).exists()


def test_a_forged_journal_whose_manifest_is_a_link_is_refused(tmp_path, monkeypatch):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.json"
    _run(out, {"a.txt": "old a"}, key=1)
    _no_exchange(monkeypatch)
    staging = out / STAGING_NAME
    staging.mkdir()
    old = _whole(out)
    record = {**old, "run_id": "forged", "status": "committing", "files": {}, "previous_run": old["run_id"]}
    (staging / MANIFEST_NAME).write_text(json.dumps(record))
    elsewhere.write_text(json.dumps({**record, "status": "finished"}))
    (staging / run_commit.FINAL_NAME).symlink_to(elsewhere)
    with output_lock(out, "the next writer"), pytest.raises(RunConflict, match="final.json is a symbolic link"):
        recover(out)
    assert not (out / MANIFEST_NAME).is_symlink() and _whole(out)["key"] == {"k": 1}


def test_a_staging_folder_that_is_a_link_or_holds_no_manifest_is_refused_and_kept(tmp_path):
    out, theirs = tmp_path / "out", tmp_path / "theirs"
    _run(out, {"a.txt": "old a"}, key=1)
    shutil.copytree(out, theirs, ignore=shutil.ignore_patterns(".ipa_probe.lock"))
    (theirs / "foreign.txt").write_text("not the run's")
    (out / STAGING_NAME).symlink_to(theirs)  # a link to a folder with a matching manifest
    with pytest.raises(RunConflict, match="not a folder ipa_probe made"):
        _run(out, {"a.txt": "new"}, key=1, overwrite=True)
    assert sorted(p.name for p in theirs.iterdir()) == ["a.txt", "foreign.txt", MANIFEST_NAME]
    (out / STAGING_NAME).unlink()
    (out / STAGING_NAME).mkdir()
    (out / STAGING_NAME / "notes.txt").write_text("a user's file")  # no manifest: not a run's
    with pytest.raises(RunConflict, match="holds no ipa_probe manifest"):
        _run(out, {"a.txt": "new"}, key=1, overwrite=True)
    assert (out / STAGING_NAME / "notes.txt").read_text() == "a user's file" and _whole(out)["key"] == {"k": 1}


def test_a_lock_hard_linked_to_a_users_file_is_never_truncated(tmp_path):
    out, theirs = tmp_path / "out", tmp_path / "theirs.txt"
    out.mkdir()
    theirs.write_text("a user's file")
    os.link(theirs, out / ".ipa_probe.lock")
    with pytest.raises(OSError, match="a hard link to another file"):
        _run(out, {"a.txt": "new"}, key=1)
    assert theirs.read_text() == "a user's file"


# ---------------------------------------------------------------- one bounded reader for every file read back


def test_the_bounded_reader_reads_regular_files_only_within_its_cap(tmp_path):
    from ipa_probe._io import Unreadable, parse_json, read_bounded

    os.mkfifo(tmp_path / "fifo")  # opened without blocking: no writer needed, no hang
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(Unreadable, match="a FIFO"):
        read_bounded(tmp_path / "fifo")
    with pytest.raises(Unreadable, match="a symbolic link"):
        read_bounded(tmp_path / "zero")
    with pytest.raises(Unreadable, match="a character device"):  # a link followed on purpose, still refused
        read_bounded(tmp_path / "zero", follow=True)
    with pytest.raises(Unreadable, match="11 bytes, more than the 10 bytes"):
        read_bounded(tmp_path / "big", limit=10)
    assert read_bounded(tmp_path / "big", limit=11) == b"x" * 11 and read_bounded(tmp_path / "none") is None
    for depth in (33, 10_000, 1_000_000):  # past the cap; past the parser's own recursion limit
        with pytest.raises(ValueError, match="nests deeper than 32 levels"):
            parse_json("[" * depth + "]" * depth)
    value = parse_json("[" * 32 + "]" * 32)
    for _ in range(31):
        (value,) = value
    assert value == []


def test_records_read_before_torch_never_hang_or_raise(tmp_path):
    from ipa_probe.experiments.tiers import TIERS, check_folder_tier

    out = tmp_path / "out"
    for name in ("fifo", "zero", "deep"):
        (out / name).mkdir(parents=True)
    os.mkfifo(out / "fifo" / "record.json")
    (out / "zero" / "record.json").symlink_to("/dev/zero")
    (out / "deep" / "record.json").write_text("[" * 10_000 + "]" * 10_000)
    check_folder_tier(out, TIERS["smoke"])  # not records: skipped (the folder check names them as not a run's)


def test_sweep_inputs_are_read_bounded(tmp_path, monkeypatch):
    from ipa_probe import _io
    from ipa_probe.sweep.manifest import ManifestError, read_manifest

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a cat", "seed": 1}\n' + '{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}\n")
    manifest = read_manifest(rows)
    assert len(manifest.rows) == 1 and "nests deeper than 32 levels" in manifest.skipped[0].reason
    monkeypatch.setattr(_io, "MAX_READ_BYTES", 100)  # the real cap is 64 MiB; the rule is the same
    with pytest.raises(ManifestError, match=r"more than the 100 bytes read back") as err:
        read_manifest(rows)
    assert "\n" not in str(err.value)


def test_files_made_during_the_swap_go_back_into_the_folder_or_are_kept_aside(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _run(out, {"a.txt": "old a"}, key=1)
    (out / "mine.txt").write_text("version 1")
    real = run_commit.rename2

    def user_writes_first(source, target, flags):
        if flags == run_commit._EXCHANGE:  # the user, just before the exchange: a new file, and an atomic save
            (out / "late.txt").write_text("made during the commit")
            (out / "mine.tmp").write_text("version 2")
            os.replace(out / "mine.tmp", out / "mine.txt")
        return real(source, target, flags)

    monkeypatch.setattr(run_commit, "rename2", user_writes_first)
    run = _run(out, {"a.txt": "new a"}, key=2, overwrite=True)
    assert _whole(out)["key"] == {"k": 2} and (out / "late.txt").read_text() == "made during the commit"
    (aside,) = tmp_path.glob("out.ipa_probe-kept-*")  # its name was taken in the new folder (by version 1)
    assert (aside / "mine.txt").read_text() == "version 2" and (out / "mine.txt").read_text() == "version 1"
    assert "kept aside files made during the commit" in run.outcome and "mine.txt" in run.outcome
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", aside.name]


def test_a_listed_file_replaced_by_a_link_is_refused_before_the_work(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.txt"
    _run(out, {"a.txt": "old a"}, key=1)
    elsewhere.write_text("a user's file")
    (out / "a.txt").unlink()
    (out / "a.txt").symlink_to(elsewhere)
    for overwrite in (False, True):  # refused when the run is entered, before any work
        with pytest.raises(RunConflict, match="a.txt changed after run"):
            check_folder(out, CMD, {"k": 2}, overwrite=overwrite)
    assert (out / "a.txt").is_symlink() and elsewhere.read_text() == "a user's file"


def test_a_listed_file_hard_linked_elsewhere_is_refused_before_the_work_and_both_names_kept(tmp_path):
    from ipa_probe.cli._common import check_run_folder
    from ipa_probe.cli._errors import CLIError

    out, keep = tmp_path / "out", tmp_path / "keep.txt"
    _run(out, {"a.txt": "old a", "b.txt": "old b"}, key=1)
    os.link(out / "a.txt", keep)  # the user's second name for the run's file (`ln OUT/a.txt keep.txt`)
    worked = []
    for overwrite in (False, True):
        with pytest.raises(RunConflict, match=r"a hard link elsewhere shares a.txt of run .* make it a copy") as err:
            with RunFolder(out, CMD, {}, {"k": 1}, overwrite=overwrite):
                worked.append(overwrite)
        assert "\n" not in str(err.value)
        with pytest.raises(CLIError, match="a hard link elsewhere shares a.txt"):  # exit 2, before torch loads
            check_run_folder(out, CMD, {"k": 1}, overwrite=overwrite)
    assert worked == [] and not (out / STAGING_NAME).exists()  # refused before the block ran
    assert keep.read_text() == (out / "a.txt").read_text() == "old a" and os.path.samefile(keep, out / "a.txt")
    _whole(out)
    keep.unlink()  # the remedy: the same run then goes through
    _run(out, {"a.txt": "new a"}, key=1)
    assert (out / "a.txt").read_text() == "new a"


def test_the_hard_links_a_killed_resumable_run_left_are_not_refused(tmp_path):
    from ipa_probe.cli._common import check_run_folder

    out, sweep, row = tmp_path / "out", "ipa-probe sweep", "rows/row-0.parquet"
    _run(out, {row: "row 0"}, key=1, command=sweep, resumable=True)
    run = RunFolder(out, sweep, {}, {"k": 1}, resumable=True)
    run.__enter__()  # killed after making its staging folder, which holds a hard link of row 0 (to resume from)
    run._stack.close()
    temp = out / f"{STAGING_NAME}.1-0123abcd.tmp"  # and a rerun killed while making its own: one more link
    (temp / "rows").mkdir(parents=True)
    os.link(out / row, temp / row)
    assert os.lstat(out / row).st_nlink == 3
    check_run_folder(out, sweep, {"k": 1}, overwrite=False)  # clears the temp folder first
    assert not temp.exists() and os.lstat(out / row).st_nlink == 2
    os.link(out / row, tmp_path / "keep.parquet")  # a link no run made
    with pytest.raises(RunConflict, match=f"shares {row}"):
        check_folder(out, sweep, {"k": 1})
    (tmp_path / "keep.parquet").unlink()
    assert _run(out, {}, key=1, command=sweep, resumable=True).resumed and set(_whole(out)["files"]) == {row}


def _exchanged_then_stopped(parent, monkeypatch):
    """``parent/out`` just after a commit's exchange, before the old folder is cleared: the new run in ``out``, the
    previous one (with the staging folder and the lock's second name) in the sibling."""
    out = _prepared(parent)
    real = run_commit.clear

    def stopped(folder, swap=None):
        if swap is None and run_commit._exchanged(folder):
            raise SystemExit("stopped after the exchange")
        return real(folder, swap)

    monkeypatch.setattr(run_commit, "clear", stopped)
    with pytest.raises(SystemExit):
        _run(out, _NEW, key=2, overwrite=True)
    monkeypatch.setattr(run_commit, "clear", real)
    assert _whole_run(out) == 2 and (out.parent / ".out.ipa_probe-swap" / STAGING_NAME).is_dir()
    return out


def test_a_commit_stopped_after_its_exchange_is_recovered_by_the_next_run(tmp_path, monkeypatch):
    from ipa_probe.cli._common import check_run_folder

    out = _exchanged_then_stopped(tmp_path, monkeypatch)  # each new file has its twin in the sibling's staging folder
    assert os.lstat(out / "a.txt").st_nlink == 2
    check_run_folder(out, CMD, {"k": 2}, overwrite=True)  # the sibling cleared before the check: not refused
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and os.lstat(out / "a.txt").st_nlink == 1
    _run(out, _NEW, key=2, overwrite=True)
    assert _whole_run(out) == 2


def test_a_recovery_stopped_before_any_of_its_calls_is_finished_by_the_next(tmp_path, monkeypatch, request):
    monkeypatch.setattr(runfolder, "versions", lambda: {})
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    if os.path.isdir("/dev/shm"):
        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm"))
        request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))

    def recovery(out):
        with output_lock(out, "the next writer"):
            recover(out)

    out = _exchanged_then_stopped(tmp_path / "unstopped", monkeypatch)
    total = _stopped_commit(out, None, check=True, work=lambda: recovery(out))
    assert 5 < total < 99 and [p.name for p in out.parent.iterdir()] == ["out"]
    for stop in range(1, total + 1):
        out = _exchanged_then_stopped(tmp_path / str(stop), monkeypatch)
        assert _stopped_commit(out, stop, check=True, work=lambda out=out: recovery(out)) == 100, stop
        assert _whole_run(out) == 2
        recovery(out)
        assert _whole_run(out) == 2 and [p.name for p in out.parent.iterdir()] == ["out"], stop
        shutil.rmtree(out.parent)
