"""A session's fused multi-table lookup (:meth:`hps.session.LookupSession.lookup_many` and
:meth:`~hps.session.LookupSession.lookup_pooled`).

One call, whatever the number of tables:

1. the tables' :class:`CallPlan` (built on the first call naming them, then kept by the
   session) and the checks (dtype, size per table; bad key values are refused by the fused
   pass before any counter moves);
2. under the session's worker slot and the reader side of its update lock, with every
   table's cache locked (in one fixed order), ONE fused cache-hit pass (:func:`hps.fused.gather`:
   probe, count, gather or pool, per-table statistics; static caches through
   :func:`hps.session.static_gather.gather_static`, the same outputs);
3. the misses of each table that had any (the miss path: dedupe of the missed keys, the
   databases, the fill policy, :meth:`~hps.session.fill.CacheFill.serve_misses`), written into
   their positions (rows), or into the rows the fused pass handed back for each bag with a
   miss, which is then summed key by key in request order (:func:`hps.fused.pool_in_order`),
   so a bag's floats never depend on which of its keys the cache held;
4. key statistics: every table's missed keys are counted one for one right after the pass,
   before any miss is served; its hits only where its statistics take the call
   (:meth:`hps.key_counts.KeyCounts.take_call`: always, or one call in ``sample_every``,
   each hit then as that many), by the fused pass itself (one hash per key for the probe and
   the count) where it can, i.e. when one thread does every key of the table, else in one
   call after the miss path (:class:`hps.key_counts.KeyCounts`). Either way a table's statistics are halved
   for every aging of its cache before the keys of the query that aged it are added (by the
   pass itself for the tables it counts, their mass and epoch then aged under the caches'
   locks); a call without a miss that a table's statistics do not take costs them nothing
   but the draw.

Tables without a cache, or caches off the CPU, go through :meth:`LookupSession.lookup` one by
one (the same results).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol, cast

import numpy as np
import torch

from hps.fused import CompiledTables, GatherArgs, GatherResult, compiled_tables, pool_in_order
from hps.kernels import load_extension
from hps.key_counts import KeyCounts
from hps.rwlock import ReadWriteLock
from hps.session.fill import CacheFill
from hps.session.static_gather import gather_any
from hps.session.table import SessionTable, unique_with_inverse
from hps.session_stats import SessionStats
from hps.storage.cache import LRU_PERIOD, EmbeddingCache, StaticEmbeddingCache, stream_of
from hps.types import CachePolicy, Pooling, TierUnavailableError

__all__ = ["fused_lookup"]

log = logging.getLogger(__name__)

_SERIAL_COUNT_KEYS = 65536  # keys of one call counted without a parallel region below this


class SessionView(Protocol):
    """What the fused pass uses of :class:`hps.session.LookupSession` (which calls it): its
    tables, workers, lock, statistics and miss path."""

    device: torch.device
    compiled: bool
    max_concurrent: int
    acquire_timeout_s: float
    update_lock: ReadWriteLock
    statistics: SessionStats
    fill: CacheFill
    key_stats: dict[str, KeyCounts] | None
    _slots: threading.BoundedSemaphore
    _plans: dict[tuple[str, ...], CallPlan]

    @property
    def hit_rate_threshold(self) -> float: ...

    def _table(self, table: str) -> SessionTable: ...

    def _age_key_stats(self, t: SessionTable, cache: EmbeddingCache) -> int: ...

    def _age_key_stats_many(
        self, tables: Sequence[tuple[SessionTable, EmbeddingCache]]
    ) -> list[int]: ...

    def _advance_ages(
        self, tables: Sequence[tuple[SessionTable, EmbeddingCache, int, int]]
    ) -> None: ...

    def lookup(self, table: str, keys: torch.Tensor | np.ndarray) -> torch.Tensor: ...


class CallPlan:
    """What a fused call over one list of tables needs that no call changes, built on the
    first call naming those tables and kept by the session (:attr:`SessionView._plans`): a
    session's tables and their caches are fixed when it is built, so a call then walks its
    tables in a few passes rather than one per argument (at small batches the per-table
    Python work of a call, not its gather, is most of its cost)."""

    __slots__ = (
        "aging",
        "all_static",
        "any_static",
        "caches",
        "columns",
        "compiled",
        "dims",
        "falses",
        "fusable",
        "intervals",
        "key_counts",
        "lru",
        "max_keys",
        "names",
        "order",
        "seeds",
        "static",
        "tables",
        "width",
        "zeros",
    )

    def __init__(self, s: SessionView, tables: Sequence[str]) -> None:
        if len(set(tables)) != len(tables):
            raise ValueError(f"a table is named twice in one fused lookup: {list(tables)}")
        self.tables = [s._table(n) for n in tables]
        self.names = tuple(t.name for t in self.tables)
        self.dims = [t.dim for t in self.tables]
        self.max_keys = [t.max_keys for t in self.tables]
        self.columns = (0, *itertools.accumulate(self.dims))[:-1]  # bags: each table's first
        self.width = sum(self.dims)
        caches = [t.cache for t in self.tables]
        self.fusable = bool(self.tables) and _fusable(s, caches)
        self.caches = [c for c in caches if c is not None]
        by_id = {id(c): c for c in self.caches}
        self.order = [by_id[k] for k in sorted(by_id)]  # one fixed order: no two calls deadlock
        self.static = [isinstance(c, StaticEmbeddingCache) for c in self.caches]
        self.all_static = all(self.static)
        self.any_static = any(self.static)  # static and set-associative caches mixed, or all static
        lru = CachePolicy.LRU
        self.lru = [c.policy is lru for c in self.caches]
        self.key_counts = [s.key_stats[n] for n in self.names] if s.key_stats is not None else None
        self.intervals = tuple(c.lfu_decay_interval for c in self.caches)
        self.aging = any(self.intervals)  # some cache halves its counts as keys are looked up
        self.zeros = (0,) * len(self.tables)  # tuples: calls share them, none may change them
        self.falses = (False,) * len(self.tables)
        self.seeds = [c.seed & 0xFFFFFFFF for c in self.caches]  # of the LFU draw streams
        #: the compiled pass's arrays of the caches, kept from call to call under their locks
        self.compiled: CompiledTables | None = None


def _plan(s: SessionView, tables: Sequence[str]) -> CallPlan:
    key = tuple(tables)
    plan = s._plans.get(key)
    if plan is None:
        plan = CallPlan(s, key)
        s._plans[key] = plan
    return plan


def _check(
    plan: CallPlan, keys: Sequence[torch.Tensor], bags: bool
) -> tuple[list[torch.Tensor], Sequence[int]]:
    """Each table's keys contiguous in the caller's shape (the fused pass reads any contiguous
    shape as its keys in row-major order: no view per table on the hot path), and each
    table's keys per bag (bags; rows: 0)."""
    ts = plan.tables
    ext = load_extension()
    if ext is not None and len(ts) == len(keys):  # every check in one call, when all pass
        try:
            plain = ext.plain_keys(keys, plan.max_keys, bags)
        except TypeError:  # a key argument that is not a tensor: worded below
            plain = None
        if plain is not None:
            return list(keys), plain if bags else plan.zeros
    if len(ts) != len(keys):
        raise ValueError(f"{len(ts)} tables but {len(keys)} key tensors")
    ks = []
    hot = []
    batch = None
    int64 = torch.int64
    for t, k in zip(ts, keys, strict=True):
        if not isinstance(k, torch.Tensor) or k.dtype != int64:
            got = k.dtype if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(f"table {t.name!r}: keys must be an int64 torch.Tensor, got {got}")
        if k.numel() > t.max_keys:
            raise ValueError(
                f"table {t.name!r}: {k.numel()} keys in one lookup, at most {t.max_keys} "
                f"(max_batch_size × maxnum_catfeature_query_per_table_per_sample)"
            )
        if bags:
            shape = k.shape
            if len(shape) != 2:
                raise ValueError(f"table {t.name!r}: bags must be (B, w), got {tuple(shape)}")
            if batch is None:
                batch = shape[0]
            elif shape[0] != batch:
                raise ValueError(
                    f"table {t.name!r}: {shape[0]} bags, but the first table has {batch}"
                )
            hot.append(shape[1])
        ks.append(k if k.is_contiguous() else k.contiguous())
    return ks, hot if bags else plan.zeros


def _out_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The call's output: ``out`` checked (bags: exactly ``shape``; rows, ``shape == (n,)``: at
    least ``n`` floats, returned flat and whole, since every pass writes and reads it at the
    tables' offsets), or a new tensor. A 1-D ``out`` is returned as it is: a view and a slice
    of it took 200 µs of a 26-table call whose code the CPU no longer held in its caches."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    need = 1
    for d in shape:
        need *= d
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"out must be a contiguous float32 tensor on {device}, got {out.dtype} on "
            f"{out.device} (contiguous: {out.is_contiguous()})"
        )
    if len(shape) == 1:
        if out.numel() < need:
            raise ValueError(f"out holds {out.numel()} floats, the rows need {need}")
        return out if out.dim() == 1 else out.view(-1)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    return out


def fused_lookup(
    s: SessionView,
    tables: Sequence[str],
    keys: Sequence[torch.Tensor],
    pooling: list[Pooling] | None,
    out: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Rows (``pooling is None``: one view per table) or bags (one ``(B, Σ dim)`` tensor)."""
    bags = pooling is not None
    plan = _plan(s, tables)
    ks, hot = _check(plan, keys, bags)
    ts, dims = plan.tables, plan.dims
    if bags:
        b = keys[0].shape[0] if keys else 0
        offsets: Sequence[int] = plan.columns
        buf = _out_buffer(out, (b, plan.width), s.device)
        if 0 in hot:
            for o, d, h in zip(offsets, dims, hot, strict=True):
                if h == 0:  # bags of no keys: no pass writes their columns; they pool to zeros
                    buf[:, o : o + d].zero_()
    else:
        sizes = [k.numel() * d for k, d in zip(ks, dims, strict=True)]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        buf = _out_buffer(out, (sum(sizes),), s.device)
    if not plan.fusable:
        return _per_table(s, ts, keys, ks, pooling, buf, offsets)
    if not s._slots.acquire(timeout=s.acquire_timeout_s):
        raise TimeoutError(
            f"no lookup worker free within {s.acquire_timeout_s} s ({s.max_concurrent} busy)"
        )
    start = time.perf_counter()
    failed: list[str] = []  # the table whose miss path failed (as per-table lookup counts it)
    try:
        s.update_lock.acquire_read()
        try:
            _run(s, plan, ks, buf, offsets, hot, pooling, failed)
        finally:
            s.update_lock.release_read()
    except Exception as e:
        for name in failed or plan.names:
            s.statistics.count_error(name, isinstance(e, TierUnavailableError))
        raise
    finally:
        s._slots.release()
    s.statistics.record_fused_latency(plan.names, time.perf_counter() - start)
    if bags:
        return [buf]
    ext = load_extension() if s.compiled else None
    if ext is not None:  # every view in one call (hps/csrc/fused_lookup.cpp, row_views)
        return cast(list[torch.Tensor], ext.row_views(buf, ks, offsets, dims))
    return [
        buf[o : o + f.numel() * d].view(*k.shape, d)
        for o, f, d, k in zip(offsets, ks, dims, keys, strict=True)
    ]


_CPU = torch.device("cpu")


def _on_cpu(device: torch.device) -> bool:
    """``device.type == "cpu"``, answered by an equality first (reading ``.type`` builds a
    string: 0.4 µs, per table per call)."""
    return device == _CPU or device.type == "cpu"


def _fusable(s: SessionView, caches: list[EmbeddingCache | None]) -> bool:
    return _on_cpu(s.device) and all(c is not None and _on_cpu(c.device) for c in caches)


def _run(
    s: SessionView,
    plan: CallPlan,
    ks: list[torch.Tensor],
    buf: torch.Tensor,
    offsets: Sequence[int],
    hot: Sequence[int],
    pooling: list[Pooling] | None,
    failed: list[str],
) -> None:
    ts, caches = plan.tables, plan.caches
    bags = pooling is not None
    # which tables' statistics count this call (drawn first, the same on every path)
    kc = plan.key_counts
    taken = [k.take_call() for k in kc] if kc is not None else plan.falses
    order = plan.order
    for c in order:
        c._lock.acquire()
    try:
        for c in order:
            c._tick()
        stamps: Sequence[int] = plan.zeros  # the static pass reads no stamp, stream or clock
        streams: Sequence[int] = plan.zeros
        looked_up: Sequence[int] = plan.zeros
        weights: Sequence[int] | None = None  # every hit one use (a static cache counts none)
        compiled = s.compiled and load_extension() is not None
        if not plan.all_static:  # one walk over the caches for the pass's per-table arguments
            stamps, streams, looked_up, weights = _clocks(caches, plan, compiled)
            if compiled and not plan.any_static:  # the caches' arrays, as the pass holds them
                plan.compiled = compiled_tables(caches, plan.compiled)
        counters = _pass_counters(s, ts, ks, caches, taken)
        args = GatherArgs(
            caches=caches,
            keys=ks,
            out=buf,
            out_offsets=offsets,
            out_stride=buf.shape[1] if bags else 0,
            hotness=hot,
            mean=[p is Pooling.MEAN for p in pooling] if pooling is not None else plan.falses,
            stamps=stamps,
            streams=streams,
            looked_up=looked_up,
            intervals=plan.intervals,
            key_counters=counters,
            weights=weights,
            tables=plan.compiled if compiled and not plan.any_static else None,
        )
        try:
            res = gather_any(args, compiled=compiled)
        except ValueError as e:
            raise ValueError(_name_table(str(e), ts)) from None
        per = res.per_table.tolist()
        counted = res.counted or plan.falses
        # clocks, epochs and the labels of the statistics the pass halved move together, before
        # the caches' locks go: no other lookup or aging halves these statistics twice
        if plan.aging:  # else no cache has an aging clock, and no pass halves a counter
            s._advance_ages(
                [
                    (t, c, row[3], row[4] if done else 0)
                    for t, c, row, done in zip(ts, caches, per, counted, strict=True)
                ]
            )
        for c, row in zip(caches, per, strict=True):
            c.stats.hits += row[2]
            c.stats.queries += row[2]
    finally:
        for c in reversed(order):
            c._lock.release()
    misses = _misses_of(ks, res, per)
    missed = [0] * len(ts)
    try:
        epochs, missed = _age_and_count_misses(s, ts, caches, misses, per, counted, taken)
        _serve_all_misses(s, plan, ks, res, misses, per, buf, offsets, hot, pooling, failed, epochs)
    except Exception:
        # the miss path raised: the call's hits are counted all the same by the statistics
        # that take the call (its misses were counted before it was served), those the pass
        # did not count aged to their caches' epochs first, as after a success. A failure to
        # count is only logged: the call raises the miss path's
        try:
            if s.key_stats is not None:
                s._age_key_stats_many(
                    [
                        (t, c)
                        for t, c, done, take in zip(ts, caches, counted, taken, strict=True)
                        if take and not done
                    ]
                )
            _count_keys(s, ts, ks, misses, per, counted, counters is not None, taken, missed)
        except Exception:
            log.exception("counting the keys of a failed lookup of %s failed", [t.name for t in ts])
        raise
    _count_keys(s, ts, ks, misses, per, counted, counters is not None, taken, missed)


def _clocks(
    caches: list[EmbeddingCache], plan: CallPlan, compiled: bool
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per table, the LRU stamp a hit writes (-1: LFU), the LFU draw stream (0: a static
    cache, which keeps no use counts), the aging clock before this query and the uses each
    hit counts (:meth:`EmbeddingCache.use_weight`: 0 where the cache's LFU sampling skips
    this query). ``compiled``: the streams are mixed by the extension in one call (the same
    numbers as :meth:`EmbeddingCache.lfu_stream`; 26 of them in Python take ~20 µs a call)."""
    stamps, clocks, looked_up, weights = [], [], [], []
    for c, lru in zip(caches, plan.lru, strict=True):
        clock = c._clock
        clocks.append(clock)
        stamps.append(clock % LRU_PERIOD if lru else -1)
        looked_up.append(c._looked_up)
        weights.append(c.use_weight())
    ext = load_extension() if compiled else None
    if ext is not None:
        streams = ext.lfu_streams(plan.seeds, clocks)
    else:
        streams = [stream_of(seed, clock) for seed, clock in zip(plan.seeds, clocks, strict=True)]
    if plan.any_static:
        streams = [0 if static else x for x, static in zip(streams, plan.static, strict=True)]
    return stamps, streams, looked_up, weights


def _pass_counters(
    s: SessionView,
    ts: list[SessionTable],
    ks: list[torch.Tensor],
    caches: list[EmbeddingCache],
    taken: Sequence[bool],
) -> list[object | None] | None:
    """The compiled key counters the fused pass may count into: per table, its counter where
    ``taken`` (the call is counted), else ``None``; ``None`` when the pass counts none (no
    statistics, no table takes the call, the reference pass, or statistics without a compiled
    counter). Each taken table's statistics are first halved for every aging of its cache so
    far."""
    if s.key_stats is None or not s.compiled or not any(taken):
        return None
    stats = s.key_stats
    counters = [stats[t.name].counter if take else None for t, take in zip(ts, taken, strict=True)]
    if any(c is None for c, take in zip(counters, taken, strict=True) if take):
        return None
    s._age_key_stats_many([(t, c) for t, c, take in zip(ts, caches, taken, strict=True) if take])
    for t, k, take in zip(ts, ks, taken, strict=True):  # bounds hold whatever the pass counts
        if take:
            stats[t.name].will_count(k.numel())
    return counters


def _name_table(msg: str, ts: list[SessionTable]) -> str:
    """The fused pass names a table by its index; name it by its name."""
    head, _, rest = msg.partition(":")
    words = head.split()
    if len(words) == 2 and words[0] == "table" and words[1].isdigit() and int(words[1]) < len(ts):
        return f"table {ts[int(words[1])].name!r}:{rest}"
    return msg


def _serve_all_misses(
    s: SessionView,
    plan: CallPlan,
    ks: list[torch.Tensor],
    res: GatherResult,
    misses: list[_Misses | None],
    per: list[list[int]],
    buf: torch.Tensor,
    offsets: Sequence[int],
    hot: Sequence[int],
    pooling: list[Pooling] | None,
    failed: list[str],
    epochs: dict[int, int],
) -> None:
    """The miss path of each table that had misses (``misses``, :func:`_misses_of`;
    ``epochs``: per such table, the ``decay_epoch`` its key statistics were aged to,
    :func:`_age_and_count_misses`); a table whose miss path fails is appended to ``failed``
    before the error propagates (the later tables are not served)."""

    all_hit_async = 1.0 >= s.hit_rate_threshold  # a lookup whose keys all hit
    if misses.count(None) == len(misses):  # no table missed: the pass's counts, as they are
        s.statistics.record_fused_hits(plan.names, res.per_table, all_hit_async)
        return
    ts, caches = plan.tables, plan.caches
    # every served table's counts, recorded at the end under one statistics lock acquisition
    records: list[tuple[str, list[int], list[int], bool]] = []
    all_hit: list[tuple[str, int, int, bool]] = []  # tables without a miss
    try:
        for i, (t, c, row, m) in enumerate(zip(ts, caches, per, misses, strict=True)):
            hits, uniq_hits = row[1], row[2]
            if m is None:
                all_hit.append((t.name, uniq_hits, hits, all_hit_async))
                continue
            epoch = epochs[i]
            pos, uniq, inv, counts = m
            flat = ks[i].view(-1)
            n_unique = uniq_hits + uniq.numel()
            with c._lock:
                c.stats.queries += uniq.numel()
            try:
                rows, tier, is_async = s.fill.serve_misses(
                    t,
                    c,
                    uniq,
                    counts,
                    n_unique,
                    epoch,
                    True,  # the misses are counted: _age_and_count_misses
                )
            except Exception:
                failed.append(t.name)
                raise
            expanded = rows.index_select(0, inv)
            d, off = t.dim, offsets[i]
            if pooling is None:
                buf[off : off + flat.numel() * d].view(-1, d)[pos] = expanded
            else:  # the bags with a miss: their rows completed, then summed in request order
                h = hot[i]
                bags, rank = torch.unique_consecutive(pos // h, return_inverse=True)
                rows_p = res.pending[i].view(bags.numel(), h, d)
                rows_p[rank, pos % h] = expanded
                valid = flat.view(-1, h).index_select(0, bags) >= 0
                buf[bags, off : off + d] = pool_in_order(rows_p, valid, pooling[i] is Pooling.MEAN)
            t64 = tier.to(torch.int64)
            uniq_tiers = torch.bincount(t64, minlength=4).tolist()
            all_tiers = torch.bincount(t64, weights=counts.to(torch.float64), minlength=4).tolist()
            records.append(
                (
                    t.name,
                    [uniq_hits + int(uniq_tiers[0]), *(int(x) for x in uniq_tiers[1:])],
                    [hits + int(all_tiers[0]), *(int(x) for x in all_tiers[1:])],
                    is_async,
                )
            )
    finally:  # also when a later table's miss path raised: the tables served before it
        s.statistics.record_counts_many(records, all_hit)


class _Misses(NamedTuple):
    """One table's missed keys in a call: ``pos`` their positions (into its keys, row-major),
    ``uniq`` the distinct ones (sorted), ``inv`` each position's index into ``uniq``,
    ``counts`` each distinct key's occurrences."""

    pos: torch.Tensor
    uniq: torch.Tensor
    inv: torch.Tensor
    counts: torch.Tensor


def _misses_of(
    ks: list[torch.Tensor], res: GatherResult, per: list[list[int]]
) -> list[_Misses | None]:
    """Per table, its misses deduplicated once (``None``: it had none), for the count, the
    miss path and the hits' mask alike."""
    if not res.misses.numel():
        return [None] * len(ks)
    out: list[_Misses | None] = []
    start = 0
    for f, row in zip(ks, per, strict=True):
        if not row[0]:
            out.append(None)
            continue
        pos = res.misses[start : start + row[0]]
        start += row[0]
        out.append(_Misses(pos, *unique_with_inverse(f.view(-1).index_select(0, pos))))
    return out


def _age_and_count_misses(
    s: SessionView,
    ts: list[SessionTable],
    caches: list[EmbeddingCache],
    misses: list[_Misses | None],
    per: list[list[int]],
    counted: Sequence[bool],
    taken: Sequence[bool],
) -> tuple[dict[int, int], list[int]]:
    """After the pass, before any miss is served: the key statistics of every table with a
    miss, and of those that take the call but were not counted by the pass, aged to their
    caches' epochs (one acquisition of the aging lock); then every table's missed keys
    ``>= 0`` counted exactly, whether or not its statistics take the call (admission reads a
    cold key's history, which a sample would blur; the hits are counted by the pass or
    :func:`_count_keys`, as the sampling says). Counted before serving, so a miss path that
    fails leaves them counted as one that succeeds. Returns ``(epochs, missed)``: per table
    with a miss, the epoch its statistics match; per table, the missed occurrences counted.
    """
    aged = [i for i, row in enumerate(per) if row[0] or (taken[i] and not counted[i])]
    if not aged:  # no miss, and every table that takes the call was counted by the pass
        return {}, [0] * len(ts)
    epochs = dict(zip(aged, s._age_key_stats_many([(ts[i], caches[i]) for i in aged]), strict=True))
    missed = [0] * len(ts)
    if s.key_stats is None:
        return epochs, missed
    for i, (t, m) in enumerate(zip(ts, misses, strict=True)):
        if m is None:
            continue
        keep = m.uniq >= 0
        uniq, counts = m.uniq[keep], m.counts[keep]
        if uniq.numel():
            s.key_stats[t.name].update(uniq.numpy(), counts.numpy())
            missed[i] = int(counts.sum())
    return epochs, missed


class _KeyCounter(Protocol):
    """The compiled ``KeyCounter`` (:mod:`hps.key_counts`): counts ``keys`` (keys < 0 skipped
    with ``skip_negative``; ``counts`` empty: its weight each)."""

    def update(self, keys: torch.Tensor, counts: torch.Tensor, skip_negative: bool) -> None: ...


def _count_keys(
    s: SessionView,
    ts: list[SessionTable],
    ks: list[torch.Tensor],
    misses: list[_Misses | None],
    per: list[list[int]],
    counted: Sequence[bool],
    bounds_grown: bool,
    taken: Sequence[bool],
    missed: Sequence[int],
) -> None:
    """The hits of the tables whose statistics take this call (``taken[i]``) and the fused
    pass did not count (``counted[i]`` False: the pass counts only hits), as the statistics'
    weight each, and the taken tables' observed totals (their hits weighted alike; the
    ``missed`` occurrences were observed exactly by :func:`_age_and_count_misses`);
    ``bounds_grown``: :func:`_pass_counters` already grew the statistics' size bounds by
    these keys."""
    if s.key_stats is None or not any(taken):
        return
    mine = [  # (statistics, hits (misses as -1), counted by the pass, row, missed) when taken
        (s.key_stats[t.name], f if done else _hits_only(f, ms), done, row, m)
        for t, f, ms, done, row, m, take in zip(
            ts, ks, misses, counted, per, missed, taken, strict=True
        )
        if take
    ]
    ext = load_extension()
    if ext is not None and all(k.counter is not None for k, _, _, _, _ in mine):
        todo = [(k.counter, f) for k, f, done, _, _ in mine if not done]
        if not bounds_grown:
            for k, f, _, _, _ in mine:
                k.will_count(f.numel())
        if todo and sum(f.numel() for _, f in todo) < _SERIAL_COUNT_KEYS:
            # one table after another: a parallel region's wake-up costs more than these
            # counts (1-15 ms on a 2-core host at load 10, against ~0.1 ms serially)
            none = torch.empty(0, dtype=torch.int64)
            for c, f in todo:
                cast(_KeyCounter, c).update(f, none, True)
        elif todo:
            ext.count_keys([c for c, _ in todo], [f for _, f in todo])
        for k, _, _, row, m in mine:  # the hits, as weighted as their counts
            k.observed((row[3] - m) * k.sample_every)
        return
    for k, f, _, _, _ in mine:  # the reference (no extension: every call taken, exact)
        valid = f[f >= 0] if f.numel() else f.view(-1)
        k.update(valid.numpy())


def _hits_only(keys: torch.Tensor, misses: _Misses | None) -> torch.Tensor:
    """``keys`` flattened with the missed positions set to -1 (skipped as padding)."""
    if misses is None:
        return keys
    out = keys.reshape(-1).clone()
    out[misses.pos] = -1
    return out


def _per_table(
    s: SessionView,
    ts: list[SessionTable],
    keys: Sequence[torch.Tensor],
    ks: list[torch.Tensor],
    pooling: list[Pooling] | None,
    buf: torch.Tensor,
    offsets: Sequence[int],
) -> list[torch.Tensor]:
    """Tables without a CPU cache: :meth:`LookupSession.lookup` each, written into ``buf``
    (``ks``: each table's keys contiguous, in the caller's shape ``keys``)."""
    outs = []
    for i, (t, k, kc) in enumerate(zip(ts, keys, ks, strict=True)):
        off, d = offsets[i], t.dim
        if pooling is None:
            block = buf[off : off + kc.numel() * d].view(*k.shape, d)
            block.copy_(s.lookup(t.name, k))
            outs.append(block)
            continue
        k2 = kc.view(k.shape[0], -1)
        if k2.numel() and bool((k2 < -1).any()):
            raise ValueError(
                f"table {t.name!r}: key {int(k2[k2 < -1][0])} (keys are >= 0; -1 pads a short bag)"
            )
        valid = k2 >= 0
        rows = torch.zeros(*k2.shape, d, device=buf.device)
        if bool(valid.any()):
            rows[valid] = s.lookup(t.name, k2[valid])
        acc = torch.zeros(k2.shape[0], d, device=buf.device)
        for j in range(k2.shape[1]):
            acc += rows[:, j]
        if pooling[i] is Pooling.MEAN:
            n = valid.sum(1)
            ok = n > 0
            acc[ok] = acc[ok] / n[ok].to(torch.float32)[:, None]
        buf[:, off : off + d] = acc
    return outs if pooling is None else [buf]
