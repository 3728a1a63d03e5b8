"""Applying online updates: every server reads the update source and writes each batch into
its volatile DB, persistent DB and cached copies, resuming after the last applied offset.

Applying a batch (:class:`UpdateApplier`): validate every table first (keys ``(n,)`` int64,
rows ``(n, dim)`` float32 and finite, no duplicate key; nothing is applied on error, and the
error names the table), then, under the writer side of each session's lock (so a lookup sees
the batch entirely or not at all): volatile DB, cached copies, and last the persistent DB rows
*together with the new offset and log id* in one atomic RocksDB write batch (or the offset
file when there is no writable persistent DB). A restarted server resumes after the last
applied offset; re-applying a batch is harmless (rows are absolute values, not deltas), which
is why a server that rebuilt its volatile DB from the sparse files clears the offset file and
replays the source from its start (:mod:`hps.parameter_server`).

A record names each table by its database name (:mod:`hps.updates.record`): a batch for a table
that two models share reaches both models' caches; a batch for ``foo.t0`` (models name ``t0``
with other rows) reaches only model ``foo``'s.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from hps.config import SCOPE_SEP
from hps.session import LookupSession
from hps.storage.persistent import RocksDBBackend
from hps.types import (
    FormatVersionError,
    StorageBackend,
    VolatileUnavailableError,
    check_keys,
    check_values,
)
from hps.updates.bounds import check_row_bound
from hps.updates.file_log import StaleOffsetError
from hps.updates.health import UpdateHealth
from hps.updates.record import CorruptRecordError, InvalidUpdateError, UpdateBatch
from hps.updates.transport import UpdateSource

__all__ = ["OffsetFile", "UpdateApplier"]

log = logging.getLogger("hps.updates")


class OffsetFile:
    """The last applied offset in a small file, replaced atomically (write + rename): one line,
    ``<offset> <log id>`` for a file log (the id of the log the offset was taken in), or
    ``<offset>`` for a source with one history (a Redis stream)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> str | None:
        """The file's text, stripped (``None`` when missing or empty); not checked."""
        return self.path.read_text(errors="replace").strip() or None if self.path.exists() else None

    def load_position(self) -> tuple[str | None, str | None]:
        """``(offset, log id)`` (``None`` for what the file does not hold); the source checks
        that they fit it (:meth:`~hps.updates.transport.UpdateSource.check_offset`).

        Raises:
            ValueError: naming the file and its text, unless it is empty or one or two ASCII
                words.
        """
        if not self.path.exists():
            return None, None
        raw = self.path.read_bytes()
        try:
            words = raw.decode("ascii").split()
        except UnicodeDecodeError:
            words = None
        if words is None or len(words) > 2:
            raise ValueError(
                f"offset file {self.path} holds {raw[:200]!r}, not '<offset> <log id>' "
                f"or '<offset>'"
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

    The offset is stored with the id of the log it was taken in (:mod:`hps.updates.file_log`)
    and checked when read: a replaced or rotated log (another id) raises
    :class:`~hps.updates.file_log.LogReplacedError` and nothing is applied. A stored offset
    that does not fit the source (not a non-negative integer, or without a log id, for a file
    log; a damaged offset file) makes :meth:`poll` raise ``ValueError`` naming where it is
    stored and the bad value; :meth:`reset_offset` still works.

    Args:
        source: where batches come from.
        sessions: sessions whose cached copies must follow the updates.
        volatile, persistent: the databases (a read-only persistent DB is skipped).
        offset_file: where the offset lives when there is no writable persistent DB.
        name: the source's name in the persistent DB's metadata.
        health: the failure count, backoff and readiness of the poller
            (:mod:`hps.updates.health`; default: its own, with the default policy).
        skip_request: the file where ``python -m hps.updates skip`` asks the poller to skip the
            refused record (``None``: no such requests).
    """

    def __init__(
        self,
        source: UpdateSource,
        sessions: Iterable[LookupSession],
        volatile: StorageBackend | None = None,
        persistent: RocksDBBackend | None = None,
        offset_file: str | Path | None = None,
        name: str = "updates",
        health: UpdateHealth | None = None,
        skip_request: str | Path | None = None,
    ) -> None:
        self.source = source
        self.health = health if health is not None else UpdateHealth()
        self.skip_request = OffsetFile(skip_request) if skip_request is not None else None
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

    # ------------------------------------------------------------------ the stored offset
    def _stored_position(self) -> tuple[str | None, str | None]:
        """``(offset, log id)`` as stored, not checked against the source.

        Raises:
            ValueError: what is stored is not text, or not one offset and one log id.
        """
        if self.persistent is None:
            return self._offset_file().load_position()
        raw = self.persistent.get_meta(self._meta_key)
        rid = self.persistent.get_meta(self._id_key)
        try:
            offset = raw.decode("ascii") or None if raw is not None else None
            log_id = rid.decode("ascii") or None if rid is not None else None
        except UnicodeDecodeError:
            offset = log_id = ""  # refused below
        if offset == "" or (offset is not None and offset.split() != [offset]):
            raise ValueError(
                f"{self._stored_in()} holds {raw!r} and log id {rid!r}, not an "
                f"update offset and a log id"
            )
        return offset, log_id

    def _load_offset(self) -> str | None:
        """The stored offset (and :attr:`log_id`); one that does not fit the source is kept
        for :meth:`poll` to refuse (the constructor must work, so that :meth:`reset_offset` can
        replace it)."""
        try:
            offset, log_id = self._stored_position()
            if offset is not None:
                try:
                    self.source.check_offset(offset, log_id)
                except ValueError as e:
                    raise ValueError(
                        f"{self._stored_in()} holds the update offset {offset!r} "
                        f"(log id {log_id!r}): {e}"
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
        return f"the offset file {self._offset_file().path}"

    def _offset_file(self) -> OffsetFile:
        """The offset file (the constructor requires it without a writable persistent db)."""
        if self.offset_file is None:
            raise RuntimeError("UpdateApplier: no offset file, and no writable persistent db")
        return self.offset_file

    def _where(self) -> str:
        """Where the offset is stored, and how to reset it (for error messages)."""
        if self.persistent is not None:
            return (
                f"the offset is {self._meta_key!r} in the persistent db {self.persistent.path}; "
                f"call UpdateApplier.reset_offset(), e.g. HierarchicalParameterServer.from_config("
                f"<ps.json>, load=False).update_applier().reset_offset() with the server stopped"
            )
        return (
            f"stop the server and delete the offset file {self._offset_file().path} "
            f"(or call UpdateApplier.reset_offset())"
        )

    def _store(
        self,
        offset: str | None,
        log_id: str | None,
        rows: list[tuple[str, np.ndarray, np.ndarray]] | None = None,
    ) -> None:
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
            self._offset_file().clear()
        else:
            self._offset_file().save(offset, log_id)
        self.offset, self.log_id = offset, log_id if offset is not None else None
        self._bad_offset = None  # a malformed stored offset is replaced

    def reset_offset(self, offset: str | None = None, log_id: str | None = None) -> None:
        """Store ``offset``, taken in the log ``log_id``, as the last applied one (``None``:
        read the source from its start, e.g. after the update log was replaced).

        Raises:
            ValueError: ``offset`` and ``log_id`` do not fit the source (a file log needs both).
        """
        if offset is not None:
            self.source.check_offset(offset, log_id)
        with self._lock:
            self._store(offset, log_id)

    # ------------------------------------------------------------------ applying
    def _dims(self) -> dict[str, int]:
        """Database name → row width of every table served."""
        dims: dict[str, int] = {}
        for s in self.sessions:
            dims.update({t.db_name: t.dim for t in s.tables.values()})
        return dims

    @staticmethod
    def _unknown(name: str, dims: dict[str, int]) -> InvalidUpdateError:
        """The error for a record naming no served table; where models name a table ``name``
        with other rows, it says which scoped names the record must use instead."""
        scoped = sorted(d for d in dims if d.endswith(f"{SCOPE_SEP}{name}"))
        hint = (
            f"; models name {name!r} with other rows, so a record names one of them by model: "
            f"{scoped}"
            if scoped
            else ""
        )
        return InvalidUpdateError(
            f"update for unknown table {name!r}; served tables: {sorted(dims)}{hint}"
        )

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
                raise self._unknown(name, dims)
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
            check_row_bound(keys, rows, what)
            # np.sort, not np.unique: numpy 2.4's hash path is ~50x slower on large batches
            s = np.sort(keys)
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
        log ``log_id``; ``None`` for a source without log ids)."""
        batch = self.validate(batch)
        locks = [s.update_lock for s in self.sessions]
        for lk in locks:
            lk.acquire_write()
        try:
            for name, (keys, rows) in batch.items():
                if self.volatile is not None:
                    self.volatile.insert(name, keys, rows)
                for s in self.sessions:
                    t = s.db_table(name)
                    if t is not None and t.cache is not None:
                        device = t.cache.device
                        t.cache.update_if_present(
                            torch.from_numpy(keys).to(device), torch.from_numpy(rows).to(device)
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
                :class:`~hps.updates.file_log.LogReplacedError`: another log replaced it; an
                :class:`~hps.updates.file_log.OffsetPastEndError`: past its end); the message
                names the log, both log ids, where the offset is stored and how to reset it.
                Nothing is applied.
            FormatVersionError: the update log is of another format version.
            ValueError: the stored offset does not fit the source (the message names where it
                is stored).
        """
        with self._lock:
            if self._bad_offset is not None:
                raise ValueError(self._bad_offset)
            try:
                log_id, recs = self.source.read_log(self.offset, self.log_id, max_records)
            except StaleOffsetError as e:
                raise e.with_hint(self._where()) from None
            for off, batch in recs:
                try:
                    self.apply(batch, off, log_id)
                except InvalidUpdateError as e:
                    self.health.refused(off, log_id)
                    raise InvalidUpdateError(
                        f"{e} (the record ending at offset {off}: it stays unapplied, with the "
                        "records after it, and is retried with backoff. To skip it: "
                        f"UpdateApplier.skip({off!r}, {log_id!r}) in the server's process, or "
                        f"python -m hps.updates skip --config <ps.json> --offset {off}"
                        + ("" if log_id is None else f" --log-id {log_id}")
                        + ". Where the offset is not kept across restarts (a server that "
                        "rebuilds its volatile db at start replays the source from its "
                        "beginning), a restart meets the record again: remove it from the "
                        "source, or replace the source)"
                    ) from None
            return len(recs)

    def skip(self, offset: str, log_id: str | None = None) -> None:
        """Skip the record refused now, named by the offset that ends it (and its log's id):
        it is recorded as applied without its rows, and the records after it apply at the
        next poll. An operator's explicit decision, logged as a warning.

        Raises:
            ValueError: no record is refused now, or ``offset``/``log_id`` name another one
                (the message names the refused record, if any).
        """
        with self._lock:
            refused = self.health.refused_record()
            if refused != (offset, log_id):
                now = (
                    "no record is refused now"
                    if refused is None
                    else f"the refused record ends at offset {refused[0]!r} (log id {refused[1]!r})"
                )
                raise ValueError(
                    f"cannot skip the update record ending at offset {offset!r} (log id "
                    f"{log_id!r}): {now}; only the refused record can be skipped"
                )
            self._store(offset, log_id)
            self.health.skipped()
        log.warning(
            "online updates: skipped the refused record ending at offset %s (log id %s) at an "
            "operator's request; its rows are not applied",
            offset,
            log_id,
        )

    def drain(self, max_records: int = 64) -> int:
        """:meth:`poll` until the source is empty (a backlog, e.g. a replay, at once); returns how many."""
        total = n = self.poll(max_records)
        while n == max_records:
            n = self.poll(max_records)
            total += n
        return total

    def attempt(self, first: bool = False) -> int:
        """One :meth:`drain`, its outcome recorded in :attr:`health`: a failure is logged once
        (with the attempt's number and the wait before the next) and not raised, so serving
        goes on; returns the records applied.

        Args:
            first: the attempt before serving starts: only a record that is refused or
                corrupt and a volatile DB that is down are logged and left to the poller;
                anything else (an update log of another format version, a stored offset that
                does not fit, a source that cannot be reached) is raised, so the start fails
                naming it.
        """
        retried: tuple[type[Exception], ...] = (
            CorruptRecordError,
            InvalidUpdateError,
            VolatileUnavailableError,
        )
        before = self.applied
        try:
            n = self.drain()
        except retried as e:  # no traceback needed
            self._failed(e, self.applied - before, traceback=False)
            return self.applied - before
        except FormatVersionError as e:
            if first:
                raise
            self._failed(e, self.applied - before, traceback=False)
            return self.applied - before
        except Exception as e:  # keep serving; the batch stays unapplied and is retried
            if first:
                raise
            self._failed(e, self.applied - before, traceback=True)
            return self.applied - before
        if self.health.succeeded(n):
            log.info("online updates: applying again (%d record(s) now)", n)
        return n

    def _failed(self, e: Exception, applied: int, traceback: bool) -> None:
        delay = self.health.failed(e, applied)
        p = self.health.policy
        log.error(
            "applying online updates failed (attempt %d in a row; next in %.3g s; the server "
            "is not ready after %d failures or %g s): %s",
            self.health.failures,
            delay,
            p.unready_after_failures,
            p.unready_after_s,
            e,
            exc_info=traceback,
        )

    def take_skip_request(self) -> bool:
        """Act on a skip request file (:attr:`skip_request`, left by ``python -m hps.updates
        skip``), then remove it: skip the refused record it names (:meth:`skip`), or log why
        not. Returns whether a record was skipped."""
        req = self.skip_request
        if req is None or not req.path.exists():
            return False
        try:
            offset, log_id = req.load_position()
            if offset is None:
                raise ValueError(f"the skip request {req.path} is empty")
            self.skip(offset, log_id)
            return True
        except ValueError as e:
            log.error("online updates: skip request %s not followed: %s", req.path, e)
            return False
        finally:
            req.clear()

    def start(self, interval_s: float) -> threading.Event:
        """Poll every ``interval_s`` in a daemon thread (:meth:`attempt`; after failures, as
        :attr:`health`'s backoff says); set the returned event to stop."""
        stop = threading.Event()
        threading.Thread(
            target=self._drain_until, args=(stop, interval_s), name="hps-updates", daemon=True
        ).start()
        return stop

    def _drain_until(self, stop: threading.Event, interval_s: float) -> None:
        """Until ``stop`` is set, every ``interval_s``: follow a skip request, then
        :meth:`attempt` if the backoff after the last failure has passed."""
        while not stop.wait(interval_s):
            self.take_skip_request()
            if self.health.due():
                self.attempt()
