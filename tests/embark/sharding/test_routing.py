"""The communication-free parts of embark.sharding, in one process: key routing, the layout's
canonical order, the one-rank world (collectives are identities) and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embark.data.jagged import JaggedBatch
from embark.sharding import Layout, ShardedEmbeddingCollection
from embark.sharding.comm import CommStats, exchange_vectors, from_int_bytes, int_bytes
from embark.sharding.hierarchical import node_blocks, relays_for
from embark.sharding.routing import bag_lengths, route_keys, sample_ids
from embark.types import CommDtype, Shard, ShardingPlan, TableConfig, TableSharding


def _two_rank_plan() -> tuple[list[TableConfig], ShardingPlan]:
    tables = [TableConfig("t0", 8, 4), TableConfig("t1", 6, 4), TableConfig("t2", 5, 3)]
    plan = ShardingPlan(
        2,
        2,
        (
            TableSharding(
                "t0", 8, 4, "row_wise", "reduction", (Shard(0, 0, 4, 0, 4), Shard(1, 4, 8, 0, 4))
            ),
            TableSharding(
                "t1", 6, 4, "column_wise", "unique", (Shard(1, 0, 6, 2, 4), Shard(0, 0, 6, 0, 2))
            ),
            TableSharding(
                "t2",
                5,
                3,
                "data_parallel",
                "data_parallel",
                (Shard(0, 0, 5, 0, 3), Shard(1, 0, 5, 0, 3)),
            ),
        ),
    )
    return tables, plan


def test_route_keys_matches_the_docstring_example() -> None:
    values = torch.tensor([1, 5, 5, 5, 7])
    samples = sample_ids(torch.tensor([2, 3], dtype=torch.int32))
    assert samples.tolist() == [0, 0, 1, 1, 1]
    shards = [Shard(0, 0, 4, 0, 4), Shard(1, 4, 8, 0, 4)]
    (r0, s0), (r1, s1) = route_keys(values, samples, shards)
    assert (r0.tolist(), s0.tolist()) == ([1], [0])
    assert (r1.tolist(), s1.tolist()) == ([1, 1, 1, 3], [0, 1, 1, 1])
    assert bag_lengths(s1, 2).tolist() == [1, 3]
    # column blocks: every id goes to each block; uneven 3d row splits per block
    shards = [Shard(0, 0, 3, 0, 2), Shard(1, 3, 8, 0, 2), Shard(2, 0, 8, 2, 4)]
    routed = route_keys(values, samples, shards)
    assert [r.tolist() for r, _ in routed] == [[1], [2, 2, 2, 4], [1, 5, 5, 5, 7]]


def test_relays_match_the_docstring_and_the_cost_model() -> None:
    """Owners relay themselves, the other sources go to the owners in turn (the module's worked
    example); one owner relays every source (sends directly); an owner on every rank of a node
    relays each source by its local index (rail-aligned); the split is even, as the cost
    model's reduce-scatter assumes."""
    assert relays_for([0, 1], 4) == (0, 1, 0, 1)
    assert relays_for([1], 4) == (1, 1, 1, 1)
    assert relays_for([2, 3], 8) == (2, 3, 2, 3, 2, 3, 2, 3)
    assert relays_for([4, 5, 6, 7], 12) == (4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7)
    load = [relays_for([0, 2, 3], 16).count(o) for o in (0, 2, 3)]
    assert max(load) - min(load) <= 1 and sum(load) == 16
    with pytest.raises(ValueError, match="0..3"):
        relays_for([4], 4)
    with pytest.raises(ValueError, match=r"\[\]"):
        relays_for([], 4)


def test_node_blocks_list_owners_and_relays_per_node() -> None:
    tables = [TableConfig("t0", 8, 4), TableConfig("t1", 6, 4)]
    plan = ShardingPlan(
        4,
        2,
        (
            TableSharding(
                "t0",
                8,
                4,
                "3d",
                "reduction",
                (Shard(0, 0, 4, 0, 4), Shard(1, 4, 6, 0, 4), Shard(2, 6, 8, 0, 4)),
            ),
            TableSharding(
                "t1", 6, 4, "column_wise", "reduction", (Shard(3, 0, 6, 2, 4), Shard(2, 0, 6, 0, 2))
            ),
        ),
    )
    blocks = node_blocks(Layout(tables, plan), 2)
    assert [(b.table, b.col_start, b.num_cols, b.owners, b.relays) for b in blocks[0]] == [
        ("t0", 0, 4, (0, 1), (0, 1, 0, 1)),
    ]
    assert [(b.table, b.col_start, b.num_cols, b.owners, b.relays) for b in blocks[1]] == [
        ("t0", 0, 4, (2,), (2, 2, 2, 2)),
        ("t1", 0, 2, (2,), (2, 2, 2, 2)),
        ("t1", 2, 2, (3,), (3, 3, 3, 3)),
    ]


def test_layout_lists_owned_shards_in_table_order() -> None:
    tables, plan = _two_rank_plan()
    layout = Layout(tuple(tables), plan)
    assert [
        [(r.table, r.shard.col_start, r.shard.row_start) for r in refs] for refs in layout.owned
    ] == [
        [("t0", 0, 0), ("t1", 0, 0)],
        [("t0", 0, 4), ("t1", 2, 0)],
    ]
    assert layout.dp_tables == ("t2",) and layout.sharded_tables == ("t0", "t1")
    assert Layout(tuple(tables), plan, CommDtype.BF16).wires_in_use == (CommDtype.BF16,)


@pytest.mark.parametrize("wire,exact", [("fp32", True), ("fp16", False), ("bf16", False)])
def test_exchange_vectors_rounds_through_the_wire_dtype(wire: str, exact: bool) -> None:
    x = (torch.randn(10) / 3).requires_grad_(True)
    stats = CommStats()
    (y,) = exchange_vectors([x], [CommDtype(wire)], [[10]], [[10]], stats=stats)
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[wire]
    assert y.dtype == torch.float32 and torch.equal(y, x.detach().to(dt).float())
    g = torch.randn(10) / 3
    y.backward(g)
    gdt = torch.bfloat16 if wire == "fp16" else dt  # fp16's gradients travel as bf16
    assert torch.equal(x.grad, g.to(gdt).float())
    assert torch.equal(x.detach(), y.detach()) == exact
    assert stats.phases == {}  # self-sends are not counted


def test_int_bytes_round_trip_at_any_offset() -> None:
    """A keys segment: int32 lengths then int64 ids, packed as bytes; an odd number of lengths
    leaves the ids at an offset not aligned for int64."""
    lengths = torch.tensor([3, 0, 2**31 - 1], dtype=torch.int32)
    ids = torch.tensor([5, 2**40, 0], dtype=torch.int64)
    buf = torch.cat([int_bytes(lengths), int_bytes(ids)])
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * 4 + 3 * 8
    assert torch.equal(from_int_bytes(buf[:12], torch.int32), lengths)
    assert torch.equal(from_int_bytes(buf[12:], torch.int64), ids)
    assert from_int_bytes(buf[:0], torch.int64).numel() == 0
    with pytest.raises(ValueError, match="a multiple of 8"):
        from_int_bytes(buf[:12], torch.int64)


def _one_rank() -> tuple[list[TableConfig], ShardingPlan]:
    tables = [
        TableConfig("a", 10, 4, combiner="mean"),
        TableConfig("b", 7, 3),
        TableConfig("c", 5, 2),
    ]
    plan = ShardingPlan(
        1,
        1,
        (
            TableSharding("a", 10, 4, "table_wise", "unique", (Shard(0, 0, 10, 0, 4),)),
            TableSharding("b", 7, 3, "table_wise", "reduction", (Shard(0, 0, 7, 0, 3),)),
            TableSharding("c", 5, 2, "data_parallel", "data_parallel", (Shard(0, 0, 5, 0, 2),)),
        ),
    )
    return tables, plan


def _batch(tables: list[TableConfig], b: int, seed: int) -> JaggedBatch:
    g = torch.Generator().manual_seed(seed)
    per = {}
    for t in tables:
        lengths = torch.randint(0, 4, (b,), generator=g, dtype=torch.int32)
        per[t.name] = (torch.randint(0, t.num_rows, (int(lengths.sum()),), generator=g), lengths)
    return JaggedBatch.from_per_key(per)


@pytest.mark.parametrize("b", [0, 1, 7])
def test_one_rank_world_equals_embedding_bag(b: int) -> None:
    tables, plan = _one_rank()
    m = ShardedEmbeddingCollection(tables, plan, 0)
    full = {t.name: torch.randint(-5, 6, (t.num_rows, t.dim)).float() for t in tables}
    m.load_full_weights(full)
    batch = _batch(tables, b, seed=b)
    out = m(batch)
    for t in tables:
        want = (
            F.embedding_bag(
                batch.values_for(t.name),
                full[t.name],
                batch.bag_offsets(t.name),
                mode=t.combiner.value,
            )
            if b
            else torch.zeros(0, t.dim)
        )
        assert torch.equal(out[t.name], want), t.name
    assert all(torch.equal(m.full_weights()[n], w) for n, w in full.items())


def test_one_rank_errors_name_the_table_rank_and_id() -> None:
    tables, plan = _one_rank()
    with pytest.raises(ValueError, match="world size 2 but the process group has 1 rank"):
        ShardedEmbeddingCollection(*_two_rank_plan(), 0)
    with pytest.raises(ValueError, match="rank 1 is outside the plan's ranks 0..0"):
        ShardedEmbeddingCollection(tables, plan, 1)
    with pytest.raises(ValueError, match="table 'd': missing from the plan"):
        ShardedEmbeddingCollection([*tables, TableConfig("d", 3, 2)], plan, 0)
    with pytest.raises(ValueError, match="TableConfig.name 'x.y' is not a valid name"):
        TableConfig("x.y", 3, 2)  # a '.' would split its parameter path
    m = ShardedEmbeddingCollection(tables, plan, 0)
    with pytest.raises(ValueError, match="table 'b' is missing"):
        m.load_full_weights({"a": torch.zeros(10, 4)})
    with pytest.raises(ValueError, match=r"table 'a' is 10 × 4, got shape \(4, 10\)"):
        m.load_full_weights({"a": torch.zeros(4, 10)})
    batch = _batch(tables, 3, seed=0)
    for bad in (7, -1):
        per = batch.per_key()
        per["b"] = (torch.tensor([0, bad]), torch.tensor([1, 1, 0], dtype=torch.int32))
        with pytest.raises(
            ValueError, match=rf"rank 0: table 'b' has 7 rows but id {bad} was looked up"
        ):
            m(JaggedBatch.from_per_key(per))
    per = batch.per_key()
    del per["c"]
    with pytest.raises(ValueError, match="rank 0: the batch has no key 'c'"):
        m(JaggedBatch.from_per_key(per))


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_16bit_gradients_at_training_scale_keep_their_norm(wire: str) -> None:
    """Upstream gradients of a loss divided by a global batch of 65,536 (~1e-7): through an
    fp16 wire they lost 5.6 % of their L2 norm (4 % of entries flushed to 0); fp16 payloads
    now send their gradients as bf16, which keeps fp32's exponent range. Sharded and DP tables."""
    from embark.data.jagged import JaggedBatch
    from embark.sharding import ShardedEmbeddingCollection
    from embark.types import ShardingPlan, TableConfig

    def entry(name: str, rows: int, stype: str, cluster: str, comm: str) -> dict[str, object]:
        return {
            "name": name,
            "num_rows": rows,
            "dim": 64,
            "sharding_type": stype,
            "cluster": cluster,
            "comm_dtype": comm,
            "shards": [{"rank": 0, "row_start": 0, "row_end": rows, "col_start": 0, "col_end": 64}],
        }

    tables = [TableConfig("sh", 1000, 64, 4), TableConfig("dp", 100, 64, 4)]
    g = torch.Generator().manual_seed(0)
    batch = JaggedBatch.from_dense_bags(
        ["sh", "dp"], [torch.randint(0, t.num_rows, (256, 4), generator=g) for t in tables]
    )
    ups = {t.name: torch.randn(256, 64, generator=g) * 0.02 / 65536 for t in tables}
    grads = {}
    for comm in ("fp32", wire):
        plan = ShardingPlan.from_dict(
            {
                "world_size": 1,
                "gpus_per_node": 1,
                "tables": [
                    entry("sh", 1000, "table_wise", "reduction", comm),
                    entry("dp", 100, "data_parallel", "data_parallel", comm),
                ],
            }
        )
        m = ShardedEmbeddingCollection(tables, plan, 0, seed=3)
        out = m(batch)
        sum((out[n] * ups[n]).sum() for n in out).backward()
        m.reduce_dp_gradients()
        grads[comm] = {n: m.weights[n].grad.clone() for n in ("sh", "dp")}
    for n in ("sh", "dp"):
        want, got = grads["fp32"][n], grads[wire][n]
        assert float((got - want).norm() / want.norm()) < 5e-3, n
        # (an entry whose fp32 sum nearly cancels can round to exactly 0: a few, not 4 %)
        assert float(((got == 0) & (want != 0)).float().mean()) < 1e-3, n
