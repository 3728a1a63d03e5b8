"""Reading one table's rows through the database tiers below the cache: the volatile DB, then
the persistent DB for what it lacks, and the refusal when a key that may exist could be read
from no tier (:class:`~hps.types.TierUnavailableError`; see :mod:`hps.session.lookup`)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hps.rowformat import RowDtype
from hps.session_stats import SessionStats
from hps.storage.cache import EmbeddingCache
from hps.types import StorageBackend, TierUnavailableError, VolatileUnavailableError

if TYPE_CHECKING:
    from hps.session.table import SessionTable

__all__ = [
    "DEFAULT_MAX_ABSENT_AGE_S",
    "DEFAULT_MAX_ABSENT_KEYS",
    "AbsentKeys",
    "Fetched",
    "TierReader",
]

#: Keys per table the negative cache holds at most (8 bytes each: 512 KiB per table).
DEFAULT_MAX_ABSENT_KEYS = 65536
#: Seconds a table's absent keys are trusted at most: a key another process (a replica sharing
#: the Redis cluster or RocksDB, an offline writer) adds to a tier is served within this age.
DEFAULT_MAX_ABSENT_AGE_S = 2.0


@dataclass(frozen=True)
class Fetched:
    """What the databases gave for ``n`` keys (:meth:`TierReader.read`)."""

    values: np.ndarray  # (n, dim) float32, or (n, row_bytes) uint8 stored bytes (raw reads)
    found: np.ndarray  # (n,) bool
    from_pdb: np.ndarray  # (n,) bool: found in the persistent DB
    unreadable: np.ndarray  # (n,) bool: may exist, but no tier could read it
    reason: str  # what the failed tier reported


class TierReader:
    """The databases of one session, read volatile first, then persistent.

    Args:
        volatile: the volatile DB or ``None``.
        persistent: the persistent DB or ``None``.
        cache_missed_embeddings: insert rows found only in the persistent DB into the volatile DB.
        statistics: where keys a tier failed to read are counted (``tier_failed_keys``).
    """

    def __init__(
        self,
        volatile: StorageBackend | None,
        persistent: StorageBackend | None,
        cache_missed_embeddings: bool,
        statistics: SessionStats,
    ) -> None:
        self.volatile, self.persistent = volatile, persistent
        self.cache_missed_embeddings = cache_missed_embeddings
        self.statistics = statistics

    def moves_bytes(self, t: SessionTable, cache: EmbeddingCache) -> bool:
        """Whether rows go into ``cache`` as the tiers' stored bytes (``raw`` reads): its rows
        are quantized and every tier stores ``t`` in the same format (else float32 rows are
        quantized by the cache)."""
        fmt = cache.row_format
        if fmt is RowDtype.FP32:
            return False
        dbs = [db for db in (self.volatile, self.persistent) if db is not None]
        return all(db.row_format(t.db_name) is fmt for db in dbs)

    def fetch(
        self, t: SessionTable, keys: np.ndarray, raw: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Volatile then persistent DB; ``(values (n, dim), found (n,) bool)`` (``raw``: the
        stored bytes, ``(n, row_bytes) uint8``). Keys no tier could read are not found (for
        cache fills, which then skip them)."""
        f = self.read(t, keys, raw)
        return f.values, f.found

    def read(self, t: SessionTable, keys: np.ndarray, raw: bool = False) -> Fetched:
        """Volatile then persistent DB: the rows, where each was found, and the keys no tier
        could read (failed in the volatile DB and absent from a persistent DB that does not
        hold every row). ``raw``: the rows as the tiers store them (``(n, row_bytes) uint8``,
        for a cache of quantized rows: a row keeps its bytes from tier to tier)."""
        n = keys.size
        vals: np.ndarray | None = None
        found = np.zeros(n, bool)
        failed = np.zeros(n, bool)
        from_pdb = np.zeros(n, bool)
        reason = ""
        rest = np.arange(n)
        if self.volatile is not None and n:
            r = (self.volatile.read_rows if raw else self.volatile.read)(t.db_name, keys)
            vals, found, failed, reason = r.values, r.found, r.failed, r.reason
            rest = np.flatnonzero(~found)
            if failed.any():
                self.statistics.tier_failed(t.name, int(failed.sum()))
        if self.persistent is not None and rest.size:
            sub = keys if rest.size == n else keys[rest]
            v, f = (self.persistent.lookup_rows if raw else self.persistent.lookup)(t.db_name, sub)
            if vals is None or rest.size == n:
                vals, found, from_pdb = v, f, f.copy()
            else:
                hit = rest[f]
                vals[hit] = v[f]
                found[hit] = True
                from_pdb[hit] = True
            if failed.any() and self.persistent.holds_every_row(t.db_name):
                failed[:] = False  # its "not found" is an answer for every key
            if self.volatile is not None and self.cache_missed_embeddings and f.any():
                try:
                    (self.volatile.insert_rows if raw else self.volatile.insert)(
                        t.db_name, sub[f], v[f]
                    )
                except VolatileUnavailableError:  # an optional copy of the persistent db's rows
                    pass
        if vals is None:
            vals = np.zeros((n, t.dim), np.float32)
        return Fetched(vals, found, from_pdb, failed & ~found, reason)

    def refuse(self, t: SessionTable, fetched: Fetched) -> None:
        """Raise :class:`TierUnavailableError` when a key of ``fetched`` could be read from no tier."""
        k = int(fetched.unreadable.sum())
        if not k:
            return
        tier = f"volatile db ({self.volatile.name if self.volatile is not None else 'none'})"
        below = (
            "there is no persistent db to fall through to"
            if self.persistent is None
            else f"the persistent db ({self.persistent.name}) lacks them and does not hold "
            "every row of the table"
        )
        raise TierUnavailableError(t.name, tier, k, fetched.reason, f"; {below}")


class AbsentKeys:
    """The negative cache of one session: per table, keys that no tier holds, so a request
    that names one again gets the table's default vector without reading the databases.

    A key enters only after a read in which every tier answered and none held it (a key a
    tier failed to read is never taken as absent). The keys of a table are one sorted array
    labelled with the update lock's ``generation`` at which they were found absent and the
    time its first key entered: any write section since (an online update, which may add
    rows) makes them stale, and so does an age of ``max_age_s`` (another process writing the
    shared databases bumps no generation here), after which the keys are read again; writers
    of this process outside the update lock call :meth:`clear`. Bounded: a table past
    ``max_keys`` starts over from the keys of its latest read. Thread-safe (reads take a
    reference to an immutable entry).

    Args:
        max_keys: keys per table at most (0: the negative cache is off).
        max_age_s: seconds a table's keys are trusted at most (``> 0``; ``math.inf``: until
            a write section or :meth:`clear`).
        clock: seconds, monotonic (injectable for tests).

    Raises:
        ValueError: a negative ``max_keys`` or a ``max_age_s`` that is not ``> 0``.
    """

    def __init__(
        self,
        max_keys: int = DEFAULT_MAX_ABSENT_KEYS,
        max_age_s: float = DEFAULT_MAX_ABSENT_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 0:
            raise ValueError(f"max_absent_keys must be an integer >= 0, got {max_keys!r}")
        if (
            isinstance(max_age_s, bool)
            or not isinstance(max_age_s, int | float)
            or math.isnan(max_age_s)
            or max_age_s <= 0
        ):
            raise ValueError(f"max_absent_age_s must be a number > 0, got {max_age_s!r}")
        self.max_keys = max_keys
        self.max_age_s = float(max_age_s)
        self._clock = clock
        # table → (generation, time its first key entered, sorted keys)
        self._keys: dict[str, tuple[int, float, np.ndarray]] = {}
        self._answered: dict[str, int] = {}
        self._restarts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _current(self, table: str, generation: int) -> np.ndarray | None:
        """The sorted keys of ``table`` still valid at ``generation`` and now, or ``None``."""
        entry = self._keys.get(table)
        if entry is None or entry[0] != generation:
            return None
        if self._clock() - entry[1] >= self.max_age_s:
            return None
        return entry[2]

    def known(self, table: str, keys: np.ndarray, generation: int) -> np.ndarray | None:
        """``(n,) bool``: which of ``keys`` (int64) are known absent at ``generation``
        (counted as answered), or ``None`` when none is (also once the entry is older than
        ``max_age_s``)."""
        held = self._current(table, generation)
        if held is None or not keys.size:
            return None
        pos = np.minimum(np.searchsorted(held, keys), held.size - 1)
        hit = held[pos] == keys
        n = int(hit.sum())
        if not n:
            return None
        with self._lock:
            self._answered[table] = self._answered.get(table, 0) + n
        return hit

    def add(self, table: str, keys: np.ndarray, generation: int) -> None:
        """Record ``keys`` (int64) as held by no tier at ``generation``."""
        if not keys.size or not self.max_keys:
            return
        with self._lock:
            held = self._current(table, generation)
            fresh = np.unique(keys)
            entry = self._keys.get(table)
            if held is not None and entry is not None:
                merged, stamp = np.union1d(held, fresh), entry[1]  # the oldest key's time
            else:
                merged, stamp = fresh, self._clock()
            if merged.size > self.max_keys:  # bounded: start over from this read's keys
                merged, stamp = fresh[: self.max_keys], self._clock()
                self._restarts[table] = self._restarts.get(table, 0) + 1
            self._keys[table] = (generation, stamp, merged)

    def clear(self, table: str | None = None) -> None:
        """Forget the absent keys of ``table`` (``None``: of every table)."""
        with self._lock:
            if table is None:
                self._keys.clear()
            else:
                self._keys.pop(table, None)

    def stats(self, table: str, generation: int) -> dict[str, int]:
        """``held``: keys known absent now; ``answered``: keys answered from here so far;
        ``restarts``: times the table's keys outgrew ``max_keys``."""
        keys = self._current(table, generation)
        held = 0 if keys is None else keys.size
        with self._lock:
            return {
                "held": int(held),
                "answered": self._answered.get(table, 0),
                "restarts": self._restarts.get(table, 0),
            }
