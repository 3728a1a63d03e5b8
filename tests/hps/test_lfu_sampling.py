"""LFU use sampling: a cache that counts the uses of one query in ``lfu_sampling``, each hit
then as that many uses, and the fused pass's per-table use weights behind it (0: the counters
are neither read nor written; the hits and unique hits are counted all the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hps.fused import GatherArgs, gather, gather_reference
from hps.session import LookupSession, SessionTable
from hps.storage.cache import (
    LEVEL_COUNTS,
    EmbeddingCache,
    StaticEmbeddingCache,
    count_of,
)
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy, Pooling
from tests.hps.hps_helpers import needs_ext

SPECS = [(300, 4), (50, 8), (1000, 3)]  # (rows, dim) per table
NAMES = ["t0", "t1", "t2"]


def _rows(n: int, d: int) -> np.ndarray:
    return (np.arange(n * d, dtype=np.float32).reshape(n, d) % 97) - 40.0


def _full_caches(policy: str) -> list[EmbeddingCache]:
    """One cache per table holding all its rows (every key below n hits), counters at 0."""
    out = []
    for n, d in SPECS:
        c = EmbeddingCache(16 * n, d, policy=policy, ways=8, lfu_decay_keys_per_slot=0.0)
        c.insert(torch.arange(n), torch.from_numpy(_rows(n, d)))
        assert bool(c.contains(torch.arange(n)).all())
        c.counters.zero_()
        out.append(c)
    return out


def _args(
    caches: list[EmbeddingCache], keys: list[torch.Tensor], weights: list[int] | None
) -> GatherArgs:
    hot = [k.shape[1] for k in keys]
    width = sum(c.dim for c in caches)
    out = torch.zeros(keys[0].shape[0], width)
    offsets = [0, *np.cumsum([c.dim for c in caches])[:-1].tolist()]
    return GatherArgs(
        caches=caches,
        keys=[k.contiguous() for k in keys],
        out=out,
        out_offsets=offsets,
        out_stride=width,
        hotness=hot,
        mean=[False] * len(caches),
        stamps=[-1 if c.policy is CachePolicy.LFU else 5 for c in caches],
        streams=[1234 + i for i in range(len(caches))],
        looked_up=[0] * len(caches),
        intervals=[0] * len(caches),
        weights=weights,
    )


def _keys(seed: int, batch: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # skewed keys (repeats within a call) below each table's rows, -1 pads
    return [
        torch.where(
            torch.rand(batch, 4, generator=g) < 0.1,
            torch.tensor(-1),
            (torch.rand(batch, 4, generator=g) ** 3 * n).long(),
        )
        for n, _ in SPECS
    ]


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("weights", [[0, 1, 3], [8, 0, 0], [1, 1, 1], None])
def test_the_compiled_weights_equal_the_reference(policy: str, weights: list[int] | None) -> None:
    needs_ext()
    a, b = _full_caches(policy), _full_caches(policy)
    for seed in range(3):  # counters carried over: later calls start from raised levels
        keys = _keys(seed)
        ra = gather(_args(a, keys, weights), compiled=True)
        args_b = _args(b, keys, weights)
        rb = gather_reference(args_b)
        assert torch.equal(ra.per_table, rb.per_table)
        for ca, cb in zip(a, b, strict=True):
            assert torch.equal(ca.counters, cb.counters)
    for i, (c, k) in enumerate(zip(a, keys, strict=True)):
        if weights is not None and weights[i] == 0:
            assert int(c.counters.max()) == 0  # never read, never written
        else:
            assert int(c.counters.max()) > 0
        valid = k[k >= 0]
        assert int(ra.per_table[i, 1]) == valid.numel()  # hits: every key is cached
        assert int(ra.per_table[i, 2]) == valid.unique().numel()  # unique hits, weight or not


def test_a_weight_counts_that_many_uses_in_expectation() -> None:
    """Every slot of one table hit once at a level whose gap is wider than the weight: the
    mean count rises by the weight (a weighted step keeps the expectation)."""
    needs_ext()
    n, d = 4000, 4
    c = EmbeddingCache(16 * n, d, policy="lfu", ways=8, lfu_decay_keys_per_slot=0.0)
    c.insert(torch.arange(n), torch.zeros(n, d))
    level = 60
    assert LEVEL_COUNTS[level + 1] - LEVEL_COUNTS[level] > 8
    c.counters.fill_(level)
    keys = torch.arange(n).view(-1, 1)
    res = gather(_args([c], [keys], [8]), compiled=True)
    assert int(res.per_table[0, 1]) == int(res.per_table[0, 2]) == n
    total = count_of(c.counters).double().sum().item()
    gained = (total - c.capacity * LEVEL_COUNTS[level]) / n
    gap = LEVEL_COUNTS[level + 1] - LEVEL_COUNTS[level]
    # each slot moves up with probability 8 / gap: the mean gain is 8 ± 4 standard errors
    se = gap * (8 / gap * (1 - 8 / gap) / n) ** 0.5
    assert abs(gained - 8) < 4 * se


@pytest.mark.parametrize("compiled", [True, False])
def test_a_negative_weight_is_refused_before_anything_is_counted(compiled: bool) -> None:
    if compiled:
        needs_ext()
    caches = _full_caches("lfu")
    before = [c.counters.clone() for c in caches]
    with pytest.raises(ValueError, match="table 1: use weight -2 is negative"):
        gather(_args(caches, _keys(0), [1, -2, 1]), compiled=compiled)
    for c, x in zip(caches, before, strict=True):
        assert torch.equal(c.counters, x)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8"])
def test_a_bad_sampling_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        EmbeddingCache(64, 4, policy="lfu", lfu_sampling=bad)  # type: ignore[arg-type]
    assert str(e.value) == (
        "cache lfu_sampling must be an integer >= 1 (one query in it counts its LFU uses, "
        f"each as that many), got {bad!r}"
    )


def test_one_query_in_k_counts_its_uses_as_k() -> None:
    c = EmbeddingCache(64, 4, policy="lfu", lfu_sampling=4)
    got = []
    for _ in range(8):
        c._tick()
        got.append((c._clock, c.use_weight()))
    assert got == [(k, 4 if k % 4 == 0 else 0) for k in range(2, 10)]
    assert EmbeddingCache(64, 4, policy="lfu").use_weight() == 1
    lru = EmbeddingCache(64, 4, policy="lru", lfu_sampling=4)  # LRU stamps every hit
    assert lru.lfu_sampling == 1 and lru.use_weight() == 1


def _session(compiled: bool, sampling: int, small: bool) -> LookupSession:
    """LFU caches of a third of each table's rows aging every half a key per slot (misses,
    evictions, halvings), or (``small`` False) of 16 × its rows, never aging (every key hits
    once cached, and only the hits' uses write a counter)."""
    tables = [
        SessionTable(
            name,
            d,
            -1.0,
            10**6,
            EmbeddingCache(
                n // 3 if small else 16 * n,
                d,
                policy="lfu",
                ways=8,
                lfu_decay_keys_per_slot=0.5 if small else 0.0,
                lfu_sampling=sampling,
            ),
        )
        for name, (n, d) in zip(NAMES, SPECS, strict=True)
    ]
    return LookupSession(
        tables,
        _rows_in_a_hash_map(),
        None,
        hit_rate_threshold=1.0,
        exact=True,
        compiled=compiled,
        key_stats_sampling=1,
    )


def _rows_in_a_hash_map() -> HashMapBackend:
    """Every table's rows in the in-process volatile tier."""
    v = HashMapBackend(num_partitions=1)
    for name, (n, d) in zip(NAMES, SPECS, strict=True):
        v.create_table(name, d)
        v.insert(name, np.arange(n, dtype=np.int64), _rows(n, d))
    return v


def _assert_same(a: LookupSession, b: LookupSession) -> None:
    for n in NAMES:
        ca, cb = a.tables[n].cache, b.tables[n].cache
        assert ca is not None and cb is not None
        assert torch.equal(ca.counters, cb.counters) and ca.stats == cb.stats
        assert torch.equal(ca.slot_keys.keys, cb.slot_keys.keys)
    sa, sb = a.stats(), b.stats()
    for n in NAMES:
        for k in ("hits_unique", "hits_all", "keys_unique"):
            assert sa[n][k] == sb[n][k], (n, k)


def test_a_sampled_session_equals_the_reference_through_misses_and_aging() -> None:
    needs_ext()
    a, b = _session(True, 4, small=True), _session(False, 4, small=True)
    modes = [Pooling.SUM, Pooling.MEAN, Pooling.SUM]
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        keys = [torch.randint(-1, n + 10, (32, 3), generator=g) for n, _ in SPECS]
        assert torch.equal(a.lookup_pooled(NAMES, keys, modes), b.lookup_pooled(NAMES, keys, modes))
        rows = [k.clamp(min=0) for k in keys]
        for x, y in zip(a.lookup_many(NAMES, rows), b.lookup_many(NAMES, rows), strict=True):
            assert torch.equal(x, y)
        _assert_same(a, b)


def test_only_sampled_calls_count_uses() -> None:
    needs_ext()
    a, b = _session(True, 4, small=False), _session(False, 4, small=False)
    modes = [Pooling.SUM] * 3
    g = torch.Generator().manual_seed(1)
    for name, (n, _) in zip(NAMES, SPECS, strict=True):  # every row cached
        assert torch.equal(a.lookup(name, torch.arange(n)), b.lookup(name, torch.arange(n)))
    changed = []
    for _ in range(8):
        keys = [torch.randint(0, n, (32, 3), generator=g) for n, _ in SPECS]
        before = [a.tables[n].cache.counters.clone() for n in NAMES]  # type: ignore[union-attr]
        clock = a.tables["t0"].cache._clock + 1  # type: ignore[union-attr]
        assert torch.equal(a.lookup_pooled(NAMES, keys, modes), b.lookup_pooled(NAMES, keys, modes))
        _assert_same(a, b)
        moved = any(
            not torch.equal(x, a.tables[n].cache.counters)  # type: ignore[union-attr]
            for n, x in zip(NAMES, before, strict=True)
        )
        changed.append((clock % 4 == 0, moved))
        assert a.tables["t0"].cache.stats.hits > 0  # type: ignore[union-attr]
    assert [m for s, m in changed if not s] == [False] * 6
    assert [m for s, m in changed if s] == [True, True]


def test_a_call_mixing_a_static_cache_counts_only_its_sampled_calls() -> None:
    """A fused call over a full static cache and sampled LFU caches runs the two kinds as two
    passes: the set-associative ones still count the uses of one call in 4, as k each."""
    needs_ext()
    n0, d0 = SPECS[0]
    tables = [
        SessionTable("t0", d0, -1.0, 10**6, StaticEmbeddingCache(np.arange(n0), d0, policy="lfu"))
    ]
    for name, (n, d) in zip(NAMES[1:], SPECS[1:], strict=True):
        cache = EmbeddingCache(16 * n, d, policy="lfu", ways=8, lfu_sampling=4)
        tables.append(SessionTable(name, d, -1.0, 10**6, cache))
    s = LookupSession(tables, _rows_in_a_hash_map(), None, hit_rate_threshold=1.0, exact=True)
    for name, (n, _) in zip(NAMES, SPECS, strict=True):  # every row cached
        s.lookup(name, torch.arange(n))
    g = torch.Generator().manual_seed(2)
    moved = []
    for _ in range(8):
        keys = [torch.randint(0, n, (32, 3), generator=g) for n, _ in SPECS]
        caches = [s.tables[n].cache for n in NAMES[1:]]
        before = [c.counters.clone() for c in caches]  # type: ignore[union-attr]
        sampled = (caches[0]._clock + 1) % 4 == 0  # type: ignore[union-attr]
        s.lookup_pooled(NAMES, keys, Pooling.SUM)
        after = [c.counters for c in caches]  # type: ignore[union-attr]
        moved.append((sampled, any(not torch.equal(x, y) for x, y in zip(before, after))))
    assert [m for sampled, m in moved if not sampled] == [False] * 6
    assert [m for sampled, m in moved if sampled] == [True, True]


@pytest.mark.parametrize("weights", [[3, 0, 8], [0, 5, 1]])
def test_two_threads_count_weights_as_the_reference(weights: list[int]) -> None:
    """A call of 11,000 keys on two threads: table 0 (9,000 keys) is cut across them and its
    uses written by the slots' owners afterwards; tables 1 and 2 are each done whole by one
    thread, uses in the same pass."""
    needs_ext()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b = _full_caches("lfu"), _full_caches("lfu")
        g = torch.Generator().manual_seed(5)
        for _ in range(2):
            keys = [
                (torch.rand(m, 1, generator=g) ** 3 * n).long()
                for m, (n, _) in zip((9000, 1000, 1000), SPECS, strict=True)
            ]
            widths = [k.shape[1] for k in keys]
            assert widths == [1, 1, 1]
            ra = gather(_args_rows(a, keys, weights), compiled=True)
            rb = gather_reference(_args_rows(b, keys, weights))
            assert torch.equal(ra.per_table, rb.per_table)
            for i, (ca, cb) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(ca.counters, cb.counters)
                assert (int(ca.counters.max()) == 0) == (weights[i] == 0)
                assert int(ra.per_table[i, 2]) == keys[i].unique().numel()
    finally:
        torch.set_num_threads(threads)


def _args_rows(
    caches: list[EmbeddingCache], keys: list[torch.Tensor], weights: list[int]
) -> GatherArgs:
    """Rows (hotness 0) of every table into one flat buffer."""
    sizes = [k.numel() * c.dim for k, c in zip(keys, caches, strict=True)]
    return GatherArgs(
        caches=caches,
        keys=[k.reshape(-1).contiguous() for k in keys],
        out=torch.zeros(sum(sizes)),
        out_offsets=[0, *np.cumsum(sizes)[:-1].tolist()],
        out_stride=0,
        hotness=[0] * len(caches),
        mean=[False] * len(caches),
        stamps=[-1] * len(caches),
        streams=[99 + i for i in range(len(caches))],
        looked_up=[0] * len(caches),
        intervals=[0] * len(caches),
        weights=weights,
    )


def test_the_per_table_query_counts_sampled_queries_only_and_as_k() -> None:
    """:meth:`EmbeddingCache.query` (the per-table lookup's path): counters untouched on the
    queries sampling skips; on a sampled one, each hit at an exact level moves up k levels."""
    c = EmbeddingCache(64, 4, policy="lfu", ways=8, lfu_decay_keys_per_slot=0.0, lfu_sampling=4)
    keys = torch.arange(10)
    c.insert(keys, torch.zeros(10, 4))
    c.counters.zero_()
    for _ in range(4):
        clock = c._clock + 1  # the query ticks first
        _, hit = c.query(keys)
        assert bool(hit.all())
        levels = sorted(int(x) for x in c.counters.view(-1) if int(x))
        assert levels == ([] if clock < 4 else [4] * 10), clock
