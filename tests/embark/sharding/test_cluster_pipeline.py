"""Pieces of the emulated-cluster work that need no root: the pipeline in a one-rank world,
the emulated topology's mapping, the link shape, the runtime-faithful cost figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embark import ShardedDLRM, TrainConfig, Trainer
from embark.cluster import LinkShape
from embark.data import SyntheticCTR
from embark.models.workloads import get_workload
from embark.planner.cost import AR_INTER, AR_INTRA, CostModel
from embark.planner.planner import plan_sharding
from embark.planner.runtime_model import (
    ALLREDUCE_OVERLAP,
    DDP_BUCKET_BYTES,
    OPS_PER_ID,
    OPS_PER_INPUT_SPLIT,
    OPS_PER_LOOKUP,
    RELAYED_EXCHANGE_FACTOR,
    HostRates,
    allreduce_seconds,
    relayed,
    runtime_phases,
)
from embark.planner.simulator import simulate
from embark.planner.types import CostConstants
from embark.sharding import InputPrefetcher, SparseDistPipeline
from embark.sharding.phases import Phase, PhaseClock
from embark.topology import (
    H100_IB_BYTES_PER_S,
    H100_NVLINK_BYTES_PER_S,
    emulated_topology,
    get_topology,
)
from embark.types import Cluster, GradReduce, grad_bucket_bytes


def _trainer(world_plan_seed: int = 3) -> Trainer:
    w = get_workload("tiny")
    plan = plan_sharding(w, emulated_topology(nodes=1, ranks_per_node=1), 32, "trw")
    model = ShardedDLRM.build(w, plan, 0, seed=world_plan_seed)
    return Trainer(model, TrainConfig(optimizer="adagrad", lr=0.05, embedding_lr=0.1))


def test_pipelined_equals_plain_in_one_process() -> None:
    torch.set_num_threads(1)
    batches = list(SyntheticCTR(get_workload("tiny"), 32, seed=5).batches(4))
    plain = _trainer()
    want = [plain.train_step(b) for b in batches]
    piped = _trainer()
    pipe = SparseDistPipeline(piped)
    got = list(pipe.train(batches))
    assert got == want
    assert pipe.prefetched == len(batches)
    assert piped.model.prefetcher is None  # removed when the iteration ends
    a, b = plain.model.state_dict(), piped.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prefetcher_refuses_a_batch_out_of_order() -> None:
    t = _trainer()
    model = t.model
    assert isinstance(model, ShardedDLRM)
    first, second = SyntheticCTR(get_workload("tiny"), 8, seed=1).batches(2)
    pf = InputPrefetcher(model.embeddings)
    pf.start(first.sparse)
    with pytest.raises(ValueError, match="other than the one"):
        pf.take(second.sparse)
    assert pf.take(first.sparse) is not None and pf.pending == 0
    pf.schedule(second.sparse)
    with pytest.raises(ValueError, match="already scheduled"):
        pf.schedule(first.sparse)


def test_phase_clock_charges_every_phase_of_a_step() -> None:
    t = _trainer()
    model = t.model
    assert isinstance(model, ShardedDLRM)
    clock = PhaseClock()
    model.set_phase_clock(clock)
    t.train_step(next(iter(SyntheticCTR(get_workload("tiny"), 16, seed=2).batches(1))))
    for phase in (Phase.LOOKUP, Phase.DENSE_FWD, Phase.DENSE_BWD, Phase.EMB_BWD):
        assert clock.seconds[phase] > 0, phase


def test_emulated_topology_keeps_the_dgx_h100_ratio() -> None:
    t = get_topology("emulated", nodes=2)
    assert (t.num_nodes, t.gpus_per_node) == (2, 2)
    ratio = t.intra_node_bandwidth_bytes_per_s / t.inter_node_bandwidth_bytes_per_s
    assert ratio == pytest.approx(H100_NVLINK_BYTES_PER_S / H100_IB_BYTES_PER_S) == 9


def test_link_shape_checks_and_tbf_arguments() -> None:
    s = LinkShape(rate_bits_per_s=128e6, intra_rate_bits_per_s=1.152e9)
    assert s.tbf_args() == ["tbf", "rate", "128000kbit", "burst", "262144", "limit", "8000000"]
    assert s.tbf_args(1.152e9)[2] == "1152000kbit"
    with pytest.raises(ValueError, match="rate_bits_per_s must be > 0"):
        LinkShape(rate_bits_per_s=0)
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        LinkShape(rate_bits_per_s=1e6, delay_s=-1)


def test_dp_gradients_rated_as_the_runtime_moves_them() -> None:
    """Without the sparse all-gather a DP table costs its whole replica's ring all-reduce."""
    w = get_workload("tiny")
    topo = emulated_topology()
    dp = plan_sharding(w, topo, 64, "dp")
    ring = CostModel(w, topo, 64, CostConstants(dp_sparse_allgather=False))
    either = CostModel(w, topo, 64)
    for ts in dp.tables:
        assert ts.cluster is Cluster.DP
        full = ring.traffic(ts)
        g, n = topo.gpus_per_node, topo.num_nodes
        replica = ts.num_rows * ts.dim * 4
        assert full[0, AR_INTRA] == pytest.approx(2 * (g - 1) / g * replica)
        assert full[0, AR_INTER] == pytest.approx(2 * (n - 1) / n * replica / g)
        assert either.traffic(ts)[0, AR_INTER] <= full[0, AR_INTER]


def test_runtime_phases_count_all_reduce_optimizer_bookkeeping_and_pipeline() -> None:
    w = get_workload("tiny")
    topo = emulated_topology()
    model = CostModel(w, topo, 64, CostConstants(dp_sparse_allgather=False))
    plan = plan_sharding(w, topo, 64, "tw")
    sim = simulate(plan, model)
    bare = HostRates(dense_param_bytes=0.0, optimizer_bytes_per_s=1e9, small_op_s=0.0)
    flat = GradReduce.FLAT
    plain = runtime_phases(plan, model, bare, grad_reduce=flat)
    heavy = runtime_phases(plan, model, HostRates(64e6, 1e9, 0.0), grad_reduce=flat)
    busy = runtime_phases(plan, model, HostRates(0.0, 1e9, 1e-4))
    piped = runtime_phases(plan, model, bare, pipelined=True)
    assert set(plain) == {p.value for p in Phase}
    # a 64 MB ring over 4 ranks: 96 MB sent per rank, one rank per node over the node's
    # uplink (2 ranks' bandwidth); the tiny dense backward hides less than the ring's latency
    # alone, so all of it is exposed; the optimizer steps the 64 MB once
    assert ALLREDUCE_OVERLAP * 2 / 3 * model.dense_seconds() < 2 * topo.inter_node_latency_s
    assert plain["allreduce"] > 0
    # 64 MB in 16 buckets of 4 MiB (grad_bucket_bytes), 0 bytes in one: 15 more buckets,
    # each with the ring's 2 (W-1) latencies
    ring = 1.5 * 64e6 / (2 * topo.inter_node_bandwidth_bytes_per_s)
    ring += 15 * 6 * topo.inter_node_latency_s
    assert heavy["allreduce"] - plain["allreduce"] == pytest.approx(ring, rel=1e-9)
    assert heavy["optimizer"] == pytest.approx(64e6 / 1e9)
    # node by node (the runtime's default on 2 x 2): 0.5 + 0.5 of the 64 MB inside the node,
    # then 1 × 64 MB through the node's uplink
    hier = runtime_phases(plan, model, HostRates(64e6, 1e9, 0.0))
    hier0 = runtime_phases(plan, model, bare)
    inside = 64e6 / topo.intra_node_bandwidth_bytes_per_s + 15 * 2 * topo.intra_node_latency_s
    across = 64e6 / (2 * topo.inter_node_bandwidth_bytes_per_s)
    across += 15 * 2 * topo.inter_node_latency_s
    assert hier["allreduce"] - hier0["allreduce"] == pytest.approx(inside + across, rel=1e-9)
    assert hier["allreduce"] < heavy["allreduce"]
    keys = sim.phases_ms["input_a2a"] / 1e3
    assert plain["input_dist"] == pytest.approx(keys)
    assert piped["input_dist"] == 0.0
    # bookkeeping: every (table, shard) split for the keys, every key routed; the busiest
    # rank's shards looked up
    splits = sum(len(ts.shards) for ts in plan.tables)
    ids = sum(16 * t.hotness for t in w.tables)
    owned = max(sum(s.rank == r for ts in plan.tables for s in ts.shards) for r in range(4))
    assert busy["input_dist"] - plain["input_dist"] == pytest.approx(
        (OPS_PER_INPUT_SPLIT * splits + OPS_PER_ID * ids) * 1e-4
    )
    assert busy["lookup"] - plain["lookup"] == pytest.approx(OPS_PER_LOOKUP * owned * 1e-4)


def test_allreduce_node_by_node_crosses_nodes_as_the_planner_rates_dp_replicas() -> None:
    """The hierarchical all-reduce's uplink bytes are the planner's AR_INTER of a DP replica
    (per rank, times the node's ranks); the flat ring's are 2 (W-1)/W of them; one node or
    one rank per node: the same ring either way."""
    w = get_workload("tiny")
    topo = emulated_topology(nodes=4, ranks_per_node=2, latency_s=0.0)
    model = CostModel(w, topo, 64, CostConstants(dp_sparse_allgather=False))
    ts = plan_sharding(w, topo, 64, "dp").tables[0]
    replica = ts.num_rows * ts.dim * 4
    uplink = 2 * topo.inter_node_bandwidth_bytes_per_s
    inside = replica / topo.intra_node_bandwidth_bytes_per_s  # 2 (g-1)/g = 1
    hier = allreduce_seconds(replica, topo, GradReduce.HIERARCHICAL)
    assert hier - inside == pytest.approx(2 * model.traffic(ts)[0, AR_INTER] / uplink)
    assert hier - inside == pytest.approx(1.5 * replica / uplink)  # 2 (N-1)/N, N = 4
    flat = allreduce_seconds(replica, topo, GradReduce.FLAT)
    assert flat == pytest.approx(2 * 7 / 8 * replica / uplink)  # 2 (W-1)/W, W = 8
    for nodes, gpn in ((1, 4), (4, 1)):
        t = emulated_topology(nodes=nodes, ranks_per_node=gpn)
        assert allreduce_seconds(1e6, t, GradReduce.HIERARCHICAL) == allreduce_seconds(
            1e6, t, GradReduce.FLAT
        )


def test_allreduce_pays_every_bucket_s_latencies_per_stage() -> None:
    """Each bucket pays its collectives' latencies: 2 (W-1) for the ring; 2 (g-1) inside the
    node and 2 (N-1) across for the node-by-node sum; the bucket count is
    ceil(bytes / bucket size), the size grad_bucket_bytes of the bytes unless given."""
    topo = emulated_topology()  # 2 nodes x 2 ranks
    lat = (topo.intra_node_latency_s, topo.inter_node_latency_s)
    assert lat[1] > 0
    nbytes = 64e6
    assert grad_bucket_bytes(nbytes) == 4 << 20 and grad_bucket_bytes(2.5e6) == 1 << 20
    buckets = 16  # ceil(64e6 / 4 MiB)
    flat1 = allreduce_seconds(nbytes, topo, GradReduce.FLAT, bucket_bytes=nbytes)
    flat = allreduce_seconds(nbytes, topo, GradReduce.FLAT)
    assert flat - flat1 == pytest.approx((buckets - 1) * 6 * lat[1], rel=1e-9)
    hier1 = allreduce_seconds(nbytes, topo, GradReduce.HIERARCHICAL, bucket_bytes=nbytes)
    hier = allreduce_seconds(nbytes, topo, GradReduce.HIERARCHICAL)
    assert hier - hier1 == pytest.approx((buckets - 1) * (2 * lat[0] + 2 * lat[1]), rel=1e-9)
    ddp = allreduce_seconds(nbytes, topo, GradReduce.FLAT, bucket_bytes=DDP_BUCKET_BYTES)
    assert ddp - flat1 == pytest.approx(2 * 6 * lat[1], rel=1e-9)  # 3 buckets of 25 MiB


def test_relayed_exchange_factor_applies_to_row_split_blocks_of_our_runtime_only() -> None:
    w = get_workload("tiny")
    topo = emulated_topology()
    model = CostModel(w, topo, 64, CostConstants(dp_sparse_allgather=False))
    bare = HostRates(dense_param_bytes=0.0, optimizer_bytes_per_s=1e9, small_op_s=0.0)
    rw = plan_sharding(w, topo, 64, "rw")
    tw = plan_sharding(w, topo, 64, "tw")
    assert all(relayed(ts, 2) for ts in rw.tables)
    assert not any(relayed(ts, 2) for ts in tw.tables)
    acc = np.sum([model.traffic(ts) for ts in rw.tables], axis=0)
    wire = float(model.phase_times(acc, latency=False)["output_a2a"].max())
    ours = runtime_phases(rw, model, bare)
    grouped = runtime_phases(rw, model, bare, grouped=True)
    assert ours["output_a2a"] - grouped["output_a2a"] == pytest.approx(
        (RELAYED_EXCHANGE_FACTOR - 1) * wire
    )
    assert runtime_phases(tw, model, bare) == runtime_phases(tw, model, bare, grouped=True)
