"""Run sizes of the experiments: ``quick`` (tests, < 2 min), ``smoke`` (directions, < 10 min), ``full`` (< 60 min) on
a CPU, and ``paper`` (the paper's sizes, for a CUDA GPU; never run in tests).

Protocol (every tier, the release's ``trainer.py``): linear warm-up, then cosine decay (CPU tiers) or a constant rate
(``paper``, as the release); validation MMD² every ``eval_every`` steps on fixed tasks of the training law, and the
best-validation weights kept as the run's result (``record.json`` names its step).

Sizes come from timing runs on the project's 2-core machine (``python -m ipa_probe.experiments.timing``). At the full
tier's model (``d_model = 64``, 2 layers, 4 heads, 16 tasks × 64 targets) one step costs 21–45 ms with one thread at a
load average of about 2 (0.1 s at a load of 7–10, when five other jobs share the two cores); one evaluation of the
learned model on 20 tasks × 500 points costs 2.6–15 s, one of the plug-in 0.3–2.2 s, and one validation (8 tasks × 128
points) about a tenth of an evaluation. ``ipa-probe experiments`` runs the CPU tiers on one thread unless told
otherwise: these models are too small to share their kernels between threads (the quick tier took 217 s at 2 threads
and 107 s at 1 on the quiet machine). :func:`ipa_probe.experiments.timing.project` at the pessimistic loaded costs (0.1
s per 32-task step, 25 s per evaluation) puts ``smoke`` at 9.7 min and ``full`` at 57 min. Measured with the protocol
on the quiet machine, ``full`` took 31 min (1 thread; the committed records in docs/results/full, the ip-adapter and
attribution experiments with their controls and grid 10 min of it). Twice its shells and scarcity steps moved no number
beyond its spread (``docs/results/full_2x_steps/``), so the step counts stay and the rest of the budget is left
unspent; how the scarcity gap moves with training at the release's constant rate is :mod:`.scarcity_steps`.

``paper`` (:data:`GPU_TIERS`) runs on CUDA only (the CLI refuses it without a GPU); its sizes and projected cost (tens
of GPU-hours) are in docs/reproducing.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .._io import parse_json, read_bounded

__all__ = ["ALL_TIERS", "GPU_TIERS", "TIERS", "Tier", "TierMismatch", "check_folder_tier", "get_tier"]

#: valid ranges of user-supplied dimensions and support sizes.
DIM_RANGE = (2, 64)
M_RANGE = (1, 100)


@dataclass(frozen=True)
class Tier:
    """Every size an experiment needs. See :data:`TIERS` for the three presets.

    Attributes:
        name: tier name.
        d_model, n_layers, n_heads: the learned model (paper 128/3/4, §D.0 CPU 64/2/4).
        batch_tasks, n_target, lr, warmup: training (paper 256/256/1e-4/1000, §D.0 CPU 32/64/1e-3/200).
        seeds: training seeds of the multi-seed experiments (collapse, shells).
        collapse_steps, shells_steps, scarcity_steps, heads_steps: training steps per run of each experiment.
        eval_tasks, eval_points, euler_steps: held-out tasks, generated (= reference) points per task, Euler grid.
        neff_tasks, neff_queries: tasks and queries per task of the NW ``n_eff`` averages (paper 30 × 256).
        collapse_dims, neff_dims, shells_dims: dimensions of the collapse benefit, its ``n_eff`` panel, the shells.
        scarcity_ms, scarcity_data: support sizes and meta-distributions of the scarcity experiment.
        heads_list, heads_ms, heads_m_range: heads ``H``, evaluation support sizes and the training range of ``m``.
        attention_ts: flow times of the attention experiment.
        ip_sets, ip_mixed_sets: reference sets of the ip-adapter experiment (one digit; two digits mixed).
        attribution_sets: reference sets (two digits mixed) of the attribution experiment, each generated once and
            once more per reference with that reference ablated.
        attribution_control_sets: sets per control population of the attribution experiment (one digit; four
            digits), each generated once, and 2 + 2 sets regenerated with their references shuffled.
        attribution_grid_sets: the first 2 + 2 sets whose references are also ablated per layer group (down / mid /
            up / all) and step range (thirds / all), trained organism only
            (:func:`ipa_probe.intervention.ablation_grid`).
        attribution_example_seeds: seeds of the two-3s-two-5s example (both 3s or both 5s ablated per group and
            range).
        ip_calibration_sets: reference sets (apart from the evaluated ones) on which the matched control's key scales
            are chosen (:func:`ipa_probe.experiments.matched_control.matched_twin`).
        ip_pool_sets: reference sets of the query-pool comparison ("item" vs "branch" at 1, 3 and 8 images).
        schedule: learning rate after warm-up, ``"cosine"`` decay or ``"constant"`` (the release).
        eval_every: steps between validations of a training run (``0``: none; the final weights are the result).
        val_tasks, val_points: validation tasks per run and generated (= reference) points per task.
        scarcity_check_m: support size of the §D.3 per-m check (one extra model trained at that fixed ``m``), or
            ``None`` to skip it.
        scarcity_check_data: the data sets of that check (each must be in ``scarcity_data`` to run).
        device: ``"cpu"``, or ``"auto"`` (CUDA when present, else the CPU).
    """

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    batch_tasks: int
    n_target: int
    lr: float
    warmup: int
    seeds: tuple[int, ...]
    collapse_steps: int
    shells_steps: int
    scarcity_steps: int
    heads_steps: int
    eval_tasks: int
    eval_points: int
    euler_steps: int
    neff_tasks: int
    neff_queries: int
    collapse_dims: tuple[int, ...]
    neff_dims: tuple[int, ...]
    shells_dims: tuple[int, ...]
    scarcity_ms: tuple[int, ...]
    scarcity_data: tuple[str, ...]
    heads_list: tuple[int, ...]
    heads_ms: tuple[int, ...]
    heads_m_range: tuple[int, int]
    attention_ts: tuple[float, ...]
    ip_sets: int
    ip_mixed_sets: int
    attribution_sets: int = 40
    attribution_control_sets: int = 20
    attribution_grid_sets: int = 5
    attribution_example_seeds: int = 8
    ip_calibration_sets: int = 4
    ip_pool_sets: int = 10
    schedule: str = "cosine"
    eval_every: int = 0
    val_tasks: int = 8
    val_points: int = 128
    scarcity_check_m: int | None = 10
    scarcity_check_data: tuple[str, ...] = ("pcafeat", "digits")
    device: str = "cpu"

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(
        self,
        seeds: tuple[int, ...] | None = None,
        dims: tuple[int, ...] | None = None,
        ms: tuple[int, ...] | None = None,
    ) -> Tier:
        """This tier with user-chosen seeds, dimensions (collapse and shells) or support sizes (scarcity, heads)."""
        changes: dict = {}
        if seeds:
            changes["seeds"] = tuple(seeds)
        if dims:
            changes["collapse_dims"] = changes["shells_dims"] = tuple(sorted(set(dims)))
            changes["neff_dims"] = tuple(sorted(set(dims)))
        if ms:
            ms = tuple(sorted(set(ms)))
            changes["scarcity_ms"] = changes["heads_ms"] = ms
            changes["heads_m_range"] = (min(ms), max(ms))
        return replace(self, **changes)


#: the sizes every tier shares; then those the larger tiers (smoke, full, paper) share; then the CPU model of smoke and
#: full.
_ALL = dict(euler_steps=100, neff_dims=(2, 4, 8, 16, 32, 64), scarcity_data=("pcafeat", "digits"))
_LARGE = dict(_ALL, neff_tasks=30, neff_queries=256, scarcity_ms=(1, 5, 10, 25, 50), heads_ms=(5, 10, 25, 50, 100))
_LARGE.update(heads_m_range=(5, 100), attention_ts=(0.1, 0.3, 0.5, 0.7, 0.9, 0.99))
_CPU = dict(_LARGE, d_model=64, n_layers=2, n_heads=4, batch_tasks=16, n_target=64, lr=1e-3, warmup=100)
_CPU.update(shells_dims=(8, 32), scarcity_check_data=("pcafeat",))

TIERS: dict[str, Tier] = {
    "quick": Tier(
        **_ALL,
        name="quick",
        d_model=16,
        n_layers=1,
        n_heads=4,
        batch_tasks=4,
        n_target=16,
        lr=1e-3,
        warmup=5,
        seeds=(0, 1),
        collapse_steps=12,
        shells_steps=12,
        scarcity_steps=12,
        heads_steps=12,
        eval_tasks=3,
        eval_points=48,
        neff_tasks=4,
        neff_queries=32,
        collapse_dims=(2, 4),
        shells_dims=(8,),
        scarcity_ms=(1, 5, 10),
        heads_list=(1, 2),
        heads_ms=(5, 10, 25),
        heads_m_range=(5, 25),
        attention_ts=(0.1, 0.5, 0.99),
        ip_sets=2,
        ip_mixed_sets=2,
        attribution_sets=3,
        attribution_control_sets=2,
        attribution_grid_sets=1,
        attribution_example_seeds=2,
        ip_calibration_sets=1,
        ip_pool_sets=1,
        eval_every=6,
        scarcity_check_data=("pcafeat",),
        val_tasks=2,
        val_points=32,
    ),
    "smoke": Tier(
        **_CPU,
        name="smoke",
        seeds=(0,),
        collapse_steps=600,
        shells_steps=800,
        scarcity_steps=800,
        heads_steps=500,
        eval_tasks=10,
        eval_points=200,
        collapse_dims=(2, 16),
        heads_list=(1, 4),
        ip_sets=20,
        ip_mixed_sets=10,
        attribution_sets=10,
        attribution_control_sets=6,
        attribution_grid_sets=3,
        attribution_example_seeds=8,
        ip_calibration_sets=2,
        ip_pool_sets=4,
        eval_every=400,
    ),
    "full": Tier(
        **_CPU,
        name="full",
        seeds=(0, 1, 2),
        collapse_steps=1000,
        shells_steps=1600,
        scarcity_steps=3000,
        heads_steps=1500,
        eval_tasks=20,
        eval_points=250,
        collapse_dims=(2, 4, 8, 16),
        heads_list=(1, 2, 4, 8),
        ip_sets=100,
        ip_mixed_sets=40,
        eval_every=500,
    ),
}

#: the paper's sizes (§A.4): for a CUDA machine, never run in tests (hours even on a GPU).
GPU_TIERS: dict[str, Tier] = {
    "paper": Tier(
        **_LARGE,
        name="paper",
        d_model=128,
        n_layers=3,
        n_heads=4,
        batch_tasks=256,
        n_target=256,
        lr=1e-4,
        warmup=1000,
        seeds=(0, 1, 2),
        collapse_steps=100_000,
        shells_steps=50_000,
        scarcity_steps=100_000,
        heads_steps=50_000,
        eval_tasks=100,
        eval_points=500,
        collapse_dims=(2, 4, 8, 16),
        shells_dims=(8, 16, 32),
        heads_list=(1, 2, 4, 8, 16),
        ip_sets=100,
        ip_mixed_sets=40,
        schedule="constant",
        eval_every=1000,
        val_tasks=100,
        val_points=500,
        device="auto",
    ),
}

#: every tier by name: the CPU tiers and the GPU one.
ALL_TIERS: dict[str, Tier] = {**TIERS, **GPU_TIERS}


def get_tier(name: str) -> Tier:
    """The tier called ``name``; raises ``ValueError`` naming the valid tiers otherwise."""
    if name not in ALL_TIERS:
        raise ValueError(f"expected a tier in {sorted(ALL_TIERS)}, got {name!r}")
    return ALL_TIERS[name]


class TierMismatch(ValueError):
    """An output folder holds results of another tier (or of this tier with other sizes)."""


def check_folder_tier(out: str | os.PathLike, tier: Tier) -> None:
    """Refuse an output folder that holds results of another tier, or of this tier with other sizes.

    Each experiment writes ``OUT/NAME/record.json`` with the tier it ran at; a run at another tier would replace some
    of those tables and leave the others, and ``summary.md`` would mix them. Trained models in ``OUT/runs`` are keyed
    by their whole configuration and never collide, so they do not count. Reads JSON only (no torch).

    Raises:
        TierMismatch: one line naming the folder, the tier it holds, what differs and the remedy.
    """
    mine = json.loads(json.dumps(tier.to_dict()))  # tuples as lists, as the records hold them
    for record in sorted(Path(out).glob("*/record.json")):
        try:  # bounded: a FIFO, a link to /dev/zero, a deep nesting is not a record (the folder check names it)
            held = parse_json(read_bounded(record) or b"null")["tier"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an experiment's record
        if not isinstance(held, dict) or held == mine:
            continue
        name = held.get("name")
        if name != tier.name:
            what = f"results of tier {name!r} ({record.parent.name}/ and maybe more)"
        else:
            differ = sorted(k for k in set(held) | set(mine) if held.get(k) != mine.get(k))
            what = f"results of tier {name!r} with other sizes ({', '.join(differ[:4])}) in {record.parent.name}/"
        raise TierMismatch(
            f"{out} holds {what}; nothing was changed. Use another --out (the default is outputs/experiments-TIER) "
            "or move those results away"
        )
