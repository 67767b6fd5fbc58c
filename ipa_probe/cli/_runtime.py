"""What the command line sets up before torch loads (OpenMP's wait policy, the thread count) and how it words a fault
of the environment (disk full, read-only, no permission) as one line.

Imports nothing heavy: :func:`configure_threads` must run before torch is imported to have its full effect.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["configure_threads", "default_threads", "describe_os_error", "thread_scope"]

#: The OpenMP wait policy set unless the user set one: threads that wait sleep instead of spinning. Spinning threads
#: keep a core busy while they wait for work; on a machine shared with other jobs they take the cores those jobs (and
#: the other threads of the same run) need, and a run can be many times slower than on a quiet machine.
WAIT_POLICY = "PASSIVE"


def default_threads() -> int:
    """The CPUs this process may use: its affinity mask (``taskset``, cpusets), capped by a container's CPU quota
    (cgroups ``cpu.max``) and by the physical cores (hyper-threads add little to torch's kernels; torch's own
    default counts physical cores too)."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        count = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        count = min(count, quota)
    try:
        import psutil  # a dependency of accelerate

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    if physical:
        count = min(count, physical)
    return max(1, count)


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), rounded up; ``None`` if
    there is none or it cannot be read."""
    import math

    candidates = ((f"{root}/cpu.max", None), (f"{root}/cpu/cpu.cfs_quota_us", "cpu.cfs_period_us"))
    for path, period_name in candidates:
        try:
            with open(path) as handle:
                fields = handle.read().split()
            if period_name is not None:
                with open(os.path.join(os.path.dirname(path), period_name)) as handle:
                    fields.append(handle.read().strip())
            quota, period = fields[0], fields[1]
            if quota in ("max", "-1"):
                return None
            return max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, IndexError):
            continue
    return None


def configure_threads(threads: int | None = None, environ: dict[str, str] | None = None) -> int:
    """Set ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS`` for a process that has not loaded torch yet.

    A variable the user set is kept, except that an explicit ``threads`` (the ``--threads`` flag) always sets
    ``OMP_NUM_THREADS``. OpenMP, torch (its default thread count), MKL and OpenBLAS read these when they load.

    Args:
        threads: the thread count asked for, or ``None`` for the user's ``OMP_NUM_THREADS`` or else
            :func:`default_threads`.
        environ: the environment to change (default ``os.environ``).

    Returns:
        the thread count in effect.
    """
    env = os.environ if environ is None else environ
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        return threads
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    count = default_threads()
    env["OMP_NUM_THREADS"] = str(count)
    return count


@contextmanager
def thread_scope(threads: int | None) -> Iterator[None]:
    """Apply ``--threads`` for one command: the environment before torch loads, and ``torch.set_num_threads`` if
    torch is already loaded (a caller running :func:`ipa_probe.cli.main` in its own process). Both are restored on
    exit, so that such a caller's later subprocesses and torch see its own settings again."""
    saved = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    configure_threads(threads)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None and threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch = sys.modules.get("torch")  # loaded by the command, perhaps: its count came from the environment
        if before is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)


#: errno -> what to do about it (the path and the system's own wording come first)
_REMEDIES = {
    errno.ENOSPC: "free space on that disk or write to another --out; files finished before it are kept whole",
    errno.EDQUOT: "your disk quota is used up: free space or write to another --out",
    errno.EROFS: "that file system is read-only: write to another --out",
    errno.EACCES: "no permission: change the permissions or write to another --out",
    errno.EPERM: "no permission: change the permissions or write to another --out",
    errno.EISDIR: "a folder stands where a file is expected: move it away or rename it",
    errno.ENOTDIR: "a file stands where a folder is expected: move it away or rename it",
    errno.EEXIST: "something already stands there: move it away or rename it",
    errno.ENOENT: "it does not exist (was it moved or deleted while the command ran?)",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) and run again",
    errno.ENAMETOOLONG: "the name is too long: use a shorter --out",
    errno.EIO: "the disk reported an I/O error: check the disk, or write to another --out",
}


def describe_os_error(err: OSError, out: str | os.PathLike | None = None) -> str:
    """One line for an ``OSError``: the path, the system's reason and the errno, then what to do.

    An error carrying a ``remedy`` attribute (:class:`ipa_probe._io.NotOurs`, an input file that cannot be read)
    names that remedy instead of the one for its errno. ``out``: the command's output folder, named when the error
    carries no path (a writer that reports only the errno, such as safetensors) and the errno is one of writing (disk
    full, quota, read-only).

    Example: ``'/mnt/out/rows/row-000003.parquet': No space left on device [errno 28]; free space on that disk or
    write to another --out; files finished before it are kept whole``.
    """
    if err.errno is not None:
        reason = err.strerror or os.strerror(err.errno)
    else:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
    where = ""
    if err.filename is not None:
        where = f"{os.fsdecode(err.filename)!r}: "
        if err.filename2 is not None:
            where = f"{os.fsdecode(err.filename)!r} -> {os.fsdecode(err.filename2)!r}: "
    elif out is not None and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        where = f"writing under {os.fspath(out)!r}: "
    code = f" [errno {err.errno}]" if err.errno is not None else ""
    remedy = getattr(err, "remedy", None) or _REMEDIES.get(
        err.errno, "fix the cause and run the same command again (finished work is kept)"
    )
    return f"{where}{reason}{code}; {remedy}"
