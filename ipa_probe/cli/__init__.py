"""The ``ipa-probe`` command line. Each subcommand lives in its own module with ``add_parser``, ``check`` (its
arguments, paths and inputs, checked without torch, diffusers or pandas) and ``run``; :func:`main` runs the check,
sets the OpenMP wait policy and thread count, then runs, and turns every fault into one line and an exit code.

A new flag follows the same pattern: check it in the command's ``check`` when that needs no torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .._quiet import quiet_known_messages

#: subcommand name -> module under ``ipa_probe.cli`` defining ``add_parser(subparsers)`` and ``run(args) -> int``.
SUBCOMMANDS = {
    "probe": "probe",
    "compare": "compare",
    "experiments": "experiments",
    "sweep": "sweep",
    "train-digits": "train_digits",
}


class CLIError(Exception):
    """A fault of the user's input (arguments, manifest, weight files, an output folder holding other work): printed
    as one line, exit code 2. ``silent``: exit 2 without printing (another process of the launch prints it)."""

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent


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
    """
    from .._io import os_error_of
    from ._common import check_path_arguments
    from ._runtime import describe_os_error, thread_scope

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        check_path_arguments(args)  # blank, undecodable, a leading ~: for every path argument alike
        if getattr(args, "check", None) is not None:
            args.check(args)  # torch-free: a bad argument answers at once
        # the known-harmless library messages (diffusers' "should be kept in float32: []" on every
        # load_ip_adapter) are dropped for the command's duration only, not by a process-wide verbosity change
        with thread_scope(getattr(args, "threads", None)), quiet_known_messages():
            return int(args.func(args) or 0)
    except CLIError as err:
        if not err.silent:
            print(f"ipa-probe {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            f"ipa-probe {args.command}: interrupted; finished work is kept, run the same command again to resume",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Exception as err:
        # an OSError, or a writer's own error type wrapping one (safetensors: "... (os error 28)")
        fault = err if isinstance(err, OSError) else os_error_of(err)
        if fault is None:
            raise
        out = getattr(args, "out", None)
        print(f"ipa-probe {args.command}: error: {describe_os_error(fault, out)}", file=sys.stderr)
        return EXIT_ENVIRONMENT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
