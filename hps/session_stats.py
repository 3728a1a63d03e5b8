"""Per-table lookup statistics of a :class:`~hps.session.LookupSession` (``session.stats()``,
and the ``hps`` part of the server's ``/v2/models/stats``), their recording, and the bytes each
tier holds for a table (:func:`held_bytes`, ``stats[table]["bytes"]``).

Bytes, not rows: a table's rows cost their row format's bytes in every tier
(:func:`hps.rowformat.row_bytes`). Worked example, an INT8 table of dim 128 (132-byte rows)
with a 64-slot cache holding 10 rows and a hash map holding 1,000::

    tier        rows    row_bytes = rows × 132    bytes (what the tier reports holding)
    cache         10        1,320                 64 × (132 + 6.125) = 8,840  (EmbeddingCache.nbytes)
    volatile   1,000      132,000                 HashMapBackend.nbytes(table): slots, keys, index
    persistent 1,000      132,000                 132,000  (RocksDB / Redis: the values only)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hps.rowformat import RowDtype, row_bytes
from hps.storage.cache import EmbeddingCache
from hps.types import StorageBackend, Tier

log = logging.getLogger(__name__)

LATENCY_WINDOW = 4096  # most recent lookups kept for p50/p99
_TIER_NAMES = tuple(t.value for t in Tier)  # in Tier order (an enum's members are slow to walk)
_CACHE = Tier.CACHE.value


@dataclass
class TableStats:
    """Per-table lookup statistics. ``unique`` counts each distinct key of a lookup once,
    ``all`` counts every occurrence."""

    lookups: int = 0
    keys_all: int = 0
    keys_unique: int = 0
    hits_unique: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in Tier})
    hits_all: dict[str, int] = field(default_factory=lambda: {t.value: 0 for t in Tier})
    async_batches: int = 0  # lookups served in asynchronous-insertion mode
    dropped_async: int = 0  # background jobs dropped because the queue was full
    stale_dropped: int = 0  # background insertions dropped: an update landed after their read
    errors: int = 0  # lookups that raised (any error, the refusals below included)
    #: distinct keys a tier could not answer for (its node down, its rows lost), whether a
    #: tier below then served them or not
    tier_failed_keys: int = 0
    #: lookups refused with TierUnavailableError: a key could be read from no tier
    unavailable: int = 0
    latencies_s: np.ndarray = field(default_factory=lambda: np.full(LATENCY_WINDOW, np.nan))

    def add_lookup(self, uniq_counts: list[int], all_counts: list[int], is_async: bool) -> None:
        """Count one lookup: its keys per tier in :class:`Tier` order (cache, volatile,
        persistent, default), distinct (``uniq_counts``) and every occurrence (``all_counts``)."""
        self.lookups += 1
        self.keys_unique += sum(uniq_counts)
        self.keys_all += sum(all_counts)
        self.async_batches += int(is_async)
        for tier, u, a in zip(_TIER_NAMES, uniq_counts, all_counts, strict=True):
            self.hits_unique[tier] += u
            self.hits_all[tier] += a

    def add_cache_hits(self, uniq: int, all_: int, is_async: bool) -> None:
        """:meth:`add_lookup` of a lookup whose keys were all cache hits: ``uniq`` distinct,
        ``all_`` every occurrence (a fused call's tables without a miss, without building the
        per-tier lists)."""
        self.lookups += 1
        self.keys_unique += uniq
        self.keys_all += all_
        self.async_batches += int(is_async)
        self.hits_unique[_CACHE] += uniq
        self.hits_all[_CACHE] += all_

    def to_dict(self) -> dict[str, object]:
        lat = self.latencies_s[~np.isnan(self.latencies_s)]
        p50, p99 = np.percentile(lat, [50, 99]) if lat.size else (float("nan"),) * 2
        rate = {
            "unique": {
                k: v / self.keys_unique if self.keys_unique else 0.0
                for k, v in self.hits_unique.items()
            },
            "all": {
                k: v / self.keys_all if self.keys_all else 0.0 for k, v in self.hits_all.items()
            },
        }
        return {
            "lookups": self.lookups,
            "keys_all": self.keys_all,
            "keys_unique": self.keys_unique,
            "hit_rate": rate,
            "hits_unique": dict(self.hits_unique),
            "hits_all": dict(self.hits_all),
            "async_batches": self.async_batches,
            "dropped_async": self.dropped_async,
            "stale_dropped": self.stale_dropped,
            "errors": self.errors,
            "tier_failed_keys": self.tier_failed_keys,
            "unavailable": self.unavailable,
            # None before the first lookup (NaN is not JSON)
            "latency_p50_ms": float(p50) * 1e3 if lat.size else None,
            "latency_p99_ms": float(p99) * 1e3 if lat.size else None,
        }


class SessionStats:
    """The :class:`TableStats` of each table of one session, behind one lock (lookups,
    background jobs and readers of ``session.stats()`` run on many threads).

    Args:
        tables: the session's table names (as :meth:`~hps.session.LookupSession.lookup` takes them).
    """

    def __init__(self, tables: Sequence[str]) -> None:
        self._stats = {name: TableStats() for name in tables}
        self._lock = threading.Lock()
        self._lat_pos = {name: 0 for name in tables}
        self._fused: dict[tuple[str, ...], _FusedCalls] = {}  # per list of tables, not yet read

    def to_dict(self, table: str | None = None) -> dict[str, object]:
        """Statistics of ``table`` (a known name), or ``{table: stats}`` for all."""
        with self._lock:
            self._fold_fused()
            if table is not None:
                return self._stats[table].to_dict()
            return {n: s.to_dict() for n, s in self._stats.items()}

    def record(self, table: str, tier: torch.Tensor, counts: torch.Tensor, is_async: bool) -> None:
        """One lookup of ``table``: ``tier (n,) int8`` where each distinct key was served
        (:class:`Tier` order), ``counts (n,) int64`` its occurrences."""
        t_np = tier.numpy().astype(np.int64)
        uniq_counts = np.bincount(t_np, minlength=4)
        all_counts = np.bincount(t_np, weights=counts.numpy(), minlength=4)
        self.record_counts(
            table, [int(x) for x in uniq_counts], [int(x) for x in all_counts], is_async
        )

    def record_counts(
        self, table: str, uniq_counts: list[int], all_counts: list[int], is_async: bool
    ) -> None:
        """One lookup of ``table``: keys per tier (cache, volatile, persistent, default),
        distinct and all occurrences."""
        with self._lock:
            self._stats[table].add_lookup(uniq_counts, all_counts, is_async)

    def record_counts_many(
        self,
        lookups: Sequence[tuple[str, list[int], list[int], bool]],
        cache_hits: Sequence[tuple[str, int, int, bool]] = (),
    ) -> None:
        """:meth:`record_counts` of several tables' lookups (``(table, uniq_counts, all_counts,
        is_async)`` each) and of those whose keys were all cache hits (``(table, uniq, all,
        is_async)`` each: the counts of :attr:`Tier.CACHE`) under one acquisition of the lock
        (a fused call's tables)."""
        with self._lock:
            for table, uniq_counts, all_counts, is_async in lookups:
                self._stats[table].add_lookup(uniq_counts, all_counts, is_async)
            for table, uniq, all_, is_async in cache_hits:
                self._stats[table].add_cache_hits(uniq, all_, is_async)

    def record_fused_hits(
        self, tables: tuple[str, ...], per_table: torch.Tensor, is_async: bool
    ) -> None:
        """One fused call over ``tables`` whose keys were all cache hits: ``per_table (T, 5)
        int64`` as the fused pass returns it (column 1 every hit, column 2 the distinct ones;
        held, not copied, until it is folded: the caller never writes it again). Kept with the
        call's list of tables and folded into each table's statistics when they are read
        (:class:`_FusedCalls`)."""
        with self._lock:
            self._fused_calls(tables).add_hits(per_table, is_async)

    def record_fused_latency(self, tables: tuple[str, ...], seconds: float) -> None:
        """:meth:`record_latency` of one fused call for each of ``tables``, folded into their
        windows when they are read (in call order, after any latency recorded earlier)."""
        with self._lock:
            self._fused_calls(tables).add_latency(seconds)

    def _fused_calls(self, tables: tuple[str, ...]) -> _FusedCalls:
        f = self._fused.get(tables)
        if f is None:
            f = self._fused[tables] = _FusedCalls(len(tables))
        return f

    def _fold_fused(self) -> None:
        """Every fused call's pending counts and latencies into its tables' statistics (the
        lock held)."""
        for names, f in self._fused.items():
            f.fold()
            if f.lookups:
                for i, name in enumerate(names):
                    st = self._stats[name]
                    uniq, all_ = int(f.hits[i, 2]), int(f.hits[i, 1])
                    st.lookups += f.lookups
                    st.keys_unique += uniq
                    st.keys_all += all_
                    st.async_batches += f.async_lookups
                    st.hits_unique[_CACHE] += uniq
                    st.hits_all[_CACHE] += all_
                f.hits[:] = 0
                f.lookups = f.async_lookups = 0
            if f.n_latencies:
                lat = f.pending_latencies()
                for name in names:
                    pos = self._lat_pos[name]
                    where = (pos + np.arange(lat.size)) % LATENCY_WINDOW
                    self._stats[name].latencies_s[where] = lat
                    self._lat_pos[name] = pos + lat.size
                f.n_latencies = 0

    def count_error(self, table: str, unavailable: bool) -> None:
        """A lookup of ``table`` raised (``unavailable``: a :class:`~hps.types.TierUnavailableError`)."""
        with self._lock:
            self._stats[table].errors += 1
            self._stats[table].unavailable += unavailable

    def record_latency(self, table: str, seconds: float) -> None:
        """A lookup of ``table`` took ``seconds`` (kept in a window of :data:`LATENCY_WINDOW`)."""
        with self._lock:
            pos = self._lat_pos[table]
            self._stats[table].latencies_s[pos % LATENCY_WINDOW] = seconds
            self._lat_pos[table] = pos + 1

    def tier_failed(self, table: str, keys: int) -> None:
        """``keys`` distinct keys of ``table`` a tier could not read."""
        with self._lock:
            self._stats[table].tier_failed_keys += keys

    def stale_dropped(self, table: str) -> None:
        """A background insertion into ``table``'s cache dropped: an update landed after its read."""
        with self._lock:
            self._stats[table].stale_dropped += 1

    def dropped_async(self, table: str) -> None:
        """A background job of ``table`` dropped: the queue was full."""
        with self._lock:
            self._stats[table].dropped_async += 1


#: fused calls whose counts and latencies :class:`_FusedCalls` holds as they came before adding
#: them up in one vector operation each (so memory stays bounded whether or not anyone reads
#: the statistics)
_PENDING_CALLS = 64


class _FusedCalls:
    """The fused all-hit calls over one list of ``T`` tables since their statistics were last
    read: summed ``per_table`` rows, the calls (and those in asynchronous-insertion mode),
    and the last :data:`LATENCY_WINDOW` latencies in a ring.

    A call only appends its ``(T, 5)`` tensor and its latency to a list; every
    :data:`_PENDING_CALLS` calls, and before the statistics are read, the lists are added
    into ``hits`` and the ring at once: adding each call's counts into the array with numpy
    would run numpy's ufunc machinery on every call, 55-60 µs of a 26-table pooled call whose
    CPU caches the rest of the process evicted (2-core VM; docs/benchmarks.md, "an all-hit
    call's bookkeeping")."""

    __slots__ = ("async_lookups", "hits", "latencies", "lookups", "n_latencies", "new", "new_s")

    def __init__(self, tables: int) -> None:
        self.hits = np.zeros((tables, 5), dtype=np.int64)
        self.lookups = 0
        self.async_lookups = 0
        self.latencies = np.zeros(LATENCY_WINDOW)
        self.n_latencies = 0
        self.new: list[torch.Tensor] = []  # per_table of the calls not yet in hits
        self.new_s: list[float] = []  # latencies not yet in the ring, in call order

    def add_hits(self, per_table: torch.Tensor, is_async: bool) -> None:
        self.new.append(per_table)
        self.lookups += 1
        self.async_lookups += is_async
        if len(self.new) >= _PENDING_CALLS:
            self._fold_hits()

    def add_latency(self, seconds: float) -> None:
        self.new_s.append(seconds)
        if len(self.new_s) >= _PENDING_CALLS:
            self._fold_latencies()

    def fold(self) -> None:
        """The calls held as they came, added into ``hits`` and the ring."""
        self._fold_hits()
        self._fold_latencies()

    def _fold_hits(self) -> None:
        if self.new:
            np.add(self.hits, torch.stack(self.new).sum(0).numpy(), out=self.hits)
            self.new.clear()

    def _fold_latencies(self) -> None:
        new = self.new_s
        if not new:
            return
        n = len(new)
        if n > LATENCY_WINDOW:  # only the window's last reach the ring
            new = new[n - LATENCY_WINDOW :]
        where = (self.n_latencies + (n - len(new)) + np.arange(len(new))) % LATENCY_WINDOW
        self.latencies[where] = new
        self.n_latencies += n
        self.new_s.clear()

    def pending_latencies(self) -> np.ndarray:
        """The pending latencies, oldest first (at most the window's)."""
        n = self.n_latencies
        if n <= LATENCY_WINDOW:
            return self.latencies[:n].copy()
        start = n % LATENCY_WINDOW
        return np.concatenate([self.latencies[start:], self.latencies[:start]])


@dataclass(frozen=True)
class TierBytes:
    """What one tier holds for one table.

    ``rows``: rows held; ``row_bytes``: ``rows`` × the table's stored row (its row format);
    ``bytes``: what the tier reports holding for the table — the cache its whole allocation
    (every slot's row and metadata, :meth:`~hps.storage.cache.EmbeddingCache.nbytes`), the
    in-process hash map its slots, counters and key index
    (:meth:`~hps.storage.volatile.HashMapBackend.nbytes`), Redis and RocksDB the row values
    (their own per-entry overhead is theirs to report); ``slots``: rows the cache can hold
    (``None`` for the databases).
    """

    rows: int
    row_bytes: int
    bytes: int
    slots: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        return {
            "rows": self.rows,
            "row_bytes": self.row_bytes,
            "bytes": self.bytes,
            "slots": self.slots,
        }


def _cache_bytes(cache: EmbeddingCache) -> TierBytes:
    rows = len(cache)
    return TierBytes(rows, rows * cache.row_bytes, cache.nbytes(), cache.capacity)


def _db_bytes(
    db: StorageBackend, table: str, dim: int, warned: set[tuple[str, str]] | None
) -> TierBytes | str:
    """A database's :class:`TierBytes` for ``table`` (:meth:`StorageBackend.held`), or why
    it could not say: a tier not :attr:`~StorageBackend.available` (a Redis cluster in its
    back-off window) is not asked, a stats read never waits on it. A failure is logged as a
    warning once per (database, table) in ``warned`` (then at debug level: stats are polled)."""
    if not db.available:
        return f"{db.name} is down (retrying)"
    try:
        rb = row_bytes(db.row_format(table), dim)
        rows, nbytes = db.held(table, dim)
    except Exception as e:  # noqa: BLE001 - a failed tier's statistics say why, not raise
        first = warned is None or (db.name, table) not in warned
        if warned is not None:
            warned.add((db.name, table))
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "bytes held by %s for table %r: %s: %s",
            db.name,
            table,
            type(e).__name__,
            e,
        )
        return f"{db.name}: {type(e).__name__}: {e}"
    return TierBytes(rows, rows * rb, nbytes)


@dataclass(frozen=True)
class TableBytes:
    """The bytes every tier of a session holds for one table (:func:`held_bytes`).

    ``tiers`` has one entry per tier the session has, in :class:`Tier` order: its
    :class:`TierBytes`, or why it could not say (a message).
    """

    row_format: RowDtype
    row_bytes: int  # one stored row
    tiers: dict[Tier, TierBytes | str]

    @property
    def total(self) -> int:
        """Σ ``bytes`` over the tiers that answered."""
        return sum(t.bytes for t in self.tiers.values() if isinstance(t, TierBytes))

    def to_dict(self) -> dict[str, object]:
        """``{"row_format": "int8", "row_bytes_per_row": 132, "tiers": {"cache": {...},
        "volatile": {"error": "..."}}, "bytes": total}`` (JSON)."""
        return {
            "row_format": self.row_format.value,
            "row_bytes_per_row": self.row_bytes,
            "tiers": {
                tier.value: t.to_dict() if isinstance(t, TierBytes) else {"error": t}
                for tier, t in self.tiers.items()
            },
            "bytes": self.total,
        }


def held_bytes(
    cache: EmbeddingCache | None,
    volatile: StorageBackend | None,
    persistent: StorageBackend | None,
    table: str,
    dim: int,
    warned: set[tuple[str, str]] | None = None,
) -> TableBytes:
    """Bytes each tier holds for ``table`` (its database name) of row width ``dim``; the row
    format is the cache's, else that of the first database that knows the table (every tier
    stores a table alike; FP32 when none does). A tier that cannot say is reported as such
    (``{"error": ...}``), never raised; ``warned``: the caller's record of the (database,
    table) failures already logged as warnings."""
    tiers: dict[Tier, TierBytes | str] = {}
    if cache is not None:
        tiers[Tier.CACHE] = _cache_bytes(cache)
    if volatile is not None:
        tiers[Tier.VOLATILE] = _db_bytes(volatile, table, dim, warned)
    if persistent is not None:
        tiers[Tier.PERSISTENT] = _db_bytes(persistent, table, dim, warned)
    fmt = cache.row_format if cache is not None else None
    for db in (volatile, persistent):
        if fmt is None and db is not None:
            try:
                fmt = db.row_format(table)
            except Exception:  # noqa: BLE001 - its tier's entry already says why
                continue
    fmt = RowDtype.FP32 if fmt is None else fmt
    return TableBytes(fmt, row_bytes(fmt, dim), tiers)


def bytes_per_tier(tables: Sequence[TableBytes]) -> dict[str, int]:
    """Σ over ``tables`` of the bytes each tier holds (tiers that answered), by tier value."""
    out: dict[str, int] = {}
    for t in tables:
        for tier, held in t.tiers.items():
            if isinstance(held, TierBytes):
                out[tier.value] = out.get(tier.value, 0) + held.bytes
    return out
