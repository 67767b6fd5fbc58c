"""What an intervention does to the output: the same seeded generation with and without it, compared.

:func:`generate` runs a pipeline once (``output_type="latent"``) and decodes the final latents with its own VAE and
image processor, as the pipeline does for ``output_type="np"``; :func:`measure_intervention` runs it twice with the
same seed (the baseline can be passed in, to share one between several interventions) and returns the distances
between the two outputs and, given a classifier, its verdict on both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._checks import check_seed, check_steps_ran
from ..layers import LayerSelection
from .config import InterventionConfig
from .hooks import intervene

__all__ = ["Generation", "InterventionEffect", "call_digest", "decode_latents", "generate", "measure_intervention"]

#: ``classify(images) -> (labels (N,), probabilities (N, classes))`` on ``(N, H, W, 3)`` arrays in ``[0, 1]``.
Classifier = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Generation:
    """One pipeline call's output.

    Attributes:
        latents: the final latents ``(N, C, h, w)`` (Flux: packed, as its pipeline returns them), float32 on the CPU.
        images: the decoded images ``(N, H, W, 3)`` in ``[0, 1]``, float32.
        seed: the generator's seed (``None``: not made by :func:`generate`).
        call: a digest of the call's arguments (:func:`call_digest`; ``None``: not made by :func:`generate`), so
            that :func:`measure_intervention` can refuse a baseline of another call.
    """

    latents: torch.Tensor
    images: np.ndarray
    seed: int | None = None
    call: str | None = None


@dataclass(frozen=True)
class InterventionEffect:
    """An intervention's effect on a generation (per generated image).

    Attributes:
        config, baseline, intervened: the intervention's settings and the two generations (same seed and call).
        latent_distance: ``(N,)`` root-mean-square difference of the final latents.
        pixel_distance: ``(N,)`` root-mean-square difference of the images, on the ``[0, 1]`` scale.
        baseline_labels, intervened_labels: ``(N,)`` the classifier's labels, or ``None`` without a classifier.
        baseline_probabilities, intervened_probabilities: ``(N, classes)``, or ``None``.
    """

    config: InterventionConfig
    baseline: Generation
    intervened: Generation
    latent_distance: np.ndarray
    pixel_distance: np.ndarray
    baseline_labels: np.ndarray | None = None
    intervened_labels: np.ndarray | None = None
    baseline_probabilities: np.ndarray | None = None
    intervened_probabilities: np.ndarray | None = None

    @property
    def flipped(self) -> np.ndarray | None:
        """``(N,)`` whether the classifier's label changed, or ``None`` without a classifier."""
        if self.baseline_labels is None:
            return None
        return self.baseline_labels != self.intervened_labels

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly numbers (no images)."""
        out: dict[str, Any] = {
            "config": self.config.describe(),
            "latent_distance": self.latent_distance.tolist(),
            "pixel_distance": self.pixel_distance.tolist(),
        }
        if self.baseline_labels is not None:
            out.update(
                baseline_labels=self.baseline_labels.tolist(),
                intervened_labels=self.intervened_labels.tolist(),
                flipped=self.flipped.tolist(),
            )
        return out


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor, height: int | None = None) -> np.ndarray:
    """Decode final latents ``(N, C, h, w)`` (Flux: packed, of a ``height``-pixel image, square unless given) as the
    pipeline does for ``output_type="np"`` with its ``vae`` and ``image_processor``: ``(N, H, W, 3)`` in ``[0, 1]``."""
    vae = pipe.vae
    if latents.ndim == 3:  # Flux's packing undone: (N, rows, columns, C, s, s) -> (N, C, rows s, columns s)
        side = math.isqrt(latents.shape[-1] // vae.config.latent_channels)
        rows = height // (pipe.vae_scale_factor * side) if height else math.isqrt(latents.shape[1])
        latents = latents.unflatten(-1, (-1, side, side)).unflatten(1, (rows, -1)).permute(0, 3, 1, 4, 2, 5)
        latents = latents.flatten(4, 5).flatten(2, 3)
    z = latents.to(device=vae.device, dtype=vae.dtype) / vae.config.scaling_factor
    z = z + (getattr(vae.config, "shift_factor", None) or 0)  # SD3, Flux
    decoded = vae.decode(z, return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded, output_type="np", do_denormalize=[True] * decoded.shape[0])


def _digest_into(digest: Any, value: Any) -> None:
    """Feed ``value`` into ``digest``: images, tensors and arrays by their bytes, containers item by item."""
    import PIL.Image

    if isinstance(value, PIL.Image.Image):
        digest.update(f"image {value.mode} {value.size}".encode())
        digest.update(value.tobytes())
    elif isinstance(value, torch.Tensor | np.ndarray):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        digest.update(f"array {array.dtype} {array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    elif isinstance(value, dict):
        digest.update(b"dict")
        for key in sorted(value, key=str):
            digest.update(f"{key}=".encode())
            _digest_into(digest, value[key])
    elif isinstance(value, list | tuple):
        digest.update(f"seq {len(value)}".encode())
        for item in value:
            _digest_into(digest, item)
    else:
        digest.update(f"{type(value).__name__} {value!r};".encode())


def call_digest(**call: Any) -> str:
    """A short SHA-256 of a pipeline call's arguments (reference images and tensors by their bytes)."""
    import hashlib

    digest = hashlib.sha256()
    _digest_into(digest, call)
    return digest.hexdigest()[:16]


def generate(pipe, *, seed: int = 0, **call: Any) -> Generation:
    """Run ``pipe(**call)`` (SD 1.5, SDXL, Flux, SD3) seeded with ``seed`` (a CPU generator: the same seed, the same
    initial noise); its latents and decoded images. ``call``: the pipeline's arguments without ``generator`` and
    ``output_type``."""
    for name in ("generator", "output_type", "return_dict"):
        if name in call:
            raise ValueError(f"{name}= is set by generate (seed= chooses the generator); drop it from the call")
    generator = torch.Generator().manual_seed(check_seed(seed))
    latents = pipe(**call, generator=generator, output_type="latent").images
    images = decode_latents(pipe, latents, call.get("height"))
    return Generation(latents.detach().float().cpu(), images, seed, call_digest(**call))


def _rms(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return np.sqrt((diff**2).reshape(diff.shape[0], -1).mean(1))


def _check_baseline(baseline: Any, seed: int, call: dict[str, Any]) -> None:
    """Refuse, in one line, a baseline that is not the un-intervened generation of this seed and call."""
    if not isinstance(baseline, Generation):
        raise TypeError(f"baseline: expected a Generation from ipa_probe.intervention.generate, got {type(baseline)}")
    if baseline.seed is None or baseline.call is None:
        raise ValueError(
            "baseline: it carries no seed or call record; make it with ipa_probe.intervention.generate(pipe, "
            "seed=..., **call) with the seed and call of this measurement"
        )
    if baseline.seed != seed:
        raise ValueError(
            f"baseline: made with seed={baseline.seed}, but this measurement uses seed={seed}; pass seed="
            f"{baseline.seed}, or a baseline generated with seed={seed} (or none, to make one)"
        )
    if baseline.call != call_digest(**call):
        raise ValueError(
            "baseline: made with other call arguments (prompt, references, steps, ...) than this measurement; "
            "generate it with the same **call, or pass none to make one"
        )


def measure_intervention(
    pipe,
    reference: int | Sequence[int],
    *,
    layers: LayerSelection = None,
    steps=None,
    mode: str = "ablate",
    other: Any = None,
    adapter: int = 0,
    factor: float | Sequence[float] | None = None,
    seed: int = 0,
    classify: Classifier | None = None,
    baseline: Generation | None = None,
    **call: Any,
) -> InterventionEffect:
    """Generate with and without an intervention (same seed and call) and compare them: an :class:`InterventionEffect`.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter.
        reference, layers, steps, mode, other, adapter, factor: the intervention (see :func:`~.hooks.intervene`).
        seed: the generator's seed for both runs.
        classify: optional ``classify(images) -> (labels, probabilities)`` on ``(N, H, W, 3)`` images in ``[0, 1]``
            (for the digits organism: :func:`ipa_probe.tiny.digits.classify_digit_images`).
        baseline: the un-intervened :func:`generate` output of the same call and seed, to reuse; made when ``None``.
            One made with another seed or other call arguments (or not by :func:`generate`) is refused: the
            distances would measure the change of seed or call, not the intervention.
        **call: the pipeline's arguments (without ``generator`` / ``output_type``).

    Example:
        ```py
        >>> effect = ipa_probe.measure_intervention(pipe, 0, prompt="a handwritten digit",
        ...                                         ip_adapter_image=[refs], num_inference_steps=20)
        >>> effect.pixel_distance
        ```
    """
    check_seed(seed)
    config = InterventionConfig(
        reference=reference, layers=layers, steps=steps, mode=mode, other=other, adapter=adapter, factor=factor
    )
    planned = call.get("num_inference_steps")
    if isinstance(planned, int) and not isinstance(planned, bool):  # the loop runs at most that many steps
        check_steps_ran(config.steps, planned)
    if baseline is None:
        baseline = generate(pipe, seed=seed, **call)
    else:
        _check_baseline(baseline, seed, call)
    where = {"layers": layers, "steps": steps, "adapter": adapter}
    with intervene(pipe, reference, **where, mode=mode, other=other, factor=factor):
        intervened = generate(pipe, seed=seed, **call)
    labels: dict[str, np.ndarray | None] = {}
    if classify is not None:
        labels["baseline_labels"], labels["baseline_probabilities"] = classify(baseline.images)
        labels["intervened_labels"], labels["intervened_probabilities"] = classify(intervened.images)
    return InterventionEffect(
        config,
        baseline,
        intervened,
        _rms(baseline.latents.numpy(), intervened.latents.numpy()),
        _rms(baseline.images, intervened.images),
        **labels,
    )
