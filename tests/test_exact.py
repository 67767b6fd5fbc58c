"""The exact empirical denoiser against the theory's closed forms, in the schedulers, and as a pipeline."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UNet2DConditionModel,
)
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
from PIL import Image

import ipa_probe
from ipa_probe.exact import ExactNWDenoiser, nw_mean_chunked
from ipa_probe.theory import VPSchedule, nw_eps, nw_mean, nw_v, nw_x0
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline

BETAS = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)


def support_latents(m=5, shape=(4, 8, 8), seed=0):
    return torch.randn(m, *shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the maths


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize("h", [0.02, 1.0, 50.0])
def test_streamed_nw_mean_equals_the_closed_form(chunk_size, h):
    gen = torch.Generator().manual_seed(0)
    query, support = torch.randn(6, 10, generator=gen), torch.randn(20, 10, generator=gen)
    expected = nw_mean(query.double(), support.double(), h)
    got = nw_mean_chunked(query, support, torch.full((6, 1), h), chunk_size)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prediction_type, field", [("sample", nw_x0), ("epsilon", nw_eps), ("v_prediction", nw_v)])
@pytest.mark.parametrize("timestep", [999, 500, 20, 0])
def test_predictions_match_the_theory_fields(prediction_type, field, timestep):
    scheduler = DDIMScheduler(**BETAS, prediction_type=prediction_type)
    support = support_latents()
    denoiser = ExactNWDenoiser(support, scheduler, chunk_size=2)
    c = VPSchedule.from_scheduler(scheduler)(timestep)
    x = c.alpha_t.float() * support[[1, 3]] + c.sigma_t.float() * torch.randn(2, 4, 8, 8)
    got = denoiser(x, torch.tensor(timestep)).sample
    expected = field(x.flatten(1).double(), c.alpha_t, c.sigma_t, support.flatten(1).double())
    scale = expected.abs().max()
    torch.testing.assert_close(got.flatten(1).double() / scale, expected / scale, rtol=1e-4, atol=1e-4)


def test_same_signature_and_output_type_as_the_unet():
    unet_params = list(inspect.signature(UNet2DConditionModel.forward).parameters)
    assert list(inspect.signature(ExactNWDenoiser.forward).parameters) == unet_params
    denoiser = ExactNWDenoiser(support_latents(), DDIMScheduler(**BETAS))
    x = torch.randn(3, 4, 8, 8)
    out = denoiser(x, 10, encoder_hidden_states=torch.randn(3, 7, 32))
    assert isinstance(out, UNet2DConditionOutput) and out.sample.shape == x.shape
    (plain,) = denoiser(x, 10, return_dict=False)
    assert torch.equal(plain, out.sample)
    assert denoiser(x.half(), 10).sample.dtype == torch.float16  # computed in float32, returned in the input dtype


def test_fractional_timesteps_follow_the_euler_sigmas():
    scheduler = EulerDiscreteScheduler(**BETAS, timestep_spacing="linspace")
    scheduler.set_timesteps(7)
    assert not torch.equal(scheduler.timesteps, scheduler.timesteps.round())  # really fractional
    denoiser = ExactNWDenoiser(support_latents(), scheduler)
    for t, sigma in zip(scheduler.timesteps, scheduler.sigmas[:-1], strict=True):
        _, _, h = denoiser.coefficients(t, 1)
        torch.testing.assert_close(h.squeeze(), sigma.float(), rtol=1e-5, atol=1e-6)


def test_per_item_timesteps_equal_one_call_per_item():
    denoiser = ExactNWDenoiser(support_latents(), DDIMScheduler(**BETAS))
    x = torch.randn(3, 4, 8, 8)
    timesteps = torch.tensor([900, 400, 5])
    batched = denoiser(x, timesteps).sample
    single = torch.cat([denoiser(x[i : i + 1], timesteps[i]).sample for i in range(3)])
    torch.testing.assert_close(batched, single)
    with pytest.raises(ValueError, match="one timestep or one per batch item"):
        denoiser(x, torch.tensor([1, 2]))


def test_chunking_does_not_change_the_prediction():
    support = support_latents(m=40)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    one = ExactNWDenoiser(support, DDIMScheduler(**BETAS), chunk_size=1)(x, 300).sample
    all_ = ExactNWDenoiser(support, DDIMScheduler(**BETAS), chunk_size=1000)(x, 300).sample
    # float32 summed in another order: over 200 random inputs the largest difference was 3e-5 on outputs up to 5.4
    torch.testing.assert_close(one, all_, rtol=0, atol=1e-4)


def test_bad_inputs_name_the_remedy():
    with pytest.raises(ValueError, match="m >= 1"):
        ExactNWDenoiser(torch.zeros(0, 4, 8, 8), DDIMScheduler(**BETAS))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ExactNWDenoiser(np.zeros((1, 4, 8, 8)), DDIMScheduler(**BETAS))
    with pytest.raises(ValueError, match="prediction_type='epsilon'"):
        ExactNWDenoiser(support_latents(), DDIMScheduler(**BETAS, prediction_type="flow"))
    with pytest.raises(TypeError, match="alphas_cumprod"):
        ExactNWDenoiser(support_latents(), FlowMatchEulerDiscreteScheduler())
    denoiser = ExactNWDenoiser(support_latents(), DDIMScheduler(**BETAS))
    with pytest.raises(ValueError, match="references' resolution"):
        denoiser(torch.randn(1, 4, 16, 16), 10)


# --------------------------------------------------------------------------- the pipeline


SCHEDULERS = {
    "ddim": lambda config: DDIMScheduler.from_config(config, set_alpha_to_one=True),
    "euler": lambda config: EulerDiscreteScheduler.from_config(config),
    "dpm": lambda config: DPMSolverMultistepScheduler.from_config(config),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_one_reference_is_reproduced_by_every_scheduler(name):
    pipe = tiny_pipeline("sd15")
    pipe.scheduler = SCHEDULERS[name](pipe.scheduler.config)
    exact = ipa_probe.exact_pipeline(pipe, default_reference_images(1, size=64))
    target = exact.unet.support + exact.unet.center  # (1, D)
    latents = exact(num_inference_steps=8, generator=torch.Generator().manual_seed(0), output_type="latent").images
    assert latents.shape == (1, 4, 8, 8)
    torch.testing.assert_close(latents.reshape(1, -1), target, rtol=0, atol=1e-5 * target.abs().max().item())


@pytest.mark.parametrize("name", ["ddim", "euler"])
def test_several_references_collapse_onto_one_of_them(name):
    """Each sample ends on one reference's latent: the plug-in model memorises its support (paper §C.2, §C.5).

    DDIM and Euler here end at timestep 1 (bandwidth 0.04), where the posterior is one-hot. DPM-Solver with this
    config's spacing ends its last step at timestep ~100 (bandwidth 0.34) and jumps to the clean sample from there,
    which blends references closer than that; it reproduces a single reference exactly (test above).
    """
    pipe = tiny_pipeline("sd15")
    pipe.scheduler = SCHEDULERS[name](pipe.scheduler.config)
    exact = ipa_probe.exact_pipeline(pipe, default_reference_images(3, size=64))
    support = exact.unet.support + exact.unet.center  # (3, D)
    generator = torch.Generator().manual_seed(0)
    latents = exact(num_inference_steps=10, num_images=4, generator=generator, output_type="latent")
    distances = torch.cdist(latents.images.reshape(4, -1), support)  # (4, 3)
    nearest = distances.min(1).values
    assert (nearest < 1e-3 * support.norm(dim=1).min()).all()  # each sample is one reference's latent


def test_same_seed_gives_the_same_initial_noise_as_the_learned_pipeline(sd15):
    refs = default_reference_images(2, size=64)
    first_inputs = []
    hook = lambda module, args, kwargs: first_inputs.append((args[0] if args else kwargs["sample"]).clone())  # noqa: E731
    handle = sd15.unet.register_forward_pre_hook(hook, with_kwargs=True)
    sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, guidance_scale=1.0, output_type="latent",
         generator=torch.Generator().manual_seed(7))  # fmt: skip
    handle.remove()
    exact = ipa_probe.exact_pipeline(sd15, refs)
    handle = exact.unet.register_forward_pre_hook(hook, with_kwargs=True)
    exact(num_inference_steps=2, generator=torch.Generator().manual_seed(7), output_type="latent")
    handle.remove()
    assert torch.equal(first_inputs[0], first_inputs[2])


def test_shares_components_and_leaves_the_users_pipeline_alone(sd15):
    refs = default_reference_images(2, size=64)
    components = dict(sd15.components)
    processors = dict(sd15.unet.attn_processors)
    config = dict(sd15.scheduler.config)
    before = sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
                  generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    exact = ipa_probe.exact_pipeline(sd15, refs)
    exact(num_inference_steps=3, generator=torch.Generator().manual_seed(0))
    assert exact.vae is sd15.vae and exact.scheduler is sd15.scheduler
    assert exact.image_processor is sd15.image_processor
    assert isinstance(exact.unet, ipa_probe.ExactNWDenoiser) and exact.unet is not sd15.unet
    assert all(sd15.components[k] is v for k, v in components.items())
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    assert dict(sd15.scheduler.config) == config
    after = sd15("a photo", ip_adapter_image=[refs], num_inference_steps=2, output_type="latent",
                 generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert torch.equal(before, after)


def test_reference_images_are_checked_and_resized_with_a_warning(sd15):
    with pytest.raises(ValueError, match="at least one reference image"):
        ipa_probe.exact_pipeline(sd15, [])
    with pytest.raises(TypeError, match="not an image"):
        ipa_probe.exact_pipeline(sd15, ["photo.png"])
    with pytest.warns(UserWarning, match="resized to 64x64"):
        exact = ipa_probe.exact_pipeline(sd15, [Image.new("RGB", (40, 30)), Image.new("RGB", (64, 64))])
    assert exact.unet.num_support == 2 and exact.unet.latent_shape == (4, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = ipa_probe.exact_pipeline(sd15, default_reference_images(2, size=64))
        tensors = ipa_probe.exact_pipeline(sd15, torch.rand(3, 3, 64, 64))  # a batch of (C, H, W) in [0, 1]
    assert same.unet.num_support == 2 and tensors.unet.num_support == 3
    with pytest.warns(UserWarning, match="resized to 128x64") as record:
        wide = ipa_probe.exact_pipeline(sd15, default_reference_images(1, size=64), height=64, width=128)
    assert record[0].filename == __file__  # the warning points at the caller's line
    assert wide(num_inference_steps=1, output_type="np").images.shape == (1, 64, 128, 3)


def test_a_bad_scheduler_raises_before_any_encoding(sd15):
    pipe = tiny_pipeline("sd15")
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, prediction_type="flow")
    calls = []
    handle = pipe.vae.encoder.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="prediction_type"):
        ipa_probe.exact_pipeline(pipe, default_reference_images(1))
    handle.remove()
    assert not calls


def test_sdxl_and_a_scheduler_swapped_after_building():
    pipe = tiny_pipeline("sdxl")
    refs = default_reference_images(2, size=64)
    exact = ipa_probe.exact_pipeline(pipe, refs)
    images = exact(num_inference_steps=3, num_images=2, generator=torch.Generator().manual_seed(0)).images
    assert len(images) == 2 and images[0].size == (64, 64)
    exact.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, prediction_type="v_prediction")
    exact(num_inference_steps=2, output_type="latent")
    assert exact.unet.scheduler is exact.scheduler and exact.unet.prediction_type == "v_prediction"
