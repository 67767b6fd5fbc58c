"""The ``ip-adapter`` recipe: an image-free base UNet (stage 1), then only the adapter on the frozen base (stage 2).

This is how IP-Adapter itself is trained (Ye et al. 2023): a frozen pretrained UNet and image encoder, and only
``ImageProjection`` plus each cross-attention layer's ``to_k_ip`` / ``to_v_ip`` (initialised from ``to_k`` /
``to_v``) trained to reconstruct each image from its own embedding. Stage 1, :func:`train_base` (``--stage base``),
writes ``unet/`` (float16), ``image_encoder/``, ``record.json`` and ``loss.png`` (shipped in
``digits_ip_adapter_weights/base``); stage 2, :func:`train_adapter`, writes ``ip_adapter/`` (``load_ip_adapter``'s
layout), ``record.json`` (naming the base and its digest) and ``loss.png`` (``digits_ip_adapter_weights/adapter``).
The VAE, text encoder and tokenizer are the ``support`` recipe's. Settings and how they were chosen:
docs/organism.md. Part of :mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from transformers import CLIPTextModel

from ..._io import write_json
from ..sd import _seeded
from .checkpoint import TrainingCheckpoint
from .data import _VISION_WIDTH, DIGITS_PROMPT, DIGITS_WEIGHTS, NUM_IP_TOKENS, TRAIN_SIZE
from .loop import (
    check_settings,
    encoder_accuracy,
    encoder_loss,
    load_state,
    noisy,
    plot_losses,
    prompt_states,
    run_fields,
    run_stage,
    save_adapter,
    training_digits,
)
from .model import (
    _adapter_state_dict,
    _init_adapter,
    _init_base_modules,
    _quiet_loading,
    base_digest,
    load_base,
    organism_scheduler,
    resolve_base,
)

__all__ = ["DigitsAdapterConfig", "DigitsBaseConfig", "train_adapter", "train_base"]


@dataclass(frozen=True)
class DigitsBaseConfig:
    """Settings of stage 1 of the ``ip-adapter`` recipe (:func:`train_base`), the shipped base's by default.

    Attributes:
        seed: seeds the initial weights and, with the step number, every batch.
        threads: ``torch.set_num_threads`` during training.
        encoder_steps, encoder_lr: the image encoder's pretraining as a digit classifier (batch ``2 * batch``).
        steps, lr, batch: base UNet training steps, peak AdamW learning rate (warm-up, cosine decay), batch size.
        drop_text: fraction trained with the empty prompt (so that CFG's unconditional branch is in distribution).
        checkpoint_every: steps between checkpoints.
    """

    seed: int = 0
    threads: int = 2
    encoder_steps: int = 300
    encoder_lr: float = 2e-3
    steps: int = 3000
    lr: float = 1e-3
    batch: int = 64
    drop_text: float = 0.1
    checkpoint_every: int = 100

    recipe = "ip-adapter/base"

    def __post_init__(self):
        counts = ("threads", "encoder_steps", "steps", "batch", "checkpoint_every")
        check_settings(self, counts, ("drop_text",), ("encoder_lr", "lr"))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DigitsAdapterConfig:
    """Settings of stage 2 of the ``ip-adapter`` recipe (:func:`train_adapter`), the shipped adapter's by default.

    Attributes:
        base: the stage-1 folder to start from; ``None``: the shipped base.
        seed: seeds the projection's initial weights and, with the step number, every batch.
        threads: ``torch.set_num_threads`` during training.
        steps, lr, batch: adapter training steps, peak AdamW learning rate (warm-up, cosine decay), batch size.
        max_refs: image conditions per target are drawn from ``1..max_refs`` (one count per batch): the target itself
            and ``k - 1`` other training images of its class, in random order (1: self-reconstruction only).
        drop_embeds: fraction trained with zero image embeddings (the CFG unconditional branch).
        drop_text: fraction trained with the empty prompt.
        drop_both: fraction trained with both dropped.
        checkpoint_every: steps between checkpoints.
    """

    base: str | None = None
    seed: int = 0
    threads: int = 2
    steps: int = 2000
    lr: float = 5e-3
    batch: int = 64
    max_refs: int = 1
    drop_embeds: float = 0.05
    drop_text: float = 0.05
    drop_both: float = 0.05
    checkpoint_every: int = 100

    recipe = "ip-adapter/adapter"

    def __post_init__(self):
        if self.base is not None and not isinstance(self.base, str | os.PathLike):
            raise TypeError(f"expected base to be a folder path or None (the shipped base), got {self.base!r}")
        if self.base is not None:
            object.__setattr__(self, "base", os.fspath(self.base))
        counts = ("threads", "steps", "batch", "max_refs", "checkpoint_every")
        check_settings(self, counts, ("drop_embeds", "drop_text", "drop_both"), ("lr",), max_refs_of="adapter")

    def to_dict(self) -> dict:
        return asdict(self)


# --- shared components --------------------------------------------------------------------------------------------


def _shipped_vae_and_text() -> tuple[AutoencoderKL, CLIPTextModel]:
    """The support recipe's shipped VAE and (float16-stored, random) text encoder, frozen, in float32."""
    model = DIGITS_WEIGHTS / "model"
    with _quiet_loading():
        vae = AutoencoderKL.from_pretrained(model / "vae", local_files_only=True)
        text_encoder = CLIPTextModel.from_pretrained(model / "text_encoder", local_files_only=True)
    for module in (vae, text_encoder):
        module.float().eval().requires_grad_(False)
        with torch.no_grad():  # out of the memory-mapped file, so that kernels see aligned weights
            for param in module.parameters():
                param.data = param.data.clone()
    return vae, text_encoder


def _shared_digest() -> str:
    """The digest of the shipped VAE and text encoder, which both stages use (recorded and checked on resume)."""
    from safetensors.torch import load_file

    from .checkpoint import tensors_digest

    model = DIGITS_WEIGHTS / "model"
    tensors = {}
    for name, rel in (("vae", "vae/diffusion_pytorch_model.safetensors"), ("text", "text_encoder/model.safetensors")):
        tensors.update({f"{name}/{k}": v for k, v in load_file(str(model / rel)).items()})
    return tensors_digest(tensors)


@torch.no_grad()
def _latents_and_prompts(vae: AutoencoderKL, text_encoder: CLIPTextModel, x: torch.Tensor) -> dict[str, Any]:
    """The training digits' latents (posterior means times the VAE's scaling factor) and the two prompts' states."""
    latents = torch.cat([vae.encode(x[i : i + 256]).latent_dist.mean for i in range(0, TRAIN_SIZE, 256)])
    return {
        "latents": latents * vae.config.scaling_factor,  # (1500, 4, 8, 8)
        "text_cond": prompt_states(text_encoder, DIGITS_PROMPT),  # (1, 77, 32)
        "text_uncond": prompt_states(text_encoder, ""),
        "alphas_cumprod": organism_scheduler().alphas_cumprod,
    }


# --- stage 1: the base --------------------------------------------------------------------------------------------

BASE_STAGES = ("encoder", "unet")
_BASE_TITLES = {"encoder": "image encoder pretraining (CE)", "unet": "base UNet, no image (eps MSE)"}


def train_base(out: Path, config: DigitsBaseConfig, progress: bool = True, stop_after: int | None = None) -> dict:
    """Stage 1 of the ``ip-adapter`` recipe; called through :func:`~.train.train_digits` (which locks ``out``)."""
    parts = _init_base_modules(config.seed)
    unet, image_encoder = parts["unet"], parts["image_encoder"]
    with _seeded(config.seed, "digits/ip-adapter/encoder_head"):
        head = torch.nn.Linear(_VISION_WIDTH, 10)  # the image encoder's pretraining head (not shipped)
    modules = {"unet": unet, "image_encoder": image_encoder, "head": head}
    optimizers = {
        "encoder": torch.optim.AdamW([*image_encoder.parameters(), *head.parameters()], lr=config.encoder_lr),
        "unet": torch.optim.AdamW(unet.parameters(), lr=config.lr, weight_decay=0.0),
    }
    steps = {"encoder": config.encoder_steps, "unet": config.steps}
    shared = _shared_digest()
    identity = {"config": config.to_dict(), "vae_and_text_encoder_sha256": shared}
    checkpoint = TrainingCheckpoint(out, config.recipe, identity, steps)
    state = load_state(checkpoint, modules, optimizers, BASE_STAGES)
    vae, text_encoder = _shipped_vae_and_text()
    data: dict[str, Any] = training_digits()
    data.update(_latents_and_prompts(vae, text_encoder, data["x"]))

    def unet_step(gen: torch.Generator) -> torch.Tensor:
        target = torch.randint(0, TRAIN_SIZE, (config.batch,), generator=gen)
        xt, t, noise = noisy(data["latents"], data["alphas_cumprod"], target, gen)
        drop_text = torch.rand(config.batch, generator=gen) < config.drop_text
        text = torch.where(drop_text.view(-1, 1, 1), data["text_uncond"], data["text_cond"])  # (B, 77, 32)
        return F.mse_loss(unet(xt, t, encoder_hidden_states=text).sample, noise)

    step_fns = {
        "encoder": lambda gen: encoder_loss(image_encoder, head, data, 2 * config.batch, gen),
        "unet": unet_step,
    }
    params = {"encoder": [*image_encoder.parameters(), *head.parameters()], "unet": list(unet.parameters())}
    budget = [stop_after if stop_after is not None else float("inf")]
    for stage in BASE_STAGES[BASE_STAGES.index(state["stage"]) :]:
        if state["stage"] != stage:
            state["stage"], state["step"] = stage, 0
        for module in (image_encoder, head) if stage == "encoder" else (unet,):
            module.train()
        finished = run_stage(
            stage, steps[stage], step_fns[stage], optimizers[stage], params[stage], state, config.seed,
            config.checkpoint_every, progress, budget, lambda: checkpoint.save(state, modules, optimizers),
            lr=config.lr if stage == "unet" else None,
        )  # fmt: skip
        if not finished:
            return {"finished": False, **state}
    fields = run_fields(state, config.threads)
    record = {
        "finished": True,
        "recipe": config.recipe,
        "config": config.to_dict(),
        "wall_s": fields.pop("wall_s"),
        "final_losses": fields.pop("final_losses"),
        "encoder_pretraining_train_accuracy": encoder_accuracy(image_encoder, head, data["pixel_values"], data["y"]),
        **fields,
        "vae_and_text_encoder_sha256": shared,
        "train_digits": f"indices [0, {TRAIN_SIZE}) of sklearn.datasets.load_digits",
        "unet": "SD 1.5's blocks at layers_per_block=2 (16 cross-attention layers), 8 heads, no image condition; "
        "stored in float16 (stage 2 and the pipeline load these values)",
        "image_encoder": "pretrained as a digit classifier on the training digits (a linear head on image_embeds, "
        "not shipped; the stand-in for CLIP's pretraining); frozen from here on",
        "vae, text_encoder, tokenizer": "the support recipe's shipped ones (ipa_probe/tiny/digits_weights/model)",
    }
    with _quiet_loading():
        unet.eval().half().save_pretrained(out / "unet", safe_serialization=True)
        image_encoder.eval().save_pretrained(out / "image_encoder", safe_serialization=True)
    unet.float()
    plot_losses(out / "loss.png", state["losses"], _BASE_TITLES)
    write_json(out / "record.json", record)
    return record


# --- stage 2: the adapter -----------------------------------------------------------------------------------------


def train_adapter(
    out: Path, config: DigitsAdapterConfig, progress: bool = True, stop_after: int | None = None
) -> dict:
    """Stage 2 of the ``ip-adapter`` recipe; called through :func:`~.train.train_digits` (which locks ``out``)."""
    base = resolve_base(config.base)
    unet, image_encoder = load_base(base)  # frozen, eval
    digest = base_digest(base)
    adapter = _init_adapter(unet, config.seed)
    image_proj, ip_processors = adapter["image_proj"], adapter["ip_processors"]
    ip_layers = torch.nn.ModuleList(ip_processors)  # each holds to_k_ip / to_v_ip (Linear, no bias)
    trainable = [*image_proj.parameters(), *ip_layers.parameters()]
    for param in trainable:
        param.requires_grad_(True)
    modules = {"image_proj": image_proj, "ip_layers": ip_layers}
    optimizers = {"adapter": torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)}
    identity = {"config": config.to_dict(), "base_sha256": digest, "vae_and_text_encoder_sha256": _shared_digest()}
    checkpoint = TrainingCheckpoint(out, config.recipe, identity, {"adapter": config.steps})
    state = load_state(checkpoint, modules, optimizers, ("adapter",))
    vae, text_encoder = _shipped_vae_and_text()
    data: dict[str, Any] = training_digits()
    data.update(_latents_and_prompts(vae, text_encoder, data["x"]))
    with torch.no_grad():  # the frozen encoder's embeddings of every training digit, computed once
        data["embeds"] = image_encoder(data["pixel_values"]).image_embeds  # (1500, 32)
    data["by_class"] = [torch.nonzero(data["y"] == c).flatten() for c in range(10)]
    image_proj.train()
    finished = run_stage(
        "adapter", config.steps, lambda gen: _adapter_loss(config, gen, data, unet, image_proj),
        optimizers["adapter"], trainable, state, config.seed, config.checkpoint_every, progress,
        [stop_after if stop_after is not None else float("inf")],
        lambda: checkpoint.save(state, modules, optimizers), lr=config.lr,
    )  # fmt: skip
    if not finished:
        return {"finished": False, **state}
    image_proj.eval()
    fields = run_fields(state, config.threads)
    record = {
        "finished": True,
        "recipe": config.recipe,
        "config": config.to_dict(),
        "base_path": str(base.resolve()) if config.base is not None else "shipped",
        "base_sha256": digest,
        "wall_s": fields.pop("wall_s"),
        "final_losses": fields.pop("final_losses"),
        **fields,
        "vae_and_text_encoder_sha256": identity["vae_and_text_encoder_sha256"],
        "trained": f"ImageProjection and to_k_ip / to_v_ip of {len(ip_processors)} cross-attention layers "
        f"({sum(p.numel() for p in trainable)} parameters), to_k_ip / to_v_ip initialised from to_k / to_v",
        "frozen": "base UNet, image encoder (the base's), VAE and text encoder (the support recipe's)",
        "target": "each training image from its own image embedding"
        + (f" plus 0-{config.max_refs - 1} others of its class" if config.max_refs > 1 else ""),
    }
    state_dict = _adapter_state_dict(unet, ip_processors, image_proj)
    save_adapter(out, state_dict, "digits ip-adapter recipe")
    plot_losses(out / "loss.png", state["losses"], {"adapter": "adapter only, base frozen (eps MSE)"})
    write_json(out / "record.json", record)
    return record


def _adapter_loss(
    config: DigitsAdapterConfig,
    gen: torch.Generator,
    data: dict[str, Any],
    unet: torch.nn.Module,
    image_proj: torch.nn.Module,
) -> torch.Tensor:
    b = config.batch
    k = int(torch.randint(1, config.max_refs + 1, (), generator=gen))
    target = torch.randint(0, TRAIN_SIZE, (b,), generator=gen)
    refs = target[:, None].repeat(1, k)  # (B, k): the target itself, then k - 1 others of its class
    if k > 1:
        for i, t in enumerate(target.tolist()):
            pool = data["by_class"][int(data["y"][t])]
            pool = pool[pool != t]
            refs[i, 1:] = pool[torch.randperm(len(pool), generator=gen)[: k - 1]]
            refs[i] = refs[i, torch.randperm(k, generator=gen)]  # the target at a random place
    xt, t, noise = noisy(data["latents"], data["alphas_cumprod"], target, gen)
    embeds = data["embeds"][refs.flatten()].view(b, k, -1)  # (B, k, 32)
    u = torch.rand(b, generator=gen)
    edges = torch.tensor([config.drop_embeds, config.drop_text, config.drop_both]).cumsum(0)
    drop_image = (u < edges[0]) | ((u >= edges[1]) & (u < edges[2]))
    drop_text = (u >= edges[0]) & (u < edges[2])
    embeds = torch.where(drop_image.view(b, 1, 1), torch.zeros_like(embeds), embeds)  # as CFG's negative branch
    tokens = image_proj(embeds.reshape(b * k, -1)).view(b, k * NUM_IP_TOKENS, -1)  # (B, 4k, 32)
    text = torch.where(drop_text.view(b, 1, 1), data["text_uncond"], data["text_cond"])  # (B, 77, 32)
    # Without encoder_hid_proj the UNet passes the (text, [image tokens]) pair straight to the IP processors.
    pred = unet(xt, t, encoder_hidden_states=(text, [tokens])).sample
    return F.mse_loss(pred, noise)
