"""The name rule of tables (and so of features, which are named after their tables).

A table name is an ASCII identifier of at most 128 characters, ``[A-Za-z_][A-Za-z0-9_]{0,127}``
(``t0``, ``user_id``; not ``../t``, ``/abs``, ``a/b``, ``x.y``, ``t-0``): it becomes a torch
parameter path (``embeddings.<table>.weight``, where ``.`` separates modules), a checkpoint
tensor name and, exported, a folder (``sparse/<table>``) and database keys. This is the rule of
``hps.names``, which says why at length; embark and hps import nothing of each other, and
``tests/faults/test_paths.py`` checks that the two accept exactly the same names.
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = ["NAME_RULE", "check_name", "is_name"]

_MAX_CHARS = 128
_NAME = re.compile(rf"[A-Za-z_][A-Za-z0-9_]{{0,{_MAX_CHARS - 1}}}")
NAME_RULE = (
    f"an ASCII identifier of at most {_MAX_CHARS} characters: a letter or '_', then "
    "letters, digits or '_' (e.g. 't0', 'user_id')"
)


def is_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` follows the name rule."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: object, what: str, error: type[ValueError] = ValueError) -> str:
    """``name`` when it follows the name rule.

    Raises:
        ValueError: (or ``error``, a subclass) naming ``what``, the value and the rule.
    """
    if not is_name(name):
        raise error(f"{what} {name!r} is not a valid name; expected {NAME_RULE}")
    return name
