"""Fresh processes forked from one preloaded interpreter (a zygote), for tests that run code in a new process.

A new interpreter pays some 5-8 s of CPU to import torch and diffusers. The zygote imports the heavy third-party
libraries once (nothing of ipa_probe: it refuses to start if one of them did) and forks a child per run. The child
is a real process with its own pid, signals and exit status; it starts in the requested folder, with the requested
environment, arguments and stdin, Python's default SIGINT handling, and runs its code as ``__main__``: what the code
imports of this repository, it imports itself. Variables read when a library is imported are the zygote's: it starts
with this process's environment, offline and with matplotlib's Agg backend (as the doc pages run); a test whose child
needs other such values (accelerate's HF_HOME, say) starts a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: what ``python -m ipa_probe ARGS`` runs (ipa_probe/__main__.py): ``zygote.start(CLI, ARGS)``
CLI = "import sys; from ipa_probe.cli import main; sys.exit(main())"
#: what the zygote imports before it forks anything (third-party only)
PRELOAD = """
import diffusers, matplotlib.pyplot, numpy, pandas, PIL.Image, pyarrow.parquet, safetensors.torch, scipy.stats, torch
for name in ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "FluxPipeline"):
    getattr(diffusers, name)
"""

# One request a line on stdin; for each, a monitor child forks the runner, reports its pid, waits for it and writes
# its exit status (Popen's returncode: negative for a signal) into the request's status file, atomically. The zygote
# ignores SIGCHLD, so its monitors are reaped without a thread; a monitor restores it to wait for its runner.
_ZYGOTE = """
import io, json, os, signal, sys
exec(PRELOAD)
assert not [m for m in sys.modules if m.split(".")[0] == "ipa_probe"], "the zygote imported ipa_probe"
signal.signal(signal.SIGCHLD, signal.SIG_IGN)


def run(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        os.dup2(os.open(path, flags, 0o644), fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.argv = ["-c", *req["argv"]]
    exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


for line in sys.stdin:
    req = json.loads(line)
    read, write = os.pipe()
    if os.fork() == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(read)
        pid = os.fork()
        if pid == 0:
            os.close(write)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            run(req)
            sys.exit(0)
        os.write(write, f"{pid}\\n".encode())
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with open(req["status"] + ".tmp", "w") as handle:
            handle.write(str(status))
        os.replace(req["status"] + ".tmp", req["status"])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as handle:
        print(handle.readline().strip(), flush=True)
"""


class Forked:
    """One run of the zygote: the parts of :class:`subprocess.Popen` the tests use (its output is read at the end)."""

    def __init__(self, pid: int, files: dict[str, Path]):
        self.pid, self._files, self.returncode = pid, files, None

    def poll(self) -> int | None:
        if self.returncode is None and self._files["status"].exists():
            self.returncode = int(self._files["status"].read_text())
        return self.returncode

    def wait(self, timeout: float = 600) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float = 600) -> tuple[str, str]:
        self.wait(timeout)
        return self._files["stdout"].read_text(), self._files["stderr"].read_text()


class Zygote:
    """The preloaded interpreter; :meth:`start` forks a fresh process from it. Close it when done."""

    def __init__(self, folder: Path, root: Path):
        self._folder, self._count = Path(folder), 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg")
        source = f"PRELOAD = {PRELOAD!r}\n{_ZYGOTE}"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", source],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env=env,
            # a background shell starts its jobs with SIGINT ignored: the children must get Python's default handling
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    def start(self, code: str, argv=(), cwd: Path | None = None, env=None, stdin: str = "") -> Forked:
        """Run ``code`` (as ``python -c code *argv``) in a fresh child, in ``cwd``, with exactly ``env``."""
        self._count += 1
        files = {name: self._folder / f"run{self._count}.{name}" for name in ("stdin", "stdout", "stderr", "status")}
        files["stdin"].write_text(stdin)
        req = {
            "code": code,
            "argv": list(argv),
            "cwd": str(cwd or self._folder),
            "env": dict(os.environ if env is None else env),
            **{name: str(path) for name, path in files.items()},
        }
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote stopped (exit status {self._proc.wait()}); see its stderr above")
        return Forked(int(line), files)

    def close(self) -> None:
        """Stop the zygote at once (it holds nothing to finish); children still running are left to end."""
        self._proc.kill()
        self._proc.wait()
        self._proc.stdin.close()
        self._proc.stdout.close()
