"""Training speed of the digits organism's recipes, measured side by side, and what it predicts for a full run.

Runs a few steps of each training in turn (the ``support`` recipe's UNet + adapter stage, the ``ip-adapter``
recipe's base stage and its adapter stage on the shipped base), for several rounds, with the shipped settings'
batch size and 2 threads, and prints each one's seconds per step and its ratio to the ``support`` UNet stage. The
ratio holds under any load (all three share it); the ``support`` stage's quiet-machine time is known from its
shipped ``record.json`` (one timed, uninterrupted run), so each ratio predicts the other stages' quiet times:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/digits_training.py            # about 5 min on a quiet 2-core machine
    OMP_WAIT_POLICY=PASSIVE ipa-probe train-digits --recipe ip-adapter --out /tmp/adapter   # the real thing, timed

The adapter stage's budget is 20 min on 2 cores with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from ipa_probe.tiny import digits as D


def seconds_per_step(kind: str, steps: int, folder: Path) -> float:
    """Seconds per step of the main stage of one training of ``steps`` steps (its setup excluded)."""
    common = dict(steps=steps, checkpoint_every=10**6, threads=2)
    config = {
        "support": lambda: D.DigitsTrainConfig(vae_steps=1, encoder_steps=1, **common),
        "ip-adapter base": lambda: D.DigitsBaseConfig(encoder_steps=1, **common),
        "ip-adapter adapter": lambda: D.DigitsAdapterConfig(**common),
    }[kind]()
    record = D.train_digits(folder, config, progress=False)
    stage = {"support": "unet", "ip-adapter base": "unet", "ip-adapter adapter": "adapter"}[kind]
    return record["wall_s"][stage] / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per training and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kinds = ("support", "ip-adapter base", "ip-adapter adapter")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in kinds:
                times[kind].append(seconds_per_step(kind, args.steps, Path(tmp) / f"{kind}-{r}"))
    support = json.loads((D.DIGITS_WEIGHTS / "record.json").read_text())
    quiet = support["wall_s"]["unet"] / support["config"]["steps"]  # s/step, the timed quiet run
    full = {
        "support": D.DigitsTrainConfig().steps,
        "ip-adapter base": D.DigitsBaseConfig().steps,
        "ip-adapter adapter": D.DigitsAdapterConfig().steps,
    }
    print(f"load average now: {os.getloadavg()[0]:.1f}; support UNet stage on a quiet machine: {quiet:.3f} s/step")
    print(f"{'training':20s} {'s/step here':>12s} {'ratio':>7s} {'steps':>6s} {'predicted quiet min':>20s}")
    base = statistics.median(times["support"])
    for kind in kinds:
        median = statistics.median(times[kind])
        ratio = median / base
        print(f"{kind:20s} {median:12.3f} {ratio:7.2f} {full[kind]:6d} {ratio * quiet * full[kind] / 60:20.1f}")


if __name__ == "__main__":
    main()
