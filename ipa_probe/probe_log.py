"""What a finished probe sends to a tracker, and under which tags: the content, apart from the trackers' APIs.

:func:`collect` reads a finished :class:`~ipa_probe.ProbeRun` (its table, summary and reference maps) into a
:class:`ProbeLog`; :func:`write` hands it to a :class:`~ipa_probe.trackers.Tracker`. Nothing here runs inside the
denoising loop.

Ordered for the researcher who opens the dashboard: the x axis is the denoising step, each tag group starts with
its rank (``1_query_frame/``, ``2_stored_frame/``, ... ``9_images/``; the first one is the finding), a series and its
references share one tag in sibling runs (``baseline``, ``mean``), and the end-of-run numbers are the HParams view's
metrics only. Every tag, chart and text is listed in docs/logging.md ("What you see").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .capture.layer_order import network_order
from .statistics.schema import ROW_THRESHOLD, frac_column, frac_null_column, rows_column

__all__ = ["GROUPS", "MEAN_RUN", "ProbeLog", "collect", "headline_branch", "write"]

#: The tag groups in the order they are read (the rank is part of the name: trackers sort groups by name).
GROUPS: dict[str, str] = {
    "query_frame": "1_query_frame",
    "stored_frame": "2_stored_frame",
    "agreement": "3_agreement",
    "qf_layer": "4_query_frame_rho_per_layer",
    "layer": "5_stored_frame_rho_per_layer",
    "shares": "6_reference_shares",
    "overlays": "7_overlays",
    "figures": "8_figures",
    "images": "9_images",
}

#: The sub-run holding each run's means over every cell (the HParams view's metrics).
MEAN_RUN = "mean"

_ROWS, _ROWS_NULL = rows_column(), f"{rows_column()}_null"

#: ``(group, tag, {sub-run: summary column})``: "" is the run itself. A chart per tag; one unit per tag.
_CHARTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("query_frame", "rho", {"": "qf_spearman", "baseline": "qf_rho_baseline"}),
    ("query_frame", "rho_null", {"": "qf_spearman_null"}),
    ("query_frame", "rho_excess", {"": "qf_rho_excess"}),
    ("query_frame", "rho_gaussian", {"": "qf_gauss_spearman", "baseline": "qf_gauss_rho_baseline"}),
    ("query_frame", "rho_gaussian_null", {"": "qf_gauss_spearman_null"}),
    ("query_frame", "rho_gaussian_excess", {"": "qf_gauss_rho_excess"}),
    ("query_frame", _ROWS, {"": f"qf_{_ROWS}", "null": f"qf_{_ROWS_NULL}"}),
    ("stored_frame", "rho", {"": "spearman", "baseline": "rho_baseline"}),
    ("stored_frame", "rho_null", {"": "spearman_null"}),
    ("stored_frame", "rho_excess", {"": "rho_excess"}),
    ("stored_frame", frac_column(ROW_THRESHOLD),
     {"": frac_column(ROW_THRESHOLD), "null": frac_null_column(ROW_THRESHOLD)}),
    ("stored_frame", _ROWS, {"": _ROWS, "null": _ROWS_NULL}),
    ("agreement", "pearson", {"": "pearson"}),
    ("agreement", "query_frame_pearson", {"": "qf_pearson"}),
    ("agreement", "top1", {"": "top1"}),
    ("agreement", "query_frame_top1", {"": "qf_top1"}),
    ("agreement", "kl", {"": "kl"}),
    ("agreement", "query_frame_kl", {"": "qf_kl"}),
    ("agreement", "neff_attention", {"": "neff_attn"}),
    ("agreement", "neff_nw", {"": "neff_nw"}),
    ("agreement", "query_frame_neff_nw", {"": "qf_neff_nw"}),
)  # fmt: skip

#: The headline charts that get the run's mean (cell column averaged over every cell) in the ``mean`` sub-run.
_MEANS = {("query_frame", "rho"): "qf_spearman", ("query_frame", "rho_excess"): "qf_rho_excess",
          ("stored_frame", "rho"): "spearman", ("stored_frame", "rho_excess"): "rho_excess"}  # fmt: skip

#: The settings TensorBoard's HParams table shows besides the caller's own (the rest: ``2_run/settings``).
_SHOWN = ("probe/bandwidth", "adapter_scale", "headline_branch", "layers", "heads")

#: The summary and table columns that group rather than measure.
_KEYS = ("call", "step", "kind", "branch")


def flat_settings(values: Mapping, prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested settings as one level (keys joined with ``/``), every value a bool, int, float or string."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_settings(value, f"{name}/"))
        elif isinstance(value, bool | int | str) or (isinstance(value, float) and math.isfinite(value)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def figure_array(fig, dpi: float | None = None):
    """An ``(H, W, 3)`` uint8 array of a matplotlib figure (drawn with Agg at ``dpi``, default the figure's own; the
    figure is closed)."""
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if dpi is not None:
        fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    array = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return array


#: The width (pixels) of a TensorBoard image card at its default size.
CARD_PIXELS = 340


def card_array(fig, pixels: int = CARD_PIXELS, text_px: float = 12.0):
    """:func:`figure_array` of ``fig`` drawn ``pixels`` wide, every text enlarged to at least ``text_px`` pixels and
    wrapped at the figure's edge (constrained layout makes room), so that a card shows it legible at its size."""
    from matplotlib.text import Text

    fig.canvas.draw()  # the tick labels exist only once drawn
    dpi = pixels / fig.get_size_inches()[0]
    texts = [t for t in fig.findobj(Text) if t.get_text().strip()]
    scale = max(1.0, text_px * 72 / dpi / min((t.get_fontsize() for t in texts), default=text_px))
    ticks = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = axis.get_ticklabels()
            ticks |= {id(label) for label in labels}
            if labels:
                ax.tick_params(axis=axis.axis_name, labelsize=labels[0].get_fontsize() * scale)
    for text in (t for t in texts if id(t) not in ticks):
        text.set_fontsize(text.get_fontsize() * scale)
        text.set_wrap(True)
    return figure_array(fig, dpi)


def headline_branch(table: pd.DataFrame) -> str | None:
    """The CFG branch the headline tags describe: ``"cond"`` when the image branch has it, else its first branch
    (``None`` for an empty table)."""
    image = table[table["kind"] == "image"] if "kind" in table else table
    part = image if len(image) else table
    if part.empty:
        return None
    branches = list(dict.fromkeys(part["branch"]))
    return "cond" if "cond" in branches else branches[0]


@dataclasses.dataclass
class ProbeLog:
    """Everything a probe logs, tracker-independent.

    Attributes:
        scalars: sub-run (``""``: the run itself) -> tag -> step -> value.
        layout: the chart layout (see :data:`ipa_probe.trackers.Layout`): exact tags.
        metrics: the end-of-run metrics: tag -> value, in the sub-run :data:`MEAN_RUN`.
        last_step: the step the end-of-run content is written at (the last denoising step's).
        settings: the names of the caller's own settings (TensorBoard's HParams table shows them).
        timesteps: step -> timestep (the first call's).
    """

    scalars: dict[str, dict[str, dict[int, float]]] = dataclasses.field(default_factory=dict)
    histograms: list[tuple[str, int, np.ndarray]] = dataclasses.field(default_factory=list)
    images: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    texts: dict[str, str] = dataclasses.field(default_factory=dict)
    layout: list = dataclasses.field(default_factory=list)
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    last_step: int = 0
    x_axis: str = "denoising step"
    settings: tuple[str, ...] = ()
    timesteps: dict[int, float] = dataclasses.field(default_factory=dict)

    def add(self, tag: str, step: int, value, run: str = "") -> None:
        if value is not None and np.isfinite(float(value)):
            self.scalars.setdefault(run, {}).setdefault(tag, {})[int(step)] = float(value)


def _steps(summary: pd.DataFrame) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], float]]:
    """``(call, loop index) -> tracker step`` (the loop index: charts read left to right in denoising order) and
    ``(call, loop index) -> timestep``."""
    pairs = summary[["call", "step", "timestep"]].drop_duplicates(["call", "step"])
    keys = [(int(c), int(s)) for c, s in zip(pairs["call"], pairs["step"], strict=True)]
    return {key: key[1] for key in keys}, dict(zip(keys, pairs["timestep"].astype(float), strict=True))


def _finding(summary: pd.DataFrame, head: tuple, timesteps: dict) -> str:
    """The headline per step as a markdown table: the first text a reader opens."""
    kind, branch = head
    part = summary[(summary["kind"] == kind) & (summary["branch"] == branch)]
    columns = {
        "qf_spearman": "query-frame ρ",
        "qf_rho_baseline": "its baseline",
        "qf_rho_excess": "ρ − baseline",
        "qf_spearman_null": "null (chance)",
        "spearman": "stored-frame ρ",
        "rho_baseline": "its baseline",
    }
    columns = {k: v for k, v in columns.items() if k in part}  # fmt: skip
    lines = ["| call | step | timestep | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 3) + "|"]
    for row in part.itertuples(index=False):
        call, step = int(row.call), int(row.step)
        values = " | ".join(f"{getattr(row, c):.3f}" for c in columns)
        lines.append(f"| {call} | {step} | {timesteps[(call, step)]:g} | {values} |")
    header = f"**{branch} branch, {kind}, mean over layers and heads** (x of every chart: the step)"
    return header + "\n\n" + "\n".join(lines)


def _group(key: str, label: str, call: str) -> str:
    """A group's name: the ranked one for the headline series (``label`` empty), else ``{label}_{key}``."""
    return (GROUPS[key] if not label else f"{label}_{key}") + call


def _summary_scalars(log: ProbeLog, summary, cells, head: tuple, calls: dict, steps: dict) -> list[str]:
    """The charts' scalars of every (kind, branch) series; returns the columns they used."""
    used = set()
    for (call, kind, branch), part in summary.groupby(["call", "kind", "branch"], sort=True):
        label = "" if (kind, branch) == head else (branch if kind == "image" else f"{kind}_{branch}")
        for group, tag, columns in _CHARTS:
            if label and group == "agreement":
                continue
            for run, column in columns.items():
                if column not in part:
                    continue
                used.add(column)
                for step, value in zip(part["step"], part[column], strict=True):
                    log.add(f"{_group(group, label, calls[call])}/{tag}", steps[(call, int(step))], value, run)
        if label:
            continue
        call_cells = cells[cells["call"] == call]
        xs = [steps[(call, int(s))] for s in part["step"]]
        for (group, tag), column in _MEANS.items():
            if column in call_cells and call_cells[column].notna().any():
                name = f"{_group(group, label, calls[call])}/{tag}"
                mean = float(call_cells[column].mean())
                for x in (min(xs), max(xs)):
                    log.add(name, x, mean, MEAN_RUN)
                log.metrics[name] = mean
    return sorted(used)


def _bookkeeping(summary: pd.DataFrame, used: Sequence[str], steps: dict) -> str:
    """The columns no chart draws, as one markdown table per series (rows: steps)."""
    rest = [c for c in summary.columns if c not in (*_KEYS, *used) and pd.api.types.is_numeric_dtype(summary[c])]
    rest = [c for c in rest if not pd.api.types.is_bool_dtype(summary[c])]
    parts = []
    for (call, kind, branch), part in summary.groupby(["call", "kind", "branch"], sort=True):
        frame = part[["step", *rest]].copy()
        frame.insert(0, "x", [steps[(call, int(s))] for s in part["step"]])
        header = f"**call {call}, {kind} branch {branch}** (x: the chart step)\n\n"
        cells = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
        cells += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"
                  for row in frame.itertuples(index=False)]  # fmt: skip
        parts.append(header + "\n".join(cells))
    return "\n\n".join(parts)


def _layer_scalars(log: ProbeLog, cells: pd.DataFrame, order: list[str], calls: dict, steps: dict) -> None:
    """One small chart per layer (mean over heads and adapters), numbered in network order; the baseline in its
    sub-run."""
    from .capture.report import short_layer_names

    width = max(2, len(str(len(order) - 1)))
    short, _ = short_layer_names(order)  # without the ending every layer id shares (".transformer_blocks.0.attn2")
    number = {name: f"{i:0{width}d}_{cut}" for i, (name, cut) in enumerate(zip(order, short, strict=True))}
    for group, columns in (
        ("qf_layer", {"": "qf_spearman", "baseline": "qf_rho_baseline"}),
        ("layer", {"": "spearman", "baseline": "rho_baseline"}),
    ):
        for run, column in columns.items():
            if column not in cells:
                continue
            means = cells.groupby(["call", "step", "layer"], observed=True)[column].mean()
            for (call, step, layer), value in means.items():
                log.add(f"{_group(group, '', calls[call])}/{number[layer]}", steps[(call, int(step))], value, run)


def _cell_histograms(log: ProbeLog, cells: pd.DataFrame, calls: dict, steps: dict) -> None:
    for column, name in (("qf_spearman", "query_frame_rho"), ("spearman", "rho"), ("spearman_null", "rho_null")):
        if column not in cells:
            continue
        for (call, step), part in cells.groupby(["call", "step"]):
            values = part[column].to_numpy(np.float64)
            log.histograms.append((f"hist{calls[call]}/{name}_per_layer_head_cell", steps[(call, step)], values))


def _ref_label(adapter: int, reference: int) -> str:
    return f"ref{reference}" if adapter == 0 else f"adapter{adapter}_ref{reference}"


def _map_content(log: ProbeLog, run, head: str, calls: dict, steps: dict, base, note: str) -> None:
    """The maps' scalars (shares, agreement), share histograms and the overlays per step."""
    from .capture.overlays import overlay_figure

    mass, agreement = run.reference_mass(), run.map_table()
    mass, agreement = mass[mass["branch"] == head], agreement[agreement["branch"] == head]
    if mass.empty:
        return
    kinds = {"attention": "attention", "nw": "nw", "contribution_share": "contribution"}
    kinds = {column: tag for column, tag in kinds.items() if column in mass.columns}
    shares = mass.groupby(["call", "step", "adapter", "reference"])[list(kinds)].mean()
    for (call, step, adapter, reference), row in shares.iterrows():
        group = _group("shares", "", calls[call])
        for column, tag in kinds.items():
            if np.isfinite(row[column]):  # a contribution is NaN where it is not recorded (masks, SD3)
                log.add(f"{group}/{tag}_{_ref_label(adapter, reference)}", steps[(call, step)], row[column])
    for (call, step), row in agreement.groupby(["call", "step"])[["dominant_agree", "tv"]].mean().iterrows():
        group = _group("shares", "", calls[call])
        log.add(f"{group}/same_dominant_reference", steps[(call, step)], row["dominant_agree"])
        log.add(f"{group}/total_variation", steps[(call, step)], row["tv"])
    for call, where in calls.items():
        for adapter in sorted(set(mass.loc[mass["call"] == call, "adapter"])):
            tag = _group("overlays", "", where) + "/reference_shares" + ("" if adapter == 0 else f"_adapter{adapter}")
            for step in run.map_steps(call):
                _share_histograms(log, run, call, step, adapter, head, where, steps)
            for step, fig in overlay_figure(run, base, call=call, adapter=adapter, branch=head, note=note).items():
                log.images.setdefault(steps[(call, step)], {})[tag] = card_array(fig)


def _share_histograms(log: ProbeLog, run, call: int, step: int, adapter: int, head: str, where: str, steps) -> None:
    """Each reference's share at every query position of every layer and every image of the branch at ``step``."""
    per_kind: dict[str, list[np.ndarray]] = {"attention": [], "nw": []}
    for item in range(len(run.map_items(call, step, head, adapter))):
        for kind, parts in per_kind.items():
            weights = run.reference_weights(call, item, adapter, kind, head, steps=[step])  # (step, layer) -> (Q, R)
            parts += [w.numpy() for w in weights.values()]
    for kind, parts in per_kind.items():
        if parts:
            stacked = np.concatenate(parts, axis=0)  # (positions over items and layers, R)
            for reference in range(stacked.shape[1]):
                tag = f"hist{where}/{kind}_share_per_position/{_ref_label(adapter, reference)}"
                log.histograms.append((tag, steps[(call, step)], stacked[:, reference]))


def _tiles(images: Sequence, height: int = 128) -> np.ndarray:
    """Images side by side, each enlarged by a whole factor (nearest) to at least ``height`` pixels, 4-px gaps."""
    arrays = [np.asarray(im.convert("RGB")) for im in images]
    factor = max(1, -(-height // max(a.shape[0] for a in arrays)))
    arrays = [a.repeat(factor, 0).repeat(factor, 1) for a in arrays]
    rows = max(a.shape[0] for a in arrays)
    gap = np.full((rows, 4, 3), 255, np.uint8)
    parts = []
    for array in arrays:
        padded = np.full((rows, array.shape[1], 3), 255, np.uint8)
        padded[: array.shape[0]] = array
        parts += [padded, gap]
    return np.concatenate(parts[:-1], axis=1)


def _adapter_scale(run) -> float | list[float] | str:
    """The IP-Adapter scale the probed layers ran with: one number per adapter (one adapter: the number), or
    ``"per layer"`` when the layers differ (InstantStyle-style settings)."""
    scales = {tuple(float(v) for v in getattr(layer.processor, "scale", ())) for layer in run.layers}
    if len(scales) != 1:
        return "per layer"
    scale = scales.pop()
    return scale[0] if len(scale) == 1 else list(scale)


def _markdown(rows: Mapping[str, Any]) -> str:
    return "| setting | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows.items())


def _figures(log: ProbeLog, run, table: pd.DataFrame, images, head: str) -> None:
    """The run's figures at the size a TensorBoard card shows them (:func:`card_array`)."""
    from .capture.report import plot_heatmap, plot_run

    end = log.images.setdefault(log.last_step, {})
    group = GROUPS["figures"]
    end[f"{group}/rho_by_timestep"] = card_array(plot_run(table, heatmaps=None, branch=head))
    if "qf_spearman" in table and table["qf_spearman"].notna().any():
        part = table[table["branch"] == head]
        kind = "image" if (part["kind"] == "image").any() else str(part["kind"].iloc[0])
        fig = plot_heatmap(table, "qf_spearman", branch=head, kind=kind)
        end[f"{group}/query_frame_rho_per_layer"] = card_array(fig)
    if run.config.maps:
        extra = {"image": images[0]} if images else {}
        # a page-wide grid of maps: at two cards' width (its text at 8 pt then reads at 10 px), not squeezed into one
        end[f"{group}/reference_maps"] = figure_array(run.plot_reference_maps(**extra), dpi=2 * CARD_PIXELS / 7.0)


def collect(
    run,
    *,
    images: Sequence | None = None,
    references: Sequence | None = None,
    readings: Sequence[str] | None = None,
    settings: Mapping | None = None,
) -> ProbeLog:
    """Read a finished probe into a :class:`ProbeLog` (arguments as in :func:`ipa_probe.trackers.log_probe_run`)."""

    if readings is not None and images is not None and len(readings) != len(images):
        raise ValueError(f"readings: expected one per generated image ({len(images)}), got {len(readings)}")
    log = ProbeLog()
    table, summary = run.to_dataframe(), run.summary()
    head = headline_branch(table)
    order = network_order([layer.name for layer in run.layers])
    several = table["call"].nunique() > 1
    calls = {int(c): (f"_call{int(c)}" if several else "") for c in sorted(set(table["call"]))}
    kind = "image" if (table["kind"] == "image").any() else "text"  # a text-only probe: the text branch's series
    cells = table[(table["kind"] == kind) & (table["branch"] == head)] if head is not None else table
    steps: dict[tuple[int, int], int] = {}
    timesteps: dict[tuple[int, int], float] = {}
    if not summary.empty:
        steps, timesteps = _steps(summary)
        log.timesteps = {s: t for (c, s), t in timesteps.items() if c == min(calls)}
        used = _summary_scalars(log, summary, cells, (kind, head), calls, steps)
        log.texts["1_finding/rho"] = _finding(summary, (kind, head), timesteps)
        log.texts["9_bookkeeping/columns"] = _bookkeeping(summary, used, steps)
        last = summary.sort_values(["call", "step"]).iloc[-1]
        log.last_step = steps[(int(last["call"]), int(last["step"]))]
    _layer_scalars(log, cells, order, calls, steps)
    _cell_histograms(log, cells, calls, steps)
    if run.config.maps and head is not None:
        base = np.asarray(images[0].convert("RGB")) if images else None
        if base is None:  # no image given: a grey field of the output's size under the maps
            size = run.reference_maps(0, 0, 0, branch=head, steps=run.map_steps(0)[:1]).shape[1:]
            base = np.full((*size, 3), 128, np.uint8)
        _map_content(log, run, head, calls, steps, base, "over the first image" if images else "(no image given)")
    end = log.images.setdefault(log.last_step, {})
    if images:
        end[f"{GROUPS['images']}/generated"] = _tiles(images)
    if references:
        end[f"{GROUPS['images']}/references"] = _tiles(references)
    if readings is not None:
        lines = "\n".join(f"| {i} | {text} |" for i, text in enumerate(readings))
        log.texts["3_images/readings"] = "| image | reading |\n|---|---|\n" + lines
    if not table.empty:
        _figures(log, run, table, images, head)
    log.settings = tuple(settings or ())
    log.hparams = {
        **dict(settings or {}),
        "probe": run.config.describe(),
        "pipeline": type(run.pipe).__name__,
        "family": run.tap.family,
        "layers": len(run.layers),
        "heads": run.num_heads,
        "adapters": run.num_adapters,
        "adapter_scale": _adapter_scale(run),
        "headline_branch": head,
    }
    ends = [(f"call {c} " if several else "") + f"step 0 = t {timesteps[(c, 0)]:g}, step {s} = t {t:g}"
            for (c, s), t in timesteps.items() if (c, s + 1) not in timesteps and (c, 0) in timesteps]  # fmt: skip
    axis = {"x axis": "denoising step (the loop index)" + (f": {'; '.join(ends)}" if ends else "")}
    log.texts["2_run/settings"] = _markdown({**axis, **flat_settings(log.hparams)})
    log.layout = _layout(log, head, calls, kind)
    return log


def _layout(log: ProbeLog, head: str | None, calls: dict[int, str], kind: str) -> list:
    """The chart layout: per call, the query frame, the stored frame, the agreement measures, the reference shares,
    then the other branches. Each chart lists exact tags; a tag draws every sub-run that has it (the run, its
    baseline, null and mean). A chart is kept only when one of its tags was logged; a category only when one of its
    charts is."""
    tags = {tag for series in log.scalars.values() for tag in series}

    def have(group: str, *names: str) -> list[str]:
        return [f"{group}/{n}" for n in names if f"{group}/{n}" in tags]

    def starting(group: str, prefix: str) -> list[str]:
        return sorted(t for t in tags if t.startswith(f"{group}/{prefix}"))

    rows, frac = _ROWS, frac_column(ROW_THRESHOLD)
    what = f"{head} branch" + ("" if kind == "image" else f" ({kind})")
    layout = []
    for where in calls.values():
        qf, st, ag, sh = (_group(key, "", where) for key in ("query_frame", "stored_frame", "agreement", "shares"))
        layout += [
            (f"query frame (gauge-invariant): {what}{where}, mean over layers and heads; x: denoising step; y: untick"
             " Ignore outliers to fit each chart's lowest and highest 5% of points", [
                ("query-frame rho: run, baseline, mean (read at smoothing 0)", have(qf, "rho")),
                ("excess over the baseline", have(qf, "rho_excess", "rho_gaussian_excess")),
                ("chance: permutation null", have(qf, "rho_null", "rho_gaussian_null")),
                ("Gaussian NW query-frame rho: run, baseline", have(qf, "rho_gaussian")),
                (f"rows with rho > {ROW_THRESHOLD:g}: run and chance", have(qf, rows)),
            ]),
            (f"stored frame (gauge-dependent): {what}{where}", [
                ("stored-frame rho: run, baseline, mean", have(st, "rho")),
                ("excess over the baseline", have(st, "rho_excess")),
                ("chance: permutation null", have(st, "rho_null")),
                (f"cells and rows with rho > {ROW_THRESHOLD:g}: run and chance", have(st, frac, rows)),
            ]),
            (f"attention vs NW weights: {what}{where}", [
                ("Pearson r", have(ag, "pearson", "query_frame_pearson")),
                ("top-1 agreement", have(ag, "top1", "query_frame_top1")),
                ("KL divergence", have(ag, "kl", "query_frame_kl")),
                ("effective number of keys", have(ag, "neff_attention", "neff_nw", "query_frame_neff_nw")),
            ]),
            (f"reference shares: {head} branch{where}, mean over layers and positions", [
                ("attention share of each reference", starting(sh, "attention_")),
                ("NW share of each reference", starting(sh, "nw_")),
                ("contribution share of each reference (after to_out)", starting(sh, "contribution_")),
                ("attention and NW pick the same dominant reference", have(sh, "same_dominant_reference")),
                ("total variation between attention and NW shares", have(sh, "total_variation")),
            ]),
        ]  # fmt: skip
        others = sorted(
            {t.split("/")[0] for t in tags} - set(GROUPS.values()) - {f"{g}{where}" for g in GROUPS.values()}
        )
        for group in (g for g in others if g.endswith(where) and not g[0].isdigit()):
            layout.append((group, [("rho: run, baseline", have(group, "rho")), ("chance", have(group, "rho_null")),
                                   ("excess over the baseline", have(group, "rho_excess"))]))  # fmt: skip
    return [(category, [(t, p) for t, p in charts if p]) for category, charts in layout if any(p for _, p in charts)]


def write(log: ProbeLog, tracker) -> None:
    """Hand ``log`` to ``tracker`` (a :class:`~ipa_probe.trackers.Tracker`): the hyper-parameters with the end-of-run
    metrics, then each sub-run's scalars in step order, the histograms and images in step order, then the texts and
    the layout."""
    hparams = log.hparams
    if tracker.name == "tensorboard":  # the HParams table lists settings before metrics: few, the finding in view
        hparams = {k: v for k, v in flat_settings(hparams).items() if k in _SHOWN or k.split("/")[0] in log.settings}
    tracker.hparams(hparams, log.metrics, log.last_step, group=MEAN_RUN)
    for run in ("", *sorted(r for r in log.scalars if r)):
        by_step: dict[int, dict[str, float]] = {}
        for tag, values in log.scalars.get(run, {}).items():
            for step, value in values.items():
                by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):
            tracker.scalars(by_step[step], step, run)
    histograms: dict[int, list] = {}
    for tag, step, values in log.histograms:
        histograms.setdefault(step, []).append((tag, values))
    for step in sorted({*histograms, *log.images}):
        for tag, values in histograms.get(step, []):
            tracker.histogram(tag, values, step)
        tracker.figures(log.images.get(step, {}), step, log.timesteps.get(step))
    tracker.text(log.texts, log.last_step)
    tracker.layout(log.layout, log.scalars, log.x_axis)
