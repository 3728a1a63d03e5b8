"""Lookup sessions: one request's keys → rows, through cache → volatile DB → persistent DB →
the table's default vector.

One lookup of ``keys`` (any shape, int64)::

    keys     [[5, 9, 5], [2, 7, 9]]          flat:   [5, 9, 5, 2, 7, 9]
    unique   [2, 5, 7, 9]                    inverse [1, 3, 1, 0, 2, 3]
    cache    hit  [F, T, F, T]   → misses [2, 7]
    volatile hit  [T, F]         → misses [7]
    persist. hit  [F]            → 7 gets the default vector
    rows     unique_rows[inverse].reshape(2, 3, dim)

A key a tier could not read (a Redis node down, or one that restarted empty: ``failed`` in
its :class:`~hps.types.TierRead`) falls through to the persistent DB; if no tier below holds
every row, the lookup raises :class:`~hps.types.TierUnavailableError` naming the table and the
tier: such a key is never answered with the default vector (it may exist). Both are counted
(``tier_failed_keys``, ``unavailable`` in :meth:`LookupSession.stats`).

What a cache miss gets (per batch, by the hit rate over the batch's unique keys):
- hit rate < ``hit_rate_threshold``: *synchronous fill* — misses are fetched from the databases,
  returned, and inserted into the cache before the call returns;
- hit rate ≥ threshold: *asynchronous insertion* (HugeCTR) — misses get the table's DEFAULT
  vector now; a background job fetches and caches them for later requests;
- ``cache_exact=True``: misses are always fetched and returned (never a default for a key that
  exists); above the threshold only the cache insertion is moved to the background.

Concurrency: any number of threads may call :meth:`LookupSession.lookup`; at most
``num_of_worker_buffer_in_pool`` run at once (the others wait: back-pressure, bounded memory),
and background jobs sit in a bounded queue (a full queue drops the *insertion*, never a reply).
Online updates take the writer side of a readers-writer lock, so a lookup sees an update
batch entirely or not at all. Background cache work never undoes an update: a job that fills
the cache reads the databases under the reader side, and a job inserting rows a lookup read
earlier drops them if an update was applied since (the lock's ``generation`` moved).

Admission priority of a missed key (LFU: compared with resident entries' use counts; LRU:
order inside a set) is its count in this request plus its count in the session's key
statistics so far, so a key hot across requests gets in even if each request holds it once.
With LFU aging (:mod:`hps.storage.cache`) those statistics are halved whenever the table's cache
halves its counters, so a priority and a resident count are on one scale: a key hot long
ago re-enters with its aged count, not its lifetime total. With exact statistics
(``key_stats_sampling=1``) and sequential lookups this is exact (a missed key is admitted with
what its counter would be had it been cached all along); concurrent lookups of one table may
halve a priority once more or once less. By default (``key_stats_sampling=8``,
:data:`DEFAULT_KEY_STATS_SAMPLING`) a fused lookup counts its missed keys one for one, always,
and its hits only where the table's statistics take the call (about one lookup in 8, each hit
then as 8; :mod:`hps.key_counts`): a cold key's history — what admission weighs — stays exact,
a resident key's is an unbiased estimate, and 7 lookups in 8 with no miss do not touch the
statistics. ``key_stats_sampling=1`` counts every key of every lookup.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hps.key_counts import KeyCounts
from hps.rwlock import ReadWriteLock
from hps.session.fill import CacheFill
from hps.session.fused import CallPlan, fused_lookup
from hps.session.table import SessionTable, unique_with_inverse
from hps.session.tiers import (
    DEFAULT_MAX_ABSENT_AGE_S,
    DEFAULT_MAX_ABSENT_KEYS,
    AbsentKeys,
    TierReader,
)
from hps.session_stats import SessionStats, TableBytes, held_bytes
from hps.storage.cache import EMPTY_KEY, EmbeddingCache
from hps.types import Pooling, StorageBackend, TierUnavailableError

if TYPE_CHECKING:  # hps.updates imports this module: its types only, at run time lazily
    from hps.updates.health import UpdateHealth, UpdateStatus

# Fused lookups per one whose hits are counted into each table's key statistics by default
# (misses are always counted): counting every hit cost 0.36-0.55 ms of a 6 ms pooled lookup of
# 26 tables (65,000 Zipf keys); an LFU cache of 10 % of a Zipf(1.05) table keeps 0.642 of the
# unique keys either way (docs/benchmarks.md, "Issue 27 at stop 33").
DEFAULT_KEY_STATS_SAMPLING = 8


class LookupSession:
    """Serves lookups of one model's tables.

    Args:
        tables: the model's tables (with their caches, or ``cache=None``).
        volatile: the volatile DB or ``None``.
        persistent: the persistent DB or ``None``.
        hit_rate_threshold: see the module docstring.
        exact: never return a default vector for a key that exists.
        max_concurrent: lookups running at once (``num_of_worker_buffer_in_pool``).
        cache_missed_embeddings: insert rows found only in the persistent DB into the volatile DB.
        record_key_stats: keep per-table :class:`~hps.key_counts.KeyCounts` (warm-up, advisor,
            admission priority).
        key_stats_sampling: each table's statistics count the hits of about one fused lookup
            in this many, each as this many, and every miss one for one (1: every key of every
            lookup, exact; module docstring).
        device: where returned rows live (the caches' device).
        acquire_timeout_s: how long a caller waits for a free worker before ``TimeoutError``.
        update_health: the health of the online updates that reach this session's tables
            (:mod:`hps.updates.health`; ``None``: none do).
        compiled: let the fused lookups use the compiled kernel when it is built (``False``:
            the pure-torch reference pass, :func:`hps.fused.gather_reference`).
        max_absent_keys: keys per table the negative cache holds (keys no tier holds, answered
            with the default vector without a database read until an update may have added
            them; :class:`~hps.session.tiers.AbsentKeys`); 0 turns it off.
        max_absent_age_s: seconds the negative cache trusts a table's absent keys at most
            (``> 0``), so a key another process adds to a shared tier (replicas sharing one
            Redis cluster or RocksDB, which bump no update generation here) is served within
            it; older entries are read again.
    """

    def __init__(
        self,
        tables: list[SessionTable],
        volatile: StorageBackend | None = None,
        persistent: StorageBackend | None = None,
        hit_rate_threshold: float = 0.9,
        exact: bool = False,
        max_concurrent: int = 4,
        cache_missed_embeddings: bool = False,
        record_key_stats: bool = True,
        device: torch.device | str = "cpu",
        acquire_timeout_s: float = 60.0,
        update_health: UpdateHealth | None = None,
        compiled: bool = True,
        max_absent_keys: int = DEFAULT_MAX_ABSENT_KEYS,
        max_absent_age_s: float = DEFAULT_MAX_ABSENT_AGE_S,
        key_stats_sampling: int = DEFAULT_KEY_STATS_SAMPLING,
    ) -> None:
        if volatile is None and persistent is None:
            raise ValueError("a LookupSession needs a volatile or a persistent database")
        if (
            isinstance(key_stats_sampling, bool)
            or not isinstance(key_stats_sampling, int)
            or key_stats_sampling < 1
        ):
            raise ValueError(
                f"key_stats_sampling must be an integer >= 1, got {key_stats_sampling!r}"
            )
        self.tables = {t.name: t for t in tables}
        self._by_db_name = {t.db_name: t for t in tables}
        self.device = torch.device(device)
        self.acquire_timeout_s = acquire_timeout_s
        self.compiled = compiled
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)
        # fused calls' plans by their tables' names (hps.session.fused.CallPlan)
        self._plans: dict[tuple[str, ...], CallPlan] = {}
        self.update_lock = ReadWriteLock()
        self.update_health = update_health
        self.statistics = SessionStats([t.name for t in tables])
        # (database, table) whose bytes could not be read, logged once as a warning
        self._bytes_warned: set[tuple[str, str]] = set()
        self.key_stats = (
            {
                t.name: KeyCounts(sample_every=key_stats_sampling, seed=i)
                for i, t in enumerate(tables)
            }
            if record_key_stats
            else None
        )
        # per table: the cache whose decay_epoch key_stats were last aged to, and that epoch
        self._stats_epoch: dict[str, tuple[weakref.ref[EmbeddingCache], int]] = {}
        self._aging_lock = threading.Lock()
        self.tiers = TierReader(volatile, persistent, cache_missed_embeddings, self.statistics)
        self.absent = AbsentKeys(max_absent_keys, max_absent_age_s)
        self.fill = CacheFill(
            self.tiers,
            self.statistics,
            self.update_lock,
            self.key_stats,
            hit_rate_threshold,
            exact,
            self.device,
            self.absent,
        )

    @property
    def volatile(self) -> StorageBackend | None:
        """The volatile DB or ``None``."""
        return self.tiers.volatile

    @property
    def persistent(self) -> StorageBackend | None:
        """The persistent DB or ``None``."""
        return self.tiers.persistent

    @property
    def cache_missed_embeddings(self) -> bool:
        """Whether rows found only in the persistent DB are inserted into the volatile DB."""
        return self.tiers.cache_missed_embeddings

    @property
    def hit_rate_threshold(self) -> float:
        """The cache hit rate from which misses are filled in the background (module docstring)."""
        return self.fill.hit_rate_threshold

    @hit_rate_threshold.setter
    def hit_rate_threshold(self, value: float) -> None:
        self.fill.hit_rate_threshold = value

    @property
    def exact(self) -> bool:
        """Never return a default vector for a key that exists."""
        return self.fill.exact

    @exact.setter
    def exact(self, value: bool) -> None:
        self.fill.exact = value

    # ------------------------------------------------------------------ public API
    def lookup(self, table: str, keys: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows of ``keys``.

        Args:
            table: table name.
            keys: int64 tensor/array of any shape ``S`` (e.g. ``(batch, hotness)``).

        Returns:
            ``S + (dim,)`` float32 on the session's device; keys found nowhere get the table's
            default value (and, above the threshold in non-exact mode, cache misses too).

        Raises:
            ValueError: unknown table, non-int64 keys, more keys than ``max_batch_size ×
                maxnum_catfeature_query_per_table_per_sample``, or the reserved key -2**63.
            TimeoutError: no worker became free within ``acquire_timeout_s``.
            TierUnavailableError: a key that may exist could be read from no tier (see the
                module docstring).
        """
        t = self._table(table)
        flat, shape = self._check_keys(t, keys)
        if not self._slots.acquire(timeout=self.acquire_timeout_s):
            raise TimeoutError(
                f"no lookup worker free within {self.acquire_timeout_s} s "
                f"({self.max_concurrent} busy)"
            )
        start = time.perf_counter()
        try:
            self.update_lock.acquire_read()
            try:
                rows = self._lookup_flat(t, flat)
            finally:
                self.update_lock.release_read()
        except Exception as e:
            self.statistics.count_error(table, isinstance(e, TierUnavailableError))
            raise
        finally:
            self._slots.release()
        self.statistics.record_latency(table, time.perf_counter() - start)
        return rows.reshape(*shape, t.dim)

    def lookup_many(
        self,
        tables: Sequence[str],
        keys: Sequence[torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Rows of several tables in one fused call (:mod:`hps.fused`): every table's cache
        hits probed and gathered in one pass, then each table's misses served as
        :meth:`lookup` serves them (same tiers, statistics, fill policy).

        Args:
            tables: ``T`` table names (distinct).
            keys: ``T`` int64 tensors, ``keys[i]`` of any shape ``S_i`` (e.g. ``(batch, hotness)``).
            out: optional reused output buffer, ``(Σ_i numel(keys[i]) · dim_i,)`` float32
                contiguous on the session's device (at least that many elements); reusing one
                avoids page-faulting a fresh result on every call.

        Returns:
            ``T`` tensors, ``S_i + (dim_i,)`` float32, views into ``out`` (or one new buffer):
            table ``i``'s block starts after the blocks of tables ``0..i-1``.

        Raises:
            ValueError: as :meth:`lookup` (naming the table), a table named twice, or an
                ``out`` too small or not float32 contiguous.
            TimeoutError / TierUnavailableError: as :meth:`lookup`.
        """
        return fused_lookup(self, tables, keys, None, out)

    def lookup_pooled(
        self,
        tables: Sequence[str],
        keys: Sequence[torch.Tensor],
        pooling: Pooling | Sequence[Pooling] = Pooling.SUM,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled bags of several tables in one fused call (gather and pooling fused):
        ``out[b, cols_i] = pool(rows of keys[i][b, :] ≥ 0)``.

        Args:
            tables: ``T`` table names (distinct).
            keys: ``T`` int64 tensors ``(B, w_i)`` (one bag of at most ``w_i`` keys per sample;
                ``-1`` pads a short bag; an empty bag pools to zeros).
            pooling: one :class:`~hps.types.Pooling` for every table, or one per table.
            out: optional reused output buffer ``(B, Σ_i dim_i)`` float32 contiguous.

        Returns:
            ``(B, Σ_i dim_i)`` float32, table ``i`` in columns ``Σ_{j<i} dim_j ..`` (with equal
            dims, ``out.view(B, T, dim)``). Bag sums run key by key in bag order
            (``((0 + r0) + r1) + …``, padding skipped), whichever keys the cache held: bit-equal
            to pooling the rows :meth:`lookup_many` returns in that order.

        Raises:
            ValueError: as :meth:`lookup_many`, a key below -1, or bags of unequal batch.
            TimeoutError / TierUnavailableError: as :meth:`lookup`.
        """
        t = len(tables)
        modes = (
            [Pooling(pooling)] * t
            if isinstance(pooling, str)
            else [p if isinstance(p, Pooling) else Pooling(p) for p in pooling]
        )
        if len(modes) != t:
            raise ValueError(f"lookup_pooled: {len(modes)} pooling modes for {t} tables")
        return fused_lookup(self, tables, keys, modes, out)[0]

    def stats(
        self,
        table: str | None = None,
        held: Mapping[str, TableBytes] | None = None,
        with_bytes: bool = False,
    ) -> dict[str, object]:
        """Statistics of one table, or ``{table: stats}`` for all; each with
        ``known_absent`` (the negative cache: keys held, keys answered from it, restarts),
        and with ``with_bytes`` (or ``held``) ``bytes``: what each tier holds for it, in its
        row format (:meth:`held_bytes`, or ``held[table]`` when the caller has just read it).
        Bytes ask every tier (a cache scan, the hash map's write lock, a Redis round trip):
        counters alone read no tier, for callers that poll per batch."""
        gen = self.update_lock.generation
        with_bytes = with_bytes or held is not None

        def one(name: str, counts: dict[str, object]) -> dict[str, object]:
            out = {**counts, "known_absent": self.absent.stats(name, gen)}
            if with_bytes:
                out["bytes"] = self._bytes_of(name, held)
            return out

        if table is not None:
            name = self._table(table).name
            return one(name, self.statistics.to_dict(name))
        every = self.statistics.to_dict(None)
        return {n: one(n, v) for n, v in every.items()}  # type: ignore[arg-type]

    def _bytes_of(self, table: str, held: Mapping[str, TableBytes] | None) -> dict[str, object]:
        """``held[table]`` (read by the caller) or :meth:`held_bytes`, as JSON."""
        got = held.get(table) if held is not None else None
        return (got if got is not None else self.held_bytes(table)).to_dict()

    def held_bytes(self, table: str) -> TableBytes:
        """The bytes each tier holds for ``table`` (:func:`hps.session_stats.held_bytes`):
        rows, their bytes in the table's row format, and what the tier reports holding."""
        t = self._table(table)
        return held_bytes(
            t.cache, self.volatile, self.persistent, t.db_name, t.dim, self._bytes_warned
        )

    def forget_absent_keys(self, table: str | None = None) -> None:
        """Empty the negative cache of ``table`` (``None``: every table). Writers that add
        rows to a tier outside the update lock's writer side call it; online updates need not
        (their write section makes every absent key stale)."""
        self.absent.clear(None if table is None else self._table(table).name)

    def update_status(self) -> UpdateStatus:
        """The online updates' health with the readiness policy applied (the servers' readiness
        and ``"online_updates"`` statistics); ready when no updates reach this session."""
        from hps.updates.health import UpdateStatus

        return UpdateStatus() if self.update_health is None else self.update_health.status()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until queued background cache jobs have run."""
        self.fill.drain(timeout_s)

    def close(self) -> None:
        """Run the queued background cache jobs, then end their worker thread."""
        self.fill.close()

    # ------------------------------------------------------------------ cache maintenance
    def warm_up(self, table: str, hot_keys: np.ndarray | torch.Tensor | None = None) -> int:
        """Fill ``table``'s cache with the hottest keys first (not file order).

        Args:
            hot_keys: keys hottest first; default: the session's observed key statistics
                (with LFU aging: aged in step with the cache, so recent popularity counts most).

        Returns:
            rows placed in the cache.
        """
        t = self._table(table)
        if t.cache is None:
            return 0
        if hot_keys is None:
            if self.key_stats is None:
                raise ValueError("warm_up without hot_keys needs record_key_stats=True")
            hot_keys = self.key_stats[table].hottest(t.cache.capacity)
        hk = np.asarray(hot_keys, dtype=np.int64)
        _, first = np.unique(hk, return_index=True)
        k = torch.from_numpy(hk[np.sort(first)][: t.cache.capacity])  # de-duplicated, order kept
        # Hottest first: a later (colder) chunk never evicts what an earlier chunk placed
        # (LRU: same clock; LFU: same priority, and a new key must be strictly hotter).
        placed = 0
        for chunk in k.split(65536):  # insert() keeps input order among equals inside a set
            self.update_lock.acquire_read()  # no update between the read and the insert
            try:
                raw = self.tiers.moves_bytes(t, t.cache)  # quantized: moved as bytes
                vals, found = self.tiers.fetch(t, chunk.numpy(), raw)
                c = chunk[torch.from_numpy(found)].to(self.device)
                got = torch.from_numpy(vals[found]).to(self.device)
                placed += t.cache.insert(c, got, rows=got if raw else None)
            finally:
                self.update_lock.release_read()
        return placed

    def refresh(self, table: str, fraction: float = 1.0) -> int:
        """Re-read the next ``fraction`` of ``table``'s cached rows from the databases
        (HugeCTR's periodic refresh); returns the rows refreshed."""
        t = self._table(table)
        if t.cache is None:
            return 0
        keys = t.cache.next_refresh_keys(fraction).cpu().numpy()
        if keys.size == 0:
            return 0
        self.update_lock.acquire_read()  # no update between the read and the write-back
        try:
            raw = self.tiers.moves_bytes(t, t.cache)  # quantized: moved as bytes
            vals, found = self.tiers.fetch(t, keys, raw)
            k = torch.from_numpy(keys[found]).to(self.device)
            got = torch.from_numpy(vals[found]).to(self.device)
            return t.cache.update_if_present(k, got, rows=got if raw else None)
        finally:
            self.update_lock.release_read()

    def start_refresh(self, interval_s: float, fraction: float) -> threading.Event:
        """Refresh every table's cache every ``interval_s`` in a daemon thread; set the
        returned event to stop it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                for name in self.tables:
                    self.refresh(name, fraction)

        threading.Thread(target=loop, name="hps-cache-refresh", daemon=True).start()
        return stop

    # ------------------------------------------------------------------ internals
    def db_table(self, db_name: str) -> SessionTable | None:
        """The table the databases key by ``db_name`` (:attr:`SessionTable.db_name`), or ``None``
        when this session serves no such table."""
        return self._by_db_name.get(db_name)

    def _table(self, table: str) -> SessionTable:
        try:
            return self.tables[table]
        except KeyError:
            raise ValueError(
                f"unknown table {table!r}; this session serves {sorted(self.tables)}"
            ) from None

    def _check_keys(
        self, t: SessionTable, keys: torch.Tensor | np.ndarray
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        if isinstance(keys, np.ndarray):
            if keys.dtype != np.int64:
                raise ValueError(f"table {t.name!r}: keys must be int64, got numpy {keys.dtype}")
            keys = torch.from_numpy(keys)
        if not isinstance(keys, torch.Tensor):
            raise ValueError(
                f"table {t.name!r}: keys must be a torch.Tensor or numpy array, got {type(keys).__name__}"
            )
        if keys.dtype != torch.int64:
            raise ValueError(f"table {t.name!r}: keys must be int64, got {keys.dtype}")
        if keys.numel() > t.max_keys:
            raise ValueError(
                f"table {t.name!r}: {keys.numel()} keys in one lookup, at most {t.max_keys} "
                f"(max_batch_size × maxnum_catfeature_query_per_table_per_sample)"
            )
        flat = keys.reshape(-1)
        if flat.numel() and bool((flat == EMPTY_KEY).any()):
            raise ValueError(
                f"table {t.name!r}: key {EMPTY_KEY} is reserved (the empty-slot sentinel)"
            )
        return flat, tuple(keys.shape)

    def _lookup_flat(self, t: SessionTable, flat: torch.Tensor) -> torch.Tensor:
        uniq, inverse, counts = unique_with_inverse(flat)
        n = uniq.numel()
        tier = torch.full((n,), 3, dtype=torch.int8)  # 0 cache, 1 volatile, 2 persistent, 3 default
        is_async = False
        cache = t.cache  # one cache for the whole lookup, even if the table's is swapped meanwhile
        if cache is not None:
            dev = self.device
            dev_keys, dev_inv, dev_counts = uniq.to(dev), inverse.to(dev), counts.to(dev)
            out, hit = cache.query(dev_keys, counts=dev_counts, inverse=dev_inv)
            # after the query (which ages before counting its own uses), the statistics catch
            # up with every halving so far; the priorities below are counted at this epoch
            epoch = self._age_key_stats(t, cache)
            hit_cpu = hit.cpu()
            tier[hit_cpu] = 0
            miss = torch.nonzero(~hit_cpu).squeeze(1)
            if miss.numel():
                mrows, mtier, is_async = self.fill.serve_misses(
                    t, cache, uniq[miss], counts[miss], n, epoch
                )
                tier[miss] = mtier
                # scatter the miss rows to every request position of a missed key
                rank = torch.full((n,), -1, dtype=torch.int64)
                rank[miss] = torch.arange(miss.numel())
                pos_rank = rank.index_select(0, inverse)
                pos = torch.nonzero(pos_rank >= 0).squeeze(1)
                out[pos.to(dev)] = mrows.index_select(0, pos_rank[pos].to(dev))
            else:
                is_async = 1.0 >= self.hit_rate_threshold
        else:
            all_unique = n == flat.numel()
            # the databases do not care about order: an all-unique request skips the final gather
            fetched = self.tiers.read(t, (flat if all_unique else uniq).numpy())
            self.tiers.refuse(t, fetched)
            vals, found, from_pdb = fetched.values, fetched.found, fetched.from_pdb
            rows = torch.from_numpy(vals).to(self.device)
            if not found.all():
                rows[~torch.from_numpy(found).to(self.device)] = t.default_value
            tier = torch.from_numpy(np.where(found, np.where(from_pdb, 2, 1), 3).astype(np.int8))
            out = rows if all_unique else rows.index_select(0, inverse.to(self.device))
        self.statistics.record(t.name, tier, counts, is_async)
        if self.key_stats is not None:
            self.key_stats[t.name].update(uniq.numpy(), counts.numpy())
        return out

    def _age_key_stats(self, t: SessionTable, cache: EmbeddingCache) -> int:
        """Halve ``t``'s key statistics once per aging of ``cache`` since the last call;
        returns the ``decay_epoch`` they now match. A cache seen for the first time (the
        table's first, or one swapped in since) starts the count at its own epoch: nothing is
        halved. The epoch is read under the lock, so two lookups racing never label
        statistics with an epoch older than the one they were aged to. Only a weak reference
        to the cache is kept (a cache taken out of the table is freed)."""
        if self.key_stats is None:
            return cache.decay_epoch
        with self._aging_lock:
            return self._age_locked(t.name, cache)

    def _age_key_stats_many(
        self, tables: Sequence[tuple[SessionTable, EmbeddingCache]]
    ) -> list[int]:
        """:meth:`_age_key_stats` of each ``(table, cache)`` under one acquisition of the
        aging lock (a fused call's tables); their epochs in order."""
        if self.key_stats is None:
            return [c.decay_epoch for _, c in tables]
        with self._aging_lock:
            return [self._age_locked(t.name, c) for t, c in tables]

    def _advance_ages(
        self, tables: Sequence[tuple[SessionTable, EmbeddingCache, int, int]]
    ) -> None:
        """After a fused pass over ``(table, cache, looked_up, halved)``: each cache's aging
        clock moves by the ``looked_up`` keys of its query (:meth:`EmbeddingCache._advance_age`)
        and, where the pass halved the table's key counter ``halved > 0`` times itself before
        counting its keys, the statistics' mass is aged to match and they are labelled with the
        cache's new epoch. Both under one hold of the aging lock: :meth:`_age_key_stats` never
        sees the new epoch with the old label (it would halve those statistics again). Called
        with the caches' locks held, right after the pass (lock order: caches, then aging)."""
        with self._aging_lock:
            for t, cache, looked_up, halved in tables:
                cache._advance_age(looked_up)
                if halved and self.key_stats is not None:
                    self.key_stats[t.name].counter_halved(halved)
                    self._stats_epoch[t.name] = (weakref.ref(cache), cache.decay_epoch)

    def _age_locked(self, name: str, cache: EmbeddingCache) -> int:
        """:meth:`_age_key_stats` of table ``name``, the aging lock held."""
        assert self.key_stats is not None
        epoch = cache.decay_epoch
        ref, seen = self._stats_epoch.get(name, (None, epoch))
        if ref is not None and ref() is cache:
            if epoch > seen:
                self.key_stats[name].halve(epoch - seen)
            epoch = max(epoch, seen)
            if epoch == seen:  # already labelled: no new reference to make
                return epoch
        self._stats_epoch[name] = (weakref.ref(cache), epoch)
        return epoch
