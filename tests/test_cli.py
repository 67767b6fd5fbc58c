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
    # the line names every file (the folder's lock, held while a run writes, is no output)
    assert all(name in wrote for name in files if not name.startswith(("image_", ".ipa_probe.lock"))), wrote
    assert "1 image(s)" in wrote
    assert "image_1.png" not in files and "digits.json" not in files  # one image, no digit verdict off the organism
    table = pd.read_parquet(tmp_path / "out" / "probe.parquet")
    assert table["step"].nunique() == 3
    record = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert record["run"]["model"] == "embedded tiny sd15" and record["run"]["seed"] == 1
    # the headline is the query-frame rho, printed with its frame; the stored-frame rho is named as such
    summary = pd.DataFrame(record["summary"])
    last = summary[summary["branch"] == "cond"].iloc[-1]
    assert (f"query-frame rho at the last step (t={last['timestep']:g}): {last['qf_spearman']:.3f} against its "
            f"baseline {last['qf_rho_baseline']:.3f} (item frame, gauge-invariant") in wrote  # fmt: skip
    assert f"stored-frame rho: {last['spearman']:.3f} against its baseline {last['rho_baseline']:.3f}" in wrote
    assert all(len(line) <= 160 for line in wrote.splitlines()[1:])  # one short line per finding
    # one image: one item per CFG branch, so the other query pool is the same rows: nothing to print, summary.json
    # says so
    assert "query pool" not in wrote and record["query_pool"].startswith("query pool: the pools coin")
    assert record["settings"]["query_frame"] == "item" and (table["query_frame"] == "item").all()


def test_query_frame_option_reaches_the_table_and_settings(tmp_path, capsys):
    assert main(["probe", "--out", str(tmp_path / "out"), *ARGS, "--query-frame", "branch"]) == 0
    assert "(branch frame, gauge-invariant;" in capsys.readouterr().out
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


# ------------------------------------------------------------------------------------------ runs that never mix
def _listed_files(folder):
    """Every regular file under ``folder`` (relative POSIX path), the lock and the manifest left out."""
    return {
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name not in ("ipa_probe_manifest.json", ".ipa_probe.lock")
    }


def _manifest(folder):
    return json.loads((folder / "ipa_probe_manifest.json").read_text())


def test_the_readme_sequence_refuses_then_overwrite_leaves_no_file_unaccounted_for(tmp_path, capsys):
    """README: `probe --maps --out D` then `probe --digit 7 --steps 50 --out D` (here 2 and 3 steps, one image)."""
    import hashlib

    out = tmp_path / "D"
    first = ["probe", "--maps", "--steps", "2", "--num-images", "1", "--out", str(out)]
    assert main(first) == 0
    record = _manifest(out)
    assert set(record["files"]) == _listed_files(out)  # every file of the run, and nothing else
    assert {"reference_maps.png", "map_table.parquet", "probe.parquet"} <= set(record["files"])
    for name, entry in record["files"].items():  # sizes and digests against the bytes on disk
        data = (out / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert record["settings"]["maps"] is True and record["command"] == "ipa-probe probe"
    assert "ipa_probe_manifest.json" in capsys.readouterr().out
    before = {name: (out / name).read_bytes() for name in _listed_files(out)}
    (out / "notes.txt").write_text("a user's notes")  # listed by no manifest: never removed

    second = ["probe", "--digit", "7", "--steps", "3", "--num-images", "1", "--out", str(out)]
    assert main(second) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and "--out" in err[0], err
    assert {name: (out / name).read_bytes() for name in before} == before  # refused: nothing changed

    assert main([*second, "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert "notes.txt" in err and "kept 1 file" in err  # said so
    assert (out / "notes.txt").read_text() == "a user's notes"
    record = _manifest(out)
    assert record["settings"]["digit"] == 7 and record["status"] == "finished"
    # no file of the first run unaccounted for: every file is the second run's, or the user's
    assert _listed_files(out) == set(record["files"]) | {"notes.txt"}
    assert not (out / "reference_maps.png").exists() and not (out / "map_table.parquet").exists()
    assert json.loads((out / "digits.json").read_text())["digit"] == 7

    assert main([*second, "--overwrite"]) == 0  # the same run again: its own files replaced, the user's kept
    assert (out / "notes.txt").exists() and _listed_files(out) == set(_manifest(out)["files"]) | {"notes.txt"}


def test_a_sweep_resumes_under_its_manifest_and_refuses_another_command(tmp_path, capsys):
    from ipa_probe.tiny.sd import default_reference_images

    refs = tmp_path / "refs"
    refs.mkdir()
    for i, image in enumerate(default_reference_images(2)):
        image.save(refs / f"{i}.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"images": str(refs / f"{i}.png"), "seed": i}) + "\n" for i in range(2)))
    out = tmp_path / "sweep"
    base = ["sweep", str(rows), "--out", str(out), "--steps", "2", "--no-progress", "--resamples", "99"]
    assert main(base) == 0
    first = _manifest(out)
    assert set(first["files"]) == _listed_files(out) and first["command"] == "ipa-probe sweep"
    parts = {p: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    capsys.readouterr()
    assert main(base) == 0  # the same sweep again: resumed by its own record, rows untouched
    assert "0 now, 2 resumed" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in parts} == parts
    again = _manifest(out)
    assert again["resumed_from"] == first["run_id"] and set(again["files"]) == _listed_files(out)
    assert main(["probe", *ARGS, "--out", str(out)]) == 2  # another command's folder
    assert "another run (ipa-probe sweep" in capsys.readouterr().err
    assert main([*base, "--overwrite"]) == 0  # a fresh sweep: the previous files removed, rows run again
    assert "2 now, 0 resumed" in capsys.readouterr().out


def test_experiments_resume_under_their_manifest(tmp_path, capsys):
    out = tmp_path / "exp"
    argv = ["experiments", "collapse", "--tier", "quick", "--seeds", "0", "--dims", "2", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    first = _manifest(out)
    assert set(first["files"]) == _listed_files(out) and first["command"] == "ipa-probe experiments"
    checkpoints = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("checkpoint.safetensors")}
    assert checkpoints
    assert main([*argv, "--no-progress"]) == 0  # the same command again: trained models reused, not retrained
    assert {p: p.stat().st_mtime_ns for p in checkpoints} == checkpoints
    again = _manifest(out)
    assert again["resumed_from"] == first["run_id"] and set(again["files"]) == _listed_files(out)
    capsys.readouterr()
    assert main(["probe", *ARGS, "--out", str(out)]) == 2
    assert "another run (ipa-probe experiments" in capsys.readouterr().err


def test_the_same_command_twice_into_one_folder_is_the_same_run(tmp_path):
    """`make demo` twice: the second run redoes the first (same settings) instead of being refused as another run's.
    The organism's defaults (prompt, recipe, guidance) are filled in after the check; the run's key must not see
    that."""
    from ipa_probe.cli import main

    argv = ["probe", "--out", str(tmp_path / "demo"), "--steps", "2", "--num-images", "1"]
    assert main(argv) == 0
    first = json.loads((tmp_path / "demo" / "ipa_probe_manifest.json").read_text())
    assert main(argv) == 0
    second = json.loads((tmp_path / "demo" / "ipa_probe_manifest.json").read_text())
    assert second["key"] == first["key"] and second["status"] == "finished"
    assert main([*argv[:-3], "3", *argv[-2:]]) == 2  # other settings: refused (exit 2, nothing written)
