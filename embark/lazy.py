"""Package attributes imported on first use: a package root lists ``name → module`` and gets
a module ``__getattr__`` and ``__dir__`` that import each name's module when the name is first
read, so that importing the package imports nothing heavy (the data converter starts without
torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_attributes(
    package: str, exports: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``exports`` map each name to
    the module defining it; a name read once is kept in ``namespace`` (the package's
    ``globals()``).

    Raises (from ``__getattr__``):
        AttributeError: naming the package and the name, for a name not in ``exports``.
    """

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
