"""How fast ``ipa-probe`` refuses a bad command line: each case of ``tests/cli_cases.py`` run as a user runs it
(``python -m ipa_probe ...``, a fresh process), beside the time of importing what the refusal no longer waits for
(torch, diffusers, pandas). Target: every refusal within 1 s on a quiet machine.

    python benchmarks/cli_latency.py             # 3 runs per case, medians
    python benchmarks/cli_latency.py --repeats 5

Prints one line per case (exit code, median seconds, ratio to the heavy imports) and a summary; exits 1 when a case
answers with another exit code than the test expects. Run it on a quiet machine: the times are the point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cli_cases import CASES, argv_of, make_fixtures  # noqa: E402

TARGET_S = 1.0


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    return time.perf_counter() - start, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median reported)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    heavy = [timed([sys.executable, "-c", "import torch, diffusers, pandas"], env)[0] for _ in range(args.repeats)]
    start = [timed([sys.executable, "-c", "pass"], env)[0] for _ in range(args.repeats)]
    heavy_s, start_s = statistics.median(heavy), statistics.median(start)
    print(
        f"python start-up alone: {start_s:.2f} s; import torch, diffusers, pandas: {heavy_s:.2f} s (median of "
        f"{args.repeats}); load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'case':<42} {'exit':>4} {'seconds':>8} {'/heavy':>7} {'<1 s':>5}")
    wrong, slow, times = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        root = make_fixtures(Path(folder))
        for case in CASES:
            runs = [
                timed([sys.executable, "-m", "ipa_probe", *argv_of(case, root)], {**env, **dict(case.env)})
                for _ in range(args.repeats)
            ]
            seconds, code = statistics.median(r[0] for r in runs), runs[-1][1]
            times.append(seconds)
            if code != case.code:
                wrong.append(case.name)
            if seconds > TARGET_S:
                slow.append(case.name)
            print(
                f"{case.name:<42} {code:>4} {seconds:>8.2f} {seconds / heavy_s:>7.2f} "
                f"{'yes' if seconds <= TARGET_S else 'NO':>5}"
            )
    print(
        f"{len(CASES)} cases: median {statistics.median(times):.2f} s, max {max(times):.2f} s; "
        f"{len(CASES) - len(slow)}/{len(CASES)} within {TARGET_S:g} s; the heavy imports alone take {heavy_s:.2f} s"
    )
    if slow:
        print(f"over {TARGET_S:g} s: {', '.join(slow)}")
    if wrong:
        print(f"unexpected exit codes: {', '.join(wrong)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
