"""Sweep throughput: rows per minute with one process and with several (``accelerate launch``), side by side.

Runs the same manifest (embedded tiny SD 1.5 pipeline, offline) under each configuration, interleaved and repeated,
and prints rows per minute two ways: over the row loop (from the split of the rows to the last process finishing,
read from ``summary.json``) and end to end (the whole command: interpreter start, imports, pipeline build, merge).
Speed-ups are ratios of medians measured in this one run, never against numbers from elsewhere.

CPU configurations, on a machine with C cores and P processes:

- 1 process x 1 thread, 1 process x C threads (torch's usual default), P processes x C/P threads
  (``accelerate launch --multi_gpu --num_processes P ... --device cpu``; ``--cpu`` would start one process).

With CUDA: 1 process on one GPU, and one process per GPU when there are several.

The tables of the configurations are compared too: equal thread counts give bit-identical tables; different thread
counts change float32 reductions in the last bits, so the maximum absolute difference is printed.

Usage:
    python benchmarks/sweep_throughput.py [--rows 12] [--steps 10] [--size 128] [--repeats 2] [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Config:
    name: str
    processes: int
    threads: int
    device: str
    loop_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    out: Path | None = None

    def rows_per_min(self, rows: int, which: str) -> float:
        times = self.loop_s if which == "loop" else self.wall_s
        return 60 * rows / statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_manifest(root: Path, rows: int) -> Path:
    from ipa_probe.tiny.sd import default_reference_images

    refs = root / "refs"
    refs.mkdir()
    for i, image in enumerate(default_reference_images(4)):
        image.save(refs / f"{i}.png")
    lines = [
        json.dumps({"prompt": f"prompt {i}", "images": [f"refs/{i % 4}.png", f"refs/{(i + 1) % 4}.png"], "seed": i})
        for i in range(rows)
    ]
    path = root / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(config: Config, manifest: Path, out: Path, args: argparse.Namespace, resume: bool = False) -> dict:
    sweep = ["sweep", str(manifest), "--out", str(out), "--steps", str(args.steps), "--size", str(args.size)]
    sweep += [str(args.size), "--device", config.device, "--threads", str(config.threads), "--no-progress"]
    sweep += ["--resamples", "999"]
    if config.processes == 1:
        command = [sys.executable, "-m", "ipa_probe", *sweep]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
        command += ["--num_processes", str(config.processes), "--num_machines", "1", "--mixed_precision", "no"]
        command += ["--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "ipa_probe", *sweep]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(config.threads),
        "HF_HOME": str(manifest.parent / "hf"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{done.stderr[-4000:]}")
    record = json.loads((out / "summary.json").read_text())
    expected = (0, args.rows) if resume else (args.rows, 0)
    if (record["rows"]["ran"], record["rows"]["resumed"]) != expected or record["processes"] != config.processes:
        raise SystemExit(f"{config.name}: expected (ran, resumed) = {expected}, got {record['rows']}")
    if not resume:
        config.loop_s.append(record["seconds"]["loop"])
        config.wall_s.append(wall)
        config.out = out
    return {**record["seconds"], "wall": wall}


def _max_difference(a: Path, b: Path) -> float:
    from ipa_probe.sweep import load_table

    x, y = load_table(a), load_table(b)
    numeric = x.select_dtypes("number").columns
    return float((x[numeric] - y[numeric]).abs().max().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12, help="manifest rows (default 12)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per row (default 10)")
    parser.add_argument("--size", type=int, default=128, help="image size (default 128: 16 x 16 latents)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, interleaved (default 2)")
    parser.add_argument("--processes", type=int, default=2, help="processes of the multi-process run (default 2)")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU configurations")
    args = parser.parse_args()

    import torch

    cores = os.cpu_count() or 1
    per_process = max(1, cores // args.processes)
    configs = [
        Config("1 process x 1 thread", 1, 1, "cpu"),
        Config(f"1 process x {cores} threads", 1, cores, "cpu"),
        Config(f"{args.processes} processes x {per_process} thread(s)", args.processes, per_process, "cpu"),
    ]
    if cores == 1:
        configs.pop(1)
    gpus = 0 if args.no_gpu or not torch.cuda.is_available() else torch.cuda.device_count()
    if gpus:
        configs.append(Config("1 process, 1 GPU", 1, 1, "cuda"))
        if gpus > 1:
            configs.append(Config(f"{gpus} processes, {gpus} GPUs", gpus, 1, "cuda"))

    print(f"sweep throughput: {args.rows} rows, embedded tiny sd15, {args.size}x{args.size}, {args.steps} steps/row")
    print(f"machine: {cores} CPU cores, {gpus} GPU(s); load average at start {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        manifest = _write_manifest(root, args.rows)
        for repeat in range(args.repeats):
            for index, config in enumerate(configs):
                _run(config, manifest, root / f"out_{index}_{repeat}", args)
                print(f"  run {repeat + 1}/{args.repeats} {config.name}: loop {config.loop_s[-1]:.1f} s", flush=True)
        base = configs[0]
        singles = [c for c in configs if c.processes == 1 and c.device == "cpu"]
        best_single = min(singles, key=lambda c: statistics.median(c.loop_s))
        print(f"load average at end {os.getloadavg()[0]:.1f}")
        print()
        gpu_base = next((c for c in configs if c.device == "cuda"), None)
        print(f"{'configuration':<28} {'rows/min (loop)':>16} {'rows/min (end to end)':>22} {'speed-up':>9}")
        print("-" * 78)
        for config in configs:
            loop, wall = config.rows_per_min(args.rows, "loop"), config.rows_per_min(args.rows, "wall")
            ref = best_single if config.device == "cpu" else gpu_base
            speedup = loop / ref.rows_per_min(args.rows, "loop")
            print(f"{config.name:<28} {loop:>16.1f} {wall:>22.1f} {speedup:>8.2f}x")
        print(f"(speed-up over the row loop, against {best_single.name} on CPU and 1 GPU on GPU)")
        multi = next((c for c in configs if c.processes > 1 and c.device == "cpu"), None)
        if multi is not None:
            loop = multi.rows_per_min(args.rows, "loop") / best_single.rows_per_min(args.rows, "loop")
            wall = multi.rows_per_min(args.rows, "wall") / best_single.rows_per_min(args.rows, "wall")
            print(
                f"\nspeed-up of {multi.name} over {best_single.name} (the faster single process): "
                f"{loop:.2f}x over the row loop, {wall:.2f}x end to end"
            )
        for config in configs[1:]:
            difference = _max_difference(config.out, base.out)
            print(f"max |difference| of the tables, {config.name} vs {base.name}: {difference:.2e}")
        # a rerun with every row done: the lock, the scan, reading every part back with its checksums, the merge
        resume = _run(base, manifest, base.out, args, resume=True)
        loop = statistics.median(base.loop_s)
        print(
            f"rerun with all {args.rows} rows done ({base.name}): {resume['check']:.2f} s checking the finished "
            f"parts (read back whole, checksums verified) = {resume['check'] / loop:.3f}x the {loop:.1f} s row loop "
            f"that computed them; {resume['wall']:.1f} s end to end"
        )


if __name__ == "__main__":
    main()
