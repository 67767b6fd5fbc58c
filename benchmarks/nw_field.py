"""Fused vs naive exact NW velocity: time and peak memory, side by side, for n = m from 4,096 to 65,536.

- **fused**: :class:`ipa_probe.theory.ExactNWHead`, one attention head through
  ``torch.nn.functional.scaled_dot_product_attention`` (flash attention on CPU, memory-efficient/flash on CUDA),
  which runs the softmax blockwise and never forms the ``n x m`` weight matrix;
- **naive**: ``softmax(-cdist(x / t, S)^2 / (2 h^2)) @ S`` and the affine output map, which forms ``n x m``
  distances, logits and weights.

Each (path, n, d) case runs in its own subprocess so that its peak memory is its own: on CPU the peak resident set
size (``ru_maxrss``) minus the resident size just before the computation, which sees every torch allocation; on
CUDA ``torch.cuda.max_memory_allocated`` minus the memory held before. A naive case whose ``n x m`` matrices
(about three of them at once) would not fit in ``--mem-cap-gib`` is not run and reported as ``OOM (> X GiB
needed)``. The fused case also measures its float32 error against the float64 naive formula on 256 rows
(``fused_rel_err``, relative to the largest velocity), next to the float32 naive formula's own (``naive_rel_err``).

Usage::

    python benchmarks/nw_field.py            # n = m in 4096..65536, d in {2, 16, 64}, CPU (and CUDA if present)
    python benchmarks/nw_field.py --quick    # small sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

FULL_SIZES = (4096, 8192, 16384, 32768, 65536)
FULL_DIMS = (2, 16, 64)
QUICK_SIZES = (1024, 4096)
QUICK_DIMS = (2, 64)
NAIVE_MATRICES = 3  # distances, logits and weights are alive together at the peak
T = 0.5
SIGMA_MIN = 0.01


def naive_velocity(x, t: float, support, sigma_min: float = SIGMA_MIN):
    """The textbook computation: pairwise distances, softmax, matmul (forms three n x m matrices)."""
    import torch

    sigma_t = 1.0 - (1.0 - sigma_min) * t
    h = sigma_t / t
    weights = torch.softmax(-torch.cdist(x / t, support).square() / (2 * h * h), dim=-1)  # (n, m)
    return (weights @ support - (1.0 - sigma_min) * x) / sigma_t


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_case(path: str, n: int, d: int, device: str, repeats: int, threads: int) -> dict:
    """Worker: time one (path, n, d) case and measure its peak memory. Runs in a fresh process."""
    import torch

    from ipa_probe.theory import ExactNWHead

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(device)
    support = torch.randn(n, d, generator=gen).to(device)
    head = ExactNWHead(SIGMA_MIN)
    fn = (lambda: head(x, T, support)) if path == "fused" else (lambda: naive_velocity(x, T, support))
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        # Warm up on a tiny problem first, so that lazy initialisation (thread pools, kernels) is not counted.
        small = slice(0, 64)
        if path == "fused":
            head(x[small], T, support[small])
        else:
            naive_velocity(x[small], T, support[small])
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = _rss_bytes()
        start = time.perf_counter()
        out = fn()
        sync()
        times = [time.perf_counter() - start]
        peak = (torch.cuda.max_memory_allocated() if cuda else _max_rss_bytes()) - before
        # Small cases: repeat for a stable median (the first call above doubles as the warm-up).
        while len(times) < repeats and sum(times) < 20.0:
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        if len(times) > 1:
            times = times[1:]
        result = {"time_s": statistics.median(times), "peak_bytes": max(peak, 0), "runs": len(times)}
        if path == "fused":
            # Accuracy on 256 rows against float64, next to the naive path's own float32 error on the same rows.
            rows = slice(0, min(n, 256))
            reference = naive_velocity(x[rows].double(), T, support.double())
            scale = reference.abs().max()
            result["fused_rel_err"] = float((out[rows].double() - reference).abs().max() / scale)
            naive32 = naive_velocity(x[rows], T, support).double()
            result["naive_rel_err"] = float((naive32 - reference).abs().max() / scale)
    return result


def _spawn(path: str, n: int, d: int, device: str, repeats: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--case", path, str(n), str(d), device, str(repeats), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"failed ({tail[:60]})" if proc.returncode > 0 else f"killed (signal {-proc.returncode})"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    import psutil

    return psutil.virtual_memory().available


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (n = m in 1024, 4096; d in 2, 64)")
    parser.add_argument("--sizes", type=int, nargs="+", help="n = m values (overrides the defaults)")
    parser.add_argument("--dims", type=int, nargs="+", help="d values (overrides the defaults)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CPU, plus CUDA")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case after the first (small cases)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    parser.add_argument(
        "--mem-cap-gib", type=float, default=None, help="skip naive cases needing more (default: half the free memory)"
    )
    parser.add_argument("--csv", help="also write the table to this CSV file")
    parser.add_argument("--case", nargs=6, help=argparse.SUPPRESS)  # worker mode: path n d device repeats threads
    args = parser.parse_args(argv)

    if args.case:
        path, n, d, device, repeats, threads = args.case
        print(json.dumps(run_case(path, int(n), int(d), device, int(repeats), int(threads))))
        return 0

    import pandas as pd
    import torch

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    dims = args.dims or (QUICK_DIMS if args.quick else FULL_DIMS)
    devices = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device in ("auto", "cuda"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            print("CUDA requested but not available", file=sys.stderr)
            return 2
    rows = []
    for device in devices:
        cap = args.mem_cap_gib * 2**30 if args.mem_cap_gib else 0.5 * _available_bytes(device)
        for d in dims:
            for n in sizes:
                row = {"device": device, "n=m": n, "d": d}
                fused = _spawn("fused", n, d, device, args.repeats, args.threads)
                need = NAIVE_MATRICES * n * n * 4
                if need > cap:
                    naive = {"error": f"OOM (> {need / 2**30:.0f} GiB needed)"}
                else:
                    naive = _spawn("naive", n, d, device, args.repeats, args.threads)
                for name, res in (("fused", fused), ("naive", naive)):
                    row[f"{name}_s"] = res.get("time_s", float("nan"))
                    row[f"{name}_peak_MiB"] = res.get("peak_bytes", float("nan")) / 2**20
                    row[f"{name}_note"] = res.get("error", "")
                row["speedup"] = row["naive_s"] / row["fused_s"]
                row["memory_ratio"] = row["naive_peak_MiB"] / max(row["fused_peak_MiB"], 1.0)
                row["fused_rel_err"] = fused.get("fused_rel_err", float("nan"))
                row["naive_rel_err"] = fused.get("naive_rel_err", float("nan"))
                rows.append(row)
                print(
                    f"{device} d={d} n=m={n}: fused {row['fused_s']:.3f}s {row['fused_peak_MiB']:.0f} MiB "
                    f"| naive {row['naive_s']:.3f}s {row['naive_peak_MiB']:.0f} MiB {row['naive_note']}",
                    file=sys.stderr,
                    flush=True,
                )
    table = pd.DataFrame(rows)
    notes = table[["fused_note", "naive_note"]].apply(lambda r: "; ".join(v for v in r if v), axis=1)
    table = table.drop(columns=["fused_note", "naive_note"]).assign(note=notes)
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.float_format", "{:.3g}".format):
        print(f"exact NW velocity at t = {T}, float32, {args.threads} CPU threads; speedup = naive_s / fused_s")
        print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
