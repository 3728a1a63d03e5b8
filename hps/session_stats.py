"""Per-table lookup statistics of a :class:`~hps.session.LookupSession` (``session.stats()``,
and the ``hps`` part of the server's ``/v2/models/stats``), and their recording."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hps.types import Tier

LATENCY_WINDOW = 4096  # most recent lookups kept for p50/p99
_TIER_NAMES = tuple(t.value for t in Tier)  # in Tier order (an enum's members are slow to walk)


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

    def to_dict(self, table: str | None = None) -> dict[str, object]:
        """Statistics of ``table`` (a known name), or ``{table: stats}`` for all."""
        with self._lock:
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
