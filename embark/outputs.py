"""Where a run writes: checks that an output folder or file can be written, made before the
run starts (so a bad path is a usage error, not a traceback after hours of training), and a
text file written atomically.

Each check raises a ``ValueError`` naming the option (``what``, e.g. ``"--out"``), the path
and what is wrong: a folder that is a file, a path under a file, a folder that cannot be
created or written (permissions, a read-only file system). Writability is tested by creating
and removing an empty folder in the nearest existing ancestor: ``os.access`` answers "yes" to
root on a read-only mount.

>>> check_output_dir("runs/x", "--out")         # doctest: +SKIP
>>> check_output_file("plan.json", "--out")     # doctest: +SKIP
>>> write_text_atomic("plan.json", "{}")        # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``.`` for a relative path)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable(folder: Path, what: str, path: Path) -> None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=folder))
    except OSError as err:
        raise ValueError(
            f"{what} {str(path)!r} cannot be written: {err.strerror or err} in {str(folder)!r}"
        ) from None


def check_parent_writable(path: str | os.PathLike[str], what: str) -> None:
    """Check that ``path`` can be created beside its siblings: the nearest existing ancestor
    of its folder is a folder that can be written.

    Raises:
        ValueError: naming ``what`` and the path: it is under a file, or that ancestor
            cannot be written.
    """
    path = Path(path)
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise ValueError(f"{what} {str(path)!r} is under {str(base)!r}, which is a file")
    _check_writable(base, what, path)


def check_output_dir(path: str | os.PathLike[str], what: str) -> None:
    """Check that the folder ``path`` exists and is writable, or can be created.

    Args:
        path: the folder a run will write into.
        what: the option naming it, for the message (``"--out"``, ``"--checkpoint-dir"``).

    Raises:
        ValueError: naming ``what`` and the path: it is a file, it is under a file, or it
            (or the ancestor it would be created in) is not writable.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a file; expected a folder")
    if p.is_dir():
        _check_writable(p, what, p)
    else:
        check_parent_writable(p, what)


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """Check that the file ``path`` can be written (created or replaced).

    Raises:
        ValueError: naming ``what`` and the path: it is a folder, it is under a file, or its
            folder cannot be created or written.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a folder; expected a file path")
    if p.parent.is_dir():
        _check_writable(p.parent, what, p)
    else:
        check_parent_writable(p, what)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush the folder ``path``'s entries (files created or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, durable: bool = False) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling renamed into place (creating the
    folder): a reader sees the old file or the new one, never half of one, and a failed write
    leaves no temporary file behind.

    Args:
        durable: also flush the file before the rename and the folder after it, so that the
            new file survives a crash of the machine (not only of the process).

    Raises:
        OSError: when the folder cannot be created or the file written (nothing is left);
            the message names the file (``No space left on device`` when the disk is full).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # not mkstemp: its files are 0600 whatever the umask, and the rename would keep that
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        try:
            with open(tmp, "x") as fh:
                fh.write(text)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
        except OSError as err:
            raise OSError(err.errno, f"cannot write {p}: {err.strerror or err}") from None
        os.replace(tmp, p)
        if durable:
            fsync_dir(p.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p
