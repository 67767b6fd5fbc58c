"""``train_digits`` (``ipa-probe train-digits``): the seeded, resumable training of the organism, every recipe.

The ``support`` recipe lives here (three stages: the VAE, the image encoder's pretraining, then UNet + adapter +
image encoder together), and ``mixed``, the same with part of each UNet batch on mixed reference sets
(``DigitsTrainConfig.mixed``); the ``ip-adapter`` recipe's two commands in :mod:`.train_ip`. Part of
:mod:`ipa_probe.tiny.digits` (see its docstring).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, StableDiffusionPipeline

from ..._io import write_json
from ..sd import _seeded
from ..tokenizer import clip_tokenizer
from .checkpoint import TrainingCheckpoint
from .data import _VISION_WIDTH, DIGITS_PROMPT, NUM_IP_TOKENS, TRAIN_SIZE
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
    training_folder,
)
from .model import (
    _adapter_state_dict,
    _feature_extractor,
    _init_modules,
    _quiet_loading,
    _restore_default_processors,
    organism_scheduler,
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
        mixed: fraction of each UNet batch trained on a mixed reference set (recipe ``mixed``; 0, the default, is
            recipe ``support`` with exactly its batches): each reference's digit drawn uniformly and independently,
            the target an image of one reference's digit, that reference chosen uniformly (so the target's digit
            is ``c`` with probability ``(count of c in the set) / k``), not itself among the references.
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
    mixed: float = 0.0

    def __post_init__(self):
        counts = ("threads", "vae_steps", "encoder_steps", "steps", "batch", "max_refs", "checkpoint_every")
        check_settings(self, counts, ("drop_embeds", "drop_tokens"), ("vae_lr", "encoder_lr", "lr", "vae_kl"))
        check_settings(self, (), ("drop_text",))
        check_settings(self, (), ("mixed",), max_refs_of="support")

    @property
    def recipe(self) -> str:
        """``"mixed"`` when part of each batch is on mixed reference sets, else ``"support"``."""
        return "mixed" if self.mixed > 0 else "support"

    def to_dict(self) -> dict:
        # ``mixed`` only where it is set: a ``support`` run's record and checkpoint identity stay what they were
        # before the field existed (its checkpoints still resume, its record still compares equal)
        settings = asdict(self)
        if not self.mixed:
            del settings["mixed"]
        return settings


def _vae_loss(vae: AutoencoderKL, x: torch.Tensor, generator: torch.Generator, kl_weight: float) -> torch.Tensor:
    posterior = vae.encode(x).latent_dist
    z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    recon = vae.decode(z).sample
    kl = 0.5 * (posterior.mean**2 + posterior.var - 1.0 - posterior.logvar)
    return F.mse_loss(recon, x) + kl_weight * kl.mean()


def train_digits(
    out: str | os.PathLike,
    config: Any = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Train the digits organism from scratch (or resume ``out``'s checkpoint) and save it in ``out``; returns the
    record (also written to ``record.json``; ``{"finished": False, ...}`` if stopped early).

    The recipe follows the type of ``config``:

    - :class:`DigitsTrainConfig` (the default), recipe ``support``: the VAE, then the image encoder's pretraining as
      a digit classifier, then the UNet, the IP-Adapter and the image encoder together, on support sets of 1-4
      other images of the target's class; with ``mixed > 0``, recipe ``mixed``: that fraction of each UNet batch
      on mixed reference sets instead.
    - :class:`~.train_ip.DigitsBaseConfig`, recipe ``ip-adapter`` stage 1: the image-free base UNet (and the image
      encoder's pretraining), on the shipped VAE's latents.
    - :class:`~.train_ip.DigitsAdapterConfig`, recipe ``ip-adapter`` stage 2: only ``ImageProjection`` and
      ``to_k_ip`` / ``to_v_ip`` on the frozen base, each image reconstructed from its own embedding.

    Every batch is drawn from a generator seeded by ``(seed, stage, step)``, so a run interrupted and resumed ends
    with the same weights as one that was not (at the same thread count). ``out`` is locked for the run (a second
    training on it stops at once); the checkpoint is one file written atomically and checked before it is used.

    Args:
        out: output folder. Written (support): ``model/`` (``save_pretrained``, without adapter), ``ip_adapter/``
            (the adapter in the published layout, for ``load_ip_adapter``), ``record.json``, ``loss.png``, and the
            checkpoint ``checkpoint.safetensors`` (kept, so that a finished run is not retrained). The other
            recipes' outputs: :func:`~.train_ip.train_base`, :func:`~.train_ip.train_adapter`.
        config: the settings (defaults: the shipped weights'); ``progress``: show tqdm progress bars.
        stop_after: stop (with a checkpoint) once this many steps, over all stages, are done in this call; for
            testing resumption.

    Raises:
        CheckpointError: ``out`` holds a checkpoint that cannot be used (the message names it and the remedy).
        OutputLocked: another training holds ``out``.
    """
    from .train_ip import DigitsAdapterConfig, DigitsBaseConfig, train_adapter, train_base

    config = DigitsTrainConfig() if config is None else config
    recipes = {DigitsTrainConfig: _train, DigitsBaseConfig: train_base, DigitsAdapterConfig: train_adapter}
    if type(config) not in recipes:
        raise TypeError(
            f"expected config to be a DigitsTrainConfig, DigitsBaseConfig or DigitsAdapterConfig, got {config!r}"
        )
    with training_folder(out, config.threads) as folder:
        return recipes[type(config)](folder, config, progress, stop_after)


STAGES = ("vae", "encoder", "unet")
"""Training stages of the ``support`` recipe in order: the VAE, the image encoder's pretraining, UNet + adapter."""


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
    steps = {"vae": config.vae_steps, "encoder": config.encoder_steps, "unet": config.steps}
    checkpoint = TrainingCheckpoint(out, config.recipe, {"config": config.to_dict()}, steps)
    state = load_state(checkpoint, modules, optimizers, STAGES)
    data: dict[str, Any] = training_digits()
    train_x, train_y, pixel_values = data["x"], data["y"], data["pixel_values"]

    def vae_step(gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(0, TRAIN_SIZE, (config.batch,), generator=gen)
        return _vae_loss(vae, train_x[idx], gen, config.vae_kl)

    step_fns = {
        "vae": vae_step,
        "encoder": lambda gen: encoder_loss(image_encoder, head, data, 2 * config.batch, gen),
        "unet": lambda gen: _unet_loss(config, gen, data, parts),
    }
    params = {"vae": list(vae.parameters()), "encoder": [*image_encoder.parameters(), *head.parameters()]}
    params["unet"] = trainable
    budget = [stop_after if stop_after is not None else float("inf")]
    for stage in STAGES[STAGES.index(state["stage"]) :]:
        if stage == "unet":
            vae.eval().requires_grad_(False)
            data.update(_unet_data(vae, train_x, train_y, parts["text_encoder"]))
        if state["stage"] != stage:
            state["stage"], state["step"] = stage, 0
        for module in (vae, image_encoder, head) if stage != "unet" else (unet, image_encoder, image_proj):
            module.train()
        finished = run_stage(
            stage, steps[stage], step_fns[stage], optimizers[stage], params[stage], state, config.seed,
            config.checkpoint_every, progress, budget, lambda: checkpoint.save(state, modules, optimizers),
            lr=config.lr if stage == "unet" else None,
        )  # fmt: skip
        if not finished:
            return {"finished": False, **state}
        if stage == "encoder":  # the head's accuracy right after pretraining (recomputed identically on a resume)
            state["encoder_pretraining_train_accuracy"] = encoder_accuracy(image_encoder, head, pixel_values, train_y)
    if "scaling_factor" not in data:
        data.update(_unet_data(vae.eval(), train_x, train_y, parts["text_encoder"]))
    scaling_factor = data["scaling_factor"]
    fields = run_fields(state, config.threads)
    record = {
        "finished": True,
        "recipe": config.recipe,
        "config": config.to_dict(),
        "scaling_factor": scaling_factor,
        "wall_s": fields.pop("wall_s"),
        "final_losses": fields.pop("final_losses"),
        # the pretraining head on the training digits: right after pretraining, and (stale head) after joint training
        "encoder_pretraining_train_accuracy": state.get("encoder_pretraining_train_accuracy"),
        "encoder_head_train_accuracy_after_joint_training": encoder_accuracy(
            image_encoder, head, pixel_values, train_y
        ),
        **fields,
        "train_digits": f"indices [0, {TRAIN_SIZE}) of sklearn.datasets.load_digits",
        "image_encoder": "pretrained as a digit classifier on the training digits (a linear head on image_embeds, "
        "not shipped; the stand-in for CLIP's pretraining), then trained jointly with the UNet and adapter",
        "text_encoder": "random, frozen, stored in float16",
    }
    for module in (unet, image_encoder, image_proj):
        module.eval()
    _save_outputs(out, parts, scaling_factor)
    plot_losses(out / "loss.png", state["losses"], _TITLES)
    write_json(out / "record.json", record)
    return record


_TITLES = {"vae": "VAE (MSE + KL)", "encoder": "image encoder pretraining (CE)", "unet": "UNet + IP-Adapter (eps MSE)"}


@torch.no_grad()
def _unet_data(vae, train_x, train_y, text_encoder) -> dict[str, Any]:
    """Latents (posterior means scaled to unit spread), class index lists and the two prompts' states."""
    latents = torch.cat([vae.encode(train_x[i : i + 256]).latent_dist.mean for i in range(0, TRAIN_SIZE, 256)])
    scaling_factor = float(1.0 / latents.std())
    return {
        "latents": latents * scaling_factor,  # (1500, 4, 8, 8)
        "scaling_factor": scaling_factor,
        "by_class": [torch.nonzero(train_y == c).flatten() for c in range(10)],
        "text_cond": prompt_states(text_encoder, DIGITS_PROMPT),
        "text_uncond": prompt_states(text_encoder, ""),
        "alphas_cumprod": organism_scheduler().alphas_cumprod,
    }


def _unet_loss(config: DigitsTrainConfig, gen: torch.Generator, data: dict[str, Any], parts: dict[str, Any]):
    unet, image_encoder, image_proj = parts["unet"], parts["image_encoder"], parts["image_proj"]
    latents, labels, by_class = data["latents"], data["y"], data["by_class"]
    pixel_values, alphas_cumprod = data["pixel_values"], data["alphas_cumprod"]
    text_cond, text_uncond = data["text_cond"], data["text_uncond"]
    b = config.batch
    refs, target = _references(config, gen, labels, by_class, len(latents))  # (B, k), (B,)
    k = refs.shape[1]
    xt, t, noise = noisy(latents, alphas_cumprod, target, gen)
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


def _references(
    config: DigitsTrainConfig, gen: torch.Generator, labels: torch.Tensor, by_class: list[torch.Tensor], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's reference sets and targets: ``(refs, target)``, (B, k) and (B,) indices into the training digits.

    ``k`` is drawn from ``1..max_refs`` (one count per batch), then B targets uniformly. With ``mixed == 0`` every
    item's k references are other images of its target's class (the draws are those of ``support`` before
    ``mixed`` existed). Otherwise a fraction ``mixed`` of the items (each with that probability) gets a mixed set:
    k digits drawn uniformly and independently, one of the k slots chosen uniformly gives the target's digit, and
    the images are distinct images of their digits, the target not among them.
    """
    b = config.batch
    k = int(torch.randint(1, config.max_refs + 1, (), generator=gen))
    target = torch.randint(0, n, (b,), generator=gen)
    if config.mixed > 0:  # drawn only then: the default batches stay bit-identical
        is_mixed = (torch.rand(b, generator=gen) < config.mixed).tolist()
        classes = torch.randint(0, 10, (b, k), generator=gen)  # (B, k) each reference's digit
        chosen = torch.randint(0, k, (b,), generator=gen)  # the slot whose digit the target takes
    else:
        is_mixed = [False] * b
    refs = torch.empty(b, k, dtype=torch.long)
    for i, t in enumerate(target.tolist()):
        if not is_mixed[i]:  # k references of the target's class, other than the target
            pool = by_class[int(labels[t])]
            pool = pool[pool != t]
            refs[i] = pool[torch.randperm(len(pool), generator=gen)[:k]]
            continue
        target_class = int(classes[i, chosen[i]])
        for c in torch.unique(classes[i]).tolist():  # sorted: a fixed order of draws
            slots = classes[i] == c
            extra = int(c == target_class)  # one more image of the target's digit: the target
            pool = by_class[c]
            picked = pool[torch.randperm(len(pool), generator=gen)[: int(slots.sum()) + extra]]
            refs[i, slots] = picked[: int(slots.sum())]
            if extra:
                target[i] = picked[-1]
    return refs, target


def _save_outputs(out: Path, parts: dict[str, Any], scaling_factor: float) -> None:

    unet = parts["unet"]
    state = _adapter_state_dict(unet, parts["ip_processors"], parts["image_proj"])
    _restore_default_processors(unet)
    parts["vae"].register_to_config(scaling_factor=scaling_factor)
    pipe = StableDiffusionPipeline(
        vae=parts["vae"].eval(),
        text_encoder=parts["text_encoder"].half(),
        tokenizer=clip_tokenizer(),
        unet=unet.eval(),
        scheduler=organism_scheduler(),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=parts["image_encoder"].eval(),
        requires_safety_checker=False,
    )
    with _quiet_loading():  # no "Writing model shards" bars
        pipe.save_pretrained(out / "model", safe_serialization=True)
    parts["text_encoder"].float()
    save_adapter(out, state, "digits")
