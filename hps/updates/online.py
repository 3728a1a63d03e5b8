"""Online updates: the trainer publishes changed rows; every server applies them to its
volatile DB, persistent DB and cached copies.

One update *batch* (all tables changed by one training step) is one checksummed record
(:mod:`hps.updates.log` has the format). Transports: an append-only log file (the embedded
default; the offset is the byte position after a record, stored together with the log's id so
that a replaced or rotated log is detected on resume, :class:`LogReplacedError`) or a Redis
Stream (``XADD``; the offset is the entry id). A record whose header, length or CRC does not
check out is never applied: a reader stops before it (logging an error) and never skips it.

Applying a batch (:class:`UpdateApplier`): validate every table first (keys ``(n,)`` int64,
rows ``(n, dim)`` float32 and finite, no duplicate key; nothing is applied on error, and the
error names the table), then, under the writer side of each session's lock (so a lookup sees
the batch entirely or not at all): volatile DB, cached copies, and last the persistent DB rows
*together with the new offset and log id* in one atomic RocksDB write batch (or the offset
file when there is no writable persistent DB). A restarted server resumes after the last
applied offset; re-applying a batch is harmless (rows are absolute values, not deltas), which
is why a server that rebuilt its volatile DB from the sparse files clears the offset file and
replays the source from its start (:mod:`hps.parameter_server`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hps.session import LookupSession
from hps.storage.persistent import RocksDBBackend
from hps.types import StorageBackend, VolatileUnavailableError, check_keys, check_values
from hps.updates.log import (
    LOG_ID_RE,
    MAGIC,
    VERSION,
    CorruptRecordError,
    FileLogPublisher,
    FileLogSource,
    InvalidUpdateError,
    LogReplacedError,
    OffsetPastEndError,
    StaleOffsetError,
    UpdateBatch,
    UpdatePublisher,
    UpdateSource,
    decode_batch,
    encode_batch,
)

log = logging.getLogger(__name__)

__all__ = [  # the record format and the file log live in hps.updates.log; re-exported here
    "LOG_ID_RE",
    "MAGIC",
    "VERSION",
    "CorruptRecordError",
    "FileLogPublisher",
    "FileLogSource",
    "InvalidUpdateError",
    "LogReplacedError",
    "OffsetFile",
    "OffsetPastEndError",
    "PublishUpdatesCallback",
    "RedisStreamPublisher",
    "RedisStreamSource",
    "StaleOffsetError",
    "UpdateApplier",
    "UpdateBatch",
    "UpdatePublisher",
    "UpdateSource",
    "decode_batch",
    "encode_batch",
    "redis_client",
]


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
    """The last applied offset in a small file, replaced atomically (write + rename): one line,
    ``<offset>`` or ``<offset> <log id>`` (the id of the update log the offset was taken in;
    files written before log ids existed hold the offset alone)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> str | None:
        """The file's text, stripped (``None`` when missing or empty); not checked."""
        return self.path.read_text(errors="replace").strip() or None if self.path.exists() else None

    def load_position(self) -> tuple[str | None, str | None]:
        """``(offset, log id)`` (``None`` for what the file does not hold).

        Raises:
            ValueError: naming the file and its text, unless it is empty or one or two words,
                the second one a log id (``log:<32 hex digits>`` or ``rec0:<n>:<8 hex digits>``).
        """
        if not self.path.exists():
            return None, None
        raw = self.path.read_bytes()
        try:
            words = raw.decode("ascii").split()
        except UnicodeDecodeError:
            words = None
        if (
            words is None
            or len(words) > 2
            or (len(words) == 2 and not LOG_ID_RE.fullmatch(words[1]))
        ):
            raise ValueError(
                f"offset file {self.path} holds {raw[:200]!r}, not '<offset>' or "
                f"'<offset> <log id>'"
            )
        return (words[0] if words else None), (words[1] if len(words) == 2 else None)

    def save(self, offset: str, log_id: str | None = None) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(offset if log_id is None else f"{offset} {log_id}")
        os.replace(tmp, self.path)

    def clear(self) -> None:
        """Forget the offset: the next reader starts at the beginning of the source."""
        self.path.unlink(missing_ok=True)


class UpdateApplier:
    """Applies published batches to the tiers and the sessions' caches, resuming after the
    last applied offset.

    The offset is stored with the id of the log it was taken in (:mod:`hps.updates.log`) and
    checked when read: a replaced or rotated log (another id) raises :class:`LogReplacedError`
    and nothing is applied. An offset stored without an id (by an older version, or given to
    :meth:`reset_offset` alone) is accepted when a record of the log starts there, and is then
    stored with the log's id. A stored offset that is not well-formed (not a non-negative
    integer for a file log; a damaged offset file) makes :meth:`poll` raise ``ValueError``
    naming where it is stored and the bad value; :meth:`reset_offset` still works.

    Args:
        source: where batches come from.
        sessions: sessions whose cached copies must follow the updates.
        volatile, persistent: the databases (a read-only persistent DB is skipped).
        offset_file: where the offset lives when there is no writable persistent DB.
        name: the source's name in the persistent DB's metadata.
    """

    def __init__(
        self,
        source: UpdateSource,
        sessions: Iterable[LookupSession],
        volatile: StorageBackend | None = None,
        persistent: RocksDBBackend | None = None,
        offset_file: str | Path | None = None,
        name: str = "updates",
    ) -> None:
        self.source = source
        self.sessions = list(sessions)
        self.volatile = volatile
        self.persistent = (
            persistent if persistent is not None and not persistent.read_only else None
        )
        self.offset_file = OffsetFile(offset_file) if offset_file else None
        if self.persistent is None and self.offset_file is None:
            raise ValueError(
                "UpdateApplier needs a writable persistent db or an offset_file to resume from"
            )
        self._meta_key = f"update_offset:{name}"
        self._id_key = f"update_log_id:{name}"
        self.log_id: str | None = None  # the id of the log ``offset`` was taken in
        self._bad_offset: str | None = None  # why the stored offset cannot be used (raised by poll)
        self.offset = self._load_offset()
        self.applied = 0  # batches applied by this instance
        self._lock = threading.Lock()

    def _load_offset(self) -> str | None:
        """The stored offset (and :attr:`log_id`); a malformed one is kept for :meth:`poll` to
        refuse (the constructor must work, so that :meth:`reset_offset` can replace it)."""
        try:
            if self.persistent is not None:
                raw, rid = (
                    self.persistent.get_meta(self._meta_key),
                    self.persistent.get_meta(self._id_key),
                )
                try:
                    offset = raw.decode("ascii") or None if raw is not None else None
                    log_id = rid.decode("ascii") or None if rid is not None else None
                    ok = (offset is None or offset.split() == [offset]) and (
                        log_id is None or LOG_ID_RE.fullmatch(log_id) is not None
                    )
                except UnicodeDecodeError:
                    ok = False
                if not ok:
                    raise ValueError(
                        f"{self._stored_in()} holds {raw!r} and log id {rid!r}, not an "
                        f"update offset and a log id"
                    )
            else:
                offset, log_id = self.offset_file.load_position()
            if offset is not None:
                try:
                    self.source.check_offset(offset)
                except ValueError as e:
                    raise ValueError(
                        f"{self._stored_in()} holds the update offset {offset!r}: {e}"
                    ) from None
        except ValueError as e:
            self._bad_offset = (
                f"{e}; nothing was applied. To apply the source from its start, {self._where()}"
            )
            return None
        self.log_id = log_id if offset is not None else None
        return offset

    def _stored_in(self) -> str:
        if self.persistent is not None:
            return f"the persistent db {self.persistent.path} (metadata {self._meta_key!r})"
        return f"the offset file {self.offset_file.path}"

    def _where(self) -> str:
        """Where the offset is stored, and how to reset it (for error messages)."""
        if self.persistent is not None:
            return (
                f"the offset is {self._meta_key!r} in the persistent db {self.persistent.path}; "
                f"call UpdateApplier.reset_offset(), e.g. HierarchicalParameterServer.from_config("
                f"<ps.json>, load=False).update_applier().reset_offset() with the server stopped"
            )
        return (
            f"stop the server and delete the offset file {self.offset_file.path} "
            f"(or call UpdateApplier.reset_offset())"
        )

    def _store(self, offset: str | None, log_id: str | None, rows: list | None = None) -> None:
        """Record the offset and its log id (with ``rows`` in one atomic write when the
        persistent db holds them)."""
        if self.persistent is not None:
            self.persistent.write_batch(
                rows or [],
                meta={
                    self._meta_key: (offset or "").encode(),
                    self._id_key: (log_id or "").encode(),
                },
            )
        elif offset is None:
            self.offset_file.clear()
        else:
            self.offset_file.save(offset, log_id)
        self.offset, self.log_id = offset, log_id if offset is not None else None
        self._bad_offset = None  # a malformed stored offset is replaced

    def reset_offset(self, offset: str | None = None, log_id: str | None = None) -> None:
        """Store ``offset`` as the last applied one (``None``: read the source from its start,
        e.g. after the update log was replaced). An ``offset`` without ``log_id`` must be on a
        record boundary of the log when it is next read (see the class docstring)."""
        if offset is not None:
            self.source.check_offset(offset)
        if log_id is not None and not LOG_ID_RE.fullmatch(log_id):
            raise ValueError(
                f"log id {log_id!r} is not 'log:<32 hex digits>' or 'rec0:<n>:<8 hex digits>'"
            )
        with self._lock:
            self._store(offset, log_id)

    def _dims(self) -> dict[str, int]:
        dims: dict[str, int] = {}
        for s in self.sessions:
            dims.update({n: t.dim for n, t in s.tables.items()})
        return dims

    def validate(self, batch: UpdateBatch) -> UpdateBatch:
        """Check every table of ``batch`` before anything is written; returns it with each
        array C-contiguous.

        Raises:
            InvalidUpdateError: naming the table, for an unknown table, keys that are not a ``(n,)``
                int64 array or hold a key twice, rows that are not an ``(n, dim)`` float32
                array (``dim`` the table's) or hold a NaN or infinite value (a diverged trainer's
                rows are refused, not served; the poller retries the record, never skips it).
        """
        dims = self._dims()
        out: UpdateBatch = {}
        for name, (keys, rows) in batch.items():
            if name not in dims:
                raise InvalidUpdateError(
                    f"update for unknown table {name!r}; served tables: {sorted(dims)}"
                )
            what = f"update for {name!r}:"
            keys = check_keys(keys, f"{what} keys")
            if not isinstance(rows, np.ndarray) or rows.shape != (keys.shape[0], dims[name]):
                got = rows.shape if isinstance(rows, np.ndarray) else type(rows).__name__
                raise InvalidUpdateError(
                    f"{what} rows {got}, expected ({keys.shape[0]}, {dims[name]})"
                )
            rows = check_values(rows, keys.shape[0], dims[name], f"{what} rows")
            bad = np.flatnonzero(~np.isfinite(rows).all(1))
            if bad.size:
                raise InvalidUpdateError(
                    f"{what} the row of key {int(keys[bad[0]])} holds a non-finite value "
                    f"({rows[bad[0]][~np.isfinite(rows[bad[0]])][0]}); {bad.size} such row(s)"
                )
            s = np.sort(
                keys
            )  # not np.unique: numpy 2.4's hash path is ~50x slower on large batches
            rep = np.flatnonzero(s[1:] == s[:-1])
            if rep.size:
                raise InvalidUpdateError(
                    f"{what} duplicate keys (key {int(s[rep[0]])} occurs more than once)"
                )
            out[name] = (keys, rows)
        return out

    def apply(self, batch: UpdateBatch, offset: str, log_id: str | None = None) -> None:
        """Apply one batch entirely (or, on a validation error, not at all: :meth:`validate`
        checks every table before anything is written) and record ``offset`` (taken in the
        log ``log_id``, ``None`` when unknown)."""
        batch = self.validate(batch)
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
                        t.cache.update_if_present(
                            torch.from_numpy(keys).to(t.cache.device),
                            torch.from_numpy(rows).to(t.cache.device),
                        )
            self._store(offset, log_id, [(n, k, r) for n, (k, r) in batch.items()])
            self.applied += 1
        finally:
            for lk in reversed(locks):
                lk.release_write()

    def poll(self, max_records: int = 64) -> int:
        """Apply every available record (up to ``max_records``); returns how many.

        Raises:
            StaleOffsetError: the stored offset does not fit the update log (a
                :class:`LogReplacedError`: another log replaced it, or an offset without a log id
                is not on a record boundary; an :class:`OffsetPastEndError`: past its end); the
                message names the log, both log ids, where the offset is stored and how to reset
                it. Nothing is applied.
            ValueError: the stored offset is malformed (the message names where it is stored).
        """
        with self._lock:
            if self._bad_offset is not None:
                raise ValueError(self._bad_offset)
            try:
                log_id, recs = self.source.read_log(self.offset, self.log_id, max_records)
            except StaleOffsetError as e:
                raise e.with_hint(self._where()) from None
            if not recs and self.offset is not None and log_id is not None and self.log_id is None:
                self._store(
                    self.offset, log_id
                )  # an offset without a log id, now checked: adopt the id
            for off, batch in recs:
                try:
                    self.apply(batch, off, log_id)
                except InvalidUpdateError as e:
                    raise InvalidUpdateError(
                        f"{e} (the record ending at offset {off}: it stays unapplied, with the "
                        "records after it, and is retried. To skip it where the offset is kept "
                        "across restarts (a writable persistent db, or a Redis volatile db that is "
                        f"not reloaded): UpdateApplier.reset_offset({off!r}, {log_id!r}) with the "
                        "server stopped. A server that rebuilds its volatile db at start replays "
                        "the source from its beginning: there the record must be removed from "
                        "the source, or the source replaced)"
                    ) from None
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
                except (
                    CorruptRecordError,
                    InvalidUpdateError,
                    VolatileUnavailableError,
                ) as e:  # no traceback needed
                    log.error("applying online updates failed; will retry: %s", e)
                except Exception:  # keep serving; the batch stays unapplied and is retried
                    log.exception("applying online updates failed; will retry")

        threading.Thread(target=loop, name="hps-updates", daemon=True).start()
        return stop


class PublishUpdatesCallback:
    """Trainer callback (duck-typed to ``embark.training.trainer.Callback``): after every
    ``every_n_steps`` optimizer steps it publishes the rows that changed, all tables in one
    batch.

    Changed rows are found by comparing each ``trainer.model.embeddings[<table>].weight``
    with a snapshot (exact for any optimizer; costs one copy of the tables).

    Args:
        publisher: transport.
        every_n_steps: publish cadence.
        tables: table names (default: every table of ``model.embeddings``).
    """

    def __init__(
        self, publisher: UpdatePublisher, every_n_steps: int = 1, tables: list[str] | None = None
    ) -> None:
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
        taken: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []  # (snapshot, rows, values)
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
