"""Experiment ``ip-adapter``: the paper's IP-Adapter analysis (§A.5 S5, §D.4), in kind, on the trained digits organism.

For many reference sets (4 held-out images of one digit each), the trained organism
(:func:`ipa_probe.tiny.digits.digits_pipeline`) generates with the 50-step DDIM schedule of SD 1.x while the probe
(:func:`ipa_probe.probe`, matched bandwidth ``h^2 = sqrt(d_head)``) records, at the paper's timesteps 981, 761, 501,
261 and 1, every image-branch head's per-row Spearman and raveled Pearson against Gaussian NW weights on the same
``q, k``, and the permutation null. Per timestep the table gives the mean per-row Spearman over reference sets (mean
over layers and heads within a set) with a 95 % bootstrap interval over sets, the mean Pearson and the fraction of
(set, layer, head) entries with rho > 0.9, beside the paper's figures. Control: the same architecture with its initial
(untrained) weights (:func:`ipa_probe.tiny.digits.untrained_digits_pipeline`), on the same reference sets.

Beyond the paper (item 6 of issue #10): support sets that mix two digits (2 + 2 references). At each recorded step
the share of image-branch attention that each reference receives (its 4 tokens summed, averaged over queries, heads
and layers) is set against the weight the exact posterior gives that reference's latent at the same noisy latent
``x_t``: the Gaussian NW weights of ``x_t / alpha_t`` over the references' VAE latents at ``h_t = sigma_t / alpha_t``
(the weights inside :class:`ipa_probe.exact.ExactNWDenoiser`). Per timestep: the mean over sets of the Spearman
correlation between the four attention shares and the four posterior weights, and the Spearman correlation over
sets between the attention share and the posterior weight of the first digit's pair.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy import stats as sstats  # noqa: E402

from .report import ExperimentResult, Row, from_record, save_figure  # noqa: E402

#: The paper's timesteps: the 50-step SD 1.x grid (steps_offset=1: 981, 961, ..., 1) at these step indices.
PAPER_TIMESTEPS = (981, 761, 501, 261, 1)
NUM_STEPS = 50
REFS_PER_SET = 4
#: The paper's mean per-row Spearman at the last timestep; it reports no value at the other timesteps.
PAPER_LAST_SPEARMAN = 0.89


def step_indices(num_steps: int = NUM_STEPS) -> list[int]:
    """Indices into the DDIM schedule of :data:`PAPER_TIMESTEPS` (50 steps, steps_offset=1: 0, 11, 24, 36, 49)."""
    from ..tiny.digits.model import _scheduler

    scheduler = _scheduler()
    scheduler.set_timesteps(num_steps)
    timesteps = scheduler.timesteps.tolist()
    missing = [t for t in PAPER_TIMESTEPS if t not in timesteps]
    if missing:
        raise ValueError(f"expected the {num_steps}-step schedule to contain {missing}; use 50 steps")
    return [timesteps.index(t) for t in PAPER_TIMESTEPS]


def _reference_sets(count: int, seed: int = 0) -> list[tuple[int, list]]:
    from ..tiny.digits import digits_reference_images

    return [(i % 10, digits_reference_images(i % 10, REFS_PER_SET, seed=seed + i // 10)) for i in range(count)]


def _mixed_sets(count: int) -> list[tuple[tuple[int, int], list]]:
    from ..tiny.digits import digits_reference_images

    sets = []
    for i in range(count):
        a, b = i % 10, (i % 10 + 1 + (i // 10) % 9) % 10
        sets.append(
            ((a, b), digits_reference_images(a, 2, seed=100 + i) + digits_reference_images(b, 2, seed=200 + i))
        )
    return sets


def probe_reference_set(pipe, references: list, seed: int, steps: list[int]) -> pd.DataFrame:
    """The probe's table (conditional branch, image kind) at ``steps`` for one generation with ``references``."""
    from ..capture.run import probe
    from ..tiny.digits import DIGITS_PROMPT

    generator = torch.Generator().manual_seed(seed)
    with probe(pipe, bandwidth="matched", steps=steps) as run:
        pipe(DIGITS_PROMPT, ip_adapter_image=[references], num_inference_steps=NUM_STEPS, guidance_scale=1.0,
             generator=generator, output_type="np")  # fmt: skip
    table = run.to_dataframe()
    return table[(table["branch"] == "cond") & (table["kind"] == "image")]


def attention_vs_posterior(pipe, references: list, seed: int, steps: list[int]) -> pd.DataFrame:
    """Per recorded step and reference: its share of image-branch attention and its exact posterior weight.

    Returns:
        one row per (step, reference): ``step``, ``timestep``, ``reference``, ``attention_share`` (the reference's
        ``K_ip / m`` tokens summed, averaged over queries, heads and layers; shares sum to 1 over references),
        ``posterior_weight`` (``softmax_i(-|x_t / alpha_t - s_i|^2 / (2 h_t^2))`` over the references' latents).
    """
    from ..capture.run import probe
    from ..exact import ExactNWDenoiser, encode_references
    from ..kernels import nw_weights
    from ..tiny.digits import DIGITS_PROMPT

    support = encode_references(pipe, references)  # (m, 4, 8, 8)
    denoiser = ExactNWDenoiser(support, pipe.scheduler)
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        inputs[len(inputs)] = sample.detach().clone()

    generator = torch.Generator().manual_seed(seed)
    handle = pipe.unet.register_forward_pre_hook(keep_input, with_kwargs=True)
    try:
        with probe(pipe, bandwidth="matched", steps=steps, keep_maps=True) as run:
            pipe(DIGITS_PROMPT, ip_adapter_image=[references], num_inference_steps=NUM_STEPS, guidance_scale=1.0,
                 generator=generator, output_type="np")  # fmt: skip
    finally:
        handle.remove()
    timesteps = pipe.scheduler.timesteps
    m = len(references)
    rows = []
    for step in steps:
        maps = [torch.cat(v).float() for (call, s, _, _), v in run.maps.items() if s == step and call == 0]
        # each map (B, H, Q, K_ip) with K_ip = 4 m tokens, reference j owning tokens [4 j, 4 j + 4)
        shares = torch.stack([mp.mean(dim=(0, 1, 2)).reshape(m, -1).sum(-1) for mp in maps]).mean(0)  # (m,)
        x = inputs[step].reshape(1, -1).float()  # (1, D)
        alpha, _, h = denoiser.coefficients(timesteps[step], 1)
        query = x / alpha - denoiser.center  # (1, D); the support is centred the same way
        weights = nw_weights(query, denoiser.support, h.reshape(()))[0]  # (m,)
        for j in range(m):
            rows.append(
                {
                    "step": step,
                    "timestep": int(timesteps[step]),
                    "reference": j,
                    "attention_share": float(shares[j]),
                    "posterior_weight": float(weights[j]),
                }
            )
    return pd.DataFrame(rows)


def _bootstrap_ci(values: np.ndarray, seed: int = 0, resamples: int = 2000) -> tuple[float, float]:
    if len(values) < 2:
        return (float("nan"), float("nan"))
    res = sstats.bootstrap((values,), np.mean, n_resamples=resamples, random_state=seed, method="percentile")
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def summarize_sets(per_set: pd.DataFrame) -> pd.DataFrame:
    """Per timestep: mean over sets of the per-set mean Spearman, its bootstrap CI, Pearson, null, rho > 0.9 share.

    Args:
        per_set: the probe tables of all sets with a ``set`` column.
    """
    rows = []
    for timestep, frame in per_set.groupby("timestep", sort=False):
        set_means = frame.groupby("set")["spearman"].mean().to_numpy()
        low, high = _bootstrap_ci(set_means)
        rows.append(
            {
                "timestep": int(timestep),
                "spearman": float(set_means.mean()),
                "ci_low": low,
                "ci_high": high,
                "pearson": float(frame["pearson"].mean()),
                "null": float(frame["spearman_null"].mean()),
                "frac_rho_gt_0.9": float((frame["spearman"] > 0.9).mean()),
                "sets": len(set_means),
                "entries": len(frame),
            }
        )
    return pd.DataFrame(rows).sort_values("timestep", ascending=False).reset_index(drop=True)


def summarize_posterior(frames: pd.DataFrame) -> pd.DataFrame:
    """Per timestep: mean per-set Spearman (4 references) of attention share vs posterior weight, and the Spearman
    over sets of the first digit's pair (attention share vs posterior weight)."""
    rows = []
    for timestep, frame in frames.groupby("timestep", sort=False):
        per_set, pair_attn, pair_post = [], [], []
        for _, g in frame.groupby("set"):
            if g["attention_share"].nunique() > 1 and g["posterior_weight"].nunique() > 1:
                per_set.append(sstats.spearmanr(g["attention_share"], g["posterior_weight"]).statistic)
            pair_attn.append(g["attention_share"].iloc[:2].sum())
            pair_post.append(g["posterior_weight"].iloc[:2].sum())
        pair = sstats.spearmanr(pair_attn, pair_post).statistic if len(pair_attn) > 2 else float("nan")
        rows.append(
            {
                "timestep": int(timestep),
                "per_set_spearman": float(np.mean(per_set)) if per_set else float("nan"),
                "sets_ranked": len(per_set),
                "pair_spearman": float(pair),
                "posterior_max_mean": float(frame.groupby("set")["posterior_weight"].max().mean()),
                "attention_max_mean": float(frame.groupby("set")["attention_share"].max().mean()),
            }
        )
    return pd.DataFrame(rows).sort_values("timestep", ascending=False).reset_index(drop=True)


def run(ctx) -> ExperimentResult:
    from tqdm.auto import tqdm

    from ..tiny.digits import digits_pipeline, untrained_digits_pipeline

    tier, folder = ctx.tier, ctx.out / "ip-adapter"
    folder.mkdir(parents=True, exist_ok=True)
    steps = step_indices()
    sets = _reference_sets(tier.ip_sets)
    pipes = {"trained": digits_pipeline(), "untrained": untrained_digits_pipeline()}
    summaries, raw = {}, {}
    for label, pipe in pipes.items():
        pipe.set_progress_bar_config(disable=True)
        frames = []
        for i, (_, refs) in enumerate(tqdm(sets, desc=f"ip-adapter {label}", disable=not ctx.progress)):
            frames.append(probe_reference_set(pipe, refs, seed=i, steps=steps).assign(set=i))
        per_set = pd.concat(frames, ignore_index=True)
        summaries[label] = summarize_sets(per_set)
        raw[label] = summaries[label].to_dict(orient="records")
    mixed = []
    for i, (_, refs) in enumerate(tqdm(_mixed_sets(tier.ip_mixed_sets), desc="mixed", disable=not ctx.progress)):
        mixed.append(attention_vs_posterior(pipes["trained"], refs, seed=i, steps=steps).assign(set=i))
    posterior = summarize_posterior(pd.concat(mixed, ignore_index=True))
    raw["posterior"] = posterior.to_dict(orient="records")

    rows = []
    last = PAPER_TIMESTEPS[-1]
    for label, summary in summaries.items():
        for rec in summary.to_dict(orient="records"):
            t = rec["timestep"]
            paper = f"{PAPER_LAST_SPEARMAN}" if (t == last and label == "trained") else "—"
            rows.append(
                Row(
                    "per-row Spearman (mean of set means)",
                    f"{label} organism, t={t}",
                    f"{rec['spearman']:.3f} [{rec['ci_low']:.3f}, {rec['ci_high']:.3f}]",
                    paper if label == "trained" else "— (control)",
                    f"Pearson {rec['pearson']:.3f}; {100 * rec['frac_rho_gt_0.9']:.0f}% of heads ρ>0.9; "
                    f"permutation null {rec['null']:+.3f}; {rec['sets']} reference sets",
                )
            )
    for rec in posterior.to_dict(orient="records"):
        rows.append(
            Row(
                "attention share vs exact posterior weight (Spearman)",
                f"2+2 mixed refs, t={rec['timestep']}",
                f"{rec['per_set_spearman']:.3f} per set; {rec['pair_spearman']:.3f} pair share over sets",
                "— (not in the paper)",
                f"largest posterior weight {rec['posterior_max_mean']:.2f}, largest attention share "
                f"{rec['attention_max_mean']:.2f} (means over {tier.ip_mixed_sets} sets)",
            )
        )

    figures = [plot(summaries, posterior, tier.ip_mixed_sets, folder)]
    record = {
        "measurements": raw,
        "num_inference_steps": NUM_STEPS,
        "timesteps": list(PAPER_TIMESTEPS),
        "step_indices": steps,
        "references_per_set": REFS_PER_SET,
        "reference_sets": tier.ip_sets,
        "mixed_sets": tier.ip_mixed_sets,
        "guidance_scale": 1.0,
        "bandwidth": "matched (h^2 = sqrt(d_head))",
        "differences_from_paper": (
            "a 16x16 digits organism trained here (SD 1.5 block structure scaled down, 10 IP layers of 4 heads, "
            "8x8x4 latents), 4 tokens per reference and 4 references per set, no CFG; the paper used SD 1.5 with a "
            "published IP-Adapter on natural images"
        ),
    }
    return ExperimentResult("ip-adapter", rows, record, figures)


def plot(summaries: dict[str, pd.DataFrame], posterior: pd.DataFrame, mixed_sets: int, folder) -> Path:
    """Left: per-row Spearman (band: its bootstrap CI over reference sets), Pearson and the permutation null per
    timestep, trained beside untrained. Right: attention share against the exact posterior weight.

    Args:
        summaries: ``"trained"`` / ``"untrained"`` -> :func:`summarize_sets` tables.
        posterior: the :func:`summarize_posterior` table.
        mixed_sets: how many two-digit reference sets the posterior comparison ran on (the pair share needs 3).
        folder: where ``ip_adapter.png`` goes.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = np.arange(len(PAPER_TIMESTEPS))
    ax = axes[0]
    for label, summary in summaries.items():
        line = ax.plot(x, summary["spearman"], marker="o", label=f"{label}: Spearman ρ")[0]
        colour = line.get_color()
        ax.fill_between(x, summary["ci_low"], summary["ci_high"], color=colour, alpha=0.2,
                        label=f"{label}: 95% bootstrap CI of ρ over sets")  # fmt: skip
        ax.plot(x, summary["pearson"], marker="s", linestyle=":", color=colour, label=f"{label}: Pearson r")
        ax.plot(x, summary["null"], linestyle="--", color=colour, linewidth=0.9, label=f"{label}: permutation null")
    ax.scatter([x[-1]], [PAPER_LAST_SPEARMAN], marker="x", color="C3", s=60, label="paper (SD 1.5, t=1)")
    ax.set(xticks=x, xticklabels=PAPER_TIMESTEPS, xlabel="timestep (noise → data)", ylabel="statistic")
    ax.set_title("IP-Adapter attention vs NW weights (digits organism)", fontsize=10)
    ax.set_ylim(-0.2, 1.05)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax = axes[1]
    ax.plot(x, posterior["per_set_spearman"], marker="o", label="per set (4 refs), mean over sets")
    pair = posterior["pair_spearman"].to_numpy(np.float64)
    if np.isfinite(pair).any():
        ax.plot(x, pair, marker="s", label="pair share, over sets")
    else:  # a rank correlation over sets needs at least 3 of them
        ax.text(0.5, 0.12, f"pair share over sets not drawn: it needs ≥ 3 mixed\nsets, this run has {mixed_sets}",
                transform=ax.transAxes, ha="center", fontsize=7, color="0.3")  # fmt: skip
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xticks=x, xticklabels=PAPER_TIMESTEPS, xlabel="timestep (noise → data)", ylabel="Spearman")
    ax.set_title("attention share vs exact posterior weight", fontsize=10)
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=7, loc="upper right")
    inputs = {"summaries": summaries, "posterior": posterior, "mixed_sets": mixed_sets}
    return save_figure(fig, Path(folder) / "ip_adapter.png", plot, _jsonable_frames(inputs))


def _jsonable_frames(inputs: dict) -> dict:
    """The plot's inputs as its ``record.json`` holds them (frames as lists of records)."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, pd.DataFrame):
            out[key] = value.to_dict(orient="records")
        elif isinstance(value, dict):
            out[key] = _jsonable_frames(value)
        else:
            out[key] = value
    return out


def redraw(record: dict, folder) -> list[Path]:
    """:func:`plot` again from a ``record.json`` of this experiment (no generation)."""
    raw = from_record(record["measurements"])
    summaries = {label: pd.DataFrame(raw[label]) for label in raw if label != "posterior"}
    return [plot(summaries, pd.DataFrame(raw["posterior"]), int(record["mixed_sets"]), folder)]
