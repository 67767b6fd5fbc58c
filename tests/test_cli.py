"""`ipa-probe probe`: the embedded default, the real-weights path through a saved pipeline, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from ipa_probe.cli import main
from ipa_probe.tiny.sd import default_reference_images, save_tiny_pipeline

# the random tiny SD 1.5 pipeline (the default embedded pipeline is the trained digits organism: tests/test_digits.py)
ARGS = ["--kind", "sd15", "--steps", "3", "--size", "64", "64", "--seed", "1"]


def test_embedded_default_writes_the_output_folder(tmp_path, capsys):
    assert main(["probe", "--out", str(tmp_path / "out"), *ARGS, "--maps", "--keep-maps"]) == 0
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"image_0.png", "probe.parquet", "summary.json", "rho_by_timestep.png"} <= files
    assert {"reference_maps.png", "map_table.parquet", "maps.pt"} <= files
    wrote = capsys.readouterr().out
    assert all(name in wrote for name in files if not name.startswith("image_")), wrote  # the line names every file
    assert "1 image(s)" in wrote
    assert "image_1.png" not in files and "digits.json" not in files  # one image, no digit verdict off the organism
    table = pd.read_parquet(tmp_path / "out" / "probe.parquet")
    assert table["step"].nunique() == 3
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["run"]["model"] == "embedded tiny sd15" and record["run"]["seed"] == 1
    # the headline is the query-frame rho, printed with its frame; the stored-frame rho is named as such
    summary = pd.DataFrame(record["summary"])
    last = summary[summary["branch"] == "cond"].iloc[-1]
    assert f"query-frame rho {last['qf_spearman']:.3f} exact / {last['qf_gauss_spearman']:.3f} Gaussian" in wrote
    assert "(item frame, gauge-invariant); stored-frame rho" in wrote
    assert record["settings"]["query_frame"] == "item" and (table["query_frame"] == "item").all()


def test_query_frame_option_reaches_the_table_and_settings(tmp_path, capsys):
    assert main(["probe", "--out", str(tmp_path / "out"), *ARGS, "--query-frame", "branch"]) == 0
    assert "(branch frame, gauge-invariant)" in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["settings"]["query_frame"] == "branch"
    assert (pd.read_parquet(tmp_path / "out" / "probe.parquet")["query_frame"] == "branch").all()
    # a pool it does not know is refused (exit status 2), naming the choices
    assert main(["probe", "--out", str(tmp_path / "other"), *ARGS, "--query-frame", "batch"]) == 2
    assert "invalid choice: 'batch' (choose from" in capsys.readouterr().err


@pytest.mark.slow
def test_real_weights_path_round_trip_matches_the_embedded_run(tmp_path):
    saved = save_tiny_pipeline(tmp_path / "saved", seed=1)
    ref_dir = tmp_path / "refs"
    ref_dir.mkdir()
    for i, image in enumerate(default_reference_images()):
        image.save(ref_dir / f"{i}.png")
    embedded, loaded = tmp_path / "embedded", tmp_path / "loaded"
    assert main(["probe", "--out", str(embedded), *ARGS]) == 0
    args = ["--model", str(saved.model_dir), "--ip-adapter", str(saved.ip_adapter_dir)]
    args += ["--weight-name", saved.weight_name, "--image", str(ref_dir), "--guidance-scale", "7.5"]
    assert main(["probe", "--out", str(loaded), *args, *ARGS]) == 0
    a = pd.read_parquet(embedded / "probe.parquet")
    b = pd.read_parquet(loaded / "probe.parquet")
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "./no/such/folder", "--ip-adapter", "./x", "--image", "a.png"], "does not exist"),
        (["--image", "missing.png"], "does not exist"),
        (["--image", "notes.png"], "not an image"),
        (["--ip-adapter", "./x"], "needs --model"),
        (["--steps", "0"], "--steps"),
        (["--device", "nonsense"], "torch device"),
        (["--out", "afile/sub"], "cannot write"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.png").write_text("not an image")
    (tmp_path / "afile").write_text("")
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert main(["probe", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_entry_point_bad_bandwidth_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "ipa_probe", "probe", "--bandwidth", "-1"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "positive" in proc.stderr
