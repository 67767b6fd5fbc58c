"""docs/screens/tensorboard.png: TensorBoard's first screen for the run of docs/logging.md, by a headless browser.

    python docs/screens/tensorboard_shot.py        # or: make screens

Runs docs/logging.md's command (``ipa-probe probe --maps --steps 20 --log-with tensorboard``, the embedded organism,
offline, about 2 min on 2 cores) into a temporary folder, starts ``tensorboard --logdir`` on a free local port, waits
until it answers, has Chromium (``--headless=new``) render the address docs/logging.md tells the reader to open and
write the screenshot, then stops TensorBoard. ``--logdir DIR`` reuses logs already written. Not part of the test suite
(it needs Chromium, which CI lacks): rerun it when the logging or the layout changes, and look at the picture.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADDRESS = "/?smoothing=0#timeseries"  # what docs/logging.md says to open


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"tensorboard did not answer at {url} within {seconds:g} s") from None
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, help="logs already written (default: run docs/logging.md's command)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screens" / "tensorboard.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    parser.add_argument("--size", default="1400,1000", help="window width,height in pixels")
    args = parser.parse_args(argv)
    if not args.chromium:
        parser.error("no chromium on PATH: install it (apt install chromium) or pass --chromium PATH")
    tensorboard = Path(sys.executable).with_name("tensorboard")
    with tempfile.TemporaryDirectory(prefix="tensorboard_shot_") as tmp:
        logdir = args.logdir
        if logdir is None:
            out = Path(tmp) / "probe-logged"
            command = [sys.executable, "-m", "ipa_probe", "probe", "--maps", "--steps", "20"]
            subprocess.run([*command, "--log-with", "tensorboard", "--out", str(out)], check=True, cwd=tmp)
            logdir = out / "logs"
        port = _free_port()
        board = subprocess.Popen(
            [str(tensorboard), "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for(f"http://127.0.0.1:{port}/data/runs", 120)
            # without a GPU, headless Chromium has no WebGL for TensorBoard's charts, which then stay empty: with
            # WebGL off TensorBoard draws them as SVG
            browser = [
                args.chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--disable-webgl",
            ]
            browser += [f"--user-data-dir={tmp}/chromium", f"--window-size={args.size}"]
            browser += ["--virtual-time-budget=15000", f"--screenshot={args.out.resolve()}"]
            subprocess.run(
                [*browser, f"http://127.0.0.1:{port}{ADDRESS}"], check=True, capture_output=True, timeout=300
            )
        finally:
            board.terminate()
            board.wait(30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
