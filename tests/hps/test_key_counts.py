"""KeyCounts (hash map, O(keys) per update) answers as KeyStatistics (the reference) does."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from hps.advisor import KeyStatistics
from hps.kernels import load_extension
from hps.key_counts import KeyCounts


def _needs_ext() -> None:
    if load_extension() is None:
        if os.environ.get("CI"):
            pytest.fail("the hps compiled kernel could not be built (python -m hps.build_ext -v)")
        pytest.skip("the hps compiled kernel is not built")


def test_counts_equal_the_reference() -> None:
    _needs_ext()
    rng = np.random.default_rng(0)
    fast, ref = KeyCounts(), KeyStatistics()
    assert fast.counter is not None
    for step in range(30):
        keys = rng.integers(-50, 5000, size=rng.integers(1, 3000)).astype(np.int64)
        if step % 3:
            fast.update(keys)
            ref.update(keys)
        else:
            u, c = np.unique(keys, return_counts=True)
            fast.update(u, c * 3)
            ref.update(u, c * 3)
        if step % 7 == 6:
            fast.halve(1 + step % 2)
            ref.halve(1 + step % 2)
        q = rng.integers(-60, 5100, size=500).astype(np.int64)
        assert np.array_equal(fast.count_of(q), ref.count_of(q))
    assert fast.total == ref.total and fast.aged_mass == ref.aged_mass
    assert np.array_equal(fast.hottest(), ref.hottest())  # ties: the smaller key first, both
    assert np.array_equal(fast.hottest(10), ref.hottest(10))
    assert np.array_equal(fast.counts(), ref.counts())


def test_trim_keeps_the_hottest() -> None:
    _needs_ext()
    fast = KeyCounts(max_keys=10)
    hot = np.arange(10, dtype=np.int64)
    fast.update(hot, np.full(10, 100, np.int64))
    fast.update(np.arange(100, 125, dtype=np.int64))  # 35 distinct > 2 × 10: trimmed
    assert sorted(fast.hottest().tolist()) == hot.tolist()
    assert fast.count_of(np.array([3, 110]))[0] == 100 and fast.count_of(np.array([110]))[0] == 0


def test_halve_rejects_negative_times() -> None:
    with pytest.raises(ValueError, match="times >= 0"):
        KeyCounts().halve(-1)


class _PausedCounter:
    """Delegates to a compiled counter; the first size/trim asked by the thread named
    ``name`` signals ``reached`` and waits for ``go`` (a slow path held mid-way)."""

    def __init__(self, inner: object, name: str) -> None:
        self.inner, self.name = inner, name
        self.reached, self.go = threading.Event(), threading.Event()

    def _pause(self) -> None:
        if threading.current_thread().name == self.name and not self.reached.is_set():
            self.reached.set()
            self.go.wait(5)

    def size(self) -> int:
        self._pause()
        return int(self.inner.size())  # type: ignore[attr-defined]

    def trim(self, max_keys: int) -> int:
        self._pause()
        return int(self.inner.trim(max_keys))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_overlapping_trims_keep_the_memory_bound() -> None:
    """Two updates' slow paths overlapping (one held after it passed the bound): every later
    update still leaves at most 2 × max_keys keys held."""
    _needs_ext()
    k = KeyCounts(max_keys=4)
    paused = _PausedCounter(k.counter, "a")
    k._counter = paused
    b_done = threading.Event()

    def b() -> None:
        k.update(np.arange(100, 120, dtype=np.int64))
        b_done.set()

    a = threading.Thread(target=k.update, args=(np.arange(20, dtype=np.int64),), name="a")
    a.start()
    assert paused.reached.wait(5)
    tb = threading.Thread(target=b)
    tb.start()
    b_done.wait(1.0)  # a bound on the wait, not an assertion: b may wait for a's slow path
    paused.go.set()
    a.join(5)
    tb.join(5)
    assert b_done.is_set()
    for i in range(4):
        k.update(np.arange(1000 + 20 * i, 1020 + 20 * i, dtype=np.int64))
        assert paused.inner.size() <= 8  # type: ignore[attr-defined]


def test_keys_counted_without_observed_keep_the_memory_bound() -> None:
    """A fused call that counted its keys in the pass and failed before they were observed:
    the next call still trims."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable, fused
    from hps.storage.cache import EmbeddingCache
    from tests.hps.test_cache_aging import _AllKeys

    c = EmbeddingCache(256, 1, policy="lfu", ways=8)
    c.insert(torch.arange(20), torch.zeros(20, 1))  # hits: the pass counts them
    assert bool(c.contains(torch.arange(20)).all())
    s = LookupSession(
        [SessionTable("t", 1, -1.0, 10**6, c)], _AllKeys(100), None, hit_rate_threshold=1.0
    )
    assert s.key_stats is not None
    stats = s.key_stats["t"] = KeyCounts(max_keys=4)
    counter = stats.counter
    real = fused._count_keys

    def failing(*args: object, **kw: object) -> None:
        raise RuntimeError("counting failed")

    fused._count_keys = failing  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="counting failed"):
            s.lookup_many(["t"], [torch.arange(20)])
    finally:
        fused._count_keys = real  # type: ignore[assignment]
    assert counter.size() == 20  # type: ignore[attr-defined]  # counted in the pass
    s.lookup_many(["t"], [torch.tensor([50])])
    assert counter.size() <= 8  # type: ignore[attr-defined]
    s.close()


def test_trim_and_in_place_halving_equal_the_reference() -> None:
    """Trims with tied counts keep the same keys as the reference (the hottest, ties the
    smaller key); halvings that free many entries of crowded runs leave every key findable."""
    _needs_ext()
    rng = np.random.default_rng(5)
    fast, ref = KeyCounts(max_keys=300), KeyStatistics(max_keys=300)
    for step in range(6):
        keys = rng.integers(0, 5000, 700).astype(np.int64)
        counts = rng.integers(1, 4, 700).astype(np.int64)
        for x in (fast, ref):
            x.update(keys, counts)
            if step % 2:
                x.halve(1)
        q = np.arange(5000, dtype=np.int64)
        assert np.array_equal(fast.count_of(q), ref.count_of(q)), step
        assert np.array_equal(fast.hottest(), ref.hottest())


def test_counter_memory_follows_distinct_keys_not_occurrences() -> None:
    """30,000 occurrences of 600 distinct keys, counted by an update and by a fused pass
    (from an empty counter, so the pass grows the map while it counts): exact counts, and a
    map sized by the distinct keys (load <= 1/2), not by the occurrences of one call."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable
    from hps.storage.cache import EmbeddingCache
    from tests.hps.test_cache_aging import _AllKeys

    rng = np.random.default_rng(3)
    keys = rng.integers(0, 600, 30_000).astype(np.int64)
    distinct, occurrences = np.unique(keys, return_counts=True)
    k = KeyCounts()
    k.update(keys)
    assert np.array_equal(k.count_of(distinct), occurrences)
    assert k.counter is not None
    size, cap = k.counter.size(), k.counter.capacity()  # type: ignore[attr-defined]
    assert size == distinct.size and 2 * size <= cap <= 4 * max(size, 512)

    c = EmbeddingCache(2048, 1, policy="lfu")
    c.insert(torch.arange(600), torch.arange(600, dtype=torch.float32)[:, None])
    s = LookupSession(
        [SessionTable("t", 1, -1.0, 10**6, c)],
        _AllKeys(600),
        None,
        hit_rate_threshold=1.0,
        key_stats_sampling=1,
    )
    assert s.key_stats is not None
    bags = torch.from_numpy(keys).view(-1, 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread does every key: the pass itself counts them
    try:
        got = s.lookup_pooled(["t"], [bags])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[:, 0], bags.to(torch.float32).sum(1))
    counter = s.key_stats["t"].counter
    assert counter is not None
    assert np.array_equal(s.key_stats["t"].count_of(distinct), occurrences)
    size, cap = counter.size(), counter.capacity()  # type: ignore[attr-defined]
    assert size == distinct.size and 2 * size <= cap <= 4 * max(size, 512)
    s.close()
