"""The matched control and the query pool (issue #40 points 1 and 3), against the test's own recomputations."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from ipa_probe.experiments import matched_control as mc


def _per_set(rng, sets=6, shift=0.0):
    rows = []
    for s, t in itertools.product(range(sets), (981.0, 1.0)):
        rows.append({"set": s, "timestep": t, "qf_spearman": rng.uniform(0.7, 0.9) + shift,
                     "qf_rho_excess": rng.normal(-0.03, 0.01) + shift})  # fmt: skip
    return pd.DataFrame(rows)


def test_paired_control_against_enumerated_sign_flips():
    """Differences, their means and the one-sided p by enumerating all 2^12 sign flips; Holm over the table."""
    from ipa_probe.attribution import holm

    rng = np.random.default_rng(0)
    per_set = {"trained": _per_set(rng, 12), "untrained": _per_set(rng, 12, 0.08), "matched": _per_set(rng, 12)}
    out = mc.paired_control(per_set)
    assert len(out) == 2 * 2 * 2  # controls x statistics x timesteps
    for r in out.to_dict(orient="records"):
        a = per_set["trained"][per_set["trained"]["timestep"] == r["timestep"]].sort_values("set")
        b = per_set[r["control"]][per_set[r["control"]]["timestep"] == r["timestep"]].sort_values("set")
        d = a[r["statistic"]].to_numpy() - b[r["statistic"]].to_numpy()
        assert r["difference"] == pytest.approx(d.mean(), abs=1e-12)
        flips = np.array(list(itertools.product([1, -1], repeat=len(d))))  # (4096, 12)
        null = (flips * d).mean(1)
        assert r["p"] == pytest.approx(np.mean(null <= d.mean() + 1e-12), abs=1e-12)  # exact enumeration either way
        # the decision's interval (-inf, U]: Student's t at 0.05 / (tests Holm keeps), Holm-compatible (0 for a
        # rejection while some are kept; never below 0 for a kept one)
        rejected = out["p_holm"] < 0.05
        kept = int((~rejected).sum())
        t_bound = d.mean() + stats.t.ppf(1 - 0.05 / (kept or len(out)), len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
        expected = (0.0 if kept else min(0.0, t_bound)) if r["p_holm"] < 0.05 else max(0.0, t_bound)
        assert r["high"] == pytest.approx(expected, abs=1e-12) and r["low"] == -np.inf
        assert (r["high"] < 0) <= (r["p_holm"] < 0.05)
    np.testing.assert_allclose(out["p_holm"], holm(out["p"].to_numpy()), atol=0)
    assert (out["p_holm"] < 0.05).any() and (out["p_holm"] >= 0.05).any()  # both kinds of row are checked


def test_per_set_means_leave_nan_out_and_measure_tv():
    table = pd.DataFrame(
        {"set": [0, 0, 0, 1, 1, 1], "timestep": [1.0] * 6, "qf_spearman": [0.5, np.nan, 0.7, 0.1, 0.3, np.nan],
         "qf_rho_excess": [0.0, np.nan, 0.2, 0.1, 0.1, np.nan]}
    )  # fmt: skip
    shares = pd.DataFrame(
        {"set": [0] * 4 + [1] * 4, "timestep": [1.0] * 8, "layer": ["a", "a", "b", "b"] * 2,
         "reference": [0, 1] * 4, "attention_share": [0.5, 0.5, 0.9, 0.1, 0.6, 0.4, 0.3, 0.7]}
    )  # fmt: skip
    out = mc.per_set_means(table, shares).set_index("set")
    assert out.loc[0, "qf_spearman"] == pytest.approx(0.6) and out.loc[1, "qf_spearman"] == pytest.approx(0.2)
    assert out.loc[0, "entries"] == 2
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
