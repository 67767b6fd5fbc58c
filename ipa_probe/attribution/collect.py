"""Collect, in one seeded generation, each reference's share of the image-branch attention and its exact posterior.

For every recorded step ``t`` (loop index) and IP-Adapter layer ``l`` of the conditional branch: the attention share
of each reference (the probe's per-reference maps, :meth:`ipa_probe.ProbeRun.reference_weights`, averaged over the
layer's positions and heads) and the posterior over the reference latents at the same ``x_t`` in the exact denoiser's
form (:class:`ipa_probe.exact.ExactNWDenoiser`, paper §C.5: ``w_i = softmax_i(-|x_t / alpha_t - s_i|^2 / (2 h_t^2))``,
``h_t = sigma_t / alpha_t``, float64), with the squared distances the temperature fit of :mod:`.analysis` needs. Each
column: docs/attribution.md ("The observational comparison"). Attention weights do not depend on the q/k gauge and
the posterior is made from latents only, so every column here is gauge invariant.
"""

from __future__ import annotations

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

#: The contribution columns (see :meth:`ipa_probe.capture.maps.MapAccumulator.contribution_weights`): per reference
#: ``j``, its contribution ``c_j(q) = s W_o sum_{i in j} w_i(q) v_i`` to the layer's output after ``to_out``: the norm
#: ``|c_j|``, the norm's share ``|c_j| / sum_k |c_k|`` and the projection ``c_j . c / |c|`` onto the branch's total
#: ``c``, each averaged over query positions (per head in :attr:`ReferenceAttribution.heads`: ``c_{j,h}``, the share
#: over the references and heads of a position).
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
        generation: the call's :class:`~ipa_probe.intervention.Generation` (the probe reads without changing anything,
            so it is the plain pipeline's output for that seed).
        run: the finished :class:`~ipa_probe.ProbeRun` (matched bandwidth, ``maps=True``): its ``to_dataframe()`` is
            the probe's table of the same generation.
        heads: per (step, layer, head, reference) the head's attention share (mean over query positions),
            columns :data:`CELL_COLUMNS` with ``cell`` the head; empty when ``per_head=False``.
        positions: per (step, layer, query position, reference) the share averaged over heads, columns
            :data:`CELL_COLUMNS` with ``cell`` the position.
        head_positions: per (step, layer, head, query position, reference) the one head's share at that position,
            columns :data:`CELL_COLUMNS` with ``cell = head * Q + position`` (the contribution columns NaN: not
            kept at this resolution); empty when ``per_head=False``. The finest resolution the verdict's TV rule is
            applied at.
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
    pipe, references: list, samples: dict[int, torch.Tensor], timesteps: dict[int, float]
) -> pd.DataFrame:
    """The exact posterior over ``references`` at given noisy latents: for the controls, references the generation
    never saw evaluated at the ``x_t`` it passed through.

    ``pipe``'s VAE encodes the references, its scheduler gives ``alpha_t``, ``h_t``; ``samples``: step -> ``x_t``
    (flattened; :attr:`ReferenceAttribution.samples`). One row per (step, reference): ``step``, ``timestep``,
    ``reference``, ``sq_distance``, ``bandwidth``, ``posterior_weight`` (as in :data:`ATTRIBUTION_COLUMNS`).
    """
    from ..exact import encode_references

    schedule = _schedule(pipe)
    support = encode_references(pipe, references).double().flatten(1)  # (R, D)
    rows = []
    for step in sorted(samples):
        distance, h, weight = _posterior(schedule, support, samples[step].double().cpu(), timesteps[step])
        rows.extend(
            (step, float(timesteps[step]), i, float(distance[i]), h, float(weight[i])) for i in range(len(weight))
        )
    columns = ["step", "timestep", "reference", "sq_distance", "bandwidth", "posterior_weight"]
    return pd.DataFrame(rows, columns=columns)


def _schedule(pipe):
    """The VP schedule the exact posterior is written in; flow matching (Flux, SD3) refused, naming why."""
    from ..theory.schedules import VPSchedule

    if hasattr(pipe.scheduler, "alphas_cumprod"):
        return VPSchedule.from_scheduler(pipe.scheduler)
    raise TypeError(
        f"reference_attribution's exact posterior needs a VP scheduler (DDIM, DDPM, PNDM: SD 1.5, SDXL), got "
        f"{type(pipe.scheduler).__name__}; on Flux and SD3 read shares with probe(pipe, maps=True).reference_mass()"
    )


def _posterior(schedule, support: torch.Tensor, x: torch.Tensor, timestep: float):
    """``(|x / alpha_t - s_i|^2 (R,), h_t, w_i (R,))`` in float64 for one flattened ``x`` (D,)."""
    coefficients = schedule(int(round(timestep)))
    alpha, h = float(coefficients.alpha_t), float(coefficients.h)
    distance = ((x / alpha - support) ** 2).sum(-1)  # (R,) |x_t / alpha_t - s_i|^2
    return distance, h, torch.softmax(-distance / (2 * h * h), -1)


def reference_attribution(
    pipe, *, steps=None, seed: int = 0, adapter: int = 0, per_head: bool = True, **call: Any
) -> ReferenceAttribution:
    """Generate once (seeded) and return each reference's attention share and exact posterior weight per step.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter, on a scheduler with integer timesteps (DDIM, DDPM,
            PNDM, ...); Flux and SD3 (flow matching) are refused with a ``TypeError``: the probe reads their shares.
        steps: loop indices to record (ints or a ``slice``); ``None`` for all.
        seed: the generator's seed.
        adapter: the IP-Adapter whose references are compared.
        per_head: also keep the attention's shares per head (:meth:`~ipa_probe.capture.maps.MapAccumulator.keep_heads`:
            H times the maps' attention memory, checked against the probe's ``max_map_bytes`` before step 0).
        **call: the pipeline's arguments, with ``ip_adapter_image=[[...]]`` (the references) and one prompt;
            without ``generator`` / ``output_type``.

    Returns:
        a :class:`ReferenceAttribution`: one row per (recorded step, layer, reference), columns as tabled in
        docs/attribution.md ("The observational comparison"), and the per-head and per-position tables
        (:attr:`ReferenceAttribution.heads`, :attr:`ReferenceAttribution.positions`); ``attention_share`` sums to 1
        over references unless an edit it runs inside left the weights unnormalised (docs/api.md).
    """
    from ..capture.run import probe
    from ..capture.spine import attach, client, detach
    from ..exact import encode_references
    from ..intervention.effect import generate

    schedule = _schedule(pipe)  # first: on Flux and SD3 the reason, before any argument's
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
    support = encode_references(pipe, references).double().flatten(1)  # (R, D)
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
        raise ValueError(f"steps: {steps!r} selects no loop index this call had; pass indices it runs")
    posterior, samples = {}, {}
    for step in sorted({step for step, _ in weights}):
        # x_t: the first pass at the probe's timestep of that step, at the batch row the probe labelled the first
        # conditional item (the row whose attention reference_weights reads), in float64 on the host
        sample = next((x for stamp, (_, x) in zip(stamps, passes, strict=True) if stamp == timesteps[step]), None)
        if sample is None:
            raise ValueError(f"no denoiser pass had the timestep {timesteps[step]} of step {step}")
        x = sample[run.map_rows(0, step, "cond", adapter)[0]].double().flatten().cpu()  # (D,)
        samples[step] = x
        posterior[step] = _posterior(schedule, support, x, timesteps[step])
    names = [layer.name for layer in run.layers]
    contributions = run.contributions(0, 0, adapter, "cond")
    missing = torch.full((3, 1, len(references)), float("nan"), dtype=torch.float64)
    rows, position_rows = [], []
    for (step, layer), w in weights.items():  # w: (Q, R)
        t = float(timesteps[step])
        c = contributions.get((step, names.index(layer)), missing.expand(3, *w.shape))  # (3, Q, R)
        position_rows.extend(
            (step, t, layer, p, i, value, *c[:, p, i].tolist())
            for p, row in enumerate(w.tolist())
            for i, value in enumerate(row)
        )
        share = w.mean(0)  # (R,)
        mean_c = c.mean(1)  # (3, R) over query positions
        position_neff = float((1.0 / (w**2).sum(-1)).mean())
        distance, h, weight = posterior[step]
        for i in range(w.shape[1]):
            rows.append(
                (step, float(timesteps[step]), layer, i, float(share[i]), position_neff)
                + (float(distance[i]), h, float(weight[i]))
                + tuple(mean_c[:, i].tolist())
            )
    table = pd.DataFrame(rows, columns=list(ATTRIBUTION_COLUMNS))
    positions = pd.DataFrame(position_rows, columns=list(CELL_COLUMNS))
    head_rows, head_position_rows = [], []
    if per_head:
        per_head_weights = run.head_shares(0, 0, adapter, "cond")
        head_contributions = run.contributions(0, 0, adapter, "cond", heads=True)
        for (step, index), w in per_head_weights.items():  # w: (H, Q, R)
            share = w.mean(1)  # (H, R) mean over query positions
            c = head_contributions.get((step, index), missing[:, None].expand(3, *w.shape)).mean(2)  # (3, H, R)
            head_rows.extend(
                (step, float(timesteps[step]), names[index], head, i, value, *c[:, head, i].tolist())
                for head, row in enumerate(share.tolist())
                for i, value in enumerate(row)
            )
            head_position_rows.extend(
                (step, float(timesteps[step]), names[index], cell, i, value, np.nan, np.nan, np.nan)
                for cell, row in enumerate(w.flatten(0, 1).tolist())  # (H * Q, R): cell = head * Q + position
                for i, value in enumerate(row)
            )
    heads = pd.DataFrame(head_rows, columns=list(CELL_COLUMNS))
    head_positions = pd.DataFrame(head_position_rows, columns=list(CELL_COLUMNS))
    if len(table) and table["reference"].max() + 1 != len(references):
        raise ValueError(
            f"the maps hold {table['reference'].max() + 1} references for {len(references)} images; "
            "reference_attribution needs the adapter's images as one list with one token group each"
        )
    return ReferenceAttribution(table, generation, run, heads, positions, samples, head_positions)  # field order


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
