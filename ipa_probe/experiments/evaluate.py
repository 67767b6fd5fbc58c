"""Evaluation: 100-step Euler sampling, per-task MMD², and effective sample sizes of NW weights and learned heads.

Protocol (paper §A.4, §D.0): held-out tasks are drawn once from a fixed seed with ``split="test"``; for each task
the sampler draws as many points as the reference holds from ``x_0 ~ N(0, I)`` and integrates ``dx/dt = v`` with
Euler on ``linspace(1e-5, 1, n_steps)``; MMD² (unbiased, Gaussian kernel, median heuristic) is computed per task,
then averaged over tasks with the standard deviation and standard error over tasks as the spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import theory
from ..statistics.agreement import compare_weights
from .model import ICFMVelocityNet
from .tasks import MetaDistribution, TaskBatch

__all__ = [
    "MMDResult",
    "evaluate_velocity",
    "generate",
    "head_attention",
    "head_neff",
    "head_statistics",
    "held_out_tasks",
    "learned_velocity",
    "mmd_per_task",
    "nw_neff",
    "plugin_velocity",
    "validation_mmd",
]

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MMDResult:
    """MMD² of generated against reference samples over held-out tasks.

    Attributes:
        per_task: MMD² of each task, shape ``(B,)``.
        mean: mean over tasks.
        std: standard deviation over tasks.
        sem: standard error of the mean over tasks.
    """

    per_task: torch.Tensor
    mean: float
    std: float
    sem: float

    @classmethod
    def from_per_task(cls, per_task: torch.Tensor) -> MMDResult:
        per_task = per_task.detach().double().cpu()
        b = per_task.numel()
        std = float(per_task.std()) if b > 1 else 0.0
        return cls(per_task.float(), float(per_task.mean()), std, std / math.sqrt(b))


def held_out_tasks(
    meta: MetaDistribution, n_tasks: int, m: int, n_ref: int, seed: int, split: str = "test"
) -> TaskBatch:
    """``n_tasks`` fixed tasks with support ``(B, m, d)`` and reference ``(B, n, d)``, drawn from ``seed``.

    ``split="test"`` (the default) gives the held-out test tasks; training's validation tasks use ``"train"``.
    For data-set tasks the reference is the rest of the class, truncated to the smallest class so tasks stack;
    ``n`` is then at most ``n_ref``. Nested supports: ``support[:, :k]`` is a valid support of size ``k``.
    """
    generator = torch.Generator().manual_seed(seed)
    pairs = [meta.sample_task(generator, split).eval_split(m, n_ref, generator) for _ in range(n_tasks)]
    n = min(ref.shape[0] for _, ref in pairs)
    return TaskBatch(torch.stack([s for s, _ in pairs]), torch.stack([ref[:n] for _, ref in pairs]))


def plugin_velocity(support: torch.Tensor, sigma_min: float = 0.01) -> VelocityFn:
    """The exact empirical field of ``support (B, m, d)`` (paper §C.2): the plug-in baseline, no training."""
    return lambda x, t: theory.nw_velocity(x, t, support, sigma_min=sigma_min)


def learned_velocity(model: ICFMVelocityNet, support: torch.Tensor) -> VelocityFn:
    """The velocity of a trained model given ``support (B, m, d)``, evaluated without gradient."""

    def velocity(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
        with torch.no_grad():
            return model(x, t, support).velocity

    return velocity


def generate(
    velocity_fn: VelocityFn,
    shape: tuple[int, int, int],
    generator: torch.Generator,
    n_steps: int = 100,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Samples ``(B, n, d)``: ``x_0 ~ N(0, I)`` integrated by Euler on ``linspace(1e-5, 1, n_steps)``.

    ``x_0`` is drawn on the generator's device and moved to ``device``, so every device integrates the same start.
    """
    x0 = torch.randn(shape, generator=generator).to(device)
    with torch.no_grad():
        return theory.euler_sample(velocity_fn, x0, n_steps=n_steps)


def mmd_per_task(samples: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Unbiased MMD² (median heuristic) of each task's samples ``(B, n, d)`` against its reference ``(B, n', d)``."""
    return theory.mmd2(samples, reference)


def evaluate_velocity(
    velocity_fn: VelocityFn, tasks: TaskBatch, seed: int, n_steps: int = 100
) -> tuple[MMDResult, torch.Tensor]:
    """Sample as many points per task as the reference holds and score them. Returns the result and the samples."""
    generator = torch.Generator().manual_seed(seed)
    samples = generate(velocity_fn, tuple(tasks.target.shape), generator, n_steps, tasks.target.device)
    return MMDResult.from_per_task(mmd_per_task(samples, tasks.target)), samples


def validation_mmd(model: ICFMVelocityNet, tasks: TaskBatch, seed: int, n_steps: int = 100) -> float:
    """Mean MMD² over ``tasks`` of the model's samples (fixed sampling ``seed``); the model's mode is restored."""
    was_training = model.training
    model.eval()
    try:
        return evaluate_velocity(learned_velocity(model, tasks.support), tasks, seed, n_steps)[0].mean
    finally:
        model.train(was_training)


def _queries(tasks: TaskBatch, t: float, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Noisy queries of the flow at time ``t``: ``x_t = t x_1 + sigma_t z`` with ``x_1`` the tasks' targets."""
    c = theory.OTSchedule()(torch.tensor(t, dtype=torch.float64))
    z = torch.randn(tasks.target.shape, generator=generator)
    return float(c.alpha_t) * tasks.target + float(c.sigma_t) * z, float(c.h)


def nw_neff(tasks: TaskBatch, t: float, seed: int = 0) -> torch.Tensor:
    """Kish ``n_eff`` of the data-space NW weights at ``h(t)``, averaged over queries: shape ``(B,)``.

    Queries are ``x~ = x_1 + h(t) z`` with ``x_1`` fresh task samples (the tasks' targets) (paper §D.0).
    """
    x_t, h = _queries(tasks, t, torch.Generator().manual_seed(seed))
    weights = theory.nw_weights(x_t / t, tasks.support, h)  # (B, n, m)
    return theory.n_eff(weights).mean(-1)


def head_attention(
    model: ICFMVelocityNet, tasks: TaskBatch, t: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every learned head's attention logits and the data-space NW logits for the same queries at time ``t``.

    Returns:
        ``attn_logits (B, L, H, n, m)`` (``q k^T / sqrt(d_k)``) and ``nw_logits (B, 1, 1, n, m)``, the
        log NW weights of ``x~ = x_t / t`` at ``h(t)`` over the support (paper §D.4, CPU surrogate).
    """
    x_t, h = _queries(tasks, t, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(x_t, t, tasks.support, return_attention=True)
    attn = torch.stack(out.attn_logits, dim=1)  # (B, L, H, n, m)
    nw = theory.nw_log_weights(x_t / t, tasks.support, h)[:, None, None]  # (B, 1, 1, n, m)
    return attn, nw


def head_neff(model: ICFMVelocityNet, tasks: TaskBatch, t: float, seed: int = 0) -> torch.Tensor:
    """Kish ``n_eff`` of each learned head's attention, averaged over tasks and queries: shape ``(L, H)``."""
    attn, _ = head_attention(model, tasks, t, seed)
    return theory.n_eff(torch.softmax(attn, dim=-1)).mean((0, 3))


def head_statistics(model: ICFMVelocityNet, tasks: TaskBatch, t: float, seed: int = 0) -> torch.Tensor:
    """The probe's statistics (:func:`ipa_probe.statistics.agreement.compare_weights`) of every (task, layer, head) at
    time ``t``.

    Returns:
        statistics, shape ``(B, L, H, len(STAT_NAMES))``.
    """
    attn, nw = head_attention(model, tasks, t, seed)
    return compare_weights(attn, nw.expand_as(attn), generator=torch.Generator().manual_seed(seed))
