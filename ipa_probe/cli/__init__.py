"""The ``ipa-probe`` command line. Each subcommand lives in its own module with ``add_parser``, ``check`` (its
arguments, paths and inputs, checked without torch, diffusers or pandas) and ``run``; :func:`main` runs the check,
sets the OpenMP wait policy and thread count, then runs, and turns every fault into one line and an exit code.

A new flag follows the same pattern: check it in the command's ``check`` when that needs no torch."""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .._quiet import quiet_known_messages
from ._errors import CLIError

#: subcommand name -> module under ``ipa_probe.cli`` defining ``add_parser(subparsers)`` and ``run(args) -> int``.
SUBCOMMANDS = {
    "probe": "probe",
    "compare": "compare",
    "experiments": "experiments",
    "sweep": "sweep",
    "train-digits": "train_digits",
}


#: Exit codes: 0 done; 1 a fault of the environment (disk full, read-only or permission denied: one line naming the
#: path; finished work kept); 2 a fault of the input (bad arguments, manifest, weight files, a folder held by another
#: run or holding other work: one line; nothing changed); 3 a sweep finished but some of its rows did not (listed
#: with their manifest lines; run again to retry them); 130 interrupted (Ctrl-C; finished work kept).
EXIT_OK, EXIT_ENVIRONMENT, EXIT_USAGE, EXIT_ROWS_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class _ArgumentError(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{prog}: error: {message} (see {prog} --help)")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (``prog: error: ...``) and exit code 2, without the usage block."""

    def error(self, message: str):
        raise _ArgumentError(self.prog, message)

    def _print_message(self, message: str, file=None) -> None:
        """Write ``--help`` (or a usage line) without argparse's silence on a write error: a full device or a closed
        pipe must not end with exit code 0."""
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ipa-probe",
        description="Record IP-Adapter attention against Gaussian Nadaraya-Watson kernel weights, swap the NW head "
        "in, and reproduce the paper's experiments. With no model arguments, `probe` and `compare` run the trained "
        "digits organism shipped in the package, offline. Each command has its own --help.",
        epilog="exit codes: 0 done, 1 a fault of the environment (disk full, read-only, no permission; one line "
        "naming the path), 2 bad arguments or input (one line; nothing changed), 3 some sweep rows did not finish "
        "(run again to retry them), 130 interrupted (finished work is kept; run the same command to resume). "
        "Every command sets OMP_WAIT_POLICY=PASSIVE and OMP_NUM_THREADS (--threads) unless you set them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{module}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``ipa-probe`` command; returns its exit code.

    Every subcommand checks its arguments, paths and inputs first (its ``check``, which imports neither torch nor
    diffusers nor pandas), then sets the OpenMP wait policy and thread count, then runs. Faults become one line on
    stderr and an exit code (:data:`EXIT_USAGE` for the input, :data:`EXIT_ENVIRONMENT` for the environment).

    Ctrl-C ends with :data:`EXIT_INTERRUPTED` however often it is pressed: the first stops the work (finished files
    are kept), a second one while that finishes is ignored, a third stops the process at once. A standard output
    that cannot be written (a reader that closed the pipe, a full device) ends with :data:`EXIT_ENVIRONMENT`, quietly
    for a closed pipe and with one line for a full device, never with Python's "Exception ignored" at exit.
    ``argv=None`` (the ``ipa-probe`` command itself) reads ``sys.argv``, also settles the process's own standard
    output before returning, and leaves a second Ctrl-C ignored until it exits.
    """
    command_line = argv is None
    with _interrupts(command_line):
        try:
            code = _main(argv)
        except SystemExit as exit_:  # --help: argparse prints, then exits
            if not command_line:
                raise
            code = exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
        if command_line:
            code = _settle_stdout(code, "ipa-probe")
    return code


def _main(argv: list[str] | None) -> int:
    from .._io import OutputLocked, os_error_of
    from ._common import check_path_arguments
    from ._runtime import describe_os_error, thread_scope

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as err:
        _say(str(err))
        return EXIT_USAGE
    except OSError as err:  # --help written to a standard output that cannot take it (a full device, a closed pipe)
        return _stdout_failed(err, "ipa-probe", EXIT_OK)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # names this run to a second writer (the lock)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        check_path_arguments(args)  # blank, undecodable, a leading ~: for every path argument alike
        if getattr(args, "check", None) is not None:
            args.check(args)  # torch-free: a bad argument answers at once
        # the known-harmless library messages (diffusers' "should be kept in float32: []" on every
        # load_ip_adapter) are dropped for the command's duration only, not by a process-wide verbosity change
        with _folder_locks(args), thread_scope(getattr(args, "threads", None)):
            with quiet_known_messages(), _named_stdout():
                return int(args.func(args) or 0)
    except CLIError as err:
        if not err.silent:
            _say(f"ipa-probe {args.command}: error: {_with_notes(err)}")
        return EXIT_USAGE
    except OutputLocked as err:  # another live run holds an output folder: decided before torch loads
        _say(f"ipa-probe {args.command}: error: {err}")
        return EXIT_USAGE
    except KeyboardInterrupt as err:
        default = "finished work is kept, run the same command again to resume"
        what = "; ".join(getattr(err, "__notes__", [])) or default
        _say(f"ipa-probe {args.command}: interrupted; {what}")
        return EXIT_INTERRUPTED
    except Exception as err:
        # an OSError, or a writer's own error type wrapping one (safetensors: "... (os error 28)")
        fault = err if isinstance(err, OSError) else os_error_of(err)
        if fault is None:
            raise
        if fault.errno == errno.EPIPE and fault.filename in (None, STDOUT):  # the reader closed the pipe: be quiet
            _silence(sys.stdout)
            return EXIT_ENVIRONMENT
        out = getattr(args, "out", None)
        _say(f"ipa-probe {args.command}: error: {_with_notes(err, describe_os_error(fault, out))}")
        return EXIT_ENVIRONMENT


def _with_notes(err: BaseException, text: str | None = None) -> str:
    """``err`` (or ``text``) and the notes added on its way up (what the output folder holds), as one line."""
    return "; ".join([text if text is not None else str(err), *getattr(err, "__notes__", [])])


@contextmanager
def _folder_locks(args: argparse.Namespace) -> Iterator[None]:
    """Hold the locks of the folders the command writes (its ``writes(args)``) from before torch loads until it
    ends: a second writer is refused at once, naming this process and its command line. Under ``accelerate launch``
    only the main process (``RANK`` 0) takes them; the others check that their launch holds the folder."""
    import shlex
    from contextlib import ExitStack

    from .._io import output_lock

    folders = args.writes(args) if getattr(args, "writes", None) else []
    args.holder = f"ipa-probe {shlex.join(args.argv)}"[:200]
    with ExitStack() as stack:
        if os.environ.get("RANK", "0") == "0":
            for folder in folders:
                stack.enter_context(output_lock(folder, args.holder, tidy=True))
        yield


#: the file name a fault of the standard output carries (its errors have none: they would be read as --out's)
STDOUT = "<standard output>"


class _NamedStdout:
    """The standard output, whose write faults name it: ``OSError(errno, reason, STDOUT)`` with the remedy, so that a
    full device is not reported as a fault of ``--out`` and a closed pipe is recognised as such."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _call(self, name: str, *args):
        try:
            return getattr(self._stream, name)(*args)
        except OSError as err:
            if err.errno is None or err.filename is not None:
                raise
            fault = OSError(err.errno, err.strerror or os.strerror(err.errno), STDOUT)
            fault.remedy = "the command's files are written; only what it prints is lost (redirect it elsewhere)"
            raise fault from None

    def write(self, text: str) -> int:
        return self._call("write", text)

    def flush(self) -> None:
        return self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def _named_stdout() -> Iterator[None]:
    """:class:`_NamedStdout` in place of ``sys.stdout`` while a command runs (the stream itself is put back)."""
    stream = sys.stdout
    if stream is None:
        yield
        return
    sys.stdout = _NamedStdout(stream)
    try:
        yield
    finally:
        if isinstance(sys.stdout, _NamedStdout):
            sys.stdout = stream


def _say(line: str) -> None:
    """``line`` on stderr; a stderr that cannot be written (closed, a full device) is silenced, never raised."""
    if sys.stderr is None:  # started with stderr closed: print(file=None) would write to stdout
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # ValueError: a closed stream
        _silence(sys.stderr)


def _silence(stream) -> None:
    """Point ``stream``'s descriptor at the null device, so that the interpreter's own flush at exit (of what is
    still buffered) succeeds instead of printing "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor (a replaced stream): nothing to point elsewhere
        pass


def _settle_stdout(code: int, prog: str) -> int:
    """Flush standard output now, while a failure can still set the exit code: a reader that closed the pipe
    (``EPIPE``) ends quietly with :data:`EXIT_ENVIRONMENT`; a full device, with one line and that code."""
    if sys.stdout is None:  # started with stdout closed: nothing was printed anywhere
        return code
    try:
        sys.stdout.flush()
    except OSError as err:
        return _stdout_failed(err, prog, code)
    except ValueError:  # stdout closed
        return code
    return code


def _stdout_failed(err: OSError, prog: str, code: int) -> int:
    """A standard output that could not be written: quiet for a closed pipe, one line otherwise; an exit code that
    said all went well becomes :data:`EXIT_ENVIRONMENT`."""
    _silence(sys.stdout)
    if err.errno != errno.EPIPE:
        reason = os.strerror(err.errno or errno.EIO)
        _say(f"{prog}: error: '{STDOUT}': {reason}; the command's files are written, only what it prints is lost")
    return code if code not in (EXIT_OK, EXIT_ROWS_FAILED) else EXIT_ENVIRONMENT


@contextmanager
def _interrupts(command_line: bool) -> Iterator[None]:
    """The first Ctrl-C raises ``KeyboardInterrupt`` (the command stops, keeping finished work); a second one while
    that unwinds is ignored, so the exit code stays :data:`EXIT_INTERRUPTED` and the cleanup finishes; a third stops
    the process at once with that code (finished files are whole; a hidden temp file may remain).

    Only in the main thread and where Python's own handler is installed (a caller's handler is left alone). For the
    command line itself the handler stays ignoring after an interrupt, until the process exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    count = 0

    def handler(signum, frame):
        nonlocal count
        count += 1
        if count == 1:
            raise KeyboardInterrupt
        if count >= 3:
            os.write(2, b"ipa-probe: interrupted again; stopping now\n")
            os._exit(EXIT_INTERRUPTED)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN if command_line and count else previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
