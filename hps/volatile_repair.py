"""Writing back, while serving, the partitions of a Redis volatile DB that lost their rows.

A Redis node that restarts empty (no Redis persistence) comes back owning its hash slots but
none of the partitions there; a read of them fails, since they hold no ``hps:loaded`` mark
(:mod:`hps.storage.redis_cluster`), so their keys fall through to the persistent DB or are
refused (503) — never answered with the default vector. :class:`VolatileRepair` looks for
unmarked partitions after the backend reported trouble (an error, or a read that met an
unmarked partition) and writes each one again from the source that holds its current rows:

    persistent DB holds every row of the table   → its rows (online updates included),
                                                   keys from the sparse files
    no such persistent DB, no update source      → the sparse files (the rows never change)
    no such persistent DB, an update source      → none: the online updates since the load
                                                   are only in the lost partition; its keys
                                                   stay refused until a restart, which
                                                   reloads and replays the source

Only the first ``initial_cache_rate`` of each table's rows are written, as at load; the
partition's mark goes last, so its keys are read from Redis again only once all its rows
are back. Each chunk is read and written under the reader side of every session's update
lock, so an online update lands before or after a chunk, never between its read and write.

Rows move as their stored bytes (:meth:`~hps.types.StorageBackend.lookup_rows`,
:meth:`~hps.types.StorageBackend.insert_rows`; a quantized table's sparse files are read with
:func:`~hps.storage.sparse_files.read_table_rows`), never through float32: a repaired
partition holds the bytes it held before, bit for bit, whatever the table's row format (a
dequantize / quantize round trip could move an INT8 row's scale, bias or values)::

    RocksDB  key 7 → 3c 1f 00 b8 0a … (int8 row)  ──lookup_rows / insert_rows──▶  Redis, same bytes
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from hps.config import TableSpec
from hps.rowformat import RowDtype
from hps.session import LookupSession
from hps.storage.redis_cluster import RedisClusterBackend
from hps.storage.row_codec import RowCodec
from hps.storage.sparse_files import has_table_rows, read_table, read_table_rows
from hps.storage.volatile import partition_of
from hps.types import StorageBackend, VolatileUnavailableError

log = logging.getLogger(__name__)

_CHUNK = 65536  # rows read and written per hold of the update locks


class VolatileRepair:
    """Restores unmarked partitions of a Redis volatile DB (see the module docstring).

    Args:
        volatile: the Redis volatile DB.
        persistent: the persistent DB or ``None``.
        tables: every table served (one entry per name).
        sessions: the sessions whose update locks order a repair against online updates.
        initial_cache_rate: the fraction of each table's rows the volatile DB holds.
        has_updates: an update source is configured (its updates may live only in Redis).
    """

    def __init__(
        self,
        volatile: RedisClusterBackend,
        persistent: StorageBackend | None,
        tables: Sequence[TableSpec],
        sessions: Sequence[LookupSession],
        initial_cache_rate: float = 1.0,
        has_updates: bool = False,
    ) -> None:
        self.volatile, self.persistent = volatile, persistent
        self.tables = list(tables)
        self.sessions = list(sessions)
        self.initial_cache_rate = initial_cache_rate
        self.has_updates = has_updates
        self.restored = 0  # partitions written back so far
        self._checked = 0  # the backend's trouble count when every table was last checked
        self._refused: set[tuple[str, int]] = set()  # partitions reported as not restorable

    def _trouble(self) -> int:
        return self.volatile.errors + self.volatile.unmarked_reads

    def repair_once(self) -> int:
        """Check every table for unmarked partitions if the backend reported trouble since
        the last complete check, and write them back; returns the partitions restored.

        Raises:
            VolatileUnavailableError: the cluster is still down (retry later).
        """
        trouble = self._trouble()
        if trouble == self._checked:
            return 0
        restored = 0
        for t in self.tables:
            lost = self.volatile.unmarked_partitions(t.name)
            if lost:
                restored += self._restore(t, lost)
        self._checked = trouble
        return restored

    def _restore(self, t: TableSpec, lost: list[int]) -> int:
        """Write back partitions ``lost`` of ``t``; 0 when no source holds their rows."""
        from_pdb = self.persistent is not None and self.persistent.holds_every_row(t.name)
        if not from_pdb and self.has_updates:
            new = sorted({(t.name, p) for p in lost} - self._refused)
            if new:
                self._refused.update(new)
                log.error(
                    "table %s: redis partitions %s lost their rows and cannot be written back "
                    "while serving (no persistent db holds the rows with their online updates); "
                    "lookups of their keys are refused until the server is restarted (it "
                    "reloads the volatile db and replays the update source)",
                    t.name,
                    [p for _, p in new],
                )
            return 0
        keys, rows, codec = self._sparse_rows(t)
        m = int(round(self.initial_cache_rate * keys.shape[0]))
        sel = np.flatnonzero(
            np.isin(partition_of(np.asarray(keys[:m]), self.volatile.num_partitions), lost)
        )
        for s in range(0, sel.size, _CHUNK):
            idx = sel[s : s + _CHUNK]
            k = np.ascontiguousarray(keys[idx], dtype=np.int64)
            self._write_chunk(t, k, np.ascontiguousarray(rows[idx]), codec, from_pdb)
        self.volatile.mark_loaded(t.name, lost)
        for sess in self.sessions:  # written under the reader side: no generation moved
            sess.forget_absent_keys()
        self._refused.difference_update((t.name, p) for p in lost)
        self.restored += len(lost)
        log.info(
            "table %s: wrote back %d rows of redis partitions %s from the %s",
            t.name,
            sel.size,
            lost,
            "persistent db" if from_pdb else "sparse files",
        )
        return len(lost)

    @staticmethod
    def _sparse_rows(t: TableSpec) -> tuple[np.ndarray, np.ndarray, RowCodec | None]:
        """``t``'s sparse files: ``(keys (n,) int64, rows, codec)``. A row-format folder's
        ``rows (n, row_bytes) uint8`` are the stored bytes (``codec`` ``None``); float32 rows
        ``(n, dim)`` (memory-mapped) are encoded chunk by chunk with ``codec``, as the load
        encodes them, so the bytes written are the ones written at load."""
        if t.row_format is not RowDtype.FP32 and has_table_rows(t.sparse_file):
            keys, rows = read_table_rows(t.sparse_file, t.row_format, t.dim, t.name)
            return keys, rows, None
        keys, vecs = read_table(t.sparse_file, t.dim)
        return keys, vecs, RowCodec(t.dim, t.row_format, f"table {t.name!r}")

    def _write_chunk(
        self,
        t: TableSpec,
        keys: np.ndarray,
        rows: np.ndarray,
        codec: RowCodec | None,
        from_pdb: bool,
    ) -> None:
        """Write ``keys``' stored rows under the reader side of every session's update lock:
        the persistent DB's bytes where ``from_pdb`` and it holds them, else ``rows`` from the
        sparse files (stored bytes, or float32 encoded with ``codec``)."""
        locks = [s.update_lock for s in self.sessions]
        for lk in locks:
            lk.acquire_read()
        try:
            if from_pdb and self.persistent is not None:
                stored, found = self.persistent.lookup_rows(t.name, keys)
                miss = np.flatnonzero(~found)
                if miss.size:  # not expected of a DB holding every row; the files' row then
                    stored = stored.copy()
                    stored[miss] = rows[miss] if codec is None else codec.encode(rows[miss])
            else:
                stored = rows if codec is None else codec.encode(rows)
            self.volatile.insert_rows(t.name, keys, stored)
        finally:
            for lk in reversed(locks):
                lk.release_read()

    def start(self, interval_s: float) -> threading.Event:
        """Every ``interval_s``, :meth:`repair_once` in a daemon thread; set the returned
        event to stop. A failure is logged and retried."""
        stop = threading.Event()
        threading.Thread(
            target=self._loop, args=(stop, interval_s), name="hps-volatile-repair", daemon=True
        ).start()
        return stop

    def _loop(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            try:
                self.repair_once()
            except VolatileUnavailableError as e:
                log.debug("volatile repair: cluster still unavailable (%s); will retry", e)
            except Exception:  # keep serving; the partitions stay refused and are retried
                log.exception("volatile repair failed; will retry")
