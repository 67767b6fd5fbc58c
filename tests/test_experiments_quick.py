"""The ``quick`` tier end to end: every experiment, every output file (the one slow experiments test)."""

from __future__ import annotations

import csv
import json
import os

import pytest

from ipa_probe.cli import main
from ipa_probe.experiments import EXPERIMENTS
from ipa_probe.experiments.headline import headline_rows


@pytest.mark.slow
def test_quick_tier_writes_every_output(tmp_path, capsys):
    out = tmp_path / "quick"
    # one thread per test process, as conftest sets (the runner's default is every core)
    threads = os.environ.get("IPA_PROBE_TEST_THREADS", "1")
    argv = ["experiments", "all", "--tier", "quick", "--out", str(out), "--no-progress", "--threads", threads]
    assert main(argv) == 0
    for name in EXPERIMENTS:
        folder = out / name
        table = (folder / "table.md").read_text()
        assert "| quantity | setting | ours | paper | note |" in table
        with (folder / "table.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        assert rows and all(row["ours"] and row["paper"] for row in rows)
        record = json.loads((folder / "record.json").read_text())
        assert record["experiment"] == name and record["tier"]["name"] == "quick"
        assert {"torch", "python", "ipa_probe"} <= set(record["versions"]) and record["wall_time_s"] > 0
        assert record["figures"] and all((folder / f).stat().st_size > 1000 for f in record["figures"])
    # every run validated and kept its best step; the §D.3 per-m check ran on the quick tier's check data set
    for name in EXPERIMENTS:
        for run in json.loads((out / name / "record.json").read_text())["training_runs"].values():
            assert run["selected"] == "best validation MMD²" and run["validation"]
            assert run["best_step"] in [step for step, _ in run["validation"]]
    scarcity = json.loads((out / "scarcity" / "record.json").read_text())
    assert set(scarcity["per_m_check"]) == {"pcafeat"} and set(scarcity["measurements"]) == {"pcafeat", "digits"}
    assert "§D.3 check: model trained at one m" in (out / "scarcity" / "table.md").read_text()
    # attention reused the shells model instead of training it again
    assert not any(
        run["trained_now"]
        for run in json.loads((out / "attention" / "record.json").read_text())["training_runs"].values()
    )
    assert (out / "summary.md").exists()
    quantities = {row.quantity.split(":")[0] for row in headline_rows(out)}
    assert quantities == set(EXPERIMENTS)
    assert any(row.quantity.startswith("scarcity: §D.3 check") for row in headline_rows(out))
    assert "summary:" in capsys.readouterr().out
