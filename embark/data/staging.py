"""Publishing an output folder whole: a writer holds a lock on the folder, writes into a
private staging sibling, flushes it to disk, then moves it into place with one rename.

For an output folder ``DIR`` its siblings are::

    .DIR.lock      held (flock) by the one writer of DIR; removed when it is done
    .DIR.partial/  the staging folder: what a writer has written so far; kept when the writer
                   is killed, so that the next one can resume from it or refuse naming it
    .DIR.old/      the folder being replaced, for the instant between the two renames

A reader of ``DIR`` therefore sees nothing, the previous folder or the new one — never a
mixture or a half-written file. While a writer is killed between the two renames of a
replacement, ``DIR`` is missing and ``.DIR.old`` holds the previous folder;
:func:`recover` (run by the next writer under the lock) puts it back, or removes it once the
new folder is in place. The lock is a ``flock``: the kernel releases it when its holder dies,
so a killed writer never leaves DIR locked.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType

from embark.outputs import fsync_dir

log = logging.getLogger(__name__)


class FolderBusyError(RuntimeError):
    """Another process holds the lock on an output folder."""


def staging_path(out: Path) -> Path:
    """``.<name>.partial``, the staging sibling of ``out``."""
    return out.with_name(f".{out.name}.partial")


def old_path(out: Path) -> Path:
    """``.<name>.old``, where ``out`` is moved while its replacement is renamed into place."""
    return out.with_name(f".{out.name}.old")


class FolderLock:
    """An exclusive, non-blocking lock on the output folder ``out`` (a ``flock`` on the
    sibling ``.<name>.lock``, which records the holder's pid for the message).

    Raises:
        FolderBusyError: on entry, naming ``out`` and the holder's pid, when another
            process holds it.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out.with_name(f".{out.name}.lock")
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                os.close(fd)
                raise FolderBusyError(
                    f"another process (pid {holder}) is writing {str(self.out)!r} "
                    f"(it holds {self.path}); wait for it to finish or pick another folder"
                ) from None
            # the holder before us may have removed the file after we opened it: our lock
            # is then on a file nobody else can see, so take the one at the path again
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while held: see the inode check on entry
            os.close(self._fd)
            self._fd = None


def recover(out: Path) -> None:
    """Finish or undo a replacement of ``out`` that a killed writer left (call it holding
    :class:`FolderLock`): ``.old`` beside a missing ``out`` is moved back; ``.old`` beside
    a present ``out`` (the replacement was in place) is removed."""
    old = old_path(out)
    if not old.exists():
        return
    if out.exists():
        log.info("removing %s, the folder an interrupted writer had replaced", old)
        shutil.rmtree(old)
    else:
        log.warning("restoring %s from %s: a writer was interrupted while replacing it", out, old)
        os.rename(old, out)
        fsync_dir(out.parent)


def publish(staging: Path, out: Path) -> None:
    """Move the finished ``staging`` folder to ``out`` (replacing the folder there), after
    flushing it to disk; call it holding :class:`FolderLock`."""
    fsync_dir(staging)
    if out.exists():
        old = old_path(out)
        os.rename(out, old)
        os.rename(staging, out)
        fsync_dir(out.parent)
        shutil.rmtree(old)
    else:
        os.rename(staging, out)
        fsync_dir(out.parent)
