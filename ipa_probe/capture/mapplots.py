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

import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..layers import LayerSelection
from .layer_order import network_order
from .maps import MAP_KINDS

__all__ = [
    "MAP_SCALES",
    "OVERLAY_LAYOUTS",
    "OverlayMap",
    "describe_selection",
    "layer_groups",
    "overlay_map",
    "plot_overlay",
    "plot_reference_maps",
    "save_overlays",
    "save_reference_maps",
]

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


# ----------------------------------------------------------------------------------------------------------- overlays


def layer_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """The probe's layers grouped by block, in network order (:func:`~.layer_order.network_order`): ``down_blocks.N``,
    ``mid_block``, ``up_blocks.N`` (UNets), ``transformer_blocks.N`` (DiTs: one block per group); a name without
    such a prefix is its own group, after those."""
    groups: dict[str, list[str]] = {}
    for name in network_order(names):
        match = re.match(r"^(mid_block|[A-Za-z_]+\.\d+)(?:\.|$)", name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return groups


def _spans(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0–2, 5, 7–8"``."""
    out, values = [], sorted(values)
    start = previous = values[0]
    for value in [*values[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        out.append(f"{start}" if start == previous else f"{start}–{previous}")
        if value is not None:
            start = previous = value
    return ", ".join(out)


def describe_selection(picked: Sequence[int], recorded: Sequence[int], timesteps, chosen, names) -> str:
    """One line naming the steps and layers a map averages, e.g. ``"step 5 (t 751) · up_blocks.1 (3 of 10
    layers)"`` or ``"all 20 recorded steps (t 951–1) · all 10 layers"``.

    Args:
        picked: the recorded loop indices averaged; ``recorded``: every recorded one.
        timesteps: the scheduler timestep of each loop index of the call.
        chosen: the layer ids averaged; ``names``: every probed layer id.
    """
    t = [timesteps[s] for s in picked]
    when = f"t {t[0]:.0f}" if len(t) == 1 else f"t {max(t):.0f}–{min(t):.0f}"
    if list(picked) == list(recorded):
        steps = f"all {len(picked)} recorded steps ({when})" if len(picked) > 1 else f"step {picked[0]} ({when})"
    else:
        steps = f"{'step' if len(picked) == 1 else 'steps'} {_spans(picked)} ({when})"
    if len(chosen) == len(names):
        layers = f"all {len(names)} layers"
    else:
        groups = list(layer_groups(chosen))
        shown = ", ".join(groups[:3]) + (f" +{len(groups) - 3} groups" if len(groups) > 3 else "")
        layers = f"{shown} ({len(chosen)} of {len(names)} layers)"
    return f"{steps} · {layers}"


class OverlayMap(NamedTuple):
    """What :func:`plot_overlay` draws.

    Attributes:
        values: ``(H, W)`` float64 map at the image's size.
        uniform: the share every position would have under uniform weights (``1/R``, ``1/(R T)`` or ``1/K``).
        description: what the map is, e.g. ``"reference 0 (attention, cond branch)"``.
        selection: the steps and layers it averages (:func:`describe_selection`).
    """

    values: np.ndarray
    uniform: float
    description: str
    selection: str


def _text_token_map(run, token: int, call, item, branch, layers, steps, size) -> tuple[np.ndarray, list, list]:
    """Text token ``token``'s attention weight per position, ``(H, W)``, from the full maps of
    ``probe(branch="text" | "both", keep_maps=True)``: mean over heads, then over the selected layers and steps; with
    the steps and layer ids averaged."""
    from .maps import query_grid, select_layers

    if run.text_slot is None or not run.config.keep_maps:
        raise ValueError(
            "token= without reference= draws a text token, which needs probe(pipe, branch='text' or 'both', "
            "keep_maps=True); for an image token of reference i pass reference=i, token=j (with maps=True)"
        )
    names = [layer.name for layer in run.layers]
    chosen = {names[i] for i in select_layers(names, layers)}
    latent = (size[0] // int(getattr(run.pipe, "vae_scale_factor", 8)), size[1] // int(run.pipe.vae_scale_factor))
    total, count, used_steps, used_layers = None, 0, set(), set()
    for key, records in run.maps.items():
        key_call, step, name, slot = key
        picked = steps is None or step in steps
        if key_call != call or slot != run.text_slot or name not in chosen or not picked:
            continue
        rows = [
            weights[position]  # (H, Q, K)
            for weights, labels in zip(records, run.map_branches[key], strict=True)
            for position, label in enumerate(labels)
            if label == branch
        ]
        if item >= len(rows):
            raise ValueError(f"item={item}: call {call} has {len(rows)} image(s) in branch {branch!r}")
        weights = rows[item].double().mean(0)  # (Q, K)
        if not 0 <= token < weights.shape[-1]:
            raise ValueError(f"token={token}: the text branch has {weights.shape[-1]} tokens (0 is the start token)")
        h, w = query_grid(latent, weights.shape[0])
        spatial = weights[:, token].reshape(1, 1, h, w)
        spatial = F.interpolate(spatial, size=size, mode="bilinear", align_corners=False)[0, 0]
        total = spatial if total is None else total + spatial
        count += 1
        used_steps.add(step)
        used_layers.add(name)
    if total is None:
        raise ValueError(f"no text maps recorded for call={call} at the selected layers and steps")
    return (total / count).numpy(), sorted(used_steps), network_order(used_layers)


def overlay_map(
    run,
    size: tuple[int, int],
    reference: int | None = None,
    token: int | None = None,
    *,
    kind: str = "attention",
    call: int = 0,
    item: int = 0,
    adapter: int = 0,
    branch: str = "cond",
    layers: LayerSelection = None,
    steps: Sequence[int] | None = None,
) -> OverlayMap:
    """The map :func:`plot_overlay` draws, at ``size`` (see :class:`OverlayMap`).

    ``reference=i``: reference ``i``'s share (maps=True); with ``token=j`` too, image token ``j`` of reference ``i``;
    ``token=j`` alone: text token ``j`` (keep_maps=True with the text branch; the uniform share is then ``1/K``).
    """
    from .maps import select_layers

    if reference is None and token is None:
        raise ValueError("expected reference=i (a reference image's share) and/or token=j (a token's weight)")
    for name, value in (("reference", reference), ("token", token)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}: expected a non-negative index, got {value!r}")
    names = [layer.name for layer in run.layers]
    timesteps = run.map_timesteps(call)
    if reference is None:
        values, used, chosen = _text_token_map(run, token, call, item, branch, layers, steps, size)
        recorded = sorted({k[1] for k in run.maps if k[0] == call and k[3] == run.text_slot})
        keys = next(v[0].shape[-1] for k, v in run.maps.items() if k[3] == run.text_slot)
        selection = describe_selection(used, recorded, timesteps, chosen, names)
        return OverlayMap(values, 1.0 / keys, f"text token {token} (attention, {branch} branch)", selection)
    _check_choice("kind", kind, MAP_KINDS)
    recorded = run.map_steps(call)
    used = recorded if steps is None else [s for s in recorded if s in set(steps)]
    chosen = [names[i] for i in select_layers(names, layers)]
    if token is None:
        maps = run.reference_maps(call, item, adapter, kind, branch, layers, steps, size)  # (R, H, W)
        if reference >= maps.shape[0]:
            raise ValueError(f"reference={reference}: adapter {adapter} has {maps.shape[0]} reference image(s)")
        selection = describe_selection(used, recorded, timesteps, chosen, names)
        what = f"reference {reference} ({kind}, {branch} branch)"
        return OverlayMap(maps[reference].double().numpy(), 1.0 / maps.shape[0], what, selection)
    maps = run.token_maps(call, item, adapter, kind, branch, layers, steps, size)  # (R, T, H, W)
    if reference >= maps.shape[0] or token >= maps.shape[1]:
        raise ValueError(
            f"reference={reference}, token={token}: adapter {adapter} has {maps.shape[0]} reference(s) of "
            f"{maps.shape[1]} token(s)"
        )
    uniform = 1.0 / (maps.shape[0] * maps.shape[1])
    what = f"reference {reference}, token {token} ({kind}, {branch} branch)"
    selection = describe_selection(used, recorded, timesteps, chosen, names)
    return OverlayMap(maps[reference, token].double().numpy(), uniform, what, selection)


#: How an overlay shows its map: ``"beside"`` (the image, and the map beside it with its colorbar) or ``"contours"``
#: (contour lines of the map over the image, each level named in a legend).
OVERLAY_LAYOUTS: tuple[str, ...] = ("beside", "contours")


def plot_overlay(
    run,
    image,
    reference: int | None = None,
    token: int | None = None,
    *,
    kind: str = "attention",
    call: int = 0,
    item: int = 0,
    adapter: int = 0,
    branch: str = "cond",
    layers: LayerSelection = None,
    steps: Sequence[int] | None = None,
    scale: str = "deviation",
    vmax: float | None = None,
    layout: str = "beside",
    ax=None,
    title: str | None = None,
):
    """One reference's (or one token's) map upsampled to the image, drawn beside it or as contours over it.

    The image keeps its own colours (a 16-pixel digit stays readable): with ``layout="beside"`` the map is drawn
    opaque in a panel of its own with a colorbar of exactly the colours drawn; with ``layout="contours"`` its contour
    lines (solid above the uniform share, dashed below) are drawn over the image and each level is named in a legend.
    The title names the map, the branch, the steps and layers averaged, and the largest ``|share − uniform|``.

    Args:
        run: a finished :class:`~ipa_probe.ProbeRun`: ``maps=True`` for ``reference=``; ``branch="text"`` or
            ``"both"`` with ``keep_maps=True`` for a text ``token=``.
        image: the generated image (PIL, ``(H, W, 3)`` array or ``(3, H, W)`` tensor); the map is resized
            bilinearly from each layer's grid to its size.
        reference: the reference image whose share to draw; with ``token`` too, that reference's image token.
        token: alone, the index of a text token (0 is the start token: ``pipe.tokenizer.tokenize(prompt)[j - 1]``
            is token ``j``); with ``reference``, an image token of that reference.
        kind: ``"attention"`` or ``"nw"`` (reference maps only).
        call, item, adapter, branch, layers, steps: as in :meth:`~ipa_probe.ProbeRun.reference_maps`.
        scale: ``"deviation"`` (share minus the uniform share, diverging, symmetric; the default, for tokens too:
            a map within a few percent of uniform then looks flat), ``"absolute"`` ([0, 1]) or ``"max"`` ([0, the
            map's largest value]).
        vmax: the colour range's end (``±vmax`` for ``"deviation"``), to share one range across several overlays;
            ``None`` for this map's own.
        layout: ``"beside"`` or ``"contours"`` (see above).
        ax: where to draw, or ``None`` for a new figure: a pair of axes (image, map) for ``"beside"``, one axes for
            ``"contours"``.
        title: the title, or ``None`` for one that states what is drawn, the selection and the largest deviation.

    Returns:
        the ``matplotlib.figure.Figure``.

    Example:
        ```py
        >>> with ipa_probe.probe(pipe, maps=True) as run:
        ...     image = pipe(..., ip_adapter_image=[refs]).images[0]
        >>> fig = ipa_probe.plot_overlay(run, image, reference=0)
        >>> fig = ipa_probe.plot_overlay(run, image, reference=0, steps=[5], layers=r"^up_blocks", layout="contours")
        ```
    """
    _check_choice("scale", scale, MAP_SCALES)
    _check_choice("layout", layout, OVERLAY_LAYOUTS)
    if vmax is not None and (isinstance(vmax, bool) or not isinstance(vmax, int | float) or not vmax > 0):
        raise ValueError(f"vmax: expected a positive colour-range end, got {vmax!r}")
    base = _as_array(image)
    drawn = overlay_map(
        run, base.shape[:2], reference, token, kind=kind, call=call, item=item, adapter=adapter, branch=branch,
        layers=layers, steps=steps,
    )  # fmt: skip
    return _draw_overlay(base, drawn, scale, vmax, layout, ax, title)


def _overlay_title(drawn: OverlayMap) -> str:
    """What is drawn, its selection and its largest deviation from uniform."""
    top = float(np.abs(drawn.values - drawn.uniform).max(initial=0.0))
    return (
        f"{drawn.description}\n{drawn.selection}\n"
        f"largest |share − uniform {drawn.uniform:.3g}| = {top:.3g} ({top / drawn.uniform:.1%} of uniform)"
    )


def _contour_levels(scale: str, norm) -> np.ndarray:
    """Contour levels inside the colour range: ±1/3 and ±2/3 of it (deviation), or 1/4, 1/2, 3/4 of it."""
    if scale == "deviation":
        return np.array([-2, -1, 1, 2]) * norm.vmax / 3
    return norm.vmin + np.array([0.25, 0.5, 0.75]) * (norm.vmax - norm.vmin)


def _draw_overlay(base, drawn: OverlayMap, scale, vmax, layout, ax, title):
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from ..figstyle import MIN_FONT_PT, paper_style

    transform, norm, cmap, label = _colour_scale(scale, [drawn.values], drawn.uniform, vmax)
    values = transform(drawn.values)
    title = title if title is not None else _overlay_title(drawn)
    with paper_style():
        if ax is None:
            panels = 2 if layout == "beside" else 1
            fig, axes = plt.subplots(1, panels, figsize=(6.4, 3.9), layout="constrained", squeeze=False)
            axes = list(axes[0])
            fig.suptitle(title, fontsize=MIN_FONT_PT)
        else:
            axes = list(ax) if isinstance(ax, Sequence | np.ndarray) else [ax]
            if len(axes) != (2 if layout == "beside" else 1):
                raise ValueError(
                    f"ax: expected {'a pair of axes' if layout == 'beside' else 'one axes'} for layout={layout!r}"
                )
            fig = axes[0].figure
            axes[-1].set_title(title, fontsize=MIN_FONT_PT)
        for a in axes:
            a.set_xticks([])
            a.set_yticks([])
        axes[0].imshow(base, interpolation="nearest")
        if layout == "beside":
            axes[0].set_xlabel("generated image", fontsize=MIN_FONT_PT)
            shown = axes[1].imshow(values, cmap=cmap, norm=norm, interpolation="bilinear")
            axes[1].set_xlabel("map", fontsize=MIN_FONT_PT)
            bar = fig.colorbar(shown, ax=axes[1], shrink=0.9)
            bar.set_label(label, fontsize=MIN_FONT_PT)
            bar.ax.tick_params(labelsize=MIN_FONT_PT)
            return fig
        levels = _contour_levels(scale, norm)
        colours = ["#2166ac" if level < 0 else "#b2182b" for level in levels]
        styles = ["--" if level < 0 else "-" for level in levels]
        widths = [1.2 + abs(i - (len(levels) - 1) / 2) for i in range(len(levels))]
        # contoured on a grid 4x finer than the image (bilinear), so that a 16-pixel image gets smooth lines
        fine = F.interpolate(torch.from_numpy(values)[None, None], scale_factor=4, mode="bilinear")[0, 0].numpy()
        rows, cols = values.shape
        x = (np.arange(fine.shape[1]) + 0.5) / 4 - 0.5  # pixel centres of the fine grid, in image pixels
        y = (np.arange(fine.shape[0]) + 0.5) / 4 - 0.5
        axes[0].contour(x, y, fine, levels=levels, colors=colours, linestyles=styles, linewidths=widths)
        axes[0].set(xlim=(-0.5, cols - 0.5), ylim=(rows - 0.5, -0.5))
        unit = "share − uniform" if scale == "deviation" else "share"
        handles = [
            Line2D([], [], color=c, linestyle=s, linewidth=w) for c, s, w in zip(colours, styles, widths, strict=True)
        ]
        names = [f"{unit} = {level:+.3g}" for level in levels]
        axes[0].legend(handles, names, loc="upper left", bbox_to_anchor=(1.03, 1.0), fontsize=MIN_FONT_PT,
                       title="contour levels", title_fontsize=MIN_FONT_PT)  # fmt: skip
        axes[0].set_xlabel("generated image, contours of the map", fontsize=MIN_FONT_PT)
    return fig


#: The code an overlay depends on (its provenance digest).
_OVERLAY_CODE = (
    overlay_map, plot_overlay, _draw_overlay, _overlay_title, _contour_levels, describe_selection, _spans,
    _colour_scale, _as_array,
)  # fmt: skip


def save_overlays(
    run,
    image,
    directory,
    *,
    per_layer_step: bool = False,
    steps: Sequence[int] | None = None,
    kind: str = "attention",
    call: int = 0,
    item: int = 0,
    branch: str = "cond",
    scale: str = "deviation",
    layout: str = "beside",
) -> list[Path]:
    """Write one overlay per reference of every adapter (and, on request, per layer group and step) as PNGs.

    Files: ``ref{r}.png`` (adapter 0; ``adapter{a}_ref{r}.png`` for further adapters), averaged over every layer and
    step; with ``per_layer_step`` also ``ref{r}/{group}_step{s:03d}.png`` for each layer group (:func:`layer_groups`)
    and recorded step, all of one reference on one colour range, so that they can be flipped through.

    Args:
        run: a finished probe made with ``maps=True``.
        image: the generated image of ``item``.
        directory: the folder (created).
        per_layer_step: also write the per (layer group, step) overlays.
        steps: the recorded steps of those (``None``: every one).
        kind, call, item, branch, scale, layout: as in :func:`plot_overlay`.

    Returns:
        the paths written.
    """
    from .._io import code_digest, write_figure

    _check_choice("scale", scale, MAP_SCALES)
    _check_choice("layout", layout, OVERLAY_LAYOUTS)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = {"code": code_digest(*_OVERLAY_CODE, save_overlays)}
    base = _as_array(image)
    size = base.shape[:2]
    options = {"kind": kind, "call": call, "item": item, "branch": branch}
    paths = []
    for adapter in range(run.num_adapters):
        count = run.reference_maps(call, item, adapter, kind, branch, size=size).shape[0]
        prefix = "" if adapter == 0 else f"adapter{adapter}_"
        for r in range(count):
            fig = plot_overlay(run, base, r, adapter=adapter, scale=scale, layout=layout, **options)
            paths.append(write_figure(fig, directory / f"{prefix}ref{r}.png", dpi=110, provenance=stamp))
        if not per_layer_step:
            continue
        groups = layer_groups([layer.name for layer in run.layers])
        for r in range(count):
            cells = {
                (group, step): overlay_map(
                    run,
                    size,
                    r,
                    adapter=adapter,
                    layers=[f"^{re.escape(n)}$" for n in names],
                    steps=[step],
                    **options,
                )  # fmt: skip
                for group, names in groups.items()
                for step in run.map_steps(call)
                if steps is None or step in steps
            }
            if not cells:
                raise ValueError(f"steps={steps!r}: none recorded with maps (recorded: {run.map_steps(call)})")
            uniform = next(iter(cells.values())).uniform
            # one colour range for every overlay of this reference, so that they can be flipped through
            spread = [np.abs(c.values - uniform) if scale == "deviation" else c.values for c in cells.values()]
            top = max(max(float(v.max(initial=0.0)) for v in spread), 1e-6)
            folder = directory / f"{prefix}ref{r}"
            folder.mkdir(exist_ok=True)
            for (group, step), drawn in cells.items():
                fig = _draw_overlay(base, drawn, scale, top, layout, None, None)
                path = folder / f"{_safe(group)}_step{step:03d}.png"
                paths.append(write_figure(fig, path, dpi=90, provenance=stamp))
    return paths


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
