"""The fused pass's fast paths against the reference: FP32 bags pooled in registers after
the probe, and key statistics counted inside the pass (:mod:`hps.fused`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hps.fused import GatherArgs, gather
from hps.kernels import load_extension
from hps.key_counts import KeyCounts
from hps.session_stats import SessionStats
from hps.storage.cache import EmbeddingCache
from hps.types import CachePolicy


def _needs_ext() -> None:
    if load_extension() is None:
        if os.environ.get("CI"):
            pytest.fail("the hps compiled kernel could not be built (python -m hps.build_ext -v)")
        pytest.skip("the hps compiled kernel is not built")


@pytest.mark.parametrize("policy", [CachePolicy.LRU, CachePolicy.LFU])
def test_register_pooled_bags_equal_reference_bit_for_bit(policy: CachePolicy) -> None:
    """FP32 bags of dim 16, 32, 64 and 128 (pooled in registers after the probe) and of dim
    24 (row by row), with random (non-integer) rows so that the summation order shows: the
    compiled pass gives the reference's bags, pending rows, counters and statistics bit for
    bit, with padding, empty bags, misses (a half-full cache), SUM and MEAN."""
    _needs_ext()
    g = torch.Generator().manual_seed(17)
    dims, hot, n, batch = [16, 32, 64, 128, 24], [3, 1, 5, 2, 4], 120, 40
    results, outs, counters = [], [], []
    keys = [torch.randint(-1, n, (batch * h,), generator=g) for h in hot]
    rows = [torch.randn(n, d, generator=g) for d in dims]
    for compiled in (True, False):
        caches = []
        for d, w in zip(dims, rows, strict=True):
            c = EmbeddingCache(n, d, policy=policy, ways=8, lfu_decay_keys_per_slot=0)
            c.insert(torch.arange(0, n, 2), w[0:n:2])
            caches.append(c)
        out = torch.full((batch, sum(dims)), 7.0)
        args = GatherArgs(
            caches=caches,
            keys=keys,
            out=out,
            out_offsets=[0, *np.cumsum(dims)[:-1].tolist()],
            out_stride=sum(dims),
            hotness=hot,
            mean=[True, False, True, False, True],
            stamps=[3 if policy is CachePolicy.LRU else -1] * len(dims),
            streams=[c.lfu_stream() for c in caches],
            looked_up=[0] * len(dims),
            intervals=[0] * len(dims),
        )
        results.append(gather(args, compiled=compiled))
        outs.append(out)
        counters.append([c.counters.clone() for c in caches])
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    assert torch.equal(results[0].per_table, results[1].per_table)
    assert torch.equal(results[0].misses, results[1].misses)
    assert int(results[0].per_table[:, 0].min()) > 0  # every table missed somewhere
    for a, b, x, y in zip(results[0].pending, results[1].pending, *counters, strict=True):
        assert torch.equal(a, b) and torch.equal(x, y)


def test_the_pass_counts_keys_only_when_one_thread_does_every_key() -> None:
    """``key_counters``: the compiled pass counts each table's hits of keys ``>= 0`` (padding
    and misses skipped: the caller counts the misses) into its counter, exactly, when one
    thread does every key; where the query crosses LFU
    halvings of the cache, the counter is halved that many times first (``c >> times``, keys
    reaching 0 dropped, as :meth:`KeyCounts.halve`); a call split between threads is left to
    the caller (``counted`` False, counter untouched)."""
    _needs_ext()
    g = torch.Generator().manual_seed(21)
    n, d = 400, 4
    c = EmbeddingCache(n, d, policy="lfu", ways=8, lfu_decay_keys_per_slot=4.0)
    never = EmbeddingCache(n, d, policy="lfu", ways=8, lfu_decay_keys_per_slot=0)
    for x in (c, never):
        x.insert(torch.arange(0, n, 2), torch.randn(n // 2, d, generator=g))

    def run(
        keys: torch.Tensor, hot: int, c: EmbeddingCache = c, stats: KeyCounts | None = None
    ) -> tuple[bool, KeyCounts]:
        stats = KeyCounts() if stats is None else stats
        out = torch.zeros((keys.numel() // hot, d) if hot else (keys.numel() * d,))
        args = GatherArgs(
            caches=[c],
            keys=[keys],
            out=out,
            out_offsets=[0],
            out_stride=d if hot else 0,
            hotness=[hot],
            mean=[False],
            stamps=[-1],
            streams=[c.lfu_stream()],
            looked_up=[c._looked_up],
            intervals=[c.lfu_decay_interval],
            key_counters=[stats.counter],
        )
        res = gather(args)
        c._advance_age(int(res.per_table[0, 3]))
        return res.counted[0], stats

    for hot in (0, 3):
        keys = torch.randint(-1 if hot else 0, n + 50, (300,), generator=g)
        resident = c.contains(keys.clamp_min(0)) & (keys >= 0)  # most even keys
        counted, stats = run(keys, hot)
        uniq, counts = keys[resident].unique(return_counts=True)
        assert counted and np.array_equal(stats.count_of(uniq.numpy()), counts.numpy())
        missed = keys[(keys >= 0) & ~resident]
        assert missed.numel() and not stats.count_of(missed.numpy()).any()
    before = KeyCounts()  # 0 seen 5 times, 1 once (halved to 0: dropped), 2 four times
    before.update(np.array([0, 1, 2]), np.array([5, 1, 4]))
    keys = torch.randint(0, n, (c.lfu_decay_interval,), generator=g)
    resident = c.contains(keys)
    epoch = c.decay_epoch
    counted, stats = run(keys, 0, stats=before)
    assert c.decay_epoch == epoch + 1  # the query crossed one halving
    want = KeyCounts()
    want.update(np.array([0, 1, 2]), np.array([5, 1, 4]))
    want.halve(1)
    want.update(keys[resident].numpy())  # the hits
    assert counted
    probe = np.arange(n)
    assert np.array_equal(stats.count_of(probe), want.count_of(probe))
    assert len(stats.hottest()) == len(want.hottest())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        keys = torch.randint(0, n, (9000,), generator=g)
        counted, stats = run(keys[:8000], 0, never)
        assert counted  # below 8,192 keys one thread does them all
        counted, stats = run(keys, 0, never)
        assert not counted and len(stats.hottest()) == 0  # split between two threads
        pre = (
            KeyCounts()
        )  # a split call crossing agings: the counter is neither halved nor added to
        pre.update(np.array([0, 1, 2]), np.array([5, 1, 4]))
        epoch = c.decay_epoch
        counted, stats = run(keys, 0, c, pre)
        assert c.decay_epoch > epoch and not counted
        want = KeyCounts()
        want.update(np.array([0, 1, 2]), np.array([5, 1, 4]))
        assert np.array_equal(stats.count_of(probe), want.count_of(probe))
        assert np.array_equal(stats.counts(), want.counts())
    finally:
        torch.set_num_threads(threads)


def test_a_threaded_call_gathers_small_tables_whole_and_counts_their_keys_in_the_pass() -> None:
    """Two threads, three pooled tables (bags of 2, 3 and 9 keys): a table of at most
    total / threads keys is gathered by one thread, which also writes its counters and mark
    bits and counts its hits into its key counter (halved first for the agings the query
    crosses), as one thread doing every key would; the table of most keys is cut across both
    threads and left to the caller (``counted`` False). Rows, bags, pending rows, statistics
    and counters equal the reference's bit for bit, and the key counts equal those of one
    thread doing every key."""
    _needs_ext()
    g = torch.Generator().manual_seed(29)
    n, d = 600, 16
    batch, hot = 1000, [2, 3, 9]  # 14,000 keys: 9,000 · 2 > 14,000 ≥ 3,000 · 2
    weights = [torch.randn(n, d, generator=g) for _ in hot]
    keys = [torch.randint(-1, n + 40, (batch * h,), generator=g) for h in hot]
    runs = []
    for compiled, threads in ((False, 1), (True, 1), (True, 2)):
        caches = []
        for w in weights:
            c = EmbeddingCache(n, d, policy="lfu", ways=16, lfu_decay_keys_per_slot=2.0)
            c.insert(torch.arange(0, n, 3), w[0:n:3])
            c.insert(torch.arange(1, n, 3), w[1:n:3])
            caches.append(c)
        stats = [KeyCounts() for _ in hot]
        for st in stats:  # earlier counts, halved by the agings the query crosses
            st.update(np.array([0, 1, 2]), np.array([9, 1, 4]))
        out = torch.zeros(batch, d * len(hot))
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            args = GatherArgs(
                caches=caches,
                keys=keys,
                out=out,
                out_offsets=[d * i for i in range(len(hot))],
                out_stride=d * len(hot),
                hotness=hot,
                mean=[False] * len(hot),
                stamps=[-1] * len(hot),
                streams=[c.lfu_stream() for c in caches],
                looked_up=[c._looked_up for c in caches],
                intervals=[c.lfu_decay_interval for c in caches],
                key_counters=[st.counter for st in stats] if compiled else None,
            )
            res = gather(args, compiled=compiled)
        finally:
            torch.set_num_threads(before)
        runs.append((res, out, [c.counters.clone() for c in caches], stats))
    (ref, ref_out, ref_counters, _), one, two = runs
    assert int(ref.per_table[:, 4].min()) > 0  # every table's query crossed an aging
    assert one[0].counted == (True, True, True) and two[0].counted == (True, True, False)
    for res, out, counters, _ in (one, two):
        assert torch.equal(out.view(torch.int32), ref_out.view(torch.int32))
        assert torch.equal(res.per_table, ref.per_table)
        assert torch.equal(res.misses, ref.misses)
        for a, b in zip(res.pending, ref.pending, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(counters, ref_counters, strict=True):
            assert torch.equal(a, b) and int(a.max()) < 128  # levels 0..127
    probe = np.arange(n + 40)
    for i in (0, 1):  # the whole tables: counted in the pass as by one thread
        assert np.array_equal(two[3][i].count_of(probe), one[3][i].count_of(probe))
        assert two[3][i].count_of(probe).sum() > 500
    untouched = KeyCounts()  # the cut table: its counter left to the caller
    untouched.update(np.array([0, 1, 2]), np.array([9, 1, 4]))
    assert np.array_equal(two[3][2].count_of(probe), untouched.count_of(probe))


def test_cache_hit_records_equal_per_tier_records() -> None:
    """A fused call's tables without a miss are recorded as ``(table, uniq, all, is_async)``
    (:meth:`SessionStats.record_counts_many`'s ``cache_hits``): the same statistics as the
    per-tier lists ``[uniq, 0, 0, 0]``, ``[all, 0, 0, 0]`` of :meth:`SessionStats.record_counts`."""
    names = ["a", "b"]
    fast, ref = SessionStats(names), SessionStats(names)
    fast.record_counts_many([("b", [1, 2, 0, 3], [4, 5, 0, 6], False)], [("a", 7, 11, True)])
    fast.record_counts_many([], [("a", 2, 3, False), ("b", 0, 0, False)])
    ref.record_counts("b", [1, 2, 0, 3], [4, 5, 0, 6], False)
    ref.record_counts("a", [7, 0, 0, 0], [11, 0, 0, 0], True)
    ref.record_counts("a", [2, 0, 0, 0], [3, 0, 0, 0], False)
    ref.record_counts("b", [0, 0, 0, 0], [0, 0, 0, 0], False)
    assert fast.to_dict() == ref.to_dict()
    assert fast.to_dict("a")["hits_all"] == {
        "cache": 14,
        "volatile": 0,
        "persistent": 0,
        "default": 0,
    }
