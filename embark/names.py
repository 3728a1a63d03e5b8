"""The name rule of tables (and so of features, which are named after their tables).

A table name is 1 to 128 ASCII letters, digits, ``_`` or ``-``, not starting with ``-``:
``[A-Za-z0-9_][A-Za-z0-9_-]{0,127}`` (``t0``, ``user_id``, ``3d-tables``; not ``../t``,
``/abs``, ``a/b``, ``x.y``, ``-t``). It becomes a torch parameter path
(``embeddings.<table>.weight``, where ``.`` separates modules), a checkpoint tensor name and,
exported, a folder (``sparse/<table>``) and database keys. This is the rule of ``hps.names``,
which says why at length; embark and hps import nothing of each other, and
``tests/faults/test_paths.py`` checks that the two accept exactly the same names.
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = ["NAME_RULE", "check_name", "is_name"]

_MAX_CHARS = 128
_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_-]{{0,{_MAX_CHARS - 1}}}")
NAME_RULE = (
    f"1 to {_MAX_CHARS} ASCII letters, digits, '_' or '-', not starting with '-' "
    "(e.g. 't0', 'user_id', 'dlrm-v2')"
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
