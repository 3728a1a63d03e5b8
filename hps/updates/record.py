"""The update record: one update *batch* (every table changed by one training step) as one
checksummed, versioned record, the unit every transport carries.

Layout (all little-endian)::

    | "HPSU" | version u8 | payload_len u64 | crc32(payload) u32 | payload ... |
    payload = n_tables u32, then per table:
              name_len u16 | name utf-8 | n u64 | dim u32 | keys n×int64 | rows n×dim×float32

    e.g. {"t0": ([7, 3], [[.1, .2], [.3, .4]])}  →  payload of 4 + (2 + 2 + 12 + 16 + 16) = 52
    bytes, the record 17 + 52 = 69 bytes.

``name`` is the table's database name (:meth:`hps.config.PSConfig.db_table`): the table's name,
or ``<model>.<table>`` where models name a table alike with other rows, so a record names one
table of one model by construction; a plain name where models hold other rows under it is
refused by the applier (:class:`InvalidUpdateError`, listing the scoped names).

A record of another ``version`` is refused (:class:`RecordVersionError`, naming the version
found and the one read); a record whose header, length, checksum or payload does not check out
is never applied (:class:`CorruptRecordError`).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from hps.types import FormatVersionError

__all__ = [
    "MAGIC",
    "VERSION",
    "CorruptRecordError",
    "InvalidUpdateError",
    "RecordVersionError",
    "UpdateBatch",
    "decode_batch",
    "encode_batch",
]

MAGIC = b"HPSU"
VERSION = 1  # the record format version this hps writes and reads
RECORD_HEADER = struct.Struct("<4sBQI")  # magic, version, payload length, crc32

#: table name → ``(keys (n,) int64, rows (n, dim) float32)``
UpdateBatch = dict[str, tuple[np.ndarray, np.ndarray]]


class InvalidUpdateError(ValueError):
    """An update batch that parses but must not be applied (an unknown table, misshaped or
    wrongly typed arrays, a NaN or infinite row, a key given twice); the message names the
    table. Publishers refuse such a batch; an applier that meets one in a source (written by a
    foreign publisher) leaves it unapplied and retries it."""


class CorruptRecordError(ValueError):
    """A record's header, length, checksum or payload is wrong (or, for
    :class:`hps.updates.file_log.StaleOffsetError`, the stored offset does not fit the log)."""


class RecordVersionError(FormatVersionError, CorruptRecordError):
    """A record of another format version: never applied (readers stop before it, as before a
    corrupt record)."""


def encode_batch(batch: UpdateBatch) -> bytes:
    """One update batch → one checksummed record (bytes).

    Raises:
        InvalidUpdateError: rows that do not match their keys, or hold a NaN or infinite value
            (naming the table and the first such key).
    """
    parts = [struct.pack("<I", len(batch))]
    for name, (keys, rows) in batch.items():
        keys = np.ascontiguousarray(keys, dtype="<i8")
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if rows.ndim != 2 or rows.shape[0] != keys.shape[0]:
            raise InvalidUpdateError(
                f"update for {name!r}: rows {rows.shape} do not match {keys.shape[0]} keys"
            )
        bad = np.flatnonzero(~np.isfinite(rows).all(1))
        if bad.size:  # a diverged trainer's rows: refused here, so they never reach a log
            raise InvalidUpdateError(
                f"update for {name!r}: the row of key {int(keys[bad[0]])} holds a non-finite value; "
                f"{bad.size} such row(s): nothing published"
            )
        nb = name.encode()
        parts += [
            struct.pack("<H", len(nb)),
            nb,
            struct.pack("<QI", keys.size, rows.shape[1]),
            keys.tobytes(),
            rows.tobytes(),
        ]
    payload = b"".join(parts)
    return RECORD_HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload)) + payload


def decode_batch(record: bytes, what: str = "update record") -> UpdateBatch:
    """The inverse of :func:`encode_batch`; ``what`` names the record in a version error
    (``update stream s entry 1-0``).

    Raises:
        RecordVersionError: the record's magic is right but its version is not :data:`VERSION`.
        CorruptRecordError: bad magic, wrong length, checksum mismatch, or a payload that does
            not parse (lengths past its end, a name that is not UTF-8, a table given twice,
            trailing bytes).
    """
    if len(record) < RECORD_HEADER.size:
        raise CorruptRecordError(f"record of {len(record)} bytes is shorter than its header")
    magic, ver, n, crc = RECORD_HEADER.unpack_from(record)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad record header (magic {magic!r}, version {ver})")
    if ver != VERSION:
        raise RecordVersionError(what, ver, VERSION)
    payload = record[RECORD_HEADER.size :]
    if len(payload) != n:
        raise CorruptRecordError(f"record payload has {len(payload)} bytes, header says {n}")
    if zlib.crc32(payload) != crc:
        raise CorruptRecordError("record checksum mismatch (torn or corrupted write)")
    return _decode_payload(payload)


def _need(size: int, pos: int, n: int, what: str) -> None:
    """Raise :class:`CorruptRecordError` unless bytes ``pos..pos + n`` lie inside a payload of
    ``size`` bytes."""
    if pos + n > size:
        raise CorruptRecordError(
            f"record payload ends at byte {size}, but {what} needs bytes {pos}..{pos + n}"
        )


def _decode_payload(payload: bytes) -> UpdateBatch:
    """The tables of a payload whose checksum matched; every length is checked against the
    bytes present (a producer bug or a foreign entry must not escape as ``struct.error``)."""
    size = len(payload)
    out: UpdateBatch = {}
    _need(size, 0, 4, "the table count")
    (n_tables,), pos = struct.unpack_from("<I", payload), 4
    for i in range(n_tables):
        _need(size, pos, 2, f"table {i} of {n_tables}'s name length")
        (ln,) = struct.unpack_from("<H", payload, pos)
        _need(size, pos + 2, ln, f"table {i}'s name")
        try:
            name = payload[pos + 2 : pos + 2 + ln].decode()
        except UnicodeDecodeError as e:
            raise CorruptRecordError(
                f"table {i}'s name at byte {pos + 2} is not UTF-8: {e}"
            ) from None
        if name in out:
            raise CorruptRecordError(f"table {name!r} appears twice in one record")
        pos += 2 + ln
        _need(size, pos, 12, f"table {name!r}'s row count and width")
        k, dim = struct.unpack_from("<QI", payload, pos)
        pos += 12
        _need(size, pos, 8 * k + 4 * k * dim, f"table {name!r}'s {k} keys of {dim} floats each")
        keys = np.frombuffer(payload, "<i8", k, pos).astype(np.int64)
        pos += 8 * k
        rows = np.frombuffer(payload, "<f4", k * dim, pos).astype(np.float32).reshape(k, dim)
        pos += 4 * k * dim
        out[name] = (keys, rows)
    if pos != size:
        raise CorruptRecordError(
            f"record payload has {size - pos} bytes after its {n_tables} table(s)"
        )
    return out
