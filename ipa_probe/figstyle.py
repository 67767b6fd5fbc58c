"""One text style for every figure, and the checks a reviewer would make of a figure, as functions.

Font sizes in matplotlib are points: a 9 pt label is 9/72 inch tall in the saved PNG at any dpi (12.4 px at the
110 dpi the figures are written at). :data:`MIN_FONT_PT` is the smallest size a figure may use, so that it stays
readable printed at its saved size; :func:`paper_style` sets it as the default of every text element, and
:func:`small_text` and :func:`unlegended_artists` find what a reviewer would send back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

__all__ = [
    "MIN_FONT_PT",
    "PAPER_RC",
    "fit_ylim",
    "paper_style",
    "regular_ticks",
    "small_text",
    "text_sizes",
    "unlegended_artists",
]

#: The smallest font size (points) of any text in a figure.
MIN_FONT_PT = 9.0

#: matplotlib rc settings of :func:`paper_style`: every text element at 9 pt or more.
PAPER_RC = {
    "font.size": MIN_FONT_PT,
    "axes.titlesize": 10.0,
    "axes.labelsize": MIN_FONT_PT,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 11.0,
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
