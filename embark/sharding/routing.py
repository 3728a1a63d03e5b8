"""Who owns what, and where each key of a batch goes: the pure (no communication) half of the
sharding runtime.

A :class:`Layout` fixes, from the plan, the canonical order in which every rank lists the
shards that rank ``o`` owns (``owned[o]``: tables in collection order, one shard per table
at most, since a rank never holds two shards of one table). Both ends of every exchange walk
that same list, so segment sizes are the only thing sent at run time.

Worked example: ``t0`` RW on 2 ranks (rows 0:4 on rank 0, 4:8 on rank 1), ``t1`` CW (cols
0:2 on rank 0, 2:4 on rank 1); rank 0's local batch, B = 2::

                 sample 0     sample 1
    "t0"         [1, 5]       [5, 5, 7]
    "t1"         [3]          [ ]

    owned[0] = [t0 rows 0:4, t1 cols 0:2]      owned[1] = [t0 rows 4:8, t1 cols 2:4]

    route_keys(t0): shard on rank 0  rows [1]        samples [0]   (local rows = id - 0)
                    shard on rank 1  rows [1, 1, 1, 3]  samples [0, 1, 1, 1]   (id - 4)
    route_keys(t1): every key to both column blocks: rows [3], samples [0] for each

    REDUCTION segment to rank 1 for t0: [lengths per sample | rows] = [1, 3 | 1, 1, 1, 3]
    UNIQUE    segment to rank 1 for t0: distinct rows [1, 3], inverse [0, 0, 0, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from embark.types import Cluster, CommDtype, Shard, ShardingPlan, ShardingType, TableConfig


@dataclass(frozen=True)
class ShardRef:
    """One shard of one table of the collection, as listed in :attr:`Layout.owned`.

    Args:
        table: table name.
        table_index: position of the table in the collection.
        shard: the rectangle (rank, rows, cols).
        cluster: ``REDUCTION`` or ``UNIQUE``.
        wire: dtype of its vectors on the wire.
    """

    table: str
    table_index: int
    shard: Shard
    cluster: Cluster
    wire: CommDtype

    @property
    def num_cols(self) -> int:
        return self.shard.num_cols


@dataclass(frozen=True)
class Layout:
    """The plan seen by the runtime.

    Args:
        tables: the collection's tables (this order is the canonical table order).
        plan: the sharding plan (already checked against ``tables``).
        comm_dtype: when set, overrides every table's wire dtype.
    """

    tables: tuple[TableConfig, ...]
    plan: ShardingPlan
    comm_dtype: CommDtype | None = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def wire(self, name: str) -> CommDtype:
        """Wire dtype of table ``name``."""
        return self.comm_dtype if self.comm_dtype is not None else self.plan[name].comm_dtype

    def is_dp(self, name: str) -> bool:
        return self.plan[name].sharding_type is ShardingType.DP

    @cached_property
    def dp_tables(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables if self.is_dp(t.name))

    @cached_property
    def sharded_tables(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables if not self.is_dp(t.name))

    @cached_property
    def owned(self) -> tuple[tuple[ShardRef, ...], ...]:
        """``owned[o]``: the non-DP shards rank ``o`` holds, in table order."""
        per_rank: list[list[ShardRef]] = [[] for _ in range(self.world_size)]
        for i, t in enumerate(self.tables):
            ts = self.plan[t.name]
            if ts.sharding_type is ShardingType.DP:
                continue
            for s in ts.shards:
                per_rank[s.rank].append(ShardRef(t.name, i, s, ts.cluster, self.wire(t.name)))
        return tuple(tuple(refs) for refs in per_rank)

    def shards_of(self, name: str) -> tuple[ShardRef, ...]:
        """Every shard of table ``name``, sorted by (col_start, row_start)."""
        refs = [r for rank_refs in self.owned for r in rank_refs if r.table == name]
        return tuple(sorted(refs, key=lambda r: (r.shard.col_start, r.shard.row_start)))

    @cached_property
    def wires_in_use(self) -> tuple[CommDtype, ...]:
        """Wire dtypes of the sharded tables, in :class:`CommDtype` order (every rank walks
        the same tuple; the vectors of all of them travel packed in one exchange)."""
        used = {self.wire(n) for n in self.sharded_tables}
        return tuple(d for d in CommDtype if d in used)

    def local_shard(self, name: str, rank: int) -> Shard | None:
        """The shard (or DP replica) of ``name`` on ``rank``, ``None`` when it holds none."""
        for s in self.plan[name].shards:
            if s.rank == rank:
                return s
        return None


def sample_ids(lengths: torch.Tensor) -> torch.Tensor:
    """``(nnz,) int64`` the sample of each id, from ``lengths: (B,) int32`` bag sizes."""
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), dtype=torch.int64, device=lengths.device),
        lengths.to(torch.int64),
    )


def route_keys(
    values: torch.Tensor, samples: torch.Tensor, shards: Sequence[Shard]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Send each id of one table to the shards whose row range holds it.

    Args:
        values: ``(nnz,) int64`` ids of the table, in range, sample-major.
        samples: ``(nnz,) int64`` the sample of each id (:func:`sample_ids`).
        shards: every shard of the table.

    Returns:
        per shard, in ``shards`` order: ``(rows (n,) int64, samples (n,) int64)`` with ``rows``
        re-based to the shard (``id - row_start``), sample order kept (so a shard's ids of one
        sample are contiguous). An id is sent once per column block.
    """
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(shards)
    blocks: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(shards):
        blocks.setdefault((s.col_start, s.col_end), []).append(i)
    for idx in blocks.values():
        idx = sorted(idx, key=lambda i: shards[i].row_start)
        if len(idx) == 1:
            s = shards[idx[0]]
            out[idx[0]] = (values - s.row_start, samples)
            continue
        starts = torch.tensor([shards[i].row_start for i in idx], dtype=torch.int64)
        which = torch.searchsorted(starts, values, right=True) - 1
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=len(idx)).tolist()
        rows_sorted, samples_sorted = values[order], samples[order]
        pos = 0
        for j, n in zip(idx, counts):
            s = shards[j]
            out[j] = (rows_sorted[pos : pos + n] - s.row_start, samples_sorted[pos : pos + n])
            pos += n
    return [o for o in out if o is not None]


def bag_lengths(samples: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``(B,) int64`` how many of a shard's ids each sample has."""
    return torch.bincount(samples, minlength=batch_size)


def check_ids(
    tables: Sequence[TableConfig], values: Sequence[torch.Tensor]
) -> tuple[int, int, int] | None:
    """First out-of-range id: ``(table_index, id, num_rows)``, or ``None`` when all are valid.

    One ``aminmax`` per table and one device-to-host copy for all of them.
    """
    filled = [(i, v) for i, v in enumerate(values) if v.numel()]
    if not filled:
        return None
    bounds = torch.stack([torch.stack(torch.aminmax(v)) for _, v in filled]).tolist()
    for (i, _), (lo, hi) in zip(filled, bounds):
        rows = tables[i].num_rows
        if lo < 0 or hi >= rows:
            return i, (hi if hi >= rows else lo), rows
    return None
