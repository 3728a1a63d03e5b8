from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hps.storage.cache import EMPTY_KEY, EmbeddingCache, set_of
from hps.types import CachePolicy


def _rows(keys: torch.Tensor, dim: int) -> torch.Tensor:
    return keys[:, None].float().repeat(1, dim) + torch.arange(dim).float()  # exact, key-dependent


def test_insert_then_query_exact() -> None:
    c = EmbeddingCache(256, 4, ways=8)
    k = torch.randperm(10_000)[:100]
    assert c.insert(k, _rows(k, 4)) == 100 - c.stats.overflowed
    q = torch.cat([k, torch.tensor([10_001, 10_002])])
    v, hit = c.query(q)
    assert not hit[-2:].any()
    assert torch.equal(v[hit], _rows(q[hit], 4))
    assert torch.equal(v[~hit], torch.zeros(int((~hit).sum()), 4))


def _one_set(policy: CachePolicy) -> EmbeddingCache:
    return EmbeddingCache(4, 2, policy=policy, ways=4)  # a single set of 4 ways


def test_lru_evicts_least_recently_used() -> None:
    c = _one_set(CachePolicy.LRU)
    k = torch.tensor([1, 2, 3, 4])
    c.insert(k, _rows(k, 2))
    c.query(torch.tensor([1, 3]))  # 2 and 4 are now the least recent
    c.insert(torch.tensor([5]), _rows(torch.tensor([5]), 2))
    assert c.contains(torch.tensor([1, 2, 3, 4, 5])).tolist() == [True, False, True, True, True]


def test_lfu_evicts_least_frequently_used() -> None:
    c = _one_set(CachePolicy.LFU)
    k = torch.tensor([1, 2, 3, 4])
    c.insert(k, _rows(k, 2))
    for _ in range(3):
        c.query(torch.tensor([1, 2, 4]))
    c.query(torch.tensor([3, 4]))  # 3 is least frequent (2 uses) even though it is the most recent
    c.insert(torch.tensor([8]), _rows(torch.tensor([8]), 2))  # seen once: not admitted over 3
    assert not c.contains(torch.tensor([8])).any()
    c.insert(torch.tensor([9]), _rows(torch.tensor([9]), 2), priority=torch.tensor([3]))
    assert c.contains(torch.tensor([1, 2, 3, 4, 9])).tolist() == [True, True, False, True, True]


def test_lru_batch_misses_never_evict_the_batch_hits() -> None:
    c = _one_set(CachePolicy.LRU)
    k = torch.tensor([1, 2, 3, 4])
    c.insert(k, _rows(k, 2))
    c.query(torch.tensor([1, 2]))
    new = torch.tensor([10, 11, 12])
    c.insert(new, _rows(new, 2), priority=torch.tensor([1, 5, 3]))  # 2 cold slots: 11 and 12 win
    assert c.contains(torch.tensor([1, 2, 3, 4, 10, 11, 12])).tolist() == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
    ]


def test_query_expanded_by_inverse_with_counts() -> None:
    c = EmbeddingCache(64, 2, policy=CachePolicy.LFU, ways=8)
    k = torch.tensor([5, 9])
    c.insert(k, _rows(k, 2))
    u = torch.tensor([5, 7, 9])
    inv = torch.tensor([0, 2, 1, 0, 0])
    out, hit = c.query(u, counts=torch.tensor([3, 1, 1]), inverse=inv)
    assert hit.tolist() == [True, False, True]
    expect = torch.stack(
        [
            _rows(torch.tensor([5]), 2)[0],
            _rows(torch.tensor([9]), 2)[0],
            torch.zeros(2),
            _rows(torch.tensor([5]), 2)[0],
            _rows(torch.tensor([5]), 2)[0],
        ]
    )
    assert torch.equal(out, expect)
    assert int(c.counters.view(-1)[c._slots(torch.tensor([5]))[1]]) == 1 + 3


def test_more_new_keys_than_ways_in_one_set() -> None:
    c = _one_set(CachePolicy.LRU)
    k = torch.arange(10)
    placed = c.insert(k, _rows(k, 2))
    assert placed == 4 and c.stats.overflowed == 6 and len(c) == 4
    v, hit = c.query(k)
    assert int(hit.sum()) == 4 and torch.equal(v[hit], _rows(k[hit], 2))


def test_update_invalidate_and_refresh_cursor() -> None:
    c = EmbeddingCache(64, 3, ways=8)
    k = torch.arange(20)
    c.insert(k[1:], _rows(k[1:], 3))
    assert c.insert(k[:1], _rows(k[:1], 3)) == 1  # the newest key: certainly cached
    present = c.contains(k)
    assert bool(present[0]) and not c.contains(torch.tensor([999])).any()
    assert c.update_if_present(torch.tensor([0, 999]), torch.full((2, 3), 7.0)) == 1
    assert torch.equal(c.query(torch.tensor([0]))[0], torch.full((1, 3), 7.0))
    assert not c.contains(torch.tensor([999])).any()  # update_if_present never inserts
    assert c.invalidate(k[:5]) == int(present[:5].sum())
    assert not c.contains(k[:5]).any()
    seen = torch.cat([c.next_refresh_keys(0.25) for _ in range(4)])
    assert sorted(seen.tolist()) == sorted(c.cached_keys().tolist())


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EmbeddingCache(0, 4)
    with pytest.raises(ValueError, match="dim"):
        EmbeddingCache(4, 0)


def test_set_hash_spreads_consecutive_keys() -> None:
    s = set_of(torch.arange(64_000), 1000)
    counts = torch.bincount(s, minlength=1000)
    assert counts.min() > 30 and counts.max() < 100  # Poisson(64)-like, not clustered


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(-(2**62), 2**62), min_size=0, max_size=40), min_size=1, max_size=6
    ),
    st.sampled_from(list(CachePolicy)),
    st.integers(1, 40),
    st.integers(1, 8),
)
def test_cache_never_returns_a_wrong_row(batches, policy, capacity, ways) -> None:
    """Whatever is inserted and evicted, a hit always returns the row last inserted for that key."""
    c = EmbeddingCache(capacity, 2, policy=policy, ways=ways)
    truth: dict[int, float] = {}
    for i, b in enumerate(batches):
        k = torch.tensor(sorted(set(b)), dtype=torch.int64)
        vals = torch.full((k.numel(), 2), float(i))
        c.insert(k, vals)
        truth.update({int(x): float(i) for x in k})
        assert len(c) <= c.capacity
        allk = (
            torch.tensor(sorted(truth), dtype=torch.int64)
            if truth
            else torch.zeros(0, dtype=torch.int64)
        )
        v, hit = c.query(allk)
        expect = torch.tensor([truth[int(x)] for x in allk[hit]])
        assert torch.equal(v[hit][:, 0], expect)
    assert EMPTY_KEY not in c.cached_keys().tolist()


def test_cache_on_numpy_keys_from_int_tensor() -> None:
    c = EmbeddingCache(16, 2, ways=4)
    k = torch.from_numpy(np.array([5, 6], np.int64))
    c.insert(k, _rows(k, 2))
    assert c.query(k)[1].all()


@pytest.mark.gpu
def test_cuda_cache_matches_cpu_cache() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    cpu, gpu = EmbeddingCache(512, 8, ways=16), EmbeddingCache(512, 8, ways=16, device="cuda")
    for _ in range(5):
        k = torch.unique(torch.randint(0, 5000, (700,), generator=g))
        v = _rows(k, 8)
        cnt = torch.randint(1, 5, (k.numel(),), generator=g)
        assert cpu.insert(k, v, priority=cnt) == gpu.insert(k.cuda(), v.cuda(), priority=cnt.cuda())
        a, ha = cpu.query(k, counts=cnt)
        b, hb = gpu.query(k.cuda(), counts=cnt.cuda())
        assert torch.equal(ha, hb.cpu()) and torch.equal(a, b.cpu())
