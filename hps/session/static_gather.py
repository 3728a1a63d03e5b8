"""The cache-hit pass of a fused lookup over static caches
(:class:`hps.storage.cache.StaticEmbeddingCache`): each key's slot computed from the
table's keys (no set probe), its row read (rows) or its bag summed in request order (bags),
with the outputs, misses and per-table statistics of :func:`hps.fused.gather`, so the session
serves the misses the same way whichever cache a table has (:mod:`hps.session.fused`).

Per table: one slot computation, one read of the slots' tags, one row gather
(:func:`hps.fused.gather_rows`: dequantized, bags summed ``((0 + r0) + r1) + …`` skipping
misses and padding, as the compiled pass sums them). Unique hits (slots hit at least once)
come from one count over the hit slots. A static cache keeps no use counts.

When every cache is full and laid out IDENTITY (key k in slot k) and every key is one of its
table's, every key hits: the compiled ``static_gather`` checks and counts all tables' keys in
one pass (distinct keys in a per-thread bitmap: O(keys), never O(table rows)), counts the keys
of the tables whose ``key_counters`` entry is set into it, and then reads every table's rows or
pools its bags (FP32 dims 16/32/64/128 in AVX registers), bit for bit the table-by-table path's
output and statistics; where the compiled pass cannot run (kernel not built, int32
keys, a tensor off the CPU), rows take one range check over all tables (:func:`_all_rows_hit`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from hps.fused import (
    FORMAT_CODES,
    GatherArgs,
    GatherResult,
    check_keys,
    flat_keys,
    gather,
    gather_rows,
    join_tables,
    row_format_of,
)
from hps.kernels import load_extension
from hps.storage.cache import StaticEmbeddingCache, StaticLayout

__all__ = ["gather_any", "gather_static"]

_T = TypeVar("_T")
_BINCOUNT_ROWS_PER_KEY = 8  # distinct slots counted by a bincount over the table up to this ratio


def _distinct(slots: torch.Tensor, capacity: int) -> int:
    """Distinct values of ``slots (k,) int64`` in ``[0, capacity)``: a bincount over the table
    when it is small beside the keys (no sort), else a sort."""
    if slots.numel() == 0:
        return 0
    if capacity <= _BINCOUNT_ROWS_PER_KEY * slots.numel():
        return int(torch.count_nonzero(torch.bincount(slots, minlength=capacity)))
    return int(torch.unique(slots).numel())


def gather_static(args: GatherArgs, compiled: bool = True) -> GatherResult:
    """:func:`hps.fused.gather` for tables whose caches are all static.

    Args:
        args: as for :func:`hps.fused.gather`; every ``args.caches[i]`` a
            :class:`StaticEmbeddingCache` (``stamps``, ``streams``, ``looked_up`` and
            ``intervals`` are not read: no use counts, no aging).
        compiled: read rows with the compiled kernel when it is built.

    Returns:
        the :class:`GatherResult` of :func:`hps.fused.gather` (halvings always 0).

    Raises:
        ValueError: a key below -1 in a bag, or the reserved key ``-2**63`` in rows, naming
            the table's index and the key; nothing was read then.
    """
    caches: list[StaticEmbeddingCache] = []
    identity = True
    on_cpu = True
    identity_layout = StaticLayout.IDENTITY
    for i, c in enumerate(args.caches):  # one walk: the type, whether every key may hit,
        # and whether the rows are where the compiled pass reads them
        if not isinstance(c, StaticEmbeddingCache):
            raise TypeError(f"table {i}: gather_static takes static caches, got {type(c).__name__}")
        caches.append(c)
        identity = identity and c.full and c.layout is identity_layout
        on_cpu = on_cpu and c.storage.is_cpu
    if identity and compiled and on_cpu and _compiled_applies(args):
        # its checks are stricter than check_keys' (every key in [lo, capacity), lo -1 for
        # bags, 0 for rows): a call it takes has no key check_keys refuses, and a call it
        # refuses has written nothing, so check_keys runs only then
        fast = _all_hit_compiled(args, caches)
        if fast is not None:
            return fast
        identity = False  # a key is not its table's: the rows' range check would fail too
    check_keys(args)
    if identity:
        fast = _all_rows_hit(flat_keys(args), caches, compiled)
        if fast is not None:
            return fast
    args = flat_keys(args)
    return join_tables([_gather_one(args, i, c, compiled) for i, c in enumerate(caches)])


def _compiled_applies(args: GatherArgs) -> bool:
    """Whether the compiled all-hit pass can take these tables, whose caches' rows the caller
    found on the CPU: the kernel built, the output and every table's keys on the CPU, the
    keys int64."""
    if load_extension() is None or not args.out.is_cpu:
        return False
    int64 = torch.int64
    for k in args.keys:  # is_cpu: no device object per tensor
        if k.dtype is not int64 or not k.is_cpu:
            return False
    return True


_NO_MISSES = torch.zeros(0, dtype=torch.int64)  # the misses of an all-hit call (never written)


@functools.lru_cache(maxsize=64)
def _no_pending(dim: int) -> torch.Tensor:
    """The ``(0, dim)`` float32 pending rows of a table without a miss (one per dim, never
    written)."""
    return torch.zeros(0, dim, dtype=torch.float32)


def _all_hit_compiled(args: GatherArgs, caches: list[StaticEmbeddingCache]) -> GatherResult | None:
    """Rows or bags of tables whose static caches are full and laid out IDENTITY, when every
    key (bags: every key but -1 padding) is one of its table's: one compiled call checks and
    counts every key, counts each table's keys into its ``args.key_counters`` entry (every key
    a hit: :attr:`GatherResult.counted`), then writes every table's output; ``None`` (nothing
    written or counted) when a key is not its table's. The caller has checked that the pass applies
    (:func:`_compiled_applies`)."""
    ext = load_extension()
    assert ext is not None  # _compiled_applies
    counters = list(args.key_counters) if args.key_counters is not None else []
    storage, formats, dims = [], [], []
    for c in caches:
        storage.append(c.storage)
        formats.append(FORMAT_CODES[row_format_of(c)])
        dims.append(c.dim)
    per = ext.static_gather(
        list(args.keys),
        storage,
        formats,
        dims,
        list(args.hotness),
        [int(m) for m in args.mean],
        args.out,
        list(args.out_offsets),
        args.out_stride,
        counters,
    )
    if per.shape[0] != len(caches):
        return None
    pending = [_no_pending(d) for d in dims]
    counted = tuple(c is not None for c in counters)
    return GatherResult(_NO_MISSES, per, pending, counted)


def _all_rows_hit(
    args: GatherArgs, caches: list[StaticEmbeddingCache], compiled: bool
) -> GatherResult | None:
    """Rows of tables whose static caches are full and laid out IDENTITY (the caller checked),
    when every key is one of its table's (so every key hits): one range check and one row gather per table and
    one distinct count over all of them; ``None`` (nothing written) otherwise."""
    if any(h for h in args.hotness):
        return None
    sizes = [k.numel() for k in args.keys]
    flat = torch.cat(list(args.keys)) if len(caches) > 1 else args.keys[0]
    bases = list(itertools.accumulate((c.capacity for c in caches), initial=0))
    if flat.numel():
        # numpy's repeat: torch's repeat_interleave opens a parallel region (ms on a busy host)
        bound = torch.from_numpy(np.repeat(np.asarray(bases[1:], np.int64), sizes))
        start = torch.from_numpy(np.repeat(np.asarray(bases[:-1], np.int64), sizes))
        glob = flat + start  # one id space: table i's slots at [bases[i], bases[i + 1])
        if int(flat.min()) < 0 or bool((glob >= bound).any()):
            return None
        ends = torch.tensor(bases[1:])
        if bases[-1] <= _BINCOUNT_ROWS_PER_KEY * flat.numel():  # distinct ids below each end
            below = (torch.bincount(glob, minlength=bases[-1]) > 0).cumsum(0)[ends - 1]
        else:
            below = torch.searchsorted(torch.unique(glob), ends)
        unique = torch.diff(below, prepend=torch.zeros(1, dtype=below.dtype)).tolist()
    else:
        unique = [0] * len(caches)
    for i, c in enumerate(caches):
        n, off = sizes[i], args.out_offsets[i]
        block = args.out[off : off + n * c.dim].view(n, c.dim)
        keys = args.keys[i].to(torch.int64)  # int32 keys too (no copy for int64)
        gather_rows(c.storage, keys, row_format_of(c), c.dim, 0, block, compiled)
    per = torch.tensor(
        [[0, n, u, n, 0] for n, u in zip(sizes, unique, strict=True)], dtype=torch.int64
    ).reshape(len(caches), 5)
    empty = torch.zeros(0)
    return GatherResult(torch.zeros(0, dtype=torch.int64), per, [empty] * len(caches))


def _gather_one(
    args: GatherArgs, i: int, c: StaticEmbeddingCache, compiled: bool
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    k, h, dim = args.keys[i], args.hotness[i], c.dim
    n = k.numel()
    fmt = row_format_of(c)
    off = args.out_offsets[i]
    slot, inside = c.home_slots(k)
    hit = inside & (c.tags.view(-1).index_select(0, slot) != 0)
    if h > 0:
        hit &= k >= 0
    sl = torch.where(hit, slot, -1)
    hslot = slot[hit]
    n_hits = int(hslot.numel())
    unique_hits = _distinct(hslot, c.capacity)
    empty = torch.zeros(0, dim)
    if h == 0:
        block = args.out[off : off + n * dim].view(n, dim)
        gather_rows(c.storage, sl, fmt, dim, 0, block, compiled)
        miss = torch.nonzero(~hit).squeeze(1)
        return [int(miss.numel()), n_hits, unique_hits, n, 0], miss, empty
    b = n // h
    valid = (k >= 0).view(b, h)
    n_valid = int(valid.sum())
    bags = args.out.view(b, args.out_stride)[:, off : off + dim]
    gather_rows(c.storage, sl, fmt, dim, h, bags, compiled)  # misses and padding skipped
    if n_hits == n_valid:  # no miss: every bag complete
        if args.mean[i]:
            nv = valid.sum(1)
            ok = nv > 0
            bags[ok] = bags[ok] / nv[ok].to(torch.float32)[:, None]
        return [0, n_hits, unique_hits, n_valid, 0], torch.zeros(0, dtype=torch.int64), empty
    missed = valid & ~hit.view(b, h)
    bag_missed = missed.any(1)
    if args.mean[i]:
        nv = valid.sum(1)
        ok = ~bag_missed & (nv > 0)
        bags[ok] = bags[ok] / nv[ok].to(torch.float32)[:, None]
    pend_slots = sl.view(b, h)[bag_missed].reshape(-1)
    pend = gather_rows(c.storage, pend_slots, fmt, dim, 0, None, compiled)
    miss = torch.nonzero(missed.view(-1)).squeeze(1)
    return [int(miss.numel()), n_hits, unique_hits, n_valid, 0], miss, pend


def _subset(args: GatherArgs, idx: list[int]) -> GatherArgs:
    """``args`` for the tables ``idx`` only (same output buffer)."""

    def pick(xs: Sequence[_T]) -> list[_T]:
        return [xs[j] for j in idx]

    return GatherArgs(
        caches=pick(args.caches),
        keys=pick(args.keys),
        out=args.out,
        out_offsets=pick(args.out_offsets),
        out_stride=args.out_stride,
        hotness=pick(args.hotness),
        mean=pick(args.mean),
        stamps=pick(args.stamps),
        streams=pick(args.streams),
        looked_up=pick(args.looked_up),
        intervals=pick(args.intervals),
        weights=pick(args.weights) if args.weights is not None else None,
    )


def gather_any(args: GatherArgs, compiled: bool = True) -> GatherResult:
    """:func:`hps.fused.gather` for any mix of caches: the static ones through
    :func:`gather_static`, the set-associative ones through :func:`hps.fused.gather`, the
    results in table order (misses table after table, as one pass gives them)."""
    static = [j for j, c in enumerate(args.caches) if isinstance(c, StaticEmbeddingCache)]
    if not static:
        return gather(args, compiled=compiled)
    if len(static) == len(args.caches):
        return gather_static(args, compiled)
    dynamic = [j for j in range(len(args.caches)) if j not in set(static)]
    parts = [
        (static, gather_static(_subset(args, static), compiled)),
        (dynamic, gather(_subset(args, dynamic), compiled=compiled)),
    ]
    t = len(args.caches)
    per = torch.zeros(t, 5, dtype=torch.int64)
    misses: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)] * t
    pending: list[torch.Tensor] = [torch.zeros(0)] * t
    for idx, res in parts:
        per[idx] = res.per_table
        chunks = res.misses.split(res.per_table[:, 0].tolist())
        for j, m, p in zip(idx, chunks, res.pending, strict=True):
            misses[j], pending[j] = m, p
    return GatherResult(torch.cat(misses), per, pending)
