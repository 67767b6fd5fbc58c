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


def _x(run, call=0) -> dict[int, int]:
    """Loop index -> the tracker's step: the loop index itself, so that charts read in denoising order."""
    table = run.to_dataframe()
    return {int(s): int(s) for s in sorted(set(table.loc[table["call"] == call, "step"]))}


def _by_x(run, means, call=0) -> dict[int, float]:
    x = _x(run, call)
    return {x[int(s)]: v for s, v in means.items()}


def test_one_run_with_its_baseline_null_and_mean_subruns(logged):
    _, logs, folder, _, _ = logged
    event_files = sorted(Path(logs).rglob("events.out.tfevents.*"))
    assert sorted({p.parent for p in event_files}) == [
        Path(folder),
        *(Path(folder) / s for s in ("baseline", "mean", "null")),  # null: the chance of rows with rho > 0.9
    ]
    assert [len(list(Path(f).glob("events.out.tfevents.*"))) for f in sorted({p.parent for p in event_files})] == [
        1
    ] * 4
    assert not list(Path(logs).rglob("hparams.yml"))


def test_a_rerun_with_the_same_name_replaces_its_run_and_names_say_what_differs(logged, tmp_path):
    from ipa_probe.trackers import run_name_for

    run = logged[0]
    first = run.log("tensorboard", tmp_path, "again")
    second = run.log("tensorboard", tmp_path, "again")
    assert first == second == tmp_path / "again" and sorted(p.name for p in tmp_path.iterdir()) == ["again"]
    assert len(list(second.glob("events.out.tfevents.*"))) == 1  # the first run's file is gone: no curve twice
    assert _scalar(_events(second), "1_query_frame/rho")  # and the replacement holds the run
    named = run.log("tensorboard", tmp_path, None, settings={"digit": 3, "seed": 0, "steps": STEPS})
    assert named.name == f"probe_digit3_seed0_frame-item_steps{STEPS}"
    assert run_name_for("probe", {"digit": 5, "seed": 1, "gauge": "c2"}, {"query_frame": "pooled"}) == (
        "probe_digit5_seed1_gaugec2_frame-pooled"
    )


def test_the_denoising_step_is_the_step_and_the_query_frame_comes_first(logged):
    """What a researcher lands on: the sorted tag groups start with the query frame, its first chart is rho, and its
    baseline and mean are the same tag in the sub-runs (one chart whose range fits them), the null a chart of its
    own; every step is the loop index, so that the x axis reads left to right in denoising order."""
    run, _, folder, _, _ = logged
    events = _events(folder)
    tags = sorted(events.Tags()["scalars"])
    assert tags[0] == "1_query_frame/rho"
    groups = list(dict.fromkeys(t.split("/")[0] for t in tags))
    assert groups[:6] == ["1_query_frame", "2_stored_frame", "3_agreement", "4_query_frame_rho_per_layer",
                          "5_stored_frame_rho_per_layer", "6_reference_shares"]  # fmt: skip
    assert not [t for t in tags if t.split("/")[0] in ("debug", "end", "nw")]  # bookkeeping and end numbers: no charts
    cells = _cells(run)
    for sub, tag, column in (("", "rho", "qf_spearman"), ("baseline", "rho", "qf_rho_baseline"),
                             ("", "rho_null", "qf_spearman_null")):  # fmt: skip
        values = _scalar(_events(Path(folder) / sub), f"1_query_frame/{tag}")
        assert sorted(values) == list(range(STEPS))  # step 0 is the noisiest timestep: denoising reads left to right
        assert values == pytest.approx(_by_x(run, cells.groupby("step")[column].mean()), abs=FLOAT32)
    for sub, tag, column in (("", "rho", "spearman"), ("baseline", "rho", "rho_baseline"),
                             ("", "rho_null", "spearman_null")):  # fmt: skip
        values = _scalar(_events(Path(folder) / sub), f"2_stored_frame/{tag}")
        assert values == pytest.approx(_by_x(run, cells.groupby("step")[column].mean()), abs=FLOAT32)
    uncond = _cells(run, "uncond")
    values = _scalar(events, "uncond_query_frame/rho")
    assert values == pytest.approx(_by_x(run, uncond.groupby("step")["qf_spearman"].mean()), abs=FLOAT32)
    for sub in ("", "baseline", "null", "mean"):  # no one-point chart anywhere
        sub_events = _events(Path(folder) / sub)
        assert all(len(sub_events.Scalars(t)) > 1 for t in sub_events.Tags()["scalars"])


def test_the_text_view_opens_on_the_finding_and_bookkeeping_is_last(logged):
    from tensorboard.util import tensor_util

    run, _, folder, _, _ = logged
    texts = sorted(t.removesuffix("/text_summary") for t in _events(folder).Tags()["tensors"] if "text_summary" in t)
    assert texts == ["1_finding/rho", "2_run/settings", "3_images/readings", "9_bookkeeping/columns"]
    (text,) = _events(folder).Tensors("1_finding/rho/text_summary")
    finding = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    cells = _cells(run)
    timesteps = cells.groupby("step")["timestep"].first()
    for step, rho in cells.groupby("step")["qf_spearman"].mean().items():  # step, timestep, rho, baseline, ...
        baseline = cells.loc[cells["step"] == step, "qf_rho_baseline"].mean()
        assert f"| 0 | {step} | {timesteps[step]:g} | {rho:.3f} | {baseline:.3f} |" in finding
    (text,) = _events(folder).Tensors("9_bookkeeping/columns/text_summary")
    table = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    header = next(line for line in table.splitlines() if line.startswith("| x |"))
    assert {"bandwidth", "cells", "nonfinite", "timestep"} <= {c.strip() for c in header.split("|")}
    counts = _cells(run).groupby("step").size()
    lines = table.splitlines()
    first = lines.index(header) + 2  # under the header and its |---| line: the cond image branch's steps
    rows = [line.split("|")[1:-1] for line in lines[first : first + STEPS]]
    columns = [c.strip() for c in header.split("|")[1:-1]]
    assert [int(r[columns.index("cells")]) for r in rows] == counts.tolist()


def test_per_layer_rho_one_small_chart_per_layer_in_network_order(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    tags = sorted(t for t in events.Tags()["scalars"] if t.startswith("5_stored_frame_rho_per_layer/"))
    assert len(tags) == len(run.layers)
    from ipa_probe.capture.layer_order import network_order

    order = network_order([layer.name for layer in run.layers])
    means = _cells(run).groupby(["step", "layer"], observed=True)["spearman"].mean()
    for tag, name in zip(tags, order, strict=True):
        assert name.startswith(tag.split("/", 1)[1][3:])  # numbered in network order, without the shared ending
        expected = {step: value for (step, layer), value in means.items() if layer == name}
        assert _scalar(events, tag) == pytest.approx(_by_x(run, expected), abs=FLOAT32)


def _layout_of(events):
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.util import tensor_util

    (config,) = events.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(config.tensor_proto).item())


def test_layout_names_the_tags_that_exist_one_unit_per_chart(logged):
    events = _events(logged[2])
    layout = _layout_of(events)
    scalars = set(events.Tags()["scalars"])
    for category in layout.category:
        for chart in category.chart:
            for pattern in chart.multiline.tag:
                assert any(re.search(pattern, t) for t in scalars), (category.title, chart.title, pattern)
            assert len(chart.multiline.tag) <= 4  # a chart of a few series of one unit, never 14
    first = layout.category[0]
    assert first.title.startswith("query frame (gauge-invariant): cond branch")
    # TensorBoard's default y range leaves out the lowest and highest ~5% of a chart's points (its t = 1 end here)
    assert "untick Ignore outliers" in first.title
    assert first.chart[0].title == "query-frame rho: run, baseline, mean (read at smoothing 0)"
    assert list(first.chart[0].multiline.tag) == ["^1_query_frame/rho$"]
    assert list(first.chart[2].multiline.tag) == ["^1_query_frame/rho_null$", "^1_query_frame/rho_gaussian_null$"]
    charts = {chart.title: list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    assert charts["attention share of each reference"] == [f"^6_reference_shares/attention_ref{r}$" for r in range(3)]


def test_histograms_of_cells_and_shares_have_the_right_counts(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    cells = _cells(run)
    x = _x(run)
    tags = {"spearman": "hist/rho_per_layer_head_cell", "spearman_null": "hist/rho_null_per_layer_head_cell"}
    for column, tag in tags.items():
        histograms = {e.step: e.histogram_value for e in events.Histograms(tag)}
        assert sorted(histograms) == sorted(x.values())
        for step in range(STEPS):
            h = histograms[x[step]]
            values = cells.loc[cells["step"] == step, column].to_numpy(np.float64)
            values = values[np.isfinite(values)]
            assert h.num == values.size == run.num_heads * len(run.layers)  # one per layer x head cell
            assert (h.sum, h.min, h.max) == pytest.approx((values.sum(), values.min(), values.max()), abs=1e-9)
    for kind in ("attention", "nw"):
        for step in range(STEPS):
            rows = run.map_items(0, step, "cond")
            assert len(rows) == 2  # the two generated images
            weights = [w for item in range(len(rows))
                       for w in run.reference_weights(0, item, kind=kind, steps=[step]).values()]  # fmt: skip
            for r in range(3):
                values = np.concatenate([w[:, r].numpy() for w in weights])
                (h,) = [e.histogram_value for e in events.Histograms(f"hist/{kind}_share_per_position/ref{r}")
                        if e.step == x[step]]  # fmt: skip
                assert h.num == values.size  # every query position of every layer and image
                assert h.sum == pytest.approx(values.sum(), rel=1e-9)


def test_reference_share_scalars_equal_reference_mass(logged):
    run, _, folder, _, _ = logged
    events = _events(folder)
    mass = run.reference_mass()
    columns = ["attention", "nw", "contribution_share"]  # the last checked against float64 in test_contributions
    means = mass[mass["branch"] == "cond"].groupby(["step", "reference"])[columns].mean()
    for kind, tag in zip(columns, ("attention", "nw", "contribution"), strict=True):
        for r in range(3):
            expected = {step: v for (step, ref), v in means[kind].items() if ref == r}
            assert _scalar(events, f"6_reference_shares/{tag}_ref{r}") == pytest.approx(
                _by_x(run, expected), abs=FLOAT32
            )


def test_overlays_first_in_images_at_every_timestep_and_drawn_for_a_card(logged):
    from tensorboard.util import tensor_util

    run, _, folder, readings, _ = logged
    events = _events(folder)
    images = sorted(events.Tags()["images"])
    assert images[0] == "7_overlays/reference_shares"  # the Images view lists groups by name: overlays first
    x = _x(run)
    assert [e.step for e in events.Images("7_overlays/reference_shares")] == sorted(x[s] for s in run.map_steps(0))
    last = x[STEPS - 1]
    for tag in ("9_images/generated", "9_images/references", "8_figures/rho_by_timestep", "8_figures/reference_maps",
                "8_figures/query_frame_rho_per_layer"):  # fmt: skip
        assert [e.step for e in events.Images(tag)] == [last]
    for tag in ("7_overlays/reference_shares", "8_figures/rho_by_timestep", "8_figures/query_frame_rho_per_layer"):
        assert events.Images(tag)[0].width == 340  # a card's own width: shown 1:1, its text enlarged to be read
    assert events.Images("8_figures/reference_maps")[0].width == 680  # a page of maps: two cards wide
    (text,) = events.Tensors("3_images/readings/text_summary")
    table = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert [line.strip("| ").split(" | ")[1] for line in table.splitlines()[2:]] == readings


def test_hparams_carry_the_settings_and_end_of_run_metrics_from_the_mean_run(logged):
    from tensorboard.plugins.hparams import plugin_data_pb2

    run, _, folder, _, _ = logged
    events = _events(folder)
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {k: v.number_value if v.HasField("number_value") else v.string_value for k, v in start.hparams.items()}
    assert {k: hparams[k] for k in SETTINGS} == SETTINGS
    assert hparams["probe/bandwidth"] == "matched" and hparams["adapter_scale"] == 1.0
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metrics = [(m.name.group, m.name.tag) for m in experiment.metric_infos]
    assert metrics == [("mean", "1_query_frame/rho"), ("mean", "1_query_frame/rho_excess"),
                       ("mean", "2_stored_frame/rho"), ("mean", "2_stored_frame/rho_excess")]  # fmt: skip
    cells = _cells(run)
    mean = _events(Path(folder) / "mean")
    for (_, tag), column in zip(metrics, ("qf_spearman", "qf_rho_excess", "spearman", "rho_excess"), strict=True):
        # the mean over the cond branch's finite cells (pandas skips the NaN rho of a one-query layer): a flat line
        # over the timesteps, whose last value the HParams view reads
        values = _scalar(mean, tag)
        assert sorted(values) == [min(_x(run).values()), max(_x(run).values())]
        assert list(values.values()) == pytest.approx([cells[column].mean()] * 2, abs=FLOAT32)


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
                                        "Image": lambda a, caption=None: ("image", a.shape, caption),
                                        "Html": lambda h: ("html", h),
                                        "plot": plot})  # fmt: skip
    run = logged[0]
    folder = run.log("wandb", tmp_path, "digits", **logged[4])
    assert folder == tmp_path / "wandb" / "offline-run-x" and folder.is_dir()
    assert calls[0] == ("init", (), {"project": "digits", "name": "digits", "dir": str(tmp_path)})
    rows = [args[0] for name, args, _ in calls if name == "run.log"]
    cells = _cells(run)
    for key, column in (("1_query_frame/rho", "qf_spearman"), ("1_query_frame/rho_baseline", "qf_rho_baseline"),
                        ("1_query_frame/rho_null", "qf_spearman_null")):  # fmt: skip
        logged_values = {row["step"]: row[key] for row in rows if key in row}
        assert logged_values == pytest.approx(_by_x(run, cells.groupby("step")[column].mean()), rel=1e-12)
    first = next(row for row in rows if any(k[0].isdigit() for k in row))
    assert sorted(k for k in first if k != "step")[0] == "1_query_frame/rho"  # the same order as TensorBoard
    histograms = {(row["step"]) for row in rows for v in row.values() if isinstance(v, tuple) and v[0] == "histogram"}
    assert histograms == set(_x(run).values())
    # wandb's rule for a media file (wandb.sdk.data_types.base_types.media._wb_filename, bound at run.log): the image
    # logged under KEY goes to media/images/{KEY}_{wandb's own step}_{hash}.png, a "/" in KEY making a folder, and
    # wandb's own step counts the run.log calls (no step= is passed). The overlay's files must carry the timestep.
    files = {
        f"media/images/{key}_{own_step}_HASH.png": (row["step"], value[2])
        for own_step, row in enumerate(rows)
        for key, value in row.items()
        if key.startswith("7_overlays/reference_shares")
    }
    timesteps = cells.groupby("step")["timestep"].first()
    own_steps = [int(name.split("_")[-2]) for name in files]
    assert files == {
        f"media/images/7_overlays/reference_shares/t{round(timesteps[x]):04d}_{n}_HASH.png": (
            x,
            f"step {x}, t {timesteps[x]:g}",
        )
        for x, n in zip(sorted(_x(run).values()), own_steps, strict=True)
    }
    charts = [v[1] for row in rows for k, v in row.items() if k.startswith("charts/")]
    (rho_chart,) = [
        c for c in charts if c["title"].endswith("query-frame rho: run, baseline, mean (read at smoothing 0)")
    ]
    assert all(len(k) <= 60 for row in rows for k in row if k.startswith("charts/"))  # wandb names an artifact so
    assert rho_chart["keys"] == ["1_query_frame/rho", "1_query_frame/rho_baseline", "1_query_frame/rho_mean"]
    assert rho_chart["xname"] == "denoising step"
    expected = _by_x(run, cells.groupby("step")["qf_spearman"].mean())
    assert rho_chart["ys"][0] == [expected[x] for x in sorted(expected)]
    config = [args[0] for name, args, _ in calls if name == "run.config.update"][0]
    assert {k: config[k] for k in SETTINGS} == SETTINGS
    summary = [args[0] for name, args, _ in calls if name == "run.summary.update"][0]
    assert summary["1_query_frame/rho_mean"] == pytest.approx(cells["qf_spearman"].mean(), rel=1e-12)
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


def _fake_mlflow(monkeypatch, tmp_path) -> list:
    """A recording stand-in for mlflow's client, installed as ``mlflow``; returns the list its calls go to."""
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
    return calls


def test_mlflow_gets_the_same_content_recorded(logged, tmp_path, monkeypatch):
    """A recording stand-in for mlflow's client (the real one is tested below where mlflow is installed)."""
    calls = _fake_mlflow(monkeypatch, tmp_path)
    run = logged[0]
    folder = run.log("mlflow", tmp_path, "digits", **logged[4])
    assert folder == tmp_path / "mlartifacts" / "1" / "r1"
    assert calls[0] == ("MlflowClient", (), {"tracking_uri": f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"})
    metrics = [m for name, _, kw in calls if name == "client.log_batch" for m in kw.get("metrics", [])]
    rho = {step: value for key, value, step in metrics if key == "1_query_frame/rho"}
    assert rho == pytest.approx(_by_x(run, _cells(run).groupby("step")["qf_spearman"].mean()), rel=1e-12)
    null = {step: value for key, value, step in metrics if key == "1_query_frame/rho_null"}
    assert null == pytest.approx(_by_x(run, _cells(run).groupby("step")["qf_spearman_null"].mean()), rel=1e-12)
    params = dict(p for name, _, kw in calls if name == "client.log_batch" for p in kw.get("params", []))
    assert params["digit"] == "3" and params["probe/bandwidth"] == "matched"
    images = [(kw["key"], kw["step"]) for name, _, kw in calls if name == "client.log_image"]
    assert [s for k, s in images if k == "7_overlays/reference_shares"] == sorted(_x(run).values())
    dicts = {args[2]: args[1] for name, args, _ in calls if name == "client.log_dict"}
    assert set(dicts["histograms.json"]["hist/rho_per_layer_head_cell"]) == set(_x(run).values())
    assert dicts["layout.json"]
    assert calls[-1][0] == "client.set_terminated"


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_run_that_fails_while_logging_is_closed_as_failed_not_finished(logged, tmp_path, monkeypatch, error):
    """A log that stops on an error (or Ctrl-C) closes its MLflow run as ``FAILED`` (``KILLED``) and re-raises: the
    tracker's list never shows it complete, nor running forever; a whole log closes it ``FINISHED``."""
    import ipa_probe.probe_log

    calls = _fake_mlflow(monkeypatch, tmp_path)
    logged[0].log("mlflow", tmp_path, "digits", **logged[4])
    assert calls[-1] == ("client.set_terminated", ("r1",), {"status": "FINISHED"})

    def fail(content, tracker):
        tracker.scalars({"x": 1.0}, 0)
        raise error

    calls.clear()
    monkeypatch.setattr(ipa_probe.probe_log, "write", fail)
    with pytest.raises(type(error)):
        logged[0].log("mlflow", tmp_path, "digits", **logged[4])
    expected = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
    assert calls[-1] == ("client.set_terminated", ("r1",), {"status": expected})
    assert [c for c in calls if c[0] == "client.set_terminated"] == [calls[-1]]  # closed once


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
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "1_query_frame/rho")}
    assert history == pytest.approx(_by_x(run, _cells(run).groupby("step")["qf_spearman"].mean()), rel=1e-12)
    assert found.data.params["guidance_scale"] == "3.0"
    assert found.data.metrics["1_query_frame/rho_mean"] == pytest.approx(_cells(run)["qf_spearman"].mean(), rel=1e-12)
    # the order, names and steps the TensorBoard test checks, read back from the store: MLflow lists metrics by name,
    # so the sorted names start with the query frame's rho; the sub-runs are TAG_baseline/_mean; steps: denoising
    charts = sorted(k for k in found.data.metrics if k.split("/")[0] not in ("end",) and not k.endswith("_mean"))
    assert charts[0] == "1_query_frame/rho"
    groups = list(dict.fromkeys(t.split("/")[0] for t in charts))
    assert groups[:6] == ["1_query_frame", "2_stored_frame", "3_agreement", "4_query_frame_rho_per_layer",
                          "5_stored_frame_rho_per_layer", "6_reference_shares"]  # fmt: skip
    assert not [t for t in charts if t.split("/")[0] in ("debug", "nw")]  # bookkeeping: no metric
    cells = _cells(run)
    for tag, column in (("1_query_frame/rho", "qf_spearman"), ("1_query_frame/rho_baseline", "qf_rho_baseline"),
                        ("1_query_frame/rho_null", "qf_spearman_null"), ("2_stored_frame/rho", "spearman"),
                        ("2_stored_frame/rho_null", "spearman_null")):  # fmt: skip
        values = {m.step: m.value for m in client.get_metric_history(found.info.run_id, tag)}
        assert sorted(values) == sorted(_x(run).values())  # denoising steps
        assert values == pytest.approx(_by_x(run, cells.groupby("step")[column].mean()), rel=1e-12)
    files = {p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()}
    assert {"histograms.json", "layout.json", "2_run/settings.md", "3_images/readings.md"} <= files
    overlays = [f for f in files if f.startswith("images/7_overlays~reference_shares+step+") and f.endswith(".png")]
    assert len(overlays) == STEPS


def test_cli_prints_the_folder_of_the_event_file(tmp_path, capsys):
    from ipa_probe.cli import main

    out = tmp_path / "out"
    argv = ["probe", "--log-with", "tensorboard", "--out", str(out), "--steps", "2", "--num-images", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    folder = re.search(r"tensorboard logs in (\S+?)[,;]", printed).group(1)
    events_files = sorted(Path(out / "logs").rglob("events.out.tfevents.*"))
    assert Path(folder) in {event.parent for event in events_files}
    assert Path(folder).name == "probe_digit3_seed0_frame-item_steps2"  # named by what differs between runs
    events = _events(folder)
    (text,) = events.Tensors("3_images/readings/text_summary")
    from tensorboard.util import tensor_util

    readings = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    digits = pd.read_json(out / "digits.json", typ="series")
    assert [int(re.search(r"read as (\d)", line).group(1)) for line in readings.splitlines()[2:]] == digits[
        "predicted"
    ]


def test_the_step_is_the_loop_index_and_the_timestep_is_kept_beside_it():
    from ipa_probe.probe_log import _steps

    summary = pd.DataFrame({"call": [0, 0, 0, 1], "step": [0, 1, 2, 0], "timestep": [999.4, 999.2, 1.0, 999.0]})
    assert _steps(summary) == ({(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 0): 0},
                               {(0, 0): 999.4, (0, 1): 999.2, (0, 2): 1.0, (1, 0): 999.0})  # fmt: skip


def test_probe_log_with_draws_the_overlays_over_a_grey_field(organism, tmp_path):
    """``probe(pipe, maps=True, log_with=...)`` sees no generated image: the overlays still come at every step."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    refs = digits_reference_images(3, 3)
    with probe(organism, maps=True, log_with="tensorboard", logging_dir=tmp_path, run_name="ctx") as run:
        organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=2, guidance_scale=3.0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    events = _events(tmp_path / "ctx")
    x = _x(run)
    assert [e.step for e in events.Images("7_overlays/reference_shares")] == sorted(x[s] for s in run.map_steps(0))
    assert len(x) == 2 and "9_images/generated" not in events.Tags()["images"]
    expected = _by_x(run, _cells(run).groupby("step")["qf_spearman"].mean())
    assert _scalar(events, "1_query_frame/rho") == pytest.approx(expected, abs=FLOAT32)


def test_several_calls_in_one_block_get_a_prefix_and_a_layout_each(sd15, refs, tmp_path):
    with probe(sd15) as run:
        for seed in (0, 1):
            sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(seed))  # fmt: skip
    events = _events(run.log("tensorboard", tmp_path, "two"))
    table = run.to_dataframe()
    for call in (0, 1):
        cells = table[(table["call"] == call) & (table["kind"] == "image") & (table["branch"] == "cond")]
        expected = _by_x(run, cells.groupby("step")["spearman"].mean(), call)
        assert _scalar(events, f"2_stored_frame_call{call}/rho") == pytest.approx(expected, abs=FLOAT32)
    assert "2_stored_frame/rho" not in events.Tags()["scalars"]
    titles = [c.title for c in _layout_of(events).category if c.title.startswith("stored frame")]
    assert titles == [f"stored frame (gauge-dependent): cond branch_call{c}" for c in (0, 1)]


@pytest.mark.parametrize("branch", ["text", "both"])
def test_text_branch_series_and_layout(sd15, refs, tmp_path, branch):
    """A text-only probe's headline is its text branch (``nw/text/...``); with both, the text gets its own category."""
    with probe(sd15, branch=branch) as run:
        sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
             generator=torch.Generator().manual_seed(0))  # fmt: skip
    events = _events(run.log("tensorboard", tmp_path, branch))
    table = run.to_dataframe()
    text = table[(table["kind"] == "text") & (table["branch"] == "cond")]
    expected = _by_x(run, text.groupby("step")["spearman"].mean())
    tag = "2_stored_frame/rho" if branch == "text" else "text_cond_stored_frame/rho"  # text-only: the headline
    assert _scalar(events, tag) == pytest.approx(expected, abs=FLOAT32)
    charts = {
        (c.title, chart.title): list(chart.multiline.tag) for c in _layout_of(events).category for chart in c.chart
    }
    scalars = set(events.Tags()["scalars"])
    assert all(any(re.search(p, t) for t in scalars) for patterns in charts.values() for p in patterns)
    assert any(f"^{re.escape(tag)}$" in tags for tags in charts.values())
    layers = {t for t in scalars if t.startswith("5_stored_frame_rho_per_layer/")}
    assert len(layers) == len(run.layers)  # per layer: the headline series (text-only: the text branch)
