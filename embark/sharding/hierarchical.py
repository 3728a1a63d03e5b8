"""Hierarchical output distribution for the REDUCTION cluster: partial sums are reduced
inside a node before they cross to another node.

Ranks ``n*gpn .. (n+1)*gpn-1`` form node ``n`` (``gpn`` = ``gpus_per_node``). Take one
column block ``b`` of a REDUCTION table and a node ``n``; its *owners* there are the ranks of
node ``n`` holding a row shard of ``b`` (``k`` of them). Every source rank ``r`` gets one
*relay* among those owners: ``r`` itself when ``r`` is an owner, else the owners take the
other sources in turn (in rank order: the ``j``-th non-owner source goes to owner
``j mod k``). Two exchanges replace the flat one:

    stage 1 (node group, intra-node): each owner sends its (B_r, cols) partial for source r
             to r's relay (kept when it is the relay); the relay sums the k partials
    stage 2 (default group): the relay sends the sum to r (kept when r is the relay)

Stage 1 is a reduce-scatter of the node's partials over its owners; stage 2 sends each source
one (B_r, cols) per (block, node). A block with one owner on a node would be sent by that
owner directly (nothing in stage 1): the collection sends such blocks in its flat exchange
and runs these stages only for blocks with ``k >= 2`` somewhere. With an owner on every rank of the node the relay of a
source is the owner with its local index (``rank % gpn``), so stage 2 stays rail-aligned.
These are the bytes the planner's cost model counts (:mod:`embark.planner.cost`): stage 1
moves ``(k-1)/k · B · cols`` per owner, stage 2 one ``b × cols`` per remote source and per
non-owner on the node.

Worked example: 2 nodes × 2 ranks, table ``t`` row-split over ranks 0 and 1 (node 0),
B = 4 on every rank. Non-owner sources 2 and 3 go to owners 0 and 1 in turn::

    flat:    rank 0 --(4, D)--> rank 3      rank 1 --(4, D)--> rank 3     inter: 2 × 4·D
    relays:  r = 0 -> 0, r = 1 -> 1 (owners), r = 2 -> 0, r = 3 -> 1
    stage 1: rank 0 --(4, D)--> rank 1 for r = 1, 3;  rank 1 --> rank 0 for r = 0, 2
             rank 1: p_3 = partial_0 + partial_1                     intra: 4 × 4·D
    stage 2: rank 1 --(4, D)--> rank 3      (inter)                       inter: 1 × 4·D

A node's inter-node bytes for a block shrink by the number of its row shards in that node;
intra-node bytes grow by ``(k-1)/k`` of them (NVLink is ~9× InfiniBand per GPU on a DGX
H100).
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
    """One column block of a REDUCTION table with at least one row shard on a node.

    Args:
        table: table name.
        col_start: first column of the block.
        num_cols: its width.
        wire: wire dtype of its vectors.
        owners: ranks of the node holding a row shard of the block, ascending (``k``).
        relays: ``(world,)`` the relay of every source rank (one of ``owners``).
    """

    table: str
    col_start: int
    num_cols: int
    wire: CommDtype
    owners: tuple[int, ...]
    relays: tuple[int, ...]


def relays_for(owners: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``(world_size,)`` the relay of each source rank: itself when it is one of ``owners``,
    else the owners in turn over the other sources in rank order.

    Raises:
        ValueError: when ``owners`` is empty or names a rank outside ``0 .. world_size-1``.
    """
    own = sorted(set(owners))
    if not own or own[0] < 0 or own[-1] >= world_size:
        raise ValueError(
            f"relays_for: owners must be ranks in 0..{world_size - 1}, got {list(owners)}"
        )
    out, j = [], 0
    for r in range(world_size):
        if r in own:
            out.append(r)
        else:
            out.append(own[j % len(own)])
            j += 1
    return tuple(out)


@dataclass
class NodeGroups:
    """This rank's node group (see the module docstring).

    Args:
        gpus_per_node: ``gpn``.
        num_nodes: number of nodes.
        node_group: process group of this rank's node (group rank = local index).
    """

    gpus_per_node: int
    num_nodes: int
    node_group: Any

    @classmethod
    def create(cls, world_size: int, gpus_per_node: int, rank: int) -> NodeGroups:
        """Create the node groups (a collective on the default group: every rank calls it
        with the same arguments)."""
        nodes = world_size // gpus_per_node
        node_group = None
        for n in range(nodes):
            g = dist.new_group(list(range(n * gpus_per_node, (n + 1) * gpus_per_node)))
            if n == rank // gpus_per_node:
                node_group = g
        return cls(gpus_per_node, nodes, node_group)


def node_blocks(layout: Layout, gpus_per_node: int) -> list[list[BlockRef]]:
    """``blocks[n]``: the (table, column block) pairs with a REDUCTION row shard on node
    ``n``, in table order then column order (both ends of each stage walk this list)."""
    world = layout.world_size
    nodes = world // gpus_per_node
    out: list[list[BlockRef]] = [[] for _ in range(nodes)]
    for name in layout.sharded_tables:
        refs = [r for r in layout.shards_of(name) if r.cluster is Cluster.REDUCTION]
        for n in range(nodes):
            owners: dict[tuple[int, int, CommDtype], set[int]] = {}
            for r in refs:
                if r.shard.rank // gpus_per_node == n:
                    owners.setdefault((r.shard.col_start, r.num_cols, r.wire), set()).add(
                        r.shard.rank
                    )
            for (c0, cols, wire), own in sorted(owners.items(), key=lambda kv: kv[0][0]):
                ranks = tuple(sorted(own))
                out[n].append(BlockRef(name, c0, cols, wire, ranks, relays_for(ranks, world)))
    return out


def relayed_blocks(
    layout: Layout, gpus_per_node: int
) -> tuple[list[list[BlockRef]], frozenset[tuple[str, int, int]]]:
    """The blocks these stages reduce: :func:`node_blocks` with row shards on two or more
    ranks of their node (one owner would send the same bytes in the flat exchange), and
    their ``(table, col_start, node)`` keys."""
    blocks = [[b for b in bs if len(b.owners) > 1] for bs in node_blocks(layout, gpus_per_node)]
    keys = frozenset((b.table, b.col_start, n) for n, bs in enumerate(blocks) for b in bs)
    return blocks, keys


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
        groups: the node groups.
        blocks: :func:`node_blocks`.
        wires: wire dtypes in use (one buffer per dtype in each stage's single exchange).
        stats: byte counter.
        after: tensors whose backward must run after these stages' (earlier exchanges' outputs):
            tied in with zero-size slices, so every rank enters the backward collectives in one
            order.

    Returns:
        ``({(table, col_start): [(B_rank, cols) sum per node holding the block]}, received
        buffers)``; the buffers are to be tied to the outputs
        (:func:`embark.sharding.comm.tie`).
    """
    ctx = _Stages(rank, groups, blocks, batch_sizes, wires, stats)
    sums, got1 = ctx.stage1(_own_partials(answers, owned, rank, ctx.world), after)
    out, got2 = ctx.stage2(sums, got1)
    return out, [*got1, *got2]


def _own_partials(
    answers: Sequence[Sequence[torch.Tensor]],
    owned: Sequence[Sequence[ShardRef]],
    rank: int,
    world: int,
) -> dict[tuple[str, int], list[torch.Tensor]]:
    """This rank's partial of each block it owns, per source (summed over its shards of it)."""
    mine: dict[tuple[str, int], list[torch.Tensor]] = {}
    for k, ref in enumerate(owned[rank]):
        if ref.cluster is Cluster.REDUCTION:
            key = (ref.table, ref.shard.col_start)
            parts = [answers[k][r] for r in range(world)]
            mine[key] = [a + p for a, p in zip(mine[key], parts)] if key in mine else parts
    return mine


def _chained(pieces: list[torch.Tensor], prev: Sequence[torch.Tensor]) -> torch.Tensor:
    """``pieces`` concatenated, with zero-size slices of ``prev`` so that its backward runs
    after theirs (under autograd: a leaf that requires grad when nothing did)."""
    x = torch.cat(pieces) if pieces else torch.zeros(0)
    if not torch.is_grad_enabled():
        return x
    x = torch.cat([x, *[p[:0] for p in prev]])
    return x if x.requires_grad else x.detach().requires_grad_(True)


@dataclass
class _Stages:
    """The two exchanges of one rank, over the blocks of its node (``here``)."""

    rank: int
    groups: NodeGroups
    blocks: Sequence[Sequence[BlockRef]]
    batch_sizes: Sequence[int]
    wires: Sequence[CommDtype]
    stats: CommStats | None

    @property
    def gpn(self) -> int:
        return self.groups.gpus_per_node

    @property
    def world(self) -> int:
        return self.gpn * self.groups.num_nodes

    @property
    def mates(self) -> list[int]:
        node = self.rank // self.gpn
        return [node * self.gpn + j for j in range(self.gpn)]

    @property
    def here(self) -> Sequence[BlockRef]:
        return self.blocks[self.rank // self.gpn]

    def _relayed(self, wire: CommDtype, owner: int, relay: int) -> list[tuple[BlockRef, int]]:
        """``(block, source)`` pairs of ``wire`` that ``owner`` sends to ``relay`` in stage 1."""
        return [
            (b, r)
            for b in self.here
            if b.wire is wire and owner in b.owners
            for r in range(self.world)
            if b.relays[r] == relay
        ]

    def stage1(
        self, mine: dict[tuple[str, int], list[torch.Tensor]], after: Sequence[torch.Tensor]
    ) -> tuple[dict[tuple[str, int, int], torch.Tensor], list[torch.Tensor]]:
        """Owner → relay of each source, inside the node; the relay sums the partials of each
        (block, source) it relays. Returns ``({(table, col_start, source): (B_source, cols)},
        received buffers)``."""
        rank, bs = self.rank, self.batch_sizes
        xs, send, recv = [], [], []
        for wire in self.wires:
            pieces: list[torch.Tensor] = []
            send_g, recv_g = [], []
            for m in self.mates:
                seg = [
                    mine[(b.table, b.col_start)][r].reshape(-1)
                    for b, r in self._relayed(wire, rank, m)
                ]
                pieces += seg
                send_g.append(sum(p.numel() for p in seg))
                recv_g.append(sum(bs[r] * b.num_cols for b, r in self._relayed(wire, m, rank)))
            xs.append(_chained(pieces, after))
            send.append(send_g)
            recv.append(recv_g)
        group = self.groups.node_group
        got = exchange_vectors(
            xs, self.wires, send, recv, group, stats=self.stats, peers=self.mates
        )
        sums: dict[tuple[str, int, int], torch.Tensor] = {}
        for g, wire in enumerate(self.wires):
            for m, chunk in zip(self.mates, got[g].split(recv[g])):
                pairs = self._relayed(wire, m, rank)
                parts = chunk.split([bs[r] * b.num_cols for b, r in pairs])
                for (b, r), v in zip(pairs, parts):
                    key = (b.table, b.col_start, r)
                    v = v.view(bs[r], b.num_cols)
                    sums[key] = sums[key] + v if key in sums else v
        return sums, got

    def stage2(
        self, sums: dict[tuple[str, int, int], torch.Tensor], got1: Sequence[torch.Tensor]
    ) -> tuple[dict[tuple[str, int], list[torch.Tensor]], list[torch.Tensor]]:
        """Relay → source, over the world (peers on this node are intra-node). Returns
        ``({(table, col_start): [(B_rank, cols) per node]}, received buffers)``."""
        rank, gpn, b_me = self.rank, self.gpn, self.batch_sizes[self.rank]
        xs, send, recv = [], [], []
        for wire in self.wires:
            pieces: list[torch.Tensor] = []
            send_g, recv_g = [], []
            for r in range(self.world):
                seg = [
                    sums[(b.table, b.col_start, r)].reshape(-1)
                    for b in self.here
                    if b.wire is wire and b.relays[r] == rank
                ]
                pieces += seg
                send_g.append(sum(p.numel() for p in seg))
                recv_g.append(
                    sum(
                        b_me * b.num_cols
                        for b in self.blocks[r // gpn]
                        if b.wire is wire and b.relays[rank] == r
                    )
                )
            xs.append(_chained(pieces, got1))
            send.append(send_g)
            recv.append(recv_g)
        got = exchange_vectors(xs, self.wires, send, recv, None, stats=self.stats)
        out: dict[tuple[str, int], list[torch.Tensor]] = {}
        for g, wire in enumerate(self.wires):
            for p, chunk in enumerate(got[g].split(recv[g])):
                bs = [b for b in self.blocks[p // gpn] if b.wire is wire and b.relays[rank] == p]
                for b, v in zip(bs, chunk.split([b_me * b.num_cols for b in bs])):
                    out.setdefault((b.table, b.col_start), []).append(v.view(b_me, b.num_cols))
        return out, got
