"""The embedding cache: a set-associative cache of rows held as torch tensors on the compute
device (CPU here, CUDA when present), LRU or LFU within each set.

Layout for ``capacity = 8`` rows, ``ways = 4`` (HugeCTR: 2 slabs of 32 → 64 ways)::

    set(key) = splitmix64(key) % num_sets         num_sets = ceil(capacity / ways) = 2

    keys     (num_sets, ways) int64    [[ 7, 12, E,  3],      E = EMPTY_KEY (-2**63)
                                        [ 5,  E, E,  E]]
    counters (num_sets, ways) int64    [[40, 38, -1, 12],     LRU: clock of last use
                                        [41, -1, -1, -1]]     LFU: number of uses
    values   (num_sets * ways, dim)    row of slot s*ways + w

A query compares each key with the ``ways`` keys of its set in one vectorised ``==``; an
insertion sorts the new keys by set, ranks them within their set and gives the r-th new key
of a set that set's r-th victim (empty slots first, then the lowest counter). No per-key
Python loop anywhere.

The cache itself is exact (it returns only rows it holds). What a *request* gets for a miss is
decided by :class:`hps.session.LookupSession` (synchronous fill below the hit-rate threshold,
default vector + background insertion above it, or the exact mode).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from hps.types import CachePolicy

log = logging.getLogger(__name__)

EMPTY_KEY = -(2**63)  # sentinel of an empty slot; this one int64 key value cannot be cached
DEFAULT_WAYS = 64  # HugeCTR: slabs of 32 keys, 2 slabs per set


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # splitmix64 constants (Steele et al., 2014)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def set_of(keys: torch.Tensor, num_sets: int) -> torch.Tensor:
    """``(n,) int64`` keys → ``(n,) int64`` set indices: the splitmix64 finaliser (the same
    as :func:`hps.types.mix64`; int64 multiplication wraps modulo 2**64), then ``% num_sets``."""
    z = keys + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    z = z ^ _srl(z, 31)
    return _srl(z, 1) % num_sets


@dataclass
class CacheStats:
    """Counters of one cache (unique keys as queried)."""

    queries: int = 0
    hits: int = 0
    inserted: int = 0
    evicted: int = 0
    overflowed: int = 0  # new keys that found no slot (more new keys than ways in one set)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class EmbeddingCache:
    """Set-associative row cache.

    Args:
        capacity: rows the cache can hold (rounded up to a whole number of sets).
        dim: row width.
        policy: ``lru`` or ``lfu``.
        ways: slots per set.
        device: where keys, counters and rows live.

    All methods take ``keys: (n,) int64`` without duplicates on ``device`` and are
    thread-safe (one lock; each call is a few vectorised tensor ops).
    """

    def __init__(self, capacity: int, dim: int, policy: CachePolicy | str = CachePolicy.LRU,
                 ways: int = DEFAULT_WAYS, device: torch.device | str = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be > 0 rows, got {capacity}")
        if dim <= 0:
            raise ValueError(f"cache dim must be > 0, got {dim}")
        if ways <= 0:
            raise ValueError(f"cache ways must be > 0, got {ways}")
        self.policy = CachePolicy(policy)
        self.dim = dim
        self.device = torch.device(device)
        self.ways = min(ways, capacity)
        self.num_sets = -(-capacity // self.ways)
        self.capacity = self.num_sets * self.ways
        self.keys = torch.full((self.num_sets, self.ways), EMPTY_KEY, dtype=torch.int64, device=self.device)
        self.counters = torch.full((self.num_sets, self.ways), -1, dtype=torch.int64, device=self.device)
        self.values = torch.zeros((self.capacity, dim), dtype=torch.float32, device=self.device)
        self._clock = 0
        self._lock = threading.Lock()
        self._refresh_cursor = 0
        self.stats = CacheStats()

    # ------------------------------------------------------------------ queries
    def _slots(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit (n,) bool, slot (n,) int64)``; ``slot`` is meaningful where ``hit``."""
        s = set_of(keys, self.num_sets)
        match = self.keys[s] == keys[:, None]  # (n, ways)
        hit = match.any(1)
        way = match.to(torch.uint8).argmax(1)
        return hit, s * self.ways + way

    def query(self, keys: torch.Tensor, count: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Look up rows.

        Args:
            keys: ``(n,) int64`` unique, on ``device``.
            count: update recency/frequency counters and statistics.

        Returns:
            ``(values (n, dim) float32, hit (n,) bool)``; rows of misses are zeros.
        """
        with self._lock:
            hit, slot = self._slots(keys)
            out = self.values.index_select(0, slot)
            out.masked_fill_(~hit[:, None], 0.0)
            if count:
                hs = slot[hit]
                flat = self.counters.view(-1)
                if self.policy is CachePolicy.LRU:
                    self._clock += 1
                    flat[hs] = self._clock
                else:
                    flat[hs] += 1
                self.stats.queries += int(keys.numel())
                self.stats.hits += int(hs.numel())
        return out, hit

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """``(n,) bool``: which keys are cached (no counter update)."""
        with self._lock:
            return self._slots(keys)[0]

    # ------------------------------------------------------------------ writes
    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Insert rows (overwriting cached copies of the same keys); returns rows newly placed.

        Args:
            keys: ``(n,) int64`` unique, on ``device``; must not contain ``EMPTY_KEY``.
            values: ``(n, dim) float32``.
        """
        if keys.numel() == 0:
            return 0
        values = values.to(device=self.device, dtype=torch.float32)
        with self._lock:
            hit, slot = self._slots(keys)
            if hit.any():
                self.values[slot[hit]] = values[hit]
            new = ~hit
            if not new.any():
                return 0
            keys, values = keys[new], values[new]
            s = set_of(keys, self.num_sets)
            s_sorted, order = torch.sort(s, stable=True)
            sets, inv, counts = torch.unique_consecutive(s_sorted, return_inverse=True, return_counts=True)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(s_sorted.numel(), device=self.device) - starts[inv]
            fits = rank < self.ways
            self.stats.overflowed += int((~fits).sum())
            victim_order = torch.argsort(self.counters[sets], dim=1, stable=True)  # (S, ways)
            way = victim_order[inv[fits], rank[fits]]
            tgt = sets[inv[fits]] * self.ways + way
            src = order[fits]
            flat_keys, flat_cnt = self.keys.view(-1), self.counters.view(-1)
            self.stats.evicted += int((flat_keys[tgt] != EMPTY_KEY).sum())
            flat_keys[tgt] = keys[src]
            self.values[tgt] = values[src]
            if self.policy is CachePolicy.LRU:
                self._clock += 1
                flat_cnt[tgt] = self._clock
            else:
                flat_cnt[tgt] = 1
            n = int(tgt.numel())
            self.stats.inserted += n
            return n

    def update_if_present(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Overwrite the cached copies of ``keys`` that are cached; returns how many were."""
        if keys.numel() == 0:
            return 0
        values = values.to(device=self.device, dtype=torch.float32)
        with self._lock:
            hit, slot = self._slots(keys)
            self.values[slot[hit]] = values[hit]
            return int(hit.sum())

    def invalidate(self, keys: torch.Tensor) -> int:
        """Drop ``keys`` from the cache; returns how many were cached."""
        if keys.numel() == 0:
            return 0
        with self._lock:
            hit, slot = self._slots(keys)
            self.keys.view(-1)[slot[hit]] = EMPTY_KEY
            self.counters.view(-1)[slot[hit]] = -1
            return int(hit.sum())

    # ------------------------------------------------------------------ refresh / inspection
    def cached_keys(self) -> torch.Tensor:
        """Every cached key, ``(k,) int64``."""
        with self._lock:
            k = self.keys.view(-1)
            return k[k != EMPTY_KEY].clone()

    def next_refresh_keys(self, fraction: float) -> torch.Tensor:
        """The cached keys of the next ``fraction`` of slots (round robin over calls)."""
        n = max(1, int(round(fraction * self.capacity)))
        with self._lock:
            start = self._refresh_cursor
            idx = torch.arange(start, start + n, device=self.device) % self.capacity
            self._refresh_cursor = (start + n) % self.capacity
            k = self.keys.view(-1)[idx]
            return k[k != EMPTY_KEY].clone()

    def __len__(self) -> int:
        with self._lock:
            return int((self.keys != EMPTY_KEY).sum())
