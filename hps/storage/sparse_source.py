"""Which sparse files a database was loaded from: each data file's size and SHA-256.

A writable persistent DB keeps its rows across restarts (online updates included), so a start
must know whether the sparse files it is given are the ones those rows came from. When a
table is loaded, the database records a :class:`SparseSource` of its folder::

    {"files": [{"name": "key",        "bytes": 8000,   "sha256": "9f2c…", "stat": [ino, mtime_ns, ctime_ns]},
               {"name": "emb_vector", "bytes": 512000, "sha256": "41d0…", "stat": [...]}]}

and a later start compares it with the folder (:meth:`SparseSource.matches`): the same files
unchanged (same inode, size, modification and change times: a file cannot be rewritten
without a new change time) match at the cost of a ``stat``; any other file is hashed, and
matches when its size and SHA-256 are the recorded ones (a copy of the same export). Another
export's files differ in their bytes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hps.storage.sparse_files import (
    KEY_FILE,
    ROWS_FILE,
    SAFETENSORS_FILE,
    VECTOR_FILE,
    SparseFormat,
    detect_format,
    has_table_rows,
)

__all__ = ["SparseFileStamp", "SparseSource"]

_FILES = {
    SparseFormat.HUGECTR: (KEY_FILE, VECTOR_FILE),
    SparseFormat.SAFETENSORS: (SAFETENSORS_FILE,),
}


def _names(folder: Path) -> tuple[str, ...]:
    """The data files of ``folder``: its layout's, or ``key`` + ``emb_rows`` for rows stored
    in a row format (:func:`hps.storage.sparse_files.write_table_rows`)."""
    if has_table_rows(folder):
        return (KEY_FILE, ROWS_FILE)
    return _FILES[detect_format(folder)]


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes whenever a file's bytes do: ``(size, inode, mtime_ns, ctime_ns)``."""
    return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class SparseFileStamp:
    """One data file of a sparse folder: its name, size, SHA-256 and ``(inode, mtime_ns,
    ctime_ns)`` when it was hashed."""

    name: str
    bytes: int
    sha256: str
    stat: tuple[int, int, int]

    @classmethod
    def of(cls, path: Path) -> SparseFileStamp:
        """Hash the file at ``path`` (read once, in 8 MiB blocks)."""
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        size, ino, mtime, ctime = _stat_key(st)
        return cls(path.name, size, digest, (ino, mtime, ctime))

    def matches(self, path: Path) -> bool:
        """Whether ``path`` holds this file's bytes (a ``stat`` when it is the same file
        unchanged, else its size and SHA-256)."""
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if _stat_key(st) == (self.bytes, *self.stat):
            return True
        if st.st_size != self.bytes:
            return False
        return SparseFileStamp.of(path).sha256 == self.sha256


@dataclass(frozen=True)
class SparseSource:
    """The data files of one table's sparse folder (see the module docstring)."""

    files: tuple[SparseFileStamp, ...]

    @classmethod
    def of(cls, folder: str | Path) -> SparseSource:
        """Hash the data files of ``folder`` (its layout detected).

        Raises:
            ValueError: a folder holding neither layout, or a missing data file.
        """
        folder = Path(folder)
        names = _names(folder)
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"sparse folder {folder}: missing file(s) {missing}")
        return cls(tuple(SparseFileStamp.of(folder / n) for n in names))

    def matches(self, folder: str | Path) -> bool:
        """Whether ``folder`` holds exactly these data files, byte for byte."""
        folder = Path(folder)
        try:
            names = _names(folder)
        except ValueError:  # neither layout: not these files
            return False
        if tuple(f.name for f in self.files) != names:
            return False
        return all(f.matches(folder / f.name) for f in self.files)

    def describe(self) -> str:
        """``key 8000 bytes sha256 9f2c1a0b…, emb_vector …`` for messages."""
        return ", ".join(f"{f.name} {f.bytes} bytes sha256 {f.sha256[:12]}…" for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "files": [
                {"name": f.name, "bytes": f.bytes, "sha256": f.sha256, "stat": list(f.stat)}
                for f in self.files
            ]
        }

    @classmethod
    def from_json(cls, doc: Any) -> SparseSource | None:
        """The source :meth:`to_json` wrote; ``None`` for anything else (a record of unknown
        origin, which matches no folder)."""
        try:
            return cls(
                tuple(
                    SparseFileStamp(
                        str(f["name"]),
                        int(f["bytes"]),
                        str(f["sha256"]),
                        (int(f["stat"][0]), int(f["stat"][1]), int(f["stat"][2])),
                    )
                    for f in doc["files"]
                )
            )
        except (KeyError, TypeError, ValueError, IndexError):
            return None
