"""The attribution experiment's tests after correction (issue #40 points 5 and 6): one-sided decisions, Holm across
each table, the mid block apart, the posterior labelled where it is read after the output is decided, exact flip-rate
intervals, and a predictor chosen on one half of the reference sets and tested on the other.

Every p-value is the one-sided sign-flip p of the per-set Spearman (:func:`ipa_probe.attribution.sign_flip_test`: a
predictor ranks the references as the effect does), decided after Holm's adjustment below
:data:`~ipa_probe.attribution.ALPHA`, with the same test's interval ``[low, 1]`` (:func:`ipa_probe.attribution.
holm_lower_bounds`). Families: one organism's
comparison table; the grid without the mid block; the mid block; one organism's held-out tests. The posterior read at
``t <`` :data:`DECIDED_BELOW` is labelled ``near_circular``. Held out: the even sets choose the predictor (and its
sign), the odd sets test it, then the roles swap. The conventions in full: docs/attribution.md.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = [
    "DECIDED_BELOW",
    "adjust_comparisons",
    "adjust_grid",
    "example_intervals",
]

#: Timesteps below this are read after the output is decided (the grid: the effect lives in steps 0-6, t >= 651).
DECIDED_BELOW = 651.0


def _decide(frame: pd.DataFrame, family: pd.Series | None = None) -> pd.DataFrame:
    """``p_holm`` per family (one family when ``family`` is None), ``predicts`` = ``p_holm < ALPHA`` and
    ``predicts_unadjusted`` = ``p < ALPHA`` (the same one-sided test before Holm: no interval). Where the frame
    carries each test's null (a ``_null`` column, dropped here), the tested rows' interval becomes the one the
    decision uses: ``[low, 1]``, ``low`` the family's Holm-compatible one-sided bound inverting the same test, cut at
    -1 (:func:`ipa_probe.attribution.holm_lower_bounds`; at least 0 where ``predicts``, at most 0 elsewhere)."""
    from ..attribution import ALPHA, holm, holm_lower_bounds

    out = frame.copy()
    out["predicts_unadjusted"] = (out["p"] < ALPHA).to_numpy()
    out["p_holm"] = np.nan
    keys = pd.Series(0, index=out.index) if family is None else family
    for _, index in out.groupby(keys.to_numpy()).groups.items():
        out.loc[index, "p_holm"] = holm(out.loc[index, "p"].to_numpy(np.float64))
        if "_null" in out.columns:
            nulls = [np.atleast_1d(n) for n in out.loc[index, "_null"]]  # NaN: a row without a test
            low = np.maximum(holm_lower_bounds(nulls, out.loc[index, "p_holm"]), -1.0)
            tested = np.isfinite(low)
            out.loc[index[tested], "low"], out.loc[index[tested], "high"] = low[tested], 1.0
    out["predicts"] = (out["p_holm"] < ALPHA).to_numpy()
    return out.drop(columns="_null", errors="ignore")


def adjust_comparisons(table: pd.DataFrame) -> pd.DataFrame:
    """One organism's :func:`~ipa_probe.experiments.attribution.compare` table after correction: ``p_holm`` over the
    whole table, ``predicts`` on it, and ``near_circular`` for the posterior read at or after the decided steps."""
    out = _decide(table)
    when = pd.to_numeric(out["timestep"], errors="coerce")  # "all": the mean over every recorded step
    late = when.isna() | (when < DECIDED_BELOW)
    out["near_circular"] = (out["predictor"].isin(["posterior_weight", "posterior - attention"]) & late).to_numpy()
    return out


def adjust_grid(table: pd.DataFrame) -> pd.DataFrame:
    """The grid's comparisons (:func:`~ipa_probe.experiments.attribution_grid.compare_grid`) after correction: a
    ``family`` column (``"mid block"`` apart, ``"grid"`` for the rest), ``p_holm`` within each, ``predicts`` on it."""
    out = table.copy()
    out["family"] = np.where(out["group"] == "mid", "mid block", "grid")
    return _decide(out, out["family"])


def example_intervals(example: pd.DataFrame) -> pd.DataFrame:
    """The 2 + 2 example's rates (``flipped``, ``baseline_reads_5``, ``reads_5``) with Clopper-Pearson intervals over
    its seeds in place of Student's t, and the counts they come from (``<rate>_count`` of ``seeds``)."""
    from ..attribution import clopper_pearson

    out = example.copy()
    for column in ("flipped", "baseline_reads_5", "reads_5"):
        if column not in out.columns:
            continue
        counts = np.rint(out[column].to_numpy(np.float64) * out["seeds"].to_numpy()).astype(int)
        bounds = [clopper_pearson(k, n) for k, n in zip(counts, out["seeds"].to_numpy(int), strict=True)]
        out[f"{column}_count"] = counts
        out[f"{column}_low"], out[f"{column}_high"] = (np.array(b) for b in zip(*bounds, strict=True))
    return out
