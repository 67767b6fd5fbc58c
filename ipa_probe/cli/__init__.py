"""The ``ipa-probe`` command line. Each subcommand lives in its own module with ``add_parser`` and ``run``."""

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
    """A user error: printed as one line, exit code 2."""


#: Exit codes: 0 done; 2 a usage error (nothing ran; one line on stderr); 3 a sweep finished but some of its rows
#: failed (listed with their manifest lines; run it again to retry them); 130 interrupted (Ctrl-C; finished work kept).
EXIT_OK, EXIT_USAGE, EXIT_ROWS_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 130


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
        epilog="exit codes: 0 done, 2 bad arguments or input (one line), 3 some sweep rows failed (run again to "
        "retry them), 130 interrupted (finished work is kept; run the same command to resume)",
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
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        # the known-harmless library messages (diffusers' "should be kept in float32: []" on every load_ip_adapter)
        # are dropped for the command's duration only; a global verbosity change leaked into in-process callers
        with quiet_known_messages():
            return int(args.func(args) or 0)
    except CLIError as err:
        print(f"ipa-probe {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            f"ipa-probe {args.command}: interrupted; finished work is kept, run the same command again to resume",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
