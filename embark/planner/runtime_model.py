"""Step time of a plan on ``embark.sharding``'s gloo runtime, phase by phase, for a topology
whose figures were measured on the target (a calibration: every efficiency 1).

:func:`~embark.planner.simulator.simulate` rates the embedding part of a step on a
NVLink/InfiniBand cluster. A CPU rank of the gloo runtime also pays for what a GPU hides:

* **per-table bookkeeping**: every table a rank splits keys for, looks up, pools or
  assembles costs a few small tensor ops (Python, dispatch, tiny copies) whatever its bytes;
  on a loaded 2-core host one such op takes tens of microseconds. :class:`HostRates` carries
  the probe's seconds per small op; ``OPS_PER_*`` say how many each phase spends per item
  (counted from the runtime's code path, see each constant).
* **the dense all-reduce**: the dense part's and the DP replicas' gradients are summed in
  buckets started during the dense backward (:func:`allreduce_seconds`; every bucket pays
  its collectives' latencies, :func:`~embark.types.grad_bucket_bytes`): node by node
  (:class:`~embark.types.GradReduce` ``HIERARCHICAL``, the runtime's choice on 2+ nodes of 2+
  ranks: the node uplink carries ``2 (N-1)/N`` of the bytes, as the planner's cost model rates
  DP replicas) or in one flat ring (``FLAT``: TorchRec's DDP, or our runtime told so; a ring
  in rank order carries ``2 (W-1)/W`` over each node boundary); gloo's transport needs CPU,
  which the backward holds, so only :data:`ALLREDUCE_OVERLAP` of the backward hides it.
* **the optimizer step** over the dense part and the DP replicas (bytes / the probe's
  optimizer rate); sharded tables update inside the backward (fused).

The result has the keys of :class:`~embark.sharding.phases.Phase` so that it lines up with a
:class:`~embark.sharding.phases.PhaseClock`'s measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embark.planner.cost import NUM_CHANNELS, CostModel
from embark.planner.simulator import check_plan
from embark.types import (
    Cluster,
    GradReduce,
    ShardingPlan,
    TableSharding,
    Topology,
    grad_bucket_bytes,
)

# Fitted once (non-negative least squares per phase) on the batch-512 runs of DLRM-DCNv2, t200
# and t180 on the emulated cluster (benchmarks/embark/bench_cluster.py; docs/benchmarks.md),
# then held fixed and checked on t510 and batch 4096; OPS_PER_LOOKUP and ALLREDUCE_OVERLAP are
# set by hand. Bookkeeping, in small ops (:attr:`HostRates.small_op_s`):
OPS_PER_INPUT_SPLIT = 16.0  # per (sharded table, shard): length counts, masks, the splits' sizes
OPS_PER_ID = 0.003  # per key routed (copies into the send buffer)
OPS_PER_ROW_SPLIT_ID = 0.005  # more per key of a row-split table (bucketized by row range)
OPS_PER_LOOKUP = 2.0  # per local shard or DP table: embedding_bag + offsets
OPS_PER_OUTPUT_TABLE = 9.6  # per sharded table: its partials cut, sent, assembled
OPS_PER_BACKWARD_TABLE = 17.0  # per sharded table: gradient split, exchange, fused update
OPS_PER_TABLE_OTHER = 32.0  # per table: zero_grad, hooks, Python between phases
#: the hierarchical exchange of row-split REDUCTION blocks (:mod:`embark.sharding.hierarchical`,
#: stage 1 inside the node then stage 2 across) takes this many times the time its bytes take
#: at the probed rates, forward and backward. Not the links: an all-to-all in stage 2's
#: rail pattern (each rank to one remote peer) runs at the probed rate.
RELAYED_EXCHANGE_FACTOR = 1.8
#: fraction of the dense backward that hides the dense gradients' all-reduce
ALLREDUCE_OVERLAP = 0.5
#: DDP's default bucket size (TorchRec's dense gradients: one flat all-reduce per bucket)
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class HostRates:
    """Figures of the runtime's host measured by a probe next to the topology's.

    Args:
        dense_param_bytes: bytes of the dense part's gradients (fp32).
        optimizer_bytes_per_s: weight bytes the dense optimizer steps per second.
        small_op_s: seconds of one small tensor op under the host's load.
    """

    dense_param_bytes: float
    optimizer_bytes_per_s: float
    small_op_s: float


def relayed(ts: TableSharding, gpus_per_node: int) -> bool:
    """Whether ``ts``'s vectors take the hierarchical (relayed) exchange: a REDUCTION table
    with some column block row-split over two or more ranks of one node."""
    if ts.cluster is not Cluster.REDUCTION:
        return False
    for c0, _ in ts.column_blocks:
        nodes = [s.rank // gpus_per_node for s in ts.shards if s.col_start == c0]
        if any(nodes.count(n) >= 2 for n in set(nodes)):
            return True
    return False


def allreduce_seconds(
    nbytes: float, topology: Topology, how: GradReduce, bucket_bytes: float | None = None
) -> float:
    """Seconds of a SUM all-reduce of ``nbytes`` over every rank of ``topology`` (bandwidths
    per rank; a node's uplink carries ``gpus_per_node`` ranks' bandwidth), in
    ``ceil(nbytes / bucket_bytes)`` buckets summed one after the other (at least one).

    ``FLAT``: gloo's ring in rank order, ``2 (W-1)/W · nbytes`` through each node boundary
    (one rank of a node sends over the uplink, which then carries the node's bandwidth), and
    ``2 (W-1)`` latencies per bucket. ``HIERARCHICAL`` (:mod:`embark.sharding.node_allreduce`):
    the reduce-scatter and the all-gather inside the node, ``(g-1)/g · nbytes`` each per rank
    over the intra-node link with ``g-1`` latencies each per bucket; then the shards'
    all-reduce across the nodes, ``2 (N-1)/N · nbytes`` through the node's uplink with
    ``2 (N-1)`` latencies per bucket; the stages one after the other. One node, or one rank
    per node: both are the one ring.

    Args:
        nbytes: the bytes summed.
        topology: the (calibrated) topology.
        how: flat ring or node by node.
        bucket_bytes: the bucket size (``None``: our runtime's,
            :func:`~embark.types.grad_bucket_bytes` of ``nbytes``; DDP's is 25 MiB).
    """
    w, g, n = topology.world_size, topology.gpus_per_node, topology.num_nodes
    if w == 1:
        return 0.0
    size = grad_bucket_bytes(nbytes) if bucket_bytes is None else bucket_bytes
    buckets = max(1, math.ceil(nbytes / size))
    if n == 1:
        ring = 2 * (w - 1) / w * nbytes / topology.intra_node_bandwidth_bytes_per_s
        return ring + buckets * 2 * (w - 1) * topology.intra_node_latency_s
    uplink = topology.inter_node_bandwidth_bytes_per_s * g
    if how is GradReduce.FLAT or g == 1:
        ring = 2 * (w - 1) / w * nbytes / uplink
        return ring + buckets * 2 * (w - 1) * topology.inter_node_latency_s
    inside = 2 * (g - 1) / g * nbytes / topology.intra_node_bandwidth_bytes_per_s
    inside += buckets * 2 * (g - 1) * topology.intra_node_latency_s
    across = 2 * (n - 1) / n * nbytes / uplink
    across += buckets * 2 * (n - 1) * topology.inter_node_latency_s
    return inside + across


def _counts(plan: ShardingPlan, model: CostModel) -> dict[str, float]:
    """Item counts of the bookkeeping terms (per rank; the busiest rank's where they differ)."""
    owned = np.zeros(model.world)
    splits = ids = row_split_ids = 0.0
    sharded = dp = 0
    for ts in plan.tables:
        if ts.cluster is Cluster.DP:
            dp += 1
            continue
        sharded += 1
        splits += len(ts.shards)
        n = model.tables[ts.name].local_ids
        ids += n
        if len({(s.row_start, s.row_end) for s in ts.shards}) > 1:  # split by row range
            row_split_ids += n
        for s in ts.shards:
            owned[s.rank] += 1
    return {
        "splits": splits,
        "ids": ids,
        "row_split_ids": row_split_ids,
        "lookups": float(owned.max()) + dp,
        "sharded": float(sharded),
        "tables": float(len(plan.tables)),
    }


def runtime_phases(
    plan: ShardingPlan,
    model: CostModel,
    rates: HostRates,
    pipelined: bool = False,
    grouped: bool = False,
    grad_reduce: GradReduce = GradReduce.HIERARCHICAL,
    bucket_bytes: float | None = None,
) -> dict[str, float]:
    """Predicted seconds of each phase of one step of ``plan`` on the gloo runtime.

    Args:
        plan: the plan run.
        model: the cost model over the calibrated topology (``dp_sparse_allgather=False``,
            efficiencies 1).
        rates: the host's probed rates.
        pipelined: the next batch's input distribution runs ahead
            (:class:`~embark.sharding.pipeline.SparseDistPipeline`): its wire time hides
            behind the dense compute; its bookkeeping does not (same CPU).
        grouped: a runtime that runs all tables of a sharding type as one kernel and one
            exchange (TorchRec's fused TBE groups): no per-table bookkeeping; the relayed
            factor is ours alone, so row-split blocks count at their bytes.
        grad_reduce: how the dense and DP gradients are summed (:func:`allreduce_seconds`;
            TorchRec's DDP: ``FLAT``).
        bucket_bytes: their bucket size (:func:`allreduce_seconds`; ``None``: our
            runtime's; TorchRec's DDP: :data:`DDP_BUCKET_BYTES`).

    Returns:
        ``{phase: seconds}`` with the keys of :class:`~embark.sharding.phases.Phase`.
    """
    check_plan(plan, model)
    t = model.topology
    gpn = t.gpus_per_node
    zero = np.zeros((model.world, NUM_CHANNELS))
    acc_relayed, acc_flat = zero.copy(), zero.copy()
    for ts in plan.tables:
        if relayed(ts, gpn):
            acc_relayed += model.traffic(ts)
        else:
            acc_flat += model.traffic(ts)
    whole = model.phase_times(acc_relayed + acc_flat)
    flat = model.phase_times(acc_flat, latency=False)
    rel = model.phase_times(acc_relayed, latency=False)
    lat = t.inter_node_latency_s if t.num_nodes > 1 else t.intra_node_latency_s
    # a step's output exchange: the flat all-to-all, then (relayed blocks) stages 1 and 2
    factor = 1.0 if grouped else RELAYED_EXCHANGE_FACTOR
    vectors = float((flat["output_a2a"] + factor * rel["output_a2a"]).max())
    wire = float((flat["output_a2a"] + rel["output_a2a"]).max())
    vectors += lat * (1 + 2 * bool(acc_relayed.any()))
    op = 0.0 if grouped else rates.small_op_s
    n = _counts(plan, model)
    dp_bytes = sum(
        ts.num_rows * ts.dim * model.c.weight_bytes
        for ts in plan.tables
        if ts.cluster is Cluster.DP
    )
    allreduce = allreduce_seconds(rates.dense_param_bytes + dp_bytes, t, grad_reduce, bucket_bytes)
    dense = model.dense_seconds()
    dense_fwd, dense_bwd = dense / 3, 2 * dense / 3
    input_wire = 0.0 if pipelined else float(whole["input_a2a"].max())
    emb_bwd = (
        vectors + float(whole["lookup_bwd"].max()) + OPS_PER_BACKWARD_TABLE * n["sharded"] * op
    )
    # the dense buckets' all-reduce shares the links with the gradients' exchange that follows
    # the dense backward; it is exposed where links, not the CPU, bound that exchange
    exposed = max(0.0, allreduce - ALLREDUCE_OVERLAP * dense_bwd)
    keys = OPS_PER_INPUT_SPLIT * n["splits"] + OPS_PER_ID * n["ids"]
    keys += OPS_PER_ROW_SPLIT_ID * n["row_split_ids"]
    return {
        "input_dist": input_wire + keys * op,
        "lookup": float(whole["lookup_fwd"].max()) + OPS_PER_LOOKUP * n["lookups"] * op,
        "output_a2a": vectors + OPS_PER_OUTPUT_TABLE * n["sharded"] * op,
        "dense_fwd": dense_fwd,
        "dense_bwd": dense_bwd,
        "emb_bwd": emb_bwd,
        "allreduce": max(0.0, wire + exposed - emb_bwd),
        "optimizer": (rates.dense_param_bytes + dp_bytes) / rates.optimizer_bytes_per_s,
        "other": OPS_PER_TABLE_OTHER * n["tables"] * op + 2 * lat,
    }


def runtime_step_seconds(
    plan: ShardingPlan,
    model: CostModel,
    rates: HostRates,
    pipelined: bool = False,
    grouped: bool = False,
    grad_reduce: GradReduce = GradReduce.HIERARCHICAL,
    bucket_bytes: float | None = None,
) -> float:
    """Predicted seconds of one step: the sum of :func:`runtime_phases` (phases of a step run
    one after the other on a rank)."""
    phases = runtime_phases(plan, model, rates, pipelined, grouped, grad_reduce, bucket_bytes)
    return sum(phases.values())
