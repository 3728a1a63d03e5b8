"""TorchRec's ``ShardingPlan`` ⇄ embark's :class:`~embark.types.ShardingPlan`.

TorchRec gives, per module path and table, a ``ParameterSharding``: a sharding type, a compute
kernel, the ranks, and (except data parallel) an ``EnumerableShardingSpec`` of
``ShardMetadata(shard_offsets=[row, col], shard_sizes=[rows, cols], placement="rank:r/cuda:i")``.
Ours gives, per table, :class:`~embark.types.Shard` rectangles ``rows r0:r1 × cols c0:c1`` on a
rank, a cluster and a wire dtype. Worked example, a 5-row table row-wise over 4 ranks
(TorchRec's ceil split leaves rank 3 an empty shard, which ours does not hold)::

    TorchRec row_wise, ranks [0, 1, 2, 3]         ours (type 3d: rank 3 holds nothing)
    offsets [0,0] sizes [2,64] rank:0/cuda:0      Shard(rank 0, rows 0:2, cols 0:64)
    offsets [2,0] sizes [2,64] rank:1/cuda:1      Shard(rank 1, rows 2:4, cols 0:64)
    offsets [4,0] sizes [1,64] rank:2/cuda:0      Shard(rank 2, rows 4:5, cols 0:64)
    offsets [5,0] sizes [0,64] rank:3/cuda:1

Going back, a row split whose rows follow TorchRec's ceil split over the world (or over one
node) from the first rank on is ``row_wise`` (``table_row_wise``) again, with the empty shards
put back, so a plan of TorchRec's planner comes back equal. What ours cannot hold: the compute
kernel (given back as ``fused``, ``dense`` for data parallel) and two adjacent column shards of
one table on one rank (ours merges them into one shard: the same placement, one shard fewer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from embark.planner.layout import classify, grid_of
from embark.types import (
    Cluster,
    CommDtype,
    PlanError,
    Shard,
    ShardingPlan,
    ShardingType,
    TableConfig,
    TableSharding,
)

__all__ = ["plan_from_torchrec", "plan_to_torchrec"]

# TorchRec's sharding type names (torchrec.distributed.types.ShardingType values) and ours.
_FROM_TORCHREC = {
    "data_parallel": ShardingType.DP,
    "table_wise": ShardingType.TW,
    "column_wise": ShardingType.CW,
    "table_column_wise": ShardingType.CW,
    "row_wise": ShardingType.RW,
    "table_row_wise": ShardingType.TRW,
    "grid_shard": ShardingType.THREE_D,
}


def _module_plan(tr_plan: Any, module_path: str | None) -> Any:
    plans = tr_plan.plan
    if module_path is None:
        if len(plans) != 1:
            raise ValueError(
                f"the TorchRec plan has modules {sorted(plans)}; pass module_path= to pick one"
            )
        return next(iter(plans.values()))
    if module_path not in plans:
        raise ValueError(f"module_path {module_path!r} is not in the plan's {sorted(plans)}")
    return plans[module_path]


def plan_from_torchrec(
    tr_plan: Any,
    tables: Sequence[TableConfig],
    world_size: int,
    gpus_per_node: int,
    comm_dtype: CommDtype = CommDtype.FP32,
    module_path: str | None = None,
    topology: str = "",
) -> ShardingPlan:
    """Our plan for the tables of one module of a TorchRec ``ShardingPlan``.

    Args:
        tr_plan: ``torchrec.distributed.types.ShardingPlan`` (e.g. from
            ``EmbeddingShardingPlanner.plan``).
        tables: the module's tables (shapes; a data-parallel entry has no shard spec).
        world_size: ranks of the plan.
        gpus_per_node: ranks per node.
        comm_dtype: wire dtype of every sharded table (TorchRec's plan does not say).
        module_path: the module's path in ``tr_plan.plan`` (``None``: the only one).
        topology: our plan's topology name.

    Returns:
        a validated :class:`ShardingPlan`: data-parallel tables in cluster ``DP``, the others in
        ``REDUCTION`` (TorchRec pools before sending); empty shards dropped, adjacent column
        shards of one rank merged; each table's type TorchRec's when ours allows that layout,
        else the most specific name of its grid.

    Raises:
        ValueError: an unknown module path, a table missing from the plan or a shard that lies
            outside its table (naming them); :class:`PlanError` for an invalid result.
    """
    params = _module_plan(tr_plan, module_path)
    missing = [t.name for t in tables if t.name not in params]
    if missing:
        raise ValueError(f"tables {missing} are not in the TorchRec plan (it has {list(params)})")
    out = [
        _table_from_torchrec(t, params[t.name], world_size, gpus_per_node, comm_dtype)
        for t in tables
    ]
    return ShardingPlan(world_size, gpus_per_node, tuple(out), topology)


def _table_from_torchrec(
    t: TableConfig, ps: Any, world_size: int, gpus_per_node: int, dtype: CommDtype
) -> TableSharding:
    kind = str(ps.sharding_type)
    if kind not in _FROM_TORCHREC:
        raise PlanError(f"table {t.name!r}: TorchRec sharding type {kind!r} has no embark layout")
    if _FROM_TORCHREC[kind] is ShardingType.DP:
        shards = tuple(Shard(r, 0, t.num_rows, 0, t.dim) for r in range(world_size))
        return TableSharding(t.name, t.num_rows, t.dim, ShardingType.DP, Cluster.DP, shards, dtype)
    raw = []
    for md in ps.sharding_spec.shards:
        (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
        if nr == 0 or nc == 0:
            continue
        if r0 + nr > t.num_rows or c0 + nc > t.dim:
            raise ValueError(
                f"table {t.name!r}: TorchRec shard rows {r0}:{r0 + nr}, cols {c0}:{c0 + nc} lies "
                f"outside the table ({t.num_rows} rows × {t.dim} cols)"
            )
        raw.append(Shard(md.placement.rank(), r0, r0 + nr, c0, c0 + nc))
    shards = tuple(_merge_same_rank(raw))
    wanted = _FROM_TORCHREC[kind]
    try:
        ts = TableSharding(t.name, t.num_rows, t.dim, wanted, Cluster.REDUCTION, shards, dtype)
        ShardingPlan(world_size, gpus_per_node, (ts,))  # the plan-level rules of that type
        return ts
    except PlanError:
        pass  # e.g. row_wise with empty shards: not every rank holds rows
    grid = TableSharding(
        t.name, t.num_rows, t.dim, ShardingType.THREE_D, Cluster.REDUCTION, shards, dtype
    )
    st = classify(grid_of(grid), world_size, gpus_per_node, Cluster.REDUCTION)
    return TableSharding(t.name, t.num_rows, t.dim, st, Cluster.REDUCTION, shards, dtype)


def _merge_same_rank(shards: list[Shard]) -> list[Shard]:
    """TorchRec may put adjacent column shards of one table on one rank; ours holds one."""
    shards = sorted(shards, key=lambda s: (s.rank, s.row_start, s.col_start))
    out: list[Shard] = []
    for s in shards:
        p = out[-1] if out else None
        if (
            p
            and p.rank == s.rank
            and (p.row_start, p.row_end) == (s.row_start, s.row_end)
            and p.col_end == s.col_start
        ):
            out[-1] = Shard(p.rank, p.row_start, p.row_end, p.col_start, s.col_end)
        else:
            out.append(s)
    return out


def _ceil_split(num_rows: int, parts: int) -> list[int]:
    """TorchRec's row split (``_calculate_rw_shard_sizes_and_offsets``): ``ceil(rows/parts)``
    rows per rank, the remainder on the next, zero after (5 rows, 4 ranks: 2, 2, 1, 0)."""
    block = math.ceil(num_rows / parts)
    return [max(0, min(block, num_rows - i * block)) for i in range(parts)]


def _row_group(ts: TableSharding, world_size: int, gpus_per_node: int) -> tuple[str, list[int]]:
    """TorchRec's name and rank group of a one-column-block row split, or ``("", [])``.

    The group is the world (``row_wise``) or the node of the first shard (``table_row_wise``);
    our type picks which is tried first. It matches when the shards, in row order, sit on the
    group's first ranks in order with TorchRec's ceil split of the rows.
    """
    if len(ts.column_blocks) != 1:
        return "", []
    shards = sorted(ts.shards, key=lambda s: s.row_start)
    node = shards[0].rank // gpus_per_node
    world = ("row_wise", list(range(world_size)))
    local = ("table_row_wise", list(range(node * gpus_per_node, (node + 1) * gpus_per_node)))
    order = [local, world] if ts.sharding_type is ShardingType.TRW else [world, local]
    for name, group in order:
        sizes = _ceil_split(ts.num_rows, len(group))
        n = len(shards)
        if (
            [s.rank for s in shards] == group[:n]
            and [s.num_rows for s in shards] == sizes[:n]
            and not any(sizes[n:])
        ):
            return name, group
    return "", []


def plan_to_torchrec(
    plan: ShardingPlan,
    module_path: str = "",
    compute_kernel: str = "fused",
    device: str = "cuda",
) -> Any:
    """A TorchRec ``ShardingPlan`` placing ``plan`` 's tables in the module at ``module_path``
    (``""``: the ``EmbeddingBagCollection`` itself). Needs torchrec.

    Types: DP → ``data_parallel`` (kernel ``dense``, no spec); TW → ``table_wise``; CW →
    ``column_wise``; a row split following TorchRec's ceil split over the world / one node →
    ``row_wise`` / ``table_row_wise`` with its empty shards; any other layout →
    ``grid_shard``. Placements read ``rank:<r>/<device>:<r % gpus_per_node>``.

    Raises:
        ImportError: when torchrec is not importable.
    """
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        ParameterSharding,
    )
    from torchrec.distributed.types import ShardingPlan as TRShardingPlan

    def placement(rank: int) -> str:
        return f"rank:{rank}/{device}:{rank % plan.gpus_per_node}"

    params: dict[str, Any] = {}
    for ts in plan.tables:
        if ts.sharding_type is ShardingType.DP:
            params[ts.name] = ParameterSharding(
                "data_parallel", "dense", list(range(plan.world_size)), None
            )
            continue
        name, group = _row_group(ts, plan.world_size, plan.gpus_per_node)
        if name:
            shards, row = [], 0
            for rank, rows in zip(group, _ceil_split(ts.num_rows, len(group))):
                shards.append(ShardMetadata([row, 0], [rows, ts.dim], placement(rank)))
                row += rows
            ranks = group
        else:
            name = {ShardingType.TW: "table_wise", ShardingType.CW: "column_wise"}.get(
                ts.sharding_type, "grid_shard"
            )
            ordered = sorted(ts.shards, key=lambda s: (s.col_start, s.row_start))
            shards = [
                ShardMetadata(
                    [s.row_start, s.col_start], [s.num_rows, s.num_cols], placement(s.rank)
                )
                for s in ordered
            ]
            ranks = [s.rank for s in ordered]
        params[ts.name] = ParameterSharding(
            name, compute_kernel, ranks, EnumerableShardingSpec(shards)
        )
    return TRShardingPlan({module_path: EmbeddingModuleShardingPlan(params)})
