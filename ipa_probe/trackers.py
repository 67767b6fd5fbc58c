"""Send a run's per-timestep statistics, figures and settings to TensorBoard, Weights & Biases or MLflow.

Storage side, apart from the capture code: nothing here runs inside a denoising loop. A probe logs when its ``with``
block ends (``probe(pipe, log_with="tensorboard")``), after the one device-to-host transfer of its buffers; a sweep
and the experiments log when they have finished. The trackers are accelerate's (:mod:`accelerate.tracking`), which
log on the main process only under ``accelerate launch``.

What is logged (tags for a probe; ``prefix`` defaults to ``"probe"``):

- per recorded step (the x axis is the denoising loop index), per kind and CFG branch, every numeric column of the
  per-timestep summary (:func:`ipa_probe.capture.report.summarize`): ``{prefix}/{kind}/{branch}/spearman``,
  ``.../pearson``, ``.../spearman_null``, ``.../timestep`` (the scheduler's timestep of that step), ...; with several
  pipeline calls in one block, ``{prefix}/call{c}/{kind}/{branch}/...``;
- figures as images: ``{prefix}/rho_by_timestep`` (and ``{prefix}/reference_maps`` with ``maps=True``);
- the settings as hyper-parameters (nested keys joined with ``/``; lists and ``None`` as text).

TensorBoard ships with ``ipa_probe`` (the tested one); ``pip install 'ipa_probe[wandb]'`` or ``'ipa_probe[mlflow]'``
adds the others. wandb refuses a step lower than its last one, so there each scalar row carries its step as the value
``step`` (chart against it) and wandb's own step just counts the rows.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TRACKERS", "Tracker", "check_tracker", "log_experiments", "log_probe_run", "log_sweep"]

logger = logging.getLogger(__name__)

#: The trackers ``log_with`` accepts, and the Python module each one needs.
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_tracker(name: Any) -> str:
    """``name`` if it is a tracker that can log now; else a one-line error naming the remedy. Checked before a run
    starts, so that a tracker that cannot log does not fail after all the work.

    wandb can log when ``WANDB_MODE`` is ``offline``/``dryrun``/``disabled``, or with an API key: ``WANDB_API_KEY``
    or the netrc entry ``wandb login`` writes for its host (``WANDB_BASE_URL``, default ``api.wandb.ai``), read here
    as wandb reads it, without importing wandb or reaching the network. TensorBoard and MLflow (by default a local
    ``mlruns`` store) need only their client.

    Raises:
        ValueError: not one of :data:`TRACKERS`, or wandb with no API key and not in offline mode.
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
    return name


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


def _flat(values: Mapping, prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested settings as one level (keys joined with ``/``), every value a bool, int, float or string."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{name}/"))
        elif isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def _figure_array(fig):
    """An ``(H, W, 3)`` uint8 array of a matplotlib figure (drawn with Agg; the figure is closed)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    array = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return array


class Tracker:
    """One run of a tracker, through accelerate's tracker classes.

    Args:
        name: ``"tensorboard"``, ``"wandb"`` or ``"mlflow"``.
        logging_dir: where the logs go (TensorBoard: ``logging_dir/run_name``; wandb: its ``dir``; MLflow: the
            experiment's artifact location).
        run_name: the run's name (TensorBoard's sub-folder, the wandb project, the MLflow experiment).
    """

    def __init__(self, name: str, logging_dir: str | os.PathLike = "runs", run_name: str = "ipa_probe") -> None:
        self.name = check_tracker(name)
        self.logging_dir = Path(logging_dir)
        self.run_name = run_name
        from accelerate import PartialState
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

        PartialState()  # accelerate's trackers log through its logger, which needs the state (one process: cheap)
        if name == "tensorboard":
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            self.tracker = TensorBoardTracker(run_name, self.logging_dir)
        elif name == "wandb":
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            self.tracker = WandBTracker(run_name, dir=str(self.logging_dir))
        else:
            self.tracker = MLflowTracker(experiment_name=run_name, logging_dir=str(self.logging_dir))
        self.tracker.start()

    @property
    def folder(self) -> Path:
        """Where TensorBoard writes its event files (``logging_dir/run_name``)."""
        return self.logging_dir / self.run_name

    def hparams(self, values: Mapping) -> None:
        """The run's settings as hyper-parameters."""
        self.tracker.store_init_configuration(_flat(values))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Numbers at one step (non-finite ones are left out: the trackers reject or mis-draw NaN)."""
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        if not finite:
            return
        if self.name == "wandb":  # wandb drops a step lower than its last: give the step as a value (the x axis)
            self.tracker.log({**finite, "step": step})
        else:
            self.tracker.log(finite, step=step)

    def text(self, values: Mapping[str, str], step: int = 0) -> None:
        """Text (markdown tables, notes)."""
        if self.name == "mlflow":
            import mlflow

            for key, value in values.items():
                mlflow.log_text(value, f"{key}.md")
        else:
            self.tracker.log(dict(values), step=None if self.name == "wandb" else step)

    def figures(self, figures: Mapping[str, Any], step: int = 0) -> None:
        """Matplotlib figures (closed afterwards) or ``(H, W, 3)`` uint8 arrays, as images."""
        import numpy as np

        arrays = {k: (np.asarray(v) if isinstance(v, np.ndarray) else _figure_array(v)) for k, v in figures.items()}
        if self.name == "tensorboard":
            self.tracker.log_images({k: a[None] for k, a in arrays.items()}, step=step, dataformats="NHWC")
        elif self.name == "wandb":
            self.tracker.log_images({k: [a] for k, a in arrays.items()})
        else:
            import mlflow

            for key, array in arrays.items():
                mlflow.log_image(array, f"{key}.png")

    def finish(self) -> None:
        self.tracker.finish()


def _summary_scalars(summary, prefix: str) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every numeric column of a per-timestep summary, per call, kind and branch."""
    import pandas as pd

    keys = ("call", "step", "kind", "branch")
    several = summary["call"].nunique() > 1
    out = []
    for _, row in summary.iterrows():
        where = f"{prefix}/" + (f"call{int(row['call'])}/" if several else "") + f"{row['kind']}/{row['branch']}"
        for column, value in row.items():
            if column in keys or not pd.api.types.is_number(value) or isinstance(value, bool):
                continue
            out.append((f"{where}/{column}", int(row["step"]), float(value)))
    return out


def log_probe_run(
    run, log_with: str, logging_dir: str | os.PathLike = "runs", run_name: str = "probe", prefix: str = "probe"
) -> Path:
    """Log a finished probe: per-step summary statistics, its figures and its settings (see the module docstring).

    Args:
        run: a finished :class:`~ipa_probe.ProbeRun`.
        log_with: ``"tensorboard"``, ``"wandb"`` or ``"mlflow"``.
        logging_dir, run_name: see :class:`Tracker`.
        prefix: the first part of every tag.

    Returns:
        the tracker's folder (TensorBoard: where the event files are).
    """
    tracker = Tracker(log_with, logging_dir, run_name)
    try:
        settings = dict(run.config.describe())
        settings.update(
            pipeline=type(run.pipe).__name__,
            family=run.tap.family,
            layers=len(run.layers),
            heads=run.num_heads,
            adapters=run.num_adapters,
        )
        tracker.hparams(settings)
        summary = run.summary()
        if not summary.empty:
            by_step: dict[int, dict[str, float]] = {}
            for tag, step, value in _summary_scalars(summary, prefix):
                by_step.setdefault(step, {})[tag] = value
            for step, values in sorted(by_step.items()):
                tracker.scalars(values, step)
        figures = {f"{prefix}/rho_by_timestep": run.plot()}
        if run.config.maps:
            figures[f"{prefix}/reference_maps"] = run.plot_reference_maps()
        tracker.figures(figures)
    finally:
        tracker.finish()
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
    tracker = Tracker(log_with, logging_dir, run_name)
    try:
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
                for row, part in rows.groupby("row"):
                    tracker.scalars({"sweep/rows/spearman_mean": float(part["spearman"].mean())}, int(row))
        if layout.plot.exists():
            with Image.open(layout.plot) as image:
                tracker.figures({"sweep/rho_by_timestep": np.asarray(image.convert("RGB"))})
    finally:
        tracker.finish()
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

    tracker = Tracker(log_with, logging_dir, run_name)
    try:
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
    finally:
        tracker.finish()
    return tracker.folder
