"""The update log: an append-only file of update records (:mod:`hps.updates.record`), the
embedded transport of online updates.

A log starts with a *log header*, framed like a record, then holds records back to back::

    offset 0   | "HPSL" | version u8 = 1 | 16 u64 | crc32(id) u32 | id 16 bytes |   (33 bytes)
    offset 33  | record 1 | record 2 | ...
                           ↑ an offset: the byte position after a record

``id`` is drawn at random when the log is created (or found empty); the log's identity, its
*log id*, is ``log:<id as 32 hex digits>``. A reader stores an offset *together with the log
id* and, on resume, checks that the log still has that id (:meth:`FileLogSource.read_log`): a
log replaced or rotated by another one, longer or not, is an error (:class:`LogReplacedError`)
rather than a silent skip of the new log's first records.

The header's ``version`` is the log format's version: a log of another version, or a file that
starts with a record instead of a log header, is refused by readers and the writer alike
(:class:`~hps.types.FormatVersionError` naming the file, the version found and the one read).

A record whose header, length or CRC does not check out is never applied: a reader stops
before it (logging an error) and never skips it. The log's single writer
(:class:`FileLogPublisher`) verifies every record when it opens the file:

* a bad *last* record (a torn write: a partial header or payload, or a full-length record
  whose CRC fails; also a tail with no valid record in it, such as the zeros a crash can
  leave) is truncated, with a warning naming the file, the offset and the bytes dropped;
* a bad record with a valid record *after it* (corruption in the middle) makes it refuse
  the file with :class:`~hps.updates.record.CorruptRecordError` naming the offset: readers
  stop there, so anything appended after it would never be applied, and dropping the valid
  records that follow is not the writer's call.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import zlib
from pathlib import Path
from typing import BinaryIO

from hps.types import FormatVersionError
from hps.updates.record import (
    MAGIC,
    RECORD_HEADER,
    VERSION,
    CorruptRecordError,
    UpdateBatch,
    decode_batch,
    encode_batch,
)
from hps.updates.transport import UpdatePublisher, UpdateSource

__all__ = [
    "LOG_ID_RE",
    "LOG_VERSION",
    "FileLogPublisher",
    "FileLogSource",
    "LogReplacedError",
    "OffsetPastEndError",
    "StaleOffsetError",
    "parse_log_offset",
]

log = logging.getLogger("hps.updates")  # one logger for the whole online-update path

LOG_MAGIC = b"HPSL"
LOG_VERSION = 1  # the log format version this hps writes and reads
_LOG_ID_BYTES = 16
_LOG_HEADER_SIZE = RECORD_HEADER.size + _LOG_ID_BYTES
LOG_ID_RE = re.compile(r"log:[0-9a-f]{32}")
_CRC_CHUNK = 1 << 20  # bytes read at a time when verifying a record (records can be large)


class StaleOffsetError(CorruptRecordError):
    """The stored offset does not belong to the update log as it is now (the log was
    replaced, rotated or truncated after the updates up to that offset were applied); nothing
    was read. Reset the stored offset (:meth:`hps.updates.applier.UpdateApplier.reset_offset`)."""

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
    """The stored offset was taken in another log: its stored log id (``stored_id``) differs
    from the log's (``log_id``)."""

    def __init__(
        self, path: str | Path, offset: str | int, stored_id: str, log_id: str, hint: str = ""
    ) -> None:
        self.stored_id, self.log_id = stored_id, log_id
        super().__init__(path, offset, hint)

    def _what(self) -> str:
        return (
            f"update log {self.path}: the stored offset {self.offset} was taken in the log with "
            f"id {self.stored_id}, but this log's id is {self.log_id}"
        )


def parse_log_offset(offset: str) -> int:
    """A file log offset (a byte position: digits only) → ``int``, else ``ValueError``."""
    if not isinstance(offset, str) or not re.fullmatch(r"[0-9]{1,19}", offset):
        raise ValueError(f"offset {offset!r} is not a byte position (a non-negative integer)")
    return int(offset)


# ------------------------------------------------------------------------------ the log's start


def _log_header(log_id: bytes) -> bytes:
    return RECORD_HEADER.pack(LOG_MAGIC, LOG_VERSION, len(log_id), zlib.crc32(log_id)) + log_id


def _log_start(f: BinaryIO, path: Path) -> tuple[int, str | None, str | None]:
    """``(offset of the first record, the log id, why the log's start is unusable)`` of an open
    log; the id is ``None`` while the header is not fully written (or is bad).

    Raises:
        FormatVersionError: the header holds another version, or the log starts with a record
            (no log header).
    """
    f.seek(0)
    head = f.read(_LOG_HEADER_SIZE)
    if not head or LOG_MAGIC.startswith(head[:4]) and len(head) < 5:
        return _LOG_HEADER_SIZE, None, None  # the header is not (fully) written yet
    if head[:4] == MAGIC:
        raise FormatVersionError(
            f"update log {path}",
            None,
            LOG_VERSION,
            "it starts with an update record, not a log header; a log written by "
            "FileLogPublisher starts with one",
        )
    if head[:4] != LOG_MAGIC:
        return 0, None, f"no log header (the log starts with {head[:4]!r}, not {LOG_MAGIC!r})"
    if head[4] != LOG_VERSION:
        raise FormatVersionError(f"update log {path}", head[4], LOG_VERSION)
    if len(head) < _LOG_HEADER_SIZE:
        return _LOG_HEADER_SIZE, None, None  # not fully written yet
    _, _, n, crc = RECORD_HEADER.unpack_from(head)
    body = head[RECORD_HEADER.size :]
    if n != _LOG_ID_BYTES or zlib.crc32(body) != crc:
        return 0, None, f"bad log header (id length {n}, or checksum)"
    return _LOG_HEADER_SIZE, "log:" + body.hex(), None


def _scan_log(path: Path) -> tuple[int, str | None]:
    """Verify the log header and every record (header, length, CRC).

    Returns:
        ``(end, why)``: the byte offset after the last record of the valid prefix, and why the
        bytes at ``end`` are not a valid record (``None`` when the file ends at ``end``).

    Raises:
        FormatVersionError: see :func:`_log_start`.
    """
    size = path.stat().st_size
    if size == 0:
        return 0, None
    with open(path, "rb") as f:
        pos, _, why = _log_start(f, path)
        if why is not None:
            return 0, why
        if pos > size:
            return 0, f"a partial log header of {size} bytes"
        while pos < size:
            f.seek(pos)
            head = f.read(RECORD_HEADER.size)
            if len(head) < RECORD_HEADER.size:
                return pos, f"a partial header of {len(head)} bytes"
            magic, ver, n, crc = RECORD_HEADER.unpack(head)
            if magic != MAGIC or ver != VERSION:
                return pos, f"bad record header (magic {magic!r}, version {ver})"
            if pos + RECORD_HEADER.size + n > size:
                present = size - pos - RECORD_HEADER.size
                return pos, f"the header announces {n} payload bytes, {present} are present"
            got, left = 0, n
            while left:
                chunk = f.read(min(left, _CRC_CHUNK))
                got, left = zlib.crc32(chunk, got), left - len(chunk)
            if got != crc:
                return pos, "checksum mismatch"
            pos += RECORD_HEADER.size + n
    return pos, None


def _next_valid_record(path: Path, start: int) -> int | None:
    """Offset of the first valid record (magic, version, length and CRC all right) that
    begins at or after ``start``, or ``None``; only called on a damaged log."""
    size = path.stat().st_size
    if start + RECORD_HEADER.size > size:
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = m.find(MAGIC, start)
        while pos != -1 and pos + RECORD_HEADER.size <= size:
            _, ver, n, crc = RECORD_HEADER.unpack_from(m, pos)
            body = pos + RECORD_HEADER.size
            if ver == VERSION and body + n <= size and zlib.crc32(m[body : body + n]) == crc:
                return pos
            pos = m.find(MAGIC, pos + 1)
    return None


# ------------------------------------------------------------------------------ the two ends


class FileLogPublisher(UpdatePublisher):
    """Append-only update log (one writer per file). Opening it verifies every record: a bad
    last record (a torn write) is truncated; a bad record followed by valid ones is refused.
    A new (or empty) log gets a log header with a random log id first.

    Raises:
        CorruptRecordError: (from the constructor) when a record in the middle of the log
            is corrupt; the message names its offset and the next valid record's.
        FormatVersionError: (from the constructor) the log is of another format version.
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


class FileLogSource(UpdateSource):
    """Reads records of an append-only log; stops before a torn or corrupted record (and
    logs an error for a corrupted one): a bad record is never skipped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.corrupt = 0  # records refused (bad checksum/header)

    def check_offset(self, offset: str, log_id: str | None) -> None:
        """An offset must be a byte position, stored with the id of the log it was taken in."""
        parse_log_offset(offset)
        if log_id is None or not LOG_ID_RE.fullmatch(log_id):
            raise ValueError(
                f"an offset into update log {self.path} needs the id of the log it was taken in "
                f"('log:<32 hex digits>'), got {log_id!r}"
            )

    def read(self, offset: str | None, max_records: int = 64) -> list[tuple[str, UpdateBatch]]:
        """Records after byte ``offset``, trusted to be a record boundary of this log (use
        :meth:`read_log` to check the log's identity)."""
        return self.read_log(offset, None, max_records)[1]

    def read_log(
        self, offset: str | None, log_id: str | None, max_records: int = 64
    ) -> tuple[str | None, list[tuple[str, UpdateBatch]]]:
        """Records after byte ``offset`` of the log ``log_id``: ``(the log's id, records)``.

        ``offset`` ``None`` (or ``"0"``) reads the log from its start, whatever its id;
        ``log_id`` ``None`` skips the identity check. Nothing is read while the log is missing
        or its header not fully written; a log whose start is corrupt is refused (an error is
        logged) and nothing is read.

        Raises:
            ValueError: ``offset`` is not a non-negative integer.
            FormatVersionError: the log is of another format version (or has no log header).
            LogReplacedError: the log's id is not ``log_id`` (another log replaced it).
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
            start, ident, why = _log_start(f, self.path)
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
            if ident is None:
                return None, []  # the header is not written yet: no record either
            return ident, self._records(f, pos, size, max_records)

    def _records(
        self, f: BinaryIO, pos: int, size: int, max_records: int
    ) -> list[tuple[str, UpdateBatch]]:
        out: list[tuple[str, UpdateBatch]] = []
        while len(out) < max_records and pos + RECORD_HEADER.size <= size:
            f.seek(pos)
            head = f.read(RECORD_HEADER.size)
            magic, ver, n, _ = RECORD_HEADER.unpack(head)
            if magic != MAGIC or ver != VERSION:
                # a garbage header's length means nothing: say so now rather than
                # waiting silently for bytes that will never come
                self.corrupt += 1
                log.error(
                    "update log %s: record at offset %d refused: bad record header "
                    "(magic %r, version %d; this log holds version %d records)",
                    self.path,
                    pos,
                    magic,
                    ver,
                    VERSION,
                )
                break
            if pos + RECORD_HEADER.size + n > size:
                break  # not fully written yet (or torn): never applied
            rec = head + f.read(n)
            try:
                batch = decode_batch(rec)
            except CorruptRecordError as e:
                self.corrupt += 1
                log.error("update log %s: record at offset %d refused: %s", self.path, pos, e)
                break
            pos += RECORD_HEADER.size + n
            out.append((str(pos), batch))
        return out
