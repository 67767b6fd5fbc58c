"""NW head and exact denoiser: wall time against the learned IP-Adapter head and the UNet, measured side by side.

1. Pipeline wall time with the NW head swapped in against the learned IP-Adapter head, on a denoiser with Stable
   Diffusion 1.5's architecture (block_out_channels (320, 640, 1280, 1280), cross-attention dim 768, 8 heads, 16
   IP-Adapter layers) and random weights, for both frames of the NW head (``frame="stored"``, the default, and
   ``frame="query"``, which also forms the image logits and a log-sum-exp over the queries per call). Prompts and
   image prompts go in as embeddings. The three configurations rotate (learned, stored, query; stored, query,
   learned; ...) so that drift in the machine's load hits all; the script prints the median of the per-round ratios
   and the ratio of the fastest calls. Target: NW / learned <= 1.10 (each frame).
2. The same comparison for the 16 cross-attention processors alone, called on the inputs they receive in one UNet
   forward: the NW head's own overhead, without the rest of the network diluting it (and resolvable on a busy CPU).
3. One denoising step of the exact empirical denoiser (:class:`ipa_probe.ExactNWDenoiser`) against one step of that
   UNet at the same latent size and batch, with 4, 64 and 512 reference latents in the support.

    python benchmarks/nw_head.py                  # CPU: 32 x 32 latents (256 px), 3 steps
    python benchmarks/nw_head.py --device cuda    # GPU: 64 x 64 latents (512 px), fp16, 30 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from sd15_arch import call_inputs, sd15_pipeline, timed


def _rotated(names: list[str], r: int) -> list[str]:
    """The round-``r`` order of the configurations: each goes first, second and third equally often."""
    return names[r % len(names) :] + names[: r % len(names)]


def _ratios(times: dict[str, list[float]], over: str, base: str) -> dict:
    ratios = [a / b for a, b in zip(times[over], times[base], strict=True)]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_of_minima": min(times[over]) / min(times[base]),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def head_ratio(pipe, inputs: dict, repeats: int, device: str) -> dict:
    """Median wall time of a pipeline call with the learned head and with the NW head in each frame, rotating."""
    import ipa_probe

    def learned():
        pipe(generator=torch.Generator(device).manual_seed(0), **inputs)

    def nw(frame: str):
        with ipa_probe.nw_head(pipe, frame=frame):
            pipe(generator=torch.Generator(device).manual_seed(0), **inputs)

    runs = {"learned": learned, "nw": lambda: nw("stored"), "nw_query": lambda: nw("query")}
    for fn in runs.values():
        fn()  # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name in _rotated(list(runs), r):
            times[name].append(timed(runs[name], device))
    return {
        "learned_s": statistics.median(times["learned"]),
        "nw_s": statistics.median(times["nw"]),
        "nw_query_s": statistics.median(times["nw_query"]),
        **_ratios(times, "nw", "learned"),
        "query": _ratios(times, "nw_query", "learned"),
        "query_over_stored": _ratios(times, "nw_query", "nw"),
        "repeats": repeats,
    }


@torch.no_grad()
def processor_ratio(pipe, latent: int, repeats: int, device: str, dtype: torch.dtype) -> dict:
    """Time all IP-Adapter processors (learned vs NW) on the inputs they get in one CFG UNet forward."""
    from ipa_probe import find_ip_layers
    from ipa_probe.nwhead import NWHeadAttnProcessor

    layers = find_ip_layers(pipe)
    captured = {}

    def capture(index):
        def hook(module, args, kwargs):
            captured[index] = (args, kwargs)

        return hook

    handles = [
        layer.attention.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    g = torch.Generator().manual_seed(3)
    sample = torch.randn(2, 4, latent, latent, generator=g).to(device, dtype)
    text = torch.randn(2, 77, 768, generator=g).to(device, dtype)
    image_embeds = torch.randn(2, 1, pipe.image_encoder.config.projection_dim, generator=g).to(device, dtype)
    pipe.unet(sample, 500, encoder_hidden_states=text, added_cond_kwargs={"image_embeds": [image_embeds]})
    for handle in handles:
        handle.remove()
    calls = [
        (
            layer.attention,
            (
                layer.processor,
                NWHeadAttnProcessor(layer.processor),
                NWHeadAttnProcessor(layer.processor, frame="query"),
            ),
            *captured[i],
        )
        for i, layer in enumerate(layers)
    ]
    names = ["learned", "nw", "nw_query"]

    def run(which: int):
        for attention, processors, args, kwargs in calls:
            processors[which](attention, *args, **kwargs)

    for which in range(len(names)):
        run(which)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in _rotated(names, r):
            which = names.index(name)
            times[name].append(timed(lambda which=which: run(which), device))
    return {
        "layers": len(calls),
        "learned_ms": 1e3 * statistics.median(times["learned"]),
        "nw_ms": 1e3 * statistics.median(times["nw"]),
        "nw_query_ms": 1e3 * statistics.median(times["nw_query"]),
        **_ratios(times, "nw", "learned"),
        "query": _ratios(times, "nw_query", "learned"),
        "query_over_stored": _ratios(times, "nw_query", "nw"),
        "repeats": repeats,
    }


@torch.no_grad()
def step_times(pipe, latent: int, refs: list[int], repeats: int, device: str, dtype: torch.dtype) -> list[dict]:
    """One UNet forward (batch 1, with its IP-Adapter) against one ExactNWDenoiser forward per support size."""
    from ipa_probe import ExactNWDenoiser

    g = torch.Generator().manual_seed(2)
    sample = torch.randn(1, 4, latent, latent, generator=g).to(device, dtype)
    timestep = torch.tensor(500, device=device)
    text = torch.randn(1, 77, 768, generator=g).to(device, dtype)
    image_embeds = torch.randn(1, 1, pipe.image_encoder.config.projection_dim, generator=g).to(device, dtype)
    unet_kwargs = {"encoder_hidden_states": text, "added_cond_kwargs": {"image_embeds": [image_embeds]}}

    def unet_step():
        pipe.unet(sample, timestep, **unet_kwargs)

    unet_step()
    unet_times = []
    rows = []
    for m in refs:
        support = torch.randn(m, 4, latent, latent, generator=g).to(device)
        exact = ExactNWDenoiser(support, pipe.scheduler)

        def exact_step(exact=exact):
            exact(sample, timestep)

        exact_step()
        exact_times = []
        for _ in range(repeats):  # alternate, as above
            unet_times.append(timed(unet_step, device))
            exact_times.append(timed(exact_step, device))
        rows.append({"references": m, "exact_step_s": statistics.median(exact_times)})
    unet_s = statistics.median(unet_times)
    for row in rows:
        row["unet_step_s"] = unet_s
        row["exact_over_unet"] = row["exact_step_s"] / unet_s
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--latent", type=int, default=None, help="latent side (default: 32 on CPU, 64 on GPU)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 3 on CPU, 30 on GPU)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repetitions per configuration")
    parser.add_argument("--processor-repeats", type=int, default=30, help="repetitions of the processor-only timing")
    parser.add_argument("--images", type=int, default=1, help="reference images in the IP-Adapter's support")
    parser.add_argument(
        "--refs", type=int, nargs="*", default=[4, 64, 512], help="exact denoiser support sizes (none: skip part 3)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda")
    latent = args.latent or (64 if gpu else 32)
    steps = args.steps or (30 if gpu else 3)
    dtype = torch.float16 if gpu else torch.float32

    pipe = sd15_pipeline(args.device, dtype)
    inputs = call_inputs(pipe, latent, steps, args.images, args.device, dtype)
    head = head_ratio(pipe, inputs, args.repeats, args.device)
    layer = processor_ratio(pipe, latent, args.processor_repeats, args.device, dtype)
    steps_rows = step_times(pipe, latent, args.refs, args.repeats, args.device, dtype) if args.refs else []

    where = f"{args.device}, {str(dtype).removeprefix('torch.')}, {latent * 8}px ({latent}x{latent} latents)"
    print(
        f"# NW head vs learned IP-Adapter head: SD 1.5 architecture, {where}, {steps} steps, CFG, "
        f"{args.repeats} rounds"
    )
    print(f"learned head            {head['learned_s']:.3f} s / call (median)")
    print(f"NW head, stored frame   {head['nw_s']:.3f} s / call (median)")
    print(f"NW head, query frame    {head['nw_query_s']:.3f} s / call (median)")
    for label, ratios in (("stored / learned", head), ("query / learned", head["query"])):
        target = "meets" if ratios["ratio_median"] <= 1.10 else "misses"
        print(
            f"ratio {label}: median {ratios['ratio_median']:.3f} "
            f"(range {ratios['ratio_min']:.3f}-{ratios['ratio_max']:.3f}), fastest calls "
            f"{ratios['ratio_of_minima']:.3f}; {target} the <= 1.10 target"
        )
    both = head["query_over_stored"]
    print(f"ratio query / stored: median {both['ratio_median']:.3f}, fastest calls {both['ratio_of_minima']:.3f}")
    print(
        f"\n# the {layer['layers']} cross-attention processors alone (CFG batch, {layer['repeats']} rounds): learned "
        f"{layer['learned_ms']:.1f} ms, NW stored {layer['nw_ms']:.1f} ms, NW query {layer['nw_query_ms']:.1f} ms; "
        f"stored / learned median {layer['ratio_median']:.3f} (fastest {layer['ratio_of_minima']:.3f}), "
        f"query / learned median {layer['query']['ratio_median']:.3f} "
        f"(fastest {layer['query']['ratio_of_minima']:.3f}), "
        f"query / stored median {layer['query_over_stored']['ratio_median']:.3f}"
    )
    if steps_rows:
        print(f"\n# exact denoiser step vs UNet step (batch 1, {where})")
        print("| references | exact step (ms) | UNet step (ms) | exact / UNet |")
        print("|---|---|---|---|")
    for row in steps_rows:
        print(
            f"| {row['references']} | {1e3 * row['exact_step_s']:.2f} | {1e3 * row['unet_step_s']:.1f} | "
            f"{row['exact_over_unet']:.4f} |"
        )
    if args.json:
        record = {
            "device": args.device,
            "dtype": str(dtype),
            "latent": latent,
            "steps": steps,
            "threads": torch.get_num_threads(),
            "head": head,
            "processors": layer,
            "exact_steps": steps_rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
