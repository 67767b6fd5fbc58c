"""The headline against a matched control, and the query pool measured (issue #40 points 1 and 3).

**Matched control.** The untrained twin is no fair control for the query-frame rho (its attention is near uniform and
its logit ratio ``r`` above the trained adapter's, while rho tracks ``r``): :func:`matched_twin` scales the twin's
``to_k_ip`` per layer by the factor of :data:`SCALE_GRID` whose mean query-frame ``r`` comes closest to the trained
adapter's on calibration sets (seeds from :data:`CALIBRATION_SEED`; the 1 x 1 mid block keeps ``c = 1``), and
:func:`paired_control` compares trained and control set by set (one-sided sign-flip permutation p, Holm over the
table, the decision's one-sided bound). **Query pool.** :func:`query_pool` reads both pools (``"item"``, ``"branch"``)
from one probed generation per set and image count (1, 3, 8; CFG 3) and reports their difference. The design and
numbers: docs/findings.md ("Training and NW-likeness: against a matched control", "The query pool").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = [
    "CALIBRATION_SEED",
    "SCALE_GRID",
    "layer_logit_ratios",
    "matched_twin",
    "paired_control",
    "per_set_means",
    "query_pool",
    "run_controls",
    "scale_key_projection",
]

#: Reference sets and seeds of the calibration start here (the evaluation uses sets and seeds 0, 1, ...).
CALIBRATION_SEED = 10_000

#: The statistics compared set by set: the query-frame rho (exact b) and its excess over its own baseline.
PAIRED_STATISTICS = ("qf_spearman", "qf_rho_excess")


def per_set_means(table: pd.DataFrame, shares: pd.DataFrame | None = None, columns=PAIRED_STATISTICS) -> pd.DataFrame:
    """Per (set, timestep): the NaN-skipping mean over layers and heads of ``columns`` (a 1 x 1 layer's query frame
    has none), how many entries had a value, and with ``shares`` (stacked attribution tables with ``set``) the mean
    over layers of the attention's TV distance from uniform over the references (``attention_tv``: is the control
    degenerate?)."""
    from ..attribution import tv_from_uniform

    grouped = table.groupby(["set", "timestep"])
    out = grouped[list(columns)].mean()  # pandas skips NaN
    out["entries"] = grouped[columns[0]].count()
    out = out.reset_index()
    if shares is not None:
        tv = []
        for (s, timestep), part in shares.groupby(["set", "timestep"]):
            matrix = part.pivot(index="layer", columns="reference", values="attention_share").to_numpy(np.float64)
            tv.append({"set": s, "timestep": float(timestep), "attention_tv": float(tv_from_uniform(matrix).mean())})
        out = out.merge(pd.DataFrame(tv), on=["set", "timestep"], how="left")
    return out


def layer_logit_ratios(pipe, sets: list, steps: list[int]) -> pd.Series:
    """Per IP layer: the mean query-frame logit ratio over heads, recorded steps and ``sets`` (cond branch, image
    kind; NaN for a layer without one, the 1 x 1 mid block)."""
    from .ip_adapter_setup import run_reference_set

    tables = [run_reference_set(pipe, refs, seed=CALIBRATION_SEED + i, steps=steps)[0] for i, refs in enumerate(sets)]
    table = pd.concat(tables, ignore_index=True)
    return table.groupby("layer", sort=False)["qf_logit_ratio"].mean()


def scale_key_projection(pipe, factors: dict[str, float]) -> None:
    """Multiply each named IP layer's ``to_k_ip`` (every adapter's, weight and bias) by its factor, in place: that
    layer's image-branch logits scale by the same factor. For a pipeline this experiment built and owns."""
    import torch

    from ..layers import find_ip_layers

    by_name = {layer.name: layer for layer in find_ip_layers(pipe)}
    unknown = sorted(set(factors) - set(by_name))
    if unknown:
        raise ValueError(f"scale_key_projection: no IP layer named {unknown}; expected some of {sorted(by_name)}")
    with torch.no_grad():
        for name, factor in factors.items():
            for linear in by_name[name].processor.to_k_ip:
                linear.weight.mul_(factor)
                if linear.bias is not None:
                    linear.bias.mul_(factor)


def _key_projections(pipe) -> list:
    """Every IP layer's ``to_k_ip`` weights and biases (the tensors :func:`scale_key_projection` scales)."""
    from ..layers import find_ip_layers

    return [
        tensor
        for layer in find_ip_layers(pipe)
        for linear in layer.processor.to_k_ip
        for tensor in (linear.weight, linear.bias)
        if tensor is not None
    ]


#: The key scales :func:`matched_twin` tries (every layer at once, then each layer takes its closest).
SCALE_GRID: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def matched_twin(trained, make_twin, sets: list, steps: list[int], grid=SCALE_GRID) -> tuple[pd.DataFrame, object]:
    """An untrained twin whose image-key projection is scaled per layer so that its query-frame logit ratio comes
    closest to ``trained``'s.

    The ratio is not linear in the key scale ``c`` (nor always monotone: ``b`` is a log-partition over the queries,
    and both spreads scale with ``c`` at small ``c``), so ``c`` is searched, not solved for: every layer scaled by
    each ``c`` of ``grid`` at once, then each layer takes the ``c`` whose ratio was closest to the trained one; the
    twin so scaled is measured again (the layers feed each other, so the achieved ratios are reported, not assumed).

    Args:
        trained: the trained organism's pipeline (read only).
        make_twin: a function returning a fresh untrained pipeline of the same architecture.
        sets: calibration reference sets (lists of images).
        steps: the recorded step indices.
        grid: the key scales tried.

    Returns:
        ``(calibration, twin)``: per layer ``layer``, ``trained_ratio``, ``untrained_ratio`` (c = 1),
        ``matched_ratio`` (the scaled twin, measured), ``factor`` (its ``c_l``; 1 where no ratio exists, the 1 x 1
        mid block); and the scaled twin.
    """
    from ..layers import find_ip_layers

    target = layer_logit_ratios(trained, sets, steps)
    tried = {}
    for c in grid:
        twin = make_twin()
        scale_key_projection(twin, {layer.name: c for layer in find_ip_layers(twin)})
        tried[c] = layer_logit_ratios(twin, sets, steps).reindex(target.index)
    table = pd.DataFrame(tried)  # (layers, grid)
    gap = (table.sub(target, axis=0)).abs()
    factors = {
        name: (float(gap.loc[name].idxmin()) if np.isfinite(gap.loc[name]).any() else 1.0) for name in target.index
    }
    twin = make_twin()
    scale_key_projection(twin, factors)
    achieved = layer_logit_ratios(twin, sets, steps).reindex(target.index)
    calibration = pd.DataFrame(
        {
            "layer": target.index,
            "trained_ratio": target.to_numpy(),
            "untrained_ratio": table[1.0].to_numpy() if 1.0 in table else np.nan,
            "matched_ratio": achieved.to_numpy(),
            "factor": [factors[name] for name in target.index],
        }
    )
    return calibration, twin


def paired_control(per_set: dict[str, pd.DataFrame], controls=("untrained", "matched"), seed: int = 0) -> pd.DataFrame:
    """Trained against each control, set by set (module docstring).

    Args:
        per_set: ``"trained"`` and each control -> :func:`per_set_means` of the same sets and seeds.
        controls: the controls to compare with.
        seed: the bootstrap's and the permutation test's seed.

    Returns:
        one row per (control, statistic, timestep), noise first: ``trained``, ``control_value``, ``difference``
        (mean over sets of trained - control), ``p`` (one-sided: trained below control; sign-flip permutation, 9999
        draws), ``sets``, ``p_holm`` (over the table) and the decision's interval ``[low, high]`` = ``(-inf, U]``,
        ``U`` the Holm-compatible one-sided upper bound (:func:`ipa_probe.attribution.holm_lower_bounds` of the
        negated differences: below 0 exactly where ``p_holm < ALPHA``).
    """
    from scipy import stats

    from ..attribution import holm, holm_lower_bounds

    trained = per_set["trained"]
    rows, differences = [], []
    for control in controls:
        if control not in per_set:
            continue
        merged = trained.merge(per_set[control], on=["set", "timestep"], suffixes=("", "_control"))
        for statistic in PAIRED_STATISTICS:
            for timestep, part in sorted(merged.groupby("timestep"), key=lambda item: -item[0]):
                difference = (part[statistic] - part[f"{statistic}_control"]).to_numpy(np.float64)
                difference = difference[np.isfinite(difference)]
                differences.append(difference)
                p = math.nan
                if difference.size >= 2:
                    test = stats.permutation_test(
                        (difference,), np.mean, permutation_type="samples", alternative="less",
                        n_resamples=9999, random_state=seed,
                    )  # fmt: skip
                    p = float(test.pvalue)
                rows.append(
                    {
                        "control": control,
                        "statistic": statistic,
                        "timestep": float(timestep),
                        "trained": float(part[statistic].mean()),
                        "control_value": float(part[f"{statistic}_control"].mean()),
                        "difference": float(difference.mean()) if difference.size else math.nan,
                        "p": p,
                        "sets": int(difference.size),
                    }
                )
    out = pd.DataFrame(rows)
    out["p_holm"] = holm(out["p"].to_numpy(np.float64)) if len(out) else []
    if len(out):  # the decision's interval: one-sided (trained below), Holm-compatible over the table
        out["high"] = -holm_lower_bounds([-d for d in differences], out["p_holm"].to_numpy(np.float64))
        out["low"] = -np.inf
    return out


def query_pool(
    pipes: dict, sets: list, steps: list[int], counts=(1, 3, 8), guidance_scale: float = 3.0, runs: str = "one"
):
    """Both query pools on the same generations (module docstring).

    Args:
        pipes: organism name -> trained pipeline.
        sets: reference sets (lists of images); set ``i`` generates from seed ``i``.
        steps: recorded step indices (of the 50-step schedule).
        counts: ``num_images_per_prompt`` values.
        guidance_scale: CFG scale (above 1: both branches).
        runs: ``"one"``: one item-pool run per generation, the branch pool from its ``qf_spearman_other_pool``;
            ``"both"``: a run per pool (twice the generations).

    Returns:
        ``(summary, cells)``: per (organism, images, CFG branch, timestep) ``item``, ``branch_pool`` (mean query-frame
        rho in each pool over the cells that have one in both, over sets, layers and heads), ``branch_only_cells``
        (cells with a rho only when the branch is pooled: a 1 x 1 layer's frame gains queries), ``difference`` (mean
        per-set branch - item), ``se`` (its standard error over sets), ``max_cell_difference`` (largest
        |difference| of one cell), ``sets``; and the per-cell differences.
    """
    import torch

    if runs not in ("one", "both"):
        raise ValueError(f"runs: expected 'one' or 'both', got {runs!r}")
    from ..capture.run import probe
    from ..tiny.digits import DIGITS_PROMPT
    from .ip_adapter_setup import NUM_STEPS

    cells = []
    for organism, pipe in pipes.items():
        for count in counts:
            for i, refs in enumerate(sets):
                frames = []
                for pool in ("item", "branch") if runs == "both" else ("item",):
                    with probe(pipe, steps=steps, query_frame=pool) as run:
                        pipe(
                            prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=NUM_STEPS,
                            guidance_scale=guidance_scale, num_images_per_prompt=count,
                            generator=torch.Generator().manual_seed(i), output_type="latent",
                        )  # fmt: skip
                    table = run.to_dataframe()
                    table = table[table["kind"] == "image"]
                    keys = ["step", "timestep", "layer", "head", "branch"]  # one row each (items pooled per cell)
                    frames.append(table.set_index(keys)["qf_spearman"].rename(f"pool_{pool}"))
                    if runs != "both":  # the same rows under the branch pool, from the same run
                        frames.append(table.set_index(keys)["qf_spearman_other_pool"].rename("pool_branch"))
                pair = pd.concat(frames, axis=1).reset_index()
                cells.append(pair.assign(organism=organism, images=count, set=i))
    cells = pd.concat(cells, ignore_index=True)
    cells["difference"] = cells["pool_branch"] - cells["pool_item"]
    return _pool_summary(cells), cells


def _pool_summary(cells: pd.DataFrame) -> pd.DataFrame:
    rows = []
    keys = ["organism", "images", "branch", "timestep"]
    for key, part in cells.groupby(keys, sort=False):
        per_set = part.groupby("set")["difference"].mean().to_numpy(np.float64)
        per_set = per_set[np.isfinite(per_set)]
        row = dict(zip(keys, key, strict=True))
        both = part[part["difference"].notna()]  # cells with a rho in both pools
        row.update(
            item=float(both["pool_item"].mean()),
            branch_pool=float(both["pool_branch"].mean()),
            branch_only_cells=int((part["pool_item"].isna() & part["pool_branch"].notna()).sum()),
            difference=float(per_set.mean()) if per_set.size else math.nan,
            se=float(per_set.std(ddof=1) / math.sqrt(per_set.size)) if per_set.size >= 2 else math.nan,
            max_cell_difference=float(part["difference"].abs().max()),
            sets=int(per_set.size),
        )
        rows.append(row)
    return pd.DataFrame(rows)


def run_controls(ctx, pipes: dict, per_set: dict, sets: list, steps: list[int], folder) -> tuple[list, dict]:
    """The ip-adapter experiment's matched control and query pool (module docstring), at the tier's sizes.

    Args:
        ctx: the experiment's context (tier, recipe, progress).
        pipes: ``"trained"``, ``"untrained"`` pipelines.
        per_set: ``"trained"``, ``"untrained"`` -> :func:`per_set_means` of the one-digit sets already generated.
        sets: those sets (lists of images); set ``i`` generated from seed ``i``.
        steps: the recorded step indices.
        folder: where ``matched_control.csv``, ``matched_calibration.csv`` and ``query_pool.csv`` go.

    Returns:
        ``(rows, record)``: table rows and the record's entries.
    """
    import torch

    from .._io import write_table
    from ..tiny.digits import digits_reference_images, untrained_digits_pipeline
    from .ip_adapter_setup import REFS_PER_SET, run_reference_set
    from .report import Row

    tier = ctx.tier

    twin = untrained_digits_pipeline(recipe=ctx.recipe)
    twin.set_progress_bar_config(disable=True)
    keys = _key_projections(twin)
    initial = [tensor.detach().clone() for tensor in keys]

    def make_twin():
        # the one untrained twin with its image-key projections back at their initial weights: the same pipeline a
        # fresh build gives (seeded), without rebuilding it for every key scale tried (most of the calibration's
        # time beside the generations); matched_twin uses each twin before asking for the next
        with torch.no_grad():
            for tensor, value in zip(keys, initial, strict=True):
                tensor.copy_(value)
        return twin

    count = tier.ip_calibration_sets
    calibration_sets = [digits_reference_images(i % 10, REFS_PER_SET, seed=CALIBRATION_SEED + i) for i in range(count)]
    calibration, twin = matched_twin(pipes["trained"], make_twin, calibration_sets, steps)
    tables, shares = [], []
    for i, refs in enumerate(sets):
        table, attributed = run_reference_set(twin, refs, seed=i, steps=steps)
        tables.append(table.assign(set=i))
        shares.append(attributed.assign(set=i))
    per_set = {**per_set, "matched": per_set_means(pd.concat(tables), pd.concat(shares))}
    paired = paired_control(per_set)
    pool, _ = query_pool({ctx.recipe: pipes["trained"]}, sets[: tier.ip_pool_sets], steps)
    for name, frame in (("matched_control", paired), ("matched_calibration", calibration), ("query_pool", pool)):
        write_table(frame, folder / f"{name}.csv")
    rows = []
    tv = {label: frame.groupby("timestep")["attention_tv"].mean() for label, frame in per_set.items()}
    for r in paired.to_dict(orient="records"):
        rows.append(
            Row(
                "trained minus control, paired by set (one-sided: trained below; Holm over the table)",
                f"{r['statistic']} vs {r['control']} twin, t={r['timestep']:g}",
                f"{r['difference']:+.3f} (≤ {r['high']:+.3f}), p {r['p']:.2g} (Holm {r['p_holm']:.2g})",
                "—",
                f"trained {r['trained']:.3f}, control {r['control_value']:.3f}; attention TV from uniform: trained "
                f"{tv['trained'].get(r['timestep'], np.nan):.3f}, control "
                f"{tv[r['control']].get(r['timestep'], np.nan):.3f}; {r['sets']} sets",
            )
        )
    for r in pool.to_dict(orient="records"):
        rows.append(
            Row(
                "query pool: branch minus item (query-frame rho, exact b)",
                f"{r['organism']}, {r['images']} images, {r['branch']}, t={r['timestep']:g}",
                f"{r['difference']:+.4f} (se {r['se']:.4f})",
                "—",
                f"item {r['item']:.3f}, branch {r['branch_pool']:.3f} (cells with both); largest single cell "
                f"{r['max_cell_difference']:.3f}; {r['branch_only_cells']} cells have a ρ only in the branch pool; "
                f"{r['sets']} sets, CFG 3",
            )
        )
    record = {
        "matched_control": {
            "calibration": calibration.to_dict(orient="records"),
            "paired": paired.to_dict(orient="records"),
            "calibration_sets": tier.ip_calibration_sets,
            "scale_grid": list(SCALE_GRID),
            "rule": "per set: trained - control; one-sided sign-flip p (trained below); Holm; one-sided "
            "Holm-compatible upper bound",
        },
        "query_pool": {"summary": pool.to_dict(orient="records"), "sets": tier.ip_pool_sets, "guidance_scale": 3.0},
    }
    return rows, record
