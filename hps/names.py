"""Names of tables and models, and the folder entries that writers make of them.

**The name rule.** A table, feature or model name is 1 to 128 ASCII letters, digits, ``_`` or
``-``, not starting with ``-``: ``[A-Za-z0-9_][A-Za-z0-9_-]{0,127}``::

    accepted   t0   user_id   _dlrm2   dlrm-v2   3d-tables   T_1
    refused    ""   ../t   /abs/t   a/b   x.y   -t   "t 0"   é   (129 characters)

A table name becomes a folder (``sparse/<table>``), a RocksDB column family, part of a Redis
key (``hps_et.<table>.p<p>``, where ``.`` separates the parts) and a torch parameter path
(``embeddings.<table>.weight``, where ``.`` separates modules); a model name becomes a URL path
segment (``/v2/models/<model>/infer``) and, deployed, often a Kubernetes name (hence ``-``).
Such a name is safe in every one of them: never a separator, ``.`` or ``..``, never an option
(no leading ``-``). 128 characters leave room under the file system's 255-byte limit for the
hidden sibling names writers add. ``embark.names`` applies the same rule to ``TableConfig``
(embark and hps import nothing of each other); ``tests/faults/test_paths.py`` checks that the
two accept exactly the same names.

**Writers.** A writer joins a name to its folder through :func:`entry` only (one path component:
never ``..``, an absolute path or a separator), so what it writes lies directly inside the
folder. It never follows the entry it writes, replaces or deletes: an existing symlink there is
refused or, when replacing, removed as a link (:func:`remove_entry`), never written or deleted
through. The folder itself is the caller's: it may be a symlink (an artifact's ``sparse/`` on
another disk).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TypeGuard

__all__ = [
    "NAME_MAX_CHARS",
    "NAME_RULE",
    "check_name",
    "entry",
    "entry_exists",
    "hidden_sibling",
    "is_name",
    "remove_entry",
]

NAME_MAX_CHARS = 128
_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_-]{{0,{NAME_MAX_CHARS - 1}}}")
NAME_RULE = (
    f"1 to {NAME_MAX_CHARS} ASCII letters, digits, '_' or '-', not starting with '-' "
    "(e.g. 't0', 'user_id', 'dlrm-v2')"
)


def is_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` follows the name rule (see the module docstring)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: object, what: str) -> str:
    """``name`` when it follows the name rule.

    Args:
        name: the value to check.
        what: what it names, for the error (``"table name"``, ``"models[0].model"``).

    Raises:
        ValueError: naming ``what``, the value and the rule.
    """
    if not is_name(name):
        raise ValueError(f"{what} {name!r} is not a valid name; expected {NAME_RULE}")
    return name


def entry(folder: str | Path, component: str, what: str) -> Path:
    """``folder / component``, a path directly inside ``folder``.

    Args:
        folder: the writer's folder.
        component: one path component (a checked name, or a fixed file name of the writer).
        what: what ``component`` is, for the error.

    Raises:
        ValueError: ``component`` is empty, ``.``, ``..``, or holds a separator or NUL (it
            would name ``folder`` itself or a path outside it).
    """
    seps = {os.sep, os.altsep or os.sep, "\0"}
    if (
        not isinstance(component, str)
        or component in ("", ".", "..")
        or any(s in component for s in seps)
    ):
        raise ValueError(
            f"{what} {component!r} does not name an entry inside {str(folder)!r}; expected "
            "one path component (no '/', not '.' or '..')"
        )
    return Path(folder) / component


def entry_exists(path: Path) -> bool:
    """Whether anything is at ``path``, a dangling symlink included (``Path.exists`` follows
    links and says no for a dangling one)."""
    return os.path.lexists(path)


def hidden_sibling(path: Path, tag: str) -> Path:
    """A fresh hidden name beside ``path``: ``.<name>.<tag>-<8 hex>`` (same folder, so a rename
    to it never copies; unique, so no earlier leftover or planted link is reused)."""
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}")


def remove_entry(path: Path) -> None:
    """Remove what is at ``path`` without following it: a symlink is unlinked (its target is
    untouched), a folder is removed with its contents (``shutil.rmtree`` unlinks the links
    inside it, never their targets), a file is unlinked; nothing there is no error."""
    if path.is_symlink() or (entry_exists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
