"""Run experiments by name: trained models are cached (and resumed) under ``OUT/runs``, results go to ``OUT/NAME``.

A trained model is identified by a hash of its model, training and task configuration; every experiment that needs
the same model (e.g. ``attention`` reuses the ``shells`` model) loads it instead of training it again, and a run
interrupted mid-training resumes from its last checkpoint when the command is started again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .._io import output_lock, versions, write_atomic
from .evaluate import MMDResult, evaluate_velocity, held_out_tasks, learned_velocity, plugin_velocity
from .model import ICFMVelocityNet, ModelConfig
from .report import ExperimentResult, markdown_table, write_result
from .tasks import MetaDistribution, TaskBatch, make_meta
from .tiers import Tier, check_folder_tier
from .training import TrainConfig, load_model, train

__all__ = ["EXPERIMENTS", "ExperimentContext", "run_experiments"]

logger = logging.getLogger(__name__)

#: offset of the held-out task seeds, far from every training seed.
EVAL_SEED = 10_000


@dataclass
class ExperimentContext:
    """Shared state of one invocation: the tier, the output folder and the cache of trained models.

    ``OUT/runs`` holds checkpoints, ``OUT/NAME`` the results of each experiment; ``recipe``: the digits organism's
    training recipe (``"support"``, ``"ip-adapter"`` or ``"mixed"``) that the experiments on it load.
    """

    tier: Tier
    out: Path
    progress: bool = True
    recipe: str = "support"
    runs: dict[str, dict] = field(default_factory=dict)
    _metas: dict[tuple[str, int], MetaDistribution] = field(default_factory=dict)
    _models: dict[str, ICFMVelocityNet] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Where models train and are evaluated: the tier's device, ``"auto"`` meaning CUDA when present."""
        if self.tier.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.tier.device)

    def meta(self, name: str, dim: int) -> MetaDistribution:
        """The meta-distribution ``name`` in dimension ``dim`` (built once; digits' PCA is fitted once)."""
        key = (name, dim)
        if key not in self._metas:
            self._metas[key] = make_meta(name, dim)
        return self._metas[key]

    def model_config(self, dim: int, exact_head: bool = False, n_heads: int | None = None) -> ModelConfig:
        t = self.tier
        return ModelConfig(dim, t.d_model, n_heads or t.n_heads, t.n_layers, exact_head=exact_head)

    def train_config(self, steps: int, seed: int, m: int = 50, m_max: int | None = None) -> TrainConfig:
        t = self.tier
        return TrainConfig(
            steps=steps,
            batch_tasks=t.batch_tasks,
            n_target=t.n_target,
            m=m,
            m_max=m_max,
            lr=t.lr,
            warmup=min(t.warmup, steps),
            seed=seed,
            checkpoint_every=max(1, min(250, steps // 4)),
            schedule=t.schedule,
            eval_every=min(t.eval_every, steps),
            val_tasks=t.val_tasks,
            val_points=t.val_points,
            val_euler_steps=t.euler_steps,
        )

    def trained(self, meta_name: str, model_config: ModelConfig, train_config: TrainConfig) -> ICFMVelocityNet:
        """The model trained on ``meta_name`` tasks: from memory, from a finished checkpoint, or trained now."""
        spec = {
            "meta": meta_name,
            "meta_spec": self.meta(meta_name, model_config.dim).spec(),
            "model": model_config.to_dict(),
            "train": train_config.to_dict(),
        }
        digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
        arm = "on" if model_config.exact_head else "off"
        key = f"{meta_name}-d{model_config.dim}-{arm}-H{model_config.n_heads}-s{train_config.seed}-{digest}"
        if key in self._models:
            return self._models[key]
        run_dir = self.out / "runs" / key
        loaded = load_model(run_dir, model_config, train_config)
        if loaded is not None:
            model, state = loaded
            info = {"trained_now": False, "final_loss": _tail_mean(state["losses"]), "wall_time_s": None}
            info.update(_selection(state["validation"], state["best_step"], state["best_val"], state["step"]))
        else:
            result = train(
                model_config,
                train_config,
                self.meta(meta_name, model_config.dim),
                run_dir=run_dir,
                progress=self.progress,
                description=key.rsplit("-", 1)[0],
                device=self.device,
            )
            model = result.model.cpu()
            info = {
                "trained_now": True,
                "resumed_from": result.resumed_from,
                "final_loss": _tail_mean(result.losses),
                "wall_time_s": round(result.wall_time, 2),
            }
            info.update(_selection(result.validation, result.best_step, result.best_val, len(result.losses)))
        self.runs[key] = dict(spec, **info)
        self._models[key] = model
        return model

    def held_out(self, meta_name: str, dim: int, m: int = 50, n_ref: int | None = None) -> TaskBatch:
        """The fixed held-out tasks of ``meta_name`` in ``dim`` dimensions (seed depends on both)."""
        seed = EVAL_SEED + 97 * dim + sum(map(ord, meta_name))
        return held_out_tasks(self.meta(meta_name, dim), self.tier.eval_tasks, m, n_ref or self.tier.eval_points, seed)

    def mmd_of(self, velocity_fn, tasks: TaskBatch, seed: int = 0) -> MMDResult:
        """MMD² of samples of any velocity field ``velocity_fn(x, t)`` on ``tasks`` (fixed sampling seed)."""
        return evaluate_velocity(velocity_fn, tasks, EVAL_SEED + seed, self.tier.euler_steps)[0]

    def mmd_plugin(self, tasks: TaskBatch, seed: int = 0) -> MMDResult:
        """MMD² of the plug-in (exact NW field) samples on ``tasks`` (on the context's device)."""
        tasks = tasks.to(self.device)
        return self.mmd_of(plugin_velocity(tasks.support), tasks, seed)

    def mmd_learned(self, model: ICFMVelocityNet, tasks: TaskBatch, seed: int = 0) -> MMDResult:
        """MMD² of the learned model's samples on ``tasks`` (on the context's device; the model stays where it is)."""
        device, home = self.device, next(model.parameters()).device
        tasks = tasks.to(device)
        try:
            return self.mmd_of(learned_velocity(model.to(device), tasks.support), tasks, seed)
        finally:
            model.to(home)


def _selection(validation: list, best_step: int, best_val: float | None, steps: int) -> dict:
    """The record of a run's checkpoint choice: its validation curve and the step whose weights are its result."""
    return {
        "selected": "best validation MMD²" if validation else "final weights",
        "best_step": best_step if validation else steps,
        "best_val_mmd2": best_val,
        "validation": [[int(k), float(v)] for k, v in validation],
    }


def _tail_mean(losses: list[float], k: int = 50) -> float | None:
    tail = losses[-k:]
    return round(sum(tail) / len(tail), 5) if tail else None


def _registry() -> dict[str, Callable[[ExperimentContext], ExperimentResult]]:
    from . import attention, attribution, collapse, heads, ip_adapter, scarcity, shells

    return {
        "collapse": collapse.run,
        "shells": shells.run,
        "scarcity": scarcity.run,
        "heads": heads.run,
        "attention": attention.run,
        "ip-adapter": ip_adapter.run,
        "attribution": attribution.run,
    }


#: experiment names in the order ``all`` runs them (attention after shells: it reuses the shells model).
EXPERIMENTS = ("collapse", "shells", "scarcity", "heads", "attention", "ip-adapter", "attribution")


def run_experiments(
    names: list[str] | tuple[str, ...],
    tier: Tier,
    out: str | Path,
    progress: bool = True,
    threads: int | None = None,
    recipe: str = "support",
) -> dict[str, ExperimentResult]:
    """Run the named experiments at ``tier`` and write their outputs under ``out``.

    ``names`` from :data:`EXPERIMENTS` (``"all"`` expands to every one). ``out`` is created if missing and locked while
    the experiments run (a second run on it raises :class:`~.._io.OutputLocked` naming this one); it holds one tier's
    results: one with another tier's (or other sizes) raises :class:`~.tiers.TierMismatch` before anything runs.
    ``threads``: by default one on the CPU tiers (their models are too small to share kernels between threads: the
    quick tier ran twice as fast on one as on two) and all cores on ``paper``. ``recipe``: the digits organism's, for
    ``ip-adapter`` and ``attribution``. Returns the results by name; ``out/NAME/`` holds ``table.md``, ``table.csv``,
    ``record.json`` and PNG figures, and ``out/summary.md`` all tables together.
    """
    names = list(EXPERIMENTS) if "all" in names else list(names)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"expected experiments among {EXPERIMENTS + ('all',)}, got {unknown}")
    out = Path(out)
    previous_threads = torch.get_num_threads()
    registry = _registry()
    results: dict[str, ExperimentResult] = {}
    with ExitStack() as stack:
        stack.enter_context(output_lock(out, "ipa-probe experiments"))  # one writer per folder
        check_folder_tier(out, tier)  # one tier per folder: no table of another tier is replaced
        stack.callback(torch.set_num_threads, previous_threads)
        torch.set_num_threads(threads or (1 if tier.device == "cpu" else os.cpu_count() or 1))
        ctx = ExperimentContext(tier, out, progress, recipe)
        for name in names:
            start = time.perf_counter()
            ctx.runs = {}
            result = registry[name](ctx)
            result.record.update(
                experiment=name,
                tier=tier.to_dict(),
                seeds=list(tier.seeds),
                versions={**versions(), "threads": torch.get_num_threads()},
                training_runs=ctx.runs,
                device=str(ctx.device),
                wall_time_s=round(time.perf_counter() - start, 2),
            )
            write_result(result, out / name)
            results[name] = result
            logger.info("%s done in %.1f s", name, result.record["wall_time_s"])
        summary = [f"# Results, tier `{tier.name}`\n"]
        for name, result in results.items():
            summary.append(f"## {name} ({result.record['wall_time_s']:.0f} s)\n\n{markdown_table(result.rows)}")
            summary.extend(f"![{p.stem}]({name}/{p.name})\n" for p in result.figures)
        write_atomic(out / "summary.md", "\n".join(summary))
    return results
