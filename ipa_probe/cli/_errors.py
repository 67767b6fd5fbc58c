"""The one exception the subcommands raise for a fault of the user's input (its own module, below every subcommand
and :mod:`ipa_probe.cli` itself, so that none of them imports the package that runs them)."""

from __future__ import annotations


class CLIError(Exception):
    """A fault of the user's input (arguments, manifest, weight files, an output folder holding other work): printed
    as one line, exit code 2. ``silent``: exit 2 without printing (another process of the launch prints it)."""

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent
