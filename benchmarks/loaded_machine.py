"""Per-step time of ``compare``, ``probe`` and ``train-digits`` on a quiet machine and on one loaded with busy
processes, with the old thread settings (OpenMP's default wait policy, torch's default thread count) and the new ones
(what every ``ipa-probe`` command sets: ``OMP_WAIT_POLICY=PASSIVE``, ``OMP_NUM_THREADS``), side by side.

Each measurement is a fresh process (the wait policy is read when OpenMP starts) running a few steps of the command's
own code on the trained digits organism: ``probe`` is the probed pipeline call of ``ipa-probe probe``; ``compare``
the three methods of ``ipa-probe compare`` (learned IP-Adapter, NW head, exact denoiser) for one seed; ``train-digits``
a few steps of each training stage. A step is the time between two calls of the denoiser (UNet or exact denoiser);
the median over the run's steps is reported, so start-up and the first step's warm-up do not count.

The load: ``--load`` processes that spin in pure Python (each keeps one core busy, so the load average approaches
that number), started before and stopped after the loaded measurements.

    python benchmarks/loaded_machine.py                      # load 6, all three commands (about 10-20 min)
    python benchmarks/loaded_machine.py --load 6 --commands probe

Run it on an otherwise quiet machine: the quiet rows are the reference of the loaded ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("probe", "compare", "train-digits")
POLICIES = ("old", "new")
#: denoiser classes whose calls mark the steps (the UNet in generation and training, the exact NW denoiser)
STEP_MODULES = ("UNet2DConditionModel", "ExactNWDenoiser")


# ------------------------------------------------------------------------------------------------ the worker


def _step_clock() -> list[float]:
    """Timestamps of every call of a :data:`STEP_MODULES` module, from a global forward pre-hook."""
    import torch

    stamps: list[float] = []

    def hook(module, args):
        if type(module).__name__ in STEP_MODULES:
            stamps.append(time.perf_counter())

    torch.nn.modules.module.register_module_forward_pre_hook(hook)
    return stamps


def _work(command: str, steps: int) -> None:
    """A few steps of ``command``'s own code on the digits organism."""
    import torch

    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_pipeline, digits_reference_images

    if command == "train-digits":
        import dataclasses

        from ipa_probe.tiny.digits import DigitsTrainConfig, train_digits

        names = {f.name for f in dataclasses.fields(DigitsTrainConfig)}
        sizes = {"vae_steps": 2, "encoder_steps": 2, "steps": steps, "checkpoint_every": 10_000}
        with tempfile.TemporaryDirectory() as out:
            train_digits(out, DigitsTrainConfig(**{k: v for k, v in sizes.items() if k in names}), progress=False)
        return
    pipe = digits_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = digits_reference_images(3, 3)
    call = {"prompt": DIGITS_PROMPT, "num_inference_steps": steps, "guidance_scale": 3.0}
    if command == "probe":
        from ipa_probe import probe

        with probe(pipe):
            pipe(ip_adapter_image=[refs], generator=torch.Generator().manual_seed(0), **call)
    else:
        from ipa_probe.compare import generate_methods

        generate_methods(pipe, refs, [0], call)


def worker(command: str, policy: str, steps: int) -> dict:
    """Run in a fresh process: set the policy before torch loads, run, return the median step time."""
    if policy == "new":
        sys.path.insert(0, str(ROOT))
        from ipa_probe.cli._runtime import configure_threads

        configure_threads(None)  # what main() does before any command runs
    stamps = _step_clock()
    start = time.perf_counter()
    _work(command, steps)
    import torch

    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "median_step_s": statistics.median(gaps[1:] or gaps),
        "steps": len(stamps),
        "wall_s": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }


# ------------------------------------------------------------------------------------------------ the driver


def measure(command: str, policy: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, __file__, "--worker", command, "--policy", policy, "--steps", str(steps)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{command}/{policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=6, help="busy processes during the loaded runs (default 6)")
    parser.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS))
    parser.add_argument("--steps", type=int, default=8, help="denoising or training steps per run (default 8)")
    parser.add_argument("--worker", choices=COMMANDS, help=argparse.SUPPRESS)
    parser.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.policy, args.steps)))
        return 0
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.2f}; {args.steps} steps per run")
    results: dict[tuple[str, str, str], dict] = {}
    for command in args.commands:
        for policy in POLICIES:
            results[command, policy, "quiet"] = measure(command, policy, args.steps)
    busy = spinners(args.load)
    try:
        time.sleep(5)  # let the load average rise before the first loaded run
        for command in args.commands:
            for policy in POLICIES:
                results[command, policy, "loaded"] = measure(command, policy, args.steps)
        load = os.getloadavg()[0]
    finally:
        for proc in busy:
            proc.kill()
        for proc in busy:
            proc.wait()
    print(f"load average at the end of the loaded runs: {load:.2f} ({args.load} busy processes)")
    header = f"{'command':<13} {'settings':<8} {'threads':>7} {'quiet s/step':>13} {'loaded s/step':>14}"
    print(f"{header} {'loaded/quiet':>13}")
    for command in args.commands:
        for policy in POLICIES:
            quiet, loaded = results[command, policy, "quiet"], results[command, policy, "loaded"]
            ratio = loaded["median_step_s"] / quiet["median_step_s"]
            label = "old" if policy == "old" else "new"
            print(
                f"{command:<13} {label:<8} {loaded['threads']:>7} {quiet['median_step_s']:>13.3f} "
                f"{loaded['median_step_s']:>14.3f} {ratio:>13.2f}"
            )
        old, new = results[command, "old", "loaded"], results[command, "new", "loaded"]
        print(f"{command:<13} loaded: old/new = {old['median_step_s'] / new['median_step_s']:.2f}")
    print(
        "old: OpenMP's default wait policy and torch's default threads; new: what ipa-probe sets (PASSIVE, "
        "OMP_NUM_THREADS = the CPUs this process may use). Issue #20's target: loaded/quiet <= 2 with the new ones."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
