"""The attribution tests after correction (issue #40 points 5 and 6): Holm, Clopper-Pearson, the mid block apart, the
near-circular label and the held-out choice of a predictor, each against the test's own recomputation."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ipa_probe.attribution import clopper_pearson, holm
from ipa_probe.experiments.attribution_aggregate import held_out_aggregations
from ipa_probe.experiments.attribution_tests import (
    DECIDED_BELOW,
    adjust_comparisons,
    adjust_grid,
    example_intervals,
)


def _holm_by_definition(p: list[float]) -> list[float]:
    """Holm from its step-down definition, by brute force over the sorted order."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out = [0.0] * m
    for rank, i in enumerate(order):
        out[i] = min(1.0, max((m - j) * p[order[j]] for j in range(rank + 1)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_holm_against_its_definition(seed):
    p = np.random.default_rng(seed).uniform(0, 0.2, 9)
    np.testing.assert_allclose(holm(p), _holm_by_definition(list(p)), rtol=0, atol=1e-15)  # exact products
    with_nan = np.append(p, np.nan)
    adjusted = holm(with_nan)
    assert np.isnan(adjusted[-1])
    np.testing.assert_allclose(adjusted[:-1], _holm_by_definition(list(p)), atol=1e-15)  # NaN does not count to m


def test_holm_rejects_what_the_issue_names():
    """The issue's case: among 136 tests, p 0.0126 does not survive Holm."""
    p = np.full(136, 0.5)
    p[0] = 0.0126
    assert holm(p)[0] > 0.05


@pytest.mark.parametrize(("k", "n"), [(0, 8), (6, 8), (8, 8), (3, 40)])
def test_clopper_pearson_against_beta_quantiles_and_inside_0_1(k, n):
    low, high = clopper_pearson(k, n)
    expected_low = 0.0 if k == 0 else stats.beta.ppf(0.025, k, n - k + 1)
    expected_high = 1.0 if k == n else stats.beta.ppf(0.975, k + 1, n - k)
    assert low == pytest.approx(expected_low, abs=1e-9)  # root-finding tolerance of scipy's binomtest
    assert high == pytest.approx(expected_high, abs=1e-9)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_example_intervals_replace_students_t():
    example = pd.DataFrame(
        {"seeds": [8, 8], "flipped": [0.75, 0.0], "flipped_low": [0.4, -0.17], "flipped_high": [1.137, 0.1]}
    ).assign(reads_5=[1.0, 0.5], baseline_reads_5=[1.0, 1.0])
    out = example_intervals(example)
    for row in out.to_dict(orient="records"):
        low, high = clopper_pearson(row["flipped_count"], 8)
        assert (row["flipped_low"], row["flipped_high"]) == (low, high)
        assert 0.0 <= row["flipped_low"] <= row["flipped_high"] <= 1.0
    assert list(out["flipped_count"]) == [6, 0]


def test_comparisons_holm_over_the_table_and_near_circular():
    rng = np.random.default_rng(3)
    rows = [
        {"timestep": t, "predictor": p, "effect": e, "p": rng.uniform(0, 0.05), "low": 0.1, "predicts": True}
        for t, p, e in itertools.product(["all", "951", "451"], ["attention_share", "posterior_weight"], ["a", "b"])
    ]
    table = pd.DataFrame(rows)
    out = adjust_comparisons(table)
    np.testing.assert_allclose(out["p_holm"], _holm_by_definition(list(table["p"])), atol=1e-15)
    assert (out["predicts"] == (out["p_holm"] < 0.05)).all()
    assert out["predicts_unadjusted"].all()
    for r in out.to_dict(orient="records"):
        late = r["timestep"] == "all" or float(r["timestep"]) < DECIDED_BELOW
        assert r["near_circular"] == (r["predictor"] == "posterior_weight" and late)

    # the unadjusted rule is the same test without Holm, whatever a row's earlier columns or interval say
    joined = pd.concat(
        [
            out,
            pd.DataFrame(
                [
                    {
                        "timestep": "all",
                        "predictor": "attribution_patching",
                        "effect": "a",
                        "p": 0.04,
                        "low": -0.1,
                        "predicts": False,
                        "predicts_unadjusted": False,
                    },
                    {
                        "timestep": "all",
                        "predictor": "output_projection",
                        "effect": "a",
                        "p": 0.07,
                        "low": 0.2,
                        "predicts": True,
                        "predicts_unadjusted": True,
                    },
                    {
                        "timestep": "all",
                        "predictor": "posterior - attention",
                        "effect": "a",
                        "p": np.nan,
                        "low": 0.2,
                        "predicts": False,
                    },
                ]
            ),
        ],  # fmt: skip
        ignore_index=True,
    )
    again = adjust_comparisons(joined)
    assert again["predicts_unadjusted"].dtype == bool
    assert again["predicts_unadjusted"].tolist() == [True] * len(out) + [True, False, False]
    assert not (again["predicts"] & ~again["predicts_unadjusted"]).any()
    np.testing.assert_allclose(again["p_holm"][:-1], _holm_by_definition(list(joined["p"][:-1])), atol=1e-15)


def test_grid_mid_block_is_its_own_family():
    rng = np.random.default_rng(4)
    table = pd.DataFrame(
        {"group": ["down", "mid", "up", "mid", "all", "up"], "p": rng.uniform(0, 0.1, 6), "predicts": False}
    )
    out = adjust_grid(table)
    for family, groups in (("grid", ["down", "up", "all"]), ("mid block", ["mid"])):
        part = table[table["group"].isin(groups)]
        np.testing.assert_allclose(out.loc[part.index, "p_holm"], _holm_by_definition(list(part["p"])), atol=1e-15)
        assert (out.loc[part.index, "family"] == family).all()


def _effects(sets: int = 12, refs: int = 4, seed: int = 5) -> pd.DataFrame:
    """Effects where ``contribution_norm`` ranks the references exactly as ``latent_effect`` does, the posterior
    backwards, the rest at random."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(sets):
        effect = rng.permutation(refs).astype(float)
        for r in range(refs):
            rows.append({"set": s, "reference": r, "latent_effect": effect[r], "class_drop": rng.normal(),
                         "attention_share": rng.uniform(), "contribution_norm": 2 * effect[r] + 1,
                         "contribution_projection": rng.normal(), "posterior_weight": -effect[r]})  # fmt: skip
    return pd.DataFrame(rows)


def test_held_out_chooses_on_one_half_and_tests_on_the_other():
    effects = _effects(sets=24)  # 12 a half: an exact sign-flip p can reach 1 / 4096
    out, scores = held_out_aggregations(effects, None, permutations=4095)
    latent = out[out["effect"] == "latent_effect"]
    # norm and the negated posterior both rank exactly: the first of the tie (PREDICTORS' order) is chosen
    assert set(latent["chosen"]) == {"contribution_norm"} and (latent["sign"] == 1).all()
    assert latent["spearman"].tolist() == [1.0, 1.0]
    assert latent["agrees"].all()
    # the held-out mean of a predictor, recomputed with scipy on the odd sets
    odd = effects[effects["set"] % 2 == 1]
    shares = [stats.spearmanr(g["attention_share"], g["class_drop"]).statistic for _, g in odd.groupby("set")]
    row = out[(out["effect"] == "class_drop") & (out["fold"] == "even chooses")].iloc[0]
    held = scores[(scores["effect"] == "class_drop") & (scores["fold"] == "even chooses")]
    assert held[held["predictor"] == "attention_share"]["held_out_spearman"].item() == pytest.approx(
        np.mean(shares), abs=1e-12
    )
    assert row["sets"] == 12
    np.testing.assert_allclose(out["p_holm"], _holm_by_definition(list(out["p"])), atol=1e-15)


ATTRIBUTION_FOLDERS = sorted((Path(__file__).resolve().parents[1] / "docs" / "results").glob("*/attribution"))
#: Each decided table of a folder, its decision column and what splits it into Holm families (None: one family).
DECIDED = (
    ("comparisons_trained.csv", "predicts", None),
    ("comparisons_untrained.csv", "predicts", None),
    ("grid_comparisons_trained.csv", "predicts", "family"),
    ("held_out_trained.csv", "agrees", None),
    ("held_out_untrained.csv", "agrees", None),
)


def committed_decisions_disagree(folder: Path) -> list[str]:
    """What in one attribution folder's committed tables is not its own one-sided test: the decision not
    ``p_holm < 0.05`` with the test's own Holm per family, ``predicts_unadjusted`` not ``p < 0.05`` or not implied by
    ``predicts``, or the decision's interval ``[low, 1]`` (Holm-compatible: at least 0 where Holm rejects, at most 0
    where it retains, above 0 only where the whole family is rejected) on the wrong side of 0."""
    wrong = []
    for name, decision, family in DECIDED:
        if not (folder / name).exists():
            continue
        table = pd.read_csv(folder / name, dtype={"timestep": str})
        where = f"{folder.parent.name}/{name}"
        tested = table["p"].notna().to_numpy()
        own = np.full(len(table), np.nan)
        rejected_family = np.zeros(len(table), dtype=bool)
        keys = table[family] if family else pd.Series(0, index=table.index)
        for _, index in table[tested].groupby(keys[tested].to_numpy()).groups.items():
            rows = table.index.get_indexer(index)
            own[rows] = _holm_by_definition(list(table.loc[index, "p"]))
            rejected_family[rows] = (own[rows] < 0.05).all()
        decided = table[decision].astype(bool).to_numpy()
        if not np.allclose(table["p_holm"], own, rtol=1e-9, atol=0, equal_nan=True):
            wrong.append(f"{where}: p_holm is not Holm of p")
        if (decided != (own < 0.05)).any():
            wrong.append(f"{where}: {decision} != own Holm < 0.05 in {int((decided != (own < 0.05)).sum())} rows")
        if "predicts_unadjusted" in table.columns:
            unadjusted = table["predicts_unadjusted"].astype(bool).to_numpy()
            if (unadjusted != (table["p"] < 0.05).to_numpy()).any():
                wrong.append(f"{where}: predicts_unadjusted != p < 0.05")
            if (decided & ~unadjusted).any():
                wrong.append(f"{where}: {int((decided & ~unadjusted).sum())} rows decided after Holm, not before")
        low, high = table["low"].to_numpy(np.float64), table["high"].to_numpy(np.float64)
        sides = np.where(decided, low >= 0, low <= 0) & ((low <= 0) | (decided & rejected_family)) & (high == 1)
        if not sides[tested].all():
            wrong.append(f"{where}: [low, high] on the wrong side of 0 in {int((~sides[tested]).sum())} tested rows")
    return wrong


@pytest.mark.parametrize("folder", ATTRIBUTION_FOLDERS, ids=lambda f: f.parent.name)
def test_committed_decisions_are_one_test_each(folder):
    """Every committed attribution table: ``predicts`` / ``agrees`` is Holm's (the test's own) one-sided decision,
    ``predicts_unadjusted`` the same test before Holm, and the tested rows' interval the decision's."""
    assert {f.parent.name for f in ATTRIBUTION_FOLDERS} >= {"smoke", "full", "full_recipe_mixed"}
    assert committed_decisions_disagree(folder) == []


#: What one set's statistic can be over R references (written out here, not read from the package).
RANGES = {
    "share_spearman": lambda r: (-1.0, 1.0),
    "layer_agreement": lambda r: (-1.0, 1.0),
    "tv_attention_posterior": lambda r: (0.0, 1.0),
    "attention_tv": lambda r: (0.0, 1.0 - 1.0 / r),
    "attention_neff": lambda r: (1.0, float(r)),
    "posterior_neff": lambda r: (1.0, float(r)),
    "head_tv_above": lambda r: (0.0, 1.0),
    "position_tv_above": lambda r: (0.0, 1.0),
    "head_position_tv_above": lambda r: (0.0, 1.0),
}


@pytest.mark.parametrize("folder", ATTRIBUTION_FOLDERS, ids=lambda f: f.parent.name)
def test_committed_intervals_stay_inside_their_statistics_range(folder):
    """No committed interval reaches values its statistic cannot take (a bootstrap-t of a few skewed values did, up
    to 66.6 for an n_eff of 4 references), and every per-timestep verdict is the rule's one test."""
    outside = []
    for path in sorted((folder.parent / "ip-adapter").glob("attribution_*.csv")):
        table = pd.read_csv(path)
        for name, bounds in RANGES.items():
            if f"{name}_low" not in table:
                continue
            low, high = np.array([bounds(r) for r in table["references"]]).T
            for end in ("low", "high"):
                values = table[f"{name}_{end}"].to_numpy(np.float64)
                bad = (values < low - 1e-12) | (values > high + 1e-12)
                outside += [f"{path.name}: {name}_{end} {v:.4g}" for v in values[bad]]
        tv_high, p = table["attention_tv_high"].to_numpy(np.float64), table["share_spearman_p"].to_numpy(np.float64)
        decided = np.where(tv_high < 0.05, "pooling", np.where(p < 0.05, "tracks posterior", "undecided"))
        rule = np.where(np.isfinite(tv_high), decided, "undecided")
        assert (table["verdict"].to_numpy() == rule).all(), path
    for label in ("trained", "untrained"):
        controls = pd.read_csv(folder / f"controls_{label}.csv")
        width = np.array([np.subtract(*RANGES[s](4)[::-1]) for s in controls["statistic"]])
        for end in ("low", "high"):
            bad = controls[end].abs().to_numpy(np.float64) > width + 1e-12
            outside += [
                f"controls_{label}: {s} {end} {v:.4g}" for s, v in controls.loc[bad, ["statistic", end]].values
            ]
        gap = pd.read_csv(folder / f"comparisons_{label}.csv").query("predictor == 'posterior - attention'")
        outside += [f"comparisons_{label}: {v:.4g}" for v in gap[["low", "high"]].to_numpy().ravel() if abs(v) > 2]
    assert outside == []


@pytest.mark.parametrize("folder", ATTRIBUTION_FOLDERS, ids=lambda f: f.parent.name)
def test_committed_grid_tests_against_an_exact_recomputation(folder):
    """Every committed grid test recomputed here from ``grid_trained.csv``: scipy's Spearman per set, the sign-flip p
    over all 2^sets patterns (the grid's few sets make the committed p exact too), Holm per family by definition, and
    each tested row's ``low`` the Holm-compatible bound of the test inverted by the test's own bisection."""
    from helpers import inverted_bound, sign_flip_p

    grid = pd.read_csv(folder / "grid_trained.csv")
    table = pd.read_csv(folder / "grid_comparisons_trained.csv")
    values = []
    for r in table.itertuples():
        part = grid[(grid["group"] == r.group) & (grid["steps"] == r.steps) & (grid["mode"] == r.mode)]
        part = part[part["factor"] == r.factor].sort_values(["set", "reference"])
        per_set = [stats.spearmanr(s[r.predictor], s[r.effect]).statistic for _, s in part.groupby("set")]
        values.append(np.array([v for v in per_set if np.isfinite(v)]))
    assert (table["sets"] == [len(v) for v in values]).all()
    np.testing.assert_allclose(table["spearman"], [v.mean() for v in values], rtol=0, atol=1e-12)
    np.testing.assert_allclose(table["p"], [sign_flip_p(v) for v in values], rtol=0, atol=1e-12)
    for _, rows in table.groupby("family"):
        p_holm = np.array(_holm_by_definition(list(rows["p"])))
        np.testing.assert_allclose(rows["p_holm"], p_holm, rtol=0, atol=1e-12)
        rejected = p_holm < 0.05
        level = 0.05 / (int((~rejected).sum()) or len(rows))
        own = np.array([max(inverted_bound(values[i], level), -1.0) for i in rows.index])
        expected = np.where(rejected, 0.0 if (~rejected).any() else np.maximum(0.0, own), np.minimum(0.0, own))
        np.testing.assert_allclose(rows["low"], expected, rtol=0, atol=1e-12)
        assert (rows["predicts"] == rejected).all() and (rows["high"] == 1).all()


@pytest.mark.parametrize("folder", ATTRIBUTION_FOLDERS, ids=lambda f: f.parent.name)
def test_committed_step_mean_tests_against_a_recomputation(folder):
    """The comparisons' step-mean and whole-run rows recomputed here from ``effects_<label>.csv``: scipy's Spearman
    per set, and the one-sided sign-flip p from the test's own draws (exact enumeration where there are few sets),
    within four Monte Carlo standard errors of the committed p, which other signs drew."""
    from helpers import sign_flip_p

    rng = np.random.default_rng(52)
    for label in ("trained", "untrained"):
        effects = pd.read_csv(folder / f"effects_{label}.csv")
        table = pd.read_csv(folder / f"comparisons_{label}.csv", dtype={"timestep": str})
        rows = table[(table["timestep"] == "all") & table["p"].notna()]
        assert len(rows) >= 8, (folder, label)
        for r in rows.itertuples():
            per_set = [stats.spearmanr(s[r.predictor], s[r.effect]).statistic for _, s in effects.groupby("set")]
            v = np.array([x for x in per_set if np.isfinite(x)])
            assert r.sets == len(v) and r.spearman == pytest.approx(v.mean(), abs=1e-12)
            if len(v) <= 12:
                p, error = sign_flip_p(v), 1 / 50_000  # exact, as the committed one (up to its own draws' floor)
            else:
                flips = rng.choice([-1.0, 1.0], size=(20_000, len(v)))
                p = (1 + np.sum((flips * v).mean(1) >= v.mean() - 1e-12)) / 20_001
                error = 4 * np.sqrt(p * (1 - p) / 20_000 + r.p * (1 - r.p) / 50_000) + 1 / 20_001
            assert r.p == pytest.approx(p, abs=error), (folder.parent.name, label, r.predictor, r.effect)
