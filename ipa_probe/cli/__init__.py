"""The ``ipa-probe`` command line. Each subcommand lives in its own module with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ipa-probe", description=__doc__)
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if not args.verbose:
        # diffusers warns on every load_ip_adapter that an empty list of modules "should be kept in float32"
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    try:
        return int(args.func(args) or 0)
    except CLIError as err:
        print(f"ipa-probe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
