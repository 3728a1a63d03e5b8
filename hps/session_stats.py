"""Per-table lookup statistics of a :class:`~hps.session.LookupSession` (``session.stats()``,
and the ``hps`` part of the server's ``/v2/models/stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hps.types import Tier

LATENCY_WINDOW = 4096  # most recent lookups kept for p50/p99


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
        for tier, u, a in zip(Tier, uniq_counts, all_counts, strict=True):
            self.hits_unique[tier.value] += u
            self.hits_all[tier.value] += a

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
