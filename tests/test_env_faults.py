"""Faults of the environment and of weight files, through the command line: one line naming the path and the
remedy, the documented exit code (1: the environment; 2: the input), finished files kept whole, no temp file left,
and a rerun that resumes.

Disk full and read-only folders are injected at the write call (a size-limited tmpfs needs root, and chmod does not
stop root): each fake raises what the real writer raises there, as seen on a full tmpfs: pyarrow an ``OSError`` with
errno 28 and no file name, safetensors its own error ending in ``(os error 28)``, the kernel ``ENOSPC`` on rename and
``EROFS`` even when unlinking a file that is not there.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from forked import CLI
from helpers import write_jsonl
from PIL import Image

from ipa_probe._io import os_error_of
from ipa_probe.cli import main
from ipa_probe.cli._runtime import describe_os_error
from ipa_probe.runfolder import STAGING_NAME
from ipa_probe.sweep import SweepLayout, load_table
from ipa_probe.tiny.sd import default_reference_images

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"prompt": "a cat", "images": "refs/0.png", "seed": 1},
    {"prompt": "a dog", "images": "refs/1.png", "seed": 2},
    {"prompt": "a tree", "images": "refs/2.png", "seed": 3},
]
SWEEP = ["--steps", "2", "--no-progress", "--resamples", "99"]


def write_workdir(folder: Path) -> Path:
    (folder / "refs").mkdir(parents=True)
    for i, image in enumerate(default_reference_images(3)):
        image.save(folder / "refs" / f"{i}.png")
    write_jsonl(folder / "m.jsonl", ROWS)
    return folder


@pytest.fixture
def workdir(tmp_path) -> Path:
    return write_workdir(tmp_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The three rows swept once, uninterrupted, through the command line (one torch thread, as the tests)."""
    import torch

    folder, before = write_workdir(tmp_path_factory.mktemp("reference")), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["sweep", str(folder / "m.jsonl"), "--out", str(folder / "out"), *SWEEP]) == 0
    finally:
        torch.set_num_threads(before)
    return folder / "out"


def one_error_line(capsys) -> str:
    """The one line on stderr besides progress bars (tqdm's lines hold ``%|``): no traceback, no warning."""
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line and "%|" not in line]
    assert len(lines) == 1, lines
    return lines[0]


def no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*.tmp")]


def fail_parquet_writes(monkeypatch, name: str, code: int = errno.ENOSPC, leave_temp: bool = True) -> None:
    """Parquet writes whose target is ``name`` fail: after writing part of the file (``leave_temp``), with errno
    ``code`` and no file name, as pyarrow does on a full disk. Row parts go through ``pyarrow.parquet.write_table``,
    tables (the aggregate) through ``DataFrame.to_parquet``."""
    import pyarrow.parquet as pq

    def fail(where) -> None:
        if leave_temp:
            Path(where).write_bytes(b"PAR1 half a file")
        raise OSError(code, f"Error writing bytes to file. Detail: [errno {code}] {os.strerror(code)}")

    def targets(where) -> bool:
        return isinstance(where, str | os.PathLike) and Path(where).name.startswith(f".{name}.")

    real_write_table, real_to_parquet = pq.write_table, pd.DataFrame.to_parquet

    def write_table(table, where, **kwargs):
        return fail(where) if targets(where) else real_write_table(table, where, **kwargs)

    def to_parquet(self, path=None, **kwargs):
        return fail(path) if targets(path) else real_to_parquet(self, path, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", to_parquet)


# ------------------------------------------------------------------------------------------------ disk full


@pytest.mark.parametrize("target", ["row-000001.parquet", "aggregate.parquet"])
def test_a_full_disk_in_a_sweep_is_one_line_and_a_rerun_resumes(
    workdir, reference, monkeypatch, capsys, one_thread, target
):
    out = workdir / "full"
    staged = out / STAGING_NAME  # the run writes aside until it is whole
    with monkeypatch.context() as patch:
        fail_parquet_writes(patch, target)
        assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *SWEEP]) == 1
    line = one_error_line(capsys)
    where = staged / "rows" / target if target.startswith("row-") else staged / target
    assert f"'{where}': No space left on device [errno 28]; free space" in line
    assert f"{out} is as it was before this run (no run of ipa_probe)" in line  # what the folder holds now
    parts = [p.name for p in SweepLayout(staged).parts()]
    assert parts == (
        ["row-000000.parquet"] if target.startswith("row-") else [f"row-00000{i}.parquet" for i in range(3)]
    )
    pd.testing.assert_frame_equal(load_table(staged, rows=[0]), load_table(reference, rows=[0]))  # kept whole
    assert no_temp_files(out) and not (out / "summary.json").exists() and not (out / "rows").exists()
    assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *SWEEP]) == 0  # space freed: resume
    assert ("1 resumed" if target.startswith("row-") else "3 resumed") in capsys.readouterr().out
    pd.testing.assert_frame_equal(load_table(out), load_table(reference))
    pd.testing.assert_frame_equal(
        pd.read_parquet(out / "aggregate.parquet"), pd.read_parquet(reference / "aggregate.parquet")
    )


def test_a_full_disk_at_the_lock_names_the_lock_file(workdir, monkeypatch, capsys):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # os.pwrite knows only the descriptor

    monkeypatch.setattr(os, "pwrite", pwrite)
    out = workdir / "lock"
    assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *SWEEP]) == 1
    assert f"'{out / '.ipa_probe.lock'}': No space left on device" in one_error_line(capsys)
    names = sorted(p.name for p in out.iterdir())
    assert names == [".ipa_probe.lock"] and not (out / ".ipa_probe.lock").read_text()  # before any work: nothing


def test_a_full_disk_in_an_overwrite_probe_leaves_the_previous_run_whole(tmp_path, monkeypatch, capsys, one_thread):
    """Issue 39: a full disk during `probe --overwrite` exited 0 with a "running" manifest listing no files. Now the
    run stops with exit 1 naming the file, and the folder holds the previous run, byte for byte."""
    import hashlib

    out = tmp_path / "probe"
    argv = ["probe", "--kind", "sd15", "--steps", "2", "--num-images", "3", "--out", str(out)]
    assert main([*argv, "--seed", "1"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == "image_1.png":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))  # the kernel names the source
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    capsys.readouterr()
    assert main([*argv, "--seed", "2", "--overwrite"]) == 1
    line = one_error_line(capsys)
    staged = out / STAGING_NAME
    assert f"'{staged / 'image_1.png'}': No space left on device [errno 28]" in line  # the file, not its temp copy
    assert f"{out} is as it was before this run (run " in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # the previous run, exactly
    record = json.loads(before["ipa_probe_manifest.json"])
    assert record["status"] == "finished" and record["settings"]["seed"] == 1
    for name, entry in record["files"].items():
        assert entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert sorted(p.name for p in staged.iterdir()) == ["image_0.png", "ipa_probe_manifest.json"]  # written before
    assert json.loads((staged / "ipa_probe_manifest.json").read_text())["status"] == "failed"
    assert Image.open(staged / "image_0.png").size == (64, 64)


def test_a_full_disk_in_experiments_names_the_checkpoint(tmp_path, monkeypatch, capsys, one_thread):
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "experiments"
    assert main(["experiments", "collapse", "--tier", "quick", "--out", str(out), "--no-progress"]) == 1
    line = one_error_line(capsys)
    assert "checkpoint.safetensors': No space left on device [errno 28]" in line
    assert str(out / STAGING_NAME / "runs") in line  # the run writes aside until it is whole
    assert no_temp_files(out) and not list(out.rglob("checkpoint.safetensors"))


# ------------------------------------------------------------------------------------------- read-only, no permission


@pytest.mark.parametrize("code, remedy", [(errno.EROFS, "read-only"), (errno.EACCES, "no permission")])
def test_a_read_only_rows_folder_is_reported_not_its_cleanup(workdir, monkeypatch, capsys, one_thread, code, remedy):
    """The temp file cannot be made (the kernel refuses the O_CREAT open of atomic_path's new temp file) and, on a
    read-only file system, even unlinking the absent temp file fails: the error shown is the write's, and nothing is
    logged about a cleanup that had nothing to remove."""
    import ipa_probe._io as io_module

    real_create = io_module._create_new

    def create_new(path: Path) -> None:
        if path.name.startswith(".row-000000.parquet."):
            raise OSError(code, os.strerror(code), str(path))
        real_create(path)

    monkeypatch.setattr(io_module, "_create_new", create_new)
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.endswith(".tmp"):
            raise OSError(code, os.strerror(code), str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    out = workdir / "ro"
    assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *SWEEP]) == 1
    line = one_error_line(capsys)
    where = out / STAGING_NAME / "rows" / "row-000000.parquet"
    assert f"'{where}': {os.strerror(code)} [errno {code}]; " in line and remedy in line


def test_writer_errors_are_read_as_os_errors():
    rust = os_error_of(ValueError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert (rust.errno, rust.filename) == (errno.ENOSPC, None)
    arrow = os_error_of(OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device"))
    assert arrow.strerror == "No space left on device"
    assert os_error_of(ValueError("not an OS error")) is None and os_error_of(OSError("no errno")) is None
    line = describe_os_error(rust, out="/data/out")
    assert line.startswith("writing under '/data/out': No space left on device [errno 28]; free space")
    line = describe_os_error(OSError(errno.EISDIR, "Is a directory", "/o/.ipa_probe.lock"))
    expected = "'/o/.ipa_probe.lock': Is a directory [errno 21]; a folder stands where a file is expected"
    assert line == f"{expected}: move it away or rename it"


# ------------------------------------------------------------------------------------------------ weight files


@pytest.mark.slow
def test_weight_files_that_load_badly_are_one_line_and_a_weight_file_path_works(tmp_path, capsys, one_thread):
    """Weights of another architecture (SDXL's adapter in an SD 1.5 pipeline) and a random-bytes pickle: exit 2,
    one line naming the file. ``--ip-adapter`` naming the weight file itself loads it (no --weight-name)."""
    from ipa_probe.tiny.sd import save_tiny_pipeline

    sd15, sdxl = save_tiny_pipeline(tmp_path / "sd15", seed=1), save_tiny_pipeline(tmp_path / "sdxl", "sdxl", seed=1)
    (tmp_path / "refs").mkdir()
    default_reference_images(1)[0].save(tmp_path / "refs" / "0.png")
    (tmp_path / "random.bin").write_bytes(os.urandom(2048))
    common = ["--model", str(sd15.model_dir), "--image", str(tmp_path / "refs"), "--steps", "2", "--kind", "sd15"]
    for weights, what in ((sdxl.weight_file, "expected shape"), (tmp_path / "random.bin", "Unable to load")):
        assert main(["probe", *common, "--ip-adapter", str(weights), "--out", str(tmp_path / "bad")]) == 2
        line = one_error_line(capsys)
        assert f"could not load --ip-adapter weights '{weights}'" in line and what in line and "family" in line
        assert not (tmp_path / "bad").exists()
    by_file, by_folder = tmp_path / "by_file", tmp_path / "by_folder"
    assert main(["probe", *common, "--ip-adapter", str(sd15.weight_file), "--out", str(by_file)]) == 0
    folder = ["--ip-adapter", str(sd15.ip_adapter_dir), "--weight-name", sd15.weight_name]
    assert main(["probe", *common, *folder, "--out", str(by_folder)]) == 0
    pd.testing.assert_frame_equal(
        pd.read_parquet(by_file / "probe.parquet"), pd.read_parquet(by_folder / "probe.parquet")
    )


# ------------------------------------------------------------------------------------------------ Ctrl-C


def _interrupted_sweep(zygote, workdir, name: str, signals: int):
    """A real `ipa-probe sweep` of 400 rows (far more than run before the signal lands, however loaded the machine:
    the interrupt must find work left), sent ``signals`` SIGINTs 0.15 s apart once two rows are done. Returns
    ``(returncode, stdout, stderr, out)``."""
    rows = [{"prompt": f"p{i}", "images": f"refs/{i % 3}.png", "seed": i} for i in range(400)]
    manifest, out = write_jsonl(workdir / "long.jsonl", rows), workdir / name
    argv = ["sweep", str(manifest), "--out", str(out), *SWEEP, "--steps", "3"]
    # `python -m ipa_probe ARGV` in a fresh process forked from a preloaded interpreter, SIGINT handled as in a
    # terminal (tests/forked.py)
    proc = zygote.start(CLI, argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 240
    rows = out / STAGING_NAME / "rows"  # the run writes aside until it is whole
    while len(list(rows.glob("row-*.parquet"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    for index in range(signals):
        if index:
            time.sleep(0.15)
        proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr, out


@pytest.mark.slow
def test_ctrl_c_in_a_real_process_prints_exactly_one_line(workdir, zygote):
    code, stdout, stderr, out = _interrupted_sweep(zygote, workdir, "interrupted", signals=1)
    assert code == 130, stderr[-2000:]
    assert stderr.strip().splitlines() == [_interrupted_line(out)]
    assert stdout == "" and len(SweepLayout(out / STAGING_NAME).parts()) >= 2 and no_temp_files(out)


def _interrupted_line(out: Path) -> str:
    """What an interrupted sweep into a fresh folder says the folder holds."""
    return (
        f"ipa-probe sweep: interrupted; {out} is as it was before this run (no run of ipa_probe); this run's files so "
        f"far are in {out / STAGING_NAME} (the same command resumes from them; any other run into the folder removes "
        "them)"
    )


@pytest.mark.slow
def test_two_ctrl_c_in_a_real_sweep_end_with_130_and_keep_finished_rows(workdir, zygote):
    """The issue's case: two SIGINTs 0.15 s apart in a running sweep (it died by SIGINT, status -2)."""
    code, _, stderr, out = _interrupted_sweep(zygote, workdir, "twice", signals=2)
    assert code == 130, stderr[-2000:]
    assert stderr.strip().splitlines() == [_interrupted_line(out)]
    assert len(SweepLayout(out / STAGING_NAME).parts()) >= 2 and no_temp_files(out)
    assert not (out / ".ipa_probe.lock").read_text()


def test_a_full_disk_in_train_digits_names_the_checkpoint_and_leaves_nothing_half_written(
    tmp_path, monkeypatch, capsys, one_thread
):
    import safetensors.torch
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")  # the writer got part of the way
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "digits"
    argv = ["train-digits", "--out", str(out), "--no-progress", "--vae-steps", "1", "--encoder-steps", "1"]
    assert main([*argv, "--steps", "2", "--batch", "4", "--checkpoint-every", "1", "--threads", "1"]) == 1
    line = one_error_line(capsys)
    assert "checkpoint.safetensors': No space left on device [errno 28]" in line and str(out / STAGING_NAME) in line
    # the first checkpoint write failed: no checkpoint, no temporary file, no outputs of a finished run
    assert no_temp_files(out) and not list(out.rglob("*.safetensors")) and not (out / "record.json").exists()


# ------------------------------------------------------------------ issue 31: permissions, signals, streams, trackers


def unreadable(monkeypatch, path: Path) -> None:
    """``path`` cannot be read: chmod 000, which stops a user; root's reads it does not stop, so as root os.access is
    answered as the kernel answers a user (the command checks with os.access before any open)."""
    path.chmod(0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == path else real(p, mode, **k))


def test_an_unreadable_image_is_exit_1_naming_the_path_and_the_remedy(workdir, monkeypatch, capsys):
    image = workdir / "refs" / "0.png"
    unreadable(monkeypatch, image)
    try:
        assert main(["probe", "--image", str(image), "--out", str(workdir / "out")]) == 1
    finally:
        image.chmod(0o644)
    line = one_error_line(capsys)
    assert line.startswith(f"ipa-probe probe: error: '{image}': Permission denied [errno 13]; ")
    assert "chmod u+r" in line and "not an image" not in line and not (workdir / "out").exists()


def test_an_unreadable_checkpoint_is_exit_1_not_delete_it(tmp_path, monkeypatch, capsys, one_thread):
    out = tmp_path / "digits"
    out.mkdir()
    checkpoint = out / "checkpoint.safetensors"
    checkpoint.write_bytes(b"a checkpoint this user may not read")
    unreadable(monkeypatch, checkpoint)
    argv = ["train-digits", "--out", str(out), "--no-progress", "--vae-steps", "1", "--encoder-steps", "1"]
    try:  # a checkpoint no manifest lists is not this run's to read, resume from or replace (issue 39)
        assert main([*argv, "--steps", "2", "--batch", "4", "--threads", "1"]) == 2
    finally:
        checkpoint.chmod(0o644)
    line = one_error_line(capsys)
    assert "holds 1 file(s) no ipa_probe run manifest lists (checkpoint.safetensors)" in line
    assert "delete it" not in line and checkpoint.read_bytes() == b"a checkpoint this user may not read"


#: runs ``ipa-probe experiments`` in a child whose work is replaced: ``print`` prints, ``work`` waits for Ctrl-C,
#: then spends a second cleaning up (where a second Ctrl-C lands) and marks that it finished
FAKE_WORK = """
import sys, time
from pathlib import Path
import ipa_probe.cli.experiments as command
mode, marker = sys.argv.pop(1), Path(sys.argv.pop(1))

def run(args):
    if mode == "print":
        print("a line of results " * 200)
        return 0
    marker.with_suffix(".working").touch()
    try:
        time.sleep(60)
    finally:
        time.sleep(1.0)
        marker.with_suffix(".cleaned").touch()

command.run = run
command.check = lambda args: None
sys.argv[0] = "ipa-probe"
from ipa_probe.cli import main
sys.exit(main())
"""


def fake_command(mode: str, marker: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", FAKE_WORK, mode, str(marker), "experiments", "collapse", "--out", str(marker)]
    return subprocess.Popen(argv, env=env, cwd=ROOT, **popen)


def test_a_second_ctrl_c_during_the_cleanup_still_ends_with_130(tmp_path):
    marker = tmp_path / "run"
    proc = fake_command(
        "work",
        marker,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    deadline = time.monotonic() + 120
    while not marker.with_suffix(".working").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.15)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "ipa-probe experiments: interrupted; finished work is kept, run the same command again to resume"
    ]
    assert marker.with_suffix(".cleaned").exists()  # the first interrupt's cleanup ran to its end


def test_a_full_stdout_is_one_line_and_exit_1(tmp_path):
    with open("/dev/full", "w") as full:
        proc = fake_command("print", tmp_path / "run", stdout=full, stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert stderr.strip().splitlines() == [
        "ipa-probe experiments: error: '<standard output>': No space left on device [errno 28]; the command's "
        "files are written; only what it prints is lost (redirect it elsewhere)"
    ]


def test_a_reader_that_closes_the_pipe_ends_quietly_with_exit_1(tmp_path):
    proc = fake_command("print", tmp_path / "run", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the command prints (as `| head -0` does)
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 1 and stderr == ""  # no "Exception ignored ... BrokenPipeError"


def test_a_full_stderr_does_not_change_the_exit_code(tmp_path):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "ipa_probe", "experiments", "bogus", "--out", str(tmp_path / "o")],
            stdout=subprocess.PIPE,
            stderr=full,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            timeout=120,
        )
    assert proc.returncode == 2 and proc.stdout == b""


#: a fake wandb client (this machine has none): importable, so the check reaches the login question
FAKE_WANDB = """
import importlib.machinery, json, sys, types
fake = types.ModuleType("wandb")
fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
sys.modules["wandb"] = fake
from ipa_probe.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "diffusers", "pandas") if m in sys.modules]}))
"""


@pytest.mark.parametrize("command", [["probe"], ["sweep", "MANIFEST"]])
def test_wandb_not_logged_in_is_refused_before_the_run(workdir, command):
    netrc = workdir / "netrc"
    netrc.write_text("machine example.com login me password secret\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), NETRC=str(netrc), HOME=str(workdir))
    argv = [a.replace("MANIFEST", str(workdir / "m.jsonl")) for a in command]
    out = subprocess.run(
        [sys.executable, "-c", FAKE_WANDB, *argv, "--log-with", "wandb", "--out", str(workdir / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 2, "heavy": []}, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "wandb is not logged in and not in offline mode" in line and "wandb login" in line
    assert "WANDB_MODE=offline" in line and not (workdir / "out").exists()


def test_wandb_logs_offline_or_with_a_key(tmp_path, monkeypatch):
    import importlib.machinery
    import types

    from ipa_probe.trackers import check_tracker

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    with pytest.raises(ValueError, match="^log_with='wandb': wandb is not logged in"):
        check_tracker("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert check_tracker("wandb") == "wandb"
    monkeypatch.delenv("WANDB_MODE")
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")  # what `wandb login` writes
    netrc.chmod(0o600)
    assert check_tracker("wandb") == "wandb"
