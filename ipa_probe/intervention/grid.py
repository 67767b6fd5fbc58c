"""Causal ground truth with resolution: each reference's ablation effect per layer group and step range (#29.4).

:func:`ablation_grid` runs, for every seed, one clean generation (reused by every cell of that seed) and one
intervened generation per cell of references x layer groups x step ranges x modes (``"ablate"``, and ``"scale"`` with
factors in ``[0, 1]``), and returns one row per (seed, cell): the RMS change of the final latent and of the pixels and,
given a classifier, its labels and probabilities before and after. :func:`summarize_grid` gives each cell's mean over
seeds with a Student's t 95 % interval.

Layer groups are regexes on the layer ids (:data:`LAYER_GROUPS`: the UNet's down blocks, mid block and up blocks;
``"all"`` for every IP-Adapter layer); step ranges are consecutive parts of the loop (:func:`step_ranges`: thirds by
default; ``"all"`` for every step). By default each cell is a separate seeded generation (the cells of one seed share
the clean run); with ``batch > 1`` up to that many cells of a seed run as the rows of one pipeline call, each row's
cell applied on the ``weights`` hook point, the same numbers up to float32 rounding.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..layers import denoiser_of
from .config import InterventionConfig
from .effect import Classifier, Generation, _check_baseline, _rms, call_digest, decode_latents, generate
from .hooks import intervene
from .points import hook_point_layers

__all__ = ["GRID_COLUMNS", "LAYER_GROUPS", "ablation_grid", "step_ranges", "summarize_grid", "t_interval"]

logger = logging.getLogger(__name__)

#: The UNet's layer groups by id: down blocks, mid block, up blocks (SD 1.5 / SDXL names).
LAYER_GROUPS: dict[str, str] = {"down": r"^down_blocks\.", "mid": r"^mid_block\.", "up": r"^up_blocks\."}

#: Columns of :func:`ablation_grid` (then ``baseline_probability_k`` and ``probability_k`` per class ``k`` with a
#: classifier).
GRID_COLUMNS: tuple[str, ...] = (
    "seed",
    "reference",
    "group",
    "steps",
    "first_step",
    "last_step",
    "mode",
    "factor",
    "latent_effect",
    "pixel_effect",
    "baseline_label",
    "label",
    "flipped",
)


def step_ranges(num_steps: int, parts: int = 3) -> dict[str, range]:
    """``parts`` consecutive ranges of loop indices covering ``range(num_steps)`` (sizes differing by at most one,
    the larger ones first), named ``"first-last"``: ``step_ranges(20)`` -> ``{"0-6", "7-13", "14-19"}``."""
    for name, value in (("num_steps", num_steps), ("parts", parts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if parts > num_steps:
        raise ValueError(f"parts={parts}: more parts than the {num_steps} steps; pass parts <= num_steps")
    size, extra = divmod(num_steps, parts)
    out, start = {}, 0
    for part in range(parts):
        stop = start + size + (part < extra)
        out[f"{start}-{stop - 1}"] = range(start, stop)
        start = stop
    return out


def _label(reference: int | Sequence[int]) -> int | str:
    return reference if isinstance(reference, int) else "+".join(str(r) for r in reference)


def _groups(pipe, groups: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """The layer groups that select at least one IP-Adapter layer (``None``: :data:`LAYER_GROUPS` and ``"all"``)."""
    names = [layer.name for layer in hook_point_layers(pipe)]
    chosen = dict(LAYER_GROUPS) if groups is None else dict(groups)
    if groups is None:
        chosen["all"] = None
    if not isinstance(chosen, dict) or not chosen:
        raise ValueError("groups: expected a non-empty {name: layer regex or None} mapping")
    out = {}
    for name, pattern in chosen.items():
        if pattern is not None and not isinstance(pattern, str):
            raise TypeError(f"groups[{name!r}]: expected a regex (str) or None for every layer, got {pattern!r}")
        if pattern is None or any(re.search(pattern, n) for n in names):
            out[name] = pattern
        elif groups is None:
            logger.info("ablation_grid: no IP-Adapter layer in group %r; left out", name)
        else:
            raise ValueError(f"groups[{name!r}]={pattern!r} matches no IP-Adapter layer (e.g. {names[0]!r})")
    return out


def ablation_grid(
    pipe,
    references: Sequence[int | Sequence[int]],
    *,
    groups: Mapping[str, str | None] | None = None,
    steps: int | Mapping[str, range | None] = 3,
    modes: Sequence[str] = ("ablate",),
    factors: Sequence[float] = (0.5,),
    seeds: Sequence[int] = (0,),
    classify: Classifier | None = None,
    adapter: int = 0,
    baselines: Mapping[int, Generation] | None = None,
    whole: bool = True,
    batch: int = 1,
    **call: Any,
) -> pd.DataFrame:
    """Each reference's effect on the output when ablated (or scaled) in one layer group during one step range.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter.
        references: the units intervened on: reference indices, or tuples of them intervened on together.
        groups: ``{name: layer regex, or None for every layer}``; ``None``: :data:`LAYER_GROUPS` (those with a layer)
            and ``"all"``.
        steps: the number of consecutive step ranges (:func:`step_ranges` of ``num_inference_steps``), or
            ``{name: range of loop indices, or None for every step}``.
        modes: ``"ablate"`` and / or ``"scale"``.
        factors: the factors in ``[0, 1]`` of ``mode="scale"`` (each a cell).
        seeds: one clean generation per seed, shared by that seed's cells.
        classify: ``classify(images) -> (labels, probabilities)``, e.g.
            :func:`ipa_probe.tiny.digits.classify_digit_images`.
        adapter: the IP-Adapter.
        baselines: ``{seed: generate(pipe, seed=seed, **call)}`` already made (checked as in
            :func:`~.effect.measure_intervention`); the others are made here.
        whole: with ``steps`` an int, add the range ``"all"`` (every step) beside the parts.
        batch: cells per pipeline call. ``1``: each cell is its own call, the intervention applied by
            :func:`~.hooks.intervene` (``"ablate"`` drops the reference's tokens). Above 1: up to ``batch`` cells of a
            seed run as the rows of one call (``num_images_per_prompt``, every row starting from the seed's noise),
            each row's cell applied on the ``weights`` hook point as :func:`~.custom.scale_hooks` does (``"ablate"``
            is factor 0: the same softmax over the other references), rows whose cell does not act at a (layer,
            step) left as computed. Same numbers up to float32 rounding (batched kernels and the explicit softmax
            sum in another order; measured on the digits organism: final latents within 1e-5 of the one-call
            cells); far cheaper where the denoiser is small. SD 1.5 / SDXL UNets.
        **call: the pipeline's arguments (with ``num_inference_steps`` when ``steps`` is an int).

    Returns:
        one row per (seed, reference, group, step range, mode, factor), columns :data:`GRID_COLUMNS` (``reference``
        the index, or ``"0+1"`` for a tuple; ``factor`` 0 for ``"ablate"``; ``first_step`` / ``last_step`` -1 for
        ``"all"``; labels -1 without a classifier), then ``baseline_probability_k`` and ``probability_k`` per class.

    Example:
        ```py
        >>> grid = ipa_probe.intervention.ablation_grid(pipe, [0, 1], seeds=(0, 1), prompt="a digit",
        ...                                             ip_adapter_image=[refs], num_inference_steps=6)
        >>> summarize_grid(grid)
        ```
    """
    if isinstance(references, int | str) or not isinstance(references, Sequence) or not references:
        raise TypeError(f"references: expected a non-empty list of reference indices (or tuples), got {references!r}")
    units = [r if isinstance(r, int) and not isinstance(r, bool) else tuple(r) for r in references]
    for mode in modes:
        if mode not in ("ablate", "scale"):
            raise ValueError(f'modes: expected "ablate" and / or "scale", got {mode!r}')
    settings = [("ablate", None)] if "ablate" in modes else []
    settings += [("scale", f) for f in factors] if "scale" in modes else []
    for unit in units:  # every cell's settings checked before the first generation
        for mode, factor in settings:
            InterventionConfig(unit, mode=mode, factor=factor, adapter=adapter)
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) for s in seeds):
        raise ValueError(f"seeds: expected a non-empty list of ints, got {seeds!r}")
    layer_groups = _groups(pipe, groups)
    if isinstance(steps, int) and not isinstance(steps, bool):
        total = call.get("num_inference_steps")
        if not isinstance(total, int):
            raise ValueError("steps as a number of parts needs num_inference_steps= in the call; or pass a mapping")
        ranges: dict[str, range | None] = dict(step_ranges(total, steps))
        if whole:
            ranges["all"] = None
    elif isinstance(steps, Mapping) and steps:
        ranges = dict(steps)
    else:
        raise ValueError(f"steps: expected a number of parts or a {{name: range or None}} mapping, got {steps!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch: expected a number of cells per pipeline call >= 1, got {batch!r}")
    cells = [
        (unit, group, pattern, name, chosen, mode, factor)
        for unit in units
        for group, pattern in layer_groups.items()
        for name, chosen in ranges.items()
        for mode, factor in settings
    ]
    rows = []
    for seed in seeds:
        if baselines is not None and seed in baselines:
            baseline = baselines[seed]
            _check_baseline(baseline, seed, call)
        else:
            baseline = generate(pipe, seed=seed, **call)
        base_labels, base_probabilities = classify(baseline.images) if classify is not None else (None, None)
        outputs = _batched_cells(pipe, cells, seed, batch, adapter, call) if batch > 1 else None
        for index, (unit, group, pattern, name, chosen, mode, factor) in enumerate(cells):
            if outputs is None:
                where = {"layers": pattern, "steps": None if chosen is None else list(chosen)}
                with intervene(pipe, unit, **where, mode=mode, factor=factor, adapter=adapter):
                    out = generate(pipe, seed=seed, **call)
            else:
                out = outputs[index]
            row = {
                "seed": seed,
                "reference": _label(unit),
                "group": group,
                "steps": name,
                "first_step": -1 if chosen is None else chosen.start,
                "last_step": -1 if chosen is None else chosen.stop - 1,
                "mode": mode,
                "factor": 0.0 if factor is None else float(factor),
                "latent_effect": float(_rms(baseline.latents.numpy(), out.latents.numpy())[0]),
                "pixel_effect": float(_rms(baseline.images, out.images)[0]),
                "baseline_label": -1,
                "label": -1,
                "flipped": False,
            }
            if classify is not None:
                labels, probabilities = classify(out.images)
                row.update(
                    baseline_label=int(base_labels[0]),
                    label=int(labels[0]),
                    flipped=bool(labels[0] != base_labels[0]),
                )
                row.update({f"baseline_probability_{k}": float(p) for k, p in enumerate(base_probabilities[0])})
                row.update({f"probability_{k}": float(p) for k, p in enumerate(probabilities[0])})
            rows.append(row)
    return pd.DataFrame(rows)


def _initial_noise(pipe, seed: int, call: dict[str, Any]) -> torch.Tensor:
    """``(1, C, h, w)`` the noise :func:`~.effect.generate` starts from with ``seed`` (drawn as the pipeline draws it,
    before its scheduler's ``init_noise_sigma``)."""
    from diffusers.utils.torch_utils import randn_tensor

    config = denoiser_of(pipe).config
    scale = getattr(pipe, "vae_scale_factor", 8)
    height = call.get("height") or config.sample_size * scale
    width = call.get("width") or config.sample_size * scale
    shape = (1, config.in_channels, height // scale, width // scale)
    dtype = next(denoiser_of(pipe).parameters()).dtype
    return randn_tensor(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _batched_cells(pipe, cells: list, seed: int, batch: int, adapter: int, call: dict[str, Any]) -> list[Generation]:
    """Every cell's intervened generation, ``batch`` cells per pipeline call (see :func:`ablation_grid`)."""
    from .custom import scale_hooks
    from .points import point_name

    for name in ("generator", "output_type", "return_dict", "latents", "num_images_per_prompt"):
        if name in call:
            raise ValueError(f"ablation_grid(batch > 1) sets {name}= itself; drop it from the call (or pass batch=1)")
    layers = [layer.name for layer in hook_point_layers(pipe)]
    noise = _initial_noise(pipe, seed, call)  # (1, C, h, w)
    digest = call_digest(**call)
    out: list[Generation] = []
    for start in range(0, len(cells), batch):
        chunk = cells[start : start + batch]
        # per cell: the scale callback of its setting (factor 0: ablate), the layers and steps where it acts
        edits = [
            (
                next(
                    iter(
                        scale_hooks(
                            InterventionConfig(unit, mode="scale", factor=0.0 if f is None else f), [""]
                        ).values()
                    )
                ),  # fmt: skip
                {n for n in layers if pattern is None or re.search(pattern, n)},
                None if chosen is None else set(chosen),
            )
            for unit, _, pattern, _, chosen, _, f in chunk
        ]

        def weights(w: torch.Tensor, ctx, edits=edits) -> torch.Tensor | None:  # w: (B, H, Q, K), B = rows x cells
            cells_here = len(edits)
            acting = [ctx.layer in names and (steps is None or ctx.step in steps) for _, names, steps in edits]
            if not any(acting):
                return None
            per_cell = w.reshape(-1, cells_here, *w.shape[1:])  # (rows, cells, H, Q, K): cells vary fastest
            edited = [
                (fn(per_cell[:, c], ctx) if act else None)
                for c, ((fn, _, _), act) in enumerate(zip(edits, acting, strict=True))
            ]
            return torch.stack([per_cell[:, c] if e is None else e for c, e in enumerate(edited)], 1).reshape(w.shape)

        hooks = {point_name(layer, "weights", adapter): weights for layer in layers}
        with intervene(pipe, hooks=hooks):
            latents = pipe(
                **call,
                num_images_per_prompt=len(chunk),
                latents=noise.expand(len(chunk), *noise.shape[1:]).clone(),
                output_type="latent",
            ).images
        images = decode_latents(pipe, latents)
        latents = latents.detach().float().cpu()
        out.extend(Generation(latents[i : i + 1], images[i : i + 1], seed, digest) for i in range(len(chunk)))
    return out


def t_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student's t interval of ``values`` at ``level`` (NaN bounds for one value)."""
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean, mean - half, mean + half


def median_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Median of ``values`` and the distribution-free interval ``[min, max]`` of the population median: it misses
    only when every value falls on one side, so it covers with probability ``1 - 2^(1 - n)`` (0.992 over 8 values),
    whatever the distribution's shape; NaN bounds where that is below ``level`` (fewer than 6 values at 95 %)."""
    values = np.asarray(values, dtype=np.float64)
    if 1 - 2.0 ** (1 - len(values)) < level:
        return float(np.median(values)), math.nan, math.nan
    return float(np.median(values)), float(values.min()), float(values.max())


def summarize_grid(
    grid: pd.DataFrame, columns: Sequence[str] | None = None, medians: Sequence[str] = ()
) -> pd.DataFrame:
    """Each cell of :func:`ablation_grid`'s table: its mean over seeds with a Student's t 95 % interval, or for the
    effects in ``medians`` its median with :func:`median_interval`.

    ``columns``: the effects summarised; ``None``: ``latent_effect``, ``pixel_effect``, ``flipped`` and the
    ``probability_k`` columns. Returns one row per (reference, group, steps, mode, factor): ``seeds`` and per effect
    ``X``: ``X``, ``X_low``, ``X_high``.
    """
    if columns is None:
        columns = ["latent_effect", "pixel_effect", "flipped"] + [c for c in grid if c.startswith("probability_")]
    keys = ["reference", "group", "steps", "mode", "factor"]
    rows = []
    for key, part in grid.groupby(keys, sort=False):
        row = dict(zip(keys, key, strict=True)) | {"seeds": int(part["seed"].nunique())}
        for column in columns:
            mean, low, high = (median_interval if column in medians else t_interval)(part[column].to_numpy(np.float64))
            row.update({column: mean, f"{column}_low": low, f"{column}_high": high})
        rows.append(row)
    return pd.DataFrame(rows)
