"""One text style for every figure, and the checks a reviewer would make of a figure, as functions.

Font sizes in matplotlib are points: a 9 pt label is 9/72 inch tall in the saved PNG at any dpi (12.4 px at the
110 dpi the figures are written at). :data:`MIN_FONT_PT` is the smallest size a figure may use, so that it stays
readable printed at its saved size; :func:`paper_style` sets it as the default of every text element, and
:func:`small_text` and :func:`unlegended_artists` find what a reviewer would send back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

__all__ = ["MIN_FONT_PT", "PAPER_RC", "paper_style", "small_text", "text_sizes", "unlegended_artists"]

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


def text_sizes(fig) -> list[tuple[str, float]]:
    """Every visible, non-empty text of ``fig`` (titles, labels, tick labels, legends, annotations) with its size in
    points, after drawing the figure once (tick labels exist only then)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    out = []
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text().strip() and _shown(text):
            out.append((text.get_text(), float(text.get_fontsize())))
    return out


def _shown(artist) -> bool:
    """Whether ``artist`` and the artists that hold it are visible (a hidden axis's tick labels are not shown)."""
    axes = getattr(artist, "axes", None)
    return axes is None or (axes.get_visible() and axes.axison) or artist in axes.texts or artist is axes.title


def small_text(fig, minimum: float = MIN_FONT_PT) -> list[tuple[str, float]]:
    """The texts of ``fig`` smaller than ``minimum`` points (empty when every text is readable)."""
    return [(text, size) for text, size in text_sizes(fig) if size < minimum - 1e-9]


def unlegended_artists(fig) -> list[str]:
    """Lines and marker sets drawn in an axes of ``fig`` whose label is in no legend of that axes or of the figure.

    A line with data is named when its label (set at ``plot(..., label=...)``) is one of the legend's texts; bands
    (``fill_between``) are named by the line they surround, and colorbar axes are skipped.

    Returns:
        ``"axes title: label"`` per artist left out (empty when every line is in a legend).
    """
    from matplotlib.collections import PathCollection

    figure_labels = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
    missing = []
    for ax in fig.axes:
        if hasattr(ax, "_colorbar") or not ax.get_visible():
            continue
        legend = ax.get_legend()
        labels = figure_labels | ({t.get_text() for t in legend.get_texts()} if legend is not None else set())
        artists = [line for line in ax.lines if len(line.get_xdata())]
        artists += [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets())]
        missing += [f"{ax.get_title()}: {a.get_label()}" for a in artists if a.get_label() not in labels]
    return missing
