"""Undefined is NaN (issue #40 point 2): an all-tied row has no arg-max and no rank correlation, a cell whose NW side
never varies has no Pearson r; such values are NaN, left out of every mean and counted. Checked against the test's
own float64 recomputation (numpy, scipy), never through the code under test."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from ipa_probe.experiments.ip_adapter import summarize_sets
from ipa_probe.schema import STAT_NAMES
from ipa_probe.stats import compare_weights


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
