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
hit at least once), looked-up keys (padding excluded) and the LFU halvings applied first.

A bag is summed key by key in request order (``((0 + r0) + r1) + …``, padding skipped), so its
floats never depend on which of its keys the cache held. A bag with no miss is pooled (and a
MEAN bag divided) here; a bag with a miss is left holding its hits' sum, and ``pending[t]``
hands back its rows (``(bags × hotness, dim)``, hits copied, misses and padding zero, bags
ascending): the session writes the missed rows in and pools those bags in the same order
(:func:`pool_in_order`).

:func:`gather_rows` reads rows of any :class:`hps.rowformat.RowDtype` from a cache's
``storage`` bytes by slot, dequantized to float32 (rows, or bags summed in order).

Two implementations: :func:`gather_compiled` (``hps/csrc/fused_lookup.cpp``, probing the tag
line of a set) and :func:`gather_reference` (torch ops, comparing the set's keys): the same
outputs, counters (LFU levels drawn from the same streams) and statistics, bit for bit
(tests/hps/test_fused.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hps.kernels import load_extension
from hps.rowformat import RowDtype, dequantize_rows, row_bytes
from hps.storage.cache import EMPTY_KEY, HALVE, EmbeddingCache, add_weighted, aging_lut, draws, gaps
from hps.storage.cache.layout import layout_now
from hps.types import CachePolicy

__all__ = [
    "FORMAT_CODES",
    "CompiledTables",
    "GatherArgs",
    "GatherResult",
    "check_keys",
    "compiled_tables",
    "flat_keys",
    "gather",
    "gather_reference",
    "gather_rows",
    "gather_rows_reference",
    "join_tables",
    "pool_in_order",
    "row_format_of",
]

#: the kernel's code of each row format (``cache_gather`` and ``gather_rows``)
FORMAT_CODES = {
    RowDtype.FP32: 0,
    RowDtype.FP16: 1,
    RowDtype.BF16: 2,
    RowDtype.INT8: 3,
    RowDtype.INT4: 4,
    RowDtype.INT2: 5,
}


@dataclass(frozen=True)
class CompiledTables:
    """The arrays of a list of caches as the compiled pass reads them (``handle``, the
    extension's ``CacheTables``: each cache's keys, high words, nibbles, dense index, tags,
    counters and storage, held and checked once), taken when the layout clock read
    ``layout`` (:func:`hps.storage.cache.layout.layout_now`) from the caches whose ids
    are ``ids``. A call passes the handle in place of seven lists of tensors: building and
    converting those lists takes a 26-table call 40-65 µs, more than the gather of a
    one-sample batch."""

    ids: tuple[int, ...]
    layout: int
    handle: object


def compiled_tables(
    caches: Sequence[EmbeddingCache], have: CompiledTables | None = None
) -> CompiledTables | None:
    """``have`` while it holds the current arrays of exactly ``caches`` (same caches, in order,
    and no array replaced since it was taken), else the arrays taken now; ``None`` without the
    extension. Call with the caches' locks held (a cache replaces an array under its lock)."""
    now = layout_now()
    ids = tuple(map(id, caches))
    if have is not None and have.layout == now and have.ids == ids:
        return have
    ext = load_extension()
    if ext is None:
        return None
    ckeys, words, word_of, tags, counters, storage, dense = [], [], [], [], [], [], []
    ways, dims, formats = [], [], []
    gaps_t, halve_t, no_nibbles, no_index = _level_tables()
    for c in caches:  # whole (num_sets, ways) arrays: the kernel reads data
        sk = c.slot_keys
        ckeys.append(sk.keys)
        words.append(sk.high_words)
        word_of.append(no_nibbles if sk.high_of is None else sk.high_of)
        tags.append(c.tags)
        counters.append(c.counters)
        storage.append(c.storage)
        dense.append(no_index if sk.dense is None else sk.dense.slots)
        ways.append(c.ways)
        dims.append(c.dim)
        formats.append(FORMAT_CODES[row_format_of(c)])
    handle = ext.CacheTables(
        ckeys, words, word_of, tags, counters, storage, dense, ways, dims, formats, gaps_t, halve_t
    )
    return CompiledTables(ids, now, handle)


@dataclass(frozen=True)
class GatherArgs:
    """One fused call's tables.

    Attributes:
        caches: one per table (CPU; rows in :func:`row_format_of` the cache).
        keys: ``int64`` contiguous per table, its ``m_t`` keys in row-major order: ``(m_t,)``
            or any shape holding them (bags: ``(B, hotness)`` or flattened; -1 pads).
        out: float32 contiguous output (rows: ``Σ m_t·dim_t``; bags: ``(B, out_stride)``).
        out_offsets: where each table starts in ``out`` (rows: element offset; bags: column).
        out_stride: bags: floats per bag row of ``out``; rows: 0.
        hotness: bags: keys per bag of each table; rows: 0 for every table.
        mean: per table, whether its bags are averaged.
        stamps: per table, the LRU stamp a hit writes (the clock modulo 128); -1 for LFU (a
            hit takes a Morris step of the slot's level).
        streams: per table, the LFU draw stream (:meth:`EmbeddingCache.lfu_stream`): the use
            by the key at position ``j`` of the table's keys draws ``mix64(stream + j)``.
        looked_up: per table, the cache's LFU aging clock before this query.
        intervals: per table, the cache's ``lfu_decay_interval`` (0: no aging): the counters
            are halved once per multiple of it that this query's keys cross, before its uses.
        key_counters: ``None``, or per table the compiled ``KeyCounter`` of its key statistics
            (:attr:`hps.key_counts.KeyCounts.counter`; ``None`` for a table whose statistics
            do not count this call): the compiled pass counts the table's
            hits of keys ``>= 0`` into it in the same pass (sharing the key's hash; each as the
            counter's weight) when one thread does every key of the table (a call of fewer than
            8,192 keys, or a table of at most total / threads keys), first halving it once per LFU
            halving of the table's cache that this query crosses (``per_table[:, 4]``: the
            caller ages the rest of the table's statistics to match); misses are never
            counted here (the caller counts them); :attr:`GatherResult.counted` says which
            tables' hits it counted (the caller ages and counts the others). The all-hit pass
            over full static caches (:mod:`hps.session.static_gather`) counts every key
            ``>= 0`` of each such table (all hits; no aging), whatever the thread count.
        weights: ``None`` (every table 1), or per table the uses each hit counts in its
            cache's counters: 0 none (the counters are not read or written; the hits and
            unique hits are counted all the same), 1 one (LFU a Morris step, LRU the stamp),
            ``w > 1`` that many at once (LFU :func:`hps.storage.cache.add_weighted`, one
            draw per hit; LRU the stamp).
        tables: ``None``, or the compiled pass's arrays of ``caches`` kept from an earlier
            call (:func:`compiled_tables`); taken again when stale. The reference ignores it.
    """

    caches: Sequence[EmbeddingCache]
    keys: Sequence[torch.Tensor]
    out: torch.Tensor
    out_offsets: Sequence[int]
    out_stride: int
    hotness: Sequence[int]
    mean: Sequence[bool]
    stamps: Sequence[int]
    streams: Sequence[int]
    looked_up: Sequence[int]
    intervals: Sequence[int]
    key_counters: Sequence[object | None] | None = None
    weights: Sequence[int] | None = None
    tables: CompiledTables | None = None


@dataclass(frozen=True)
class GatherResult:
    """``misses (k,) int64`` positions into each table's keys, table after table, ascending;
    ``per_table (T, 5) int64``: misses, hits, unique hits, looked-up keys, LFU halvings;
    ``pending`` per table (bags): ``(p × hotness, dim) float32`` rows of its ``p`` bags with a
    miss, ascending (hits copied, misses and padding zero); ``(0, dim)`` for rows or no miss;
    ``counted``: per table, whether the pass counted its hits into ``args.key_counters[i]``
    (empty: none counted)."""

    misses: torch.Tensor
    per_table: torch.Tensor
    pending: list[torch.Tensor]
    counted: tuple[bool, ...] = ()


def row_format_of(cache: EmbeddingCache) -> RowDtype:
    """The layout of ``cache.storage``'s rows (``cache.row_format``; FP32 rows are the cache's
    ``values`` view)."""
    return cache.row_format


def cached_rows(cache: EmbeddingCache, slots: torch.Tensor) -> torch.Tensor:
    """``(n, dim) float32`` rows of ``slots (n,) int64`` read from ``cache.storage`` in its
    row format (:func:`hps.rowformat.dequantize_rows`): what the kernel reads."""
    fmt = row_format_of(cache)
    if fmt is RowDtype.FP32:
        return cache.values.index_select(0, slots)
    rb = row_bytes(fmt, cache.dim)
    return dequantize_rows(cache.storage[:, :rb].index_select(0, slots), fmt, cache.dim)


def gather(args: GatherArgs, compiled: bool = True) -> GatherResult:
    """The fused cache-hit pass (compiled when built and ``compiled``, else the reference).

    Raises:
        ValueError: a key below -1 in a bag, or the reserved key ``-2**63`` in rows, naming
            the table's index and the key; nothing was counted then.
    """
    ext = load_extension() if compiled else None
    if ext is None:
        return gather_reference(args)
    tables = compiled_tables(args.caches, args.tables)
    assert tables is not None  # the extension is loaded
    misses, per_table, counted, *pending = ext.cache_gather(
        list(args.keys),
        tables.handle,
        list(args.stamps),
        list(args.streams),
        list(args.looked_up),
        list(args.intervals),
        args.out,
        list(args.out_offsets),
        args.out_stride,
        list(args.hotness),
        [int(m) for m in args.mean],
        list(args.key_counters) if args.key_counters is not None else [],
        list(args.weights) if args.weights is not None else [],
    )
    return GatherResult(misses, per_table, pending, tuple(bool(x) for x in counted.tolist()))


@functools.lru_cache(maxsize=1)
def _level_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's read-only inputs, built once per process: the LFU tables ``gaps (128,)
    int64`` and ``HALVE (128,) uint8`` (:mod:`hps.storage.cache.slot_counter`), the ``(0,)
    uint8`` nibbles of a cache with one high word and the ``(0,) int32`` dense index of a
    cache without one."""
    return (
        gaps(),
        torch.tensor(HALVE, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.int32),
    )


def gather_reference(args: GatherArgs) -> GatherResult:
    """:func:`gather` in torch ops, one table after another: the specification the compiled
    kernel is tested against (same outputs, counters, statistics)."""
    args = flat_keys(args)
    check_keys(args)
    for i, w in enumerate(args.weights or ()):
        if w < 0:
            raise ValueError(f"table {i}: use weight {w} is negative")
    return join_tables([_gather_one(args, i, c) for i, c in enumerate(args.caches)])


def flat_keys(args: GatherArgs) -> GatherArgs:
    """``args`` with every table's keys as ``(m_t,)`` (views of the same keys)."""
    if all(k.dim() == 1 for k in args.keys):
        return args
    return dataclasses.replace(args, keys=[k.reshape(-1) for k in args.keys])


def check_keys(args: GatherArgs) -> None:
    """Refuse a key below -1 in a bag or the reserved key ``-2**63`` in rows, naming the
    table's index and the key, before anything is read.

    Raises:
        ValueError: such a key.
    """
    for i, (k, h) in enumerate(zip(args.keys, args.hotness, strict=True)):
        lo = -1 if h > 0 else EMPTY_KEY + 1
        if k.numel() and int(k.min()) < lo:
            raise ValueError(f"table {i}: key {int(k[k < lo][0])} is not a key this lookup takes")


def join_tables(
    tables: Sequence[tuple[list[int], torch.Tensor, torch.Tensor]],
) -> GatherResult:
    """The :class:`GatherResult` of per-table ``(statistics (5 ints), misses, pending)``
    gathered one table after another."""
    per = torch.tensor([t[0] for t in tables], dtype=torch.int64).reshape(len(tables), 5)
    misses = [t[1] for t in tables]
    all_misses = torch.cat(misses) if misses else torch.zeros(0, dtype=torch.int64)
    return GatherResult(all_misses, per, [t[2] for t in tables])


def pool_in_order(rows: torch.Tensor, valid: torch.Tensor, mean: bool) -> torch.Tensor:
    """Bags pooled key by key in request order, the order of every fast path.

    Args:
        rows: ``(B, h, d) float32``.
        valid: ``(B, h) bool``, False where a key pads its bag (its row is skipped).
        mean: divide each non-empty bag by its valid keys.

    Returns:
        ``(B, d) float32``: ``((0 + r0) + r1) + …`` over the valid rows (an empty bag: zeros).
    """
    acc = torch.zeros(rows.shape[0], rows.shape[2], dtype=torch.float32, device=rows.device)
    for j in range(rows.shape[1]):  # key 0 first
        acc = torch.where(valid[:, j, None], acc + rows[:, j], acc)
    if mean:
        n = valid.sum(1)
        ok = n > 0
        acc[ok] = acc[ok] / n[ok].to(torch.float32)[:, None]
    return acc


def _gather_one(
    args: GatherArgs, i: int, c: EmbeddingCache
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    k, h, dim = args.keys[i], args.hotness[i], c.dim
    n = k.numel()
    valid = torch.arange(n) if h == 0 else torch.nonzero(k >= 0).squeeze(1)
    w, before = args.intervals[i], args.looked_up[i]
    crossed = (before + valid.numel()) // w - before // w if w > 0 else 0
    if crossed > 0:
        c.counters.copy_(aging_lut(crossed)[c.counters.long()])
    hit, slot = c._hashed_slots(k[valid])  # the specification: never the dense key index
    hpos, hslot, miss = valid[hit], slot[hit], valid[~hit]
    weight = 1 if args.weights is None else args.weights[i]  # 0: the counters stay as they are
    if weight and c.policy is CachePolicy.LFU:
        _morris_steps(c.counters.view(-1), hslot, hpos, args.streams[i], weight)
    elif weight:
        c.counters.view(-1)[hslot] = args.stamps[i]
    unique_hits = int(torch.unique(hslot).numel())
    off = args.out_offsets[i]
    pending = torch.zeros(0, dim)
    if h == 0:
        block = args.out[off : off + n * dim].view(n, dim)
        block[hpos] = cached_rows(c, hslot)
    else:
        b = n // h
        r = torch.zeros(n, dim)
        r[hpos] = cached_rows(c, hslot)
        r = r.view(b, h, dim)
        missed = torch.zeros(n, dtype=torch.bool)
        missed[miss] = True
        bag_missed = missed.view(b, h).any(1)
        valid_keys = k.view(b, h) >= 0
        acc = pool_in_order(r, valid_keys, False)  # a miss's zero row adds nothing
        if args.mean[i]:
            nv = valid_keys.sum(1)
            ok = ~bag_missed & (nv > 0)
            acc[ok] = acc[ok] / nv[ok].to(torch.float32)[:, None]
        args.out.view(b, args.out_stride)[:, off : off + dim] = acc
        pending = r[bag_missed].reshape(-1, dim)
    stats = [int(miss.numel()), int(hpos.numel()), unique_hits, int(valid.numel()), crossed]
    return stats, miss, pending


def _morris_steps(
    levels: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, stream: int, weight: int
) -> None:
    """``weight`` uses of ``levels[slots[i]]`` per hit (:func:`add_weighted`; one: a Morris
    step), each slot's hits in position order (``positions`` ascending), the hit at position
    ``j`` drawing ``mix64(stream + j)``: the kernel's sequential uses, one rank of every slot's
    hits per round."""
    if slots.numel() == 0:
        return
    u = draws(stream, positions)
    order = torch.argsort(slots, stable=True)
    ss, uu = slots[order], u[order]
    _, inv, counts = torch.unique_consecutive(ss, return_inverse=True, return_counts=True)
    rank = torch.arange(ss.numel()) - (torch.cumsum(counts, 0) - counts)[inv]
    for r in range(int(counts.max())):
        sel = rank == r
        s = ss[sel]
        levels[s] = add_weighted(levels[s], torch.full_like(s, weight), uu[sel])


def gather_rows(
    storage: torch.Tensor,
    slots: torch.Tensor,
    row_format: RowDtype,
    dim: int,
    hotness: int = 0,
    out: torch.Tensor | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Rows of ``row_format`` read from a cache's ``storage`` by slot, dequantized to float32
    (:func:`hps.rowformat.dequantize_rows`, bit for bit), or bags of them summed in order.

    Args:
        storage: ``(capacity, ≥ row_bytes(row_format, dim)) uint8`` contiguous (a cache's
            ``storage``: each row in hps.rowformat's layout, FBGEMM's).
        slots: ``(n,) int64`` slots into ``storage``; -1: a zero row (rows) or a skipped key
            (bags).
        row_format: the layout of the stored rows.
        dim: values per row.
        hotness: 0: one output row per slot; ``h > 0``: ``n / h`` bags of ``h`` slots each,
            ``out[b] = ((0 + row(s_b0)) + row(s_b1)) + …``.
        out: optional ``(n or n / h, ≥ dim) float32`` with a unit last stride (e.g. a column
            block of a wider buffer); written in its first ``dim`` columns.
        compiled: use the compiled kernel when it is built (else :func:`gather_rows_reference`).

    Returns:
        ``out`` (or a new ``(n or n / h, dim)`` tensor).

    Raises:
        ValueError: a slot outside ``[-1, capacity)``, ``n`` not a multiple of ``hotness``,
            storage rows narrower than the format's, or a mis-shaped ``out``.
    """
    row_format = RowDtype(row_format)
    n = slots.numel()
    if hotness < 0 or (hotness and n % hotness):
        raise ValueError(f"gather_rows: {n} slots are not bags of hotness {hotness}")
    rows = n // hotness if hotness else n
    if out is None:
        out = torch.empty(rows, dim, dtype=torch.float32)
    ext = load_extension() if compiled else None
    if ext is None:
        return gather_rows_reference(storage, slots, row_format, dim, hotness, out)
    ext.gather_rows(storage, slots, FORMAT_CODES[row_format], dim, out, hotness)
    return out


def gather_rows_reference(
    storage: torch.Tensor,
    slots: torch.Tensor,
    row_format: RowDtype,
    dim: int,
    hotness: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`gather_rows` in torch ops (:func:`hps.rowformat.dequantize_rows`, then
    :func:`pool_in_order`): the specification the kernel is tested against."""
    rb = row_bytes(row_format, dim)
    cap = storage.shape[0]
    if storage.dim() != 2 or storage.dtype != torch.uint8 or storage.shape[1] < rb:
        raise ValueError(
            f"gather_rows: storage must be (capacity, >= {rb}) uint8 for {row_format.value} rows "
            f"of dim {dim}, got {storage.dtype} {tuple(storage.shape)}"
        )
    bad = (slots < -1) | (slots >= cap)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"gather_rows: slot {int(slots[i])} at position {i} is outside [-1, {cap})"
        )
    valid = slots >= 0
    rows = dequantize_rows(storage[:, :rb].index_select(0, slots.clamp(min=0)), row_format, dim)
    rows[~valid] = 0.0
    if hotness == 0:
        out[:, :dim] = rows
    else:
        b = slots.numel() // hotness
        out[:, :dim] = pool_in_order(rows.view(b, hotness, dim), valid.view(b, hotness), False)
    return out
