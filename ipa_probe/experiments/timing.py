"""Measure what the tiers cost on this machine: seconds per training step and per 100-step evaluation.

``python -m ipa_probe.experiments.timing [--steps 100]`` trains each arm of the experiments for a few steps at the
§D.0 CPU sizes, times one evaluation, and prints the projected wall time of every tier. Timings on a shared
machine are noisy: the tiers are sized with a factor-2 margin (see :mod:`.tiers`).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from .evaluate import evaluate_velocity, held_out_tasks, learned_velocity, plugin_velocity
from .model import ModelConfig
from .tasks import make_meta
from .tiers import TIERS, Tier
from .training import TrainConfig, train

__all__ = ["StepCost", "measure", "project"]

ARMS = (("gmm", 8, False), ("gmm", 8, True), ("shells", 8, False), ("digits", 16, False))


@dataclass
class StepCost:
    """Measured costs of one arm.

    Attributes:
        arm: ``meta-d-on|off``.
        train_step_s: seconds per training step (mean of ``steps`` steps, after 5 warm-up steps).
        eval_learned_s: seconds for one evaluation of the learned model (``tasks`` × ``points``, 100 Euler steps).
        eval_plugin_s: the same for the plug-in field.
    """

    arm: str
    train_step_s: float
    eval_learned_s: float
    eval_plugin_s: float


def measure(steps: int = 100, tasks: int = 20, points: int = 500) -> list[StepCost]:
    """Time every arm of :data:`ARMS` at the ``full`` tier's model and batch sizes."""
    tier = TIERS["full"]
    costs = []
    for meta_name, dim, exact in ARMS:
        meta = make_meta(meta_name, dim)
        model_cfg = ModelConfig(dim, tier.d_model, tier.n_heads, tier.n_layers, exact_head=exact)
        cfg = TrainConfig(steps=5, batch_tasks=tier.batch_tasks, n_target=tier.n_target, warmup=5)
        train(model_cfg, cfg, meta, progress=False)  # warm-up: allocator, kernels
        cfg = TrainConfig(steps=steps, batch_tasks=tier.batch_tasks, n_target=tier.n_target, warmup=5)
        start = time.perf_counter()
        model = train(model_cfg, cfg, meta, progress=False).model
        step_s = (time.perf_counter() - start) / steps
        batch = held_out_tasks(meta, tasks, 50, points, seed=0)
        start = time.perf_counter()
        evaluate_velocity(learned_velocity(model, batch.support), batch, 0)
        learned_s = time.perf_counter() - start
        start = time.perf_counter()
        evaluate_velocity(plugin_velocity(batch.support), batch, 0)
        costs.append(
            StepCost(f"{meta_name}-{dim}-{'on' if exact else 'off'}", step_s, learned_s, time.perf_counter() - start)
        )
    return costs


#: cost of one plug-in (or blockwise plug-in) evaluation relative to one of the learned model, at the full tier's
#: model on the 2-core machine (``measure``: 0.3-2.2 s against 2.6-15 s, so about 0.1-0.15).
PLUGIN_FRACTION = 0.15


def project(tier: Tier, step_s: float, eval_s: float, plugin_fraction: float = PLUGIN_FRACTION) -> float:
    """Projected seconds of ``all`` at ``tier``.

    Args:
        tier: run sizes.
        step_s: seconds per training step of 32 tasks × 64 targets at ``d_model = 64`` (scaled to the tier's size).
        eval_s: seconds per evaluation of the learned model on 20 tasks × 500 points (scaled to the tier's size);
            validations cost the same per point.
        plugin_fraction: cost of a plug-in evaluation relative to a learned one.

    Returns:
        seconds: training steps (with the §D.3 per-m check), validations, learned and plug-in evaluations.
    """
    seeds, arms = len(tier.seeds), 2
    checks = len(set(tier.scarcity_check_data) & set(tier.scarcity_data)) if tier.scarcity_check_m else 0
    runs = [  # (steps per run, runs)
        (tier.collapse_steps, len(tier.collapse_dims) * arms * seeds),
        (tier.shells_steps, len(tier.shells_dims) * seeds),
        (tier.scarcity_steps, len(tier.scarcity_data) + checks),
        (tier.heads_steps, len(tier.heads_list)),
    ]
    steps = sum(s * n for s, n in runs)
    validations = sum(n * -(-s // min(tier.eval_every, s)) for s, n in runs) if tier.eval_every else 0
    learned = (
        len(tier.collapse_dims) * arms * seeds
        + len(tier.shells_dims) * seeds
        + len(tier.scarcity_data) * len(tier.scarcity_ms)
        + checks
        + len(tier.heads_list) * len(tier.heads_ms)
    )
    plugin = (
        len(tier.collapse_dims)
        + len(tier.shells_dims)
        + len(tier.scarcity_data) * len(tier.scarcity_ms)
        + len(tier.heads_list) * len(tier.heads_ms)
    )
    batch_scale = tier.batch_tasks * tier.n_target * tier.d_model / (32 * 64 * 64)
    eval_scale = tier.eval_tasks * tier.eval_points / (20 * 500)
    val_scale = tier.val_tasks * tier.val_points / (20 * 500)
    evals = (learned + plugin_fraction * plugin) * eval_s * eval_scale + validations * eval_s * val_scale
    return steps * step_s * batch_scale + evals


def main() -> None:  # pragma: no cover - a script
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    costs = measure(args.steps)
    for c in costs:
        print(
            f"{c.arm:16s} train {1000 * c.train_step_s:7.1f} ms/step   eval learned {c.eval_learned_s:5.1f} s"
            f"   eval plug-in {c.eval_plugin_s:5.1f} s"
        )
    # measured at the full tier's batch; project() takes the cost of a 32-task step
    full = TIERS["full"]
    step_s = sum(c.train_step_s for c in costs) / len(costs) * 32 * 64 / (full.batch_tasks * full.n_target)
    eval_s = sum(c.eval_learned_s for c in costs) / len(costs)
    fraction = sum(c.eval_plugin_s for c in costs) / sum(c.eval_learned_s for c in costs)
    print(
        f"mean: {1000 * step_s:.1f} ms per 32-task step, {eval_s:.1f} s per learned evaluation, "
        f"plug-in {fraction:.2f}x"
    )
    for name, tier in TIERS.items():
        minutes = project(tier, step_s, eval_s, fraction) / 60
        print(f"tier {name:5s}: projected {minutes:5.1f} min on {args.threads} threads")


if __name__ == "__main__":  # pragma: no cover
    main()
