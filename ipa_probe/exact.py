"""The exact empirical denoiser: the closed-form posterior of a finite support, standing in for the UNet (paper §C.5).

On the variance-preserving path ``x_t = alpha_t x_0 + sigma_t eps`` with data ``x_0`` drawn uniformly from a support
``S = {s_1 .. s_m}`` (here: the VAE latents of the reference images), the posterior over support points is a Gaussian
Nadaraya–Watson (NW) weighting of the rescaled sample at bandwidth ``h_t = sigma_t / alpha_t``:

    w_i(x) = softmax_i(-|x / alpha_t - s_i|^2 / (2 h_t^2)),
    x0^(x, t) = sum_i w_i(x) s_i,                     (sample prediction: the optimal denoiser)
    eps^(x, t) = (x - alpha_t x0^) / sigma_t,          (epsilon prediction)
    v^(x, t) = alpha_t eps^ - sigma_t x0^.             (v prediction)

:class:`ExactNWDenoiser` returns whichever of these the scheduler expects, so any diffusers scheduler driving it
samples from (a discretisation of) the exact flow of the empirical measure: the paper's zero-parameter plug-in
baseline, which reproduces its support. :func:`exact_pipeline` wraps it, with the VAE, scheduler and image processor
of a user's pipeline, into a pipeline that generates images.

The weights are computed in float32 with a running log-sum-exp over chunks of the support, so the working memory is
``O(batch x latent size)`` whatever the number of references.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from .statistics import kernels
from .theory.schedules import VPSchedule

__all__ = ["PREDICTION_TYPES", "ExactNWDenoiser", "ExactNWPipeline", "exact_pipeline", "encode_references"]

logger = logging.getLogger(__name__)

#: Scheduler ``prediction_type`` values the exact denoiser can produce.
PREDICTION_TYPES: tuple[str, ...] = ("epsilon", "sample", "v_prediction")

ImageInput = PIL.Image.Image | np.ndarray | torch.Tensor


def _prediction_type(scheduler: Any) -> str:
    config = getattr(scheduler, "config", None)
    prediction_type = getattr(config, "prediction_type", None) if config is not None else None
    if prediction_type is None:
        prediction_type = "epsilon"  # the diffusers default for VP schedulers without the field
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"the scheduler's prediction_type is {prediction_type!r}, which the exact denoiser does not produce "
            f"(it produces {', '.join(PREDICTION_TYPES)}); build the scheduler with one of them, e.g. "
            f"`{type(scheduler).__name__}.from_config(scheduler.config, prediction_type='epsilon')`"
        )
    return prediction_type


def nw_mean_chunked(query: torch.Tensor, support: torch.Tensor, h: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """NW local mean ``sum_i w_i s_i``, ``w = softmax_i(-|q - s_i|^2 / (2 h^2))``, streamed over the support.

    A running log-sum-exp (maximum ``m``, normaliser ``Z`` and numerator ``N``, rescaled by ``exp(m_old - m_new)``
    whenever the maximum grows) keeps the working memory at ``O(B x (D + chunk_size))``. ``query`` ``(B, D)`` and
    ``support`` ``(m >= 1, D)`` in float32, the bandwidth ``h`` ``(B, 1)`` or ``()``; returns ``(B, D)``.
    """
    batch, dim = query.shape
    running_max = query.new_full((batch, 1), float("-inf"))
    normaliser = query.new_zeros(batch, 1)
    numerator = query.new_zeros(batch, dim)
    inv_h2 = 1.0 / (h * h)
    for chunk in support.split(chunk_size):
        # (q·s_i - |s_i|^2/2) / h^2: the same per-row constant in every chunk (kernels.nw_logits re-centres per call,
        # which would shift each chunk's logits differently), so the running log-sum-exp can combine them.
        logits = kernels.dot_logits(query, chunk, inv_h2) + kernels.key_norm_bias(chunk, h)  # (B, n)
        new_max = torch.maximum(running_max, logits.amax(-1, keepdim=True))  # (B, 1)
        rescale = torch.exp(running_max - new_max)  # 0 on the first chunk (exp(-inf))
        weights = torch.exp(logits - new_max)  # (B, n), unnormalised, largest = 1
        numerator = numerator * rescale + weights @ chunk  # (B, D)
        normaliser = normaliser * rescale + weights.sum(-1, keepdim=True)
        running_max = new_max
    return numerator / normaliser


class ExactNWDenoiser(torch.nn.Module):
    """The closed-form denoiser of a finite support of latents, with the UNet's call signature and output type.

    Args:
        support_latents: the support ``s_i``, shape ``(m, C, H, W)`` (already scaled like the diffusion latents,
            i.e. VAE latents times ``vae.config.scaling_factor``), ``m >= 1``.
        scheduler: the diffusers scheduler that will drive it; its ``alphas_cumprod`` give ``alpha_t`` and
            ``sigma_t`` and its ``config.prediction_type`` (``"epsilon"``, ``"sample"`` or ``"v_prediction"``)
            chooses the output.
        chunk_size: support points processed at once (memory ``O(batch x (latent size + chunk_size))``).

    Fractional timesteps (Euler with ``linspace`` spacing, Karras sigmas) are read by linear interpolation of the
    bandwidth ``h_t = sigma_t / alpha_t`` between neighbouring training timesteps, the interpolation diffusers'
    Euler scheduler applies to its sigmas; timesteps are clamped to ``[0, T - 1]``.

    Example:
        ```py
        >>> denoiser = ExactNWDenoiser(latents, pipe.scheduler)
        >>> eps = denoiser(noisy, torch.tensor(500), None).sample
        ```
    """

    def __init__(self, support_latents: torch.Tensor, scheduler: Any, chunk_size: int = 256) -> None:
        super().__init__()
        if not isinstance(support_latents, torch.Tensor):
            raise TypeError(
                f"expected support_latents as a torch.Tensor (m, C, H, W), got {type(support_latents).__name__}; "
                "use exact_pipeline(pipe, images) to encode reference images"
            )
        if support_latents.ndim != 4 or support_latents.shape[0] == 0:
            raise ValueError(
                f"expected support_latents of shape (m, C, H, W) with m >= 1, got {tuple(support_latents.shape)}; "
                "pass at least one reference latent"
            )
        if not support_latents.is_floating_point():
            raise TypeError(f"expected floating-point support_latents, got {support_latents.dtype}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"expected chunk_size >= 1 (support points per chunk), got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.latent_shape: tuple[int, int, int] = tuple(support_latents.shape[1:])
        flat = support_latents.detach().reshape(support_latents.shape[0], -1).float()  # (m, C*H*W)
        center = flat.mean(0, keepdim=True)  # (1, D): NW weights are translation invariant; centring keeps dots small
        self.register_buffer("support", flat - center, persistent=False)
        self.register_buffer("center", center, persistent=False)
        self.register_buffer("bandwidths", torch.empty(0), persistent=False)
        self.scheduler = None
        self.prediction_type = "epsilon"
        self.use_scheduler(scheduler)

    def use_scheduler(self, scheduler: Any) -> None:
        """Read ``alpha_t``, ``sigma_t`` and the prediction type from ``scheduler`` (validated first)."""
        prediction_type = _prediction_type(scheduler)
        abar = VPSchedule.from_scheduler(scheduler).alphas_cumprod  # (T,), float64, validated in (0, 1)
        self.bandwidths = ((1.0 - abar) / abar).sqrt().to(device=self.support.device, dtype=torch.float32)  # h_t
        self.scheduler = scheduler
        self.prediction_type = prediction_type

    @property
    def num_support(self) -> int:
        return self.support.shape[0]

    @property
    def device(self) -> torch.device:
        return self.support.device

    @property
    def dtype(self) -> torch.dtype:
        return self.support.dtype

    def coefficients(self, timestep: torch.Tensor | float | int, batch: int) -> tuple[torch.Tensor, ...]:
        """``(alpha_t, sigma_t, h_t)`` as ``(B, 1)`` float32 columns on the support's device (no host sync), for a
        number, a 0-d or a ``(B,)`` tensor of (possibly fractional) training timesteps."""
        t = torch.as_tensor(timestep, device=self.device).reshape(-1).float()
        if t.numel() not in (1, batch):
            raise ValueError(
                f"expected one timestep or one per batch item ({batch}), got {t.numel()}; pass a 0-d or (B,) tensor"
            )
        last = self.bandwidths.shape[0] - 1
        t = t.clamp(0, last)
        low = t.floor()
        frac = t - low
        low = low.long()
        high = (low + 1).clamp(max=last)
        h = self.bandwidths[low] * (1 - frac) + self.bandwidths[high] * frac  # (1,) or (B,)
        alpha = torch.rsqrt(1 + h * h)  # alpha_t = 1 / sqrt(1 + h^2) since h^2 = (1 - abar) / abar
        sigma = h * alpha
        column = (batch, 1)
        return (
            alpha.reshape(-1, 1).expand(column),
            sigma.reshape(-1, 1).expand(column),
            h.reshape(-1, 1).expand(column),
        )

    @torch.no_grad()
    def predict_x0(self, sample: torch.Tensor, timestep: torch.Tensor | float | int) -> torch.Tensor:
        """The posterior mean ``x0^(x, t) = sum_i w_i(x) s_i`` of the support, shape ``(B, C, H, W)``, float32."""
        alpha, _, h = self.coefficients(timestep, sample.shape[0])
        return self._x0(sample, alpha, h)

    def _x0(self, sample: torch.Tensor, alpha: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = sample.reshape(sample.shape[0], -1).float()  # (B, C, H, W) -> (B, D)
        x0 = nw_mean_chunked(x / alpha - self.center, self.support, h, self.chunk_size) + self.center  # (B, D)
        return x0.reshape(sample.shape)

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor | None = None,
        class_labels: torch.Tensor | None = None,
        timestep_cond: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cross_attention_kwargs: dict[str, Any] | None = None,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None,
        down_block_additional_residuals: tuple[torch.Tensor] | None = None,
        mid_block_additional_residual: torch.Tensor | None = None,
        down_intrablock_additional_residuals: tuple[torch.Tensor] | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> UNet2DConditionOutput | tuple:
        """``x0^``, ``eps^`` or ``v^`` (by the scheduler's ``prediction_type``) for the noisy latents ``sample``
        ``(B, C, H, W)`` at ``timestep``, in ``sample``'s dtype, as ``UNet2DConditionModel.forward`` returns it.
        Conditioning arguments are accepted for compatibility and ignored: the support alone defines the model."""
        if tuple(sample.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"expected latents of shape (B, {', '.join(map(str, self.latent_shape))}) like the support, got "
                f"{tuple(sample.shape)}; generate at the references' resolution (the height and width that "
                "exact_pipeline encoded them at)"
            )
        batch = sample.shape[0]
        alpha, sigma, h = self.coefficients(timestep, batch)
        with torch.no_grad():
            x0 = self._x0(sample, alpha, h)
        if self.prediction_type == "sample":
            prediction = x0
        else:
            shape = (batch,) + (1,) * (sample.ndim - 1)
            alpha, sigma = alpha.reshape(shape), sigma.reshape(shape)
            eps = (sample.float() - alpha * x0) / sigma  # eps^ = (x - alpha_t x0^) / sigma_t
            prediction = eps if self.prediction_type == "epsilon" else alpha * eps - sigma * x0
        prediction = prediction.to(sample.dtype)
        if not return_dict:
            return (prediction,)
        return UNet2DConditionOutput(sample=prediction)


# ---------------------------------------------------------------------------------------------------------------------
# References -> latents, and the pipeline
# ---------------------------------------------------------------------------------------------------------------------


def _as_image_list(reference_images: Any) -> list[ImageInput]:
    if reference_images is None:
        reference_images = []
    if isinstance(reference_images, PIL.Image.Image | np.ndarray | torch.Tensor):
        reference_images = [reference_images]
    if not isinstance(reference_images, Sequence) or isinstance(reference_images, str | bytes):
        raise TypeError(
            f"expected reference images as a PIL image, an array/tensor or a list of them, got "
            f"{type(reference_images).__name__}; load files with PIL.Image.open(path)"
        )
    images: list[ImageInput] = []
    for index, item in enumerate(reference_images):
        if isinstance(item, PIL.Image.Image):
            images.append(item)
        elif isinstance(item, np.ndarray | torch.Tensor) and item.ndim in (3, 4):
            images.extend(list(item) if item.ndim == 4 else [item])
        else:
            raise TypeError(
                f"reference image {index} is not an image: expected a PIL image, an (H, W, C) array or a "
                f"(C, H, W) tensor in [0, 1], got {type(item).__name__}"
                f"{' of shape ' + str(tuple(item.shape)) if hasattr(item, 'shape') else ''}; "
                "load files with PIL.Image.open(path)"
            )
    if not images:
        raise ValueError(
            "expected at least one reference image, got none; pass the images the exact denoiser should "
            "reproduce (e.g. ipa_probe.tiny.sd.default_reference_images())"
        )
    return images


def _size(image: ImageInput) -> tuple[int, int]:
    """(width, height)."""
    if isinstance(image, PIL.Image.Image):
        return image.size
    if isinstance(image, np.ndarray):
        return image.shape[1], image.shape[0]  # (H, W, C)
    return image.shape[-1], image.shape[-2]  # (C, H, W)


def _default_size(pipe) -> tuple[int, int]:
    """The pipeline's default (height, width)."""
    scale = getattr(pipe, "vae_scale_factor", 8)
    sample_size = getattr(pipe, "default_sample_size", None)
    if sample_size is None:
        sample_size = pipe.unet.config.sample_size
    if isinstance(sample_size, int):
        return sample_size * scale, sample_size * scale
    return sample_size[0] * scale, sample_size[1] * scale


def encode_references(
    pipe, reference_images: Any, height: int | None = None, width: int | None = None, batch_size: int = 8
) -> torch.Tensor:
    """Encode reference images to diffusion latents with the pipeline's VAE: ``(z - shift) * scaling_factor``.

    Images are resized to ``height x width`` (the pipeline's default resolution unless given); references whose size
    differs are resized with a warning. The VAE's posterior mode is used (deterministic). ``reference_images``: a
    PIL image, an ``(H, W, C)`` array or ``(C, H, W)`` tensor in ``[0, 1]``, a batch of them, or a list; at least
    one. Returns latents ``(m, C, height / f, width / f)`` in float32 on the VAE's device.
    """
    return _encode(pipe, reference_images, height, width, batch_size, stacklevel=3)


@torch.no_grad()
def _encode(pipe, reference_images: Any, height, width, batch_size: int, stacklevel: int) -> torch.Tensor:
    # stacklevel: frames from warnings.warn to the user's call (the no_grad wrapper counts as one)
    images = _as_image_list(reference_images)
    for name in ("vae", "image_processor"):
        if getattr(pipe, name, None) is None:
            raise TypeError(
                f"expected a diffusers pipeline with a `{name}` (e.g. StableDiffusionPipeline), got "
                f"{type(pipe).__name__} without one; pass a full Stable Diffusion / SDXL pipeline"
            )
    default_height, default_width = _default_size(pipe)
    height, width = height or default_height, width or default_width
    sizes = sorted({_size(image) for image in images})
    if sizes != [(width, height)]:
        warnings.warn(
            f"reference images of size(s) {', '.join(f'{w}x{h}' for w, h in sizes)} resized to {width}x{height} "
            "(the generation resolution); pass images of that size, or height=/width=, to avoid resampling",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    vae = pipe.vae
    pixels = torch.cat([pipe.image_processor.preprocess(image, height=height, width=width) for image in images])
    latents = []
    for part in pixels.split(batch_size):  # (n, 3, height, width) in [-1, 1]
        z = vae.encode(part.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
        latents.append(z.float())
    z = torch.cat(latents)
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        z = z - shift
    return z * vae.config.scaling_factor


class ExactNWPipeline(DiffusionPipeline):
    """Generate with the exact empirical denoiser of a reference set: the paper's plug-in baseline in image space.

    Built by :func:`exact_pipeline`; the VAE, scheduler and image processor are the user's pipeline's own objects.
    The initial noise is drawn exactly as Stable Diffusion pipelines draw it, so the same generator seed gives the
    same starting latents as the learned pipeline at the same resolution. ``unet`` is the :class:`ExactNWDenoiser`;
    ``scheduler`` any diffusers scheduler on the VP path (DDIM, Euler, DPM-Solver, ...).
    """

    model_cpu_offload_seq = "unet->vae"

    def __init__(self, vae, unet: ExactNWDenoiser, scheduler, image_processor=None) -> None:
        super().__init__()
        self.register_modules(vae=vae, unet=unet, scheduler=scheduler)
        if image_processor is None:
            from diffusers.image_processor import VaeImageProcessor

            image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        self.image_processor = image_processor

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def _step_kwargs(self, generator, eta: float) -> dict[str, Any]:
        import inspect

        accepted = inspect.signature(self.scheduler.step).parameters
        return {key: value for key, value in (("eta", eta), ("generator", generator)) if key in accepted}

    @torch.no_grad()
    def __call__(
        self,
        num_inference_steps: int = 50,
        num_images: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        eta: float = 0.0,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> ImagePipelineOutput | tuple:
        """Sample ``num_images`` images (or final latents for ``output_type="latent"``) from the exact flow of the
        reference set; ``latents`` ``(num_images, C, h, w)`` replace the drawn initial noise, ``eta`` goes to the
        schedulers that accept it."""
        denoiser: ExactNWDenoiser = self.unet
        if self.scheduler is not denoiser.scheduler:
            denoiser.use_scheduler(self.scheduler)  # the scheduler was swapped on the pipeline: follow it
        device = denoiser.device
        dtype = self.vae.dtype
        shape = (num_images, *denoiser.latent_shape)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"expected latents of shape {shape}, got {tuple(latents.shape)}")
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        latents = latents.to(device) * self.scheduler.init_noise_sigma
        step_kwargs = self._step_kwargs(generator, eta)
        for t in self.progress_bar(self.scheduler.timesteps):
            model_input = self.scheduler.scale_model_input(latents, t)
            prediction = denoiser(model_input, t, return_dict=False)[0]
            latents = self.scheduler.step(prediction, t, latents, **step_kwargs, return_dict=False)[0]
        if output_type == "latent":
            images = latents
        else:
            z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
            shift = getattr(self.vae.config, "shift_factor", None)
            if shift is not None:
                z = z + shift
            decoded = self.vae.decode(z, return_dict=False)[0]
            images = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)


def exact_pipeline(
    pipe,
    reference_images: Any,
    *,
    height: int | None = None,
    width: int | None = None,
    chunk_size: int = 256,
) -> ExactNWPipeline:
    """A pipeline that generates with the exact empirical denoiser of ``reference_images`` (paper §C.5).

    The returned pipeline shares ``pipe``'s VAE, scheduler and image processor (the same objects); ``pipe`` itself is
    not modified. Its denoiser is an :class:`ExactNWDenoiser` over the VAE latents (times
    ``vae.config.scaling_factor``) of the references (PIL images, arrays or tensors, as :func:`encode_references`
    takes them), resized to ``height x width`` (the pipeline's default if not given). Call the result with
    ``num_inference_steps`` and ``generator``.

    Raises:
        ValueError: no reference images, or a scheduler ``prediction_type`` it cannot produce (before any encoding).
        TypeError: something that is not an image, or a pipeline without VAE / image processor.

    Example:
        ```py
        >>> exact = ipa_probe.exact_pipeline(pipe, refs)
        >>> image = exact(num_inference_steps=20, generator=torch.Generator().manual_seed(0)).images[0]
        ```
    """
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is None:
        raise TypeError(f"expected a diffusers pipeline with a `scheduler`, got {type(pipe).__name__}")
    _prediction_type(scheduler)  # fail before encoding anything
    VPSchedule.from_scheduler(scheduler)
    _as_image_list(reference_images)
    latents = _encode(pipe, reference_images, height, width, batch_size=8, stacklevel=3)
    denoiser = ExactNWDenoiser(latents, scheduler, chunk_size=chunk_size)
    exact = ExactNWPipeline(vae=pipe.vae, unet=denoiser, scheduler=scheduler, image_processor=pipe.image_processor)
    return exact
