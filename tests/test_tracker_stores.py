"""A tracker's local store under the default ``OUT/logs``: written where it lives (never staged, listed or removed
with a run), so the paths it records stay true and reruns add to it. The real MLflow client on its SQLite store,
read back with sqlite3 and MlflowClient; skipped where MLflow is absent (CI installs only '.[dev]')."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from ipa_probe.runfolder import MANIFEST_NAME, STAGING_NAME


def _text_cells(db: Path) -> list[str]:
    """Every text value of every table of a SQLite file, read with sqlite3 (not through MLflow)."""
    with closing(sqlite3.connect(db)) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return [v for t in tables for row in con.execute(f'SELECT * FROM "{t}"') for v in row if isinstance(v, str)]


def test_mlflow_store_lives_in_out_logs_and_keeps_every_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient

    from ipa_probe.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    argv = ["probe", "--log-with", "mlflow", "--out", str(out), "--steps", "2", "--num-images", "1"]
    assert main(argv) == 0
    assert main(argv) == 0  # the identical command again: the store is not a file that blocks the folder
    assert main([*argv, "--seed", "1", "--overwrite"]) == 0  # another run replaces the run, not the store
    capsys.readouterr()
    db = out / "logs" / "mlflow.db"
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["status"] == "finished" and not (out / STAGING_NAME).exists()
    assert not [n for n in manifest["files"] if n.startswith(("logs/mlflow.db", "logs/mlartifacts"))]
    assert not [c for c in _text_cells(db) if STAGING_NAME in c]  # no recorded path points into the staging folder
    client = MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
    experiments = client.search_experiments()
    runs = [r for e in experiments for r in client.search_runs([e.experiment_id])]
    assert sorted(r.data.params["seed"] for r in runs) == ["0", "0", "1"]  # every run logged is still there
    for found in runs:
        assert found.info.status == "FINISHED"
        folder = Path(found.info.artifact_uri.removeprefix("file://"))
        assert folder.is_relative_to((out / "logs" / "mlartifacts").resolve())
        assert {f.path for f in client.list_artifacts(found.info.run_id)} >= {"layout.json", "run"}
        assert json.loads((folder / "layout.json").read_text())  # read where the store says it is


def test_logging_dir_naming_out_logs_is_the_default_and_the_rerun_is_accepted(tmp_path, capsys):
    """``--logging-dir OUT/logs`` written out is the default: the event file is the run's own (listed, staged), so
    the identical command into the folder runs again (a --logging-dir elsewhere inside a run folder is refused
    before torch loads: tests/cli_cases.py)."""
    from ipa_probe.cli import main

    out = tmp_path / "out"
    argv = ["probe", "--log-with", "tensorboard", "--out", str(out), "--logging-dir", str(out / "logs")]
    argv += ["--steps", "2", "--num-images", "1"]
    assert main(argv) == 0
    assert main(argv) == 0
    capsys.readouterr()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    events = [n for n in manifest["files"] if n.startswith("logs/") and "events.out.tfevents" in n]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("events.out.tfevents*"))
    assert events and on_disk == sorted(events)  # every event file listed: the run's own
    assert len({Path(n).parent for n in events}) == len(events)  # one per (sub-)run: the rerun replaced its run
