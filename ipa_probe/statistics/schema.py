"""The one list of what a probe records: per-cell fields, table columns and summary columns.

Everything that writes or reads a probe's numbers (the statistics, the capture buffers, the tidy table, the
per-timestep summary and the sweeps' aggregates) takes its names from here, so a column cannot be added in one place
and forgotten in another. This module imports nothing: it sits below every module that reads it.
"""

from __future__ import annotations

__all__ = [
    "AUTO_SAMPLE_ROWS",
    "BRANCH_LABELS",
    "CELL_FIELDS",
    "COLUMNS",
    "FEW_KEYS",
    "GAUGE_COLUMNS",
    "INDEX_COLUMNS",
    "NULL_COLUMNS",
    "QUERY_FRAMES",
    "QUERY_FRAME_COLUMN",
    "QUERY_FRAME_COLUMNS",
    "QUERY_FRAME_PREFIXES",
    "QUERY_FRAME_STATS",
    "QUERY_POOL_OTHER_COLUMN",
    "ROW_KEY_BUDGET",
    "ROW_SAMPLE_COLUMNS",
    "ROW_THRESHOLD",
    "SAMPLED_COLUMNS",
    "SAMPLE_GROUPS",
    "STAT_NAMES",
    "SUMMARY_GAUGE_MEANS",
    "SUMMARY_HEADLINE",
    "SUMMARY_KEYS",
    "SUMMARY_MAX",
    "SUMMARY_MEANS",
    "SUMMARY_QUERY_FRAME_MEANS",
    "frac_column",
    "frac_null_column",
    "query_frame_column",
    "rows_column",
    "se_column",
]

#: The per-row rho threshold of the rows' shares in :data:`NULL_COLUMNS` (the paper's 0.9).
ROW_THRESHOLD: float = 0.9


def rows_column(threshold: float = ROW_THRESHOLD) -> str:
    """The name of the cell column counting the share of a cell's rows with rho above ``threshold``,
    e.g. ``"rows_rho_gt_0.9"``."""
    return f"rows_rho_gt_{threshold:g}"


#: What the per-row rho depends on besides the model (see docs/gauge.md): ``logit_ratio`` (per row
#: ``r = sd_i(q·k_i) / sd_i(|k_i|^2 / 2)``, averaged over rows), ``rho_baseline`` (the rho a row of that ``r`` and
#: number of keys gives when its key-norm term is independent of its attention logits) and ``rho_excess``
#: (``spearman - rho_baseline``).
GAUGE_COLUMNS: tuple[str, ...] = ("logit_ratio", "rho_baseline", "rho_excess")

#: The per-row rho read against chance for the cell's number of keys: the share of rows with rho above
#: :data:`ROW_THRESHOLD` and its chance level under independent rankings, the shares of rows at exactly +1 and -1,
#: and the chance of exactly +1 (equal to that of -1: ``1 / K!`` for ``K`` distinct keys).
NULL_COLUMNS: tuple[str, ...] = (
    rows_column(),
    f"{rows_column()}_null",
    "rows_rho_pos1",
    "rows_rho_neg1",
    "rows_rho_pos1_null",
)

#: The fields of :func:`ipa_probe.statistics.agreement.compare_weights`' last dimension, in order.
STAT_NAMES: tuple[str, ...] = (
    "spearman",
    "spearman_null",
    "pearson",
    "kl",
    "top1",
    "neff_attn",
    "neff_nw",
    "nonfinite",
    *GAUGE_COLUMNS,
    *NULL_COLUMNS,
)

#: The statistics of :data:`STAT_NAMES` that the query frame reports (docs/gauge.md, "The query frame"): all but
#: ``neff_attn`` and ``nonfinite``, which are the attention's own and the same in every frame.
QUERY_FRAME_STATS: tuple[str, ...] = tuple(name for name in STAT_NAMES if name not in ("neff_attn", "nonfinite"))

#: Column prefix of each form of the query-frame key term (:data:`ipa_probe.statistics.kernels.QUERY_FRAME_FORMS`): the
# exact  log-partition over the frame's queries, and its Gaussian (mean + variance / 2) form.
QUERY_FRAME_PREFIXES: dict[str, str] = {"exact": "qf_", "gaussian": "qf_gauss_"}


def query_frame_column(name: str, form: str = "exact") -> str:
    """The name of a query-frame column: ``name`` (one of :data:`QUERY_FRAME_STATS`) for ``form``, e.g.
    ``"qf_spearman"`` or ``"qf_gauss_rho_excess"``."""
    return f"{QUERY_FRAME_PREFIXES[form]}{name}"


#: The query-frame statistics per cell: :data:`QUERY_FRAME_STATS` of NW weights ``softmax_i(L_qi - b_i)`` against
#: the attention, ``b_i`` the key's log-partition over the frame's queries
#: (:func:`ipa_probe.statistics.kernels.query_frame_bias`), exact form first (``qf_*``), then the Gaussian form
#: (``qf_gauss_*``). Unlike the stored-frame columns (the unprefixed ``spearman``, ``pearson``, ..., whose NW
#: weights use the stored keys' norms and so move under a per-head basis change of q and k that changes no
#: output), they depend on the attention logits alone.
QUERY_FRAME_COLUMNS: tuple[str, ...] = tuple(
    query_frame_column(name, form) for form in QUERY_FRAME_PREFIXES for name in QUERY_FRAME_STATS
)

#: The per-cell statistics computed row by row, which a row sample (:class:`ipa_probe.ProbeConfig`'s ``rows``)
#: estimates: :data:`STAT_NAMES`, then :data:`QUERY_FRAME_COLUMNS`.
SAMPLED_COLUMNS: tuple[str, ...] = (*STAT_NAMES, *QUERY_FRAME_COLUMNS)


def se_column(name: str) -> str:
    """The name of the column holding the sampling error of ``name`` (one of :data:`SAMPLED_COLUMNS`), e.g.
    ``"spearman_se"``."""
    return f"{name}_se"


#: The row sample's columns: ``row_fraction`` (the share of a cell's query rows its per-row statistics used: 1 when
#: exact) and, per column of :data:`SAMPLED_COLUMNS`, its standard error (``<column>_se``: 0 when exact; the
#: random-groups estimate of :func:`ipa_probe.statistics.agreement.compare_frames` when sampled; for a mean over
# several cells  the root of the summed variances over the count). The probe's buffers keep each standard error
# squared.
ROW_SAMPLE_COLUMNS: tuple[str, ...] = ("row_fraction", *(se_column(name) for name in SAMPLED_COLUMNS))

#: The pools of queries a query frame can be estimated over (:class:`ipa_probe.ProbeConfig`'s ``query_frame``):
#: ``"item"``, one batch item's query positions (its frames pooled) at one step, per layer, head and adapter;
#: ``"branch"``, every item of one CFG branch of the denoiser pass pooled.
QUERY_FRAMES: tuple[str, ...] = ("item", "branch")

#: ``rows="auto"``: the most query rows x keys per cell computed exactly. The measured curve (docs/measured.md, "The
#: curve at every adapter size", one torch thread) met the 1.05 target with exact statistics at 16 x 16 latents with
#: 4 and 16 tokens (256 rows: up to 4,096 row-keys) and at 32 x 32 with 4 tokens (1,024 rows x 4 = 4,096), and missed
#: it everywhere beyond (32 x 32 with 16 tokens, 16,384 row-keys: 1.12; 64 tokens: 1.30-2.15).
ROW_KEY_BUDGET: int = 4096

#: ``rows="auto"``: the most rows of a sample (the former default ``rows=256``, which met the 1.02 target at 512 px
#: with 4 and 8 tokens), and the fewest (the sample size whose interval coverage tests/test_row_sample.py holds;
#: below it the random groups' standard errors rest on 8 rows each).
AUTO_SAMPLE_ROWS: tuple[int, int] = (64, 256)

#: Random groups a row sample is split into for its standard errors
# (:func:`~ipa_probe.statistics.agreement.compare_frames`).
SAMPLE_GROUPS: int = 8

#: The table column (and summary column) naming the pool the query-frame columns were estimated over.
QUERY_FRAME_COLUMN: str = "query_frame"

#: The query-frame rho (exact form) had the query frame been estimated over the *other* pool of
#: :data:`QUERY_FRAMES` than the run's ``query_frame`` (``"branch"`` for an ``"item"`` run and the reverse), over the
#: same rows. Computed only where a CFG branch of the pass holds two or more items; where each holds one, the pools
#: are the same rows and the column repeats ``qf_spearman`` (nothing more is computed). A summary states how far it
#: would move the mean query-frame rho (:func:`ipa_probe.capture.report.summarize`).
QUERY_POOL_OTHER_COLUMN: str = "qf_spearman_other_pool"

#: Per-cell values kept in the probe's buffers, in order: the bandwidth used, then :data:`STAT_NAMES`, then the
#: query and key geometry, ``ip_mass`` (the share of a joint softmax's mass on the image tokens: SD3, where the
#: image tokens share one softmax with the latent tokens; NaN where the image branch is a softmax of its own),
#: ``keys`` (how many keys each row's weights run over, after the text padding is left out), then
#: :data:`QUERY_FRAME_COLUMNS`, :data:`ROW_SAMPLE_COLUMNS` and :data:`QUERY_POOL_OTHER_COLUMN`.
CELL_FIELDS: tuple[str, ...] = (
    "bandwidth",
    *STAT_NAMES,
    "q_norm",
    "k_norm_spread",
    "ip_mass",
    "keys",
    *QUERY_FRAME_COLUMNS,
    *ROW_SAMPLE_COLUMNS,
    QUERY_POOL_OTHER_COLUMN,
)

#: Columns that place a cell: call, step, timestep, layer, head, CFG branch, kind and adapter.
INDEX_COLUMNS: tuple[str, ...] = ("call", "step", "timestep", "layer", "head", "branch", "kind", "adapter")

#: The comparison statistics and geometry, in table order (a summary averages them too).
_AVERAGED: tuple[str, ...] = (
    "spearman",
    "pearson",
    "spearman_null",
    "kl",
    "top1",
    "neff_attn",
    "neff_nw",
    "q_norm",
    "k_norm_spread",
)

#: Columns of :meth:`ipa_probe.ProbeRun.to_dataframe`, in order. ``few_keys`` flags cells whose rows have fewer than
#: :data:`FEW_KEYS` keys (per-row Spearman is then +-1 or undefined); ``complete`` is False in a step cut short. The
#: unprefixed statistics (``spearman``, ``pearson``, ..., :data:`GAUGE_COLUMNS`, :data:`NULL_COLUMNS`) are the
#: *stored frame*'s: NW weights from the stored q and k, which a per-head basis change of q and k moves (see
#: docs/gauge.md); the query-frame columns (:data:`QUERY_FRAME_COLUMNS`, after :data:`QUERY_FRAME_COLUMN`) are
#: invariant under it. New columns are appended so that the earlier ones keep their positions.
COLUMNS: tuple[str, ...] = (
    *INDEX_COLUMNS,
    "bandwidth",
    *_AVERAGED,
    "nonfinite",
    "ip_mass",
    "keys",
    "few_keys",
    "complete",
    *GAUGE_COLUMNS,
    *NULL_COLUMNS,
    QUERY_FRAME_COLUMN,
    *QUERY_FRAME_COLUMNS,
    *ROW_SAMPLE_COLUMNS,
    QUERY_POOL_OTHER_COLUMN,
)

#: Rows with fewer keys than this have a degenerate per-row Spearman (two keys give +-1, one key none).
FEW_KEYS: int = 3

#: Columns of :func:`ipa_probe.capture.report.summarize` that group the cells (one summary row per group).
SUMMARY_KEYS: tuple[str, ...] = ("call", "step", "timestep", "kind", "branch")

#: Columns a summary (and a sweep's aggregate) averages over cells.
SUMMARY_MEANS: tuple[str, ...] = (*_AVERAGED, "ip_mass", "bandwidth")

#: Further columns a summary (and a sweep's aggregate) averages over cells, after every column above (appended so
#: that the earlier columns keep their positions).
SUMMARY_GAUGE_MEANS: tuple[str, ...] = (*GAUGE_COLUMNS, *NULL_COLUMNS)

#: The headline "how NW-like" columns: a summary (:func:`ipa_probe.capture.report.summarize`) puts their means first,
#: right after its keys: the query-frame rho, exact and Gaussian forms.
SUMMARY_HEADLINE: tuple[str, ...] = (query_frame_column("spearman"), query_frame_column("spearman", "gaussian"))

#: The other query-frame columns a summary (and a sweep's aggregate) averages over cells, appended after every
#: column above.
SUMMARY_QUERY_FRAME_MEANS: tuple[str, ...] = tuple(c for c in QUERY_FRAME_COLUMNS if c not in SUMMARY_HEADLINE)

#: Columns a summary takes the maximum of over cells.
SUMMARY_MAX: tuple[str, ...] = ("nonfinite",)

#: The CFG-branch labels the probe gives batch items (see :mod:`ipa_probe.capture.branches`): ``"uncond"`` and
#: ``"cond"`` (classifier-free guidance), ``"perturbed"`` (the last part of a PAG batch), ``"uncond_text"``
#: (InstructPix2Pix's middle chunk: negative prompt, real image), ``"sag"`` (self-attention guidance's pass on
#: degraded latents), ``"safety"`` (the safety concept's chunk of ``StableDiffusionPipelineSafe``) and ``"batch"``
#: (items the evidence does not decide).
BRANCH_LABELS: tuple[str, ...] = ("uncond", "cond", "perturbed", "uncond_text", "sag", "safety", "batch")


def frac_column(threshold: float) -> str:
    """The name of the summary column counting cells with rho above ``threshold``, e.g. ``"frac_rho_gt_0.9"``."""
    return f"frac_rho_gt_{threshold:g}"


def frac_null_column(threshold: float) -> str:
    """The name of :func:`frac_column`'s chance level: the same fraction over the cells' permutation-null rho
    (``spearman_null``), e.g. ``"frac_rho_gt_0.9_null"``."""
    return f"{frac_column(threshold)}_null"
