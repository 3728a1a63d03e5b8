"""Online updates: the trainer publishes changed rows; every server applies them to its
volatile DB, persistent DB and cached copies.

One update *batch* (all tables changed by one training step) is one record::

    offset → | "HPSU" | ver u8 | payload_len u64 | crc32(payload) u32 | payload ... |
    payload  = n_tables u32, then per table:
               name_len u16 | name utf-8 | n u64 | dim u32 | keys n×int64 | rows n×dim×float32
    (all little-endian)

Transports: an append-only log file (the embedded default; the offset is the byte position
after a record) or a Redis Stream (``XADD``; the offset is the entry id). A record whose
header, length or CRC does not check out is never applied: a reader stops before it (logging
an error) and never skips it. The log's single writer (:class:`FileLogPublisher`) verifies
every record when it opens the file:

* a bad *last* record (a torn write: a partial header or payload, or a full-length record
  whose CRC fails; also a tail with no valid record in it, such as the zeros a crash can
  leave) is truncated, with a warning naming the file, the offset and the bytes dropped;
* a bad record with a valid record *after it* (corruption in the middle) makes it refuse
  the file with :class:`CorruptRecordError` naming the offset: readers stop there, so
  anything appended after it would never be applied, and dropping the valid records that
  follow is not the writer's call.

Applying a batch (:class:`UpdateApplier`): validate every table and shape first (nothing is
applied on error), then, under the writer side of each session's lock (so a lookup sees the
batch entirely or not at all): volatile DB, cached copies, and last the persistent DB rows
*together with the new offset* in one atomic RocksDB write batch (or the offset file when
there is no writable persistent DB). A restarted server resumes after the last applied offset;
re-applying a batch is harmless (rows are absolute values, not deltas), which is why a server
that rebuilt its volatile DB from the sparse files clears the offset file and replays the
source from its start (:mod:`hps.parameter_server`).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hps.persistent import RocksDBBackend
from hps.session import LookupSession
from hps.types import StorageBackend, VolatileUnavailableError

log = logging.getLogger(__name__)

MAGIC = b"HPSU"
VERSION = 1
_HEADER = struct.Struct("<4sBQI")  # magic, version, payload length, crc32
UpdateBatch = dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (keys (n,) int64, rows (n, dim) float32)


class CorruptRecordError(ValueError):
    """A record's header, length, checksum or payload is wrong (or, for
    :class:`OffsetPastEndError`, the stored offset does not fit the log)."""


class OffsetPastEndError(CorruptRecordError):
    """The stored offset lies past the end of the update log: the log was replaced, rotated
    or truncated after the updates up to that offset were applied; reading from there would
    wait forever. Reset the stored offset (:meth:`UpdateApplier.reset_offset`)."""

    def __init__(self, path: Path, offset: int, size: int, hint: str = "") -> None:
        self.path, self.offset, self.size = path, offset, size
        super().__init__(
            f"update log {path}: the stored offset {offset} is past the end of the log ({size} bytes): "
            f"the log was replaced, rotated or truncated after the updates up to that offset were "
            f"applied, and nothing appended to it would ever be applied. Reset the stored offset to "
            f"apply this log from its start{': ' + hint if hint else ' (UpdateApplier.reset_offset())'}"
        )


def encode_batch(batch: UpdateBatch) -> bytes:
    """One update batch → one checksummed record (bytes)."""
    parts = [struct.pack("<I", len(batch))]
    for name, (keys, rows) in batch.items():
        keys = np.ascontiguousarray(keys, dtype="<i8")
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if rows.ndim != 2 or rows.shape[0] != keys.shape[0]:
            raise ValueError(f"update for {name!r}: rows {rows.shape} do not match {keys.shape[0]} keys")
        nb = name.encode()
        parts += [struct.pack("<H", len(nb)), nb, struct.pack("<QI", keys.size, rows.shape[1]),
                  keys.tobytes(), rows.tobytes()]
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
    payload = record[_HEADER.size:]
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
            raise CorruptRecordError(f"record payload ends at byte {size}, but {what} needs bytes "
                                     f"{pos}..{pos + n}")

    out: UpdateBatch = {}
    need(0, 4, "the table count")
    (n_tables,), pos = struct.unpack_from("<I", payload), 4
    for i in range(n_tables):
        need(pos, 2, f"table {i} of {n_tables}'s name length")
        (ln,) = struct.unpack_from("<H", payload, pos)
        need(pos + 2, ln, f"table {i}'s name")
        try:
            name = payload[pos + 2:pos + 2 + ln].decode()
        except UnicodeDecodeError as e:
            raise CorruptRecordError(f"table {i}'s name at byte {pos + 2} is not UTF-8: {e}") from None
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
        raise CorruptRecordError(f"record payload has {size - pos} bytes after its {n_tables} table(s)")
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


class FileLogPublisher(UpdatePublisher):
    """Append-only update log (one writer per file). Opening it verifies every record: a bad
    last record (a torn write) is truncated; a bad record followed by valid ones is refused.

    Raises:
        CorruptRecordError: (from the constructor) when a record in the middle of the log
            is corrupt; the message names its offset and the next valid record's.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.path.touch(exist_ok=True)
        end, why = _scan_log(self.path)
        if why is None:
            return
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
        log.warning("update log %s: truncating %d bytes at offset %d, a torn or corrupted last record (%s)",
                    self.path, size - end, end, why)
        with open(self.path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())

    def publish(self, batch: UpdateBatch) -> str:
        rec = encode_batch(batch)
        with self._lock, open(self.path, "ab") as f:
            f.write(rec)
            f.flush()
            os.fsync(f.fileno())
            return str(f.tell())


_CRC_CHUNK = 1 << 20  # bytes read at a time when verifying a record (records can be large)


def _scan_log(path: Path) -> tuple[int, str | None]:
    """Verify every record (header, length, CRC) from the start of the log.

    Returns:
        ``(end, why)``: the byte offset after the last record of the valid prefix, and why the
        bytes at ``end`` are not a valid record (``None`` when the file ends at ``end``).
    """
    size, pos = path.stat().st_size, 0
    with open(path, "rb") as f:
        while pos < size:
            f.seek(pos)
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return pos, f"a partial header of {len(head)} bytes"
            magic, ver, n, crc = _HEADER.unpack(head)
            if magic != MAGIC or ver != VERSION:
                return pos, f"bad record header (magic {magic!r}, version {ver})"
            if pos + _HEADER.size + n > size:
                return pos, f"the header announces {n} payload bytes, {size - pos - _HEADER.size} are present"
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
            if ver == VERSION and body + n <= size and zlib.crc32(m[body:body + n]) == crc:
                return pos
            pos = m.find(MAGIC, pos + 1)
    return None


class FileLogSource(UpdateSource):
    """Reads records of an append-only log; stops before a torn or corrupted record (and
    logs an error for a corrupted one): a bad record is never skipped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.corrupt = 0  # records refused (bad checksum/header)

    def read(self, offset: str | None, max_records: int = 64) -> list[tuple[str, UpdateBatch]]:
        """Records after byte ``offset``.

        Raises:
            OffsetPastEndError: ``offset`` lies past the end of the log (it was replaced).
        """
        if not self.path.exists():
            return []
        pos = int(offset or 0)
        out = []
        size = self.path.stat().st_size
        if pos > size:
            raise OffsetPastEndError(self.path, pos, size)
        with open(self.path, "rb") as f:
            while len(out) < max_records and pos + _HEADER.size <= size:
                f.seek(pos)
                head = f.read(_HEADER.size)
                magic, ver, n, _ = _HEADER.unpack(head)
                if magic != MAGIC or ver != VERSION:
                    # a garbage header's length means nothing: say so now rather than
                    # waiting silently for bytes that will never come
                    self.corrupt += 1
                    log.error("update log %s: record at offset %d refused: bad record header "
                              "(magic %r, version %d)", self.path, pos, magic, ver)
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


def redis_client(address: str, cluster: bool) -> Any:
    """A redis-py client for ``"host:port[,host:port]"`` (``RedisCluster`` when ``cluster``)."""
    from redis import Redis
    from redis.cluster import ClusterNode, RedisCluster

    nodes = []
    for part in filter(None, (p.strip() for p in address.split(","))):
        host, _, port = part.rpartition(":")
        nodes.append((host, int(port)))
    if not nodes:
        raise ValueError(f"redis address {address!r}: expected 'host:port[,host:port...]'")
    if cluster:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes])
    return Redis(host=nodes[0][0], port=nodes[0][1])


class RedisStreamPublisher(UpdatePublisher):
    """Publishes each batch as one Redis Stream entry (``XADD stream * r <record>``)."""

    def __init__(self, client: Any, stream: str = "hps_updates") -> None:
        self.client, self.stream = client, stream

    def publish(self, batch: UpdateBatch) -> str:
        rid = self.client.xadd(self.stream, {b"r": encode_batch(batch)})
        return rid.decode() if isinstance(rid, bytes) else str(rid)


class RedisStreamSource(UpdateSource):
    """Reads a Redis Stream after an entry id; a corrupted entry stops the reader."""

    def __init__(self, client: Any, stream: str = "hps_updates") -> None:
        self.client, self.stream = client, stream
        self.corrupt = 0

    def read(self, offset: str | None, max_records: int = 64) -> list[tuple[str, UpdateBatch]]:
        res = self.client.xread({self.stream: offset or "0-0"}, count=max_records)
        out = []
        for _, entries in res or []:
            for rid, fields in entries:
                rid = rid.decode() if isinstance(rid, bytes) else str(rid)
                try:
                    out.append((rid, decode_batch(fields[b"r"])))
                except (CorruptRecordError, KeyError) as e:
                    self.corrupt += 1
                    log.error("update stream %s: entry %s refused: %s", self.stream, rid, e)
                    return out
        return out


# ------------------------------------------------------------------------------ applying


class OffsetFile:
    """The last applied offset in a small file, replaced atomically (write + rename)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> str | None:
        return self.path.read_text().strip() or None if self.path.exists() else None

    def save(self, offset: str) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(offset)
        os.replace(tmp, self.path)

    def clear(self) -> None:
        """Forget the offset: the next reader starts at the beginning of the source."""
        self.path.unlink(missing_ok=True)


class UpdateApplier:
    """Applies published batches to the tiers and the sessions' caches, resuming after the
    last applied offset.

    Args:
        source: where batches come from.
        sessions: sessions whose cached copies must follow the updates.
        volatile, persistent: the databases (a read-only persistent DB is skipped).
        offset_file: where the offset lives when there is no writable persistent DB.
        name: the source's name in the persistent DB's metadata.
    """

    def __init__(self, source: UpdateSource, sessions: Iterable[LookupSession],
                 volatile: StorageBackend | None = None, persistent: RocksDBBackend | None = None,
                 offset_file: str | Path | None = None, name: str = "updates") -> None:
        self.source = source
        self.sessions = list(sessions)
        self.volatile = volatile
        self.persistent = persistent if persistent is not None and not persistent.read_only else None
        self.offset_file = OffsetFile(offset_file) if offset_file else None
        if self.persistent is None and self.offset_file is None:
            raise ValueError("UpdateApplier needs a writable persistent db or an offset_file to resume from")
        self._meta_key = f"update_offset:{name}"
        self.offset = self._load_offset()
        self.applied = 0  # batches applied by this instance
        self._lock = threading.Lock()

    def _load_offset(self) -> str | None:
        if self.persistent is not None:
            raw = self.persistent.get_meta(self._meta_key)
            return raw.decode() or None if raw is not None else None
        return self.offset_file.load()

    def _where(self) -> str:
        """Where the offset is stored, and how to reset it (for error messages)."""
        if self.persistent is not None:
            return (f"the offset is {self._meta_key!r} in the persistent db {self.persistent.path}; "
                    f"call UpdateApplier.reset_offset(), e.g. HierarchicalParameterServer.from_config("
                    f"<ps.json>, load=False).update_applier().reset_offset() with the server stopped")
        return (f"stop the server and delete the offset file {self.offset_file.path} "
                f"(or call UpdateApplier.reset_offset())")

    def reset_offset(self, offset: str | None = None) -> None:
        """Store ``offset`` as the last applied one (``None``: read the source from its start,
        e.g. after the update log was replaced)."""
        with self._lock:
            if self.persistent is not None:
                self.persistent.write_batch([], meta={self._meta_key: (offset or "").encode()})
            elif offset is None:
                self.offset_file.clear()
            else:
                self.offset_file.save(offset)
            self.offset = offset

    def _dims(self) -> dict[str, int]:
        dims: dict[str, int] = {}
        for s in self.sessions:
            dims.update({n: t.dim for n, t in s.tables.items()})
        return dims

    def validate(self, batch: UpdateBatch) -> None:
        """Raise ``ValueError`` (naming table and shape) unless every part of ``batch`` fits."""
        dims = self._dims()
        for name, (keys, rows) in batch.items():
            if name not in dims:
                raise ValueError(f"update for unknown table {name!r}; served tables: {sorted(dims)}")
            if rows.shape != (keys.shape[0], dims[name]):
                raise ValueError(f"update for {name!r}: rows {rows.shape}, expected ({keys.shape[0]}, {dims[name]})")
            s = np.sort(keys)  # not np.unique: numpy 2.4's hash path is ~50x slower on large batches
            rep = np.flatnonzero(s[1:] == s[:-1])
            if rep.size:
                raise ValueError(f"update for {name!r}: duplicate keys (key {int(s[rep[0]])} occurs more than once)")

    def apply(self, batch: UpdateBatch, offset: str) -> None:
        """Apply one batch entirely (or, on a validation error, not at all) and record ``offset``."""
        self.validate(batch)
        locks = [s.update_lock for s in self.sessions]
        for lk in locks:
            lk.acquire_write()
        try:
            for name, (keys, rows) in batch.items():
                if self.volatile is not None:
                    self.volatile.insert(name, keys, rows)
                for s in self.sessions:
                    t = s.tables.get(name)
                    if t is not None and t.cache is not None:
                        t.cache.update_if_present(torch.from_numpy(keys).to(t.cache.device),
                                                  torch.from_numpy(rows).to(t.cache.device))
            if self.persistent is not None:
                self.persistent.write_batch([(n, k, r) for n, (k, r) in batch.items()],
                                            meta={self._meta_key: offset.encode()})
            else:
                self.offset_file.save(offset)
            self.offset = offset
            self.applied += 1
        finally:
            for lk in reversed(locks):
                lk.release_write()

    def poll(self, max_records: int = 64) -> int:
        """Apply every available record (up to ``max_records``); returns how many.

        Raises:
            OffsetPastEndError: the stored offset lies past the end of a replaced update log;
                the message says where the offset is stored and how to reset it.
        """
        with self._lock:
            try:
                recs = self.source.read(self.offset, max_records)
            except OffsetPastEndError as e:
                raise OffsetPastEndError(e.path, e.offset, e.size, self._where()) from None
            for off, batch in recs:
                self.apply(batch, off)
            return len(recs)

    def drain(self, max_records: int = 64) -> int:
        """:meth:`poll` until the source is empty (a backlog, e.g. a replay, at once); returns how many."""
        total = n = self.poll(max_records)
        while n == max_records:
            n = self.poll(max_records)
            total += n
        return total

    def start(self, interval_s: float) -> threading.Event:
        """Every ``interval_s``, :meth:`drain` in a daemon thread; set the returned event to stop."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.drain()
                except (CorruptRecordError, VolatileUnavailableError) as e:  # no traceback needed
                    log.error("applying online updates failed; will retry: %s", e)
                except Exception:  # keep serving; the batch stays unapplied and is retried
                    log.exception("applying online updates failed; will retry")

        threading.Thread(target=loop, name="hps-updates", daemon=True).start()
        return stop


class PublishUpdatesCallback:
    """Trainer callback (duck-typed to ``embark.train.Callback``): after every
    ``every_n_steps`` optimizer steps it publishes the rows that changed, all tables in one
    batch.

    Changed rows are found by comparing each ``trainer.model.embeddings[<table>].weight``
    with a snapshot (exact for any optimizer; costs one copy of the tables).

    Args:
        publisher: transport.
        every_n_steps: publish cadence.
        tables: table names (default: every table of ``model.embeddings``).
    """

    def __init__(self, publisher: UpdatePublisher, every_n_steps: int = 1, tables: list[str] | None = None) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be > 0, got {every_n_steps}")
        self.publisher = publisher
        self.every_n_steps = every_n_steps
        self.tables = tables
        self._snap: dict[str, torch.Tensor] = {}
        self.published = 0  # batches
        self.last_offset: str | None = None

    @staticmethod
    def _embeddings(trainer: Any) -> Any:
        model = getattr(trainer, "model", trainer)
        model = getattr(model, "module", model)  # DDP
        if not hasattr(model, "embeddings"):
            raise ValueError("PublishUpdatesCallback: trainer.model has no 'embeddings' ModuleDict")
        return model.embeddings

    def on_train_begin(self, trainer: Any) -> None:
        self._snapshot(trainer)

    def _snapshot(self, trainer: Any) -> None:
        emb = self._embeddings(trainer)
        for name in self.tables or list(emb.keys()):
            self._snap[name] = emb[name].weight.detach().cpu().clone()

    def on_after_backward(self, trainer: Any, step: int) -> None:
        if not self._snap:
            self._snapshot(trainer)

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        if not self._snap:
            self._snapshot(trainer)  # first call: nothing to compare with yet
            return
        if (step + 1) % self.every_n_steps:
            return
        self.publish_changes(trainer)

    def on_eval(self, trainer: Any, step: int, metrics: dict) -> None:
        pass

    def publish_changes(self, trainer: Any) -> int:
        """Publish the rows changed since the last successful publication; returns the rows
        published.

        Raises:
            Exception: whatever ``publisher.publish`` raises (e.g. ``ConnectionError``); the
                snapshot is then left as it was, so the next call publishes these rows again.
        """
        emb = self._embeddings(trainer)
        batch: UpdateBatch = {}
        taken: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (snapshot, rows, values)
        for name, snap in self._snap.items():
            w = emb[name].weight.detach().cpu()
            rows = torch.nonzero((w != snap).any(1)).squeeze(1)
            if rows.numel():
                vals = w[rows]  # a copy: the trainer may change w before the snapshot is updated
                batch[name] = (rows.numpy().astype(np.int64), vals.numpy().astype(np.float32))
                taken.append((snap, rows, vals))
        if not batch:
            return 0
        # The snapshot moves only once the transport has the rows: when publish raises (the
        # Redis server went away), the rows still differ from it and the next call re-sends them.
        self.last_offset = self.publisher.publish(batch)
        for snap, rows, vals in taken:
            snap[rows] = vals
        self.published += 1
        return sum(k.size for k, _ in batch.values())
