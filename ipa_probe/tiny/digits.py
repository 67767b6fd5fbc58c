"""A trained model organism: a small Stable Diffusion 1.5-architecture pipeline with an IP-Adapter, trained on digits.

The data are scikit-learn's handwritten digits (1,797 grey 8 x 8 images, 10 classes, shipped with the package),
rendered as 16 x 16 RGB images (bilinear upsampling, :func:`digit_images`). Every component is a diffusers or
transformers class, so a real pipeline's code paths all run:

- ``vae``: ``AutoencoderKL`` with two levels (16 x 16 x 3 images <-> 8 x 8 x 4 latents), trained first
  (reconstruction + a small KL term), then frozen; its ``scaling_factor`` gives the training latents unit spread.
- ``text_encoder``: a two-layer ``CLIPTextModel`` with the project's offline CLIP tokenizer, random and frozen (the
  prompt is always ``"a handwritten digit"``, or ``""`` for classifier-free guidance), stored in float16.
- ``image_encoder``: a two-layer ``CLIPVisionModelWithProjection`` on 16 x 16 inputs in 4 x 4 patches, trained
  jointly with the adapter (a random one would throw away what a digit looks like).
- ``unet``: ``UNet2DConditionModel`` with SD 1.5's block structure scaled down (three cross-attention down blocks
  and a plain one, the mirror image going up, a cross-attention mid block, a fixed number of heads per layer).
- the IP-Adapter: ``ImageProjection`` (4 tokens per reference image) and ``to_k_ip`` / ``to_v_ip`` in every
  cross-attention layer, saved in the published checkpoints' layout and loaded by ``pipe.load_ip_adapter``.

Training task (support-conditioned generation, as in the paper): the adapter sees 1-4 reference images of one class
(their tokens concatenated, as diffusers does for a list of images per adapter) and the target is another image of
that class, with the DDPM epsilon loss on SD 1.5's noise schedule. The image condition is dropped part of the time
in the two ways the pipeline drops it: zero image embeddings (what ``pipe(..., guidance_scale > 1)`` uses as the
unconditional branch) and zero image tokens (exactly ``set_ip_adapter_scale(0)``, since ``to_k_ip``/``to_v_ip`` have
no bias); the prompt is replaced by ``""`` part of the time. The organism trains on the first
:data:`TRAIN_SIZE` digits; the rest are the held-out pool that :func:`digits_reference_images` draws from and on
which the evaluation classifier's accuracy is stated.

:func:`train_digits` (``ipa-probe train-digits``) is seeded and resumable; the weights shipped in
``ipa_probe/tiny/digits_weights/`` are its output, with their ``record.json`` and loss curve.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from diffusers.models.embeddings import ImageProjection
from tqdm.auto import tqdm
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from .sd import _seeded, realign_weights
from .tokenizer import CLIP_MODEL_MAX_LENGTH, CLIP_VOCAB_SIZE, clip_tokenizer

__all__ = [
    "DIGITS_PROMPT",
    "add_digit_scores",
    "DIGITS_WEIGHTS",
    "DigitsTrainConfig",
    "classify_digit_images",
    "digit_classifier",
    "digit_images",
    "digits_pipeline",
    "digits_reference_images",
    "evaluate_digits",
    "train_digits",
    "untrained_digits_pipeline",
]

DIGITS_PROMPT = "a handwritten digit"
IMAGE_SIZE = 16
LATENT_SIZE = 8
TRAIN_SIZE = 1500
"""Digits ``[0, TRAIN_SIZE)`` train the organism and the classifier; ``[TRAIN_SIZE, 1797)`` are held out."""
NUM_IP_TOKENS = 4
WEIGHT_NAME = "ip-adapter.safetensors"
DIGITS_WEIGHTS = Path(__file__).parent / "digits_weights"
"""The shipped output of ``ipa-probe train-digits``: ``model/``, ``ip_adapter/``, ``record.json``, ``loss.png``."""

_TEXT_WIDTH = 32
_VISION_WIDTH = 32
_CHECKPOINT = "checkpoint"


# --- data ---------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)  # (1797, 8, 8) in [0, 16], (1797,)


@lru_cache(maxsize=1)
def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as the organism sees them: 16 x 16 uint8 grey images, and their labels.

    Rendering: the 8 x 8 values in [0, 16] are upsampled bilinearly (``F.interpolate``, ``align_corners=False``) to
    16 x 16, scaled by 255 / 16 and rounded to uint8. Ink is bright on a black ground, as in the data.

    Returns:
        ``(images, labels)``: uint8 array ``(1797, 16, 16)`` and int64 array ``(1797,)``.
    """
    images, labels = _digits()
    up = F.interpolate(torch.from_numpy(images)[:, None], size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
    grey = torch.round(up[:, 0] * (255.0 / 16.0)).clamp(0, 255).to(torch.uint8)  # (N, 16, 16)
    return grey.numpy(), labels


def _to_pil(grey: np.ndarray) -> PIL.Image.Image:
    return PIL.Image.fromarray(grey, mode="L").convert("RGB")


def digits_reference_images(digit: int, n: int, seed: int = 0) -> list[PIL.Image.Image]:
    """``n`` different held-out images of ``digit``, rendered exactly as in training (16 x 16 RGB).

    They come from the digits the organism never trained on (indices ``>= TRAIN_SIZE``, about 30 per class), drawn
    without replacement by a generator seeded with ``seed``.

    Args:
        digit: 0-9.
        n: how many (1 to the number of held-out images of that digit).
        seed: the draw's seed.

    Returns:
        ``n`` RGB ``PIL.Image.Image`` of size 16 x 16.
    """
    if isinstance(digit, bool) or not isinstance(digit, int | np.integer) or not 0 <= digit <= 9:
        raise ValueError(f"expected digit to be an int in 0..9, got {digit!r}")
    images, labels = digit_images()
    pool = np.flatnonzero(labels[TRAIN_SIZE:] == digit) + TRAIN_SIZE
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(pool):
        raise ValueError(f"expected n to be an int in 1..{len(pool)} (held-out images of {digit}), got {n!r}")
    rng = np.random.default_rng(seed)
    return [_to_pil(images[i]) for i in rng.choice(pool, size=n, replace=False)]


# --- components ---------------------------------------------------------------------------------------------------


def _vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        norm_num_groups=16,
        latent_channels=4,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,  # set from the training latents' spread after the VAE is trained
        force_upcast=False,
    )


def _unet() -> UNet2DConditionModel:
    # SD 1.5's layout: CrossAttnDown x 3 + Down, mid with cross-attention, Up + CrossAttnUp x 3, a fixed number of
    # heads (diffusers' legacy ``attention_head_dim`` means heads for SD 1.5): 4 heads of width 8 or 16.
    return UNet2DConditionModel(
        sample_size=LATENT_SIZE,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=_TEXT_WIDTH,
        attention_head_dim=4,
        norm_num_groups=32,
    )


def _text_encoder() -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=_TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MODEL_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    )
    model = CLIPTextModel(config)
    # Shipped in float16 (the 49k-token embedding is most of its size): train with exactly the shipped values.
    return model.half().float()


def _image_encoder() -> CLIPVisionModelWithProjection:
    config = CLIPVisionConfig(
        hidden_size=_VISION_WIDTH,
        projection_dim=_VISION_WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=4,
        hidden_act="quick_gelu",
    )
    return CLIPVisionModelWithProjection(config)


def _feature_extractor() -> CLIPImageProcessor:
    return CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def _scheduler() -> DDIMScheduler:
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _install_ip_processors(unet: UNet2DConditionModel) -> list[IPAdapterAttnProcessor2_0]:
    """Give every cross-attention layer a fresh ``IPAdapterAttnProcessor2_0`` (self-attention keeps the default)."""
    processors: dict[str, Any] = {}
    ip = []
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            attn = unet.get_submodule(name.removesuffix(".processor"))
            proc = IPAdapterAttnProcessor2_0(
                hidden_size=attn.to_k.out_features,
                cross_attention_dim=_TEXT_WIDTH,
                num_tokens=(NUM_IP_TOKENS,),
                scale=1.0,
            )
            processors[name] = proc
            ip.append(proc)
        else:
            processors[name] = AttnProcessor2_0()
    unet.set_attn_processor(processors)
    return ip


def untrained_digits_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """The organism's architecture with its initial (untrained) weights: the control of the experiments.

    The VAE and image encoder are untrained too; the scaling factor is the trained run's. Built the way
    :func:`train_digits` initialises them, then loaded through ``load_ip_adapter`` like the trained one.
    """
    parts = _init_modules(seed)
    pipe = StableDiffusionPipeline(
        vae=parts["vae"],
        text_encoder=parts["text_encoder"],
        tokenizer=clip_tokenizer(),
        unet=parts["unet"],
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=parts["image_encoder"],
        requires_safety_checker=False,
    )
    record = json.loads((DIGITS_WEIGHTS / "record.json").read_text())
    pipe.vae.register_to_config(scaling_factor=record["scaling_factor"])
    state = _adapter_state_dict(parts["unet"], parts["ip_processors"], parts["image_proj"])
    _restore_default_processors(pipe.unet)
    with _seeded(seed, "digits/load_ip_adapter"):
        pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None)
    return pipe


def _init_modules(seed: int) -> dict[str, Any]:
    with _seeded(seed, "digits/vae"):
        vae = _vae()
    with _seeded(seed, "digits/text_encoder"):
        text_encoder = _text_encoder()
    with _seeded(seed, "digits/image_encoder"):
        image_encoder = _image_encoder()
    with _seeded(seed, "digits/unet"):
        unet = _unet()
    with _seeded(seed, "digits/ip_adapter"):
        image_proj = ImageProjection(
            image_embed_dim=_VISION_WIDTH, cross_attention_dim=_TEXT_WIDTH, num_image_text_embeds=NUM_IP_TOKENS
        )
        ip_processors = _install_ip_processors(unet)
    return dict(
        vae=vae,
        text_encoder=text_encoder.eval().requires_grad_(False),
        image_encoder=image_encoder,
        unet=unet,
        image_proj=image_proj,
        ip_processors=ip_processors,
    )


def _adapter_state_dict(
    unet: UNet2DConditionModel, ip_processors: Sequence[IPAdapterAttnProcessor2_0], image_proj: ImageProjection
) -> dict[str, dict[str, torch.Tensor]]:
    """The adapter in the published checkpoints' layout: ``image_proj.{proj,norm}.*`` and, for the ``n``-th
    cross-attention layer in ``unet.attn_processors`` order, ``ip_adapter.{2n+1}.to_{k,v}_ip.weight``."""
    sd = image_proj.state_dict()
    proj = {
        "proj.weight": sd["image_embeds.weight"],
        "proj.bias": sd["image_embeds.bias"],
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
    }
    layers = {}
    for n, proc in enumerate(ip_processors):
        layers[f"{2 * n + 1}.to_k_ip.weight"] = proc.to_k_ip[0].weight
        layers[f"{2 * n + 1}.to_v_ip.weight"] = proc.to_v_ip[0].weight
    clean = lambda d: {k: v.detach().clone().contiguous() for k, v in d.items()}
    return {"image_proj": clean(proj), "ip_adapter": clean(layers)}


def _restore_default_processors(unet: UNet2DConditionModel) -> None:
    unet.set_attn_processor({name: AttnProcessor2_0() for name in unet.attn_processors})


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


def _versions() -> dict[str, str]:
    import diffusers
    import sklearn
    import transformers

    from .. import __version__

    return {
        "ipa_probe": __version__,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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
        _write_json(self.meta, {**meta, "config": self.config.to_dict()})


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
    if "scaling_factor" not in data:
        data.update(_unet_data(vae.eval(), train_x, train_y, parts["text_encoder"]))
    scaling_factor = data["scaling_factor"]
    record = {
        "finished": True,
        "config": config.to_dict(),
        "scaling_factor": scaling_factor,
        "wall_s": {**meta["wall_s"], "total": sum(meta["wall_s"].values())},
        "final_losses": {s: float(np.mean(meta["losses"][s][-100:])) for s in STAGES if meta["losses"][s]},
        "encoder_pretraining_accuracy_last100": _encoder_accuracy(image_encoder, head, pixel_values, train_y),
        "threads": config.threads,
        "load_average_at_start": meta.get("load_average_at_start"),
        "load_average_at_end": list(os.getloadavg()),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "resumed": meta["resumed"],
        "versions": _versions(),
        "train_digits": f"indices [0, {TRAIN_SIZE}) of sklearn.datasets.load_digits",
        "image_encoder": "pretrained as a digit classifier on the training digits (a linear head on image_embeds, "
        "not shipped; the stand-in for CLIP's pretraining), then trained jointly with the UNet and adapter",
        "text_encoder": "random, frozen, stored in float16",
    }
    for module in (unet, image_encoder, image_proj):
        module.eval()
    _save_outputs(out, parts, scaling_factor)
    _plot_losses(out / "loss.png", meta["losses"])
    _write_json(out / "record.json", record)
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


# --- loading ------------------------------------------------------------------------------------------------------


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """No loading progress bars from diffusers and transformers (local files load in a blink); restored on exit."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    states = [(lib, lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)]
    for lib, _ in states:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, enabled in states:
            if enabled:
                lib.enable_progress_bar()


def digits_pipeline(path: str | os.PathLike | None = None) -> StableDiffusionPipeline:
    """The trained digits organism: a ``StableDiffusionPipeline`` on CPU in float32, progress bar on.

    Loaded through diffusers' ``from_pretrained`` (``<path>/model``) and ``load_ip_adapter``
    (``<path>/ip_adapter/ip-adapter.safetensors``), offline.

    Args:
        path: a folder written by ``ipa-probe train-digits``; ``None`` loads the weights shipped with the package.

    Returns:
        the pipeline; call it with ``ip_adapter_image=[digits_reference_images(d, n)]`` (one support set).

    Example:
        ```py
        >>> pipe = digits_pipeline()
        >>> refs = digits_reference_images(3, 2)
        >>> image = pipe("a handwritten digit", ip_adapter_image=[refs], num_inference_steps=20).images[0]
        ```
    """
    root = Path(path) if path is not None else DIGITS_WEIGHTS
    if not (root / "model" / "model_index.json").exists():
        raise FileNotFoundError(
            f"expected a digits organism in {root} (model/model_index.json); "
            "train one with `ipa-probe train-digits --out DIR` or pass path=None for the shipped weights"
        )
    with _quiet_loading():
        pipe = StableDiffusionPipeline.from_pretrained(root / "model", local_files_only=True)
        pipe.load_ip_adapter(
            str(root / "ip_adapter"),
            subfolder="",
            weight_name=WEIGHT_NAME,
            image_encoder_folder=None,
            local_files_only=True,
        )
    pipe.text_encoder.float()  # stored in float16 (the rest in float32); it ran in float32 during training
    pipe.set_progress_bar_config(disable=False)
    return realign_weights(pipe)


# --- evaluation ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def digit_classifier() -> tuple[Any, float]:
    """A logistic-regression classifier of 8 x 8 digits, fitted on the training digits.

    Returns:
        ``(classifier, held_out_accuracy)``: the fitted scikit-learn model (input: 64 values in [0, 16]) and its
        accuracy on the held-out digits (indices ``>= TRAIN_SIZE``).
    """
    from sklearn.linear_model import LogisticRegression

    images, labels = _digits()
    x = images.reshape(len(images), 64)
    clf = LogisticRegression(max_iter=2000, C=1.0)
    clf.fit(x[:TRAIN_SIZE], labels[:TRAIN_SIZE])
    accuracy = float((clf.predict(x[TRAIN_SIZE:]) == labels[TRAIN_SIZE:]).mean())
    return clf, accuracy


def classify_digit_images(images: Sequence[PIL.Image.Image] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Classify generated images with :func:`digit_classifier`.

    Each image is turned grey (mean of RGB), area-downsampled to 8 x 8 and scaled to [0, 16].

    Args:
        images: PIL images, or an array ``(N, H, W, 3)`` in [0, 1] (``output_type="np"``), H and W multiples of 8.

    Returns:
        ``(labels, probabilities)``: int array ``(N,)`` and float array ``(N, 10)``.
    """
    if isinstance(images, np.ndarray):
        arr = images.astype(np.float64)
    else:
        arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float64) / 255.0 for im in images])
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.shape[1] % 8 or arr.shape[2] % 8:
        raise ValueError(f"expected images of shape (N, H, W, 3) with H, W multiples of 8, got {arr.shape}")
    n, h, w, _ = arr.shape
    grey = arr.mean(-1).reshape(n, 8, h // 8, 8, w // 8).mean(axis=(2, 4)) * 16.0  # (N, 8, 8)
    clf, _ = digit_classifier()
    probs = clf.predict_proba(grey.reshape(n, 64))
    return clf.classes_[probs.argmax(1)], probs


def evaluate_digits(
    pipe: StableDiffusionPipeline,
    samples_per_digit: int = 10,
    n_refs: int = 3,
    ref_sets: int = 1,
    num_inference_steps: int = 20,
    guidance_scale: float = 1.0,
    ip_adapter_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """How often the organism draws the digit of its references, judged by :func:`digit_classifier`.

    For each digit and each of ``ref_sets`` reference sets (``digits_reference_images(d, n_refs, seed=seed + s)``),
    ``samples_per_digit`` images are generated from seeded latents.

    Returns:
        ``{"rate", "confidence", "per_digit", "labels", "targets", "classifier_accuracy", ...settings}``: the fraction
        classified as the references' digit, the mean probability the classifier gives that digit.
    """
    pipe.set_ip_adapter_scale(ip_adapter_scale)
    predicted, confidence, targets = [], [], []
    try:
        for digit in range(10):
            for s in range(ref_sets):
                refs = digits_reference_images(digit, n_refs, seed=seed + s)
                gen = torch.Generator().manual_seed(seed * 1000 + digit * 10 + s)
                out = pipe(
                    DIGITS_PROMPT,
                    ip_adapter_image=[refs],
                    num_images_per_prompt=samples_per_digit,
                    num_inference_steps=num_inference_steps,
                    guidance_scale=guidance_scale,
                    generator=gen,
                    output_type="np",
                )
                labels, probs = classify_digit_images(out.images)
                predicted.extend(labels.tolist())
                confidence.extend(probs[:, digit].tolist())
                targets.extend([digit] * len(labels))
    finally:
        pipe.set_ip_adapter_scale(1.0)
    predicted_arr, targets_arr = np.array(predicted), np.array(targets)
    hits = predicted_arr == targets_arr
    return {
        "rate": float(hits.mean()),
        "confidence": float(np.mean(confidence)),
        "per_digit": {d: float(hits[targets_arr == d].mean()) for d in range(10)},
        "labels": predicted_arr,
        "targets": targets_arr,
        "classifier_accuracy": digit_classifier()[1],
        "samples": len(hits),
        "n_refs": n_refs,
        "num_inference_steps": num_inference_steps,
        "guidance_scale": guidance_scale,
        "ip_adapter_scale": ip_adapter_scale,
    }


def add_digit_scores(comparison: Any, digit: int) -> None:
    """Score a :class:`ipa_probe.compare.Comparison` of the organism with :func:`digit_classifier`, in place.

    Adds ``digit_right`` (1 if the image is classified as ``digit``) and ``digit_confidence`` (the probability the
    classifier gives ``digit``) to ``comparison.per_image``, and their means and standard deviations over seeds
    (``*_std``) to ``comparison.table``, for every method and the VAE round trip of the references.

    Args:
        comparison: the result of :func:`ipa_probe.compare.compare_methods` on the digits organism.
        digit: the references' digit.
    """
    from ..compare import ROUNDTRIP

    per = comparison.per_image
    right = np.full(len(per), np.nan)
    confidence = np.full(len(per), np.nan)
    groups = [*comparison.images.items(), (ROUNDTRIP, comparison.roundtrip or [])]
    for method, items in groups:
        rows = np.flatnonzero((per["method"] == method).to_numpy())  # in the order the images were scored
        if len(items) == 0 or len(rows) != len(items):
            continue
        labels, probs = classify_digit_images(items)
        right[rows] = labels == digit
        confidence[rows] = probs[:, digit]
    per["digit_right"], per["digit_confidence"] = right, confidence
    stats = per.groupby("method", sort=False)[["digit_right", "digit_confidence"]].agg(
        ["mean", lambda x: x.std(ddof=0)]
    )
    for name in ("digit_right", "digit_confidence"):
        comparison.table[name] = comparison.table["method"].map(stats[(name, "mean")])
        comparison.table[f"{name}_std"] = comparison.table["method"].map(stats[(name, "<lambda_0>")])
    comparison.settings["digit"] = digit
    comparison.settings["digit_classifier"] = {
        "model": "sklearn LogisticRegression on 8x8 digits (area-downsampled grey images)",
        "held_out_accuracy": digit_classifier()[1],
    }


#: the settings of the README's rates: ``python -m ipa_probe.tiny.digits --out docs/results/digits``
EVALUATION_SETTINGS: dict[str, dict[str, Any]] = {
    "adapter on": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0},
    "adapter on, CFG 3": {"ip_adapter_scale": 1.0, "guidance_scale": 3.0},
    "adapter scale 0": {"ip_adapter_scale": 0.0, "guidance_scale": 1.0},
    "untrained weights": {"ip_adapter_scale": 1.0, "guidance_scale": 1.0, "untrained": True},
}


def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - a script; tests run evaluate_digits
    import argparse

    parser = argparse.ArgumentParser(description="Rates of the right digit (README), written to OUT/rates.{md,json}.")
    parser.add_argument("--out", default="outputs/digits-eval")
    parser.add_argument("--samples", type=int, default=10, help="samples per digit and reference set")
    parser.add_argument("--ref-sets", type=int, default=3, help="reference sets per digit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trained, untrained = digits_pipeline(), None
    rows, raw = [], {}
    for name, settings in EVALUATION_SETTINGS.items():
        settings = dict(settings)
        if settings.pop("untrained", False):
            untrained = untrained or untrained_digits_pipeline()
            pipe = untrained
        else:
            pipe = trained
        pipe.set_progress_bar_config(disable=True)
        start = time.perf_counter()
        result = evaluate_digits(
            pipe, samples_per_digit=args.samples, n_refs=3, ref_sets=args.ref_sets,
            num_inference_steps=args.steps, **settings,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        raw[name] = {k: v for k, v in result.items() if k not in ("labels", "targets")} | {"seconds": seconds}
        rows.append(
            {
                "setting": name,
                "right digit": f"{result['rate']:.1%}",
                "confidence": f"{result['confidence']:.3f}",
                "samples": result["samples"],
                "most frequent label": f"{np.bincount(result['labels'], minlength=10).argmax()}",
            }
        )
        print(rows[-1], flush=True)
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    table = "\n".join(lines)
    accuracy = digit_classifier()[1]
    note = (
        f"\n\nClassifier: logistic regression on the 8x8 digits [0, {TRAIN_SIZE}), held-out accuracy {accuracy:.3f}. "
        f"{args.ref_sets} held-out reference sets of 3 images per digit, {args.samples} samples each, "
        f"DDIM {args.steps} steps.\n"
    )
    (out / "rates.md").write_text(table + note)
    _write_json(out / "rates.json", {"rates": raw, "args": vars(args), "versions": _versions()})
    print(table + note)


if __name__ == "__main__":  # pragma: no cover
    _main()
