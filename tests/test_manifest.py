"""Run manifests (ipa_probe/_manifest.py): what a run lists, what a rerun refuses, what --overwrite removes and what it
never touches. Digests are recomputed here with hashlib on the bytes the test reads back."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from ipa_probe._manifest import MANIFEST_NAME, RunConflict, check_folder, claim_folder, read_run_manifest

CMD = "ipa-probe probe"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(folder, files: dict[str, str], key=None, overwrite=False, command=CMD):
    """One run that writes ``files`` (relative name -> text) into ``folder``; returns its claim."""
    with claim_folder(folder, command, {"key": key}, {"k": key}, overwrite=overwrite) as claim:
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
    return claim


def test_the_manifest_lists_each_file_with_its_size_and_sha256(tmp_path):
    out = tmp_path / "out"
    claim = _run(out, {"a.txt": "alpha", "sub/b.bin": "beta!"}, key=1)
    record = json.loads((out / MANIFEST_NAME).read_text())
    assert record["run_id"] == claim.run_id and record["command"] == CMD and record["status"] == "finished"
    assert set(record["files"]) == {"a.txt", "sub/b.bin"}
    for name, entry in record["files"].items():
        assert entry == {"size": len((out / name).read_bytes()), "sha256": _sha(out / name)}
    assert record["folders"] == ["sub"] and "python" in record["versions"]


def test_another_run_is_refused_in_one_line_and_nothing_changes(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RunConflict) as err:
        _run(out, {"b.txt": "beta"}, key=2)
    message = str(err.value)
    assert "\n" not in message and "--overwrite" in message and "fresh --out" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_removes_exactly_the_listed_files_and_keeps_the_rest(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha", "sub/b.txt": "beta", "keep/c.txt": "gamma"}, key=1)
    (out / "mine.txt").write_text("a user's notes")  # listed by no manifest
    (out / "keep" / "user.txt").write_text("inside a folder the run made")
    claim = _run(out, {"new.txt": "new"}, key=2, overwrite=True)
    assert sorted(claim.removed) == ["a.txt", "keep/c.txt", "sub/b.txt"]
    assert claim.left == ["keep/user.txt", "mine.txt"] and "mine.txt" in claim.note()
    assert (out / "mine.txt").read_text() == "a user's notes" and (out / "keep" / "user.txt").exists()
    assert not (out / "sub").exists()  # the first run's folder, empty once its file went
    record = read_run_manifest(out)
    assert set(record["files"]) == {"new.txt"}


def test_a_listed_file_changed_since_is_left(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha", "b.txt": "beta"}, key=1)
    (out / "b.txt").write_text("edited by hand")
    claim = _run(out, {}, key=2, overwrite=True)
    assert claim.removed == ["a.txt"] and claim.left == ["b.txt"]
    assert (out / "b.txt").read_text() == "edited by hand"


def test_symlinks_are_never_followed_nor_removed(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("precious")
    _run(out, {"a.txt": "alpha", "d/b.txt": "beta"}, key=1)
    record = read_run_manifest(out)
    # a file the run listed becomes a symlink to a file of the same bytes elsewhere; a folder it made, a symlink to
    # another folder holding a file of the listed name and bytes; and a hand-edited entry that climbs out
    (outside / "a.txt").write_text("alpha")
    os.unlink(out / "a.txt")
    os.symlink(outside / "a.txt", out / "a.txt")
    (outside / "d").mkdir()
    (outside / "d" / "b.txt").write_text("beta")
    os.unlink(out / "d" / "b.txt")
    os.rmdir(out / "d")
    os.symlink(outside / "d", out / "d")
    record["files"]["../outside/precious.txt"] = {"size": 8, "sha256": _sha(outside / "precious.txt")}
    (out / MANIFEST_NAME).write_text(json.dumps(record))
    with pytest.raises(RunConflict, match="no ipa_probe run manifest lists"):  # the symlinks are not the run's files
        _run(out, {}, key=2)
    claim = _run(out, {}, key=2, overwrite=True)
    assert claim.removed == []
    assert (outside / "a.txt").read_text() == "alpha" and (outside / "d" / "b.txt").read_text() == "beta"
    assert (outside / "precious.txt").read_text() == "precious"
    assert os.path.islink(out / "a.txt") and os.path.islink(out / "d")


def test_unlisted_files_refuse_a_run_and_overwrite_keeps_them(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(RunConflict, match=r"1 file\(s\) no ipa_probe run manifest lists \(notes.md\)"):
        check_folder(out, CMD, {})
    claim = _run(out, {"a.txt": "alpha"}, key=1, overwrite=True)
    assert claim.left == ["notes.md"] and (out / "notes.md").read_text() == "mine"
    assert set(read_run_manifest(out)["files"]) == {"a.txt"}  # the user's file is not claimed either


def test_the_same_run_again_keeps_and_carries_its_files(tmp_path):
    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    first = read_run_manifest(out)
    claim = _run(out, {"b.txt": "beta"}, key=1)
    record = read_run_manifest(out)
    assert claim.resumed and record["resumed_from"] == first["run_id"]
    assert set(record["files"]) == {"a.txt", "b.txt"}


def test_a_killed_run_is_resumed_with_the_files_it_wrote(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("a user's file from before the run")
    past = 1_000_000_000  # 1970: older than any run's start
    os.utime(out / "old.txt", ns=(past, past))
    _run(out, {"a.txt": "alpha"}, key=1, overwrite=True)
    record = read_run_manifest(out)
    # what a SIGKILL leaves: the "running" manifest of a run that wrote b.txt after it started
    record.update(status="running", files={})
    (out / MANIFEST_NAME).write_text(json.dumps(record))
    (out / "b.txt").write_text("beta")
    with pytest.raises(RunConflict, match="old.txt"):  # the user's older file still refuses a plain rerun
        check_folder(out, CMD, {"k": 1})
    state = check_folder(out, CMD, {"k": 1}, overwrite=True)
    assert sorted(state.adopted) == ["a.txt", "b.txt"] and state.unlisted == ["old.txt"]
    os.unlink(out / "old.txt")
    claim = _run(out, {"c.txt": "gamma"}, key=1)
    assert claim.resumed and set(read_run_manifest(out)["files"]) == {"a.txt", "b.txt", "c.txt"}


def test_an_interrupted_block_still_writes_its_manifest(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with claim_folder(out, CMD, {}, {}):
            (out / "part.txt").write_text("half")
            raise KeyboardInterrupt
    record = read_run_manifest(out)
    assert record["status"] == "interrupted" and set(record["files"]) == {"part.txt"}


def test_a_broken_manifest_is_one_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(RunConflict, match="cannot be read") as err:
        check_folder(out, CMD, {})
    assert "\n" not in str(err.value)


def test_a_folder_a_live_run_holds_is_not_touched(tmp_path):
    import subprocess
    import sys

    from ipa_probe._io import OutputLocked

    out = tmp_path / "out"
    _run(out, {"a.txt": "alpha"}, key=1)
    hold = "import sys, time\nfrom ipa_probe._io import output_lock\nwith output_lock(sys.argv[1], 'holder'):\n"
    hold += "    print('locked', flush=True)\n    time.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = (out / MANIFEST_NAME).read_bytes()
        with pytest.raises(OutputLocked, match=f"process {holder.pid} on"):
            _run(out, {"b.txt": "beta"}, key=2, overwrite=True)
        assert (out / "a.txt").exists() and (out / MANIFEST_NAME).read_bytes() == before
    finally:
        holder.kill()
        holder.wait()


def test_a_resumable_command_takes_a_folder_without_manifest_and_never_claims_its_files(tmp_path):
    """A sweep folder written by the Python API (no manifest): the sweep command resumes there, leaves the files it
    found listed as foreign (accepted by its later runs, never removed), and another command is still refused."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "rows.parquet").write_text("written by run_sweep() from Python")
    with pytest.raises(RunConflict):
        check_folder(out, "ipa-probe sweep", {})  # not resumable: refused
    with claim_folder(out, "ipa-probe sweep", {}, {}, resumable=True) as claim:
        (out / "summary.json").write_text("{}")
    assert claim.left == ["rows.parquet"]
    record = read_run_manifest(out)
    assert set(record["files"]) == {"summary.json"} and record["foreign"] == ["rows.parquet"]
    check_folder(out, "ipa-probe sweep", {}, resumable=True)  # its own next run: accepted
    with pytest.raises(RunConflict):
        check_folder(out, CMD, {"k": 1})  # another command: refused
    claim = _run(out, {}, key=1, overwrite=True)
    assert claim.removed == ["summary.json"] and (out / "rows.parquet").exists()
