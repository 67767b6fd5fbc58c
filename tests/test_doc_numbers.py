"""Every number the docs take from a committed record, read from the record (issue #52 point 5).

Each claim is a line of text as the doc states it, rebuilt here from the CSV it comes from (the claim's table of
(doc, text, record, rows, column)): the test fails when the prose and its record drift apart, either way. Numbers are
formatted as the prose writes them (signs, the minus sign, significant digits); whitespace is normalised.

The inventory at the end (issue #52 point 4) reads every number of README.md, findings.md and attribution.md and
fails on any that no assertion here covers, unless a short rule names it as not data or as having no record.
"""

from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ipa_probe.experiments.attribution_setup import PREDICTORS as PREDICTOR_WORDS  # the tables' wording

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
ORGANISMS = {"support": "full", "ip-adapter": "full_recipe_ip_adapter", "mixed": "full_recipe_mixed"}


CLAIMS: dict[str, set[str]] = defaultdict(set)  # per doc, every text a test here asserted (the inventory's input)


@functools.cache
def doc(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


@functools.cache
def read(path: str) -> pd.DataFrame:
    return pd.read_csv(RESULTS / path, dtype={"timestep": str} if "attribution/" in path else None)


def record(path: str) -> pd.DataFrame:
    """A committed CSV under docs/results/, read once per session (a copy: no test can change another's)."""
    return read(path).copy()


def one(table: pd.DataFrame, **where) -> pd.Series:
    rows = table
    for column, value in where.items():
        rows = rows[rows[column].astype(str) == str(value)]
    assert len(rows) == 1, f"{where}: {len(rows)} rows"
    return rows.iloc[0]


def signed(x: float, digits: int = 2) -> str:
    """``+0.43`` / ``−0.02``: the docs' signed numbers, with the minus sign."""
    return f"{x:+.{digits}f}".replace("-", "−")


def g(x: float) -> str:
    """Two significant digits, as p-values are written (``0.0012``, ``1``)."""
    return f"{x:.2g}"


def e(x: float) -> str:
    """Two significant digits with a short exponent, as the docs write small numbers (``4.1e-6``, ``0.0089``)."""
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m.group(1).replace('+', '')}{m.group(2)}", f"{x:.2g}")


def assert_in(name: str, text: str) -> None:
    text = re.sub(r"\s+", " ", text)
    assert text in doc(name), f"{name} does not state, from its record: {text!r}"
    CLAIMS[name].add(text)


# ------------------------------------------------------------------------------------------- findings.md section 1
def test_gauge_group_claims():
    """The headline's invariance: the query-frame rho's means over the group's 9 gauges, their spread, the outputs'
    largest change and the stored-frame rho's range (the table gauge_sweep/group/README.md says the docs quote)."""
    table = record("gauge_sweep/group/gauge_sweep.csv")
    table = table[(table.kind == "image") & (table.branch == "cond")]
    means = table.groupby("gauge", sort=False).mean(numeric_only=True)
    assert len(means) == 9
    exact, gauss, stored = means["qf_spearman"], means["qf_gauss_spearman"], means["spearman"]
    spread = max(np.ptp(exact.to_numpy()), np.ptp(gauss.to_numpy()))
    assert_in(
        "docs/findings.md",
        f"`ip-adapter` organism: {exact.mean():.4f} (exact) / {gauss.mean():.4f} (Gaussian) under every gauge, means "
        f"within {e(spread)}, outputs within {e(table['output_max_abs_diff'].max())}; the stored-frame ρ of the same "
        f"model spans {signed(stored.min())} to {stored.max():.2f}",
    )


# ------------------------------------------------------------------------------------------- findings.md section 9
def test_organism_claims():
    """The README's organism figures as findings.md section 9 restates them: the right-digit rates with the adapter on
    and at scale 0 (CFG 3), and the largest share of outputs a same-class swap moves (organism.md's records)."""
    digits = RESULTS / "digits"
    rates = {o: json.loads((digits / o / "rates.json").read_text())["rates"] for o in ("support", "ip-adapter")}
    following = {o: json.loads((digits / o / "following.json").read_text())["following"] for o in rates}

    def rate(organism: str, arm: str) -> str:
        return f"{100 * rates[organism][arm]['rate']['mean']:.1f}%"

    on, off = "adapter on, CFG 3", "adapter scale 0, CFG 3"
    assert_in(
        "docs/findings.md",
        f"(`support` {rate('support', on)}, `ip-adapter` {rate('ip-adapter', on)}; [organism.md](organism.md)). "
        f"Control: the adapter at scale 0 ({rate('support', off)}, {rate('ip-adapter', off)})",
    )
    swaps = [run["metrics"]["swap_toward"]["mean"] for runs in following.values() for run in runs.values()]
    assert_in("docs/findings.md", f"swapping the reference moves the output** ({100 * max(swaps):.0f}%)")
    assert_in("docs/organism.md", f"moves {100 * min(swaps):.0f}–{100 * max(swaps):.0f}% of outputs")


def clustered_exact(successes: list[int], size: int) -> tuple[float, float]:
    """The exact 95 % interval of a proportion over clusters of ``size`` trials at Korn and Graubard's effective size,
    written out here (scipy's beta quantiles): design effect from the clusters' spread, the t correction for their
    degrees of freedom, then Clopper-Pearson at the effective count."""
    from scipy import stats

    x, c = np.asarray(successes, dtype=np.float64), len(successes)
    p = x.sum() / (c * size)
    v = c / (c - 1) * ((x - p * size) ** 2).sum() / (c * size) ** 2
    n = min(c * size, p * (1 - p) / v) * (stats.norm.ppf(0.975) / stats.t.ppf(0.975, c - 1)) ** 2
    low = stats.beta.ppf(0.025, p * n, n - p * n + 1) if p > 0 else 0.0
    return low, stats.beta.ppf(0.975, p * n + 1, n - p * n) if p < 1 else 1.0


def test_organism_rates_clustered_by_seed():
    """Section 9's exact intervals clustered by seed, from rates.json's per-seed rates (100 images a seed)."""
    text, ends = [], []
    for arm in ("adapter on, CFG 3", "adapter scale 0, CFG 3"):
        for organism in ("support", "ip-adapter"):
            r = json.loads((RESULTS / "digits" / organism / "rates.json").read_text())["rates"][arm]
            size = r["samples"] // len(r["rate"]["values"])
            assert size == 100
            low, high = clustered_exact([round(v * size) for v in r["rate"]["values"]], size)
            text.append(f"[{100 * low:.1f}%, {100 * high:.1f}%]")
            ends.append((low, high))
    assert ends[0][0] > ends[2][1] and ends[1][0] > ends[3][1]  # "apart on both organisms"
    on_s, on_i, off_s, off_i = text
    assert_in(
        "docs/findings.md",
        f"is {on_s} (`support`) and {on_i} (`ip-adapter`) against the control's {off_s} and {off_i}: apart on both",
    )


# ------------------------------------------------------------------------------------------- findings.md section 2
def bound(x: float) -> str:
    """A Holm-compatible bound as the docs write it: ``0`` where exactly 0 (a rejection while others are kept)."""
    return "0" if x == 0 else signed(x, 3)


def decided(r: pd.Series) -> str:
    """A two-directions test as the tables write it: gap, ``[low, high]``, both Holm p and the decision."""
    return (
        f"{signed(r['difference'], 3)} [{bound(r['low'])}, {bound(r['high'])}], Holm ↑{g(r['p_holm_above'])} "
        f"↓{g(r['p_holm_below'])}: {r['decision']}"
    )


def matched_control(organism: str) -> pd.DataFrame:
    return record(f"{ORGANISMS[organism]}/ip-adapter/matched_control.csv")


@pytest.mark.parametrize("organism", list(ORGANISMS))
def test_matched_control_tables(organism):
    """The full tier's twins, row by row: each side's r at the timestep, then each twin's test in both directions."""
    table = matched_control(organism)
    for timestep in sorted(table["timestep"].unique(), reverse=True):
        raw, twin = (
            one(table, control=c, statistic="qf_spearman", timestep=timestep) for c in ("untrained", "matched")
        )
        assert raw["trained_r"] == twin["trained_r"]
        cells = [f"{timestep:g}", f"{raw['trained_r']:.2f}, {raw['control_r']:.2f}, {twin['control_r']:.2f}"]
        for statistic in ("qf_spearman", "qf_rho_excess"):
            for control in ("untrained", "matched"):
                cells.append(decided(one(table, control=control, statistic=statistic, timestep=timestep)))
        assert_in("docs/findings.md", "| " + " | ".join(cells) + " |")


def test_matched_control_claims():
    """The prose under the twins' tables: each twin's decisions counted, the r gaps they follow, the raw twin's and
    the trained r, the slopes of rho on r, and the smoke tiers' signs against the full tier's."""
    t = pd.concat([matched_control(o).assign(organism=o) for o in ORGANISMS], ignore_index=True)
    np.testing.assert_allclose(t["r_gap"], t["trained_r"] - t["control_r"], atol=1e-12)
    rho, excess = t[t["statistic"] == "qf_spearman"], t[t["statistic"] == "qf_rho_excess"]

    def counts(rows: pd.DataFrame) -> list[int]:
        return [int((rows["decision"] == d).sum()) for d in ("above", "below", "neither")]

    raw, twin = (rho[rho["control"] == c] for c in ("untrained", "matched"))
    assert (raw["decision"] == "below").all() and len(raw) == len(twin) == 15
    up, down, level = counts(excess[excess["control"] == "untrained"])
    assert_in(
        "docs/findings.md",
        f"the trained ρ is below at all 15 (organism, timestep) cells (Holm ↓ {g(raw['p_holm_below'].min())}–"
        f"{g(raw['p_holm_below'].max())}), where the twin's r is above the trained one by {-raw['r_gap'].max():.2f}–"
        f"{-raw['r_gap'].min():.2f}; the excess over the logit-ratio baseline is above at {up}, below at {down} and "
        f"neither at {level}.",
    )
    (a, b, n), (ea, eb, en) = counts(twin), counts(excess[excess["control"] == "matched"])
    assert_in(
        "docs/findings.md",
        f"the trained ρ is above at {a} cells, below at {b} and neither at {n} (the excess: above at {ea}, below at "
        f"{eb}, neither at {en}).",
    )
    far, near = twin[twin["r_gap"] < -0.15], twin[twin["r_gap"] >= -0.15]  # the split the prose describes
    assert (far["decision"] != "above").all() and (near["decision"] != "below").all()

    def listed(o: str) -> str:  # "981, 761 and 1"
        steps = [f"{x:g}" for x in far.loc[far["organism"] == o, "timestep"]]
        return " and ".join([", ".join(steps[:-1]), steps[-1]] if len(steps) > 1 else steps)

    where = {o: listed(o) for o in ORGANISMS}
    (_, below, level), (above, _, middle) = counts(far), counts(near)
    assert_in(
        "docs/findings.md",
        f"at the {len(far)} cells where the twin's r exceeds the trained one by {-far['r_gap'].max():.2f}–"
        f"{-far['r_gap'].min():.2f} (`support` at t = {where['support']}, `ip-adapter` at t = {where['ip-adapter']}, "
        f"`mixed` at t = {where['mixed']}) the trained ρ is below at {below} and neither at {level}; at the other "
        f"{len(near)}, where the twin's r is from {-near['r_gap'].min():.2f} above to {near['r_gap'].max():.2f} below "
        f"the trained one, above at {above} and neither at {middle}",
    )
    assert_in(
        "docs/findings.md",
        f"its query-frame logit ratio r ({raw['control_r'].min():.2f}–{raw['control_r'].max():.2f} per timestep) is "
        f"above the trained adapters' ({raw['trained_r'].min():.2f}–{raw['trained_r'].max():.2f})",
    )
    slopes = pd.concat([record(f"{f}/ip-adapter/init_adapter_per_set.csv") for f in ORGANISMS.values()])
    slopes = slopes.loc[slopes["statistic"] == "qf_spearman", "slope"]
    assert_in("docs/findings.md", f"rises in {(slopes > 0).sum():,} of {len(slopes):,} (organism, set, timestep) fits")
    for organism, smoke in (("support", "smoke"), ("ip-adapter", "smoke_recipe_ip_adapter")):
        both = record(f"{smoke}/ip-adapter/matched_control.csv").merge(
            matched_control(organism), on=["control", "statistic", "timestep"], suffixes=("", "_full")
        )
        same = np.sign(both["difference"]) == np.sign(both["difference_full"])
        held = (both["decision"] != "neither") | (both["decision_full"] != "neither")
        assert len(both) == 20 and same[held].all()
        words = "at all 20 cells" if same.all() else f"at all {held.sum()} cells where either tier's test held"
        assert_in("docs/findings.md", f"sign {words}")


def test_matched_twin_attention_and_calibration():
    """The twins' attention TV from uniform (the table's control rows) and the calibration's ratio gaps: the median
    over layers (the 1 x 1 mid block has no ratio) of |twin ratio - trained ratio|, raw and matched, and the largest
    matched gap (``matched_calibration.csv``)."""
    tv, gaps = {}, {}
    for organism, folder in ORGANISMS.items():
        rows = record(f"{folder}/ip-adapter/table.csv")
        rows = rows[rows["quantity"].str.startswith("trained minus control") & rows["setting"].str.contains("matched")]
        both = rows["note"].str.extract(r"attention TV from uniform: trained ([0-9.]+), control ([0-9.]+)")
        assert both.notna().all().all() and len(both) == 10
        tv[organism] = [f"{both[i].astype(float).min():.3f}–{both[i].astype(float).max():.3f}" for i in (0, 1)]
        t = record(f"{folder}/ip-adapter/matched_calibration.csv")
        raw, matched = ((t[c] - t["trained_ratio"]).abs() for c in ("untrained_ratio", "matched_ratio"))
        gaps[organism] = (f"{np.nanmedian(raw):.2f}", f"{np.nanmedian(matched):.2f}", f"{np.nanmax(matched):.2f}")
    assert tv["support"][1] == tv["ip-adapter"][1]
    raw = max(  # the raw twin's attention: the control's TV from uniform beside each raw-twin test
        record(f"{f}/ip-adapter/table.csv")
        .query("quantity.str.startswith('trained minus control')", engine="python")
        .query("not setting.str.contains('matched')", engine="python")["note"]
        .str.extract(r"attention TV from uniform: trained [0-9.]+, control ([0-9.]+)")[0]
        .astype(float)
        .max()
        for f in ORGANISMS.values()
    )
    assert_in("docs/findings.md", f"its attention over references is within TV {raw:.3f} of uniform (degenerate)")
    assert_in(
        "docs/findings.md",
        f"TV from uniform {tv['support'][1]} on `support` and `ip-adapter` and {tv['mixed'][1]} on `mixed`, against "
        f"the trained organisms' {tv['support'][0]}, {tv['ip-adapter'][0]} and {tv['mixed'][0]}",
    )
    raw, matched, largest = gaps["support"]
    assert_in("docs/findings.md", f"ratio falls from {raw} to {matched} (largest remaining {largest};")
    for organism in ("ip-adapter", "mixed"):
        raw, matched, largest = gaps[organism]
        assert_in("docs/findings.md", f"median ratio gap {raw} → {matched}, largest {largest})")


def init_adapter(organism: str) -> pd.DataFrame:
    return record(f"{ORGANISMS[organism]}/ip-adapter/init_adapter_tests.csv")


@pytest.mark.parametrize("organism", list(ORGANISMS))
def test_init_adapter_table(organism):
    """The table of the control that isolates training, row by row from the full tier's ``init_adapter_tests.csv``."""
    table = init_adapter(organism)
    for timestep in sorted(table["timestep"].unique(), reverse=True):
        rho, excess = (one(table, statistic=s, timestep=timestep) for s in ("qf_spearman", "qf_rho_excess"))
        cells = [f"`{organism}`", f"{timestep:g}", f"{signed(rho['r_gap'])} ({100 * rho['r_gap_positive']:.0f}%)",
                 signed(rho["raw_difference"], 3), decided(rho), decided(excess)]  # fmt: skip
        assert_in("docs/findings.md", "| " + " | ".join(cells) + " |")


def test_init_adapter_claims():
    """The prose under the table and the README's line: counts of each decision and the ranges, from the records."""
    t = pd.concat([init_adapter(o).assign(organism=o) for o in ORGANISMS], ignore_index=True)
    rho, excess = t[t["statistic"] == "qf_spearman"], t[t["statistic"] == "qf_rho_excess"]
    below, above = (int((rho["decision"] == d).sum()) for d in ("below", "above"))
    assert above == 0 and len(rho) == 15
    assert_in("docs/findings.md", f"lowers the query-frame ρ at {below} of 15 (organism, timestep) cells")
    assert_in("README.md", f"adapter training lowers it at {below} of 15 organism-timesteps, raising none.")
    small = rho[rho["organism"] != "mixed"]
    sizes = small.loc[small["decision"] == "below", "difference"].abs()
    mixed = rho.loc[rho["organism"] == "mixed", "difference"].abs()
    assert (rho.loc[rho["organism"] == "mixed", "decision"] == "below").all()
    assert_in(
        "docs/findings.md",
        f"by {sizes.min():.3f}–{sizes.max():.3f} on `support` and `ip-adapter` (raw gaps "
        f"{signed(small['raw_difference'].min(), 3)} to {signed(small['raw_difference'].max(), 3)}, partly the "
        f"trained adapter's lower r) and by {mixed.min():.3f}–{mixed.max():.3f} on `mixed`.",
    )
    assert_in("docs/findings.md", f"by at most {sizes.max():.3f} except on `mixed`")
    moved = excess[excess["decision"] != "neither"]
    assert set(moved["organism"] + moved["decision"]) == {"mixedbelow", "supportabove"}
    down, up = moved[moved["decision"] == "below"], one(moved, decision="above")
    assert_in(
        "docs/findings.md",
        f"below on `mixed` at {len(down)} of 5 timesteps ({signed(down['difference'].min(), 3)} to "
        f"{signed(down['difference'].max(), 3)}), above on `support` at t = {up['timestep']:g} "
        f"({signed(up['difference'], 3)}), neither at the other {len(excess) - len(moved)}.",
    )
    share = rho["r_gap_positive"]
    assert_in("docs/findings.md", f"trained r above in {100 * share.min():.0f}–{100 * share.max():.0f}% of cells")


# ------------------------------------------------------------------------------------------- findings.md section 7
def test_nw_quality_rates():
    table = record("nw_quality/rates.csv")
    for organism in ORGANISMS:
        cells = []
        for method in ("learned", "nw_head_query", "nw_head_stored", "adapter_off"):
            r = one(table, recipe=organism, method=method)
            cells.append(
                f"{r['right']}/{r['images']} ({100 * r['rate']:.0f}%) [{100 * r['low']:.0f}, {100 * r['high']:.0f}]"
            )
        assert_in("docs/findings.md", f"| `{organism}` | " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------------- attribution.md, verdicts per cell
RESOLUTIONS = ("layer", "layer x head", "layer x position", "layer x head x position")


def test_verdict_share_ranges():
    """The table of pooling shares: per organism, population and resolution the range over the five steps of the
    point share, and in brackets the lowest certified and the highest possible true share (the simultaneous bounds)."""
    populations = {"one digit": "same digit", "2 + 2 digits": "2+2 digits", "4 digits": "4 digits"}
    for organism in ("support", "ip-adapter"):
        table = record(f"{ORGANISMS[organism]}/attribution/verdicts_trained.csv")
        for words, population in populations.items():
            cells = []
            for resolution in RESOLUTIONS:
                part = table[(table["population"] == population) & (table["resolution"] == resolution)]
                share = 100 * part["pooling"].to_numpy(np.float64)
                low, high = f"{share.min():.0f}", f"{share.max():.0f}"
                bounds = f"[{100 * part['pooling_low'].min():.0f}, {100 * part['pooling_high'].max():.0f}]"
                cells.append(f"{low}% {bounds}" if low == high else f"{low}–{high}% {bounds}")
            assert_in("docs/attribution.md", f"| `{organism}`, {words} | " + " | ".join(cells) + " |")


def test_verdict_records_carry_their_bounds_and_the_tracking_claim():
    """Every committed verdict row below the average carries both bounds of every share (``low <= high``, the point
    share between them, as each per-cell decision is one of the possible verdicts there; under ``MIN_SETS`` sets, the
    smoke tier's control populations, no cell decides: every one ``undecided``), and the prose's figures for the
    share of cells certified to track the posterior come from the full tier's trained records."""
    from ipa_probe.sweep.aggregation import MIN_SETS

    frames = []
    folders = {**ORGANISMS, "smoke support": "smoke", "smoke ip-adapter": "smoke_recipe_ip_adapter"}
    for organism, folder in folders.items():
        controls = json.loads((ROOT / f"docs/results/{folder}/attribution/record.json").read_text())["control_sets"]
        for label in ("trained", "untrained"):
            table = record(f"{folder}/attribution/verdicts_{label}.csv")
            few = table["population"].isin(["same digit", "4 digits"]) & (int(controls) < MIN_SETS)
            assert (table.loc[few, "undecided"] == 1).all() and few.any() == (folder.startswith("smoke"))
            table = table[(table["resolution"] != "average")]
            for v in ("pooling", "tracks_posterior", "undecided"):
                low, high = table[f"{v}_low"].to_numpy(np.float64), table[f"{v}_high"].to_numpy(np.float64)
                assert np.isfinite(low).all() and np.isfinite(high).all() and (low <= high).all(), (folder, label, v)
                decided = table[~few.loc[table.index]]
                assert (decided[f"{v}_low"] <= decided[v] + 1e-12).all(), (folder, label, v)
                assert (decided[v] <= decided[f"{v}_high"] + 1e-12).all(), (folder, label, v)
            if label == "trained" and organism in ORGANISMS:
                frames.append(table.assign(organism=organism))
    trained = pd.concat(frames, ignore_index=True)
    shown = trained[trained["organism"] != "mixed"]
    certified = shown[shown["tracks_posterior_low"] > 0]
    assert certified.empty
    assert_in(
        "docs/attribution.md",
        f"No true share of `tracks posterior` cells above 0 is certified: {len(certified)} of {len(shown)} "
        "(organism, population, resolution, step) rows.",
    )


# -------------------------------------------------------------- attribution.md and findings.md section 6: predictors
EFFECT_WORDS = {"latent_effect": "RMS latent change", "class_drop": "drop of P(digit)"}


def comparison_row(organism: str, effect: str) -> str:
    """One row of the whole-table comparison: per predictor (all 40 sets, the step mean or the whole run), the mean
    per-set Spearman and its Holm p, in bold where it predicts."""
    table = record(f"{ORGANISMS[organism]}/attribution/comparisons_trained.csv")
    cells = []
    for predictor in PREDICTOR_WORDS:
        r = one(table, timestep="all", predictor=predictor, effect=effect)
        cell = f"{signed(r['spearman'])}, Holm {g(r['p_holm'])}"
        cells.append(f"**{cell}**" if r["predicts"] else cell)
    return f"| `{organism}`, {EFFECT_WORDS[effect]} | " + " | ".join(cells) + " |"


def held_out_cell(r: pd.Series) -> str:
    where = "" if r["steps"] == "whole run" else f", {r['group']} layers × {r['steps']}"
    negated = " (negated)" if r["sign"] < 0 else ""
    return f"{PREDICTOR_WORDS[r['chosen']]}{where}{negated} → {signed(r['spearman'])}, Holm {g(r['p_holm'])}"


def held_out_row(organism: str, effect: str) -> str:
    table = record(f"{ORGANISMS[organism]}/attribution/held_out_trained.csv")
    folds = [one(table, effect=effect, fold=f"{side} chooses") for side in ("even", "odd")]
    agrees = sum(bool(r["agrees"]) for r in folds)
    verdict = {0: "no", 1: "in one fold", 2: "**in both folds**"}[agrees]
    return (
        f"| `{organism}`, {EFFECT_WORDS[effect]} | " + " | ".join(held_out_cell(r) for r in folds) + f" | {verdict} |"
    )


@pytest.mark.parametrize("organism", list(ORGANISMS))
@pytest.mark.parametrize("effect", list(EFFECT_WORDS))
def test_predictor_tables(organism, effect):
    assert_in("docs/attribution.md", comparison_row(organism, effect))
    assert_in("docs/attribution.md", held_out_row(organism, effect))


def survivors(organism: str) -> str:
    """What predicts after Holm on one trained organism, in words: on the step mean or the whole run, and per
    recorded step (timesteps in the table's order)."""
    table = record(f"{ORGANISMS[organism]}/attribution/comparisons_trained.csv")
    table = table[table["predicts"]]
    whole = [
        f"{PREDICTOR_WORDS[r.predictor]} ({EFFECT_WORDS[r.effect]})" for r in table.itertuples() if r.timestep == "all"
    ]
    steps = table[table["timestep"] != "all"]
    per_step = [
        f"{PREDICTOR_WORDS[p]} ({EFFECT_WORDS[e]}) at t = {', '.join(part['timestep'])}"
        for (p, e), part in steps.groupby(["predictor", "effect"], sort=False)
    ]
    return (
        f"`{organism}`: step mean or whole run: {', '.join(whole) or 'none'}; per recorded step: "
        f"{'; '.join(per_step) or 'none'}"
    )


@pytest.mark.parametrize("organism", list(ORGANISMS))
def test_what_survives_holm(organism):
    assert_in("docs/attribution.md", survivors(organism))
    untrained = record(f"{ORGANISMS[organism]}/attribution/comparisons_untrained.csv")
    assert not untrained["predicts"].any()


def test_untrained_smallest_holm_p():
    smallest = min(record(f"{f}/attribution/comparisons_untrained.csv")["p_holm"].min() for f in ORGANISMS.values())
    assert_in("docs/attribution.md", f"no untrained row predicts after Holm (smallest Holm p {g(smallest)})")


def effect_sizes(organism: str) -> str:
    """The size of one reference's ablation on an organism: mean RMS latent change and flipped share, trained and
    untrained, and the range of the trained attention shares."""
    folder = ORGANISMS[organism]
    trained, untrained = (record(f"{folder}/attribution/effects_{w}.csv") for w in ("trained", "untrained"))
    shares = trained["attention_share"]
    return (
        f"`{organism}`: {trained['latent_effect'].mean():.2f} RMS, {100 * trained['flipped'].mean():.0f}% flipped "
        f"(untrained {untrained['latent_effect'].mean():.2f}, {100 * untrained['flipped'].mean():.0f}%); "
        f"attention shares {shares.min():.3f}–{shares.max():.3f}"
    )


@pytest.mark.parametrize("organism", list(ORGANISMS))
def test_effect_sizes(organism):
    assert_in("docs/attribution.md", effect_sizes(organism))


def grid_counts_row(organism: str, effect: str) -> str:
    """The grid's unadjusted counts (the mid block apart): per predictor, in how many of the grid family's cells its
    one-sided permutation p fell below 0.05, which is the uncorrected rule (``predicts_unadjusted``)."""
    table = record(f"{ORGANISMS[organism]}/attribution/grid_comparisons_trained.csv")
    assert (table["predicts_unadjusted"] == (table["p"] < 0.05)).all()
    table = table[(table["family"] == "grid") & (table["effect"] == effect)]
    cells = []
    for predictor in list(PREDICTOR_WORDS)[:4]:
        part = table[table["predictor"] == predictor]
        cells.append(f"{int((part['p'] < 0.05).sum())} of {len(part)}")
    return f"| `{organism}`, {EFFECT_WORDS[effect]} | " + " | ".join(cells) + " |"


@pytest.mark.parametrize("organism", list(ORGANISMS))
def test_grid_counts(organism):
    for effect in EFFECT_WORDS:
        assert_in("docs/attribution.md", grid_counts_row(organism, effect))


# ------------------------------------------------------------------------------------------- findings.md section 8
def shuffle_sentence(folders=("smoke", "smoke_recipe_ip_adapter")) -> str:
    """The shuffled-order control's largest differences over the smoke tier's organisms (``shuffled_<w>.csv``)."""
    tables = {
        w: pd.concat([record(f"{f}/attribution/shuffled_{w}.csv") for f in folders]) for w in ("trained", "untrained")
    }
    first = [c for c in tables["trained"].columns if c.startswith("first_step_")]
    overall = max(tables[w][first].to_numpy(np.float64).max() for w in tables)
    t = tables["trained"].max()
    return (
        f"at the first recorded step every column agrees to {e(overall)} or better (trained: shares "
        f"{e(t['first_step_share_max_diff'])}, contribution norms {e(t['first_step_contribution_norm_max_diff'])}, "
        f"posterior weights {e(t['first_step_posterior_weight_max_diff'])}, distances "
        f"{e(t['first_step_sq_distance_max_diff'])}), final latents within {e(t['latent_max_diff'])} (trained) and "
        f"{e(tables['untrained']['latent_max_diff'].max())} of |x| ≤ "
        f"{tables['untrained']['latent_max_abs'].max():.0f} (untrained"
    )


def test_shuffle_sentence():
    assert_in("docs/findings.md", shuffle_sentence())


# ------------------------------------------------------------------------------------------------------ README.md
def test_readme_findings():
    rho = []
    for folder in ORGANISMS.values():
        table = record(f"{folder}/ip-adapter/table.csv")
        rows = table[table["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
        rows = rows[rows["setting"].str.startswith("trained organism")]
        rho += [float(v.split()[0]) for v in rows["ours"]]
    assert len(rho) == 15  # 3 organisms x 5 timesteps
    assert_in("README.md", f"query-frame ρ is {min(rho):.2f}–{max(rho):.2f} on the three trained organisms")
    r = one(
        record("full_recipe_ip_adapter/attribution/held_out_trained.csv"), effect="class_drop", fold="even chooses"
    )
    assert r["chosen"] == "attribution_patching" and r["agrees"]
    assert_in("README.md", f"(`ip-adapter` {signed(r['spearman'])}, Holm {g(r['p_holm'])})")
    chosen = pd.concat([record(f"{f}/attribution/held_out_trained.csv")["chosen"] for f in ORGANISMS.values()])
    assert len(chosen) == 12 and "attention_share" not in set(chosen)
    assert_in("README.md", "sets' held-out halves the attention share is never chosen;")
    # fresh sets: on every organism no predictor agrees with the deciding pair more often than reading the output
    fresh = record("attribution_fresh/summary.csv")
    baseline = fresh[fresh["predictor"] == "output_digit"].set_index("organism")["agreement"]
    others = fresh[fresh["predictor"] != "output_digit"]
    assert (others["agreement"].to_numpy() <= baseline.loc[others["organism"]].to_numpy()).all()
    assert_in("README.md", "on fresh 2+2 sets no predictor beats reading the output")


# ------------------------------------------------------------------------------------------- findings.md section 3
def query_frame(organism: str) -> dict[int, tuple[str, str, str]]:
    """Per timestep of the trained organism's ``ip-adapter/table.csv``: the query-frame ρ with its interval as the
    table writes it, the point value, and the excess over the logit-ratio baseline (exact b), signed."""
    table = record(f"{ORGANISMS[organism]}/ip-adapter/table.csv")
    rows = table[table["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
    out = {}
    for r in rows[rows["setting"].str.startswith("trained organism")].itertuples():
        excess = float(re.search(r"exact (-?[0-9.]+) \[", r.note).group(1))
        out[int(r.setting.split("t=")[1])] = (r.ours, r.ours.split()[0], signed(excess, 3))
    return out


def test_query_frame_claims():
    for organism in ("ip-adapter", "support"):
        q = query_frame(organism)
        assert_in("docs/findings.md", f"`{organism}` {q[981][0]} → {q[501][1]} → {q[1][0]}")
        assert_in("docs/findings.md", f"{q[981][2]} → {q[501][2]} → {q[1][2]} (`{organism}`)")
    q = query_frame("mixed")
    assert_in(
        "docs/findings.md", f"{q[981][1]} → {q[501][1]} → {q[1][1]}, excess {q[981][2]} → {q[501][2]} → {q[1][2]}"
    )
    assert_in(
        "docs/attribution.md",
        f"{q[981][0]} → {q[501][1]} → {q[261][1]} (t = 261) → {q[1][0]} (t = 981, 501, 261, 1), excess {q[981][2]} → "
        f"{q[501][2]} → {q[261][2]} → {q[1][2]}",
    )


def test_query_frame_excess_holds_family_wise():
    """Section 3's family-wise reading of the excess: each interval's width read as 2 x 1.96 standard errors, the
    smallest |excess| / se over the 15 rows, against Bonferroni's two-sided 5 % critical value for 15 (scipy)."""
    from scipy import stats

    z = []
    for organism in ORGANISMS:
        table = record(f"{ORGANISMS[organism]}/ip-adapter/table.csv")
        rows = table[table["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
        for note in rows[rows["setting"].str.startswith("trained organism")]["note"]:
            x, low, high = map(float, re.search(r"exact (-?[0-9.]+) \[(-?[0-9.]+), (-?[0-9.]+)\]", note).groups())
            assert high < 0
            z.append(-x / ((high - low) / (2 * 1.96)))
    critical = stats.norm.ppf(1 - 0.05 / (2 * len(z)))
    assert len(z) == 15 and min(z) > critical
    assert_in(
        "docs/findings.md",
        f"read as ±1.96 standard errors, each interval's width (`table.csv`, rounded) puts its excess at least "
        f"{int(min(z))} standard errors below 0 at every timestep of all three organisms, "
        f"where Bonferroni over those {len(z)} rows needs {critical:.1f} (two-sided 5%): the {len(z)} hold together",
    )


# ------------------------------------------------------------------------------------------- findings.md section 5
def test_finest_verdict_ranges_in_findings():
    ranges = {}
    for organism in ("support", "ip-adapter"):
        table = record(f"{ORGANISMS[organism]}/attribution/verdicts_trained.csv")
        table = table[table["resolution"] == "layer x head x position"]
        for population in ("same digit", "2+2 digits", "4 digits"):
            share = 100 * table[table["population"] == population]["pooling"].to_numpy(np.float64)
            ranges[organism, population] = f"{share.min():.0f}–{share.max():.0f}%"
    s, i = (lambda p, o=o: ranges[o, p] for o in ("support", "ip-adapter"))
    assert_in(
        "docs/findings.md",
        f"`pooling` covers {s('same digit')} of those cells with one-digit references on `support`, "
        f"{s('2+2 digits')} with 2 + 2 digits and {s('4 digits')} with four; on `ip-adapter` {i('same digit')}, "
        f"{i('2+2 digits')} and {i('4 digits')}",
    )


# ----------------------------------------------------------------------- attribution.md, the observational table
def observational_cells(weights: str, population: str) -> list[str]:
    """The first columns of a row of the observational table (``full/ip-adapter/attribution_<w>_<p>.csv``): TV from
    uniform (its range over timesteps and the largest upper end), attention n_eff, posterior n_eff first → last."""
    t = record(f"full/ip-adapter/attribution_{weights}_{population}.csv")
    tv = f"{t['attention_tv'].min():.3f}–{t['attention_tv'].max():.3f} (≤ {t['attention_tv_high'].max():.3f})"
    if f"{t['attention_tv'].max():.3f}" == f"{t['attention_tv_high'].max():.3f}":
        tv = f"{t['attention_tv'].max():.3f}"  # no spread to state
    neff = f"{t['attention_neff'].min():.2f}–{t['attention_neff'].max():.2f}"
    if neff.split("–")[0] == neff.split("–")[1]:
        neff = neff.split("–")[0]
    return [tv, neff, f"{t['posterior_neff'].iloc[0]:.2f} → {t['posterior_neff'].iloc[-1]:.2f}"]


@pytest.mark.parametrize("weights", ["trained", "untrained"])
@pytest.mark.parametrize("population, words", [("one", "one digit (100 sets)"), ("2+2", "2 + 2 digits (40 sets)")])
def test_observational_table(weights, population, words):
    t = record(f"full/ip-adapter/attribution_{weights}_{population}.csv")
    assert (t["verdict"] == "pooling").all() and len(t) == 5
    row = f"| {weights}, {words} | " + " | ".join(observational_cells(weights, population)) + " |"
    if weights == "trained":  # the ranking, the layers' agreement and the fitted bandwidth
        assert ((t["share_spearman_low"] < 0) & (t["share_spearman_high"] > 0)).all()
        assert np.isinf(t["fitted_bandwidth"]).all()
        row += (
            f" {signed(t['share_spearman'].iloc[0])} → {signed(t['share_spearman'].iloc[-1])}, every interval "
            f"includes 0, p ≥ {t['share_spearman_p'].min():.2f} | {signed(t['layer_agreement'].min())} to "
            f"{signed(t['layer_agreement'].max())} | ∞ at every t (lower ends "
            + "–".join("∞" if np.isinf(v) else f"{v:.0f}" for v in t["fitted_bandwidth_low"].agg(["min", "max"]))
            + ") | pooling × 5 |"
        )
    assert_in("docs/attribution.md", row)


# ------------------------------------------------------------------------ attribution.md, the two-3s-two-5s example
def test_two_plus_two_example():
    def row(organism, reference, group="all", steps="all"):
        t = record(f"{ORGANISMS[organism]}/attribution/example_3s_5s_trained.csv")
        return one(t, reference=reference, group=group, steps=steps)

    def ci(r):
        return f"{r['latent_effect']:.3f} [{r['latent_effect_low']:.3f}, {r['latent_effect_high']:.3f}]"

    def flips(r):
        return f"{r['flipped_count']} of {r['seeds']} [{100 * r['flipped_low']:.0f}%, {100 * r['flipped_high']:.0f}%]"

    five, three = row("support", "both 5s"), row("support", "both 3s")
    assert five["baseline_reads_5"] == 1.0 and three["flipped_count"] == 0
    assert_in(
        "docs/attribution.md",
        f"Ablating both 5s in every layer and step changes the latent by {ci(five)} and flips {flips(five)} "
        f"(to another digit); ablating both 3s changes it by {ci(three)} and flips none "
        f"[0%, {100 * three['flipped_high']:.0f}%].",
    )
    up, down, mid = (row("support", "both 5s", g) for g in ("up", "down", "mid"))
    thirds = " / ".join(
        f"{row('support', 'both 5s', 'all', s)['latent_effect']:.3f}" for s in ("0-6", "7-13", "14-19")
    )
    assert_in(
        "docs/attribution.md",
        f"(both 5s: {up['latent_effect']:.3f}, {up['flipped_count']} of 8 flips; down {down['latent_effect']:.3f}, "
        f"mid {mid['latent_effect']:.3f}), and the first third of the steps most ({thirds},",
    )
    five, three = row("ip-adapter", "both 5s"), row("ip-adapter", "both 3s")
    down, up = (row("ip-adapter", "both 5s", g)["latent_effect"] for g in ("down", "up"))
    thirds = " / ".join(
        f"{row('ip-adapter', 'both 5s', 'all', s)['latent_effect']:.3f}" for s in ("0-6", "7-13", "14-19")
    )
    assert_in(
        "docs/attribution.md",
        f"ablating both 5s flips {five['flipped_count']} of 8 (reads 5: {100 * five['baseline_reads_5']:.0f}% → "
        f"{100 * five['reads_5']:.0f}%; latent {ci(five)}), both 3s {three['flipped_count']} of 8 "
        f"({three['latent_effect']:.3f}); down ({down:.3f}) and up ({up:.3f}) blocks carry it alike, mid nothing; "
        f"thirds {thirds}.",
    )


# ------------------------------------------------------------------------------------------- findings.md section 4
def test_query_pool_claims():
    from scipy import stats

    tables = {o: record(f"{f}/ip-adapter/query_pool.csv") for o, f in ORGANISMS.items()}
    several = pd.concat([t[t["images"] > 1] for t in tables.values()])
    # the rows' two-sided t tests (scipy) and Holm over them, written out here
    p = np.sort(2 * stats.t.sf((several["difference"] / several["se"]).abs(), several["sets"] - 1))
    adjusted = np.maximum.accumulate(np.minimum(1, (len(p) - np.arange(len(p))) * p))
    assert (several["difference"] > 0).all() and (adjusted < 0.05).all()
    (sets,) = several["sets"].unique()
    assert_in(
        "docs/findings.md",
        f"over its {sets} sets (`difference / se`, {sets - 1} degrees of freedom) rejects 0 in all {len(p)} rows, "
        f"Holm over the {len(p)} (largest adjusted p {g(adjusted[-1])};",
    )
    assert (pd.concat(tables.values()).query("images == 1")["difference"] == 0).all()
    assert_in(
        "docs/findings.md",
        f"differences {several['difference'].min():.3f}–{several['difference'].max():.3f}, standard errors "
        f"{several['se'].min():.4f}–{several['se'].max():.4f})",
    )
    parts, cells = [], []
    for organism, t in tables.items():
        cond = t[(t["images"] > 1) & (t["branch"] == "cond")]

        def ends(n, cond=cond):
            part = cond[cond["images"] == n].set_index("timestep")["difference"]
            return f"{signed(part[981.0], 3)} → {signed(part[1.0], 3)}"

        uncond = signed(t[(t["images"] > 1) & (t["branch"] == "uncond")]["difference"].max(), 3)
        parts.append((organism, ends(3), ends(8), uncond))
        cells.append(f"{t['max_cell_difference'].max():.2f}")
    (_, a3, a8, au), (_, b3, b8, bu), (_, c3, c8, cu) = parts
    assert_in(
        "docs/findings.md",
        f"`support` cond {a3} (3 images) and {a8} (8 images) from t = 981 to 1, uncond up to {au}; `ip-adapter` {b3} "
        f"and {b8}, uncond up to {bu}; `mixed` {c3} and {c8}, uncond up to {cu}. Single cells move by up to "
        f"{cells[0]} (`support`), {cells[1]} (`ip-adapter`) and {cells[2]} (`mixed`).",
    )


def test_grid_effect_sizes():
    """The grid's mean RMS latent change per layer group (every step) and per step third (every layer), and of the
    scale-0.5 cell (``grid_trained.csv``)."""
    sizes = {}
    for organism in ("support", "ip-adapter"):
        t = record(f"{ORGANISMS[organism]}/attribution/grid_trained.csv")
        ablate = t[t["mode"] == "ablate"]
        group = ablate[ablate["steps"] == "all"].groupby("group")["latent_effect"].mean()
        third = ablate[ablate["group"] == "all"].groupby("steps")["latent_effect"].mean()
        sizes[organism] = (group, third, t[t["mode"] == "scale"]["latent_effect"].mean())
    (g, s, scale), (h, u, scale_ip) = sizes["support"], sizes["ip-adapter"]
    assert_in(
        "docs/attribution.md",
        f"changes the final latent by {g['up']:.2f} on `support` (down {g['down']:.2f}, mid {g['mid']:.3f}; all "
        f"layers {g['all']:.2f}), and by {h['up']:.2f} on `ip-adapter`, where the down blocks carry almost as much "
        f"({h['down']:.2f}; mid {h['mid']:.3f}; all {h['all']:.2f}). By step third (all layers) it is "
        f"{s['0-6']:.2f} / {s['7-13']:.2f} / {s['14-19']:.2f} on `support` and {u['0-6']:.2f} / {u['7-13']:.2f} / "
        f"{u['14-19']:.2f} on `ip-adapter`",
    )
    assert_in("docs/attribution.md", f"about half as much as removing it ({scale:.2f} and {scale_ip:.2f})")


def test_full_tier_shuffle_and_tracking():
    r = {
        (o, w): record(f"{ORGANISMS[o]}/attribution/shuffled_{w}.csv").max()
        for o in ("support", "ip-adapter")
        for w in ("trained", "untrained")
    }
    s, i, su, iu = (
        r["support", "trained"],
        r["ip-adapter", "trained"],
        r["support", "untrained"],
        r["ip-adapter", "untrained"],
    )
    norm = max(s["first_step_contribution_norm_max_diff"], i["first_step_contribution_norm_max_diff"])
    post = max(s["first_step_posterior_weight_max_diff"], i["first_step_posterior_weight_max_diff"])
    assert s["first_step_sq_distance_max_diff"] == i["first_step_sq_distance_max_diff"] == 0  # "distances equal"
    assert_in(
        "docs/attribution.md",
        f"final latents within {e(s['latent_max_diff'])} (`support`) and {e(i['latent_max_diff'])} (`ip-adapter`) "
        f"for the trained organisms, {e(su['latent_max_diff'])} and {e(iu['latent_max_diff'])} (at |x| up to "
        f"{su['latent_max_abs']:.0f} and {iu['latent_max_abs']:.0f}) for the untrained ones, whose random weights "
        f"amplify rounding; at the first step the shares within {e(s['first_step_share_max_diff'])} and "
        f"{e(i['first_step_share_max_diff'])} trained, contribution norms within {e(norm)}, posterior weights within "
        f"{e(post)}, distances equal",
    )
    t = record("full/attribution/verdicts_trained.csv")
    cells = t[t["resolution"] != "average"]
    top = cells.loc[cells["tracks_posterior"].idxmax()]
    assert (top["population"], top["resolution"]) == ("4 digits", "layer x head")
    for folder in ORGANISMS.values():  # the largest over every trained organism's cells is support's
        other = record(f"{folder}/attribution/verdicts_trained.csv")
        assert other[other["resolution"] != "average"]["tracks_posterior"].max() <= top["tracks_posterior"]
    assert_in(
        "docs/attribution.md", f"at most {100 * top['tracks_posterior']:.1f}% of any resolution's cells at any step"
    )
    same = cells[cells["population"] == "same digit"]
    same = same.loc[same["tracks_posterior"].idxmax()]
    assert same["resolution"] == "layer x head"
    assert_in(
        "docs/attribution.md", f"the same-digit sets reach {100 * same['tracks_posterior']:.0f}% (`support`, per head)"
    )


# ------------------------------------------------------- attribution.md and findings.md section 6: fresh sets (#52.1)
FRESH_ORGANISMS = ("support", "ip-adapter", "mixed")
FRESH_WORDS = {
    "output_digit": "reading the output's digit",
    "contribution_norm": "contribution norm",
    "attention_share": "attention share",
    "attribution_patching": "attribution patching",
    "integrated_patching": "integrated patching",
}


def fresh_rows(predictors: dict[str, str] = FRESH_WORDS) -> list[str]:
    """attribution.md's two tables of the fresh sets, row by row, from ``attribution_fresh/summary.csv``."""
    table = record("attribution_fresh/summary.csv")
    agreement, calibration = [], []
    for predictor, words in predictors.items():
        rows = [one(table, organism=o, predictor=predictor) for o in FRESH_ORGANISMS]
        agreement.append(
            f"| {words} | "
            + " | ".join(f"{r['hits']} of {r['decided']} (≥ {r['agreement_low']:.2f}, p {g(r['p'])})" for r in rows)
            + " |"
        )
        calibration.append(
            f"| {words} | "
            + " | ".join(
                f"{signed(r['spearman'])}; {e(r['slope'])}; {e(r['median_predicted'])} vs {e(r['median_real'])}"
                for r in rows
            )
            + " |"
        )
    return agreement + calibration


def test_fresh_set_tables():
    for row in fresh_rows():
        assert_in("docs/attribution.md", row)
    table = record("attribution_fresh/summary.csv")
    for organism in FRESH_ORGANISMS:
        r = one(table, organism=organism, predictor="output_digit")
        assert_in("docs/attribution.md", f"`{organism}`: {r['decided']} of {r['sets']} sets decided")
    read = [one(table, organism=o, predictor="output_digit") for o in FRESH_ORGANISMS]
    aside, third = (
        ", ".join(str(r[k]) for r in read[:-1]) + f" and {read[-1][k]}" for k in ("set_aside", "third_digit")
    )
    assert_in("docs/attribution.md", f"(set aside: {aside} sets, of which {third} show a third digit)")


def fresh_claims() -> list[str]:
    """The prose of the fresh-set section (attribution.md, findings.md section 6), rebuilt from ``summary.csv``."""
    table = record("attribution_fresh/summary.csv")
    by = {(r["organism"], r["predictor"]): r for r in table.to_dict(orient="records")}
    read = [by[o, "output_digit"] for o in FRESH_ORGANISMS]
    hits = ", ".join(f"{r['hits']} of {r['decided']}" for r in read[:-1]) + f" and {read[-1]['hits']} of "
    slopes, ranks = [r["slope"] for r in read], [r["spearman"] for r in read]

    def medians(predictor: str, key: str = "median_predicted") -> str:
        return " / ".join(e(by[o, predictor][key]) for o in FRESH_ORGANISMS)

    return [
        f"chooses the deciding pair in {hits}{read[-1]['decided']} decided sets",
        f"(slopes {e(min(slopes))}–{e(max(slopes))}, Spearman at least {signed(min(ranks))})",
        fresh_chance_claim(),
        f"{medians('attribution_patching')} (first order) and {medians('integrated_patching')} (integrated, 2 "
        f"points) against real drops of {medians('output_digit', 'median_real')}",
    ]


#: The predictors as the chance sentence names them.
FRESH_NAMES = {
    "contribution_norm": "the contribution norm",
    "attention_share": "the attention share",
    "attribution_patching": "attribution patching",
    "integrated_patching": "integrated patching",
    "cheap_ablation": "the cheap ablation",
}


def listed(items: list[str]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else items[0]


def fresh_chance_claim(sets: int | None = None, survivors: bool = False) -> str | list[tuple[str, str]]:
    """Which predictors other than reading the output agree above chance: unadjusted, and after Holm over the
    table's tests of them, recomputed from ``records.csv`` (``fresh_well_posed``), scipy's binomial p and Holm here;
    ``""`` where none does unadjusted; ``survivors``: the (organism, predictor) that remain after Holm instead."""
    from scipy import stats

    facts = fresh_well_posed(FRESH_WORDS | FRESH_CHEAP, sets)
    keys = [(o, p) for p in FRESH_NAMES for o in FRESH_ORGANISMS]
    n = {key: facts[key[0]]["well"] for key in keys}
    k = {(o, p): facts[o]["hits"][p] for o, p in keys}
    pv = np.array([stats.binomtest(k[key], n[key], 0.5, alternative="greater").pvalue for key in keys])
    order = np.argsort(pv)
    adjusted = np.empty(len(pv))
    adjusted[order] = np.minimum(1, np.maximum.accumulate((len(pv) - np.arange(len(pv))) * pv[order]))
    low = {key: pv[i] < 0.05 for i, key in enumerate(keys)}  # unadjusted
    above = [
        f"{FRESH_NAMES[p]} on " + listed([f"`{o}`" for o in FRESH_ORGANISMS if low[o, p]])
        for p in FRESH_NAMES
        if any(low[o, p] for o in FRESH_ORGANISMS)
    ]
    ranked = sorted(zip(keys, adjusted, strict=True), key=lambda x: x[1])
    if survivors:
        return [key for key, a in ranked if a < 0.05]
    if not above:
        return ""
    kept = [a for key, a in ranked if a < 0.05]
    dropped = [f"{FRESH_NAMES[p]} on `{o}`" for (o, p), a in ranked if low[o, p] and a >= 0.05]
    held = (f"all of them but {listed(dropped)}" if dropped else "all of them") if kept else "none of them"
    span = f" (Holm {g(min(kept))} to {g(max(kept))})" if kept else ""
    return (
        f"unadjusted, {listed(above)} agree above chance (p below 0.05); after Holm over the table's {len(keys)} "
        f"tests of predictors other than reading the output, {held} remain{span}"
    )


def fresh_survivors(sets: int | None = None, cheap: bool = False) -> str:
    """The predictors read from the model (``cheap``: the cheap ablation instead) that agree above chance after Holm,
    per predictor with its organisms, in the table's order."""
    kept = fresh_chance_claim(sets, survivors=True)
    names = ["cheap_ablation"] if cheap else [p for p in FRESH_NAMES if p != "cheap_ablation"]
    return listed(
        [
            f"{FRESH_NAMES[p]} on " + listed([f"`{o}`" for o in FRESH_ORGANISMS if (o, p) in kept])
            for p in names
            if any((o, p) in kept for o in FRESH_ORGANISMS)
        ]
    )


def test_fresh_set_claims():
    for claim in fresh_claims():
        assert_in("docs/attribution.md", claim)
        assert_in("docs/findings.md", claim)
    assert fresh_chance_claim(sets=16) == ""  # the record's first 16 sets, the first run: none above chance
    earlier = f"At 16 sets per organism none did, at 32 only {len(fresh_chance_claim(sets=32, survivors=True))} did ("
    assert_in("docs/attribution.md", earlier + fresh_survivors(32, cheap=True) + ", " + fresh_survivors(32) + ").")
    assert_in("docs/findings.md", "At 16 sets per organism none did, at 32 two.")
    assert len(fresh_chance_claim(sets=32, survivors=True)) == 2
    model = fresh_survivors()
    assert_in("docs/attribution.md", f"after Holm {model} agree above chance")
    assert_in("docs/attribution.md", f"Read from the model, {model} agree above chance after Holm")
    assert_in("docs/attribution.md", f"above chance after Holm on {fresh_survivors(cheap=True).split(' on ', 1)[1]}")
    patching = record("attribution_fresh/summary.csv").query("predictor == 'attribution_patching'")
    ratio = patching["median_real"] / patching["median_predicted"]
    assert_in("docs/attribution.md", f"median drop {ratio.min():,.0f} to {ratio.max():,.0f} times too small")


def test_patching_ranking_is_described_not_decided():
    """The two patching estimates' calibration Spearman: positive on every organism, the range the docs give; the
    docs decide nothing on its per-row intervals (the sentence says so)."""
    table = record("attribution_fresh/summary.csv")
    patching = table[table["predictor"].isin(["attribution_patching", "integrated_patching"])]
    sets = record("attribution_fresh/records.csv").groupby("organism")["set"].nunique()
    assert len(patching) == 6 and (patching["spearman"] > 0).all() and (patching["sets"] == sets.min()).all()
    span = f"{signed(patching['spearman'].min())} to {signed(patching['spearman'].max())}"
    assert_in(
        "docs/attribution.md",
        f"drop is positive on every organism ({span}), but whether they rank the pairs is not decided",
    )
    assert_in(
        "docs/findings.md", f"real drop is positive on every organism ({span}; no interval: a percentile bootstrap"
    )


def test_controls_family_wise_reading():
    """attribution.md's reading of the controls' unadjusted rows: each interval's width as 2 x 1.96 standard errors,
    |difference| / se against Bonferroni over an organism's rows (Student's t with the control's 20 sets, scipy)."""
    from scipy import stats

    cleared, others = [], []
    for folder in ORGANISMS.values():
        t = record(f"{folder}/attribution/controls_trained.csv")
        critical = stats.t.ppf(1 - 0.05 / (2 * len(t)), 19)
        z = (t["difference"] / ((t["high"] - t["low"]) / (2 * 1.96))).abs()
        concentration = t["statistic"].str.contains("tv")
        assert len(t) == 80 and concentration.sum() == 40
        cleared.append(str(int((z[concentration] > critical).sum())))
        others.append(int((z[~concentration] > critical).sum()))
    assert others == [0, 0, 0]
    assert_in(
        "docs/attribution.md",
        "Read as ±1.96 standard errors against Bonferroni over the 80 rows with the control's 20 sets "
        f"(Student's t, 19 degrees of freedom: {critical:.2f}), {', '.join(cleared[:-1])} and {cleared[-1]} of the 40 "
        "concentration rows (`support`, `ip-adapter`, `mixed`) clear it, and none of the other 40)",
    )


@pytest.mark.parametrize("folder", ["full", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke"])
def test_one_reference_ablation_interval_is_over_sets(folder):
    """The tables' "ablating one reference" interval: a set's 4 references share its generation, so the interval is
    a bootstrap-t of the set means (the test's own, with the tables' seeded draws), not of the 4 x sets rows."""
    for label in ("trained", "untrained"):
        effects = record(f"{folder}/attribution/effects_{label}.csv")
        per_set = effects.groupby("set")["latent_effect"].mean().to_numpy()
        assert (effects.groupby("set").size() == 4).all()  # balanced: the mean of set means is the rows' mean
        n, mean = len(per_set), per_set.mean()
        samples = per_set[np.random.default_rng(0).integers(0, n, (9999, n))]
        t = (samples.mean(1) - mean) / (samples.std(1, ddof=1) / np.sqrt(n))
        upper, lower = np.quantile(t, [0.975, 0.025]) * per_set.std(ddof=1) / np.sqrt(n)
        row = f"RMS latent change {effects['latent_effect'].mean():.3f} [{mean - upper:.3f}, {mean - lower:.3f}]"
        text = (RESULTS / folder / "attribution" / "table.md").read_text()
        assert f"| {label} organism | {row};" in text, row


def agreement_cell(k: int, n: int) -> tuple[str, float]:
    """``k`` hits of ``n`` as the agreement tables write them, recomputed with scipy: the one-sided exact
    (Clopper-Pearson) 95 % lower bound and the one-sided binomial p of agreement above 1/2; and that p."""
    from scipy import stats

    test = stats.binomtest(k, n, 0.5, alternative="greater")
    return f"{k} of {n} (≥ {test.proportion_ci(method='exact').low:.2f}, p {g(test.pvalue)})", test.pvalue


def fresh_held_out_rows() -> list[str]:
    """attribution.md's table of the held-out choice on the fresh sets, row by row from ``held_out.csv``."""
    table = record("attribution_fresh/held_out.csv")
    rows = []
    for (organism, pool, fold), part in table.groupby(["organism", "pool", "fold"], sort=False):
        held, read = one(part, predictor="held out"), one(part, predictor="output_digit")
        rows.append(
            f"| `{organism}` | {pool} | {fold} | `{held['chosen'].replace(' | ', ', ')}` ({held['choosing_hits']} of "
            f"{held['choosing_decided']}) | {held['hits']} of {held['decided']} (≥ {held['agreement_low_holm']:.2f}, "
            f"p {g(held['p'])}, Holm {g(held['p_holm'])}) | {signed(held['spearman'])}; "
            f"{e(held['median_predicted'])} vs {e(held['median_real'])} | "
            f"{read['hits']} of {read['decided']} (p {g(read['p'])}) |"
        )
    return rows


def test_fresh_held_out_bounds_are_holm_compatible():
    """The held-out table's bounds, recomputed here: Holm over the 12 held-out binomial p (scipy), then Strassburger
    and Bretz's bound for Holm with null 1/2: the exact one-sided bound at 5 % / (retained count) capped at 1/2 for a
    retained test, 1/2 for a rejected one (while some are retained), the uncapped bound at 5 % / 12 when all are."""
    from scipy import stats

    held = record("attribution_fresh/held_out.csv").query("predictor == 'held out'")
    k, n = held["hits"].to_numpy(), held["decided"].to_numpy()
    p = np.array([stats.binomtest(a, b, 0.5, alternative="greater").pvalue for a, b in zip(k, n, strict=True)])
    order = np.argsort(p)
    adjusted = np.empty(len(p))
    adjusted[order] = np.minimum(1, np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]))
    np.testing.assert_allclose(held["p_holm"], adjusted, rtol=1e-12)
    rejected = adjusted < 0.05
    kept = int((~rejected).sum())
    level = 0.05 / (kept or len(p))
    tests = [stats.binomtest(a, b, alternative="greater") for a, b in zip(k, n, strict=True)]
    exact = np.array([test.proportion_ci(1 - level).low for test in tests])
    expected = np.where(rejected, 0.5 if kept else np.maximum(0.5, exact), np.minimum(0.5, exact))
    np.testing.assert_allclose(held["agreement_low_holm"], expected, rtol=1e-9, atol=1e-12)
    low = held["agreement_low_holm"].to_numpy()
    assert ((low > 0.5) <= rejected).all() and (rejected <= (low >= 0.5)).all()
    assert len(p) == 12 and kept in (0, len(p))  # the sentence below says which of the two
    state = (
        "retained, the exact one-sided bound at 5% / 12 capped at 1/2"
        if kept
        else "rejected, the exact one-sided bound at 5% / 12 raised to 1/2 where below"
    )
    assert_in("docs/attribution.md", f"with all {len(p)} tests {state}, holding for the {len(p)} together")


def test_fresh_held_out_table_and_claims():
    """The held-out choice on the fresh sets: the table, and the prose's counts of what was chosen and what agreed."""
    for row in fresh_held_out_rows():
        assert_in("docs/attribution.md", row)
    table = record("attribution_fresh/held_out.csv")
    held = table[table["predictor"] == "held out"]
    assert len(held) == 12 and (held["candidates"].groupby(held["pool"]).nunique() == 1).all()
    sizes = held.groupby("pool")["candidates"].first()
    own, every = held[held["pool"] == "without the posterior"], held[held["pool"] == "every candidate"]
    posterior = every[every["chosen"].str.startswith("posterior_weight")]
    late = posterior["chosen"].str.extract(r"t=(\d+)")[0].astype(int)
    assert (late < 651).all()  # read after the output is decided: near-circular
    claims = [
        f"among {sizes['every candidate']} candidates ({sizes['without the posterior']} without the posterior;",
        f"Without the posterior, the choice agrees above chance in {int((own['p'] < 0.05).sum())} of {len(own)} "
        f"folds at an unadjusted p below 0.05 (smallest {g(own['p'].min())})",
        f"with it, {len(posterior)} of {len(every)} folds choose the exact posterior at t ≤ {late.max()}",
        f"{int((held['p_holm'] < 0.05).sum())} of {len(held)} survive Holm over the table's {len(held)} held-out "
        f"tests (largest {g(held['p_holm'].max())})",
    ]
    assert (held["p_holm"] < 0.05).all()  # "in every fold"
    read = table[table["predictor"] == "output_digit"]
    assert (read["hits"] == read["decided"]).all()  # "where the output's digit is right in all"
    fewer = held["hits"].to_numpy() < read["hits"].to_numpy()
    assert (held["hits"].to_numpy() <= read["hits"].to_numpy()).all()  # no fold more often than reading the output
    for name in ("docs/attribution.md", "docs/findings.md"):
        more = "right more often than reading the output's digit on the same sets"
        assert_in(name, f"{more} (less often in {fewer.sum()} of {len(held)}")
    kinds = set(own[own["organism"] == "ip-adapter"]["chosen"].str.split(" | ", regex=False).str[0])
    assert kinds == {"integrated_patching", "contribution_projection"}  # "integrated patching and that projection"
    projection = held[(held["organism"] == "support")]["chosen"].str.startswith("contribution_projection")
    claims.append(f"on `support` {int(projection.sum())} of {len(projection)} folds choose the contribution on the")
    same = held.groupby(["organism", "pool"], sort=False)["chosen"].agg(
        lambda c: c.iloc[0] if c.nunique() == 1 else ""
    )
    again = {c: [(o, pool) for (o, pool), d in same.items() if d == c] for c in set(same) - {""}}
    assert list(again) == ["integrated_patching"]  # the one choice both halves make
    places = again["integrated_patching"]
    pools = {o: [pool for x, pool in places if x == o] for o in dict.fromkeys(o for o, _ in places)}
    where = [f"`{o}` ({'both pools' if len(p) == 2 else p[0]})" for o, p in pools.items()]
    claims.append(f"Both halves choose integrated patching on {listed(where)}; every other choice differs")
    claims.append(f"and {int((posterior['p'] < 0.05).sum())} of those agree at an unadjusted p below 0.05")
    pooled = [int(own[own["organism"] == o]["hits"].sum()) for o in FRESH_ORGANISMS]
    decided = [int(own[own["organism"] == o]["decided"].sum()) for o in FRESH_ORGANISMS]
    counts = [f"{k} of {n}" for k, n in zip(pooled, decided, strict=True)]
    claims.append(f"pooled agreement without the posterior {listed(counts)}, where the output's digit is right in all")
    claims.append(
        f"among {sizes['every candidate']} candidates ({sizes['without the posterior']} without the posterior)"
    )
    for claim in claims:
        assert_in("docs/attribution.md", claim)
    assert_in("docs/findings.md", claims[1])
    assert_in("docs/findings.md", f"with it, the posterior is chosen in {len(posterior)} folds, at steps after the")
    # the pooled rows: every decided set tested once, recomputed here from the folds' counts
    for pool, words in (("without the posterior", "without the posterior"),
                        ("every candidate", "every candidate (near-circular where the posterior)")):  # fmt: skip
        cells = []
        for organism in FRESH_ORGANISMS:
            part = held[(held["pool"] == pool) & (held["organism"] == organism)]
            cells.append(agreement_cell(int(part["hits"].sum()), int(part["decided"].sum()))[0])
        assert_in("docs/attribution.md", f"| the held-out choice, {words} | " + " | ".join(cells) + " |")


def fresh_well_posed(predictors: dict[str, str] = FRESH_WORDS, sets: int | None = None) -> dict[str, dict]:
    """Per organism, from ``records.csv`` alone (its first ``sets`` sets, or all): the sets where one pair's removal
    alone flips the digit, those of them whose clean output is a third digit (its ``clean_label`` is neither the set's
    ``a`` nor its ``b``), and every predictor's hits on the others (the decided sets)."""
    records = record("attribution_fresh/records.csv")
    records = records if sets is None else records[records["set"] < sets]
    out = {}
    for organism in FRESH_ORGANISMS:
        frame = records[records["organism"] == organism]
        assert (frame.groupby("set")["clean_label"].nunique() == 1).all()  # one generation per set
        sets = frame.groupby("set").first()  # (S,) a, b, clean_label
        flipped = frame.pivot(index="set", columns="pair", values="flipped").astype(bool)  # (S, 2)
        single = flipped.sum(axis=1) == 1
        other = (sets["clean_label"] != sets["a"]) & (sets["clean_label"] != sets["b"])
        third, well = single & other, single & ~other
        truth = flipped.idxmax(axis=1)[well]  # the deciding pair
        clean = frame.pivot(index="set", columns="pair", values="output_digit")  # P(pair's digit), clean output
        hits = {}
        for predictor in predictors:
            score = frame.pivot(index="set", columns="pair", values=predictor)[well]
            hits[predictor] = int((np.where(score["a"] >= score["b"], "a", "b") == truth.to_numpy()).sum())
        out[organism] = {
            "single": int(single.sum()), "third": list(third[third].index), "well": int(well.sum()), "hits": hits,
            "largest": float(clean[third].to_numpy().max()), "other": int(other.sum()), "sets": len(sets),
            "both_small": int((clean[third].max(axis=1) < 1e-3).sum()),  # both pairs' P(digit) below 0.001
        }  # fmt: skip
    return out


def test_fresh_third_digit_sets():
    """Issue #52 point 3: the sets whose output is a third digit are left out of the decided sets, and counted."""
    from scipy import stats

    facts = fresh_well_posed()
    summary = record("attribution_fresh/summary.csv")
    for organism, f in facts.items():  # the summary's counts, recomputed from the records alone
        for predictor, k in f["hits"].items():
            row = one(summary, organism=organism, predictor=predictor)
            assert (row["hits"], row["decided"]) == (k, f["well"])
            assert (row["third_digit"], row["set_aside"]) == (f["other"], f["sets"] - f["well"])
    for name in ("docs/attribution.md", "docs/findings.md"):
        counts = [f"{len(facts[o]['third'])} of {facts[o]['single']}" for o in FRESH_ORGANISMS]
        assert_in(name, f"In {', '.join(counts[:-1])} and {counts[-1]} sets where one pair's")
    third = "; ".join(f"`{o}` {', '.join(map(str, facts[o]['third']))}" for o in FRESH_ORGANISMS)
    assert_in("docs/attribution.md", f"({third})")
    largest = max(f["largest"] for f in facts.values())
    small = sum(f["both_small"] for f in facts.values())
    total = sum(len(f["third"]) for f in facts.values())
    assert_in(
        "docs/attribution.md", f"at most {e(largest)} for both pairs, below 0.001 for both in {small} of {total}"
    )
    ps, cells = {}, {}
    for organism, f in facts.items():
        for predictor, k in f["hits"].items():
            cells[organism, predictor], ps[organism, predictor] = agreement_cell(k, f["well"])
    for predictor, words in FRESH_WORDS.items():
        assert_in("docs/attribution.md", f"| {words} | " + " | ".join(cells[o, predictor] for o in FRESH_ORGANISMS))
    read = [facts[o]["hits"]["output_digit"] for o in FRESH_ORGANISMS]
    assert read == [facts[o]["well"] for o in FRESH_ORGANISMS]  # "every decided set"
    assert_in("docs/findings.md", f"(P(pair's digit) at most {e(largest)} for both pairs;")
    summary = record("attribution_fresh/summary.csv")  # "no predictor read from the model has as many hits"
    assert all(f["hits"]["output_digit"] > max(k for p, k in f["hits"].items() if p != "output_digit")
               for f in facts.values())  # fmt: skip
    for organism in FRESH_ORGANISMS:
        part = summary[summary["organism"] == organism].set_index("predictor")["hits"]
        assert part.drop("output_digit").max() < part["output_digit"]
    # the paired exact sign test of reading the output against the best predictor read from the model, per organism
    # reading the output is right in every well-posed set: the discordant sets are the other predictor's misses
    signs, apart, decided = [], [], []
    for organism, f in facts.items():
        apart.append(f["well"] - max(k for p, k in f["hits"].items() if p != "output_digit"))
        p = stats.binomtest(apart[-1], apart[-1], 0.5, alternative="greater").pvalue
        signs.append(g(p))
        decided += [f"`{organism}`"] if p < 0.05 else []
    tested = f"p {' / '.join(signs)} (`support`, `ip-adapter`, `mixed`; {apart[0]}, {apart[1]} and {apart[2]} such"
    assert_in("docs/attribution.md", tested)
    best = [max((k, p) for p, k in f["hits"].items() if p != "output_digit")[1] for f in facts.values()]
    assert best == ["contribution_norm", "integrated_patching", "integrated_patching"]  # the sentence's best
    assert_in("docs/attribution.md", "sets; the contribution norm on `support`, integrated patching on the others)")
    assert decided == ["`support`", "`ip-adapter`"]  # the words below
    assert_in("docs/attribution.md", f"(fewer by the exact sign test on {listed(decided)}, not on `mixed`)")
    assert_in("docs/attribution.md", f"does better than the best predictor read from the model on {listed(decided)}")
    assert_in(  # "Not measured": the organism the sign test leaves undecided
        "docs/findings.md",
        f"(on `mixed`, {facts['mixed']['well']} decided sets leave reading the output against integrated patching "
        "undecided)",
    )


# --------------------------------------------- the numbers the inventory found unread (issue #52 point 4), by doc
def table_rows(name: str, heading: str) -> list[list[str]]:
    """The cells of the first markdown table after ``heading`` in a committed doc (a benchmark's printed record)."""
    lines = (ROOT / name).read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|")) + 2  # the header and its rule
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]


def test_query_frame_peak_and_pearson():
    """Section 3: where the query-frame rho peaks, and the trained ``qf_pearson`` means (``table.csv``'s notes)."""
    peaks, pearson = set(), {}
    for organism in ("support", "ip-adapter"):
        table = record(f"{ORGANISMS[organism]}/ip-adapter/table.csv")
        rows = table[table["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
        rows = rows[rows["setting"].str.startswith("trained organism")]
        steps = rows["setting"].str.extract(r"t=(\d+)")[0].astype(int).to_numpy()
        rho = rows["ours"].str.split().str[0].astype(float).to_numpy()
        peaks.add(int(steps[rho.argmax()]))
        assert rho[steps == 1] < rho.max()
        values = dict(zip(steps, rows["note"].str.extract(r"Pearson ([0-9.]+)")[0], strict=True))
        pearson[organism] = " → ".join(values[t] for t in (981, 501, 1))
    (peak,) = peaks
    assert_in("docs/findings.md", f"the query-frame ρ rises until t = {peak} and turns back by t = 1")
    assert_in(
        "docs/findings.md",
        f"(`support` {pearson['support']} at t = 981, 501, 1; `ip-adapter` {pearson['ip-adapter']})",
    )


def test_query_frame_excess_margins():
    """Section 3: the excess intervals' largest half-width and smallest distance from 0 (kept apart: the section's
    intervals may be redone)."""
    half, size = [], []
    for organism in ("support", "ip-adapter"):
        table = record(f"{ORGANISMS[organism]}/ip-adapter/table.csv")
        rows = table[table["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
        rows = rows[rows["setting"].str.startswith("trained organism")]
        both = rows["note"].str.extract(r"exact (-?[0-9.]+) \[(-?[0-9.]+), (-?[0-9.]+)\]").astype(float)
        assert (both[2] < 0).all()  # every interval below 0
        half += list((both[2] - both[1]) / 2)
        size += list(both[0].abs())
    assert_in("docs/findings.md", f"the half-widths are ≤ {max(half):.3f} for differences ≥ {min(size):.3f}")


def test_item_pool_and_pooling_bound():
    """Section 4: the item pool's spread over 1, 3 and 8 images at t = 981; section 5: the average's TV bound."""
    spread = max(
        record(f"{f}/ip-adapter/query_pool.csv").query("timestep == 981").groupby("branch")["item"].agg(np.ptp).max()
        for f in ORGANISMS.values()
    )
    assert_in("docs/findings.md", f"differ only by seed: within {spread:.3f} at t = 981 on every organism")
    tv = max(
        record(f"{ORGANISMS[o]}/ip-adapter/attribution_trained_{p}.csv")["attention_tv"].max()
        for o in ("support", "ip-adapter")
        for p in ("one", "2+2")
    )
    assert_in("docs/findings.md", f"(attention within {100 * tv:.1f}% TV of uniform at every timestep)")


def test_survivors_in_findings():
    """Section 6: the per-step survivors after Holm that findings.md names, and the grid's mid block, the fresh
    sets' halves and the 2 + 2 example as it restates them."""
    table = {o: record(f"{ORGANISMS[o]}/attribution/comparisons_trained.csv") for o in ORGANISMS}
    steps = {o: t[t["predicts"] & (t["timestep"] != "all")] for o, t in table.items()}
    posterior = {
        o: sorted(set(t.loc[t["predictor"] == "posterior_weight", "timestep"]), key=float, reverse=True)
        for o, t in steps.items()
    }
    assert posterior["ip-adapter"] == [] and posterior["mixed"] == ["1"] and posterior["support"][-1] == "1"
    listed = ", ".join(posterior["support"][:-1]) + f" and {posterior['support'][-1]}"
    assert_in("docs/findings.md", f"the posterior survives at t = {listed} on `support` and at t = 1 on `mixed`")
    assert_in("docs/findings.md", f"at t = {listed} the output is decided")
    assert_in("docs/attribution.md", f"The posterior's survivals at t = {listed} are read after")
    assert not any((t["predictor"] == "contribution_projection").any() for t in steps.values())
    assert_in("docs/findings.md", "the contribution projection survives nowhere")
    norm = {o: t[t["predicts"] & (t["predictor"] == "contribution_norm")] for o, t in table.items()}
    whole = [(o, r.effect) for o, t in norm.items() for r in t.itertuples() if r.timestep == "all"]
    assert whole == [("support", "latent_effect")] and len(norm["ip-adapter"]) == 0
    assert (norm["support"]["effect"] == "latent_effect").all() and len(norm["support"]) == 6
    (late,) = norm["mixed"].itertuples()
    assert late.effect == "class_drop"
    assert_in(
        "docs/findings.md",
        "the contribution norm's step mean survives on `support`'s latent change only (there at every recorded step "
        f"too; on `mixed` at t = {late.timestep} alone, on the drop)",
    )
    mid = max(
        record(f"{f}/attribution/grid_trained.csv")
        .query("group == 'mid'")
        .groupby("steps")["latent_effect"]
        .mean()
        .max()
        for f in ORGANISMS.values()
    )
    assert_in("docs/findings.md", f"the mid block's largest mean effect is {mid:.3f}")
    assert_in("docs/attribution.md", f"its largest mean effect {mid:.3f})")
    held = record("attribution_fresh/held_out.csv").query("predictor == 'held out'")
    decided = pd.concat([held["decided"], held["choosing_decided"]])
    assert (held["sets"] == held["sets"].iloc[0]).all()
    assert_in(
        "docs/findings.md",
        f"swap; {held['sets'].iloc[0]} sets a half; each held-out half decides on {decided.min()}–{decided.max()} "
        "sets",
    )
    assert_in(
        "docs/attribution.md",
        f"each half holds {held['sets'].iloc[0]} sets, of which {decided.min()}–{decided.max()} are decided",
    )


def test_example_flips_in_findings():
    """Section 6's 2 + 2 example: flips with their Clopper-Pearson intervals (kept apart: intervals may be redone)."""
    t = record("full/attribution/example_3s_5s_trained.csv")
    five, three = (one(t, reference=r, group="all", steps="all") for r in ("both 5s", "both 3s"))
    assert_in(
        "docs/findings.md",
        f"(`support`: both 5s ablated {five['flipped_count']} of {five['seeds']} [{100 * five['flipped_low']:.0f}%, "
        f"{100 * five['flipped_high']:.0f}%], both 3s {three['flipped_count']} of {three['seeds']} "
        f"[{100 * three['flipped_low']:.0f}%, {100 * three['flipped_high']:.0f}%])",
    )


def test_nw_quality_prose():
    """Section 7's words on its table: the NW heads' range against the adapter switched off."""
    t = record("nw_quality/rates.csv").set_index(["recipe", "method"])
    nw = t[t.index.get_level_values("method").str.startswith("nw_head")]
    weak = ("ip-adapter", "nw_head_stored")
    rest, off = 100 * nw.drop(weak)["rate"], 100 * t.xs("adapter_off", level="method")["rate"]
    assert off.nunique() == 1 and t.loc[weak, "rate"] < rest.min() / 100
    assert_in(
        "docs/findings.md",
        f"({rest.min():.0f}–{rest.max():.0f}% against {off.iloc[0]:.0f}%, except the stored-frame head on "
        f"`ip-adapter`, {100 * t.loc[weak, 'rate']:.0f}%)",
    )
    q, st = (100 * t.loc[("ip-adapter", m), "rate"] for m in ("nw_head_query", "nw_head_stored"))
    assert_in("docs/findings.md", f"the query-frame head ({q:.0f}%) is above the stored-frame one ({st:.0f}%)")


def test_nw_quality_intervals_meet():
    """Section 7: no NW head's clustered interval lies wholly above the adapter switched off; where they meet (kept
    apart: the intervals may be redone)."""
    t = record("nw_quality/rates.csv").set_index(["recipe", "method"])
    nw = t[t.index.get_level_values("method").str.startswith("nw_head")]
    lows = 100 * nw.xs("support", level="recipe")["low"]
    assert (np.round(lows) == np.round(100 * t.loc[("support", "adapter_off"), "high"])).all()
    off_high = t.xs("adapter_off", level="method")["high"].reindex(nw.index.get_level_values("recipe"))
    assert (nw["low"].to_numpy() <= off_high.to_numpy()).all()  # no NW head's interval wholly above adapter off
    assert_in("docs/findings.md", f"(on `support` they meet at {lows.iloc[0]:.0f}%)")


def digits_record(organism: str, name: str) -> dict:
    return json.loads((RESULTS / "digits" / organism / name).read_text())


def test_organism_rates_in_prose():
    """The organisms' rates as the README and findings.md's last section state them (``digits/<recipe>/``)."""
    on, off = "adapter on, CFG 3", "adapter scale 0, CFG 3"
    rate = {
        (o, arm): f"{100 * digits_record(o, 'rates.json')['rates'][arm]['rate']['mean']:.0f}%"
        for o in ORGANISMS
        for arm in (on, off)
    }
    per = {o: digits_record(o, "per_digit.json")["rates"][on]["per_digit"] for o in ("support", "ip-adapter")}
    ranked = {o: sorted(per[o], key=lambda d: per[o][d]["mean"]) for o in per}
    assert all(set(order) == set("0123456789") and order.index("3") <= 1 for order in ranked.values())  # hardest
    pct = {(o, d): f"{100 * per[o][d]['mean']:.0f}%" for o in per for d in per[o]}
    s, i = (f"{pct[o, ranked[o][0]]} to {pct[o, ranked[o][-1]]}" for o in per)
    assert_in(
        "docs/findings.md", f"model, {rate['support', on]} right digit at CFG 3, {rate['support', off]} at adapter"
    )
    assert_in("docs/findings.md", f"as IP-Adapter is: {rate['ip-adapter', on]} against {rate['ip-adapter', off]} at")
    assert_in("docs/findings.md", f"digit only {rate['mixed', on]} of the time)")
    assert_in(
        "docs/findings.md",
        f"Per digit the rates run from {s} (`support`) and {i} (`ip-adapter`); the 3 used below is among the hardest "
        f"({pct['support', '3']} and {pct['ip-adapter', '3']}; the 7 of the command line: {pct['support', '7']} and "
        f"{pct['ip-adapter', '7']})",
    )
    assert_in("README.md", f"(a 3 is drawn right {pct['support', '3']} of the time)")
    # one reference: the chance of retrieving it among its class
    chance = {digits_record(o, "following.json")["following"]["1"]["chance"]["retrieval"] for o in per}
    assert len(chance) == 1
    assert_in("docs/findings.md", f"(retrieval among its class, chance {chance.pop():.3f})")


SCALE = '"scale"'


def test_costs_from_measured():
    """The costs the README and findings.md quote. They have no CSV: their record is docs/measured.md's tables, as
    the benchmarks printed them, read here (ratios recomputed from the launch counts)."""
    launches = {(r[0], r[1]): r for r in table_rows("docs/measured.md", "## What a GPU pays")}
    plain = int(launches["SD 1.5 UNet (16)", "4"][2])

    def ratio(cell: str, digits: int = 2) -> str:
        count = int(re.match(r"\+([\d,]+)", cell).group(1).replace(",", ""))
        return f"{count / plain:.{digits}f}×"

    # a step's launches (the probe's are a few: three digits), and the probe's once per call (the last column)
    probe, (maps, call) = (
        ratio(launches["SD 1.5 UNet (16)", "4"][3], 3),
        (ratio(launches["SD 1.5 UNet (16)", "4"][c]) for c in (4, 8)),
    )
    compiled = ratio(launches["SD 1.5 UNet (16), `compile=True`", "4"][3])
    scale = re.search(r'`mode="scale"`[^+]*(\+\d+) launches a step on SD 1.5', doc("docs/measured.md"))
    scale = ratio(scale.group(1))
    cpu = {(r[0], r[1]): r for r in table_rows("docs/measured.md", "**The whole curve on a quieter machine")}
    # the latest 512 px measurement: the merged code's probe, its own CPU over a plain call's, 4 and 64 tokens
    now = {r[0]: r for r in table_rows("docs/measured.md", "**CPU time at 512 px, before and after")}
    # at 512 px with 64 tokens, the latest measurement's probe and maps (their own CPU, glibc's malloc as it comes)
    faults = table_rows("docs/measured.md", "**What a plain call's CPU holds: page faults**")
    faults = {tuple(r[:2]): r for r in faults}
    latest = faults["64², 64", "glibc's defaults"]
    own = [now["4"][3].split(" / ")[0], latest[3].split(" / ")[0]]
    maps_cpu = latest[4].split(" / ")[0]
    assert_in(
        "README.md",
        f"CPU time {own[0]}× a plain call's at 64² latents ({own[1]}× with 64 tokens, maps {maps_cpu}×); "
        "GPU launches: probed SD 1.5 "
        f"steps add {probe} a plain step's, a call {call} (maps {maps}, `compile=True` {compiled}, `mode={SCALE}` "
        f"{scale};",
    )
    # the probe's own CPU over a plain call's (the measure held against the targets) at 512 px: 2 images, 8 tokens
    default, exact = (cpu["64", "8"][c].split(" / ")[0] for c in (2, 4))
    assert_in("docs/findings.md", f"at {exact}× a plain call's cost at 512 px instead of {default}×")
    gauge = {(r[0], r[1]): r for r in table_rows("docs/gauge.md", "printed by `python benchmarks/query_frame.py`")}
    row = gauge["1", "item"]  # the benchmark's record: its table in gauge.md
    assert_in(
        "docs/findings.md",
        f"it reads {float(row[3]):.3f} where the stored-frame ρ reads {float(row[2]):.3f}",
    )


def test_observational_prose_and_untrained_rows():
    """attribution.md's observational table, untrained rows' last columns, and the prose under the table."""
    one_, two = (record(f"full/ip-adapter/attribution_untrained_{p}.csv") for p in ("one", "2+2"))
    for t in (one_, two):
        assert ((t["share_spearman_low"] < 0) & (t["share_spearman_high"] > 0)).all()

    def ranks(t):
        return f"{signed(t['share_spearman'].min())} to {signed(t['share_spearman'].max())}, every interval includes 0"

    def layers(t):
        return f"{signed(t['layer_agreement'].min())} to {signed(t['layer_agreement'].max())}"

    def fitted(t):  # the finite fitted bandwidths' range, to tens
        finite = t.loc[np.isfinite(t["fitted_bandwidth"]), "fitted_bandwidth"]
        return f"{round(finite.min(), -1):,.0f}–{round(finite.max(), -1):,.0f}"

    infinite = one_.loc[np.isinf(one_["fitted_bandwidth"]), "timestep"]
    assert len(infinite) == 1 and np.isfinite(two["fitted_bandwidth"]).all()
    assert_in(
        "docs/attribution.md",
        f"{ranks(one_)}, p ≥ {one_['share_spearman_p'].min():.2f} | {layers(one_)} | {fitted(one_)}, or ∞ at t = "
        f"{infinite.iloc[0]:g} | pooling × 5 |",
    )
    assert_in(
        "docs/attribution.md",
        f"{ranks(two)} (p {two['share_spearman_p'].min():.2f}–{two['share_spearman_p'].max():.2f}) | {layers(two)} | "
        f"{fitted(two)} | pooling × 5 |",
    )
    trained = pd.concat([record(f"full/ip-adapter/attribution_trained_{p}.csv") for p in ("one", "2+2")])
    bandwidth = trained.groupby("timestep")["bandwidth"].first()
    assert_in(
        "docs/attribution.md",
        f"(its bandwidth h(t) from {bandwidth[981.0]:.1f} to {bandwidth[1.0]:.3f}); averaged over sets, layers, heads "
        f"and positions, the trained adapter's attention moves at most about "
        f"{100 * trained['attention_tv_high'].max():.0f}% of its mass away from uniform (position n_eff, the mean "
        f"over positions of the head-averaged shares' n_eff, "
        f"{trained['position_neff'].min():.2f}–{trained['position_neff'].max():.2f})",
    )
    untrained = pd.concat([one_, two])
    p981 = one(two, timestep=981.0)["share_spearman_p"]
    assert_in(
        "docs/attribution.md",
        f"pools even more evenly (TV {untrained['attention_tv'].max():.3f}). The untrained 2 + 2 row at t = 981 has a "
        f"permutation p of {p981:.3f} but an interval that reaches below 0, so the rule does not count it (and its "
        f"attention is uniform to {100 * untrained['attention_tv'].max():.1f}% anyway)",
    )


def test_mixed_organism_paragraph():
    """attribution.md on the organism trained on mixed references, from its full-tier records."""

    def follows(folder):  # un-ablated outputs that read as one of the set's digits
        t = record(f"{folder}/attribution/effects_trained.csv")
        sets = t.groupby("set").agg(label=("baseline_label", "first"), digits=("digit", set))
        return 100 * np.mean([label in digits for label, digits in zip(sets["label"], sets["digits"], strict=True)])

    assert_in(
        "docs/attribution.md",
        f"but only {follows('full_recipe_mixed'):.0f}% of its un-ablated outputs read as one of the set's digits "
        f"({follows('full'):.0f}% on `support`)",
    )
    t = record("full_recipe_mixed/attribution/example_3s_5s_trained.csv")
    three, five = (one(t, reference=r, group="all", steps="all") for r in ("both 3s", "both 5s"))
    up = one(t, reference="both 5s", group="up", steps="all")
    assert three["baseline_reads_5_count"] == five["baseline_reads_5_count"] and five["reads_5_count"] == 0
    assert_in(
        "docs/attribution.md",
        f"{three['baseline_reads_5_count']} of {three['seeds']} seeds read 5 with all four references; with both 3s "
        f"ablated {three['reads_5_count']} of 8 do (flipped {three['flipped_count']} of 8), with both 5s ablated none "
        f"(flipped {five['flipped_count']} of 8); the up blocks carry it (both 5s: {up['latent_effect']:.2f} of "
        f"{five['latent_effect']:.2f} RMS)",
    )
    v = record("full_recipe_mixed/attribution/verdicts_trained.csv")
    heads = v[v["resolution"] == "layer x head"]
    mixed, same = heads[heads["population"] != "same digit"], heads[heads["population"] == "same digit"]
    assert_in(
        "docs/attribution.md",
        f"(per (layer, head) {100 * mixed['pooling'].min():.0f}–{100 * mixed['pooling'].max():.0f}% of cells on mixed "
        f"sets, {100 * same['pooling'].min():.0f}–{100 * same['pooling'].max():.0f}% on one-digit sets; `tracks "
        f"posterior` at most {100 * v['tracks_posterior'].max():.0f}%)",
    )
    twin = record("full_recipe_mixed/ip-adapter/table.csv")
    twin = twin[twin["quantity"].str.startswith("query-frame per-row Spearman, exact b")]
    twin = twin[twin["setting"].str.startswith("untrained organism")].set_index("setting")["ours"].str.split().str[0]
    assert_in(
        "docs/attribution.md",
        f"initial weights, {twin['untrained organism, t=981']} → {twin['untrained organism, t=1']})",
    )


def controls() -> pd.DataFrame:
    return pd.concat(
        [
            record(f"{ORGANISMS[o]}/attribution/controls_trained.csv").assign(organism=o)
            for o in ("support", "ip-adapter")
        ]
    )


def test_control_counts():
    """At how many of the 5 steps each control's difference counts (kept apart: the controls' counts may be redone)."""
    c = controls()
    heads = c[(c["statistic"] == "head_tv_above") & (c["control"] == "same-digit sets")]
    assert heads["counts"].all() and (heads["difference"] > 0).all() and len(heads) == 20
    assert_in("docs/attribution.md", "than for one-digit sets at all 5 steps, on both organisms")
    ranking = c[(c["statistic"] == "share_spearman") & (c["control"] == "same-digit sets")]
    assert not ranking["counts"].any()
    assert_in("docs/findings.md", "(the concentration differs at all 5 steps, the ranking at none)")
    assert_in("docs/attribution.md", "differs from the one-digit sets' at none of the steps")
    unseen = c[(c["control"] == "unseen references") & c["statistic"].isin(["posterior_neff", "share_spearman"])]
    per = unseen.groupby(["statistic", "organism", "population"])["counts"].agg(["sum", "size"])
    assert (per["size"] == 5).all()
    for statistic, text in (
        ("posterior_neff", "{} or {} of 5 steps in every population"),
        ("share_spearman", "with the unseen ones' at {} or {} of 5 steps"),
    ):
        k = per.loc[statistic, "sum"]
        span = [k.min()] if k.min() == k.max() else [k.min(), k.max()]
        assert_in("docs/attribution.md", text.replace("{} or {}", " or ".join(map(str, span))))


def test_control_values():
    """attribution.md's sizes under the controls: head cells above the threshold, the ranking's range, the
    posterior's collapse (``controls_trained.csv``)."""
    c = controls()
    heads = c[(c["statistic"] == "head_tv_above") & (c["control"] == "same-digit sets")]
    two = heads[heads["population"] == "2+2 digits"].groupby("organism")[["value", "control_value"]].mean()
    (a, b), (x, y) = (
        (f"{two.loc[o, 'value']:.2f}", e(two.loc[o, "control_value"])) for o in ("support", "ip-adapter")
    )
    assert_in(
        "docs/attribution.md",
        f"(`support` 2 + 2: head cells above 0.05 {a} against {b} on average over steps; `ip-adapter` {x} against "
        f"{y})",
    )
    ranking = c.query("statistic == 'share_spearman' and control == 'same-digit sets'")
    means = ranking.groupby(["organism", "population"])[["value", "control_value"]].mean().to_numpy()
    assert_in("docs/attribution.md", f"(`share_spearman`, {signed(means.min())} to {signed(means.max())} on average)")
    collapse = c[c["statistic"] == "posterior_neff"]
    first, last = (collapse[collapse["timestep"].astype(float) == t][["value", "control_value"]] for t in (951, 1))
    assert len(first) == len(last) == 6 and (last == 1).all().all()
    assert_in(
        "docs/attribution.md",
        f"it falls from {first.min().min():.1f}–{first.max().max():.1f} at t = 951 to 1 either way",
    )


def test_grid_survivors_and_example_reads():
    """No grid cell survives Holm, nor can one over the grid's sets (the smallest exact sign-flip p against Holm's
    first threshold over the grid family); the attention share's uncorrected count; how many of the example's seeds
    read 5."""
    grids = {o: record(f"{ORGANISMS[o]}/attribution/grid_comparisons_trained.csv") for o in ORGANISMS}
    (sets,) = {int(n) for grid in grids.values() for n in grid["sets"]}
    (family,) = {int((grid["family"] == "grid").sum()) for grid in grids.values()}
    smallest = 1 / 2**sets  # all sets on one side: no sign pattern but the identity reaches the observed mean
    assert all(grid["p"].min() == smallest > 0.05 / family and not grid["predicts"].any() for grid in grids.values())
    assert_in(
        "docs/attribution.md",
        f"nor can one: over {sets} sets the smallest sign-flip p is 1/{2**sets} = {1 / 2**sets:.3f}, and Holm over "
        f"{family} tests needs one below {g(0.05 / family)}",
    )
    grid = grids["ip-adapter"]
    share = grid.query("family == 'grid' and predictor == 'attention_share' and effect == 'class_drop'")
    below = share[share["p"] < 0.05]
    assert {("all", "0-6"), ("down", "0-6")} <= set(zip(below["group"], below["steps"], strict=True))
    assert (grid["predicts_unadjusted"] == (grid["p"] < 0.05)).all()
    assert_in(
        "docs/attribution.md", "(`predicts_unadjusted`: the same one-sided p below 0.05, before Holm, no interval)"
    )
    assert_in(
        "docs/attribution.md",
        f"probability in {len(below)} cells (all layers and the down blocks during the first third among them)",
    )
    for organism in ("support", "ip-adapter"):  # how many of the 8 seeds read 5 with every reference
        example = record(f"{ORGANISMS[organism]}/attribution/example_3s_5s_trained.csv")
        r = one(example, reference="both 5s", group="all", steps="all")
        k, n = r["baseline_reads_5_count"], r["seeds"]
        assert_in("docs/attribution.md", f"all {k} outputs read 5" if k == n else f"`{organism}` {k} of {n} read 5")


def test_first_hour_record():
    """What the README's first blocks print, read from ``first_hour/record.json``, which ``record.py`` beside it made
    by running those blocks as they stand (a changed block needs the record made again)."""
    rec = json.loads((RESULTS / "first_hour" / "record.json").read_text())
    blocks = re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", (ROOT / "README.md").read_text(), re.S | re.M)
    assert rec["blocks"] == blocks[:3], "README.md's first blocks changed: run docs/results/first_hour/record.py"
    maps, first, last = rec["maps"], rec["summary"]["951"], rec["summary"]["1"]
    assert_in("README.md", f"# cond, every step: {maps['dominant_agree']:.2f}, {maps['tv']:.3f}")

    def ends(column: str) -> str:
        return f"{first[column]:.3f} → {last[column]:.3f}"

    assert_in(
        "docs/findings.md",
        f"query-frame ρ {ends('qf_spearman')} (exact b; Gaussian {ends('qf_gauss_spearman')}) and the stored-frame ρ "
        f"{ends('spearman')} (t = 951 → 1,",
    )


def test_family_sizes():
    """The size of every Holm family and described set of cells the docs name, counted in the records' rows."""
    size = {}
    for name in ("init_adapter_tests", "matched_control"):  # a row per test, a Holm p per direction
        tables = [record(f"{f}/ip-adapter/{name}.csv") for f in ORGANISMS.values()]
        (size[name],) = {len(t) * len([c for c in t.columns if c.startswith("p_holm_")]) for t in tables}
    assert_in("docs/findings.md", f"both statistics and the five timesteps ({size['init_adapter_tests']} hypotheses")
    assert_in("docs/findings.md", f"all {size['init_adapter_tests']} bounds hold together")
    assert_in("docs/findings.md", f"both statistics and the five timesteps ({size['matched_control']} hypotheses")
    twin = pd.concat([matched_control(o) for o in ORGANISMS]).query(
        "control == 'matched' and statistic == 'qf_spearman'"
    )
    assert_in("docs/findings.md", f"(a description of {len(twin)} cells, not a test)")
    cells = {o: set(record(f"{ORGANISMS[o]}/ip-adapter/init_adapter_per_set.csv")["cells"]) for o in ORGANISMS}
    assert cells["support"] == cells["mixed"] and all(len(c) == 1 for c in cells.values())
    assert_in(
        "docs/findings.md",
        f"(a set has {cells['support'].pop()} cells on `support` and `mixed`, {cells['ip-adapter'].pop()} on "
        "`ip-adapter`)",
    )
    (held,) = {len(record(f"{f}/attribution/held_out_trained.csv")) for f in ORGANISMS.values()}
    folds = record(f"{ORGANISMS['support']}/attribution/held_out_trained.csv")[["effect", "fold"]].nunique()
    assert folds["effect"] * folds["fold"] == held
    assert_in("docs/findings.md", f"Holm over the organism's {held} tests.")
    assert_in("docs/attribution.md", f"Holm over the organism's {held} held-out tests;")
    assert_in("docs/attribution.md", f"bound over the organism's {held} tests")
    assert_in("docs/attribution.md", f"({folds['effect']} effects × {folds['fold']} folds)")
    fresh = record("attribution_fresh/held_out.csv").query("predictor == 'held out'")
    assert_in("docs/attribution.md", f"Holm over the table's {len(fresh)} held-out tests)")
    (whole,) = {  # the rows Holm adjusted (the posterior-minus-attention rows are descriptions)
        int(record(f"{f}/attribution/comparisons_trained.csv")["p_holm"].notna().sum()) for f in ORGANISMS.values()
    }
    assert_in("docs/findings.md", f"`comparisons_<weights>.csv`, {whole} tests per organism")
    assert_in("docs/attribution.md", f"predictors × 2 effects, {whole} tests, each p")
    grid = record(f"{ORGANISMS['support']}/attribution/grid_comparisons_trained.csv")
    family = {f: part for f, part in grid.groupby("family")}
    per = {f: part.groupby(["predictor", "effect"]).size() for f, part in family.items()}
    assert all(len(set(n)) == 1 for n in per.values())
    cells = {f: int(n.iloc[0]) for f, n in per.items()}  # cells per (predictor, effect)
    predictors, effects = family["grid"]["predictor"].nunique(), family["grid"]["effect"].nunique()
    ablation = record(f"{ORGANISMS['support']}/attribution/grid_trained.csv").query("group != 'mid'")
    ablation = ablation[ablation["mode"] == "ablate"][["group", "steps"]].drop_duplicates()
    assert len(ablation) + 1 == cells["grid"]  # and the scale-0.5 cell
    assert_in(
        "docs/attribution.md",
        f"(the grid on {family['grid']['sets'].iloc[0]} sets; {cells['grid']} cells without the mid block "
        f"({len(ablation)} ablation cells and the scale-0.5 one) x {predictors} predictors x {effects} effects = "
        f"{len(family['grid'])} tests, one Holm family; the mid block's {cells['mid block']} cells x "
        f"{per['mid block'].size} = {len(family['mid block'])} tests",
    )
    assert_in(
        "docs/findings.md",
        f"(5 sets, {len(family['grid'])} tests without the mid block, Holm; the mid block's "
        f"{len(family['mid block'])} tests apart)",
    )


# ------------------------------------------------------------------------------- the inventory (issue #52 point 4)
DOCS = ("README.md", "docs/findings.md", "docs/attribution.md")
NUMBER = re.compile(r"(?<![\w.#§/^-])[−+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e-\d+)?%?(?![\w])")
NOT_PROSE = (r"`[^`]*`", r"\]\([^)]*\)", r"<!--.*?-->", r"(?m)^#+ [^\n]*$")  # code spans, link targets, headings


def prose_numbers(raw: str) -> tuple[str, list[tuple[int, str, str]]]:
    """A markdown text with each run of whitespace as one space (as ``doc`` reads it), and every number of its prose
    as (position there, the number, its context). Fenced code is left out but for its comments (the README states
    figures there), and so are code spans, link targets and headings."""
    keep = np.ones(len(raw), bool)
    for m in re.finditer(r"```.*?```", raw, re.S):
        keep[m.start() : m.end()] = False
        for c in re.finditer(r"#[^\n]*", m.group()):
            keep[m.start() + c.start() : m.start() + c.end()] = True
    scan = "".join(ch if k else " " for ch, k in zip(raw, keep, strict=True))
    for pattern in NOT_PROSE:
        for m in re.finditer(pattern, scan, re.S):
            keep[m.start() : m.end()] = False
    pieces = list(re.finditer(r"\s+|\S+", raw))  # doc()'s text: a run of whitespace is one space
    text = "".join(" " if m.group().isspace() else m.group() for m in pieces)
    mask = np.concatenate([[False] if m.group().isspace() else keep[m.start() : m.end()] for m in pieces])
    found = [(m.start(), m.group(), text[max(0, m.start() - 50) : m.end() + 20]) for m in NUMBER.finditer(text)]
    return text, [
        (start, number, context) for start, number, context in found if mask[start : start + len(number)].all()
    ]


def run_every_claim() -> None:
    """Call every test of this module (each parametrised case) so that ``CLAIMS`` holds all it asserts, whatever
    order or process the suite runs them in."""
    for name, test in list(globals().items()):
        if not name.startswith("test_") or name == "test_every_number_is_read_from_a_record":
            continue
        cases = [{}]
        for mark in [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]:
            names = [n.strip() for n in mark.args[0].split(",")]
            values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
            cases = [{**case, **dict(zip(names, v, strict=True))} for case in cases for v in values]
        for case in cases:
            test(**case)


# Numbers that are not data, each with why; a number inside a match needs no record. Everything else in the three
# docs' prose must lie inside a text that a test above asserted against its record.
NOT_DATA = {
    r"\d+ ?[×x+] ?\d+|\d+²": "a size or a product of the design (2 + 2 sets, 16 × 16 digits, 4 x 8 cells)",
    r"(?:in|within) \[−1, 1\]|\[0, 1 − 1/R\]|\[1, R\]": "a statistic's range (its definition)",
    r"\b95%|\bat 5%|(?:α =|threshold|below|above|p <|p-value below) 0\.05|0\.95|2\.5%": "a level set before the data",
    r"\b\de-\d+\b|(?:than|to|at) \d+%|more than \d+% off": "a tolerance or threshold of a check",
    r"(?:SD|Stable Diffusion) 1\.5|Python 3\.10|arXiv:[\d.]+|paper's 0\.89": "a name, a version, the paper's figure",
    r"\*\*\d\.|\b\d\. (?:else )?\*\*|point \d+|section \d+|§\d+|#\d+": "a numbered item, section or issue",
    r"\bt (?:[=≥<] )?\d+(?:(?:,| and| →) \d+)*|\d+-\d+": "the recorded timesteps and step ranges (the design's grid)",
    r"\b(?:of )?a [0-9]\b|reference \d|stage \d": "a digit, a reference or a stage named",
    r"\d/\d|c = [\d./]+ and \d+|scale [\d.]+|CFG \d|by 0\.5|step [\d.]+ in|multiplier \d+|exceed [\d,]+|"
    r"from [\d,]+ on|key scales [\d.]+–\d+|n_eff of \d|keys: \d+ at|floor(?:,| is) [\d /,=.]+\d": "a setting",
    r"(?:quick|smoke|full) \d+|(?:\d+, )?\d+ and \d+ images|\d+ (?:held out|new|in all|per organism|per population)|"
    r"first \d+|calibration on \d+|at least \d+ of \d+ draws|\d+ instead of \d+|\d+ or \d+ cells|, 120 on|x \d+ = \d+|"
    r"[\d,]+ (?:one-digit |mixed |control |other |held-out |reference |recorded |DDIM |bootstrap |odd |ablation )*"
    r"(?:sets?|seeds|steps|references|images|permutations|draws|resamples|candidates|points|gauges|"
    r"timesteps|tokens|inputs|cores|rows|px|organisms|predictors|effects)\b": "a design size",
    r"(?<![\d.])[01](?![\d.,]?\d| of)": "0 and 1 as bounds, scales and factors (not counts: '0 of n' is data)",
    r"\d+ of \d+ steps|\d+-step|\d+ (?:DDIM )?steps instead of \d+|P\(\d\) between a training \d and a training \d|"
    r"central difference \(0\.01": "the cheap ablation's steps and the judge's step, set before the data",
    r"over \d+(?:, \d+)*(?: and| to) \d+ sets": "the sizes a coverage simulation runs at (its design)",
}


# ------------------------------------------- figures once checked while coding, now read from committed records
def test_scale_zero_paths():
    """attribution.md's scale-0 paths (``scale_zero/record.json``, written by ``scale_zero/measure.py``)."""
    d = json.loads((RESULTS / "scale_zero/record.json").read_text())["largest_abs_difference"]
    e = lambda x: re.sub(r"e-0*", "e-", f"{x:.1e}")  # noqa: E731 - two significant digits, as written (1.0e-6)
    assert d["nested_ablate_vs_at_once"] == d["every_ablate_vs_adapter_scale_0"] == 0  # "equal bit for bit"
    assert_in(
        "docs/attribution.md",
        f'`mode="scale", factor=0` ends {e(d["scale_vs_ablate"])} from `"ablate"`, two nested factor-0 blocks '
        f"{e(d['nested_scale_vs_at_once'])} from the same factors given at once, and factor 0 for all four references "
        f"{e(d['every_scale_vs_adapter_scale_0'])} from `set_ip_adapter_scale(0)`, while the ablations are equal bit "
        "for bit in the last two",
    )


def test_regenerated_aggregates_and_later_shuffled_steps():
    """The held-out choice's aggregates regenerated (their all-layers, all-steps rows against the committed effects'
    overall means, the test's own merge) and the shuffled-order control's later steps at the full tier."""
    for effects in sorted(RESULTS.glob("*/attribution/effects_*.csv")):
        again = pd.read_csv(str(effects).replace("effects_", "aggregates_"))
        again = again[(again["group"] == "all") & (again["steps"] == "all steps")]
        both = pd.read_csv(effects).merge(again, on=["set", "reference"], suffixes=("", "_again"), validate="1:1")
        assert len(both) == len(again) > 0
        for column in ("attention_share", "contribution_norm", "contribution_projection", "posterior_weight"):
            scale = max(1.0, both[column].abs().max())
            assert (both[column] - both[f"{column}_again"]).abs().max() <= 4 * np.finfo(np.float64).eps * scale
    regenerated = "the regenerated overall means equal the committed `effects_<weights>.csv` to float64 rounding"
    assert_in("docs/attribution.md", regenerated + " on every organism")
    shuffled = {
        w: [record(f"{f}/attribution/shuffled_{w}.csv") for f in ORGANISMS.values()] for w in ("trained", "untrained")
    }
    later = {w: max(t["share_max_diff"].max() for t in tables) for w, tables in shuffled.items()}
    assert later["trained"] < 1e-4 < later["untrained"]  # why later steps are reported, not held to 1e-4
    assert_in(
        "docs/attribution.md",
        f"(at the full tier they move by up to {e(later['trained'])} on the trained organisms and "
        f"{e(later['untrained'])} on the untrained ones, whose random weights amplify rounding)",
    )


def uncovered(name: str) -> list[tuple[str, str]]:
    """The prose numbers of a doc that no assertion read and no rule above excuses."""
    text, numbers = prose_numbers((ROOT / name).read_text())
    assert text == doc(name)
    covered = np.zeros(len(text), bool)
    texts = [re.escape(c) for c in CLAIMS[name]] + list(NOT_DATA)
    for text in texts:
        for m in re.finditer(text, doc(name)):
            covered[m.start() : m.end()] = True
    return [(n, context) for start, n, context in numbers if not covered[start : start + len(n)].all()]


def test_every_number_is_read_from_a_record():
    """The inventory: every number in the README, findings.md and attribution.md is asserted against its record by
    a test above, or is named as not data (``NOT_DATA``)."""
    run_every_claim()
    missing = {name: uncovered(name) for name in DOCS}
    assert not any(missing.values()), "numbers no test reads from a record:\n" + "\n".join(
        f"{name}: {number!r} in …{context}…" for name, rows in missing.items() for number, context in rows
    )


def test_the_inventory_finds_planted_numbers():
    """The inventory's reader on a planted text: it finds the prose's numbers (a fenced block's comment included)
    and leaves out code, link targets, headings and commit hashes."""
    raw = (
        "## 3. A heading 0.99\n\nThe rate is 0.42 (`code 7`; [page](a.md#s-5)), 12 of 40, −0.013 and 1,499 at 5e45e7f "
        "and 4.1e-6.\n\n```python\nx = 17  # prints 0.64, 0.020\n```\n"
    )
    text, numbers = prose_numbers(raw)
    assert [n for _, n, _ in numbers] == ["0.42", "12", "40", "−0.013", "1,499", "4.1e-6", "0.64", "0.020"]
    assert all(text[start : start + len(n)] == n for start, n, _ in numbers)


#: The fresh sets' sizing predictor, an ablation rather than a reading of the model (its own rows in each table).
FRESH_CHEAP = {"cheap_ablation": "cheap ablation (5 of 20 steps)"}


def test_fresh_cheap_ablation():
    """The cheap ablation's rows and prose: its agreement and point calibration recomputed from ``records.csv``
    (numpy / scipy, apart from ``summarize``) equal ``summary.csv``'s, whose rows the docs print."""
    from scipy import stats

    records, summary = record("attribution_fresh/records.csv"), record("attribution_fresh/summary.csv")
    by = {(r["organism"], r["predictor"]): r for r in summary.to_dict(orient="records")}
    for organism in FRESH_ORGANISMS:
        frame = records[records["organism"] == organism]
        flipped = frame.pivot(index="set", columns="pair", values="flipped").astype(bool)  # (S, 2)
        sets = frame.groupby("set").first()
        own = (sets["clean_label"] == sets["a"]) | (sets["clean_label"] == sets["b"])  # not a third digit
        decided = ((flipped.sum(axis=1) == 1) & own).to_numpy()
        score, real = (frame.pivot(index="set", columns="pair", values=c) for c in ("cheap_ablation", "real_drop"))
        truth = flipped.idxmax(axis=1).to_numpy()[decided]
        row = by[organism, "cheap_ablation"]
        assert (row["hits"], row["decided"]) == (
            int((np.where(score["a"] >= score["b"], "a", "b")[decided] == truth).sum()),
            int(decided.sum()),
        )
        x, y = score.to_numpy().ravel(), real.to_numpy().ravel()
        assert row["slope"] == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-9)
        assert row["spearman"] == pytest.approx(stats.spearmanr(x, y).statistic, rel=1e-9)
        chosen = [score.loc[s, p] for s, p in zip(score.index[decided], truth, strict=True)]
        assert row["median_predicted"] == pytest.approx(np.median(chosen), rel=1e-12)
    for row in fresh_rows(FRESH_CHEAP):
        assert_in("docs/attribution.md", row)
    facts = fresh_well_posed(FRESH_CHEAP)
    cells = [agreement_cell(facts[o]["hits"]["cheap_ablation"], facts[o]["well"]) for o in FRESH_ORGANISMS]
    assert_in("docs/attribution.md", f"| {FRESH_CHEAP['cheap_ablation']} | " + " | ".join(c for c, _ in cells) + " |")
    cheap = [by[o, "cheap_ablation"] for o in FRESH_ORGANISMS]
    read = [by[o, "output_digit"] for o in FRESH_ORGANISMS]
    assert all(c["hits"] < r["hits"] for c, r in zip(cheap, read, strict=True))  # "less often than reading"
    ratio = [c["median_predicted"] / c["median_real"] for c in cheap]  # on the drop's scale on every organism
    assert all(0.8 < r < 1.2 for r in ratio) and cheap[-1]["slope"] == min(c["slope"] for c in cheap)  # mixed least
    slopes, ranks = " / ".join(e(c["slope"]) for c in cheap), " / ".join(signed(c["spearman"]) for c in cheap)
    medians = " / ".join(e(c["median_predicted"]) for c in cheap)
    assert_in(
        "docs/attribution.md",
        f"slopes {slopes}, Spearman {ranks}, the deciding pairs' median predicted drop {medians} against "
        f"{' / '.join(e(c['median_real']) for c in cheap)}",
    )
    assert_in("docs/findings.md", f"(slopes {slopes}, Spearman {ranks}, the deciding pairs' median {medians})")
    assert_in("docs/findings.md", "output (" + ", ".join(f"{c['hits']} of {c['decided']}" for c in cheap[:-1])
              + f" and {cheap[-1]['hits']} of {cheap[-1]['decided']})")  # fmt: skip
