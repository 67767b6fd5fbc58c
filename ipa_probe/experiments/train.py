"""Training on the OT-path flow-matching loss, with checkpoints that make an interrupted run resume exactly.

Loss (paper §A.4, §D.0): per task, draw support ``S`` and target ``x_1`` independently; ``x_0 ~ N(0, I)``,
``t ~ U(0, 1)`` clamped at ``1e-5``, ``x_t = t x_1 + sigma_t x_0`` with ``sigma_t = 1 - (1 - sigma_min) t``, and
regress ``v_theta(x_t, t; S)`` on ``y = x_1 - (1 - sigma_min) x_0``: ``loss = mean_points sum_dims (v - y)^2``.

Every random draw (tasks, noise, times, support sizes) comes from one :class:`torch.Generator` seeded by the run's
seed, and the model's initial weights from a forked global RNG seeded the same way. A checkpoint stores the
model, the optimiser, the learning-rate schedule, the step and the generator's state, so a run interrupted at any
point and restarted replays the same stream from its last checkpoint and ends with the same weights as an
uninterrupted run (on the same machine and thread count).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import load_checkpoint, save_checkpoint
from .model import ICFMVelocityNet, ModelConfig
from .tasks import MetaDistribution

__all__ = ["TrainConfig", "TrainResult", "build_model", "flow_matching_loss", "load_model", "train"]

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.safetensors"
#: checkpoints of earlier versions (pickled, unsafe to load): ignored, with a warning.
LEGACY_CHECKPOINT = "checkpoint.pt"
T_EPS = 1e-5


@dataclass
class TrainConfig:
    """Optimisation settings (paper §A.4; CPU values of §D.0 by default).

    Args:
        steps: optimiser steps.
        batch_tasks: tasks per batch (paper 256, CPU 32).
        n_target: target points per task (paper 256, CPU 64).
        m: support size per task; with ``m_max`` set, each batch draws its size uniformly from ``{m..m_max}``.
        m_max: upper end of the support-size range, or ``None`` for a fixed ``m``.
        lr: AdamW learning rate after warm-up (paper 1e-4, CPU 1e-3).
        warmup: linear warm-up steps, then constant (paper 1000, CPU 200).
        weight_decay: AdamW weight decay (1e-5).
        grad_clip: gradient-norm clip (1.0).
        seed: seeds the initial weights and every random draw.
        checkpoint_every: steps between checkpoints.
    """

    steps: int = 3000
    batch_tasks: int = 32
    n_target: int = 64
    m: int = 50
    m_max: int | None = None
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 1e-5
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 250

    def __post_init__(self):
        for name in ("steps", "batch_tasks", "n_target", "m", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected a positive integer {name}, got {value!r}")
        if self.m_max is not None and self.m_max < self.m:
            raise ValueError(f"expected m_max >= m, got m={self.m}, m_max={self.m_max}")
        if self.warmup < 0 or self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(
                f"expected warmup >= 0, lr > 0, grad_clip > 0, got {self.warmup}, {self.lr}, {self.grad_clip}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult:
    """A finished (or resumed-and-finished) run.

    Attributes:
        model: the trained model, in eval mode.
        losses: training loss of every step, from step 1 (including steps replayed before a resume).
        wall_time: seconds spent training in this process.
        resumed_from: the step the run resumed from (0 for a fresh run).
    """

    model: ICFMVelocityNet
    losses: list[float] = field(default_factory=list)
    wall_time: float = 0.0
    resumed_from: int = 0


def build_model(config: ModelConfig, seed: int) -> ICFMVelocityNet:
    """A freshly initialised model whose weights depend only on ``config`` and ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ICFMVelocityNet(config)


def flow_matching_loss(
    model: ICFMVelocityNet, support: torch.Tensor, x1: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """OT-path flow-matching loss ``mean_points sum_dims (v(x_t, t; S) - (x_1 - (1 - sigma_min) x_0))^2``.

    Args:
        support: ``(B, m, d)``.
        x1: target points, ``(B, n, d)``.
        generator: source of ``x_0`` and ``t``.
    """
    sigma_min = model.config.sigma_min
    x0 = torch.randn(x1.shape, generator=generator)
    t = torch.rand(x1.shape[:-1] + (1,), generator=generator).clamp_min(T_EPS)  # (B, n, 1)
    xt = t * x1 + (1 - (1 - sigma_min) * t) * x0
    y = x1 - (1 - sigma_min) * x0
    v = model(xt, t, support).velocity
    return ((v - y) ** 2).sum(-1).mean()


def _lr_lambda(warmup: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def _checkpoint_path(run_dir: str | Path) -> Path:
    legacy = Path(run_dir) / LEGACY_CHECKPOINT
    if legacy.exists():
        logger.warning("ignoring %s: pickled checkpoints are no longer loaded (unsafe); training again", legacy)
    return Path(run_dir) / CHECKPOINT


def load_model(run_dir: str | Path) -> tuple[ICFMVelocityNet, dict] | None:
    """The finished model of ``run_dir`` and its checkpoint record, or ``None`` if the run has not finished."""
    path = _checkpoint_path(run_dir)
    if not path.exists():
        return None
    state = load_checkpoint(path)
    if state["step"] < state["train_config"]["steps"]:
        return None
    model = ICFMVelocityNet(ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.eval(), state


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    meta: MetaDistribution,
    run_dir: str | Path | None = None,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
    description: str = "train",
) -> TrainResult:
    """Train :class:`ICFMVelocityNet` on tasks from ``meta``; resume from ``run_dir``'s checkpoint if there is one.

    Args:
        model_config: the architecture (its ``dim`` must equal ``meta.dim``).
        train_config: optimisation settings and seed.
        meta: the training meta-distribution (tasks drawn with ``split="train"``).
        run_dir: folder for ``checkpoint.safetensors`` (see :mod:`.checkpoint`); ``None`` trains without checkpoints.
        progress: show a tqdm progress bar.
        callback: called as ``callback(step, loss)`` after every step (e.g. to log, or to interrupt a test run).
        description: the progress bar's label.

    Returns:
        :class:`TrainResult` with the trained model in eval mode.
    """
    if model_config.dim != meta.dim:
        raise ValueError(f"expected the model's dim to equal the tasks' dim, got {model_config.dim} and {meta.dim}")
    cfg = train_config
    model = build_model(model_config, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg.warmup))
    generator = torch.Generator().manual_seed(cfg.seed)
    step, losses = 0, []
    path = _checkpoint_path(run_dir) if run_dir is not None else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            state = load_checkpoint(path)
            if state["model_config"] != model_config.to_dict() or state["train_config"] != cfg.to_dict():
                raise ValueError(f"expected {path} to hold a run of the same configuration; remove it to retrain")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            generator.set_state(state["generator"])
            step, losses = state["step"], list(state["losses"])
            logger.info("resuming %s from step %d", path, step)
    resumed_from = step

    def save() -> None:
        if path is not None:
            save_checkpoint(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "generator": generator.get_state(),
                    "step": step,
                    "losses": losses,
                    "model_config": model_config.to_dict(),
                    "train_config": cfg.to_dict(),
                },
                path,
            )

    start = time.perf_counter()
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=description, disable=not progress, leave=False)
    try:
        while step < cfg.steps:
            m = cfg.m if cfg.m_max is None else int(torch.randint(cfg.m, cfg.m_max + 1, (), generator=generator))
            batch = meta.sample_batch(cfg.batch_tasks, m, cfg.n_target, generator, split="train")
            loss = flow_matching_loss(model, batch.support, batch.target, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(float(loss.detach()))
            bar.update(1)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{sum(losses[-50:]) / 50:.3f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save()
            if callback is not None:
                callback(step, losses[-1])
    finally:
        bar.close()
    return TrainResult(model.eval(), losses, time.perf_counter() - start, resumed_from)
