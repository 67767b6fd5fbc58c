"""Send a finished run to TensorBoard, Weights & Biases or MLflow, through each one's own public API.

Storage side, apart from the capture code: nothing here runs inside a denoising loop. :class:`Tracker` is one run of
one tracker; :func:`log_probe_run` logs a probe (what and under which tags: :mod:`ipa_probe.probe_log`),
:func:`log_sweep` and :func:`log_experiments` a sweep's aggregate and rows and the experiments' tables, figures and
series. TensorBoard ships with ``ipa_probe``; ``pip install 'ipa_probe[wandb]'`` or ``'ipa_probe[mlflow]'`` adds the
others. What each tracker shows, and where: docs/logging.md.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TRACKERS",
    "Layout",
    "Tracker",
    "check_tracker",
    "log_experiments",
    "log_probe_run",
    "log_sweep",
    "run_name_for",
]

logger = logging.getLogger(__name__)

#: The trackers ``log_with`` accepts, and the Python module each one needs.
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_tracker(name: Any) -> str:
    """``name`` if it is a tracker that can log now; else a one-line error naming the remedy. Checked before a run
    starts, so that a tracker that cannot log does not fail after all the work.

    wandb can log when ``WANDB_MODE`` is ``offline``/``dryrun``/``disabled``, or with an API key: ``WANDB_API_KEY``
    or the netrc entry ``wandb login`` writes for its host (``WANDB_BASE_URL``, default ``api.wandb.ai``), read here
    as wandb reads it, without importing wandb or reaching the network. TensorBoard and MLflow (by default a local
    store) need only their client; MLflow with an ``http(s)`` ``MLFLOW_TRACKING_URI`` also a server that accepts a
    connection (one attempt, 3 s at most).

    Raises:
        ValueError: not one of :data:`TRACKERS`, wandb with no API key and not in offline mode, or an MLflow
            tracking server that does not answer.
        ImportError: its client is not installed (the message names the extra to install).
    """
    if name not in TRACKERS:
        raise ValueError(f"log_with: expected one of {', '.join(map(repr, TRACKERS))}, got {name!r}")
    if importlib.util.find_spec(TRACKERS[name]) is None:
        raise ImportError(f"log_with={name!r} needs the {name} client: pip install 'ipa_probe[{name}]'")
    if name == "wandb" and not _wandb_can_log(os.environ):
        raise ValueError(
            "log_with='wandb': wandb is not logged in and not in offline mode, so it would fail after the run; run "
            "`wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to log locally"
        )
    if name == "mlflow":
        _check_mlflow_server(os.environ.get("MLFLOW_TRACKING_URI"))
    return name


def _check_mlflow_server(uri: str | None, timeout: float = 3.0) -> None:
    """An ``http(s)`` ``MLFLOW_TRACKING_URI`` must accept a connection now: MLflow's client would otherwise retry for
    minutes after the run and then fail. Other URIs (a local database or folder, Databricks profiles) pass."""
    if not uri:
        return
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ValueError(
            f"log_with='mlflow': no tracking server answers at MLFLOW_TRACKING_URI={uri!r} ({err}); start the server, "
            "or unset MLFLOW_TRACKING_URI to log to a local store in the logging folder"
        ) from None


def run_name_for(base: str, settings: Mapping | None = None, probe: Mapping | None = None) -> str:
    """A run's name from what tells it apart from its neighbours: ``base`` then, where known, the digit, the seed, the
    gauge, the query frame and the number of steps (``probe_digit3_seed0_frame-item_steps20``). Two runs with the
    same settings get the same name, so that a rerun replaces its run instead of adding a copy beside it."""
    settings, probe = dict(settings or {}), dict(probe or {})
    parts = [base]
    for key, short in (("digit", "digit"), ("seed", "seed"), ("gauge", "gauge")):
        if settings.get(key) is not None:
            parts.append(f"{short}{settings[key]}")
    if probe.get("query_frame") is not None:
        parts.append(f"frame-{probe['query_frame']}")
    if settings.get("steps") is not None:
        parts.append(f"steps{settings['steps']}")
    return "_".join(str(p).replace("/", "-").replace(" ", "-") for p in parts)


def _run_folder(logging_dir: Path, run_name: str) -> Path:
    """``logging_dir/run_name``, emptied of the event files a previous run of that name wrote there (in it and in its
    sub-runs: subfolders that hold nothing but event files): a rerun with the same name replaces its run, so that no
    curve shows twice. Nothing else is removed."""
    folder = logging_dir / run_name
    if folder.is_dir():
        subruns = [f for f in folder.iterdir() if f.is_dir() and any(f.iterdir())]
        subruns = [f for f in subruns if all(p.name.startswith("events.out.tfevents.") for p in f.iterdir())]
        for place in (folder, *subruns):
            for old in place.glob("events.out.tfevents.*"):
                old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wandb_can_log(environ: Mapping[str, str]) -> bool:
    """Whether wandb has what it needs to log: offline mode, or an API key in the environment or in netrc."""
    from urllib.parse import urlparse

    if environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun", "disabled"):
        return True
    if environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes"):
        return True
    if environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    return _netrc_has(host, environ)


def _netrc_has(host: str, environ: Mapping[str, str]) -> bool:
    """Whether the user's netrc (``NETRC``, else ``~/.netrc``) holds a password for ``host``."""
    import netrc

    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


#: A chart layout: ``[(category title, [(chart title, [tag, ...]), ...]), ...]`` (exact tags; each chart draws the
#: run's series of each tag and every sub-run's).
Layout = list[tuple[str, list[tuple[str, list[str]]]]]


def _histogram_record(values) -> dict[str, Any]:
    """Count, sum, min, max and a 30-bucket histogram of ``values`` (what MLflow keeps of a histogram)."""
    import numpy as np

    counts, edges = np.histogram(values, bins=30)
    return {
        "count": int(values.size),
        "sum": float(values.sum()),
        "min": float(values.min()),
        "max": float(values.max()),
        "bucket_edges": edges.tolist(),
        "bucket_counts": counts.tolist(),
    }


class Tracker:
    """One run of a tracker, written through the tracker's own public API (how each tracker stores it:
    docs/logging.md). Under ``accelerate launch`` only the main process writes, as with accelerate's trackers.

    ``logging_dir``: TensorBoard writes to ``logging_dir/run_name`` (the event files an earlier run of that name left
    removed first), wandb takes it as its ``dir``, MLflow writes ``logging_dir/mlflow.db`` and ``mlartifacts``.
    ``run_name`` names TensorBoard's folder, wandb's project and run, MLflow's experiment and run. :attr:`folder`:
    where the run's files are (for a remote MLflow store, its tracking URI).
    """

    def __init__(self, name: str, logging_dir: str | os.PathLike = "runs", run_name: str = "ipa_probe") -> None:
        self.name = check_tracker(name)
        self.logging_dir = Path(logging_dir)
        self.run_name = run_name
        from accelerate import PartialState

        self.active = PartialState().is_main_process
        self.folder = self.logging_dir / run_name
        self._histograms: dict[str, dict[int, dict[str, Any]]] = {}
        if not self.active:
            return
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.folder = _run_folder(self.logging_dir, run_name)
            self._writer = SummaryWriter(log_dir=str(self.folder))
            self._subwriters: dict[str, Any] = {}
        elif name == "wandb":
            import wandb

            self.logging_dir.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(project=run_name, name=run_name, dir=str(self.logging_dir))
            self._run.define_metric("step")
            self._run.define_metric("*", step_metric="step")  # wandb's own step counts rows; chart against ours
            self.folder = Path(self._run.dir).parent  # run.dir is the run folder's files/
        else:
            self._start_mlflow()

    def _start_mlflow(self) -> None:
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if uri is None:  # a local store: no server; MLflow 3 keeps runs in a database (its file store is retired)
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(self.logging_dir / 'mlflow.db').resolve()}"
            artifacts = str((self.logging_dir / "mlartifacts").resolve())
        self._client = client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(self.run_name)
        if experiment is None:
            experiment_id = client.create_experiment(self.run_name, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        self._run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
        artifact_uri = client.get_run(self._run_id).info.artifact_uri
        local = artifact_uri.removeprefix("file://")
        self.folder = Path(local) if "://" not in local else artifact_uri  # a remote store: where it keeps them

    def hparams(
        self, values: Mapping, metrics: Mapping[str, float] | None = None, step: int = 0, group: str | None = None
    ) -> None:
        """The run's settings as hyper-parameters and, when given, its end-of-run metrics.

        ``group``: the sub-run whose scalars (of the metrics' tags) already hold the metrics' values (the probe's
        ``mean`` run: TensorBoard's HParams view reads a metric as the last value of that scalar, so no one-point
        chart is written); ``None``: the values are written here as scalars at ``step``. wandb: the run's summary
        (``tag_group``); MLflow: the metrics of the run (written with the sub-run's scalars when ``group`` is given).
        """
        if not self.active:
            return
        from .probe_log import flat_settings  # pandas: not before the run (the CLI checks trackers torch-free)

        flat = {k: (str(v) if isinstance(v, bool) else v) for k, v in flat_settings(values).items()}
        metrics = {k: float(v) for k, v in (metrics or {}).items() if v is not None and math.isfinite(float(v))}
        if self.name == "tensorboard":
            from tensorboard.plugins.hparams import plugin_data_pb2
            from torch.utils.tensorboard.summary import hparams

            experiment, start, end = hparams(flat, metrics)
            if group:  # the metrics' values live in the sub-run `group`: name it in each metric's info
                plugin = experiment.value[0].metadata.plugin_data
                data = plugin_data_pb2.HParamsPluginData.FromString(plugin.content)
                for info in data.experiment.metric_infos:  # a short header: "query frame rho", not cut
                    info.name.group = group
                    info.display_name = info.name.tag.split("_", 1)[-1].replace("_", " ").replace("/", " ")
                plugin.content = data.SerializeToString()
            for summary in (experiment, start, end):  # into this run's file: no second, timestamped run
                self._writer.file_writer.add_summary(summary)
            if not group:
                for tag, value in metrics.items():
                    self._writer.add_scalar(tag, value, step)
        elif self.name == "wandb":
            self._run.config.update(flat, allow_val_change=True)
            self._run.summary.update({f"{k}_{group}" if group else k: v for k, v in metrics.items()})
        else:
            from mlflow.entities import Param

            params = [Param(k, str(v)[:6000]) for k, v in flat.items()]  # MLflow's limit on a parameter's length
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self._client.log_batch(self._run_id, params=params[i : i + 100])
            if metrics and not group:
                self.scalars(metrics, step)

    def scalars(self, values: Mapping[str, float], step: int, series: str = "") -> None:
        """Numbers at one step (non-finite ones are left out: the trackers reject or mis-draw NaN).

        ``series``: a sub-run (``"baseline"``, ``"null"``, ``"mean"``) holding references to the run's own series
        under the same tags: TensorBoard writes it to the subfolder ``series`` (one chart then draws the run and its
        sub-runs in their own colours, each named by its run); wandb and MLflow, which have no sub-runs, log it as
        ``tag_series``.
        """
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        if not finite or not self.active:
            return
        if self.name == "tensorboard":
            if series and series not in self._subwriters:
                from torch.utils.tensorboard import SummaryWriter

                self._subwriters[series] = SummaryWriter(log_dir=str(self.folder / series))
            writer = self._subwriters[series] if series else self._writer
            for tag, value in finite.items():
                writer.add_scalar(tag, value, step)
            return
        if series:
            finite = {f"{tag}_{series}": value for tag, value in finite.items()}
        if self.name == "wandb":
            self._run.log({**finite, "step": step})
        else:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, step) for k, v in finite.items()]
            for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
                self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def histogram(self, tag: str, values, step: int) -> None:
        """The distribution of ``values`` (the finite ones; none: nothing is written) at one step. MLflow has no
        histograms: there they are kept as ``histograms.json`` (count, sum, min, max, 30 buckets per tag and step)."""
        import numpy as np

        values = np.asarray(values, dtype=np.float64).ravel()
        values = values[np.isfinite(values)]
        if not values.size or not self.active:
            return
        if self.name == "tensorboard":
            self._writer.add_histogram(tag, values, step)
        elif self.name == "wandb":
            import wandb

            self._run.log({tag: wandb.Histogram(values), "step": step})
        else:
            self._histograms.setdefault(tag, {})[step] = _histogram_record(values)

    def text(self, values: Mapping[str, str], step: int = 0) -> None:
        """Text (markdown tables, notes)."""
        if not self.active:
            return
        if self.name == "tensorboard":
            for tag, value in values.items():
                self._writer.add_text(tag, value, step)
        elif self.name == "wandb":
            import html

            import wandb

            self._run.log({k: wandb.Html(f"<pre>{html.escape(v)}</pre>") for k, v in values.items()} | {"step": step})
        else:
            for key, value in values.items():
                self._client.log_text(self._run_id, value, f"{key}.md")

    def figures(self, figures: Mapping[str, Any], step: int = 0, timestep: float | None = None) -> None:
        """Matplotlib figures (closed afterwards) or ``(H, W, 3)`` uint8 arrays, as images at ``step`` (TensorBoard
        and MLflow: a slider over the steps of one tag). wandb names the file of an image logged under ``key``
        ``media/images/{key}_{its own step}_{hash}.png``: given the ``timestep``, the key is ``TAG/t0951``."""
        import numpy as np

        from .probe_log import figure_array

        arrays = {k: (np.asarray(v) if isinstance(v, np.ndarray) else figure_array(v)) for k, v in figures.items()}
        if not self.active or not arrays:
            return
        if self.name == "tensorboard":
            for tag, array in arrays.items():
                self._writer.add_image(tag, array, step, dataformats="HWC")
        elif self.name == "wandb":
            import wandb

            tail = "" if timestep is None else f"/t{timestep:04.0f}"
            caption = f"step {step}, t {timestep:g}" if tail else None
            self._run.log({k + tail: wandb.Image(a, caption=caption) for k, a in arrays.items()} | {"step": step})
        else:
            for key, array in arrays.items():
                self._client.log_image(self._run_id, array, key=key, step=step)

    def layout(
        self, layout: Layout, series: Mapping[str, Mapping[str, Mapping[int, float]]], x_axis: str = "step"
    ) -> None:
        """Charts that draw several scalars together: each chart lists exact tags and draws every sub-run that has
        them. TensorBoard: a custom-scalars layout (its Custom Scalars view; a tag's sub-runs are drawn by
        TensorBoard itself); wandb: one line-series chart per entry, of the ``series`` (sub-run -> tag -> step ->
        value) it names, against ``x_axis``; MLflow, which has no chart API: ``layout.json``, the charts and the
        metric names each one draws."""
        import re

        if not self.active:
            return
        if self.name == "tensorboard":
            self._writer.add_custom_scalars(
                {
                    category: {title: ["Multiline", [f"^{re.escape(t)}$" for t in tags]] for title, tags in charts}
                    for category, charts in layout
                }
            )
            return
        drawn = {
            f"{category}/{title}": [
                (f"{tag}_{run}" if run else tag, values[tag])
                for tag in tags
                for run, values in sorted(series.items())
                if tag in values
            ]
            for category, charts in layout
            for title, tags in charts
        }
        if self.name == "wandb":
            import wandb

            for number, (title, lines) in enumerate((k, v) for k, v in drawn.items() if v):
                xs = [sorted(values) for _, values in lines]
                ys = [[values[s] for s in x] for (_, values), x in zip(lines, xs, strict=True)]
                keys = [name for name, _ in lines]
                chart = wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title, xname=x_axis)
                # the key names a wandb artifact (at most 128 characters): a number and the chart's title, cut
                self._run.log({f"charts/{number:02d} {title.rsplit('/', 1)[-1]}"[:60]: chart})
        else:
            self._client.log_dict(self._run_id, {k: [n for n, _ in v] for k, v in drawn.items()}, "layout.json")

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        self.finish(err)
        return False

    def finish(self, error: BaseException | None = None) -> None:
        """Close the run. A run left by ``error`` is closed as what it is, so that a tracker's list of runs never
        shows it as complete or, after an interrupt, as still running: MLflow ``KILLED`` (Ctrl-C) or ``FAILED``,
        wandb exit code 1 (TensorBoard keeps no status)."""
        if not self.active:
            return
        self.active = False
        if self.name == "tensorboard":
            for writer in (self._writer, *self._subwriters.values()):
                writer.close()
        elif self.name == "wandb":
            self._run.finish(exit_code=0 if error is None else 1)
        else:
            if self._histograms and error is None:
                self._client.log_dict(self._run_id, self._histograms, "histograms.json")
            status = "FINISHED" if error is None else "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            self._client.set_terminated(self._run_id, status=status)


def log_probe_run(
    run,
    log_with: str,
    logging_dir: str | os.PathLike = "runs",
    run_name: str | None = None,
    *,
    images: Sequence | None = None,
    references: Sequence | None = None,
    readings: Sequence[str] | None = None,
    settings: Mapping | None = None,
) -> Path:
    """Log a finished probe: the headline statistics under readable tags with a custom-scalars layout, histograms,
    the overlays at every step, the generated images and their readings, and the settings with end-of-run metrics
    (what and under which tags: :mod:`ipa_probe.probe_log` and docs/logging.md).

    ``logging_dir``, ``run_name``: see :class:`Tracker` (``run_name=None``: named by what differs between runs,
    :func:`run_name_for`). ``images``: the generated images (PIL), the first the overlays' background (``None``: a
    grey field); ``references``: the first adapter's; ``readings``: one line per generated image (e.g. the digit
    classifier's reading); ``settings``: the generation's (steps, guidance, adapter scale, model, ...), logged as
    hyper-parameters beside the probe's own. Returns :attr:`Tracker.folder`.
    """
    from .probe_log import collect, write

    content = collect(run, images=images, references=references, readings=readings, settings=settings)
    if run_name is None:
        run_name = run_name_for("probe", settings, run.config.describe())
    with Tracker(log_with, logging_dir, run_name) as tracker:
        write(content, tracker)
    return tracker.folder


def log_sweep(
    result, directory, settings: Mapping, log_with: str, logging_dir: str | os.PathLike, run_name: str = "sweep"
) -> Path:
    """Log a finished sweep: the aggregate per timestep (step = position in the denoising order), each row's mean
    Spearman (step = manifest row), the aggregate figure and the settings.

    Args:
        result: what :func:`ipa_probe.sweep.run_sweep` returned.
        directory: the sweep's output folder (its ``aggregate.parquet``, ``row_summary.parquet`` and plot are read).
        settings: the sweep's settings (hyper-parameters).
        log_with, logging_dir, run_name: see :class:`Tracker`.
    """
    import numpy as np
    import pandas as pd
    from PIL import Image

    from .sweep.storage import SweepLayout

    layout = SweepLayout(Path(directory))
    with Tracker(log_with, logging_dir, run_name) as tracker:
        tracker.hparams(settings)
        if layout.aggregate.exists():
            agg = pd.read_parquet(layout.aggregate)
            for branch, part in agg.groupby("branch", sort=True):
                part = part.sort_values("timestep", ascending=False).reset_index(drop=True)
                for position, row in part.iterrows():
                    values = {
                        f"sweep/{branch}/{column}": value
                        for column, value in row.items()
                        if column != "branch" and pd.api.types.is_number(value) and not isinstance(value, bool)
                    }
                    tracker.scalars(values, int(position))
        if layout.row_summary.exists():
            rows = pd.read_parquet(layout.row_summary)
            if "row" in rows and "spearman" in rows:
                means = [c for c in ("qf_spearman", "spearman") if c in rows]  # query frame first, where recorded
                for row, part in rows.groupby("row"):
                    tracker.scalars({f"sweep/rows/{c}_mean": float(part[c].mean()) for c in means}, int(row))
        if layout.plot.exists():
            with Image.open(layout.plot) as image:
                tracker.figures({"sweep/rho_by_timestep": np.asarray(image.convert("RGB"))})
    return tracker.folder


def _series(measurements: Any, path: str = "") -> list[tuple[str, int, float]]:
    """``(tag, position, value)`` of the per-timestep series in an experiment's measurements: lists of records with
    a ``timestep`` (the ip-adapter experiment) and dicts keyed by flow time whose values are records (attention)."""
    out: list[tuple[str, int, float]] = []
    if isinstance(measurements, list) and measurements and all(isinstance(r, Mapping) for r in measurements):
        if all("timestep" in r for r in measurements):
            for position, record in enumerate(measurements):
                out += [
                    (f"{path}/{k}", position, float(v))
                    for k, v in record.items()
                    if isinstance(v, int | float) and not isinstance(v, bool) and k != "timestep"
                ]
        return out
    if isinstance(measurements, Mapping):
        numeric = all(isinstance(k, int | float) and not isinstance(k, bool) for k in measurements)
        if numeric and measurements and all(isinstance(v, Mapping) for v in measurements.values()):
            for position, key in enumerate(measurements):
                out += [
                    (f"{path}/{k}", position, float(v))
                    for k, v in measurements[key].items()
                    if isinstance(v, int | float) and not isinstance(v, bool)
                ]
            return out
        for key, value in measurements.items():
            out += _series(value, f"{path}/{key}" if path else str(key))
    return out


def log_experiments(
    results: Mapping, folder, settings: Mapping, log_with: str, logging_dir, run_name: str = "experiments"
) -> Path:
    """Log finished experiments: each one's table (text), figures (images), per-timestep series where its
    measurements have them (:func:`_series`) and wall time, and the settings (the tier) as hyper-parameters."""
    import numpy as np
    from PIL import Image

    with Tracker(log_with, logging_dir, run_name) as tracker:
        tracker.hparams(settings)
        for name, result in results.items():
            table = Path(folder) / name / "table.md"
            if table.exists():
                tracker.text({f"{name}/table": table.read_text()})
            for figure in result.figures:
                with Image.open(figure) as image:
                    tracker.figures({f"{name}/{Path(figure).stem}": np.asarray(image.convert("RGB"))})
            by_step: dict[int, dict[str, float]] = {}
            for tag, position, value in _series(result.record.get("measurements", {}), name):
                by_step.setdefault(position, {})[tag] = value
            for position, values in sorted(by_step.items()):
                tracker.scalars(values, position)
            if "wall_time_s" in result.record:
                tracker.scalars({f"{name}/wall_time_s": result.record["wall_time_s"]}, 0)
    return tracker.folder
