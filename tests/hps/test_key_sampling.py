"""Sampled key statistics (KeyCounts(sample_every=s), a session's key_stats_sampling): the
calls counted are those the statistics' generator takes, every occurrence of one as ``s``; a
session's fused lookups sample only their hits (misses are counted one for one: the failed-call
test in test_fused.py, and admission below)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from hps.key_counts import KeyCounts
from tests.hps.test_key_counts import _needs_ext


def _taken(seed: int, every: int, calls: int) -> list[bool]:
    """The statistics' draws in Python: a call is counted when ``random() · every < 1``."""
    rng = random.Random(seed)
    return [rng.random() * every < 1.0 for _ in range(calls)]


def _check(ks: KeyCounts, want: Counter[int], universe: np.ndarray) -> None:
    got = ks.count_of(universe).tolist()
    assert got == [want.get(int(k), 0) for k in universe]
    assert ks.counter is not None
    assert ks.counter.size() == len(want)  # type: ignore[attr-defined]  # only counted keys held


def test_update_counts_the_calls_the_generator_takes() -> None:
    _needs_ext()
    rng = np.random.default_rng(1)
    calls = [(rng.zipf(1.2, 500) % 3000).astype(np.int64) for _ in range(40)]
    ks = KeyCounts(sample_every=8, seed=11)
    for keys in calls:
        ks.update(keys)
    want: Counter[int] = Counter()
    for keys, take in zip(calls, _taken(11, 8, len(calls)), strict=True):
        if take:
            for k in keys.tolist():
                want[k] += 8
    assert 0 < sum(want.values()) < 8 * 500 * 40  # some calls counted, not all
    _check(ks, want, np.arange(3000))
    assert ks.total == sum(want.values())  # weighted alike: the counts' sum
    ks.update(np.array([2999, 2998]), np.array([5, 7]))  # pre-counted: exact, never skipped
    assert ks.count_of(np.array([2999, 2998])).tolist() == [
        want.get(2999, 0) + 5,
        want.get(2998, 0) + 7,
    ]


@pytest.mark.parametrize("static", [False, True], ids=["set_associative", "static"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_session_counts_the_tables_whose_statistics_take_the_call(
    threads: int, static: bool
) -> None:
    """Per table its own draws (seed: the table's index): one thread (the fused pass counts)
    and two (a table of most of a call's keys cut across the threads: counted after the
    pass; the others gathered whole by one thread: counted in it) alike, and full
    static caches (the all-hit pass counts every key it takes); rows and bags unchanged."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable
    from hps.storage.cache import EmbeddingCache, StaticEmbeddingCache
    from tests.hps.test_cache_aging import _AllKeys

    rng = np.random.default_rng(2)
    names = ["a", "b", "c"]
    caches: list[EmbeddingCache] = []
    for _ in names:
        c = (
            StaticEmbeddingCache(np.arange(600), 1, policy="lfu")
            if static
            else EmbeddingCache(2048, 1, policy="lfu", lfu_decay_keys_per_slot=0)  # no halving
        )
        c.insert(torch.arange(600), torch.arange(600, dtype=torch.float32)[:, None])
        caches.append(c)
    s = LookupSession(
        [SessionTable(n, 1, -1.0, 10**6, c) for n, c in zip(names, caches, strict=True)],
        _AllKeys(600),
        None,
        hit_rate_threshold=1.0,
        key_stats_sampling=4,
    )
    calls = []
    for _ in range(24):
        # 1,000 bags each; c of 24 keys: with two threads it is cut across them, a and b not
        keys = [(rng.zipf(1.1, 1000 * w) % 600).reshape(-1, w) for w in (6, 6, 24)]
        for k in keys:
            k[rng.random(k.shape) < 0.03] = -1
        calls.append([torch.from_numpy(k.astype(np.int64)) for k in keys])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for keys in calls:
            got = s.lookup_pooled(names, keys)
            for i, k in enumerate(keys):
                assert torch.equal(got[:, i], k.clamp_min(0).to(torch.float32).sum(1))
    finally:
        torch.set_num_threads(before)
    assert s.key_stats is not None
    for i, name in enumerate(names):
        want: Counter[int] = Counter()
        for keys, take in zip(calls, _taken(i, 4, len(calls)), strict=True):
            if take:
                for k in keys[i].view(-1).tolist():
                    if k >= 0:
                        want[k] += 4
        ks = s.key_stats[name]
        assert ks.sample_every == 4
        _check(ks, want, np.arange(600))
        assert ks.total == sum(want.values())
    s.close()


def test_sampled_counts_estimate_the_hot_keys() -> None:
    _needs_ext()
    rng = np.random.default_rng(4)
    calls = [(rng.zipf(1.05, 4000) % 100_000).astype(np.int64) for _ in range(400)]
    ks = KeyCounts(sample_every=8)
    for keys in calls:
        ks.update(keys)
    distinct, true = np.unique(np.concatenate(calls), return_counts=True)
    hot = np.argsort(-true)[:5]
    est = ks.count_of(distinct[hot])
    # per call the hottest keys recur steadily: about 50 of 400 calls counted, as 8 each
    assert np.all(np.abs(est - true[hot]) <= 0.35 * true[hot])
    assert abs(int(est[0]) - int(true[hot][0])) <= 0.2 * true[hot][0]
    assert set(ks.hottest(3).tolist()) <= set(distinct[hot].tolist())


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_a_bad_sampling_rate_is_refused(bad: object) -> None:
    from hps.session import LookupSession, SessionTable
    from tests.hps.test_cache_aging import _AllKeys

    with pytest.raises(ValueError, match="sample_every must be an integer >= 1"):
        KeyCounts(sample_every=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_stats_sampling must be an integer >= 1"):
        LookupSession(
            [SessionTable("t", 1, -1.0, 10, None)],
            _AllKeys(10),
            None,
            key_stats_sampling=bad,  # type: ignore[arg-type]
        )


def test_admission_is_the_same_whichever_path_counted_the_call() -> None:
    """Sampling 4, a cache smaller than the keys: with one thread the fused pass counts a
    taken call's hits itself, with two those of table c (most of the keys, cut across the
    threads) are counted after the miss path; the misses are
    counted one for one before they are admitted either way, so a missed key's priority
    (history plus its uses in the call) is the same, and the two sessions end with the same
    resident keys and the same statistics."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable
    from hps.storage.cache import EmbeddingCache
    from tests.hps.test_cache_aging import _AllKeys

    rng = np.random.default_rng(5)
    names = ["a", "b", "c"]
    calls = [
        [
            torch.from_numpy((rng.zipf(1.1, 1000 * w) % 600).reshape(-1, w).astype(np.int64))
            for w in (6, 6, 24)  # 1,000 bags each
        ]
        for _ in range(20)
    ]
    finals = []
    for threads in (1, 2):
        caches = [
            EmbeddingCache(128, 1, policy="lfu", ways=8, lfu_decay_keys_per_slot=0) for _ in names
        ]
        s = LookupSession(
            [SessionTable(n, 1, -1.0, 10**6, c) for n, c in zip(names, caches, strict=True)],
            _AllKeys(600),
            None,
            hit_rate_threshold=1.0,  # misses admitted within the call
            key_stats_sampling=4,
        )
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for keys in calls:
                s.lookup_pooled(names, keys)
        finally:
            torch.set_num_threads(before)
        assert s.key_stats is not None
        finals.append(
            (
                [sorted(c.cached_keys().tolist()) for c in caches],
                [s.key_stats[n].count_of(np.arange(600)).tolist() for n in names],
            )
        )
        s.close()
    assert finals[0] == finals[1]
    assert all(len(k) > 64 for k in finals[0][0])  # the caches did fill


@pytest.mark.parametrize("threads", [1, 2])
def test_a_partly_hit_call_counts_its_misses_exactly_and_its_hits_when_taken(threads: int) -> None:
    """One call, half of its keys resident: table ``a`` (seed 0: 0.84 · 4 >= 1) does not take
    it, ``b`` (seed 1: 0.13 · 4 < 1) does; both count every miss once, ``b`` its hits as 4,
    and the totals are the counts' sums."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable
    from hps.storage.cache import EmbeddingCache
    from tests.hps.test_cache_aging import _AllKeys

    rng = np.random.default_rng(7)
    caches = []
    for _ in "ab":
        c = EmbeddingCache(1024, 1, policy="lfu", lfu_decay_keys_per_slot=0)
        c.insert(torch.arange(300), torch.arange(300, dtype=torch.float32)[:, None])
        caches.append(c)
    s = LookupSession(
        [SessionTable(n, 1, -1.0, 10**6, c) for n, c in zip("ab", caches, strict=True)],
        _AllKeys(600),
        None,
        hit_rate_threshold=0.0,  # misses read, admitted in the background (not this call)
        key_stats_sampling=4,
    )
    keys = [torch.from_numpy(rng.integers(0, 600, (1500, 4)).astype(np.int64)) for _ in "ab"]
    resident = [c.contains(k.view(-1)) for c, k in zip(caches, keys, strict=True)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s.lookup_pooled(["a", "b"], keys)
    finally:
        torch.set_num_threads(before)
    assert s.key_stats is not None
    for name, k, hit, weight in zip("ab", keys, resident, (0, 4), strict=True):
        flat = k.view(-1)
        want: Counter[int] = Counter(flat[~hit].tolist())
        for key in flat[hit].tolist():
            want[key] += weight
        want = Counter({key: v for key, v in want.items() if v})
        _check(s.key_stats[name], want, np.arange(600))
        assert s.key_stats[name].total == sum(want.values())
    s.close()


def test_a_counted_missed_key_keeps_at_least_its_uses_as_priority() -> None:
    """The misses are counted before their priority is read; a trim (or a halving) in between
    may drop or shrink a just-counted key: its priority is still at least its uses in the
    call, and padding keys (< 0, never counted) add their uses to the history."""
    _needs_ext()
    from hps.session import LookupSession, SessionTable
    from tests.hps.test_cache_aging import _AllKeys

    t = SessionTable("t", 1, -1.0, 10**6, None)
    s = LookupSession([t], _AllKeys(100), None, key_stats_sampling=1)
    assert s.key_stats is not None
    s.key_stats["t"].update(np.array([5, 6]), np.array([9, 1]))  # 7: dropped by a trim
    mkeys, mcounts = torch.tensor([-1, 5, 6, 7]), torch.tensor([2, 3, 3, 4])
    got = s.fill._priority(t, mkeys, mcounts, counted=True)
    assert got.tolist() == [2, 9, 3, 4]
    assert s.fill._priority(t, mkeys, mcounts, counted=False).tolist() == [2, 12, 4, 4]
    s.close()
