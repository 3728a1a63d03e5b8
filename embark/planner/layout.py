"""Building table layouts: even row and column splits, naming a layout's sharding type.

A layout is given as a grid: one list of ranks per column block; the ranks of a block split
its rows evenly in order. ``grid=[[0, 1], [2, 3]]`` on a 1000 × 128 table::

                 cols 0:64     cols 64:128
        rows   0:500  rank 0       rank 2
        rows 500:1000 rank 1       rank 3
"""

from __future__ import annotations

from collections.abc import Sequence

from embark.types import Cluster, CommDtype, Shard, ShardingType, TableConfig, TableSharding


def even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``0:total``; the first ``total % parts`` get one
    more element. ``even_splits(10, 3) == [(0, 4), (4, 7), (7, 10)]``."""
    if parts < 1 or parts > total:
        raise ValueError(f"cannot split {total} into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def classify(
    grid: Sequence[Sequence[int]], world_size: int, gpus_per_node: int, cluster: Cluster
) -> ShardingType:
    """The most specific :class:`ShardingType` naming a grid layout."""
    if cluster is Cluster.DP:
        return ShardingType.DP
    n_blocks = len(grid)
    k = {len(b) for b in grid}
    ranks = {r for b in grid for r in b}
    if k == {1}:
        return ShardingType.TW if n_blocks == 1 else ShardingType.CW
    if n_blocks == 1:
        if len(ranks) == world_size:
            return ShardingType.RW
        if len({r // gpus_per_node for r in ranks}) == 1:
            return ShardingType.TRW
    return ShardingType.THREE_D


def make_sharding(
    table: TableConfig,
    grid: Sequence[Sequence[int]],
    cluster: Cluster,
    comm_dtype: CommDtype,
    world_size: int,
    gpus_per_node: int,
) -> TableSharding:
    """A :class:`TableSharding` for ``table`` laid out as ``grid`` (see module docstring).
    For ``Cluster.DP`` the grid is ignored and the table is replicated on every rank."""
    if cluster is Cluster.DP:
        shards = tuple(Shard(r, 0, table.num_rows, 0, table.dim) for r in range(world_size))
        return TableSharding(
            table.name, table.num_rows, table.dim, ShardingType.DP, cluster, shards, comm_dtype
        )
    pieces: list[Shard] = []
    for (c0, c1), ranks in zip(even_splits(table.dim, len(grid)), grid):
        for (r0, r1), rank in zip(even_splits(table.num_rows, len(ranks)), ranks):
            pieces.append(Shard(rank, r0, r1, c0, c1))
    st = classify(grid, world_size, gpus_per_node, cluster)
    return TableSharding(
        table.name, table.num_rows, table.dim, st, cluster, tuple(pieces), comm_dtype
    )


def grid_of(ts: TableSharding) -> list[list[int]]:
    """The ranks of each column block of ``ts`` in row order (inverse of :func:`make_sharding`)."""
    out = []
    for c0, _ in ts.column_blocks:
        out.append(
            [s.rank for s in sorted(ts.shards, key=lambda s: s.row_start) if s.col_start == c0]
        )
    return out
