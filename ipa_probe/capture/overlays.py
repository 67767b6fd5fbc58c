"""Overlays: one reference's (or text token's) map beside a generated image or as contours over it, with the
selection it averages in the title, and the per-layer-group and per-step files of ``ipa-probe probe --overlays``.

Drawing side, apart from the capture code: it reads a finished :class:`~ipa_probe.ProbeRun`'s maps; the colour
scales and the reference-map figure are :mod:`ipa_probe.capture.mapplots`'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import check_choice
from ..layers import LayerSelection
from .layer_order import network_order
from .mapplots import EFFECT_SIZE, MAP_SCALES, _as_array, _colour_scale, draw_outline
from .maps import MAP_KINDS

__all__ = [
    "OVERLAY_LAYOUTS",
    "OverlayMap",
    "describe_selection",
    "layer_groups",
    "overlay_figure",
    "overlay_map",
    "plot_overlay",
    "save_overlays",
]


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
    ``probe(kind="text" | "both", keep_maps=True)``: mean over heads, then over the selected layers and steps; with
    the steps and layer ids averaged."""
    from .maps import query_grid, select_layers

    if run.text_slot is None or not run.config.keep_maps:
        raise ValueError(
            "token= without reference= draws a text token, which needs probe(pipe, kind='text' or 'both', "
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
    check_choice(kind, "kind", MAP_KINDS)
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
        run: a finished :class:`~ipa_probe.ProbeRun`: ``maps=True`` for ``reference=``; ``kind="text"`` or
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
    check_choice(scale, "scale", MAP_SCALES)
    check_choice(layout, "layout", OVERLAY_LAYOUTS)
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
            fig, axes = plt.subplots(1, panels, figsize=(7.0, 3.9), layout="constrained", squeeze=False)
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

    ``run`` made with ``maps=True``; ``image``: the generated image of ``item``; ``directory`` is created;
    ``steps``: the recorded steps of the per-step overlays (``None``: every one); the rest as in
    :func:`plot_overlay`. Returns the paths written.
    """
    from .._io import code_digest, write_figure

    check_choice(scale, "scale", MAP_SCALES)
    check_choice(layout, "layout", OVERLAY_LAYOUTS)
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
            paths.append(write_figure(fig, directory / f"{prefix}ref{r}.png", provenance=stamp))
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
                paths.append(write_figure(fig, path, provenance=stamp))
    return paths


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def overlay_figure(run, image, *, call: int = 0, adapter: int = 0, branch: str = "cond", note: str = "") -> dict:
    """Per recorded step, a card-sized figure (7 in wide): each reference's share minus 1/R under attention (top row)
    and NW (bottom row), averaged over layers, with the image's outline on every map and one colour range for every
    step, both rows and every reference: ±:data:`EFFECT_SIZE` of the uniform share (stated on the colorbar).

    Returns:
        ``{loop index: matplotlib.figure.Figure}``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable

    from ..figstyle import MIN_FONT_PT, paper_style

    steps = run.map_steps(call)
    size = _as_array(image).shape[:2]
    timesteps = run.map_timesteps(call)
    figures = {}
    for step in steps:
        drawn = {
            kind: run.reference_maps(call, 0, adapter, kind, branch, None, [step], size).double().numpy()
            for kind in MAP_KINDS
        }  # kind -> (R, H, W)
        count = drawn["attention"].shape[0]
        uniform = 1.0 / count
        transform, norm, cmap, _ = _colour_scale("deviation", [], uniform, EFFECT_SIZE * uniform)
        with paper_style():
            fig, axes = plt.subplots(2, count, figsize=(7.0, 1.0 + 2 * min(2.2, 6.0 / count)), squeeze=False,
                                     layout="constrained")  # fmt: skip
            for row, kind in enumerate(MAP_KINDS):
                for r in range(count):
                    ax = axes[row, r]
                    ax.imshow(transform(drawn[kind][r]), cmap=cmap, norm=norm, interpolation="bilinear")
                    draw_outline(ax, image)
                    ax.set_xticks([])
                    ax.set_yticks([])
                    ax.set_title(f"ref {r}\n{'attention' if kind == 'attention' else 'NW'}", fontsize=MIN_FONT_PT)
            bar = fig.colorbar(ScalarMappable(norm, cmap), ax=axes, shrink=0.9, extend="both")
            bar.set_label(f"share − 1/{count}\n(saturates at ±{EFFECT_SIZE:g}/{count})", fontsize=MIN_FONT_PT)
            bar.ax.tick_params(labelsize=MIN_FONT_PT)
            fig.suptitle(
                f"t {timesteps[step]:.0f} (step {step}), {branch} branch, mean over layers and heads; "
                f"outline: the generated image {note}".strip(),
                fontsize=MIN_FONT_PT,
            )
        figures[step] = fig
    return figures
