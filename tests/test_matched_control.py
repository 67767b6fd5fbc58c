"""The matched control and the query pool (issue #40 points 1 and 3), against the test's own recomputations."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import inverted_bound, sign_flip_p
from scipy import stats

from ipa_probe.experiments import matched_control as mc


def _per_set(rng, sets=6, shift=0.0):
    rows = []
    for s, t in itertools.product(range(sets), (981.0, 1.0)):
        rows.append({"set": s, "timestep": t, "qf_spearman": rng.uniform(0.7, 0.9) + shift,
                     "qf_rho_excess": rng.normal(-0.03, 0.01) + shift})  # fmt: skip
    return pd.DataFrame(rows)


def test_paired_control_against_enumerated_sign_flips():
    """Differences, their means and both one-sided p by enumerating all 2^12 sign flips; Holm over both directions
    and the table; each direction's Holm-compatible bound, the test inverted by the test's own bisection."""
    from ipa_probe.attribution import holm

    rng = np.random.default_rng(0)
    per_set = {"trained": _per_set(rng, 12), "untrained": _per_set(rng, 12, 0.08), "matched": _per_set(rng, 12, -0.05)}
    out = mc.paired_control(per_set)
    assert len(out) == 2 * 2 * 2  # controls x statistics x timesteps
    assert list(out["control"].unique()) == ["untrained", "matched"] and out["timestep"].iloc[0] == 981.0
    np.testing.assert_allclose(
        np.concatenate([out["p_holm_above"], out["p_holm_below"]]),
        holm(np.concatenate([out["p_above"], out["p_below"]])),
        atol=0,
    )
    rejected = np.concatenate([out["p_holm_above"], out["p_holm_below"]]) < 0.05
    kept = int((~rejected).sum())
    flips = np.array(list(itertools.product([1, -1], repeat=12)))  # (4096, 12)
    for r in out.to_dict(orient="records"):
        a = per_set["trained"][per_set["trained"]["timestep"] == r["timestep"]].sort_values("set")
        b = per_set[r["control"]][per_set[r["control"]]["timestep"] == r["timestep"]].sort_values("set")
        d = a[r["statistic"]].to_numpy() - b[r["statistic"]].to_numpy()
        assert r["difference"] == pytest.approx(d.mean(), abs=1e-12)
        assert r["trained"] == pytest.approx(a[r["statistic"]].mean()) and r["sets"] == 12
        null = (flips * d).mean(1)  # exact enumeration either way
        assert r["p_above"] == pytest.approx(np.mean(null >= d.mean() - 1e-12), abs=1e-12)
        assert r["p_below"] == pytest.approx(np.mean(null <= d.mean() + 1e-12), abs=1e-12)
        # each direction's bound: its own test inverted at 0.05 / (hypotheses Holm keeps, of both directions),
        # Holm-compatible
        for side, bound, sign in (("above", r["low"], 1), ("below", r["high"], -1)):
            own = inverted_bound(sign * d, 0.05 / (kept or 2 * len(out)))
            assert sign_flip_p(sign * d, own) >= 0.05 / (kept or 2 * len(out))
            expected = (0.0 if kept else max(0.0, own)) if r[f"p_holm_{side}"] < 0.05 else min(0.0, own)
            assert sign * bound == pytest.approx(expected, abs=1e-12)
        decision = "above" if r["p_holm_above"] < 0.05 else "below" if r["p_holm_below"] < 0.05 else "neither"
        assert r["decision"] == decision and (r["low"] > 0) <= (decision == "above")
        assert (r["high"] < 0) <= (decision == "below")
    assert set(out["decision"]) == {"above", "below", "neither"}  # every kind of row is checked
    assert "trained_r" not in out  # the frames carry no logit ratio


def test_paired_control_records_each_sides_logit_ratio():
    """Where the per-set frames carry ``qf_logit_ratio``, every row has the means over sets of both sides' ratio at
    its timestep and their gap (trained - control): the confound beside the numbers."""
    rng = np.random.default_rng(4)
    per_set = {k: _per_set(rng, 5) for k in ("trained", "matched")}
    for frame in per_set.values():
        frame["qf_logit_ratio"] = rng.uniform(1.5, 3.5, len(frame))
    out = mc.paired_control(per_set, controls=("matched",))
    assert len(out) == 2 * 2
    for r in out.to_dict(orient="records"):
        a, b = (per_set[k][per_set[k]["timestep"] == r["timestep"]]["qf_logit_ratio"] for k in ("trained", "matched"))
        assert r["trained_r"] == pytest.approx(a.mean(), abs=1e-12)
        assert r["control_r"] == pytest.approx(b.mean(), abs=1e-12)
        assert r["r_gap"] == pytest.approx(a.mean() - b.mean(), abs=1e-12)


def _cells(rng, sets=3, timesteps=(1.0,)):
    """Constructed (set, timestep, layer, head) cells where the rho gap is 0.03 - 0.2 x the r gap plus small noise,
    the trained r mostly above the control's (so the raw mean gap is confounded by it); one cell's rho is NaN."""
    rows = {"trained": [], "control": []}
    for s, t, layer, head in itertools.product(range(sets), timesteps, range(6), range(4)):
        r_control = rng.uniform(1.5, 3.5)
        gap = rng.normal(0.5, 0.3)
        rho_control = rng.uniform(0.6, 0.9)
        rho_gap = 0.03 - 0.2 * gap + rng.normal(0, 0.002)
        nan = layer == 5 and head == 0
        pairs = (("control", r_control, rho_control), ("trained", r_control + gap, rho_control + rho_gap))
        for label, r, rho in pairs:
            rows[label].append({"set": s, "timestep": t, "layer": layer, "head": head, "qf_logit_ratio": r,
                                "qf_spearman": np.nan if nan else rho, "qf_rho_excess": rho - 0.5})  # fmt: skip
    return pd.DataFrame(rows["trained"]), pd.DataFrame(rows["control"])


def test_equal_r_difference_is_the_intercept_of_the_gap_line():
    """The per-set intercept is scipy's linregress intercept (the difference at equal r), not the raw mean gap; NaN
    cells are left out."""
    trained, control = _cells(np.random.default_rng(2))
    out = mc.equal_r_differences(trained, control)
    assert len(out) == 3 * 2
    for r in out.to_dict(orient="records"):
        a = trained[trained["set"] == r["set"]]
        b = control[control["set"] == r["set"]]
        gap = a["qf_logit_ratio"].to_numpy() - b["qf_logit_ratio"].to_numpy()
        d = a[r["statistic"]].to_numpy() - b[r["statistic"]].to_numpy()
        ok = np.isfinite(d)
        fit = stats.linregress(gap[ok], d[ok])
        assert r["difference"] == pytest.approx(fit.intercept, abs=1e-10)
        assert r["slope"] == pytest.approx(fit.slope, abs=1e-10)
        assert r["raw_difference"] == pytest.approx(d[ok].mean(), abs=1e-12)
        assert r["r_gap_positive"] == pytest.approx(np.mean(gap[ok] > 0)) and r["cells"] == ok.sum()
        assert r["difference"] == pytest.approx(0.03, abs=0.005)  # the known difference at equal r
        assert r["raw_difference"] < 0  # what a comparison at unequal r would read


def test_init_adapter_control_tests_the_equal_r_differences_and_records_both_ratios():
    """The experiment's init-adapter tables from two probe tables: each test row is :func:`paired_tests` of the
    per-set intercepts (their mean recomputed with scipy here), beside the means over sets of the cells' raw
    difference and r gap, and each side's mean r (per set over cells, NaN rho cells kept for r, then over sets)."""
    trained, control = _cells(np.random.default_rng(3), sets=8, timesteps=(981.0, 1.0))
    out = mc.init_adapter_control(trained, control)
    tests, means = out["tests"], out["means"]
    assert len(tests) == 2 * 2 and set(tests["control"]) == {"init-adapter"} and tests["timestep"].iloc[0] == 981.0
    assert tests.equals(tests.dropna(subset=["trained_r", "control_r", "r_gap", "p_holm_below"]))
    for r in tests.to_dict(orient="records"):
        intercepts, raw, gaps = [], [], []
        for s in range(8):
            a = trained[(trained["set"] == s) & (trained["timestep"] == r["timestep"])]
            b = control[(control["set"] == s) & (control["timestep"] == r["timestep"])]
            gap = a["qf_logit_ratio"].to_numpy() - b["qf_logit_ratio"].to_numpy()
            d = a[r["statistic"]].to_numpy() - b[r["statistic"]].to_numpy()
            ok = np.isfinite(d)
            intercepts.append(stats.linregress(gap[ok], d[ok]).intercept)
            raw.append(d[ok].mean())
            gaps.append(gap[ok].mean())
        assert r["difference"] == pytest.approx(np.mean(intercepts), abs=1e-10) and r["sets"] == 8
        assert r["raw_difference"] == pytest.approx(np.mean(raw), abs=1e-12)
        assert r["r_gap"] == pytest.approx(np.mean(gaps), abs=1e-12)
        for side, frame in (("trained_r", trained), ("control_r", control)):
            part = frame[frame["timestep"] == r["timestep"]]
            assert r[side] == pytest.approx(part.groupby("set")["qf_logit_ratio"].mean().mean(), abs=1e-12)
    assert r["decision"] == "above" and r["low"] >= 0 > r["raw_difference"]  # 0.03 at equal r, below 0 at unequal
    assert set(means["organism"]) == {"trained", "init-adapter"} and len(means) == 2 * 8 * 2


def test_per_set_means_leave_nan_out_and_measure_tv():
    table = pd.DataFrame(
        {"set": [0, 0, 0, 1, 1, 1], "timestep": [1.0] * 6, "qf_spearman": [0.5, np.nan, 0.7, 0.1, 0.3, np.nan],
         "qf_rho_excess": [0.0, np.nan, 0.2, 0.1, 0.1, np.nan], "qf_logit_ratio": [2.0, 3.0, 4.0, 1.0, 2.0, 6.0]}
    )  # fmt: skip
    shares = pd.DataFrame(
        {"set": [0] * 4 + [1] * 4, "timestep": [1.0] * 8, "layer": ["a", "a", "b", "b"] * 2,
         "reference": [0, 1] * 4, "attention_share": [0.5, 0.5, 0.9, 0.1, 0.6, 0.4, 0.3, 0.7]}
    )  # fmt: skip
    out = mc.per_set_means(table, shares).set_index("set")
    assert out.loc[0, "qf_spearman"] == pytest.approx(0.6) and out.loc[1, "qf_spearman"] == pytest.approx(0.2)
    assert out.loc[0, "entries"] == 2
    assert out.loc[0, "qf_logit_ratio"] == pytest.approx(3.0) and out.loc[1, "qf_logit_ratio"] == pytest.approx(3.0)
    # TV from uniform over 2 references: |w_0 - 1/2|, averaged over the layers
    assert out.loc[0, "attention_tv"] == pytest.approx((0.0 + 0.4) / 2)
    assert out.loc[1, "attention_tv"] == pytest.approx((0.1 + 0.2) / 2)


def test_scale_key_projection_scales_the_image_keys():
    from ipa_probe.layers import find_ip_layers
    from ipa_probe.tiny.digits import digits_pipeline

    pipe = digits_pipeline()
    layers = find_ip_layers(pipe)
    name = layers[0].name
    x = torch.randn(2, 3, layers[0].processor.to_k_ip[0].in_features)
    before = layers[0].processor.to_k_ip[0](x)
    other = layers[1].processor.to_k_ip[0].weight.clone()
    mc.scale_key_projection(pipe, {name: 2.5})
    torch.testing.assert_close(layers[0].processor.to_k_ip[0](x), 2.5 * before, rtol=1e-6, atol=1e-6)  # float32
    assert torch.equal(layers[1].processor.to_k_ip[0].weight, other)
    with pytest.raises(ValueError, match="no IP layer named"):
        mc.scale_key_projection(pipe, {"nowhere": 2.0})


def test_pool_summary_against_numpy():
    rng = np.random.default_rng(1)
    rows = []
    for s, layer, head in itertools.product(range(4), ("a", "mid"), range(2)):
        item = np.nan if layer == "mid" else rng.uniform(0.6, 0.9)
        rows.append({"organism": "o", "images": 3, "branch": "cond", "timestep": 1.0, "set": s, "layer": layer,
                     "head": head, "pool_item": item, "pool_branch": rng.uniform(0.6, 0.9)})  # fmt: skip
    cells = pd.DataFrame(rows)
    cells["difference"] = cells["pool_branch"] - cells["pool_item"]
    out = mc._pool_summary(cells).iloc[0]
    both = cells[cells["layer"] == "a"]
    per_set = both.groupby("set")["difference"].mean().to_numpy()
    assert out["difference"] == pytest.approx(per_set.mean(), abs=1e-12)
    assert out["se"] == pytest.approx(per_set.std(ddof=1) / 2, abs=1e-12)
    assert out["item"] == pytest.approx(both["pool_item"].mean()) and out["branch_only_cells"] == 8


def test_query_pool_from_one_run_equals_a_run_per_pool():
    """The branch pool read from the item run (``qf_spearman_other_pool``) is what a run with
    ``query_frame="branch"`` reports for the same cells, so the pool table needs half the generations."""
    from ipa_probe.tiny.digits import digits_pipeline, digits_reference_images

    pipe = digits_pipeline(recipe="support")
    pipe.set_progress_bar_config(disable=True)
    sets = [digits_reference_images(3, 4, seed=0)]
    (_, one), (_, both) = (
        mc.query_pool({"support": pipe}, sets, [0, 49], counts=(1, 2), runs=r) for r in ("one", "both")
    )
    keys = ["organism", "images", "set", "step", "layer", "head", "branch"]
    one, both = (c.sort_values(keys).reset_index(drop=True) for c in (one, both))
    assert one[keys].equals(both[keys])
    assert np.array_equal(one["pool_item"], both["pool_item"], equal_nan=True)  # the same run's own column
    # the same rows and arithmetic in another pass: float32 reductions may vectorise differently (1e-6)
    np.testing.assert_allclose(one["pool_branch"], both["pool_branch"], rtol=0, atol=1e-6)
    two = one["images"] == 2
    assert (one.loc[two, "pool_item"].isna() & one.loc[two, "pool_branch"].notna()).any()  # the mid block gains a rho
    assert not np.allclose(one.loc[two, "difference"].dropna(), 0)  # two items per branch: the pools differ
    with pytest.raises(ValueError, match="runs: expected 'one' or 'both'"):
        mc.query_pool({"support": pipe}, sets, [0], runs="all")


@pytest.mark.parametrize("recipe", ["support", "ip-adapter"])
def test_init_adapter_pipeline_starts_where_training_did(recipe, tmp_path):
    """The control's adapter is exactly the tensors a training run of the recipe starts from (its checkpoint after 0
    steps), and every other weight is the trained organism's (``mixed`` shares ``support``'s initialiser)."""
    from safetensors.torch import load_file

    from ipa_probe.layers import find_ip_layers
    from ipa_probe.tiny.digits import DigitsAdapterConfig, DigitsTrainConfig, digits_pipeline, train_digits
    from ipa_probe.tiny.digits.model import init_adapter_pipeline

    config = DigitsAdapterConfig() if recipe == "ip-adapter" else DigitsTrainConfig()
    assert train_digits(tmp_path, config, progress=False, stop_after=0)["finished"] is False
    start = {k.removeprefix("model/"): v for k, v in load_file(str(tmp_path / "checkpoint.safetensors")).items()}
    control, trained = init_adapter_pipeline(recipe), digits_pipeline(recipe=recipe)
    for n, layer in enumerate(find_ip_layers(control)):
        for kind in ("to_k_ip", "to_v_ip"):
            key = (
                f"ip_layers/{n}.{kind}.0.weight"
                if recipe == "ip-adapter"
                else f"unet/{layer.name}.processor.{kind}.0.weight"
            )
            assert torch.equal(getattr(layer.processor, kind)[0].weight, start[key])
    projection = control.unet.encoder_hid_proj.image_projection_layers[0].state_dict()
    assert all(torch.equal(v, start[f"image_proj/{k}"]) for k, v in projection.items()) and len(projection) == 4
    adapter = ("_ip.", "encoder_hid_proj")
    ours, theirs = control.unet.state_dict(), trained.unet.state_dict()
    assert ours.keys() == theirs.keys()
    same = [torch.equal(ours[k], theirs[k]) for k in ours if not any(a in k for a in adapter)]
    assert all(same) and len(same) > 100
    assert not all(torch.equal(ours[k], theirs[k]) for k in ours if "_ip." in k)  # training moved the adapter
    for module in ("image_encoder", "vae", "text_encoder"):
        pairs = zip(getattr(control, module).parameters(), getattr(trained, module).parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


FULL = {"support": "full", "ip-adapter": "full_recipe_ip_adapter", "mixed": "full_recipe_mixed"}


@pytest.mark.parametrize("recipe", list(FULL))
def test_committed_init_adapter_control_compares_the_experiments_own_generations(recipe):
    """The full tier's init-adapter records (``init_adapter_means.csv``) take their trained side from the ip-adapter
    experiment's own one-digit generations: their means over the 100 sets equal the trained measurements the same
    run wrote into ``record.json``, so the control is compared on the experiment's data."""
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "docs" / "results" / FULL[recipe] / "ip-adapter"
    means = pd.read_csv(folder / "init_adapter_means.csv")
    ours = means[means["organism"] == "trained"].groupby("timestep")[["qf_spearman", "qf_logit_ratio"]].mean()
    full = json.loads((folder / "record.json").read_text())
    assert full["recipe"] == recipe and full["reference_sets"] == means["set"].nunique() == 100
    for row in full["measurements"]["trained"]:
        assert ours.loc[row["timestep"], "qf_spearman"] == pytest.approx(row["qf_spearman"], abs=1e-6)
        assert ours.loc[row["timestep"], "qf_logit_ratio"] == pytest.approx(row["qf_logit_ratio"], abs=1e-6)


@pytest.mark.parametrize(
    "recipe, folder, atol", [("support", "smoke", 1e-7), ("ip-adapter", "smoke_recipe_ip_adapter", 1e-7)]
)
def test_the_smoke_tiers_init_adapter_records_equal_the_full_tiers(recipe, folder, atol):
    """Each set of the init-adapter control is seeded on its own: on the sets the two tiers share (the smoke tier's
    20, sets and seeds 0-19) the smoke run's per-set lines and means equal the full run's, bit for bit where one code
    made both; issue #52 reran the full tier's folders alone with later code, which moved float32 rounding by up to
    6e-8 (``atol`` 1e-7 until the smoke folders are rerun)."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    for name, keys in (("per_set", ["set", "timestep", "statistic"]), ("means", ["set", "timestep", "organism"])):
        ours = pd.read_csv(results / folder / "ip-adapter" / f"init_adapter_{name}.csv")
        full = pd.read_csv(results / FULL[recipe] / "ip-adapter" / f"init_adapter_{name}.csv")
        both = ours.merge(full, on=keys, suffixes=("", "_full"), validate="one_to_one")
        assert len(both) == len(ours) == 20 * 5 * 2 and len(full) == 100 * 5 * 2
        for column in ours.columns.difference(keys):
            if atol == 0 or not pd.api.types.is_float_dtype(both[column]):
                np.testing.assert_array_equal(both[column], both[f"{column}_full"], err_msg=column)
            else:
                np.testing.assert_allclose(both[column], both[f"{column}_full"], rtol=0, atol=atol, err_msg=column)
