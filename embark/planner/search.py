"""Local search after the greedy: move or swap shards between the most and the least loaded
ranks while the simulated step time falls.

First each sharded table, smallest first, may be replicated (data parallel) or switch
cluster if that lowers the simulated step. Then each pass takes the slowest rank of the
costliest phase, tries moving each of its costliest shards to the least
loaded ranks, then swapping them with shards there, and applies the first change that lowers
``(step time, embedding time)``. Moves keep the rules of a plan (no two shards of a table on
one rank, memory caps, pinned ranks, allowed sharding types); a table's sharding type is
re-derived from its new layout. Deterministic: candidates are visited in a fixed order and
the pass budget is a count, not a clock.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from embark.planner.cost import NUM_CHANNELS, CostModel
from embark.planner.layout import classify, grid_of
from embark.planner.types import TableConstraints
from embark.types import Cluster, Shard, ShardingPlan, ShardingType, TableSharding

log = logging.getLogger(__name__)


def _with_rank(ts: TableSharding, old: int, new: int, world: int, gpn: int) -> TableSharding:
    shards = tuple(replace(s, rank=new) if s.rank == old else s for s in ts.shards)
    tmp = replace(ts, shards=shards)
    return replace(tmp, sharding_type=classify(grid_of(tmp), world, gpn, ts.cluster))


def local_search(
    plan: ShardingPlan,
    model: CostModel,
    constraints: dict[str, TableConstraints] | None = None,
    max_passes: int = 60,
    shards_per_pass: int = 8,
    targets_per_pass: int = 3,
    swaps_per_shard: int = 4,
) -> ShardingPlan:
    """Improve ``plan`` by shard moves and swaps (see the module docstring)."""
    cons = constraints or {}
    world, gpn = model.world, model.gpn
    cap = model.memory_cap_bytes
    tables = list(plan.tables)
    traffic = [model.traffic(ts) for ts in tables]
    memory = [model.memory(ts) for ts in tables]
    acc = np.sum(traffic, axis=0) if tables else np.zeros((world, NUM_CHANNELS))
    mem = np.sum(memory, axis=0)

    def score(a: np.ndarray) -> tuple[float, float]:
        step, _, emb = model.step_seconds(a)
        return (round(step, 12), round(emb, 12))

    def legal(i: int, ts: TableSharding) -> bool:
        c = cons.get(ts.name)
        if c is None:
            return True
        if c.ranks is not None and not set(ts.ranks) <= set(c.ranks):
            return False
        if c.cluster is not None and ts.cluster is not c.cluster:
            return False
        return c.allows(ts.sharding_type)

    best = score(acc)
    # Re-type pass: replicate a sharded table, or flip its cluster, where the simulator
    # says so (the greedy decides both per table in isolation).
    by_size = sorted(range(len(tables)), key=lambda i: (tables[i].num_rows * tables[i].dim, i))
    for i in by_size:
        ts = tables[i]
        if ts.cluster is Cluster.DP:
            continue
        options = [
            replace(
                ts, cluster=Cluster.UNIQUE if ts.cluster is Cluster.REDUCTION else Cluster.REDUCTION
            )
        ]
        full = Shard(0, 0, ts.num_rows, 0, ts.dim)
        options.append(
            replace(
                ts,
                sharding_type=ShardingType.DP,
                cluster=Cluster.DP,
                shards=tuple(replace(full, rank=r) for r in range(world)),
            )
        )
        for cand_ts in options:
            m_new = model.memory(cand_ts)
            new_mem = mem - memory[i] + m_new
            if new_mem.max() > cap or not legal(i, cand_ts):
                continue
            t_new = model.traffic(cand_ts)
            cand = acc - traffic[i] + t_new
            sc = score(cand)
            if sc < best:
                tables[i], traffic[i], memory[i], acc, mem, best = (
                    cand_ts,
                    t_new,
                    m_new,
                    cand,
                    new_mem,
                    sc,
                )
                ts = cand_ts
                if ts.cluster is Cluster.DP:
                    break
    for _ in range(max_passes):
        phases = model.phase_times(acc)
        per_rank = sum(phases.values())
        # the slowest rank of the phase that costs most (collectives wait for it)
        worst = max(phases, key=lambda k: (float(phases[k].max()), k))
        src = int(np.argmax(phases[worst]))
        order = [int(r) for r in np.argsort(per_rank, kind="stable") if r != src][:targets_per_pass]
        on_src = []
        for i, ts in enumerate(tables):
            if ts.cluster is Cluster.DP or src not in ts.ranks:
                continue
            cost = float(sum(v[src] for v in model.phase_times(traffic[i], latency=False).values()))
            on_src.append((-cost, i))
        on_src = [i for _, i in sorted(on_src)[:shards_per_pass]]
        improved = False
        for i in on_src:
            ts = tables[i]
            for dst in order:
                if dst in ts.ranks:
                    continue
                moved = _with_rank(ts, src, dst, world, gpn)
                m_new = model.memory(moved)
                if (mem - memory[i] + m_new)[dst] > cap or not legal(i, moved):
                    continue
                t_new = model.traffic(moved)
                cand = acc - traffic[i] + t_new
                sc = score(cand)
                if sc < best:
                    tables[i], traffic[i], acc, best = moved, t_new, cand, sc
                    mem = mem - memory[i] + m_new
                    memory[i] = m_new
                    improved = True
                    break
                # swap with one of the costliest shards on dst whose table is not on src
                on_dst = [
                    (-float(traffic[j][dst, :2].sum()), j)
                    for j, other in enumerate(tables)
                    if j != i
                    and other.cluster is not Cluster.DP
                    and dst in other.ranks
                    and src not in other.ranks
                ]
                for _, j in sorted(on_dst)[:swaps_per_shard]:
                    other = tables[j]
                    o_moved = _with_rank(other, dst, src, world, gpn)
                    om_new = model.memory(o_moved)
                    new_mem = mem - memory[i] - memory[j] + m_new + om_new
                    if new_mem[src] > cap or new_mem[dst] > cap or not legal(j, o_moved):
                        continue
                    ot_new = model.traffic(o_moved)
                    cand2 = cand - traffic[j] + ot_new
                    sc = score(cand2)
                    if sc < best:
                        tables[i], traffic[i], memory[i] = moved, t_new, m_new
                        tables[j], traffic[j], memory[j] = o_moved, ot_new, om_new
                        acc, best, mem = cand2, sc, new_mem
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break
        if not improved:
            break
    log.info("local search: simulated step %.3f ms", best[0] * 1e3)
    return ShardingPlan(world, gpn, tuple(tables), plan.topology)


__all__ = ["local_search"]
