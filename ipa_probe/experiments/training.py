"""Training on the OT-path flow-matching loss, with validation, best-checkpoint selection and exact resumption.

Loss, time sampling, learning-rate schedule and validation follow the paper's release (``src/training/trainer.py``;
docs/reproducing.md lists each choice): ``x_t = t x_1 + sigma_t x_0``, ``sigma_t = 1 - (1 - sigma_min) t``,
``v_theta(x_t, t; S)`` regressed on ``y = x_1 - (1 - sigma_min) x_0`` (``loss = mean_points sum_dims (v - y)^2``);
linear warm-up, then a constant rate or a cosine decay; the weights with the lowest validation MMD² (on fixed tasks of
the training law) are the run's result.

Every random draw comes from one :class:`torch.Generator` seeded by the run's seed (the initial weights from a forked
global RNG seeded the same way), and a checkpoint stores the model, the optimiser, the schedule, the step and the
generator's state, so a run interrupted at any point and restarted ends with the same weights as an uninterrupted
run (on the same machine and thread count).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .evaluate import held_out_tasks, validation_mmd
from .model import ICFMVelocityNet, ModelConfig
from .tasks import MetaDistribution, TaskBatch

__all__ = [
    "TrainConfig",
    "TrainResult",
    "build_model",
    "build_scheduler",
    "check_state",
    "flow_matching_loss",
    "load_model",
    "lr_factor",
    "sample_time",
    "train",
]

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.safetensors"
#: checkpoints of earlier versions (pickled, unsafe to load): ignored, with a warning.
LEGACY_CHECKPOINT = "checkpoint.pt"
T_EPS = 1e-5
#: upper end of ``log h`` of the release's ``log_uniform_bandwidth`` time sampling.
LOG_H_MAX = 5.0
#: offset of the validation tasks' seed from the run's seed (far from training and test seeds).
VAL_SEED = 50_000
SCHEDULES = ("constant", "cosine")
TIME_SAMPLINGS = ("uniform", "log_uniform_bandwidth")


@dataclass
class TrainConfig:
    """Optimisation settings (paper §A.4; CPU values of §D.0 by default).

    Attributes:
        batch_tasks, n_target: tasks per batch and target points per task (paper 256 and 256, CPU 32 and 64).
        m: support size per task; with ``m_max`` set, each batch draws its size uniformly from ``{m..m_max}``.
        lr: AdamW peak learning rate, reached at the end of the linear warm-up (paper 1e-4 after 1000 steps, CPU
            1e-3 after 200).
        schedule: after warm-up, ``"constant"`` (the release) or ``"cosine"`` decay to zero at the last step.
        time_sampling: ``"uniform"`` (the release's default) or ``"log_uniform_bandwidth"`` (its ``f1`` option).
        seed: seeds the initial weights and every random draw.
        eval_every: steps between validations (the last step is always validated); ``0`` turns validation off
            and the run's result is its final weights.
        val_tasks, val_points: fixed validation tasks (release 100) and their generated (= reference) points (release
            500); ``val_euler_steps``: the validation sampler's Euler grid (release 100).
        val_m: support size of the validation tasks; ``None`` means ``m_max`` (or ``m``).
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
    schedule: str = "constant"
    time_sampling: str = "uniform"
    eval_every: int = 0
    val_tasks: int = 8
    val_points: int = 128
    val_m: int | None = None
    val_euler_steps: int = 100

    def __post_init__(self):
        positive = ("steps", "batch_tasks", "n_target", "m", "checkpoint_every", "val_tasks", "val_points")
        for name in positive + ("val_euler_steps",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected a positive integer {name}, got {value!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"expected eval_every >= 0 (0 turns validation off), got {self.eval_every!r}")
        if self.val_m is not None and (not isinstance(self.val_m, int) or self.val_m < 1):
            raise ValueError(f"expected a positive integer val_m or None, got {self.val_m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"expected schedule in {SCHEDULES}, got {self.schedule!r}")
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ValueError(f"expected time_sampling in {TIME_SAMPLINGS}, got {self.time_sampling!r}")
        if self.m_max is not None and self.m_max < self.m:
            raise ValueError(f"expected m_max >= m, got m={self.m}, m_max={self.m_max}")
        if self.warmup < 0 or self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(
                f"expected warmup >= 0, lr > 0, grad_clip > 0, got {self.warmup}, {self.lr}, {self.grad_clip}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def validation_m(self) -> int:
        """The support size of the validation tasks."""
        return self.val_m or self.m_max or self.m


@dataclass
class TrainResult:
    """A finished (or resumed-and-finished) run.

    Attributes:
        model: the run's result in eval mode: the best-validation weights, or the final ones without validation.
        losses: training loss of every step, from step 1 (including steps replayed before a resume).
        wall_time: seconds spent training in this process.
        resumed_from: the step the run resumed from (0 for a fresh run).
        validation: ``[(step, val MMD²), ...]`` of every validation, in order (empty without validation).
        best_step: the step whose weights are ``model`` (the last step without validation).
        best_val: its validation MMD², or ``None`` without validation.
    """

    model: ICFMVelocityNet
    losses: list[float] = field(default_factory=list)
    wall_time: float = 0.0
    resumed_from: int = 0
    validation: list[tuple[int, float]] = field(default_factory=list)
    best_step: int = 0
    best_val: float | None = None


def build_model(config: ModelConfig, seed: int) -> ICFMVelocityNet:
    """A freshly initialised model whose weights depend only on ``config`` and ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ICFMVelocityNet(config)


def flow_matching_loss(
    model: ICFMVelocityNet,
    support: torch.Tensor,
    x1: torch.Tensor,
    generator: torch.Generator,
    time_sampling: str = "uniform",
) -> torch.Tensor:
    """OT-path flow-matching loss ``mean_points sum_dims (v(x_t, t; S) - (x_1 - (1 - sigma_min) x_0))^2``.

    ``support`` ``(B, m, d)``, target points ``x1`` ``(B, n, d)``; ``x_0`` and ``t`` drawn from ``generator``.
    """
    sigma_min = model.config.sigma_min
    # drawn on the generator's device (the CPU) and moved: the same stream on every device
    x0 = torch.randn(x1.shape, generator=generator).to(x1.device)
    t = sample_time(x1.shape[:-1] + (1,), generator, time_sampling, sigma_min).to(x1.device)  # (B, n, 1)
    xt = t * x1 + (1 - (1 - sigma_min) * t) * x0
    y = x1 - (1 - sigma_min) * x0
    v = model(xt, t, support).velocity
    return ((v - y) ** 2).sum(-1).mean()


def sample_time(
    shape: tuple[int, ...], generator: torch.Generator, method: str = "uniform", sigma_min: float = 0.01
) -> torch.Tensor:
    """Flow times of the release's two samplers, clamped to ``[1e-5, 1]``.

    ``method``: ``"uniform"`` (``t ~ U(0, 1)``) or ``"log_uniform_bandwidth"`` (``log h ~ U(log sigma_min, 5)`` and
    ``t = 1 / (h + 1 - sigma_min)``, i.e. the NW bandwidth ``h(t) = sigma_t / t`` is log-uniform); one uniform draw
    from ``generator`` per time.
    """
    u = torch.rand(shape, generator=generator)
    if method == "uniform":
        return u.clamp_min(T_EPS)
    if method == "log_uniform_bandwidth":
        log_h_min = math.log(sigma_min)
        h = torch.exp(log_h_min + (LOG_H_MAX - log_h_min) * u)
        return (1.0 / (h + 1.0 - sigma_min)).clamp(T_EPS, 1.0)
    raise ValueError(f"expected time sampling in {TIME_SAMPLINGS}, got {method!r}")


def lr_factor(k: int, steps: int, warmup: int, schedule: str) -> float:
    """Learning-rate multiplier of optimiser step index ``k`` (0-based) of a ``steps``-step run.

    Warm-up (the release): ``max(k, 1) / warmup`` for ``k < warmup``. Then ``1`` (``"constant"``) or
    ``(1 + cos(pi (k - warmup) / (steps - warmup))) / 2`` (``"cosine"``).
    """
    if k < warmup:
        return max(k, 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (k - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's learning-rate schedule (:func:`lr_factor`) on ``optimizer``, stepped once per optimiser step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k, config.steps, config.warmup, config.schedule)
    )


def validation_tasks(meta: MetaDistribution, config: TrainConfig) -> TaskBatch:
    """The run's fixed validation tasks: fresh tasks of the training law (``split="train"``), seeded by the run."""
    return held_out_tasks(
        meta, config.val_tasks, config.validation_m, config.val_points, VAL_SEED + config.seed, split="train"
    )


def _checkpoint_path(run_dir: str | Path) -> Path:
    legacy = Path(run_dir) / LEGACY_CHECKPOINT
    if legacy.exists():
        logger.warning("ignoring %s: pickled checkpoints are no longer loaded (unsafe); training again", legacy)
    return Path(run_dir) / CHECKPOINT


#: every key of a training checkpoint and the types it may hold (``None`` where allowed)
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "model": (dict,),
    "optimizer": (dict,),
    "scheduler": (dict,),
    "generator": (torch.Tensor,),
    "step": (int,),
    "losses": (list,),
    "validation": (list,),
    "best_model": (dict, type(None)),
    "best_step": (int,),
    "best_val": (float, int, type(None)),
    "model_config": (dict,),
    "train_config": (dict,),
}


def check_state(state: Any, path: Path, model_config: ModelConfig, train_config: TrainConfig) -> dict:
    """Check a checkpoint record's structure before any of it is used: every key with its type, the run's two
    configurations, the step within the run, one loss per step, and the weights' names and shapes.

    Returns:
        ``state``.

    Raises:
        CheckpointError: one line naming the file, what is wrong and the remedy (delete it to train again).
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(path)!r} {what}; delete it to train that model again")

    if not isinstance(state, dict):
        raise bad("is not a training checkpoint")
    for key, types in _STATE_TYPES.items():
        if key not in state:
            raise bad(f"has no {key!r}")
        if isinstance(state[key], bool) or not isinstance(state[key], types):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise bad(f"holds {key!r} as {type(state[key]).__name__}, expected {expected}")
    if state["model_config"] != model_config.to_dict():
        raise bad("was written for another model configuration")
    if state["train_config"] != train_config.to_dict():
        raise bad("was written for another training configuration")
    step = state["step"]
    if not 0 <= step <= train_config.steps or len(state["losses"]) != step:
        raise bad(f"is at step {step} with {len(state['losses'])} losses (a run of {train_config.steps} steps)")
    if not all(isinstance(v, float | int) and not isinstance(v, bool) for v in state["losses"]):
        raise bad("holds losses that are not numbers")
    reference = ICFMVelocityNet(model_config).state_dict()
    for key in ("model", "best_model"):
        weights = state[key]
        if weights is None:
            continue
        shapes = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
        if len(shapes) != len(weights) or shapes != {k: tuple(v.shape) for k, v in reference.items()}:
            raise bad(f"holds {key!r} weights whose names or shapes are not this model's")
    generator = state["generator"]
    if generator.dtype != torch.uint8 or generator.shape != torch.Generator().get_state().shape:
        raise bad("holds a random-generator state of another form")
    return state


def load_model(
    run_dir: str | Path, model_config: ModelConfig | None = None, train_config: TrainConfig | None = None
) -> tuple[ICFMVelocityNet, dict] | None:
    """The result of ``run_dir``'s finished run and its checkpoint record, or ``None`` if the run has not finished.

    The result is the best-validation weights when the run validated, its final weights otherwise. With the run's
    configurations given, the checkpoint is checked to be theirs (:func:`check_state`) before it is used; without,
    they are read from the checkpoint and checked against it.

    Raises:
        CheckpointError: the checkpoint is unreadable, of another run, or not whole (one line naming the file).
    """
    path = _checkpoint_path(run_dir)
    if not path.exists():
        return None
    state = load_checkpoint(path)
    if model_config is None or train_config is None:
        try:
            model_config = model_config or ModelConfig(**state["model_config"])
            train_config = train_config or TrainConfig(**state["train_config"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no usable configuration ({err}); delete it to train that model again"
            ) from None
    check_state(state, path, model_config, train_config)
    if state["step"] < train_config.steps:
        return None
    model = ICFMVelocityNet(model_config)
    model.load_state_dict(state["best_model"] if state["best_model"] is not None else state["model"])
    return model.eval(), state


def _is_better(value: float, best: float | None) -> bool:
    """Strictly lower validation MMD² than ``best`` (a non-finite value never wins; the first of ties stays)."""
    if best is None:
        return True
    return math.isfinite(value) and (not math.isfinite(best) or value < best)


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    meta: MetaDistribution,
    run_dir: str | Path | None = None,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
    description: str = "train",
    observe: Callable[[int, ICFMVelocityNet], None] | None = None,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train :class:`ICFMVelocityNet` on tasks from ``meta``; resume from ``run_dir``'s checkpoint if there is one.

    Tasks come from ``meta`` with ``split="train"`` (validation tasks too, from a seed of their own); ``run_dir``
    holds ``checkpoint.safetensors`` (``None``: no checkpoints). ``callback(step, loss)`` runs after every step (e.g.
    to log, or to interrupt a test run), then ``observe(step, model)`` after validation and checkpointing (e.g. to
    evaluate snapshots; it must leave the weights and the global random state alone). On any ``device`` every random
    draw still comes from the CPU generator, so the data stream is the same; bit-exact resumption is only promised
    on the CPU. The result (best-validation weights when validating) is in eval mode.
    """
    if model_config.dim != meta.dim:
        raise ValueError(f"expected the model's dim to equal the tasks' dim, got {model_config.dim} and {meta.dim}")
    cfg = train_config
    device = torch.device(device)
    model = build_model(model_config, cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg)
    generator = torch.Generator().manual_seed(cfg.seed)
    val_batch = validation_tasks(meta, cfg).to(device) if cfg.eval_every else None
    step, losses = 0, []
    validation: list[tuple[int, float]] = []
    best: dict = {"model": None, "step": 0, "val": None}
    path = _checkpoint_path(run_dir) if run_dir is not None else None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            state = check_state(load_checkpoint(path), path, model_config, cfg)  # on the CPU
            try:  # load_state_dict copies onto the model's device
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
                generator.set_state(state["generator"].cpu())
            except (KeyError, TypeError, ValueError, RuntimeError) as err:  # the optimiser's or scheduler's state
                raise CheckpointError(
                    f"checkpoint {str(path)!r} cannot be resumed ({type(err).__name__}: {str(err).splitlines()[0]}); "
                    "delete it to train that model again"
                ) from None
            step, losses = state["step"], list(state["losses"])
            validation = [(int(k), float(v)) for k, v in state["validation"]]
            best = {"model": state["best_model"], "step": state["best_step"], "val": state["best_val"]}
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
                    "validation": validation,
                    "best_model": best["model"],
                    "best_step": best["step"],
                    "best_val": best["val"],
                    "model_config": model_config.to_dict(),
                    "train_config": cfg.to_dict(),
                },
                path,
            )

    def validate() -> None:
        # fixed tasks and a fixed sampling seed: the value depends on the weights only, so a resumed run
        # recomputes every later validation exactly and picks the same best step.
        value = validation_mmd(model, val_batch, seed=VAL_SEED + cfg.seed, n_steps=cfg.val_euler_steps)
        validation.append((step, value))
        if _is_better(value, best["val"]):
            best.update(model={k: v.detach().clone() for k, v in model.state_dict().items()}, step=step, val=value)

    start = time.perf_counter()
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=description, disable=not progress, leave=False)
    try:
        while step < cfg.steps:
            m = cfg.m if cfg.m_max is None else int(torch.randint(cfg.m, cfg.m_max + 1, (), generator=generator))
            batch = meta.sample_batch(cfg.batch_tasks, m, cfg.n_target, generator, split="train").to(device)
            loss = flow_matching_loss(model, batch.support, batch.target, generator, cfg.time_sampling)
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
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                validate()
                bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", val=f"{validation[-1][1]:.4f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save()
            if observe is not None:
                observe(step, model)
            if callback is not None:
                callback(step, losses[-1])
    finally:
        bar.close()
    if best["model"] is not None:
        model.load_state_dict(best["model"])
    else:
        best["step"] = step
    return TrainResult(
        model=model.eval(),
        losses=losses,
        wall_time=time.perf_counter() - start,
        resumed_from=resumed_from,
        validation=validation,
        best_step=best["step"],
        best_val=best["val"],
    )
