"""One partition of the in-process hash map: a pool of row slots and the key index over it.

A partition holds rows of its table's format (``row_bytes`` each) in a pool of slots, and a
key index saying which slot holds each key. The index has one of three layouts
(:class:`KeyLayout`), chosen per table by :class:`~hps.storage.volatile.HashMapBackend`; the
pool is the same in all three::

    keys held: 3, 7, 42 (all in this partition), their rows in slots 1, 0, 2

    DIRECT      index = [S, S, S, 1, S, S, S, 0, S, ..., S, 2]   (bound,) uint32, one entry
                per key in [0, bound), S = 2**32 - 1 for "absent"; one array shared by the
                table's partitions (each reads and writes only its own keys' entries)
                lookup = index[q]                                4 B × bound for the table
    SORTED_U32  keys  = [3, 7, 42]  sorted (m,) uint32, key i's row in slot i: 4 B per row
                (the rows in key order: rows = [[3], [7], [42], <free>])  lookup = searchsorted
    SORTED_I64  the same with int64 keys: 4 B per row while they have at most 64 high
                words (runs of uint32 low words), else 8 B per row
                (keys inserted since the last merge: a side part, :mod:`hps.storage.sorted_index`)

    rows  = [[row of 7], [row of 3], [row of 42], <free>]  (capacity, row_bytes) uint8 (DIRECT)
    free  = [3]                     free slots, a stack, (f,) int32
    uses  = [ 5, 1, 2, -]           reads per slot               (evict_least_used only)
    stamp = [90, 12, 40, -]         clock of the last read/write (evict_oldest only)
    owner = [ 7, 3, 42, S]          key of each slot, S free (DIRECT, once it evicts)

A direct index enumerates a partition's keys (:meth:`Partition.live`, for evictions and
compactions) by scanning the whole index, O(bound). A partition that evicts (an overflow
margin reached) pays that scan once: it then keeps ``owner`` (uint32, 4 B per slot), the key each
slot holds, and enumerates its keys from its own slots, O(capacity).

A sorted partition keeps uint32 keys while every key it holds is in ``[0, 2**32)``
(:class:`~hps.storage.sorted_index.SortedIndex`). Every layout enumerates its keys in
ascending order (:meth:`Partition.live`), assigns new keys slots in ascending key order and
frees slots in the order asked, so the rows each eviction picks are the same in every layout;
where a row sits differs (a sorted index merges its rows into key order).

The pool grows by a quarter (at least 64 slots) when it is full and is compacted (live rows
copied to the front in key order, ``capacity = live × 9/8``) when more than half of the live
rows' count is free: its slack stays under half the live rows.

Callers hold :attr:`Partition.lock` around every method but :meth:`Partition.maybe_compact`;
replacing :attr:`Partition.direct` (the table switching layouts) needs every partition's lock
of the table. A write leaves the compaction it makes due to :meth:`Partition.maybe_compact`,
which the writer calls without the partition lock (the writer's own lock held): it builds the
compacted pool and index outside the partition lock (lookups go on reading the old ones) and
swaps them in under it (with the use counts and stamps, which lookups write).
"""

from __future__ import annotations

import contextlib
import threading
from enum import StrEnum

import numpy as np

from hps.storage.sorted_index import KEY_LIMIT, SortedIndex
from hps.types import mix64

ABSENT = np.uint32(2**32 - 1)  # a direct index's entry for a key the map does not hold
DIRECT_LIMIT = KEY_LIMIT - 1  # a direct index's keys are below this (ABSENT is no key)
_MIN_GROWTH = 64  # slots a pool grows by at least (and the slack a compaction leaves alone)


class KeyLayout(StrEnum):
    """How a table's key index of the hash map is laid out (see the module docstring)."""

    DIRECT = "direct"  # uint32 slot per key in [0, bound)
    SORTED_U32 = "sorted_u32"  # sorted uint32 keys, rows in key order (+ a small side part)
    SORTED_I64 = "sorted_i64"  # sorted keys past uint32: runs of uint32 low words, or int64


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


class Partition:
    """Partition ``index`` of ``num_partitions`` of a table: its pool and key index.

    Args:
        row_bytes: bytes of one stored row.
        uses: keep a read count per slot (``evict_least_used``).
        stamps: keep a clock per slot (``evict_oldest``).
        index: this partition's number, ``[0, num_partitions)``.
        num_partitions: partitions of the table (a direct index is shared by all).
        key_dtype: ``np.uint32`` or ``np.int64``, the sorted keys' dtype while empty.
    """

    def __init__(
        self,
        row_bytes: int,
        uses: bool,
        stamps: bool,
        index: int,
        num_partitions: int,
        key_dtype: type[np.generic],
    ) -> None:
        self.lock = threading.Lock()
        self.index, self.num_partitions = index, num_partitions
        self.direct: np.ndarray | None = None  # the table's (bound,) uint32 index when DIRECT
        self.n_direct = 0  # keys held through the direct index
        #: the sorted index (empty while DIRECT), :mod:`hps.storage.sorted_index`
        self.sorted_index = SortedIndex(compact=key_dtype == np.uint32)
        self.rows = np.zeros((0, row_bytes), np.uint8)
        self.uses = np.zeros(0, np.int64) if uses else None
        self.stamp = np.zeros(0, np.int64) if stamps else None
        self.free = np.zeros(0, np.int32)  # a stack
        self.owner: np.ndarray | None = None  # (capacity,) uint32 key per slot, ABSENT free

    @property
    def size(self) -> int:
        """Keys this partition holds."""
        return self.n_direct if self.direct is not None else self.sorted_index.size

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found (k,) bool, slot of each found key (f,) int64)``."""
        d = self.direct
        if d is not None:
            inside = (q >= 0) & (q < d.size)
            if inside.all():
                s = d[q]
            else:
                s = np.full(q.size, ABSENT, np.uint32)
                s[inside] = d[q[inside]]
            found = s != ABSENT
            return found, s[found].astype(np.int64)
        return self.sorted_index.find(q)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys (m,) ascending, their slots (m,))`` of every key held: the sorted index's
        own arrays; for a direct index, from :attr:`owner` when kept (O(capacity)), else a
        scan of the index (O(bound), for compactions only)."""
        d = self.direct
        if d is None:
            return self.sorted_index.live()
        o = self.owner
        if o is not None:
            slots = np.flatnonzero(o != ABSENT)
            keys = o[slots].astype(np.int64)
            order = np.argsort(keys, kind="stable")  # nearly sorted: a compaction sorts them
            return keys[order], slots[order]
        k = np.flatnonzero(d != ABSENT)
        if self.num_partitions > 1:
            k = k[partition_of(k, self.num_partitions) == self.index]
        return k, d[k].astype(np.int64)

    def to_sorted(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Leave the direct index for a sorted one over ``keys (m,) int64`` ascending in
        ``slots (m,) int64`` (:meth:`live`'s answer): the rows are copied into key order, so
        that the index is the keys alone (:mod:`hps.storage.sorted_index`)."""
        self.direct, self.n_direct, self.owner = None, 0, None
        self._compact(self.rows.shape[0], (keys, slots))

    def keep_owner(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Keep :attr:`owner` from now on (DIRECT), from :meth:`live`'s answer ``keys``,
        ``slots`` (one scan of the table's index for many partitions: the caller's)."""
        owner = np.full(self.rows.shape[0], ABSENT, np.uint32)
        owner[slots] = keys
        self.owner = owner

    def add(self, nk: np.ndarray, ns: np.ndarray) -> None:
        """Index new keys ``nk (k,) int64`` (ascending, none held; inside the direct index's
        bound when DIRECT) in slots ``ns (k,) int32``."""
        if self.direct is not None:
            self.direct[nk] = ns
            self.n_direct += int(nk.size)
            if self.owner is not None:
                self.owner[ns] = nk
            return
        self.sorted_index.add(nk, ns)

    def touch(self, slots: np.ndarray, now: int, read: bool) -> None:
        """Count a read (``uses``) and stamp ``now`` (``stamp``) where the policy keeps them."""
        if read and self.uses is not None:
            self.uses[slots] += 1
        if self.stamp is not None:
            self.stamp[slots] = now

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` free slots, ``(n,) int32``, growing the pool when too few are free."""
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
            if self.owner is not None:
                self.owner = np.concatenate([self.owner, np.full(grow, ABSENT, np.uint32)])
            self.free = np.concatenate(
                [np.arange(new_cap - 1, cap - 1, -1, dtype=np.int32), self.free]
            )
        out = self.free[self.free.size - n :][::-1].copy()  # lowest first: an ascending run
        self.free = self.free[: self.free.size - n]
        return out

    def remove_positions(
        self, pos: np.ndarray, live: tuple[np.ndarray, np.ndarray] | None = None
    ) -> None:
        """Drop the keys at positions ``pos (r,)`` (unique) of :meth:`live`'s order (``live``:
        its answer, when the caller has it); their slots are freed in ``pos`` order."""
        if self.direct is not None:
            keys, slots = live if live is not None else self.live()
            self._drop_direct(keys[pos], slots[pos])
            return
        keys, slots = live if live is not None else self.live()
        self.sorted_index.remove(keys[pos], slots[pos])
        self.free = np.concatenate([self.free, slots[pos].astype(np.int32)])

    def remove_keys(self, keys: np.ndarray) -> None:
        """Drop held keys ``keys (r,) int64`` (ascending, unique); slots freed in that order."""
        if self.direct is not None:
            self._drop_direct(keys, self.direct[keys].astype(np.int64))
            return
        _, slots = self.sorted_index.find(keys)
        self.sorted_index.remove(keys, slots)
        self.free = np.concatenate([self.free, slots.astype(np.int32)])

    def _drop_direct(self, keys: np.ndarray, slots: np.ndarray) -> None:
        assert self.direct is not None  # the caller's layout
        self.direct[keys] = ABSENT
        self.n_direct -= int(keys.size)
        if self.owner is not None:
            self.owner[slots] = ABSENT
        self.free = np.concatenate([self.free, slots.astype(np.int32)])

    def trim(self, live: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Compact to a pool of exactly the rows held (no free slot) if any slot is free
        (``live``: :meth:`live`'s answer, when the caller has it)."""
        if self.free.size:
            self._compact(self.size, live)

    def maybe_compact(self) -> bool:
        """Compact if the free slots outgrew half the live rows (to ``capacity = live ×
        9/8``) or the sorted index needs a merge; whether it did. Call WITHOUT :attr:`lock`,
        holding the writer's lock (no other write meanwhile): the new pool and index are built
        outside :attr:`lock`, lookups reading the old ones, and swapped in under it."""
        with self.lock:
            live = self.size
            if self.free.size > max(_MIN_GROWTH, live // 2):
                capacity = live + live // 8
            elif self.direct is None and self.sorted_index.needs_merge():
                capacity = self.rows.shape[0]
            else:
                return False
        self._compact(capacity, swap_lock=self.lock)
        return True

    def _compact(
        self,
        capacity: int,
        held: tuple[np.ndarray, np.ndarray] | None = None,
        swap_lock: threading.Lock | None = None,
    ) -> None:
        """Copy the live rows to slots ``0..live-1`` (key order) of a pool of ``capacity``;
        the new pool and index are built first, then swapped in under ``swap_lock`` (``None``:
        the caller holds :attr:`lock` throughout)."""
        keys, slots = held if held is not None else self.live()
        live = int(keys.size)
        rows = np.zeros((capacity, self.rows.shape[1]), np.uint8)
        rows[:live] = self.rows[slots]
        index = None
        if self.direct is None:
            index = SortedIndex(compact=self.sorted_index.compact)
            index.reset(keys)
        with swap_lock if swap_lock is not None else contextlib.nullcontext():
            self.rows = rows
            for name in ("uses", "stamp"):  # lookups write these: copied under the lock
                old = getattr(self, name)
                if old is not None:
                    new = np.zeros(capacity, np.int64)
                    new[:live] = old[slots]
                    setattr(self, name, new)
            if index is None:
                assert self.direct is not None  # the layout, unchanged by the writer's lock
                self.direct[keys] = np.arange(live, dtype=np.uint32)
                if self.owner is not None:
                    self.owner = np.full(capacity, ABSENT, np.uint32)
                    self.owner[:live] = keys
            else:
                self.sorted_index = index
            self.free = np.arange(capacity - 1, live - 1, -1, dtype=np.int32)

    def nbytes(self) -> int:
        """Bytes of the pool, its free list, use counts or stamps, slot owners, and the sorted
        index (a direct index is the table's: :meth:`HashMapBackend.nbytes` counts it once)."""
        arrays: list[np.ndarray] = [self.rows, self.free]
        arrays += [a for a in (self.uses, self.stamp, self.owner) if a is not None]
        return sum(int(a.nbytes) for a in arrays) + self.sorted_index.nbytes()
