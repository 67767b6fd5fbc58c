"""Figures of the per-reference maps (:mod:`~.maps`): where each reference goes, attention beside NW."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..layers import LayerSelection
from .maps import MAP_KINDS

__all__ = ["plot_reference_maps", "save_reference_maps"]


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
):
    """A figure of where each reference goes: attention beside NW at early / middle / late steps.

    Row 0 shows the generated image and, per timestep range, the dominant reference under attention and NW and the
    per-position total-variation distance between the two reference-share vectors. Row ``1 + r`` shows reference
    ``r`` and, per range, its attention share, its NW share (overlaid on the generated image when given) and
    ``|attention - NW|``.

    Args:
        run: a finished :class:`~ipa_probe.ProbeRun` made with ``maps=True``.
        call, item, adapter, branch, layers: as in :meth:`~ipa_probe.ProbeRun.reference_maps`.
        image: the generated image (PIL, array or ``(3, H, W)`` tensor), or ``None``.
        references: the adapter's reference images (PIL / arrays), or ``None``.
        ranges: how many consecutive ranges the recorded steps are split into (3: early, middle, late).

    Returns:
        a ``matplotlib.figure.Figure``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    steps = run.map_steps(call)
    if not isinstance(ranges, int) or isinstance(ranges, bool) or ranges < 1:
        raise ValueError(f"ranges: expected a positive int, got {ranges!r}")
    chunks = [list(map(int, c)) for c in np.array_split(np.asarray(steps), min(ranges, len(steps))) if len(c)]
    names = ["early", "middle", "late"] if len(chunks) == 3 else [f"range {i + 1}" for i in range(len(chunks))]
    maps = {
        kind: [run.reference_maps(call, item, adapter, kind, branch, layers, chunk, "image") for chunk in chunks]
        for kind in MAP_KINDS
    }
    n_refs = maps["attention"][0].shape[0]
    base = _as_array(image) if image is not None else None
    cols, rows = 1 + 3 * len(chunks), 1 + n_refs
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.6 * rows + 0.4), squeeze=False)
    colours = ListedColormap(plt.get_cmap("tab10").colors[: max(n_refs, 1)])
    timesteps = run.map_timesteps(call)

    def show(ax, values, title=None, overlay=True, **style):
        if overlay and base is not None:
            ax.imshow(base, extent=(0, values.shape[-1], values.shape[-2], 0))
            style.setdefault("alpha", 0.6)
        ax.imshow(values, extent=(0, values.shape[-1], values.shape[-2], 0), **style)
        if title:
            ax.set_title(title, fontsize=7)

    # one colour scale per figure, shared by attention and NW, so that the two are comparable
    low = min(float(m.min()) for kind in MAP_KINDS for m in maps[kind])
    top = max(float(m.max()) for kind in MAP_KINDS for m in maps[kind])
    top = top if top > low else low + 1e-6
    gap = max(float((a - n).abs().max()) for a, n in zip(maps["attention"], maps["nw"], strict=True)) or 1.0
    if base is not None:
        axes[0, 0].imshow(base)
    axes[0, 0].set_title("generated" if base is not None else "(image not given)", fontsize=7)
    for c, (chunk, name) in enumerate(zip(chunks, names, strict=True)):
        a, n = maps["attention"][c].numpy(), maps["nw"][c].numpy()
        span = f"t {timesteps[chunk[0]]:.0f}-{timesteps[chunk[-1]]:.0f}"
        style = {"cmap": colours, "vmin": -0.5, "vmax": n_refs - 0.5, "interpolation": "nearest"}
        show(axes[0, 1 + 3 * c], a.argmax(0), f"{name} ({span})\nattention: top ref", **style)
        show(axes[0, 2 + 3 * c], n.argmax(0), "NW: top ref", **style)
        show(axes[0, 3 + 3 * c], 0.5 * np.abs(a - n).sum(0), "TV(attn, NW)", False, cmap="magma", vmin=0, vmax=gap)
        for r in range(n_refs):
            show(axes[1 + r, 1 + 3 * c], a[r], f"ref {r}: attention", cmap="viridis", vmin=low, vmax=top)
            show(axes[1 + r, 2 + 3 * c], n[r], f"ref {r}: NW", cmap="viridis", vmin=low, vmax=top)
            show(axes[1 + r, 3 + 3 * c], np.abs(a[r] - n[r]), "|attn - NW|", False, cmap="magma", vmin=0, vmax=gap)
    for r in range(n_refs):
        if references is not None and r < len(references):
            axes[1 + r, 0].imshow(_as_array(references[r]))
        axes[1 + r, 0].set_title(f"reference {r}", fontsize=7, color=colours(r))
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        f"Where each reference goes (call {call}, item {item}, adapter {adapter}, {branch}): "
        f"share of image-branch weight per reference (viridis {low:.2f}-{top:.2f}; differences, magma 0-{gap:.3f})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def save_reference_maps(run, directory, image=None, references: Sequence | None = None, call: int = 0) -> dict:
    """Write ``reference_maps.png`` (:func:`plot_reference_maps` of item 0, every adapter stacked as separate files
    ``reference_maps_adapter{a}.png`` after the first) and ``map_table.parquet`` (:meth:`ProbeRun.map_table`).

    Args:
        run: a finished probe made with ``maps=True``.
        directory: an existing folder.
        image: the generated image (first item), or ``None``.
        references: per adapter, its reference images (a list of lists), or ``None``.
        call: the pipeline call to draw.

    Returns:
        ``{"figure": path, "table": path}`` (and ``"figure_adapter{a}"`` for further adapters).
    """
    from .._io import write_figure, write_table

    directory = Path(directory)
    paths = {}
    for adapter in range(run.num_adapters):
        refs = references[adapter] if references is not None and adapter < len(references) else None
        fig = run.plot_reference_maps(call, 0, adapter, image=image, references=refs)
        key, name = ("figure", "reference_maps.png") if adapter == 0 else (f"figure_adapter{adapter}", None)
        path = directory / (name or f"reference_maps_adapter{adapter}.png")
        paths[key] = write_figure(fig, path, dpi=110)
    paths["table"] = write_table(run.map_table(), directory / "map_table.parquet")
    return paths
