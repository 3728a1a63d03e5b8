"""embark.planner: the EMBark sharding planner — cost model, greedy + local search,
baselines, simulator.

>>> from embark.planner import plan_sharding, simulate, CostModel
>>> from embark.topology import get_topology
>>> from embark.models.workloads import get_workload
>>> w, topo = get_workload("t200"), get_topology("dgx-h100", nodes=8)
>>> plan = plan_sharding(w, topo, batch_size=65536)               # doctest: +SKIP
>>> simulate(plan, CostModel(w, topo, 65536)).step_ms             # doctest: +SKIP

Layout: ``types`` (data types), ``zipf`` and ``cost`` (the model), ``layout`` (grids),
``greedy`` and ``search`` (strategies), ``baselines``, ``simulator``, ``manual`` (hand-written
plans and constraint files), ``stats`` (the text table), ``planner`` (the entry point),
``report`` (plan, simulate and rate the baselines: ``python -m embark.plan``). Every failure
to plan is a :class:`~embark.types.PlanError`.
"""

from embark.planner.cost import CostModel
from embark.planner.manual import load_constraints, load_plan
from embark.planner.planner import STRATEGIES, plan_sharding
from embark.planner.report import PlanReport, PlanRequest, plan_and_rate
from embark.planner.simulator import check_memory, simulate
from embark.planner.types import CostConstants, GpuStats, SimResult, TableConstraints
from embark.types import PlanError

__all__ = [
    "STRATEGIES",
    "CostConstants",
    "CostModel",
    "GpuStats",
    "PlanError",
    "PlanReport",
    "PlanRequest",
    "SimResult",
    "TableConstraints",
    "check_memory",
    "load_constraints",
    "load_plan",
    "plan_and_rate",
    "plan_sharding",
    "simulate",
]
