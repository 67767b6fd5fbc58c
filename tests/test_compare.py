"""The comparison: scores against hand computations, the CLIP scorer offline, the files, and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from diffusers import DDIMScheduler
from helpers import write_tiny_clip
from PIL import Image

from ipa_probe.capture.spine import spine_of
from ipa_probe.cli import main
from ipa_probe.compare import (
    METHODS,
    ROUNDTRIP,
    ClipScorer,
    Comparison,
    compare_methods,
    diversity,
    make_grid,
    markdown_table,
    score_method,
)
from ipa_probe.tiny.sd import default_reference_images, tiny_pipeline


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny open_clip model as a ``local-dir:`` folder (config only: random weights)."""
    return write_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


# --------------------------------------------------------------------------- scores


def test_scores_match_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    refs = torch.nn.functional.normalize(torch.randn(4, 8, generator=gen), dim=-1)
    made = torch.nn.functional.normalize(torch.randn(3, 8, generator=gen), dim=-1)
    made[0] = refs[2]  # a copy of reference 2
    ref_pix, made_pix = torch.rand(4, 12, generator=gen).double(), torch.rand(3, 12, generator=gen).double()
    made_pix[0] = ref_pix[2]
    scores = score_method(made, refs, made_pix, ref_pix)
    r, m = refs.double().numpy(), made.double().numpy()
    mean = r.mean(0) / np.linalg.norm(r.mean(0))
    for i in range(3):
        np.testing.assert_allclose(scores["clip_i_nearest"][i], max(m[i] @ r[j] for j in range(4)), rtol=1e-12)
        np.testing.assert_allclose(scores["clip_i_mean"][i], m[i] @ mean, rtol=1e-12)
        rms = [np.sqrt(np.mean((made_pix[i].numpy() - ref_pix[j].numpy()) ** 2)) for j in range(4)]
        np.testing.assert_allclose(scores["pixel_nearest"][i], min(rms), rtol=1e-10, atol=1e-12)
        assert scores["nearest_reference"][i] == int(np.argmin(rms))
    assert scores["clip_i_nearest"][0] == pytest.approx(1.0) and scores["pixel_nearest"][0] == pytest.approx(0.0)


def test_diversity():
    e = torch.eye(3)
    assert diversity(e) == pytest.approx(1.0)  # orthogonal: cosine distance 1
    assert diversity(torch.ones(4, 2) / math.sqrt(2)) == pytest.approx(0.0, abs=1e-6)  # identical images
    assert math.isnan(diversity(e[:1]))
    x = torch.nn.functional.normalize(torch.randn(5, 6), dim=-1)
    pairs = [1 - float(x[a] @ x[b]) for a in range(5) for b in range(a + 1, 5)]
    assert diversity(x) == pytest.approx(np.mean(pairs))


def test_markdown_table():
    table = pd.DataFrame(
        {"method": ["a", "b"], "images": [2, 2], "score": [0.5, math.nan], "score_std": [0.25, math.nan]}
    )
    lines = markdown_table(table, digits=2).splitlines()
    assert lines[0] == "| method | images | score |" and lines[1] == "|---|---|---|"
    assert lines[2] == "| a | 2 | 0.50 ± 0.25 |" and lines[3] == "| b | 2 | n/a |"


def test_grid_layout():
    refs = [Image.new("RGB", (16, 16), (255, 0, 0))] * 2
    images = {m: [Image.new("RGB", (16, 16), (0, 0, 255))] * 3 for m in METHODS}
    grid = make_grid(refs, images, [0, 1, 2])
    with_roundtrip = make_grid(refs, images, [0, 1, 2], roundtrip=refs)
    assert grid.mode == "RGB" and with_roundtrip.height > grid.height and with_roundtrip.width == grid.width
    pixels = np.asarray(grid)
    # four rows of equal height: the references inside the first fifth, none below 3/10 (the rows' margins vary)
    top, bottom = pixels[: grid.height // 5], pixels[3 * grid.height // 10 :]
    red = (top[..., 0] > 200) & (top[..., 2] < 50)
    blue = (bottom[..., 2] > 200) & (bottom[..., 0] < 50)
    assert red.any() and blue.any() and not ((bottom[..., 0] > 200) & (bottom[..., 2] < 50)).any()


# --------------------------------------------------------------------------- the CLIP scorer


def test_random_clip_is_seeded_offline_and_says_so(tiny_clip):
    images = default_reference_images(3, size=40)
    state = torch.random.get_rng_state()
    a = ClipScorer(tiny_clip, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    emb = a.embed(images)
    assert emb.shape == (3, 16) and torch.allclose(emb.norm(dim=-1), torch.ones(3))
    assert torch.equal(emb, ClipScorer(tiny_clip, seed=0).embed(images))
    assert not torch.equal(emb, ClipScorer(tiny_clip, seed=1).embed(images))
    assert a.random_weights and "random weights" in a.describe()["clip_note"]


def test_a_local_checkpoint_is_loaded(tiny_clip, tmp_path):
    from safetensors.torch import save_file

    images = default_reference_images(2, size=40)
    source = ClipScorer(tiny_clip, seed=5)
    folder = tmp_path / "with_weights"
    write_tiny_clip(folder)
    save_file(
        {k: v.contiguous() for k, v in source.model.state_dict().items()}, folder / "open_clip_model.safetensors"
    )
    loaded = ClipScorer(f"local-dir:{folder}", seed=0)  # the seed no longer matters: the weights are the file's
    assert not loaded.random_weights and "clip_note" not in loaded.describe()
    torch.testing.assert_close(loaded.embed(images), source.embed(images))


def test_clip_errors_name_the_remedy(tmp_path):
    with pytest.raises(ValueError, match="open_clip knows no model"):
        ClipScorer("ViT-Q-99")
    with pytest.raises(ValueError, match="local checkpoint file"):
        ClipScorer("ViT-S-32", pretrained=str(tmp_path / "missing.pt"))


# --------------------------------------------------------------------------- the comparison


def test_compare_methods_on_the_tiny_pipeline(tiny_clip, tmp_path, capsys):
    pipe = tiny_pipeline("sd15")
    bar_settings = dict(pipe._progress_bar_config)
    # DDIM that ends on alpha = 1 (no residual noise in the last step), so the exact denoiser's final latent is its
    # last x0-prediction: one reference latent exactly.
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, set_alpha_to_one=True)
    refs = default_reference_images(2)
    processors, unet, seen = dict(pipe.unet.attn_processors), pipe.unet, []
    hooks = (dict(unet._forward_pre_hooks), dict(unet._forward_hooks))

    def during(module, args):  # on a submodule: the hooks the denoiser carries beyond its own at each of its passes
        seen.append((len(unet._forward_pre_hooks) - len(hooks[0]), len(unet._forward_hooks) - len(hooks[1])))
        seen[-1] += (spine_of(pipe) is not None,)

    handle = unet.conv_in.register_forward_pre_hook(during)
    try:
        result = compare_methods(
            pipe, refs, seeds=[3, 4], call_kwargs={"num_inference_steps": 3}, scorer=ClipScorer(tiny_clip)
        )
    finally:
        handle.remove()
    assert all(pipe.unet.attn_processors[k] is v for k, v in processors.items())  # the swap was undone
    assert (dict(unet._forward_pre_hooks), dict(unet._forward_hooks)) == hooks  # the very hooks it had, no more
    # the twin's 12 passes (the learned method's and the NW head's) carry no hook but a spine's one pre-hook and one
    # forward hook where a feature attached one (compare's progress bar none)
    assert len(seen) == 12 and all(pre == post == spine for pre, post, spine in seen), seen
    # one labelled bar per method, counting its denoising steps over both seeds; the pipeline's own bar settings back
    bars = [line.split("\r")[-1] for line in capsys.readouterr().err.strip().split("\n")]
    assert [bar.split(":")[0] for bar in bars] == list(METHODS) and all("6/6" in bar for bar in bars), bars
    assert pipe._progress_bar_config == bar_settings
    assert list(result.table["method"]) == [*METHODS, ROUNDTRIP]
    assert list(result.images) == list(METHODS) and all(len(v) == 2 for v in result.images.values())
    assert len(result.per_image) == 3 * 2 + len(refs)
    table = result.table.set_index("method")
    # The learned and the NW head differ; the exact denoiser copies a reference latent, so its pixel distance is the
    # VAE round trip's (the memorisation floor) and its images equal round-trip images.
    assert not np.array_equal(np.asarray(result.images["ip_adapter"][0]), np.asarray(result.images["nw_head"][0]))
    roundtrip = [np.asarray(im, dtype=float) for im in result.roundtrip]
    for image in result.images["exact"]:
        assert min(np.abs(np.asarray(image, dtype=float) - r).mean() for r in roundtrip) < 2.0  # 8-bit levels
    assert table.loc["exact", "pixel_nearest"] == pytest.approx(table.loc[ROUNDTRIP, "pixel_nearest"], abs=0.02)
    assert np.isfinite(table.loc[list(METHODS), ["clip_i_nearest", "clip_i_mean", "diversity"]].to_numpy()).all()
    # Same seed, same method: the same image (generation is deterministic).
    again = compare_methods(
        pipe, refs, seeds=[3], call_kwargs={"num_inference_steps": 3}, scorer=ClipScorer(tiny_clip), methods=["exact"]
    )
    assert np.array_equal(np.asarray(again.images["exact"][0]), np.asarray(result.images["exact"][0]))

    paths = result.save(tmp_path / "out")
    assert {p.name for p in paths.values()} == {
        "compare.csv",
        "compare.md",
        "per_image.csv",
        "grid.png",
        "compare.json",
    }
    record = json.loads(paths["record"].read_text())
    assert record["settings"]["clip_random_weights"] is True and "random weights" in record["settings"]["clip_note"]
    assert record["seeds"] == [3, 4] and len(record["table"]) == 4
    assert "random weights" in paths["markdown"].read_text()
    assert pd.read_csv(paths["table"])["method"].tolist() == [*METHODS, ROUNDTRIP]
    assert Image.open(paths["grid"]).size == result.grid().size
    assert len(list((tmp_path / "out" / "images").glob("*.png"))) == 6


def test_bad_comparison_arguments(tiny_clip):
    pipe = tiny_pipeline("sd15")
    with pytest.raises(ValueError, match="at least one reference"):
        compare_methods(pipe, [], seeds=[0])
    with pytest.raises(ValueError, match="at least one seed"):
        compare_methods(pipe, default_reference_images(1), seeds=[], scorer=ClipScorer(tiny_clip))
    with pytest.raises(ValueError, match="unknown method"):
        compare_methods(pipe, default_reference_images(1), seeds=[0], methods=["dreambooth"])


# --------------------------------------------------------------------------- the CLI


def test_cli_compare_with_model_arguments(tiny_clip, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--kind", "sd15", "--out", str(out), "--steps", "2", "--seeds", "5", "9"]
    code = main([*argv, "--clip-model", tiny_clip])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| ip_adapter |" in printed and "random weights" in printed and "grid.png" in printed
    wrote = printed.splitlines()[-1]
    named = [p.name for p in out.iterdir() if p.name != ".ipa_probe.lock"]  # the lock: held while a run writes
    assert all(name in wrote for name in named) and "6 PNGs" in wrote, wrote  # every file and folder named
    record = json.loads((out / "compare.json").read_text())
    assert record["seeds"] == [5, 9] and record["settings"]["run"]["model"] == "embedded tiny sd15"


def test_compare_passes_the_nw_frame_through(tiny_clip, tmp_path, capsys):
    pipe = tiny_pipeline("sd15")
    refs = default_reference_images(2)
    call = {"num_inference_steps": 2}
    images = {
        frame: compare_methods(
            pipe, refs, seeds=[3], call_kwargs=call, scorer=ClipScorer(tiny_clip), methods=["nw_head"], nw_frame=frame
        )
        for frame in ("stored", "query")
    }
    assert images["query"].settings["nw_frame"] == "query" and images["stored"].settings["nw_frame"] == "stored"
    stored, query = (np.asarray(images[f].images["nw_head"][0], dtype=float) for f in ("stored", "query"))
    assert np.abs(stored - query).max() > 0  # a different head
    with pytest.raises(ValueError, match="does not apply to frame='query'"):
        compare_methods(pipe, refs, seeds=[3], bandwidth=0.5, nw_frame="query", methods=["nw_head"])
    out = tmp_path / "cmp"
    argv = ["compare", "--kind", "sd15", "--out", str(out), "--steps", "2", "--seeds", "5", "--nw-frame", "query"]
    assert main([*argv, "--clip-model", tiny_clip]) == 0
    assert json.loads((out / "compare.json").read_text())["settings"]["nw_frame"] == "query"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num-seeds", "0"], "--num-seeds must be at least 1"),
        (["--seeds", "1", "1"], "repeated"),
        (["--clip-model", "ViT-Q-99"], "open_clip knows no model"),
        (["--nw-frame", "query", "--bandwidth", "2"], "does not apply to --nw-frame query"),
        (["--model", "/no/such/model", "--ip-adapter", "x", "--image", "y"], "does not exist"),
    ],
)
def test_cli_compare_bad_arguments_exit_2(tmp_path, capsys, argv, match):
    assert main(["compare", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_compare_runs_with_no_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare"]) == 0
    out = tmp_path / "outputs" / "compare"
    assert (out / "grid.png").exists() and (out / "compare.md").exists()
    record = json.loads((out / "compare.json").read_text())
    assert record["settings"]["clip_model"] == "ViT-B-32" and record["settings"]["clip_random_weights"] is True
    assert len(record["seeds"]) == 3


def test_cli_compare_prints_and_saves_the_nw_heads_digit_rates(tiny_clip, tmp_path, capsys):
    """On the digits organism, compare prints and saves each head's right-digit rate (learned, NW head in both
    frames, adapter off); the learned and adapter-off counts against the test's own generations and classifier."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, classify_digit_images, digits_pipeline, digits_reference_images

    out = tmp_path / "cmp"
    argv = ["compare", "--out", str(out), "--steps", "3", "--seeds", "5", "9", "--clip-model", tiny_clip]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rates = pd.read_csv(out / "digit_rates.csv").set_index("method")
    assert list(rates.index) == ["learned", "nw_head_query", "nw_head_stored", "adapter_off"]
    assert (rates["images"] == 2).all() and (rates["digit"] == 3).all()
    line = next(x for x in printed.splitlines() if x.startswith("digit-right rate"))
    for name, method in (("learned", "learned"), ("(query frame)", "nw_head_query"), ("adapter off", "adapter_off")):
        assert f"{name} {rates.loc[method, 'right']}/2" in line, line
    assert "digit_rates.csv" in printed.splitlines()[-1]
    pipe = digits_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = digits_reference_images(3, 3, seed=0)
    for method, scale in (("learned", 1.0), ("adapter_off", 0.0)):
        pipe.set_ip_adapter_scale(scale)
        images = [
            pipe(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=3, guidance_scale=3.0,
                 generator=torch.Generator().manual_seed(s)).images[0]
            for s in (5, 9)
        ]  # fmt: skip
        assert rates.loc[method, "right"] == int((classify_digit_images(images)[0] == 3).sum())


def _small_comparison() -> Comparison:
    """A :class:`Comparison` built by hand (no pipeline): two seeds of every method, the references as images."""
    refs = [Image.new("RGB", (16, 16), (60 * i, 60 * i, 60 * i)) for i in range(2)]
    per_image = pd.DataFrame(
        [{"method": m, "seed": s, "clip_i_nearest": 0.9, "pixel_nearest": 0.1} for m in METHODS for s in (0, 1)]
    )
    table = pd.DataFrame({"method": list(METHODS), "clip_i_nearest": 0.9})
    return Comparison(refs, [0, 1], {m: refs for m in METHODS}, per_image, table, {"run": {"steps": 2}})


def test_compare_save_writes_aside_and_never_loses_a_file(tmp_path, monkeypatch):
    """``Comparison.save`` keeps the folder rules of the command line: the same save again replaces its own files; a
    hand-edited file and a file no run wrote are refused by name (the remedy in the message), ``overwrite`` writes
    beside a stranger's file and keeps it; a save that fails half way leaves the folder byte for byte as it was."""
    from ipa_probe.runfolder import MANIFEST_NAME, RunConflict

    result, out = _small_comparison(), tmp_path / "out"
    paths = result.save(out)
    assert paths["table"] == out / "compare.csv" and (out / MANIFEST_NAME).is_file()
    assert len(list((out / "images").glob("*.png"))) == 2 * len(METHODS)
    result.save(out)  # the same run's files, replaced

    def snapshot():
        files = [p for p in out.rglob("*") if p.is_file() and ".ipa_probe" not in str(p)]
        return {p.relative_to(out): p.read_bytes() for p in files}

    before = snapshot()
    other = _small_comparison()
    other.table["clip_i_nearest"] = 0.5  # other numbers: written in place, compare.csv would change
    monkeypatch.setattr(Comparison, "markdown", lambda self: 1 / 0)  # fails after the tables are written
    with pytest.raises(ZeroDivisionError):
        other.save(out)
    monkeypatch.undo()
    assert snapshot() == before  # the failed save's tables stayed in staging, never in the folder

    (out / "notes.txt").write_text("mine")
    with pytest.raises(RunConflict, match="notes.txt.*--overwrite"):
        result.save(out)
    result.save(out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"

    (out / "compare.md").write_text("edited by hand")
    with pytest.raises(RunConflict, match="compare.md changed"):
        result.save(out, overwrite=True)
    assert (out / "compare.md").read_text() == "edited by hand"
