"""Rate any sharding plan on any topology: per-iteration time with a per-rank breakdown.

>>> model = CostModel(get_workload("t200"), get_topology("dgx-h100", 1), 65536)
>>> simulate(plan, model).step_ms           # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np

from embark.planner.cost import NUM_CHANNELS, CostModel
from embark.planner.types import GpuStats, SimResult, format_bytes
from embark.types import Cluster, PlanError, ShardingPlan


def check_plan(plan: ShardingPlan, model: CostModel) -> None:
    """Check ``plan`` matches the model's workload and topology.

    Raises:
        PlanError: missing/unknown/mis-shaped tables (from :meth:`ShardingPlan.check_tables`).
        PlanError: world size or node size differ from the topology.
    """
    plan.check_tables(model.workload.tables)
    if plan.world_size != model.world or plan.gpus_per_node != model.gpn:
        raise PlanError(
            f"plan is for {plan.world_size} ranks ({plan.gpus_per_node} per node) but the "
            f"topology {model.topology.name!r} has {model.world} ({model.gpn} per node)"
        )


def check_memory(plan: ShardingPlan, model: CostModel) -> np.ndarray:
    """Per-rank bytes ``(W,)``; raises :class:`PlanError` naming the first rank over the
    cap, by how much, and its largest tables."""
    mem = np.zeros(model.world)
    for ts in plan.tables:
        mem += model.memory(ts)
    cap = model.memory_cap_bytes
    over = np.nonzero(mem > cap)[0]
    if over.size:
        r = int(over[0])
        big = sorted(
            ((float(model.memory(ts)[r]), ts.name) for ts in plan.tables if r in ts.ranks),
            reverse=True,
        )[:3]
        raise PlanError(
            f"rank {r} needs {format_bytes(mem[r])} of weights + optimizer state but holds "
            f"{format_bytes(cap)} (over by {format_bytes(mem[r] - cap)}; largest tables there: "
            + ", ".join(f"{n!r} {format_bytes(b)}" for b, n in big)
            + ")"
        )
    return mem


def simulate(plan: ShardingPlan, model: CostModel) -> SimResult:
    """Simulated iteration of ``plan`` (see :class:`SimResult` for the timing rules).

    Memory over the cap is reported (``fits_memory=False``), not raised: any plan can be rated.
    """
    check_plan(plan, model)
    acc = np.zeros((model.world, NUM_CHANNELS))
    mem = np.zeros(model.world)
    tables = np.zeros(model.world, dtype=np.int64)
    shards = np.zeros(model.world, dtype=np.int64)
    table_ms: dict[str, float] = {}
    for ts in plan.tables:
        tr = model.traffic(ts)
        acc += tr
        mem += model.memory(ts)
        ph = model.phase_times(tr, latency=False)
        table_ms[ts.name] = 1e3 * float(sum(v.max() for v in ph.values()))
        ranks = sorted(set(ts.ranks))
        tables[ranks] += 1
        if ts.cluster is not Cluster.DP:
            np.add.at(shards, list(ts.ranks), 1)
    step, step_no, emb = model.step_seconds(acc)
    ph = model.phase_times(acc)
    cap = model.memory_cap_bytes
    per_gpu = tuple(
        GpuStats(
            rank=r,
            memory_bytes=float(mem[r]),
            memory_cap_bytes=cap,
            lookup_fwd_ms=1e3 * float(ph["lookup_fwd"][r]),
            lookup_bwd_ms=1e3 * float(ph["lookup_bwd"][r]),
            input_a2a_ms=1e3 * float(ph["input_a2a"][r]),
            output_a2a_ms=1e3 * float(ph["output_a2a"][r]),
            grad_a2a_ms=1e3 * float(ph["grad_a2a"][r]),
            dp_allreduce_ms=1e3 * float(ph["dp_allreduce"][r]),
            num_tables=int(tables[r]),
            num_shards=int(shards[r]),
        )
        for r in range(model.world)
    )
    return SimResult(
        step_ms=1e3 * step,
        step_ms_no_overlap=1e3 * step_no,
        embedding_ms=1e3 * emb,
        dense_ms=1e3 * model.dense_seconds(),
        phases_ms={k: 1e3 * float(v.max()) for k, v in ph.items()},
        per_gpu=per_gpu,
        table_ms=table_ms,
        fits_memory=bool((mem <= cap).all()),
    )
