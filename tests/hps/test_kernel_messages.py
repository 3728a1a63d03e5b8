"""The compiled kernels' argument errors, whose messages are built only when a check fails
(hps/csrc/common.h ``check``), and the fused call's plan (:class:`hps.session.fused.CallPlan`):
each message names the table and the values at fault, a plan is built once per list of
tables and never for a call that is refused, and a planned call without a miss records its
tables' statistics as one with misses does."""

from __future__ import annotations

import pytest
import torch

from hps.fused import FORMAT_CODES, GatherArgs, gather, gather_rows
from hps.kernels import load_extension
from hps.rowformat import RowDtype
from hps.session import LookupSession, SessionTable
from hps.storage.cache import EmbeddingCache, StaticEmbeddingCache
from hps.storage.volatile import HashMapBackend
from hps.types import Pooling, Tier
from tests.hps.hps_helpers import needs_ext

FP32 = FORMAT_CODES[RowDtype.FP32]


def _static_args(n_tables: int = 2) -> dict[str, object]:
    """Valid arguments of ``static_gather``: tables of 10 FP32 rows of dim 4, two keys each,
    rows written one after another into one output."""
    return {
        "keys": [torch.tensor([1, 2]) for _ in range(n_tables)],
        "storage": [torch.zeros(10, 16, dtype=torch.uint8) for _ in range(n_tables)],
        "formats": [FP32] * n_tables,
        "dims": [4] * n_tables,
        "hotness": [0] * n_tables,
        "mean": [0] * n_tables,
        "out": torch.empty(8 * n_tables),
        "out_offsets": [8 * i for i in range(n_tables)],
        "out_stride": 0,
        "key_counters": [],
    }


def _static_gather(**changed: object) -> torch.Tensor:
    ext = load_extension()
    assert ext is not None
    a = {**_static_args(), **changed}
    return ext.static_gather(
        a["keys"],
        a["storage"],
        a["formats"],
        a["dims"],
        a["hotness"],
        a["mean"],
        a["out"],
        a["out_offsets"],
        a["out_stride"],
        a["key_counters"],
    )


def test_static_gather_names_the_table_and_the_values_at_fault() -> None:
    needs_ext()
    per = _static_gather()  # the valid call runs: two tables, two hits each
    assert per[:, 1].tolist() == [2, 2]
    two = [torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int32)]
    with pytest.raises(ValueError, match=r"^hps: static_gather: table 1: keys must be CPU int64$"):
        _static_gather(keys=two)
    narrow = [torch.zeros(10, 16, dtype=torch.uint8), torch.zeros(10, 12, dtype=torch.uint8)]
    with pytest.raises(
        ValueError,
        match=r"^hps: static_gather: table 1: rows of format 0 and dim 4 need 16 bytes, "
        r"storage rows hold 12$",
    ):
        _static_gather(storage=narrow)
    with pytest.raises(
        ValueError, match=r"^hps: static_gather: table 0: 2 keys are not bags of hotness 3$"
    ):
        _static_gather(hotness=[3, 0])
    with pytest.raises(
        ValueError,
        match=r"^hps: static_gather: table 1: its output \(offset 9, 2 keys of dim 4\) does not "
        r"fit out of 16 values$",
    ):
        _static_gather(out_offsets=[0, 9])
    with pytest.raises(
        ValueError,
        match=r"static_gather: table 0: its output \(offset 2, 2 keys of dim 4, hotness 1, "
        r"stride 4\) does not fit out of 16 values \(each bag's offset \+ dim must be <= stride\)",
    ):
        _static_gather(hotness=[1, 1], out_offsets=[2, 0], out_stride=4)


def test_gather_rows_names_the_format_the_widths_and_the_shape_it_needs() -> None:
    needs_ext()
    storage = torch.zeros(10, 16, dtype=torch.uint8)
    slots = torch.tensor([0, 3])
    with pytest.raises(ValueError, match=r"^hps: row format code 9 with dim 4 is not a row format"):
        load_extension().gather_rows(storage, slots, 9, 4, torch.empty(2, 4), 0)  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"^hps: rows of format 0 and dim 8 need 32 bytes, storage rows hold 16$"
    ):
        gather_rows(storage, slots, RowDtype.FP32, 8, out=torch.empty(2, 8))
    with pytest.raises(
        ValueError, match=r"^hps: out must be a CPU float32 \(2, >= 4\) tensor with unit last"
    ):
        gather_rows(storage, slots, RowDtype.FP32, 4, out=torch.empty(3, 4))


def _session() -> LookupSession:
    v = HashMapBackend(num_partitions=1)
    tables = []
    for name in ("a", "b"):
        v.create_table(name, 4)
        keys = torch.arange(10)
        c = StaticEmbeddingCache(keys, 4, policy="lfu")
        c.insert(keys, torch.arange(40, dtype=torch.float32).view(10, 4) + (name == "b"))
        tables.append(SessionTable(name, 4, 0.0, 64, c))
    return LookupSession(tables, v, None, hit_rate_threshold=0.0)


def test_a_fused_call_plans_its_tables_once_and_never_for_a_refused_call() -> None:
    s = _session()
    k = torch.tensor([[1], [2]])
    first = s.lookup_pooled(["a", "b"], [k, k], Pooling.SUM).clone()
    plan = s._plans[("a", "b")]
    assert [t.name for t in plan.tables] == ["a", "b"] and plan.columns == (0, 4)
    again = s.lookup_pooled(["a", "b"], [k, k], Pooling.SUM)
    assert s._plans[("a", "b")] is plan and torch.equal(again, first)
    # another order is another plan: its own columns
    swapped = s.lookup_pooled(["b", "a"], [k, k], Pooling.SUM)
    assert torch.equal(swapped, torch.cat([first[:, 4:], first[:, :4]], 1))
    assert s._plans[("b", "a")].columns == (0, 4) and len(s._plans) == 2
    for bad, msg in ((["a", "a"], "named twice"), (["a", "nope"], "unknown table 'nope'")):
        for _ in range(2):  # refused on every call, not only the first
            with pytest.raises(ValueError, match=msg):
                s.lookup_pooled(bad, [k, k], Pooling.SUM)
    assert set(s._plans) == {("a", "b"), ("b", "a")}
    with pytest.raises(ValueError, match="2 tables but 1 key tensors"):
        s.lookup_pooled(["a", "b"], [k], Pooling.SUM)


def test_an_all_hit_fused_call_counts_each_tables_distinct_keys_and_occurrences() -> None:
    """A call without a miss records each table's counts in one pass: distinct keys and
    every occurrence (padding excluded) as cache hits, as a call with misses records them."""
    s = _session()
    a = torch.tensor([[1, 1, 2], [2, -1, 1]])  # 5 occurrences of 2 distinct keys
    b = torch.tensor([[3, -1, -1], [3, 4, -1]])  # 3 occurrences of 2 distinct keys
    s.lookup_pooled(["a", "b"], [a, b], Pooling.SUM)
    s.lookup_pooled(["b"], [b[:1]], Pooling.SUM)  # 1 occurrence of 1 key
    st = s.stats()
    cache = Tier.CACHE.value
    for name, lookups, occurrences, distinct in (("a", 1, 5, 2), ("b", 2, 4, 3)):
        got = st[name]
        assert isinstance(got, dict)
        assert (got["lookups"], got["keys_all"], got["keys_unique"]) == (
            lookups,
            occurrences,
            distinct,
        ), name
        assert got["hits_all"] == {**dict.fromkeys(got["hits_all"], 0), cache: occurrences}
        assert got["hits_unique"] == {**dict.fromkeys(got["hits_unique"], 0), cache: distinct}


def _gather_lfu(
    caches: list[EmbeddingCache],
    keys: list[torch.Tensor],
    out: torch.Tensor,
    offsets: list[int],
    stride: int,
    hotness: tuple[int, int],
) -> torch.Tensor:
    """:func:`hps.fused.gather` over two LFU caches at their current clocks (no aging, every
    hit one use); returns the pass's ``per_table``."""
    args = GatherArgs(
        caches=caches,
        keys=keys,
        out=out,
        out_offsets=offsets,
        out_stride=stride,
        hotness=hotness,
        mean=[False, False],
        stamps=[-1, -1],
        streams=[c.lfu_stream() for c in caches],
        looked_up=[0, 0],
        intervals=[0, 0],
    )
    return gather(args).per_table


def test_a_fused_pass_refuses_an_output_its_tables_do_not_fit() -> None:
    """:func:`hps.fused.gather` checks each table's place in ``out`` before any key is probed
    or any counter moves: rows past its end, and bags whose stride leaves no room for a
    table's columns, are refused naming the table, the shapes and ``out``'s size."""
    needs_ext()
    caches = [EmbeddingCache(64, 4, policy="lfu", ways=8) for _ in range(2)]
    for c in caches:
        c.insert(torch.arange(8), torch.ones(8, 4))
    before = [c.counters.clone() for c in caches]

    def call(
        keys: list[torch.Tensor],
        out: torch.Tensor,
        offsets: list[int],
        stride: int = 0,
        hotness: tuple[int, int] = (0, 0),
    ) -> None:
        _gather_lfu(caches, keys, out, offsets, stride, hotness)

    rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    with pytest.raises(
        ValueError,
        match=r"^hps: table 1: its output \(offset 12, 2 keys of dim 4\) does not fit out of "
        r"16 values$",
    ):
        call(rows, torch.empty(16), [0, 12])
    bags = [torch.tensor([[1, 2], [3, -1]]), torch.tensor([[4], [5]])]
    with pytest.raises(
        ValueError,
        match=r"^hps: table 1: its output \(offset 4, 2 keys of dim 4, hotness 1, stride 6\) "
        r"does not fit out of 12 values \(each bag's offset \+ dim must be <= stride\)$",
    ):
        call(bags, torch.empty(2, 6), [0, 4], stride=6, hotness=(2, 1))
    with pytest.raises(ValueError, match=r"^hps: table 0: 3 keys are not bags of hotness 2$"):
        call(
            [torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
            torch.empty(2, 8),
            [0, 4],
            stride=8,
            hotness=(2, 1),
        )
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c.counters, b)  # refused before any use was counted
    out = torch.empty(2, 8)
    call(bags, out, [0, 4], stride=8, hotness=(2, 1))  # the same keys, room for both
    assert out.tolist() == [[2.0] * 4 + [1.0] * 4, [1.0] * 8]


def test_a_fused_calls_keys_are_checked_in_one_call_and_refused_in_words() -> None:
    """Keys that pass every check are taken in one extension call (``plain_keys``: each
    table's bag width, or ``None``); any other keys go through the per-table checks, whose
    errors name the table and the value at fault. Keys that are not contiguous are taken as a
    contiguous copy, with the same rows."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    k3, k2 = torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([[7], [8], [9]])
    assert ext.plain_keys([k3, k2], [64, 64], True) == [2, 1]
    assert ext.plain_keys([k3.view(-1), k2.view(-1)], [64, 64], False) == []
    for keys, bound in [
        ([k3.int(), k2], [64, 64]),  # int32
        ([k3.t(), k2], [64, 64]),  # not contiguous
        ([k3, k2[:2]], [64, 64]),  # another batch
        ([k3.view(-1), k2], [64, 64]),  # not (B, w)
        ([k3, k2], [5, 64]),  # over the bound
        ([k3], [64, 64]),  # one tensor short
    ]:
        assert ext.plain_keys(keys, bound, True) is None
    with pytest.raises(TypeError):
        ext.plain_keys([[1, 2], k2], [64, 64], True)

    s = _session()
    want = s.lookup_pooled(["a", "b"], [k3, k3], Pooling.SUM).clone()
    assert torch.equal(
        s.lookup_pooled(["a", "b"], [k3.t().contiguous().t(), k3], Pooling.SUM), want
    )
    rows = s.lookup_many(["a", "b"], [k3.t(), k3.t()])
    assert torch.equal(rows[0], s.lookup_many(["a"], [k3.t().contiguous()])[0])
    cases: list[tuple[list[object], str]] = [
        ([k3.int(), k3], r"table 'a': keys must be an int64 torch.Tensor, got torch.int32"),
        ([[1, 2], k3], r"table 'a': keys must be an int64 torch.Tensor, got list"),
        (
            [k3, torch.zeros(65, 1, dtype=torch.long)],
            r"table 'b': 65 keys in one lookup, at most 64",
        ),
        ([k3.view(-1), k3], r"table 'a': bags must be \(B, w\), got \(6,\)"),
        ([k3, k3[:2]], r"table 'b': 2 bags, but the first table has 3"),
    ]
    for keys, msg in cases:
        with pytest.raises(ValueError, match=msg):
            s.lookup_pooled(["a", "b"], keys, Pooling.SUM)  # type: ignore[arg-type]


def test_a_fused_pass_counts_its_keys_and_refuses_a_reserved_one_before_any_use() -> None:
    """The fused pass's key check (``valid_keys``, one branchless pass per table): bags count
    their keys but the -1 pads as looked up, rows every key; a bag key below -1, or the
    reserved key -2**63 in rows, is refused naming the table, the key and its first position,
    before any counter moves."""
    needs_ext()
    caches = [EmbeddingCache(64, 4, policy="lfu", ways=8) for _ in range(2)]
    for c in caches:
        c.insert(torch.arange(8), torch.ones(8, 4))
    before = [c.counters.clone() for c in caches]

    def call(keys: list[torch.Tensor], hotness: tuple[int, int]) -> torch.Tensor:
        if hotness[0] > 0:  # bags: table 0's columns 0-3, table 1's 4-7
            return _gather_lfu(caches, keys, torch.empty(keys[0].shape[0], 8), [0, 4], 8, hotness)
        out = torch.empty(sum(k.numel() * 4 for k in keys))
        return _gather_lfu(caches, keys, out, [0, keys[0].numel() * 4], 0, hotness)

    # a long table, so that the check's vector loop and its tail both see keys
    long_bags = torch.full((40, 3), -1, dtype=torch.int64)
    long_bags[:, 0] = torch.arange(40) % 8
    long_bags[::3, 2] = 5
    for pos, bad in ((0, -2), (61, -7), (119, -(2**63))):
        keys = long_bags.clone()
        keys.view(-1)[pos] = bad
        keys.view(-1)[pos + 1 :] = torch.where(keys.view(-1)[pos + 1 :] >= 0, -5, -1)
        with pytest.raises(
            ValueError,
            match=rf"^table 0: key {bad} at position {pos} \(keys are >= 0; -1 pads a short "
            r"bag\)$",
        ):
            call([keys, torch.tensor([[1]] * 40)], (3, 1))
    rows = torch.arange(37) % 8
    rows[30] = -(2**63)
    with pytest.raises(
        ValueError,
        match=r"^table 1: key -9223372036854775808 at position 30 is reserved \(the "
        r"empty-slot sentinel\)$",
    ):
        call([torch.tensor([1, 2]), rows], (0, 0))
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c.counters, b)  # refused before any use was counted
    per = call([long_bags, torch.tensor([[1]] * 40)], (3, 1))
    assert per[:, 3].tolist() == [40 + 14, 40]  # looked up: the -1 pads are not keys
    rows[30] = -5  # a negative key in rows is looked up (and missed), not refused
    per = call([torch.tensor([1, 2]), rows], (0, 0))
    assert per[:, 3].tolist() == [2, 37] and per[1, 0] == 1


def test_row_views_are_views_of_the_output_at_each_tables_offset_and_refuse_what_overflows() -> (
    None
):
    """``row_views``: table i's rows of a fused call's flat output, viewed in its keys' shape
    plus its dim at offsets[i] (the output's own storage offset added), sharing its storage and
    version counter; a block past the output's end is refused, naming the table."""
    needs_ext()
    ext = load_extension()
    assert ext is not None
    base = torch.arange(40, dtype=torch.float32)
    out = base[3:]  # a view with a storage offset of its own
    k0, k1 = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    v0, v1 = ext.row_views(out, [k0, k1], [0, 12], [2, 5])
    assert v0.shape == (2, 3, 2) and v0.stride() == (6, 2, 1) and v0.storage_offset() == 3
    assert v1.shape == (4, 5) and v1.stride() == (5, 1) and v1.storage_offset() == 15
    assert torch.equal(v0.reshape(-1), out[:12]) and torch.equal(v1.reshape(-1), out[12:32])
    assert v0._base is base and v1._base is base
    v = out._version
    v1.add_(1.0)  # written through the view: the output's version moves with it
    assert out._version > v and torch.equal(out[12:32], torch.arange(15, 35).float() + 1.0)
    with pytest.raises(ValueError, match="table 1's 20 values at 18 do not fit in 37"):
        ext.row_views(out, [k0, k1], [0, 18], [2, 5])
    with pytest.raises(ValueError, match="1-D"):
        ext.row_views(out.view(37, 1), [k0], [0], [2])
    with pytest.raises(ValueError, match="one offset and one dim per table"):
        ext.row_views(out, [k0, k1], [0], [2, 5])
