"""``train_digits`` (``ipa-probe train-digits``): the seeded, resumable three-stage training of the organism.

Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, StableDiffusionPipeline
from tqdm.auto import tqdm
from transformers import (
    CLIPTextModel,
)

from ..._io import versions, write_json
from ..sd import _seeded
from ..tokenizer import clip_tokenizer
from .data import (
    _CHECKPOINT,
    _VISION_WIDTH,
    DIGITS_PROMPT,
    NUM_IP_TOKENS,
    TRAIN_SIZE,
    WEIGHT_NAME,
    _to_pil,
    digit_images,
)
from .model import (
    _adapter_state_dict,
    _feature_extractor,
    _init_modules,
    _quiet_loading,
    _restore_default_processors,
    _scheduler,
)

# --- training -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitsTrainConfig:
    """Settings of :func:`train_digits`.

    Attributes:
        seed: seeds the initial weights and, with the step number, every batch (so a resumed run replays exactly).
        threads: ``torch.set_num_threads`` during training (the result depends on it at the last bits).
        vae_steps, vae_lr, vae_kl: VAE training steps, learning rate and KL weight (per latent element).
        encoder_steps, encoder_lr: the image encoder's pretraining as a digit classifier (batch ``2 * batch``).
        steps, lr, batch: UNet + adapter + image encoder training steps, AdamW learning rate, batch size.
        max_refs: references per target are drawn from ``1..max_refs`` (one count per batch).
        drop_embeds: fraction of targets trained with zero image embeddings (the CFG unconditional branch).
        drop_tokens: fraction trained with zero image tokens (identical to adapter scale 0).
        drop_text: fraction trained with the empty prompt.
        checkpoint_every: steps between checkpoints (both stages).
    """

    seed: int = 0
    threads: int = 2
    vae_steps: int = 300
    vae_lr: float = 2e-3
    vae_kl: float = 1e-3
    encoder_steps: int = 300
    encoder_lr: float = 2e-3
    steps: int = 800
    lr: float = 1e-3
    batch: int = 64
    max_refs: int = 4
    drop_embeds: float = 0.1
    drop_tokens: float = 0.05
    drop_text: float = 0.1
    checkpoint_every: int = 100

    def __post_init__(self):
        for name in ("threads", "vae_steps", "encoder_steps", "steps", "batch", "max_refs", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be an int >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"expected seed to be a non-negative int, got {self.seed!r}")
        for name in ("drop_embeds", "drop_tokens", "drop_text"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"expected {name} in [0, 1), got {getattr(self, name)!r}")
        if self.drop_embeds + self.drop_tokens >= 1.0:
            raise ValueError("expected drop_embeds + drop_tokens < 1 so that some targets see their references")
        for name in ("vae_lr", "encoder_lr", "lr", "vae_kl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"expected {name} > 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def _step_generator(seed: int, stage: str, step: int) -> torch.Generator:
    offset = {"vae": 0, "unet": 1, "encoder": 2}[stage]
    return torch.Generator().manual_seed((seed * 1_000_003 + offset) * 10_000_019 + step)


def _flat_state(modules: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    flat: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        for key, value in module.state_dict().items():
            flat[f"model/{name}/{key}"] = value.detach().contiguous()
    for name, opt in optimizers.items():
        for index, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                flat[f"optim/{name}/{index}/{key}"] = torch.as_tensor(value).detach().contiguous()
    return flat


def _load_flat_state(
    flat: dict[str, torch.Tensor], modules: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    for name, module in modules.items():
        prefix = f"model/{name}/"
        module.load_state_dict({k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)})
    for name, opt in optimizers.items():
        prefix = f"optim/{name}/"
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in flat.items():
            if key.startswith(prefix):
                index, field = key.removeprefix(prefix).split("/")
                state.setdefault(int(index), {})[field] = value.clone()
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)


class _Checkpoint:
    """``checkpoint.safetensors`` (weights and optimizer moments) + ``checkpoint.json`` (stage, step, losses)."""

    def __init__(self, out: Path, config: DigitsTrainConfig):
        self.tensors = out / f"{_CHECKPOINT}.safetensors"
        self.meta = out / f"{_CHECKPOINT}.json"
        self.config = config

    def load(self) -> tuple[dict, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        if not self.meta.exists():
            return None
        meta = json.loads(self.meta.read_text())
        if meta["config"] != self.config.to_dict():
            raise ValueError(
                f"expected {self.meta} to hold a run with the same settings, got {meta['config']}; "
                "pass a fresh --out folder or delete the checkpoint to retrain"
            )
        return meta, load_file(str(self.tensors))

    def save(self, meta: dict, flat: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tmp = self.tensors.with_name(self.tensors.name + ".tmp")
        save_file(flat, str(tmp))
        os.replace(tmp, self.tensors)
        write_json(self.meta, {**meta, "config": self.config.to_dict()})


def _vae_loss(vae: AutoencoderKL, x: torch.Tensor, generator: torch.Generator, kl_weight: float) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    recon = vae.decode(z).sample
    kl = 0.5 * (posterior.mean**2 + posterior.var - 1.0 - posterior.logvar)
    return F.mse_loss(recon, x) + kl_weight * kl.mean()


def _pixels(grey: np.ndarray) -> torch.Tensor:
    """uint8 ``(N, 16, 16)`` -> the VAE's input, float ``(N, 3, 16, 16)`` in [-1, 1]."""
    x = torch.from_numpy(grey).float() / 127.5 - 1.0
    return x[:, None].expand(-1, 3, -1, -1).contiguous()


def _prompt_states(text_encoder: CLIPTextModel, prompt: str) -> torch.Tensor:
    tokenizer = clip_tokenizer()
    ids = tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    with torch.no_grad():
        return text_encoder(ids.input_ids)[0]  # (1, 77, 32)


def train_digits(
    out: str | os.PathLike,
    config: DigitsTrainConfig | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Train the digits organism from scratch (or resume ``out``'s checkpoint) and save it in ``out``.

    Stage 1 trains the VAE on the training digits; stage 2 fixes the latents (posterior means, scaled to unit
    spread) and trains the UNet, the IP-Adapter and the image encoder together. Every batch is drawn from a generator
    seeded by ``(seed, stage, step)``, so a run interrupted and resumed ends with the same weights as one that was not
    (at the same thread count).

    Args:
        out: output folder. Written: ``model/`` (``save_pretrained``, without adapter), ``ip_adapter/`` (the adapter
            in the published layout, for ``load_ip_adapter``), ``record.json``, ``loss.png``, and the checkpoint
            ``checkpoint.{safetensors,json}`` (kept, so that a finished run is not retrained).
        config: the settings (defaults: the shipped weights').
        progress: show tqdm progress bars.
        stop_after: stop (with a checkpoint) once this many steps, over all stages, are done in this call; for
            testing resumption.

    Returns:
        the record (also written to ``record.json``); ``{"finished": False, ...}`` if stopped early.
    """
    config = config or DigitsTrainConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _train(out, config, progress, stop_after)
    finally:
        torch.set_num_threads(previous_threads)


def _train(out: Path, config: DigitsTrainConfig, progress: bool, stop_after: int | None) -> dict:
    parts = _init_modules(config.seed)
    vae, unet, image_encoder, image_proj = parts["vae"], parts["unet"], parts["image_encoder"], parts["image_proj"]
    with _seeded(config.seed, "digits/encoder_head"):
        head = torch.nn.Linear(_VISION_WIDTH, 10)  # the image encoder's pretraining head (not shipped)
    # the processors' to_k_ip/to_v_ip are submodules of the UNet's attention layers, so unet.parameters() has them
    trainable = list(unet.parameters()) + list(image_encoder.parameters()) + list(image_proj.parameters())
    modules = {"vae": vae, "unet": unet, "image_encoder": image_encoder, "image_proj": image_proj, "head": head}
    optimizers = {
        "vae": torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0),
        "encoder": torch.optim.AdamW([*image_encoder.parameters(), *head.parameters()], lr=config.encoder_lr),
        "unet": torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0),
    }
    checkpoint = _Checkpoint(out, config)
    meta: dict[str, Any] = {
        "stage": STAGES[0],
        "step": 0,
        "losses": {s: [] for s in STAGES},
        "wall_s": {s: 0.0 for s in STAGES},
        "load_average_at_start": list(os.getloadavg()),
        "resumed": 0,
    }
    loaded = checkpoint.load()
    if loaded is not None:
        meta, flat = loaded
        meta["resumed"] += 1
        _load_flat_state(flat, modules, optimizers)
    grey, labels = digit_images()
    train_x = _pixels(grey[:TRAIN_SIZE])  # (1500, 3, 16, 16)
    train_y = torch.from_numpy(labels[:TRAIN_SIZE])
    pixel_values = _feature_extractor()([_to_pil(g) for g in grey[:TRAIN_SIZE]], return_tensors="pt").pixel_values
    data: dict[str, Any] = {"y": train_y, "pixel_values": pixel_values}

    def vae_step(gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, TRAIN_SIZE, (config.batch,), generator=gen)
        return _vae_loss(vae, train_x[idx], gen, config.vae_kl)

    def encoder_step(gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, TRAIN_SIZE, (2 * config.batch,), generator=gen)
        logits = head(image_encoder(pixel_values[idx]).image_embeds)  # (2B, 10)
        return F.cross_entropy(logits, train_y[idx])

    def unet_step(gen: torch.Generator) -> torch.Tensor:
        return _unet_loss(config, gen, data, parts)

    steps = {"vae": config.vae_steps, "encoder": config.encoder_steps, "unet": config.steps}
    step_fns = {"vae": vae_step, "encoder": encoder_step, "unet": unet_step}
    params = {"vae": list(vae.parameters()), "encoder": [*image_encoder.parameters(), *head.parameters()]}
    params["unet"] = trainable
    budget = [stop_after if stop_after is not None else float("inf")]
    for stage in STAGES[STAGES.index(meta["stage"]) :]:
        if stage == "unet":
            vae.eval().requires_grad_(False)
            data.update(_unet_data(vae, train_x, train_y, parts["text_encoder"]))
        if meta["stage"] != stage:
            meta["stage"], meta["step"] = stage, 0
        for module in (vae, image_encoder, head) if stage != "unet" else (unet, image_encoder, image_proj):
            module.train()
        finished = _run_stage(
            stage, steps[stage], step_fns[stage], optimizers[stage], params[stage], meta, config, progress, budget,
            lambda: checkpoint.save(meta, _flat_state(modules, optimizers)),
        )  # fmt: skip
        if not finished:
            return {"finished": False, **meta}
        if stage == "encoder":  # the head's accuracy right after pretraining (recomputed identically on a resume)
            meta["encoder_pretraining_train_accuracy"] = _encoder_accuracy(image_encoder, head, pixel_values, train_y)
    if "scaling_factor" not in data:
        data.update(_unet_data(vae.eval(), train_x, train_y, parts["text_encoder"]))
    scaling_factor = data["scaling_factor"]
    record = {
        "finished": True,
        "config": config.to_dict(),
        "scaling_factor": scaling_factor,
        "wall_s": {**meta["wall_s"], "total": sum(meta["wall_s"].values())},
        "final_losses": {s: float(np.mean(meta["losses"][s][-100:])) for s in STAGES if meta["losses"][s]},
        # the pretraining head on the training digits: right after pretraining, and (stale head) after joint training
        "encoder_pretraining_train_accuracy": meta.get("encoder_pretraining_train_accuracy"),
        "encoder_head_train_accuracy_after_joint_training": _encoder_accuracy(
            image_encoder, head, pixel_values, train_y
        ),
        "threads": config.threads,
        "load_average_at_start": meta.get("load_average_at_start"),
        "load_average_at_end": list(os.getloadavg()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "resumed": meta["resumed"],
        "versions": versions(),
        "train_digits": f"indices [0, {TRAIN_SIZE}) of sklearn.datasets.load_digits",
        "image_encoder": "pretrained as a digit classifier on the training digits (a linear head on image_embeds, "
        "not shipped; the stand-in for CLIP's pretraining), then trained jointly with the UNet and adapter",
        "text_encoder": "random, frozen, stored in float16",
    }
    for module in (unet, image_encoder, image_proj):
        module.eval()
    _save_outputs(out, parts, scaling_factor)
    _plot_losses(out / "loss.png", meta["losses"])
    write_json(out / "record.json", record)
    return record


STAGES = ("vae", "encoder", "unet")
"""Training stages in order: the VAE, the image encoder's classification pretraining, then UNet + adapter."""


def _run_stage(stage, total, step_fn, optimizer, params, meta, config, progress, budget, save) -> bool:
    """Run ``stage`` from ``meta["step"]`` to ``total`` steps; ``False`` if stopped early by ``budget``."""
    bar = tqdm(total=total, initial=meta["step"], desc=stage, disable=not progress)
    start = time.perf_counter() - meta["wall_s"][stage]
    try:
        while meta["step"] < total:
            if budget[0] <= 0:
                save()
                return False
            gen = _step_generator(config.seed, stage, meta["step"])
            loss = step_fn(gen)
            if stage == "unet":
                for group in optimizer.param_groups:
                    group["lr"] = config.lr * _lr_factor(meta["step"], total)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            meta["step"] += 1
            meta["losses"][stage].append(float(loss.detach()))
            budget[0] -= 1
            bar.update(1)
            if meta["step"] % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(meta['losses'][stage][-50:]):.4f}")
            meta["wall_s"][stage] = time.perf_counter() - start
            if meta["step"] % config.checkpoint_every == 0 or meta["step"] == total:
                save()
    finally:
        bar.close()
    return True


@torch.no_grad()
def _encoder_accuracy(image_encoder, head, pixel_values, labels) -> float:
    logits = head(image_encoder.eval()(pixel_values).image_embeds)
    return float((logits.argmax(1) == labels).float().mean())


@torch.no_grad()
def _unet_data(vae, train_x, train_y, text_encoder) -> dict[str, Any]:
    """Latents (posterior means scaled to unit spread), class index lists and the two prompts' states."""
    latents = torch.cat([vae.encode(train_x[i : i + 256]).latent_dist.mean for i in range(0, TRAIN_SIZE, 256)])
    scaling_factor = float(1.0 / latents.std())
    return {
        "latents": latents * scaling_factor,  # (1500, 4, 8, 8)
        "scaling_factor": scaling_factor,
        "by_class": [torch.nonzero(train_y == c).flatten() for c in range(10)],
        "text_cond": _prompt_states(text_encoder, DIGITS_PROMPT),
        "text_uncond": _prompt_states(text_encoder, ""),
        "alphas_cumprod": _scheduler().alphas_cumprod,
    }


def _lr_factor(step: int, steps: int, warmup: int = 100) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + float(np.cos(np.pi * progress)))


def _unet_loss(config: DigitsTrainConfig, gen: torch.Generator, data: dict[str, Any], parts: dict[str, Any]):
    unet, image_encoder, image_proj = parts["unet"], parts["image_encoder"], parts["image_proj"]
    latents, labels, by_class = data["latents"], data["y"], data["by_class"]
    pixel_values, alphas_cumprod = data["pixel_values"], data["alphas_cumprod"]
    text_cond, text_uncond = data["text_cond"], data["text_uncond"]
    b = config.batch
    k = int(torch.randint(1, config.max_refs + 1, (), generator=gen))
    target = torch.randint(0, len(latents), (b,), generator=gen)
    # k references of the target's class, other than the target: (B, k) indices into the training digits
    refs = torch.empty(b, k, dtype=torch.long)
    for i, t in enumerate(target.tolist()):
        pool = by_class[int(labels[t])]
        pool = pool[pool != t]
        refs[i] = pool[torch.randperm(len(pool), generator=gen)[:k]]
    x0 = latents[target]  # (B, 4, 8, 8)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, len(alphas_cumprod), (b,), generator=gen)
    a = alphas_cumprod[t].view(b, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    embeds = image_encoder(pixel_values[refs.flatten()]).image_embeds.view(b, k, -1)  # (B, k, 32)
    u = torch.rand(b, generator=gen)
    drop_embeds = u < config.drop_embeds
    drop_tokens = (u >= config.drop_embeds) & (u < config.drop_embeds + config.drop_tokens)
    embeds = torch.where(drop_embeds.view(b, 1, 1), torch.zeros_like(embeds), embeds)
    tokens = image_proj(embeds.reshape(b * k, -1)).view(b, k * NUM_IP_TOKENS, -1)  # (B, 4k, 32)
    tokens = torch.where(drop_tokens.view(b, 1, 1), torch.zeros_like(tokens), tokens)
    drop_text = torch.rand(b, generator=gen) < config.drop_text
    text = torch.where(drop_text.view(b, 1, 1), text_uncond, text_cond)  # (B, 77, 32)
    # Without encoder_hid_proj the UNet passes the (text, [image tokens]) pair straight to the IP processors.
    pred = unet(xt, t, encoder_hidden_states=(text, [tokens])).sample
    return F.mse_loss(pred, noise)


def _save_outputs(out: Path, parts: dict[str, Any], scaling_factor: float) -> None:
    from safetensors.torch import save_file

    unet = parts["unet"]
    state = _adapter_state_dict(unet, parts["ip_processors"], parts["image_proj"])
    _restore_default_processors(unet)
    parts["vae"].register_to_config(scaling_factor=scaling_factor)
    pipe = StableDiffusionPipeline(
        vae=parts["vae"].eval(),
        text_encoder=parts["text_encoder"].half(),
        tokenizer=clip_tokenizer(),
        unet=unet.eval(),
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=parts["image_encoder"].eval(),
        requires_safety_checker=False,
    )
    with _quiet_loading():  # no "Writing model shards" bars from transformers (two small files)
        pipe.save_pretrained(out / "model", safe_serialization=True)
    parts["text_encoder"].float()
    flat = {f"{group}.{key}": value for group, tensors in state.items() for key, value in tensors.items()}
    (out / "ip_adapter").mkdir(exist_ok=True)
    save_file(flat, str(out / "ip_adapter" / WEIGHT_NAME), metadata={"format": "pt", "ipa_probe": "digits"})


def _plot_losses(path: Path, losses: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import pandas as pd

    titles = {
        "vae": "VAE (MSE + KL)",
        "encoder": "image encoder pretraining (CE)",
        "unet": "UNet + IP-Adapter (eps MSE)",
    }
    fig, axes = plt.subplots(1, len(STAGES), figsize=(4.2 * len(STAGES), 3.2))
    for ax, stage in zip(axes, STAGES, strict=True):
        series = pd.Series(losses[stage], dtype=float)
        ax.plot(series.index + 1, series, color="0.8", linewidth=0.6, label="step")
        ax.plot(series.index + 1, series.rolling(50, min_periods=1).mean(), color="C0", label="mean of 50")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(titles[stage])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
