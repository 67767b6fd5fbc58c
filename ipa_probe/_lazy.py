"""Lazy package attributes (PEP 562), shared by the packages whose import must stay light: the command line imports
them to check its arguments before torch, diffusers or pandas load."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(
    package: str, exports: dict[str, str], submodules: tuple[str, ...] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: each name of ``exports`` (name -> submodule relative to the
    package) is imported on first use and then kept in the package's namespace; each of ``submodules`` is reachable as
    an attribute. Call it at the end of the package's ``__init__``.

    A name must not also be a submodule's name: importing that submodule would rebind the package attribute.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
