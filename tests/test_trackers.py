"""A probe's tracker logs, read back from the trackers' own files: one TensorBoard run per probe, a custom-scalars
layout naming the tags that exist, scalars equal to the run's table averaged here with pandas, histograms with the
right counts, overlays at every step, hparams with metrics; wandb and MLflow get the same content."""

from __future__ import annotations

import importlib.machinery
import re
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ipa_probe.capture.run import probe

STEPS = 3
SETTINGS = {"steps": STEPS, "guidance_scale": 3.0, "scale": 1.0, "references": 3, "digit": 3, "seed": 0,
            "model": "embedded digits organism (trained)"}  # fmt: skip

# TensorBoard stores scalars as float32: a mean in [-1, 1] comes back within 6e-8 of the float64 one
FLOAT32 = 1e-6


@pytest.fixture(scope="module")
def logged(organism, tmp_path_factory):
    """The organism probed with maps at 3 steps (2 images, CFG), logged to TensorBoard with its images, references,
    the classifier's readings and the generation's settings."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, classify_digit_images, digits_reference_images

    refs = digits_reference_images(3, 3)
    with probe(organism, maps=True) as run:
        images = organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=STEPS, guidance_scale=3.0,
                          num_images_per_prompt=2, generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    labels, probs = classify_digit_images(images)
    readings = [f"read as {v} (P(3) = {p[3]:.2f})" for v, p in zip(labels, probs, strict=True)]
    logs = tmp_path_factory.mktemp("logs")
    content = {"images": images, "references": refs, "readings": readings, "settings": SETTINGS}
    folder = run.log("tensorboard", logs, "digits", **content)
    return run, logs, folder, readings, content


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kinds = ("scalars", "images", "histograms", "tensors", "compressedHistograms", "audio")
    events = EventAccumulator(str(folder), size_guidance=dict.fromkeys(kinds, 0))
    events.Reload()
    return events


def _scalar(events, tag) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(tag)}


def _cells(run, branch="cond"):
    table = run.to_dataframe()
    return table[(table["kind"] == "image") & (table["branch"] == branch)]


def test_one_run_folder_holds_every_event(logged):
    _, logs, folder, _, _ = logged
    event_files = sorted(Path(logs).rglob("events.out.tfevents.*"))
    assert [p.parent for p in event_files] == [Path(folder)] == [Path(logs) / "digits"]  # no hparams sub-run
    assert not list(Path(logs).rglob("hparams.yml"))


def test_a_second_probe_gets_its_own_folder(logged, tmp_path):
    run = logged[0]
    first = run.log("tensorboard", tmp_path, "again")
    second = run.log("tensorboard", tmp_path, "again")
    assert (first.name, second.name) == ("again", "again-2")
    assert [len(list(f.glob("events.out.tfevents.*"))) for f in (first, second)] == [1, 1]


def test_headline_scalars_equal_the_table_averaged_with_pandas(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    for branch, path in (("cond", "nw/"), ("uncond", "nw/uncond/")):
        cells = _cells(run, branch)
        means = cells.groupby("step")[["spearman", "rho_baseline", "spearman_null", "rho_excess"]].mean()
        for column, name in (("spearman", "rho"), ("rho_baseline", "rho_baseline"), ("spearman_null", "rho_null"),
                             ("rho_excess", "rho_excess")):  # fmt: skip
            logged_values = _scalar(events, path + name)
            assert sorted(logged_values) == list(range(STEPS))
            assert logged_values == pytest.approx(means[column].to_dict(), abs=FLOAT32)
        counts = cells.groupby("step").size()
        assert _scalar(events, f"debug/{path[3:]}cells") == counts.astype(float).to_dict()
    timesteps = _cells(run).groupby("step")["timestep"].first()
    assert _scalar(events, "debug/timestep") == pytest.approx(timesteps.to_dict(), abs=1e-3)
    tags = set(events.Tags()["scalars"])
    assert {"debug/bandwidth", "debug/nonfinite", "debug/rho_cells"} <= tags  # bookkeeping under debug/ only
    assert not {"nw/bandwidth", "nw/nonfinite", "nw/cells", "nw/timestep"} & tags


def test_per_layer_rho_in_network_order(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    tags = sorted(t for t in events.Tags()["scalars"] if t.startswith("nw/layer/"))
    names = [t.split("_", 1)[1] for t in tags]
    assert sorted(names) == sorted(layer.name for layer in run.layers)
    blocks = [n.split(".")[0] for n in names]
    assert blocks == sorted(blocks, key=["down_blocks", "mid_block", "up_blocks"].index)  # down, mid, up
    assert "mid_block" in blocks
    means = _cells(run).groupby(["step", "layer"], observed=True)["spearman"].mean()
    for tag, name in zip(tags, names, strict=True):
        expected = {step: value for (step, layer), value in means.items() if layer == name}
        assert _scalar(events, tag) == pytest.approx(expected, abs=FLOAT32)


def test_layout_names_the_tags_that_exist(logged):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    events = _events(logged[2])
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())
    scalars = set(events.Tags()["scalars"])
    for category in layout.category:
        for chart in category.chart:
            for pattern in chart.multiline.tag:
                assert any(re.search(pattern, t) for t in scalars), (category.title, chart.title, pattern)
    charts = {chart.title: list(chart.multiline.tag) for c in layout.category[:2] for chart in c.chart}

    def drawn(title):
        return sorted(t for t in scalars if any(re.search(p, t) for p in charts[title]))

    assert drawn("rho with its baseline and null (stored frame)") == ["nw/rho", "nw/rho_baseline", "nw/rho_null"]
    assert drawn("rho per layer (network order)") == sorted(t for t in scalars if t.startswith("nw/layer/"))
    assert len(drawn("rho per layer (network order)")) == len(logged[0].layers)
    assert drawn("attention share of each reference") == [f"maps/attention_share/ref{r}" for r in range(3)]
    assert layout.category[0].title.startswith("rho vs Gaussian NW: cond branch")
    # the probe records the query-frame columns: the view opens on them, the stored frame's chart beside it
    assert layout.category[0].chart[0].title == "query-frame rho with its baseline and null"
    assert drawn("query-frame rho with its baseline and null") == ["nw/qf_rho", "nw/qf_rho_baseline", "nw/qf_rho_null"]
    assert layout.category[0].chart[1].title == "rho with its baseline and null (stored frame)"


def test_histograms_of_cells_and_shares_have_the_right_counts(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    cells = _cells(run)
    tags = {"spearman": "hist/rho_per_layer_head_cell", "spearman_null": "hist/rho_null_per_layer_head_cell"}
    for column, tag in tags.items():
        histograms = {e.step: e.histogram_value for e in events.Histograms(tag)}
        assert sorted(histograms) == list(range(STEPS))
        for step, h in histograms.items():
            values = cells.loc[cells["step"] == step, column].to_numpy(np.float64)
            values = values[np.isfinite(values)]
            assert h.num == values.size == run.num_heads * len(run.layers)  # one per layer x head cell
            assert (h.sum, h.min, h.max) == pytest.approx((values.sum(), values.min(), values.max()), abs=1e-9)
    for kind in ("attention", "nw"):
        for step in range(STEPS):
            rows = run.map_rows(0, step, "cond")
            assert len(rows) == 2  # the two generated images
            weights = [w for item in range(len(rows))
                       for w in run.reference_weights(0, item, kind=kind, steps=[step]).values()]  # fmt: skip
            for r in range(3):
                values = np.concatenate([w[:, r].numpy() for w in weights])
                (h,) = [e.histogram_value for e in events.Histograms(f"hist/{kind}_share_per_position/ref{r}")
                        if e.step == step]  # fmt: skip
                assert h.num == values.size  # every query position of every layer and image
                assert h.sum == pytest.approx(values.sum(), rel=1e-9)


def test_reference_share_scalars_equal_reference_mass(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    mass = run.reference_mass()
    columns = ["attention", "nw", "contribution_share"]  # the last checked against float64 in test_contributions
    means = mass[mass["branch"] == "cond"].groupby(["step", "reference"])[columns].mean()
    for kind, tag in zip(columns, ("attention_share", "nw_share", "contribution_share"), strict=True):
        for r in range(3):
            expected = {step: v for (step, ref), v in means[kind].items() if ref == r}
            assert _scalar(events, f"maps/{tag}/ref{r}") == pytest.approx(expected, abs=FLOAT32)


def test_overlays_at_every_step_and_the_images_with_their_readings(logged):
    from tensorboard.util import tensor_util

    run, _, folder, readings, _ = logged
    events = _events(folder)
    assert [e.step for e in events.Images("overlays/reference_shares")] == run.map_steps(0) == list(range(STEPS))
    for tag in ("images/generated", "images/references", "figures/rho_by_timestep", "figures/reference_maps"):
        assert [e.step for e in events.Images(tag)] == [STEPS - 1]
    (text,) = events.Tensors("images/readings/text_summary")
    table = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert [line.strip("| ").split(" | ")[1] for line in table.splitlines()[2:]] == readings


def test_hparams_carry_the_settings_and_end_of_run_metrics(logged):
    from tensorboard.plugins.hparams import plugin_data_pb2

    run, _, folder, _, _ = logged
    events = _events(folder)
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {k: v.number_value if v.HasField("number_value") else v.string_value for k, v in start.hparams.items()}
    assert {k: hparams[k] for k in SETTINGS} == SETTINGS
    assert hparams["probe/bandwidth"] == "matched" and hparams["adapter_scale"] == 1.0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metrics = [m.name.tag for m in experiment.metric_infos]
    assert metrics[:4] == ["end/rho", "end/rho_baseline", "end/rho_null", "end/rho_excess"]
    assert {"end/qf_rho", "end/qf_rho_baseline", "end/qf_rho_null", "end/qf_rho_excess"} <= set(metrics)
    cells = _cells(run)
    columns = {"rho": "spearman", "rho_null": "spearman_null", "rho_baseline": "rho_baseline"}
    columns.update(rho_excess="rho_excess", qf_rho="qf_spearman", qf_rho_null="qf_spearman_null")
    columns.update(qf_rho_baseline="qf_rho_baseline", qf_rho_excess="qf_rho_excess")
    for name, column in columns.items():
        # the mean over the cond branch's finite cells (pandas skips the NaN rho of a one-query layer)
        assert list(_scalar(events, f"end/{name}").values()) == pytest.approx([cells[column].mean()], abs=FLOAT32)


# --------------------------------------------------------------------------- wandb and MLflow


class _Recorder:
    """Stands in for a tracker's client: records every call as (name, args, kwargs) and returns another recorder."""

    def __init__(self, calls, name=""):
        self._calls, self._name = calls, name

    def __getattr__(self, name):
        return _Recorder(self._calls, f"{self._name}.{name}".lstrip("."))

    def __call__(self, *args, **kwargs):
        self._calls.append((self._name, args, kwargs))
        return _Recorder(self._calls, self._name + "()")


def _fake_module(monkeypatch, name, attributes):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_gets_the_same_content_and_its_real_run_folder(logged, tmp_path, monkeypatch):
    """A recording stand-in for wandb (not installed in the test environment) asserts the public API calls."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # a logged-out wandb is refused before the run (issue 31)
    calls = []

    class Run(_Recorder):
        dir = str(tmp_path / "wandb" / "offline-run-x" / "files")

    def init(**kwargs):
        calls.append(("init", (), kwargs))
        Path(Run.dir).mkdir(parents=True)
        return Run(calls, "run")

    plot = types.SimpleNamespace(line_series=lambda **kw: ("line_series", kw))
    _fake_module(monkeypatch, "wandb", {"init": init, "Histogram": lambda v: ("histogram", np.asarray(v)),
                                        "Image": lambda a: ("image", a.shape), "Html": lambda h: ("html", h),
                                        "plot": plot})  # fmt: skip
    run = logged[0]
    folder = run.log("wandb", tmp_path, "digits", **logged[4])
    assert folder == tmp_path / "wandb" / "offline-run-x" and folder.is_dir()
    assert calls[0] == ("init", (), {"project": "digits", "name": "digits", "dir": str(tmp_path)})
    rows = [args[0] for name, args, _ in calls if name == "run.log"]
    rho = {row["step"]: row["nw/rho"] for row in rows if "nw/rho" in row}
    expected = _cells(run).groupby("step")["spearman"].mean().to_dict()
    assert rho == pytest.approx(expected, rel=1e-12)
    steps = [row["step"] for row in rows if "step" in row]
    assert steps == sorted(steps)  # rows in step order
    histograms = {(row["step"]) for row in rows for v in row.values() if isinstance(v, tuple) and v[0] == "histogram"}
    assert histograms == set(range(STEPS))
    overlays = [row["step"] for row in rows if "overlays/reference_shares" in row]
    assert overlays == list(range(STEPS))
    charts = [v[1] for row in rows for k, v in row.items() if k.startswith("charts/")]
    (rho_chart,) = [c for c in charts if c["title"].endswith("rho with its baseline and null (stored frame)")]
    assert all(len(k) <= 60 for row in rows for k in row if k.startswith("charts/"))  # wandb names an artifact so
    assert rho_chart["keys"] == ["nw/rho", "nw/rho_baseline", "nw/rho_null"]
    assert rho_chart["ys"][0] == [expected[s] for s in range(STEPS)]
    config = [args[0] for name, args, _ in calls if name == "run.config.update"][0]
    assert {k: config[k] for k in SETTINGS} == SETTINGS
    summary = [args[0] for name, args, _ in calls if name == "run.summary.update"][0]
    assert summary["end/rho"] == pytest.approx(_cells(run)["spearman"].mean(), rel=1e-12)
    assert calls[-1][0] == "run.finish"


def test_an_mlflow_server_that_does_not_answer_is_refused_before_the_run(monkeypatch):
    """With an http MLFLOW_TRACKING_URI, check_tracker tries one connection: a closed port is refused at once with
    the remedy; a listening one, a local store and no URI pass."""
    import socket

    from ipa_probe.trackers import check_tracker

    _fake_module(monkeypatch, "mlflow", {})  # installed, as far as the check can tell
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert check_tracker("mlflow") == "mlflow"
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # bound, then released: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    with pytest.raises(
        ValueError, match=r"no tracking server answers at MLFLOW_TRACKING_URI=.*unset MLFLOW_TRACKING_URI"
    ):
        check_tracker("mlflow")
    for uri in ("sqlite:///somewhere/mlflow.db", "file:///tmp/mlruns", "databricks"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert check_tracker("mlflow") == "mlflow"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert check_tracker("mlflow") == "mlflow"


def test_mlflow_gets_the_same_content_recorded(logged, tmp_path, monkeypatch):
    """A recording stand-in for mlflow's client (the real one is tested below where mlflow is installed)."""
    calls = []

    class Client(_Recorder):
        def __init__(self, tracking_uri):
            super().__init__(calls, "client")
            calls.append(("MlflowClient", (), {"tracking_uri": tracking_uri}))

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location=None):
            calls.append(("create_experiment", (name,), {"artifact_location": artifact_location}))
            return "1"

        def create_run(self, experiment_id, run_name=None):
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

        def get_run(self, run_id):
            return types.SimpleNamespace(info=types.SimpleNamespace(artifact_uri=f"{tmp_path}/mlartifacts/1/r1"))

    class Metric(tuple):
        def __new__(cls, key, value, timestamp, step):
            return super().__new__(cls, (key, value, step))

    _fake_module(monkeypatch, "mlflow", {"MlflowClient": Client})
    _fake_module(monkeypatch, "mlflow.entities", {"Metric": Metric, "Param": lambda k, v: (k, v)})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = logged[0]
    folder = run.log("mlflow", tmp_path, "digits", **logged[4])
    assert folder == tmp_path / "mlartifacts" / "1" / "r1"
    assert calls[0] == ("MlflowClient", (), {"tracking_uri": f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"})
    metrics = [m for name, _, kw in calls if name == "client.log_batch" for m in kw.get("metrics", [])]
    rho = {step: value for key, value, step in metrics if key == "nw/rho"}
    assert rho == pytest.approx(_cells(run).groupby("step")["spearman"].mean().to_dict(), rel=1e-12)
    params = dict(p for name, _, kw in calls if name == "client.log_batch" for p in kw.get("params", []))
    assert params["digit"] == "3" and params["probe/bandwidth"] == "matched"
    images = [(kw["key"], kw["step"]) for name, _, kw in calls if name == "client.log_image"]
    assert [s for k, s in images if k == "overlays/reference_shares"] == list(range(STEPS))
    dicts = {args[2]: args[1] for name, args, _ in calls if name == "client.log_dict"}
    assert set(dicts["histograms.json"]["hist/rho_per_layer_head_cell"]) == set(range(STEPS))
    assert dicts["layout.json"]
    assert calls[-1][0] == "client.set_terminated"


def test_mlflow_local_store_read_back(logged, tmp_path, monkeypatch):
    """The real MLflow client on its local SQLite store (no server), read back with MlflowClient."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = logged[0]
    folder = run.log("mlflow", tmp_path, "digits", **logged[4])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "nw/rho")}
    assert history == pytest.approx(_cells(run).groupby("step")["spearman"].mean().to_dict(), rel=1e-12)
    assert found.data.params["guidance_scale"] == "3.0"
    assert found.data.metrics["end/rho"] == pytest.approx(_cells(run)["spearman"].mean(), rel=1e-12)
    files = {p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()}
    assert {"histograms.json", "layout.json", "run/settings.md", "images/readings.md"} <= files
    overlays = [f for f in files if f.startswith("images/overlays~reference_shares+step+") and f.endswith(".png")]
    assert len(overlays) == STEPS


def test_cli_prints_the_folder_of_the_event_file(tmp_path, capsys):
    from ipa_probe.cli import main

    out = tmp_path / "out"
    argv = ["probe", "--log-with", "tensorboard", "--out", str(out), "--steps", "2", "--num-images", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    folder = re.search(r"tensorboard logs in (\S+?)[,;]", printed).group(1)
    (event,) = Path(out / "logs").rglob("events.out.tfevents.*")
    assert Path(folder) == event.parent
    events = _events(folder)
    (text,) = events.Tensors("images/readings/text_summary")
    from tensorboard.util import tensor_util

    readings = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    digits = pd.read_json(out / "digits.json", typ="series")
    assert [int(re.search(r"read as (\d)", line).group(1)) for line in readings.splitlines()[2:]] == digits[
        "predicted"
    ]


def test_query_frame_columns_get_their_tags_charts_and_metrics_once_they_exist(logged, tmp_path, monkeypatch):
    """The query-frame columns (another part of the probe adds them) are found by name: here they are added to the
    run's table and summary by the test, with values that differ from the stored frame's."""
    run = logged[0]
    table, summary = run.to_dataframe(), run.summary()
    for frame in (table, summary):
        frame["qf_spearman"] = frame["spearman"] / 2
        frame["qf_rho_baseline"] = frame["rho_baseline"] / 3
        frame["qf_spearman_null"] = frame["spearman_null"] / 4
        frame["qf_rho_excess"] = frame["qf_spearman"] - frame["qf_rho_baseline"]
        frame["qf_gauss_rho"] = frame["spearman"] / 5
    monkeypatch.setattr(run, "to_dataframe", lambda: table.copy())
    monkeypatch.setattr(run, "summary", lambda: summary.copy())
    events = _events(run.log("tensorboard", tmp_path, "qf"))
    cells = table[(table["kind"] == "image") & (table["branch"] == "cond")]
    means = cells.groupby("step")[["qf_spearman", "qf_rho_baseline", "qf_spearman_null", "qf_gauss_rho"]].mean()
    for column, tag in (("qf_spearman", "nw/qf_rho"), ("qf_rho_baseline", "nw/qf_rho_baseline"),
                        ("qf_spearman_null", "nw/qf_rho_null"), ("qf_gauss_rho", "nw/qf_gauss_rho")):  # fmt: skip
        assert _scalar(events, tag) == pytest.approx(means[column].to_dict(), abs=FLOAT32)
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())
    assert layout.category[0].title.startswith("rho vs Gaussian NW: cond branch")
    charts = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    assert next(iter(charts)) == "query-frame rho with its baseline and null"  # the headline's chart first
    assert charts["query-frame rho with its baseline and null"] == ["^nw/qf_rho$", "^nw/qf_rho_baseline$",
                                                                     "^nw/qf_rho_null$"]  # fmt: skip
    assert charts["query-frame Gaussian columns"] == ["^nw/qf_gauss"]
    assert charts["excess over the baseline"] == ["^nw/rho_excess$", "^nw/qf_rho_excess$"]
    layers = sorted(t for t in events.Tags()["scalars"] if t.startswith("nw/qf_layer/"))
    assert len(layers) == len(run.layers)
    histograms = {e.step: e.histogram_value.num for e in events.Histograms("hist/qf_rho_per_layer_head_cell")}
    assert histograms == cells.groupby("step")["qf_spearman"].count().astype(float).to_dict()
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")["_hparams_/experiment"]
    metrics = [m.name.tag for m in plugin_data_pb2.HParamsPluginData.FromString(content).experiment.metric_infos]
    assert {"end/qf_rho", "end/qf_rho_baseline", "end/qf_rho_null", "end/qf_rho_excess"} <= set(metrics)
    assert list(_scalar(events, "end/qf_rho").values()) == pytest.approx([cells["qf_spearman"].mean()], abs=FLOAT32)


def test_probe_log_with_draws_the_overlays_over_a_grey_field(organism, tmp_path):
    """``probe(pipe, maps=True, log_with=...)`` sees no generated image: the overlays still come at every step."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    refs = digits_reference_images(3, 3)
    with probe(organism, maps=True, log_with="tensorboard", logging_dir=tmp_path, run_name="ctx") as run:
        organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=2, guidance_scale=3.0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    events = _events(tmp_path / "ctx")
    assert [e.step for e in events.Images("overlays/reference_shares")] == run.map_steps(0) == [0, 1]
    assert "images/generated" not in events.Tags()["images"]
    expected = _cells(run).groupby("step")["spearman"].mean().to_dict()
    assert _scalar(events, "nw/rho") == pytest.approx(expected, abs=FLOAT32)


def test_several_calls_in_one_block_get_a_prefix_and_a_layout_each(sd15, refs, tmp_path):
    with probe(sd15) as run:
        for seed in (0, 1):
            sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(seed))  # fmt: skip
    events = _events(run.log("tensorboard", tmp_path, "two"))
    table = run.to_dataframe()
    for call in (0, 1):
        cells = table[(table["call"] == call) & (table["kind"] == "image") & (table["branch"] == "cond")]
        expected = cells.groupby("step")["spearman"].mean().to_dict()
        assert _scalar(events, f"call{call}/nw/rho") == pytest.approx(expected, abs=FLOAT32)
    assert "nw/rho" not in events.Tags()["scalars"]
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())
    titles = [c.title for c in layout.category if "cond branch" in c.title]
    assert titles == [f"call{c}/rho vs Gaussian NW: cond branch, mean over layers and heads" for c in (0, 1)]


@pytest.mark.parametrize("branch", ["text", "both"])
def test_text_branch_series_and_layout(sd15, refs, tmp_path, branch):
    """A text-only probe's headline is its text branch (``nw/text/...``); with both, the text gets its own category."""
    with probe(sd15, branch=branch) as run:
        sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    events = _events(run.log("tensorboard", tmp_path, branch))
    table = run.to_dataframe()
    text = table[(table["kind"] == "text") & (table["branch"] == "cond")]
    expected = text.groupby("step")["spearman"].mean().to_dict()
    assert _scalar(events, "nw/text/rho") == pytest.approx(expected, abs=FLOAT32)
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())
    charts = {(c.title, chart.title): list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    scalars = set(events.Tags()["scalars"])
    assert all(any(re.search(p, t) for t in scalars) for patterns in charts.values() for p in patterns)
    drawn = [tags for (category, title), tags in charts.items() if title.startswith("rho with its baseline")]
    assert ["^nw/text/rho$", "^nw/text/rho_baseline$", "^nw/text/rho_null$"] in drawn
    layers = {t for t in scalars if t.startswith("nw/layer/")}
    assert len(layers) == len(run.layers)  # per layer: the headline series (text-only: the text branch)
