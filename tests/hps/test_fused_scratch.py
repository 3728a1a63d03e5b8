"""The compiled fused pass keeps each key's slot and each table's first hits in the calling
thread's scratch from call to call (``CallScratch``, hps/csrc/fused_lookup.cpp), and hands
its units to whichever thread is free. Calls of every size in a row, on one thread, larger
and smaller, more tables and fewer, split across two threads or not, with misses: each gives
the reference's rows, bags, misses, pending rows, counts and counters bit for bit, so no call
reads what the one before it left in the scratch."""

from __future__ import annotations

import torch

from hps.fused import GatherArgs, GatherResult, gather
from hps.storage.cache import EmbeddingCache
from hps.types import CachePolicy
from tests.hps.hps_helpers import needs_ext

DIMS = (4, 8, 4)
ROWS = 3000


def _caches(policy: CachePolicy, w: list[torch.Tensor]) -> list[EmbeddingCache]:
    out = []
    for d, rows in zip(DIMS, w, strict=True):
        c = EmbeddingCache(ROWS, d, policy=policy, ways=64, lfu_decay_keys_per_slot=0.5)
        c.insert(torch.arange(0, ROWS, 2), rows[0:ROWS:2])  # every other key: half the keys miss
        out.append(c)
    return out


def _call(
    caches: list[EmbeddingCache], keys: list[torch.Tensor], hot: int, compiled: bool
) -> tuple[torch.Tensor, GatherResult]:
    dims = [c.dim for c in caches]
    if hot:
        b = keys[0].numel() // hot
        out = torch.full((b, sum(dims)), 7.0)
        offsets = [sum(dims[:i]) for i in range(len(dims))]
    else:
        sizes = [k.numel() * d for k, d in zip(keys, dims, strict=True)]
        out = torch.full((sum(sizes),), 7.0)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    args = GatherArgs(
        caches=caches,
        keys=keys,
        out=out,
        out_offsets=offsets,
        out_stride=sum(dims) if hot else 0,
        hotness=[hot] * len(caches),
        mean=[False] * len(caches),
        stamps=[c._clock % 128 if c.policy is CachePolicy.LRU else -1 for c in caches],
        streams=[c.lfu_stream() for c in caches],
        looked_up=[c._looked_up for c in caches],
        intervals=[c.lfu_decay_interval for c in caches],
    )
    return out, gather(args, compiled=compiled)


def test_calls_of_every_size_in_a_row_equal_the_reference() -> None:
    needs_ext()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(5)
        w = [torch.randn(ROWS, d, generator=g) for d in DIMS]
        for policy in (CachePolicy.LFU, CachePolicy.LRU):
            ours, ref = _caches(policy, w), _caches(policy, w)
            # (tables, keys per table, hotness): two threads from 8,192 keys in all, a table
            # of more than half of them split across both
            calls = [(3, 12_000, 4), (1, 12, 0), (2, 6_000, 0), (3, 300, 3), (1, 12_000, 4)]
            calls += [(3, 3_000, 0), (2, 9_000, 3), (3, 12_000, 0)]
            for tables, n, hot in calls:
                keys = [torch.randint(-1 if hot else 0, ROWS, (n,), generator=g)]
                keys += [torch.randint(0, ROWS, (n,), generator=g) for _ in range(tables - 1)]
                out_a, res_a = _call(ours[:tables], keys, hot, compiled=True)
                out_b, res_b = _call(ref[:tables], keys, hot, compiled=False)
                where = (policy, tables, n, hot)
                assert torch.equal(out_a, out_b), where
                assert torch.equal(res_a.per_table, res_b.per_table), where
                assert torch.equal(res_a.misses, res_b.misses), where
                assert int(res_a.per_table[:, 0].sum()) > 0, where  # the call had misses
                for p, q in zip(res_a.pending, res_b.pending, strict=True):
                    assert torch.equal(p, q), where
                for a, b in zip(ours, ref, strict=True):
                    assert torch.equal(a.counters, b.counters), where
                    a._clock += 1  # the next query, as a session ticks each cache per call
                    b._clock += 1
    finally:
        torch.set_num_threads(threads)
