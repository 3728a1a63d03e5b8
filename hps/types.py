"""Data types and the one small storage-backend interface shared by every HPS tier.

Only enums, the backend protocol, small records and the error types shared across the package
live here; the tiers live in :mod:`hps.storage`.

Keys are ``int64`` (HugeCTR's ``supportlonglong: true``); rows are ``float32`` at the interface
(``lookup`` / ``read`` / ``insert``) and stored in the table's row format (``lookup_rows`` /
``read_rows`` / ``insert_rows`` move those bytes as they are). Backends work on
numpy arrays (zero-copy to and from CPU torch tensors) because the lower tiers talk to bytes
(Redis, RocksDB) or to numpy hash maps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from hps.rowformat import RowDtype, row_bytes


class VolatileDBType(StrEnum):
    """``volatile_db.type`` in ps.json (HugeCTR names). ``none`` disables the tier."""

    NONE = "none"
    HASH_MAP = "hash_map"
    PARALLEL_HASH_MAP = "parallel_hash_map"
    REDIS_CLUSTER = "redis_cluster"


class PersistentDBType(StrEnum):
    """``persistent_db.type`` in ps.json. ``none`` disables the tier."""

    NONE = "none"
    ROCKS_DB = "rocks_db"


class OverflowPolicy(StrEnum):
    """What a volatile-DB partition evicts when it grows past ``overflow_margin`` rows.

    ``evict_random``: uniformly random rows; ``evict_least_used``: the rows read the fewest
    times; ``evict_oldest``: the rows whose last read or write is the oldest.
    """

    EVICT_RANDOM = "evict_random"
    EVICT_LEAST_USED = "evict_least_used"
    EVICT_OLDEST = "evict_oldest"


class CachePolicy(StrEnum):
    """Replacement policy inside one cache set: least recently used or least frequently used."""

    LRU = "lru"
    LFU = "lfu"


#: LFU aging period in looked-up keys per cache slot (``cache_lfu_decay_keys_per_slot``).
#: TinyLFU halves every 10 × the cache's size (Einziger et al., 2017); on our drift benchmark
#: (benchmarks/hps/bench_hps.py --only drift; Zipf α 1.05 and 1.2, 1 % and 10 % caches) 20
#: keeps the steady state within ~0.01 of never aging (10 loses up to 0.03 with a 1 % cache)
#: and still recovers from a full popularity permutation within ~40 keys per slot.
DEFAULT_LFU_DECAY_KEYS_PER_SLOT = 20.0


class Pooling(StrEnum):
    """How a bag of rows becomes one vector (a table's ``combiner`` in the serving metadata)."""

    SUM = "sum"
    MEAN = "mean"


class UpdateSourceType(StrEnum):
    """``update_source.type``: where online updates from the trainer arrive."""

    NONE = "none"
    FILE_LOG = "file_log"
    REDIS_STREAM = "redis_stream"


class Tier(StrEnum):
    """Where a looked-up key was found (statistics)."""

    CACHE = "cache"
    VOLATILE = "volatile"
    PERSISTENT = "persistent"
    DEFAULT = "default"


@dataclass(frozen=True)
class TierRead:
    """What one tier answered for ``n`` keys (:meth:`StorageBackend.read`).

    ``found`` and ``failed`` never overlap: a key is held (``found``, its row in ``values``), or
    known not to be held (neither), or the tier could not say (``failed``: a Redis node down,
    or one that restarted empty). Only the middle case may get the table's default vector.

        keys    [ 7,  3, 42, 11]
        found   [ T,  F,  F,  F]
        failed  [ F,  F,  T,  T]    -> 3 is not there; 42 and 11 must be read elsewhere
    """

    values: np.ndarray  # (n, dim) float32; zeros where not found
    found: np.ndarray  # (n,) bool
    failed: np.ndarray  # (n,) bool
    reason: str = ""  # why the failed keys could not be read (for errors and logs)


class StorageBackend(ABC):
    """The interface of the volatile and persistent tiers (one instance holds many tables).

    ``table`` is always a table's database name (:meth:`hps.config.PSConfig.db_table`): its
    name, or ``<model>.<table>`` where models name a table alike with other rows.

    Every method is batched: ``keys`` is ``(n,) int64`` (C-contiguous), ``values`` is
    ``(n, dim) float32``. Implementations are thread-safe.

    "Not found" is an answer: a backend that cannot tell whether it holds a key (a tier that
    failed) says so in :meth:`read` and raises :class:`TierUnavailableError` from
    :meth:`lookup`, never reports the key as absent.
    """

    #: short name used in logs and statistics, e.g. ``"hash_map"``
    name: str = "backend"

    @abstractmethod
    def create_table(self, table: str, dim: int, row_format: RowDtype = RowDtype.FP32) -> None:
        """Declare ``table`` with rows of ``dim`` values stored as ``row_format`` (idempotent
        for the same dim and format; another format than the stored one is a ``ValueError``)."""

    @abstractmethod
    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fetch rows.

        Returns:
            ``(values (n, dim) float32, found (n,) bool)``; rows of keys not found are zeros.
        """

    def read(self, table: str, keys: np.ndarray) -> TierRead:
        """Like :meth:`lookup`, plus the keys this tier could not answer for (``failed``).

        A backend that cannot fail (in-process) reads with :meth:`lookup`; one that can
        overrides this.
        """
        values, found = self.lookup(table, keys)
        return TierRead(values, found, np.zeros(found.shape, bool))

    def row_format(self, table: str) -> RowDtype:
        """How ``table``'s rows are stored (:mod:`hps.rowformat`); FP32 unless the backend
        stores another format."""
        return RowDtype.FP32

    def lookup_rows(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`lookup` of the stored bytes: ``(rows (n, row_bytes) uint8, found (n,) bool)``
        (a backend storing FP32 rows: their float32 bytes). Rows move between tiers as these
        bytes, so a quantized row is the same bytes in every tier."""
        values, found = self.lookup(table, keys)
        return np.ascontiguousarray(values, np.float32).view(np.uint8), found

    def read_rows(self, table: str, keys: np.ndarray) -> TierRead:
        """:meth:`read` of the stored bytes (``values (n, row_bytes) uint8``); a backend that
        can fail overrides it as it does :meth:`read`."""
        rows, found = self.lookup_rows(table, keys)
        return TierRead(rows, found, np.zeros(found.shape, bool))

    def insert_rows(self, table: str, keys: np.ndarray, rows: np.ndarray) -> None:
        """:meth:`insert` of stored bytes, ``rows (n, row_bytes) uint8``, kept as they are."""
        self.insert(table, keys, np.ascontiguousarray(rows).view(np.float32))

    def mark_loaded(self, table: str, partitions: list[int] | None = None) -> None:  # noqa: B027
        """Record that every row meant for ``table`` (or for its ``partitions``) was written.

        A tier that can lose rows behind the server's back (a Redis node restarted empty)
        keeps this mark beside the rows, and a read of a part without it fails instead of
        answering "not found". A no-op for tiers that cannot lose rows.
        """

    def holds_every_row(self, table: str) -> bool:
        """True when a key this tier does not hold is in no tier (the persistent DB after a
        complete load): a miss here is an answer even for keys a tier above failed to read."""
        return False

    @abstractmethod
    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert or overwrite rows (``keys`` must be unique within the call)."""

    @abstractmethod
    def size(self, table: str) -> int:
        """Number of rows currently held for ``table``."""

    @property
    def available(self) -> bool:
        """False while the tier is known to be down and not to be asked (a Redis cluster in
        its back-off window); a tier that cannot fail is always available."""
        return True

    def held(self, table: str, dim: int) -> tuple[int, int]:
        """``(rows, bytes)`` this tier holds for ``table`` (rows of ``dim`` values), read
        together. By default :meth:`size` rows of the row format's bytes each: the values
        only (a store's own per-entry overhead is its to report); the in-process hash map
        counts its slots, counters and key index."""
        rows = self.size(table)
        return rows, rows * row_bytes(self.row_format(table), dim)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (files, connections)."""


def check_keys(keys: np.ndarray, what: str = "keys") -> np.ndarray:
    """Return ``keys`` as a C-contiguous ``(n,) int64`` array or raise ``ValueError``."""
    if not isinstance(keys, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(keys).__name__}")
    if keys.dtype != np.int64:
        raise ValueError(f"{what} must have dtype int64, got {keys.dtype}")
    if keys.ndim != 1:
        raise ValueError(f"{what} must be 1-D (n,), got shape {tuple(keys.shape)}")
    return np.ascontiguousarray(keys)


def check_values(values: np.ndarray, n: int, dim: int, what: str = "values") -> np.ndarray:
    """Return ``values`` as a C-contiguous ``(n, dim) float32`` array or raise ``ValueError``."""
    if not isinstance(values, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(values).__name__}")
    if values.dtype != np.float32:
        raise ValueError(f"{what} must have dtype float32, got {values.dtype}")
    if values.shape != (n, dim):
        raise ValueError(f"{what} must have shape ({n}, {dim}), got {tuple(values.shape)}")
    return np.ascontiguousarray(values)


def mix64(keys: np.ndarray) -> np.ndarray:
    """A splitmix64 finaliser over ``(n,) int64`` keys → ``(n,) uint64`` well-spread hashes.

    Vectorised; uint64 multiplication wraps modulo 2**64 as intended. Consecutive ids land in
    different partitions/sets, so a table's row order never clusters into one bucket.
    """
    z = keys.view(np.uint64) if keys.dtype == np.int64 else keys.astype(np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class VolatileUnavailableError(RuntimeError):
    """A write the volatile DB could neither apply nor queue (a Redis cluster down with
    ``max_pending_rows`` rows already queued); nothing of it was written."""


class TierUnavailableError(RuntimeError):
    """A lookup some of whose keys may exist but could be read from no tier (the tier holding
    them failed and no tier below holds every row). The lookup is refused rather than answered
    with default vectors; the server answers 503 (retry later).

    Attributes:
        table: the table looked up.
        tier: the tier that failed (``volatile db (redis_cluster)``).
        keys: how many distinct keys of the lookup could not be read.
        reason: what the tier reported.
    """

    def __init__(self, table: str, tier: str, keys: int, reason: str, detail: str = "") -> None:
        self.table, self.tier, self.keys, self.reason = table, tier, keys, reason
        super().__init__(
            f"table {table!r}: {keys} key(s) could not be read: the {tier} failed for them "
            f"({reason}){detail}; the lookup is refused rather than answered with default "
            "vectors (retry later)"
        )


class CorruptRowError(RuntimeError):
    """A row a database returned is not ``dim`` float32s: the database is damaged (not the
    request's fault; the server answers 500 and logs it)."""


class FormatVersionError(ValueError):
    """A file (or stream entry) in one of the formats hps reads (an update log, an update record,
    a ``ps.json`` of serving artifacts, a dense graph's serving metadata) whose format version is
    not the one this hps reads. Nothing of it is used.

    Attributes:
        what: the file or entry (``update log out/u.log``).
        found: the version it holds (``None`` when it holds none).
        expected: the version this hps reads.
    """

    def __init__(self, what: str, found: object, expected: int, hint: str = "") -> None:
        self.what, self.found, self.expected = what, found, expected
        has = "has no format version" if found is None else f"has format version {found!r}"
        super().__init__(
            f"{what} {has}; this hps reads format version {expected} only"
            + (f" ({hint})" if hint else "")
        )
