"""The sorted key index of a hash-map partition (:mod:`hps.storage.hash_partition`) whose
pool keeps its rows in key order, so that the index is the keys alone.

Two levels, as a log-structured merge tree with one level below memory's own (O'Neil et al.,
1996): the *main* part, sorted keys whose rows are the pool's first slots in the same order
(key ``i`` in slot ``i``: no slot array), and a small *side* part of sorted keys with explicit
slots for the keys inserted since the last merge. Worked example, a partition of 5 slots::

    main   keys = [3, 7, 42, 50]     key i's row in slot i         4 B per key (uint32) or
           dead = [F, T, F,  F]      7 deleted (its slot free)     8 B (int64), 1 B per key
                                                                   once a key is deleted
    side   keys = [9, 60]            int64, sorted                 12 B per key
           slots = [4, 1]            60 reuses 7's freed slot
    rows   = [[3], [60], [42], [50], [9]]

A lookup binary-searches the main part, then (the keys it does not find there) the side part:
O(log n) per key. A new key larger than every main key stored in the next slot of the main
run is appended to the main part (an ascending load stays there, at 4 B per key); any other new key goes
to the side part. When the side part outgrows ``MERGE_FRACTION`` of the main part (or the
deleted keys ``DEAD_FRACTION``), the partition merges: it copies its live rows to the front of
the pool in key order (:meth:`~hps.storage.hash_partition.Partition`'s compaction) and the
main part becomes every live key again. A merge costs O(rows) and happens once per
``MERGE_FRACTION × rows`` inserts: O(1) amortised per insert, and the side part (12 B per key)
costs at most ``12 × MERGE_FRACTION`` ≈ 1.5 B per row.

Main keys are uint32 while each is in ``[0, 2**32)`` (``compact``). Beyond that range, sorted
keys sharing their high 32 bits are one run, so a compact main part of at most ``MAX_RUNS``
runs keeps each key's low 32 bits and, per run, its high word and first position::

    keys  = [-3, -1, 2**40 + 5, 2**40 + 9]  →  keys (low words, uint32) = [2**32 - 3,
                                                  2**32 - 1, 5, 9]
                                               run_words = [-1, 256]  run_starts = [0, 2, 4]

(4 B per key + 16 B per run); a lookup finds its key's run by its high word, then searches
that run's low words. More runs (64-bit hashed keys) are held as int64 (8 B per key).
"""

from __future__ import annotations

import numpy as np

__all__ = ["DEAD_FRACTION", "KEY_LIMIT", "MAX_RUNS", "MERGE_FRACTION", "MIN_MERGE", "SortedIndex"]

KEY_LIMIT = 2**32  # uint32 keys are below this
MERGE_FRACTION = 8  # merge when the side part holds more than main / 8 keys ...
DEAD_FRACTION = 4  # ... or main / 4 keys of the main part are deleted
MIN_MERGE = 64  # ... and more than this many (small partitions do not merge at every insert)
MAX_RUNS = 64  # high words a compact main part keeps as runs (a lookup visits those it needs)


def _fits_u32(keys: np.ndarray) -> bool:
    """Whether every one of ``keys`` (ascending) is in ``[0, 2**32)``."""
    return keys.size == 0 or (int(keys[0]) >= 0 and int(keys[-1]) < KEY_LIMIT)


class SortedIndex:
    """The key index of a partition in a sorted layout (the module docstring).

    Args:
        compact: hold the main keys as uint32 while they fit (``False``: int64 always).
    """

    def __init__(self, compact: bool) -> None:
        self.compact = compact
        self.keys = np.zeros(0, np.uint32 if compact else np.int64)  # main: key i in slot i
        #: runs of the main part's keys: ``(high words (h,) int64, starts (h + 1,) int64)``,
        #: with ``keys`` their low words; ``None``: ``keys`` are the keys
        self.runs: tuple[np.ndarray, np.ndarray] | None = None
        self.dead: np.ndarray | None = None  # (main,) bool, allocated at the first delete
        self.n_dead = 0
        self.side_keys = np.zeros(0, np.int64)
        self.side_slots = np.zeros(0, np.int32)

    @property
    def size(self) -> int:
        """Keys held (main keys not deleted, and side keys)."""
        return int(self.keys.size) - self.n_dead + int(self.side_keys.size)

    @property
    def wide(self) -> bool:
        """Whether the main keys are int64 (a key outside ``[0, 2**32)``, or not ``compact``)
        or a side key is outside ``[0, 2**32)``."""
        return self.keys.dtype == np.int64 or self.runs is not None or not _fits_u32(self.side_keys)

    def main_keys(self, pos: np.ndarray) -> np.ndarray:
        """``(k,) int64``: the main part's keys at positions ``pos (k,) int64``."""
        if self.runs is None:
            return self.keys[pos].astype(np.int64)
        words, starts = self.runs
        r = np.searchsorted(starts, pos, side="right") - 1
        return (words[r] << 32) | self.keys[pos].astype(np.int64)

    def extent(self) -> tuple[int, int] | None:
        """``(lowest, highest)`` key held, ``None`` when empty."""
        lo: list[int] = []
        hi: list[int] = []
        if self.keys.size > self.n_dead:
            first, last = 0, self.keys.size - 1
            if self.dead is not None:  # argmax stops at the first live key
                first = int(np.argmax(~self.dead))
                last = self.keys.size - 1 - int(np.argmax(~self.dead[::-1]))
            ends = self.main_keys(np.array([first, last], np.int64))
            lo.append(int(ends[0]))
            hi.append(int(ends[1]))
        if self.side_keys.size:
            lo.append(int(self.side_keys[0]))
            hi.append(int(self.side_keys[-1]))
        return (min(lo), max(hi)) if lo else None

    def _main_pos(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found in the main part (k,) bool, position (k,) int64)``."""
        m = self.keys.size
        if m == 0:
            return np.zeros(q.size, bool), np.zeros(q.size, np.int64)
        if self.runs is not None:
            found, pos = self._run_pos(q)
        elif self.keys.dtype == np.uint32:  # compare as uint32: never widen the whole index
            qq = q.astype(np.uint32)  # keys outside [0, 2**32) wrap: dropped below
            pos = np.minimum(np.searchsorted(self.keys, qq), m - 1)
            found = (self.keys[pos] == qq) & (q >= 0) & (q < KEY_LIMIT)
        else:
            pos = np.minimum(np.searchsorted(self.keys, q), m - 1)
            found = self.keys[pos] == q
        if self.dead is not None:
            found &= ~self.dead[pos]
        return found, pos.astype(np.int64)

    def _run_pos(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_main_pos` of run-encoded keys: each key's run by its high word, then a
        search of that run's low words (one search per run the keys touch)."""
        assert self.runs is not None  # the caller's layout
        words, starts = self.runs
        found = np.zeros(q.size, bool)
        pos = np.zeros(q.size, np.int64)
        hi = q >> 32
        r = np.minimum(np.searchsorted(words, hi), words.size - 1)
        known = words[r] == hi
        lo = (q & 0xFFFFFFFF).astype(np.uint32)
        for run in np.unique(r[known]):
            at = np.flatnonzero(known & (r == run))
            a, b = int(starts[run]), int(starts[run + 1])
            p = np.minimum(np.searchsorted(self.keys[a:b], lo[at]), b - a - 1)
            found[at] = self.keys[a + p] == lo[at]
            pos[at] = a + p
        return found, pos

    def _side_pos(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found in the side part (k,) bool, position (k,) int64)``."""
        m = self.side_keys.size
        if m == 0:
            return np.zeros(q.size, bool), np.zeros(q.size, np.int64)
        pos = np.minimum(np.searchsorted(self.side_keys, q), m - 1)
        return self.side_keys[pos] == q, pos

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found (k,) bool, slot of each found key (f,) int64)``."""
        found, slot = self._main_pos(q)
        if self.side_keys.size:
            rest = np.flatnonzero(~found)
            f2, pos = self._side_pos(q[rest])
            hit = rest[f2]
            found[hit] = True
            slot[hit] = self.side_slots[pos[f2]]
        return found, slot[found]

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys (m,) int64 ascending, their slots (m,) int64)`` of every key held."""
        if self.dead is None:
            ms = np.arange(self.keys.size, dtype=np.int64)
        else:
            ms = np.flatnonzero(~self.dead)
        mk = self.main_keys(ms)
        if self.side_keys.size == 0:
            return mk, ms
        keys = np.concatenate([mk, self.side_keys])
        slots = np.concatenate([ms, self.side_slots.astype(np.int64)])
        order = np.argsort(keys, kind="stable")  # two sorted runs: a merge
        return keys[order], slots[order]

    def add(self, nk: np.ndarray, ns: np.ndarray) -> None:
        """Index new keys ``nk (k,) int64`` (ascending, none held) in slots ``ns (k,)``:
        appended to the main part when they follow it in keys and slots, else to the side."""
        if nk.size == 0:
            return
        m = self.keys.size
        follows = m == 0 or int(nk[0]) > int(self.main_keys(np.array([m - 1]))[0])
        if follows and int(ns[0]) == m and np.array_equal(ns, np.arange(m, m + nk.size)):
            dead = self.dead
            self.reset(np.concatenate([self.main_keys(np.arange(m)), nk]), keep=True)
            if dead is not None:
                self.dead = np.concatenate([dead, np.zeros(nk.size, bool)])
            return
        pos = np.searchsorted(self.side_keys, nk)
        self.side_keys = np.insert(self.side_keys, pos, nk)
        self.side_slots = np.insert(self.side_slots, pos, ns.astype(np.int32))

    def remove(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Drop held ``keys (r,) int64`` (unique) whose slots are ``slots (r,) int64``."""
        m = self.keys.size
        inside = slots < m
        s = np.where(inside, slots, 0)
        main = inside & (self.main_keys(s) == keys) if m else inside
        if self.dead is not None:
            main &= ~self.dead[s]
        if main.any():
            if self.dead is None:
                self.dead = np.zeros(m, bool)
            self.dead[slots[main]] = True
            self.n_dead += int(main.sum())
        side = keys[~main]
        if side.size:
            pos = np.searchsorted(self.side_keys, np.sort(side))
            self.side_keys = np.delete(self.side_keys, pos)
            self.side_slots = np.delete(self.side_slots, pos)

    def needs_merge(self) -> bool:
        """Whether the side part or the deleted keys outgrew their share of the main part."""
        m = self.keys.size
        return self.side_keys.size > max(MIN_MERGE, m // MERGE_FRACTION) or self.n_dead > max(
            MIN_MERGE, m // DEAD_FRACTION
        )

    def reset(self, keys: np.ndarray, keep: bool = False) -> None:
        """Make ``keys (m,) int64`` (ascending) the main part, key ``i`` in slot ``i``
        (``keep``: the side part and deleted marks stay, the caller's)."""
        self.runs = None
        if not self.compact:
            self.keys = keys.astype(np.int64)
        elif _fits_u32(keys):
            self.keys = keys.astype(np.uint32)
        else:
            hi = keys >> 32
            cut = np.flatnonzero(hi[1:] != hi[:-1]) + 1
            if cut.size < MAX_RUNS:
                starts = np.concatenate([[0], cut, [keys.size]]).astype(np.int64)
                self.runs = (hi[starts[:-1]], starts)
                self.keys = (keys & 0xFFFFFFFF).astype(np.uint32)
            else:
                self.keys = keys.astype(np.int64)
        if keep:
            return
        self.dead, self.n_dead = None, 0
        self.side_keys = np.zeros(0, np.int64)
        self.side_slots = np.zeros(0, np.int32)

    def clear(self) -> None:
        """Hold no key (the table switched to a direct index)."""
        self.reset(np.zeros(0, np.int64))

    def narrow(self) -> None:
        """Store int64 main keys as uint32 when every one is in ``[0, 2**32)``."""
        if self.compact and self.keys.dtype == np.int64 and _fits_u32(self.keys):
            self.keys = self.keys.astype(np.uint32)

    def nbytes(self) -> int:
        """Bytes of the main keys, the deleted marks and the side part."""
        arrays = [self.keys, self.side_keys, self.side_slots]
        if self.runs is not None:
            arrays += list(self.runs)
        if self.dead is not None:
            arrays.append(self.dead)
        return sum(int(a.nbytes) for a in arrays)
