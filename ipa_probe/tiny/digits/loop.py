"""The parts both training recipes share: seeded batches, the learning-rate schedule, the stage loop with its
checkpoints, the image encoder's pretraining, the loss figure and the run's record fields.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import CLIPTextModel, CLIPVisionModelWithProjection

from ..._checks import DIGITS_SMALLEST_CLASS, max_refs_limit
from ..._io import output_lock, write_figure
from ..tokenizer import clip_tokenizer
from .data import TRAIN_SIZE, _to_pil, digit_images

_STAGE_OFFSETS = {"vae": 0, "unet": 1, "encoder": 2, "adapter": 3}


def check_settings(
    config: Any,
    counts: Sequence[str],
    fractions: Sequence[str] = (),
    positives: Sequence[str] = (),
    max_refs_of: str | None = None,
) -> None:
    """Check a training config's fields: ``seed`` a non-negative int, ``counts`` ints >= 1, ``fractions`` in [0, 1)
    summing below 1 (some targets must see their references), ``positives`` > 0 (rates, weights), and with
    ``max_refs_of`` (``"support"`` or ``"adapter"``) ``max_refs`` at most what that training can draw."""
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
        raise ValueError(f"expected seed to be a non-negative int, got {config.seed!r}")
    for name in counts:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected {name} to be an int >= 1, got {value!r}")
    for name in fractions:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
            raise ValueError(f"expected {name} in [0, 1), got {value!r}")
    if sum(getattr(config, name) for name in fractions) >= 1.0:
        raise ValueError(f"expected {' + '.join(fractions)} < 1 so that some targets see their references")
    for name in positives:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"expected {name} > 0, got {value!r}")
    if max_refs_of is not None and config.max_refs > max_refs_limit(max_refs_of):
        raise ValueError(
            f"max_refs: expected at most {max_refs_limit(max_refs_of)} (a target's references come from its class; "
            f"the rarest digit has {DIGITS_SMALLEST_CLASS} training images), got {config.max_refs}"
        )


def step_generator(seed: int, stage: str, step: int) -> torch.Generator:
    """The generator of one training step: seeded by ``(seed, stage, step)``, so a resumed run replays exactly."""
    return torch.Generator().manual_seed((seed * 1_000_003 + _STAGE_OFFSETS[stage]) * 10_000_019 + step)


def lr_factor(step: int, steps: int, warmup: int = 100) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + float(np.cos(np.pi * progress)))


def load_state(checkpoint: Any, modules: dict, optimizers: dict, stages: Sequence[str]) -> dict[str, Any]:
    """The run state (what the checkpoint carries besides tensors): ``checkpoint``'s, with ``modules`` and
    ``optimizers`` loaded from it and one more resume counted; without one, the state a fresh training starts from."""
    state = checkpoint.load(modules, optimizers)
    if state is not None:
        state["resumed"] += 1
        return state
    return {
        "stage": stages[0],
        "step": 0,
        "losses": {s: [] for s in stages},
        "wall_s": {s: 0.0 for s in stages},
        "load_average_at_start": list(os.getloadavg()),
        "resumed": 0,
    }


def run_stage(
    stage: str,
    total: int,
    step_fn: Callable[[torch.Generator], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    state: dict[str, Any],
    seed: int,
    checkpoint_every: int,
    progress: bool,
    budget: list[float],
    save: Callable[[], Any],
    lr: float | None = None,
) -> bool:
    """Run ``stage`` from ``state["step"]`` to ``total`` steps, checkpointing every ``checkpoint_every`` steps.

    Args:
        step_fn: the loss of one step, given that step's generator.
        params: the parameters whose gradient norm is clipped to 1.
        state: the run state, updated in place (step, losses, wall time).
        budget: ``[steps left in this call]``; decremented; at 0 the stage checkpoints and stops.
        save: writes the checkpoint.
        lr: the base learning rate, scheduled by :func:`lr_factor`; ``None`` keeps the optimizer's.

    Returns:
        ``False`` if stopped early by ``budget``.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=state["step"], desc=stage, disable=not progress)
    start = time.perf_counter() - state["wall_s"][stage]
    try:
        while state["step"] < total:
            if budget[0] <= 0:
                save()
                return False
            loss = step_fn(step_generator(seed, stage, state["step"]))
            if lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr * lr_factor(state["step"], total)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            state["step"] += 1
            state["losses"][stage].append(float(loss.detach()))
            budget[0] -= 1
            bar.update(1)
            if state["step"] % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(state['losses'][stage][-50:]):.4f}")
            state["wall_s"][stage] = time.perf_counter() - start
            if state["step"] % checkpoint_every == 0 or state["step"] == total:
                save()
    finally:
        bar.close()
    return True


@contextmanager
def training_folder(out: str | os.PathLike, threads: int) -> Iterator[Path]:
    """Create ``out``, hold its lock (one training per folder) and run with ``threads`` torch threads."""
    out = Path(out)
    previous_threads = torch.get_num_threads()
    with output_lock(out, "ipa-probe train-digits"):
        torch.set_num_threads(threads)
        try:
            yield out
        finally:
            torch.set_num_threads(previous_threads)


def pixels(grey: np.ndarray) -> torch.Tensor:
    """uint8 ``(N, 16, 16)`` -> the VAE's input, float ``(N, 3, 16, 16)`` in [-1, 1]."""
    x = torch.from_numpy(grey).float() / 127.5 - 1.0
    return x[:, None].expand(-1, 3, -1, -1).contiguous()


def training_digits() -> dict[str, torch.Tensor]:
    """The training digits: ``x`` (N, 3, 16, 16) in [-1, 1], ``y`` (N,), and the image encoder's ``pixel_values``
    (the pipeline's feature extractor on each rendered digit). A new dict of the same tensors on each call (the
    tensors are made once per process; do not modify them in place)."""
    return dict(_training_digits())


@lru_cache(maxsize=1)
def _training_digits() -> dict[str, torch.Tensor]:
    from .model import _feature_extractor

    grey, labels = digit_images()
    pixel_values = _feature_extractor()([_to_pil(g) for g in grey[:TRAIN_SIZE]], return_tensors="pt").pixel_values
    return {"x": pixels(grey[:TRAIN_SIZE]), "y": torch.from_numpy(labels[:TRAIN_SIZE]), "pixel_values": pixel_values}


def prompt_states(text_encoder: CLIPTextModel, prompt: str) -> torch.Tensor:
    """The text encoder's last hidden states for ``prompt``: ``(1, 77, width)``."""
    tokenizer = clip_tokenizer()
    ids = tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    with torch.no_grad():
        return text_encoder(ids.input_ids)[0]


def encoder_loss(
    image_encoder: CLIPVisionModelWithProjection,
    head: torch.nn.Linear,
    data: dict[str, torch.Tensor],
    batch: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """One step of the image encoder's pretraining as a digit classifier (a linear head on ``image_embeds``)."""
    idx = torch.randint(0, TRAIN_SIZE, (batch,), generator=gen)
    logits = head(image_encoder(data["pixel_values"][idx]).image_embeds)  # (B, 10)
    return F.cross_entropy(logits, data["y"][idx])


@torch.no_grad()
def encoder_accuracy(image_encoder, head, pixel_values, labels) -> float:
    """The pretraining head's accuracy on ``pixel_values``."""
    logits = head(image_encoder.eval()(pixel_values).image_embeds)
    return float((logits.argmax(1) == labels).float().mean())


def plot_losses(path: Path, losses: dict[str, list[float]], titles: dict[str, str]) -> None:
    """One log-scale panel per stage: every step's loss and its running mean of 50."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import pandas as pd

    from ...figstyle import DOUBLE_COLUMN, paper_style

    with paper_style():
        fig, axes = plt.subplots(1, len(titles), figsize=(DOUBLE_COLUMN, 3.2), squeeze=False, layout="constrained")
        for ax, (stage, title) in zip(axes[0], titles.items(), strict=True):
            series = pd.Series(losses[stage], dtype=float)
            ax.plot(series.index + 1, series, color="0.8", linewidth=0.6, label="step")
            ax.plot(series.index + 1, series.rolling(50, min_periods=1).mean(), color="C0", label="mean of 50")
            ax.set(yscale="log", xlabel="step", ylabel="training loss (log)", title=title)
            ax.legend()
    write_figure(fig, path)


def final_losses(losses: dict[str, list[float]]) -> dict[str, float]:
    """Each stage's mean loss over its last 100 steps."""
    return {s: float(np.mean(v[-100:])) for s, v in losses.items() if v}


def run_fields(state: dict[str, Any], threads: int) -> dict[str, Any]:
    """The record fields every training run writes: wall times, threads, load, wait policy, resumes."""
    from ..._io import versions

    return {
        "wall_s": {**state["wall_s"], "total": sum(state["wall_s"].values())},
        "final_losses": final_losses(state["losses"]),
        "threads": threads,
        "load_average_at_start": state.get("load_average_at_start"),
        "load_average_at_end": list(os.getloadavg()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "resumed": state["resumed"],
        "versions": versions(),
    }


def save_adapter(out: Path, state: dict[str, dict[str, torch.Tensor]], note: str) -> None:
    """``out/ip_adapter/ip-adapter.safetensors`` in ``load_ip_adapter``'s layout (``state``'s groups flattened to
    ``group.key``), written atomically."""
    from safetensors.torch import save_file

    from ..._io import atomic_path
    from .data import WEIGHT_NAME

    flat = {f"{group}.{key}": value for group, tensors in state.items() for key, value in tensors.items()}
    (out / "ip_adapter").mkdir(exist_ok=True)
    with atomic_path(out / "ip_adapter" / WEIGHT_NAME) as temp:
        save_file(flat, str(temp), metadata={"format": "pt", "ipa_probe": note})


def noisy(latents: torch.Tensor, alphas_cumprod: torch.Tensor, target: torch.Tensor, gen: torch.Generator):
    """``(x_t, t, noise)`` for the targets, on SD 1.5's DDPM schedule: x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise."""
    b = len(target)
    x0 = latents[target]  # (B, 4, 8, 8)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, len(alphas_cumprod), (b,), generator=gen)
    a = alphas_cumprod[t].view(b, 1, 1, 1)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise, t, noise
