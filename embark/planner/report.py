"""Plan (or load) a sharding, simulate it and rate the baselines beside it: what
``python -m embark.plan`` prints and writes, as a library call.

>>> report = plan_and_rate(PlanRequest("t200", "dgx-h100", nodes=8))     # doctest: +SKIP
>>> report.result.step_ms, report.baselines["trw"]                       # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embark.models.workloads import Workload, get_workload
from embark.planner.baselines import BASELINES
from embark.planner.cost import CostModel
from embark.planner.manual import load_constraints, load_plan
from embark.planner.planner import STRATEGIES, plan_sharding
from embark.planner.simulator import check_memory, simulate
from embark.planner.stats import format_stats, top_tables
from embark.planner.types import SimResult
from embark.topology import get_topology
from embark.types import CommDtype, PlanError, ShardingPlan, Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan.

    Args:
        workload: a workload preset name.
        topology: a topology preset name.
        nodes: nodes of the topology.
        batch_size: GLOBAL batch (all ranks, >= world size).
        strategy: one of :data:`~embark.planner.planner.STRATEGIES`, or a plan file
            (JSON/YAML, :func:`~embark.planner.manual.load_plan`) to rate as it is.
        constraints: a per-table constraints file (JSON/YAML), or ``None``.
        comm_dtype: wire dtype of the embedding vectors.
        rounds: greedy split rounds (>= 0).
    """

    workload: str
    topology: str = "dgx-h100"
    nodes: int = 1
    batch_size: int = 65536
    strategy: str = "auto"
    constraints: str | None = None
    comm_dtype: CommDtype = CommDtype.FP32
    rounds: int = 20


@dataclass(frozen=True)
class PlanReport:
    """A plan, its simulation and the baselines' simulated step times.

    Attributes:
        request: what was asked.
        workload, topology: the resolved presets.
        plan: the plan made (or loaded).
        result: its simulation.
        baselines: simulated step ms of each baseline (``None``: it does not fit).
        planning_s: seconds spent planning (or loading).
    """

    request: PlanRequest
    workload: Workload
    topology: Topology
    plan: ShardingPlan
    result: SimResult
    baselines: dict[str, float | None]
    planning_s: float

    def stats_table(self) -> str:
        """The per-GPU stats table with the costliest tables and the baselines."""
        return format_stats(self.plan, self.result, self.baselines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: the request, ``simulated_step_ms``, ``per_gpu``, ... (the
        simulation's fields), ``top_tables``, ``baselines`` and ``plan``."""
        return {
            "workload": self.workload.name,
            "topology": self.topology.name,
            "nodes": self.topology.num_nodes,
            "world_size": self.topology.world_size,
            "batch_size": self.request.batch_size,
            "strategy": self.request.strategy,
            "comm_dtype": self.request.comm_dtype.value,
            "planning_s": self.planning_s,
            **self.result.to_dict(),
            "top_tables": [{"name": n, "ms": ms} for n, ms in top_tables(self.result)],
            "baselines": self.baselines,
            "plan": self.plan.to_dict(),
        }


def plan_and_rate(req: PlanRequest) -> PlanReport:
    """Plan ``req.workload`` on ``req.topology`` (or load ``req.strategy``'s file and check
    its memory), simulate it and every baseline.

    Raises:
        PlanError: the workload does not fit, or a plan or constraints file breaks a rule.
        ValueError: the topology, cost model or constraints reject the combination (e.g.
            ``cpu-local`` with 2 nodes, a batch smaller than the world, an unknown table).
        FileNotFoundError: a constraints file does not exist.
        ValueError: ``req.strategy`` is neither a strategy nor an existing file (listing the
            strategies).
    """
    if req.strategy not in STRATEGIES and not Path(req.strategy).is_file():
        raise ValueError(
            f"strategy {req.strategy!r} is not one of {', '.join(STRATEGIES)}, and no plan "
            "file of that name exists"
        )
    workload = get_workload(req.workload)
    topology = get_topology(req.topology, req.nodes)
    model = CostModel(workload, topology, req.batch_size)
    cons = load_constraints(req.constraints, workload) if req.constraints else None
    t0 = time.perf_counter()
    if req.strategy in STRATEGIES:
        plan = plan_sharding(
            workload, topology, req.batch_size, req.strategy, cons, req.comm_dtype, req.rounds
        )
    else:
        plan = load_plan(req.strategy, workload, topology)
        check_memory(plan, model)
    planning_s = time.perf_counter() - t0
    baselines: dict[str, float | None] = {}
    for name, fn in BASELINES.items():
        try:
            baselines[name] = simulate(fn(model, req.comm_dtype), model).step_ms
        except PlanError as e:
            log.info("baseline %s: %s", name, e)
            baselines[name] = None
    return PlanReport(req, workload, topology, plan, simulate(plan, model), baselines, planning_s)
