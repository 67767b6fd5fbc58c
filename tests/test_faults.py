"""The fault suite: killed runs resume to identical output, nothing finished is lost to a run that stops, rows fail
alone, one writer per output folder, and bad values stop with one line before the pipeline runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import Counting, pinned_threads, runner_for, write_jsonl
from PIL import Image

from ipa_probe._io import LOCK_NAME, OutputLocked, check_launch_holds, output_lock
from ipa_probe.cli import main
from ipa_probe.experiments.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ipa_probe.experiments.training import TrainConfig
from ipa_probe.images import load_image
from ipa_probe.runfolder import STAGING_NAME
from ipa_probe.sweep import (
    ManifestRow,
    RowInputError,
    SweepLayout,
    SweepRunner,
    aggregate,
    load_table,
    read_manifest,
    run_sweep,
)
from ipa_probe.sweep.aggregation import row_summary
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline

STEPS = 2
ROWS = [
    {"prompt": "a cat", "images": ["refs/0.png", "refs/1.png"], "seed": 1},
    {"prompt": "a dog", "images": "refs/2.png", "seed": 2, "scale": 0.5},
    {"prompt": "a tree", "images": "refs/1.png", "seed": 3},
]
CLI = ["--steps", str(STEPS), "--no-progress", "--resamples", "99"]


def _workdir(folder: Path) -> Path:
    (folder / "refs").mkdir()
    for i, image in enumerate(default_reference_images(3)):
        image.save(folder / "refs" / f"{i}.png")
    write_jsonl(folder / "m.jsonl", ROWS)
    return folder


@pytest.fixture
def workdir(tmp_path) -> Path:
    return _workdir(tmp_path)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=0)


class Poisoned(SweepRunner):
    """Test double: the pipeline raises inside row 1 (as a CUDA error or a bad value deep in diffusers would)."""

    def run_row(self, row):
        if row.row == 1:
            raise RuntimeError("CUDA error: an illegal memory access\nsecond line of the traceback")
        return super().run_row(row)


def derived_bytes(out: Path) -> dict[str, bytes]:
    layout = SweepLayout(out)
    files = [layout.aggregate, layout.row_summary, layout.summary, layout.plot, *layout.parts()]
    return {p.name: p.read_bytes() for p in files}


def assert_same_results(a: Path, b: Path) -> None:
    pd.testing.assert_frame_equal(load_table(a), load_table(b))
    pd.testing.assert_frame_equal(pd.read_parquet(a / "aggregate.parquet"), pd.read_parquet(b / "aggregate.parquet"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pipe) -> Path:
    """The three rows run once, uninterrupted, from a work folder of their own (the same images and manifest as each
    test's ``workdir``), once per module: the tests only read it."""
    workdir = _workdir(tmp_path_factory.mktemp("reference"))
    out = workdir / "reference"
    with contextlib.contextmanager(pinned_threads)(1):  # one torch thread, as the tests
        run_sweep(read_manifest(workdir / "m.jsonl"), runner_for(pipe), out, progress=False, n_resamples=99)
    return out


# ------------------------------------------------------------------------------------------------ killed runs

KILLED_SWEEP = """
import os, signal, sys, torch
torch.set_num_threads(1)
from ipa_probe.sweep import RowDefaults, SweepRunner, read_manifest, run_sweep
from ipa_probe.tiny.sd import tiny_pipeline

class KillAt(SweepRunner):
    def run_row(self, row):
        if row.row == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
        return super().run_row(row)

runner = KillAt(tiny_pipeline(seed=0), RowDefaults(steps=2), call_kwargs={"height": 64, "width": 64},
                settings={"model": "tiny"})
run_sweep(read_manifest(sys.argv[1]), runner, sys.argv[2], progress=False, n_resamples=99)
"""


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_identical_output(workdir, pipe, reference, one_thread, caplog, zygote):
    out = workdir / "killed"
    proc = zygote.start(KILLED_SWEEP, [str(workdir / "m.jsonl"), str(out)])  # a fresh process (tests/forked.py)
    assert proc.wait(300) == -signal.SIGKILL, proc.communicate()[1][-2000:]
    layout = SweepLayout(out)
    assert [p.name for p in layout.parts()] == ["row-000000.parquet", "row-000001.parquet"]
    assert (out / LOCK_NAME).read_text()  # the dead run's lock record is still there
    counting = runner_for(pipe, Counting)
    result = run_sweep(read_manifest(workdir / "m.jsonl"), counting, out, progress=False, n_resamples=99)
    assert counting.ran == [2] and (result.resumed, result.done) == (2, 3)
    assert "taking over the lock" in caplog.text  # the stale lock was recognised
    assert_same_results(out, reference)


KILLED_TRAINING = """
import os, signal, sys, torch
torch.set_num_threads(1)
from ipa_probe.experiments.model import ModelConfig
from ipa_probe.experiments.tasks import make_meta
from ipa_probe.experiments.training import TrainConfig, train

def kill(step, loss):
    if step == 5:
        os.kill(os.getpid(), signal.SIGKILL)

cfg = TrainConfig(steps=8, batch_tasks=4, n_target=16, m=5, m_max=12, warmup=3, checkpoint_every=3)
train(ModelConfig(2, 16, 2, 1), cfg, make_meta("mixed2d", 2), run_dir=sys.argv[1], progress=False, callback=kill)
"""


@pytest.mark.slow
def test_a_killed_training_run_resumes_to_the_same_weights(tmp_path, one_thread, zygote):
    from ipa_probe.experiments.model import ModelConfig
    from ipa_probe.experiments.tasks import make_meta
    from ipa_probe.experiments.training import TrainConfig, train

    proc = zygote.start(KILLED_TRAINING, [str(tmp_path / "b")])  # a fresh process (tests/forked.py)
    assert proc.wait(300) == -signal.SIGKILL, proc.communicate()[1][-2000:]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["checkpoint.safetensors"]  # no temp file left
    cfg = TrainConfig(steps=8, batch_tasks=4, n_target=16, m=5, m_max=12, warmup=3, checkpoint_every=3)
    model, meta = ModelConfig(2, 16, 2, 1), make_meta("mixed2d", 2)
    straight = train(model, cfg, meta, run_dir=tmp_path / "a", progress=False)
    resumed = train(model, cfg, meta, run_dir=tmp_path / "b", progress=False)
    assert resumed.resumed_from == 3 and resumed.losses == straight.losses
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------------------------------------ damaged parts


@pytest.mark.parametrize("damage", ["inside", "truncated"])
def test_a_damaged_part_is_rerun_alone_with_one_warning(workdir, pipe, reference, one_thread, caplog, damage):
    out = workdir / "damaged"
    manifest = read_manifest(workdir / "m.jsonl")
    run_sweep(manifest, runner_for(pipe), out, progress=False, n_resamples=99)
    part = SweepLayout(out).part(1)
    data = bytearray(part.read_bytes())
    if damage == "inside":  # flip bytes in the data pages; the footer (schema, metadata) stays intact
        for i in range(200, 260):
            data[i] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    part.write_bytes(bytes(data))
    counting = runner_for(pipe, Counting)
    result = run_sweep(manifest, counting, out, progress=False, n_resamples=99)
    assert counting.ran == [1] and result.done == 3
    warnings = [r.getMessage() for r in caplog.records if "running the row again" in r.getMessage()]
    assert len(warnings) == 1 and "row 1 (line 2)" in warnings[0] and "\n" not in warnings[0]
    assert [p.name for p in SweepLayout(out).set_aside.iterdir()] == ["row-000001.damaged.parquet"]
    assert_same_results(out, reference)


# ------------------------------------------------------------------------------------------------ nothing lost


def test_a_refused_rerun_deletes_nothing(workdir, one_thread, capsys):
    out = workdir / "cli"
    base = ["sweep", str(workdir / "m.jsonl"), "--out", str(out), *CLI]
    assert main(base) == 0
    before = derived_bytes(out)
    assert main([*base, "--steps", "3"]) == 2  # the last --steps wins
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0] and "Nothing was changed" in err[0]
    assert derived_bytes(out) == before  # aggregate, row summary, summary.json, plot and parts all intact


def test_rows_leaving_the_manifest_leave_rows_and_are_kept_aside(workdir, pipe, one_thread):
    out = workdir / "shrink"
    run_sweep(read_manifest(workdir / "m.jsonl"), runner_for(pipe), out, progress=False, n_resamples=99)
    shorter = read_manifest(write_jsonl(workdir / "short.jsonl", ROWS[:2]))
    result = run_sweep(shorter, runner_for(pipe, Counting), out, progress=False, n_resamples=99)
    assert result.done == 2 and sorted(pd.read_parquet(out / "rows")["row"].unique()) == [0, 1]
    assert [p.name for p in (out / "set_aside").iterdir()] == ["row-000002.not-in-manifest.parquet"]


def test_a_changed_image_reruns_the_rows_that_use_it(workdir, pipe, reference, one_thread):
    out = workdir / "changed"
    manifest = read_manifest(workdir / "m.jsonl")
    run_sweep(manifest, runner_for(pipe), out, progress=False, n_resamples=99)
    Image.new("RGB", (64, 64), (255, 0, 0)).save(workdir / "refs" / "1.png")  # same name, other pixels
    counting = runner_for(pipe, Counting)
    run_sweep(manifest, counting, out, progress=False, n_resamples=99)
    assert counting.ran == [0, 2]  # rows 0 and 2 use refs/1.png; row 1 does not
    assert not load_table(out, rows=[0]).equals(load_table(reference, rows=[0]))
    pd.testing.assert_frame_equal(load_table(out, rows=[1]), load_table(reference, rows=[1]))
    assert sorted(p.name for p in (out / "set_aside").iterdir()) == [
        "row-000000.images-changed.parquet",
        "row-000002.images-changed.parquet",
    ]


# ------------------------------------------------------------------------------------------------ rows fail alone


def test_a_poison_row_fails_alone_and_a_rerun_retries_only_it(workdir, pipe, reference, one_thread, caplog):
    out = workdir / "poison"
    manifest = read_manifest(workdir / "m.jsonl")
    result = run_sweep(manifest, runner_for(pipe, Poisoned), out, progress=False, n_resamples=99)
    assert result.done == 2 and [(f.row, f.line) for f in result.failed] == [(1, 2)]
    assert result.failed[0].reason == "RuntimeError: CUDA error: an illegal memory access"  # one line
    record = json.loads((out / "summary.json").read_text())
    assert record["failed"] == [
        {"row": 1, "line": 2, "reason": result.failed[0].reason, "stage": "run", "kept_part": False}
    ]
    assert record["rows"]["failed"] == 1 and (pd.read_parquet(out / "aggregate.parquet")["rows"] == 2).all()
    assert any("line 2 (row 1) failed" in r.getMessage() for r in caplog.records)
    counting = runner_for(pipe, Counting)
    again = run_sweep(manifest, counting, out, progress=False, n_resamples=99)
    assert counting.ran == [1] and not again.failed and not list((out / "skipped").iterdir())
    assert_same_results(out, reference)


def test_rows_the_pipeline_would_reject_fail_alone_with_exit_3(workdir, one_thread, capsys):
    rows = [ROWS[0], {"images": "refs/2.png", "steps": 1000}, {"images": "refs/2.png", "steps": 5000}, ROWS[2]]
    rows.append({"images": "refs/0.png", "seed": 2**64})
    out = workdir / "reject"
    assert main(["sweep", str(write_jsonl(workdir / "r.jsonl", rows)), "--out", str(out), *CLI]) == 3
    record = json.loads((out / "summary.json").read_text())
    failed = {f["line"]: (f["reason"], f["stage"]) for f in record["failed"]}
    assert sorted(failed) == [2, 3, 5] and "use at most 999 steps" in failed[2][0] and "more than" in failed[3][0]
    assert "seed" in failed[5][0] and failed[5][1] == "manifest"  # out of range: rejected when read
    assert record["rows"]["done"] == 2 and "2 failed while running" in capsys.readouterr().out


def test_an_image_over_pils_pixel_limit_fails_its_row_alone(workdir, monkeypatch):
    width, height = Image.open(workdir / "refs" / "1.png").size
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", width * height)
    Image.new("L", (2 * width, 2 * height)).save(workdir / "refs" / "big.png")  # 4x the limit: PIL's bomb error
    Image.new("L", (width + 8, height)).save(workdir / "refs" / "large.png")  # above the limit: PIL's warning
    rows = [ROWS[2], {"images": "refs/big.png"}, {"images": ["refs/large.png"]}]
    manifest = read_manifest(write_jsonl(workdir / "bomb.jsonl", rows))
    assert [r.row for r in manifest.rows] == [0]
    assert all("larger than PIL's limit" in s.reason and "\n" not in s.reason for s in manifest.skipped)
    for skip in manifest.skipped:  # one limit quoted (PIL's own messages name 1x and 2x), and the image's size
        assert f"{width * height:,}" in skip.reason and f"{2 * width * height:,}" not in skip.reason
    assert f"{4 * width * height:,} pixels" in manifest.skipped[0].reason
    with pytest.raises(ValueError, match="MAX_IMAGE_PIXELS"):
        load_image(workdir / "refs" / "big.png")


def test_ctrl_c_ends_with_one_line_exit_130_and_keeps_finished_rows(workdir, monkeypatch, one_thread, capsys):
    original = SweepRunner.run_row

    def interrupt_at_row_2(self, row):
        if row.row == 2:
            raise KeyboardInterrupt
        return original(self, row)

    monkeypatch.setattr(SweepRunner, "run_row", interrupt_at_row_2)
    out = workdir / "ctrl-c"
    assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *CLI]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and "resume" in err[0]
    staged = SweepLayout(out / STAGING_NAME)  # the finished rows, aside until the sweep is whole
    assert len(staged.parts()) == 2 and not staged.temp_files() and not (out / "rows").exists()
    assert not (out / LOCK_NAME).read_text()  # released
    monkeypatch.undo()
    assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *CLI]) == 0  # resumed from them
    assert len(SweepLayout(out).parts()) == len(ROWS) and not (out / STAGING_NAME).exists()


# ------------------------------------------------------------------------------------------------ rows without results


def test_a_row_the_manifest_check_rejects_counts_as_failed(workdir, one_thread, capsys):
    rows = [ROWS[2], {"prompt": "gone", "images": "refs/missing.png", "seed": 5}]
    out = workdir / "rejected"
    assert main(["sweep", str(write_jsonl(workdir / "one_bad.jsonl", rows)), "--out", str(out), *CLI]) == 3
    line = capsys.readouterr().out.strip()
    assert line.startswith("sweep: 1/2 rows done") and "1 failed (line 2: 1 rejected by the checks before" in line
    record = json.loads((out / "summary.json").read_text())
    [failed] = record["failed"]
    assert (failed["row"], failed["line"], failed["stage"], failed["kept_part"]) == (1, 2, "manifest", False)
    assert "does not exist" in failed["reason"] and "\n" not in failed["reason"]
    assert (record["rows"]["manifest"], record["rows"]["done"], record["rows"]["failed"]) == (2, 1, 1)


def test_a_finished_row_whose_image_goes_missing_keeps_its_part(workdir, pipe, reference, one_thread):
    out = workdir / "missing"
    manifest = read_manifest(workdir / "m.jsonl")
    run_sweep(manifest, runner_for(pipe), out, progress=False, n_resamples=99)
    part = SweepLayout(out).part(1)  # row 1 alone uses refs/2.png
    before = part.read_bytes()
    (workdir / "refs" / "2.png").rename(workdir / "2.png.away")
    counting = runner_for(pipe, Counting)
    result = run_sweep(read_manifest(workdir / "m.jsonl"), counting, out, progress=False, n_resamples=99)
    assert counting.ran == [] and result.done == 2
    [failed] = result.failed
    assert (failed.row, failed.line, failed.stage, failed.kept_part) == (1, 2, "manifest", True)
    assert "does not exist" in failed.reason and "its finished part is kept" in failed.describe()
    assert part.read_bytes() == before and not SweepLayout(out).set_aside.exists()  # kept in place, not set aside
    assert (pd.read_parquet(out / "aggregate.parquet")["rows"] == 2).all()  # left out of the aggregate
    (workdir / "2.png.away").rename(workdir / "refs" / "2.png")  # back, unchanged: counts again, without running
    again = run_sweep(read_manifest(workdir / "m.jsonl"), counting, out, progress=False, n_resamples=99)
    assert counting.ran == [] and (again.done, again.resumed, again.failed) == (3, 3, [])
    assert_same_results(out, reference)


def test_a_finished_row_whose_images_cannot_be_read_keeps_its_part(workdir, pipe, reference, one_thread):
    """Its images passed the manifest check but cannot be hashed now (e.g. permission lost between the two)."""
    out = workdir / "unreadable"
    manifest = read_manifest(workdir / "m.jsonl")
    run_sweep(manifest, runner_for(pipe), out, progress=False, n_resamples=99)

    class Unreadable(Counting):
        def inputs(self, row):
            if row.row == 0:
                raise RowInputError("image 'refs/0.png' cannot be read (Permission denied)")
            return super().inputs(row)

    runner = runner_for(pipe, Unreadable)
    result = run_sweep(manifest, runner, out, progress=False, n_resamples=99)
    assert runner.ran == [] and [(f.row, f.stage, f.kept_part) for f in result.failed] == [(0, "manifest", True)]
    assert "Permission denied" in result.failed[0].reason and SweepLayout(out).part(0).is_file()
    pd.testing.assert_frame_equal(load_table(out, rows=[0]), load_table(reference, rows=[0]))


# ------------------------------------------------------------------------------------------------ one writer


HOLD_LOCK = """
import sys, time
from ipa_probe._io import output_lock
with output_lock(sys.argv[1], "holder"):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_second_run_on_a_held_folder_exits_2_naming_the_holder(workdir, capsys):
    out = workdir / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["sweep", str(workdir / "m.jsonl"), "--out", str(out), *CLI]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"process {holder.pid} on" in err[0] and "in use" in err[0]
        assert main(["experiments", "collapse", "--tier", "quick", "--out", str(out), "--no-progress"]) == 2
        assert f"process {holder.pid}" in capsys.readouterr().err
        assert not (out / "rows").exists()  # the refused sweep wrote nothing
    finally:
        holder.kill()
        holder.wait()
    with output_lock(out, "after"):  # the holder died: its lock is free again
        pass


def test_a_nested_hold_closed_after_the_outer_one_ends_quietly(tmp_path):
    """An interrupt between a nested block's entry and its exit's registration leaves it to the collector."""
    import gc

    unraised = []
    hook, sys.unraisablehook = sys.unraisablehook, unraised.append
    try:
        with output_lock(tmp_path, "outer"):
            inner = output_lock(tmp_path, "inner", reentrant=True)
            inner.__enter__()  # never exited: what enter_context leaves when KeyboardInterrupt lands in between
        del inner
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraised == []
    with output_lock(tmp_path, "after"):  # free again, and held afresh
        pass


def test_processes_of_another_launch_do_not_share_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with output_lock(tmp_path, "launch A"):
        check_launch_holds(tmp_path)  # a process of the same launch
        monkeypatch.setenv("MASTER_PORT", "29501")
        with pytest.raises(OutputLocked, match="not by this launch"):
            check_launch_holds(tmp_path)


def test_unique_temp_names_let_two_writers_of_one_file_coexist(tmp_path):
    from ipa_probe._io import atomic_path

    target = tmp_path / "x.json"
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b
        a.write_text("a")
        b.write_text("b")
    assert target.read_text() == "a" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, "truncated"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "checkpoint.safetensors"
    save_checkpoint({"w": torch.arange(100.0), "step": 3, "betas": (0.9, 0.999)}, path)
    assert load_checkpoint(path)["betas"] == (0.9, 0.999)
    path.write_bytes(path.read_bytes()[:60] if content == "truncated" else content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value) and "delete it" in str(err.value)


def _damage(name: str, state: dict) -> None:
    if name == "step missing":
        del state["step"]
    elif name == "step a string":
        state["step"] = str(state["step"])
    elif name == "model_config changed":
        state["model_config"]["d_model"] *= 2
    elif name == "weights of another shape":
        key = next(iter(state["model"]))
        state["model"][key] = torch.zeros(3)
    elif name == "losses cut short":
        state["losses"] = state["losses"][:1]
    elif name == "generator of another form":
        state["generator"] = torch.zeros(7, dtype=torch.uint8)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny training run: its configurations and its checkpoint record."""
    from ipa_probe.experiments.model import ModelConfig
    from ipa_probe.experiments.tasks import make_meta
    from ipa_probe.experiments.training import CHECKPOINT, TrainConfig, train

    folder = tmp_path_factory.mktemp("run")
    model, cfg = ModelConfig(2, 16, 2, 1), TrainConfig(steps=4, batch_tasks=4, n_target=16, m=5, warmup=2)
    meta = make_meta("mixed2d", 2)
    with torch.random.fork_rng():
        train(model, cfg, meta, run_dir=folder, progress=False)
    return model, cfg, meta, load_checkpoint(folder / CHECKPOINT)


@pytest.mark.parametrize(
    "damage",
    [
        "step missing",
        "step a string",
        "model_config changed",
        "weights of another shape",
        "losses cut short",
        "generator of another form",
    ],
)
def test_a_checkpoint_of_the_wrong_structure_is_refused_before_use(tmp_path, finished_run, damage):
    import copy

    from ipa_probe.experiments.training import CHECKPOINT, load_model, train

    model, cfg, meta, state = finished_run
    state = copy.deepcopy(state)
    _damage(damage, state)
    path = save_checkpoint(state, tmp_path / CHECKPOINT)
    resume = TrainConfig(**{**cfg.to_dict(), "steps": cfg.steps})  # the same run: resuming reads it
    for attempt in (
        lambda: load_model(tmp_path, model, cfg),
        lambda: load_model(tmp_path),
        lambda: train(model, resume, meta, run_dir=tmp_path, progress=False),
    ):
        with pytest.raises(CheckpointError) as err:
            attempt()
        message = str(err.value)
        assert str(path) in message and "\n" not in message and "delete it to train that model again" in message


def test_a_checkpoint_error_in_experiments_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from ipa_probe.experiments import runner

    def damaged(run_dir, *configs):
        raise CheckpointError(f"checkpoint '{run_dir}/checkpoint.safetensors' has no 'step'; delete it to train again")

    monkeypatch.setattr(runner, "load_model", damaged)
    assert main(["experiments", "collapse", "--tier", "quick", "--out", str(tmp_path), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "has no 'step'" in lines[0] and lines[0].startswith("ipa-probe experiments: error:")


def test_experiments_refuse_a_folder_of_another_tier(tmp_path):
    from ipa_probe.experiments import get_tier, run_experiments
    from ipa_probe.experiments.tiers import TierMismatch

    smoke = json.loads(json.dumps(get_tier("smoke").to_dict()))
    (tmp_path / "shells").mkdir()
    (tmp_path / "shells" / "record.json").write_text(json.dumps({"tier": smoke}))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(TierMismatch, match="holds results of tier 'smoke'"):
        run_experiments(["collapse"], get_tier("quick"), tmp_path, progress=False)
    quick_more_seeds = get_tier("smoke").with_overrides(seeds=(0, 1, 2, 3, 4, 5, 6))
    with pytest.raises(TierMismatch, match=r"tier 'smoke' with other sizes \(seeds\)"):
        run_experiments(["collapse"], quick_more_seeds, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted([*before, ".ipa_probe.lock"])  # nothing else


def test_a_pickled_checkpoint_is_never_unpickled(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    path = tmp_path / "checkpoint.safetensors"
    torch.save({"x": Boom()}, path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**64)], "--seed"),
        (["--scale", "nan"], "--scale"),
        (["--scale", "-1"], "--scale"),
        (["--guidance-scale", "nan"], "--guidance-scale"),
        (["--guidance-scale", "inf"], "--guidance-scale"),
        (["--steps", "0"], "--steps"),
        (["--steps", "1000"], "use at most 999 steps"),
        (["--bandwidth", "1e300"], "--bandwidth"),
        (["--bandwidth", "nan"], "--bandwidth"),
        (["--device", "meta"], "cannot run a pipeline"),
        (["--device", "cuda:7"] if not torch.cuda.device_count() > 7 else ["--device", "meta"], "--device"),
        (["--device", "mps"] if not torch.backends.mps.is_available() else ["--device", "meta"], "--device"),
        (["--size", "60", "60"], "--size"),
    ],
)
@pytest.mark.parametrize("command", ["probe", "sweep"])
def test_bad_values_exit_2_with_one_line_and_no_output_folder(workdir, capsys, command, argv, message):
    out = workdir / "never"
    head = [command, str(workdir / "m.jsonl")] if command == "sweep" else [command]
    assert main([*head, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_manifest_that_is_a_folder_is_named_as_such(workdir, capsys):
    assert main(["sweep", str(workdir / "refs"), "--out", str(workdir / "never")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_summary_records_every_setting(workdir, one_thread):
    out = workdir / "settings"
    argv = ["sweep", str(workdir / "m.jsonl"), "--out", str(out), *CLI]
    argv += ["--scale", "0.7", "--guidance-scale", "3", "--size", "64", "64"]
    assert main(argv) == 0
    arguments = json.loads((out / "summary.json").read_text())["run"]["arguments"]
    assert (arguments["scale"], arguments["guidance_scale"], arguments["size"]) == (0.7, 3.0, [64, 64])
    assert arguments["steps"] == STEPS and arguments["bandwidth"] == "matched" and arguments["resamples"] == 99


# ------------------------------------------------------------------------------------------------ images, numbers


def test_16_bit_grayscale_keeps_its_brightness(tmp_path):
    values = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(values).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode.startswith("I")
    rgb = np.asarray(load_image(tmp_path / "gray16.png"))
    expected = np.rint(values.astype(np.float64) * 255 / 65535).astype(np.uint8)
    assert rgb.shape == (64, 64, 3) and np.array_equal(rgb[..., 0], expected) and np.array_equal(rgb[..., 2], expected)


def test_rows_with_non_finite_cells_are_not_averaged_as_full_rows(pipe, one_thread):
    runner = runner_for(pipe, default_images=default_reference_images(2))
    table = runner.run_row(ManifestRow(row=0, line=1, seed=0))
    layers = sorted(table["layer"].unique())
    broken = table.copy()
    broken.loc[broken["layer"] != layers[0], ["spearman", "pearson"]] = np.nan  # all layers but one lost
    broken["row"] = 1
    good_summary, broken_summary = row_summary(table), row_summary(broken)
    cells = broken.groupby(["step", "branch"])["spearman"].apply(lambda s: int(s.isna().sum()))
    merged = broken_summary.set_index(["step", "branch"])["cells_nonfinite"]
    assert merged.sort_index().tolist() == cells.sort_index().tolist() and (merged > 0).all()
    agg = aggregate(pd.concat([good_summary, broken_summary]), n_resamples=99)
    assert (agg["rows"] == 1).all() and (agg["rows_partial"] == 1).all()
    cond = agg[agg["branch"] == "cond"].set_index("timestep")["spearman"]
    alone = good_summary[good_summary["branch"] == "cond"].set_index("timestep")["spearman"]
    np.testing.assert_allclose(cond.sort_index(), alone.sort_index())  # only the full row is averaged


def test_the_lock_records_its_holder(tmp_path):
    with output_lock(tmp_path, "ipa-probe test"):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["command"] == "ipa-probe test" and record["host"]
        assert record["started"] <= time.time()


# ------------------------------------------------------------------ issue 31: never touch what is not ours


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every file under ``folder`` with its bytes (links by target, FIFOs by kind: never opened)."""
    import stat

    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            found[str(path.relative_to(folder))] = f"link -> {os.readlink(path)}"
        elif stat.S_ISREG(mode):
            found[str(path.relative_to(folder))] = path.read_bytes()
        elif stat.S_ISFIFO(mode):
            found[str(path.relative_to(folder))] = "fifo"
    return found


@pytest.mark.parametrize("planted", ["symlink", "fifo", "dangling symlink"])
def test_the_lock_never_follows_a_link_or_opens_a_special_file(tmp_path, planted):
    from ipa_probe._io import NotOurs

    notes = tmp_path / "notes"
    notes.write_text("the user's notes\n")
    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_NAME
    {"symlink": lambda: lock.symlink_to(notes), "fifo": lambda: os.mkfifo(lock)}.get(
        planted, lambda: lock.symlink_to(tmp_path / "would_be_created")
    )()
    before = snapshot(tmp_path)
    with pytest.raises(NotOurs, match="stands where an output file belongs"):
        with output_lock(out, "test"):
            pytest.fail("the lock was taken")
    assert snapshot(tmp_path) == before and notes.read_text() == "the user's notes\n"


@pytest.mark.parametrize("command", ["sweep", "experiments", "train-digits"])
def test_a_lock_linked_to_the_users_file_is_refused_with_exit_1(workdir, capsys, command):
    notes = workdir / "notes"
    notes.write_text("the user's notes\n")
    out = workdir / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(notes)
    before = snapshot(workdir)
    argv = {"sweep": ["sweep", str(workdir / "m.jsonl"), *CLI], "experiments": ["experiments", "collapse"]}
    assert main([*argv.get(command, [command]), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{out / LOCK_NAME}': a symbolic link stands where an output file belongs" in err[0]
    assert "move it away or write to another --out" in err[0]
    assert snapshot(workdir) == before


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_an_output_file_never_replaces_a_link_or_special_file(tmp_path, planted):
    from ipa_probe._io import NotOurs, write_json

    notes = tmp_path / "notes"
    notes.write_text("the user's notes\n")
    target = tmp_path / "summary.json"
    target.symlink_to(notes) if planted == "symlink" else os.mkfifo(target)
    before = snapshot(tmp_path)
    with pytest.raises(NotOurs, match="summary.json"):
        write_json(target, {"a": 1})
    assert snapshot(tmp_path) == before  # no temp file left either


def test_a_temp_name_taken_by_a_planted_link_is_never_written_through(tmp_path, monkeypatch):
    """The temp file is created new (O_EXCL | O_NOFOLLOW) before the writer opens it."""
    import uuid

    from ipa_probe._io import write_atomic

    class Fixed:
        hex = "0123456789abcdef"

    monkeypatch.setattr(uuid, "uuid4", lambda: Fixed)
    notes = tmp_path / "notes"
    notes.write_text("the user's notes\n")
    (tmp_path / f".out.txt.{os.getpid()}-01234567.tmp").symlink_to(notes)
    before = snapshot(tmp_path)
    with pytest.raises(OSError, match="out.txt"):
        write_atomic(tmp_path / "out.txt", "ours")
    assert snapshot(tmp_path) == before


def test_a_quoted_tilde_means_home_for_the_outputs_and_the_tracker_logs(workdir, monkeypatch, one_thread):
    home, elsewhere = workdir / "home", workdir / "cwd"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    argv = ["sweep", str(workdir / "m.jsonl"), "--out", "~/sw", "--log-with", "tensorboard", *CLI]
    assert main(argv) == 0
    assert (home / "sw" / "summary.json").is_file() and any((home / "sw" / "logs").rglob("events.out.tfevents.*"))
    assert list(elsewhere.iterdir()) == []  # no literal ./~/sw


def test_a_manifest_image_that_cannot_be_read_fails_its_row_naming_the_remedy(workdir, monkeypatch, one_thread):
    """chmod 000 stops a user but not root: as root, os.access is answered as the kernel answers a user."""
    image = workdir / "refs" / "2.png"
    image.chmod(0)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == image else real(p, mode, **k))
    try:
        manifest = read_manifest(workdir / "m.jsonl")
    finally:
        image.chmod(0o644)
    (skipped,) = manifest.skipped
    assert skipped.row == 1 and f"'{image}': Permission denied" in skipped.reason and "chmod" in skipped.reason
    assert "not an image" not in skipped.reason


def test_the_max_refs_bound_is_the_rarest_training_digit():
    """Recounted from scikit-learn's digits (the first TRAIN_SIZE train the organism), not from our constant."""
    from sklearn.datasets import load_digits

    from ipa_probe._checks import DIGITS_SMALLEST_CLASS
    from ipa_probe.tiny.digits import DigitsTrainConfig
    from ipa_probe.tiny.digits.data import TRAIN_SIZE
    from ipa_probe.tiny.digits.train_ip import DigitsAdapterConfig

    assert DIGITS_SMALLEST_CLASS == np.bincount(load_digits().target[:TRAIN_SIZE]).min()
    DigitsTrainConfig(max_refs=DIGITS_SMALLEST_CLASS - 1)  # the largest that draws from the data
    DigitsAdapterConfig(max_refs=DIGITS_SMALLEST_CLASS)
    with pytest.raises(ValueError, match="^max_refs: expected at most 145"):
        DigitsTrainConfig(max_refs=DIGITS_SMALLEST_CLASS)
    with pytest.raises(ValueError, match="^max_refs: expected at most 146"):
        DigitsAdapterConfig(max_refs=DIGITS_SMALLEST_CLASS + 1)


def test_batched_resamples_keep_the_default_intervals_and_bound_the_rest():
    """Up to one batch the default interval is drawn at once; beyond, in batches of the same draws (the test's own
    bootstrap-t over them); n_resamples is bounded (and checked)."""
    from test_sweep import own_bootstrap_t

    from ipa_probe.sweep.aggregation import RESAMPLE_BATCH, bootstrap_ci

    x = np.random.default_rng(3).normal(size=40)
    assert RESAMPLE_BATCH >= 9999
    assert bootstrap_ci(x, 0.95, 9999) == pytest.approx(own_bootstrap_t(x, 0.95, 0, [9999]), abs=1e-12)
    batches = [RESAMPLE_BATCH, RESAMPLE_BATCH, 25_000 - 2 * RESAMPLE_BATCH]
    assert bootstrap_ci(x, 0.95, 25_000) == pytest.approx(own_bootstrap_t(x, 0.95, 0, batches), abs=1e-12)
    with pytest.raises(ValueError, match="^n_resamples"):
        aggregate(pd.DataFrame(), n_resamples=10**9)
