"""Where a probed call's own CPU time goes: the plain call, the probe and ``maps=True`` side by side, and the CPU
time spent inside the probe's named parts, each over the plain call's (issue #53 point 5's misses).

The parts are timed by wrapping the functions (``time.process_time`` around each call, summed per pipeline call):
the records' forming at a pass's end (``ProbeRun._join_pass``), the statistics pass (``agreement._frame_stats``)
and, for the maps, the per-reference sums (``maps.reference_sums``) with the two products inside them: the tokens
through ``W_o`` (``kernels.projected_tokens``) and the sums from the mixed products (``kernels.mixed_sums``). For
``mixed_sums`` the multiply-adds are counted from its arguments' shapes (``c = w P`` and ``P c``: ``2 Q R H T C``
per batch item, and ``Q R (H T)^2`` for the norms) and set beside one plain matrix product of the same inner size,
timed here: the rate this CPU reaches on that work. SD 1.5 at full width (``sd15_arch``), one CFG call of one step,
one thread, the modes alternating; medians over the rounds after a warm-up round.

    python benchmarks/cost_parts.py --latent 16 --tokens 64 --rounds 5
    python benchmarks/cost_parts.py --latent 64 --tokens 64 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sd15_arch import call_inputs, sd15_pipeline

import ipa_probe.capture.maps as maps_module
import ipa_probe.statistics.agreement as agreement
import ipa_probe.statistics.kernels as kernels
from ipa_probe import probe
from ipa_probe.capture.run import ProbeRun

MODES = ("plain", "probe", "maps")
MIXED = "  of it: mixed products (mixed_sums)"  # the part whose multiply-adds are counted


class Parts:
    """CPU seconds and counted multiply-adds inside the wrapped functions since the last :meth:`reset`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.macs = 0
        self.labels: list[str] = []  # in the order wrapped

    def reset(self):
        self.seconds, self.macs = {}, 0

    def wrap(self, owner, name: str, label: str, count=None):
        """Time ``owner.name`` under ``label``; ``count(*args)``, when given, adds the call's multiply-adds."""
        inner = getattr(owner, name)
        self.labels.append(label)

        def timed(*args, **kwargs):
            if count is not None:
                self.macs += count(*args)
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.process_time() - start

        setattr(owner, name, timed)


def mixed_macs(weights, projected, *_) -> int:
    """``mixed_sums``' multiply-adds, from its arguments' shapes: ``c = w P`` and ``P c``, and the norms."""
    batch, references, heads, tokens, channels = projected.shape
    queries, vectors = weights.shape[2], references * heads * tokens
    return batch * queries * (2 * vectors * channels + references * (heads * tokens) ** 2)


def matmul_rate(rows: int = 4096, inner: int = 512, channels: int = 320, repeats: int = 20) -> float:
    """Multiply-adds per CPU second of one ``(rows, inner) @ (inner, channels)`` float32 product."""
    a, b = torch.randn(rows, inner), torch.randn(inner, channels)
    a @ b
    start = time.process_time()
    for _ in range(repeats):
        a @ b
    return repeats * rows * inner * channels / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latent", type=int, default=16, help="latent side (16: 128 px, 64: 512 px)")
    parser.add_argument("--tokens", type=int, default=64, help="reference tokens (4 per reference image)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of the three modes, after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = sd15_pipeline("cpu", torch.float32)
    inputs = call_inputs(pipe, args.latent, 1, args.tokens // 4, "cpu", torch.float32)
    parts = Parts()
    parts.wrap(ProbeRun, "_join_pass", "forming at a pass's end (_join_pass)")
    parts.wrap(agreement, "_frame_stats", "statistics pass (_frame_stats)")
    parts.wrap(maps_module, "reference_sums", "maps: per-reference sums (reference_sums)")
    parts.wrap(kernels, "projected_tokens", "  of it: tokens through W_o (projected_tokens)")
    parts.wrap(kernels, "mixed_sums", MIXED, count=mixed_macs)

    def call(mode: str) -> tuple[float, dict[str, float], int]:
        parts.reset()
        start = time.process_time()
        if mode == "plain":
            pipe(**inputs, generator=torch.Generator().manual_seed(0))
        else:
            with probe(pipe, maps=mode == "maps"):
                pipe(**inputs, generator=torch.Generator().manual_seed(0))
        return time.process_time() - start, dict(parts.seconds), parts.macs

    for mode in MODES:  # warm-up round
        call(mode)
    runs = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(call(mode))
    plain = statistics.median(cpu for cpu, _, _ in runs["plain"])
    print(
        f"SD 1.5, {args.latent}² latents, {args.tokens} tokens, 1 step, CFG, {args.threads} thread(s), "
        f"{args.rounds} rounds: plain call {plain:.3f} s CPU"
    )
    for mode in MODES[1:]:
        print(f"{mode}: whole call {statistics.median(cpu for cpu, _, _ in runs[mode]) / plain:.3f}x plain")
        for label in (label for label in parts.labels if label in runs[mode][0][1]):
            seconds = statistics.median(part[label] for _, part, _ in runs[mode])
            print(f"  {label}: {1e3 * seconds:.1f} ms, {seconds / plain:.4f} of plain")
    seconds = statistics.median(part.get(MIXED, 0.0) for _, part, _ in runs["maps"])
    macs = runs["maps"][0][2]
    if macs and seconds > 0:
        print(
            f"mixed_sums: {macs / 1e9:.2f} G multiply-adds a call at {macs / seconds / 1e9:.1f} G/s; "
            f"one (4096, 512) @ (512, 320) product here: {matmul_rate() / 1e9:.1f} G/s"
        )


if __name__ == "__main__":
    main()
