"""EMBark's greedy planner.

One round places every table's shards, hottest first, each on the least-loaded rank(s) with
room; a table split ``k`` ways by rows (``k ≤ gpus_per_node``: ranks of one node; more:
whole nodes) and ``n`` ways by columns gives ``n`` groups of ``k`` row shards. After each
round the simulator rates the plan; then the costliest table on the bottleneck rank is
split further (rows doubled, or columns doubled, whichever the simulator prefers) and the
next round starts. After ``rounds`` rounds the best plan is kept. Per table the cluster
(reduction, unique, data parallel) is the one with the lowest modelled cost for its split.
Everything is deterministic: ties break on rank and table order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from embark.planner.cost import NUM_CHANNELS, CostModel
from embark.planner.layout import even_splits, make_sharding
from embark.planner.types import TableConstraints, format_bytes
from embark.types import (
    Cluster,
    CommDtype,
    PlanError,
    ShardingPlan,
    ShardingType,
    TableConfig,
    TableSharding,
)

log = logging.getLogger(__name__)

DP_MEMORY_FRACTION = 0.2  # share of each GPU's table memory that replicas may take (assumed)


@dataclass(frozen=True)
class Split:
    """Row split ``k``, column split ``n`` and cluster of one sharded table."""

    k: int
    n: int
    cluster: Cluster


def split_type(k: int, n: int, world: int, gpn: int) -> ShardingType:
    """The sharding type the greedy's layout for ``(k, n)`` gets."""
    if k == 1:
        return ShardingType.TW if n == 1 else ShardingType.CW
    if n == 1:
        return (
            ShardingType.RW
            if k == world
            else (ShardingType.TRW if k <= gpn else ShardingType.THREE_D)
        )
    return ShardingType.THREE_D


class GreedyPlanner:
    """See the module docstring.

    Args:
        model: the cost model (workload, topology, batch).
        constraints: per-table :class:`TableConstraints` by table name.
        comm_dtype: wire dtype of every sharded table.
        rounds: split-and-replace rounds after the first placement (EMBark uses ~20); an
            integer >= 0.

    Raises:
        PlanError: for a negative or non-integer ``rounds`` or constraints naming an unknown
            table or rank.
    """

    def __init__(
        self,
        model: CostModel,
        constraints: dict[str, TableConstraints] | None = None,
        comm_dtype: CommDtype = CommDtype.FP32,
        rounds: int = 20,
    ) -> None:
        self.m = model
        self.cons = dict(constraints or {})
        self.dtype = CommDtype(comm_dtype)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise PlanError(f"rounds must be an integer >= 0, got {rounds!r}")
        self.rounds = rounds
        self.tables = {t.name: t for t in model.workload.tables}
        for name, c in self.cons.items():
            if name not in self.tables:
                raise PlanError(f"constraints name table {name!r}, which is not in the workload")
            if c.ranks is not None and max(c.ranks) >= model.world:
                raise PlanError(
                    f"table {name!r}: pinned rank {max(c.ranks)} but the topology has ranks "
                    f"0..{model.world - 1}"
                )
        self._owner_cost: dict[tuple[str, int, int, Cluster], float] = {}
        self._blocks: dict[tuple[str, int, int, Cluster], np.ndarray] = {}
        self._dp_cache: dict[tuple[str, ...], np.ndarray] = {}
        # _swap[n]: the rank map exchanging node 0 and node n
        g = model.gpn
        self._swap = []
        for n in range(model.nodes):
            nm = np.arange(model.nodes)
            nm[0], nm[n] = n, 0
            self._swap.append((nm[:, None] * g + np.arange(g)[None, :]).reshape(-1))

    # -- options ---------------------------------------------------------------------------
    def _cons(self, name: str) -> TableConstraints:
        return self.cons.get(name, TableConstraints())

    def _row_options(self, t: TableConfig) -> list[int]:
        g, w = self.m.gpn, self.m.world
        ks = [1]
        while ks[-1] * 2 <= g:
            ks.append(ks[-1] * 2)
        if ks[-1] != g:
            ks.append(g)
        q = 2
        while q * g <= w:
            ks.append(q * g)
            q *= 2
        if ks[-1] != w:
            ks.append(w)
        pinned = self._cons(t.name).ranks
        limit = len(pinned) if pinned is not None else w
        return [k for k in ks if k <= t.num_rows and k <= limit]

    def _col_options(self, t: TableConfig) -> list[int]:
        ns, n = [1], 2
        while t.dim % n == 0 and t.dim // n >= self.m.c.min_column_block:
            ns.append(n)
            n *= 2
        return ns

    def _allowed(self, t: TableConfig, k: int, n: int) -> bool:
        c = self._cons(t.name)
        if k * n > (len(c.ranks) if c.ranks is not None else self.m.world):
            return False
        if c.cluster is Cluster.DP:
            return False
        return c.allows(split_type(k, n, self.m.world, self.m.gpn))

    def _canonical(self, t: TableConfig, k: int, n: int, cluster: Cluster) -> TableSharding:
        grid = [[j * k + i for i in range(k)] for j in range(n)]
        return make_sharding(t, grid, cluster, self.dtype, self.m.world, self.m.gpn)

    def owner_cost(self, t: TableConfig, k: int, n: int, cluster: Cluster) -> float:
        """Seconds one owner of a ``(k, n)`` shard of ``t`` spends per iteration."""
        key = (t.name, k, n, cluster)
        if key not in self._owner_cost:
            ph = self.m.phase_times(
                self.m.traffic(self._canonical(t, k, n, cluster)), latency=False
            )
            self._owner_cost[key] = float(sum(v[0] for v in ph.values()))
        return self._owner_cost[key]

    def _table_total(self, ts: TableSharding) -> float:
        ph = self.m.phase_times(self.m.traffic(ts), latency=False)
        return float(sum(v.max() for v in ph.values()))

    def _table_work(self, ts: TableSharding) -> float:
        """Rank-seconds ``ts`` costs summed over all ranks (what balancing can spread)."""
        ph = self.m.phase_times(self.m.traffic(ts), latency=False)
        return float(sum(v.sum() for v in ph.values()))

    def choose_cluster(self, t: TableConfig, k: int, n: int) -> Cluster:
        forced = self._cons(t.name).cluster
        if forced is not None:
            return forced
        costs = {
            cl: self._table_total(self._canonical(t, k, n, cl))
            for cl in (Cluster.REDUCTION, Cluster.UNIQUE)
        }
        return min(costs, key=lambda cl: (costs[cl], cl.value))

    def shard_bytes(self, t: TableConfig, k: int, n: int) -> float:
        return -(-t.num_rows // k) * -(-t.dim // n) * self.m.bytes_per_element()

    # -- data parallel choice --------------------------------------------------------------
    def choose_dp(self) -> list[str]:
        """Tables replicated: those whose DP cost beats table-wise, cheapest memory first,
        within ``DP_MEMORY_FRACTION`` of a GPU (or all allowed ones when forced)."""
        per = self.m.bytes_per_element()
        slack = (
            self.m.memory_cap_bytes
            - sum(t.num_rows * t.dim for t in self.m.workload.tables) * per / self.m.world
        )
        budget = min(DP_MEMORY_FRACTION * self.m.memory_cap_bytes, max(0.0, slack / 2))
        limit = budget
        chosen, cands = [], []
        for t in self.m.workload.tables:
            c = self._cons(t.name)
            full = t.num_rows * t.dim * self.m.bytes_per_element()
            if c.cluster is Cluster.DP or c.sharding_types == (ShardingType.DP,):
                chosen.append(t.name)
                budget -= full
                continue
            if not c.allows(ShardingType.DP) or c.ranks is not None or c.cluster is not None:
                continue
            dp = self._table_work(
                make_sharding(t, [], Cluster.DP, self.dtype, self.m.world, self.m.gpn)
            )
            if not self._row_options(t):
                continue
            tw = min(
                self._table_work(self._canonical(t, 1, 1, cl))
                for cl in (Cluster.REDUCTION, Cluster.UNIQUE)
            )
            if dp < tw:
                cands.append((full, t.name))
        for full, name in sorted(cands):
            if full <= budget:
                chosen.append(name)
                budget -= full
        if budget < 0:
            raise PlanError(
                f"data-parallel tables forced by constraints need {format_bytes(limit - budget)} "
                f"per GPU, over the {format_bytes(limit)} replica budget by {format_bytes(-budget)}"
            )
        return chosen

    # -- one round ---------------------------------------------------------------------------
    def place(
        self, splits: dict[str, Split], dp: list[str]
    ) -> tuple[dict[str, list[list[int]]] | None, str | None]:
        """Place every shard; returns ``(grids, None)`` (ranks of each column block per
        table) or ``(None, name of a table that did not fit)``."""
        m = self.m
        g, world = m.gpn, m.world
        cap = m.memory_cap_bytes
        mem = np.zeros(world)
        for name in dp:
            t = self.tables[name]
            mem += t.num_rows * t.dim * m.bytes_per_element()
        load = np.zeros(world)
        holds: dict[str, set[int]] = {name: set() for name in splits}
        groups = []
        for i, t in enumerate(m.workload.tables):
            if t.name not in splits:
                continue
            s = splits[t.name]
            cost = self.owner_cost(t, s.k, s.n, s.cluster)
            for j in range(s.n):
                groups.append((-cost, i, j, t, s, cost))
        groups.sort(key=lambda x: x[:3])
        grids: dict[str, list[list[int]]] = {name: [] for name in splits}
        all_ranks = np.arange(world)
        for _, _, _, t, s, cost in groups:
            need = self.shard_bytes(t, s.k, s.n)
            pinned = self._cons(t.name).ranks
            ok = mem + need <= cap
            ok[list(holds[t.name])] = False
            if pinned is not None:
                ok &= np.isin(all_ranks, pinned)
            chosen: list[int] | None = None
            if s.k <= g:
                masked = np.where(ok, load, np.inf).reshape(m.nodes, g)
                # stable: equal loads keep rank order
                order = np.argsort(masked, axis=1, kind="stable")[:, : s.k]
                kth = masked[np.arange(m.nodes), order[:, -1]]
                node = int(np.argmin(kth))
                if np.isfinite(kth[node]):
                    chosen = sorted(int(node * g + j) for j in order[node])
            else:
                full = [n for n in range(m.nodes) if ok[n * g : n * g + g].all()]
                q = s.k // g
                if len(full) >= q:
                    full.sort(key=lambda n: (load[n * g : n * g + g].sum(), n))
                    chosen = [r for n in sorted(full[:q]) for r in range(n * g, n * g + g)]
            if chosen is None:
                return None, t.name
            load[chosen] += cost
            mem[chosen] += need
            holds[t.name].update(chosen)
            grids[t.name].append(chosen)
        return grids, None

    def build(self, grids: dict[str, list[list[int]]], splits: dict[str, Split]) -> ShardingPlan:
        """The :class:`ShardingPlan` of a placement (DP for tables without a grid)."""
        m = self.m
        out = []
        for t in m.workload.tables:
            if t.name in grids:
                out.append(
                    make_sharding(
                        t, grids[t.name], splits[t.name].cluster, self.dtype, m.world, m.gpn
                    )
                )
            else:
                out.append(make_sharding(t, [], Cluster.DP, self.dtype, m.world, m.gpn))
        return ShardingPlan(m.world, m.gpn, tuple(out), m.topology.name)

    def _canonical_block(self, t: TableConfig, k: int, n: int, cluster: Cluster) -> np.ndarray:
        key = (t.name, k, n, cluster)
        tr = self._blocks.get(key)
        if tr is None:
            frac = (
                np.array([b - a for a, b in even_splits(t.num_rows, k)], dtype=np.float64)
                / t.num_rows
            )
            tr = self.m.block_traffic(
                t.name, cluster, self.dtype.nbytes, t.dim // n, np.arange(k), frac
            )
            self._blocks[key] = tr
        return tr

    def _perm(self, ranks: list[int]) -> np.ndarray:
        """Rank map ``p`` with ``actual[r] = canonical[p[r]]``: the canonical layout puts the
        ``k`` owners on ranks ``0..k-1``; traffic only depends on which ranks share a node,
        so any node-preserving relabelling carries it over exactly."""
        g, nodes = self.m.gpn, self.m.nodes
        k = len(ranks)
        if k <= g:
            node = ranks[0] // g
            perm = self._swap[node].copy()
            local = [r - node * g for r in ranks]
            taken = set(local)
            others = [j for j in range(g) if j not in taken]
            perm[node * g + np.array(local + others)] = np.arange(g)
            return perm
        owner_nodes = sorted({r // g for r in ranks})
        rest = [nd for nd in range(nodes) if nd not in owner_nodes]
        canon = {nd: i for i, nd in enumerate(owner_nodes + rest)}
        perm = np.empty(self.m.world, dtype=np.int64)
        for nd in range(nodes):
            perm[nd * g : nd * g + g] = np.arange(canon[nd] * g, canon[nd] * g + g)
        return perm

    def grid_traffic(self, name: str, grid: list[list[int]], split: Split) -> np.ndarray:
        """Traffic of a placed table, from permuted canonical blocks (equal to
        :meth:`CostModel.traffic` of its layout; tested)."""
        t = self.tables[name]
        out = np.zeros((self.m.world, NUM_CHANNELS))
        base = self._canonical_block(t, split.k, split.n, split.cluster)
        for ranks in grid:
            out += base[self._perm(ranks)]
        return out

    def _dp_bytes(self, dp: list[str]) -> float:
        return (
            sum(self.tables[n].num_rows * self.tables[n].dim for n in dp)
            * self.m.bytes_per_element()
        )

    def _dp_traffic(self, dp: list[str]) -> np.ndarray:
        key = tuple(dp)
        if key not in self._dp_cache:
            acc = np.zeros((self.m.world, NUM_CHANNELS))
            for name in dp:
                t = self.tables[name]
                acc += self.m.traffic(
                    make_sharding(t, [], Cluster.DP, self.dtype, self.m.world, self.m.gpn)
                )
            self._dp_cache[key] = acc
        return self._dp_cache[key]

    def evaluate(
        self, grids: dict[str, list[list[int]]], splits: dict[str, Split], dp: list[str]
    ) -> tuple[tuple[float, float], np.ndarray, dict[str, np.ndarray]]:
        """``((step s, embedding s), per-rank seconds (W,), traffic per sharded table)``."""
        per_table = {name: self.grid_traffic(name, g, splits[name]) for name, g in grids.items()}
        acc = self._dp_traffic(dp) + (sum(per_table.values()) if per_table else 0.0)
        step, _, emb = self.m.step_seconds(acc)
        per_rank = np.asarray(sum(self.m.phase_times(acc).values()))
        return (round(step, 12), round(emb, 12)), per_rank, per_table

    # -- the search ----------------------------------------------------------------------------
    def initial_splits(self, dp: list[str], rows_per_node: bool = False) -> dict[str, Split]:
        """Starting splits: the fewest shards whose size is at most half a GPU; with
        ``rows_per_node`` the table-row-wise start (rows over one node's GPUs) instead."""
        splits = {}
        cap = self.m.memory_cap_bytes
        for t in self.m.workload.tables:
            if t.name in dp:
                continue
            opts = [
                (k * n, n, k)
                for k in self._row_options(t)
                for n in self._col_options(t)
                if self._allowed(t, k, n)
            ]
            if not opts:
                raise PlanError(
                    f"table {t.name!r}: no layout satisfies its constraints "
                    f"({self._cons(t.name)}) on {self.m.world} ranks"
                )
            opts.sort()
            room = cap - self._dp_bytes(dp)
            smallest = min(self.shard_bytes(t, k, n) for _, n, k in opts)
            if smallest > room:
                k, n = max(
                    (o[2], o[1]) for o in opts if self.shard_bytes(t, o[2], o[1]) == smallest
                )
                raise PlanError(
                    f"table {t.name!r} ({format_bytes(t.num_rows * t.dim * self.m.bytes_per_element())} "
                    f"with optimizer state) does not fit: its finest allowed split ({k}×{n}) needs "
                    f"{format_bytes(smallest)} per shard but a GPU holds {format_bytes(room)} "
                    f"(short by {format_bytes(smallest - room)})"
                )
            fit = [o for o in opts if self.shard_bytes(t, o[2], o[1]) <= cap / 2] or [opts[-1]]
            if rows_per_node:
                fit = [o for o in fit if o[1] == 1 and o[2] >= min(self.m.gpn, t.num_rows)] or fit
            _, n, k = fit[0]
            splits[t.name] = Split(k, n, self.choose_cluster(t, k, n))
        return splits

    def _grow(self, t: TableConfig, s: Split) -> list[Split]:
        """Candidate next splits of ``t``: rows doubled, columns doubled."""
        out = []
        ks = [k for k in self._row_options(t) if k > s.k and self._allowed(t, k, s.n)]
        if ks:
            out.append(Split(ks[0], s.n, self.choose_cluster(t, ks[0], s.n)))
        ns = [n for n in self._col_options(t) if n > s.n and self._allowed(t, s.k, n)]
        if ns:
            out.append(Split(s.k, ns[0], self.choose_cluster(t, s.k, ns[0])))
        return out

    def _fit(self, splits: dict[str, Split], dp: list[str]) -> dict[str, list[list[int]]]:
        """Place, splitting the table that did not fit further until everything fits."""
        for _ in range(2 * len(splits) + 10):
            grids, failed = self.place(splits, dp)
            if grids is not None:
                return grids
            assert failed is not None
            t = self.tables[failed]
            grow = self._grow(t, splits[failed])
            if not grow:
                # split the largest shards that still can be, to free room for this one
                growable = [
                    (-self.shard_bytes(self.tables[n], s.k, s.n), i, n)
                    for i, (n, s) in enumerate(splits.items())
                    if self._grow(self.tables[n], s)
                ]
                if not growable:
                    need = t.num_rows * t.dim * self.m.bytes_per_element()
                    shard = self.shard_bytes(t, splits[failed].k, splits[failed].n)
                    raise PlanError(
                        f"table {failed!r} ({format_bytes(need)} with optimizer state) does not fit: "
                        f"split {splits[failed].k}×{splits[failed].n} ways it needs {format_bytes(shard)} "
                        f"per shard, and no rank set with room is left (per-GPU cap "
                        f"{format_bytes(self.m.memory_cap_bytes)}; short by at least "
                        f"{format_bytes(max(shard - (self.m.memory_cap_bytes - self._dp_bytes(dp)), 0.0))} "
                        f"on an empty GPU)"
                    )
                failed = min(growable)[2]
                grow = self._grow(self.tables[failed], splits[failed])
            splits[failed] = min(grow, key=lambda s: (s.k * s.n, s.k))
        raise PlanError("greedy placement did not converge")  # pragma: no cover

    def plan(self) -> ShardingPlan:
        m = self.m
        total = sum(t.num_rows * t.dim for t in m.workload.tables) * m.bytes_per_element()
        have = m.memory_cap_bytes * m.world
        if total > have:
            raise PlanError(
                f"workload {m.workload.name!r} needs {format_bytes(total)} of weights + optimizer "
                f"state but {m.world} GPUs hold {format_bytes(have)} (short by {format_bytes(total - have)})"
            )
        dp = self.choose_dp()
        best = None
        for rows_per_node in (False, True):
            splits = self.initial_splits(dp, rows_per_node)
            grids = self._fit(splits, dp)
            cand = self._rounds(grids, splits, dp)
            if best is None or cand[0] < best[0]:
                best = cand
        assert best is not None
        log.info("greedy: best simulated step %.3f ms", best[0][0] * 1e3)
        return self.build(best[1], best[2])

    def _rounds(
        self, grids: dict[str, list[list[int]]], splits: dict[str, Split], dp: list[str]
    ) -> tuple[tuple[float, float], dict[str, list[list[int]]], dict[str, Split]]:
        """Split the bottleneck rank's costliest table, re-place, ``rounds`` times; the best."""
        score, per_rank, per_table = self.evaluate(grids, splits, dp)
        best = (score, grids, splits)
        frozen: set[str] = set()
        for rnd in range(self.rounds):
            cands = []
            for name in self._bottleneck_tables(grids, per_table, per_rank):
                if name in frozen:
                    continue
                for s in self._grow(self.tables[name], splits[name]):
                    trial = dict(splits)
                    trial[name] = s
                    g, _ = self.place(trial, dp)
                    if g is not None:
                        sc, pr, pt = self.evaluate(g, trial, dp)
                        cands.append((sc, name, s.k, s.n, g, pr, pt, trial))
                if cands:
                    break
                frozen.add(name)
            if not cands:
                log.debug("greedy: nothing left to split after %d rounds", rnd)
                break
            score, _, _, _, grids, per_rank, per_table, splits = min(cands, key=lambda c: c[:4])
            if score < best[0]:
                best = (score, grids, splits)
        return best

    def _bottleneck_tables(
        self,
        grids: dict[str, list[list[int]]],
        per_table: dict[str, np.ndarray],
        per_rank: np.ndarray,
    ) -> list[str]:
        """Sharded tables on the slowest rank, costliest first."""
        r = int(np.argmax(per_rank))
        on = []
        for i, t in enumerate(self.m.workload.tables):
            g = grids.get(t.name)
            if g is None or not any(r in b for b in g):
                continue
            row = per_table[t.name][r : r + 1]
            cost = float(sum(v[0] for v in self.m.phase_times(row, latency=False).values()))
            on.append((-cost, i, t.name))
        return [name for _, _, name in sorted(on)]
