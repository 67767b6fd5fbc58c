"""The one exception the subcommands raise for a fault of the user's input (its own module, below every subcommand
and :mod:`ipa_probe.cli` itself, so that none of them imports the package that runs them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CLIError(Exception):
    """A fault of the user's input (arguments, manifest, weight files, an output folder holding other work): printed
    as one line, exit code 2. ``silent``: exit 2 without printing (another process of the launch prints it)."""

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent


@contextmanager
def cli_errors(*types: type[Exception], prefix: str = "") -> Iterator[None]:
    """Turn an error of ``types`` (default: ``ValueError``) raised in the block into a :class:`CLIError` of its
    message after ``prefix`` (``"--"`` where the message starts with the argument's name)."""
    caught = types or (ValueError,)
    try:
        yield
    except caught as err:
        raise CLIError(f"{prefix}{err}") from None
