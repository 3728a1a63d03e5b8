"""The Redis-cluster volatile database: rows spread over many ``redis-server`` processes.

Layout (tilerec's own): each table is split into ``num_partitions`` partitions by
``mix64(key) % num_partitions``; partition ``p`` of table ``t`` is one Redis hash named
``hps_et.t.p<p>`` whose fields are the 8-byte little-endian keys and whose values are the
rows' bytes in the table's row format (:mod:`hps.storage.row_codec`; float32 for FP32). ``t`` is the table's database name (:meth:`hps.config.PSConfig.db_table`):
its name (``hps_et.t0.p3``), or, where two models name a table alike with other rows, the
model and the name (``hps_et.foo.t0.p3`` and ``hps_et.bar.t0.p3``). The cluster places each hash on a node by CRC16 of its name, so one
table's partitions spread over all nodes. A lookup is one pipelined ``HMGET`` per touched
partition (chunks of ``max_batch_size`` fields), sent node by node by the cluster pipeline.

HugeCTR's layout differs (one hash ``hps_et{hps_et.<model>.<table>/p<part>}v`` per partition,
keys spread by its ``rrxmrrxmsx_0`` hash, no load mark), so a cluster HugeCTR filled is not
read: the tables are loaded again from their sparse files, the same files HugeCTR loaded
(``docs/migrating-from-hugectr.md``).

Each partition also holds the field ``hps:loaded`` (not 8 bytes long, so no key's field),
written by :meth:`RedisClusterBackend.mark_loaded` once every row meant for the partition is
in, and fetched first by every ``HMGET``. A partition without it has lost its rows (its node
restarted empty, or it was deleted) or was never completely loaded: a read of its keys
*fails*, it never answers "not found" (:class:`~hps.types.TierRead`).

Failures: any Redis error marks the backend *down* for ``retry_interval_s``; while down,
reads fail at once for every key (the session falls through to a persistent DB that holds
every row, or refuses the lookup with :class:`~hps.types.TierUnavailableError`; it never
answers such a key with the default vector) and writes are queued (bounded by
``max_pending_rows``) and replayed when the cluster answers again. A write that the full queue cannot take raises :class:`VolatileUnavailableError` instead
of being dropped: the Redis hashes still hold the old rows of its keys and are read before the
persistent DB, so a dropped online update would be undone silently once the cluster is back.
The update applier lets the error fail the batch (its offset is not advanced; the batch is
applied again, rows being absolute values, when the cluster answers); loading and the session's
``cache_missed_embeddings`` fills catch it (their rows are copies of the persistent DB's).
Every error is counted in :attr:`RedisClusterBackend.errors` and logged; partitions found
without their mark are counted in :attr:`RedisClusterBackend.unmarked_reads`, and
:meth:`RedisClusterBackend.unmarked_partitions` lists them for a repair
(:mod:`hps.volatile_repair`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from hps.rowformat import RowDtype
from hps.storage.persistent import decode_rows, encode_keys, encode_rows
from hps.storage.row_codec import RowCodec
from hps.storage.volatile import split_by_partition
from hps.types import (
    StorageBackend,
    TierRead,
    TierUnavailableError,
    VolatileUnavailableError,
    check_keys,
    check_values,
)

log = logging.getLogger(__name__)

_DEFAULT_MAX_PENDING_ROWS = 1_000_000  # rows of writes kept for replay while the cluster is down


#: the field of a partition's hash that says every row meant for it was written (not 8 bytes
#: long: never a key's field)
LOADED_FIELD = b"hps:loaded"


def partition_name(table: str, p: int) -> str:
    """Redis key of partition ``p`` of ``table`` (a database name: ``t0`` or ``foo.t0``)."""
    return f"hps_et.{table}.p{p}"


class _Queued(NamedTuple):
    """A write kept for replay while the cluster is down: rows (``values`` set), or the mark
    of ``partitions`` (``values`` is ``None``, ``keys`` holds the partition ids)."""

    table: str
    keys: np.ndarray
    values: np.ndarray | None

    @property
    def rows(self) -> int:
        return 0 if self.values is None else int(self.keys.size)


class RedisClusterBackend(StorageBackend):
    """Volatile tier on a Redis cluster.

    Args:
        addresses: ``[(host, port), ...]`` startup nodes.
        num_partitions: partitions per table.
        max_batch_size: fields per ``HMGET``/``HSET`` command.
        retry_interval_s: how long the backend stays *down* after an error before it retries.
        socket_timeout_s: connect and read timeout per node.
        max_pending_rows: rows of writes queued while down; a write beyond them raises
            :class:`VolatileUnavailableError` (nothing of it is written or queued).
        start_down: when no node answers at construction, start *down* (lookups fall through,
            writes queue, the connection is retried after ``retry_interval_s``) instead of
            raising; for a server with a persistent DB that holds every row.

    Raises:
        ValueError: no address, or (``start_down=False``) no node of the cluster answers,
            naming the addresses.
    """

    name = "redis_cluster"

    def __init__(
        self,
        addresses: list[tuple[str, int]],
        num_partitions: int = 8,
        max_batch_size: int = 65536,
        retry_interval_s: float = 1.0,
        socket_timeout_s: float = 1.0,
        max_pending_rows: int = _DEFAULT_MAX_PENDING_ROWS,
        start_down: bool = False,
    ) -> None:
        if not addresses:
            raise ValueError("redis_cluster needs at least one 'host:port' address")
        self.addresses = list(addresses)
        self.num_partitions = num_partitions
        self.max_batch_size = max_batch_size
        self.retry_interval_s = retry_interval_s
        self.socket_timeout_s = socket_timeout_s
        self.max_pending_rows = max_pending_rows
        self._codecs: dict[str, RowCodec] = {}
        self._lock = threading.Lock()
        self._client: Any = None  # a redis.cluster.RedisCluster once a node answered
        self._down_until = 0.0
        self._pending: list[_Queued] = []
        self._pending_rows = 0
        self.errors = 0  # Redis errors seen (connection refused, timeouts, cluster down)
        self.skipped_lookups = 0  # reads failed at once because the backend was down
        self.unmarked_reads = 0  # reads that met a partition without its mark (rows lost)
        self._unmarked_logged: set[str] = set()  # unmarked partitions already logged
        self.dropped_rows = 0  # queued writes dropped because the queue was full
        self._replaying = False  # a replay of queued writes is running (the tier stays down)
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001 - redis raises many types; all mean "unreachable"
            if not start_down:
                raise ValueError(
                    f"redis cluster at {self._address_list} cannot "
                    f"be reached ({type(e).__name__}: {e})"
                ) from e
            self._client = None
            self._fail("connect", e)

    # ------------------------------------------------------------------ connection state
    def _connect(self) -> None:
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        nodes = [ClusterNode(h, p) for h, p in self.addresses]
        client = RedisCluster(
            startup_nodes=nodes,
            require_full_coverage=False,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.socket_timeout_s,
        )
        old, self._client = self._client, client
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - the old connections may already be gone
                pass

    @property
    def _address_list(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.addresses)

    def _connected(self) -> Any:
        """The client, or :class:`VolatileUnavailableError` when no node answered yet."""
        if self._client is None:
            raise VolatileUnavailableError(
                f"redis cluster at {self._address_list} has not answered since the start"
            )
        return self._client

    def _fail(self, what: str, err: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + self.retry_interval_s
        log.warning(
            "redis cluster %s failed (%s: %s); treating it as down for %.1f s",
            what,
            type(err).__name__,
            err,
            self.retry_interval_s,
        )

    @property
    def available(self) -> bool:
        """False while the backend is in its post-error back-off window."""
        return time.monotonic() >= self._down_until

    def _ensure_up(self) -> bool:
        """Reconnect and replay queued writes after a back-off; False while still down.

        The tier stays down until the replay has finished: a lookup meanwhile must not read a
        row whose queued update has not reached Redis yet (it would fill the embedding cache
        with the old row, for good). Writes that arrive during the replay are queued behind it
        and replayed by it, in order.
        """
        if not self.available:
            return False
        with self._lock:
            if self._replaying:
                return False
            if not self._pending and self._client is not None:
                return True
            self._replaying = True
        try:
            if self._client is None or self._pending:
                self._connect()
            replayed = 0
            while True:
                with self._lock:
                    batch, self._pending, self._pending_rows = self._pending, [], 0
                    if not batch:
                        self._replaying = False
                        break
                done = 0
                try:
                    for item in batch:
                        if item.values is None:
                            self._write_marks(item.table, item.keys.tolist())
                        else:
                            self._write(item.table, item.keys, item.values)
                        done += 1
                    replayed += done
                except BaseException:
                    with self._lock:  # not yet written: back to the front of the queue
                        rest = batch[done:]
                        self._pending = rest + self._pending
                        self._pending_rows += sum(q.rows for q in rest)
                    raise
        except Exception as e:  # noqa: BLE001 - any client error means "still down"
            with self._lock:
                self._replaying = False
            self._fail("replay" if self._client is not None else "connect", e)
            return False
        except BaseException:
            with self._lock:
                self._replaying = False
            raise
        if replayed:
            log.info("redis cluster is back; replayed %d queued write batches", replayed)
        return True

    # ------------------------------------------------------------------ interface
    def create_table(self, table: str, dim: int, row_format: RowDtype = RowDtype.FP32) -> None:
        """Declare ``table`` with rows of ``dim`` values stored as ``row_format`` (the values
        of its hashes are those bytes)."""
        codec = RowCodec(dim, RowDtype(row_format), f"redis table {table!r}")
        had = self._codecs.get(table, codec)
        if (had.dim, had.dtype) != (codec.dim, codec.dtype):
            raise ValueError(
                f"redis table {table!r} exists with dim {had.dim}, not {dim} "
                f"({had.dtype.value} rows, not {codec.dtype.value})"
            )
        self._codecs[table] = codec

    def _codec(self, table: str) -> RowCodec:
        try:
            return self._codecs[table]
        except KeyError:
            raise ValueError(
                f"redis volatile db has no table {table!r}; tables: {sorted(self._codecs)}"
            ) from None

    def _dim(self, table: str) -> int:
        return self._codec(table).dim

    def row_format(self, table: str) -> RowDtype:
        """How ``table``'s rows are stored."""
        return self._codec(table).dtype

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` (see :meth:`read`).

        Raises:
            TierUnavailableError: some keys could not be read (the cluster or a node is down,
                or a partition lost its rows): "not found" would be a guess.
        """
        rows, found = self.lookup_rows(table, keys)
        return self._codec(table).decode(rows), found

    def lookup_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lookup` of the stored bytes, ``(rows (n, row_bytes) uint8, found)``."""
        r = self.read_rows(table, keys)
        if r.failed.any():
            raise TierUnavailableError(
                table, f"volatile db ({self.name})", int(r.failed.sum()), r.reason
            )
        return r.values, r.found

    def read(self, table: str, keys: np.ndarray) -> TierRead:
        """:meth:`read_rows`, dequantized (``values (n, dim) float32``)."""
        r = self.read_rows(table, keys)
        return TierRead(self._codec(table).decode(r.values), r.found, r.failed, r.reason)

    def read_rows(self, table: str, keys: np.ndarray) -> TierRead:
        """One pipelined ``HMGET`` per touched partition (its mark first, then the keys);
        ``values`` are the stored bytes, ``(n, row_bytes) uint8``.

        A key fails (``failed``) when the backend is down, when its command failed, or when its
        partition has no mark (:data:`LOADED_FIELD`): lost rows are not "not found".
        """
        keys = check_keys(keys)
        codec = self._codec(table)
        out = np.zeros((keys.size, codec.row_bytes), np.uint8)
        found = np.zeros(keys.size, bool)
        if keys.size == 0:
            return TierRead(out, found, np.zeros(0, bool))
        if not self._ensure_up():
            self.skipped_lookups += 1
            why = "replaying the writes queued during an outage" if self._replaying else "down"
            return TierRead(out, found, np.ones(keys.size, bool), f"redis cluster {why}")
        try:
            pipe = self._client.pipeline()
            plan = []
            for p, idx in split_by_partition(keys, self.num_partitions):
                name = partition_name(table, p)
                for s in range(0, idx.size, self.max_batch_size):
                    chunk = idx[s : s + self.max_batch_size]
                    pipe.hmget(name, [LOADED_FIELD, *encode_keys(keys[chunk])])
                    plan.append((p, chunk))
            results = pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - redis raises many types; all mean "tier failed"
            self._fail("lookup", e)
            return TierRead(out, found, np.ones(keys.size, bool), f"{type(e).__name__}: {e}")
        return self._decode(table, codec, keys, plan, results, out, found)

    def _decode(
        self,
        table: str,
        codec: RowCodec,
        keys: np.ndarray,
        plan: list[tuple[int, np.ndarray]],
        results: list[Any],
        out: np.ndarray,
        found: np.ndarray,
    ) -> TierRead:
        """The :class:`TierRead` of a pipelined read: ``plan[i] = (partition, positions)`` of
        the ``i``-th ``HMGET``, whose reply ``results[i]`` is an exception or the mark + rows."""
        failed = np.zeros(keys.size, bool)
        error: BaseException | None = None
        unmarked: list[int] = []
        for (p, chunk), res in zip(plan, results):
            if isinstance(res, Exception):
                error = res
                failed[chunk] = True
            elif res[0] is None:
                unmarked.append(p)
                failed[chunk] = True
            else:
                v, f = decode_rows(res[1:], codec, f"redis table {table!r}", keys[chunk])
                out[chunk], found[chunk] = v, f
        reasons = []
        if error is not None:
            self._fail("lookup (some partitions)", error)
            reasons.append(f"{type(error).__name__}: {error}")
        if unmarked:
            names = sorted({partition_name(table, p) for p in unmarked})
            with self._lock:
                self.unmarked_reads += 1
                new = [n for n in names if n not in self._unmarked_logged]
                self._unmarked_logged.update(new)
            if new:  # once per partition until it is marked again
                log.warning("redis partitions %s hold no %r mark: rows lost", new, LOADED_FIELD)
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            reasons.append(
                f"partition(s) {shown} hold no {LOADED_FIELD.decode()!r} mark: their node "
                "restarted empty or they were never completely loaded"
            )
        return TierRead(out, found, failed, "; ".join(reasons))

    def _write(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """Write stored bytes ``rows (n, row_bytes) uint8`` (raises what Redis raised)."""
        pipe = self._client.pipeline()
        for p, idx in split_by_partition(keys, self.num_partitions):
            name = partition_name(table, p)
            for s in range(0, idx.size, self.max_batch_size):
                chunk = idx[s : s + self.max_batch_size]
                vb = encode_rows(rows[chunk])
                pipe.hset(name, mapping=dict(zip(encode_keys(keys[chunk]), vb)))
        results = pipe.execute(raise_on_error=False)
        errs = [r for r in results if isinstance(r, Exception)]
        if errs:
            raise errs[0]

    def _write_marks(self, table: str, partitions: list[int]) -> None:
        pipe = self._client.pipeline()
        for p in partitions:
            pipe.hset(partition_name(table, p), LOADED_FIELD, b"1")
        errs = [r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
        if errs:
            raise errs[0]
        with self._lock:
            self._unmarked_logged.difference_update(partition_name(table, p) for p in partitions)

    def mark_loaded(self, table: str, partitions: list[int] | None = None) -> None:
        """Mark ``table``'s partitions (default: all) as holding every row meant for them;
        call it once they were written. While the cluster is down the mark is queued behind
        the rows and replayed after them (it holds no row: a full queue still takes it)."""
        self._dim(table)
        parts = list(range(self.num_partitions)) if partitions is None else list(partitions)
        if self._ensure_up():
            try:
                self._write_marks(table, parts)
                return
            except Exception as e:  # noqa: BLE001 - queue below, counted in _fail
                self._fail("mark", e)
        self._enqueue(_Queued(table, np.asarray(parts, np.int64), None))

    def unmarked_partitions(self, table: str) -> list[int]:
        """The partitions of ``table`` without their mark (rows lost, or never loaded).

        Raises:
            VolatileUnavailableError: the cluster is down or a node does not answer.
        """
        self._dim(table)
        if not self._ensure_up():
            raise VolatileUnavailableError(f"redis cluster at {self._address_list} is down")
        try:
            pipe = self._client.pipeline()
            for p in range(self.num_partitions):
                pipe.hexists(partition_name(table, p), LOADED_FIELD)
            res = pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - any client error means "cannot tell"
            self._fail("mark check", e)
            raise VolatileUnavailableError(f"redis cluster: cannot check marks ({e})") from e
        bad = [r for r in res if isinstance(r, Exception)]
        if bad:
            self._fail("mark check", bad[0])
            raise VolatileUnavailableError(f"redis cluster: cannot check marks ({bad[0]})")
        return [p for p, ok in enumerate(res) if not ok]

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        """Write rows; while the cluster is down they are queued and replayed later.

        Raises:
            VolatileUnavailableError: the cluster is down and the queue is full (``dropped_rows``
                counts the rows refused).
        """
        keys = check_keys(keys)
        codec = self._codec(table)
        values = check_values(values, keys.size, codec.dim)
        self.insert_rows(table, keys, codec.encode(values))

    def insert_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """:meth:`insert` of stored bytes, ``rows (n, row_bytes) uint8``, written as they are."""
        keys = check_keys(keys)
        rows = self._codec(table).check_stored(rows, keys.size, f"redis table {table!r}")
        if keys.size == 0:
            return
        if self._ensure_up():
            try:
                self._write(table, keys, rows)
                return
            except Exception as e:  # noqa: BLE001 - queue below, counted in _fail
                self._fail("insert", e)
        self._enqueue(_Queued(table, keys.copy(), rows.copy()))

    def _enqueue(self, item: _Queued) -> None:
        """Keep ``item`` for the replay, or raise :class:`VolatileUnavailableError` when its
        rows do not fit the queue (``dropped_rows`` counts them)."""
        with self._lock:
            if self._pending_rows + item.rows > self.max_pending_rows:
                self.dropped_rows += item.rows
                raise VolatileUnavailableError(
                    f"redis cluster down and {self._pending_rows} rows already queued "
                    f"(max_pending_rows {self.max_pending_rows}): {item.rows} rows of "
                    f"{item.table!r} neither written nor queued"
                )
            self._pending.append(item)
            self._pending_rows += item.rows

    def size(self, table: str) -> int:
        """Rows of ``table`` in the cluster (the marks are not rows).

        Raises:
            VolatileUnavailableError: no node has answered since the start.
        """
        self._dim(table)
        pipe = self._connected().pipeline()
        for p in range(self.num_partitions):
            pipe.hlen(partition_name(table, p))
            pipe.hexists(partition_name(table, p), LOADED_FIELD)
        res = pipe.execute()
        return int(sum(res[0::2])) - int(sum(res[1::2]))

    def held(self, table: str, dim: int) -> tuple[int, int]:
        """``(rows, bytes)`` of ``table`` in the cluster: :meth:`size` rows of its row
        format's bytes (the values; Redis's own per-entry overhead is not counted).

        Raises:
            ValueError: ``dim`` is not the table's.
            VolatileUnavailableError: no node has answered since the start.
        """
        codec = self._codec(table)
        if dim != codec.dim:
            raise ValueError(f"redis cluster table {table!r} has dim {codec.dim}, not {dim}")
        rows = self.size(table)
        return rows, rows * codec.row_bytes

    def clear(self, table: str) -> None:
        """Delete every partition of ``table``.

        Raises:
            VolatileUnavailableError: no node has answered since the start.
        """
        pipe = self._connected().pipeline()
        for p in range(self.num_partitions):
            pipe.delete(partition_name(table, p))
        pipe.execute()

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
