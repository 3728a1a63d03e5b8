"""The fused multi-table lookup: the compiled pass equals the torch reference bit for bit
(outputs, counters, statistics), and both equal per-table :meth:`LookupSession.lookup`
on integer-valued rows (exact by construction)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hps.fused import GatherArgs, gather, gather_reference, gather_rows
from hps.kernels import load_extension
from hps.rowformat import RowDtype, dequantize_rows, quantize_rows
from hps.session import LookupSession, SessionTable
from hps.session import fused as fused_module
from hps.session.static_gather import gather_static
from hps.storage.cache import EMPTY_KEY, EmbeddingCache, StaticEmbeddingCache, set_of, tag_of
from hps.storage.volatile import HashMapBackend
from hps.types import CachePolicy, Pooling, TierRead, TierUnavailableError
from tests.hps.hps_helpers import needs_ext

SPECS = [(300, 4), (50, 8), (1000, 3)]  # (rows, dim) per table
NAMES = ["t0", "t1", "t2"]
DEFAULT = -1.0


def _rows(n: int, d: int) -> np.ndarray:
    return (np.arange(n * d, dtype=np.float32).reshape(n, d) % 97) - 40.0  # integer-valued


def _session(
    compiled: bool, policy: str, threshold: float = 1.0, exact: bool = True, compact: bool = True
) -> LookupSession:
    v = HashMapBackend(num_partitions=2)
    tables = []
    for name, (n, d) in zip(NAMES, SPECS, strict=True):
        v.create_table(name, d)
        v.insert(name, np.arange(n, dtype=np.int64), _rows(n, d))
        cache = EmbeddingCache(
            n // 3, d, policy=policy, ways=8, lfu_decay_keys_per_slot=0.5, compact_keys=compact
        )
        tables.append(SessionTable(name, d, DEFAULT, 10**6, cache))
    return LookupSession(  # exact key statistics: both passes' states compared bit for bit
        tables,
        v,
        None,
        hit_rate_threshold=threshold,
        exact=exact,
        compiled=compiled,
        key_stats_sampling=1,
    )


def _bags(g: torch.Generator, batch: int = 16) -> list[torch.Tensor]:
    return [torch.randint(-1, n + 20, (batch, 3), generator=g) for n, _ in SPECS]


def _assert_same_state(a: LookupSession, b: LookupSession) -> None:
    for n in NAMES:
        ca, cb = a.tables[n].cache, b.tables[n].cache
        assert ca is not None and cb is not None
        assert torch.equal(ca.slot_keys.keys, cb.slot_keys.keys) and torch.equal(
            ca.counters, cb.counters
        )
        assert torch.equal(ca.tags, cb.tags) and torch.equal(ca.homed_bits, cb.homed_bits)
        assert int(ca.counters.max()) < 128  # every counter byte a level (or stamp) 0..127
        assert ca.decay_epoch == cb.decay_epoch and ca.stats == cb.stats
    sa, sb = a.stats(), b.stats()
    for n in NAMES:
        for k in ("lookups", "keys_all", "keys_unique", "hits_unique", "hits_all", "async_batches"):
            assert sa[n][k] == sb[n][k], (n, k)


@pytest.mark.parametrize(
    ("policy", "compact"),
    [(CachePolicy.LRU, True), (CachePolicy.LFU, True), (CachePolicy.LFU, False)],
)
def test_compiled_pass_equals_reference_bit_for_bit(policy: CachePolicy, compact: bool) -> None:
    """int32 keys (compact) and int64 keys: the same outputs, counters and statistics."""
    needs_ext()
    a, b = _session(True, policy, compact=compact), _session(False, policy, compact=compact)
    g = torch.Generator().manual_seed(0)
    modes = [Pooling.SUM, Pooling.MEAN, Pooling.SUM]
    for _ in range(4):  # later rounds hit, age (LFU) and evict
        keys = _bags(g)
        assert torch.equal(a.lookup_pooled(NAMES, keys, modes), b.lookup_pooled(NAMES, keys, modes))
        rows = [k.clamp(min=0) for k in keys]
        for x, y in zip(a.lookup_many(NAMES, rows), b.lookup_many(NAMES, rows), strict=True):
            assert torch.equal(x, y)
        _assert_same_state(a, b)
    assert a.tables["t2"].cache.stats.hits > 0  # type: ignore[union-attr]
    assert a.tables["t2"].cache.slot_keys.keys.dtype == (torch.int32 if compact else torch.int64)  # type: ignore[union-attr]
    for n in NAMES:  # counted by the fused pass (a) and after it (b): the same counts
        ka, kb = a.key_stats[n], b.key_stats[n]  # type: ignore[index]
        assert np.array_equal(ka.hottest(), kb.hottest())
        assert np.array_equal(ka.counts(), kb.counts()) and ka.total == kb.total
        assert ka.aged_mass == kb.aged_mass and a._stats_epoch[n][1] == b._stats_epoch[n][1]


@pytest.mark.parametrize("compiled", [True, False])
def test_fused_rows_equal_per_table_lookups(compiled: bool) -> None:
    if compiled:
        needs_ext()
    fused, single = _session(compiled, "lfu"), _session(compiled, "lfu")
    g = torch.Generator().manual_seed(1)
    for r in range(4):
        keys = [torch.randint(0, n + 20, (8, 5), generator=g) for n, _ in SPECS]
        need = sum(k.numel() * d for k, (_, d) in zip(keys, SPECS, strict=True))
        # a flat buffer with room to spare (its tail never written), or one of another shape
        buf = torch.full((need + 9,), 7.0) if r % 2 == 0 else torch.full((need // 4, 4), 7.0)
        got = fused.lookup_many(NAMES, keys, out=buf)
        at = 0
        for name, k, x in zip(NAMES, keys, got, strict=True):
            dim = fused.tables[name].dim
            assert x.shape == (*k.shape, dim) and x.is_contiguous()
            # a view of the reused buffer, the tables' blocks one after another
            assert x._base is buf and x.data_ptr() == buf.data_ptr() + 4 * at
            at += k.numel() * dim
            assert torch.equal(x, single.lookup(name, k))
        assert torch.equal(buf.view(-1)[need:], torch.full((buf.numel() - need,), 7.0))
    s1, s2 = fused.stats(), single.stats()
    for n in NAMES:
        assert (
            s1[n]["hits_all"] == s2[n]["hits_all"] and s1[n]["hits_unique"] == s2[n]["hits_unique"]
        )


def _pooled(ref: LookupSession, name: str, k: torch.Tensor, mode: Pooling) -> torch.Tensor:
    """The reference bags of table ``name``: ``ref``'s rows of the keys ``k`` (``(B, h)``,
    negative: padding) summed per bag, or averaged over the bag's keys (an empty bag: 0)."""
    valid = k >= 0
    rows = ref.lookup(name, k.clamp(min=0)) * valid[..., None]
    want = rows.sum(1)  # integer-valued rows: any summation order is exact
    if mode is Pooling.MEAN:
        n = valid.sum(1, keepdim=True)
        want = torch.where(n > 0, want / n.clamp(min=1), want)
    return want


@pytest.mark.parametrize("compiled", [True, False])
def test_pooled_bags_equal_pooled_rows(compiled: bool) -> None:
    if compiled:
        needs_ext()
    s, ref = _session(compiled, "lru"), _session(compiled, "lru")
    g = torch.Generator().manual_seed(2)
    modes = [Pooling.MEAN, Pooling.SUM, Pooling.MEAN]
    for _ in range(3):
        keys = _bags(g)
        keys[0][0] = -1  # an empty bag pools to zeros
        out = s.lookup_pooled(NAMES, keys, modes)
        col = 0
        for name, k, mode in zip(NAMES, keys, modes, strict=True):
            d = s.tables[name].dim
            assert torch.equal(out[:, col : col + d], _pooled(ref, name, k, mode)), name
            col += d


@pytest.mark.parametrize("compiled", [True, False])
def test_bags_of_no_keys_pool_to_zeros_in_a_reused_buffer(compiled: bool) -> None:
    if compiled:
        needs_ext()
    s, ref = _session(compiled, "lru"), _session(compiled, "lru")
    g = torch.Generator().manual_seed(5)
    keys = _bags(g)
    keys[1] = torch.zeros(16, 0, dtype=torch.int64)  # table t1: bags of width 0
    modes = [Pooling.SUM, Pooling.MEAN, Pooling.SUM]
    out = torch.full((16, sum(d for _, d in SPECS)), 55.0)
    got = s.lookup_pooled(NAMES, keys, modes, out=out)
    d0, d1 = SPECS[0][1], SPECS[1][1]
    assert torch.equal(got[:, d0 : d0 + d1], torch.zeros(16, d1))
    for cols, name, k in ((slice(0, d0), "t0", keys[0]), (slice(d0 + d1, None), "t2", keys[2])):
        assert torch.equal(got[:, cols], _pooled(ref, name, k, Pooling.SUM)), name


def test_tags_follow_inserts_and_invalidations() -> None:
    c = EmbeddingCache(64, 2, ways=8)
    k = torch.arange(40, dtype=torch.int64)
    c.insert(k, torch.zeros(40, 2))
    c.invalidate(k[:10])
    held = c.slot_keys.keys.view(-1) != c.slot_keys.empty_key
    assert torch.equal(c.tags.view(-1)[held], tag_of(c.slot_keys.keys.view(-1)[held]))
    assert int(c.tags.view(-1)[~held].max()) == 0
    assert int(tag_of(torch.arange(10_000)).min()) >= 1
    s = set_of(torch.arange(10_000), 7)
    assert int(s.min()) == 0 and int(s.max()) == 6


def test_bad_keys_are_refused_before_anything_counts() -> None:
    for compiled in [True, False] if load_extension() is not None else [False]:
        s = _session(compiled, "lfu")
        with pytest.raises(ValueError, match="'t1'.*-5"):
            s.lookup_pooled(
                NAMES,
                [
                    torch.zeros(2, 1, dtype=torch.int64),
                    torch.tensor([[3], [-5]]),
                    torch.zeros(2, 1, dtype=torch.int64),
                ],
            )
        with pytest.raises(ValueError, match="'t0'"):
            s.lookup_many(NAMES[:1], [torch.tensor([EMPTY_KEY])])
        assert all(st["lookups"] == 0 for st in s.stats().values())  # type: ignore[union-attr]
        assert int((s.tables["t0"].cache.counters > 0).sum()) == 0  # type: ignore[union-attr]
    s = _session(False, "lfu")
    with pytest.raises(ValueError, match="named twice"):
        s.lookup_many(["t0", "t0"], [torch.zeros(1, dtype=torch.int64)] * 2)
    with pytest.raises(ValueError, match="int64"):
        s.lookup_many(["t0"], [torch.zeros(1, dtype=torch.int32)])
    with pytest.raises(ValueError, match="out holds"):
        s.lookup_many(["t0"], [torch.zeros(4, dtype=torch.int64)], out=torch.empty(3))
    with pytest.raises(ValueError, match="bags"):
        s.lookup_pooled(
            ["t0", "t1"],
            [torch.zeros(2, 1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64)],
        )


@pytest.mark.parametrize(("hotness", "bad"), [(2, -2), (0, EMPTY_KEY)])
def test_the_gathers_refuse_a_key_they_cannot_take_naming_table_and_key(
    hotness: int, bad: int
) -> None:
    # a key below -1 in bags, the empty-slot key in rows: refused by the reference pass and
    # the static pass alike, before any output is written
    for cache in (EmbeddingCache(16, 4, ways=4), StaticEmbeddingCache(np.arange(8), 4)):
        ok = torch.zeros(2, dtype=torch.int64)
        keys = torch.tensor([1, bad], dtype=torch.int64)
        out = torch.full((8,), 5.0)
        args = GatherArgs(
            caches=[cache, cache],
            keys=[ok, keys],
            out=out,
            out_offsets=[0, 4 if hotness else 8],
            out_stride=4 if hotness else 0,
            hotness=[hotness, hotness],
            mean=[False, False],
            stamps=[-1, -1],
            streams=[0, 0],
            looked_up=[0, 0],
            intervals=[0, 0],
        )
        gathers = [gather_reference, gather_static]
        for fn in gathers if isinstance(cache, StaticEmbeddingCache) else gathers[:1]:
            with pytest.raises(ValueError, match=f"table 1: key {bad} is not a key"):
                fn(args)
            assert bool((out == 5.0).all())


class _Failing(HashMapBackend):
    """A volatile DB that cannot answer for keys ≥ 100 (a node down)."""

    def read(self, table: str, keys: np.ndarray) -> TierRead:
        r = super().read(table, keys)
        failed = keys >= 100
        return TierRead(r.values, r.found & ~failed, failed, "node down")


def test_a_failed_tier_is_refused_never_defaulted() -> None:
    v = _Failing(num_partitions=1)
    v.create_table("t", 2)
    v.insert("t", np.arange(200, dtype=np.int64), np.ones((200, 2), np.float32))
    c = EmbeddingCache(32, 2, ways=8)
    s = LookupSession([SessionTable("t", 2, DEFAULT, 1000, c)], v, None, hit_rate_threshold=1.0)
    assert torch.equal(s.lookup_many(["t"], [torch.tensor([1, 2])])[0], torch.ones(2, 2))
    with pytest.raises(TierUnavailableError):
        s.lookup_pooled(["t"], [torch.tensor([[1, 150]])])
    assert s.stats("t")["unavailable"] == 1


@pytest.mark.parametrize(
    ("sampling", "want"),
    [
        (1, [([1, 150], [1, 1], 2), ([7], [1], 1)]),
        # sampled: every key missed (empty caches), and misses are counted one for one
        # whether or not the statistics take the call (t's do not: seed 0 draws 0.84 · 2 >= 1)
        (2, [([1, 150], [1, 1], 2), ([7], [1], 1)]),
    ],
)
def test_a_failed_call_leaves_the_same_key_statistics_on_both_paths(
    sampling: int, want: list[tuple[list[int], list[int], int]]
) -> None:
    """The miss path of the first table raises: both paths count every table's misses, one for
    one, and the hits of those whose statistics take the call, totals included, as for a call
    that succeeded."""
    needs_ext()
    stats = []
    for compiled in (True, False):
        v = _Failing(num_partitions=1)
        for n in ("t", "u"):
            v.create_table(n, 2)
            v.insert(n, np.arange(200, dtype=np.int64), np.ones((200, 2), np.float32))
        ts = [SessionTable(n, 2, DEFAULT, 1000, EmbeddingCache(32, 2, ways=8)) for n in "tu"]
        s = LookupSession(
            ts, v, None, hit_rate_threshold=1.0, compiled=compiled, key_stats_sampling=sampling
        )
        with pytest.raises(TierUnavailableError):
            s.lookup_pooled(["t", "u"], [torch.tensor([[1, 150]]), torch.tensor([[7, -1]])])
        assert s.key_stats is not None
        stats.append(
            [(k.hottest().tolist(), k.counts().tolist(), k.total) for k in s.key_stats.values()]
        )
    assert stats[0] == stats[1] == want


def test_a_failure_to_count_keys_does_not_mask_the_miss_paths_error(monkeypatch, caplog) -> None:
    """The miss path raises, then counting the call's keys raises too: the call fails with the
    miss path's error (booked as unavailable), and the counting failure is logged."""

    def broken(*args: object) -> None:
        raise RuntimeError("counter broke")

    monkeypatch.setattr(fused_module, "_count_keys", broken)
    v = _Failing(num_partitions=1)
    v.create_table("t", 2)
    v.insert("t", np.arange(200, dtype=np.int64), np.ones((200, 2), np.float32))
    c = EmbeddingCache(32, 2, ways=8)
    s = LookupSession([SessionTable("t", 2, DEFAULT, 1000, c)], v, None, hit_rate_threshold=1.0)
    with pytest.raises(TierUnavailableError):
        s.lookup_pooled(["t"], [torch.tensor([[1, 150]])])
    assert s.stats("t")["unavailable"] == 1
    assert "counter broke" in caplog.text


def _pool_in_order(rows: torch.Tensor, valid: torch.Tensor, mean: bool) -> torch.Tensor:
    """``(B, w, d)`` rows pooled key by key in bag order (padding skipped), as specified."""
    acc = torch.zeros(rows.shape[0], rows.shape[2])
    for j in range(rows.shape[1]):
        acc = torch.where(valid[:, j, None], acc + rows[:, j], acc)
    if mean:
        n = valid.sum(1)
        ok = n > 0
        acc[ok] = acc[ok] / n[ok].to(torch.float32)[:, None]
    return acc


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("policy", [CachePolicy.LRU, CachePolicy.LFU])
def test_pooled_bags_sum_in_request_order_whatever_the_cache_holds(
    compiled: bool, policy: CachePolicy
) -> None:
    """Non-integer rows (float sums depend on their order), a cache holding some of a bag's
    keys: each bag is summed key by key in request order, bit-equal to pooling the rows of
    :meth:`lookup_many` in bag order, on a cold and on a warm cache."""
    if compiled:
        needs_ext()
    g = torch.Generator().manual_seed(5)
    n, d = 400, 16
    w = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, d)
    v = HashMapBackend(num_partitions=1)
    v.create_table("t", d)
    v.insert("t", np.arange(n, dtype=np.int64), w.numpy())
    cache = EmbeddingCache(n // 4, d, policy=policy, ways=8)
    cache.insert(torch.arange(0, n, 7), w[0:n:7])  # some keys of most bags resident
    s = LookupSession(
        [SessionTable("t", d, DEFAULT, 10**6, cache)],
        v,
        None,
        hit_rate_threshold=1.0,
        compiled=compiled,
    )
    for mode in (Pooling.SUM, Pooling.MEAN, Pooling.SUM):
        keys = torch.randint(-1, n, (64, 6), generator=g)
        got = s.lookup_pooled(["t"], [keys], mode)
        rows = s.lookup_many(["t"], [keys.clamp(min=0)])[0]
        assert torch.equal(rows, w[keys.clamp(min=0)])
        want = _pool_in_order(rows, keys >= 0, mode is Pooling.MEAN)
        assert torch.equal(got, want), (mode, (got - want).abs().max())


@pytest.mark.parametrize("d", [4, 24, 16, 36, 128])
@pytest.mark.parametrize("fmt", list(RowDtype))
def test_gather_rows_dequantizes_as_the_row_format_does(fmt: RowDtype, d: int) -> None:
    """The compiled dequantizing gather (rows, and bags summed in order into a column block
    of a wider buffer) equals hps.rowformat.dequantize_rows bit for bit, for every format
    (FP32 bags of dims 16 and 128 summed in registers, of dims 4, 24 and 36 row by row; INT4
    and INT2 rows 16 values at a time, dims 4, 24 and 36 with values left over)."""
    needs_ext()
    g = torch.Generator().manual_seed(7)
    cap, h = 300, 5
    w = torch.randn(cap, d, generator=g) * 3
    storage = quantize_rows(w, fmt).contiguous()
    slots = torch.randint(-1, cap, (40 * h,), generator=g)
    ref_rows = dequantize_rows(storage[slots.clamp(min=0)], fmt, d) * (slots >= 0)[:, None]
    got = gather_rows(storage, slots, fmt, d)
    assert torch.equal(got, ref_rows)
    assert torch.equal(got, gather_rows(storage, slots, fmt, d, compiled=False))
    wide = torch.full((40, 3 * d), 9.0)
    block = wide[:, d : 2 * d]
    gather_rows(storage, slots, fmt, d, hotness=h, out=block)
    want = _pool_in_order(ref_rows.view(40, h, d), (slots >= 0).view(40, h), False)
    assert torch.equal(block, want)
    assert bool((wide[:, :d] == 9.0).all() and (wide[:, 2 * d :] == 9.0).all())
    ref_out = torch.empty(40, d)
    gather_rows(storage, slots, fmt, d, hotness=h, out=ref_out, compiled=False)
    assert torch.equal(ref_out, want)
    for compiled in (True, False):
        with pytest.raises(ValueError, match=f"slot {cap}"):
            gather_rows(storage, torch.tensor([0, cap]), fmt, d, compiled=compiled)


def _quantized_cache(fmt: RowDtype, policy: CachePolicy) -> tuple[EmbeddingCache, torch.Tensor]:
    """A cache holding ``fmt`` rows (hps.rowformat's layout in ``storage``); returns it and
    the dequantized rows of keys 0..199."""
    g = torch.Generator().manual_seed(11)
    n, d = 200, 16
    w = torch.randn(n, d, generator=g)
    c = EmbeddingCache(n // 2, d, policy=policy, ways=8, row_format=fmt)
    c.insert(torch.arange(n), w)
    assert c.storage.shape == (c.capacity, quantize_rows(w[:1], fmt).shape[1])
    return c, dequantize_rows(quantize_rows(w, fmt), fmt, d)


@pytest.mark.parametrize("fmt", [RowDtype.FP16, RowDtype.INT8, RowDtype.INT4, RowDtype.INT2])
def test_fused_pass_reads_quantized_cache_rows(fmt: RowDtype) -> None:
    """The fused pass over a cache holding fp16 / int8 / int4 / int2 rows: compiled equals the
    reference bit for bit (rows, in-order bags, counters) and rows equal the format's
    dequantization."""
    needs_ext()
    g = torch.Generator().manual_seed(12)
    for bags in (False, True):
        (c1, want), (c2, _) = (
            _quantized_cache(fmt, CachePolicy.LFU),
            _quantized_cache(fmt, CachePolicy.LFU),
        )
        keys = torch.randint(-1 if bags else 0, 200, (32 * 4,), generator=g)
        outs = []
        results = []
        for c, compiled in ((c1, True), (c2, False)):
            out = torch.full((32, 16) if bags else (keys.numel() * 16,), 5.0)
            args = GatherArgs(
                caches=[c],
                keys=[keys],
                out=out,
                out_offsets=[0],
                out_stride=16 if bags else 0,
                hotness=[4 if bags else 0],
                mean=[False],
                stamps=[-1],
                streams=[c.lfu_stream()],
                looked_up=[0],
                intervals=[0],
            )
            results.append(gather(args, compiled=compiled))
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(results[0].per_table, results[1].per_table)
        assert torch.equal(results[0].misses, results[1].misses)
        assert torch.equal(results[0].pending[0], results[1].pending[0])
        assert torch.equal(c1.counters, c2.counters) and int(c1.counters.max()) < 128
        if not bags:
            hit = torch.ones(keys.numel(), dtype=torch.bool)
            hit[results[0].misses] = False
            rows = outs[0].view(-1, 16)
            assert torch.equal(rows[hit], want[keys[hit]])


@pytest.mark.parametrize("policy", [CachePolicy.LRU, CachePolicy.LFU])
def test_threaded_pass_equals_reference(policy: CachePolicy) -> None:
    """A call large enough to be split between threads (≥ 8,192 keys, two threads; its one
    table is cut across them: the threads gather, then each writes the counters and counts the unique hits
    of the slots it owns) gives the
    reference's rows, bags, counters and statistics bit for bit; hot keys (~60 hits a slot)
    take LFU levels past the exact ones, where each hit's step is drawn."""
    needs_ext()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(13)
        n, d = 3000, 4
        w = torch.randn(n, d, generator=g)
        caches = []
        for _ in range(2):
            c = EmbeddingCache(n, d, policy=policy, ways=64, lfu_decay_keys_per_slot=0.5)
            c.insert(torch.arange(0, n, 2), w[0:n:2])
            caches.append(c)
        for hot, span in ((0, n), (4, n), (0, 200), (4, 200)):
            keys = torch.randint(-1 if hot else 0, span, (12_000,), generator=g)
            outs, results = [], []
            for c, compiled in zip(caches, (True, False), strict=True):
                out = torch.zeros((12_000 // hot, d) if hot else (12_000 * d,))
                args = GatherArgs(
                    caches=[c],
                    keys=[keys],
                    out=out,
                    out_offsets=[0],
                    out_stride=d if hot else 0,
                    hotness=[hot],
                    mean=[hot > 0],
                    stamps=[c._clock % 128 if policy is CachePolicy.LRU else -1],
                    streams=[c.lfu_stream()],
                    looked_up=[c._looked_up],
                    intervals=[c.lfu_decay_interval],
                )
                results.append(gather(args, compiled=compiled))
                outs.append(out)
            assert torch.equal(outs[0], outs[1])
            assert torch.equal(results[0].per_table, results[1].per_table)
            assert torch.equal(results[0].misses, results[1].misses)
            assert torch.equal(results[0].pending[0], results[1].pending[0])
            assert torch.equal(caches[0].counters, caches[1].counters)
            assert int(caches[0].counters.max()) < 128  # counter bytes are levels 0..127
        if policy is CachePolicy.LFU:  # levels past the exact ones were drawn
            assert int(caches[0].counters.max()) > 18
    finally:
        torch.set_num_threads(threads)


def _keys_of(spread: str, n: int) -> np.ndarray:
    """``n`` distinct keys: one high word far from 0, five high words (the cache keeps a
    nibble per slot), or 64-bit hashes (more than 16 words: int64 keys)."""
    i = np.arange(n, dtype=np.int64)
    if spread == "one_word":
        return i * 3 + 5 * 2**40
    if spread == "words":
        return ((i % 5 - 2) << 32) | (i * 7)
    return np.unique(np.random.default_rng(0).integers(-(2**63) + 1, 2**63 - 1, size=n))[:n]


@pytest.mark.parametrize("spread", ["one_word", "words", "wide"])
def test_compiled_pass_reads_high_words_like_the_reference(spread: str) -> None:
    """Keys outside int32's range: the compiled probe matches low word, nibble and high word
    (or whole int64 keys) exactly as the reference; a key sharing a cached key's low word but
    not its high word misses."""
    needs_ext()
    n, d = 600, 4
    keys = _keys_of(spread, n)
    sessions = []
    for compiled in (True, False):
        v = HashMapBackend(num_partitions=2)
        v.create_table("t", d)
        v.insert("t", keys, _rows(n, d))
        cache = EmbeddingCache(n // 3, d, policy="lfu", ways=8)
        t = SessionTable("t", d, DEFAULT, 10**6, cache)
        sessions.append(
            LookupSession(
                [t], v, None, hit_rate_threshold=1.0, compiled=compiled, key_stats_sampling=1
            )
        )
    a, b = sessions
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        pick = torch.from_numpy(keys)[torch.randint(0, n, (64,), generator=g)]
        q = torch.cat([pick, pick[:8] ^ (1 << 40), pick[8:16] + 2**32]).view(8, -1)
        x, y = a.lookup_many(["t"], [q])[0], b.lookup_many(["t"], [q])[0]
        assert torch.equal(x, y)
        ca, cb = a.tables["t"].cache, b.tables["t"].cache
        assert ca is not None and cb is not None
        assert torch.equal(ca.slot_keys.keys, cb.slot_keys.keys) and torch.equal(
            ca.counters, cb.counters
        )
        assert ca.stats == cb.stats
    assert ca.stats.hits > 0
    want = {"one_word": (torch.int32, False), "words": (torch.int32, True)}
    dtype, nibbles = want.get(spread, (torch.int64, False))
    assert ca.slot_keys.keys.dtype == dtype and (ca.slot_keys.high_of is not None) == nibbles
    held = ca.cached_keys().numpy()
    assert np.isin(held, keys).all() and held.size == len(ca)


def test_the_kernel_refuses_several_high_words_without_nibbles() -> None:
    """More than one high word needs a nibble per slot: without them every slot would name
    word 0 (a key stored as another), so the kernel refuses the call, naming the count."""
    needs_ext()
    s = _session(True, "lru")
    c = s.tables["t0"].cache
    assert c is not None
    c.insert(torch.tensor([5, 2**32 + 5]), torch.ones(2, 4))
    assert c.slot_keys.high_words.numel() == 2 and c.slot_keys.high_of is not None
    c.slot_keys.high_of = None
    with pytest.raises(ValueError, match="2 high words but no nibbles"):
        s.lookup_many(["t0"], [torch.tensor([5])])


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("dim", [4, 16])
def test_pooled_bags_start_from_plus_zero_so_negative_zero_rows_pool_to_plus_zero(
    mean: bool, dim: int
) -> None:
    """A bag sums ``((+0.0 + r0) + r1) + …``: bags of -0.0 rows give +0.0 (sign bit clear),
    compiled and reference alike, bit for bit; -1.0 stays negative (dim 16: the compiled pass
    pools such bags in registers)."""
    passes = [True, False] if load_extension() is not None else [False]
    if os.environ.get("CI"):
        needs_ext()
    outs = []
    half = dim // 2
    for compiled in passes:
        c = EmbeddingCache(64, dim, ways=8)
        v = torch.full((3, dim), -0.0)
        v[1] = 5.0
        v[2, half:] = -1.0  # key 3: [-0, .., -0, -1, .., -1]
        c.insert(torch.tensor([1, 2, 3]), v)
        keys = torch.tensor([[1, -1], [-1, 1], [3, 1], [1, 1], [1, 2]]).reshape(-1)
        out = torch.full((5, dim), 7.0)
        args = GatherArgs(
            caches=[c], keys=[keys], out=out, out_offsets=[0], out_stride=dim, hotness=[2],
            mean=[mean], stamps=[1], streams=[0], looked_up=[0], intervals=[0],
        )  # fmt: skip
        gather(args, compiled=compiled)
        outs.append(out)
    sign = torch.zeros(5, dim, dtype=torch.bool)
    sign[2, half:] = True
    want = torch.zeros(5, dim)
    want[2, half:] = -1.0 / (2 if mean else 1)
    want[4] = 5.0 / (2 if mean else 1)
    for out in outs:
        assert torch.equal(torch.signbit(out), sign) and torch.equal(out, want)
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))
