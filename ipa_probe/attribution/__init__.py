"""Which reference does the model use? Attention shares per reference against the exact posterior (issue #18 point 3).

``collect`` runs one seeded generation and tables, per recorded step, layer and reference, the attention share and
the exact NW posterior over the reference latents at the same noisy latent (:func:`reference_attribution`);
``analysis`` compares them over many reference sets with gauge-invariant statistics, intervals, permutation tests,
a fitted data-space temperature and a verdict by a pre-stated rule (:func:`summarize_attribution`). The causal side,
removing a reference's tokens, is :mod:`ipa_probe.intervention`; ``patching`` estimates its effect to first order
from one backward pass (attribution patching).
"""

from .analysis import (
    ALPHA,
    POOLING_TV,
    VERDICTS,
    cell_shares,
    cell_verdicts,
    clopper_pearson,
    clustered_clopper_pearson,
    control_difference,
    fit_bandwidth,
    holm,
    holm_lower_bounds,
    layer_agreement_test,
    neff,
    paired_rank_test,
    sign_flip_test,
    simultaneous_band,
    summarize_attribution,
    summarize_cells,
    tv_from_uniform,
    value_range,
    verdict,
    verdict_shares,
)
from .collect import (
    ATTRIBUTION_COLUMNS,
    CELL_COLUMNS,
    CONTRIBUTION_COLUMNS,
    ReferenceAttribution,
    posterior_at,
    reference_attribution,
    sets_table,
)
from .patching import PATCHING_COLUMNS, digit_probability_gradients, integrated_patching, patching_gradients

__all__ = [
    "ALPHA",
    "ATTRIBUTION_COLUMNS",
    "CELL_COLUMNS",
    "CONTRIBUTION_COLUMNS",
    "PATCHING_COLUMNS",
    "POOLING_TV",
    "ReferenceAttribution",
    "VERDICTS",
    "cell_shares",
    "cell_verdicts",
    "clopper_pearson",
    "clustered_clopper_pearson",
    "control_difference",
    "digit_probability_gradients",
    "fit_bandwidth",
    "holm",
    "holm_lower_bounds",
    "sign_flip_test",
    "integrated_patching",
    "layer_agreement_test",
    "neff",
    "paired_rank_test",
    "patching_gradients",
    "posterior_at",
    "reference_attribution",
    "sets_table",
    "simultaneous_band",
    "summarize_attribution",
    "summarize_cells",
    "tv_from_uniform",
    "value_range",
    "verdict",
    "verdict_shares",
]
