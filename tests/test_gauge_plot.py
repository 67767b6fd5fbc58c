"""The gauge-sweep figure: every gauge's lines in both frames, data-driven ranges, every line named, readable text."""

import numpy as np
import pandas as pd
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from ipa_probe.gauge import plot_gauge_sweep  # noqa: E402

GAUGES = ("identity", "c = 0.25", "random:0:1 (cond <= 69.6)")
TIMESTEPS = (951.0, 501.0, 1.0)


def _table() -> pd.DataFrame:
    """A gauge_sweep-shaped table: the stored frame moves by gauge, the query frame differs by 1e-7 only."""
    rng = np.random.default_rng(0)
    rows = []
    for g, gauge in enumerate(GAUGES):
        for step, t in enumerate(TIMESTEPS):
            for branch in ("cond", "uncond"):
                qf = 0.78 + 0.01 * step
                rows.append(
                    {
                        "gauge": gauge,
                        "step": step,
                        "timestep": t,
                        "kind": "image",
                        "branch": branch,
                        "spearman": 0.1 + 0.3 * g + 0.01 * step,
                        "rho_baseline": 0.12 + 0.3 * g,
                        "rho_excess": -0.02 - 0.1 * g,
                        "qf_spearman": qf + 1e-7 * g,
                        "qf_gauss_spearman": qf - 0.02,
                        "qf_rho_excess": -0.016 + 1e-7 * rng.standard_normal(),
                        "neff_attn": 7.9 + 0.01 * step,
                    }
                )
    return pd.DataFrame(rows)


def test_plot_gauge_sweep_draws_both_frames_with_fitted_ranges_and_a_full_legend():
    table = _table()
    fig = plot_gauge_sweep(table)
    stored, query, excess, neff = fig.axes[:4]
    cond = table[table["branch"] == "cond"]

    def drawn(ax):
        return sorted(tuple(np.round(line.get_ydata(), 9)) for line in ax.get_lines() if len(line.get_ydata()) == 3)

    def expected(columns):
        return sorted(
            tuple(np.round(cond[cond["gauge"] == g].sort_values("timestep", ascending=False)[c].to_numpy(), 9))
            for g in GAUGES
            for c in columns
        )

    assert drawn(stored) == expected(["spearman", "rho_baseline"])
    assert drawn(query) == expected(["qf_spearman", "qf_gauss_spearman"])
    assert drawn(excess) == expected(["rho_excess", "qf_rho_excess"])
    assert drawn(neff) == expected(["neff_attn"])
    # the query frame's y range fits its data (0.76 .. 0.80), not a fixed span that would hide 0.02 differences
    low, high = query.get_ylim()
    assert 0.74 < low < 0.76 and 0.80 < high < 0.82
    # the stored frame's range holds all its lines
    low, high = stored.get_ylim()
    assert low < 0.1 and high > 0.1 + 0.6 + 0.02
    # the titles state the largest gap between gauges at one step, recomputed here
    gap = cond.groupby("timestep")["spearman"].agg(lambda v: v.max() - v.min()).max()
    assert f"ρ {gap:.2g}" in stored.get_title()
    # every gauge and every line style is named in a legend (two keys: colours, line styles; at most 7 entries each)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 2 and all(len(legend.get_texts()) <= 7 for legend in legends)
    labels = [text.get_text() for legend in legends for text in legend.get_texts()]
    assert all(g in labels for g in GAUGES)
    for what in ("stored-frame ρ", "baseline", "query-frame ρ, exact b", "query-frame ρ, Gaussian b"):
        assert any(what in label for label in labels), what
    # drawn at a paper's page width and measured as drawn: text at 8 pt or more, none overlapping or cut, no legend
    # over data, every axis labelled, at most a page tall
    from ipa_probe.figstyle import DOUBLE_COLUMN, drawn_problems, size_problems

    assert drawn_problems(fig) == []
    assert fig.get_size_inches()[0] == DOUBLE_COLUMN and size_problems(*fig.get_size_inches()) == []
    # the selection (attention branch, CFG branch) is in the title
    assert "image branch" in fig._suptitle.get_text() and "cond CFG branch" in fig._suptitle.get_text()
    matplotlib.pyplot.close(fig)


def test_plot_gauge_sweep_without_query_frame_columns_says_so():
    table = _table().drop(columns=["qf_spearman", "qf_gauss_spearman", "qf_rho_excess"])
    fig = plot_gauge_sweep(table, branch="uncond")
    query = fig.axes[1]
    assert not query.get_lines() and any("not in this table" in t.get_text() for t in query.texts)
    assert "n/a" in query.get_title()
    matplotlib.pyplot.close(fig)
