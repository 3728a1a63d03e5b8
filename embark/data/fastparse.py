"""Vectorised parsing of Criteo TSV in chunks of whole lines, for the converter.

A file is read in chunks of about ``chunk_bytes`` ending at a newline. Each chunk is parsed
by pyarrow's CSV reader (every field as bytes) and checked vectorised; a chunk that holds
anything the fast path cannot vouch for — a row count other than its newline count, a label
other than ``0``/``1``, an id that is not 1-16 hex digits, a dense field with a byte outside
``[0-9-]`` or more than 19 digits, one pyarrow cannot cast to int64 — is parsed again line
by line by :func:`embark.data.criteo_lines.parse_fields`, which names the file and line of
each bad line. Both paths therefore accept exactly the lines :class:`~embark.data.CriteoTSV`
accepts, and give the same values. Memory is bounded by a few chunks whatever the file size.

A chunk's arrays (``n`` good lines, ``D`` dense, ``T`` categorical)::

    labels (n,) int32 in {0, 1}
    dense  (n, D) int64, empty → 0
    ids    (n, T) uint64, the unhashed ``int(c, 16)``, empty → 0
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from embark.data.criteo_lines import (
    EMPTY_LINES,
    READ_ERRORS,
    CriteoFormatError,
    ReadStats,
    decode,
    parse_fields,
    truncated_error,
)

DEFAULT_CHUNK_BYTES = 16 << 20  # ~120 k Criteo lines: large enough to amortise pyarrow's calls
_MAX_DIGITS = 19  # of a dense value (int64); a longer field goes the exact way

_BLOCK_BYTES = 1 << 20  # pyarrow's parse unit: blocks parse in parallel
_DECIMAL = np.zeros(256, dtype=bool)  # bytes a dense field may hold on the fast path
_DECIMAL[list(b"0123456789-")] = True
_BIG_ENDIAN = {2: ">u1", 4: ">u2", 8: ">u4", 16: ">u8"}  # hex digits → packed dtype
_NIBBLE = np.full(256, 255, dtype=np.uint8)  # hex digit → value; 255 = not a hex digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i


@dataclass
class Chunk:
    """The good lines of one chunk (layout in the module docstring)."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    exact: bool = False  # parsed line by line (the fast path could not vouch for it)

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])


class _NotFast(Exception):
    """The fast path cannot vouch for this chunk; parse it line by line."""


def raw_chunks(
    path: Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_read: Callable[[int], None] | None = None
) -> Iterator[tuple[int, bytes]]:
    """``(1-based number of the chunk's first line, bytes of whole lines)`` of ``path``.

    ``on_read(n)`` is called with the bytes of the file (compressed, for a ``.gz``) read so
    far, for a progress bar.

    Raises:
        CriteoFormatError: kind ``truncated`` for a file that cannot be read to its end,
            naming how many lines were read.
    """
    first_line = 1
    tail = b""
    with open(path, "rb") as raw_fh:
        fh = gzip.GzipFile(fileobj=raw_fh, mode="rb") if path.suffix == ".gz" else raw_fh
        with fh:
            while True:
                try:
                    block = fh.read(chunk_bytes)
                except READ_ERRORS as err:
                    raise truncated_error(path, first_line - 1, err) from None
                if on_read is not None:
                    on_read(raw_fh.tell())
                if not block:
                    break
                data = tail + block
                cut = data.rfind(b"\n") + 1
                tail = data[cut:]
                if cut:
                    yield first_line, data[:cut]
                    first_line += data.count(b"\n", 0, cut)
    if tail:
        yield first_line, tail + b"\n"


def _column_bytes(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets (n+1,) int32 from 0, data uint8)`` of a string or binary column; a null
    (an empty field) is an empty value."""
    arr = col.combine_chunks()
    if arr.null_count:
        arr = arr.fill_null(pa.scalar(b"" if pa.types.is_binary(arr.type) else "", arr.type))
    buffers = arr.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4)
    if buffers[2] is None:
        return offsets - offsets[0], np.zeros(0, dtype=np.uint8)
    data = np.frombuffer(buffers[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return offsets - offsets[0], data


def _hex_column(col: pa.ChunkedArray) -> np.ndarray:
    """``(n,) uint64`` ids of a column of hex digits (empty → 0)."""
    offsets, data = _column_bytes(col)
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths), dtype=np.uint64)
    if data.size == 0:
        return out
    if lengths.max() > 16:
        raise _NotFast
    nib = _NIBBLE[data]
    if nib.max() > 15:
        raise _NotFast
    filled = np.flatnonzero(lengths)
    width = int(lengths.max())
    if width in _BIG_ENDIAN and np.all(lengths[filled] == width):  # every id as wide (Criteo: 8)
        packed = (nib[0::2] << 4) | nib[1::2]  # two hex digits per byte, big-endian
        out[filled] = packed.view(_BIG_ENDIAN[width])
        return out
    lens = lengths[filled]  # right-align ids of different widths in a (n, width) grid
    pos = np.arange(width)[None, :] - (width - lens)[:, None]
    take = offsets[filled][:, None] + np.maximum(pos, 0)
    digits = np.where(pos >= 0, nib[take], 0).astype(np.uint64)
    shifts = (np.uint64(4) * np.arange(width - 1, -1, -1, dtype=np.uint64))[None, :]
    out[filled] = np.bitwise_or.reduce(digits << shifts, axis=1)
    return out


def _dense_column(col: pa.ChunkedArray) -> np.ndarray:
    """``(n,) int64`` of a column of decimal strings (empty → 0)."""
    offsets, data = _column_bytes(col)
    if data.size == 0:
        return np.zeros(len(offsets) - 1, dtype=np.int64)
    if not _DECIMAL[data].all():
        raise _NotFast  # pyarrow would take " 5" or "0x5"; the exact path does not
    lengths = np.diff(offsets)
    long = np.flatnonzero(lengths > _MAX_DIGITS)
    if long.size and not (
        np.all(lengths[long] == _MAX_DIGITS + 1) and np.all(data[offsets[long]] == 45)
    ):
        raise _NotFast  # more than 19 digits ("000…01"): pyarrow takes it, the exact path not
    try:
        return pc.cast(col, pa.int64()).fill_null(0).to_numpy()
    except pa.ArrowInvalid:  # "-", "5-", or out of int64
        raise _NotFast from None


def _label_column(col: pa.ChunkedArray) -> np.ndarray:
    """``(n,) int32`` labels of a column that must hold only ``0`` and ``1``."""
    offsets, data = _column_bytes(col)
    if data.size != len(offsets) - 1 or np.diff(offsets).min(initial=1) != 1:
        raise _NotFast  # a label that is not exactly one byte
    if not ((data == 48) | (data == 49)).all():
        raise _NotFast
    return (data - 48).astype(np.int32)


def _arrow_owned(data: bytes) -> pa.Buffer:
    """A copy of ``data`` in memory Arrow allocated (one memcpy of the chunk).

    pyarrow's threaded CSV reader drops its reference to the input on a pool worker, possibly
    after ``read_csv`` has returned or raised. The last reference to a ``pa.py_buffer`` of a
    Python ``bytes`` takes the GIL to release it; if that happens while the interpreter
    finalises, the worker is ended inside a C++ destructor and the process aborts
    (``terminate called without an active exception``, exit status 134). Arrow-owned memory
    is released without the GIL.
    """
    buf = pa.allocate_buffer(len(data))
    if data:
        memoryview(buf).cast("B")[:] = data
    return buf


def _fast_chunk(data: bytes, num_dense: int, num_sparse: int) -> Chunk:
    """Parse a chunk vectorised, or raise :class:`_NotFast`."""
    names = ["label", *(f"I{j}" for j in range(num_dense)), *(f"C{j}" for j in range(num_sparse))]
    types = {n: pa.string() if n.startswith("I") else pa.binary() for n in names}
    try:
        table = pacsv.read_csv(
            _arrow_owned(data),
            read_options=pacsv.ReadOptions(column_names=names, block_size=_BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(
                column_types=types, strings_can_be_null=True, null_values=[""]
            ),
        )
    except pa.ArrowInvalid:  # a wrong field count, or not UTF-8 in a dense field
        raise _NotFast from None
    n = table.num_rows
    if n != data.count(b"\n"):  # an empty line (pyarrow skips it) or a row split at a \r
        raise _NotFast
    labels = _label_column(table.column("label"))
    dense = np.empty((n, num_dense), dtype=np.int64)
    for j in range(num_dense):
        dense[:, j] = _dense_column(table.column(f"I{j}"))
    ids = np.empty((n, num_sparse), dtype=np.uint64)
    for j in range(num_sparse):
        ids[:, j] = _hex_column(table.column(f"C{j}"))
    return Chunk(labels, dense, ids)


def _exact_chunk(
    data: bytes, first_line: int, path: str, num_dense: int, num_sparse: int,
    skip_bad_lines: bool, stats: ReadStats,
) -> Chunk:  # fmt: skip
    """Parse a chunk line by line, raising or counting each malformed line."""
    labels, dense, ids = [], [], []
    for k, raw in enumerate(data.split(b"\n")[:-1]):
        if raw + b"\n" in EMPTY_LINES:
            continue
        stats.lines += 1
        lineno = first_line + k
        try:
            label, d, c = parse_fields(
                decode(raw, path, lineno), num_dense, num_sparse, path, lineno
            )
        except CriteoFormatError as err:
            if not skip_bad_lines:
                raise
            stats.count_bad(err)
            continue
        stats.good_lines += 1
        labels.append(label)
        dense.append(d)
        ids.append(c)
    return Chunk(
        np.asarray(labels, dtype=np.int32),
        np.asarray(dense, dtype=np.int64).reshape(len(labels), num_dense),
        np.asarray(ids, dtype=np.uint64).reshape(len(labels), num_sparse),
        exact=True,
    )


def parse_chunk(
    data: bytes,
    first_line: int,
    path: str,
    num_dense: int,
    num_sparse: int,
    *,
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Chunk:
    """The good lines of ``data`` (whole lines, the first numbered ``first_line``).

    Args:
        data: whole ``\\n``-terminated lines of a Criteo TSV file.
        first_line: 1-based number of ``data``'s first line in ``path``.
        path: the file, for error messages.
        num_dense, num_sparse: ``D`` and ``T``; a line has ``1 + D + T`` fields.
        skip_bad_lines: count and drop malformed lines instead of raising.
        stats: counts added to (lines, good and bad lines, reasons, examples).

    Raises:
        CriteoFormatError: the first malformed line, naming ``path`` and its line number,
            unless ``skip_bad_lines``.
    """
    stats = ReadStats() if stats is None else stats
    try:
        chunk = _fast_chunk(data, num_dense, num_sparse)
    except _NotFast:
        return _exact_chunk(data, first_line, path, num_dense, num_sparse, skip_bad_lines, stats)
    stats.lines += chunk.rows
    stats.good_lines += chunk.rows
    return chunk
