"""Temporary siblings of a checkpoint folder: a save writes ``.<name>.tmp-<host>-<pid>-<random>``
and renames it into place (the checkpoint it replaces goes to ``.old-`` first); each save and
load removes those a killed save left (their process is gone), never a live save's.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

from embark.training.checkpoint_schema import STATE_FILE

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


def remove_stale_siblings(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary siblings of the checkpoint folder ``path`` left by saves of this
    host whose process is gone; returns what was removed.

    A sibling of a live process (a save in progress), of another host, or not named by a
    save is kept; so is an ``.old-`` one while ``path`` is not a checkpoint (it may hold the
    only copy; a warning names it).
    """
    path = Path(path)
    host = socket.gethostname()
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for kind in ("tmp", "old"):
        prefix = f".{path.name}.{kind}-"
        for sib in path.parent.glob(glob.escape(prefix) + "*"):
            parts = sib.name[len(prefix) :].rsplit("-", 2)
            if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
                continue
            if _owner_alive(int(parts[1])):
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
