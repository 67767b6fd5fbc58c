"""The ``quick`` tier end to end: every experiment, every output file (the slow experiments tests).

The experiments run in three parts, each its own test, so that parallel test processes share them: the five paper
experiments in one invocation (attention reuses the shells model), ip-adapter and attribution each through the
command. ``experiments all`` itself (every experiment in order, one summary) is checked with the experiments stubbed.
"""

from __future__ import annotations

import csv
import json
import os

import pytest
from test_attribution_corrections import committed_decisions_disagree

from ipa_probe.cli import main
from ipa_probe.experiments import EXPERIMENTS, get_tier, run_experiments
from ipa_probe.experiments.headline import headline_rows

#: the parts of the tier, each run in one test; together every experiment once
PARTS = {
    "paper": ("collapse", "shells", "scarcity", "heads", "attention"),
    "ip-adapter": ("ip-adapter",),
    "attribution": ("attribution",),
}
# one thread per test process, as conftest sets (the runner's default is every core)
THREADS = os.environ.get("IPA_PROBE_TEST_THREADS", "1")


def test_the_parts_hold_every_experiment_once():
    assert sorted(name for part in PARTS.values() for name in part) == sorted(EXPERIMENTS)


def _check_outputs(out, names) -> None:
    for name in names:
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
        # every run validated and kept its best step
        for run in record["training_runs"].values():
            assert run["selected"] == "best validation MMD²" and run["validation"]
            assert run["best_step"] in [step for step, _ in run["validation"]]
    assert (out / "summary.md").exists()
    assert {row.quantity.split(":")[0] for row in headline_rows(out)} == set(names)


@pytest.mark.slow
@pytest.mark.parametrize("part", PARTS)
def test_quick_tier_writes_every_output(tmp_path, capsys, part):
    out, names = tmp_path / "quick", PARTS[part]
    if part == "paper":  # one invocation: the shells model is in memory when attention asks for it
        run_experiments(list(names), get_tier("quick"), out, progress=False, threads=int(THREADS))
    else:
        argv = ["experiments", part, "--tier", "quick", "--out", str(out), "--no-progress", "--threads", THREADS]
        assert main(argv) == 0
        assert "summary:" in capsys.readouterr().out
    _check_outputs(out, names)
    if part == "attribution":  # each decision is its own one-sided test, as in the committed folders
        assert (out / "attribution" / "comparisons_trained.csv").exists()
        assert committed_decisions_disagree(out / "attribution") == []
    if part == "paper":
        # the §D.3 per-m check ran on the quick tier's check data set
        scarcity = json.loads((out / "scarcity" / "record.json").read_text())
        assert set(scarcity["per_m_check"]) == {"pcafeat"} and set(scarcity["measurements"]) == {"pcafeat", "digits"}
        assert "§D.3 check: model trained at one m" in (out / "scarcity" / "table.md").read_text()
        assert any(row.quantity.startswith("scarcity: §D.3 check") for row in headline_rows(out))
        # attention reused the shells model instead of training it again
        assert not any(
            run["trained_now"]
            for run in json.loads((out / "attention" / "record.json").read_text())["training_runs"].values()
        )


def test_all_runs_every_experiment_in_order_into_one_summary(tmp_path, capsys, monkeypatch):
    """What the parts above do not run: the command's ``all``, here with each experiment a stub that records it ran."""
    from ipa_probe.experiments import runner
    from ipa_probe.experiments.report import ExperimentResult, Row

    ran = []

    def stub(name):
        return lambda ctx: ran.append(name) or ExperimentResult(name, [Row(name, "-", "1", "2", "")], {})

    monkeypatch.setattr(runner, "_registry", lambda: {name: stub(name) for name in reversed(EXPERIMENTS)})
    out = tmp_path / "all"
    assert (
        main(["experiments", "all", "--tier", "quick", "--out", str(out), "--no-progress", "--threads", THREADS]) == 0
    )
    assert ran == list(EXPERIMENTS)
    summary = (out / "summary.md").read_text()
    positions = [summary.index(f"## {name} (") for name in EXPERIMENTS]  # each summarised, in this order
    assert positions == sorted(positions)
    for name in EXPERIMENTS:
        record = json.loads((out / name / "record.json").read_text())
        assert record["experiment"] == name and record["tier"]["name"] == "quick"
    printed = capsys.readouterr().out
    assert f"summary: {out / 'summary.md'}" in printed and all(f"{name}: {out / name}" in printed for name in ran)
