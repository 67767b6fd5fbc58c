"""One text style for every figure, the sizes a paper prints them at, and the checks a reviewer would make of a
figure, as functions.

A figure is drawn at the width it is read at: one column of a paper (:data:`SINGLE_COLUMN`, 3.5 in) or the page
(:data:`DOUBLE_COLUMN`, 7 in), at most a page tall, and saved at :data:`SAVE_DPI`. Font sizes in matplotlib are
points: an 8 pt label is 8/72 inch tall at any dpi. :func:`paper_style` sets :data:`MIN_FONT_PT` as the default of
every text element; :func:`drawn_problems` measures the drawn figure as a reviewer would (overlapping or small text,
legends over data, unlabelled axes; stored in every saved PNG by :func:`ipa_probe._io.write_figure`, read back with
its size by :func:`saved_layout_problems`), and :func:`small_text` and :func:`unlegended_artists` list the rest.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

__all__ = [
    "COLUMN_WIDTHS",
    "DOUBLE_COLUMN",
    "MAX_HEIGHT",
    "MIN_FONT_PT",
    "PAPER_RC",
    "SAVE_DPI",
    "SINGLE_COLUMN",
    "drawn_problems",
    "fit_ylim",
    "label_log_axis",
    "legend_below",
    "paper_style",
    "regular_ticks",
    "saved_layout_problems",
    "size_problems",
    "small_text",
    "unlegended_artists",
]

#: The smallest font size (points) of any text in a figure, at the width it is drawn (and printed) at.
MIN_FONT_PT = 8.0

#: The widths (inches) a figure is drawn at: one column of a two-column paper, and the full page width.
SINGLE_COLUMN, DOUBLE_COLUMN = 3.5, 7.0

#: The widths (inches) a paper prints a figure at, (low, high): a column, the page; the tallest figure a page holds
#: (a letter page's text block); the resolution every figure is saved at (a printer's).
COLUMN_WIDTHS, MAX_HEIGHT, SAVE_DPI = ((3.3, 3.5), (7.0, 7.2)), 9.0, 300

#: matplotlib rc settings of :func:`paper_style`: every text element at 8 pt or more.
PAPER_RC = {
    "font.size": MIN_FONT_PT,
    "axes.titlesize": 9.0,
    "axes.labelsize": MIN_FONT_PT,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 9.0,
}


def paper_style() -> AbstractContextManager:
    """A ``matplotlib.rc_context`` with :data:`PAPER_RC`: draw a figure inside it."""
    import matplotlib

    return matplotlib.rc_context(PAPER_RC)


def legend_below(ax, *args, **kwargs):
    """``ax.legend(*args, **kwargs)`` under the panel, below its tick labels and x label, so that it covers none of
    the panel's data; constrained layout makes room for it."""
    from matplotlib import rcParams
    from matplotlib.font_manager import FontProperties

    label = ax.xaxis.label
    lines = label.get_text().count("\n") + 1 if label.get_text() else 0
    ticks = FontProperties(size=rcParams["xtick.labelsize"]).get_size_in_points()
    below = ticks + 3.5 + 1.25 * lines * label.get_fontsize() + 6  # points: tick labels, their pad, the label
    size = FontProperties(size=kwargs.get("fontsize", rcParams["legend.fontsize"])).get_size_in_points()
    return ax.legend(*args, **{"loc": "upper center", "bbox_to_anchor": (0.5, 0.0), "borderaxespad": below / size,
                               "frameon": False, **kwargs})  # fmt: skip


def fit_ylim(ax, values, include=(), pad: float = 0.12, log: bool = False) -> tuple[float, float]:
    """Set ``ax``'s y range to the finite ``values`` and ``include`` (reference lines, a paper's value) with ``pad``
    of their span on each side, so that a panel does not spread its lines over a fixed range (say ±0.5) that hides
    differences of 0.02.

    Args:
        ax: a matplotlib axes.
        values: the numbers drawn (any shape; NaN and infinities are left out).
        include: further values the range must hold.
        pad: the margin on each side, as a fraction of the span.
        log: fit in log10 (for a log-scale axis; values <= 0 are left out).

    Returns:
        the ``(low, high)`` set (the axes' own range, unchanged, when nothing is finite).
    """
    import numpy as np

    data = np.asarray([*np.ravel(np.asarray(values, float)), *include], float)
    data = data[np.isfinite(data)]
    if log:
        data = np.log10(data[data > 0])
    if not data.size:  # nothing finite drawn (a statistic undefined at every point): keep matplotlib's range
        return ax.get_ylim()
    low, high = float(data.min()), float(data.max())
    span = max(high - low, 1e-3 * max(abs(high), 1e-3))  # a flat line still gets a visible range around it
    low, high = low - pad * span, high + pad * span
    limits = (10**low, 10**high) if log else (low, high)
    ax.set_ylim(limits)
    return limits


def regular_ticks(count: int, most: int = 8) -> list[int]:
    """Positions ``0, k, 2k, ...`` of at most ``most`` ticks among ``count`` evenly spaced columns (timesteps of one
    schedule), one stride ``k`` for all, so that the labels step regularly (951, 801, 651, ...) instead of the
    uneven gaps that rounding ``linspace`` positions gives.

    Args:
        count: the number of columns.
        most: the largest number of ticks.

    Returns:
        the tick positions, ascending.
    """
    for name, value in (("count", count), ("most", most)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if count <= most:
        return list(range(count))
    stride = -(-(count - 1) // (most - 1)) if most > 1 else count
    return list(range(0, count, stride))


def _drawn_tick_labels(axis) -> list:
    """The tick labels ``axis`` draws: of its ticks (placed by ``get_ticklabels``) within its view interval."""
    axis.get_ticklabels(which="both")
    transform = axis.get_transform().transform
    low, high = sorted(transform(axis.get_view_interval()))
    slack = 1e-10 * (high - low)  # matplotlib's own closeness for a tick inside the view
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [x for t in ticks if low - slack <= transform(t.get_loc()) <= high + slack for x in (t.label1, t.label2)]


def _drawn_texts(fig) -> list:
    """Every text matplotlib draws in ``fig`` (drawn once here): visible, non-empty, not of a hidden panel, not a
    tick label of a tick outside the view nor of an axes drawn without axes (``set_axis_off``)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    undrawn = set()
    for ax in fig.axes:
        if not ax.get_visible():
            undrawn |= {id(t) for t in ax.findobj(Text)}
        for axis in (ax.xaxis, ax.yaxis):
            drawn = {id(t) for t in _drawn_tick_labels(axis)} if ax.axison else set()
            if not ax.axison:
                undrawn |= {id(t) for t in axis.findobj(Text)}
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            undrawn |= {id(t) for tick in ticks for t in (tick.label1, tick.label2) if id(t) not in drawn}
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in undrawn]


def small_text(fig, minimum: float = MIN_FONT_PT) -> list[tuple[str, float]]:
    """The texts ``fig`` draws under ``minimum`` points, with their sizes (empty when every text is readable)."""
    return [(t.get_text(), float(t.get_fontsize())) for t in _drawn_texts(fig) if t.get_fontsize() < minimum - 1e-9]


def unlegended_artists(fig) -> list[str]:
    """Lines and marker sets drawn in an axes of ``fig`` whose label is in no legend of that axes or of the figure.

    A line with data is named when its label (set at ``plot(..., label=...)``) is one of the legend's texts; bands
    (``fill_between``) are named by the line they surround, the data line and caps of an ``errorbar`` by the
    errorbar's own label (the legend's entry draws them together), and colorbar axes are skipped.

    Returns:
        ``"axes title: label"`` per artist left out (empty when every line is in a legend).
    """
    from matplotlib.collections import PathCollection
    from matplotlib.container import ErrorbarContainer

    figure_labels = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
    missing = []
    for ax in fig.axes:
        if "outline" in ax.spines or not ax.get_visible():  # a colorbar's axes (its outline spine)
            continue
        legend = ax.get_legend()
        labels = figure_labels | ({t.get_text() for t in legend.get_texts()} if legend is not None else set())
        named_by = {}  # an errorbar's data line and caps -> the errorbar's label
        for container in ax.containers:
            if isinstance(container, ErrorbarContainer):
                data_line, caps, _ = container.lines
                for part in (data_line, *caps):
                    if part is not None:
                        named_by[id(part)] = container.get_label()
        artists = [line for line in ax.lines if len(line.get_xdata())]
        artists += [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets())]
        for artist in artists:
            label = named_by.get(id(artist), artist.get_label())
            if label not in labels:
                missing.append(f"{ax.get_title()}: {label}")
    return missing


def _data_points(ax, renderer):
    """The display coordinates of what ``ax`` plots inside its frame: its lines and error bars (24 points along each
    segment: a line crossing a box between two points is found), markers, and a 5 x 5 grid over each bar."""
    import numpy as np
    from matplotlib.collections import LineCollection, PathCollection
    from matplotlib.patches import Rectangle

    def along(xy, joined=True):  # display points of a polyline, and points along its segments when they are drawn
        return np.concatenate([xy, *([] if not joined or len(xy) < 2 else [
            (xy[:-1] + np.linspace(0, 1, 24)[:, None, None] * (xy[1:] - xy[:-1])).reshape(-1, 2)])])  # fmt: skip

    parts = [along(ln.get_transform().transform(np.reshape(ln.get_xydata(), (-1, 2))),
                   ln.get_linestyle() not in ("None", "", " ")) for ln in ax.lines]  # fmt: skip
    for c in ax.collections:
        if isinstance(c, PathCollection):
            parts.append(c.get_offset_transform().transform(c.get_offsets()))
        elif isinstance(c, LineCollection):
            parts += [along(c.get_transform().transform(np.asarray(segment, float))) for segment in c.get_segments()]
    for box in (p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle) and p.get_visible()):
        grid = np.meshgrid(np.linspace(box.x0, box.x1, 5), np.linspace(box.y0, box.y1, 5))
        parts.append(np.stack(grid, -1).reshape(-1, 2))
    xy = np.concatenate([np.zeros((0, 2)), *parts])
    f = ax.bbox
    return xy[
        np.isfinite(xy).all(1) & (xy[:, 0] >= f.x0) & (xy[:, 0] <= f.x1) & (xy[:, 1] >= f.y0) & (xy[:, 1] <= f.y1)
    ]


def drawn_problems(fig, minimum: float = MIN_FONT_PT) -> list[str]:
    """What a reviewer finds on ``fig`` drawn at its size, measured by matplotlib's renderer on every text and mark
    as drawn (nothing read from what the code meant to draw): a text under ``minimum`` points, two texts that
    overlap (by more than half a point), a text cut by the figure's edge, a legend over another legend or over the
    lines, markers, error bars or bars of any panel, and an axis whose tick labels are drawn without an axis label
    (a colorbar's included; a figure's ``supxlabel`` / ``supylabel`` labels every panel's x / y axis).

    Returns:
        one line per problem (empty when the figure is fit to print).
    """
    import numpy as np

    texts = _drawn_texts(fig)  # draws the figure
    renderer = fig.canvas.get_renderer()
    frame, slack = fig.bbox, fig.dpi / 144  # half a point: boxes that merely touch do not collide
    problems = [f"text under {minimum:g} pt: {t.get_text()!r} at {t.get_fontsize():g} pt" for t in texts
                if t.get_fontsize() < minimum - 1e-9]  # fmt: skip
    boxes = np.array([tuple(t.get_window_extent(renderer).extents) for t in texts]).reshape(-1, 4)
    for text, (x0, y0, x1, y1) in zip(texts, boxes, strict=True):
        if x0 < frame.x0 - 1 or y0 < frame.y0 - 1 or x1 > frame.x1 + 1 or y1 > frame.y1 + 1:
            problems.append(f"text cut by the figure's edge: {text.get_text()!r}")
    wide = np.minimum(boxes[:, None, 2], boxes[None, :, 2]) - np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    tall = np.minimum(boxes[:, None, 3], boxes[None, :, 3]) - np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    for i, j in zip(*np.nonzero(np.triu((wide > slack) & (tall > slack), 1)), strict=True):
        problems.append(f"texts overlap: {texts[i].get_text()!r} and {texts[j].get_text()!r}")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None and ax.get_visible()]
    legends = [legend for legend in [*legends, *fig.legends] if legend.get_visible()]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    for i, legend in enumerate(legends):
        box = legend.get_window_extent(renderer).expanded(1, 1).padded(-slack)
        for other in legends[i + 1 :]:
            if box.overlaps(other.get_window_extent(renderer)):
                problems.append(f"two legends overlap: {legend.get_texts()[0].get_text()!r}…")
        for ax in panels:
            xy = _data_points(ax, renderer)
            inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
            if inside.any():
                problems.append(f"a legend ({legend.get_texts()[0].get_text()!r}…) covers data in {ax.get_title()!r}")
    for ax in panels:
        if not ax.axison:
            continue
        for axis, sup in ((ax.xaxis, fig.get_supxlabel()), (ax.yaxis, fig.get_supylabel())):
            ticks = _drawn_tick_labels(axis)
            labelled = axis.label.get_visible() and axis.label.get_text().strip() or sup
            if any(t.get_visible() and t.get_text().strip() for t in ticks) and not labelled:
                problems.append(f"an unlabelled {axis.axis_name} axis in {ax.get_title()!r}")
    return problems


def size_problems(width: float, height: float, dpi: float | None = SAVE_DPI) -> list[str]:
    """What is wrong with a figure's saved size (inches, dots per inch) for a paper: a width outside a column's
    (:data:`COLUMN_WIDTHS`), a height over :data:`MAX_HEIGHT`, a resolution under :data:`SAVE_DPI`."""
    problems = [] if any(low - 0.01 <= width <= high + 0.01 for low, high in COLUMN_WIDTHS) else [
        f"{width:.2f} in wide, not a column's or a page's width {COLUMN_WIDTHS}"]  # fmt: skip
    if height > MAX_HEIGHT + 0.01:
        problems.append(f"{height:.2f} in tall, over a page's {MAX_HEIGHT} in")
    if dpi is None or dpi < SAVE_DPI - 0.5:
        problems.append(f"saved at {dpi or 0:.0f} dpi, under {SAVE_DPI}")
    return problems


def saved_layout_problems(path) -> list[str]:
    """What is wrong with a saved PNG as a paper's figure, read from the file: its size (pixels over the dpi it
    records, :func:`size_problems`), and the :func:`drawn_problems` :func:`ipa_probe._io.write_figure` measured on
    the figure when it drew it (missing when it was written otherwise).

    Returns:
        one line per problem (empty when the figure is fit to print).
    """
    import json

    from PIL import Image

    with Image.open(path) as image:
        pixels, dpi, text = image.size, image.info.get("dpi"), dict(getattr(image, "text", {}) or {})
    if not dpi:
        return [f"{path}: no dpi recorded, so its printed size is unknown"]
    width, height = pixels[0] / float(dpi[0]), pixels[1] / float(dpi[1])
    problems = [f"{path}: {problem}" for problem in size_problems(width, height, float(dpi[0]))]
    raw = next((v for k, v in text.items() if k.startswith("ipa_probe")), None)
    facts = (json.loads(raw) or {}).get("layout") if raw else None
    if not facts or "problems" not in facts:
        return [*problems, f"{path}: no layout facts stored (write it with ipa_probe._io.write_figure)"]
    if abs(facts["width_in"] - width) > 0.02 or abs(facts["height_in"] - height) > 0.02:
        problems.append(f"{path}: stored size {facts['width_in']} x {facts['height_in']} in is not the file's")
    return problems + [f"{path}: {problem}" for problem in facts["problems"]]


def label_log_axis(ax, which: str = "y") -> None:
    """Label a log axis readably: at 1, 2 and 5 times each decade when its range spans two decades or less (a range
    of one or two decades otherwise shows one or two labels), at each decade above that; plain numbers (``0.5``,
    ``20``), not powers. Call it after the axis' range is set."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis = ax.yaxis if which == "y" else ax.xaxis
    low, high = sorted(ax.get_ylim() if which == "y" else ax.get_xlim())
    decades = math.log10(high / low) if low > 0 else math.inf
    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())
