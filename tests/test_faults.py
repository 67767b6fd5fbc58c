"""The fault suite: killed runs resume to identical output, nothing finished is lost to a run that stops, rows fail
alone, one writer per output folder, and bad values stop with one line before the pipeline runs."""

from __future__ import annotations

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
from helpers import Counting, runner_for, write_jsonl
from PIL import Image

from ipa_probe._io import LOCK_NAME, OutputLocked, check_launch_holds, output_lock
from ipa_probe.cli import main
from ipa_probe.experiments.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ipa_probe.images import load_image
from ipa_probe.sweep import (
    ManifestRow,
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


@pytest.fixture
def workdir(tmp_path) -> Path:
    (tmp_path / "refs").mkdir()
    for i, image in enumerate(default_reference_images(3)):
        image.save(tmp_path / "refs" / f"{i}.png")
    write_jsonl(tmp_path / "m.jsonl", ROWS)
    return tmp_path


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


@pytest.fixture
def reference(workdir, pipe, one_thread) -> Path:
    """The three rows run once, uninterrupted."""
    manifest = read_manifest(workdir / "m.jsonl")
    out = workdir / "reference"
    run_sweep(manifest, runner_for(pipe), out, progress=False, n_resamples=99)
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
def test_a_killed_sweep_resumes_to_identical_output(workdir, pipe, reference, one_thread, caplog):
    out = workdir / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SWEEP, str(workdir / "m.jsonl"), str(out)], capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
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
def test_a_killed_training_run_resumes_to_the_same_weights(tmp_path, one_thread):
    from ipa_probe.experiments.model import ModelConfig
    from ipa_probe.experiments.tasks import make_meta
    from ipa_probe.experiments.training import TrainConfig, train

    proc = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINING, str(tmp_path / "b")], capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
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


def test_a_refused_rerun_deletes_nothing(workdir, reference, one_thread, capsys):
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
    assert len(SweepLayout(out).parts()) == 2 and not SweepLayout(out).temp_files()
    assert not (out / LOCK_NAME).read_text()  # released


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


def test_argument_errors_and_help_do_not_import_torch():
    code = (
        "import sys; from ipa_probe.cli import main; rc = main(['probe', '--seed', '-1']); "
        "print(rc, 'torch' in sys.modules, 'diffusers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    helped = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from ipa_probe.cli import main\ntry: main(['--help'])\nexcept "
            "SystemExit: print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.stdout.strip().endswith("False") and "exit codes" in helped.stdout


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
