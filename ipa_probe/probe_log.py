"""What a finished probe sends to a tracker, and under which tags: the content, apart from the trackers' APIs.

:func:`collect` reads a finished :class:`~ipa_probe.ProbeRun` (its table, summary and reference maps) into a
:class:`ProbeLog`; :func:`write` hands it to a :class:`~ipa_probe.trackers.Tracker` step by step, in step order.
Nothing here runs inside the denoising loop. The step of every tag is the denoising loop index. Tags (``call{c}/``
in front of each when the block probed several pipeline calls):

- ``nw/rho``, ``nw/rho_baseline``, ``nw/rho_null``, ``nw/rho_excess``: the per-timestep means over layers, heads and
  adapters of the stored-frame ``spearman``, ``rho_baseline``, ``spearman_null`` and ``rho_excess`` of the image
  branch's CFG branch ``cond`` (the only branch without CFG); ``nw/pearson``, ``nw/top1``, ``nw/kl``,
  ``nw/neff_attn``, ``nw/neff_nw``, ``nw/frac_rho_gt_0.9`` (``_null``), ``nw/rows_rho_gt_0.9`` (``_null``) beside them;
  every query-frame column of the summary (``qf_*``, ``spearman`` written ``rho``: ``nw/qf_rho``,
  ``nw/qf_rho_baseline``, ``nw/qf_rho_null``, ``nw/qf_rho_excess``, ``nw/qf_gauss_*``) when the probe has it. Other
  branches: ``nw/{branch}/...``; the text branch: ``nw/text/...``.
- ``nw/layer/{i}_{layer}``: ``spearman`` per layer (mean over heads and adapters), numbered in network order
  (down, mid, up) so that TensorBoard's alphabetical order is the network's; ``nw/qf_layer/...`` likewise.
- ``debug/...``: every other numeric summary column (``bandwidth``, ``cells``, ``rho_cells``, ``nonfinite``,
  ``timestep``, ``q_norm``, ``logit_ratio``, ...), per series as above.
- ``maps/attention_share/ref{r}``, ``maps/nw_share/ref{r}``, ``maps/contribution_share/ref{r}`` (``maps=True``):
  reference ``r``'s mean share per step of the attention, of the NW weights and of the image branch's output norm
  after ``to_out`` (:meth:`~ipa_probe.ProbeRun.reference_mass`, averaged over layers); ``maps/dominant_agree``,
  ``maps/tv`` (:meth:`~ipa_probe.ProbeRun.map_table`, averaged over layers and images).
- histograms per step: ``hist/rho_per_layer_head_cell`` (the ``spearman`` of each layer × head × adapter cell),
  ``hist/rho_null_per_layer_head_cell``, ``hist/qf_rho_per_layer_head_cell`` when present; with maps
  ``hist/attention_share_per_position/ref{r}`` and ``hist/nw_share_per_position/ref{r}`` (reference ``r``'s share at
  every query position of every layer and every image of the branch). The probe records no per-reference
  contribution (the image branch's output split by reference), so none is logged.
- images: ``overlays/reference_shares`` at every step with maps (each reference's share minus ``1/R`` over the first
  image, attention above NW, one colour range per reference over all steps), ``images/generated``,
  ``images/references``, ``figures/rho_by_timestep``, ``figures/reference_maps``; text: ``images/readings`` (one line
  per image), ``run/settings``.
- hyper-parameters: the generation's settings and the probe's (``probe/...``), with the metrics ``end/rho``,
  ``end/rho_baseline``, ``end/rho_null``, ``end/rho_excess`` (and ``end/qf_*``): the means over every cell of the
  headline series, all steps, layers and heads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .schema import ROW_THRESHOLD, frac_column, frac_null_column, rows_column


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


def figure_array(fig):
    """An ``(H, W, 3)`` uint8 array of a matplotlib figure (drawn with Agg; the figure is closed)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    array = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return array


__all__ = ["HEADLINE", "ProbeLog", "collect", "headline_branch", "headline_tag", "network_order", "write"]

#: Summary columns logged under ``nw/`` and the name each gets there (query-frame ``qf_*`` columns are added by
#: :func:`headline_tag`); every other numeric column goes under ``debug/``.
HEADLINE: dict[str, str] = {
    "spearman": "rho",
    "rho_baseline": "rho_baseline",
    "spearman_null": "rho_null",
    "rho_excess": "rho_excess",
    "pearson": "pearson",
    "top1": "top1",
    "kl": "kl",
    "neff_attn": "neff_attn",
    "neff_nw": "neff_nw",
    frac_column(ROW_THRESHOLD): frac_column(ROW_THRESHOLD),
    frac_null_column(ROW_THRESHOLD): frac_null_column(ROW_THRESHOLD),
    rows_column(): rows_column(),
    f"{rows_column()}_null": f"{rows_column()}_null",
}

#: The summary and table columns that group rather than measure.
_KEYS = ("call", "step", "kind", "branch")

#: The columns whose means over the headline series are the run's end-of-run metrics (those present).
_METRICS = ("spearman", "rho_baseline", "spearman_null", "rho_excess")


def headline_tag(column: str) -> str | None:
    """The name of a summary column under ``nw/`` (``spearman`` -> ``rho``, ``qf_spearman_null`` ->
    ``qf_rho_null``), or ``None`` for a bookkeeping column (logged under ``debug/``)."""
    if column in HEADLINE:
        return HEADLINE[column]
    if column.startswith("qf_"):
        return column.replace("spearman", "rho")
    return None


def network_order(names: Sequence[str]) -> list[str]:
    """Layer ids in the order the network runs them: ``down_blocks``, ``mid_block``, ``up_blocks`` (diffusers lists
    ``mid_block`` last); any other layers keep their order (DiT blocks are already in order)."""
    rank = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    return sorted(names, key=lambda name: rank.get(name.split(".")[0], 1))  # stable: within a block, as listed


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
        scalars: tag -> step -> value.
        histograms: ``(tag, step, values)``.
        images: step -> tag -> ``(H, W, 3)`` uint8 array.
        texts: tag -> markdown.
        layout: the custom-scalars layout (see :data:`ipa_probe.trackers.Layout`).
        hparams: the settings (nested mappings allowed).
        metrics: the end-of-run metrics (tag -> value).
        last_step: the step the end-of-run content is written at.
    """

    scalars: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    histograms: list[tuple[str, int, np.ndarray]] = dataclasses.field(default_factory=list)
    images: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    texts: dict[str, str] = dataclasses.field(default_factory=dict)
    layout: list = dataclasses.field(default_factory=list)
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    last_step: int = 0

    def add(self, tag: str, step: int, value) -> None:
        if value is not None and np.isfinite(float(value)):
            self.scalars.setdefault(tag, {})[int(step)] = float(value)


def _series_path(kind: str, branch: str, head: str) -> str:
    """The part of a tag after ``nw/`` or ``debug/`` that names a (kind, branch) series: empty for the headline."""
    return ("" if kind == "image" else f"{kind}/") + ("" if branch == head else f"{branch}/")


def _summary_scalars(log: ProbeLog, summary: pd.DataFrame, head: str, calls: dict[int, str]) -> None:
    for _, row in summary.iterrows():
        path = _series_path(row["kind"], row["branch"], head)
        where = calls[int(row["call"])]
        for column, value in row.items():
            if column in _KEYS or isinstance(value, bool) or not pd.api.types.is_number(value):
                continue
            name = headline_tag(column)
            tag = f"{where}nw/{path}{name}" if name is not None else f"{where}debug/{path}{column}"
            log.add(tag, row["step"], value)


def _layer_scalars(log: ProbeLog, cells: pd.DataFrame, order: list[str], calls: dict[int, str]) -> None:
    """``nw/layer/{i}_{layer}`` (and ``nw/qf_layer/...``): per step, the mean over heads and adapters."""
    width = max(2, len(str(len(order) - 1)))
    number = {name: f"{i:0{width}d}_{name}" for i, name in enumerate(order)}
    for column, group in (("spearman", "layer"), ("qf_spearman", "qf_layer")):
        if column not in cells:
            continue
        means = cells.groupby(["call", "step", "layer"], observed=True)[column].mean()
        for (call, step, layer), value in means.items():
            log.add(f"{calls[int(call)]}nw/{group}/{number[layer]}", step, value)


def _cell_histograms(log: ProbeLog, cells: pd.DataFrame, calls: dict[int, str]) -> None:
    for column in ("spearman", "spearman_null", "qf_spearman"):
        if column not in cells:
            continue
        name = headline_tag(column)
        for (call, step), part in cells.groupby(["call", "step"]):
            values = part[column].to_numpy(np.float64)
            log.histograms.append((f"{calls[int(call)]}hist/{name}_per_layer_head_cell", int(step), values))


def _ref_label(adapter: int, reference: int) -> str:
    return f"ref{reference}" if adapter == 0 else f"adapter{adapter}_ref{reference}"


def _map_content(log: ProbeLog, run, head: str, calls: dict[int, str], base: np.ndarray, note: str) -> None:
    """The maps' scalars (shares, agreement), share histograms and the overlays per step."""
    mass, agreement = run.reference_mass(), run.map_table()
    mass, agreement = mass[mass["branch"] == head], agreement[agreement["branch"] == head]
    if mass.empty:
        return
    kinds = {"attention": "attention_share", "nw": "nw_share", "contribution_share": "contribution_share"}
    kinds = {column: tag for column, tag in kinds.items() if column in mass.columns}
    shares = mass.groupby(["call", "step", "adapter", "reference"])[list(kinds)].mean()
    for (call, step, adapter, reference), row in shares.iterrows():
        for column, tag in kinds.items():
            if np.isfinite(row[column]):  # a contribution is NaN where it is not recorded (masks, SD3)
                log.add(f"{calls[int(call)]}maps/{tag}/{_ref_label(adapter, reference)}", step, row[column])
    for (call, step), row in agreement.groupby(["call", "step"])[["dominant_agree", "tv"]].mean().iterrows():
        log.add(f"{calls[int(call)]}maps/dominant_agree", step, row["dominant_agree"])
        log.add(f"{calls[int(call)]}maps/tv", step, row["tv"])
    for call, where in calls.items():
        for adapter in sorted(set(mass.loc[mass["call"] == call, "adapter"])):
            for step in run.map_steps(call):
                _share_histograms(log, run, call, step, adapter, head, where)
            _overlays(log, run, call, adapter, head, where, base, note)


def _share_histograms(log: ProbeLog, run, call: int, step: int, adapter: int, head: str, where: str) -> None:
    """Each reference's share at every query position of every layer and every image of the branch at ``step``."""
    per_kind: dict[str, list[np.ndarray]] = {"attention": [], "nw": []}
    for item in range(len(run.map_rows(call, step, head, adapter))):
        for kind, parts in per_kind.items():
            weights = run.reference_weights(call, item, adapter, kind, head, steps=[step])  # (step, layer) -> (Q, R)
            parts += [w.numpy() for w in weights.values()]
    for kind, parts in per_kind.items():
        if parts:
            stacked = np.concatenate(parts, axis=0)  # (positions over items and layers, R)
            for reference in range(stacked.shape[1]):
                tag = f"{where}hist/{kind}_share_per_position/{_ref_label(adapter, reference)}"
                log.histograms.append((tag, step, stacked[:, reference]))


def _overlays(log: ProbeLog, run, call: int, adapter: int, head: str, where: str, base, note: str) -> None:
    """One figure per recorded step: each reference's share over ``base``, attention above NW, one colour range per
    reference over every step and both kinds (so that the step slider compares like with like)."""
    import matplotlib.pyplot as plt

    from .capture.overlays import overlay_map, plot_overlay

    steps = run.map_steps(call)
    size = base.shape[:2]
    count = run.reference_maps(call, 0, adapter, "attention", head, steps=steps[:1], size=size).shape[0]
    top = {}
    for r in range(count):
        spread = 1e-6
        for kind in ("attention", "nw"):
            for step in steps:
                drawn = overlay_map(run, size, r, kind=kind, call=call, adapter=adapter, branch=head, steps=[step])
                values, uniform = drawn.values, drawn.uniform
                spread = max(spread, float(np.abs(values - uniform).max()))
        top[r] = spread
    timesteps = run.map_timesteps(call)
    tag = f"{where}overlays/reference_shares" + ("" if adapter == 0 else f"_adapter{adapter}")
    for step in steps:
        # no constrained layout: it doubles the drawing time of these six-colorbar figures, one per step
        fig, axes = plt.subplots(2, count, figsize=(2.9 * count, 5.4), squeeze=False)
        fig.subplots_adjust(left=0.02, right=0.93, bottom=0.03, top=0.86, wspace=0.55, hspace=0.3)
        for row, kind in enumerate(("attention", "nw")):
            for r in range(count):
                options = {"kind": kind, "call": call, "adapter": adapter, "branch": head, "steps": [step]}
                title = f"reference {r}, {kind}"
                plot_overlay(
                    run,
                    base,
                    r,
                    scale="deviation",
                    vmax=top[r],
                    layout="contours",
                    ax=axes[row, r],
                    title=title,
                    **options,
                )
        fig.suptitle(
            f"step {step} (t {timesteps[step]:.0f}), {head} branch: share minus 1/{count} {note}, mean over layers "
            "and heads",
            fontsize=9,
        )
        log.images.setdefault(step, {})[tag] = figure_array(fig)


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
    calls = {int(c): (f"call{int(c)}/" if several else "") for c in sorted(set(table["call"]))}
    kind = "image" if (table["kind"] == "image").any() else "text"  # a text-only probe: the text branch's series
    cells = table[(table["kind"] == kind) & (table["branch"] == head)] if head is not None else table
    if not summary.empty:
        _summary_scalars(log, summary, head, calls)
        log.last_step = int(summary["step"].max())
    _layer_scalars(log, cells, order, calls)
    _cell_histograms(log, cells, calls)
    if run.config.maps and head is not None:
        base = np.asarray(images[0].convert("RGB")) if images else None
        if base is None:  # no image given: a grey field of the output's size under the maps
            size = run.reference_maps(0, 0, 0, branch=head, steps=run.map_steps(0)[:1]).shape[1:]
            base = np.full((*size, 3), 128, np.uint8)
        _map_content(log, run, head, calls, base, "over the first image" if images else "(no image given)")
    end = log.images.setdefault(log.last_step, {})
    if images:
        end["images/generated"] = _tiles(images)
    if references:
        end["images/references"] = _tiles(references)
    if readings is not None:
        lines = "\n".join(f"| {i} | {text} |" for i, text in enumerate(readings))
        log.texts["images/readings"] = "| image | reading |\n|---|---|\n" + lines
    if not table.empty:
        end["figures/rho_by_timestep"] = figure_array(run.plot())
        if run.config.maps:
            extra = {"image": images[0]} if images else {}
            end["figures/reference_maps"] = figure_array(run.plot_reference_maps(**extra))
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
    log.texts["run/settings"] = _markdown(flat_settings(log.hparams))
    for column in (*_METRICS, *(c for c in cells.columns if c.startswith("qf_"))):
        if column in cells and pd.api.types.is_numeric_dtype(cells[column]):
            log.metrics[f"end/{headline_tag(column)}"] = float(cells[column].mean())
    log.layout = _layout(log, head, calls, "" if kind == "image" else f"{kind}/")
    return log


def _layout(log: ProbeLog, head: str | None, calls: dict[int, str], series: str = "") -> list:
    """The custom-scalars layout: per call, the headline series' charts, the reference shares, then the other
    branches. ``series``: the headline's part of the tags after ``nw/`` (``"text/"`` for a text-only probe). A chart
    is kept only when one of its tags was logged; a category only when one of its charts is."""
    tags = set(log.scalars)

    def exact(base: str, *names: str) -> list[str]:
        return [f"^{re.escape(base + n)}$" for n in names if base + n in tags]

    def prefix(name: str) -> list[str]:
        return [f"^{re.escape(name)}"] if any(t.startswith(name) for t in tags) else []

    trio = ("rho", "rho_baseline", "rho_null")
    chance = (frac_column(ROW_THRESHOLD), frac_null_column(ROW_THRESHOLD), rows_column(), f"{rows_column()}_null")
    layout = []
    for where in calls.values():
        nw, maps = f"{where}nw/{series}", f"{where}maps/"
        charts = [
            ("rho with its baseline and null (stored frame)", exact(nw, *trio)),
            ("query-frame rho with its baseline and null", exact(nw, *(f"qf_{n}" for n in trio))),
            ("excess over the baseline", exact(nw, "rho_excess", "qf_rho_excess")),
            ("query-frame Gaussian columns", prefix(nw + "qf_gauss")),
            ("rho per layer (network order)", prefix(f"{where}nw/layer/")),
            ("query-frame rho per layer (network order)", prefix(f"{where}nw/qf_layer/")),
            (f"cells and rows with rho > {ROW_THRESHOLD:g}, and chance", exact(nw, *chance)),
            ("attention vs NW weights: Pearson and top-1 agreement", exact(nw, "pearson", "top1")),
        ]
        if charts[1][1]:  # the query-frame rho, once the probe has it, is the headline: its chart comes first
            charts[0], charts[1] = charts[1], charts[0]
        what = f"{head} branch" + (f" ({series[:-1]})" if series else "")
        layout.append((f"{where}rho vs Gaussian NW: {what}, mean over layers and heads", charts))
        shares = [
            ("attention share of each reference", prefix(maps + "attention_share/")),
            ("NW share of each reference", prefix(maps + "nw_share/")),
            ("contribution share of each reference (after to_out)", prefix(maps + "contribution_share/")),
            ("attention and NW: same dominant reference; total variation", exact(maps, "dominant_agree", "tv")),
        ]
        layout.append((f"{where}reference shares: {head} branch, mean over layers and positions", shares))
        base = f"{where}nw/"
        others = {t[len(base) :].rsplit("/", 1)[0] for t in tags if t.startswith(base) and "/" in t[len(base) :]}
        for name in sorted(others - {"layer", "qf_layer", series[:-1]}):
            charts = [
                ("rho with its baseline and null", exact(f"{base}{name}/", *trio)),
                ("query-frame rho with its baseline and null", exact(f"{base}{name}/", *(f"qf_{n}" for n in trio))),
            ]
            layout.append((f"{where}rho vs Gaussian NW: {name}", charts))
    return [(category, [(t, p) for t, p in charts if p]) for category, charts in layout if any(p for _, p in charts)]


def write(log: ProbeLog, tracker) -> None:
    """Hand ``log`` to ``tracker`` (a :class:`~ipa_probe.trackers.Tracker`): the hyper-parameters with the end-of-run
    metrics, then in step order each step's scalars, histograms and images, then the texts and the layout."""
    tracker.hparams(log.hparams, log.metrics, log.last_step)
    by_step: dict[int, dict[str, float]] = {}
    for tag, values in log.scalars.items():
        for step, value in values.items():
            by_step.setdefault(step, {})[tag] = value
    histograms: dict[int, list] = {}
    for tag, step, values in log.histograms:
        histograms.setdefault(step, []).append((tag, values))
    for step in sorted({*by_step, *histograms, *log.images}):
        tracker.scalars(by_step.get(step, {}), step)
        for tag, values in histograms.get(step, []):
            tracker.histogram(tag, values, step)
        tracker.figures(log.images.get(step, {}), step)
    tracker.text(log.texts, log.last_step)
    tracker.layout(log.layout, log.scalars)
