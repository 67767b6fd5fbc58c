"""Sweeps: manifests and their bad rows, the row runner, the resumable Parquet dataset, aggregation, the CLI, and
two processes under `accelerate launch` giving the single-process table."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import Counting, runner_for, write_jsonl

from ipa_probe.cli import main
from ipa_probe.sweep import (
    ManifestError,
    SweepLayout,
    SweepRunner,
    aggregate,
    bootstrap_ci,
    load_table,
    plot_aggregate,
    read_manifest,
    row_summary,
    run_sweep,
    write_part,
)
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline

STEPS = 2
MANIFEST_4 = [
    {"prompt": "a cat", "images": ["refs/0.png", "refs/1.png"], "seed": 1},
    {"prompt": "a dog", "images": "refs/2.png", "seed": 2, "scale": 0.5},
    {"prompt": "a tree", "images": "refs", "seed": 3, "bandwidth": 2.5},
    {"images": ["refs/1.png", "refs/2.png"], "steps": 3},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder with refs/{0,1,2}.png, a non-image refs_bad/bad.png and a truncated PNG."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "refs").mkdir()
    for i, image in enumerate(default_reference_images(3)):
        image.save(root / "refs" / f"{i}.png")
    (root / "refs_bad").mkdir()
    (root / "refs_bad" / "bad.png").write_text("not an image")
    whole = (root / "refs" / "0.png").read_bytes()
    (root / "refs_bad" / "truncated.png").write_bytes(whole[: len(whole) // 3])  # header fine, pixels cut off
    return root


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(seed=0)


# ------------------------------------------------------------------------------------------------ manifests


def test_jsonl_and_csv_manifests_give_the_same_rows(workdir):
    jsonl = write_jsonl(workdir / "same.jsonl", MANIFEST_4)
    (workdir / "same.csv").write_text(
        "prompt,images,seed,scale,steps,bandwidth\n"
        "a cat,refs/0.png;refs/1.png,1,,,\n"
        "a dog,refs/2.png,2,0.5,,\n"
        "\n"
        "a tree,refs,3,,,2.5\n"
        ",refs/1.png | refs/2.png,,,3,\n"
    )
    a, b = read_manifest(jsonl), read_manifest(workdir / "same.csv")
    assert (a.format, b.format) == ("jsonl", "csv")
    assert not a.skipped and not b.skipped
    strip = lambda m: [(r.row, r.prompt, r.images, r.seed, r.scale, r.steps, r.bandwidth) for r in m.rows]
    assert strip(a) == strip(b)
    refs = workdir / "refs"
    assert a.rows[0].images == (str(refs / "0.png"), str(refs / "1.png"))  # relative to the manifest's folder
    assert a.rows[2].images == tuple(str(refs / f"{i}.png") for i in range(3))  # a folder, sorted
    assert a.rows[2].bandwidth == 2.5 and a.rows[1].scale == 0.5 and a.rows[3].prompt is None
    assert [r.line for r in b.rows] == [2, 3, 5, 6]  # the blank line still counts


def test_bad_rows_are_skipped_with_their_line_numbers(workdir):
    lines = [
        {"prompt": "ok", "images": "refs/0.png"},
        "",
        {"prompt": "gone", "images": "refs/missing.png"},
        {"prompt": "not an image", "images": "refs_bad/bad.png"},
        {"prompt": "typo", "imgs": "refs/0.png"},
        {"images": "refs/0.png", "seed": -1},
        {"images": "refs/0.png", "steps": 0},
        {"images": "refs/0.png", "bandwidth": "wide"},
        {"images": "refs/0.png", "scale": "high"},
        '{"prompt": "broken json"',
        '["a", "list"]',
        {"prompt": "also ok", "images": ["refs/1.png"], "seed": 7},
    ]
    manifest = read_manifest(write_jsonl(workdir / "bad.jsonl", lines))
    assert [(r.row, r.line) for r in manifest.rows] == [(0, 1), (10, 12)]
    skipped = {s.line: (s.row, s.reason) for s in manifest.skipped}
    assert sorted(skipped) == list(range(3, 12))
    expected = {
        3: "does not exist",
        4: "cannot be read",
        5: "unknown key(s) 'imgs'",
        6: "seed",
        7: "steps",
        8: "bandwidth",
        9: "scale",
        10: "not valid JSON",
        11: "JSON object",
    }
    for line, fragment in expected.items():
        assert fragment in skipped[line][1], (line, skipped[line])
    assert skipped[3][0] == 1  # row indices count rows, not lines
    assert manifest.total == 11


def test_csv_rows_with_the_wrong_number_of_cells_are_skipped(workdir):
    path = workdir / "cells.csv"
    path.write_text('prompt,images\n"a, quoted prompt",refs/0.png\ntoo,many,cells\n')
    manifest = read_manifest(path)
    assert [r.prompt for r in manifest.rows] == ["a, quoted prompt"]
    assert [(s.line, "3 cells" in s.reason) for s in manifest.skipped] == [(3, True)]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", "", "is empty"),
        ("blank.csv", "\n  \n", "is empty"),
        ("header_only.csv", "prompt,images\n", "no rows"),
        ("unknown_column.csv", "prompt,imgs\na,refs/0.png\n", "line 1: unknown column(s) 'imgs'"),
        ("notes.txt", "hello: world\nsteps: 3\n", "neither JSON Lines"),
        ("array.json", '[{"prompt": "a"}]\n', "JSON array"),
        ("garbage.jsonl", "this is not json\n", "not JSON Lines"),
        ("binary.jsonl", b"\xff\xfe\x00\x81\x00", "not UTF-8"),
        ("missing.jsonl", None, "does not exist"),
    ],
)
def test_unusable_manifests_stop_with_one_line_and_exit_2(workdir, tmp_path, capsys, name, content, message):
    path = workdir / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_manifest(path)
    capsys.readouterr()
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ipa-probe sweep: error:") and message in err[0]


def test_a_manifest_whose_rows_all_fail_exits_2(workdir, tmp_path, capsys):
    path = write_jsonl(workdir / "allbad.jsonl", [{"imgs": "x"}, {"images": "refs/missing.png"}])
    assert main(["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "none of its 2 rows can run" in err and "line 1" in err and "line 2" in err


# ------------------------------------------------------------------------------------------------ running rows


def test_a_row_depends_on_itself_only(workdir, pipe, one_thread):
    """Row 1 gives the same table after another row (other scale, seed, steps) as on its own: no state leaks."""
    manifest = read_manifest(write_jsonl(workdir / "order.jsonl", MANIFEST_4))
    runner = runner_for(pipe)
    first, second = manifest.rows[3], manifest.rows[1]
    after_other = (runner.run_row(first), runner.run_row(second))[1]
    alone = runner_for(tiny_pipeline(seed=0)).run_row(second)
    pd.testing.assert_frame_equal(after_other, alone)
    assert (after_other["row"] == 1).all() and (after_other["scale"] == 0.5).all() and (after_other["seed"] == 2).all()
    assert after_other["step"].nunique() == STEPS
    assert runner.run_row(first)["step"].nunique() == 3  # the row's own steps
    # a row without seed gets base seed + row index
    assert runner.resolve(first).seed == 0 + 3 and runner_for(pipe, seed=10).resolve(first).seed == 13


def test_write_part_is_atomic(tmp_path):
    path = tmp_path / "row-000000.parquet"
    good = pd.DataFrame({"row": [0, 0], "x": [1.0, 2.0]})
    write_part(good, path, {"fingerprint": "a"})
    bad = pd.DataFrame({"row": [0, 0], "x": [1.0, object()]})  # pyarrow cannot store an object()
    with pytest.raises(Exception):  # noqa: B017 - pyarrow's own error type; what matters is what is left behind
        write_part(bad, path, {"fingerprint": "b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left
    pd.testing.assert_frame_equal(pd.read_parquet(path), good)  # the earlier part is intact


# ------------------------------------------------------------------------------------------------ the sweep


def test_sweep_writes_one_dataset_with_a_row_column_and_an_aggregate(workdir, pipe, tmp_path):
    rows = [*MANIFEST_4[:3], {"prompt": "cut", "images": "refs_bad/truncated.png"}, {"imgs": "typo"}]
    manifest = read_manifest(write_jsonl(workdir / "full.jsonl", rows))
    assert [s.line for s in manifest.skipped] == [5]  # the truncated file passes the header check
    result = run_sweep(manifest, runner_for(pipe), tmp_path, progress=False, n_resamples=999)
    layout = SweepLayout(tmp_path)
    assert [p.name for p in layout.parts()] == [f"row-00000{i}.parquet" for i in range(3)]
    dataset = pd.read_parquet(layout.rows)  # the folder reads as one table
    assert sorted(dataset["row"].unique()) == [0, 1, 2]
    pd.testing.assert_frame_equal(
        dataset.sort_values(["row"], kind="stable").reset_index(drop=True), load_table(tmp_path)
    )
    # the truncated image fails at run time, the typo when the manifest is read: both fail with their lines
    assert [(s.line, "truncated.png" in s.reason, s.stage) for s in result.failed] == [
        (4, True, "run"),
        (5, False, "manifest"),
    ]
    assert [s.line for s in result.skipped] == [5]
    assert (result.done, result.ran, result.resumed, result.processes) == (3, 3, 0, 1)
    record = json.loads(layout.summary.read_text())
    assert [s["line"] for s in record["failed"]] == [4, 5] and record["rows"]["done"] == 3
    assert (record["rows"]["manifest"], record["rows"]["failed"]) == (5, 2)
    agg = pd.read_parquet(layout.aggregate)
    assert set(agg["branch"]) == {"cond", "uncond"} and (agg["rows"] == 3).all()
    per_row = pd.read_parquet(layout.row_summary)
    cond = per_row[per_row["branch"] == "cond"].groupby("timestep")["spearman"].mean()
    np.testing.assert_allclose(
        agg[agg["branch"] == "cond"].set_index("timestep")["spearman"], cond.sort_index(ascending=False)
    )
    assert layout.plot.stat().st_size > 0
    line = result.describe()
    assert line.startswith("sweep: 3/5 rows done (3 now") and "2 failed (line 4, 5: " in line and "spearman" in line


class InterruptAt(SweepRunner):
    """Test double: Ctrl-C arrives while row ``stop`` runs."""

    def __init__(self, *args, stop: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop = stop

    def run_row(self, row):
        if row.row == self.stop:
            raise KeyboardInterrupt
        return super().run_row(row)


def test_an_interrupted_sweep_resumes_where_it_stopped(workdir, pipe, tmp_path):
    manifest = read_manifest(write_jsonl(workdir / "resume.jsonl", MANIFEST_4))
    reference = tmp_path / "reference"
    run_sweep(manifest, runner_for(pipe), reference, progress=False, n_resamples=999)

    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(manifest, runner_for(pipe, InterruptAt, stop=2), out, progress=False)
    layout = SweepLayout(out)
    assert [p.name for p in layout.parts()] == ["row-000000.parquet", "row-000001.parquet"]
    assert not layout.temp_files() and not layout.summary.exists()
    written = {p: p.stat().st_mtime_ns for p in layout.parts()}

    counting = runner_for(pipe, Counting)
    result = run_sweep(manifest, counting, out, progress=False, n_resamples=999)
    assert counting.ran == [2, 3]
    assert (result.ran, result.resumed, result.done) == (2, 2, 4)
    assert {p: p.stat().st_mtime_ns for p in list(written)} == written  # finished parts untouched
    pd.testing.assert_frame_equal(load_table(out), load_table(reference))
    pd.testing.assert_frame_equal(pd.read_parquet(layout.aggregate), pd.read_parquet(reference / "aggregate.parquet"))

    again = runner_for(pipe, Counting)
    assert run_sweep(manifest, again, out, progress=False, n_resamples=99).resumed == 4 and again.ran == []


def test_rows_written_with_other_settings_stop_the_sweep_until_restart(workdir, tmp_path, capsys):
    path = write_jsonl(workdir / "cli.jsonl", MANIFEST_4[:2])
    out = str(tmp_path / "out")
    base = ["sweep", str(path), "--out", out, "--steps", str(STEPS), "--no-progress", "--resamples", "99"]
    assert main(base) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sweep: 2/2 rows done (2 now, 0 resumed, 1 process")
    assert main([*base, "--steps", "3"]) == 2  # neither row sets steps: both were made with 2
    err = capsys.readouterr().err
    assert "other settings" in err and "steps differ" in err and "--restart" in err
    assert main([*base, "--steps", "3", "--restart"]) == 0
    assert load_table(out)["step"].nunique() == 3


@pytest.mark.slow
def test_real_weights_by_path_take_images_from_the_rows(workdir, tmp_path, capsys, one_thread):
    """--model without --image: rows bring their images, a row without any is skipped; same table as embedded."""
    from ipa_probe.tiny.sd import save_tiny_pipeline

    saved = save_tiny_pipeline(tmp_path / "saved", seed=0)
    path = write_jsonl(workdir / "real.jsonl", [*MANIFEST_4[:2], {"prompt": "no images"}])
    common = ["--steps", str(STEPS), "--size", "64", "64", "--no-progress", "--resamples", "99"]
    model = ["--model", str(saved.model_dir), "--ip-adapter", str(saved.ip_adapter_dir)]
    model += ["--weight-name", saved.weight_name, "--guidance-scale", "7.5"]
    assert main(["sweep", str(path), "--out", str(tmp_path / "real"), *model, *common]) == 3  # a row failed
    assert "1 failed (line 3: 1 rejected by the checks before running" in capsys.readouterr().out
    record = json.loads((tmp_path / "real" / "summary.json").read_text())
    assert "no 'images'" in record["failed"][0]["reason"] and record["settings"]["default_images"] is None
    assert main(["sweep", str(path), "--out", str(tmp_path / "embedded"), *common]) == 0
    real, embedded = load_table(tmp_path / "real"), load_table(tmp_path / "embedded", rows=[0, 1])
    # weights read back from disk agree with the in-memory ones to float32 rounding, not always bit for bit
    pd.testing.assert_frame_equal(real, embedded, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------ aggregation


def synthetic_per_row(values: dict[float, list[float]], cells: list[int] | None = None) -> pd.DataFrame:
    records = []
    for timestep, rhos in values.items():
        for row, rho in enumerate(rhos):
            for branch in ("cond", "uncond"):
                records.append(
                    {
                        "row": row,
                        "branch": branch,
                        "timestep": timestep,
                        "spearman": rho if branch == "cond" else -rho,
                        "pearson": rho / 2,
                        "frac_rho_gt_0.9": float(rho > 0.9),
                        "spearman_null": 0.01 * row,
                        **{k: 1.0 for k in ("kl", "top1", "neff_attn", "neff_nw", "q_norm", "bandwidth")},
                        "nonfinite": float(row == 1),
                    }
                )
    return pd.DataFrame(records)


def test_aggregate_averages_rows_and_bootstraps_over_them():
    rhos = [0.95, 0.85, 0.99, 0.91, 0.97, 0.88, 0.93, 0.9]
    per_row = synthetic_per_row({981.0: [0.2, 0.4, 0.3, 0.5], 1.0: rhos, 501.0: [0.6]})
    agg = aggregate(per_row, n_resamples=1999, seed=3)
    cond = agg[agg["branch"] == "cond"]
    assert cond["timestep"].tolist() == [981.0, 501.0, 1.0]  # denoising order
    last = cond.iloc[-1]
    assert last["rows"] == 8 and math.isclose(last["spearman"], np.mean(rhos))
    assert math.isclose(last["frac_rho_gt_0.9"], 5 / 8) and math.isclose(last["pearson"], last["spearman"] / 2)
    assert math.isclose(last["spearman_std"], np.std(rhos, ddof=1))
    assert last["nonfinite"] == 1.0
    assert last["spearman_ci_low"] < last["spearman"] < last["spearman_ci_high"]
    assert np.isnan(cond.iloc[1]["spearman_ci_low"]) and cond.iloc[1]["rows"] == 1  # one row: no interval
    assert np.isnan(cond.iloc[0]["spearman_ci_low"])  # 4 rows, below MIN_SETS: none either
    uncond = agg[agg["branch"] == "uncond"].iloc[-1]
    assert math.isclose(uncond["spearman"], -last["spearman"])
    # the same numbers whatever the order of the input rows
    shuffled = per_row.sample(frac=1.0, random_state=0).reset_index(drop=True)
    pd.testing.assert_frame_equal(aggregate(shuffled, n_resamples=1999, seed=3), agg)


def own_bootstrap_t(x: np.ndarray, confidence: float, seed: int, batches: list[int]) -> tuple[float, float]:
    """The bootstrap-t interval of the mean of ``x``, written out: the same resample draws as ``bootstrap_ci`` (set
    indices per batch from ``default_rng(seed)``), each resample's mean studentised by its own standard error."""
    rng, n = np.random.default_rng(seed), len(x)
    samples = np.concatenate([x[rng.integers(0, n, (size, n))] for size in batches])
    t = (samples.mean(1) - x.mean()) / (samples.std(1, ddof=1) / math.sqrt(n))
    upper, lower = np.quantile(t, [(1 + confidence) / 2, (1 - confidence) / 2])
    se = x.std(ddof=1) / math.sqrt(n)
    return x.mean() - upper * se, x.mean() - lower * se


def test_bootstrap_ci_is_the_bootstrap_t_and_behaves_at_the_edges():
    rng = np.random.default_rng(0)
    x = rng.normal(0.7, 0.1, size=40)
    low, high = bootstrap_ci(x, 0.9, 4999, np.random.default_rng(1))
    assert (low, high) == pytest.approx(own_bootstrap_t(x, 0.9, 1, [4999]), abs=1e-12)
    wide = bootstrap_ci(x[:8], 0.9, 4999, np.random.default_rng(1))
    assert wide[1] - wide[0] > high - low  # fewer rows, wider interval
    assert bootstrap_ci(np.full(8, 0.5)) == (0.5, 0.5)
    assert all(np.isnan(bootstrap_ci(x[:7])))  # below MIN_SETS: no interval (it would not cover)
    assert all(np.isnan(bootstrap_ci(np.r_[x[:7], np.nan])))
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci(x, 95)


def test_bootstrap_ci_is_cut_to_the_means_range():
    # an effective number of 4 references: mostly 1, one set near 4; the bootstrap-t reaches far past both ends
    x = np.array([1.0, 1.0, 1.01, 1.02, 1.0, 1.03, 1.0, 1.01, 1.02, 3.9])
    low, high = own_bootstrap_t(x, 0.95, 1, [4999])
    assert low < 1 and high > 30  # what the cut is for
    assert bootstrap_ci(x, 0.95, 4999, np.random.default_rng(1), (1.0, 4.0)) == (1.0, 4.0)
    assert bootstrap_ci(x, 0.95, 4999, np.random.default_rng(1), (0.5, 40.0)) == pytest.approx((low, high), rel=1e-12)
    assert bootstrap_ci(np.full(8, 0.5), bounds=(0.0, 1.0)) == (0.5, 0.5)
    with pytest.raises(ValueError, match="bounds"):
        bootstrap_ci(x, bounds=(4.0, 1.0))


def test_plot_aggregate_draws_the_interval_as_a_band():
    from matplotlib.collections import PolyCollection

    rhos = [0.95, 0.85, 0.99, 0.91, 0.97, 0.88, 0.93, 0.9]
    agg = aggregate(synthetic_per_row({981.0: [r - 0.6 for r in rhos], 1.0: rhos}), n_resamples=999)
    fig = plot_aggregate(agg)
    ax = fig.axes[0]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    ys = bands[0].get_paths()[0].vertices[:, 1]
    cond = agg[agg["branch"] == "cond"]
    assert math.isclose(ys.min(), cond["spearman_ci_low"].min())
    assert math.isclose(ys.max(), cond["spearman_ci_high"].max())
    assert ax.xaxis_inverted()
    from ipa_probe.figstyle import drawn_problems, size_problems

    assert drawn_problems(fig) == [] and size_problems(*fig.get_size_inches()) == []  # legend clear of the lines


def test_row_summary_keeps_the_row_identity(workdir, pipe):
    manifest = read_manifest(write_jsonl(workdir / "one.jsonl", MANIFEST_4[1:2]))
    summary = row_summary(runner_for(pipe).run_row(manifest.rows[0]))
    assert (summary["row"] == 0).all() and (summary["scale"] == 0.5).all() and len(summary) == 2 * STEPS


# ------------------------------------------------------------------------------------------------ accelerate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_accelerate_give_the_single_process_table(workdir, tmp_path, one_thread, capsys):
    manifest = write_jsonl(workdir / "accelerate.jsonl", MANIFEST_4)
    args = ["sweep", str(manifest), "--steps", str(STEPS), "--device", "cpu", "--resamples", "999"]
    single = tmp_path / "single"
    assert main([*args, "--out", str(single), "--no-progress"]) == 0
    capsys.readouterr()

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    # `accelerate launch --cpu` starts one process whatever --num_processes says (its simple launcher); the
    # torchrun launcher (`--multi_gpu`) starts two, and `--device cpu` makes them CPU (gloo) processes.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port()), "-m", "ipa_probe"]
    multi = tmp_path / "multi"
    done = subprocess.run(
        [*launch, *args, "--out", str(multi), "--threads", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary_lines = [line for line in done.stdout.splitlines() if line.startswith("sweep:")]
    assert len(summary_lines) == 1 and "2 processes" in summary_lines[0]  # printed by the main process only
    assert "process 1/2" in done.stderr and "process 2/2" in done.stderr  # a progress bar per process
    record = json.loads((multi / "summary.json").read_text())
    assert record["processes"] == 2 and record["rows_by_process"] == {"0": [0, 1], "1": [2, 3]}
    pd.testing.assert_frame_equal(load_table(multi), load_table(single))
    pd.testing.assert_frame_equal(
        pd.read_parquet(multi / "aggregate.parquet"), pd.read_parquet(single / "aggregate.parquet")
    )
