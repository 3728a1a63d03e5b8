"""The update record format and the append-only update log (:mod:`hps.updates.online` applies them).

One update *batch* (all tables changed by one training step) is one record::

    offset → | "HPSU" | ver u8 | payload_len u64 | crc32(payload) u32 | payload ... |
    payload  = n_tables u32, then per table:
               name_len u16 | name utf-8 | n u64 | dim u32 | keys n×int64 | rows n×dim×float32
    (all little-endian)

A log written by :class:`FileLogPublisher` starts with a *log header*, framed like a record:
``| "HPSL" | 1 u8 | 16 u64 | crc32(id) u32 | id 16 bytes |`` (33 bytes), ``id`` random, drawn
when the log is created (or found empty). The log's *identity* (its *log id*) is ``log:<id as
32 hex digits>``; a log without a header (written before there were headers) is identified by
its first record instead, ``rec0:<payload_len>:<crc32 as 8 hex digits>``. An offset into the log
is the byte position after a record; a reader stores it *together with the log id* and, on
resume, checks that the log still has that id (:meth:`FileLogSource.read_log`): a log replaced
or rotated by another one, longer or not, is an error (:class:`LogReplacedError`) rather than a
silent skip of the new log's first records.

A record whose header, length or CRC does not check out is never applied: a reader stops
before it (logging an error) and never skips it. The log's single writer
(:class:`FileLogPublisher`) verifies every record when it opens the file:

* a bad *last* record (a torn write: a partial header or payload, or a full-length record
  whose CRC fails; also a tail with no valid record in it, such as the zeros a crash can
  leave) is truncated, with a warning naming the file, the offset and the bytes dropped;
* a bad record with a valid record *after it* (corruption in the middle) makes it refuse
  the file with :class:`CorruptRecordError` naming the offset: readers stop there, so
  anything appended after it would never be applied, and dropping the valid records that
  follow is not the writer's call.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import BinaryIO

import numpy as np

log = logging.getLogger("hps.updates.online")  # one logger for the whole online-update path

MAGIC = b"HPSU"
VERSION = 1
_HEADER = struct.Struct("<4sBQI")  # magic, version, payload length, crc32
LOG_MAGIC = b"HPSL"  # the log header (same framing as a record; payload = the 16-byte log id)
LOG_VERSION = 1
_LOG_ID_BYTES = 16
_LOG_HEADER_SIZE = _HEADER.size + _LOG_ID_BYTES
LOG_ID_RE = re.compile(r"log:[0-9a-f]{32}|rec0:[0-9]{1,20}:[0-9a-f]{8}")
UpdateBatch = dict[
    str, tuple[np.ndarray, np.ndarray]
]  # table -> (keys (n,) int64, rows (n, dim) float32)


class InvalidUpdateError(ValueError):
    """An update batch that parses but must not be applied (an unknown table, misshaped or
    wrongly typed arrays, a NaN or infinite row, a key given twice); the message names the
    table. Publishers refuse such a batch; an applier that meets one in a log (written by an
    older or foreign publisher) leaves it unapplied and retries it."""


class CorruptRecordError(ValueError):
    """A record's header, length, checksum or payload is wrong (or, for
    :class:`StaleOffsetError`, the stored offset does not fit the log)."""


class StaleOffsetError(CorruptRecordError):
    """The stored offset does not belong to the update log as it is now (the log was
    replaced, rotated or truncated after the updates up to that offset were applied); nothing
    was read. Reset the stored offset (:meth:`hps.updates.online.UpdateApplier.reset_offset`)."""

    def __init__(self, path: str | Path, offset: str | int, hint: str = "") -> None:
        self.path, self.offset, self.hint = Path(path), offset, hint
        super().__init__(self._message())

    def _what(self) -> str:
        return f"update log {self.path}: the stored offset {self.offset} does not fit the log"

    def _message(self) -> str:
        return (
            f"{self._what()}: the log was replaced, rotated or truncated after the updates up to "
            f"that offset were applied; nothing was applied from it. Reset the stored offset to "
            f"apply this log from its start"
            f"{': ' + self.hint if self.hint else ' (UpdateApplier.reset_offset())'}"
        )

    def with_hint(self, hint: str) -> StaleOffsetError:
        """The same error, its advice naming where the offset is stored and how to reset it."""
        e = self.__class__.__new__(self.__class__)
        e.__dict__.update(self.__dict__)
        e.hint = hint
        Exception.__init__(e, e._message())
        return e


class OffsetPastEndError(StaleOffsetError):
    """The stored offset lies past the end of the update log (reading from there would wait
    forever)."""

    def __init__(self, path: str | Path, offset: str | int, size: int, hint: str = "") -> None:
        self.size = size
        super().__init__(path, offset, hint)

    def _what(self) -> str:
        return (
            f"update log {self.path}: the stored offset {self.offset} is past the end of the log "
            f"({self.size} bytes)"
        )


class LogReplacedError(StaleOffsetError):
    """The stored offset was taken in another log: its stored log id differs from the log's
    (``stored_id`` and ``log_id``), or, stored without a log id (by an older version), it is not
    on a record boundary of this log (``reason`` says where the records around it lie)."""

    def __init__(
        self,
        path: str | Path,
        offset: str | int,
        stored_id: str | None,
        log_id: str | None,
        reason: str = "",
        hint: str = "",
    ) -> None:
        self.stored_id, self.log_id, self.reason = stored_id, log_id, reason
        super().__init__(path, offset, hint)

    def _what(self) -> str:
        if self.stored_id is not None:
            return (
                f"update log {self.path}: the stored offset {self.offset} was taken in the log with "
                f"id {self.stored_id}, but this log's id is {self.log_id}"
            )
        return (
            f"update log {self.path} (log id {self.log_id}): the stored offset {self.offset} has no "
            f"log id (stored by an older version) and {self.reason}"
        )


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
        bad = np.flatnonzero(~np.isfinite(rows).all(1)) if rows.size else ()
        if len(bad):  # a diverged trainer's rows: refused here, so they never reach a log
            raise InvalidUpdateError(
                f"update for {name!r}: the row of key {int(keys[bad[0]])} holds a non-finite value; "
                f"{len(bad)} such row(s): nothing published"
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
    return _HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload)) + payload


def decode_batch(record: bytes) -> UpdateBatch:
    """The inverse of :func:`encode_batch`.

    Raises:
        CorruptRecordError: bad magic/version, wrong length, checksum mismatch, or a payload
            that does not parse (lengths past its end, a name that is not UTF-8, a table given
            twice, trailing bytes).
    """
    if len(record) < _HEADER.size:
        raise CorruptRecordError(f"record of {len(record)} bytes is shorter than its header")
    magic, ver, n, crc = _HEADER.unpack_from(record)
    if magic != MAGIC or ver != VERSION:
        raise CorruptRecordError(f"bad record header (magic {magic!r}, version {ver})")
    payload = record[_HEADER.size :]
    if len(payload) != n:
        raise CorruptRecordError(f"record payload has {len(payload)} bytes, header says {n}")
    if zlib.crc32(payload) != crc:
        raise CorruptRecordError("record checksum mismatch (torn or corrupted write)")
    return _decode_payload(payload)


def _decode_payload(payload: bytes) -> UpdateBatch:
    """The tables of a payload whose checksum matched; every length is checked against the
    bytes present (a producer bug or a foreign entry must not escape as ``struct.error``)."""
    size = len(payload)

    def need(pos: int, n: int, what: str) -> None:
        if pos + n > size:
            raise CorruptRecordError(
                f"record payload ends at byte {size}, but {what} needs bytes {pos}..{pos + n}"
            )

    out: UpdateBatch = {}
    need(0, 4, "the table count")
    (n_tables,), pos = struct.unpack_from("<I", payload), 4
    for i in range(n_tables):
        need(pos, 2, f"table {i} of {n_tables}'s name length")
        (ln,) = struct.unpack_from("<H", payload, pos)
        need(pos + 2, ln, f"table {i}'s name")
        try:
            name = payload[pos + 2 : pos + 2 + ln].decode()
        except UnicodeDecodeError as e:
            raise CorruptRecordError(
                f"table {i}'s name at byte {pos + 2} is not UTF-8: {e}"
            ) from None
        if name in out:
            raise CorruptRecordError(f"table {name!r} appears twice in one record")
        pos += 2 + ln
        need(pos, 12, f"table {name!r}'s row count and width")
        k, dim = struct.unpack_from("<QI", payload, pos)
        pos += 12
        need(pos, 8 * k + 4 * k * dim, f"table {name!r}'s {k} keys of {dim} floats each")
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


# ------------------------------------------------------------------------------ transports


class UpdatePublisher(ABC):
    @abstractmethod
    def publish(self, batch: UpdateBatch) -> str:
        """Append one batch; returns its offset (as a string)."""


class UpdateSource(ABC):
    @abstractmethod
    def read(self, offset: str | None, max_records: int) -> list[tuple[str, UpdateBatch]]:
        """Records after ``offset`` (``None`` = from the start): ``[(offset after it, batch)]``."""

    def read_log(
        self, offset: str | None, log_id: str | None, max_records: int = 64
    ) -> tuple[str | None, list[tuple[str, UpdateBatch]]]:
        """:meth:`read`, for a source whose offsets mean something only within one log: checks
        that ``offset`` was taken in the log ``log_id`` and returns ``(the log's id, records)``.
        This default (a source with one history, e.g. a Redis stream) has no log id: ``None``."""
        return None, self.read(offset, max_records)

    def check_offset(self, offset: str) -> None:
        """Raise ``ValueError`` (saying why) unless ``offset`` is well-formed for this source
        (this default accepts any offset: the source itself refuses a bad one)."""
        return None


def _log_header(log_id: bytes) -> bytes:
    return _HEADER.pack(LOG_MAGIC, LOG_VERSION, len(log_id), zlib.crc32(log_id)) + log_id


class FileLogPublisher(UpdatePublisher):
    """Append-only update log (one writer per file). Opening it verifies every record: a bad
    last record (a torn write) is truncated; a bad record followed by valid ones is refused.
    A new (or empty) log gets a log header with a random log id first; a log written without
    one (by an older version) keeps its first record as its identity.

    Raises:
        CorruptRecordError: (from the constructor) when a record in the middle of the log
            is corrupt; the message names its offset and the next valid record's.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        open(self.path, "ab").close()
        end, why = _scan_log(self.path)
        if why is not None:
            self._drop_bad_tail(end, why)
        with self._lock, open(self.path, "ab") as f:
            self._header_if_empty(f)

    def _drop_bad_tail(self, end: int, why: str) -> None:
        size = self.path.stat().st_size
        nxt = _next_valid_record(self.path, end + 1)
        if nxt is not None:
            raise CorruptRecordError(
                f"update log {self.path}: the record at offset {end} is corrupt ({why}) but a valid "
                f"record follows at offset {nxt}; readers stop at offset {end}, so nothing appended "
                f"after it would be applied. Move the log aside (then reset every server's stored offset "
                f"so it reads the new log from its start: UpdateApplier.reset_offset(), or delete its "
                f"offset file), or truncate it to {end} bytes to drop the corrupt record and every "
                f"record after it ({size - end} bytes)"
            )
        log.warning(
            "update log %s: truncating %d bytes at offset %d, a torn or corrupted last record (%s)",
            self.path,
            size - end,
            end,
            why,
        )
        with open(self.path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())

    @staticmethod
    def _header_if_empty(f: BinaryIO) -> None:
        """A log found empty (new, truncated to nothing, or emptied by a copy-and-truncate
        rotation) gets a log header with a fresh id before its first record."""
        if os.fstat(f.fileno()).st_size == 0:
            f.write(_log_header(os.urandom(_LOG_ID_BYTES)))
            f.flush()
            os.fsync(f.fileno())

    def publish(self, batch: UpdateBatch) -> str:
        rec = encode_batch(batch)
        with self._lock, open(self.path, "ab") as f:
            self._header_if_empty(f)
            f.write(rec)
            f.flush()
            os.fsync(f.fileno())
            return str(f.tell())


_CRC_CHUNK = 1 << 20  # bytes read at a time when verifying a record (records can be large)


def _log_start(f: BinaryIO, size: int) -> tuple[int, str | None, str | None]:
    """``(offset of the first record, the log id, why the log's start is unusable)`` of an open
    log of ``size`` bytes; the id is ``None`` while its start is not fully written (or bad)."""
    f.seek(0)
    head = f.read(_LOG_HEADER_SIZE)
    if head and LOG_MAGIC.startswith(head[:4]):  # a log header (or the start of one)
        if len(head) < _LOG_HEADER_SIZE:
            return _LOG_HEADER_SIZE, None, None  # not fully written yet
        _, ver, n, crc = _HEADER.unpack_from(head)
        body = head[_HEADER.size :]
        if ver != LOG_VERSION or n != _LOG_ID_BYTES or zlib.crc32(body) != crc:
            return 0, None, f"bad log header (version {ver}, length {n}, or checksum)"
        return _LOG_HEADER_SIZE, "log:" + body.hex(), None
    if len(head) < _HEADER.size:  # no header (an older writer): the first record names the log
        return 0, None, None
    magic, ver, n, crc = _HEADER.unpack_from(head)
    if magic != MAGIC or ver != VERSION:
        return 0, None, f"bad record header (magic {magic!r}, version {ver})"
    return 0, f"rec0:{n}:{crc:08x}", None


def _boundary_miss(f: BinaryIO, start: int, size: int, target: int) -> str | None:
    """``None`` when a record starts (or the log ends) at ``target``, else where the records
    around it lie. Hops over the record headers from ``start`` (no CRCs): one small read per
    record, done once per applier for an offset stored without a log id."""
    pos = start
    while pos < target:
        f.seek(pos)
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return f"the record at offset {pos} is incomplete"
        magic, ver, n, _ = _HEADER.unpack(head)
        if magic != MAGIC or ver != VERSION:
            return f"the record at offset {pos} has a bad header"
        if pos + _HEADER.size + n > target:
            return f"it lies inside the record at offsets {pos}..{pos + _HEADER.size + n}"
        pos += _HEADER.size + n
    return None if pos == target else f"it lies inside the log header (0..{start})"


def _scan_log(path: Path) -> tuple[int, str | None]:
    """Verify the log header (when there is one) and every record (header, length, CRC).

    Returns:
        ``(end, why)``: the byte offset after the last record of the valid prefix, and why the
        bytes at ``end`` are not a valid record (``None`` when the file ends at ``end``).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos, _, why = _log_start(f, size)
        if why is not None:  # a bad log header, or a bad first record in a log without one
            return 0, why
        if pos > size:
            return 0, f"a partial log header of {size} bytes"
        while pos < size:
            f.seek(pos)
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return pos, f"a partial header of {len(head)} bytes"
            magic, ver, n, crc = _HEADER.unpack(head)
            if magic != MAGIC or ver != VERSION:
                return pos, f"bad record header (magic {magic!r}, version {ver})"
            if pos + _HEADER.size + n > size:
                return (
                    pos,
                    f"the header announces {n} payload bytes, {size - pos - _HEADER.size} are present",
                )
            got, left = 0, n
            while left:
                chunk = f.read(min(left, _CRC_CHUNK))
                got, left = zlib.crc32(chunk, got), left - len(chunk)
            if got != crc:
                return pos, "checksum mismatch"
            pos += _HEADER.size + n
    return pos, None


def _next_valid_record(path: Path, start: int) -> int | None:
    """Offset of the first valid record (magic, version, length and CRC all right) that
    begins at or after ``start``, or ``None``; only called on a damaged log."""
    size = path.stat().st_size
    if start + _HEADER.size > size:
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(MAGIC, start)
        while pos != -1 and pos + _HEADER.size <= size:
            _, ver, n, crc = _HEADER.unpack_from(m, pos)
            body = pos + _HEADER.size
            if ver == VERSION and body + n <= size and zlib.crc32(m[body : body + n]) == crc:
                return pos
            pos = m.find(MAGIC, pos + 1)
    return None


def parse_log_offset(offset: str) -> int:
    """A file log offset (a byte position: digits only) → ``int``, else ``ValueError``."""
    if not isinstance(offset, str) or not re.fullmatch(r"[0-9]{1,19}", offset):
        raise ValueError(f"offset {offset!r} is not a byte position (a non-negative integer)")
    return int(offset)


class FileLogSource(UpdateSource):
    """Reads records of an append-only log; stops before a torn or corrupted record (and
    logs an error for a corrupted one): a bad record is never skipped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.corrupt = 0  # records refused (bad checksum/header)

    def check_offset(self, offset: str) -> None:
        parse_log_offset(offset)

    def read(self, offset: str | None, max_records: int = 64) -> list[tuple[str, UpdateBatch]]:
        """Records after byte ``offset``; :meth:`read_log` without a log id (``offset`` must be
        on a record boundary)."""
        return self.read_log(offset, None, max_records)[1]

    def read_log(
        self, offset: str | None, log_id: str | None, max_records: int = 64
    ) -> tuple[str | None, list[tuple[str, UpdateBatch]]]:
        """Records after byte ``offset`` of the log ``log_id``: ``(the log's id, records)``.

        ``offset`` ``None`` reads the log from its start, whatever its id. Otherwise the log's
        id must be ``log_id``; an offset stored without one (``log_id`` ``None``: by an older
        version, or given by hand) is accepted when a record starts there (checked by hopping
        over the record headers before it), and the caller then stores it with the id returned.
        Nothing is read while the log is missing or its start not fully written; a log whose
        start is corrupt is refused (an error is logged) and nothing is read.

        Raises:
            ValueError: ``offset`` is not a non-negative integer.
            LogReplacedError: the log's id is not ``log_id`` (another log replaced it), or an
                offset without a log id is not on a record boundary (nothing is read).
            OffsetPastEndError: ``offset`` lies past the end of the log (it was replaced or
                truncated).
        """
        try:
            pos = None if offset is None else parse_log_offset(offset)
        except ValueError as e:
            raise ValueError(f"update log {self.path}: {e}") from None
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return None, []
        with f:
            size = os.fstat(f.fileno()).st_size
            start, ident, why = _log_start(f, size)
            if why is not None:
                self.corrupt += 1
                log.error("update log %s: refused from its start: %s", self.path, why)
                return None, []
            if pos is None or pos == 0:  # from the start: right in any log
                pos = start
            elif log_id is not None and ident is not None and ident != log_id:
                raise LogReplacedError(self.path, pos, log_id, ident)
            elif pos > size:
                raise OffsetPastEndError(self.path, pos, size)
            elif ident is None:
                return None, []  # the log's start is not written yet: nothing to check against
            elif log_id is None and (miss := _boundary_miss(f, start, size, pos)) is not None:
                raise LogReplacedError(
                    self.path, pos, None, ident, f"is not on a record boundary ({miss})"
                )
            return ident, self._records(f, pos, size, max_records)

    def _records(
        self, f: BinaryIO, pos: int, size: int, max_records: int
    ) -> list[tuple[str, UpdateBatch]]:
        out = []
        while len(out) < max_records and pos + _HEADER.size <= size:
            f.seek(pos)
            head = f.read(_HEADER.size)
            magic, ver, n, _ = _HEADER.unpack(head)
            if magic != MAGIC or ver != VERSION:
                # a garbage header's length means nothing: say so now rather than
                # waiting silently for bytes that will never come
                self.corrupt += 1
                log.error(
                    "update log %s: record at offset %d refused: bad record header "
                    "(magic %r, version %d)",
                    self.path,
                    pos,
                    magic,
                    ver,
                )
                break
            if pos + _HEADER.size + n > size:
                break  # not fully written yet (or torn): never applied
            rec = head + f.read(n)
            try:
                batch = decode_batch(rec)
            except CorruptRecordError as e:
                self.corrupt += 1
                log.error("update log %s: record at offset %d refused: %s", self.path, pos, e)
                break
            pos += _HEADER.size + n
            out.append((str(pos), batch))
        return out
