"""The headline against a matched control, and the query pool measured (issue #40 points 1 and 3).

**Matched control.** The untrained twin is no fair control for the query-frame rho (its attention is near uniform and
its logit ratio ``r`` above the trained adapter's, while rho tracks ``r``): :func:`matched_twin` scales the twin's
``to_k_ip`` per layer by the factor of :data:`SCALE_GRID` whose mean query-frame ``r`` comes closest to the trained
adapter's on calibration sets (seeds from :data:`CALIBRATION_SEED`; the 1 x 1 mid block keeps ``c = 1``), and
:func:`paired_control` compares trained and control set by set (:func:`paired_tests`: both one-sided sign-flip
tests, Holm over both and the table, each decision's one-sided bound), each control's mean ``r`` per timestep beside
the trained one. **The control that isolates training.** :func:`init_adapter_control`: the trained organism against
itself with the adapter at its starting weights, compared at equal ``r`` (:func:`equal_r_differences`). **Query
pool.** :func:`query_pool` reads both pools (``"item"``, ``"branch"``) from one probed generation per set and image
count (1, 3, 8; CFG 3) and reports their difference. The design and numbers: docs/findings.md ("Training and
NW-likeness: against a matched control", "The query pool").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = [
    "CALIBRATION_SEED",
    "DIRECTIONS",
    "SCALE_GRID",
    "equal_r_differences",
    "init_adapter_control",
    "layer_logit_ratios",
    "logit_ratios",
    "matched_twin",
    "paired_control",
    "paired_tests",
    "per_set_means",
    "probed",
    "query_pool",
    "run_controls",
    "scale_key_projection",
]

#: Reference sets and seeds of the calibration start here (the evaluation uses sets and seeds 0, 1, ...).
CALIBRATION_SEED = 10_000

#: The statistics compared set by set: the query-frame rho (exact b) and its excess over its own baseline.
PAIRED_STATISTICS = ("qf_spearman", "qf_rho_excess")


def per_set_means(table: pd.DataFrame, shares: pd.DataFrame | None = None, columns=PAIRED_STATISTICS) -> pd.DataFrame:
    """Per (set, timestep): the NaN-skipping mean over layers and heads of ``columns`` and of ``qf_logit_ratio`` (a
    1 x 1 layer's query frame has none), how many entries had a value, and with ``shares`` (stacked attribution
    tables with ``set``) the mean over layers of the attention's TV distance from uniform over the references
    (``attention_tv``: is the control degenerate?)."""
    from ..attribution import tv_from_uniform

    grouped = table.groupby(["set", "timestep"])
    out = grouped[[*columns, "qf_logit_ratio"]].mean()  # pandas skips NaN
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


#: The key scales :func:`matched_twin` tries (every layer at once, then each layer takes its closest).
SCALE_GRID: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def matched_twin(trained, make_twin, sets: list, steps: list[int], grid=SCALE_GRID) -> tuple[pd.DataFrame, object]:
    """An untrained twin (a fresh one from ``make_twin()``) whose image-key projection is scaled per layer so that
    its query-frame logit ratio comes closest to ``trained``'s (read only) on the calibration ``sets`` (of images).

    The ratio is not linear in the key scale ``c`` (nor always monotone: ``b`` is a log-partition over the queries,
    and both spreads scale with ``c`` at small ``c``), so ``c`` is searched, not solved for: every layer scaled by
    each ``c`` of ``grid`` at once, then each layer takes the ``c`` whose ratio was closest to the trained one; the
    twin so scaled is measured again (the layers feed each other, so the achieved ratios are reported, not assumed).

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


#: Both directions of every paired test, fixed before the data: "above" (trained - control > 0: the trained
#: attention more NW-like) and "below"; each one-sided, Holm over both directions and the whole table.
DIRECTIONS = ("above", "below")


def paired_tests(differences: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Both one-sided sign-flip tests (:func:`ipa_probe.attribution.sign_flip_test`, 9999 patterns from ``seed``) of
    the mean per-set difference, per (control, statistic, timestep). ``differences``: one row per set with
    ``control``, ``statistic``, ``timestep`` and ``difference`` (trained - control; NaN left out).

    Returns:
        one row per (control, statistic, timestep), noise first: ``difference`` (mean over sets), ``sets``,
        ``p_above`` / ``p_below``, ``p_holm_above`` / ``p_holm_below`` (Holm over both directions and every row),
        ``[low, high]``: the Holm-compatible bounds of "above" and "below", each test inverted (:func:`ipa_probe.
        attribution.holm_lower_bounds` over the 2 x rows hypotheses; ``low`` >= 0 where "above" is rejected, else <= 0;
        ``high`` mirrored for "below"), and ``decision`` (``"above"``, ``"below"`` or ``"neither"``).
    """
    from ..attribution import ALPHA, holm, holm_lower_bounds, sign_flip_test

    rows, nulls = [], {direction: [] for direction in DIRECTIONS}
    keys = ["control", "statistic", "timestep"]
    pairs = zip(differences["control"], differences["statistic"], strict=True)
    order = {pair: i for i, pair in enumerate(dict.fromkeys(pairs))}  # first seen first, then noise first
    groups = sorted(differences.groupby(keys, sort=False), key=lambda item: (order[item[0][:2]], -item[0][2]))
    for key, part in groups:
        d = part["difference"].to_numpy(np.float64)
        d = d[np.isfinite(d)]
        p = {}
        for direction, sign in zip(DIRECTIONS, (1.0, -1.0), strict=True):
            p[direction], null = sign_flip_test(sign * d, 9999, seed)
            nulls[direction].append(null)
        row = dict(zip(keys, key, strict=True))
        row.update(difference=float(d.mean()) if d.size else math.nan, sets=int(d.size))
        rows.append(row | {f"p_{direction}": p[direction] for direction in DIRECTIONS})
    out = pd.DataFrame(rows)
    m = len(out)
    adjusted = holm(np.concatenate([out["p_above"], out["p_below"]]).astype(np.float64)) if m else np.empty(0)
    out["p_holm_above"], out["p_holm_below"] = adjusted[:m], adjusted[m:]
    bounds = holm_lower_bounds(nulls["above"] + nulls["below"], adjusted) if m else np.empty(0)
    out["low"], out["high"] = bounds[:m], -bounds[m:]
    above, below = out["p_holm_above"] < ALPHA, out["p_holm_below"] < ALPHA
    out["decision"] = np.where(above, "above", np.where(below, "below", "neither"))
    return out


def paired_control(per_set: dict[str, pd.DataFrame], controls=("untrained", "matched"), seed: int = 0) -> pd.DataFrame:
    """Trained against each control, set by set: :func:`paired_tests` of the per-set differences of each of
    :data:`PAIRED_STATISTICS`, with ``trained`` and ``control_value`` (the means over sets) beside them, and where
    the frames have ``qf_logit_ratio`` the logit ratios of both (:func:`logit_ratios`: ``trained_r``, ``control_r``,
    ``r_gap``). ``per_set``: ``"trained"`` and each control -> :func:`per_set_means` of the same sets and seeds.
    """
    frames, means = [], []
    for control in controls:
        if control not in per_set:
            continue
        merged = per_set["trained"].merge(per_set[control], on=["set", "timestep"], suffixes=("", "_control"))
        for statistic in PAIRED_STATISTICS:
            part = merged[["set", "timestep"]].assign(control=control, statistic=statistic)
            frames.append(part.assign(difference=merged[statistic] - merged[f"{statistic}_control"]))
            mean = merged.groupby("timestep")[[statistic, f"{statistic}_control"]].mean().reset_index()
            mean.columns = ["timestep", "trained", "control_value"]
            if "qf_logit_ratio" in merged:
                mean = mean.merge(logit_ratios(per_set["trained"], per_set[control]), on="timestep", how="left")
            means.append(mean.assign(control=control, statistic=statistic))
    out = paired_tests(pd.concat(frames, ignore_index=True), seed)
    return out.merge(pd.concat(means), on=["control", "statistic", "timestep"], how="left")


def logit_ratios(trained: pd.DataFrame, control: pd.DataFrame) -> pd.DataFrame:
    """Per timestep: ``trained_r`` and ``control_r``, the means over sets of each side's :func:`per_set_means`
    ``qf_logit_ratio``, and ``r_gap`` (trained - control), the confound every control carries beside its numbers."""
    r = {f"{name}_r": frame.groupby("timestep")["qf_logit_ratio"].mean() for name, frame in
         (("trained", trained), ("control", control))}  # fmt: skip
    out = pd.DataFrame(r).reset_index()
    return out.assign(r_gap=out["trained_r"] - out["control_r"])


def equal_r_differences(trained: pd.DataFrame, control: pd.DataFrame, columns=PAIRED_STATISTICS) -> pd.DataFrame:
    """Per (set, timestep) and statistic: the trained - control difference at equal logit ratio r.

    Trained and control generate from the same sets and seeds, so each (set, timestep, layer, head) cell is a pair.
    Over one set's cells at one timestep, the least-squares line of the statistic's difference on the r difference,
    ``d_c = delta + beta (r_trained - r_control)_c``, has at ``r_trained = r_control`` the value ``delta`` (its
    intercept): the difference at equal r. Chosen over matching r by rescaling the image keys per step (an edit
    of the weights the probe reads, calibrated per layer, step and set) because it leaves both pipelines as trained
    and started, and over binning r because a set has a few dozen cells; it assumes the difference is linear in the
    r gap over the cells' range (``r_gap_positive`` shows how far the line is extrapolated to reach 0).
    ``trained``, ``control``: probe tables (cond branch, image kind) with ``set``, ``layer``, ``head``, ``timestep``,
    ``qf_logit_ratio`` and the statistics ``columns``.

    Returns:
        one row per (set, timestep, statistic): ``difference`` (``delta``), ``raw_difference`` (the mean cell
        difference), ``slope`` (``beta``), ``r_gap`` (mean r_trained - r_control), ``r_gap_positive`` (the share of
        cells with r_trained above) and ``cells`` (cells with every value finite; under 3: NaN).
    """
    keys = ["set", "timestep", "layer", "head"]
    merged = trained.merge(control, on=keys, suffixes=("", "_control"))
    rows = []
    for (s, timestep), part in merged.groupby(["set", "timestep"]):
        gap = (part["qf_logit_ratio"] - part["qf_logit_ratio_control"]).to_numpy(np.float64)
        for statistic in columns:
            d = (part[statistic] - part[f"{statistic}_control"]).to_numpy(np.float64)
            ok = np.isfinite(d) & np.isfinite(gap)
            fit = np.polynomial.polynomial.polyfit(gap[ok], d[ok], 1) if ok.sum() >= 3 else (math.nan, math.nan)
            rows.append(
                {"set": s, "timestep": float(timestep), "statistic": statistic, "difference": float(fit[0]),
                 "raw_difference": float(d[ok].mean()) if ok.any() else math.nan, "slope": float(fit[1]),
                 "r_gap": float(gap[ok].mean()) if ok.any() else math.nan,
                 "r_gap_positive": float((gap[ok] > 0).mean()) if ok.any() else math.nan, "cells": int(ok.sum())}
            )  # fmt: skip
    return pd.DataFrame(rows)


def probed(pipe, references: list, seed: int, steps: list[int], guidance_scale: float = 1.0, count: int = 1,
           pool: str = "item") -> pd.DataFrame:  # fmt: skip
    """The probe's table of one generation from ``references`` (generator seeded with ``seed``), image kind."""
    import torch

    from ..capture.run import probe
    from ..tiny.digits import DIGITS_PROMPT
    from .ip_adapter_setup import NUM_STEPS

    with probe(pipe, steps=steps, query_frame=pool) as run:
        pipe(
            prompt=DIGITS_PROMPT, ip_adapter_image=[references], num_inference_steps=NUM_STEPS,
            guidance_scale=guidance_scale, num_images_per_prompt=count,
            generator=torch.Generator().manual_seed(seed), output_type="latent",
        )  # fmt: skip
    table = run.to_dataframe()
    return table[table["kind"] == "image"]


def init_adapter_control(trained: pd.DataFrame, control: pd.DataFrame, seed: int = 0) -> dict[str, pd.DataFrame]:
    """The control that isolates training (docs/findings.md, section 2): the trained organism against itself with the
    adapter at its starting weights (:func:`ipa_probe.tiny.digits.model.init_adapter_pipeline`), compared at equal r.
    ``trained``, ``control``: their probe tables of the same sets and seeds (image kind, with ``set``).

    Returns:
        ``"tests"``: :func:`paired_tests` of the :func:`equal_r_differences` (control ``"init-adapter"``) with the
        per-timestep means over sets of ``raw_difference``, ``r_gap`` and ``r_gap_positive`` beside them, and each
        side's mean r (``trained_r``, ``control_r``: :func:`logit_ratios`); ``"per_set"``: those differences;
        ``"means"``: per organism, set and timestep the :func:`per_set_means`.
    """
    per_set = equal_r_differences(trained, control).assign(control="init-adapter")
    described = per_set.groupby(["statistic", "timestep"])[["raw_difference", "r_gap", "r_gap_positive"]].mean()
    means = {label: per_set_means(t) for label, t in (("trained", trained), ("init-adapter", control))}
    ratios = logit_ratios(*means.values()).drop(columns="r_gap")  # r_gap: the cells' own, from described
    tests = paired_tests(per_set, seed).merge(described.reset_index(), on=["statistic", "timestep"], how="left")
    means = pd.concat([frame.assign(organism=label) for label, frame in means.items()], ignore_index=True)
    return {"tests": tests.merge(ratios, on="timestep", how="left"), "per_set": per_set, "means": means}


def query_pool(
    pipes: dict, sets: list, steps: list[int], counts=(1, 3, 8), guidance_scale: float = 3.0, runs: str = "one"
):
    """Both query pools on the same generations (module docstring).

    Args:
        pipes: organism name -> trained pipeline; set ``i`` of ``sets`` generates from seed ``i``; ``steps`` index the
            50-step schedule.
        counts: ``num_images_per_prompt`` values; ``guidance_scale`` above 1 probes both branches.
        runs: ``"one"``: one item-pool run per generation, the branch pool from its ``qf_spearman_other_pool``;
            ``"both"``: a run per pool (twice the generations).

    Returns:
        ``(summary, cells)``: per (organism, images, CFG branch, timestep) ``item``, ``branch_pool`` (mean query-frame
        rho in each pool over the cells that have one in both, over sets, layers and heads), ``branch_only_cells``
        (cells with a rho only when the branch is pooled: a 1 x 1 layer's frame gains queries), ``difference`` (mean
        per-set branch - item), ``se`` (its standard error over sets), ``max_cell_difference`` (largest
        |difference| of one cell), ``sets``; and the per-cell differences.
    """
    if runs not in ("one", "both"):
        raise ValueError(f"runs: expected 'one' or 'both', got {runs!r}")
    cells = []
    for organism, pipe in pipes.items():
        for count in counts:
            for i, refs in enumerate(sets):
                frames = []
                for pool in ("item", "branch") if runs == "both" else ("item",):
                    table = probed(pipe, refs, i, steps, guidance_scale, count, pool)
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


def run_controls(ctx, pipes: dict, per_set: dict, cells, sets: list, steps: list[int], folder) -> tuple[list, dict]:
    """The ip-adapter experiment's controls (module docstring): the matched twin, the adapter at its starting weights
    and the query pool, at the tier's sizes.

    ``pipes``: ``"trained"``, ``"untrained"``; ``per_set``: the same keys -> :func:`per_set_means` of the one-digit
    ``sets`` already generated (set ``i`` from seed ``i``); ``cells``: the same keys -> their probe tables (with
    ``set``). Writes ``matched_control.csv``, ``matched_calibration.csv``, ``query_pool.csv`` and
    ``init_adapter_<name>.csv`` (each of :func:`init_adapter_control`'s tables) to ``folder``; returns ``(rows,
    record)``: table rows and the record's entries.
    """
    import torch

    from .._io import write_table
    from ..layers import find_ip_layers
    from ..tiny.digits import digits_reference_images, untrained_digits_pipeline
    from ..tiny.digits.model import init_adapter_pipeline
    from .ip_adapter_setup import REFS_PER_SET, run_reference_set
    from .report import Row

    tier = ctx.tier

    twin = untrained_digits_pipeline(recipe=ctx.recipe)
    twin.set_progress_bar_config(disable=True)
    linears = [linear for layer in find_ip_layers(twin) for linear in layer.processor.to_k_ip]
    keys = [t for linear in linears for t in (linear.weight, linear.bias) if t is not None]  # what scaling scales
    initial = [tensor.detach().clone() for tensor in keys]

    def make_twin():
        # the twin's image keys back at their initial weights: a fresh (seeded) build without rebuilding it per scale
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
    start = init_adapter_pipeline(ctx.recipe)
    start.set_progress_bar_config(disable=True)
    init = init_adapter_control(
        cells["trained"], pd.concat([probed(start, refs, i, steps).assign(set=i) for i, refs in enumerate(sets)])
    )
    pool, _ = query_pool({ctx.recipe: pipes["trained"]}, sets[: tier.ip_pool_sets], steps)
    written = {"matched_control": paired, "matched_calibration": calibration, "query_pool": pool}
    for name, frame in {**written, **{f"init_adapter_{k}": v for k, v in init.items()}}.items():
        write_table(frame, folder / f"{name}.csv")
    rows = []
    tv = {label: frame.groupby("timestep")["attention_tv"].mean() for label, frame in per_set.items()}
    for r in [*paired.to_dict(orient="records"), *init["tests"].to_dict(orient="records")]:
        t, ratios = r["timestep"], f"r trained {r['trained_r']:.2f}, control {r['control_r']:.2f}"
        if r["control"] == "init-adapter":
            compared, twin = "its adapter at the start, at equal r,", ""
            note = f"at unequal r {r['raw_difference']:+.3f}; {ratios}, cells with r trained above "
            note += f"{r['r_gap_positive']:.0%}"
        else:
            compared, twin = "control,", " twin"
            note = (
                f"trained {r['trained']:.3f}, control {r['control_value']:.3f}; {ratios}; attention TV from uniform: "
                f"trained {tv['trained'].get(t, np.nan):.3f}, control {tv[r['control']].get(t, np.nan):.3f}"
            )
        quantity = f"trained minus {compared} paired by set (both one-sided tests; Holm over both and the table)"
        setting = f"{r['statistic']} vs {r['control']}{twin}, t={t:g}"
        rows.append(Row(quantity, setting, _decided(r), "—", f"{note}; {r['sets']} sets"))
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
            "rule": "per set: trained - control; both one-sided sign-flip p (above, below); Holm over both and the "
            "table; Holm-compatible one-sided bounds of each direction",
        },
        "init_adapter": {"tests": init["tests"].to_dict(orient="records"), "rule": "matched_control's, at equal r"},
        "query_pool": {"summary": pool.to_dict(orient="records"), "sets": tier.ip_pool_sets, "guidance_scale": 3.0},
    }
    return rows, record


def _decided(r: dict) -> str:
    """A :func:`paired_tests` row as the table shows it: the decision, the difference and its bounds, both p."""
    return (
        f"{r['decision']}: {r['difference']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}], p above {r['p_above']:.2g} "
        f"(Holm {r['p_holm_above']:.2g}), below {r['p_below']:.2g} (Holm {r['p_holm_below']:.2g})"
    )
