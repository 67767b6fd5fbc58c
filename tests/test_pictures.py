"""Pictures that tell the truth: honest colour in the map figures, overlays, heat maps, the demo strip, trackers
read back from their own files, and `make figures`' provenance checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import CountScalarReads

from ipa_probe.capture.run import probe

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent


def generate(pipe, refs, steps=3, **kwargs):
    kwargs.setdefault("output_type", "pil")
    generator = torch.Generator().manual_seed(0)
    return pipe("a photo", ip_adapter_image=[refs], num_inference_steps=steps, generator=generator, **kwargs).images


@pytest.fixture(scope="module")
def refs3():
    from ipa_probe.tiny.sd import default_reference_images

    return default_reference_images(3)


@pytest.fixture(scope="module")
def mapped(sd15, refs3):
    """A finished probe with maps (3 references, 3 steps, CFG) and its first image."""
    with probe(sd15, maps=True) as run:
        image = generate(sd15, refs3)[0]
    return run, image


def _panels(fig, rows, cols):
    """The figure's map panels as a (rows, cols) array of axes (the colorbars come after them)."""
    return np.asarray(fig.axes[: rows * cols], dtype=object).reshape(rows, cols)


# --------------------------------------------------------------------------- honest colour


def test_reference_map_figure_draws_deviation_from_uniform_on_a_stated_symmetric_range(mapped, refs3):
    from ipa_probe.capture.mapplots import EFFECT_SIZE
    from ipa_probe.figstyle import DOUBLE_COLUMN, small_text

    run, image = mapped
    fig = run.plot_reference_maps(image=image, references=refs3, margin=0.001)
    rows, cols, n = 4, 7, 3
    panels = _panels(fig, rows, cols)
    assert len(fig.axes) == rows * cols + 2  # every map has a colorbar: references, shares
    assert fig.get_size_inches()[0] == pytest.approx(DOUBLE_COLUMN) and small_text(fig) == []
    steps = run.map_steps()
    chunks = [list(map(int, c)) for c in np.array_split(np.asarray(steps), 3)]
    shares = {
        kind: [run.reference_maps(kind=kind, steps=c, size="image").double().numpy() for c in chunks]
        for kind in ("attention", "nw")
    }
    # the colour scale: symmetric about 0 (uniform share 1/3), saturating at the stated effect size, not the data's
    # extreme
    top = EFFECT_SIZE / n
    for c in range(3):
        for r in range(n):
            for offset, kind in ((1, "attention"), (2, "nw")):
                panel = panels[1 + r, 2 * c + offset]
                drawn = panel.get_images()[0]
                np.testing.assert_allclose(drawn.get_array(), shares[kind][c][r] - 1 / n, atol=1e-12)
                assert drawn.norm.vmin == pytest.approx(-top) and drawn.norm.vmax == pytest.approx(top)
                assert drawn.get_cmap().name == "RdBu_r"
                assert panel.collections  # the generated image's outline on every map
        # the dominant reference, recomputed here: colour only where the leader's margin exceeds the threshold
        for offset, kind in ((1, "attention"), (2, "nw")):
            values = shares[kind][c]
            ordered = np.sort(values, axis=0)
            expected = np.where(ordered[-1] - ordered[-2] > 0.001, values.argmax(0), n)
            images = panels[0, 2 * c + offset].get_images()
            if images:
                np.testing.assert_array_equal(images[0].get_array(), expected)
            else:  # no position has a clear winner: one line of text instead of a grey panel
                assert (expected == n).all()
    labels = [ax.get_ylabel() for ax in fig.axes[rows * cols :]]
    assert f"saturates at ±{EFFECT_SIZE:g}/3" in labels[1]
    text = " ".join(t.get_text() for t in fig.texts)
    assert "share − 1/3" in text and "by more than 0.001" in text
    largest = max(np.abs(m - 1 / n).max() for kind in shares for m in shares[kind])
    assert f"largest deviation drawn is {largest:.3g}" in text.replace("\n", " ")


def test_a_large_margin_leaves_no_dominant_reference_and_absolute_scale_is_0_to_1(mapped):
    run, _ = mapped
    fig = run.plot_reference_maps(margin=0.5, scale="absolute", ranges=1)
    panels = _panels(fig, 4, 3)
    for offset in (1, 2):  # no clear winner anywhere: no grey panels, a line of text instead
        assert not panels[0, offset].get_images() and not panels[0, offset].axison
        assert [t.get_text() for t in panels[0, offset].texts] == ["no ref\nleads by\n> 0.5"]
    assert not fig.axes[12].get_visible()  # the reference-colour bar describes nothing drawn
    drawn = panels[1, 1].get_images()[0]
    assert (drawn.norm.vmin, drawn.norm.vmax) == (0.0, 1.0) and drawn.get_cmap().name == "viridis"
    assert "absolute 0–1 scale" in " ".join(t.get_text() for t in fig.texts)
    for bad, match in [({"scale": "log"}, "scale"), ({"margin": 1.5}, "margin"), ({"margin": True}, "margin")]:
        with pytest.raises(ValueError, match=match):
            run.plot_reference_maps(**bad)


def test_one_reference_draws_no_stretched_noise(sd15, refs3):
    with probe(sd15, maps=True) as run:
        generate(sd15, refs3[:1], steps=2)
    fig = run.plot_reference_maps(ranges=1)
    drawn = _panels(fig, 2, 3)[1, 1].get_images()[0]
    assert np.abs(drawn.get_array()).max() < 1e-6  # share 1 everywhere: deviation 0
    assert drawn.norm.vmax >= 1e-3  # the range has a floor: rounding noise is not stretched into colour


# --------------------------------------------------------------------------- overlays


def test_plot_overlay_draws_the_map_beside_the_image_with_the_colorbar_of_what_is_drawn(mapped):
    from ipa_probe import plot_overlay

    run, image = mapped
    fig = plot_overlay(run, image, reference=1)
    picture, drawn_ax, bar_ax = fig.axes
    (base,) = picture.get_images()
    np.testing.assert_array_equal(base.get_array(), np.asarray(image) / 255.0)  # the image keeps its own colours
    (drawn,) = drawn_ax.get_images()
    shares = run.reference_maps(size=(image.height, image.width)).double().numpy()  # (R, H, W)
    np.testing.assert_allclose(drawn.get_array(), shares[1] - 1 / 3, atol=1e-12)
    assert drawn.get_alpha() is None  # opaque: the colorbar's colours are the colours drawn
    assert bar_ax._colorbar.mappable is drawn and "share − uniform" in bar_ax.get_ylabel()
    top = np.abs(shares[1] - 1 / 3).max()
    assert drawn.norm.vmax == pytest.approx(max(top, 1e-3)) and drawn.norm.vmin == -drawn.norm.vmax
    steps, names = run.map_steps(), [layer.name for layer in run.layers]
    title = fig.get_suptitle()
    assert f"all {len(steps)} recorded steps" in title and f"all {len(names)} layers" in title
    assert "cond branch" in title and f"= {top:.3g}" in title
    # an image token of that reference: its own share, uniform 1/(R T)
    tokens = run.token_maps(size=(image.height, image.width)).double().numpy()  # (R, T, H, W)
    fig = plot_overlay(run, image, reference=1, token=2, scale="absolute")
    np.testing.assert_allclose(fig.axes[1].get_images()[0].get_array(), tokens[1, 2], atol=1e-12)
    for kwargs, match in [
        ({}, "reference=i"),
        ({"reference": 5}, "reference=5"),
        ({"reference": 0, "layout": "blend"}, "layout"),
        ({"reference": 0, "vmax": -1}, "vmax"),
        ({"token": 1}, "keep_maps=True"),
    ]:
        with pytest.raises(ValueError, match=match):
            plot_overlay(run, image, **kwargs)


def test_a_narrowed_overlay_is_titled_with_its_selection_and_drawn_as_contours(mapped):
    from ipa_probe import plot_overlay

    run, image = mapped
    last = run.map_steps()[-1]
    names = [layer.name for layer in run.layers]
    chosen = [n for n in names if n.startswith("up_blocks.1")]
    fig = plot_overlay(run, image, reference=0, steps=[last], layers=r"^up_blocks\.1", layout="contours")
    (ax,) = fig.axes
    title = fig.get_suptitle()
    t = run.map_timesteps()[last]
    assert f"step {last} (t {t:.0f})" in title and f"up_blocks.1 ({len(chosen)} of {len(names)} layers)" in title
    shares = run.reference_maps(layers=r"^up_blocks\.1", steps=[last], size=(image.height, image.width))
    top = float(np.abs(shares[0].double().numpy() - 1 / 3).max())
    assert f"= {top:.3g}" in title  # the largest |deviation| of this selection, not of the full average
    assert len(ax.get_images()) == 1  # the image alone: the map is contour lines over it, no translucent fill
    levels = [float(t.get_text().split("= ")[1]) for t in ax.get_legend().get_texts()]
    np.testing.assert_allclose(levels, np.array([-2, -1, 1, 2]) * max(top, 1e-3) / 3, rtol=1e-2)  # 3 digits shown


def test_overlay_text_is_readable_at_the_saved_size(mapped):
    from ipa_probe import plot_overlay
    from ipa_probe.figstyle import MIN_FONT_PT, drawn_problems, size_problems

    run, image = mapped
    for layout in ("beside", "contours"):
        assert drawn_problems(plot_overlay(run, image, reference=0, layout=layout)) == []
    fig = run.plot_reference_maps(image=image)
    assert drawn_problems(fig) == [] and size_problems(*fig.get_size_inches()) == []
    assert MIN_FONT_PT >= 8  # a paper's floor at the printed size, which is the drawn size


def test_text_token_overlay_against_the_tests_own_hooks(sd15, refs3):
    """token= alone: the text branch's weight on one prompt token, recomputed from the test's own hooks."""
    from ipa_probe import plot_overlay

    saved = {}

    def keep(name):
        def hook(module, args, output):
            saved.setdefault(name, []).append(output.detach().double())

        return hook

    attn = {
        n[: -len(".processor")]: sd15.unet.get_submodule(n[: -len(".processor")]) for n in sd15.unet.attn_processors
    }
    attn = {n: m for n, m in attn.items() if n.endswith("attn2")}
    handles = [m.to_q.register_forward_hook(keep((n, "q"))) for n, m in attn.items()]
    handles += [m.to_k.register_forward_hook(keep((n, "k"))) for n, m in attn.items()]
    try:
        with probe(sd15, kind="both", keep_maps=True) as run:
            image = generate(sd15, refs3, steps=2)[0]
    finally:
        for handle in handles:
            handle.remove()
    size = (image.height, image.width)
    token = 2
    total, count = np.zeros(size), 0
    for name, module in attn.items():
        for q, k in zip(saved[(name, "q")], saved[(name, "k")], strict=True):
            heads = module.heads
            b, n_q, inner = q.shape
            d = inner // heads
            qh = q.reshape(b, n_q, heads, d).transpose(1, 2)  # (B, H, Q, D)
            kh = k.reshape(b, -1, heads, d).transpose(1, 2)  # (B, H, K, D)
            weights = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(d), -1).mean(1)  # (B, Q, K)
            cond = weights[1, :, token]  # CFG: uncond first, cond second
            side = math.isqrt(n_q)  # the tiny pipeline's latents are square
            grid = cond.reshape(1, 1, side, side)
            total += F.interpolate(grid, size=size, mode="bilinear", align_corners=False)[0, 0].numpy()
            count += 1
    n_tokens = saved[(next(iter(attn)), "k")][0].shape[1]
    fig = plot_overlay(run, image, token=token)
    # tokens too are drawn as deviation from the uniform weight 1/K: a map within a few % of uniform looks flat
    drawn = fig.axes[1].get_images()[0].get_array()
    np.testing.assert_allclose(drawn, total / count - 1 / n_tokens, atol=1e-5)  # fp16 maps
    assert f"share − uniform {1 / n_tokens:.3g}" in fig.axes[2].get_ylabel()
    fig = plot_overlay(run, image, token=token, scale="max")  # the 0-to-max scale stays an option
    assert "largest" in fig.axes[2].get_ylabel()


def test_save_overlays_writes_one_per_reference_and_per_layer_group_and_step(mapped, tmp_path):
    from ipa_probe._io import read_provenance
    from ipa_probe.capture.overlays import layer_groups, save_overlays

    run, image = mapped
    last = run.map_steps()[-1]
    paths = save_overlays(run, image, tmp_path, per_layer_step=True, steps=[last])
    groups = layer_groups([layer.name for layer in run.layers])
    assert {p.name for p in paths if p.parent == tmp_path} == {"ref0.png", "ref1.png", "ref2.png"}
    assert len(paths) == 3 + 3 * len(groups)
    assert (tmp_path / "ref2" / f"up_blocks.1_step{last:03d}.png").exists()
    with pytest.raises(ValueError, match="none recorded"):
        save_overlays(run, image, tmp_path, per_layer_step=True, steps=[99])
    assert all(read_provenance(p)["code"] for p in paths)


def test_layer_groups():
    from ipa_probe.capture.overlays import layer_groups

    names = ["down_blocks.0.attentions.0.x", "mid_block.attentions.0.x", "up_blocks.1.attentions.1.x",
             "up_blocks.1.attentions.0.x", "transformer_blocks.3.attn", "odd"]  # fmt: skip
    assert (
        layer_groups(names)
        == {
            "down_blocks.0": names[:1],
            "mid_block": names[1:2],
            "up_blocks.1": names[3:1:-1],  # network order: attentions.0 before attentions.1
            "transformer_blocks.3": names[4:5],
            "odd": ["odd"],
        }
    )


# --------------------------------------------------------------------------- what a reviewer checks


def test_network_order_puts_the_mid_block_between_down_and_up():
    from ipa_probe.capture.layer_order import network_order

    names = [
        "up_blocks.1.attentions.10.t.attn2",
        "mid_block.attentions.0.t.attn2",
        "odd",
        "up_blocks.1.attentions.2.t.attn2",
        "down_blocks.10.attentions.0.t.attn2",
        "down_blocks.2.attentions.1.t.attn2",
        "single_transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
    ]
    # fmt: skip
    assert network_order(names) == [
        "down_blocks.2.attentions.1.t.attn2",
        "down_blocks.10.attentions.0.t.attn2",  # numbers compare as numbers
        "mid_block.attentions.0.t.attn2",
        "up_blocks.1.attentions.2.t.attn2",
        "up_blocks.1.attentions.10.t.attn2",
        "transformer_blocks.1.attn",
        "single_transformer_blocks.0.attn",
        "odd",
    ]
    with pytest.raises(TypeError, match="layer id"):
        network_order([3])


def test_network_order_of_a_real_unet(sd15, refs3):
    """diffusers lists a UNet's layers down, up, mid; network_order gives the order one UNet call runs them in."""
    from ipa_probe.capture.layer_order import network_order

    listed = [n.removesuffix(".processor") for n in sd15.unet.attn_processors]
    calls = []  # the order the UNet runs its attention layers, from the test's own hooks
    handles = [
        sd15.unet.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
        for name in listed
    ]
    try:
        generate(sd15, refs3, steps=1, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    assert listed.index("mid_block.attentions.0.transformer_blocks.0.attn2") == len(listed) - 1  # why we sort
    assert network_order(listed) == calls[: len(listed)]


def test_selection_lines_name_steps_and_layer_groups_in_network_order():
    from ipa_probe.capture.overlays import describe_selection

    names = ["down_blocks.0.a", "down_blocks.1.a", "up_blocks.0.a", "up_blocks.0.b", "mid_block.a"]  # diffusers' order
    timesteps = [951.0, 901.0, 851.0, 801.0, 751.0]
    everything = describe_selection([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], timesteps, names, names)
    assert everything == "all 5 recorded steps (t 951–751) · all 5 layers"
    some = describe_selection([0, 1, 2, 4], [0, 1, 2, 3, 4], timesteps, ["up_blocks.0.a", "mid_block.a"], names)
    assert some == "steps 0–2, 4 (t 951–751) · mid_block, up_blocks.0 (2 of 5 layers)"
    one = describe_selection([3], [0, 1, 2, 3, 4], timesteps, names[:1], names)
    assert one == "step 3 (t 801) · down_blocks.0 (1 of 5 layers)"


def test_the_checkers_catch_small_text_and_unnamed_lines():
    import matplotlib.pyplot as plt

    from ipa_probe.figstyle import small_text, unlegended_artists

    fig, ax = plt.subplots()
    ax.plot([0, 1], label="named")
    ax.plot([1, 0], label="forgotten")
    ax.legend(handles=ax.lines[:1])
    ax.text(0.5, 0.5, "tiny", fontsize=6)
    blank = fig.add_axes([0.7, 0.7, 0.2, 0.2])
    blank.tick_params(labelsize=4)  # not drawn: the axes is off
    blank.set_axis_off()
    blank.text(0.5, 0.5, "said in an empty panel", fontsize=5)  # drawn although the axes is off
    assert sorted(small_text(fig)) == [("said in an empty panel", 5.0), ("tiny", 6.0)]
    assert unlegended_artists(fig) == [": forgotten"]
    plt.close(fig)
    # an errorbar's data line and caps are named by the errorbar's label, in the legend or not
    fig, ax = plt.subplots()
    shown = ax.errorbar([0, 1], [1, 2], yerr=[0.1, 0.2], capsize=3, label="mean ± s.e.m.")
    hidden = ax.errorbar([0, 1], [2, 1], yerr=[0.1, 0.2], capsize=3, label="left out")
    ax.legend(handles=[shown])
    assert unlegended_artists(fig) == [": left out"] * (1 + len(hidden.lines[1]))  # its line and its 2 caps
    plt.close(fig)


def test_regular_ticks_step_evenly_and_fit_ylim_holds_the_data():
    import matplotlib.pyplot as plt

    from ipa_probe.figstyle import fit_ylim, regular_ticks

    assert regular_ticks(5) == [0, 1, 2, 3, 4]
    assert regular_ticks(20) == [0, 3, 6, 9, 12, 15, 18]  # one stride: 951, 801, 651, ... on 20 DDIM steps
    assert regular_ticks(50, most=6) == [0, 10, 20, 30, 40]
    for count in range(1, 60):
        ticks = regular_ticks(count)
        assert len(ticks) <= 8 and len(set(np.diff(ticks))) <= 1
    with pytest.raises(ValueError, match="count"):
        regular_ticks(0)
    fig, ax = plt.subplots()
    low, high = fit_ylim(ax, [0.78, 0.80, np.nan], include=[0.79])
    assert low < 0.78 and high > 0.80 and high - low == pytest.approx(0.02 * 1.24)  # 12% margin each side
    assert fit_ylim(ax, [1e-2, 1e3, np.inf], log=True)[1] > 1e3
    assert fit_ylim(ax, [np.nan]) == ax.get_ylim()  # nothing finite: the range is left as it is
    plt.close(fig)


@pytest.fixture(scope="module")
def ip_adapter_figure():
    """ip_adapter.png's figure drawn from the committed full-tier record, caught before it is written and closed."""
    import ipa_probe._io as io
    from ipa_probe.experiments.ip_adapter import redraw

    caught, real = [], io.write_figure

    def keep(fig, path, dpi=None, provenance=None):
        caught.append((fig, dpi))
        return Path(path)

    record = json.loads((ROOT / "docs/results/full/ip-adapter/record.json").read_text())
    io.write_figure = keep
    try:
        redraw(record, Path("unused"))
    finally:
        io.write_figure = real
    return caught[0]


def test_ip_adapter_figure_names_every_line_at_9_pt(ip_adapter_figure):
    from ipa_probe.figstyle import small_text, unlegended_artists

    fig, dpi = ip_adapter_figure
    assert small_text(fig) == [] and dpi is None  # write_figure's default: figstyle.SAVE_DPI
    assert unlegended_artists(fig) == []
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert all(len(ax.get_legend().get_texts()) <= 7 for ax in shown)  # no 9-10-entry legends
    assert not any(ax.get_shared_x_axes().get_siblings(ax)[1:] for ax in fig.axes)  # no twin axes


def test_ip_adapter_panels_fit_their_range_to_the_data(ip_adapter_figure):
    """Each linear panel's y range is at most 1.3x the span of what it draws (lines, bands, reference lines), so a
    difference of 0.003 is not drawn on a range of 1."""
    fig, _ = ip_adapter_figure
    for ax in fig.axes:
        if ax.get_yscale() != "linear" or not ax.get_visible() or not ax.axison:  # the colour key has no range
            continue
        ys = [y for line in ax.lines for y in np.asarray(line.get_ydata(), float) if np.isfinite(y)]
        ys += [y for c in ax.collections for path in c.get_paths() for y in path.vertices[:, 1] if np.isfinite(y)]
        low, high = ax.get_ylim()
        assert high - low <= 1.3 * (max(ys) - min(ys)), ax.get_title()


# --------------------------------------------------------------------------- heat maps, lines, strip


def test_heat_map_is_the_layer_by_timestep_mean_with_a_colorbar(mapped):
    from ipa_probe.capture.report import plot_heatmap, plot_run

    run, _ = mapped
    table = run.to_dataframe()
    fig = plot_heatmap(table)
    drawn = fig.axes[0].get_images()[0]
    cond = table[(table["branch"] == "cond") & (table["kind"] == "image")]
    # rows in the order a UNet runs its blocks (down, mid, up), whatever order the processors dict lists them in
    rank = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    layers = sorted((layer.name for layer in run.layers), key=lambda n: (rank[n.split(".")[0]], n))
    timesteps = sorted(set(cond["timestep"]), reverse=True)
    expected = np.array(
        [[cond.loc[(cond["layer"] == name) & (cond["timestep"] == t), "spearman"].to_numpy().mean() for t in timesteps]
         for name in layers]
    )  # fmt: skip
    np.testing.assert_allclose(drawn.get_array(), expected, atol=1e-12)
    assert len(fig.axes) == 2 and "spearman" in fig.axes[1].get_xlabel()  # the colorbar under the map
    # a column of both signs is drawn on a diverging scale centred at 0; plot_run draws every heat-map column it has
    table["rho_excess"] = table["spearman"] - float(cond["spearman"].median())
    fig = plot_run(table)
    assert [ax.get_title().split("\n")[0] for ax in fig.axes if "mean over heads" in ax.get_title()] == [
        "query-frame ρ (exact)",
        "stored-frame ρ",
        "stored-frame ρ − baseline",
    ]
    excess = [ax for ax in fig.axes if ax.get_title().startswith("stored-frame ρ − baseline")][0].get_images()[0]
    # a difference saturates at a stated effect size (0.1 in rho), symmetric about 0, not at the data's extreme
    assert (excess.norm.vmin, excess.norm.vmax) == (-0.1, 0.1) and excess.get_cmap().name == "RdBu_r"


def test_rho_lines_name_every_band_and_fit_their_axis(mapped):
    run, _ = mapped
    fig = run.plot()
    ax, null_ax = fig.axes[0], fig.axes[1]
    labels = ax.get_legend_handles_labels()[1]
    # the band says which rho it spreads; the nulls are in a panel of their own
    assert "stored-frame ρ ± 1 std over layers × heads" in labels
    assert null_ax.get_legend_handles_labels()[1] == [
        "query-frame ρ, permutation null",
        "stored-frame ρ, permutation null",
    ]
    assert labels[0] == "query-frame ρ (exact, item frame)"  # the headline first
    legend = [t.get_text() for a in fig.axes if a.get_legend() for t in a.get_legend().get_texts()]
    assert set(labels) | set(null_ax.get_legend_handles_labels()[1]) == set(legend)  # one legend names them all
    summary = run.summary()
    cond = summary[(summary["branch"] == "cond") & (summary["kind"] == "image")]
    drawn = np.concatenate([cond["spearman"] - cond["spearman_std"], cond["spearman"] + cond["spearman_std"],
                            cond["qf_spearman"], cond["qf_gauss_spearman"], cond["rho_baseline"],
                            cond["qf_rho_baseline"]])  # fmt: skip
    low, high = ax.get_ylim()
    assert low <= drawn.min() and high >= drawn.max()
    assert high - low < 1.2 * (drawn.max() - drawn.min()) + 0.05  # fitted to the headline, not stretched to 0
    title = ax.get_title()
    assert f"{cond['step'].nunique()} steps" in title and f"{len(run.layers)} layers" in title  # the selection


def test_image_strip_titles_references_and_verdicts():
    from PIL import Image

    from ipa_probe.images import plot_image_strip

    refs = [Image.new("RGB", (16, 16), "white")] * 2
    out = [Image.new("RGB", (16, 16), "black")] * 3
    fig = plot_image_strip(refs, out, ["read as 3", "read as 8", "read as 3"], [True, False, True], title="demo")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["reference 0", "reference 1", "image 0", "image 1", "image 2"]
    captions = [(ax.get_xlabel(), ax.xaxis.label.get_color()) for ax in fig.axes[2:]]
    assert captions == [("read as 3", "#1a7f37"), ("read as 8", "#cf222e"), ("read as 3", "#1a7f37")]
    assert {"references", "generated", "demo"} <= {t.get_text() for t in fig.texts}
    with pytest.raises(ValueError, match="captions"):
        plot_image_strip(refs, out, ["x"])
    # at a paper's page width: 7 in whatever the count, the images shrink and the short labels fit
    from ipa_probe.figstyle import DOUBLE_COLUMN, drawn_problems

    fig = plot_image_strip(refs, out * 3, ["reads 3"] * 9, [True] * 9, title="two\nlines", width=DOUBLE_COLUMN)
    assert fig.get_size_inches()[0] == DOUBLE_COLUMN and drawn_problems(fig) == []
    assert [ax.get_title() for ax in fig.axes[:2]] == ["ref 0", "ref 1"]
    with pytest.raises(ValueError, match="no room"):
        plot_image_strip(refs, out * 40, width=DOUBLE_COLUMN)


# --------------------------------------------------------------------------- trackers


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_done_when_probe_overlays_and_tensorboard_on_the_organism(tmp_path, capsys):
    """`ipa-probe probe --maps --overlays DIR --log-with tensorboard --out OUT` on the organism: per-reference overlays
    and event files whose rho per step equals the run's own table, averaged here with numpy."""
    from ipa_probe._io import read_provenance
    from ipa_probe.cli import main

    out, overlays = tmp_path / "out", tmp_path / "overlays"
    argv = ["probe", "--maps", "--overlays", str(overlays), "--log-with", "tensorboard", "--out", str(out)]
    assert main([*argv, "--steps", "3", "--num-images", "2"]) == 0
    pngs = ["ref0.png", "ref1.png", "ref2.png"]
    listed = sorted(p.name for p in overlays.iterdir())
    assert listed == [".ipa_probe.lock", "ipa_probe_manifest.json", *pngs]  # a folder of its own, with its lock
    assert sorted(json.loads((overlays / "ipa_probe_manifest.json").read_text())["files"]) == pngs
    assert all(read_provenance(overlays / name)["code"] for name in pngs)
    printed = capsys.readouterr().out
    assert "3 overlay(s)" in printed and "tensorboard logs in" in printed
    folder = out / "logs" / "probe_digit3_seed0_frame-item_steps3"  # named by what differs between runs
    events = _scalars(folder)
    table = pd.read_parquet(out / "probe.parquet")
    for branch, group in (("cond", "2_stored_frame"), ("uncond", "uncond_stored_frame")):  # cond: the headline
        part = table[(table["branch"] == branch) & (table["kind"] == "image")]
        logged = {e.step: e.value for e in events.Scalars(f"{group}/rho")}
        steps = sorted(set(part["step"]))
        assert sorted(logged) == steps  # the step is the denoising step: the chart reads left to right
        for step in steps:
            rows = part.loc[part["step"] == step, "spearman"].to_numpy(np.float64)
            # TensorBoard keeps float32
            assert logged[step] == pytest.approx(rows[np.isfinite(rows)].mean(), abs=1e-6)
    assert {"8_figures/rho_by_timestep", "8_figures/reference_maps", "7_overlays/reference_shares"} <= set(
        events.Tags()["images"]
    )
    assert sorted(p.name for p in folder.glob("*/")) == ["baseline", "mean", "null"]  # sub-runs of references


def test_logging_adds_no_host_synchronisation_inside_the_loop(sd15, refs, tmp_path):
    generate(sd15, refs, output_type="latent")  # warm-up
    with CountScalarReads() as plain:
        generate(sd15, refs, output_type="latent")
    with probe(sd15, log_with="tensorboard", logging_dir=tmp_path, run_name="r") as run:
        with CountScalarReads() as probed:
            generate(sd15, refs, output_type="latent")
    assert probed.count == plain.count
    steps = set(run.summary()["step"])  # the denoising steps
    assert {e.step for e in _scalars(tmp_path / "r").Scalars("2_stored_frame/rho")} == steps
    assert run.summary()["spearman"].notna().all()


def test_a_missing_tracker_client_fails_with_one_line_naming_the_extra(sd15, refs, tmp_path, monkeypatch, capsys):
    import importlib.util

    from ipa_probe.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name)
    )
    processors = dict(sd15.unet.attn_processors)
    with pytest.raises(ImportError, match=r"pip install 'ipa_probe\[wandb\]'"):
        with probe(sd15, log_with="wandb"):
            pass
    assert all(sd15.unet.attn_processors[k] is v for k, v in processors.items())
    with pytest.raises(ValueError, match="log_with: expected one of"):
        with probe(sd15, log_with="tensorbored"):
            pass
    out = tmp_path / "never"
    assert main(["probe", "--log-with", "mlflow", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'ipa_probe[mlflow]'" in err[0] and not out.exists()
    assert main(["probe", "--logging-dir", str(tmp_path), "--out", str(out)]) == 2
    assert "--logging-dir needs --log-with" in capsys.readouterr().err


def test_sweep_logs_its_aggregate_per_timestep(workdir_sweep, tmp_path, capsys):
    from ipa_probe.cli import main

    out = tmp_path / "sweep"
    argv = ["sweep", str(workdir_sweep), "--out", str(out), "--steps", "2", "--no-progress", "--resamples", "99"]
    assert main([*argv, "--log-with", "tensorboard"]) == 0
    events = _scalars(out / "logs" / "sweep")
    agg = pd.read_parquet(out / "aggregate.parquet")
    cond = agg[agg["branch"] == "cond"].sort_values("timestep", ascending=False)
    logged = [e.value for e in events.Scalars("sweep/cond/spearman")]
    np.testing.assert_allclose(logged, cond["spearman"].to_numpy(), atol=1e-6)  # float32 in the event file
    rows = pd.read_parquet(out / "row_summary.parquet")
    means = {e.step: e.value for e in events.Scalars("sweep/rows/spearman_mean")}
    assert means == pytest.approx({int(r): float(p["spearman"].mean()) for r, p in rows.groupby("row")}, abs=1e-6)
    assert "sweep/rho_by_timestep" in events.Tags()["images"]


@pytest.fixture
def workdir_sweep(tmp_path):
    from ipa_probe.tiny.sd import default_reference_images

    for i, image in enumerate(default_reference_images(2)):
        image.save(tmp_path / f"{i}.png")
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps({"images": [f"{i}.png"], "seed": i}) for i in range(2)) + "\n")
    return path


def test_experiments_log_tables_figures_and_per_timestep_series(tmp_path):
    import matplotlib.pyplot as plt

    from ipa_probe.experiments.report import ExperimentResult, Row, save_figure, write_result
    from ipa_probe.trackers import log_experiments

    folder = tmp_path / "exp" / "attention"
    folder.mkdir(parents=True)
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    png = save_figure(fig, folder / "attention.png")
    measurements = {"gmm d=16": {0.1: {"spearman": 0.5, "null": 0.0}, 0.9: {"spearman": 0.7, "null": 0.01}}}
    result = ExperimentResult("attention", [Row("rho", "t=0.1", "0.5")], {"measurements": measurements}, [png])
    write_result(result, folder)
    log_experiments({"attention": result}, tmp_path / "exp", {"tier": "quick"}, "tensorboard", tmp_path / "logs")
    events = _scalars(tmp_path / "logs" / "experiments")
    logged = [(e.step, e.value) for e in events.Scalars("attention/gmm d=16/spearman")]
    assert logged == [(0, 0.5), (1, pytest.approx(0.7, abs=1e-6))]  # float32 in the event file
    assert "attention/attention" in events.Tags()["images"]
    assert any("attention/table" in tag for tag in events.Tags()["tensors"])  # text is stored as a tensor


# --------------------------------------------------------------------------- make figures


def test_record_round_trip_keeps_the_inputs_digest():
    from ipa_probe._io import data_digest, jsonable
    from ipa_probe.experiments.report import from_record

    raw = {"shells d=8": {0.1: {"spearman": 0.02, "ci": math.nan}, 1.0: {"spearman": 0.03, "ci": 1.5}}, 4: [1, 2]}
    back = from_record(json.loads(json.dumps(jsonable(raw))))
    assert data_digest(back) == data_digest(raw)
    assert back[4] == [1, 2] and math.isnan(back["shells d=8"][0.1]["ci"]) and 1.0 in back["shells d=8"]


def test_every_docs_figure_is_listed_and_has_a_command():
    import re

    from ipa_probe.devtools.figures import all_figures

    listed = {f.path for f in all_figures(ROOT)}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("**/*.png")}
    # screenshots (docs/screens/NAME.png) are made by their own script, docs/screens/NAME_shot.py (`make screens`)
    screens = {p for p in on_disk if p.startswith("docs/screens/") and (ROOT / p.replace(".png", "_shot.py")).exists()}
    missing = on_disk - listed - screens
    assert not missing, f"PNGs under docs/ that `make figures` does not make: {sorted(missing)}; add them to FIGURES"
    shown = set(re.findall(r"\]\(((?:docs/)[^)]+\.png)\)", (ROOT / "README.md").read_text()))
    for page in (ROOT / "docs").glob("*.md"):
        shown |= {f"docs/{link}" for link in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text())}
    assert shown <= listed | screens, (
        f"images shown in README/docs that nothing makes: {sorted(shown - listed - screens)}"
    )
    page = (ROOT / "docs" / "figures.md").read_text()
    assert [f for f in listed if f.removeprefix("docs/") not in page and f not in page] == []


@pytest.fixture
def digests_only(monkeypatch):
    """``check`` redraws figures for their provenance's code, inputs and data, never reading the layout facts that
    ``write_figure`` adds from ``drawn_problems`` (about half a redraw's cost): left out of its redraws here. The
    figures' layout is the saved-size tests' (they call ``drawn_problems`` themselves)."""
    from ipa_probe import figstyle

    monkeypatch.setattr(figstyle, "drawn_problems", lambda fig, minimum=figstyle.MIN_FONT_PT: [])


def test_every_figure_is_current(digests_only):
    """Each figure exists, carries provenance, was drawn by today's code and, for the experiments, from the numbers
    their committed record.json holds (the organism's data are compared with a fresh run in the slow test below)."""
    from ipa_probe.devtools.figures import check

    problems = {path: issues for path, issues in check(ROOT).items() if issues}
    assert not problems, f"run `make figures`: {problems}"


@pytest.mark.slow
def test_the_organisms_figures_match_what_their_commands_make_today():
    """`ipa-probe probe --maps` rerun: the reference maps and the demo strip hold the data it makes today (the
    comparison grid's rerun, a minute of CLIP embeddings, is left to `make figures-check`)."""
    from ipa_probe.devtools.figures import check

    only = ["docs/images/reference_maps.png", "docs/images/demo_digits.png"]
    problems = {path: issues for path, issues in check(ROOT, rerun=True, only=only).items() if issues}
    assert not problems, f"run `make figures`: {problems}"


def test_rho_by_timestep_reads_at_its_saved_size(mapped):
    from ipa_probe.figstyle import DOUBLE_COLUMN, drawn_problems, size_problems

    run, _ = mapped

    fig = run.plot()
    assert drawn_problems(fig) == []  # no overlapping ticks, no text under 8 pt, no legend over data, axes labelled
    assert fig.get_size_inches()[0] == DOUBLE_COLUMN and size_problems(*fig.get_size_inches()) == []
    heat = [ax for ax in fig.axes if "mean over heads" in ax.get_title()]
    assert heat and all("_" not in ax.get_title().split("\n")[0] for ax in heat)  # titles, not column names
    for ax in heat:
        ticks = ax.get_xticks()
        assert len(set(np.diff(ticks))) <= 1  # one stride: the timestep labels step regularly
    labelled = [ax for ax in heat if any(t.get_text() for t in ax.get_yticklabels())]
    assert labelled == heat[:1]  # the layers named once, at the left; the maps beside it share its rows
    assert len({len(ax.get_images()[0].get_array()) for ax in heat}) == 1


# --------------------------------------------------------------------------- the other docs figures, read


def _caught_figures(monkeypatch, draw):
    """Run ``draw()`` with the figure writers replaced: returns ``[(figure, dpi)]`` as they would have been saved
    (after the layout each writer applies), none written, none closed."""
    import ipa_probe._io as io
    import ipa_probe.experiments.report as report

    caught = []

    def keep(fig, path, dpi=None, provenance=None):
        caught.append((fig, dpi))
        return Path(path)

    monkeypatch.setattr(report, "write_figure", keep)
    monkeypatch.setattr(io, "write_figure", keep)
    draw()
    return caught


def _record_figure_cases():
    """The experiments' figures of docs/figures.md (every record's, ip-adapter and attribution included)."""
    from ipa_probe.devtools.figures import record_figures

    return record_figures(ROOT)


def _command_figure(name, monkeypatch):
    """An organism's command figure from the smallest input: 16-pixel images in place of a run's."""
    from PIL import Image

    images = [Image.new("RGB", (16, 16), (40 * i, 40 * i, 40 * i)) for i in range(6)]
    if name == "demo_digits.png":  # the demo strip as `ipa-probe probe` writes it, with the classifier's verdicts
        from ipa_probe.cli.probe import _write_strip

        labels, probs = np.array([3, 3, 9, 3, 9, 3, 3, 3]), np.full((8, 10), 0.1)
        draw = lambda: _write_strip(images[:3], images[:2] * 4, (labels, probs), 3, Path("unused.png"))  # noqa: E731
        caught = _caught_figures(monkeypatch, draw)
        assert [dpi for _, dpi in caught] == [None]  # write_figure's default: figstyle.SAVE_DPI
        return caught[0][0]
    from ipa_probe.compare import METHODS, grid_figure

    return grid_figure(images[:3], {m: images[:3] for m in METHODS}, [0, 1, 2], roundtrip=images[3:])


#: the figures of docs/figures.md drawn from a record or a command (reference maps and rho_by_timestep have theirs)
FIGURE_CASES = [
    *(f.path for f in _record_figure_cases()),
    "docs/images/demo_digits.png",
    "docs/images/compare_grid.png",
]


@pytest.mark.parametrize("path", FIGURE_CASES)
def test_docs_figures_read_at_their_saved_size(path, monkeypatch):
    """Each figure of docs/figures.md not tested elsewhere, drawn as `make figures` draws it (the experiments' from
    their committed record.json, the organism's from 16-pixel images) and measured by matplotlib's renderer at its
    saved size (:func:`figstyle.drawn_problems`): no text under 8 pt, no two texts overlapping, no legend over
    data, no unlabelled axis; a column's or a page's width and at most a page's height; every line and mark in a
    legend of at most 7 entries, no empty panel, and no linear y range more than 1.3x the span of what the panel
    draws (matplotlib's 5% margins give 1.1x, fit_ylim's 12% 1.24x; a fixed -0.2...1.05 range over lines at 0.02
    gives 50x). Every panel of an experiment's figure has a title."""
    import importlib

    import matplotlib.pyplot as plt

    from ipa_probe.devtools.figures import EXPERIMENT_MODULES
    from ipa_probe.figstyle import drawn_problems, size_problems, unlegended_artists

    figure = next((f for f in _record_figure_cases() if f.path == path), None)
    if figure is None:
        fig = _command_figure(Path(path).name, monkeypatch)
    else:
        record = json.loads((ROOT / figure.record).read_text())
        name = Path(figure.record).parent.name
        module = importlib.import_module(f"ipa_probe.experiments.{EXPERIMENT_MODULES.get(name, name)}")
        caught = _caught_figures(monkeypatch, lambda: module.redraw(record, Path("unused")))
        assert [dpi for _, dpi in caught] == [None]  # write_figure's default: figstyle.SAVE_DPI
        fig = caught[0][0]
    assert drawn_problems(fig) == []  # measured by the renderer on the figure as it is saved
    assert size_problems(*fig.get_size_inches()) == []
    assert unlegended_artists(fig) == []
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert all(len(legend.get_texts()) <= 7 for legend in legends)
    for ax in fig.axes:
        if not ax.get_visible() or hasattr(ax, "_colorbar"):
            continue
        drawn = ax.lines or ax.collections or ax.images or ax.patches or ax.texts
        assert drawn or not ax.axison, f"an empty panel: {ax.get_title()!r}"
        assert figure is None or ax.get_title(), f"a panel without a title in {path}"
        if ax.get_yscale() == "linear" and ax.lines:
            low, high = ax.get_ylim()
            assert high - low <= 1.3 * ax.dataLim.height, ax.get_title()
    plt.close(fig)


# --------------------------------------------------------------------------- a paper's column, read from the files

#: The docs figures drawn at a paper's width (3.5 or 7 in), read back from the saved PNGs: every figure of
#: docs/figures.md (test_every_docs_figure_is_paper_sized holds the list to it).
PAPER_SIZED = [
    "docs/images/reference_maps.png",
    *(f"docs/results/{tier}/collapse/collapse.png" for tier in ("full", "smoke")),
    *(f"docs/results/{tier}/shells/shells.png" for tier in ("full", "smoke", "full_2x_steps")),
    *(f"docs/results/{tier}/ip-adapter/ip_adapter.png"
      for tier in ("full", "smoke", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke_recipe_ip_adapter")),
    *(f"docs/results/{tier}/{name}/{name}.png" for tier in ("full", "smoke") for name in ("attention", "heads")),
    *(f"docs/results/{tier}/scarcity/scarcity.png" for tier in ("full", "smoke", "full_2x_steps")),
    "docs/results/scarcity_steps/scarcity_steps.png",
    "docs/images/gauge_sweep.png",
    "docs/images/demo_digits.png",
    "docs/images/compare_grid.png",
    *(f"docs/results/{tier}/attribution/attribution.png"
      for tier in ("full", "smoke", "full_recipe_ip_adapter", "full_recipe_mixed", "smoke_recipe_ip_adapter")),
]  # fmt: skip


def test_every_docs_figure_is_paper_sized():
    """Every figure `make figures` makes (those docs/figures.md lists) is held to a paper's column below."""
    from ipa_probe.devtools.figures import all_figures

    assert sorted(f.path for f in all_figures(ROOT)) == sorted(PAPER_SIZED)


@pytest.mark.parametrize("path", PAPER_SIZED)
def test_docs_figures_fit_a_papers_column_read_from_the_saved_file(path):
    """Width (pixels over the PNG's dpi) 3.5 or 7 in; the layout facts stored at saving agree with the file's size,
    no text under 8 pt, no text or legend cut by the edge, no legend over another panel."""
    from ipa_probe.figstyle import saved_layout_problems

    assert saved_layout_problems(ROOT / path) == []


def test_the_drawn_check_catches_overlapping_ticks_small_text_a_legend_over_data_and_a_bare_axis():
    """Each fault drawn on purpose, measured on the drawn figure, and the clean figure that passes."""
    import matplotlib.pyplot as plt

    from ipa_probe.figstyle import SINGLE_COLUMN, drawn_problems, legend_below

    fig, ax = plt.subplots(figsize=(SINGLE_COLUMN, 2.5), layout="constrained")
    ax.plot(np.arange(20), np.linspace(0, 1, 20), label="a rising line")
    ax.set_xticks(range(20), [f"{t}" for t in range(951, -49, -50)])  # 20 three-digit labels in 3 in: they collide
    ax.legend(loc="center")  # the line runs through the middle of the panel
    ax.set_title("tiny", fontsize=6)
    ax.set_xlabel("timestep")
    text = "\n".join(drawn_problems(fig))
    assert "texts overlap: '951' and '901'" in text and "text under 8 pt: 'tiny'" in text
    assert "covers data in 'tiny'" in text and "an unlabelled y axis in 'tiny'" in text
    assert "unlabelled x axis" not in text
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(SINGLE_COLUMN, 2.5), layout="constrained")
    ax.errorbar([0, 1, 2], [1.5, 1.5, 1.5], yerr=1.5, fmt="o", label="mean ± s.e.m.")
    ax.set(xlabel="x", ylabel="y", ylim=(-2, 3.5))
    ax.legend(loc="center")  # clear of the markers, over the middle error bar
    assert any("covers data" in problem for problem in drawn_problems(fig))
    ax.get_legend().remove()
    legend_below(ax)  # the same entry under the panel: clear of every bar, and of the x label
    assert drawn_problems(fig) == []
    handles, labels = ax.get_legend_handles_labels()
    for _ in range(2):  # two keys placed at one side of the figure are drawn over each other
        fig.legend(handles, labels, loc="outside upper center")
    assert any("two legends overlap" in problem for problem in drawn_problems(fig))
    plt.close(fig)


def test_the_saved_file_check_reads_size_resolution_and_what_was_drawn(tmp_path):
    """A figure too wide, too tall and too coarse, with 6 pt text and a legend cut by the edge, read from the file;
    a figure fit to print reads clean."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from ipa_probe._io import write_figure
    from ipa_probe.figstyle import saved_layout_problems

    fig, ax = plt.subplots(figsize=(9.0, 10.0))
    ax.plot([0, 1], label="cut")
    ax.legend(loc="upper left", bbox_to_anchor=(1.2, 1.0))  # past the figure's edge
    ax.set(title="tiny", xlabel="x", ylabel="y")
    ax.title.set_fontsize(6)
    text = "\n".join(saved_layout_problems(write_figure(fig, tmp_path / "wide.png", dpi=50)))
    for what in ("9.00 in wide", "10.00 in tall", "saved at 50 dpi", "'tiny' at 6 pt", "cut by the figure's edge"):
        assert what in text, what
    fig, ax = plt.subplots(figsize=(3.5, 2.5), layout="constrained")
    ax.plot([0, 1], label="fits")
    ax.set(xlabel="x", ylabel="y")
    ax.legend(loc="upper left")
    path = write_figure(fig, tmp_path / "fits.png")
    assert saved_layout_problems(path) == []
    assert Image.open(path).size == (1050, 750)  # 300 dpi by default


def test_compare_grid_is_titled_with_each_images_scores_and_the_classifiers_reading(tmp_path):
    """grid.png: 7 in wide, the selection in its title, under each image its CLIP-I, pixel distance and p(digit)
    (green where the classifier reads the digit, red where not), the references' readings under them."""
    import pandas as pd
    from PIL import Image

    from ipa_probe.compare import METHODS, Comparison
    from ipa_probe.figstyle import saved_layout_problems

    refs = [Image.new("RGB", (16, 16), (60 * i, 60 * i, 60 * i)) for i in range(3)]
    images = {m: refs[:2] for m in METHODS}
    per_image = pd.DataFrame(
        [{"method": m, "seed": s, "clip_i_nearest": 0.9 + 0.01 * s, "pixel_nearest": 0.1 * (s + 1),
          "digit_confidence": 0.2 + 0.7 * s, "digit_right": float(s == 1)} for m in METHODS for s in (0, 1)]
    )  # fmt: skip
    settings = {"run": {"digit": 3}, "digit_readings": {"references": {"labels": [3, 5, 3]}}}
    result = Comparison(refs, [0, 1], images, per_image, pd.DataFrame(), settings)
    path = tmp_path / "out"
    result.save(path)
    assert saved_layout_problems(path / "grid.png") == []
    captions, title = result.grid_captions()
    assert "3 references of a 3" in title and f"{len(METHODS)} methods x 2 seeds" in title and "p(3)" in title
    assert captions["references"] == [("reads 3", True), ("reads 5", False), ("reads 3", True)]
    assert captions[METHODS[0]] == [("CLIP-I 0.90\npixel 0.100\np(3) 0.20", False),
                                    ("CLIP-I 0.91\npixel 0.200\np(3) 0.90", True)]  # fmt: skip
