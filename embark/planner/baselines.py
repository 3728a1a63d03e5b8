"""Baseline plans in the same framework: table-row-wise (the EMBark paper's baseline),
row-wise, table-wise round-robin and all data-parallel. All use the reduction cluster
(the pooled all-to-all of TorchRec and HugeCTR) except data-parallel.
"""

from __future__ import annotations

import numpy as np

from embark.planner.cost import CostModel
from embark.planner.layout import make_sharding
from embark.planner.simulator import check_memory
from embark.planner.types import format_bytes
from embark.types import Cluster, CommDtype, PlanError, ShardingPlan, TableSharding


def _finish(model: CostModel, tables: list[TableSharding], what: str) -> ShardingPlan:
    plan = ShardingPlan(model.world, model.gpn, tuple(tables), model.topology.name)
    try:
        check_memory(plan, model)
    except PlanError as e:
        raise PlanError(f"{what} plan does not fit: {e}") from None
    return plan


def table_row_wise(model: CostModel, comm_dtype: CommDtype = CommDtype.FP32) -> ShardingPlan:
    """Every table row-split over the GPUs of one node; nodes taken round-robin in table
    order (a table with fewer rows than GPUs uses its first ``num_rows`` GPUs)."""
    g = model.gpn
    out = []
    for i, t in enumerate(model.workload.tables):
        node = i % model.nodes
        ranks = [node * g + j for j in range(min(g, t.num_rows))]
        out.append(
            make_sharding(t, [ranks], Cluster.REDUCTION, CommDtype(comm_dtype), model.world, g)
        )
    return _finish(model, out, "table_row_wise")


def row_wise(model: CostModel, comm_dtype: CommDtype = CommDtype.FP32) -> ShardingPlan:
    """Every table row-split over all ranks (fewer when it has fewer rows than ranks)."""
    out = []
    for t in model.workload.tables:
        ranks = list(range(min(model.world, t.num_rows)))
        out.append(
            make_sharding(
                t, [ranks], Cluster.REDUCTION, CommDtype(comm_dtype), model.world, model.gpn
            )
        )
    return _finish(model, out, "row_wise")


def table_wise(model: CostModel, comm_dtype: CommDtype = CommDtype.FP32) -> ShardingPlan:
    """Whole tables dealt round-robin to ranks in table order; a rank that is full is
    skipped for the next one with room."""
    mem = np.zeros(model.world)
    cap = model.memory_cap_bytes
    out, nxt = [], 0
    for t in model.workload.tables:
        need = t.num_rows * t.dim * model.bytes_per_element()
        for j in range(model.world):
            r = (nxt + j) % model.world
            if mem[r] + need <= cap:
                break
        else:
            raise PlanError(
                f"table_wise plan does not fit: table {t.name!r} needs {format_bytes(need)} but the "
                f"emptiest rank has {format_bytes(cap - mem.min())} free"
            )
        mem[r] += need
        nxt = r + 1
        out.append(
            make_sharding(
                t, [[r]], Cluster.REDUCTION, CommDtype(comm_dtype), model.world, model.gpn
            )
        )
    return _finish(model, out, "table_wise")


def data_parallel(model: CostModel, comm_dtype: CommDtype = CommDtype.FP32) -> ShardingPlan:
    """Every table replicated on every rank (only where the whole workload fits one GPU)."""
    out = [
        make_sharding(t, [], Cluster.DP, CommDtype(comm_dtype), model.world, model.gpn)
        for t in model.workload.tables
    ]
    return _finish(model, out, "data_parallel")


BASELINES = {
    "trw": table_row_wise,
    "rw": row_wise,
    "tw": table_wise,
    "dp": data_parallel,
}
