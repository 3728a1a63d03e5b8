"""The ``.npy`` files of TorchRec's binary Criteo layout: a streaming writer (the row count is
written into the header when the file is closed) and a header reader whose row ranges are
memory-mapped one window at a time, so reading never maps more than the rows asked for.

A file is ``b"\\x93NUMPY" v1.0``, a little-endian ``uint16`` header length, the header (a
Python dict literal padded with spaces to :data:`HEADER_BYTES` in all), then the rows in C
order. For ``n = 3`` rows of 13 ``float32``::

    \\x93NUMPY \\x01\\x00 \\x76\\x00 {'descr': '<f4', 'fortran_order': False, 'shape': (3, 13), }␣…␣\\n
    |<------------------------------ 128 bytes ------------------------------>| 3·13·4 bytes
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + dict; any row count fits
_MAGIC = b"\x93NUMPY\x01\x00"


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    body = text.encode("ascii").ljust(HEADER_BYTES - len(_MAGIC) - 2 - 1) + b"\n"
    return _MAGIC + struct.pack("<H", len(body)) + body


class NpyWriter:
    """Append rows to a ``.npy`` file whose final row count is not known in advance.

    The file is written as ``<path>.tmp``, flushed to disk and renamed to ``path`` by
    :meth:`close`, so a reader never sees a half-written file under the final name.
    :attr:`sha256` is the digest of the rows written (the bytes after the header).

    Args:
        path: the ``.npy`` file to write.
        dtype: the rows' dtype.
        row_shape: shape of one row (``()`` for a 1-D array, ``(13,)`` for ``(n, 13)``).

    Raises:
        OSError: naming the file when it cannot be created or written (``No space left on
            device`` when the disk is full).
    """

    def __init__(
        self, path: str | os.PathLike[str], dtype: np.dtype | type, row_shape: tuple[int, ...]
    ) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.rows = 0
        self._hash = hashlib.sha256()
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        with self._os_errors():
            self._fh = open(self._tmp, "wb")
        self._write(_header(self.dtype, (0, *self.row_shape)))

    def _os_errors(self) -> _NamedOSErrors:
        return _NamedOSErrors(self._tmp)

    def _write(self, data: bytes | memoryview) -> None:
        with self._os_errors():
            self._fh.write(data)

    def append(self, rows: np.ndarray) -> None:
        """Append ``rows``: shape ``(n, *row_shape)``, of this writer's dtype.

        Raises:
            ValueError: for another dtype or row shape.
            OSError: naming the file, when it cannot be written.
        """
        if rows.dtype != self.dtype or tuple(rows.shape[1:]) != self.row_shape:
            raise ValueError(
                f"{self.path.name}: rows of {self.dtype} {self.row_shape} expected, "
                f"got {rows.dtype} {tuple(rows.shape[1:])}"
            )
        if rows.shape[0] == 0:  # (a chunk of bad lines only) a view of no bytes cannot be cast
            return
        data = np.ascontiguousarray(rows).data.cast("B")
        self._hash.update(data)
        self._write(data)
        self.rows += rows.shape[0]

    @property
    def sha256(self) -> str:
        """Hex sha256 of the rows appended so far."""
        return self._hash.hexdigest()

    def close(self) -> None:
        """Write the row count into the header, flush the file to disk and move it to its
        name."""
        with self._os_errors():
            self._fh.seek(0)
            self._fh.write(_header(self.dtype, (self.rows, *self.row_shape)))
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        """Close and remove the unfinished file."""
        try:
            self._fh.close()
        except OSError:  # the disk is full: the buffered tail cannot be written, nor is it wanted
            pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.discard()


class _NamedOSErrors:
    """Re-raise an ``OSError`` with the file's name and the system's reason
    (numpy's and the buffered writer's own messages name neither)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, f"cannot write {self.path}: {err.strerror or err}") from None


@dataclass(frozen=True)
class NpyArray:
    """A ``.npy`` file known by its header: ``shape``, ``dtype`` and where its data begins.
    :meth:`rows` maps only the rows asked for."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> NpyArray:
        """Read the header of ``path``.

        Raises:
            ValueError: naming the file, for a file that is not a C-ordered ``.npy`` (or is
                shorter than its header says).
        """
        p = Path(path)
        try:
            with open(p, "rb") as fh:
                major, _ = np.lib.format.read_magic(fh)
                read = (
                    np.lib.format.read_array_header_1_0
                    if major == 1
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read(fh)
                offset = fh.tell()
        except (ValueError, OSError) as e:
            raise ValueError(f"{p}: not a .npy file: {e}") from None
        if fortran or not shape:
            raise ValueError(f"{p}: a C-ordered array of at least one dimension expected")
        want = offset + int(np.prod(shape)) * dtype.itemsize
        if p.stat().st_size < want:
            raise ValueError(f"{p}: {p.stat().st_size} bytes, its header {shape} needs {want}")
        return cls(p, np.dtype(dtype), tuple(int(s) for s in shape), offset)

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def rows(self, start: int, stop: int) -> np.memmap:
        """Rows ``start:stop``, memory-mapped (only those rows' pages are mapped)."""
        n = stop - start
        if n <= 0:
            return np.zeros((0, *self.shape[1:]), dtype=self.dtype)  # type: ignore[return-value]
        return np.memmap(
            self.path,
            dtype=self.dtype,
            mode="r",
            offset=self.offset + start * self.row_bytes,
            shape=(n, *self.shape[1:]),
        )
