"""The in-process volatile database: a partitioned, vectorised hash map of embedding rows.

Each table is split into ``num_partitions`` partitions by ``mix64(key) % num_partitions``.
A partition keeps a sorted key index and a pool of row slots (rows are bytes in the table's
row format, :class:`~hps.storage.row_codec.RowCodec`: ``row_bytes`` each, 512 for FP32 and
132 for INT8 at dim 128; ``lookup`` dequantizes, ``insert`` quantizes, ``lookup_rows`` /
``insert_rows`` move the bytes as they are)::

    keys   = [ 3,  7, 42]      sorted, (m,) int64          lookup = np.searchsorted(keys, q)
    slots  = [ 1,  0,  2]      row slot of each key, int32  insert = np.insert at those positions
    rows   = [[row of 7], [row of 3], [row of 42], <free>]  (capacity, row_bytes) uint8
    uses   = [ 5, 1, 2, -]     reads per slot               (evict_least_used only)
    stamp  = [90, 12, 40, -]   clock of the last read/write (evict_oldest only)

The pool grows by a quarter (at least 64 slots) when it is full and is compacted (live rows
copied to the front, ``capacity = live × 9/8``) when more than half of the live rows' count is
free: its slack stays under half the live rows, and a move of many rows up into an attached
cache (below) gives their memory back.

Every operation is a handful of numpy calls per partition touched (a loop over partitions,
never over keys). When a partition holds more than ``overflow_margin`` rows after an insert it
evicts rows by ``overflow_policy`` until it holds ``overflow_resolution_target ×
overflow_margin`` (HugeCTR's semantics).

Exclusive with a cache (:meth:`HashMapBackend.attach_cache`; :mod:`hps.storage.cache`
draws it): the rows a CPU cache above holds for this map are stored there only. The map still
answers for them (``lookup``, ``size``; an ``insert`` writes into the cached slot; a
``delete`` drops the map's claim), so from outside it holds what it would hold without the
cache; ``nbytes`` and the overflow margin count the rows it stores itself (the cache's rows
are bounded by its capacity).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from hps.rowformat import RowDtype
from hps.storage.cache import EmbeddingCache
from hps.storage.row_codec import RowCodec
from hps.types import OverflowPolicy, StorageBackend, check_keys, check_values, mix64

log = logging.getLogger(__name__)

_MIN_GROWTH = 64  # slots a pool grows by at least (and the slack a compaction leaves alone)


def partition_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """``(n,) int64`` keys → ``(n,) int64`` partition ids in ``[0, num_partitions)``."""
    return (mix64(keys) % np.uint64(num_partitions)).astype(np.int64)


def split_by_partition(keys: np.ndarray, num_partitions: int) -> list[tuple[int, np.ndarray]]:
    """Group positions of ``keys`` by partition: ``[(partition, positions (k,) int64), ...]``."""
    part = partition_of(keys, num_partitions)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(num_partitions + 1))
    return [
        (p, order[bounds[p] : bounds[p + 1]])
        for p in range(num_partitions)
        if bounds[p + 1] > bounds[p]
    ]


class _Partition:
    def __init__(self, row_bytes: int, uses: bool, stamps: bool) -> None:
        self.lock = threading.Lock()
        self.keys = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int32)  # a partition holds < 2**31 rows
        self.rows = np.zeros((0, row_bytes), np.uint8)
        self.uses = np.zeros(0, np.int64) if uses else None
        self.stamp = np.zeros(0, np.int64) if stamps else None
        self.free = np.zeros(0, np.int32)  # a stack

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found (k,) bool, slot of each found key (f,) int64)``."""
        if self.keys.size == 0:
            return np.zeros(q.size, bool), np.zeros(0, np.int64)
        pos = np.searchsorted(self.keys, q)
        pos = np.minimum(pos, self.keys.size - 1)
        found = self.keys[pos] == q
        return found, self.slots[pos[found]]

    def touch(self, slots: np.ndarray, now: int, read: bool) -> None:
        """Count a read (``uses``) and stamp ``now`` (``stamp``) where the policy keeps them."""
        if read and self.uses is not None:
            self.uses[slots] += 1
        if self.stamp is not None:
            self.stamp[slots] = now

    def allocate(self, n: int) -> np.ndarray:
        if self.free.size < n:
            cap = self.rows.shape[0]
            new_cap = max(cap + n - self.free.size, cap + max(cap // 4, _MIN_GROWTH))
            if new_cap >= 2**31:
                raise ValueError(
                    f"a volatile db partition would hold {new_cap} rows, at most {2**31 - 1}: "
                    "raise num_partitions"
                )
            grow = new_cap - cap
            self.rows = np.concatenate([self.rows, np.zeros((grow, self.rows.shape[1]), np.uint8)])
            if self.uses is not None:
                self.uses = np.concatenate([self.uses, np.zeros(grow, np.int64)])
            if self.stamp is not None:
                self.stamp = np.concatenate([self.stamp, np.zeros(grow, np.int64)])
            self.free = np.concatenate(
                [np.arange(new_cap - 1, cap - 1, -1, dtype=np.int32), self.free]
            )
        out = self.free[self.free.size - n :]
        self.free = self.free[: self.free.size - n]
        return out

    def remove_positions(self, pos: np.ndarray) -> None:
        self.free = np.concatenate([self.free, self.slots[pos]])
        keep = np.ones(self.keys.size, bool)
        keep[pos] = False
        self.keys, self.slots = self.keys[keep], self.slots[keep]
        live = self.keys.size
        if self.free.size > max(_MIN_GROWTH, live // 2):
            self._compact(live + live // 8)

    def _compact(self, capacity: int) -> None:
        """Copy the live rows to slots ``0..live-1`` of a pool of ``capacity`` slots."""
        live = self.keys.size
        rows = np.zeros((capacity, self.rows.shape[1]), np.uint8)
        rows[:live] = self.rows[self.slots]
        self.rows = rows
        for name in ("uses", "stamp"):
            old = getattr(self, name)
            if old is not None:
                new = np.zeros(capacity, np.int64)
                new[:live] = old[self.slots]
                setattr(self, name, new)
        self.slots = np.arange(live, dtype=np.int32)
        self.free = np.arange(capacity - 1, live - 1, -1, dtype=np.int32)

    def nbytes(self) -> int:
        arrays: list[np.ndarray] = [self.rows, self.free, self.keys, self.slots]
        arrays += [a for a in (self.uses, self.stamp) if a is not None]
        return sum(int(a.nbytes) for a in arrays)


@dataclass
class _Table:
    """One table of the map: its partitions and, when exclusive, the cache above it."""

    codec: RowCodec
    parts: list[_Partition]
    lock: threading.Lock = field(default_factory=threading.Lock)  # moves and reads (cache)
    front: EmbeddingCache | None = None


class _TableHome:
    """A table of the map as its attached cache sees it (:class:`hps.storage.cache.RowHome`)."""

    def __init__(self, db: HashMapBackend, table: str, t: _Table) -> None:
        self.lock = t.lock
        self._db, self._table, self._t = db, table, t

    def take(self, keys: np.ndarray) -> np.ndarray:
        return self._db._take(self._t, keys)

    def put_back(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._db._store(self._table, self._t, keys, rows)


class HashMapBackend(StorageBackend):
    """Partitioned in-process hash map (HugeCTR ``hash_map`` / ``parallel_hash_map``).

    Args:
        num_partitions: partitions per table (1 = ``hash_map``).
        overflow_margin: most rows a partition holds before it evicts.
        overflow_policy: which rows go; see :class:`~hps.types.OverflowPolicy`.
        overflow_resolution_target: fraction of ``overflow_margin`` kept after an eviction.
        seed: seeds ``evict_random``.
    """

    name = "hash_map"

    def __init__(
        self,
        num_partitions: int = 8,
        overflow_margin: int = 2**40,
        overflow_policy: OverflowPolicy | str = OverflowPolicy.EVICT_RANDOM,
        overflow_resolution_target: float = 0.8,
        seed: int = 0,
    ) -> None:
        if num_partitions <= 0:
            raise ValueError(f"num_partitions must be > 0, got {num_partitions}")
        if overflow_margin <= 0:
            raise ValueError(f"overflow_margin must be > 0, got {overflow_margin}")
        if not 0.0 < overflow_resolution_target <= 1.0:
            raise ValueError(
                f"overflow_resolution_target must be in (0, 1], got {overflow_resolution_target}"
            )
        self.num_partitions = num_partitions
        self.overflow_margin = overflow_margin
        self.overflow_policy = OverflowPolicy(overflow_policy)
        self.overflow_resolution_target = overflow_resolution_target
        self._rng = np.random.default_rng(seed)
        self._tables: dict[str, _Table] = {}
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.evicted = 0  # rows evicted by overflow handling, all tables

    def create_table(self, table: str, dim: int, row_format: RowDtype = RowDtype.FP32) -> None:
        """Declare ``table`` with rows of ``dim`` values stored as ``row_format``.

        Raises:
            ValueError: the table exists with another dim or row format, or ``dim`` does not
                pack into ``row_format`` (naming the table).
        """
        codec = RowCodec(dim, RowDtype(row_format), f"volatile db table {table!r}")
        with self._lock:
            if table in self._tables:
                had = self._tables[table].codec
                if (had.dim, had.dtype) != (dim, codec.dtype):
                    raise ValueError(
                        f"table {table!r} exists with dim {had.dim}, not {dim} "
                        f"({had.dtype.value} rows, not {codec.dtype.value})"
                    )
                return
            uses = self.overflow_policy is OverflowPolicy.EVICT_LEAST_USED
            stamps = self.overflow_policy is OverflowPolicy.EVICT_OLDEST
            parts = [_Partition(codec.row_bytes, uses, stamps) for _ in range(self.num_partitions)]
            self._tables[table] = _Table(codec, parts)

    def row_format(self, table: str) -> RowDtype:
        """How ``table``'s rows are stored."""
        return self._table(table).codec.dtype

    def _table(self, table: str) -> _Table:
        try:
            return self._tables[table]
        except KeyError:
            raise ValueError(
                f"volatile db has no table {table!r}; tables: {sorted(self._tables)}"
            ) from None

    def attach_cache(self, table: str, cache: EmbeddingCache) -> None:
        """Make ``cache`` (empty, on the CPU) exclusive with ``table``: the rows it caches
        from this map are stored in the cache only (see the module docstring).

        Raises:
            ValueError: an unknown table, a cache of another dim, a table that already has
                one, or a cache :meth:`EmbeddingCache.attach` refuses.
        """
        t = self._table(table)
        if (cache.dim, cache.row_format) != (t.codec.dim, t.codec.dtype):
            raise ValueError(
                f"table {table!r} has dim {t.codec.dim} ({t.codec.dtype.value} rows), the cache "
                f"{cache.dim} ({cache.row_format.value} rows)"
            )
        with t.lock:
            if t.front is not None:
                raise ValueError(f"table {table!r} of the volatile db already has a cache attached")
            cache.attach(_TableHome(self, table, t))
            t.front = cache

    def front(self, table: str) -> EmbeddingCache | None:
        """The cache exclusive with ``table`` (:meth:`attach_cache`), or ``None``."""
        return self._table(table).front

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(values (n, dim) float32, found (n,) bool)``, dequantized; zeros where not found."""
        t = self._table(table)
        rows, found = self.lookup_rows(table, keys)
        return t.codec.decode(rows), found

    def lookup_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows (n, row_bytes) uint8, found (n,) bool)``: the stored bytes; zeros where not
        found (an attached cache's rows included)."""
        keys = check_keys(keys)
        t = self._table(table)
        if t.front is None:
            return self._lookup(t, keys)
        with t.lock:  # no row moves between the map and its cache while both are read
            out, found = self._lookup(t, keys)
            rest = np.flatnonzero(~found)
            if rest.size:
                rows, hit = t.front.peek_homed(torch.from_numpy(keys[rest]))
                h = hit.numpy()
                out[rest[h]] = rows.numpy()[h]
                found[rest[h]] = True
        return out, found

    def _lookup(self, t: _Table, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros((keys.size, t.codec.row_bytes), np.uint8)
        found = np.zeros(keys.size, bool)
        now = next(self._clock)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = t.parts[p]
            with part.lock:
                hit, slots = part.find(keys[idx])
                out[idx[hit]] = part.rows[slots]
                part.touch(slots, now, read=True)
            found[idx] = hit
        return out, found

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert or overwrite rows (quantized to the table's row format; written into the
        attached cache's slot where it caches the key).

        Args:
            keys: ``(n,) int64``, unique within the call.
            values: ``(n, dim) float32``.

        Raises:
            ValueError: for an unknown table, bad shapes, a key given twice (it would get
                two rows, and a delete would leave one), or a row the format cannot hold
                (:class:`~hps.rowformat.RowFormatError`); nothing is inserted then.
        """
        keys = check_keys(keys)
        t = self._table(table)
        values = check_values(values, keys.size, t.codec.dim)
        self.insert_rows(table, keys, t.codec.encode(values))

    def insert_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """:meth:`insert` of stored bytes, ``rows (n, row_bytes) uint8``, kept as they are."""
        keys = check_keys(keys)
        t = self._table(table)
        rows = t.codec.check_stored(rows, keys.size, f"volatile db insert into {table!r}")
        if keys.size > 1:
            s = np.sort(
                keys
            )  # one sort before any partition is touched: the call stays all-or-nothing
            rep = np.flatnonzero(s[1:] == s[:-1])
            if rep.size:
                raise ValueError(
                    f"volatile db insert into {table!r}: keys must be unique within a call, but key "
                    f"{int(s[rep[0]])} occurs more than once ({np.unique(s[rep]).size} repeated key(s) "
                    f"among {keys.size})"
                )
        if t.front is None:
            self._store(table, t, keys, rows)
            return
        with t.lock:
            cached = t.front.update_homed(torch.from_numpy(keys), torch.from_numpy(rows))
            rest = ~cached.numpy()
            self._store(table, t, keys[rest], rows[rest])

    def _store(self, table: str, t: _Table, keys: np.ndarray, rows: np.ndarray) -> None:
        """Store ``rows (n, row_bytes) uint8`` under unique ``keys`` in the partitions."""
        now = next(self._clock)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = t.parts[p]
            q = keys[idx]
            with part.lock:
                hit, slots = part.find(q)
                part.rows[slots] = rows[idx[hit]]
                part.touch(slots, now, read=False)
                new = ~hit
                if new.any():
                    nk = q[new]
                    order = np.argsort(nk, kind="stable")
                    nk = nk[order]
                    ns = part.allocate(nk.size)
                    part.rows[ns] = rows[idx[new][order]]
                    if part.uses is not None:
                        part.uses[ns] = 0
                    part.touch(ns, now, read=False)
                    pos = np.searchsorted(part.keys, nk)
                    part.keys = np.insert(part.keys, pos, nk)
                    part.slots = np.insert(part.slots, pos, ns)
                if part.keys.size > self.overflow_margin:
                    self._resolve_overflow(table, p, part)

    def _resolve_overflow(self, table: str, p: int, part: _Partition) -> None:
        target = int(self.overflow_margin * self.overflow_resolution_target)
        n_evict = part.keys.size - target
        if self.overflow_policy is OverflowPolicy.EVICT_RANDOM:
            pos = self._rng.choice(part.keys.size, size=n_evict, replace=False)
        else:
            score = (
                part.uses if self.overflow_policy is OverflowPolicy.EVICT_LEAST_USED else part.stamp
            )
            assert score is not None  # kept for the policy that reads it (create_table)
            s = score[part.slots]
            pos = (
                np.argpartition(s, n_evict - 1)[:n_evict] if n_evict < s.size else np.arange(s.size)
            )
        part.remove_positions(pos)
        self.evicted += int(n_evict)
        log.debug(
            "volatile db: table %s partition %d evicted %d rows (%s)",
            table,
            p,
            n_evict,
            self.overflow_policy.value,
        )

    def _take(self, t: _Table, keys: np.ndarray) -> np.ndarray:
        """Drop the stored rows of ``keys (n,) int64``; ``(n,) bool``: which were stored."""
        found = np.zeros(keys.size, bool)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = t.parts[p]
            with part.lock:
                if part.keys.size == 0:
                    continue
                pos = np.minimum(np.searchsorted(part.keys, keys[idx]), part.keys.size - 1)
                hit = part.keys[pos] == keys[idx]
                found[idx] = hit
                if hit.any():
                    part.remove_positions(np.unique(pos[hit]))
        return found

    def delete(self, table: str, keys: np.ndarray) -> None:
        """Remove rows (missing keys are ignored; an attached cache keeps its copies)."""
        keys = check_keys(keys)
        t = self._table(table)
        if t.front is None:
            self._take(t, keys)
            return
        with t.lock:
            self._take(t, keys)
            t.front.unhome(torch.from_numpy(keys))

    def nbytes(self, table: str) -> int:
        """Bytes ``table`` holds in this map: row slots (held or free), their use counts or
        stamps (the policy's), the free list, and the sorted key index. Rows an attached cache
        holds for it are the cache's bytes (:meth:`EmbeddingCache.nbytes`)."""
        total = 0
        for p in self._table(table).parts:
            with p.lock:
                total += p.nbytes()
        return total

    def stored_rows(self, table: str) -> int:
        """Rows of ``table`` stored in this map itself (without an attached cache's)."""
        return int(sum(p.keys.size for p in self._table(table).parts))

    def size(self, table: str) -> int:
        """Rows of ``table`` this map holds, an attached cache's included."""
        t = self._table(table)
        if t.front is None:
            return self.stored_rows(table)
        with t.lock:
            return self.stored_rows(table) + t.front.homed_rows()
