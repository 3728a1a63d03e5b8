"""The fused cache-hit pass of a multi-table lookup: every table's keys probed, counted and
gathered (rows) or pooled (bags) in one call.

Rows, two tables of dims 2 and 3 (``*`` = a cache miss, filled afterwards by the session)::

    keys   t0 [7, 9, 7]          t1 [4, 5]
    out    [ r7 r7 | r9 r9 | r7 r7 | r4 r4 r4 | ** ** ** ]   one flat float32 buffer,
            t0 (3, 2) at offset 0        t1 (2, 3) at offset 6
    misses [4]  (positions into each table's keys, table after table; per_table says how many)

Bags, batch 2, t0 hotness 2 (-1 pads a short bag), t1 hotness 1::

    keys   t0 [[7, 9], [7, -1]]  t1 [[4], [5]]
    out    (2, 5) = [[r7 + r9 | r4], [r7 | ** ]]     columns 0..1 t0, 2..4 t1

``per_table (T, 5) int64`` holds, per table: misses, hits (every occurrence), unique hits (slots
hit at least once), looked-up keys (padding excluded) and the LFU halvings applied first. MEAN bags are divided here when none of
their keys missed; the session adds the missed rows of the others and divides them.

Two implementations: :func:`gather_compiled` (``hps/csrc/fused_lookup.cpp``, probing the tag
line of a set) and :func:`gather_reference` (torch ops, comparing the set's keys): the same
outputs, counters and marks, bit for bit (tests/hps/test_fused.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hps.kernels import load_extension
from hps.storage.cache import EMPTY_KEY, EmbeddingCache
from hps.types import CachePolicy

__all__ = ["FP32_CODE", "GatherArgs", "GatherResult", "gather", "gather_reference"]

#: the kernel's code of FP32 rows (4 × dim bytes each); other row formats have no kernel yet
FP32_CODE = 0


@dataclass(frozen=True)
class GatherArgs:
    """One fused call's tables.

    Attributes:
        caches: one per table (CPU, FP32 rows).
        keys: ``(m_t,) int64`` contiguous per table (bags: ``B × hotness`` flattened, -1 pads).
        out: float32 contiguous output (rows: ``Σ m_t·dim_t``; bags: ``(B, out_stride)``).
        out_offsets: where each table starts in ``out`` (rows: element offset; bags: column).
        out_stride: bags: floats per bag row of ``out``; rows: 0.
        hotness: bags: keys per bag of each table; rows: 0 for every table.
        mean: per table, whether its bags are averaged.
        stamps: per table, the LRU clock a hit stamps; -1 for LFU (a hit adds 1).
        marks: per table, :meth:`EmbeddingCache.next_mark`.
        looked_up: per table, the cache's LFU aging clock before this query.
        intervals: per table, the cache's ``lfu_decay_interval`` (0: no aging): the counters
            are halved once per multiple of it that this query's keys cross, before its uses.
    """

    caches: Sequence[EmbeddingCache]
    keys: Sequence[torch.Tensor]
    out: torch.Tensor
    out_offsets: Sequence[int]
    out_stride: int
    hotness: Sequence[int]
    mean: Sequence[bool]
    stamps: Sequence[int]
    marks: Sequence[int]
    looked_up: Sequence[int]
    intervals: Sequence[int]


@dataclass(frozen=True)
class GatherResult:
    """``misses (k,) int64`` positions into each table's keys, table after table, ascending;
    ``per_table (T, 5) int64``: misses, hits, unique hits, looked-up keys, LFU halvings."""

    misses: torch.Tensor
    per_table: torch.Tensor


def gather(args: GatherArgs, compiled: bool = True) -> GatherResult:
    """The fused cache-hit pass (compiled when built and ``compiled``, else the reference).

    Raises:
        ValueError: a key below -1 in a bag, or the reserved key ``-2**63`` in rows, naming
            the table's index and the key; nothing was counted then.
    """
    ext = load_extension() if compiled else None
    if ext is None:
        return gather_reference(args)
    cs = args.caches
    misses, per_table = ext.cache_gather(
        list(args.keys),
        [c.keys.view(-1) for c in cs],
        [c.tags.view(-1) for c in cs],
        [c.counters.view(-1) for c in cs],
        [c.marks for c in cs],
        [c.storage for c in cs],
        [c.ways for c in cs],
        [c.dim for c in cs],
        [FP32_CODE] * len(cs),
        list(args.stamps),
        list(args.marks),
        list(args.looked_up),
        list(args.intervals),
        args.out,
        list(args.out_offsets),
        args.out_stride,
        list(args.hotness),
        [int(m) for m in args.mean],
    )
    return GatherResult(misses, per_table)


def gather_reference(args: GatherArgs) -> GatherResult:
    """:func:`gather` in torch ops, one table after another: the specification the compiled
    kernel is tested against (same outputs, counters, marks)."""
    for i, (k, h) in enumerate(zip(args.keys, args.hotness, strict=True)):
        lo = -1 if h > 0 else EMPTY_KEY + 1
        if k.numel() and bool((k < lo).any()):
            bad = int(k[k < lo][0])
            raise ValueError(f"table {i}: key {bad} is not a key this lookup takes")
    rows = []
    misses = []
    for i, c in enumerate(args.caches):
        stats, miss = _gather_one(args, i, c)
        rows.append(stats)
        misses.append(miss)
    per = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 5)
    return GatherResult(torch.cat(misses) if misses else torch.zeros(0, dtype=torch.int64), per)


def _gather_one(args: GatherArgs, i: int, c: EmbeddingCache) -> tuple[list[int], torch.Tensor]:
    k, h, dim = args.keys[i], args.hotness[i], c.dim
    n = k.numel()
    valid = torch.arange(n) if h == 0 else torch.nonzero(k >= 0).squeeze(1)
    w, before = args.intervals[i], args.looked_up[i]
    crossed = (before + valid.numel()) // w - before // w if w > 0 else 0
    if crossed > 0:
        c.counters.bitwise_right_shift_(min(crossed, 63))
    hit, slot = c._slots(k[valid])
    hpos, hslot, miss = valid[hit], slot[hit], valid[~hit]
    flat_counters = c.counters.view(-1)
    if c.policy is CachePolicy.LFU:
        flat_counters.index_add_(0, hslot, torch.ones_like(hslot))
    else:
        flat_counters[hslot] = args.stamps[i]
    unique_hits = int(torch.unique(hslot).numel())
    c.marks[hslot] = args.marks[i]
    off = args.out_offsets[i]
    if h == 0:
        block = args.out[off : off + n * dim].view(n, dim)
        block[hpos] = c.values[hslot]
    else:
        b = n // h
        r = torch.zeros(n, dim)
        r[hpos] = c.values[hslot]
        r = r.view(b, h, dim)
        acc = torch.zeros(b, dim)
        for j in range(h):  # the kernel's order: key 0 first
            acc += r[:, j]
        if args.mean[i]:
            nv = (k.view(b, h) >= 0).sum(1)
            missed = torch.zeros(n, dtype=torch.bool)
            missed[miss] = True
            ok = (~missed.view(b, h).any(1)) & (nv > 0)
            acc[ok] = acc[ok] / nv[ok].to(torch.float32)[:, None]
        args.out.view(b, args.out_stride)[:, off : off + dim] = acc
    stats = [int(miss.numel()), int(hpos.numel()), unique_hits, int(valid.numel()), crossed]
    return stats, miss
