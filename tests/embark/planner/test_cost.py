"""Cost model: Zipf distinct-key estimate vs Monte Carlo, exact bytes on hand-sized cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embark.models.workloads import Workload
from embark.planner import cost as C
from embark.planner.cost import CostModel
from embark.planner.layout import make_sharding
from embark.planner.zipf import expected_distinct
from embark.topology import get_topology
from embark.types import Cluster, CommDtype, TableConfig


@pytest.mark.parametrize("rows, alpha, n", [(5000, 1.1, 3000), (2000, 0.8, 500), (300, 1.5, 2000)])
def test_distinct_keys_match_monte_carlo(rows, alpha, n):
    rng = np.random.default_rng(0)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    counts = [len(np.unique(rng.choice(rows, size=n, p=p))) for _ in range(200)]
    mean, sem = float(np.mean(counts)), float(np.std(counts) / np.sqrt(len(counts)))
    est = expected_distinct(rows, alpha, n)
    assert abs(est - mean) <= 4 * sem + 1e-9, (est, mean, sem)


@pytest.mark.parametrize("alpha", [0.7, 1.0, 1.1, 1.3])
def test_integral_tail_matches_exact_sum(alpha):
    rows, n = 300_000, 100_000
    exact = expected_distinct(rows, alpha, n, exact_terms=rows)
    approx = expected_distinct(rows, alpha, n, exact_terms=512)
    assert abs(approx - exact) / exact < 1e-3


def test_distinct_keys_limits():
    assert expected_distinct(10, 1.1, 0) == 0.0
    assert expected_distinct(10, 1.1, 1) == pytest.approx(1.0)
    assert expected_distinct(10, 1.1, 1e7) == pytest.approx(10.0)
    assert expected_distinct(10**9, 1.1, 1000) < 1000
    with pytest.raises(ValueError, match="alpha must be > 0"):
        expected_distinct(10, 0.0, 5)


def _model(optimizer="sgd", gpn=2, nodes=1, batch=4, hot=3, rows=100, dim=8):
    t = TableConfig("t", rows, dim, hot)
    w = Workload("w", (t,), bottom_mlp=(dim,), optimizer=optimizer)
    topo = replace(get_topology("dgx-h100", nodes), gpus_per_node=gpn)
    return CostModel(w, topo, batch), t


def test_table_wise_reduction_bytes_by_hand():
    m, t = _model()
    b, B, h, d = 2, 4, 3, 8
    tr = m.traffic(make_sharding(t, [[0]], Cluster.REDUCTION, CommDtype.FP32, 2, 2))
    keys = b * (h * 8 + 4)  # int64 keys + one int32 length per bag
    assert tr[1, C.KEY_SEND_INTRA] == keys and tr[0, C.KEY_RECV_INTRA] == keys
    assert tr[0, C.KEY_SEND_INTRA] == 0 and tr[1, C.KEY_RECV_INTRA] == 0
    assert tr[0, C.OUT_SEND_INTRA] == b * d * 4 and tr[1, C.OUT_RECV_INTRA] == b * d * 4
    assert tr[0, C.LOOKUP_FWD] == B * h * d * 4 + B * d * 4
    assert tr[1, C.LOOKUP_FWD] == 0
    assert not tr[:, [C.KEY_SEND_INTER, C.KEY_RECV_INTER, C.OUT_SEND_INTER, C.OUT_RECV_INTER]].any()
    half = m.traffic(make_sharding(t, [[0]], Cluster.REDUCTION, CommDtype.BF16, 2, 2))
    assert half[0, C.OUT_SEND_INTRA] == b * d * 2
    assert half[1, C.KEY_SEND_INTRA] == keys  # keys are not compressed


def test_unique_cluster_sends_distinct_keys_only():
    m, t = _model(batch=4000, hot=50, rows=1000)
    u = m.tables["t"].local_unique
    assert u == pytest.approx(expected_distinct(1000, 1.1, 2000 * 50))
    tr = m.traffic(make_sharding(t, [[0]], Cluster.UNIQUE, CommDtype.FP16, 2, 2))
    assert tr[1, C.KEY_SEND_INTRA] == pytest.approx(u * 8)
    assert tr[0, C.OUT_SEND_INTRA] == pytest.approx(u * 8 * 2)
    rb = m.traffic(make_sharding(t, [[0]], Cluster.REDUCTION, CommDtype.FP16, 2, 2))
    assert tr[1, C.KEY_SEND_INTRA] < rb[1, C.KEY_SEND_INTRA]


def test_hierarchical_reduction_sends_one_partial_per_node():
    # 2 nodes × 2 GPUs; table row-split over node 0: the inter-node traffic is one reduced
    # b × d partial per remote rank, shared by the two owners.
    m, t = _model(nodes=2, batch=8)
    b, B, d = 2, 8, 8
    tr = m.traffic(make_sharding(t, [[0, 1]], Cluster.REDUCTION, CommDtype.FP32, 4, 2))
    assert tr[0, C.OUT_SEND_INTER] + tr[1, C.OUT_SEND_INTER] == 2 * b * d * 4
    assert tr[2, C.OUT_RECV_INTER] == b * d * 4 and tr[3, C.OUT_RECV_INTER] == b * d * 4
    rs = 0.5 * B * d * 4  # reduce-scatter of the full batch's partial sums inside node 0
    assert tr[0, C.OUT_RECV_INTRA] == rs and tr[0, C.OUT_SEND_INTRA] == rs


def test_one_node_reduction_books_the_runtimes_flat_exchange():
    """On one node the runtime runs the flat exchange (hierarchical mode needs two nodes):
    each owner sends every other rank its b × d partial, and each rank receives one from every
    owner but itself. 4 ranks, rows split over ranks 0 and 1, b = 8, d = 16, fp32: the bytes a
    gloo run of this layout received, [512, 512, 1024, 1024]."""
    m, t = _model(nodes=1, gpn=4, batch=32, dim=16)
    b, d = 8, 16
    tr = m.traffic(make_sharding(t, [[0, 1]], Cluster.REDUCTION, CommDtype.FP32, 4, 4))
    assert tr[:, C.OUT_RECV_INTRA].tolist() == [512, 512, 1024, 1024]
    assert tr[:, C.OUT_SEND_INTRA].tolist() == [3 * b * d * 4] * 2 + [0, 0]
    assert not tr[:, [C.OUT_SEND_INTER, C.OUT_RECV_INTER]].any()


def test_memory_and_data_parallel_allreduce():
    m, t = _model(optimizer="adagrad", nodes=2)
    dp = make_sharding(t, [], Cluster.DP, CommDtype.FP32, 4, 2)
    assert (m.memory(dp) == t.num_rows * t.dim * 8).all()  # fp32 weight + Adagrad state
    tr = m.traffic(dp)
    ring = t.num_rows * t.dim * 4
    sparse = m.tables["t"].local_unique * (t.dim * 4 + 8)
    ring_time = m._link_time(2 * 0.5 * ring, 2 * 0.5 * ring / 2)
    sparse_time = m._link_time(2 * sparse, sparse)
    assert m._link_time(tr[0, C.AR_INTRA], tr[0, C.AR_INTER]) == pytest.approx(
        min(ring_time, sparse_time)
    )
    assert not tr[:, C.KEY_SEND_INTRA : C.OUT_RECV_INTER + 1].any()


def test_phase_times_use_max_of_send_and_receive():
    m, t = _model()
    acc = np.zeros((2, C.NUM_CHANNELS))
    acc[0, C.OUT_SEND_INTRA] = 3e9
    acc[0, C.OUT_RECV_INTRA] = 1e9
    ph = m.phase_times(acc, latency=False)
    bw = m.topology.intra_node_bandwidth_bytes_per_s * m.c.intra_a2a_efficiency
    assert ph["output_a2a"][0] == pytest.approx(3e9 / bw)
    assert ph["grad_a2a"][0] == ph["output_a2a"][0]
    step, no_overlap, emb = m.step_seconds(acc)
    assert no_overlap == pytest.approx(emb + m.dense_seconds())
    assert step <= no_overlap


def test_batch_must_cover_ranks():
    t = TableConfig("t", 10, 8)
    with pytest.raises(ValueError, match="batch_size must be an integer >= world_size 16"):
        CostModel(Workload("w", (t,)), get_topology("dgx-h100", 2), 8)
