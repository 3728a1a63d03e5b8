"""Temporary siblings of a checkpoint folder: a save writes ``.<name>.tmp-<host>-<pid>-<random>``
and renames it into place (the checkpoint it replaces goes to ``.old-`` first); each save and
load removes those a killed save left (their process is gone), never a live save's.

A save killed between its two renames leaves no checkpoint at ``<dir>`` and the previous one
in ``.<name>.old-…``. The next save or load of ``<dir>`` moves it back
(:func:`recover_previous`, a warning names it), so a resume continues from it and a fresh run
replaces it as it replaces any checkpoint, never deleting it as a leftover. Where it cannot be
moved back (another host's or a live process's save, or several candidates), loading refuses
naming the folder(s) that hold it.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

from embark.training.checkpoint.schema import STATE_FILE

log = logging.getLogger(__name__)


def fresh_sibling(path: Path, kind: str) -> Path:
    """A fresh temporary sibling of ``path``: ``.<name>.<kind>-<host>-<pid>-<random>``."""
    owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return path.with_name(f".{path.name}.{kind}-{owner}")


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _siblings(path: Path, kind: str) -> list[tuple[Path, str, int]]:
    """``(sibling, host, pid)`` of each ``kind`` (``tmp``/``old``) sibling a save named."""
    prefix = f".{path.name}.{kind}-"
    out = []
    for sib in sorted(path.parent.glob(glob.escape(prefix) + "*")):
        parts = sib.name[len(prefix) :].rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit():
            out.append((sib, parts[0], int(parts[1])))
    return out


def previous_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The ``.old-`` siblings of ``path`` that hold a checkpoint (``state.json``): where a save
    killed between its two renames left the previous one."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return [sib for sib, _, _ in _siblings(path, "old") if (sib / STATE_FILE).is_file()]


def recover_previous(path: str | os.PathLike[str]) -> Path | None:
    """When ``path`` is missing and exactly one save of this host whose process is gone left
    the previous checkpoint in an ``.old-`` sibling, rename it back to ``path`` (a warning names
    it); returns the sibling moved back, or ``None``.

    Raises:
        ValueError: ``path`` is missing and several such siblings hold a checkpoint (naming
            them: which to keep is the operator's choice).
    """
    path = Path(path)
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        return None
    host = socket.gethostname()
    dead = [
        sib
        for sib, h, pid in _siblings(path, "old")
        if h == host and not _owner_alive(pid) and (sib / STATE_FILE).is_file()
    ]
    if not dead:
        return None
    if len(dead) > 1:
        raise ValueError(
            f"checkpoint {str(path)!r} is missing and interrupted saves left {len(dead)} previous "
            f"checkpoints: {[str(d) for d in dead]}; move the one to keep to {str(path)!r}"
        )
    try:
        os.rename(dead[0], path)
    except FileNotFoundError:  # another process (a rank of the same run) moved it back first
        if not path.exists():
            raise
        return None
    log.warning(
        "checkpoint %s was missing: a save killed between its two renames left the previous "
        "checkpoint at %s; moved it back",
        path,
        dead[0],
    )
    return dead[0]


def remove_stale_siblings(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary siblings of the checkpoint folder ``path`` left by saves of this
    host whose process is gone; returns what was removed.

    A sibling of a live process (a save in progress), of another host, or not named by a
    save is kept; so is an ``.old-`` one while ``path`` is not a checkpoint (it may hold the
    only copy; a warning names it). First, a previous checkpoint an interrupted save left is
    moved back to a missing ``path`` (:func:`recover_previous`).

    Raises:
        ValueError: as :func:`recover_previous`.
    """
    path = Path(path)
    host = socket.gethostname()
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    recover_previous(path)
    for kind in ("tmp", "old"):
        for sib, owner_host, pid in _siblings(path, kind):
            if owner_host != host or _owner_alive(pid):
                continue
            if kind == "old" and not (path / STATE_FILE).is_file():
                log.warning(
                    "checkpoint %s is missing; an interrupted save left the previous one at %s",
                    path,
                    sib,
                )
                continue
            try:
                shutil.rmtree(sib)
            except OSError as err:  # a read-only copy still loads; say what was left
                log.warning("could not remove %s, left by an interrupted save: %s", sib, err)
                continue
            log.info("removed %s, left by an interrupted save", sib)
            removed.append(sib)
    return removed
