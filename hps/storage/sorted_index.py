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
run is appended to the main part (an ascending load stays there, at 4 B per key): written in
place in an over-allocated buffer that doubles when full (O(1) amortised per key; the buffer
is at most twice the main keys until the next merge). Any other new key goes to the side
part, two sorted levels: a small one of at most ``max(MIN_MERGE, √s)`` keys (``s`` the larger
level's size) takes the inserts (O(√s) to insert into), and is merged into the larger one
when full (O(s) once per √s inserts): O(√s) amortised per side insert, ``s ≤ rows / 8``. When
the side part outgrows ``MERGE_FRACTION`` of the main part (or the deleted keys
``DEAD_FRACTION``), the partition merges: it copies its live rows to the front of the pool in
key order (:meth:`~hps.storage.hash_partition.Partition`'s compaction) and the main part
becomes every live key again. A merge costs O(rows) and happens once per
``MERGE_FRACTION × rows`` inserts: O(1) amortised per insert, and the side part (12 B per key)
costs at most ``12 / MERGE_FRACTION`` = 1.5 B per row. The live main keys' first and last
positions are kept by deletes (O(deleted keys passed)), so that :meth:`SortedIndex.extent` is
O(1).

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

import math

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
        #: the main keys' buffer, over-allocated so that appends write in place
        self._buf = np.zeros(0, np.uint32 if compact else np.int64)
        self.keys = self._buf  # main: key i in slot i (a view of ``_buf``'s first keys)
        #: runs of the main part's keys: ``(high words (h,) int64, starts (h + 1,) int64)``,
        #: with ``keys`` their low words; ``None``: ``keys`` are the keys
        self.runs: tuple[np.ndarray, np.ndarray] | None = None
        self._dead_buf: np.ndarray | None = None  # deleted marks' buffer, from the first delete
        self.dead: np.ndarray | None = None  # (main,) bool, a view of ``_dead_buf``
        self.n_dead = 0
        self._lo = self._hi = 0  # positions of the first and last live main keys (if any)
        self.side_keys = np.zeros(0, np.int64)  # side part: the larger sorted level
        self.side_slots = np.zeros(0, np.int32)
        self.tail_keys = np.zeros(0, np.int64)  # side part: the smaller sorted level
        self.tail_slots = np.zeros(0, np.int32)

    @property
    def size(self) -> int:
        """Keys held (main keys not deleted, and side keys)."""
        return int(self.keys.size) - self.n_dead + self.side_size

    @property
    def side_size(self) -> int:
        """Keys in the side part (both its levels)."""
        return int(self.side_keys.size) + int(self.tail_keys.size)

    @property
    def capacity(self) -> int:
        """Main keys the buffer holds before an append reallocates it."""
        return int(self._buf.size)

    @property
    def wide(self) -> bool:
        """Whether the main keys are int64 (a key outside ``[0, 2**32)``, or not ``compact``)
        or a side key is outside ``[0, 2**32)``."""
        return (
            self.keys.dtype == np.int64
            or self.runs is not None
            or not _fits_u32(self.side_keys)
            or not _fits_u32(self.tail_keys)
        )

    def main_keys(self, pos: np.ndarray) -> np.ndarray:
        """``(k,) int64``: the main part's keys at positions ``pos (k,) int64``."""
        if self.runs is None:
            return self.keys[pos].astype(np.int64)
        words, starts = self.runs
        r = np.searchsorted(starts, pos, side="right") - 1
        return (words[r] << 32) | self.keys[pos].astype(np.int64)

    def extent(self) -> tuple[int, int] | None:
        """``(lowest, highest)`` key held, ``None`` when empty: O(1) (the live main keys'
        bounds are kept by :meth:`remove` and :meth:`add`)."""
        lo: list[int] = []
        hi: list[int] = []
        if self.keys.size > self.n_dead:
            ends = self.main_keys(np.array([self._lo, self._hi], np.int64))
            lo.append(int(ends[0]))
            hi.append(int(ends[1]))
        for part in (self.side_keys, self.tail_keys):
            if part.size:
                lo.append(int(part[0]))
                hi.append(int(part[-1]))
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

    @staticmethod
    def _level_pos(keys: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found in ``keys`` (k,) bool, position (k,) int64)``."""
        m = keys.size
        if m == 0:
            return np.zeros(q.size, bool), np.zeros(q.size, np.int64)
        pos = np.minimum(np.searchsorted(keys, q), m - 1)
        return keys[pos] == q, pos

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``q (k,) int64`` → ``(found (k,) bool, slot of each found key (f,) int64)``."""
        found, slot = self._main_pos(q)
        for keys, slots in ((self.side_keys, self.side_slots), (self.tail_keys, self.tail_slots)):
            if keys.size:
                rest = np.flatnonzero(~found)
                f2, pos = self._level_pos(keys, q[rest])
                hit = rest[f2]
                found[hit] = True
                slot[hit] = slots[pos[f2]]
        return found, slot[found]

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys (m,) int64 ascending, their slots (m,) int64)`` of every key held."""
        if self.dead is None:
            ms = np.arange(self.keys.size, dtype=np.int64)
        else:
            ms = np.flatnonzero(~self.dead)
        mk = self.main_keys(ms)
        if self.side_size == 0:
            return mk, ms
        keys = np.concatenate([mk, self.side_keys, self.tail_keys])
        slots = np.concatenate([ms, self.side_slots, self.tail_slots]).astype(np.int64)
        order = np.argsort(keys, kind="stable")  # sorted runs: a merge
        return keys[order], slots[order]

    def add(self, nk: np.ndarray, ns: np.ndarray) -> None:
        """Index new keys ``nk (k,) int64`` (ascending, none held) in slots ``ns (k,)``:
        appended to the main part when they follow it in keys and slots (O(k) amortised),
        else to the side part (O(k + √side) amortised)."""
        if nk.size == 0:
            return
        m = self.keys.size
        follows = m == 0 or int(nk[0]) > int(self.main_keys(np.array([m - 1]))[0])
        if follows and int(ns[0]) == m and np.array_equal(ns, np.arange(m, m + nk.size)):
            self._append(nk)
            return
        pos = np.searchsorted(self.tail_keys, nk)
        self.tail_keys = np.insert(self.tail_keys, pos, nk)
        self.tail_slots = np.insert(self.tail_slots, pos, ns.astype(np.int32))
        if self.tail_keys.size > max(MIN_MERGE, math.isqrt(self.side_keys.size)):
            at = np.searchsorted(self.side_keys, self.tail_keys)
            self.side_keys = np.insert(self.side_keys, at, self.tail_keys)
            self.side_slots = np.insert(self.side_slots, at, self.tail_slots)
            self.tail_keys = self.tail_keys[:0]
            self.tail_slots = self.tail_slots[:0]

    def _append(self, nk: np.ndarray) -> None:
        """Append ``nk (k,) int64`` (ascending, above every main key) to the main part, in
        place in its over-allocated buffer (the buffer doubles when full: O(k) amortised);
        a new run only where the high word changes."""
        m = self.keys.size
        total = m + int(nk.size)
        self._lo = m if self.n_dead == m else self._lo  # no live main key before these
        self._hi = total - 1
        if m == 0:
            self.reset(nk, keep=True)
            self.dead, self._dead_buf = None, None  # no main key: none deleted
            return
        if self.runs is None and (self.keys.dtype == np.int64 or _fits_u32(nk)):
            low = nk.astype(self.keys.dtype)
        else:  # compact keys with runs (or the first key beyond uint32: word 0 so far)
            words, starts = self.runs or (np.zeros(1, np.int64), np.array([0, m], np.int64))
            hi = nk >> 32
            cut = np.flatnonzero(hi[1:] != hi[:-1]) + 1
            new_words = hi[np.concatenate([[0], cut])]
            inner = m + cut
            if int(new_words[0]) == int(words[-1]):  # the first new keys extend the last run
                new_words = new_words[1:]
            else:
                inner = np.concatenate([[m], inner])
            if words.size + new_words.size > MAX_RUNS:  # too many runs: int64 keys
                dead = self.dead
                self.reset(np.concatenate([self.main_keys(np.arange(m)), nk]), keep=True)
                if dead is not None:
                    self._dead_buf = np.zeros(total, bool)
                    self._dead_buf[:m] = dead
                    self.dead = self._dead_buf
                return
            self.runs = (
                np.concatenate([words, new_words]),
                np.concatenate([starts[:-1], inner, [total]]).astype(np.int64),
            )
            low = (nk & 0xFFFFFFFF).astype(np.uint32)
        if total > self._buf.size:
            buf = np.empty(max(total, 2 * self._buf.size), self._buf.dtype)
            buf[:m] = self.keys
            self._buf = buf
        self._buf[m:total] = low
        self.keys = self._buf[:total]
        if self._dead_buf is not None:
            if total > self._dead_buf.size:
                grown = np.zeros(self._buf.size, bool)
                grown[:m] = self._dead_buf[:m]
                self._dead_buf = grown
            self._dead_buf[m:total] = False
            self.dead = self._dead_buf[:total]

    def remove(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Drop held ``keys (r,) int64`` (unique) whose slots are ``slots (r,) int64``."""
        m = self.keys.size
        inside = slots < m
        s = np.where(inside, slots, 0)
        main = inside & (self.main_keys(s) == keys) if m else inside
        if self.dead is not None:
            main &= ~self.dead[s]
        if main.any():
            if self._dead_buf is None:
                self._dead_buf = np.zeros(self._buf.size, bool)
            self.dead = self._dead_buf[:m]
            self.dead[slots[main]] = True
            self.n_dead += int(main.sum())
            if self.n_dead < m:
                self._lo = self._live_from(self._lo, 1)
                self._hi = self._live_from(self._hi, -1)
        side = np.sort(keys[~main])
        if side.size:
            in_side, pos = self._level_pos(self.side_keys, side)
            self.side_keys = np.delete(self.side_keys, pos[in_side])
            self.side_slots = np.delete(self.side_slots, pos[in_side])
            _, pos = self._level_pos(self.tail_keys, side[~in_side])
            self.tail_keys = np.delete(self.tail_keys, pos)
            self.tail_slots = np.delete(self.tail_slots, pos)

    def _live_from(self, p: int, step: int) -> int:
        """The first live main position from ``p`` on in direction ``step`` (±1), some live:
        O(deleted keys passed), in doubling chunks."""
        assert self.dead is not None  # the caller's: a key was deleted
        chunk = 64
        while True:
            if step > 0:
                live = np.flatnonzero(~self.dead[p : p + chunk])
                if live.size:
                    return p + int(live[0])
                p += chunk
            else:
                a = max(0, p - chunk + 1)
                live = np.flatnonzero(~self.dead[a : p + 1])
                if live.size:
                    return a + int(live[-1])
                p = a - 1
            chunk *= 2

    def needs_merge(self) -> bool:
        """Whether the side part or the deleted keys outgrew their share of the main part."""
        m = self.keys.size
        return self.side_size > max(MIN_MERGE, m // MERGE_FRACTION) or self.n_dead > max(
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
        self._buf = self.keys
        if keep:
            return
        self._lo, self._hi = 0, int(keys.size) - 1
        self.dead, self._dead_buf, self.n_dead = None, None, 0
        self.side_keys = np.zeros(0, np.int64)
        self.side_slots = np.zeros(0, np.int32)
        self.tail_keys = np.zeros(0, np.int64)
        self.tail_slots = np.zeros(0, np.int32)

    def clear(self) -> None:
        """Hold no key (the table switched to a direct index)."""
        self.reset(np.zeros(0, np.int64))

    def narrow(self) -> None:
        """Store int64 main keys as uint32 when every one is in ``[0, 2**32)``. Run-encoded
        keys stay runs until the next merge (a run may hold only deleted keys)."""
        if self.compact and self.keys.dtype == np.int64 and _fits_u32(self.keys):
            self.keys = self.keys.astype(np.uint32)
            self._buf = self.keys

    def nbytes(self) -> int:
        """Bytes of the main keys' buffer, the deleted marks and the side part."""
        arrays = [self._buf, self.side_keys, self.side_slots, self.tail_keys, self.tail_slots]
        if self.runs is not None:
            arrays += list(self.runs)
        if self._dead_buf is not None:
            arrays.append(self._dead_buf)
        return sum(int(a.nbytes) for a in arrays)
