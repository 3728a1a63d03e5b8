"""What a fused call keeps from one call to the next (:mod:`hps.fused`, :mod:`hps.session.fused`):
the caches' arrays as the compiled pass holds them (taken again once any cache replaces one,
:mod:`hps.storage.cache.layout`), the LFU draw streams mixed by the extension, and the
statistics of all-hit calls folded in when read (:class:`hps.session_stats.SessionStats`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hps.fused import _level_tables, compiled_tables
from hps.kernels import load_extension
from hps.session import LookupSession, SessionTable
from hps.session_stats import _PENDING_CALLS, LATENCY_WINDOW, SessionStats
from hps.storage.cache import EmbeddingCache, stream_of
from hps.storage.cache.layout import layout_now
from hps.storage.volatile import HashMapBackend
from hps.types import Pooling
from tests.hps.hps_helpers import needs_ext


def test_assigning_a_cache_array_moves_the_layout_clock() -> None:
    """Every array the compiled pass reads moves the clock when assigned (the cache's own and
    its keys'), and reading them does not."""
    c = EmbeddingCache(128, 4, policy="lfu", ways=8, key_bound=256)
    before = layout_now()
    _ = (c.storage, c.counters, c.tags, c.slot_keys.keys, c.slot_keys.high_words)
    assert layout_now() == before
    for owner, name in [
        (c, "storage"),
        (c, "counters"),
        (c, "tags"),
        (c, "row_bytes"),
        (c, "row_format"),
        (c.slot_keys, "keys"),
        (c.slot_keys, "high_words"),
        (c.slot_keys, "high_of"),
        (c.slot_keys.dense, "slots"),
    ]:
        now = layout_now()
        setattr(owner, name, getattr(owner, name))
        assert layout_now() != now, name


def test_compiled_tables_are_kept_until_an_array_is_replaced() -> None:
    """The same handle while nothing changes; a new one for another list of caches, and once
    a cache takes a second high word (its nibbles and high words replaced)."""
    needs_ext()
    a = EmbeddingCache(64, 4, policy="lfu", ways=8)
    b = EmbeddingCache(64, 4, policy="lfu", ways=8)
    t = compiled_tables([a, b])
    assert t is not None and len(t.handle) == 2  # type: ignore[arg-type]
    assert compiled_tables([a, b], t) is t
    assert compiled_tables([b, a], t) is not t
    a.insert(torch.tensor([5]), torch.ones(1, 4))  # the first high word: keys 0 .. 2**32 - 1
    t = compiled_tables([a, b], t)
    assert compiled_tables([a, b], t) is t
    a.insert(torch.tensor([(3 << 32) + 5]), torch.ones(1, 4))  # a second: nibbles made
    assert a.slot_keys.high_of is not None
    assert compiled_tables([a, b], t) is not t


def test_a_session_reads_the_arrays_a_cache_replaced_between_calls() -> None:
    """A session keeps the compiled arrays of its tables across calls; a cache whose keys take
    new high words, then are widened to int64 (more than 16 high words), is read through its
    new arrays on the next call: every row and bag equals the cache's own query."""
    needs_ext()
    dim, n = 8, 40
    cache = EmbeddingCache(1024, dim, policy="lfu", ways=16, lfu_decay_keys_per_slot=0)
    other = EmbeddingCache(64, dim, policy="lru", ways=8)
    g = torch.Generator().manual_seed(3)
    truth: dict[int, torch.Tensor] = {}

    def put(keys: torch.Tensor) -> None:
        rows = torch.randn(keys.numel(), dim, generator=g)
        cache.insert(keys, rows)
        truth.update(zip(keys.tolist(), rows, strict=True))

    base = torch.arange(n)
    put(base)
    other.insert(base[:10], torch.ones(10, dim))
    v = HashMapBackend(num_partitions=1)
    for name in ("t", "u"):
        v.create_table(name, dim)
    s = LookupSession(
        [SessionTable("t", dim, 0.0, 1 << 12, cache), SessionTable("u", dim, 0.0, 1 << 12, other)],
        v,
        None,
        hit_rate_threshold=0.0,
    )

    def check(keys: torch.Tensor) -> None:
        want = torch.stack([truth[k] for k in keys.tolist()])
        other_keys = torch.arange(keys.numel() // 2).remainder(10)
        rows = s.lookup_many(["t", "u"], [keys, other_keys])[0]
        assert torch.equal(rows, want)
        bags = [keys.view(-1, 2), other_keys.view(-1, 1)]
        pooled = s.lookup_pooled(["t", "u"], bags, [Pooling.SUM, Pooling.SUM])
        pairs = want.view(-1, 2, dim)
        assert torch.equal(pooled[:, :dim], pairs[:, 0] + pairs[:, 1])

    check(base[:20])
    layouts = [layout_now()]
    for word in range(1, 18):  # words 0..15 in use, then word 16 widens the keys
        k = (word << 32) + base[:4]
        put(k)
        layouts.append(layout_now())
        check(torch.cat([k, base[:4]]))
    assert cache.slot_keys.wide  # int64 keys: the arrays were replaced
    # each new high word replaced arrays, the 17th (word 16) by widening the keys; a key of
    # word 17 then goes into the int64 keys in place
    assert layouts == sorted(set(layouts)) + [layouts[-1]]


def test_extension_streams_equal_stream_of() -> None:
    """The extension's LFU draw streams are :func:`stream_of` of the same seeds and clocks
    (seeds masked to 32 bits as a plan keeps them, clocks of any size)."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    seeds = [0, 1, 7, 0xFFFFFFFF, 123456789, (2**40 + 5) & 0xFFFFFFFF]
    clocks = [1, 2, 2**31 + 3, 2**32 + 9, 5, 2**62]
    assert ext.lfu_streams(seeds, clocks) == [
        stream_of(s, c) for s, c in zip(seeds, clocks, strict=True)
    ]


def test_fused_all_hit_records_equal_per_table_records() -> None:
    """All-hit fused calls recorded as the pass's ``(T, 5)`` counts and one latency each
    (:meth:`SessionStats.record_fused_hits`, :meth:`SessionStats.record_fused_latency`)
    read back as the per-table records of the same calls, interleaved with a per-table
    lookup, and once more after more calls than the latency window holds."""
    names = ("a", "b")
    fast, ref = SessionStats(names), SessionStats(names)
    rng = np.random.default_rng(0)
    for call in range(LATENCY_WINDOW + 50):
        per = torch.from_numpy(rng.integers(0, 50, (2, 5)))
        seconds = float(rng.random())
        is_async = call % 3 == 0
        fast.record_fused_hits(names, per, is_async)
        fast.record_fused_latency(names, seconds)
        ref.record_counts_many(
            (), [(n, int(per[i, 2]), int(per[i, 1]), is_async) for i, n in enumerate(names)]
        )
        for n in names:
            ref.record_latency(n, seconds)
        if call == 10:
            for s in (fast, ref):
                s.record_counts("b", [1, 2, 0, 3], [4, 5, 0, 6], False)
            assert fast.to_dict() == ref.to_dict()
    assert fast.to_dict() == ref.to_dict()
    assert fast.to_dict("a")["lookups"] == LATENCY_WINDOW + 50


def test_fused_calls_held_as_they_came_stay_bounded_and_add_up() -> None:
    """All-hit calls that nobody reads the statistics of hold at most ``_PENDING_CALLS`` of
    them as they came (the rest added up), whatever their number; read back, every call's
    counts and the window's last latencies, in call order, are there."""
    names = ("a", "b", "c")
    stats = SessionStats(names)
    total = np.zeros((3, 5), dtype=np.int64)
    seconds = []
    for call in range(10 * _PENDING_CALLS + 7):
        per = torch.full((3, 5), call % 11, dtype=torch.int64)
        per[1] *= 2
        total += per.numpy()
        stats.record_fused_hits(names, per, False)
        stats.record_fused_latency(names, call * 1e-6)
        seconds.append(call * 1e-6)
        held = stats._fused[names]
        assert len(held.new) < _PENDING_CALLS and len(held.new_s) < _PENDING_CALLS
    got = stats.to_dict()
    for i, n in enumerate(names):
        assert got[n]["lookups"] == 10 * _PENDING_CALLS + 7
        assert got[n]["keys_all"] == int(total[i, 1])
        assert got[n]["keys_unique"] == int(total[i, 2])
    ref = SessionStats(names)
    for x in seconds:
        for n in names:
            ref.record_latency(n, x)
    assert stats.to_dict()["b"]["latency_p99_ms"] == ref.to_dict()["b"]["latency_p99_ms"]
    # the ring as the per-table records leave it (NaN: not yet written, in both)
    np.testing.assert_array_equal(stats._stats["c"].latencies_s, ref._stats["c"].latencies_s)


def test_compiled_tables_refuse_arrays_that_are_not_a_caches() -> None:
    """The held view checks each cache's arrays once, when built, naming the table: slots that
    are not whole sets, storage rows too narrow for the row format, a dense index of another
    dtype, and lists of unequal length."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    c = EmbeddingCache(64, 4, policy="lfu", ways=8, key_bound=32)
    good = compiled_tables([c])
    assert good is not None

    def arrays(**over: object) -> list[object]:
        sk = c.slot_keys
        a: dict[str, object] = {
            "keys": [sk.keys],
            "words": [sk.high_words],
            "nibbles": [torch.zeros(0, dtype=torch.uint8)],
            "tags": [c.tags],
            "counters": [c.counters],
            "storage": [c.storage],
            "dense": [
                sk.dense.slots if sk.dense is not None else torch.zeros(0, dtype=torch.int32)
            ],
            "ways": [c.ways],
            "dims": [c.dim],
            "formats": [0],
        }
        a.update(over)
        gaps_t, halve_t, _, _ = _level_tables()
        return [*a.values(), gaps_t, halve_t]

    assert len(ext.CacheTables(*arrays())) == 1
    with pytest.raises(ValueError, match=r"^hps: table 0: 64 slots are not whole sets of 7 ways$"):
        ext.CacheTables(*arrays(ways=[7]))
    narrow = torch.zeros(64, 12, dtype=torch.uint8)
    with pytest.raises(
        ValueError, match=r"^hps: rows of format 0 and dim 4 need 16 bytes, storage rows hold 12$"
    ):
        ext.CacheTables(*arrays(storage=[narrow]))
    with pytest.raises(ValueError, match=r"^hps: table 0: a dense key index must be"):
        ext.CacheTables(*arrays(dense=[torch.zeros(32, dtype=torch.int64)]))
    with pytest.raises(ValueError, match=r"^hps: one tensor per table expected$"):
        ext.CacheTables(*arrays(tags=[c.tags, c.tags]))
