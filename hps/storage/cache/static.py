"""The static embedding cache: a cache that can hold every row of its table, so each of the
table's keys owns one slot fixed when the cache is built (HugeCTR HPS's ``static`` embedding
cache, for tables that fit whole). No sets, no victims, no evictions: a key of the table misses
only until its row is first inserted (or after it is invalidated), never because other keys
took its place.

The parameter server builds one instead of a set-associative :class:`EmbeddingCache` when a
model's cache covers the whole table (``gpucacheper × rows ≥ rows``, i.e. ``gpucacheper`` 1.0,
on the CPU) and it knows the table's keys (it loaded them). A full-size set-associative cache
cannot hold every row: 64-way sets receiving more than 64 of the table's keys keep evicting
(1.6 % of the tiny model's keys missed on every pass over them).

Where a key's slot is, by the table's keys (``n`` of them, unique), chosen once::

    IDENTITY   keys are 0 .. n-1 (what exports write):  slot = key          no index bytes
    SORTED     any other keys:  slot = rank of the key in sorted(keys)      8 B per row
               keys  [70, 3, 12]  →  sorted [3, 12, 70]:  3 → 0, 12 → 1, 70 → 2

    keys     (1, n) int32|int64   the key whose row a slot holds (-1 / EMPTY_KEY: absent)
    tags     (1, n) uint8         tag_of(key) while the slot holds its row, 0 while it does not
    storage  (n, row_bytes) uint8 slot s's row, in ``row_format``

It is an :class:`EmbeddingCache` (one set of ``n`` ways, so every method of the set-associative
cache holds for it): lookups, insertion of misses, online updates (``update_if_present``),
refresh, invalidation, statistics, bytes (``nbytes``, its index included) and the exclusive
tiers (an attached in-process hash map moves a row up on insertion; nothing is ever evicted, so
nothing moves back down except on invalidation) behave as documented for the cache. A key
outside the table's keys (added later by an online update) is never placed (``overflowed``):
the tiers below answer it on every lookup, as for any key a cache does not hold.

The fused multi-table lookup (:mod:`hps.session.fused`) probes a static cache with
:func:`hps.session.static_gather.gather_static` (a slot computed, then read), never with the
set probe of the compiled kernel.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
import torch

from hps.rowformat import RowDtype
from hps.storage.cache.index import EMPTY_KEY, tag_of
from hps.storage.cache.records import Placed
from hps.storage.cache.set_associative import EmbeddingCache
from hps.types import CachePolicy

__all__ = ["StaticEmbeddingCache", "StaticLayout"]


class StaticLayout(StrEnum):
    """Where a static cache finds a key's slot (module docstring)."""

    IDENTITY = "identity"  # keys 0 .. n-1: the slot is the key
    SORTED = "sorted"  # any keys: the key's rank among the sorted keys


class StaticEmbeddingCache(EmbeddingCache):
    """A cache with one fixed slot per key of its table (module docstring).

    Args:
        keys: ``(n,) int64`` the table's keys, unique (any order); the cache holds ``n`` rows.
        dim: row width.
        policy: reported as the cache's policy (a static cache replaces nothing).
        device: where keys, tags and rows live.
        row_format: how ``storage`` holds a row (the table's dtype).

    Raises:
        ValueError: no keys, a key given twice, or the reserved key ``-2**63``.
    """

    def __init__(
        self,
        keys: np.ndarray | torch.Tensor,
        dim: int,
        policy: CachePolicy | str = CachePolicy.LRU,
        device: torch.device | str = "cpu",
        row_format: RowDtype | str = RowDtype.FP32,
    ) -> None:
        k = torch.from_numpy(np.array(keys, dtype=np.int64).reshape(-1))  # a copy
        n = int(k.numel())
        if n == 0:
            raise ValueError("a static cache needs the table's keys, got none")
        sorted_keys = torch.sort(k).values
        dup = torch.nonzero(sorted_keys[1:] == sorted_keys[:-1]).squeeze(1)
        if dup.numel():
            raise ValueError(
                f"a static cache's keys must be unique, but key {int(sorted_keys[int(dup[0])])} "
                f"occurs more than once"
            )
        lo, hi = int(sorted_keys[0]), int(sorted_keys[-1])
        if lo == EMPTY_KEY:
            raise ValueError(f"key {EMPTY_KEY} is reserved (the empty-slot sentinel)")
        super().__init__(
            n,
            dim,
            policy=policy,
            ways=n,  # one set of every slot: the set-associative methods hold as they are
            device=device,
            lfu_decay_keys_per_slot=0,
            row_format=row_format,
        )
        #: how a key's slot is found
        self.layout = StaticLayout.IDENTITY if (lo, hi) == (0, n - 1) else StaticLayout.SORTED
        #: ``(n,) int64`` the table's keys, sorted (SORTED; ``None`` for IDENTITY)
        self.table_keys = (
            sorted_keys.to(self.device) if self.layout is StaticLayout.SORTED else None
        )
        self._held = 0  # slots holding their row (under the lock)

    @property
    def full(self) -> bool:
        """Whether every key of the table has its row here (no key of the table can miss).
        An invalidation clears tags and counts its rows out under one hold of the cache's
        lock, so a reader holding the lock (the fused session) never sees ``True`` with a tag
        cleared."""
        return self._held == self.capacity

    # ------------------------------------------------------------------ where keys live
    def home_slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys (m,) int64`` → ``(slot (m,) int64, inside (m,) bool)``: the slot each key
        of the table owns, and whether the key is one of the table's (``slot`` is in
        ``[0, capacity)`` for every key, meaningful where ``inside``)."""
        n = self.capacity
        if self.table_keys is None:  # IDENTITY
            inside = (keys >= 0) & (keys < n)
            return keys.clamp(0, n - 1), inside
        pos = torch.searchsorted(self.table_keys, keys).clamp_(max=n - 1)
        return pos, self.table_keys.index_select(0, pos) == keys

    def _slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit (n,) bool, slot (n,) int64)``: a key hits when its slot holds its row."""
        slot, inside = self.home_slots(keys)
        return inside & (self.tags.view(-1).index_select(0, slot) != 0), slot

    def _hashed_slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_slots`: a static cache has no set probe (a key's slot is its home)."""
        return self._slots(keys)

    def _tick(self) -> int:
        """Advance the query clock (no LRU stamps to renormalise: nothing is replaced)."""
        self._clock += 1
        return self._clock

    def _touch(
        self, slots: torch.Tensor, counts: torch.Tensor | None, positions: torch.Tensor
    ) -> None:
        """No use counts: a static cache never chooses a victim."""

    # ------------------------------------------------------------------ writes
    def _insert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        priority: torch.Tensor | None,
        epoch: int | None,
    ) -> Placed:
        """Each of the table's keys into its own slot (cached copies overwritten); keys
        outside the table's keys are counted in ``overflowed`` and not placed. Nothing is
        evicted."""
        with self._lock:
            slot, inside = self.home_slots(keys)
            tags = self.tags.view(-1)
            held = inside & (tags.index_select(0, slot) != 0)
            if held.any():
                self.storage[slot[held]] = values[held]
            self.stats.overflowed += int((~inside).sum())
            new = inside & ~held
            if not new.any():
                return Placed.none(self.storage)
            tgt, nk = slot[new], keys[new]
            self.slot_keys.write(tgt, nk, tags)
            tags[tgt] = tag_of(nk)
            self.storage[tgt] = values[new]
            self._set_homed(tgt, False)
            n = int(tgt.numel())
            self.stats.inserted += n
            self._held += n
            none = torch.zeros(0, dtype=torch.int64, device=self.device)
            return Placed(n, nk, tgt, none, self.storage[:0])

    def _invalidate(self, keys: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Drop ``keys`` (their slots stay theirs); ``(how many were cached, homed keys
        dropped, their rows)``."""
        with self._lock:  # one critical section: never tags cleared while ``full`` holds
            dropped = self._drop_locked(keys)
            self._held -= dropped[0]
            return dropped

    def nbytes(self) -> int:
        """Host or device bytes this cache holds: rows, keys, tags, counters, homed bits and
        the SORTED layout's key index (8 B per row)."""
        index = 0 if self.table_keys is None else self.table_keys.numel() * 8
        return super().nbytes() + index
