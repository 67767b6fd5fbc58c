"""The embedded tiny pipelines and the offline tokenizer: real diffusers pipelines, seeded, no network."""

from __future__ import annotations

import random
import threading

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0
from diffusers.models.embeddings import ImageProjection, IPAdapterPlusImageProjection
from safetensors import safe_open

from ipa_probe.tiny.sd import (
    IP_ADAPTER_NUM_TOKENS,
    SavedTinyPipeline,
    default_reference_images,
    realign_weights,
    save_tiny_pipeline,
    tiny_ip_adapter_state_dict,
    tiny_pipeline,
)
from ipa_probe.tiny.tokenizer import CLIP_VOCAB_SIZE, bytes_to_unicode, clip_tokenizer, clip_tokenizer_dir

KINDS = ["sd15", "sdxl"]
ADAPTERS = ["base", "plus"]
# The number of IP-Adapter cross-attention layers of each tiny UNet (documented in ``tiny_pipeline``).
NUM_IP_LAYERS = {"sd15": 7, "sdxl": 11}


def _generate(pipe, **kwargs) -> np.ndarray:
    kwargs.setdefault("prompt", "a photo of a flower")
    kwargs.setdefault("num_inference_steps", 2)
    return pipe(**kwargs, output_type="np", generator=torch.Generator().manual_seed(0)).images


def _ip_processors(pipe) -> dict[str, IPAdapterAttnProcessor2_0]:
    return {k: p for k, p in pipe.unet.attn_processors.items() if isinstance(p, IPAdapterAttnProcessor2_0)}


def _all_weights(pipe) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("unet", "vae", "text_encoder", "text_encoder_2", "image_encoder"):
        module = getattr(pipe, name, None)
        if module is not None:
            out.update({f"{name}.{k}": v for k, v in module.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def refs() -> list[PIL.Image.Image]:
    return default_reference_images(4, size=48)


# --- tokenizer ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "a photo of a cat",
        "A Painting of the Eiffel Tower, trending on artstation, 8k!!",
        "naïve café — 東京 🙂 it's   spaced\tout\nlines",
        "",
    ],
)
def test_tokenizer_matches_open_clip(text):
    from open_clip.tokenizer import SimpleTokenizer

    reference = SimpleTokenizer()
    ours = clip_tokenizer()
    expected = [reference.sot_token_id, *reference.encode(text), reference.eot_token_id]
    assert ours(text).input_ids == expected


def test_tokenizer_vocabulary_and_padding():
    tok = clip_tokenizer()
    assert len(tok) == CLIP_VOCAB_SIZE
    assert tok.model_max_length == 77
    assert (tok.bos_token_id, tok.eos_token_id) == (49406, 49407)
    ids = tok("a cat", padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    assert len(ids) == 77 and ids[:4] == [49406, 320, 2368, 49407] and set(ids[4:]) == {49407}
    long = tok("cat " * 200, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(long) == 77 and long[-1] == 49407
    assert clip_tokenizer(pad_token="!").pad_token_id == 0


def test_bytes_to_unicode_is_a_bijection_onto_printable_chars():
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256))
    assert len(set(mapping.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in mapping.values())
    assert mapping[ord("a")] == "a" and mapping[ord(" ")] == "Ġ"


def test_tokenizer_dir_is_deterministic_and_safe_concurrently(tmp_path):
    results: list = []
    errors: list = []

    def work():
        try:
            results.append(clip_tokenizer_dir(tmp_path / "a"))
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    folder = results[0]
    # No temporary folders left behind; a second, independent cache holds the same bytes.
    assert [p.name for p in (tmp_path / "a").iterdir()] == [folder.name]
    other = clip_tokenizer_dir(tmp_path / "b")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (other / name).read_bytes()


# --- pipelines ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ip_adapter", ADAPTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_generates_with_ip_adapter_images(kind, ip_adapter, refs):
    pipe = tiny_pipeline(kind, ip_adapter=ip_adapter, num_adapters=2, seed=0)
    assert isinstance(pipe, StableDiffusionPipeline if kind == "sd15" else StableDiffusionXLPipeline)
    procs = _ip_processors(pipe)
    n_tokens = IP_ADAPTER_NUM_TOKENS[ip_adapter]
    assert len(procs) == NUM_IP_LAYERS[kind]
    assert {tuple(p.num_tokens) for p in procs.values()} == {(n_tokens, n_tokens)}
    assert all(p.to_k_ip[0].weight.shape[1] == pipe.unet.config.cross_attention_dim for p in procs.values())
    # At least 2 heads in every IP layer.
    assert all(pipe.unet.get_submodule(k.removesuffix(".processor")).heads >= 2 for k in procs)
    proj_type = ImageProjection if ip_adapter == "base" else IPAdapterPlusImageProjection
    assert all(isinstance(layer, proj_type) for layer in pipe.unet.encoder_hid_proj.image_projection_layers)
    assert pipe.safety_checker is None if kind == "sd15" else True

    images = [refs[:2], refs[2:]]  # two adapters, two reference images each: 2 * n_tokens image tokens per adapter
    cfg = _generate(pipe, ip_adapter_image=images, guidance_scale=5.0)
    no_cfg = _generate(pipe, ip_adapter_image=images, guidance_scale=1.0)
    batch = _generate(pipe, ip_adapter_image=images, num_images_per_prompt=2)
    prompts = _generate(pipe, prompt=["a flower", "a temple"], ip_adapter_image=images)
    wide = _generate(pipe, ip_adapter_image=images, height=64, width=96, num_inference_steps=3)
    assert cfg.shape == no_cfg.shape == (1, 64, 64, 3)
    assert batch.shape == prompts.shape == (2, 64, 64, 3)
    assert wide.shape == (1, 64, 96, 3)
    for out in (cfg, no_cfg, batch, prompts, wide):
        assert np.isfinite(out).all() and out.std() > 1e-3
    assert not np.array_equal(cfg, no_cfg)
    assert not np.array_equal(prompts[0], prompts[1])
    # The reference images reach the UNet: other images, another output.
    assert not np.array_equal(cfg, _generate(pipe, ip_adapter_image=[refs[2:], refs[:2]], guidance_scale=5.0))


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_weights_and_output(kind, refs):
    a = tiny_pipeline(kind, ip_adapter="plus", num_adapters=2, seed=3)
    b = tiny_pipeline(kind, ip_adapter="plus", num_adapters=2, seed=3)
    c = tiny_pipeline(kind, ip_adapter="plus", num_adapters=2, seed=4)
    wa, wb, wc = _all_weights(a), _all_weights(b), _all_weights(c)
    assert wa.keys() == wb.keys() == wc.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Every randomly initialised tensor changes with the seed (norm weights, zero biases and buffers are constant).
    random_init = [k for k, v in wa.items() if v.is_floating_point() and v.numel() > 1 and v.std() > 0]
    assert len(random_init) > 100
    assert all(not torch.equal(wa[k], wc[k]) for k in random_init)
    # Two adapters of one pipeline are drawn from different seeds.
    proc = next(iter(_ip_processors(a).values()))
    assert not torch.equal(proc.to_k_ip[0].weight, proc.to_k_ip[1].weight)
    images = [refs[:1], refs[1:3]]
    np.testing.assert_array_equal(_generate(a, ip_adapter_image=images), _generate(b, ip_adapter_image=images))


def test_global_rng_untouched():
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    tiny_pipeline("sdxl", ip_adapter="plus", num_adapters=2)
    default_reference_images(3)
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    assert torch.equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    assert before[2] == after[2]


def test_state_dict_layout_matches_diffusers_loader():
    pipe = tiny_pipeline("sd15", ip_adapter="plus")
    state = tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, "plus", seed=0)
    # Published Plus checkpoints fuse keys and values of the resampler and number cross-attention layers 1, 3, 5...
    assert "layers.0.0.to_kv.weight" in state["image_proj"] and "latents" in state["image_proj"]
    assert state["image_proj"]["latents"].shape[1] == IP_ADAPTER_NUM_TOKENS["plus"]
    assert sorted(int(k.split(".")[0]) for k in state["ip_adapter"] if k.endswith("to_k_ip.weight")) == list(
        range(1, 2 * NUM_IP_LAYERS["sd15"], 2)
    )
    # What diffusers loaded is exactly what we made (seed 0 is adapter 0's seed).
    loaded = pipe.unet.encoder_hid_proj.image_projection_layers[0].state_dict()
    to_k, to_v = state["image_proj"]["layers.0.0.to_kv.weight"].chunk(2)
    assert torch.equal(loaded["layers.0.attn.to_k.weight"], to_k)
    assert torch.equal(loaded["layers.0.attn.to_v.weight"], to_v)
    first = next(iter(_ip_processors(pipe).values()))
    assert torch.equal(first.to_k_ip[0].weight, state["ip_adapter"]["1.to_k_ip.weight"])


@pytest.mark.parametrize("kind", KINDS)
def test_set_scale_and_unload(kind, refs):
    pipe = tiny_pipeline(kind, ip_adapter="base", num_adapters=2)
    images = [refs[:2], refs[2:3]]
    full = _generate(pipe, ip_adapter_image=images)
    pipe.set_ip_adapter_scale([0.0, 0.0])
    assert all(p.scale == [0.0, 0.0] for p in _ip_processors(pipe).values())
    off = _generate(pipe, ip_adapter_image=images)
    assert not np.array_equal(full, off)
    pipe.set_ip_adapter_scale([1.0, 1.0])
    np.testing.assert_array_equal(full, _generate(pipe, ip_adapter_image=images))

    pipe.unload_ip_adapter()
    assert not _ip_processors(pipe)
    assert pipe.unet.encoder_hid_proj is None and pipe.image_encoder is None
    plain = _generate(pipe)
    # With scale 0 the image branch adds exactly 0 * (finite) to every IP layer.
    np.testing.assert_allclose(plain, off, atol=1e-6)


def test_dtype_and_bad_arguments():
    pipe = tiny_pipeline("sd15", dtype="bfloat16")
    assert {p.dtype for p in pipe.unet.parameters()} == {torch.bfloat16}
    assert pipe.image_encoder.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="one of 'sd15', 'sdxl'"):
        tiny_pipeline("sd3")
    with pytest.raises(ValueError, match="one of 'base', 'plus'"):
        tiny_pipeline("sd15", ip_adapter="full")
    with pytest.raises(ValueError, match="num_adapters"):
        tiny_pipeline("sd15", num_adapters=0)
    with pytest.raises(ValueError, match="seed"):
        tiny_pipeline("sd15", seed=-1)
    with pytest.raises(TypeError, match="seed"):
        tiny_pipeline("sd15", seed=1.5)
    with pytest.raises(TypeError, match="dtype"):
        tiny_pipeline("sd15", dtype="float17")


# --- reference images ---------------------------------------------------------------------------------------------


def test_default_reference_images():
    two = default_reference_images()
    assert [im.size for im in two] == [(640, 427), (640, 427)]
    assert all(im.mode == "RGB" for im in two)
    five = default_reference_images(5)
    arrays = [np.asarray(im) for im in five]
    np.testing.assert_array_equal(arrays[0], np.asarray(two[0]))
    assert all(
        not np.array_equal(arrays[i], arrays[j])
        for i in range(5)
        for j in range(i)
        if arrays[i].shape == arrays[j].shape
    )
    again = default_reference_images(5)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(arrays, again, strict=True))
    assert {im.size for im in default_reference_images(3, size=32)} == {(32, 32)}
    assert {im.size for im in default_reference_images(3, size=(40, 24))} == {(40, 24)}
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="n to be"):
            default_reference_images(bad)
    with pytest.raises(ValueError, match="size"):
        default_reference_images(2, size=(32,))


# --- save / load --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "ip_adapter"), [("sd15", "base"), ("sdxl", "plus")])
def test_save_and_load_by_path_round_trip(kind, ip_adapter, tmp_path, monkeypatch, refs):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    saved = save_tiny_pipeline(tmp_path, kind=kind, ip_adapter=ip_adapter, seed=5)
    assert isinstance(saved, SavedTinyPipeline)
    assert saved.model_dir == tmp_path / "model" and (saved.model_dir / "model_index.json").is_file()
    assert (saved.model_dir / "image_encoder").is_dir() and (saved.model_dir / "feature_extractor").is_dir()
    assert saved.weight_file == tmp_path / "ip_adapter" / "ip-adapter.safetensors" and saved.weight_file.is_file()
    with safe_open(saved.weight_file, framework="pt") as f:
        prefixes = {key.split(".")[0] for key in f.keys()}
    assert prefixes == {"image_proj", "ip_adapter"}

    cls = StableDiffusionPipeline if kind == "sd15" else StableDiffusionXLPipeline
    loaded = cls.from_pretrained(saved.model_dir, local_files_only=True)
    loaded.load_ip_adapter(
        str(saved.ip_adapter_dir), subfolder="", weight_name=saved.weight_name, image_encoder_folder=None
    )
    loaded.set_progress_bar_config(disable=True)
    memory = tiny_pipeline(kind, ip_adapter=ip_adapter, seed=5)
    assert _all_weights(loaded).keys() == _all_weights(memory).keys()
    assert all(torch.equal(v, _all_weights(memory)[k]) for k, v in _all_weights(loaded).items())
    images = [refs[:2]]
    expected = _generate(memory, ip_adapter_image=images)
    # Straight from the memory-mapped files the weights may sit at unaligned addresses, which sends CPU BLAS down
    # another path (last-bit differences); copied into fresh memory, the output is bit-identical.
    np.testing.assert_allclose(_generate(loaded, ip_adapter_image=images), expected, atol=1e-5)
    np.testing.assert_array_equal(_generate(realign_weights(loaded), ip_adapter_image=images), expected)
    # The convenience loader takes the same path.
    np.testing.assert_array_equal(
        _generate(saved.load(), ip_adapter_image=images, guidance_scale=1.0),
        _generate(memory, ip_adapter_image=images, guidance_scale=1.0),
    )
