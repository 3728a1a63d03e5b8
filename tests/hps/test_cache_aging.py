"""LFU aging: counters (and a session's key statistics) halve every ``lfu_decay_interval``
looked-up keys, so a drift in popularity is followed; exact arithmetic, config, sessions."""

from __future__ import annotations

import gc
import math
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from hps.advisor import KeyStatistics, zipf_hit_curve
from hps.config import parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EMPTY_KEY, EmbeddingCache, count_of, level_of
from hps.storage.sparse_files import write_table
from hps.types import DEFAULT_LFU_DECAY_KEYS_PER_SLOT, CachePolicy, StorageBackend
from tests.hps.hps_helpers import make_table


def _one_set(per_slot: float, capacity: int = 4) -> EmbeddingCache:
    """A single fully associative set (no hashing in the way of exact checks)."""
    return EmbeddingCache(
        capacity, 1, policy=CachePolicy.LFU, ways=capacity, lfu_decay_keys_per_slot=per_slot
    )


def _counter(c: EmbeddingCache, key: int) -> int:
    hit, slot = c._slots(torch.tensor([key]))
    assert bool(hit[0]), f"key {key} is not cached"
    return int(count_of(c.counters.view(-1)[slot[:1]])[0])  # uses its level stands for


def _keys(*k: int) -> torch.Tensor:
    return torch.tensor(k, dtype=torch.int64)


class _AllKeys(StorageBackend):
    """Every key in [0, n) exists with the row ``[key]``; counts reads."""

    name = "all_keys"

    def __init__(self, n: int) -> None:
        self.n = n

    def create_table(self, table: str, dim: int) -> None:
        pass

    def lookup(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return keys.astype(np.float32)[:, None], (keys >= 0) & (keys < self.n)

    def insert(self, table: str, keys: np.ndarray, values: np.ndarray) -> None:
        raise ValueError(f"{self.name}: read-only; insert into {table!r} refused")

    def size(self, table: str) -> int:
        return self.n


def _session(
    cache: EmbeddingCache, n: int = 10**6, threshold: float = 1.0, exact: bool = False
) -> LookupSession:
    return LookupSession(
        [SessionTable("t", 1, -1.0, 10**6, cache)],
        _AllKeys(n),
        None,
        hit_rate_threshold=threshold,
        exact=exact,
        max_concurrent=1,
    )


# ------------------------------------------------------------------ counter arithmetic


def test_counters_halve_exactly_when_the_clock_reaches_the_interval() -> None:
    """The module docstring's worked example: interval 10 looked-up keys (4 slots × 2.5)."""
    c = _one_set(2.5)
    assert c.lfu_decay_interval == 10
    c.insert(_keys(1, 2, 3, 4), torch.zeros(4, 1), priority=_keys(5, 3, 1, 7))
    c.invalidate(_keys(4))  # an empty slot (tag 0) stays empty through halving

    def counters() -> list[int]:
        assert int((c.tags == 0).sum()) == 1
        return [_counter(c, k) for k in (1, 2, 3)]

    c.query(_keys(100, 101, 102, 103, 104, 105))  # 6 keys, no hit
    assert counters() == [5, 3, 1] and c.decay_epoch == 0
    c.query(_keys(1, 106, 107))  # clock 9: key 1 hit, no halving yet
    assert counters() == [6, 3, 1] and c.decay_epoch == 0
    c.query(_keys(1))  # clock 10: every counter halves first ([3, 1, 0]), then the hit counts
    assert counters() == [4, 1, 0] and c.decay_epoch == 1
    # counts weigh the clock: 25 more looked-up keys cross 20 and 30 → two halvings in one query
    c.query(_keys(2, 200), counts=_keys(5, 20))
    assert counters() == [
        1,
        5,
        0,
    ]  # key 1: 4 >> 2; key 2: (1 >> 2) + 5, the query's own uses in full
    assert c.decay_epoch == 3 and c.stats.decays == 3 and c._looked_up == 35
    assert len(c) == 3  # halving never evicts; a 0 counter only makes a slot replaceable
    # priority 1 takes the empty slot, then key 3's (counter 0); keys 1 (1) and 2 (5) stay
    assert c.insert(_keys(9, 10), torch.zeros(2, 1)) == 2
    assert c.contains(_keys(1, 2, 9, 10)).all() and not bool(c.contains(_keys(3))[0])
    assert c.insert(_keys(11, 12), torch.zeros(2, 1)) == 0 and c.stats.overflowed == 2


def test_a_huge_query_saturates_the_shift() -> None:
    c = _one_set(0.25)  # interval 1
    c.insert(_keys(1), torch.zeros(1, 1), priority=_keys(2**31 - 1))
    c.query(_keys(1, 5), counts=_keys(1, 10_000))
    assert _counter(c, 1) == 1 and c.decay_epoch == 10_001  # shifted to 0, then its own hit
    assert int((c.tags == 0).sum()) == 3


def test_a_query_longer_than_the_period_keeps_its_own_hot_hits() -> None:
    """A 65,536-key batch against a small cache's period halves the cache many times in one
    query; the query's own hits count after those halvings, so its hot key is not lost to the
    cold misses inserted right after (with the halvings last it would be (1 + 10) >> 15 = 0)."""
    c = _one_set(0.25)  # interval 1
    c.insert(_keys(1, 2, 3, 4), torch.zeros(4, 1), priority=_keys(1, 1, 1, 1))
    _, hit = c.query(_keys(1, 50, 51, 52, 53, 54), counts=_keys(10, 1, 1, 1, 1, 1))
    assert hit.tolist() == [True] + [False] * 5 and c.decay_epoch == 15
    assert [_counter(c, k) for k in (1, 2, 3, 4)] == [10, 0, 0, 0]
    assert c.insert(_keys(50, 51, 52, 53, 54), torch.zeros(5, 1)) == 3  # the 0 counters only
    assert bool(c.contains(_keys(1))[0]) and c.stats.overflowed == 2


def test_an_aging_period_that_overflows_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"lfu_decay_keys_per_slot 1e\+300 × 8 slots is no usable aging period"
    ):
        EmbeddingCache(8, 1, policy="lfu", ways=8, lfu_decay_keys_per_slot=1e300)
    assert (
        EmbeddingCache(8, 1, policy="lru", ways=8, lfu_decay_keys_per_slot=1e300).lfu_decay_interval
        == 0
    )


def test_interval_from_keys_per_slot() -> None:
    lfu = EmbeddingCache(100, 2, policy=CachePolicy.LFU, ways=8)  # 13 sets × 8 = 104 slots
    assert lfu.capacity == 104 and lfu.lfu_decay_interval == round(
        DEFAULT_LFU_DECAY_KEYS_PER_SLOT * 104
    )
    assert (
        EmbeddingCache(100, 2, policy="lfu", ways=8, lfu_decay_keys_per_slot=0).lfu_decay_interval
        == 0
    )
    assert (
        EmbeddingCache(
            100, 2, policy="lfu", ways=8, lfu_decay_keys_per_slot=1e-9
        ).lfu_decay_interval
        == 1
    )
    assert (
        EmbeddingCache(100, 2, policy="lru", ways=8, lfu_decay_keys_per_slot=1.0).lfu_decay_interval
        == 0
    )


def test_lru_and_never_aging_lfu_do_not_age() -> None:
    for c in (EmbeddingCache(4, 1, ways=4, lfu_decay_keys_per_slot=0.25), _one_set(0)):
        c.insert(_keys(1), torch.zeros(1, 1), priority=_keys(8))
        before = _counter(c, 1)
        for _ in range(50):
            c.query(_keys(2, 3))
        assert c.decay_epoch == 0 and c.stats.decays == 0 and _counter(c, 1) == before


def test_writes_never_move_the_clock() -> None:
    """Insertions (warm-up, fills), updates, invalidation: only lookups age the cache."""
    c = _one_set(0.25)  # interval 1
    c.insert(_keys(1, 2), torch.zeros(2, 1), priority=_keys(8, 8))
    c.update_if_present(_keys(1), torch.ones(1, 1))
    c.invalidate(_keys(2))
    c.contains(_keys(1, 2))
    c.next_refresh_keys(1.0)
    assert c._looked_up == 0 and c.decay_epoch == 0 and _counter(c, 1) == 8


def test_insert_halves_a_priority_counted_before_a_halving() -> None:
    c = _one_set(1.0)  # interval 4
    c.query(_keys(10, 11, 12, 13, 14, 15, 16, 17))  # clock 8: epoch 2
    c.insert(_keys(1), torch.zeros(1, 1), priority=_keys(12), epoch=0)
    c.insert(_keys(2), torch.zeros(1, 1), priority=_keys(12), epoch=1)
    c.insert(_keys(3), torch.zeros(1, 1), priority=_keys(12))  # counted now
    c.insert(_keys(4), torch.zeros(1, 1), priority=_keys(12), epoch=5)  # "ahead": not scaled up
    assert [_counter(c, k) for k in (1, 2, 3, 4)] == [3, 6, 12, 12]
    lru = EmbeddingCache(4, 1, ways=4)
    lru.insert(
        _keys(1), torch.zeros(1, 1), priority=_keys(12), epoch=-3
    )  # LRU: epochs mean nothing
    assert lru.contains(_keys(1)).all()


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "10", None, True])
def test_bad_decay_values_are_named(bad) -> None:
    with pytest.raises(
        ValueError, match=r"lfu_decay_keys_per_slot must be a finite number >= 0.*got"
    ):
        EmbeddingCache(8, 1, policy="lfu", lfu_decay_keys_per_slot=bad)


def test_key_statistics_halve() -> None:
    ks = KeyStatistics()
    ks.update(np.array([1, 2, 3], np.int64), np.array([9, 1, 4], np.int64))
    ks.halve()
    assert ks.count_of(np.array([1, 2, 3], np.int64)).tolist() == [4, 0, 2]
    assert (
        ks.hottest().tolist() == [1, 3] and ks.total == 14
    )  # 2 reached 0: dropped; total not aged
    ks.halve(0)
    ks.halve(100)
    assert ks.hottest().size == 0 and ks.total == 14
    with pytest.raises(ValueError, match="times >= 0, got -1"):
        ks.halve(-1)


# ------------------------------------------------------------------ drift


def _run_drift(c: EmbeddingCache, old: torch.Tensor, new: torch.Tensor, rounds: int) -> list[float]:
    """``rounds`` queries of ``old``, then of ``new`` (misses inserted with their request counts,
    as the benchmark's raw-cache protocol); the hit rate of each ``new`` round."""
    rates = []
    for i in range(2 * rounds):
        k = old if i < rounds else new
        _, hit = c.query(k)
        c.insert(k[~hit], torch.zeros(int((~hit).sum()), 1))
        if i >= rounds:
            rates.append(float(hit.float().mean()))
    return rates


def test_drift_to_a_disjoint_hot_set_recovers_only_with_aging() -> None:
    """Yesterday's 64 hot keys fill a 64-slot cache; today 64 others are looked up every round.
    Never aging: the old counts (40) stay above any new key's (1): the new set never hits.
    Aging every 2 keys/slot (128 looked-up keys = 2 rounds): the old counters reach 0 within a
    few rounds, the new set takes over and then always hits (the ideal: it fits exactly)."""
    old, new = torch.arange(64), torch.arange(1000, 1064)
    never = _run_drift(_one_set(0, capacity=64), old, new, rounds=40)
    assert max(never) == 0.0
    aged = _run_drift(_one_set(2, capacity=64), old, new, rounds=40)
    first_full = aged.index(1.0)
    assert first_full <= 6 and min(aged[first_full:]) == 1.0


class _Zipf:
    def __init__(self, n: int, alpha: float, seed: int) -> None:
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(p / p.sum())
        self.perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
        self.rng = np.random.default_rng(seed + 100)

    def sample(self, k: int) -> torch.Tensor:
        return torch.from_numpy(
            self.perm[np.minimum(np.searchsorted(self.cdf, self.rng.random(k)), self.cdf.size - 1)]
        )


def _session_drift(
    per_slot: float, n: int = 5_000, before: int = 300, after: int = 80
) -> tuple[float, float, float]:
    """Zipf α=1.05 over ``n`` keys through a session (sync fill, key statistics on), 10% cache,
    batches of n/10; the popularity permuted after ``before`` batches. Returns the hit rates
    (all keys) over the second half before the drift, the last quarter after it, and the ideal.

    The aging interval (``per_slot`` × n/10 slots keys) is ``per_slot`` batches whatever ``n``
    is, so ``n`` sets only the cost of a lookup; at 5,000 keys every assertion of
    :func:`test_zipf_drift_through_a_session` holds with a margin of at least 0.012."""
    c = EmbeddingCache(n // 10, 1, policy=CachePolicy.LFU, lfu_decay_keys_per_slot=per_slot)
    s = _session(c, n)
    a, b = _Zipf(n, 1.05, seed=1), _Zipf(n, 1.05, seed=2)
    series, hits = [], 0
    for i in range(before + after):
        s.lookup("t", (a if i < before else b).sample(n // 10))
        now = s.stats("t")["hits_all"]["cache"]
        series.append((now - hits) / (n // 10))
        hits = now
    s.close()
    ideal = float(zipf_hit_curve(n, 1.05, np.array([c.capacity]))[0])
    return (
        float(np.mean(series[before // 2 : before])),
        float(np.mean(series[-after // 4 :])),
        ideal,
    )


def test_zipf_drift_through_a_session() -> None:
    """Never aging, the new hot keys must out-count the old ones' lifetime totals and the hit rate
    lags far behind the ideal; with the default aging it is back near the ideal (and near its own
    steady state) within the last quarter, at a small steady-state cost."""
    steady_never, after_never, ideal = _session_drift(0.0)
    steady_aged, after_aged, _ = _session_drift(DEFAULT_LFU_DECAY_KEYS_PER_SLOT)
    assert after_never < ideal - 0.06
    assert after_aged > ideal - 0.03 and after_aged > after_never + 0.04
    assert abs(after_aged - steady_aged) < 0.015  # recovered
    assert steady_aged > steady_never - 0.03


def test_a_cache_smaller_than_one_request_s_period_is_not_worse_than_lru() -> None:
    """128 slots age every 2,560 looked-up keys, a batch has 8,192: each request halves the
    cache 3-4 times. Counting the request's own hits after those halvings keeps LFU with the
    default aging level with LRU and never-aging LFU (halvings last gave 0.52 against 0.58)."""
    n, batch = 20_000, 8192

    def steady(policy: CachePolicy, per_slot: float) -> float:
        c = EmbeddingCache(128, 1, policy=policy, lfu_decay_keys_per_slot=per_slot)
        s = _session(c, n)
        z, series, hits = _Zipf(n, 1.05, seed=1), [], 0
        for _ in range(60):
            s.lookup("t", z.sample(batch))
            now = s.stats("t")["hits_all"]["cache"]
            series.append((now - hits) / batch)
            hits = now
        s.close()
        assert c.lfu_decay_interval in (0, 2560)
        return float(np.mean(series[20:]))

    lru, never, aged = (
        steady(CachePolicy.LRU, 0),
        steady(CachePolicy.LFU, 0),
        steady(CachePolicy.LFU, 20),
    )
    assert aged > lru - 0.015 and aged > never - 0.015, (lru, never, aged)


# ------------------------------------------------------------------ sessions


def test_session_key_statistics_age_in_step_with_the_cache() -> None:
    """A key hot long ago re-enters with its aged count, not its lifetime total (interval 4)."""
    c = _one_set(1.0)
    s = _session(c)
    ks = s.key_stats["t"]
    s.lookup("t", _keys(7, 7, 7))  # miss, priority 3; clock 3
    assert _counter(c, 7) == 3 and ks.count_of(np.array([7]))[0] == 3
    s.lookup("t", _keys(7))  # clock 4: halved first (3 >> 1 = 1), then the hit → 2
    assert _counter(c, 7) == 2 and c.decay_epoch == 1
    s.lookup("t", _keys(1))  # the statistics catch up: 7: 4 >> 1 = 2; clock 5
    assert ks.count_of(np.array([7, 1])).tolist() == [2, 1] == [_counter(c, 7), _counter(c, 1)]
    c.invalidate(_keys(7))  # evicted
    s.lookup("t", _keys(1, 2, 3))  # clock 8: halved (epoch 2)
    s.lookup("t", _keys(7))  # priority 1 + (2 >> 1) = 2; without aged statistics it would be 1 + 4
    assert _counter(c, 7) == 2
    s.close()


@pytest.mark.parametrize("mode", ["sync", "async", "exact_async"])
def test_a_query_s_own_uses_count_in_full_after_its_halvings(mode: str) -> None:
    """8 occurrences of a missed key cross the interval (4) twice: the halvings age what came
    before, and whether the key is inserted now or by the background worker later, it gets
    what a resident's hits would add: all 8."""
    c = _one_set(1.0)
    s = _session(c, threshold=1.0 if mode == "sync" else 0.0, exact=mode == "exact_async")
    rows = s.lookup("t", torch.full((8,), 7, dtype=torch.int64))
    s.drain()
    assert rows[:, 0].tolist() == (
        [-1.0] * 8 if mode == "async" else [7.0] * 8
    )  # async: default now
    assert c.decay_epoch == 2 and _counter(c, 7) == 8
    s.lookup("t", _keys(5))  # clock 9: no halving
    assert s.key_stats["t"].count_of(np.array([7]))[0] == 8
    s.lookup("t", _keys(5, 5, 5))  # clock 12: epoch 3, the statistics follow
    assert s.key_stats["t"].count_of(np.array([7]))[0] == 4 and _counter(c, 7) == 4
    s.close()


def test_a_swapped_in_cache_restarts_the_statistics_epoch() -> None:
    """The statistics follow the cache the table holds now: a fresh cache (epoch 0) neither
    halves them on the swap nor waits until it reaches the old cache's epoch."""
    c = _one_set(0.25)  # interval 1
    s = _session(c)
    for _ in range(3):
        s.lookup("t", _keys(7, 8))  # every lookup crosses the interval twice: epoch 6
    ks = s.key_stats["t"]
    assert (
        c.decay_epoch == 6 and ks.count_of(np.array([7]))[0] == 1
    )  # the last lookup's, not yet halved
    s.tables["t"].cache = _one_set(0.25)
    s.lookup("t", _keys(9))  # the fresh cache's epoch 0 → 1
    assert ks.count_of(np.array([7, 9])).tolist() == [1, 1]
    s.lookup("t", _keys(1))  # statistics halved once, to the fresh cache's epoch 1
    assert ks.count_of(np.array([7, 9])).tolist() == [0, 0]
    s.close()


def test_the_first_cache_a_table_gets_does_not_halve_earlier_statistics() -> None:
    """Statistics recorded while a table had no cache are not halved for agings the cache
    went through before it was put in (another session's lookups)."""
    shared = _one_set(1.0)  # interval 4
    other = _session(shared)
    other.lookup("t", torch.arange(24))  # epoch 6
    s = LookupSession(
        [SessionTable("t", 1, -1.0, 10**6, None)], _AllKeys(100), None, max_concurrent=1
    )
    s.lookup("t", torch.full((40,), 7, dtype=torch.int64))
    s.tables["t"].cache = shared
    s.lookup("t", _keys(1))  # no halving by this lookup
    assert s.key_stats["t"].count_of(np.array([7]))[0] == 40 and shared.decay_epoch == 6
    s.lookup("t", _keys(1, 2, 3))  # clock 28: epoch 7, the statistics follow once
    assert s.key_stats["t"].count_of(np.array([7]))[0] == 20
    other.close()
    s.close()


def test_a_background_fill_goes_into_the_cache_its_lookup_queried() -> None:
    """Above the hit-rate threshold a miss is filled by the worker; when the table's cache is
    swapped before the job runs, the row and its priority (counted at the queried cache's
    epoch) go into the queried cache, never into the new one with another cache's epoch."""
    queried = _one_set(1000.0)  # epoch 0
    swapped_in = _one_set(0.25)
    swapped_in.query(torch.arange(100, 130))  # epoch 30
    s = _session(queried, threshold=0.0)
    gate = threading.Event()
    s.fill.submit(s.tables["t"], gate.wait)  # hold the worker
    s.lookup("t", torch.full((1000,), 7, dtype=torch.int64))
    s.tables["t"].cache = swapped_in
    gate.set()
    s.drain()
    # 1000 uses at the queried cache's epoch (rounded down to a one-byte level: 959)
    assert _counter(queried, 7) == int(count_of(level_of(_keys(1000)))[0]) == 959
    assert not bool(swapped_in.contains(_keys(7))[0])
    s.close()


def test_a_cache_taken_out_of_a_table_is_freed() -> None:
    c = _one_set(0.25)
    s = _session(c)
    for _ in range(2):
        s.lookup("t", _keys(1, 2))  # epoch 4
    assert "t" in s._stats_epoch
    ref = weakref.ref(c)
    s.tables["t"].cache = None
    del c
    gc.collect()
    assert ref() is None  # the session's aging bookkeeping holds no strong reference
    s.lookup("t", _keys(1))  # and still works without a cache
    s.close()


def test_statistics_labelled_with_the_epoch_they_were_aged_to_under_a_race() -> None:
    """Two lookups racing: one reads the cache's epoch, the other ages cache and statistics
    further before the first takes the aging lock. The first must return the epoch the
    statistics now match, not the older one it read (its priorities would be over-halved)."""

    class Paused(EmbeddingCache):
        pause: tuple[threading.Event, threading.Event] | None = None

        @property
        def decay_epoch(self) -> int:
            if Paused.pause is not None and threading.current_thread().name == "racer":
                (read, go), Paused.pause = Paused.pause, None
                read.set()
                go.wait(5)
            return self.__dict__.get("_epoch", 0)

        @decay_epoch.setter
        def decay_epoch(self, v: int) -> None:
            self.__dict__["_epoch"] = v

    c = Paused(4, 1, policy="lfu", ways=4, lfu_decay_keys_per_slot=1.0)  # interval 4
    s = LookupSession(
        [SessionTable("t", 1, -1.0, 10**6, c)],
        _AllKeys(100),
        None,
        hit_rate_threshold=1.0,
        max_concurrent=2,
    )
    s.lookup("t", _keys(9, 9, 9, 9))  # epoch 1
    read, go = threading.Event(), threading.Event()
    Paused.pause = (read, go)
    got: dict[str, int] = {}
    racer = threading.Thread(
        target=lambda: got.update(e=s._age_key_stats(s.tables["t"], c)), name="racer"
    )
    racer.start()
    assert read.wait(5)
    s.lookup("t", _keys(60, 61, 62, 63))  # epoch 2, statistics aged to it
    go.set()
    racer.join(5)
    assert got["e"] == s._stats_epoch["t"][1] == c.decay_epoch == 2
    s.close()


def test_online_update_keeps_counters(tmp_path: Path) -> None:
    from hps.storage.volatile import HashMapBackend
    from hps.updates import FileLogSource, UpdateApplier

    vdb = HashMapBackend(num_partitions=1)
    vdb.create_table("t", 1)
    vdb.insert("t", np.arange(10, dtype=np.int64), np.zeros((10, 1), np.float32))
    c = _one_set(1.0)
    s = LookupSession([SessionTable("t", 1, 0.0, 100, c)], vdb, None, hit_rate_threshold=1.0)
    s.lookup("t", _keys(3, 3, 3))
    ap = UpdateApplier(
        FileLogSource(tmp_path / "none.log"), [s], vdb, None, offset_file=tmp_path / "off"
    )
    ap.apply({"t": (np.array([3], np.int64), np.full((1, 1), 5.0, np.float32))}, "1")
    assert _counter(c, 3) == 3 and c._looked_up == 3
    assert s.lookup("t", _keys(3)).tolist() == [[5.0]] and _counter(c, 3) == 2  # 3 >> 1, then + 1
    s.close()


# ------------------------------------------------------------------ config


def _doc(**model_over):
    m = {
        "model": "m",
        "max_batch_size": 32,
        "sparse_files": ["sparse/t0"],
        "embedding_table_names": ["t0"],
        "embedding_vecsize_per_table": [4],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "gpucacheper": 0.25,
        "cache_policy": "lfu",
    }
    m.update(model_over)
    return {"volatile_db": {"type": "hash_map"}, "models": [m]}


def test_config_default_round_trip_and_plumbing(tmp_path: Path) -> None:
    cfg = parse_config(_doc())
    assert cfg.model("m").cache_lfu_decay_keys_per_slot == DEFAULT_LFU_DECAY_KEYS_PER_SLOT
    cfg = parse_config(_doc(cache_lfu_decay_keys_per_slot=2.5), tmp_path)
    assert cfg.model("m").cache_lfu_decay_keys_per_slot == 2.5
    assert cfg.to_dict()["models"][0]["cache_lfu_decay_keys_per_slot"] == 2.5
    assert parse_config(cfg.to_dict()) == cfg
    assert (
        parse_config(_doc(cache_lfu_decay_keys_per_slot=0)).model("m").cache_lfu_decay_keys_per_slot
        == 0.0
    )
    keys, rows = make_table(400, 4, seed=3)
    write_table(tmp_path / "sparse/t0", keys, rows)
    ps = HierarchicalParameterServer(cfg)
    cache = ps.session("m").tables["t0"].cache
    assert cache.policy is CachePolicy.LFU and cache.lfu_decay_interval == round(
        2.5 * cache.capacity
    )
    ps.close()


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            -1,
            r"models\[0\]\.cache_lfu_decay_keys_per_slot: -1.0 is impossible; expected looked-up keys per cache",
        ),
        (math.inf, r"models\[0\]\.cache_lfu_decay_keys_per_slot: inf is impossible"),
        (math.nan, r"models\[0\]\.cache_lfu_decay_keys_per_slot: nan is impossible"),
        ("ten", r"models\[0\]\.cache_lfu_decay_keys_per_slot: expected a number, got .ten."),
        (True, r"models\[0\]\.cache_lfu_decay_keys_per_slot: expected a number, got True"),
    ],
)
def test_bad_config_value_is_named(bad, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_config(_doc(cache_lfu_decay_keys_per_slot=bad))


@pytest.mark.gpu
def test_cuda_aging_matches_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    cpu = EmbeddingCache(512, 8, policy="lfu", ways=16, lfu_decay_keys_per_slot=0.5)
    gpu = EmbeddingCache(512, 8, policy="lfu", ways=16, lfu_decay_keys_per_slot=0.5, device="cuda")
    for _ in range(8):
        k = torch.unique(torch.randint(0, 5000, (700,), generator=g))
        cnt = torch.randint(1, 5, (k.numel(),), generator=g)
        a, ha = cpu.query(k, counts=cnt)
        b, hb = gpu.query(k.cuda(), counts=cnt.cuda())
        assert torch.equal(ha, hb.cpu()) and torch.equal(a, b.cpu())
        miss = ~ha
        v = k[miss].float()[:, None].repeat(1, 8)
        e = cpu.decay_epoch - 1
        assert cpu.insert(k[miss], v, cnt[miss], epoch=e) == gpu.insert(
            k[miss].cuda(), v.cuda(), cnt[miss].cuda(), epoch=e
        )
    assert cpu.decay_epoch == gpu.decay_epoch > 0
    assert torch.equal(cpu.counters, gpu.counters.cpu()) and torch.equal(cpu.keys, gpu.keys.cpu())
    assert EMPTY_KEY not in cpu.cached_keys().tolist()
