"""What a session's cache misses get, and the background cache jobs: the fill policy of
:mod:`hps.session.lookup` (synchronous fill below the hit-rate threshold, asynchronous
insertion above it, ``exact`` mode) and the worker thread that runs the deferred insertions.

Background jobs wait in a bounded queue (a full queue drops the *insertion*, never a reply)
and never undo an update: a job that fills the cache reads the databases under the reader
side of the update lock, and a job inserting rows a lookup read earlier drops them if an
update was applied since (the lock's ``generation`` moved).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hps.key_counts import KeyCounts
from hps.rwlock import ReadWriteLock
from hps.session.tiers import AbsentKeys, TierReader
from hps.session_stats import SessionStats
from hps.storage.cache import EmbeddingCache

if TYPE_CHECKING:
    from hps.session.table import SessionTable

__all__ = ["CacheFill"]

log = logging.getLogger(__name__)

_ASYNC_QUEUE = 8  # background cache jobs waiting at most


class CacheFill:
    """Serves one session's cache misses and runs its background cache jobs (one daemon
    worker thread, started here; :meth:`close` ends it).

    Args:
        tiers: the session's databases.
        statistics: where dropped background jobs are counted.
        update_lock: the session's update lock (jobs read under its reader side).
        key_stats: the session's per-table key statistics (admission priority), or ``None``.
        hit_rate_threshold: below it misses are filled synchronously, at or above it in the
            background (see :mod:`hps.session.lookup`).
        exact: never return a default vector for a key that exists.
        device: where returned rows live (the caches' device).
        absent: the session's negative cache (keys no tier holds; :class:`AbsentKeys`):
            misses it knows get the default vector without a database read.
    """

    def __init__(
        self,
        tiers: TierReader,
        statistics: SessionStats,
        update_lock: ReadWriteLock,
        key_stats: dict[str, KeyCounts] | None,
        hit_rate_threshold: float,
        exact: bool,
        device: torch.device,
        absent: AbsentKeys | None = None,
    ) -> None:
        self.absent = absent if absent is not None else AbsentKeys(0)
        self.tiers, self.statistics = tiers, statistics
        self.update_lock, self.key_stats = update_lock, key_stats
        self.hit_rate_threshold, self.exact = hit_rate_threshold, exact
        self.device = device
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=_ASYNC_QUEUE)
        self._worker = threading.Thread(target=self._work, name="hps-cache-insert", daemon=True)
        self._worker.start()

    def serve_misses(
        self,
        t: SessionTable,
        cache: EmbeddingCache,
        mkeys: torch.Tensor,
        mcounts: torch.Tensor,
        n_unique: int,
        epoch: int,
        counted: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Rows for the cache misses of one lookup of ``t`` (the fill policy of
        :mod:`hps.session.lookup`), used by :meth:`~hps.session.LookupSession.lookup` and the
        fused lookups (:mod:`hps.session.fused`).

        Args:
            mkeys: ``(k,) int64`` the missed keys, unique, on the CPU.
            mcounts: ``(k,) int64`` their occurrences in the request.
            n_unique: distinct keys of the request (hits and misses): the hit rate's denominator.
            epoch: the cache's ``decay_epoch`` the key statistics were aged to.
            counted: the request's missed keys are already in the key statistics (a fused
                lookup counts them before serving): the priority does not add ``mcounts``
                twice.

        Returns:
            ``(rows (k, dim) float32 on the session's device, tier (k,) int8: 1 volatile,
            2 persistent, 3 default; is_async)``.

        Raises:
            TierUnavailableError: a missed key could be read from no tier.
        """
        dev = self.device
        k = mkeys.numel()
        is_async = 1.0 - k / max(n_unique, 1) >= self.hit_rate_threshold
        generation = self.update_lock.generation  # stable: lookups hold the reader side
        if is_async and not self.exact:
            mrows = torch.full((k, t.dim), t.default_value, device=dev)
            # keys no tier holds are not read again in the background
            known = self.absent.known(t.name, mkeys.numpy(), generation)
            if known is not None:
                rest = torch.from_numpy(~known)
                mkeys, mcounts = mkeys[rest], mcounts[rest]
            if mkeys.numel():
                prio = self._priority(t, mkeys, mcounts, counted)
                mk, mp = mkeys.numpy(), prio.to(dev)
                job = functools.partial(self._fill_from_db, t, cache, mk, mp, epoch, generation)
                self.submit(t, job)
            return mrows, torch.full((k,), 3, dtype=torch.int8), is_async
        known = self.absent.known(t.name, mkeys.numpy(), generation)
        if known is None:
            mrows, tier = self._read(t, cache, mkeys, mcounts, is_async, epoch, generation, counted)
            return mrows, tier, is_async
        # keys no tier holds get the default without a read; the others are read
        mrows = torch.full((k, t.dim), t.default_value, device=dev)
        tier = torch.full((k,), 3, dtype=torch.int8)
        rest = torch.from_numpy(np.flatnonzero(~known))
        if rest.numel():
            r_rows, r_tier = self._read(
                t, cache, mkeys[rest], mcounts[rest], is_async, epoch, generation, counted
            )
            mrows[rest.to(dev)] = r_rows
            tier[rest] = r_tier
        return mrows, tier, is_async

    def _priority(
        self, t: SessionTable, mkeys: torch.Tensor, mcounts: torch.Tensor, counted: bool = False
    ) -> torch.Tensor:
        """Admission priority of missed keys: their uses in this request plus the history
        before it (``counted``: the statistics already hold this request's missed keys
        ``>= 0``, exactly — a fused lookup counts its misses one for one even where its
        statistics sample the hits, :mod:`hps.session.fused` — so for those they are that
        sum)."""
        if self.key_stats is None:
            return mcounts
        seen = torch.from_numpy(self.key_stats[t.name].count_of(mkeys.numpy()))
        if not counted:
            return mcounts + seen
        # at least this request's uses: a trim (or a concurrent halving) between the count and
        # this read may have dropped or halved a key just counted
        return torch.where(mkeys < 0, mcounts + seen, torch.maximum(seen, mcounts))

    def _read(
        self,
        t: SessionTable,
        cache: EmbeddingCache,
        mkeys: torch.Tensor,
        mcounts: torch.Tensor,
        is_async: bool,
        epoch: int,
        generation: int,
        counted: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Missed keys read from the databases and cached (now, or in the background when
        ``is_async``); those no tier holds are recorded in the negative cache.
        ``(rows (k, dim), tier (k,) int8)``."""
        dev = self.device
        prio = self._priority(t, mkeys, mcounts, counted)
        raw = self.tiers.moves_bytes(t, cache)  # quantized rows move as their bytes
        fetched = self.tiers.read(t, mkeys.numpy(), raw)
        self.tiers.refuse(t, fetched)
        vals, found, from_pdb = fetched.values, fetched.found, fetched.from_pdb
        stored = torch.from_numpy(vals[found]).to(dev) if raw else None
        mrows = torch.from_numpy(cache.codec.decode(vals) if raw else vals).to(dev)
        fm = torch.from_numpy(found)
        if not found.all():
            mrows[~fm.to(dev)] = t.default_value
            # every tier answered (refuse passed) and none holds these keys
            self.absent.add(t.name, mkeys.numpy()[~found], generation)
        tier = torch.from_numpy(np.where(found, np.where(from_pdb, 2, 1), 3).astype(np.int8))
        fm_dev = fm.to(dev)
        fk, fv, fp = mkeys[fm].to(dev), mrows[fm_dev], prio[fm].to(dev)
        if is_async:
            # bound to this cache: a job running after the table's cache was
            # replaced must not write these (by then maybe stale) rows into the new one
            job = functools.partial(
                self._insert_if_current, t, cache, fk, fv, fp, generation, epoch, stored
            )
            self.submit(t, job)
        else:
            cache.insert(fk, fv, priority=fp, epoch=epoch, rows=stored)
        return mrows, tier

    def submit(self, t: SessionTable, job: Callable[[], None]) -> None:
        """Queue a background job of table ``t``; dropped (and counted) when the queue is full."""
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.statistics.dropped_async(t.name)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until queued background cache jobs have run."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def close(self) -> None:
        """Run the queued jobs, then end the worker thread."""
        self.drain()
        self._jobs.put(None)
        self._worker.join(timeout=5)

    def _fill_from_db(
        self,
        t: SessionTable,
        cache: EmbeddingCache,
        keys: np.ndarray,
        priority: torch.Tensor | None = None,
        epoch: int | None = None,
        generation: int | None = None,
    ) -> None:
        """Background job: read ``keys`` from the databases and put them in ``cache`` (the one
        the lookup queried, even if the table's was swapped since), under the reader side of
        the update lock (an update cannot land between the read and the insert). ``priority``
        was counted at ``cache``'s ``epoch`` (halved for agings since). Keys every tier
        answered and none holds enter the negative cache at ``generation`` (the lock's when
        the job was queued; skipped when an update was applied since, or ``None``); a key a
        tier failed to read never does."""
        self.update_lock.acquire_read()
        try:
            raw = self.tiers.moves_bytes(t, cache)  # quantized rows move as their bytes
            fetched = self.tiers.read(t, keys, raw)
            vals, found = fetched.values, fetched.found
            if generation is not None and generation == self.update_lock.generation:
                self.absent.add(t.name, keys[~found & ~fetched.unreadable], generation)
            fm = torch.from_numpy(found)
            got = torch.from_numpy(vals[found]).to(self.device)
            cache.insert(
                torch.from_numpy(keys[found]).to(self.device),
                got,
                priority=None if priority is None else priority[fm.to(priority.device)],
                epoch=epoch,
                rows=got if raw else None,
            )
        finally:
            self.update_lock.release_read()

    def _insert_if_current(
        self,
        t: SessionTable,
        cache: EmbeddingCache,
        keys: torch.Tensor,
        values: torch.Tensor,
        priority: torch.Tensor,
        generation: int,
        epoch: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Background job: cache rows a lookup read (``rows``: their stored bytes), unless an
        update was applied since (``priority`` counted at ``cache``'s ``epoch``)."""
        self.update_lock.acquire_read()
        try:
            if self.update_lock.generation != generation:
                self.statistics.stale_dropped(t.name)
                return
            cache.insert(keys, values, priority=priority, epoch=epoch, rows=rows)
        finally:
            self.update_lock.release_read()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed background insertion must not kill the worker
                log.exception("background cache insertion failed")
            finally:
                self._jobs.task_done()
