"""The tables a probe's maps give (:meth:`~ipa_probe.ProbeRun.map_table`, :meth:`~ipa_probe.ProbeRun.reference_mass`):
read from a finished :class:`~ipa_probe.capture.maps.MapAccumulator`, on the host, apart from the recording."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from .maps import MAP_TABLE_COLUMNS, REFERENCE_MASS_COLUMNS, MapAccumulator, _reference_shares, with_share

__all__ = ["map_statistics", "reference_mass"]


def _chunks(accumulator: MapAccumulator, calls: list[dict[str, Any]], names: list[str]):
    """Every recorded (call, step, layer, adapter, branch) with its :func:`_reference_shares`: yields
    ``((call, step, timestep, layer name, adapter, branch), shares, covered, references, contributions)``, the last
    :meth:`MapAccumulator.contribution_chunk` (``(2, I, Q, R)`` or ``None``)."""
    by_index = {call["index"]: call for call in calls}
    for key in sorted(accumulator.store):
        call, step, index, adapter = key
        info = by_index[call]
        timestep = float(info["timesteps"][step]) if step < len(info["timesteps"]) else math.nan
        for label in sorted({label for labels, _ in accumulator.store[key] for label in labels.tolist()}):
            refs, covered, count = _reference_shares(accumulator, key, label)
            where = (call, step, timestep, names[index], adapter, info["branches"][label])
            yield where, refs, covered, count, accumulator.contribution_chunk(key, label)


def _covered_mean(values: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    """``(k, I, Q, R)`` -> ``(k, R)``: the mean over each item's covered positions, then over the items with any."""
    positions = covered.sum(-1)  # (I,)
    return ((values * covered[..., None]).sum(-2) / positions.clamp(min=1)[:, None])[:, positions > 0].mean(1)


def reference_mass(accumulator: MapAccumulator, calls: list[dict[str, Any]], names: list[str]) -> pd.DataFrame:
    """The share of each reference image in the image branch's weight, per (call, step, layer, adapter, branch).

    For every query position the attention (and NW) weight on a reference's tokens, averaged over heads (normalised
    over the adapter's references under masks; inside an edit, the weights the layer used, as they are), then
    averaged over the covered positions of each batch item and over the items of the branch. The attention's shares
    depend on the attention weights only, so no reparametrisation of the queries and keys moves them (see
    :func:`ipa_probe.gauge_sweep`). Beside them, each reference's contribution to the layer output after ``to_out``
    (norm, share of the norms, projection onto the total), averaged the same way over heads' sum, positions and
    items: what the values carry, which the weights alone do not show; invariant under the q/k group and under a
    per-head basis change of the values (``W_v -> B W_v``, ``W_o -> W_o B^-1``).

    Returns:
        a DataFrame with :data:`REFERENCE_MASS_COLUMNS`, one row per reference.
    """
    rows = []
    for where, refs, covered, count, contributions in _chunks(accumulator, calls, names):
        kept = torch.full((3, count), math.nan, dtype=torch.float64)
        if contributions is not None and contributions.shape[1:] == refs.shape[1:]:
            kept = _covered_mean(with_share(contributions), covered)  # (3, R): norm, share, projection
        shares = _covered_mean(refs, covered)  # (2, R)
        for reference in range(count):
            contribution = tuple(float(kept[k, reference]) for k in range(3))
            rows.append((*where, reference, float(shares[0, reference]), float(shares[1, reference]), *contribution))
    table = pd.DataFrame(rows, columns=list(REFERENCE_MASS_COLUMNS))
    table["layer"] = pd.Categorical(table["layer"], categories=names)
    return table


def map_statistics(accumulator: MapAccumulator, calls: list[dict[str, Any]], names: list[str]) -> pd.DataFrame:
    """The per (call, step, layer, adapter, branch, item) agreement of the attention and NW reference shares of a
    finished accumulator (``calls``: the run's finished calls; ``names``: its layer names): :data:`MAP_TABLE_COLUMNS`.
    """
    rows = []
    for where, refs, covered, count, _ in _chunks(accumulator, calls, names):
        agree = (refs[0].argmax(-1) == refs[1].argmax(-1)) & covered
        tv = 0.5 * (refs[0] - refs[1]).abs().sum(-1) * covered
        positions = covered.sum(-1)  # (I,)
        agree_frac = agree.sum(-1) / positions.clamp(min=1)
        tv_mean = tv.sum(-1) / positions.clamp(min=1)
        for item in range(refs.shape[1]):
            if positions[item] == 0:
                continue
            rows.append((*where, item, count, int(positions[item]), float(agree_frac[item]), float(tv_mean[item])))
    table = pd.DataFrame(rows, columns=list(MAP_TABLE_COLUMNS))
    table["layer"] = pd.Categorical(table["layer"], categories=names)
    return table
