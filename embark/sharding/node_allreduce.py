"""Hierarchical (node-aware) SUM all-reduce of a flat fp32 buffer: reduce inside the node over
the fast link, cross the nodes once per shard, spread the result inside the node again.

Ranks ``n*g .. (n+1)*g-1`` form node ``n`` (``g`` = ranks per node, ``N`` nodes, ``W = N g``);
the *rail* of local index ``i`` is the ranks ``i, g+i, 2g+i, ...`` (one per node). A buffer of
``L`` elements is cut into ``g`` shards of ``S = ceil(L / g)`` (the last padded with zeros)::

    stage 1  node group:  reduce-scatter      rank n*g+i gets shard i summed over node n
    stage 2  rail group:  all-reduce          shard i summed over every node
    stage 3  node group:  all-gather          every rank of the node gets every shard

Bytes per node over its uplink: ``g · 2 (N-1)/N · S ≈ 2 (N-1)/N · L`` against a flat ring's
``2 (W-1)/W · L`` (a ring in rank order crosses each node boundary with the whole ring's
flow), e.g. 2 nodes × 2 ranks: ``L`` against ``1.5 L``. The fast link carries the
reduce-scatter and the all-gather, ``2 (g-1)/g · L`` per rank.

Summation order. Element ``e`` of shard ``i`` is ``Σ_nodes (Σ_{ranks of the node} x_r[e])``:
each node's sum first (gloo's reduce-scatter), then the nodes' sums (gloo's all-reduce). With
2 ranks per node and 2 nodes that is exactly ``(x_0 + x_1) + (x_2 + x_3)`` (float addition is
commutative, so neither collective's internal order matters); in general the order inside a
stage is gloo's. A flat all-reduce adds in another order, so the two agree within float
rounding (exactly on integer-valued inputs). Every rank receives the same bits (stage 3 copies
one result), so replicas stay bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NodeRailGroups:
    """This rank's node group and rail group (see the module docstring).

    Args:
        gpus_per_node: ``g``, ranks per node.
        num_nodes: ``N``.
        node_group: the ranks of this rank's node (group rank = local index).
        rail_group: the ranks of this rank's local index, one per node (group rank = node).
    """

    gpus_per_node: int
    num_nodes: int
    node_group: Any
    rail_group: Any

    @classmethod
    def create(cls, world_size: int, gpus_per_node: int, rank: int) -> NodeRailGroups:
        """Create every node group, then every rail group (a collective on the default group:
        every rank calls it with the same arguments, so the groups are made in one order).

        Only gloo is supported: the buckets run these groups' collectives on a worker thread
        while the main thread runs the default group's, in an order that differs between
        ranks, which gloo's per-group transport tolerates; NCCL collectives issued from two
        threads on different communicators in rank-dependent order can deadlock, and the
        worker thread does not set the CUDA device.

        Raises:
            ValueError: when ``gpus_per_node`` does not divide ``world_size`` or ``rank`` is
                outside ``0 .. world_size-1``, or the default group's backend is not gloo.
        """
        if gpus_per_node < 1 or world_size % gpus_per_node:
            raise ValueError(
                f"NodeRailGroups: gpus_per_node must divide world_size {world_size}, "
                f"got {gpus_per_node}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"NodeRailGroups: rank must be in 0..{world_size - 1}, got {rank}")
        backend = str(dist.get_backend())
        if backend != dist.Backend.GLOO:
            raise ValueError(
                f"NodeRailGroups: the hierarchical all-reduce runs on gloo only, the default "
                f"process group's backend is {backend!r} (use GradReduce.FLAT there)"
            )
        nodes = world_size // gpus_per_node
        node_group = rail_group = None
        for n in range(nodes):
            g = dist.new_group(list(range(n * gpus_per_node, (n + 1) * gpus_per_node)))
            if n == rank // gpus_per_node:
                node_group = g
        for i in range(gpus_per_node):
            g = dist.new_group(list(range(i, world_size, gpus_per_node)))
            if i == rank % gpus_per_node:
                rail_group = g
        return cls(gpus_per_node, nodes, node_group, rail_group)


@dataclass
class HierarchicalAllReduce:
    """The hierarchical SUM all-reduce over :class:`NodeRailGroups` (blocking; call it from
    one thread at a time, every rank with buffers of the same sizes in the same order).

    A buffer whose length ``g`` does not divide is reduced through a zero-padded copy; the
    padded copies and the shards are kept per length and reused on every call.
    """

    groups: NodeRailGroups
    _scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @torch.no_grad()
    def __call__(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over every rank, in place.

        Args:
            flat: ``(L,)`` contiguous fp32 (any floating dtype), equal length on every rank.

        Raises:
            ValueError: when ``flat`` is not a contiguous 1-d tensor.
        """
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"HierarchicalAllReduce: expected a contiguous 1-d buffer, got shape "
                f"{tuple(flat.shape)} (contiguous: {flat.is_contiguous()})"
            )
        g = self.groups.gpus_per_node
        n = flat.numel()
        whole, shard = self._buffers(flat, n, g)
        if whole.data_ptr() != flat.data_ptr():
            whole[:n].copy_(flat)
        if g > 1:
            dist.reduce_scatter_tensor(shard, whole, group=self.groups.node_group)
        if self.groups.num_nodes > 1:
            dist.all_reduce(shard, group=self.groups.rail_group)
        if g > 1:
            dist.all_gather_single(whole, shard, group=self.groups.node_group)
        if whole.data_ptr() != flat.data_ptr():
            flat.copy_(whole[:n])

    def _buffers(self, flat: torch.Tensor, n: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(whole, shard)``: ``flat`` itself when ``g`` divides ``n`` (else a zero-padded
        copy of ``g · S``), and the ``(S,)`` shard of this rank; ``shard`` is ``whole`` when
        ``g == 1`` (nothing to scatter)."""
        if g == 1:
            return flat, flat
        s = -(-n // g)
        kept = self._scratch.get(n)
        if kept is None or kept[1].dtype != flat.dtype:
            padded = flat.new_zeros(s * g if s * g != n else 0)
            kept = (padded, flat.new_empty(s))
            self._scratch[n] = kept
        padded, shard = kept
        return (flat if s * g == n else padded), shard
