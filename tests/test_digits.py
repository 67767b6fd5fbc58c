"""The digits organism: rendering, the shipped weights' loading path and layout, their quality, and training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0
from safetensors.torch import load_file
from scipy import ndimage
from transformers import CLIPTextModel, CLIPVisionModelWithProjection

from ipa_probe.tiny import digits as D


@pytest.fixture(scope="module")
def organism():
    return D.digits_pipeline()


def test_rendering_matches_an_independent_bilinear_upsampling():
    from sklearn.datasets import load_digits

    images, labels = D.digit_images()
    raw = load_digits()
    assert images.shape == (1797, 16, 16) and images.dtype == np.uint8
    assert np.array_equal(labels, raw.target)
    # bilinear with half-pixel centres (align_corners=False) == scipy's order-1 zoom on a grid-mode mapping
    expected = ndimage.zoom(raw.images[:50] * (255 / 16), (1, 2, 2), order=1, mode="nearest", grid_mode=True)
    assert np.abs(images[:50].astype(float) - expected).max() <= 1.0


def test_reference_images_are_held_out_images_of_the_digit():
    images, labels = D.digit_images()
    refs = D.digits_reference_images(7, 4, seed=3)
    assert len(refs) == 4 and all(r.size == (16, 16) and r.mode == "RGB" for r in refs)
    rows = []
    for ref in refs:
        grey = np.asarray(ref)[..., 0]
        (match,) = np.flatnonzero((images == grey).all(axis=(1, 2)))
        rows.append(match)
    assert all(i >= D.TRAIN_SIZE and labels[i] == 7 for i in rows) and len(set(rows)) == 4
    assert [np.asarray(r).tolist() for r in refs] == [
        np.asarray(r).tolist() for r in D.digits_reference_images(7, 4, 3)
    ]
    with pytest.raises(ValueError, match="digit"):
        D.digits_reference_images(10, 2)
    with pytest.raises(ValueError, match="held-out"):
        D.digits_reference_images(1, 500)


def test_classifier_is_accurate_on_held_out_digits_and_on_the_rendering():
    clf, accuracy = D.digit_classifier()
    images, labels = D.digit_images()
    held_out = labels[D.TRAIN_SIZE :]
    from sklearn.datasets import load_digits

    x = load_digits().data[D.TRAIN_SIZE :]
    assert accuracy == pytest.approx(float((clf.predict(x) == held_out).mean())) and accuracy > 0.85
    # the 16x16 rendering, downsampled back through the generated-image path, is still classified right
    rgb = np.repeat(images[D.TRAIN_SIZE :, :, :, None], 3, axis=-1) / 255.0
    predicted, probs = D.classify_digit_images(rgb)
    assert (predicted == held_out).mean() > 0.85 and np.allclose(probs.sum(1), 1)


def test_shipped_pipeline_is_a_real_sd15_pipeline_with_an_ip_adapter(organism):
    pipe = organism
    assert isinstance(pipe, StableDiffusionPipeline)
    assert isinstance(pipe.vae, AutoencoderKL) and isinstance(pipe.unet, UNet2DConditionModel)
    assert isinstance(pipe.text_encoder, CLIPTextModel)
    assert isinstance(pipe.image_encoder, CLIPVisionModelWithProjection)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in pipe.unet.parameters())
    assert pipe.unet.config.down_block_types[-1] == "DownBlock2D" and pipe.unet.config.up_block_types[0] == "UpBlock2D"
    ip = [p for n, p in pipe.unet.attn_processors.items() if n.endswith("attn2.processor")]
    assert len(ip) == 10 and all(isinstance(p, IPAdapterAttnProcessor2_0) for p in ip)
    # the processors hold exactly the shipped file's tensors, numbered 1, 3, 5, ... in attn_processors order
    shipped = load_file(str(D.DIGITS_WEIGHTS / "ip_adapter" / D.WEIGHT_NAME))
    for n, proc in enumerate(ip):
        assert torch.equal(proc.to_k_ip[0].weight, shipped[f"ip_adapter.{2 * n + 1}.to_k_ip.weight"])
        assert torch.equal(proc.to_v_ip[0].weight, shipped[f"ip_adapter.{2 * n + 1}.to_v_ip.weight"])
    record = json.loads((D.DIGITS_WEIGHTS / "record.json").read_text())
    assert record["finished"] and pipe.vae.config.scaling_factor == pytest.approx(record["scaling_factor"])
    assert pipe._progress_bar_config == {"disable": False}  # progress bar on


def _tokens_by_hand(pipe, refs):
    """Image tokens recomputed from the shipped file: Linear -> (n, 4, 32) -> LayerNorm, as ImageProjection."""
    shipped = load_file(str(D.DIGITS_WEIGHTS / "ip_adapter" / D.WEIGHT_NAME))
    pixels = pipe.feature_extractor(refs, return_tensors="pt").pixel_values
    embeds = pipe.image_encoder(pixels).image_embeds  # (n, 32)
    tokens = F.linear(embeds, shipped["image_proj.proj.weight"], shipped["image_proj.proj.bias"]).view(-1, 4, 32)
    tokens = F.layer_norm(tokens, (32,), shipped["image_proj.norm.weight"], shipped["image_proj.norm.bias"])
    return embeds, tokens.reshape(1, -1, 32)  # (1, 4n, 32): references' tokens concatenated


@torch.no_grad()
def test_training_path_equals_the_pipeline_path_and_zero_tokens_equal_scale_zero(organism):
    pipe = organism
    refs = D.digits_reference_images(2, 3)
    embeds, tokens = _tokens_by_hand(pipe, refs)
    text = D.loop.prompt_states(pipe.text_encoder, D.DIGITS_PROMPT)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor(500)
    loaded = pipe.unet(x, t, encoder_hidden_states=text, added_cond_kwargs={"image_embeds": [embeds[None]]}).sample
    proj = pipe.unet.encoder_hid_proj
    try:
        pipe.unet.encoder_hid_proj = None  # the training call: (text, [tokens]) straight to the IP processors
        trained = pipe.unet(x, t, encoder_hidden_states=(text, [tokens])).sample
        zero = pipe.unet(x, t, encoder_hidden_states=(text, [torch.zeros_like(tokens)])).sample
    finally:
        pipe.unet.encoder_hid_proj = proj
    torch.testing.assert_close(trained, loaded, rtol=1e-5, atol=1e-5)
    pipe.set_ip_adapter_scale(0.0)
    try:
        scale0 = pipe.unet(x, t, encoder_hidden_states=text, added_cond_kwargs={"image_embeds": [embeds[None]]}).sample
    finally:
        pipe.set_ip_adapter_scale(1.0)
    torch.testing.assert_close(zero, scale0, rtol=1e-5, atol=1e-5)
    assert (trained - scale0).abs().max() > 1e-3  # the adapter does something


def test_train_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="steps"):
        D.DigitsTrainConfig(steps=0)
    with pytest.raises(ValueError, match="drop_embeds"):
        D.DigitsTrainConfig(drop_embeds=0.6, drop_tokens=0.5)


@pytest.mark.slow
def test_training_resumes_to_the_same_weights(tmp_path):
    config = D.DigitsTrainConfig(vae_steps=3, encoder_steps=2, steps=3, batch=4, checkpoint_every=1, threads=1)
    straight = D.train_digits(tmp_path / "a", config, progress=False)
    first = D.train_digits(tmp_path / "b", config, progress=False, stop_after=2)  # stops inside the VAE stage
    assert first["finished"] is False and first["stage"] == "vae"
    second = D.train_digits(tmp_path / "b", config, progress=False, stop_after=4)  # VAE, encoder, 1 UNet step
    assert second["finished"] is False and second["stage"] == "unet" and second["step"] == 1
    resumed = D.train_digits(tmp_path / "b", config, progress=False)
    assert resumed["finished"] and resumed["resumed"] == 2 and straight["resumed"] == 0
    assert resumed["final_losses"] == straight["final_losses"]
    accuracy = resumed["encoder_pretraining_train_accuracy"]  # measured in the second call, carried by the checkpoint
    assert accuracy is not None and accuracy == straight["encoder_pretraining_train_accuracy"]
    for sub in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        a, b = load_file(str(tmp_path / "a" / "model" / sub)), load_file(str(tmp_path / "b" / "model" / sub))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a = load_file(str(tmp_path / "a" / "ip_adapter" / D.WEIGHT_NAME))
    b = load_file(str(tmp_path / "b" / "ip_adapter" / D.WEIGHT_NAME))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "b" / "loss.png").stat().st_size > 1000
    with pytest.raises(D.CheckpointError, match="other settings"):
        D.train_digits(tmp_path / "b", D.DigitsTrainConfig(vae_steps=4, steps=3, batch=4), progress=False)
    # what was trained loads through diffusers' own path
    pipe = D.digits_pipeline(tmp_path / "b")
    assert pipe.unet.encoder_hid_proj is not None


def test_shipped_weights_are_a_clean_run_of_the_default_recipe():
    record = json.loads((D.DIGITS_WEIGHTS / "record.json").read_text())
    assert record["finished"] and record["resumed"] == 0
    assert record["config"] == D.DigitsTrainConfig().to_dict()


@pytest.mark.slow
def test_train_digits_command_writes_a_loadable_organism(tmp_path, capsys):
    from ipa_probe.cli import main

    out = tmp_path / "organism"
    argv = ["train-digits", "--out", str(out), "--no-progress", "--threads", "1"]
    # the smallest stages the command takes (the image encoder's pretraining defaults to 300 steps)
    sizes = ["--vae-steps", "1", "--encoder-steps", "1", "--steps", "2", "--batch", "4", "--checkpoint-every", "1"]
    assert main([*argv, *sizes]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["steps"] == 2 and record["config"]["threads"] == 1 and record["resumed"] == 0
    assert record["config"]["encoder_steps"] == 1
    printed = capsys.readouterr().out
    assert f"{record['final_losses']['unet']:.4f}" in printed and str(out) in printed
    trained, shipped = D.digits_pipeline(out).unet.config, D.digits_pipeline().unet.config
    assert {k: v for k, v in trained.items() if not k.startswith("_")} == {
        k: v for k, v in shipped.items() if not k.startswith("_")
    }  # the shipped architecture


# --------------------------------------------------------------------------- the CLI on the organism


def _box_probabilities(path) -> np.ndarray:
    """The digit classifier's probabilities for a saved PNG, downsampled independently of classify_digit_images
    (PIL's box filter to 8 x 8 instead of its reshape-mean)."""
    from PIL import Image

    rgb = np.asarray(Image.open(path).convert("RGB"))
    grey = Image.fromarray(rgb.mean(-1).astype(np.float32), mode="F")
    small = np.asarray(grey.resize((8, 8), Image.Resampling.BOX), dtype=float) / 255 * 16
    return D.digit_classifier()[0].predict_proba(small.reshape(1, 64))[0]


def test_probe_with_no_model_arguments_probes_the_organism(tmp_path, capsys):
    import pandas as pd
    from PIL import Image

    from ipa_probe.cli import main

    out = tmp_path / "demo"
    assert main(["probe", "--out", str(out), "--steps", "3"]) == 0
    row = Image.open(out / "references_and_output.png")
    assert row.width > 3 * row.height  # 3 references and the 8 generated digits side by side, two title lines
    assert {Image.open(out / f"image_{i}.png").size for i in range(8)} == {(16, 16)}
    assert not (out / "image_8.png").exists()
    record = json.loads((out / "summary.json").read_text())
    assert record["run"]["model"] == "embedded digits organism (trained)" and record["run"]["digit"] == 3
    assert record["run"]["prompt"] == D.DIGITS_PROMPT and record["run"]["references"] == 3
    assert record["run"]["num_images"] == 8
    table = pd.read_parquet(out / "probe.parquet")
    assert table["layer"].nunique() == 10 and table["step"].nunique() == 3
    printed = capsys.readouterr().out
    assert "references_and_output.png" in printed
    # the classifier's verdict on each saved image, recomputed from the PNGs
    verdict = json.loads((out / "digits.json").read_text())
    probs = np.stack([_box_probabilities(out / f"image_{i}.png") for i in range(8)])
    assert verdict["predicted"] == probs.argmax(1).tolist()
    assert verdict["right"] == int((probs.argmax(1) == 3).sum()) and verdict["images"] == 8
    np.testing.assert_allclose(verdict["confidence_in_digit"], probs[:, 3], atol=1e-4)
    assert f"{verdict['right']} of 8 images drawn as 3" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["probe", "--digit", "12"], "--digit"),
        (["probe", "--variant", "plus"], "base IP-Adapter only"),
        (["train-digits", "--steps", "0"], "steps"),
        (["probe", "--num-images", "0"], "num-images"),
    ],
)
def test_organism_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, message):
    from ipa_probe.cli import main

    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_compare_on_the_organism_scores_the_methods_with_the_digit_classifier(tmp_path):
    from helpers import write_tiny_clip

    from ipa_probe.cli import main

    clip = write_tiny_clip(tmp_path / "clip")
    out = tmp_path / "cmp"
    argv = ["compare", "--out", str(out), "--steps", "4", "--seeds", "0", "1", "--digit", "4"]
    assert main([*argv, "--clip-model", clip]) == 0
    record = json.loads((out / "compare.json").read_text())
    assert record["settings"]["digit"] == 4
    for row in record["per_image"]:
        if row["method"] == "vae_roundtrip":
            continue
        probs = _box_probabilities(out / "images" / f"{row['method']}_seed{row['seed']}.png")
        assert row["digit_confidence"] == pytest.approx(probs[4], abs=1e-4)
        assert row["digit_right"] == float(probs.argmax() == 4)
    table = {row["method"]: row for row in record["table"]}
    assert set(table) == {"ip_adapter", "nw_head", "exact", "vae_roundtrip"}
    for method, row in table.items():
        values = [r["digit_right"] for r in record["per_image"] if r["method"] == method]
        assert row["digit_right"] == pytest.approx(np.mean(values))


# ------------------------------------------------------------ the scorer reads the references and their round trip
def _box_label_and_p(image, digit: int) -> tuple[int, float]:
    """The classifier's label and P(digit) of a PIL image, downsampled here with PIL's box filter."""
    from PIL import Image

    rgb = np.asarray(image.convert("RGB"), dtype=np.float64)
    grey = Image.fromarray(rgb.mean(-1).astype(np.float32), mode="F")
    small = np.asarray(grey.resize((8, 8), Image.Resampling.BOX), dtype=float) / 255 * 16
    clf = D.digit_classifier()[0]
    probs = clf.predict_proba(small.reshape(1, 64))[0]
    return int(clf.classes_[probs.argmax()]), float(probs[list(clf.classes_).index(digit)])


@torch.no_grad()
def _own_roundtrip(pipe, images) -> list:
    """The references through the organism's VAE, by the test's own calls: posterior mode, decode, to [0, 255]."""
    from PIL import Image

    x = torch.stack([torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0) for im in images])
    x = x.permute(0, 3, 1, 2) * 2 - 1  # (N, 3, H, W) in [-1, 1]
    z = pipe.vae.encode(x).latent_dist.mode()
    y = ((pipe.vae.decode(z).sample.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()  # (N, H, W, 3)
    return [Image.fromarray(np.round(a * 255).astype(np.uint8)) for a in y]


def test_the_scorer_reports_the_reading_of_the_references_and_their_round_trip(organism):
    import pandas as pd

    from ipa_probe.compare import ROUNDTRIP, Comparison, vae_roundtrip

    digit = 3
    refs = D.digits_reference_images(digit, 3, seed=0)
    roundtrip = vae_roundtrip(organism, refs, 16, 16)
    images = {"exact": list(refs[:2])}  # a method that copies its references
    per = pd.DataFrame({"method": ["exact", "exact", ROUNDTRIP, ROUNDTRIP, ROUNDTRIP], "seed": [0, 1, -1, -1, -1]})
    table = pd.DataFrame({"method": ["exact", ROUNDTRIP]})
    comparison = Comparison(refs, [0, 1], images, per, table, {}, roundtrip)
    D.add_digit_scores(comparison, digit)
    own = {
        "references": [_box_label_and_p(im, digit) for im in refs],
        ROUNDTRIP: [_box_label_and_p(im, digit) for im in _own_roundtrip(organism, refs)],
    }
    readings = comparison.settings["digit_readings"]
    for name, expected in own.items():
        assert readings[name]["labels"] == [label for label, _ in expected]
        # tolerance: the box filter and the reshape-mean differ only in float rounding; 1e-3 in a probability
        np.testing.assert_allclose(readings[name]["p_digit"], [p for _, p in expected], atol=1e-3)
    right = np.mean([label == digit for label, _ in own["references"]])
    assert (comparison.table["references_read_right"] == right).all()  # beside every row's score
    assert (comparison.table["roundtrip_read_right"] == np.mean([lab == digit for lab, _ in own[ROUNDTRIP]])).all()
    line = D.evaluate.digit_readings_line(comparison)
    assert str(readings["references"]["labels"]) in line and "round trip" in line


def test_the_rates_come_with_the_reading_of_the_references_and_their_round_trip(organism):
    result = D.evaluate_digits(organism, samples_per_digit=1, num_inference_steps=2, guidance_scale=1.0, seed=4)
    labels, round_labels, targets = [], [], []
    for digit in range(10):
        refs = D.digits_reference_images(digit, 3, seed=4)
        labels += [_box_label_and_p(im, digit)[0] for im in refs]
        round_labels += [_box_label_and_p(im, digit)[0] for im in _own_roundtrip(organism, refs)]
        targets += [digit] * 3
    labels, round_labels, targets = map(np.array, (labels, round_labels, targets))
    np.testing.assert_array_equal(result["reference_labels"], labels)
    np.testing.assert_array_equal(result["roundtrip_labels"], round_labels)
    assert result["references_read_right"] == pytest.approx(np.mean(labels == targets))
    assert result["roundtrip_read_right"] == pytest.approx(np.mean(round_labels == targets))
    for d in range(10):
        assert result["roundtrip_read_right_per_digit"][d] == pytest.approx(np.mean(round_labels[targets == d] == d))


def test_the_per_digit_table_in_the_docs_is_the_records():
    """docs/organism.md's per-digit rates are those of docs/results/digits/<recipe>/per_digit.json, rounded."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "organism.md").read_text()
    rows = {}
    for line in page.splitlines():
        match = re.match(r"\| (`support`: right digit|`ip-adapter`: right digit|`mixed`: right digit"
                         r"|references read as their digit"
                         r"|their VAE round trip read so) \|(.*)\|$", line)  # fmt: skip
        if match:
            rows[match.group(1)] = [float(c.strip().strip("*").rstrip("%")) for c in match.group(2).split("|")]
    assert len(rows) == 5
    for recipe in ("support", "ip-adapter", "mixed"):
        record = json.loads((root / "docs/results/digits" / recipe / "per_digit.json").read_text())
        rates = record["rates"]["adapter on, CFG 3"]
        want = [100 * rates["per_digit"][str(d)]["mean"] for d in range(10)] + [100 * rates["rate"]["mean"]]
        # the page rounds to whole percent (the overall rate to 0.1%)
        np.testing.assert_allclose(rows[f"`{recipe}`: right digit"], want, atol=0.5)
        for label, key in (("references read as their digit", "references_read_right"),
                           ("their VAE round trip read so", "roundtrip_read_right")):  # fmt: skip
            read = [100 * rates[f"{key}_per_digit"][str(d)] for d in range(10)] + [100 * rates[key]["mean"]]
            np.testing.assert_allclose(rows[label], read, atol=0.5)
