"""Hierarchical output distribution for the REDUCTION cluster: partial sums are reduced
inside a node before they cross to another node.

Ranks ``n*gpn .. (n+1)*gpn-1`` form node ``n`` (``gpn`` = ``gpus_per_node``); a rank's
*local index* is ``rank % gpn``. Two kinds of subgroups: the *node group* (one per node) and
the *rail group* (one per local index: the ranks with that index on every node). For a
source rank ``r``, the *relay* of node ``n`` is the rank of node ``n`` with ``r``'s local
index. Two exchanges replace the flat one:

    stage 1 (node group, intra-node): each owner sends its (B_r, cols) partial for source r
             to node n's relay of r; the relay sums the partials of one (table, column block)
    stage 2 (rail group, inter-node): the relay sends one (B_r, cols) per (table, block)
             to r (a self-send when r is the relay, i.e. r sits on node n)

Worked example: 2 nodes × 2 ranks, table ``t`` row-split over ranks 0 and 1 (node 0), B = 4
on rank 3 (local index 1, so its relay on node 0 is rank 1)::

    flat:    rank 0 --(4, D)--> rank 3      rank 1 --(4, D)--> rank 3     inter: 2 × 4·D
    stage 1: rank 0 --(4, D)--> rank 1      (intra)
             rank 1: p = partial_0 + partial_1
    stage 2: rank 1 --(4, D)--> rank 3      (inter)                       inter: 1 × 4·D

A node's inter-node bytes for a block shrink by the number of its row shards in that node;
intra-node bytes grow by as much (NVLink is ~9× InfiniBand per GPU on a DGX H100).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from embark.sharding.comm import CommStats, exchange_vectors
from embark.sharding.routing import Layout, ShardRef
from embark.types import Cluster, CommDtype


@dataclass(frozen=True)
class BlockRef:
    """One column block of a REDUCTION table with at least one row shard on a node."""

    table: str
    col_start: int
    num_cols: int
    wire: CommDtype


@dataclass
class NodeGroups:
    """This rank's node group and rail group (see the module docstring).

    Args:
        gpus_per_node: ``gpn``.
        num_nodes: number of nodes.
        node_group: process group of this rank's node (group rank = local index).
        rail_group: process group of this rank's local index (group rank = node).
    """

    gpus_per_node: int
    num_nodes: int
    node_group: Any
    rail_group: Any

    @classmethod
    def create(cls, world_size: int, gpus_per_node: int, rank: int) -> NodeGroups:
        """Create the subgroups (a collective on the default group: every rank calls it with
        the same arguments)."""
        nodes = world_size // gpus_per_node
        node_group = rail_group = None
        for n in range(nodes):
            g = dist.new_group(list(range(n * gpus_per_node, (n + 1) * gpus_per_node)))
            if n == rank // gpus_per_node:
                node_group = g
        for lo in range(gpus_per_node):
            g = dist.new_group([n * gpus_per_node + lo for n in range(nodes)])
            if lo == rank % gpus_per_node:
                rail_group = g
        return cls(gpus_per_node, nodes, node_group, rail_group)


def node_blocks(layout: Layout, gpus_per_node: int) -> list[list[BlockRef]]:
    """``blocks[n]``: the (table, column block) pairs with a REDUCTION row shard on node
    ``n``, in table order then column order (both ends of stage 2 walk this list)."""
    nodes = layout.world_size // gpus_per_node
    out: list[list[BlockRef]] = [[] for _ in range(nodes)]
    for name in layout.sharded_tables:
        refs = [r for r in layout.shards_of(name) if r.cluster is Cluster.REDUCTION]
        for n in range(nodes):
            seen: list[BlockRef] = []
            for r in refs:
                if r.shard.rank // gpus_per_node == n:
                    b = BlockRef(name, r.shard.col_start, r.num_cols, r.wire)
                    if b not in seen:
                        seen.append(b)
            out[n] += sorted(seen, key=lambda b: b.col_start)
    return out


def reduce_hierarchically(
    answers: Sequence[Sequence[torch.Tensor]],
    owned: Sequence[Sequence[ShardRef]],
    rank: int,
    batch_sizes: Sequence[int],
    groups: NodeGroups,
    blocks: Sequence[Sequence[BlockRef]],
    wires: Sequence[CommDtype],
    stats: CommStats | None,
    after: Sequence[torch.Tensor] = (),
) -> tuple[dict[tuple[str, int], list[torch.Tensor]], list[torch.Tensor]]:
    """Stages 1 and 2 for every REDUCTION shard.

    Args:
        answers: ``answers[k][r]``: ``(B_r, cols)`` partial of ``owned[rank][k]`` for source
            ``r`` (entries of UNIQUE shards are ignored).
        owned: :attr:`Layout.owned`.
        rank: this rank.
        batch_sizes: ``(world,)`` every source's ``B``.
        groups: the subgroups.
        blocks: :func:`node_blocks`.
        wires: wire dtypes in use (one buffer per dtype in each stage's single exchange).
        stats: byte counter.
        after: tensors whose backward must run after these stages' (earlier exchanges' outputs):
            tied in with zero-size slices, so every rank enters the backward collectives in one
            order.

    Returns:
        ``({(table, col_start): [(B_rank, cols) partial per node]}, received buffers)``; the
        buffers are to be tied to the outputs (:func:`embark.sharding.comm.tie`).
    """
    gpn, nodes = groups.gpus_per_node, groups.num_nodes
    node, local = rank // gpn, rank % gpn
    world = gpn * nodes
    by_local = [[r for r in range(world) if r % gpn == lo] for lo in range(gpn)]
    mates = [node * gpn + j for j in range(gpn)]

    def red(o: int, wire: CommDtype) -> list[tuple[int, ShardRef]]:
        return [(k, ref) for k, ref in enumerate(owned[o])
                if ref.cluster is Cluster.REDUCTION and ref.wire is wire]

    def chained(x: torch.Tensor, prev: Sequence[torch.Tensor]) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return x
        x = torch.cat([x, *[p[:0] for p in prev]])
        return x if x.requires_grad else x.detach().requires_grad_(True)

    # stage 1: owner -> relay of each source, inside the node
    xs, send, recv = [], [], []
    for wire in wires:
        pieces, send_g = [], []
        for j in range(gpn):
            mine = [answers[k][r].reshape(-1) for r in by_local[j] for k, _ in red(rank, wire)]
            pieces += mine
            send_g.append(sum(p.numel() for p in mine))
        recv_g = [sum(batch_sizes[r] * ref.num_cols for r in by_local[local] for _, ref in red(m, wire))
                  for m in mates]
        xs.append(chained(torch.cat(pieces) if pieces else torch.zeros(0), after))
        send.append(send_g)
        recv.append(recv_g)
    got1 = exchange_vectors(xs, wires, send, recv, groups.node_group, stats=stats, peers=mates)
    # relay: sum the partials of each (table, block) for each source of my local index
    sums: dict[tuple[int, str, int], torch.Tensor] = {}
    for g, wire in enumerate(wires):
        for m, chunk in zip(mates, got1[g].split(recv[g])):
            sizes = [(r, ref) for r in by_local[local] for _, ref in red(m, wire)]
            parts = chunk.split([batch_sizes[r] * ref.num_cols for r, ref in sizes])
            for (r, ref), v in zip(sizes, parts):
                key = (r, ref.table, ref.shard.col_start)
                v = v.view(batch_sizes[r], ref.num_cols)
                sums[key] = sums[key] + v if key in sums else v
    # stage 2: relay -> source, across nodes (same local index)
    rail = [n * gpn + local for n in range(nodes)]
    xs, send, recv = [], [], []
    for wire in wires:
        pieces, send_g = [], []
        for r in rail:
            mine = [sums[(r, b.table, b.col_start)].reshape(-1) for b in blocks[node] if b.wire is wire]
            pieces += mine
            send_g.append(sum(p.numel() for p in mine))
        recv_g = [sum(batch_sizes[rank] * b.num_cols for b in blocks[n] if b.wire is wire)
                  for n in range(nodes)]
        xs.append(chained(torch.cat(pieces) if pieces else torch.zeros(0), got1))
        send.append(send_g)
        recv.append(recv_g)
    got2 = exchange_vectors(xs, wires, send, recv, groups.rail_group, stats=stats, peers=rail)
    out: dict[tuple[str, int], list[torch.Tensor]] = {}
    for g, wire in enumerate(wires):
        for n, chunk in enumerate(got2[g].split(recv[g])):
            bs = [b for b in blocks[n] if b.wire is wire]
            for b, v in zip(bs, chunk.split([batch_sizes[rank] * b.num_cols for b in bs])):
                out.setdefault((b.table, b.col_start), []).append(v.view(batch_sizes[rank], b.num_cols))
    return out, [*got1, *got2]
