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

from ..layers import LayerSelection
from .maps import MAP_KINDS

__all__ = ["MAP_SCALES", "plot_reference_maps", "save_reference_maps"]

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


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def dominant(shares: np.ndarray, margin: float) -> tuple[np.ndarray, float]:
    """The dominant reference per position where it leads the runner-up by more than ``margin``.

    Args:
        shares: ``(R, H, W)`` shares.
        margin: the lead (in share units) a reference needs to be called dominant.

    Returns:
        ``(H, W)`` int array: the reference index, or ``R`` ("no clear winner"); and the fraction of positions with a
        clear winner.
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


def _panel_grid(rows: int, cols: int, header: float, panel: float = 1.5, gap: float = 0.12):
    """A figure of ``rows x cols`` square panels under a ``header`` (inches) of text, and three colorbar axes at the
    right (one beside row 0, two side by side beside rows 1...), laid out in inches so that every count of rows and
    columns fits and 9 pt titles have room."""
    import matplotlib.pyplot as plt

    first_title, title, bottom, left = 0.62, 0.3, 0.1, 0.1
    bar_gap, bar, labels = 0.25, 0.16, 1.25
    width = left + cols * panel + (cols - 1) * gap + 2 * (bar_gap + bar + labels)
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
    bars = (
        fig.add_axes(box(x, header + first_title, bar, panel)),
        fig.add_axes(box(x, y, bar, span)),
        fig.add_axes(box(x + bar + labels + bar_gap, y, bar, span)),
    )
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
    """``lines`` wrapped to a figure ``width`` inches wide at 9 pt, and the height (inches) they take."""
    columns = int(width * 12)  # characters of 9 pt text per line of `width` inches
    text = "\n".join(textwrap.fill(line, columns) for line in lines)
    return text, 0.2 + (text.count("\n") + 1) * 9 * 1.3 / 72


def _draw_reference_maps(data, call, item, adapter, branch, image, references, scale, margin):
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize

    from ..figstyle import MIN_FONT_PT, paper_style

    maps, names, spans = data["maps"], data["names"], data["spans"]
    n_refs = maps["attention"][0].shape[0]
    uniform = 1.0 / n_refs
    base = _as_array(image) if image is not None else None
    cols, rows = 1 + 3 * len(names), 1 + n_refs
    every = [m for kind in MAP_KINDS for m in maps[kind]]
    transform, norm, cmap, share_label = _colour_scale(scale, every, uniform)
    scale_text = {
        "deviation": f"colour: share − uniform 1/{n_refs}, one symmetric range for every panel",
        "absolute": "colour: share on the absolute 0–1 scale",
        "max": "colour: share from 0 to the largest share in the figure",
    }[scale]
    lines = [
        f"Where each reference goes (call {call}, item {item}, adapter {adapter}, {branch} branch; every layer, the "
        "steps of each range averaged).",
        f"{scale_text}; a reference is dominant where its share leads the runner-up by more than {margin:g}, else "
        "grey (no clear winner).",
    ]
    with paper_style():
        width = 0.1 + cols * 1.5 + (cols - 1) * 0.12 + 2 * (0.25 + 0.16 + 1.25)
        text, header = _header(lines, width)
        fig, axes, (category_ax, share_ax, gap_ax) = _panel_grid(rows, cols, header)
        fig.text(0.5, 1 - 0.1 / fig.get_figheight(), text, ha="center", va="top", fontsize=MIN_FONT_PT)
        gaps = [np.abs(a - n) for a, n in zip(maps["attention"], maps["nw"], strict=True)]
        tvs = [0.5 * g.sum(0) for g in gaps]
        top = max(max(float(g.max(initial=0.0)) for g in gaps), max(float(t.max(initial=0.0)) for t in tvs))
        gap_norm = Normalize(0.0, top or 1e-3)
        colours = [plt.get_cmap("tab10")(r % 10) for r in range(n_refs)]
        categorical = ListedColormap([*colours, NO_WINNER])
        category_norm = BoundaryNorm(np.arange(-0.5, n_refs + 1.0), n_refs + 1)

        def show(ax, values, title, **style):
            ax.imshow(values, interpolation="nearest", **style)
            ax.set_title(title, fontsize=MIN_FONT_PT)

        if base is not None:
            axes[0, 0].imshow(base)
        axes[0, 0].set_title("generated" if base is not None else "(image not given)", fontsize=MIN_FONT_PT)
        for c, (name, span) in enumerate(zip(names, spans, strict=True)):
            a, n = maps["attention"][c], maps["nw"][c]
            winners = [dominant(values, margin) for values in (a, n)]
            panels = axes[0, 1 + 3 * c], axes[0, 2 + 3 * c]
            if all(clear == 0 for _, clear in winners):
                # two empty grey panels say less than one line of text across them
                for ax in panels:
                    ax.set_axis_off()
                panels[0].set_title(f"{name} ({span})", fontsize=MIN_FONT_PT)
                panels[0].text(
                    1.04, 0.5, f"no reference leads by > {margin:g}", transform=panels[0].transAxes, ha="center",
                    va="center", fontsize=MIN_FONT_PT,
                )  # fmt: skip
            else:
                for offset, (kind, (values, clear)) in enumerate(zip(("attention", "NW"), winners, strict=True)):
                    head = f"{name} ({span})\n" if offset == 0 else ""
                    if clear == 0:
                        panels[offset].set_axis_off()
                        panels[offset].set_title(f"{head}{kind}: dominant ref", fontsize=MIN_FONT_PT)
                        panels[offset].text(
                            0.5, 0.5, f"none: no ref\nleads by > {margin:g}", transform=panels[offset].transAxes,
                            ha="center", va="center", fontsize=MIN_FONT_PT,
                        )  # fmt: skip
                        continue
                    title = f"{head}{kind}: dominant ref\n(clear at {clear:.0%})"
                    show(panels[offset], values, title, cmap=categorical, norm=category_norm)
            show(axes[0, 3 + 3 * c], tvs[c], "TV(attention, NW)", cmap=DIFFERENCE, norm=gap_norm)
            for r in range(n_refs):
                show(axes[1 + r, 1 + 3 * c], transform(a[r]), f"ref {r}: attention", cmap=cmap, norm=norm)
                show(axes[1 + r, 2 + 3 * c], transform(n[r]), f"ref {r}: NW", cmap=cmap, norm=norm)
                show(axes[1 + r, 3 + 3 * c], gaps[c][r], "|attention − NW|", cmap=DIFFERENCE, norm=gap_norm)
        for r in range(n_refs):
            if references is not None and r < len(references):
                axes[1 + r, 0].imshow(_as_array(references[r]))
            else:
                axes[1 + r, 0].set_facecolor("white")
            axes[1 + r, 0].set_title(f"reference {r}", fontsize=MIN_FONT_PT, color=colours[r])
        for ax in axes.flat:
            ax.set_xticks([])
            ax.set_yticks([])
        if any(
            clear > 0
            for values in (a for kind in MAP_KINDS for a in maps[kind])
            for _, clear in [dominant(values, margin)]
        ):
            bar = fig.colorbar(ScalarMappable(category_norm, categorical), cax=category_ax)
            bar.set_ticks(range(n_refs + 1), labels=[f"ref {r}" for r in range(n_refs)] + ["no clear\nwinner"])
        else:  # no panel draws a dominant reference: a legend of reference colours would describe nothing
            category_ax.set_visible(False)
        bar = fig.colorbar(ScalarMappable(norm, cmap), cax=share_ax)
        bar.set_label(share_label, fontsize=MIN_FONT_PT)
        bar = fig.colorbar(ScalarMappable(gap_norm, DIFFERENCE), cax=gap_ax)
        bar.set_label("|attention − NW|, TV\n(share units)", fontsize=MIN_FONT_PT)
        for cax in (category_ax, share_ax, gap_ax):
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

    Args:
        run: a finished :class:`~ipa_probe.ProbeRun` made with ``maps=True``.
        call, item, adapter, branch, layers: as in :meth:`~ipa_probe.ProbeRun.reference_maps`.
        image: the generated image (PIL, array or ``(3, H, W)`` tensor), or ``None``.
        references: the adapter's reference images (PIL / arrays), or ``None``.
        ranges: how many consecutive ranges the recorded steps are split into (3: early, middle, late).
        scale: ``"deviation"`` (share - 1/R on a diverging colormap centred at 0, symmetric range), ``"absolute"``
            (share on [0, 1]) or ``"max"`` (share on [0, the largest share drawn]).
        margin: the lead over the runner-up (share units) a reference needs to be drawn as dominant.

    Returns:
        a ``matplotlib.figure.Figure``.
    """
    _check_choice("scale", scale, MAP_SCALES)
    _check_margin(margin)
    data = _reference_map_data(run, call, item, adapter, branch, layers, ranges)
    return _draw_reference_maps(data, call, item, adapter, branch, image, references, scale, margin)


def _check_margin(margin) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"margin: expected a share lead in [0, 1) such as 0.05, got {margin!r}")


#: The code a reference-map figure depends on (its provenance digest).
_REFERENCE_MAP_CODE = (
    _reference_map_data,
    _draw_reference_maps,
    _panel_grid,
    _header,
    dominant,
    _colour_scale,
    _as_array,
)


def save_reference_maps(run, directory, image=None, references: Sequence | None = None, call: int = 0) -> dict:
    """Write ``reference_maps.png`` (:func:`plot_reference_maps` of item 0; further adapters as
    ``reference_maps_adapter{a}.png``) and ``map_table.parquet`` (:meth:`ProbeRun.map_table`).

    Each PNG carries its provenance (:func:`ipa_probe._io.read_provenance`): the digest of the drawing code and a
    fingerprint of the shares it draws.

    Args:
        run: a finished probe made with ``maps=True``.
        directory: an existing folder.
        image: the generated image (first item), or ``None``.
        references: per adapter, its reference images (a list of lists), or ``None``.
        call: the pipeline call to draw.

    Returns:
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
        stamp = {"code": code_digest(*_REFERENCE_MAP_CODE), "data": _fingerprint(data), "atol": 2e-3}
        paths[key] = write_figure(fig, path, dpi=110, provenance=stamp)
    paths["table"] = write_table(run.map_table(), directory / "map_table.parquet")
    return paths
