"""The all-hit pass over full IDENTITY static caches (:func:`hps.session.static_gather.gather_static`
through the compiled ``static_gather``): rows and bags (SUM and MEAN, -1 padding, empty bags,
FP32 rows of dims pooled in registers and row by row, a quantized format) equal the table-by-
table path and the torch reference bit for bit, statistics included; a key that is not its
table's leaves the pass without a write, and the table-by-table path answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hps import fused
from hps.fused import FORMAT_CODES, GatherArgs, GatherResult, gather_reference, join_tables
from hps.kernels import load_extension
from hps.rowformat import RowDtype
from hps.session import static_gather
from hps.session.static_gather import gather_static
from hps.storage.cache import StaticEmbeddingCache, StaticLayout
from tests.hps.hps_helpers import needs_ext

DIMS = [16, 128, 24, 64, 32]
SIZES = [50, 70, 40, 90, 30]


def _caches(fmt: RowDtype) -> list[StaticEmbeddingCache]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n, d in zip(SIZES, DIMS, strict=True):
        c = StaticEmbeddingCache(np.arange(n), d, row_format=fmt)
        c.insert(torch.arange(n), torch.randn(n, d, generator=g) * 3)
        assert c.full and c.layout is StaticLayout.IDENTITY
        out.append(c)
    return out


def _args(
    caches: list[StaticEmbeddingCache], keys: list[torch.Tensor], hot: list[int], mean: list[bool]
) -> GatherArgs:
    dims = [c.dim for c in caches]
    if hot[0]:  # bags: one row of every table's bag per sample
        batch = keys[0].numel() // hot[0]
        out = torch.full((batch, sum(dims)), 7.0)
        offsets, stride = [0, *np.cumsum(dims)[:-1].tolist()], sum(dims)
    else:  # rows: each table's block after the last
        sizes = [k.numel() * d for k, d in zip(keys, dims, strict=True)]
        out = torch.full((sum(sizes),), 7.0)
        offsets, stride = [0, *np.cumsum(sizes)[:-1].tolist()], 0
    t = len(caches)
    return GatherArgs(
        caches=list(caches), keys=keys, out=out, out_offsets=offsets, out_stride=stride,
        hotness=hot, mean=mean, stamps=[-1] * t, streams=[0] * t, looked_up=[0] * t,
        intervals=[0] * t,
    )  # fmt: skip


def _same(a: GatherResult, b: GatherResult) -> None:
    assert torch.equal(a.per_table, b.per_table)
    assert torch.equal(a.misses, b.misses)
    for x, y in zip(a.pending, b.pending, strict=True):
        assert x.numel() == 0 and y.numel() == 0


def _no_table_by_table(*_: object) -> None:
    raise AssertionError("the all-hit pass fell back to the table-by-table path")


@pytest.mark.parametrize(
    ("fmt", "batch"), [(RowDtype.FP32, 24), (RowDtype.INT8, 24), (RowDtype.FP32, 2048)]
)
@pytest.mark.parametrize("bags", [True, False], ids=["bags", "rows"])
def test_all_hit_pass_equals_the_table_by_table_path_and_the_reference(
    fmt: RowDtype, batch: int, bags: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 2048 (over 8,192 keys) with two torch threads: the pass splits its pieces
    between threads."""
    needs_ext()
    caches = _caches(fmt)
    g = torch.Generator().manual_seed(9)
    hot = [1, 3, 2, 5, 4] if bags else [0] * 5
    mean = [True, False, True, True, False]
    keys = [
        torch.randint(-1 if bags else 0, n, (batch * max(h, 1),), generator=g)
        for n, h in zip(SIZES, hot, strict=True)
    ]
    if bags:
        for k in keys:
            k[::7] = -1  # padding in every table
        keys[1].view(batch, 3)[5] = -1  # an empty bag (SUM)
        keys[3].view(batch, 5)[7] = -1  # an empty bag (MEAN): stays zero
    outs, results = [], []
    threads = torch.get_num_threads()
    with monkeypatch.context() as m:  # the all-hit pass only
        m.setattr(static_gather, "_gather_one", _no_table_by_table)
        m.setattr(static_gather, "_all_rows_hit", _no_table_by_table)
        a = _args(caches, keys, hot, mean)
        torch.set_num_threads(2)
        try:
            results.append(gather_static(a))
        finally:
            torch.set_num_threads(threads)
        outs.append(a.out)
    a = _args(caches, keys, hot, mean)  # table by table, compiled gathers
    results.append(
        join_tables([static_gather._gather_one(a, i, c, True) for i, c in enumerate(caches)])
    )
    outs.append(a.out)
    a = _args(caches, keys, hot, mean)  # torch ops
    results.append(gather_reference(a))
    outs.append(a.out)
    for out, res in zip(outs[1:], results[1:], strict=True):
        assert torch.equal(outs[0].view(torch.int32), out.view(torch.int32))
        _same(results[0], res)
    valid = [int((k >= 0).sum()) for k in keys]
    unique = [int(torch.unique(k[k >= 0]).numel()) for k in keys]
    want = [[0, v, u, v, 0] for v, u in zip(valid, unique, strict=True)]
    assert results[0].per_table.tolist() == want
    if bags:
        empty = outs[0][7, sum(DIMS[:3]) : sum(DIMS[:4])]
        assert bool((empty == 0).all())


def test_a_key_not_its_tables_leaves_the_all_hit_pass_without_a_write() -> None:
    needs_ext()
    ext = load_extension()
    assert ext is not None
    caches = _caches(RowDtype.FP32)
    g = torch.Generator().manual_seed(10)
    hot, mean = [2] * 5, [False] * 5
    keys = [torch.randint(-1, n, (16,), generator=g) for n in SIZES]
    keys[4][11] = SIZES[4]  # one past the table's last key: a miss
    a = _args(caches, keys, hot, mean)
    counters = [ext.KeyCounter() for _ in caches]
    per = ext.static_gather(
        a.keys, [c.storage for c in caches], [FORMAT_CODES[fmt] for fmt in [RowDtype.FP32] * 5],
        DIMS, hot, [0] * 5, a.out, a.out_offsets, a.out_stride, counters,
    )  # fmt: skip
    assert per.shape == (0, 5) and bool((a.out == 7.0).all())
    assert [c.size() for c in counters] == [0] * 5  # nothing counted either
    got = gather_static(a)
    b = _args(caches, keys, hot, mean)
    want = fused.gather_reference(b)
    assert torch.equal(a.out, b.out) and torch.equal(got.per_table, want.per_table)
    assert got.misses.tolist() == [11] and int(got.per_table[4, 0]) == 1
    for x, y in zip(got.pending, want.pending, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("hot", [0, 2], ids=["rows", "bags"])
def test_a_key_no_lookup_takes_raises_after_the_compiled_pass_wrote_nothing(
    hot: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled pass runs before the key check (its range check is stricter): it refuses
    a bag key below -1, or the reserved key -2**63 in rows, without a write, and the key check
    then raises ValueError naming the table and the key."""
    needs_ext()
    caches = _caches(RowDtype.FP32)
    g = torch.Generator().manual_seed(12)
    keys = [torch.randint(0, n, (16,), generator=g) for n in SIZES]
    bad = -5 if hot else -(2**63)
    keys[3][9] = bad
    a = _args(caches, keys, [hot] * 5, [False] * 5)
    answers: list[GatherResult | None] = []
    compiled_pass = static_gather._all_hit_compiled

    def spy(args: GatherArgs, cs: list[StaticEmbeddingCache]) -> GatherResult | None:
        answers.append(compiled_pass(args, cs))
        return answers[-1]

    monkeypatch.setattr(static_gather, "_all_hit_compiled", spy)
    with pytest.raises(ValueError, match=rf"table 3: key {bad} is not a key this lookup takes"):
        gather_static(a)
    assert answers == [None]  # the compiled pass ran first and refused
    assert bool((a.out == 7.0).all())


@pytest.mark.parametrize("hot", [0, 2], ids=["rows", "bags"])
def test_a_large_sparsely_hit_table_is_counted_by_its_keys(hot: int) -> None:
    """4 M rows (FP32, dim 16; only the hit rows' pages touched), 40 keys with repeats, the
    first and last rows among them: statistics and output equal the reference. (That the
    distinct count's cost stays flat in the table's rows is measured, not asserted here.)"""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    cap, dim, g = 4_000_000, 16, torch.Generator().manual_seed(11)
    storage = torch.empty(cap, dim * 4, dtype=torch.uint8)  # untouched but the rows below
    picks = torch.cat([torch.randint(0, cap, (24,), generator=g), torch.tensor([0, cap - 1])])
    storage[picks] = torch.randn(picks.numel(), dim, generator=g).view(torch.uint8)
    keys = picks[torch.randint(0, picks.numel(), (40,), generator=g)]
    if hot:
        keys[::5] = -1
    valid = keys[keys >= 0]
    out = torch.full((40 * dim,) if hot == 0 else (20, dim), 7.0)
    per = ext.static_gather(
        [keys], [storage], [FORMAT_CODES[RowDtype.FP32]], [dim], [hot], [0], out, [0], dim, []
    )
    n = int(valid.numel())
    assert per.tolist() == [[0, n, int(torch.unique(valid).numel()), n, 0]]
    want = fused.gather_rows(storage, keys, RowDtype.FP32, dim, hot, None, compiled=False)
    assert torch.equal(out.view(torch.int32), want.reshape(out.shape).view(torch.int32))


def test_an_output_that_does_not_fit_is_refused_before_a_write() -> None:
    """An offset near 2**63 (``offset + n × dim`` wraps) and bags whose ``offset + dim``
    passes the stride (one table's bag into the next bag) raise ValueError naming the table,
    the offset and the sizes; nothing written."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    f, dim = FORMAT_CODES[RowDtype.FP32], 16
    storage = torch.arange(4 * dim, dtype=torch.float32).view(4, dim).view(torch.uint8)
    k = torch.arange(4)
    out = torch.full((64,), 7.0)
    with pytest.raises(ValueError, match=r"table 0: its output \(offset 9223372036854775776, 4 keys of dim 16\)"):  # fmt: skip
        ext.static_gather([k], [storage], [f], [dim], [0], [0], out, [2**63 - 32], 0, [])
    bags = torch.full((4, 24), 7.0)
    with pytest.raises(ValueError, match=r"table 1: .*offset 16, 4 keys of dim 16, hotness 1, stride 24"):  # fmt: skip
        ext.static_gather(
            [k, k], [storage, storage], [f, f], [dim, dim], [1, 1], [0, 0], bags, [0, 16], 24, []
        )
    assert bool((out == 7.0).all()) and bool((bags == 7.0).all())


def test_keys_the_compiled_pass_cannot_take_fall_back_to_the_torch_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int32 keys: the rows' torch all-hit pass answers (no raise), equal to the reference."""
    needs_ext()
    caches = _caches(RowDtype.FP32)
    g = torch.Generator().manual_seed(12)
    keys = [torch.randint(0, n, (12,), generator=g, dtype=torch.int32) for n in SIZES]
    a = _args(caches, keys, [0] * 5, [False] * 5)
    with monkeypatch.context() as m:
        m.setattr(static_gather, "_gather_one", _no_table_by_table)
        got = gather_static(a)
    b = _args(caches, [k.long() for k in keys], [0] * 5, [False] * 5)
    want = gather_reference(b)
    assert torch.equal(a.out, b.out)
    _same(got, want)


def test_a_row_key_not_its_tables_is_range_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled pass found a key out of its table: the table-by-table path answers, the
    torch all-hit pass (the same range check again) is not tried."""
    needs_ext()
    caches = _caches(RowDtype.FP32)
    g = torch.Generator().manual_seed(13)
    keys = [torch.randint(0, n, (10,), generator=g) for n in SIZES]
    keys[2][4] = SIZES[2]
    a = _args(caches, keys, [0] * 5, [False] * 5)
    with monkeypatch.context() as m:
        m.setattr(static_gather, "_all_rows_hit", _no_table_by_table)
        got = gather_static(a)
    b = _args(caches, keys, [0] * 5, [False] * 5)
    want = gather_reference(b)
    hit = torch.ones(a.out.numel(), dtype=torch.bool)
    miss_at = sum(10 * d for d in DIMS[:2]) + 4 * DIMS[2]
    hit[miss_at : miss_at + DIMS[2]] = False  # a miss's row is the session's to fill
    assert torch.equal(a.out[hit], b.out[hit]) and torch.equal(got.per_table, want.per_table)
    assert got.misses.tolist() == [4]


@pytest.mark.parametrize("n_keys", [24, 3000])
def test_the_all_hit_pass_counts_every_tables_keys_and_leaves_its_bitmap_clear(
    n_keys: int,
) -> None:
    """With key counters, the compiled pass counts each table's keys >= 0 (all hits) as the
    counter's weight, and none into a table given no counter; 3,000 keys a table (over 8,192
    in all) with two torch threads count the tables on whichever thread is free, beside the
    copy. A call refused midway through a table (after keys of it set their bits) leaves no bit
    set and counts nothing: the next call on the same thread counts the same distinct keys as
    the reference."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    caches = _caches(RowDtype.FP32)
    g = torch.Generator().manual_seed(13)
    hot = [3] * 5
    keys = [torch.randint(-1, n, (n_keys,), generator=g) for n in SIZES]
    storage = [c.storage for c in caches]
    formats = [FORMAT_CODES[RowDtype.FP32]] * 5
    counters = [ext.KeyCounter() for _ in caches]
    counters[1].set_weight(8)
    given = [counters[0], counters[1], None, counters[3], None]
    bad = [k.clone() for k in keys]
    bad[2][20] = SIZES[2]  # past table 2's rows, after 20 of its keys set their bits
    threads = torch.get_num_threads()
    for ks, cs in ((bad, given), (keys, given), (keys, [])):
        a = _args(caches, ks, hot, [False] * 5)
        torch.set_num_threads(2)
        try:
            per = ext.static_gather(
                ks, storage, formats, DIMS, hot, [0] * 5, a.out, a.out_offsets, a.out_stride, cs
            )
        finally:
            torch.set_num_threads(threads)
        if ks is bad:
            assert per.shape == (0, 5)
            continue
        unique = [int(torch.unique(k[k >= 0]).numel()) for k in keys]
        assert per[:, 2].tolist() == unique
    for i, c in enumerate(counters):
        got_keys, got_counts = c.items()
        if given[i] is None:
            assert got_keys.numel() == 0
            continue
        want_keys, want_counts = torch.unique(keys[i][keys[i] >= 0], return_counts=True)
        assert got_keys.tolist() == want_keys.tolist()
        assert got_counts.tolist() == (want_counts * (8 if i == 1 else 1)).tolist()
