"""EMBark sharding planner: cost model, greedy + local search, baselines, simulator.

>>> from embark.planner import plan_sharding, simulate, CostModel
>>> from embark.topology import get_topology
>>> from embark.models.workloads import get_workload
>>> w, topo = get_workload("t200"), get_topology("dgx-h100", nodes=8)
>>> plan = plan_sharding(w, topo, batch_size=65536)               # doctest: +SKIP
>>> simulate(plan, CostModel(w, topo, 65536)).step_ms             # doctest: +SKIP

Layout: ``types`` (data types), ``zipf`` and ``cost`` (the model), ``layout`` (grids),
``greedy`` and ``search`` (strategies), ``baselines``, ``simulator``, ``manual`` (hand-written
plans and constraint files), ``stats`` (the text table), ``planner`` (the entry point).
"""

from embark.planner.cost import CostModel
from embark.planner.manual import load_constraints, load_plan
from embark.planner.planner import STRATEGIES, plan_sharding
from embark.planner.simulator import check_memory, simulate
from embark.planner.types import CostConstants, GpuStats, PlannerError, SimResult, TableConstraints

__all__ = [
    "STRATEGIES",
    "CostConstants",
    "CostModel",
    "GpuStats",
    "PlannerError",
    "SimResult",
    "TableConstraints",
    "check_memory",
    "load_constraints",
    "load_plan",
    "plan_sharding",
    "simulate",
]
