"""The in-process volatile database: a partitioned, vectorised hash map of embedding rows.

Each table is split into ``num_partitions`` partitions by ``mix64(key) % num_partitions``.
A partition keeps a pool of row slots and a key index over it
(:mod:`hps.storage.hash_partition`, which draws both); rows are bytes in the table's row
format, :class:`~hps.storage.row_codec.RowCodec`: ``row_bytes`` each, 512 for FP32 and 68 for
INT4 at dim 128; ``lookup`` dequantizes, ``insert`` quantizes, ``lookup_rows`` /
``insert_rows`` move the bytes as they are.

The key index of a table is laid out by the density of its keys (:class:`KeyLayout`), chosen
after every write, so that the index costs at most what the sorted one would (8 B per row)
and 4 B per row for an identity vocabulary (keys ``0..n-1``, as exports write them)::

    keys in [0, 2**32 - 1) (2**32 - 1 marks "absent"), n held, max key b - 1:
        2·n ≥ b      → DIRECT      (b,) uint32 slot per key, shared by the partitions: 4·b B
        3·n < b      → SORTED_U32  sorted uint32 keys, rows in key order: 4 B per row
        (in between, the layout it has stays: a table does not flap between the two)
    a key < 0 or ≥ 2**32 → SORTED_I64 in the partitions holding one: 4 B per row for keys of
        at most 64 high 32-bit words a partition, else 8 B per row
    (sorted layouts: + 12 B per key inserted since the last merge, :mod:`hps.storage.sorted_index`)

A direct index takes an insert of keys past its bound by growing to the largest key + 1 (at
least an eighth larger: appended keys cost O(1) amortised) while the table stays above the
3·n ≥ b line, and switches to the sorted layout otherwise (negative keys, keys ≥ 2**32, or
too sparse). A lookup of any int64 key is answered in every layout (keys outside the index
are not found); it costs O(batch) with a direct index and O(batch · log rows) with a sorted
one. A switch builds the new index under the table's write lock (O(bound), about 20 B per
row transiently, less than a pool's growth; lookups go on meanwhile) and swaps it in under
every partition lock of the table (a switch to a sorted index also copies each partition's rows
into key order); ``compact_keys=False`` keeps the sorted int64 layout always (the reference
the others are tested against).
:meth:`HashMapBackend.mark_loaded` (the end of a load) compacts the table's pools to the rows
they hold: loads in chunks leave no slack.

Every operation is a handful of numpy calls per partition touched (a loop over partitions,
never over keys). When a partition holds more than ``overflow_margin`` rows after an insert it
evicts rows by ``overflow_policy`` until it holds ``overflow_resolution_target ×
overflow_margin`` (HugeCTR's semantics); the rows it picks do not depend on the layout. An
eviction costs O(rows of the partition) in every layout: with a direct index the partition
keeps its slots' keys from its first eviction on (4 B per slot,
:attr:`~hps.storage.hash_partition.Partition.owner`; one scan of the index, O(bound), for
the partitions evicting first in one insert).

Exclusive with a cache (:meth:`HashMapBackend.attach_cache`; :mod:`hps.storage.cache`
draws it): the rows a CPU cache above holds for this map are stored there only. The map still
answers for them (``lookup``, ``size``; an ``insert`` writes into the cached slot; a
``delete`` drops the map's claim), so from outside it holds what it would hold without the
cache; ``nbytes`` and the overflow margin count the rows it stores itself (the cache's rows
are bounded by its capacity).

Locks: a table's writes (inserts, deletes, moves to and from its cache) take its
``write_lock``, then one partition lock at a time (all of them, in order, to switch
layouts); reads take one partition lock at a time.
"""

from __future__ import annotations

import itertools
import logging
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
import torch

from hps.rowformat import RowDtype
from hps.storage.cache import EmbeddingCache
from hps.storage.hash_partition import (
    ABSENT,
    DIRECT_LIMIT,
    KeyLayout,
    Partition,
    partition_of,
    split_by_partition,
)
from hps.storage.row_codec import RowCodec
from hps.types import OverflowPolicy, StorageBackend, check_keys, check_values

__all__ = ["HashMapBackend", "KeyLayout", "partition_of", "split_by_partition"]

log = logging.getLogger(__name__)


@dataclass
class _Table:
    """One table of the map: its partitions and, when exclusive, the cache above it."""

    codec: RowCodec
    parts: list[Partition]
    lock: threading.Lock = field(default_factory=threading.Lock)  # moves and reads (cache)
    write_lock: threading.Lock = field(default_factory=threading.Lock)  # every write
    front: EmbeddingCache | None = None
    direct: np.ndarray | None = None  # (bound,) uint32, the partitions' shared direct index

    def all_partitions(self) -> ExitStack:
        """Every partition's lock, taken in order (a layout switch; hold ``write_lock``)."""
        stack = ExitStack()
        for part in self.parts:
            stack.enter_context(part.lock)
        return stack


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
        compact_keys: lay each table's key index out by its keys' density (the module
            docstring); ``False`` keeps sorted int64 keys (8 B per row) always.
    """

    name = "hash_map"

    def __init__(
        self,
        num_partitions: int = 8,
        overflow_margin: int = 2**40,
        overflow_policy: OverflowPolicy | str = OverflowPolicy.EVICT_RANDOM,
        overflow_resolution_target: float = 0.8,
        seed: int = 0,
        compact_keys: bool = True,
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
        self.compact_keys = compact_keys
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
            key_dtype = np.uint32 if self.compact_keys else np.int64
            parts = [
                Partition(codec.row_bytes, uses, stamps, p, self.num_partitions, key_dtype)
                for p in range(self.num_partitions)
            ]
            self._tables[table] = _Table(codec, parts)

    def row_format(self, table: str) -> RowDtype:
        """How ``table``'s rows are stored."""
        return self._table(table).codec.dtype

    def key_layout(self, table: str) -> KeyLayout:
        """How ``table``'s key index is laid out now: SORTED_I64 where any partition holds a
        key outside ``[0, 2**32)`` in its index, deleted ones included until that partition's
        next merge (its main keys stay runs or int64 till then; :meth:`_relayout` narrows only
        int64 main keys that all fit uint32)."""
        t = self._table(table)
        with t.write_lock:
            if t.direct is not None:
                return KeyLayout.DIRECT
            wide = any(p.sorted_index.wide for p in t.parts)
            return KeyLayout.SORTED_I64 if wide else KeyLayout.SORTED_U32

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
        """Store ``rows (n, row_bytes) uint8`` under unique ``keys`` in the partitions, then
        resolve the overflows (in partition order, as each partition's rows alone decide)."""
        with t.write_lock:
            self._fit_direct(t, keys)
            now = next(self._clock)
            over: list[int] = []
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
                        part.add(nk, ns)
                    if part.size > self.overflow_margin:
                        over.append(p)
            if over:
                self._keep_owners(t, over)
                for p in over:
                    with t.parts[p].lock:
                        self._resolve_overflow(table, p, t.parts[p])
            for part in t.parts:  # outside the partition locks: lookups go on meanwhile
                part.maybe_compact()
            self._relayout(t)

    def _keep_owners(self, t: _Table, parts: list[int]) -> None:
        """Make the partitions ``parts`` of a direct index keep their slots' keys
        (:attr:`Partition.owner`), so that their evictions enumerate O(rows held), not
        O(bound): one scan of the index for all of them. Hold ``t.write_lock``."""
        if t.direct is None:
            return
        need = [p for p in parts if t.parts[p].owner is None]
        if not need:
            return
        held = self._direct_live(t)
        for p in need:
            with t.parts[p].lock:
                t.parts[p].keep_owner(*held[p])

    def _direct_live(self, t: _Table) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each partition's :meth:`Partition.live` of a direct index, from one scan of it
        (O(bound)). Hold ``t.write_lock`` (no index entry changes meanwhile)."""
        d = t.direct
        assert d is not None  # the caller's layout
        held = np.flatnonzero(d != ABSENT)
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        out = dict.fromkeys(range(self.num_partitions), empty)
        for p, idx in split_by_partition(held, self.num_partitions):
            k = held[idx]  # ascending: the split keeps the order within a partition
            out[p] = (k, d[k].astype(np.int64))
        return out

    def _resolve_overflow(self, table: str, p: int, part: Partition) -> None:
        target = int(self.overflow_margin * self.overflow_resolution_target)
        n_evict = part.size - target
        live = part.live()
        if self.overflow_policy is OverflowPolicy.EVICT_RANDOM:
            pos = self._rng.choice(part.size, size=n_evict, replace=False)
        else:
            score = (
                part.uses if self.overflow_policy is OverflowPolicy.EVICT_LEAST_USED else part.stamp
            )
            assert score is not None  # kept for the policy that reads it (create_table)
            s = score[live[1]]
            pos = (
                np.argpartition(s, n_evict - 1)[:n_evict] if n_evict < s.size else np.arange(s.size)
            )
        part.remove_positions(pos, live)
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
        with t.write_lock:
            for p, idx in split_by_partition(keys, self.num_partitions):
                part = t.parts[p]
                with part.lock:
                    if part.size == 0:
                        continue
                    hit, _ = part.find(keys[idx])
                    found[idx] = hit
                    if hit.any():
                        part.remove_keys(np.unique(keys[idx][hit]))
            for part in t.parts:  # outside the partition locks: lookups go on meanwhile
                part.maybe_compact()
            self._relayout(t)
        return found

    def _fit_direct(self, t: _Table, keys: np.ndarray) -> None:
        """Make a direct index take ``keys``: grow it, or switch to the sorted layout
        (the module docstring). Hold ``t.write_lock``."""
        d = t.direct
        if d is None or keys.size == 0:
            return
        lo, hi = int(keys.min()), int(keys.max())
        if lo >= 0 and hi < d.size:
            return
        if lo >= 0 and hi < DIRECT_LIMIT:
            bound = min(max(hi + 1, d.size + d.size // 8), DIRECT_LIMIT)
            inside = keys[keys < d.size]
            new = keys.size - inside.size + int(np.count_nonzero(d[inside] == ABSENT))
            if 3 * (self._live(t) + new) >= bound:
                grown = np.full(bound, ABSENT, np.uint32)
                grown[: d.size] = d
                with t.all_partitions():
                    for part in t.parts:
                        part.direct = grown
                    t.direct = grown
                return
        self._to_sorted(t)

    def _relayout(self, t: _Table) -> None:
        """Switch ``t``'s key index by the density of the keys it holds now (the module
        docstring); O(partitions) unless it switches. Hold ``t.write_lock``."""
        if not self.compact_keys:
            return
        live = self._live(t)
        if t.direct is not None:
            if 3 * live < t.direct.size:
                self._to_sorted(t)
            return
        spans = [e for e in (p.sorted_index.extent() for p in t.parts) if e is not None]
        if spans:
            lo = min(e[0] for e in spans)
            hi = max(e[1] for e in spans)
            if lo >= 0 and hi < DIRECT_LIMIT and 2 * live >= hi + 1:
                self._to_direct(t, hi + 1)
                return
        for p in t.parts:
            if p.sorted_index.keys.dtype == np.int64:
                with p.lock:
                    p.sorted_index.narrow()

    def _to_direct(self, t: _Table, bound: int) -> None:
        """Switch to a direct index over ``[0, bound)``: built outside the partition locks
        (``t.write_lock``, held, keeps the sorted indices as they are), swapped under them."""
        d = np.full(bound, ABSENT, np.uint32)
        for part in t.parts:
            k, slots = part.live()
            d[k] = slots
        with t.all_partitions():
            for part in t.parts:
                part.n_direct = part.size
                part.direct = d
                part.sorted_index.clear()
            t.direct = d
        log.debug("volatile db: a table's key index is direct over [0, %d)", bound)

    def _to_sorted(self, t: _Table) -> None:
        """Switch to sorted indices: built outside the partition locks (``t.write_lock``,
        held, keeps the direct index as it is), swapped under them."""
        held = self._direct_live(t)
        with t.all_partitions():
            for p, part in enumerate(t.parts):
                part.to_sorted(*held[p])
            t.direct = None
        log.debug("volatile db: a table's key index is sorted (%d keys)", self._live(t))

    @staticmethod
    def _live(t: _Table) -> int:
        return sum(p.size for p in t.parts)

    def mark_loaded(self, table: str, partitions: list[int] | None = None) -> None:
        """The end of a load: give back the pools' slack of ``table`` (or of its
        ``partitions``), which growth by a quarter leaves after inserts in chunks. One
        partition's pool is copied at a time (``capacity = rows held``)."""
        t = self._table(table)
        with t.write_lock:
            asked = range(self.num_partitions) if partitions is None else partitions
            todo = [p for p in asked if t.parts[p].free.size]
            # a direct index is scanned once for every partition (not once per partition)
            held = self._direct_live(t) if todo and t.direct is not None else None
            for p in todo:
                part = t.parts[p]
                with part.lock:
                    part.trim(None if held is None or part.owner is not None else held[p])

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
        stamps (the policy's), the free list, and the key index (a direct index once, or each
        partition's sorted keys and slots). Rows an attached cache holds for it are the
        cache's bytes (:meth:`EmbeddingCache.nbytes`)."""
        t = self._table(table)
        with t.write_lock:
            return self._nbytes(t)

    @staticmethod
    def _nbytes(t: _Table) -> int:
        """:meth:`nbytes` of ``t``; hold ``t.write_lock``."""
        total = int(t.direct.nbytes) if t.direct is not None else 0
        for p in t.parts:
            with p.lock:
                total += p.nbytes()
        return total

    def held(self, table: str, dim: int) -> tuple[int, int]:
        """``(rows stored in this map itself, nbytes)`` of ``table``, read under one lock (the
        rows an attached cache holds are the cache's). ``dim`` is the table's own."""
        t = self._table(table)
        with t.write_lock:
            return self._live(t), self._nbytes(t)

    def stored_rows(self, table: str) -> int:
        """Rows of ``table`` stored in this map itself (without an attached cache's)."""
        t = self._table(table)
        with t.write_lock:  # never counted halfway through a layout switch
            return self._live(t)

    def size(self, table: str) -> int:
        """Rows of ``table`` this map holds, an attached cache's included."""
        t = self._table(table)
        if t.front is None:
            return self.stored_rows(table)
        with t.lock:
            return self.stored_rows(table) + t.front.homed_rows()
