"""Undefined is NaN (issue #40 point 2): an all-tied row has no arg-max and no rank correlation, a cell whose NW side
never varies has no Pearson r; such values are NaN, left out of every mean and counted. Checked against the test's
own float64 recomputation (numpy, scipy), never through the code under test."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from ipa_probe.experiments.ip_adapter import summarize_sets
from ipa_probe.statistics.agreement import compare_weights
from ipa_probe.statistics.schema import STAT_NAMES


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _stat(values: torch.Tensor, name: str) -> float:
    return float(values[..., STAT_NAMES.index(name)])


def test_every_nw_row_uniform_gives_nan_for_what_needs_variation():
    """A query frame of one query: NW logits the same in every key, so rho, Pearson r and top-1 are undefined;
    KL and n_eff, which need no variation, stay finite."""
    rng = np.random.default_rng(0)
    attn = torch.tensor(rng.normal(size=(3, 5)))  # (R, K) float64
    nw = torch.zeros_like(attn)  # uniform NW rows
    out = compare_weights(attn, nw)
    for name in ("spearman", "pearson", "top1", "spearman_null"):
        assert np.isnan(_stat(out, name)), name
    a = _softmax(attn.numpy())
    expected_kl = (a * (np.log(a) - np.log(1 / 5))).sum(-1).mean()
    assert _stat(out, "kl") == pytest.approx(expected_kl, rel=1e-5)  # float32 result: 1e-5 relative
    assert _stat(out, "neff_nw") == pytest.approx(5.0, rel=1e-6)  # float32 result


def test_tied_rows_are_left_out_of_top1_and_rho():
    """Rows whose NW logits are all tied are left out of top-1 and rho; the rest match scipy / numpy in float64."""
    rng = np.random.default_rng(1)
    rows, keys = 12, 6
    attn = rng.normal(size=(rows, keys))
    nw = rng.normal(size=(rows, keys))
    tied = np.zeros(rows, dtype=bool)
    tied[::3] = True
    nw[tied] = 0.7  # all tied in these rows
    out = compare_weights(torch.tensor(attn), torch.tensor(nw))
    kept = ~tied
    top1 = (attn[kept].argmax(-1) == nw[kept].argmax(-1)).mean()
    rho = np.mean([stats.spearmanr(attn[i], nw[i]).statistic for i in np.flatnonzero(kept)])
    assert _stat(out, "top1") == pytest.approx(top1, abs=1e-6)  # float32 mean of 0/1 values
    assert _stat(out, "spearman") == pytest.approx(rho, abs=1e-6)  # float32 rank arithmetic
    # Pearson stays defined: the NW side varies in the other rows (all R * K entries take part)
    r = np.corrcoef(_softmax(attn).ravel(), _softmax(nw).ravel())[0, 1]
    assert _stat(out, "pearson") == pytest.approx(r, abs=1e-5)  # float32 sums over 72 entries


def test_summary_leaves_undefined_entries_out_and_counts_them():
    """summarize_sets: NaN entries (a 1 x 1 layer's query frame) are left out of every mean, and counted."""
    rng = np.random.default_rng(2)
    n = 40
    frame = pd.DataFrame(
        {
            "set": np.repeat(np.arange(5), 8),
            "timestep": np.tile([981, 1], 20),
            "layer": np.tile(["down", "down", "mid", "mid", "up", "up", "up", "up"], 5),
            "spearman": rng.uniform(0.5, 1, n),
            "pearson": rng.uniform(0.5, 1, n),
            "spearman_null": rng.normal(0, 0.05, n),
            "qf_spearman": rng.uniform(0.5, 1, n),
            "qf_pearson": rng.uniform(0.5, 1, n),
            "qf_top1": rng.uniform(0, 1, n),
        }
    )
    mid = frame["layer"] == "mid"
    frame.loc[mid, ["qf_spearman", "qf_pearson", "qf_top1"]] = np.nan
    summary = summarize_sets(frame)
    for _, row in summary.iterrows():
        part = frame[frame["timestep"] == row["timestep"]]
        kept = part[part["layer"] != "mid"]
        assert row["qf_pearson"] == pytest.approx(kept["qf_pearson"].to_numpy().mean(), rel=1e-12)
        assert row["qf_top1"] == pytest.approx(kept["qf_top1"].to_numpy().mean(), rel=1e-12)
        assert row["qf_undefined"] == int(part["layer"].eq("mid").sum())
        assert row["qf_entries"] == len(kept)


# --------------------------------------------------------------------------- the committed tables

ROOT = Path(__file__).resolve().parents[1]

#: The committed ip-adapter records made with the NaN rule (docs/results/README.md, "Issue #40"), by folder.
COMMITTED = ("smoke", "smoke_recipe_ip_adapter", "full", "full_recipe_ip_adapter", "full_recipe_mixed")


@functools.cache
def _one_query_heads(recipe: str) -> tuple[int, int]:
    """``(heads, heads of one-query layers)`` of the organism's IP-Adapter layers, counted from the queries that
    ``to_q`` returns to the test's own hooks in one denoiser pass (a layer whose latent grid is 1 x 1 has one query,
    hence a query frame of one row and no query-frame rho)."""
    from helpers import CaptureQK

    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_pipeline, digits_reference_images

    pipe = digits_pipeline(recipe=recipe)
    pipe.set_progress_bar_config(disable=True)
    with CaptureQK(pipe) as capture:
        pipe(DIGITS_PROMPT, ip_adapter_image=[digits_reference_images(3, 4, seed=0)], num_inference_steps=1,
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    heads = {layer.name: layer.attention.heads for layer in capture.layers}
    queries = {name: capture.captured[name]["q"][0].shape[1] for name in heads}
    return sum(heads.values()), sum(h for name, h in heads.items() if queries[name] == 1)


@pytest.mark.parametrize("folder", COMMITTED)
def test_committed_ip_adapter_tables_count_undefined_entries_and_leave_them_out(folder):
    """In every committed ip-adapter record made with the NaN rule, per weights and timestep: the entries are the
    organism's (set, layer, head) cells; exactly those of its one-query layers (counted from the test's own hooks)
    are undefined and counted (``qf_undefined``), the rest have a rho (``qf_entries``), every mean over entries is a
    number (NaN left out, not propagated), the table's note quotes the counts; the query pool's table counts the cells
    only the branch pool defines; the matched control's rows carry their sets and Holm-adjusted p (each direction's and
    both sides' logit ratio in the records made since issue #52)."""
    path = ROOT / "docs" / "results" / folder / "ip-adapter"
    record = json.loads((path / "record.json").read_text())
    heads, one_query = _one_query_heads(record["recipe"])
    assert one_query > 0  # the organism has a one-query layer, so the rule has something to count
    note = (path / "table.csv").read_text()
    means = ("qf_spearman", "qf_gauss_spearman", "qf_pearson", "qf_top1", "qf_gauss_pearson", "qf_gauss_top1")
    for weights in ("trained", "untrained"):
        for row in record["measurements"][weights]:
            assert row["entries"] == row["sets"] * heads, (weights, row["timestep"])
            assert row["qf_undefined"] == row["sets"] * one_query, (weights, row["timestep"])
            assert row["qf_entries"] == row["entries"] - row["qf_undefined"]
            assert all(math.isfinite(row[c]) for c in means), (weights, row["timestep"])
            assert f"{row['qf_entries']} of {row['entries']} entries" in note
    pool = pd.read_csv(path / "query_pool.csv")
    single = pool["images"] == 1
    assert (pool.loc[single, ["difference", "branch_only_cells"]] == 0).all().all()  # one item: the same pool
    # several items: the one-query layers' frames gain queries, so each set gains those cells, counted apart
    assert (pool.loc[~single, "branch_only_cells"] == pool.loc[~single, "sets"] * one_query).all()
    assert np.isfinite(pool[["item", "branch_pool", "difference", "se"]].to_numpy()).all()
    control = pd.read_csv(path / "matched_control.csv")
    columns = ["trained", "control_value", "difference", "low", "high"]
    if "r_gap" in control:  # since issue #52: both directions, each side's logit ratio
        columns += ["trained_r", "control_r", "r_gap"]
    for side in ("_above", "_below") if "r_gap" in control else ("",):
        assert (control[f"p_holm{side}"] >= control[f"p{side}"]).all()
        columns += [f"p{side}", f"p_holm{side}"]
    assert (control["sets"] >= 2).all() and np.isfinite(control[columns]).all().all()
