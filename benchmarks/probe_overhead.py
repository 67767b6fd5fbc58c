"""Probe overhead: wall time and memory of one pipeline call with the probe on and off, side by side.

The denoiser has Stable Diffusion 1.5's architecture (block_out_channels (320, 640, 1280, 1280), cross-attention dim
768, 8 heads, 16 IP-Adapter layers) with random weights; prompts and image prompts go in as embeddings, so no text or
image encoder weights are needed. Plain and probed calls alternate; the script prints the median ratio.

Memory: each configuration runs in a fresh subprocess, is warmed up, and reports the peak of one call above its
resident baseline (RSS sampled at 1 kHz on CPU; ``torch.cuda.max_memory_allocated`` on a GPU). The probe's own
buffers are also reported: they grow with steps × layers × heads,
not with the image size. A third configuration runs the probe with ``maps=True`` (reference maps, see
``ipa_probe/capture/maps.py``): its ratio to plain (target <= 1.10 on the CPU). The probe's own target is <= 1.05
on the CPU and <= 1.02 on a GPU (512², fp16, 30 steps), and its kept maps next to the
up-front estimate (steps × layers × batch × queries × tokens × 2 kinds × 4 bytes; no head dimension).

    python benchmarks/probe_overhead.py                 # CPU, 32x32 latents (256 px), 4 steps
    python benchmarks/probe_overhead.py --device cuda   # GPU, 64x64 latents (512 px), fp16, 30 steps
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import pandas as pd
import torch
from sd15_arch import call_inputs, sd15_pipeline, sync

MODES = ("plain", "probe", "maps")


def timed_call(pipe, inputs: dict, mode: str, device: str):
    """Seconds of one pipeline call (``mode``: plain, probe, or probe with maps=True), and the finished probe run
    (``None`` when plain)."""
    from ipa_probe import probe

    generator = torch.Generator(device).manual_seed(0)
    sync(device)
    start = time.perf_counter()
    if mode != "plain":
        with probe(pipe, maps=mode == "maps") as run:
            pipe(generator=generator, **inputs)
    else:
        run = None
        pipe(generator=generator, **inputs)
    sync(device)
    return time.perf_counter() - start, run


def buffer_bytes(run) -> int:
    """Bytes the probe keeps on the device for its statistics (sums, counts, timesteps)."""
    return sum(call["sums"].nbytes + call["counts"].nbytes + call["timesteps"].nbytes for call in run._result["calls"])


def map_bytes(run) -> int:
    """Bytes of the reference maps a ``maps=True`` run kept (0 without maps)."""
    if run is None or run._maps is None:
        return 0
    return sum(t.nbytes for entries in run._maps.store.values() for _, t in entries)


class _PeakRSS:
    """Samples this process's resident set every millisecond while active; ``peak`` is the largest seen (bytes)."""

    def __init__(self):
        import threading

        import psutil

        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.peak = self._process.memory_info().rss

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _peak_child(args: tuple) -> dict:
    """In a fresh process: build, warm up, then the peak memory of one call above the resident baseline."""
    device, dtype_name, latent, steps, n_images, mode = args
    dtype = getattr(torch, dtype_name)
    pipe = sd15_pipeline(device, dtype)
    inputs = call_inputs(pipe, latent, steps, n_images, device, dtype)
    timed_call(pipe, inputs, mode, device)  # warm-up: allocator pools and lazy state exist before measuring
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    import psutil

    rss_base = psutil.Process().memory_info().rss
    with _PeakRSS() as sampler:
        _, run = timed_call(pipe, inputs, mode, device)
    out = {"call_extra_rss_mib": (sampler.peak - rss_base) / 2**20}
    if device.startswith("cuda"):
        out["call_extra_cuda_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    out["probe_buffers_kib"] = buffer_bytes(run) / 1024 if run is not None else 0.0
    out["maps_kept_kib"] = map_bytes(run) / 1024
    out["maps_estimate_kib"] = run._maps.estimated_bytes / 1024 if mode == "maps" else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--latent", type=int, default=None, help="latent side (default: 32 on CPU, 64 on GPU)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: 4 on CPU, 30 on GPU)")
    parser.add_argument("--images", type=int, default=2, help="reference images (4 tokens each)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating plain/probed pairs")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--no-memory", action="store_true", help="time only (skip the fresh-process memory runs)")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    latent = args.latent or (64 if gpu else 32)
    steps = args.steps or (30 if gpu else 4)
    dtype = torch.float16 if gpu else torch.float32
    print(
        f"SD 1.5 UNet (random weights), {latent}x{latent} latents, {steps} steps, CFG, {args.images} reference "
        f"images, {args.device}, {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}"
    )

    pipe = sd15_pipeline(args.device, dtype)
    inputs = call_inputs(pipe, latent, steps, args.images, args.device, dtype)
    for mode in MODES:  # warm-up, every path
        _, run = timed_call(pipe, inputs, mode, args.device)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):  # rotate which goes first, so drift in the machine's load hits all
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            times[mode].append(timed_call(pipe, inputs, mode, args.device)[0])
    rows = []
    # targets: the probe <= 1.05 on the CPU (its first issue) and <= 1.02 on a GPU at 512², fp16, 30 steps
    for mode, target in (("probe", 1.02 if gpu else 1.05), ("maps", 1.10)):
        ratios = [p / q for p, q in zip(times[mode], times["plain"], strict=True)]
        rows.append(
            {
                "config": "probe" if mode == "probe" else "probe, maps=True",
                "plain_s": statistics.median(times["plain"]),
                "probed_s": statistics.median(times[mode]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "target": target,
                "met": statistics.median(ratios) <= target,
            }
        )
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    extra = [m / p for m, p in zip(times["maps"], times["probe"], strict=True)]
    print(f"maps=True over the probe alone: median {statistics.median(extra):.3f}x")

    if args.no_memory:
        return 0
    # memory: fresh processes so each peak is its own
    ctx = mp.get_context("spawn")
    memory = []
    configs = [(latent, steps), (latent // 2, steps), (latent, steps * 2)]
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        for lat, st in configs:
            for mode in MODES:
                res = pool.apply(
                    _peak_child, ((args.device, str(dtype).removeprefix("torch."), lat, st, args.images, mode),)
                )
                memory.append({"latent": lat, "steps": st, "mode": mode, **res})
    mem = pd.DataFrame(memory)
    peak = "call_extra_cuda_mib" if gpu else "call_extra_rss_mib"
    plain_mem, probed_mem, maps_mem = (mem[mem["mode"] == m].set_index(["latent", "steps"]) for m in MODES)
    side = pd.DataFrame(
        {
            "plain_call_peak_mib": plain_mem[peak],
            "probed_call_peak_mib": probed_mem[peak],
            "extra_mib": probed_mem[peak] - plain_mem[peak],
            "probe_buffers_kib": probed_mem["probe_buffers_kib"],
            "maps_call_peak_mib": maps_mem[peak],
            "maps_extra_mib": maps_mem[peak] - plain_mem[peak],
            "maps_kept_kib": maps_mem["maps_kept_kib"],
            "maps_estimate_kib": maps_mem["maps_estimate_kib"],
        }
    )
    print(
        f"peak memory of one call above the resident baseline ({'CUDA allocator' if gpu else 'RSS, sampled 1 kHz'}):"
    )
    print(side.to_string(float_format=lambda v: f"{v:.2f}"))
    print(
        "probe buffers depend on steps x layers x heads, not on the latent size:",
        mem[mem["mode"] == "probe"].groupby("steps")["probe_buffers_kib"].nunique().eq(1).all(),
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"timing": rows, "memory": memory}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
