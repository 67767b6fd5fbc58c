"""One text style for every figure, the sizes a paper prints them at, and the checks a reviewer would make of a
figure, as functions.

A figure is drawn at the width it is read at: one column of a paper (:data:`SINGLE_COLUMN`, 3.5 in) or the page
(:data:`DOUBLE_COLUMN`, 7 in). Font sizes in matplotlib are points: an 8 pt label is 8/72 inch tall in the saved PNG
at any dpi, so a figure drawn at its printed width keeps its sizes in print. :data:`MIN_FONT_PT` is the smallest size
a figure may use; :func:`paper_style` sets it as the default of every text element; :func:`small_text`,
:func:`unlegended_artists` and :func:`layout_facts` (size, smallest text, legends inside the figure and clear of other
panels: stored in every saved PNG by :func:`ipa_probe._io.write_figure`, read back by :func:`saved_layout_problems`)
find what a reviewer would send back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

__all__ = [
    "DOUBLE_COLUMN",
    "MIN_FONT_PT",
    "PAPER_RC",
    "SINGLE_COLUMN",
    "fit_ylim",
    "label_log_axis",
    "layout_facts",
    "paper_style",
    "regular_ticks",
    "saved_layout_problems",
    "small_text",
    "text_sizes",
    "unlegended_artists",
]

#: The smallest font size (points) of any text in a figure, at the width it is drawn (and printed) at.
MIN_FONT_PT = 8.0

#: The widths (inches) a figure is drawn at: one column of a two-column paper, and the full page width.
SINGLE_COLUMN, DOUBLE_COLUMN = 3.5, 7.0

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


def text_sizes(fig) -> list[tuple[str, float]]:
    """Every visible, non-empty text of ``fig`` (titles, labels, tick labels, legends, annotations) with its size in
    points, after drawing the figure once (tick labels exist only then); the texts of a hidden axes, and the tick and
    axis labels of an axes drawn without axes (``set_axis_off``), are left out: they are not drawn."""
    from matplotlib.text import Text

    fig.canvas.draw()
    hidden = set()
    for ax in fig.axes:
        if not ax.get_visible():
            hidden |= {id(t) for t in ax.findobj(Text)}
        elif not ax.axison:
            hidden |= {id(t) for axis in (ax.xaxis, ax.yaxis) for t in axis.findobj(Text)}
    return [
        (text.get_text(), float(text.get_fontsize()))
        for text in fig.findobj(Text)
        if text.get_visible() and text.get_text().strip() and id(text) not in hidden
    ]


def small_text(fig, minimum: float = MIN_FONT_PT) -> list[tuple[str, float]]:
    """The texts of ``fig`` smaller than ``minimum`` points (empty when every text is readable)."""
    return [(text, size) for text, size in text_sizes(fig) if size < minimum - 1e-9]


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
        if hasattr(ax, "_colorbar") or not ax.get_visible():
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


def _within(box, frame, slack: float = 1.0) -> bool:
    """Whether ``box`` lies inside ``frame`` (display pixels) up to ``slack`` pixels (antialiasing)."""
    return (box.x0 >= frame.x0 - slack and box.y0 >= frame.y0 - slack and box.x1 <= frame.x1 + slack
            and box.y1 <= frame.y1 + slack)  # fmt: skip


def layout_facts(fig) -> dict:
    """What a reviewer measures of ``fig`` as it will be saved (drawn once): its size in inches, its smallest text in
    points, and per legend whether it lies inside the figure and clear of every other panel and legend (a legend cut
    by the edge or covered by the next panel is the usual casualty of a shrunken figure).

    Returns:
        ``{"texts_cut": [texts cut by the figure's edge], "width_in", "height_in", "min_font_pt", "legends":
        [{"inside": bool, "overlaps": [axes titles]}]}``.
    """
    sizes = [size for _, size in text_sizes(fig)]  # draws the figure
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
    legends += [(None, legend) for legend in fig.legends]
    out = []
    shown = [legend for _, legend in legends if legend.get_visible()]
    for owner, legend in legends:
        if not legend.get_visible():
            continue
        box = legend.get_window_extent(renderer)
        inside = (
            box.x0 >= frame.x0 - 1 and box.y0 >= frame.y0 - 1 and box.x1 <= frame.x1 + 1 and box.y1 <= frame.y1 + 1
        )
        overlaps = [
            ax.get_title() or f"axes {i}"
            for i, ax in enumerate(fig.axes)
            if ax is not owner and ax.get_visible() and ax.axison and not hasattr(ax, "_colorbar")
            and box.overlaps(ax.get_window_extent(renderer))
        ]  # fmt: skip
        overlaps += [  # two legends drawn over each other (two keys placed at one side of the figure)
            f"legend {j}" for j, other in enumerate(shown)
            if other is not legend and box.overlaps(other.get_window_extent(renderer))
        ]  # fmt: skip
        out.append({"inside": bool(inside), "overlaps": overlaps})
    from matplotlib.text import Text

    undrawn = set()  # tick labels of ticks outside the view: matplotlib keeps them but does not draw them
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            drawn = (
                {id(t) for tick in axis._update_ticks() for t in (tick.label1, tick.label2)} if ax.axison else set()
            )
            ticks = axis.get_major_ticks() + axis.get_minor_ticks()
            undrawn |= {id(t) for tick in ticks for t in (tick.label1, tick.label2) if id(t) not in drawn}
    for ax in fig.axes:  # a hidden panel draws none of its texts
        if not ax.get_visible():
            undrawn |= {id(t) for t in ax.findobj(Text)}
    cut = [
        text.get_text()
        for text in fig.findobj(Text)
        if text.get_visible() and text.get_text().strip() and id(text) not in undrawn
        and not _within(text.get_window_extent(renderer), frame)
    ]  # fmt: skip
    width, height = fig.get_size_inches()
    return {
        "texts_cut": cut,
        "width_in": round(float(width), 3),
        "height_in": round(float(height), 3),
        "min_font_pt": float(min(sizes)) if sizes else None,
        "legends": out,
    }


def saved_layout_problems(path, widths=(SINGLE_COLUMN, DOUBLE_COLUMN), minimum: float = MIN_FONT_PT) -> list[str]:
    """What is wrong with a saved PNG as a paper's figure, read from the file: its width (pixels over the dpi the PNG
    records) is not one of ``widths``, the layout facts :func:`ipa_probe._io.write_figure` stored in it are missing or
    disagree with its pixels, a text is under ``minimum`` points, or a legend is cut by the edge or covers a panel.

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
    problems = []
    if not any(abs(width - w) < 0.02 for w in widths):
        problems.append(f"{path}: {width:.2f} in wide, expected one of {widths}")
    raw = next((v for k, v in text.items() if k.startswith("ipa_probe")), None)
    facts = (json.loads(raw) or {}).get("layout") if raw else None
    if not facts:
        return [*problems, f"{path}: no layout facts stored (write it with ipa_probe._io.write_figure)"]
    if abs(facts["width_in"] - width) > 0.02 or abs(facts["height_in"] - height) > 0.02:
        problems.append(f"{path}: stored size {facts['width_in']} x {facts['height_in']} in is not the file's")
    if facts["min_font_pt"] is not None and facts["min_font_pt"] < minimum - 1e-9:
        problems.append(f"{path}: text at {facts['min_font_pt']} pt, under {minimum} pt")
    for text in facts.get("texts_cut", ["(not measured)"]):
        problems.append(f"{path}: text cut by the figure's edge: {text!r}")
    for i, legend in enumerate(facts["legends"]):
        if not legend["inside"]:
            problems.append(f"{path}: legend {i} is cut by the figure's edge")
        if legend["overlaps"]:
            problems.append(f"{path}: legend {i} covers {legend['overlaps']}")
    return problems


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
