"""The attribution predictors' aggregation chosen on held-out sets (issue #40 point 5): the aggregates against the
test's own means, the chooser against a planted aggregation that predicts on one half only (it must not be reported
as agreeing) and on both halves (it must), and the overall-only case against the older chooser."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ipa_probe.experiments.attribution_aggregate import aggregate, candidates, held_out_aggregations
from ipa_probe.experiments.attribution_setup import STEP_PREDICTORS

LAYERS = [
    "down_blocks.0.attentions.0.transformer_blocks.0.attn2",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn2",
    "mid_block.attentions.0.transformer_blocks.0.attn2",
    "up_blocks.1.attentions.0.transformer_blocks.0.attn2",
    "up_blocks.2.attentions.1.transformer_blocks.0.attn2",
]
STEPS = {0: 951.0, 5: 701.0, 10: 451.0, 15: 201.0, 19: 1.0}


def _organism(sets: int = 16, planted: str = "even", seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A synthetic attribution table and effects: every predictor random, except the attention share in the up
    blocks at the first third's steps (0 and 5), which ranks the references as ``latent_effect`` does on the sets
    ``planted`` names (``"even"``, ``"all"``)."""
    rng = np.random.default_rng(seed)
    rows, effects = [], []
    for s in range(sets):
        effect = rng.permutation(4).astype(float)
        for r in range(4):
            effects.append({"set": s, "reference": r, "digit": r // 2, "latent_effect": effect[r],
                            "class_drop": rng.normal()})  # fmt: skip
        for step, timestep in STEPS.items():
            posterior = rng.dirichlet(np.ones(4))
            for layer in LAYERS:
                for r in range(4):
                    row = {"set": s, "step": step, "timestep": timestep, "layer": layer, "reference": r,
                           "posterior_weight": posterior[r]}  # fmt: skip
                    row.update({p: rng.uniform() for p in STEP_PREDICTORS if p != "posterior_weight"})
                    if layer.startswith("up_") and step <= 6 and (planted == "all" or s % 2 == 0):
                        row["attention_share"] = 10.0 + effect[r]
                    rows.append(row)
    table = pd.DataFrame(rows)
    effects = pd.DataFrame(effects)
    overall = table.groupby(["set", "reference"], as_index=False)[list(STEP_PREDICTORS)].mean()
    return table, effects.merge(overall, on=["set", "reference"])


def test_aggregates_are_the_means_over_their_layers_and_steps():
    table, _ = _organism(sets=3)
    out = aggregate(table)
    selections = {"all steps": list(STEPS), "first third": [0, 5], "last third": [15, 19]}
    selections.update({f"t={t:g}": [s] for s, t in STEPS.items()})
    groups = {"all": LAYERS, "down": LAYERS[:2], "mid": LAYERS[2:3], "up": LAYERS[3:]}
    assert len(out) == 3 * 4 * len(groups) * len(selections)
    records = table.to_dict(orient="records")
    for row in out.sample(40, random_state=0).itertuples():
        for predictor in STEP_PREDICTORS:
            values = [
                r[predictor]
                for r in records
                if r["set"] == row.set and r["reference"] == row.reference and r["layer"] in groups[row.group]
                and r["step"] in selections[row.steps]
            ]  # fmt: skip
            assert getattr(row, predictor) == pytest.approx(np.mean(values), rel=1e-12)  # the same float64 sum


def test_an_aggregation_planted_on_one_half_does_not_agree_on_the_other():
    table, effects = _organism(planted="even")
    out, scores = held_out_aggregations(effects, aggregate(table), permutations=999)
    row = out[(out["effect"] == "latent_effect") & (out["fold"] == "even chooses")].iloc[0]
    # the even half chooses an aggregation holding the planted cells (a perfect ranking there; the planted values
    # are large enough to rank every mean that includes them) ...
    assert (row["chosen"], row["sign"], row["selection_spearman"]) == ("attention_share", 1, 1)
    assert row["group"] in {"all", "up"} and row["steps"] in {"all steps", "first third", "t=951", "t=701"}
    # ... and the odd half, where it is noise, does not confirm it
    assert not row["agrees"] and row["p_holm"] >= 0.05
    assert row["candidates"] == len(candidates(effects, aggregate(table))[1]) > 100
    # the held-out mean recomputed with scipy over the odd sets
    odd = aggregate(table).query("group == @row.group and steps == @row.steps and set % 2 == 1")
    merged = odd.merge(effects[["set", "reference", "latent_effect"]], on=["set", "reference"])
    rho = [stats.spearmanr(g["attention_share"], g["latent_effect"]).statistic for _, g in merged.groupby("set")]
    assert row["spearman"] == pytest.approx(np.mean(rho), abs=1e-12)
    chosen = scores[(scores["effect"] == "latent_effect") & (scores["fold"] == "even chooses")
                    & (scores["group"] == row["group"]) & (scores["steps"] == row["steps"])
                    & (scores["predictor"] == "attention_share")]  # fmt: skip
    assert chosen["held_out_spearman"].item() == pytest.approx(np.mean(rho), abs=1e-12)


def test_an_aggregation_planted_on_every_set_agrees():
    table, effects = _organism(planted="all")
    out, _ = held_out_aggregations(effects, aggregate(table), permutations=999)
    latent = out[out["effect"] == "latent_effect"]
    assert (latent["chosen"] == "attention_share").all() and latent["group"].isin(["all", "up"]).all()
    assert latent["agrees"].all() and (latent["spearman"] == 1).all()


def test_without_aggregates_it_is_the_overall_chooser():
    _, effects = _organism(planted="all")
    new, scores = held_out_aggregations(effects, None, permutations=999)
    assert (new["steps"] == "all steps").all() and (new["group"] == "all").all()
    assert len(scores) == 4 * len(scores[["predictor"]].drop_duplicates())  # one candidate per predictor


def test_too_few_sets_is_refused():
    table, effects = _organism(sets=3)
    with pytest.raises(ValueError, match="two sets on each side"):
        held_out_aggregations(effects, aggregate(table))


def test_observe_again_refuses_a_record_whose_sets_are_not_the_experiments(tmp_path):
    """The regeneration makes each set from its index: a file whose digits differ from that set is refused."""
    from ipa_probe.experiments.attribution_aggregate import observe_again

    pd.DataFrame({"set": [0] * 4, "reference": range(4), "digit": [5, 5, 6, 6]}).to_csv(
        tmp_path / "effects_trained.csv", index=False
    )  # set 0 of the experiment is digits 0, 0, 1, 1
    (tmp_path / "record.json").write_text('{"control_sets": 2}')
    with pytest.raises(ValueError, match=r"set 0 holds digits \[5, 5, 6, 6\]"):
        observe_again(tmp_path, "support", labels=("trained",))


@pytest.mark.parametrize(
    "folder", ["full", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke", "smoke_recipe_ip_adapter"]
)
def test_committed_tables_are_what_their_csvs_say(folder, tmp_path):
    """Each committed attribution ``table.md`` / ``table.csv`` is :func:`table_rows` of the folder's own CSVs."""
    import shutil
    from pathlib import Path

    from ipa_probe.experiments.attribution import retable

    source = Path(__file__).parents[1] / "docs" / "results" / folder / "attribution"
    copy = tmp_path / "attribution"
    shutil.copytree(source, copy)
    retable(copy)
    for name in ("table.md", "table.csv"):
        assert (copy / name).read_text() == (source / name).read_text(), f"{folder}/attribution/{name}"
    held = pd.read_csv(source / "held_out_trained.csv")
    assert {"group", "steps", "candidates"} <= set(held.columns)  # chosen over predictors x aggregations
