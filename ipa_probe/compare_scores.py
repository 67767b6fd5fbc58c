"""Scores of generated images against a reference set (:mod:`ipa_probe.compare`): open_clip image embeddings
(CLIP-I to the nearest and to the mean reference), the RMS pixel distance to the nearest reference, and the
diversity of a method's images across seeds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from ._quiet import quiet_known_messages

__all__ = ["RANDOM_WEIGHTS_NOTE", "SCORES", "ClipScorer", "diversity", "image_pixels", "score_method"]

#: Per-image score columns.
SCORES: tuple[str, ...] = ("clip_i_nearest", "clip_i_mean", "pixel_nearest")
RANDOM_WEIGHTS_NOTE = (
    "open_clip model built from its config with random weights (offline): scores compare the methods with each other "
    "through one fixed random feature map, not with published CLIP-I numbers; pass --clip-pretrained for real weights"
)


class ClipScorer:
    """Image embeddings from an open_clip model, unit-normalised.

    Args:
        model: an open_clip model name (``open_clip.list_models()``), or ``local-dir:<folder>`` holding an
            ``open_clip_config.json`` (and optionally ``open_clip_model.safetensors``), or ``hf-hub:<repo>``.
        pretrained: ``None`` for random weights built from the config (offline; seeded, so reproducible), an
            open_clip pretrained tag whose weights are already cached, or the path of a local checkpoint file.
        device: where to run it.
        seed: seed of the random initialisation (the caller's RNG is untouched).

    Raises:
        ValueError: unknown model name, or weights that cannot be loaded (the message names the remedy).
    """

    def __init__(
        self, model: str = "ViT-B-32", pretrained: str | None = None, device: str | torch.device = "cpu", seed: int = 0
    ) -> None:
        import open_clip

        known = set(open_clip.list_models())
        if not model.startswith(("hf-hub:", "local-dir:")) and model not in known:
            close = sorted(n for n in known if n.lower().startswith(model.lower()[:5]))[:6]
            raise ValueError(
                f"open_clip knows no model {model!r}; pick one of open_clip.list_models() "
                f"(e.g. {', '.join(close or ['ViT-B-32', 'ViT-S-32'])})"
            )
        if pretrained is not None and Path(pretrained).expanduser().exists():
            pretrained = str(Path(pretrained).expanduser())
        self.model_name = model
        self.pretrained = pretrained
        if model.startswith("local-dir:"):
            folder = Path(model.removeprefix("local-dir:")).expanduser()
            self.random_weights = not any(folder.glob("open_clip_*.safetensors")) and not any(
                folder.glob("open_clip_*.bin")
            )
        else:
            self.random_weights = pretrained is None and not model.startswith("hf-hub:")
        try:
            with torch.random.fork_rng(devices=[]), quiet_known_messages():
                torch.manual_seed(seed)
                clip, _, preprocess = open_clip.create_model_and_transforms(
                    model, pretrained=pretrained, device=device
                )
        except Exception as err:  # open_clip raises RuntimeError, OSError, HF hub errors... all mean "cannot load"
            raise ValueError(
                f"could not load open_clip weights {pretrained!r} for {model!r} "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); pass the path of a local "
                "checkpoint file, a pretrained tag whose weights are in the open_clip cache, or no --clip-pretrained "
                "for random weights"
            ) from None
        self.model = clip.eval()
        self.preprocess = preprocess
        self.device = torch.device(device)

    def describe(self) -> dict[str, Any]:
        return {
            "clip_model": self.model_name,
            "clip_pretrained": self.pretrained,
            "clip_random_weights": self.random_weights,
            **({"clip_note": RANDOM_WEIGHTS_NOTE} if self.random_weights else {}),
        }

    @torch.no_grad()
    def embed(self, images: Sequence[PIL.Image.Image], batch_size: int = 16) -> torch.Tensor:
        """Unit-norm image embeddings, shape ``(N, E)``, float32 on CPU."""
        out = []
        for start in range(0, len(images), batch_size):
            batch = torch.stack([self.preprocess(im.convert("RGB")) for im in images[start : start + batch_size]])
            emb = self.model.encode_image(batch.to(self.device)).float()
            out.append(torch.nn.functional.normalize(emb, dim=-1).cpu())
        return torch.cat(out)


def image_pixels(images: Sequence[PIL.Image.Image], size: tuple[int, int]) -> torch.Tensor:
    """``(N, H*W*3)`` float64 in ``[0, 1]`` at ``size = (width, height)``."""
    rgb = [im.convert("RGB") for im in images]
    arrays = [np.asarray(im if im.size == size else im.resize(size, PIL.Image.Resampling.BICUBIC)) for im in rgb]
    return torch.from_numpy(np.stack(arrays)).double().div(255).flatten(1)


def score_method(
    generated: torch.Tensor, references: torch.Tensor, generated_pixels: torch.Tensor, reference_pixels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-image scores of generated images against a reference set.

    Args:
        generated: unit-norm embeddings ``(N, E)``.
        references: unit-norm embeddings ``(M, E)``.
        generated_pixels: ``(N, P)`` in ``[0, 1]``.
        reference_pixels: ``(M, P)`` in ``[0, 1]``, same ``P``.

    Returns:
        ``clip_i_nearest`` ``max_j cos(g, r_j)``, ``clip_i_mean`` ``cos(g, mean_j r_j)``, ``pixel_nearest``
        ``min_j RMS(g - r_j)`` and ``nearest_reference`` (the index of that ``j``), each of shape ``(N,)``.
    """
    cos = generated.double() @ references.double().T  # (N, M)
    mean_ref = torch.nn.functional.normalize(references.double().mean(0), dim=0)  # (E,)
    rms = torch.cdist(generated_pixels, reference_pixels) / math.sqrt(generated_pixels.shape[1])  # (N, M)
    pixel_nearest, nearest = rms.min(1)
    return {
        "clip_i_nearest": cos.max(1).values,
        "clip_i_mean": generated.double() @ mean_ref,
        "pixel_nearest": pixel_nearest,
        "nearest_reference": nearest,
    }


def diversity(embeddings: torch.Tensor) -> float:
    """Mean pairwise cosine distance ``1 - cos(g_a, g_b)`` over pairs ``a < b`` of unit-norm ``(N, E)``; NaN if N<2."""
    n = embeddings.shape[0]
    if n < 2:
        return math.nan
    cos = embeddings.double() @ embeddings.double().T
    upper = torch.triu_indices(n, n, offset=1)
    return float((1 - cos[upper[0], upper[1]]).mean())
