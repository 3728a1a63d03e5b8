"""The planner entry point: one short loop over injected strategies.

>>> plan = plan_sharding(get_workload("t200"), get_topology("dgx-h100", 8), batch_size=65536)
>>> simulate(plan, CostModel(...)).step_ms            # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from embark.models.workloads import Workload
from embark.planner.baselines import BASELINES
from embark.planner.cost import CostModel
from embark.planner.greedy import GreedyPlanner
from embark.planner.search import local_search
from embark.planner.simulator import check_memory
from embark.planner.types import CostConstants, TableConstraints
from embark.types import CommDtype, PlanError, ShardingPlan, Topology

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "greedy", "trw", "rw", "tw", "dp")


def plan_sharding(
    workload: Workload,
    topology: Topology,
    batch_size: int,
    strategy: str = "auto",
    constraints: Mapping[str, TableConstraints] | None = None,
    comm_dtype: CommDtype | str = CommDtype.FP32,
    rounds: int = 20,
    constants: CostConstants | None = None,
) -> ShardingPlan:
    """Plan ``workload`` on ``topology`` for a global batch of ``batch_size`` samples.

    Args:
        strategy: ``auto`` (EMBark greedy + local search), ``greedy`` (greedy only), or a
            baseline: ``trw`` table-row-wise, ``rw`` row-wise, ``tw`` table-wise, ``dp``.
        constraints: per-table constraints (honoured by ``auto``/``greedy`` only).
        comm_dtype: wire dtype of embedding vectors and gradients.
        rounds: greedy split rounds.

    Raises:
        PlanError: the workload or a table does not fit (naming it and by how much), or
            constraints cannot be met.
        ValueError: unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {strategy!r}; expected one of {list(STRATEGIES)} or a plan file"
        )
    model = CostModel(workload, topology, batch_size, constants)
    dtype = CommDtype(comm_dtype)
    if strategy in BASELINES:
        if constraints:
            raise PlanError(
                f"strategy {strategy!r} is a fixed baseline and ignores constraints; use 'auto'"
            )
        return BASELINES[strategy](model, dtype)
    cons = dict(constraints or {})
    plan = GreedyPlanner(model, cons, dtype, rounds).plan()
    if strategy == "auto":
        plan = local_search(plan, model, cons)
    check_memory(plan, model)
    return plan


__all__ = ["STRATEGIES", "PlanError", "plan_sharding"]
