"""Collect, in one seeded generation, each reference's share of the image-branch attention and its exact posterior.

For every recorded step ``t`` (loop index) and IP-Adapter layer ``l`` of the conditional branch: the attention share
of each reference (the probe's per-reference maps, :meth:`ipa_probe.ProbeRun.reference_weights`, averaged over the
layer's positions and heads) and the exact posterior over the reference latents at the same ``x_t`` on the path
``x_t = alpha_t x_0 + sigma_t eps`` (paper §C.5: ``w_i = softmax_i(-|x_t / alpha_t - s_i|^2 / (2 h_t^2))``, ``h_t =
sigma_t / alpha_t``, float64; VP: ``alpha_t = sqrt(abar_t)``, flow matching: ``1 - sigma_t``), with the squared
distances the temperature fit of :mod:`.analysis` needs. Columns: docs/attribution.md. All gauge invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from .._checks import check_flag, check_int, check_seed, check_steps_ran, parse_step_selection

__all__ = [
    "ATTRIBUTION_COLUMNS",
    "CELL_COLUMNS",
    "CONTRIBUTION_COLUMNS",
    "ReferenceAttribution",
    "posterior_at",
    "reference_attribution",
    "sets_table",
]

#: Columns of :func:`reference_attribution`'s table, one row per (step, layer, reference).
ATTRIBUTION_COLUMNS: tuple[str, ...] = (
    "step",
    "timestep",
    "layer",
    "reference",
    "attention_share",
    "position_neff",
    "sq_distance",
    "bandwidth",
    "posterior_weight",
    "contribution_norm",
    "contribution_share",
    "contribution_projection",
)

#: Per reference ``j``, its contribution ``c_j(q) = s W_o sum_{i in j} w_i(q) v_i`` to the layer's output: ``|c_j|``,
#: ``|c_j| / sum_k |c_k|`` and ``c_j . c / |c|`` (``c`` the branch's total), each averaged over query positions (per
#: head: ``c_{j,h}``, the share over the references and heads). See :meth:`.MapAccumulator.contribution_weights`.
CONTRIBUTION_COLUMNS: tuple[str, ...] = ("contribution_norm", "contribution_share", "contribution_projection")


#: Columns of :attr:`ReferenceAttribution.heads` (``cell`` = head index) and :attr:`ReferenceAttribution.positions`
#: (``cell`` = query position, row-major on the layer's grid): one row per (step, layer, cell, reference).
CELL_COLUMNS: tuple[str, ...] = (
    "step",
    "timestep",
    "layer",
    "cell",
    "reference",
    "attention_share",
    *CONTRIBUTION_COLUMNS,
)


@dataclass(frozen=True)
class ReferenceAttribution:
    """One generation's attribution.

    Attributes:
        table: one row per (recorded step, layer, reference), columns :data:`ATTRIBUTION_COLUMNS`.
        generation: the call's :class:`~ipa_probe.intervention.Generation` (the plain pipeline's, for that seed).
        run: the finished :class:`~ipa_probe.ProbeRun` (``maps=True``): the probe's table of the same generation.
        heads: per (step, layer, head, reference) the head's attention share (mean over query positions),
            columns :data:`CELL_COLUMNS` with ``cell`` the head; empty when ``per_head=False``.
        positions: per (step, layer, query position, reference) the share averaged over heads, columns
            :data:`CELL_COLUMNS` with ``cell`` the position.
        head_positions: per (step, layer, head, query position, reference) the one head's share at that position,
            columns :data:`CELL_COLUMNS` with ``cell = head * Q + position`` (contributions NaN: not kept); empty
            when ``per_head=False``. The finest resolution the verdict's TV rule is applied at.
        samples: recorded step -> ``x_t`` (the conditional row of the denoiser's input, float64, flattened), where
            the posterior was evaluated; :func:`posterior_at` evaluates other references' posterior there.
    """

    table: pd.DataFrame
    generation: Any
    run: Any
    heads: pd.DataFrame | None = None
    positions: pd.DataFrame | None = None
    samples: dict[int, torch.Tensor] | None = None
    head_positions: pd.DataFrame | None = None


def _references(call: dict[str, Any], adapter: int) -> list:
    images = call.get("ip_adapter_image")
    if not isinstance(images, list | tuple) or adapter >= len(images) or not isinstance(images[adapter], list | tuple):
        raise ValueError(
            "reference_attribution needs the references as images: pass ip_adapter_image=[[img0, img1, ...]] "
            f"(one list per adapter; adapter={adapter})"
        )
    if call.get("num_images_per_prompt", 1) != 1 or not isinstance(call.get("prompt", ""), str):
        raise ValueError(
            "reference_attribution compares one generated image with its posterior: pass one prompt (a string) and "
            "num_images_per_prompt=1, and run several seeds for several images"
        )
    return list(images[adapter])


def posterior_at(
    pipe, references: list, samples: dict[int, torch.Tensor], timesteps: dict[int, float], height=None, width=None
) -> pd.DataFrame:
    """The exact posterior over ``references`` at given noisy latents: for the controls, references the generation
    never saw evaluated at the ``x_t`` it passed through.

    ``pipe``'s VAE encodes the references at the generation's ``height x width`` (the pipeline's default unless
    given), its scheduler gives ``alpha_t``, ``sigma_t`` (flow matching's as the generation left it); ``samples``:
    step -> ``x_t`` (flattened; :attr:`ReferenceAttribution.samples`). One row per (step, reference): ``step``,
    ``timestep``, ``reference``, ``sq_distance``, ``bandwidth``, ``posterior_weight`` (:data:`ATTRIBUTION_COLUMNS`).
    """
    schedule, support = _schedule(pipe), _support(pipe, references, height, width)  # (R, D)
    rows = []
    for step in sorted(samples):
        (alpha, sigma), x = schedule(timesteps[step]), samples[step].double().cpu()
        if x.shape != support.shape[1:]:
            raise ValueError(f"x_t: {x.numel()} values, the latents {support.shape[1]}: pass the call's height, width")
        if alpha:
            distance, h = ((x / alpha - support) ** 2).sum(-1), sigma / alpha  # (R,) |x_t / alpha_t - s_i|^2, h_t
            weight = torch.softmax(-distance / (2 * h * h), -1)
        else:  # flow matching's sigma = 1: x_t tells nothing of x_0 (distances and h inf, the posterior uniform)
            distance, h = torch.full((len(support),), math.inf, dtype=torch.float64), math.inf
            weight = torch.full_like(distance, 1 / len(support))
        pairs = enumerate(zip(distance.tolist(), weight.tolist(), strict=True))
        rows += [(step, float(timesteps[step]), i, d, h, w) for i, (d, w) in pairs]
    columns = ["step", "timestep", "reference", "sq_distance", "bandwidth", "posterior_weight"]
    return pd.DataFrame(rows, columns=columns)


def _schedule(pipe):
    """timestep -> ``(alpha_t, sigma_t)``: VP (SD 1.5, SDXL) from ``alphas_cumprod``; flow matching (Flux, SD3)
    ``sigma_t`` the scheduler's sigma at that timestep of its last loop, ``alpha_t = 1 - sigma_t``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ..theory.schedules import VPSchedule

    scheduler = pipe.scheduler
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return lambda t: (1 - _flow_sigma(scheduler, t), _flow_sigma(scheduler, t))
    if hasattr(scheduler, "alphas_cumprod"):
        vp = VPSchedule.from_scheduler(scheduler)
        return lambda t: (float(vp(int(round(t))).alpha_t), float(vp(int(round(t))).sigma_t))
    raise TypeError(
        f"reference_attribution's exact posterior needs a VP scheduler (alphas_cumprod: DDIM, DDPM, PNDM, Euler) or "
        f"FlowMatchEulerDiscreteScheduler, got {type(scheduler).__name__}; set pipe.scheduler to one"
    )


def _flow_sigma(scheduler, timestep: float) -> float:
    at = (scheduler.timesteps.double().cpu() == timestep).nonzero().flatten().tolist()
    if not at:
        raise ValueError(f"the scheduler's last loop had no timestep {timestep}: call right after the generation")
    return float(scheduler.sigmas[at[0]])


def _support(pipe, references: list, height, width) -> torch.Tensor:
    """The references' latents ``(R, D)`` in float64 as the denoiser takes them: Flux packs ``side x side`` latent
    pixels into a token (``side**2`` its ``in_channels`` over the VAE's channels), row-major as its pipeline does."""
    from ..exact import encode_references
    from ..layers import denoiser_of

    z = encode_references(pipe, references, height, width).double()  # (R, C, H, W)
    side = math.isqrt(denoiser_of(pipe).config.in_channels // z.shape[1])
    if side > 1:
        z = z.unflatten(-1, (-1, side)).unflatten(-3, (-1, side)).permute(0, 2, 4, 1, 3, 5)  # (R, H/s, W/s, C, s, s)
    return z.flatten(1)


def reference_attribution(
    pipe, *, steps=None, seed: int = 0, adapter: int = 0, per_head: bool = True, **call: Any
) -> ReferenceAttribution:
    """Generate once (seeded) and return each reference's attention share and exact posterior weight per step.

    Args:
        pipe: an SD 1.5 / SDXL (VP scheduler: DDIM, DDPM, PNDM, ...) or Flux / SD3 pipeline with an IP-Adapter.
        steps: the steps to record, as :func:`~ipa_probe.probe` takes them (loop indices, Timesteps or a predicate).
        seed: the generator's seed.
        adapter: the IP-Adapter whose references are compared.
        per_head: also keep the attention's shares per head (:meth:`~ipa_probe.capture.maps.MapAccumulator.keep_heads`:
            H times the maps' attention memory, checked against the probe's ``max_map_bytes`` before step 0).
        **call: the pipeline's arguments, with ``ip_adapter_image=[[...]]`` (the references) and one prompt;
            without ``generator`` / ``output_type``.

    Returns:
        a :class:`ReferenceAttribution` (columns: docs/attribution.md, "The observational comparison");
        ``attention_share`` sums to 1 over references unless an edit it runs inside left the weights unnormalised
        (docs/api.md; NaN on SD3 where an edit left a query no image mass, ``ip_mass`` 0: no share is defined).
    """
    from ..capture.run import probe
    from ..capture.spine import attach, client, detach
    from ..intervention.effect import generate

    _schedule(pipe)  # first: a scheduler it has no posterior for, before any argument's
    check_seed(seed)
    check_int(adapter, "adapter", 0)
    references = _references(call, adapter)
    check_flag(per_head, "per_head")
    if per_head and (call.get("cross_attention_kwargs") or {}).get("ip_adapter_masks") is not None:
        raise ValueError("reference_attribution(per_head=True) does not support ip_adapter_masks: pass per_head=False")
    selection = parse_step_selection(steps)
    planned = call.get("num_inference_steps")
    if isinstance(planned, int) and not isinstance(planned, bool):  # the loop runs at most that many steps
        check_steps_ran(selection, planned)
    passes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (timestep, denoiser input) of every pass, on its device

    def keep_input(spine, args, kwargs):
        # a client of the attachment core (its clock's timestep, its tap's sample), not a denoiser hook of its own;
        # the timestep as the probe stores it (first element, float32), so that the steps match exactly
        timestep = torch.as_tensor(spine.now.timestep).reshape(-1)[0].float()
        passes.append((timestep, spine.tap.sample(args, kwargs).detach().clone()))

    keeper = client(on_pass=keep_input)
    attach(pipe, keeper)
    try:
        with probe(pipe, steps=selection, maps=True) as run:
            if per_head:
                run.keep_head_maps()  # before its first pass
            generation = generate(pipe, seed=seed, **call)
    finally:
        detach(pipe, keeper)
    weights = run.reference_weights(adapter=adapter, branch="cond")
    timesteps = run.map_timesteps(0)
    stamps = torch.stack([t for t, _ in passes]).double().cpu().tolist() if passes else []  # one transfer
    if selection is not None and not weights:  # the selection missed every step the call had
        raise ValueError(f"steps: {steps!r} selects no step this call had; pass indices it runs, or widen it")
    samples = {}
    for step in sorted({step for step, _ in weights}):
        # x_t: the first pass at the probe's timestep of that step, at the batch row the probe labelled the first
        # conditional item (the row whose attention reference_weights reads), in float64 on the host
        sample = next((x for stamp, (_, x) in zip(stamps, passes, strict=True) if stamp == timesteps[step]), None)
        if sample is None:
            raise ValueError(f"no denoiser pass had the timestep {timesteps[step]} of step {step}")
        samples[step] = sample[run.map_items(0, step, "cond", adapter)[0]].double().flatten().cpu()  # (D,)
    names, nan = [layer.name for layer in run.layers], torch.tensor(math.nan, dtype=torch.float64)
    contributions = run.contributions(0, 0, adapter, "cond")
    rows, cells = [], {"positions": [], "heads": [], "head_positions": []}
    for (step, layer), w in weights.items():  # w: (Q, R)
        c = contributions.get((step, names.index(layer)), nan.expand(3, *w.shape))  # (3, Q, R)
        key, neff = (step, float(timesteps[step]), layer), float((1.0 / (w**2).sum(-1)).mean())  # position_neff
        cells["positions"] += _cells(key, w, c)
        rows += [(*row, neff) for row in _cells(key, w.mean(0, keepdim=True), c.mean(1, keepdim=True))]
    if per_head:
        head_contributions = run.contributions(0, 0, adapter, "cond", heads=True)
        for (step, index), w in run.head_shares(0, 0, adapter, "cond").items():  # w: (H, Q, R)
            c = head_contributions.get((step, index), nan.expand(3, *w.shape))  # (3, H, Q, R)
            key, finest = (step, float(timesteps[step]), names[index]), w.flatten(0, 1)  # cell = head * Q + position
            cells["heads"] += _cells(key, w.mean(1), c.mean(2))
            cells["head_positions"] += _cells(key, finest, nan.expand(3, *finest.shape))  # no contributions kept
    posterior = posterior_at(pipe, references, samples, timesteps, call.get("height"), call.get("width"))
    table = pd.DataFrame(rows, columns=[*CELL_COLUMNS, "position_neff"]).merge(posterior, how="left")
    table = table[list(ATTRIBUTION_COLUMNS)]
    positions, heads, head_positions = (pd.DataFrame(cells[n], columns=list(CELL_COLUMNS)) for n in cells)
    if len(table) and table["reference"].max() + 1 != len(references):
        raise ValueError(
            f"the maps hold {table['reference'].max() + 1} references for {len(references)} images; "
            "reference_attribution needs the adapter's images as one list with one token group each"
        )
    return ReferenceAttribution(table, generation, run, heads, positions, samples, head_positions)  # field order


def _cells(key: tuple, shares: torch.Tensor, c: torch.Tensor) -> list[tuple]:
    """Rows of :data:`CELL_COLUMNS` after ``key`` (step, timestep, layer): ``shares`` ``(cells, R)``, their
    contributions ``c`` ``(3, cells, R)``."""
    c = c.permute(1, 2, 0).tolist()  # (cells, R, 3)
    return [
        (*key, cell, i, value, *c[cell][i]) for cell, row in enumerate(shares.tolist()) for i, value in enumerate(row)
    ]


def sets_table(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Stack per-set tables with a ``set`` column (0, 1, ...)."""
    return pd.concat([t.assign(set=i) for i, t in enumerate(tables)], ignore_index=True)


def arrays(frame: pd.DataFrame, timestep: float) -> dict[str, np.ndarray]:
    """One timestep of a multi-set table as arrays: ``shares`` ``(S, L, R)``, ``posterior``, ``distance`` ``(S, R)``,
    ``position_neff`` ``(S, L)`` and ``bandwidth`` (a float); sets and layers in sorted order."""
    part = frame[frame["timestep"] == timestep].sort_values(["set", "layer", "reference"])
    sets, layers, refs = part["set"].nunique(), part["layer"].nunique(), part["reference"].nunique()
    if len(part) != sets * layers * refs:
        raise ValueError(
            f"timestep {timestep}: expected every set to have the same {layers} layers and {refs} references, got "
            f"{len(part)} rows for {sets} sets"
        )
    shares = part["attention_share"].to_numpy(np.float64).reshape(sets, layers, refs)
    first = part[part["layer"] == part["layer"].iloc[0]]
    return {
        "shares": shares,
        "posterior": first["posterior_weight"].to_numpy(np.float64).reshape(sets, refs),
        "distance": first["sq_distance"].to_numpy(np.float64).reshape(sets, refs),
        "position_neff": part["position_neff"].to_numpy(np.float64).reshape(sets, layers, refs)[..., 0],
        "bandwidth": float(first["bandwidth"].iloc[0]),
    }
