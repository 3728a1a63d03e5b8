"""Whole tables in and out of a :class:`~embark.sharding.collection.ShardedEmbeddingCollection`:
each rank copies its slices of full tables in, and the full tables are assembled back (for
checking, and for a single-process ``state_dict``). Both cost the size of the whole tables, so
training and checkpoints use neither (``ShardedDLRM.build`` and the sharded checkpoint
readers fill shards directly)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from embark.sharding.comm import distributed_world

if TYPE_CHECKING:
    from embark.sharding.routing import Layout
    from embark.types import Shard


class FullTables:
    """The whole-table methods of the sharded collection (a mixin: it reads the collection's
    ``layout``, ``local_shards``, ``weights``, ``process_group`` and ``rank``)."""

    layout: Layout
    local_shards: dict[str, Shard]
    weights: Any
    process_group: Any | None
    rank: int

    @torch.no_grad()
    def load_full_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's slices of full tables into its shards.

        Args:
            weights: ``{table: (num_rows, dim) float tensor}`` for every table.

        Raises:
            ValueError: naming a missing or mis-shaped table.
        """
        for t in self.layout.tables:
            if t.name not in weights:
                raise ValueError(f"load_full_weights: table {t.name!r} is missing")
            w = weights[t.name]
            if tuple(w.shape) != (t.num_rows, t.dim):
                raise ValueError(
                    f"load_full_weights: table {t.name!r} is {t.num_rows} × {t.dim}, got shape "
                    f"{tuple(w.shape)}"
                )
            s = self.local_shards.get(t.name)
            if s is not None:
                self.weights[t.name].copy_(w[s.row_start : s.row_end, s.col_start : s.col_end])

    @torch.no_grad()
    def full_weights(self, dst: int | None = 0) -> dict[str, torch.Tensor]:
        """Assemble the full tables (a collective: every rank must call it; for checking).

        Args:
            dst: rank that gets the tables; ``None``: every rank.

        Returns:
            ``{table: (num_rows, dim) float32}`` on ``dst`` (or everywhere), ``{}`` elsewhere.
            DP tables are this rank's replica.
        """
        sharded = self.layout.sharded_tables
        sizes = [self.layout.plan[n].num_rows * self.layout.plan[n].dim for n in sharded]
        buf = torch.zeros(sum(sizes))
        pos = 0
        for n, size in zip(sharded, sizes):
            ts = self.layout.plan[n]
            if n in self.local_shards:
                s = self.local_shards[n]
                buf[pos : pos + size].view(ts.num_rows, ts.dim)[
                    s.row_start : s.row_end, s.col_start : s.col_end
                ] = self.weights[n]
            pos += size
        if distributed_world(self.process_group) is not None:
            dist.all_reduce(buf, group=self.process_group)
        if dst is not None and dst != self.rank:
            return {}
        out: dict[str, torch.Tensor] = {}
        pos = 0
        for n, size in zip(sharded, sizes):
            ts = self.layout.plan[n]
            out[n] = buf[pos : pos + size].view(ts.num_rows, ts.dim).clone()
            pos += size
        for n in self.layout.dp_tables:
            out[n] = self.weights[n].detach().clone()
        return {t.name: out[t.name] for t in self.layout.tables}

    # ---------------------------------------------------------- input distribution
