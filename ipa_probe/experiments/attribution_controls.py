"""The attribution experiment's controls (#29.3): references the generation never saw, mixed against same-digit sets,
the verdict at every resolution against its control, shuffled reference order, and mixed-reference following."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweep.aggregation import MIN_SETS
from .attribution_setup import (
    GUIDANCE_SCALE,
    NUM_STEPS,
    POPULATIONS,
    RESOLUTIONS,
    SHUFFLE_LATENT_RTOL,
    SHUFFLE_SHARE_ATOL,
    _call,
    observe,
)
from .report import Row

__all__ = [
    "control_rows",
    "control_sets",
    "controls",
    "mixed_following",
    "observed_checks",
    "resolution_verdicts",
    "set_statistics",
    "shuffle_check",
    "unseen_references",
]


def control_sets(count: int) -> dict[str, list[tuple[list[int], list]]]:
    """The two control populations, ``count`` sets each: four held-out images of one digit (``"same digit"``) and
    one image each of four different digits (``"4 digits"``), as ``(digits, images)``."""
    from ..tiny.digits import digits_reference_images

    same, mixed = [], []
    for i in range(count):
        digit = i % 10
        same.append(([digit] * 4, digits_reference_images(digit, 4, seed=300 + i)))
        digits = [(i + 3 * k) % 10 for k in range(4)]  # 3 is prime to 10: four different digits
        mixed.append((digits, [digits_reference_images(d, 1, seed=400 + i)[0] for d in digits]))
    return {"same digit": same, "4 digits": mixed}


def unseen_references(digits: list[int], refs: list, seed: int) -> list:
    """Other held-out images of the same digits, one per reference and in its place, none equal to a reference of
    the set (compared pixel for pixel) and none repeated: references the generation never saw."""
    from ..tiny.digits import digits_reference_images

    taken = {np.asarray(image).tobytes() for image in refs}
    out = []
    for i, digit in enumerate(digits):
        pool = digits_reference_images(digit, len(_pool(digit)), seed=seed * 10 + i)  # the whole pool, shuffled
        image = next(image for image in pool if np.asarray(image).tobytes() not in taken)
        taken.add(np.asarray(image).tobytes())
        out.append(image)
    return out


def _pool(digit: int) -> np.ndarray:
    from ..tiny.digits.data import TRAIN_SIZE, digit_images

    _, labels = digit_images()
    return np.flatnonzero(labels[TRAIN_SIZE:] == digit)


def set_statistics(result, unseen: pd.DataFrame) -> pd.DataFrame:
    """One set's statistics per recorded timestep, with their unseen-reference controls.

    Args:
        result: the set's :class:`~ipa_probe.attribution.ReferenceAttribution`.
        unseen: :func:`~ipa_probe.attribution.posterior_at` of its unseen references at its ``x_t``.

    Returns:
        one row per timestep: ``references``, ``attention_tv`` (mean over layers of the TV of ``A[l]`` from uniform),
        ``share_spearman`` (Spearman of the layer-mean shares with ``-d``), ``posterior_neff``, the same two against
        the unseen references (``share_spearman_unseen``, ``posterior_neff_unseen``: the attention's shares paired
        with the unseen reference in the same place), and ``head_tv_above`` / ``position_tv_above`` /
        ``head_position_tv_above``, the share of (layer, head) / (layer, position) / (layer, head, position) cells
        whose TV from uniform exceeds ``POOLING_TV``.
    """
    from scipy import stats

    from ..attribution import POOLING_TV, neff, tv_from_uniform

    rows = []
    finest = getattr(result, "head_positions", None)
    for timestep, part in result.table.groupby("timestep"):
        shares = part.pivot(index="layer", columns="reference", values="attention_share").to_numpy(np.float64)
        first = part[part["layer"] == part["layer"].iloc[0]].sort_values("reference")
        other = unseen[unseen["timestep"] == timestep].sort_values("reference")
        mean = shares.mean(0)  # (R,) layer mean

        def spearman(distance, mean=mean):
            return float(stats.spearmanr(mean, -np.asarray(distance)).statistic)

        def above(cells, timestep=timestep):
            part = cells[cells["timestep"] == timestep]
            values = part.pivot_table(index=["layer", "cell"], columns="reference", values="attention_share")
            return float((tv_from_uniform(values.to_numpy(np.float64)) > POOLING_TV).mean())

        rows.append(
            {"timestep": float(timestep), "references": shares.shape[1],
             "attention_tv": float(tv_from_uniform(shares).mean()),
             "share_spearman": spearman(first["sq_distance"]), "share_spearman_unseen": spearman(other["sq_distance"]),
             "posterior_neff": float(neff(first["posterior_weight"].to_numpy())),
             "posterior_neff_unseen": float(neff(other["posterior_weight"].to_numpy())),
             "head_tv_above": above(result.heads) if len(result.heads) else np.nan,
             "position_tv_above": above(result.positions),
             "head_position_tv_above": above(finest) if finest is not None and len(finest) else np.nan}
        )  # fmt: skip
    return pd.DataFrame(rows)


def resolution_verdicts(results: list, outer: int, seed: int = 0) -> pd.DataFrame:
    """The verdict's rule at every resolution for one population of sets.

    Args:
        results: the sets' :class:`~ipa_probe.attribution.ReferenceAttribution`.
        outer: :func:`~ipa_probe.attribution.verdict_shares`' bootstrap resamples of the sets for the bounds.
        seed: the generator's seed.

    Returns:
        one row per (timestep, resolution): ``cells`` and, for each verdict, the share of cells
        (``pooling``, ``tracks_posterior``, ``undecided``, each with ``_low``, ``_high``); at ``"average"`` one cell,
        decided by :func:`~ipa_probe.attribution.summarize_attribution` (intervals NaN).
    """
    from ..attribution import VERDICTS, sets_table, summarize_attribution, summarize_cells

    table = sets_table([r.table for r in results])
    summary = summarize_attribution(table, permutations=999, resamples=199, seed=seed)
    average = []
    for row in summary.to_dict(orient="records"):
        entry = {"timestep": row["timestep"], "cells": 1}
        for v in VERDICTS:
            key = v.replace(" ", "_")
            entry.update({key: float(row["verdict"] == v), f"{key}_low": np.nan, f"{key}_high": np.nan})
        average.append(entry)
    parts = [pd.DataFrame(average).assign(resolution="average")]
    cells = {"layer": None, "layer x head": "heads", "layer x position": "positions",
             "layer x head x position": "head_positions"}  # fmt: skip
    for resolution, name in cells.items():
        tables = None if name is None else [getattr(r, name, None) for r in results]
        if tables is not None and any(t is None for t in tables):
            continue  # a result from before this resolution
        stacked = None if tables is None else sets_table(tables)
        if stacked is not None and not len(stacked):
            continue  # per_head=False
        shares = summarize_cells(table, stacked, outer=outer, seed=seed)
        parts.append(shares.assign(resolution=resolution))
    out = pd.concat(parts, ignore_index=True)
    order = {r: i for i, r in enumerate(RESOLUTIONS)}
    out = out.sort_values(["timestep", "resolution"], key=lambda c: c.map(order) if c.name == "resolution" else -c)
    first = ["timestep", "resolution"]
    return out.reset_index(drop=True)[first + [c for c in out.columns if c not in first]]


def controls(statistics: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every statistic against its control, per population and timestep
    (:func:`~ipa_probe.attribution.control_difference`).

    Args:
        statistics: population -> stacked :func:`set_statistics` with a ``set`` column.

    Returns:
        one row per (population, timestep, statistic, control): ``value``, ``control_value``, ``difference``,
        ``low``, ``high``, ``counts`` (the interval excludes 0).
    """
    from ..attribution import control_difference, value_range

    rows = []

    def add(population, timestep, statistic, control, result):
        rows.append(
            {"population": population, "timestep": float(timestep), "statistic": statistic, "control": control,
             "value": result["value"], "control_value": result["control"],
             **{key: result[key] for key in ("difference", "low", "high", "counts")}}
        )  # fmt: skip

    for population, frame in statistics.items():
        for timestep, part in frame.groupby("timestep"):
            for statistic in ("posterior_neff", "share_spearman"):
                values, control = part[statistic].to_numpy(), part[f"{statistic}_unseen"].to_numpy()
                bounds = value_range(statistic, int(part["references"].max()))
                result = control_difference(values, control, True, bounds)
                add(population, timestep, statistic, "unseen references", result)
    same = statistics.get("same digit")
    for population, frame in statistics.items():
        if population == "same digit" or same is None:
            continue
        for timestep, part in frame.groupby("timestep"):
            base = same[same["timestep"] == timestep]
            refs = int(max(part["references"].max(), base["references"].max()))
            for statistic in ("attention_tv", "share_spearman", "head_tv_above", "position_tv_above",
                              "head_position_tv_above"):  # fmt: skip
                bounds = value_range(statistic, refs)
                result = control_difference(part[statistic], base[statistic], False, bounds)
                add(population, timestep, statistic, "same-digit sets", result)
    return pd.DataFrame(rows).sort_values(
        ["population", "statistic", "control", "timestep"], ascending=[True, True, True, False]
    )


def observed_checks(pipe, observed: dict, shuffled_sets: int, outer: int) -> tuple[pd.DataFrame, ...]:
    """The controls of one organism from its observed generations (no ablation): the verdict at every resolution per
    population, every statistic against its control, and the shuffled-order check on the first ``shuffled_sets``
    2 + 2 sets.

    Args:
        pipe: the organism's pipeline.
        observed: population -> ``[(digits, refs, ReferenceAttribution), ...]`` (set ``i`` generated from seed ``i``).
        shuffled_sets: how many 2 + 2 sets are generated again in another order.
        outer: :func:`resolution_verdicts`' bootstrap resamples.

    Returns:
        ``(verdicts, controls, shuffled)``, as ``verdicts_<label>.csv``, ``controls_<label>.csv`` and
        ``shuffled_<label>.csv``.
    """
    from ..attribution import posterior_at

    statistics, verdicts = {}, []
    for population, members in observed.items():
        per_set = []
        for i, (digits, refs, result) in enumerate(members):
            timesteps = dict(zip(result.table["step"], result.table["timestep"], strict=True))
            unseen = posterior_at(pipe, unseen_references(digits, refs, seed=i), result.samples, timesteps)
            per_set.append(set_statistics(result, unseen).assign(set=i))
        statistics[population] = pd.concat(per_set, ignore_index=True)
        by_resolution = resolution_verdicts([result for *_, result in members], outer)
        verdicts.append(by_resolution.assign(population=population))
    shuffled = [
        shuffle_check(pipe, result, refs, i, _order(i, len(refs)))
        for i, (_, refs, result) in enumerate(observed["2+2 digits"][:shuffled_sets])
    ]
    return pd.concat(verdicts, ignore_index=True), controls(statistics), pd.DataFrame(shuffled)


def shuffle_check(pipe, result, refs: list, seed: int, order: list[int]) -> dict:
    """Generate again with the references in ``order`` (reference ``j`` of the new call is ``refs[order[j]]``) and
    compare: the largest absolute difference of the final latents, and of the shares (average, per head, per
    position) with the new references put back in their old places, at the first recorded step (the same ``x_t``:
    only the token order differs) and over every recorded step (later ``x_t`` carry the loop's float32 drift).

    Every per-reference column (:data:`SHUFFLED_COLUMNS`) is compared the same way (``first_step_<column>_max_diff``,
    ``<column>_max_diff``; the share keeps its older names). The check passes when the final latent agrees to
    :data:`SHUFFLE_LATENT_RTOL` of its largest value and every column at the first step to :data:`SHUFFLE_SHARE_ATOL`
    of its largest absolute value (at least 1); the later steps' differences are reported beside them.
    """
    again = observe(pipe, [refs[i] for i in order], seed)
    before = result.generation.latents.double()
    latent = float((again.generation.latents.double() - before).abs().max())
    scale = float(before.abs().max())
    worst = {c: 0.0 for c in SHUFFLED_COLUMNS}
    first = {c: 0.0 for c in SHUFFLED_COLUMNS}
    size = {c: 0.0 for c in SHUFFLED_COLUMNS}
    for name in ("table", "heads", "positions"):
        old, new = getattr(result, name), getattr(again, name).copy()
        if not len(old):
            continue
        new["reference"] = np.asarray(order)[new["reference"].to_numpy()]  # back to the original numbering
        keys = [k for k in ("step", "layer", "cell", "reference") if k in old.columns]
        merged = old.merge(new, on=keys, suffixes=("", "_shuffled"), validate="one_to_one")
        if len(merged) != len(old):
            raise ValueError(f"shuffled order: the {name} tables do not pair ({len(merged)} of {len(old)} rows)")
        at_first = merged["step"] == merged["step"].min()
        for column in SHUFFLED_COLUMNS:
            if column not in old.columns:
                continue
            diff = (merged[column] - merged[f"{column}_shuffled"]).abs()
            worst[column] = max(worst[column], float(diff.max()))
            first[column] = max(first[column], float(diff[at_first].max()))
            size[column] = max(size[column], float(merged[column].abs().max()))
    out = {"order": list(order), "latent_max_diff": latent, "latent_max_abs": scale}
    out["first_step_share_max_diff"], out["share_max_diff"] = first["attention_share"], worst["attention_share"]
    for column in SHUFFLED_COLUMNS[1:]:
        out[f"first_step_{column}_max_diff"], out[f"{column}_max_diff"] = first[column], worst[column]
    # every per-reference column at the first step within SHUFFLE_SHARE_ATOL of its own scale (at least 1: shares and
    # posterior weights are in [0, 1]; contribution norms carry the layer output's units)
    columns_ok = all(first[c] <= SHUFFLE_SHARE_ATOL * max(1.0, size[c]) for c in SHUFFLED_COLUMNS)
    out["bit_equal"] = latent == 0.0 and all(v == 0.0 for v in worst.values())
    out["within_tolerance"] = latent <= SHUFFLE_LATENT_RTOL * scale and columns_ok
    return out


#: The per-reference columns the shuffled-order control compares (issue #40 point 6: every one, not the share alone).
SHUFFLED_COLUMNS: tuple[str, ...] = (
    "attention_share",
    "contribution_norm",
    "contribution_share",
    "contribution_projection",
    "posterior_weight",
    "sq_distance",
)


def _order(index: int, refs: int) -> list[int]:
    """A seeded permutation of ``refs`` references that moves at least one."""
    order = np.random.default_rng(index).permutation(refs)
    return [int(i) for i in (order if (order != np.arange(refs)).any() else np.roll(order, 1))]


def _share_text(row: dict, key: str) -> str:
    if not np.isfinite(row[f"{key}_low"]):
        return f"{100 * row[key]:.0f}%"
    return f"{100 * row[key]:.0f}% [{100 * row[f'{key}_low']:.0f}, {100 * row[f'{key}_high']:.0f}]"


def control_rows(label: str, check: dict) -> list[Row]:
    """Table rows of one organism's verdicts per resolution, controls and shuffled-order check."""
    rows = []
    verdicts = check["verdicts"]
    for population in POPULATIONS:
        part = verdicts[verdicts["population"] == population]
        if not len(part):
            continue
        for resolution in RESOLUTIONS:
            chosen = part[part["resolution"] == resolution].to_dict(orient="records")
            if not chosen:
                continue
            first, last = chosen[0], chosen[-1]  # noise first
            text = "; ".join(
                f"t={r['timestep']:g}: pooling {_share_text(r, 'pooling')}, "
                f"tracks {_share_text(r, 'tracks_posterior')}"
                for r in (first, last)
            )
            rows.append(Row(
                "verdict per cell (share of cells)",
                f"{label}, {population} sets, {resolution} ({first['cells']} cells)",
                text,
                "—",
                "the rule of ipa_probe.attribution.verdict per cell; [certified, possible] simultaneous 95% "
                "bounds on the true share (max-|t| bootstrap over reference sets; none in records from before "
                f"issue #52); a cell decides with {MIN_SETS} sets or more (else undecided); first and last timestep",
            ))  # fmt: skip
    table = check["controls"]
    for (population, statistic, control), part in table.groupby(["population", "statistic", "control"], sort=False):
        counted = int(part["counts"].sum())
        values = ", ".join(
            f"{r['value']:.3g} vs {r['control_value']:.3g} "
            f"({r['difference']:+.3g} [{r['low']:+.3g}, {r['high']:+.3g}])"
            for r in part.to_dict(orient="records")
        )
        rows.append(Row(
            "statistic against its control",
            f"{label}, {population}: {statistic} vs {control}",
            f"differs at {counted} of {len(part)} timesteps",
            "—",
            f"t = {', '.join(f'{t:g}' for t in part['timestep'])}: {values}",
        ))  # fmt: skip
    shuffled = check["shuffled"]
    if len(shuffled):
        rows.append(Row(
            "shuffled reference order",
            f"{label}, {len(shuffled)} sets",
            f"max |Δ latent| {shuffled['latent_max_diff'].max():.2g} (|latent| up to "
            f"{shuffled['latent_max_abs'].max():.2g}), max |Δ share| at the first step "
            f"{shuffled['first_step_share_max_diff'].max():.2g}, at any step "
            f"{shuffled['share_max_diff'].max():.2g}; "
            f"within tolerance: {'yes' if shuffled['within_tolerance'].all() else 'NO'}"
            f"{'; bit-equal' if shuffled['bit_equal'].all() else ''}",
            "—",
            f"tolerances {SHUFFLE_LATENT_RTOL:g} x max |latent|, {SHUFFLE_SHARE_ATOL:g} (x max(1, |column|)) on "
            "the first step's per-reference columns permuted back: float32 sums in another order (later steps' "
            "x_t carry the loop's drift); first step, every column: "
            + ", ".join(
                f"{c} {shuffled[f'first_step_{c}_max_diff'].max():.2g}"
                for c in SHUFFLED_COLUMNS[1:]
                if f"first_step_{c}_max_diff" in shuffled.columns
            ),
        ))  # fmt: skip
    return rows


def mixed_following(pipe, seeds=(0, 1, 2, 3, 4), samples: int = 2, n_refs: int = 3) -> dict:
    """How often each reference's digit appears in the output, for sets of ``n_refs`` different digits against sets
    of one digit (issue #29 point 5; neither recipe was trained on mixed references).

    Per seed ``s`` and digit ``d``: a one-digit set (``digits_reference_images(d, n_refs, seed=500 + s)``) and a mixed
    set of the digits ``d, d + 3, d + 6, ...`` (mod 10; one held-out image each, ``seed=600 + 10 s + j``), each
    generating ``samples`` images from the same seeded latents (``s * 1000 + d``), DDIM 20 steps, CFG 3, judged by
    :func:`~ipa_probe.tiny.digits.classify_digit_images`. Rates per seed, then mean and Student's t 95 % interval
    over seeds (:func:`ipa_probe.tiny.digits.following.interval`).

    Returns:
        ``{"same": {"rate"}, "mixed": {"position_0", ..., "any", "none"}, "settings": ...}``, each an interval dict
        (``mean``, ``low``, ``high``, ``n``, ``values``); ``position_j``: the output is reference ``j``'s digit;
        ``any``: one of the set's digits (chance 0.3 for 3 digits); ``none``: none of them.
    """
    import torch

    from ..tiny.digits import classify_digit_images, digits_reference_images
    from ..tiny.digits.following import interval

    per_seed: dict[str, list[float]] = {"same": [], "any": [], "none": []}
    per_seed.update({f"position_{j}": [] for j in range(n_refs)})
    labels_out = []
    for seed in seeds:
        same_hits, positions, any_hits = [], [], []
        for digit in range(10):
            mixed_digits = [(digit + 3 * j) % 10 for j in range(n_refs)]
            sets = {"same": digits_reference_images(digit, n_refs, seed=500 + seed),
                    "mixed": [digits_reference_images(d, 1, seed=600 + 10 * seed + j)[0]
                              for j, d in enumerate(mixed_digits)]}  # fmt: skip
            for kind, refs in sets.items():
                out = pipe(
                    **{**_call(refs), "num_images_per_prompt": samples},
                    generator=torch.Generator().manual_seed(seed * 1000 + digit),
                    output_type="np",
                )
                labels, _ = classify_digit_images(out.images)
                labels_out.append({"seed": seed, "digit": digit, "kind": kind, "labels": labels.tolist()})
                if kind == "same":
                    same_hits.extend((labels == digit).tolist())
                else:
                    positions.append(labels[:, None] == np.asarray(mixed_digits)[None])  # (samples, n_refs)
                    any_hits.extend(np.isin(labels, mixed_digits).tolist())
        per_seed["same"].append(float(np.mean(same_hits)))
        hits = np.concatenate(positions)  # (10 * samples, n_refs)
        for j in range(n_refs):
            per_seed[f"position_{j}"].append(float(hits[:, j].mean()))
        per_seed["any"].append(float(np.mean(any_hits)))
        per_seed["none"].append(1.0 - float(np.mean(any_hits)))
    bounds = (0.0, 1.0)
    return {
        "same": {"rate": interval(per_seed["same"], bounds=bounds)},
        "mixed": {key: interval(values, bounds=bounds) for key, values in per_seed.items() if key != "same"},
        "labels": labels_out,
        "settings": {
            "seeds": list(seeds),
            "samples": samples,
            "n_refs": n_refs,
            "num_inference_steps": NUM_STEPS,
            "guidance_scale": GUIDANCE_SCALE,
        },  # fmt: skip
    }
