"""Figures of the per-reference maps (:mod:`~.maps`): where each reference goes, attention beside NW, and overlays.

Colour is honest here: every map has a colorbar, and a reference's share is drawn either as its deviation from the
uniform share (``share - 1/R`` on a diverging colormap centred at 0, one symmetric range per figure, the default) or
on the absolute ``[0, 1]`` scale; the title says which. A "dominant reference" is coloured only where its share
exceeds the runner-up's by more than a stated margin, and grey ("no clear winner") elsewhere, so that differences of
a fraction of a percent are not painted as territories; where no reference leads anywhere, one line of text says so
instead of empty grey panels. Overlays draw the map beside the image (which keeps its own colours) or as contour
lines over it, never as a translucent fill whose colours no colorbar shows, and their titles state the steps, layers
and branch averaged and the largest deviation from uniform. Text is 9 pt or more (:mod:`ipa_probe.figstyle`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import check_choice
from ..layers import LayerSelection
from .maps import MAP_KINDS

__all__ = ["EFFECT_SIZE", "MAP_SCALES", "draw_outline", "plot_reference_maps", "save_reference_maps"]

#: How shares become colours: ``"deviation"`` (share - uniform, diverging, symmetric range), ``"absolute"`` (the
#: share on [0, 1]) or ``"max"`` (the share on [0, the map's largest value]; for text-token maps).
MAP_SCALES: tuple[str, ...] = ("deviation", "absolute", "max")

#: Colour of the positions where no reference's share exceeds the runner-up's by the margin.
NO_WINNER = "#bdbdbd"
#: The smallest half-range of a deviation colour scale: rounding noise (1e-16 with one reference) is not stretched
#: into colour.
DEVIATION_FLOOR = 1e-3
#: Diverging colormap of share deviations (red: more than uniform), sequential colormap of absolute shares and of
#: attention-vs-NW differences.
DIVERGING, SEQUENTIAL, DIFFERENCE = "RdBu_r", "viridis", "magma"


def _as_array(image) -> np.ndarray:
    """A PIL image, ``(H, W, 3)`` array in [0, 1] or [0, 255], or ``(3, H, W)`` tensor -> float array in [0, 1]."""
    if isinstance(image, torch.Tensor):
        image = image.detach().float().cpu()
        image = image.permute(1, 2, 0) if image.ndim == 3 and image.shape[0] in (1, 3) else image
        image = image.numpy()
    array = np.asarray(image, dtype=np.float64)
    if array.max(initial=0.0) > 1.0:
        array = array / 255.0
    return array.clip(0.0, 1.0)


def dominant(shares: np.ndarray, margin: float) -> tuple[np.ndarray, float]:
    """The dominant reference per position where it leads the runner-up by more than ``margin``.

    ``shares``: ``(R, H, W)``. Returns an ``(H, W)`` int array, the reference index or ``R`` ("no clear winner"),
    and the fraction of positions with a clear winner.
    """
    if shares.shape[0] == 1:
        return np.zeros(shares.shape[1:], dtype=int), 1.0
    ordered = np.sort(shares, axis=0)
    lead = ordered[-1] - ordered[-2]  # (H, W)
    clear = lead > margin
    return np.where(clear, shares.argmax(0), shares.shape[0]), float(clear.mean())


def _colour_scale(scale: str, values: Sequence[np.ndarray], uniform: float, vmax: float | None = None):
    """``(transform, norm, cmap, label)`` of one figure's shares: one range for every panel."""
    from matplotlib.colors import Normalize

    if scale == "deviation":
        top = vmax if vmax is not None else max(float(np.abs(v - uniform).max(initial=0.0)) for v in values)
        top = max(top, DEVIATION_FLOOR)
        label = f"share − uniform {uniform:.3g}\n(range ±{top:.3g})"
        return (lambda v: v - uniform), Normalize(-top, top), DIVERGING, label
    if scale == "absolute":
        return (lambda v: v), Normalize(0.0, 1.0), SEQUENTIAL, "share (absolute, 0 to 1)"
    top = vmax if vmax is not None else max(float(v.max(initial=0.0)) for v in values)
    top = top if top > 0 else 1e-6
    return (lambda v: v), Normalize(0.0, top), SEQUENTIAL, f"share (0 to the largest, {top:.3g})"


#: The deviation from the uniform share at which a share map's colour saturates, as a fraction of the uniform share:
#: a reference given 1.5x (or 0.5x) its uniform share is full red (blue); smaller deviations are paler in proportion,
#: so that a map within 1% of uniform looks flat instead of painted in saturated colour.
EFFECT_SIZE = 0.5


def draw_outline(ax, image, color: str = "black") -> None:
    """The outline of the generated image's subject (its luminance contour halfway between its darkest and lightest
    pixel) over ``ax``, in image pixels, so that a map drawn there reads against the digit it made."""
    base = _as_array(image)
    luminance = base.mean(axis=-1) if base.ndim == 3 else base  # (H, W)
    low, high = float(luminance.min()), float(luminance.max())
    if high - low < 1e-6:  # a flat field (no image given): nothing to outline
        return
    ax.contour(luminance, levels=[(low + high) / 2], colors=color, linewidths=0.8)


def _panel_grid(rows: int, cols: int, header: float, width: float = 7.0, gap: float = 0.06):
    """A figure ``width`` inches wide of ``rows x cols`` square panels under a ``header`` (inches) of text, and two
    colorbar axes at the right (one beside row 0, one beside rows 1...), laid out in inches so that 8 pt titles have
    room."""
    import matplotlib.pyplot as plt

    first_title, title, bottom, left = 0.42, 0.08, 0.05, 0.2
    bar_gap, bar, labels = 0.1, 0.12, 0.8
    panel = (width - left - (cols - 1) * gap - (bar_gap + bar + labels)) / cols
    height = header + first_title + panel + (rows - 1) * (title + panel) + bottom
    fig = plt.figure(figsize=(width, height))

    def box(x, y, w, h):  # inches from the top-left corner -> figure fractions
        return [x / width, 1 - (y + h) / height, w / width, h / height]

    axes = np.empty((rows, cols), dtype=object)
    for r in range(rows):
        y = header + first_title + r * (panel + title)
        for c in range(cols):
            axes[r, c] = fig.add_axes(box(left + c * (panel + gap), y, panel, panel))
    x = left + cols * panel + (cols - 1) * gap + bar_gap
    y = header + first_title + panel + title
    span = (rows - 1) * (panel + title) - title
    bars = (fig.add_axes(box(x, header + first_title, bar, panel)), fig.add_axes(box(x, y, bar, span)))
    return fig, axes, bars


def _reference_map_data(run, call, item, adapter, branch, layers, ranges) -> dict:
    """The shares a reference-map figure draws: per kind, one ``(R, H, W)`` array per range of steps."""
    steps = run.map_steps(call)
    if not isinstance(ranges, int) or isinstance(ranges, bool) or ranges < 1:
        raise ValueError(f"ranges: expected a positive int, got {ranges!r}")
    chunks = [list(map(int, c)) for c in np.array_split(np.asarray(steps), min(ranges, len(steps))) if len(c)]
    names = ["early", "middle", "late"] if len(chunks) == 3 else [f"range {i + 1}" for i in range(len(chunks))]
    timesteps = run.map_timesteps(call)
    maps = {
        kind: [
            run.reference_maps(call, item, adapter, kind, branch, layers, chunk, "image").double().numpy()
            for chunk in chunks
        ]
        for kind in MAP_KINDS
    }
    spans = [f"t {timesteps[c[0]]:.0f}–{timesteps[c[-1]]:.0f}" for c in chunks]
    return {"maps": maps, "names": names, "spans": spans}


def _fingerprint(data: dict) -> list[float]:
    """A few hundred numbers that follow the drawn shares (each panel pooled to at most 4 x 4, 4 decimals)."""
    out = []
    for kind in MAP_KINDS:
        for values in data["maps"][kind]:
            pooled = F.adaptive_avg_pool2d(torch.from_numpy(values)[None], (4, 4))[0]
            out.extend(round(float(v), 4) for v in pooled.flatten())
    return out


def _header(lines: list[str], width: float) -> tuple[str, float]:
    """``lines`` wrapped to a figure ``width`` inches wide at 8 pt, and the height (inches) they take."""
    columns = int(width * 13)  # characters of 8 pt text per line of `width` inches
    text = "\n".join(textwrap.fill(line, columns) for line in lines)
    return text, 0.15 + (text.count("\n") + 1) * 8 * 1.3 / 72


def _draw_reference_maps(data, call, item, adapter, branch, image, references, scale, margin):
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap

    from ..figstyle import DOUBLE_COLUMN, MIN_FONT_PT, paper_style

    maps, names, spans = data["maps"], data["names"], data["spans"]
    n_refs = maps["attention"][0].shape[0]
    uniform = 1.0 / n_refs
    base = _as_array(image) if image is not None else None
    cols, rows = 1 + 2 * len(names), 1 + n_refs
    every = [m for kind in MAP_KINDS for m in maps[kind]]
    vmax = EFFECT_SIZE * uniform if scale == "deviation" else None
    transform, norm, cmap, share_label = _colour_scale(scale, every, uniform, vmax)
    if scale == "deviation":
        share_label = f"share − 1/{n_refs}\n(saturates at ±{EFFECT_SIZE:g}/{n_refs})"
    largest = max(float(np.abs(m - uniform).max(initial=0.0)) for m in every)
    scale_text = {
        "deviation": f"colour: share − 1/{n_refs}, saturating at ±{EFFECT_SIZE:g}/{n_refs} (a reference given "
        f"{1 + EFFECT_SIZE:g}x its uniform share); the largest deviation drawn is {largest:.3g}",
        "absolute": "colour: share on the absolute 0–1 scale",
        "max": "colour: share from 0 to the largest share in the figure",
    }[scale]
    ranges = "; ".join(f"{n}: {s}" for n, s in zip(names, spans, strict=True))
    lines = [
        f"Where each reference goes: call {call}, item {item}, adapter {adapter}, {branch} branch, every layer, the "
        f"steps of each range averaged ({ranges}); outline: the generated image.",
        f"{scale_text}. Top row: the dominant reference where it leads the runner-up by more than {margin:g}.",
    ]
    with paper_style():
        text, header = _header(lines, DOUBLE_COLUMN)
        fig, axes, (category_ax, share_ax) = _panel_grid(rows, cols, header, DOUBLE_COLUMN)
        fig.text(0.5, 1 - 0.08 / fig.get_figheight(), text, ha="center", va="top", fontsize=MIN_FONT_PT)
        colours = [plt.get_cmap("tab10")(r % 10) for r in range(n_refs)]
        categorical = ListedColormap([*colours, NO_WINNER])
        category_norm = BoundaryNorm(np.arange(-0.5, n_refs + 1.0), n_refs + 1)

        def show(ax, values, title, **style):
            ax.imshow(values, interpolation="nearest", **style)
            if base is not None and values.shape[:2] == base.shape[:2]:
                draw_outline(ax, base)
            if title:
                ax.set_title(title, fontsize=MIN_FONT_PT)

        if base is not None:
            axes[0, 0].imshow(base)
        axes[0, 0].set_title("generated" if base is not None else "(no image)", fontsize=MIN_FONT_PT)
        drawn_winner = False
        for c, name in enumerate(names):
            a, n = maps["attention"][c], maps["nw"][c]
            winners = [dominant(values, margin) for values in (a, n)]
            panels = axes[0, 1 + 2 * c], axes[0, 2 + 2 * c]
            for offset, (kind, (values, clear)) in enumerate(zip(("attn", "NW"), winners, strict=True)):
                if clear == 0:
                    panels[offset].set_axis_off()
                    panels[offset].set_title(f"{name}: {kind}", fontsize=MIN_FONT_PT)
                    note = f"no ref\nleads by\n> {margin:g}"
                    panels[offset].text(0.5, 0.5, note, transform=panels[offset].transAxes, ha="center",
                                        va="center", fontsize=MIN_FONT_PT)  # fmt: skip
                    continue
                drawn_winner = True
                show(panels[offset], values, f"{name}: {kind}\n(clear {clear:.0%})", cmap=categorical,
                     norm=category_norm)  # fmt: skip
            for r in range(n_refs):
                show(axes[1 + r, 1 + 2 * c], transform(a[r]), "", cmap=cmap, norm=norm)  # titled in the top row
                show(axes[1 + r, 2 + 2 * c], transform(n[r]), "", cmap=cmap, norm=norm)
        for r in range(n_refs):
            if references is not None and r < len(references):
                axes[1 + r, 0].imshow(_as_array(references[r]))
            else:
                axes[1 + r, 0].set_facecolor("white")
            axes[1 + r, 0].set_ylabel(f"ref {r}", fontsize=MIN_FONT_PT, color=colours[r])
        for ax in axes.flat:
            ax.set_xticks([])
            ax.set_yticks([])
        if drawn_winner:
            bar = fig.colorbar(ScalarMappable(category_norm, categorical), cax=category_ax)
            bar.set_ticks(range(n_refs + 1), labels=[f"ref {r}" for r in range(n_refs)] + ["no clear\nwinner"])
        else:  # no panel draws a dominant reference: a legend of reference colours would describe nothing
            category_ax.set_visible(False)
        bar = fig.colorbar(ScalarMappable(norm, cmap), cax=share_ax, extend="both" if vmax is not None else "neither")
        bar.set_label(share_label, fontsize=MIN_FONT_PT)
        for cax in (category_ax, share_ax):
            cax.tick_params(labelsize=MIN_FONT_PT)
    return fig


def plot_reference_maps(
    run,
    call: int = 0,
    item: int = 0,
    adapter: int = 0,
    image=None,
    references: Sequence | None = None,
    branch: str = "cond",
    layers: LayerSelection = None,
    ranges: int = 3,
    scale: str = "deviation",
    margin: float = 0.05,
):
    """A figure of where each reference goes: attention beside NW at early / middle / late steps.

    Row 0 shows the generated image and, per timestep range, the dominant reference under attention and under NW
    (grey where no reference leads the runner-up by more than ``margin``) and the per-position total-variation
    distance between the two reference-share vectors. Row ``1 + r`` shows reference ``r`` and, per range, its
    attention share, its NW share and ``|attention - NW|``. Three colorbars: the references, the shares (one range for
    every panel, attention and NW alike) and the differences.

    ``run`` made with ``maps=True``; the selection as in :meth:`~ipa_probe.ProbeRun.reference_maps`; ``image``
    (PIL, array or ``(3, H, W)`` tensor) and the adapter's ``references`` are optional; ``ranges``: how many
    consecutive ranges the recorded steps are split into (3: early, middle, late); ``scale``: ``"deviation"``
    (share - 1/R on a diverging colormap centred at 0, symmetric range), ``"absolute"`` (share on [0, 1]) or ``"max"``
    (share on [0, the largest share drawn]); ``margin``: the lead over the runner-up (share units) a reference needs
    to be drawn as dominant.
    """
    check_choice(scale, "scale", MAP_SCALES)
    _check_margin(margin)
    data = _reference_map_data(run, call, item, adapter, branch, layers, ranges)
    return _draw_reference_maps(data, call, item, adapter, branch, image, references, scale, margin)


def _check_margin(margin) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"margin: expected a share lead in [0, 1) such as 0.05, got {margin!r}")


#: The code a reference-map figure depends on (its provenance digest).
REFERENCE_MAP_CODE = (
    _reference_map_data,
    _draw_reference_maps,
    _panel_grid,
    _header,
    draw_outline,
    dominant,
    _colour_scale,
    _as_array,
)


def save_reference_maps(run, directory, image=None, references: Sequence | None = None, call: int = 0) -> dict:
    """Write ``reference_maps.png`` (:func:`plot_reference_maps` of item 0; further adapters as
    ``reference_maps_adapter{a}.png``) and ``map_table.parquet`` (:meth:`ProbeRun.map_table`).

    Each PNG carries its provenance (:func:`ipa_probe._io.read_provenance`): the digest of the drawing code and a
    fingerprint of the shares it draws.

    ``directory`` must exist; ``references``: per adapter, its reference images (a list of lists). Returns
    ``{"figure": path, "table": path}`` (and ``"figure_adapter{a}"`` for further adapters).
    """
    from .._io import code_digest, write_figure, write_table

    directory = Path(directory)
    paths = {}
    for adapter in range(run.num_adapters):
        refs = references[adapter] if references is not None and adapter < len(references) else None
        data = _reference_map_data(run, call, 0, adapter, "cond", None, 3)
        fig = _draw_reference_maps(data, call, 0, adapter, "cond", image, refs, "deviation", 0.05)
        key, name = ("figure", "reference_maps.png") if adapter == 0 else (f"figure_adapter{adapter}", None)
        path = directory / (name or f"reference_maps_adapter{adapter}.png")
        # the fingerprint's tolerance: shares move by ~1e-6 between CPUs, far below 2e-3 (an invisible colour step)
        stamp = {"code": code_digest(*REFERENCE_MAP_CODE), "data": _fingerprint(data), "atol": 2e-3}
        paths[key] = write_figure(fig, path, provenance=stamp)
    paths["table"] = write_table(run.map_table(), directory / "map_table.parquet")
    return paths
