"""LFU aging: counters (and a session's key statistics) halve every ``lfu_decay_interval``
looked-up keys, so a drift in popularity is followed; exact arithmetic, config, sessions."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hps_helpers import make_table

from hps.advisor import KeyStatistics, zipf_hit_curve
from hps.cache import EMPTY_KEY, EmbeddingCache
from hps.config import parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.session import LookupSession, SessionTable
from hps.sparse_files import write_table
from hps.types import DEFAULT_LFU_DECAY_KEYS_PER_SLOT, CachePolicy, StorageBackend


def _one_set(per_slot: float, capacity: int = 4) -> EmbeddingCache:
    """A single fully associative set (no hashing in the way of exact checks)."""
    return EmbeddingCache(capacity, 1, policy=CachePolicy.LFU, ways=capacity, lfu_decay_keys_per_slot=per_slot)


def _counter(c: EmbeddingCache, key: int) -> int:
    hit, slot = c._slots(torch.tensor([key]))
    assert bool(hit[0]), f"key {key} is not cached"
    return int(c.counters.view(-1)[slot[0]])


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


def _session(cache: EmbeddingCache, n: int = 10**6, threshold: float = 1.0, exact: bool = False) -> LookupSession:
    return LookupSession([SessionTable("t", 1, -1.0, 10**6, cache)], _AllKeys(n), None,
                         hit_rate_threshold=threshold, exact=exact, max_concurrent=1)


# ------------------------------------------------------------------ counter arithmetic


def test_counters_halve_exactly_when_the_clock_reaches_the_interval() -> None:
    """The module docstring's worked example: interval 10 looked-up keys (4 slots × 2.5)."""
    c = _one_set(2.5)
    assert c.lfu_decay_interval == 10
    c.insert(_keys(1, 2, 3, 4), torch.zeros(4, 1), priority=_keys(5, 3, 1, 7))
    c.invalidate(_keys(4))  # an empty slot: its -1 must survive halving

    def counters() -> list[int]:
        assert int((c.counters == -1).sum()) == 1
        return [_counter(c, k) for k in (1, 2, 3)]

    c.query(_keys(100, 101, 102, 103, 104, 105))  # 6 keys, no hit
    assert counters() == [5, 3, 1] and c.decay_epoch == 0
    c.query(_keys(1, 106, 107))  # clock 9: key 1 hit, no halving yet
    assert counters() == [6, 3, 1] and c.decay_epoch == 0
    c.query(_keys(1))  # clock 10: the hit counts first (7), then every counter halves
    assert counters() == [3, 1, 0] and c.decay_epoch == 1
    # counts weigh the clock: 25 more looked-up keys cross 20 and 30 → two halvings in one query
    c.query(_keys(2, 200), counts=_keys(5, 20))
    assert counters() == [0, 1, 0]  # key 2: (1 + 5) >> 2
    assert c.decay_epoch == 3 and c.stats.decays == 3 and c._looked_up == 35
    assert len(c) == 3  # halving never evicts; a 0 counter only makes a slot replaceable
    # priority 1: the empty slot, then a counter of 0 (key 1 or 3); key 2 (counter 1) stays
    assert c.insert(_keys(9, 10), torch.zeros(2, 1)) == 2
    assert c.contains(_keys(2, 9, 10)).all() and int(c.contains(_keys(1, 3)).sum()) == 1
    assert c.insert(_keys(11, 12), torch.zeros(2, 1)) == 1 and c.stats.overflowed == 1


def test_a_huge_query_saturates_the_shift() -> None:
    c = _one_set(0.25)  # interval 1
    c.insert(_keys(1), torch.zeros(1, 1), priority=_keys(2**31 - 1))
    c.query(_keys(1, 5), counts=_keys(1, 10_000))
    assert _counter(c, 1) == 0 and c.decay_epoch == 10_001
    assert int((c.counters == -1).sum()) == 3


def test_interval_from_keys_per_slot() -> None:
    lfu = EmbeddingCache(100, 2, policy=CachePolicy.LFU, ways=8)  # 13 sets × 8 = 104 slots
    assert lfu.capacity == 104 and lfu.lfu_decay_interval == round(DEFAULT_LFU_DECAY_KEYS_PER_SLOT * 104)
    assert EmbeddingCache(100, 2, policy="lfu", ways=8, lfu_decay_keys_per_slot=0).lfu_decay_interval == 0
    assert EmbeddingCache(100, 2, policy="lfu", ways=8, lfu_decay_keys_per_slot=1e-9).lfu_decay_interval == 1
    assert EmbeddingCache(100, 2, policy="lru", ways=8, lfu_decay_keys_per_slot=1.0).lfu_decay_interval == 0


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
    lru.insert(_keys(1), torch.zeros(1, 1), priority=_keys(12), epoch=-3)  # LRU: epochs mean nothing
    assert lru.contains(_keys(1)).all()


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "10", None, True])
def test_bad_decay_values_are_named(bad) -> None:
    with pytest.raises(ValueError, match=r"lfu_decay_keys_per_slot must be a finite number >= 0.*got"):
        EmbeddingCache(8, 1, policy="lfu", lfu_decay_keys_per_slot=bad)


def test_key_statistics_halve() -> None:
    ks = KeyStatistics()
    ks.update(np.array([1, 2, 3], np.int64), np.array([9, 1, 4], np.int64))
    ks.halve()
    assert ks.count_of(np.array([1, 2, 3], np.int64)).tolist() == [4, 0, 2]
    assert ks.hottest().tolist() == [1, 3] and ks.total == 14  # 2 reached 0: dropped; total not aged
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
        return torch.from_numpy(self.perm[np.minimum(np.searchsorted(self.cdf, self.rng.random(k)), self.cdf.size - 1)])


def _session_drift(per_slot: float, n: int = 10_000, before: int = 300, after: int = 80) -> tuple[float, float, float]:
    """Zipf α=1.05 over ``n`` keys through a session (sync fill, key statistics on), 10% cache,
    batches of n/10; the popularity permuted after ``before`` batches. Returns the hit rates
    (all keys) over the second half before the drift, the last quarter after it, and the ideal."""
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
    return float(np.mean(series[before // 2:before])), float(np.mean(series[-after // 4:])), ideal


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


# ------------------------------------------------------------------ sessions


def test_session_key_statistics_age_in_step_with_the_cache() -> None:
    """A key hot long ago re-enters with its aged count, not its lifetime total (interval 4)."""
    c = _one_set(1.0)
    s = _session(c)
    ks = s.key_stats["t"]
    s.lookup("t", _keys(7, 7, 7))  # miss, priority 3; clock 3
    assert _counter(c, 7) == 3 and ks.count_of(np.array([7]))[0] == 3
    s.lookup("t", _keys(7))  # hit → 4; clock 4: halved → 2
    assert _counter(c, 7) == 2 and c.decay_epoch == 1
    s.lookup("t", _keys(1))  # the statistics catch up first: 7: 4 >> 1 = 2; clock 5
    assert ks.count_of(np.array([7, 1])).tolist() == [2, 1] == [_counter(c, 7), _counter(c, 1)]
    c.invalidate(_keys(7))  # evicted
    s.lookup("t", _keys(1, 2, 3))  # clock 8: halved (epoch 2)
    s.lookup("t", _keys(7))  # priority 1 + (2 >> 1) = 2; without aged statistics it would be 1 + 4
    assert _counter(c, 7) == 2
    s.close()


@pytest.mark.parametrize("mode", ["sync", "async", "exact_async"])
def test_priorities_counted_before_the_query_halves_them(mode: str) -> None:
    """8 occurrences of a missed key cross the interval (4) twice: whether it is inserted now or
    by the background worker later, it gets what a resident counter would hold: 8 >> 2."""
    c = _one_set(1.0)
    s = _session(c, threshold=1.0 if mode == "sync" else 0.0, exact=mode == "exact_async")
    rows = s.lookup("t", torch.full((8,), 7, dtype=torch.int64))
    s.drain()
    assert rows[:, 0].tolist() == ([-1.0] * 8 if mode == "async" else [7.0] * 8)  # async: default now
    assert c.decay_epoch == 2 and _counter(c, 7) == 2
    s.lookup("t", _keys(5))
    assert s.key_stats["t"].count_of(np.array([7]))[0] == 2
    s.close()


def test_a_swapped_in_cache_restarts_the_statistics_epoch() -> None:
    """The statistics follow the cache the table holds now: a fresh cache (epoch 0) neither
    halves them on the swap nor waits until it reaches the old cache's epoch."""
    c = _one_set(0.25)  # interval 1
    s = _session(c)
    for _ in range(3):
        s.lookup("t", _keys(7, 8))  # every lookup crosses the interval twice: epoch 6
    ks = s.key_stats["t"]
    assert c.decay_epoch == 6 and ks.count_of(np.array([7]))[0] == 1  # the last lookup's, not yet halved
    s.tables["t"].cache = _one_set(0.25)
    s.lookup("t", _keys(9))  # the fresh cache's epoch 0 → 1
    assert ks.count_of(np.array([7, 9])).tolist() == [1, 1]
    s.lookup("t", _keys(1))  # statistics halved once, to the fresh cache's epoch 1
    assert ks.count_of(np.array([7, 9])).tolist() == [0, 0]
    s.close()


def test_online_update_keeps_counters(tmp_path: Path) -> None:
    from hps.updates import FileLogSource, UpdateApplier
    from hps.volatile import HashMapBackend

    vdb = HashMapBackend(num_partitions=1)
    vdb.create_table("t", 1)
    vdb.insert("t", np.arange(10, dtype=np.int64), np.zeros((10, 1), np.float32))
    c = _one_set(1.0)
    s = LookupSession([SessionTable("t", 1, 0.0, 100, c)], vdb, None, hit_rate_threshold=1.0)
    s.lookup("t", _keys(3, 3, 3))
    ap = UpdateApplier(FileLogSource(tmp_path / "none.log"), [s], vdb, None, offset_file=tmp_path / "off")
    ap.apply({"t": (np.array([3], np.int64), np.full((1, 1), 5.0, np.float32))}, "1")
    assert _counter(c, 3) == 3 and c._looked_up == 3
    assert s.lookup("t", _keys(3)).tolist() == [[5.0]] and _counter(c, 3) == 2  # 3 + 1 = 4 → halved
    s.close()


# ------------------------------------------------------------------ config


def _doc(**model_over):
    m = {"model": "m", "max_batch_size": 32, "sparse_files": ["sparse/t0"], "embedding_table_names": ["t0"],
         "embedding_vecsize_per_table": [4], "maxnum_catfeature_query_per_table_per_sample": [1],
         "gpucacheper": 0.25, "cache_policy": "lfu"}
    m.update(model_over)
    return {"volatile_db": {"type": "hash_map"}, "models": [m]}


def test_config_default_round_trip_and_plumbing(tmp_path: Path) -> None:
    cfg = parse_config(_doc())
    assert cfg.model("m").cache_lfu_decay_keys_per_slot == DEFAULT_LFU_DECAY_KEYS_PER_SLOT
    cfg = parse_config(_doc(cache_lfu_decay_keys_per_slot=2.5), tmp_path)
    assert cfg.model("m").cache_lfu_decay_keys_per_slot == 2.5
    assert cfg.to_dict()["models"][0]["cache_lfu_decay_keys_per_slot"] == 2.5
    assert parse_config(cfg.to_dict()) == cfg
    assert parse_config(_doc(cache_lfu_decay_keys_per_slot=0)).model("m").cache_lfu_decay_keys_per_slot == 0.0
    keys, rows = make_table(400, 4, seed=3)
    write_table(tmp_path / "sparse/t0", keys, rows)
    ps = HierarchicalParameterServer(cfg)
    cache = ps.session("m").tables["t0"].cache
    assert cache.policy is CachePolicy.LFU and cache.lfu_decay_interval == round(2.5 * cache.capacity)
    ps.close()


@pytest.mark.parametrize("bad, match", [
    (-1, r"models\[0\]\.cache_lfu_decay_keys_per_slot: -1.0 is impossible; expected looked-up keys per cache"),
    (math.inf, r"models\[0\]\.cache_lfu_decay_keys_per_slot: inf is impossible"),
    (math.nan, r"models\[0\]\.cache_lfu_decay_keys_per_slot: nan is impossible"),
    ("10", r"models\[0\]\.cache_lfu_decay_keys_per_slot: expected a number, got '10'"),
    (True, r"models\[0\]\.cache_lfu_decay_keys_per_slot: expected a number, got True"),
])
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
        assert cpu.insert(k[miss], v, cnt[miss], epoch=e) == gpu.insert(k[miss].cuda(), v.cuda(), cnt[miss].cuda(),
                                                                         epoch=e)
    assert cpu.decay_epoch == gpu.decay_epoch > 0
    assert torch.equal(cpu.counters, gpu.counters.cpu()) and torch.equal(cpu.keys, gpu.keys.cpu())
    assert EMPTY_KEY not in cpu.cached_keys().tolist()
