"""What the probe costs a GPU, counted on any machine: operations dispatched per denoising step.

On a GPU each eager operation costs some 5-10 us of host time whatever its size, so the probe's cost there is the
number of operations it adds, not its CPU time. This script counts them exactly (``benchmarks/dispatch.py``'s
``DispatchCount``: kernel launches, views, operations that wait for the device) for one CFG pipeline call per
configuration, on three architectures with random weights (op counts depend on the layers, heads and tokens, not on
the channel widths, so the wide models are narrowed to run on a CPU):

- ``sd15``: Stable Diffusion 1.5's UNet exactly (16 IP-Adapter layers, 8 heads);
- ``sdxl``: SDXL's UNet topology (transformer depths 1 / 2 / 10, 5 / 10 / 20 heads: 70 IP-Adapter layers) at an
  eighth of its widths;
- ``flux``: Flux.1's transformer topology (19 double-stream blocks with IP-Adapter, 38 single-stream) at 2 heads of 16.

A step's count is the difference of a 3-step and a 2-step call (the call's fixed cost cancels), counted from the
probe's ``with`` block opening to its end (the statistics pass runs when a call ends: a per-call cost, the column
"per call": the 2-step call's launches beyond the plain call's, less two steps'). Counted under the GPU's policy
(``--cpu-policy`` for the CPU's): on a CPU the probe forms large records apart instead of stacked
(``ipa_probe.capture.cells.JOIN_ELEMENTS_CPU``: a stack that leaves the cache costs CPU time) and each layer size's
query frames apart (``JOIN_FRAMES_CPU``), and sorts through numpy (``ipa_probe.statistics.rows.NUMPY_SORTS_CPU``:
operations a dispatch count does not see), on a GPU it stacks every record of a size, joins the sizes' query frames,
ranks by binary searches and draws the nulls' permutations by torch's argsort, which is what saves launches.

Modes: the plain call, the probe (default rows), ``maps=True``, ``rows=None``, ``compile=True`` (counted with
``DispatchCount(compiled=True)``: the operations the compiled statistics still dispatch plus one launch per fused
kernel they run; the first call compiles), the NW head, an ablation of reference 0 and ``mode="scale"`` at 0.5 on
it. Counts are the same on every run and machine; the suite holds budgets on them (``tests/test_launch_budget.py``).

    python benchmarks/launches.py                      # sd15 at 16 x 16 latents, 4 and 64 tokens
    python benchmarks/launches.py --arch sd15 sdxl flux --tokens 4 64 --by-site
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

import ipa_probe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dispatch and sd15_arch beside this file
from dispatch import DispatchCount  # noqa: E402

MODES = ("plain", "probe", "maps", "exact", "compiled", "nw_head", "ablate", "scale")


def sdxl_pipeline(seed: int = 0):
    """A StableDiffusionXLPipeline whose UNet has SDXL's topology (70 IP-Adapter layers) at an eighth of its widths."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    from ipa_probe.tiny.sd import tiny_components, tiny_ip_adapter_state_dict

    components = tiny_components("sdxl", seed)
    tiny = components["unet"].config
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        components["unet"] = UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            block_out_channels=(40, 80, 160),
            layers_per_block=2,
            norm_num_groups=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            use_linear_projection=True,
            cross_attention_dim=tiny.cross_attention_dim,
            addition_embed_type="text_time",
            addition_time_embed_dim=tiny.addition_time_embed_dim,
            projection_class_embeddings_input_dim=tiny.projection_class_embeddings_input_dim,
        ).eval()
    pipe = StableDiffusionXLPipeline(**components)
    state = tiny_ip_adapter_state_dict(pipe.unet, pipe.image_encoder, "base", seed)
    pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None)
    return pipe


def flux_pipeline(seed: int = 0):
    """A FluxPipeline whose transformer has Flux.1's block counts (19 double-stream, 38 single-stream)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from ipa_probe.tiny.dit import tiny_flux_components, tiny_flux_ip_adapter_state_dict

    components = tiny_flux_components(seed)
    config = dict(components["transformer"].config)
    config.update(num_layers=19, num_single_layers=38)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        components["transformer"] = FluxTransformer2DModel.from_config(config).eval()
    pipe = FluxPipeline(**components)
    state = tiny_flux_ip_adapter_state_dict(pipe.transformer, pipe.image_encoder, seed)
    pipe.load_ip_adapter([state], subfolder=[""], weight_name=[""], image_encoder_folder=None)
    return pipe


def gpu_policy() -> None:
    """Join records as the probe does on a GPU (every record of a size stacked, every size's frames joined), rank by
    binary searches and sort in torch, on any device."""
    from ipa_probe.capture import cells
    from ipa_probe.statistics import rows

    cells.JOIN_ELEMENTS_CPU = cells.JOIN_FRAMES_CPU = 2**62
    rows.NUMPY_SORTS_CPU = False


def build(arch: str, narrow: int = 1):
    """The ``arch`` pipeline (for ``sd15``, its widths divided by ``narrow``: the same operations)."""
    if arch == "sd15":
        from sd15_arch import sd15_pipeline

        pipe = sd15_pipeline("cpu", torch.float32, narrow=narrow)
    elif arch == "sdxl":
        pipe = sdxl_pipeline()
    else:
        pipe = flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(pipe, arch: str, tokens: int, steps: int) -> dict:
    """One CFG call from random embeddings (no encoders run): ``tokens`` image tokens (4 per reference image)."""
    g = torch.Generator().manual_seed(1)
    images = max(1, tokens // 4)
    embed_dim = pipe.image_encoder.config.projection_dim
    kwargs = dict(num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(0))
    if arch == "flux":
        # Flux's CFG is "true CFG": a separate unconditional pass per step
        image = torch.randn(1, images, embed_dim, generator=g)
        return dict(
            kwargs,
            prompt="a photo",
            negative_prompt="",
            true_cfg_scale=2.0,
            ip_adapter_image_embeds=[image],
            negative_ip_adapter_image_embeds=[torch.zeros_like(image)],
            height=32,
            width=32,
            max_sequence_length=16,
        )
    if arch == "sd15":  # SD 1.5's 768-wide text embeddings, random (its UNet is wider than the tiny text encoder)
        from sd15_arch import call_inputs

        return dict(call_inputs(pipe, 16, steps, images, "cpu", torch.float32), generator=kwargs["generator"])
    embeds = torch.randn(2, images, embed_dim, generator=g)  # [negative, positive] for CFG
    # 16 x 16 latents (the tiny VAE downsamples by 8)
    return dict(kwargs, prompt="a photo", ip_adapter_image_embeds=[embeds], height=128, width=128, guidance_scale=5.0)


def feature(pipe, mode: str):
    if mode == "plain":
        return contextlib.nullcontext()
    if mode == "nw_head":
        return ipa_probe.nw_head(pipe)
    if mode == "ablate":
        return ipa_probe.intervene(pipe, 0)
    if mode == "scale":
        return ipa_probe.intervene(pipe, 0, mode="scale", factor=0.5)
    options = {"probe": {}, "maps": {"maps": True}, "exact": {"rows": None}, "compiled": {"compile": True}}[mode]
    return ipa_probe.probe(pipe, **options)


def count(pipe, arch: str, mode: str, tokens: int, steps: int, by_site: bool) -> DispatchCount:
    counter = DispatchCount(by_site=by_site, compiled=mode == "compiled")
    kwargs = call_kwargs(pipe, arch, tokens, steps)
    with counter, feature(pipe, mode), torch.no_grad():  # the block's end too: its statistics pass may run there
        pipe(**kwargs)
    return counter


def per_step(pipe, arch: str, mode: str, tokens: int, by_site: bool = False) -> dict:
    """Launches, views and syncs one denoising step adds: a 3-step call's counts minus a 2-step call's (and the 2-step
    call's launches, whose excess over two steps is the call's fixed cost)."""
    two, three = (count(pipe, arch, mode, tokens, steps, by_site) for steps in (2, 3))
    sites = {site: three.by_site[site] - two.by_site[site] for site in three.by_site}
    return {
        "two_steps": two.launches,
        "launches": three.launches - two.launches,
        "views": three.views - two.views,
        "syncs": three.syncs - two.syncs,
        "sites": {k: v for k, v in sorted(sites.items(), key=lambda kv: -kv[1]) if v and k != "model"},
    }


def table(arch: str, tokens: int, modes=MODES, by_site: bool = False, pipe=None) -> list[dict]:
    pipe = pipe if pipe is not None else build(arch)
    rows, plain = [], None
    for mode in modes:
        counts = per_step(pipe, arch, mode, tokens, by_site)
        plain = counts if mode == "plain" else plain
        added = counts["launches"] - plain["launches"] if plain and mode != "plain" else None
        fixed = None if added is None else counts["two_steps"] - plain["two_steps"] - 2 * added
        rows.append(dict(arch=arch, tokens=tokens, mode=mode, **counts, added=added, fixed=fixed))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["sd15"], choices=["sd15", "sdxl", "flux"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4, 64])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--by-site", action="store_true", help="the probe's launches per ipa_probe function")
    parser.add_argument("--cpu-policy", action="store_true", help="count the CPU's joining policy, not the GPU's")
    args = parser.parse_args(argv)
    if not args.cpu_policy:
        gpu_policy()
    torch.set_num_threads(1)
    modes = ["plain", *(m for m in args.modes if m != "plain")]
    print("| arch | tokens | mode | launches / step | views / step | syncs / step | added | x plain | per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in args.arch:
        pipe = build(arch)
        for tokens in args.tokens:
            rows = table(arch, tokens, modes, args.by_site, pipe)
            plain = rows[0]["launches"]
            for row in rows:
                added = "" if row["added"] is None else f"+{row['added']:,}"
                ratio = "" if row["added"] is None else f"{row['added'] / plain:.3f}"
                fixed = "" if row["fixed"] is None else f"+{row['fixed']:,}"
                print(
                    f"| {arch} | {tokens} | {row['mode']} | {row['launches']:,} | {row['views']:,} | {row['syncs']} | "
                    f"{added} | {ratio} | {fixed} |"
                )
                if args.by_site and row["sites"]:
                    print("|  |  |  | " + ", ".join(f"{k} {v}" for k, v in list(row["sites"].items())[:12]) + " |||||")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
