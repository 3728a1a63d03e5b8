"""Planner: every plan (ours and the baselines) covers every row once and fits memory;
determinism; constraints; infeasible inputs; ours never worse than table-row-wise."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embark.models.workloads import Workload, get_workload
from embark.planner.baselines import BASELINES
from embark.planner.cost import CostModel
from embark.planner.greedy import GreedyPlanner, Split
from embark.planner.layout import grid_of
from embark.planner.planner import plan_sharding
from embark.planner.simulator import simulate
from embark.planner.types import TableConstraints
from embark.topology import get_topology
from embark.types import Cluster, PlanError, ShardingPlan, ShardingType, Topology


def assert_covers_once(plan: ShardingPlan, workload: Workload) -> None:
    """Independent of the plan's own validation: count owners of every (row, col) cell by
    sweeping interval end points per table."""
    assert sorted(t.name for t in plan.tables) == sorted(t.name for t in workload.tables)
    for cfg in workload.tables:
        ts = plan[cfg.name]
        if ts.cluster is Cluster.DP:
            assert sorted(ts.ranks) == list(range(plan.world_size))
            assert all(
                (s.row_start, s.row_end, s.col_start, s.col_end) == (0, cfg.num_rows, 0, cfg.dim)
                for s in ts.shards
            )
            continue
        cuts_r = sorted(
            {0, cfg.num_rows} | {s.row_start for s in ts.shards} | {s.row_end for s in ts.shards}
        )
        cuts_c = sorted(
            {0, cfg.dim} | {s.col_start for s in ts.shards} | {s.col_end for s in ts.shards}
        )
        owners = np.zeros((len(cuts_r) - 1, len(cuts_c) - 1), dtype=np.int64)
        for s in ts.shards:
            i0, i1 = cuts_r.index(s.row_start), cuts_r.index(s.row_end)
            j0, j1 = cuts_c.index(s.col_start), cuts_c.index(s.col_end)
            owners[i0:i1, j0:j1] += 1
            assert 0 <= s.rank < plan.world_size
        assert (owners == 1).all(), (
            f"table {cfg.name}: cells owned {owners.min()}..{owners.max()} times"
        )
        assert len(set(ts.ranks)) == len(ts.ranks)


def assert_fits(plan: ShardingPlan, model: CostModel) -> None:
    per = model.bytes_per_element()
    mem = np.zeros(plan.world_size)
    for ts in plan.tables:
        for s in ts.shards:
            mem[s.rank] += (s.row_end - s.row_start) * (s.col_end - s.col_start) * per
    assert mem.max() <= model.memory_cap_bytes, f"rank {mem.argmax()} over the cap"


def tight_topology(
    workload: Workload, world_nodes: int = 2, gpn: int = 4, fill: float = 0.7
) -> Topology:
    """A DGX-H100-like topology whose HBM is just large enough (total need / fill)."""
    need = (
        sum(t.num_rows * t.dim for t in workload.tables)
        * 4
        * (2 if workload.optimizer == "adagrad" else 1)
    )
    cap = need / fill / (world_nodes * gpn) / 0.9
    base = get_topology("dgx-h100", world_nodes)
    return replace(base, name="tight", gpus_per_node=gpn, hbm_capacity_bytes=cap)


CASES = [
    ("tiny", "cpu-local", 1, None),
    ("tiny", "tight", 2, None),
    ("dlrm_dcnv2", "dgx-a100", 2, 1000.0),
    ("t200", "tight", 2, 100.0),
    ("t180", "gb200-nvl72", 1, 1000.0),
    ("t510", "dgx-h100", 1, 100.0),
]


@pytest.mark.parametrize("workload_name, topo_name, nodes, scale", CASES)
def test_every_plan_covers_rows_and_fits(workload_name, topo_name, nodes, scale):
    w = get_workload(workload_name)
    if scale:
        w = w.scaled(scale)
    topo = tight_topology(w) if topo_name == "tight" else get_topology(topo_name, nodes)
    model = CostModel(w, topo, 64 * topo.world_size)
    plans = {"auto": plan_sharding(w, topo, 64 * topo.world_size)}
    for name, fn in BASELINES.items():
        try:
            plans[name] = fn(model)
        except PlanError as e:
            assert "does not fit" in str(e) and name in ("dp", "tw")
    assert {"auto", "trw", "rw"} <= set(plans)
    for name, plan in plans.items():
        assert_covers_once(plan, w)
        assert_fits(plan, model)
        assert simulate(plan, model).fits_memory, name


def test_tight_memory_forces_splits():
    w = get_workload("t200").scaled(10)
    topo = tight_topology(w, fill=0.8)
    plan = plan_sharding(w, topo, 1024)
    model = CostModel(w, topo, 1024)
    assert_fits(plan, model)
    biggest = max(w.tables, key=lambda t: t.num_rows * t.dim)
    assert len(plan[biggest.name].shards) > 1, "a table larger than a GPU's share must be split"


def test_deterministic():
    w = get_workload("t180").scaled(100)
    topo = get_topology("dgx-h100", 2)
    a = plan_sharding(w, topo, 8192 * 16)
    b = plan_sharding(w, topo, 8192 * 16)
    assert a.to_dict() == b.to_dict()


def test_grid_traffic_equals_model_traffic():
    w = get_workload("t180").scaled(100)
    topo = get_topology("dgx-h100", 3)
    model = CostModel(w, topo, 8192 * 24)
    g = GreedyPlanner(model)
    plan = g.plan()
    kinds = set()
    for ts in plan.tables:
        if ts.cluster is Cluster.DP:
            continue
        n = len(ts.column_blocks)
        split = Split(len(ts.shards) // n, n, ts.cluster)
        kinds.add((ts.sharding_type, ts.cluster))
        np.testing.assert_allclose(
            g.grid_traffic(ts.name, grid_of(ts), split), model.traffic(ts), rtol=1e-12
        )
    assert len(kinds) >= 2


@pytest.mark.parametrize(
    "workload_name, nodes",
    [("dlrm_dcnv2", 1), ("dlrm_dcnv2", 2), ("t180", 2), ("t200", 2), ("t510", 1)],
)
def test_ours_never_worse_than_table_row_wise(workload_name, nodes):
    w = get_workload(workload_name)
    topo = get_topology("dgx-h100", nodes)
    batch = 8192 * topo.world_size
    model = CostModel(w, topo, batch)
    ours = simulate(plan_sharding(w, topo, batch), model).step_ms
    trw = simulate(BASELINES["trw"](model), model).step_ms
    assert ours <= trw * (1 + 1e-9), (ours, trw)


def test_constraints_are_honoured():
    tiny = get_workload("tiny")
    w = replace(
        tiny, tables=tuple(replace(t, dim=128) if t.name == "t3" else t for t in tiny.tables)
    )
    topo = get_topology("dgx-h100", 2)
    cons = {
        "t0": TableConstraints(sharding_types=(ShardingType.TW,), ranks=(5,)),
        "t1": TableConstraints(
            cluster=Cluster.UNIQUE, sharding_types=(ShardingType.TRW, ShardingType.RW)
        ),
        "t2": TableConstraints(cluster=Cluster.DP),
        "t3": TableConstraints(sharding_types=(ShardingType.CW,), ranks=(8, 9, 10, 11)),
    }
    plan = plan_sharding(w, topo, 4096, constraints=cons)
    assert plan["t0"].sharding_type is ShardingType.TW and plan["t0"].ranks == (5,)
    assert plan["t1"].cluster is Cluster.UNIQUE and plan["t1"].sharding_type in (
        ShardingType.TRW,
        ShardingType.RW,
    )
    assert plan["t2"].sharding_type is ShardingType.DP
    assert plan["t3"].sharding_type is ShardingType.CW and set(plan["t3"].ranks) <= {8, 9, 10, 11}
    assert_covers_once(plan, w)


def test_infeasible_inputs_raise_planner_error():
    w = get_workload("t200")
    with pytest.raises(
        PlanError, match=r"needs 415\.45 GB .* 4 GPUs hold 288\.00 GB \(short by 127\.45 GB\)"
    ):
        plan_sharding(w, replace(get_topology("dgx-h100"), gpus_per_node=4), 65536)
    big = get_workload(
        "t180"
    )  # one 500M × 32 table: 64 GB, more than 80 GB × 0.9 minus replicas allows
    topo = replace(get_topology("dgx-h100", 1), hbm_capacity_bytes=60e9)
    with pytest.raises(
        PlanError,
        match=r"table 't176' \(64\.00 GB .* needs 64\.00 GB per shard .* \(short by 10\.24 GB\)",
    ):
        plan_sharding(
            big,
            topo,
            65536,
            constraints={"t176": TableConstraints(sharding_types=(ShardingType.TW,))},
        )
    with pytest.raises(PlanError, match="pinned rank 99"):
        plan_sharding(
            get_workload("tiny"),
            get_topology("dgx-h100"),
            4096,
            constraints={"t0": TableConstraints(ranks=(99,))},
        )
    with pytest.raises(PlanError, match="'nope', which is not in the workload"):
        plan_sharding(
            get_workload("tiny"),
            get_topology("dgx-h100"),
            4096,
            constraints={"nope": TableConstraints()},
        )
    with pytest.raises(PlanError, match="data_parallel plan does not fit: rank 0 needs"):
        BASELINES["dp"](CostModel(w, get_topology("dgx-h100", 1), 65536))


@pytest.mark.parametrize("rounds", [-5, 2.5, True, "3"])
def test_greedy_rejects_bad_rounds(rounds):
    model = CostModel(get_workload("tiny"), get_topology("cpu-local"), 64)
    with pytest.raises(PlanError, match=f"rounds must be an integer >= 0, got {rounds!r}"):
        GreedyPlanner(model, rounds=rounds)
