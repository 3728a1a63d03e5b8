"""The in-process volatile database: a partitioned, vectorised hash map of embedding rows.

Each table is split into ``num_partitions`` partitions by ``mix64(key) % num_partitions``.
A partition keeps a sorted key index and a slot pool of rows::

    keys   = [ 3,  7, 42]      sorted, (m,) int64          lookup = np.searchsorted(keys, q)
    slots  = [ 1,  0,  2]      row slot of each key         insert = np.insert at those positions
    values = [[row of 7], [row of 3], [row of 42], <free>]  (capacity, dim) float32
    uses   = [ 5, 1, 2, -]     reads per slot               (evict_least_used)
    stamp  = [90, 12, 40, -]   clock of the last read/write (evict_oldest)

Every operation is a handful of numpy calls per partition touched (a loop over partitions,
never over keys). When a partition holds more than ``overflow_margin`` rows after an insert it
evicts rows by ``overflow_policy`` until it holds ``overflow_resolution_target ×
overflow_margin`` (HugeCTR's semantics).
"""

from __future__ import annotations

import itertools
import logging
import threading

import numpy as np

from hps.types import OverflowPolicy, StorageBackend, check_keys, check_values, mix64

log = logging.getLogger(__name__)

_INITIAL_CAPACITY = 1024  # rows per partition before the first growth


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
    def __init__(self, dim: int) -> None:
        self.lock = threading.Lock()
        self.keys = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int64)
        self.values = np.zeros((_INITIAL_CAPACITY, dim), np.float32)
        self.uses = np.zeros(_INITIAL_CAPACITY, np.int64)
        self.stamp = np.zeros(_INITIAL_CAPACITY, np.int64)
        self.free = np.arange(_INITIAL_CAPACITY - 1, -1, -1, dtype=np.int64)  # a stack

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found (k,) bool, slot of each found key (f,) int64)``."""
        if self.keys.size == 0:
            return np.zeros(q.size, bool), np.zeros(0, np.int64)
        pos = np.searchsorted(self.keys, q)
        pos = np.minimum(pos, self.keys.size - 1)
        found = self.keys[pos] == q
        return found, self.slots[pos[found]]

    def allocate(self, n: int) -> np.ndarray:
        if self.free.size < n:
            cap = self.values.shape[0]
            new_cap = max(2 * cap, cap + n - self.free.size)
            grow = new_cap - cap
            self.values = np.concatenate(
                [self.values, np.zeros((grow, self.values.shape[1]), np.float32)]
            )
            self.uses = np.concatenate([self.uses, np.zeros(grow, np.int64)])
            self.stamp = np.concatenate([self.stamp, np.zeros(grow, np.int64)])
            self.free = np.concatenate(
                [np.arange(new_cap - 1, cap - 1, -1, dtype=np.int64), self.free]
            )
        out = self.free[self.free.size - n :]
        self.free = self.free[: self.free.size - n]
        return out

    def remove_positions(self, pos: np.ndarray) -> None:
        self.free = np.concatenate([self.free, self.slots[pos]])
        keep = np.ones(self.keys.size, bool)
        keep[pos] = False
        self.keys, self.slots = self.keys[keep], self.slots[keep]


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
        self._tables: dict[str, tuple[int, list[_Partition]]] = {}
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.evicted = 0  # rows evicted by overflow handling, all tables

    def create_table(self, table: str, dim: int) -> None:
        with self._lock:
            if table in self._tables:
                if self._tables[table][0] != dim:
                    raise ValueError(
                        f"table {table!r} exists with dim {self._tables[table][0]}, not {dim}"
                    )
                return
            self._tables[table] = (dim, [_Partition(dim) for _ in range(self.num_partitions)])

    def _table(self, table: str) -> tuple[int, list[_Partition]]:
        try:
            return self._tables[table]
        except KeyError:
            raise ValueError(
                f"volatile db has no table {table!r}; tables: {sorted(self._tables)}"
            ) from None

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = check_keys(keys)
        dim, parts = self._table(table)
        out = np.zeros((keys.size, dim), np.float32)
        found = np.zeros(keys.size, bool)
        now = next(self._clock)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = parts[p]
            with part.lock:
                hit, slots = part.find(keys[idx])
                out[idx[hit]] = part.values[slots]
                part.uses[slots] += 1
                part.stamp[slots] = now
            found[idx] = hit
        return out, found

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert or overwrite rows.

        Args:
            keys: ``(n,) int64``, unique within the call.
            values: ``(n, dim) float32``.

        Raises:
            ValueError: for an unknown table, bad shapes, or a key given twice (it would get
                two rows, and a delete would leave one); nothing is inserted then.
        """
        keys = check_keys(keys)
        dim, parts = self._table(table)
        values = check_values(values, keys.size, dim)
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
        now = next(self._clock)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = parts[p]
            q = keys[idx]
            with part.lock:
                hit, slots = part.find(q)
                part.values[slots] = values[idx[hit]]
                part.stamp[slots] = now
                new = ~hit
                if new.any():
                    nk = q[new]
                    order = np.argsort(nk, kind="stable")
                    nk = nk[order]
                    ns = part.allocate(nk.size)
                    part.values[ns] = values[idx[new][order]]
                    part.uses[ns] = 0
                    part.stamp[ns] = now
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

    def delete(self, table: str, keys: np.ndarray) -> None:
        """Remove rows (missing keys are ignored)."""
        keys = check_keys(keys)
        _, parts = self._table(table)
        for p, idx in split_by_partition(keys, self.num_partitions):
            part = parts[p]
            with part.lock:
                if part.keys.size == 0:
                    continue
                pos = np.minimum(np.searchsorted(part.keys, keys[idx]), part.keys.size - 1)
                pos = pos[part.keys[pos] == keys[idx]]
                part.remove_positions(np.unique(pos))

    def nbytes(self, table: str) -> int:
        """Bytes ``table`` holds in this map: row slots (held or free), their use counts and
        stamps, the free list, and the sorted key index."""
        _, parts = self._table(table)
        total = 0
        for p in parts:
            with p.lock:
                arrays = (p.values, p.uses, p.stamp, p.free, p.keys, p.slots)
                total += sum(a.nbytes for a in arrays)
        return total

    def size(self, table: str) -> int:
        _, parts = self._table(table)
        return int(sum(p.keys.size for p in parts))
