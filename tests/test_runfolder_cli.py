"""Run folders from the command line, in real processes (issue 39): a second writer is refused before torch loads,
naming the live run; two writers started together end with one whole run and one exit 2; an ``--overwrite`` run
killed (SIGINT, SIGKILL) at several moments leaves one whole run in the folder.

A whole run: the manifest says finished and every file it lists has its listed size and sha256, recomputed here with
hashlib. The writers are forked from one preloaded interpreter (tests/forked.py); the folder rules themselves are
tests/test_runfolder.py's, in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_cases import Case, run_in_fresh_process
from forked import CLI
from test_runfolder import _whole

from ipa_probe._io import output_lock
from ipa_probe.runfolder import MANIFEST_NAME, STAGING_NAME, recover

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["probe", "--kind", "sd15", "--steps", "2", "--size", "64", "64", "--threads", "1"]


def _start(zygote, argv: list[str]):
    """``ipa-probe ARGV`` in a fresh process forked from the preloaded interpreter (tests/forked.py), with Ctrl-C as
    at a terminal: it has imported torch already, so the kill at "lock" comes before the model loads."""
    return zygote.start(CLI, argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


HOLD = textwrap.dedent(
    """
    import sys, time
    from ipa_probe.runfolder import RunFolder
    with RunFolder(sys.argv[1], "ipa-probe probe", {}, {}, holder="ipa-probe probe --seed 3 --out X"):
        print("held", flush=True)
        time.sleep(120)
    """
)


def test_a_second_writer_of_every_command_is_refused_before_torch_loads(tmp_path):
    out = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "ok.jsonl").write_text('{"seed": 1}\n')
        cases = [
            Case("probe", ("probe", "--overwrite"), 2, ""),
            Case("compare", ("compare",), 2, ""),
            Case("sweep", ("sweep", str(tmp_path / "ok.jsonl")), 2, ""),
            Case("experiments", ("experiments", "collapse", "--tier", "quick"), 2, ""),
            Case("train-digits", ("train-digits",), 2, ""),
        ]
        cases = [Case(c.name, (*c.argv, "--out", str(out)), c.code, c.message) for c in cases]
        results = run_in_fresh_process(cases, tmp_path, ROOT)
        for case in cases:
            result = results[case.name]
            lines = result["stderr"].strip().splitlines()
            assert result["code"] == 2 and len(lines) == 1, result["stderr"]
            assert (
                f"is in use by process {holder.pid} on" in lines[0]
                and "(ipa-probe probe --seed 3 --out X)" in lines[0]
            )
            assert result["heavy"] == [], f"{case.name} loaded {result['heavy']} before refusing"
        assert sorted(p.name for p in out.iterdir()) == [".ipa_probe-staging", ".ipa_probe.lock"]  # untouched
    finally:
        holder.kill()
        holder.wait()


def test_two_writers_started_together_end_with_one_whole_run_and_one_refusal(tmp_path, zygote):
    out = tmp_path / "out"
    first = _start(zygote, [*ARGS, "--seed", "1", "--overwrite", "--out", str(out)])
    second = _start(zygote, [*ARGS, "--seed", "2", "--overwrite", "--out", str(out)])
    procs = {1: first, 2: second}
    ended = []
    while len(ended) < 2:
        for seed, proc in procs.items():
            if seed not in ended and proc.poll() is not None:
                ended.append(seed)
        time.sleep(0.05)
    loser, winner = procs[ended[0]], procs[ended[1]]
    loser_err = loser.communicate()[1]
    assert (loser.returncode, winner.returncode) == (2, 0), loser_err
    lines = loser_err.strip().splitlines()
    assert len(lines) == 1 and f"in use by process {winner.pid}" in lines[0] and "ipa-probe probe --kind" in lines[0]
    record = _whole(out)
    assert record["settings"]["seed"] == ended[1]  # the winner's run, whole; nothing of the loser's
    assert not (out / STAGING_NAME).exists()


#: (signal, what the folder shows when it is sent): the lock taken (before the model loads), the staging folder made
#: (the model loading or the generation running), the first image staged, the table staged (the writes under way)
MOMENTS = [
    ("SIGKILL", "lock"),
    ("SIGINT", "staging"),
    ("SIGKILL", "staging/image_0.png"),
    ("SIGINT", "staging/probe.parquet"),
]


def _reached(out: Path, moment: str) -> bool:
    if moment == "lock":
        lock = out / ".ipa_probe.lock"
        return lock.exists() and lock.stat().st_size > 0
    return (out / moment.replace("staging", STAGING_NAME)).exists()


@pytest.mark.slow
def test_an_overwrite_killed_at_any_moment_leaves_one_whole_run(tmp_path, zygote):
    from ipa_probe.cli import main

    out = tmp_path / "out"
    assert main([*ARGS, "--seed", "1", "--out", str(out)]) == 0  # the previous run (in this process: no start-up)
    old = _whole(out)
    old_bytes = {n: (out / n).read_bytes() for n in old["files"]}
    for name, moment in MOMENTS:
        proc = _start(zygote, [*ARGS, "--seed", "2", "--overwrite", "--out", str(out)])
        while proc.poll() is None and not _reached(out, moment):
            time.sleep(0.005)
        proc.send_signal(getattr(signal, name))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode in (-signal.SIGKILL, 130), (moment, proc.returncode, err)  # stopped mid-run
        with output_lock(out, "the test"):  # what the next writer does first: finish a commit a kill cut short
            recover(out)
        record = _whole(out)
        assert record["run_id"] == old["run_id"]  # stopped before its commit: the previous run, exactly
        assert {n: (out / n).read_bytes() for n in record["files"]} == old_bytes
        if name == "SIGINT":
            lines = err.strip().splitlines()
            assert "Traceback" not in err and lines[-1].startswith("ipa-probe probe: interrupted; "), err
            assert f"{out} is as it was before this run (run {old['run_id']}, finished)" in lines[-1]
    assert main([*ARGS, "--seed", "2", "--overwrite", "--out", str(out)]) == 0
    record = _whole(out)
    assert record["settings"]["seed"] == 2 and not (out / STAGING_NAME).exists()
    listed = set(record["files"]) | {MANIFEST_NAME, ".ipa_probe.lock"}
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == listed  # nothing else left
