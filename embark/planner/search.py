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
from dataclasses import dataclass, field, replace

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


@dataclass
class _Search:
    """The plan under search and its per-table traffic and memory, with their sums."""

    model: CostModel
    cons: dict[str, TableConstraints]
    tables: list[TableSharding]
    traffic: list[np.ndarray] = field(init=False)
    memory: list[np.ndarray] = field(init=False)
    acc: np.ndarray = field(init=False)
    mem: np.ndarray = field(init=False)
    best: tuple[float, float] = field(init=False)

    def __post_init__(self) -> None:
        model, world = self.model, self.model.world
        self.traffic = [model.traffic(ts) for ts in self.tables]
        self.memory = [model.memory(ts) for ts in self.tables]
        self.acc = np.sum(self.traffic, axis=0) if self.tables else np.zeros((world, NUM_CHANNELS))
        self.mem = np.sum(self.memory, axis=0)
        self.best = self.score(self.acc)

    def score(self, a: np.ndarray) -> tuple[float, float]:
        step, _, emb = self.model.step_seconds(a)
        return (round(step, 12), round(emb, 12))

    def legal(self, ts: TableSharding) -> bool:
        c = self.cons.get(ts.name)
        if c is None:
            return True
        if c.ranks is not None and not set(ts.ranks) <= set(c.ranks):
            return False
        if c.cluster is not None and ts.cluster is not c.cluster:
            return False
        return c.allows(ts.sharding_type)

    def retype(self) -> None:
        """Replicate a sharded table, or flip its cluster, where the simulator says so (the
        greedy decides both per table in isolation); smallest tables first."""
        model, cap, world = self.model, self.model.memory_cap_bytes, self.model.world
        tables = self.tables
        by_size = sorted(range(len(tables)), key=lambda i: (tables[i].num_rows * tables[i].dim, i))
        for i in by_size:
            ts = tables[i]
            if ts.cluster is Cluster.DP:
                continue
            flipped = Cluster.UNIQUE if ts.cluster is Cluster.REDUCTION else Cluster.REDUCTION
            full = Shard(0, 0, ts.num_rows, 0, ts.dim)
            replicated = replace(
                ts,
                sharding_type=ShardingType.DP,
                cluster=Cluster.DP,
                shards=tuple(replace(full, rank=r) for r in range(world)),
            )
            for cand_ts in (replace(ts, cluster=flipped), replicated):
                m_new = model.memory(cand_ts)
                new_mem = self.mem - self.memory[i] + m_new
                if new_mem.max() > cap or not self.legal(cand_ts):
                    continue
                t_new = model.traffic(cand_ts)
                cand = self.acc - self.traffic[i] + t_new
                sc = self.score(cand)
                if sc < self.best:
                    tables[i], self.traffic[i], self.memory[i] = cand_ts, t_new, m_new
                    self.acc, self.mem, self.best = cand, new_mem, sc
                    if cand_ts.cluster is Cluster.DP:
                        break

    def improve(self, shards_per_pass: int, targets_per_pass: int, swaps_per_shard: int) -> bool:
        """One pass: move (or swap) one of the costliest shards of the slowest rank of the
        costliest phase to one of the least loaded ranks; whether anything improved."""
        model = self.model
        phases = model.phase_times(self.acc)
        per_rank = sum(phases.values())
        # the slowest rank of the phase that costs most (collectives wait for it)
        worst = max(phases, key=lambda k: (float(phases[k].max()), k))
        src = int(np.argmax(phases[worst]))
        order = [int(r) for r in np.argsort(per_rank, kind="stable") if r != src][:targets_per_pass]
        costs: list[tuple[float, int]] = []
        for i, ts in enumerate(self.tables):
            if ts.cluster is Cluster.DP or src not in ts.ranks:
                continue
            times = model.phase_times(self.traffic[i], latency=False)
            costs.append((-float(sum(v[src] for v in times.values())), i))
        for _, i in sorted(costs)[:shards_per_pass]:
            for dst in order:
                if dst not in self.tables[i].ranks and self._move(i, src, dst, swaps_per_shard):
                    return True
        return False

    def _move(self, i: int, src: int, dst: int, swaps: int) -> bool:
        """Move table ``i``'s shard from ``src`` to ``dst``, or else swap it with one of the
        costliest shards on ``dst`` whose table is not on ``src``; whether one was applied."""
        model, cap, tables = self.model, self.model.memory_cap_bytes, self.tables
        moved = _with_rank(tables[i], src, dst, model.world, model.gpn)
        m_new = model.memory(moved)
        if (self.mem - self.memory[i] + m_new)[dst] > cap or not self.legal(moved):
            return False
        t_new = model.traffic(moved)
        cand = self.acc - self.traffic[i] + t_new
        sc = self.score(cand)
        if sc < self.best:
            tables[i], self.traffic[i], self.acc, self.best = moved, t_new, cand, sc
            self.mem = self.mem - self.memory[i] + m_new
            self.memory[i] = m_new
            return True
        on_dst = [
            (-float(self.traffic[j][dst, :2].sum()), j)
            for j, other in enumerate(tables)
            if j != i
            and other.cluster is not Cluster.DP
            and dst in other.ranks
            and src not in other.ranks
        ]
        for _, j in sorted(on_dst)[:swaps]:
            o_moved = _with_rank(tables[j], dst, src, model.world, model.gpn)
            om_new = model.memory(o_moved)
            new_mem = self.mem - self.memory[i] - self.memory[j] + m_new + om_new
            if new_mem[src] > cap or new_mem[dst] > cap or not self.legal(o_moved):
                continue
            ot_new = model.traffic(o_moved)
            cand2 = cand - self.traffic[j] + ot_new
            sc = self.score(cand2)
            if sc < self.best:
                tables[i], self.traffic[i], self.memory[i] = moved, t_new, m_new
                tables[j], self.traffic[j], self.memory[j] = o_moved, ot_new, om_new
                self.acc, self.best, self.mem = cand2, sc, new_mem
                return True
        return False


def local_search(
    plan: ShardingPlan,
    model: CostModel,
    constraints: dict[str, TableConstraints] | None = None,
    max_passes: int = 60,
    shards_per_pass: int = 8,
    targets_per_pass: int = 3,
    swaps_per_shard: int = 4,
) -> ShardingPlan:
    """Improve ``plan`` by re-typing tables, then shard moves and swaps (see the module
    docstring), for at most ``max_passes`` passes."""
    search = _Search(model, constraints or {}, list(plan.tables))
    search.retype()
    for _ in range(max_passes):
        if not search.improve(shards_per_pass, targets_per_pass, swaps_per_shard):
            break
    log.info("local search: simulated step %.3f ms", search.best[0] * 1e3)
    return ShardingPlan(model.world, model.gpn, tuple(search.tables), plan.topology)


__all__ = ["local_search"]
