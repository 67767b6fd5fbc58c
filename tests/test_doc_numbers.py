"""Every number the docs take from a committed record, read from the record (issue #52 point 5).

Each claim is a line of text as the doc states it, rebuilt here from the CSV it comes from (the claim's table of
(doc, text, record, rows, column)): the test fails when the prose and its record drift apart, either way. Numbers are
formatted as the prose writes them (signs, the minus sign, significant digits); whitespace is normalised.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ipa_probe.experiments.attribution_setup import PREDICTORS as PREDICTOR_WORDS  # the tables' wording

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
ORGANISMS = {"support": "full", "ip-adapter": "full_recipe_ip_adapter", "mixed": "full_recipe_mixed"}


def doc(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / name).read_text())


def record(path: str) -> pd.DataFrame:
    return pd.read_csv(RESULTS / path, dtype={"timestep": str} if "attribution/" in path else None)


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


# ------------------------------------------------------------------------------------------- findings.md section 1
def test_gauge_group_claims():
    """The headline's invariance: the query-frame rho's means over the group's 9 gauges, their spread, the outputs'
    largest change and the stored-frame rho's range (the table gauge_sweep/group/README.md says the docs quote)."""
    table = pd.read_csv(RESULTS / "gauge_sweep" / "group" / "gauge_sweep.csv")
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
    share between them, as each per-cell decision is one of the possible verdicts there), and the prose's figures
    for the share of cells certified to track the posterior come from the full tier's trained records."""
    frames = []
    folders = {**ORGANISMS, "smoke support": "smoke", "smoke ip-adapter": "smoke_recipe_ip_adapter"}
    for organism, folder in folders.items():
        for label in ("trained", "untrained"):
            table = record(f"{folder}/attribution/verdicts_{label}.csv")
            table = table[table["resolution"] != "average"]
            for v in ("pooling", "tracks_posterior", "undecided"):
                low, high = table[f"{v}_low"].to_numpy(np.float64), table[f"{v}_high"].to_numpy(np.float64)
                assert np.isfinite(low).all() and np.isfinite(high).all(), (folder, label, v)
                assert (low <= table[v] + 1e-12).all() and (table[v] <= high + 1e-12).all(), (folder, label, v)
            if label == "trained" and organism in ORGANISMS:
                frames.append(table.assign(organism=organism))
    trained = pd.concat(frames, ignore_index=True)
    shown = trained[trained["organism"] != "mixed"]
    certified = shown[shown["tracks_posterior_low"] > 0]
    assert set(certified["population"]) == {"4 digits"} and set(certified["organism"]) == {"support", "ip-adapter"}
    assert_in(
        "docs/attribution.md",
        f"A true share of `tracks posterior` cells above 0 is certified in {len(certified)} of {len(shown)} "
        f"(organism, population, resolution, step) rows, at most {100 * certified['tracks_posterior_low'].max():.1f}% "
        "of the cells (four-digit sets on both organisms).",
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
    """The grid's uncorrected counts (``predicts_unadjusted``, the mid block apart): per predictor, in how many of
    the grid family's cells it 'predicted' the effect."""
    table = record(f"{ORGANISMS[organism]}/attribution/grid_comparisons_trained.csv")
    table = table[(table["family"] == "grid") & (table["effect"] == effect)]
    cells = []
    for predictor in list(PREDICTOR_WORDS)[:4]:
        part = table[table["predictor"] == predictor]
        cells.append(f"{int(part['predicts_unadjusted'].sum())} of {len(part)}")
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
    # fresh sets: on every organism no predictor agrees with the deciding pair more often than reading the output,
    # and none of them beats chance after Holm over the table's tests
    fresh = record("attribution_fresh/summary.csv")
    baseline = fresh[fresh["predictor"] == "output_digit"].set_index("organism")["agreement"]
    others = fresh[fresh["predictor"] != "output_digit"]
    assert (others["agreement"].to_numpy() <= baseline.loc[others["organism"]].to_numpy()).all()
    p = np.sort(others["p"].to_numpy())
    holm = np.maximum.accumulate(np.minimum(1, p * (len(p) - np.arange(len(p)))))
    assert holm.min() >= 0.05
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
            f"{signed(t['layer_agreement'].max())} | ∞ at every t (lower ends {t['fitted_bandwidth_low'].min():.0f}–"
            f"{t['fitted_bandwidth_low'].max():.0f}) | pooling × 5 |"
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
    tables = {o: record(f"{f}/ip-adapter/query_pool.csv") for o, f in ORGANISMS.items()}
    several = pd.concat([t[t["images"] > 1] for t in tables.values()])
    assert (several["difference"] > several["se"]).all()  # "by more than its standard error everywhere"
    assert (pd.concat(tables.values()).query("images == 1")["difference"] == 0).all()
    assert_in(
        "docs/findings.md",
        f"(differences {several['difference'].min():.3f}–{several['difference'].max():.3f}, standard errors "
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
                f"{signed(r['spearman'])} [{signed(r['spearman_low'])}, {signed(r['spearman_high'])}]; "
                f"{e(r['slope'])} [{e(r['slope_low'])}, {e(r['slope_high'])}]; "
                f"{e(r['median_predicted'])} vs {e(r['median_real'])}"
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


def fresh_claims() -> list[str]:
    """The prose of the fresh-set section (attribution.md, findings.md section 6), rebuilt from ``summary.csv``."""
    table = record("attribution_fresh/summary.csv")
    by = {(r["organism"], r["predictor"]): r for r in table.to_dict(orient="records")}
    read = [by[o, "output_digit"] for o in FRESH_ORGANISMS]
    hits = ", ".join(f"{r['hits']} of {r['decided']}" for r in read[:-1]) + f" and {read[-1]['hits']} of "
    slopes, ranks = [r["slope"] for r in read], [r["spearman"] for r in read]

    def medians(predictor: str, key: str = "median_predicted") -> str:
        return " / ".join(e(by[o, predictor][key]) for o in FRESH_ORGANISMS)

    attribution = [p for p in FRESH_WORDS if p != "output_digit"]
    above = sorted((o, p) for o in FRESH_ORGANISMS for p in attribution if by[o, p]["p"] < 0.05)
    assert above == [("mixed", "integrated_patching"), ("support", "attention_share")]  # the prose names these two
    assert len({g(by[k]["p"]) for k in above}) == 1
    ranked = {(o, p) for o in FRESH_ORGANISMS for p in ("attribution_patching", "integrated_patching")}
    assert {k for k in ranked if by[k]["spearman_low"] <= 0} == {("ip-adapter", "attribution_patching")}
    return [
        f"chooses the deciding pair in {hits}{read[-1]['decided']} decided sets",
        f"(slopes {e(min(slopes))}–{e(max(slopes))}, Spearman at least {signed(min(ranks))})",
        f"each at an unadjusted p of {g(by[above[0]]['p'])} in a table of {len(table)} tests",
        f"{medians('attribution_patching')} (first order) and {medians('integrated_patching')} (integrated, 2 "
        f"points) against real drops of {medians('output_digit', 'median_real')}",
    ]


def test_fresh_set_claims():
    for claim in fresh_claims():
        assert_in("docs/attribution.md", claim)
        assert_in("docs/findings.md", claim)
    patching = record("attribution_fresh/summary.csv").query("predictor == 'attribution_patching'")
    ratio = patching["median_real"] / patching["median_predicted"]
    assert_in("docs/attribution.md", f"median drop {ratio.min():,.0f} to {ratio.max():,.0f} times too small")


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
            f"{held['choosing_decided']}) | {held['hits']} of {held['decided']} (≥ {held['agreement_low']:.2f}, p "
            f"{g(held['p'])}, Holm {g(held['p_holm'])}) | {signed(held['spearman'])} [{signed(held['spearman_low'])}, "
            f"{signed(held['spearman_high'])}]; {e(held['median_predicted'])} vs {e(held['median_real'])} | "
            f"{read['hits']} of {read['decided']} (p {g(read['p'])}) |"
        )
    return rows


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
        f"among {sizes['every candidate']} candidates ({sizes['without the posterior']} without the posterior)",
        f"Without the posterior, the choice agrees above chance in {int((own['p'] < 0.05).sum())} of {len(own)} "
        f"folds (p ≥ {g(own['p'].min())})",
        f"with it, {len(posterior)} of {len(every)} folds choose the exact posterior at t ≤ {late.max()}",
        f"none survives Holm over the table's {len(held)} held-out tests (smallest {g(held['p_holm'].min())})",
    ]
    assert (held["p_holm"] >= 0.05).all()
    assert (held.groupby(["organism", "pool"])["chosen"].nunique() == 2).all()  # "the choices differ between halves"
    claims.append(f"and {int((posterior['p'] < 0.05).sum())} of those agree at an unadjusted p below 0.05")
    for claim in claims:
        assert_in("docs/attribution.md", claim)
    assert_in("docs/findings.md", claims[1])
    # the pooled rows: every decided set tested once, recomputed here from the folds' counts
    for pool, words in (("without the posterior", "without the posterior"),
                        ("every candidate", "every candidate (near-circular where the posterior)")):  # fmt: skip
        cells = []
        for organism in FRESH_ORGANISMS:
            part = held[(held["pool"] == pool) & (held["organism"] == organism)]
            cells.append(agreement_cell(int(part["hits"].sum()), int(part["decided"].sum()))[0])
        assert_in("docs/attribution.md", f"| the held-out choice, {words} | " + " | ".join(cells) + " |")


def fresh_well_posed(predictors: dict[str, str] = FRESH_WORDS) -> dict[str, dict]:
    """Per organism, from ``records.csv`` alone: the decided sets whose clean output is a third digit (its
    ``clean_label`` is neither the set's ``a`` nor its ``b``), and every predictor's hits restricted to the others."""
    records = record("attribution_fresh/records.csv")
    out = {}
    for organism in FRESH_ORGANISMS:
        frame = records[records["organism"] == organism]
        assert (frame.groupby("set")["clean_label"].nunique() == 1).all()  # one generation per set
        sets = frame.groupby("set").first()  # (S,) a, b, clean_label
        flipped = frame.pivot(index="set", columns="pair", values="flipped").astype(bool)  # (S, 2)
        decided = flipped.sum(axis=1) == 1
        third = decided & (sets["clean_label"] != sets["a"]) & (sets["clean_label"] != sets["b"])
        well = decided & ~third
        truth = flipped.idxmax(axis=1)[well]  # the deciding pair
        clean = frame.pivot(index="set", columns="pair", values="output_digit")  # P(pair's digit), clean output
        real = frame.pivot(index="set", columns="pair", values="real_drop")
        hits = {}
        for predictor in predictors:
            score = frame.pivot(index="set", columns="pair", values=predictor)[well]
            hits[predictor] = int((np.where(score["a"] >= score["b"], "a", "b") == truth.to_numpy()).sum())
        out[organism] = {
            "decided": int(decided.sum()), "third": list(third[third].index), "well": int(well.sum()), "hits": hits,
            "largest": float(clean[third].to_numpy().max()),
            "both_small": int((clean[third].max(axis=1) < 1e-3).sum()),  # both pairs' P(digit) below 0.001
            "median_real": float(np.median([real.loc[s, p] for s, p in truth.items()])),
        }  # fmt: skip
    return out


def test_fresh_third_digit_sets():
    """Issue #52: where the decided set's output is a third digit, and the agreement on the other sets."""
    from scipy import stats

    facts = fresh_well_posed()
    for name in ("docs/attribution.md", "docs/findings.md"):
        assert_in(name, "In " + ", ".join(f"{len(facts[o]['third'])} of {facts[o]['decided']}"
                                          for o in FRESH_ORGANISMS[:-1])
                  + f" and {len(facts['mixed']['third'])} of {facts['mixed']['decided']} decided sets")  # fmt: skip
    third = "; ".join(f"`{o}` {', '.join(map(str, facts[o]['third']))}" for o in FRESH_ORGANISMS)
    assert_in("docs/attribution.md", f"({third})")
    largest = max(f["largest"] for f in facts.values())
    small = sum(f["both_small"] for f in facts.values())
    total = sum(len(f["third"]) for f in facts.values())
    assert_in(
        "docs/attribution.md", f"at most {e(largest)} for both pairs, below 0.001 for both in {small} of {total}"
    )
    assert_in("docs/attribution.md", f"({e(facts['mixed']['median_real'])} on its {facts['mixed']['well']} sets")
    ps, cells = {}, {}
    for organism, f in facts.items():
        for predictor, k in f["hits"].items():
            cells[organism, predictor], ps[organism, predictor] = agreement_cell(k, f["well"])
    for predictor, words in FRESH_WORDS.items():
        assert_in("docs/attribution.md", f"| {words} | " + " | ".join(cells[o, predictor] for o in FRESH_ORGANISMS))
    read = [facts[o]["hits"]["output_digit"] for o in FRESH_ORGANISMS]
    assert read == [facts[o]["well"] for o in FRESH_ORGANISMS]  # "every well-posed set"
    assert_in("docs/attribution.md", f"(with {min(read)}–{max(read)} well-posed sets, not a decided difference)")
    assert_in("docs/attribution.md", f"all of the {read[0]}, {read[1]} and {read[2]} whose output is one of the set's")
    assert_in("docs/findings.md", f"the deciding pair in all of {read[0]}, {read[1]} and {read[2]}, and no predictor")
    assert_in("docs/findings.md", f"(P(pair's digit) at most {e(largest)} for both pairs;")
    summary = record("attribution_fresh/summary.csv")  # "no predictor read from the model has as many hits"
    assert all(f["hits"]["output_digit"] > max(k for p, k in f["hits"].items() if p != "output_digit")
               for f in facts.values())  # fmt: skip
    for organism in FRESH_ORGANISMS:
        part = summary[summary["organism"] == organism].set_index("predictor")["hits"]
        assert part.drop("output_digit").max() < part["output_digit"]
    others = {k: p for k, p in ps.items() if k[1] != "output_digit"}
    assert min(others.values()) >= 0.05
    assert_in("docs/attribution.md", f"(p ≥ {g(min(others.values()))}")
    assert_in("docs/findings.md", f"(p ≥ {g(min(others.values()))}")
    # the paired exact sign test of reading the output against the best predictor read from the model, per organism
    # reading the output is right in every well-posed set: the discordant sets are the other predictor's misses
    signs, apart = [], []
    for f in facts.values():
        apart.append(f["well"] - max(k for p, k in f["hits"].items() if p != "output_digit"))
        p = stats.binomtest(apart[-1], apart[-1], 0.5, alternative="greater").pvalue
        assert p >= 0.05  # "not a decided difference"
        signs.append(g(p))
    tested = f"p {' / '.join(signs)} (`support`, `ip-adapter`, `mixed`; {apart[0]}, {apart[1]} and {apart[2]} such"
    assert_in("docs/attribution.md", tested)


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
        decided = (flipped.sum(axis=1) == 1).to_numpy()
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
    assert_in("docs/attribution.md", f"nor does the cheap ablation (p ≥ {g(min(p for _, p in cells))})")
    cheap = [by[o, "cheap_ablation"] for o in FRESH_ORGANISMS]
    read = [by[o, "output_digit"] for o in FRESH_ORGANISMS]
    above = [o for o, r in zip(FRESH_ORGANISMS, cheap, strict=True) if r["p"] < 0.05]
    assert above == ["support"] and g(cheap[0]["p"]) == "0.033"  # "as does the cheap ablation on `support`"
    assert all(c["hits"] < r["hits"] for c, r in zip(cheap, read, strict=True))  # "less often than reading"
    assert all(c["spearman_low"] > 0 for c in cheap)  # "every interval above 0"
    ratio = [c["median_predicted"] / c["median_real"] for c in cheap]  # the drop, about half, a quarter
    assert 0.9 < ratio[0] < 1.1 and 0.4 < ratio[1] < 0.6 and 0.2 < ratio[2] < 0.3
    slopes, ranks = " / ".join(e(c["slope"]) for c in cheap), " / ".join(signed(c["spearman"]) for c in cheap)
    medians = " / ".join(e(c["median_predicted"]) for c in cheap)
    assert_in(
        "docs/attribution.md",
        f"slopes {slopes}, Spearman {ranks} (every interval above 0), the deciding "
        f"pairs' median predicted drop {medians} against {' / '.join(e(c['median_real']) for c in cheap)}",
    )
    assert_in("docs/findings.md", f"(slopes {slopes}, Spearman {ranks}, the deciding pairs' median {medians})")
    assert_in("docs/findings.md", "output (" + ", ".join(f"{c['hits']} of {c['decided']}" for c in cheap[:-1])
              + f" and {cheap[-1]['hits']} of {cheap[-1]['decided']})")  # fmt: skip
