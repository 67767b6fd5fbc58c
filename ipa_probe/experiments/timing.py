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
from .train import TrainConfig, train

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


def project(tier: Tier, step_s: float, eval_s: float) -> float:
    """Projected seconds of ``all`` at ``tier`` from a per-step and a per-evaluation (20 × 500 points) cost."""
    seeds, arms = len(tier.seeds), 2
    steps = (
        len(tier.collapse_dims) * arms * seeds * tier.collapse_steps
        + len(tier.shells_dims) * seeds * tier.shells_steps
        + len(tier.scarcity_data) * tier.scarcity_steps
        + len(tier.heads_list) * tier.heads_steps
    )
    scale = tier.eval_tasks * tier.eval_points / (20 * 500)
    evals = (
        len(tier.collapse_dims) * (arms * seeds + 1)
        + len(tier.shells_dims) * (seeds + 1)
        + len(tier.scarcity_data) * len(tier.scarcity_ms) * 2
        + len(tier.heads_list) * len(tier.heads_ms) * 2
    )
    batch_scale = tier.batch_tasks * tier.n_target * tier.d_model / (32 * 64 * 64)
    return steps * step_s * batch_scale + evals * eval_s * scale


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
    step_s = sum(c.train_step_s for c in costs) / len(costs)
    eval_s = sum(c.eval_learned_s + c.eval_plugin_s for c in costs) / (2 * len(costs))
    for name, tier in TIERS.items():
        print(f"tier {name:5s}: projected {project(tier, step_s, eval_s) / 60:5.1f} min on {args.threads} threads")


if __name__ == "__main__":  # pragma: no cover
    main()
