"""Plans made by the planner itself, executed by ShardedEmbeddingCollection over gloo.

The ``tiny`` workload on 4 ranks as 2 nodes × 2 "GPUs": the GreedyPlanner (``auto``: greedy
plus local search) under a few topologies and batches chosen so that its plans differ (table
wise under both clusters, row wise unique, 3d, table-row-wise, data parallel), and every
baseline of :data:`embark.planner.baselines.BASELINES`. Each plan runs flat and hierarchical;
forward must equal single-process ``nn.EmbeddingBag(mode=combiner)`` on the full tables and
every shard's gradient the slice of the single-process gradient of the global loss.

The plans are made once in the pytest process and written to JSON; one 4-rank world is
spawned for all of them (spawning costs seconds). A worker by hand:
``python tests/embark/sharding/test_plans.py --worker RANK WORLD INIT_FILE OUT_DIR``
(``OUT_DIR/plans.json`` must exist).

Numerics are exact by construction: integer-valued weights, bags of at most 4 ids, upstream
gradients that are integers × 12 (every tiny table is ``sum``), so ``torch.equal`` holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from embark.models.workloads import get_workload
from embark.planner import PlanError, plan_sharding
from embark.planner.baselines import BASELINES
from embark.planner.types import CostConstants
from embark.topology import get_topology
from embark.types import Topology
from tests.embark.gloo_world import reference_step, spawn_world, worker_main

WORLD, GPN = 4, 2
MODES = ("flat", "hierarchical")
BATCH_SIZES = ((5, 3, 0, 4), (2, 6, 4, 1))  # per step, per rank (rank 2 empty in step 0)
MAX_BAG = 4
ROW_BYTES = 4  # fp32 wire


def cpu_2x2(**changes: Any) -> Topology:
    """``cpu-local``'s per-rank figures on 2 nodes × 2 ranks (gloo ranks on this host)."""
    return replace(get_topology("cpu-local"), name="cpu-local-2x2", num_nodes=2, **changes)


def dgx_h100_2x2() -> Topology:
    """DGX H100 per-GPU figures, 2 nodes × 2 GPUs."""
    return replace(get_topology("dgx-h100", nodes=2), name="dgx-h100-2x2", gpus_per_node=2)


_INTER_SLOW = get_topology("cpu-local").inter_node_bandwidth_bytes_per_s / 9  # NVLink:IB 450:50


@dataclass(frozen=True)
class PlanSpec:
    """How one plan is made: ``plan_sharding(tiny, topology, batch_size, strategy)``."""

    strategy: str
    topology: Topology
    batch_size: int
    why: str


# Greedy variants picked (by running the planner) for the layouts they produce today; the
# baselines on the plain 2 × 2 topology (6 GiB per rank: every baseline fits).
SPECS: dict[str, PlanSpec] = {
    "greedy": PlanSpec("auto", cpu_2x2(), 64, "table-wise, reduction and unique"),
    "greedy-large-batch": PlanSpec("auto", cpu_2x2(), 4096, "row-wise unique"),
    "greedy-400kB": PlanSpec(
        "auto", cpu_2x2(hbm_capacity_bytes=4e5), 64, "a 3d row split across nodes beside table-wise"
    ),
    "greedy-slow-inter": PlanSpec(
        "auto",
        cpu_2x2(hbm_capacity_bytes=1e6, inter_node_bandwidth_bytes_per_s=_INTER_SLOW),
        64,
        "data parallel, table-row-wise reduction and unique, table-wise",
    ),
    "greedy-dgx-h100": PlanSpec(
        "auto", dgx_h100_2x2(), 16, "data parallel, table-row-wise reduction, row-wise unique"
    ),
    **{f"baseline-{b}": PlanSpec(b, cpu_2x2(), 64, f"baseline {b}") for b in BASELINES},
}


def make_plans() -> dict[str, dict[str, Any]]:
    """``{spec: {"plan": plan dict} or {"error": message}}``; a plan the planner cannot make
    is recorded, not raised, so the other plans still run."""
    w = get_workload("tiny")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in SPECS.items():
        assert spec.topology.world_size == WORLD and spec.topology.gpus_per_node == GPN
        try:
            plan = plan_sharding(w, spec.topology, spec.batch_size, spec.strategy)
        except PlanError as e:
            out[name] = {"error": f"PlanError: {e}"}
            continue
        out[name] = {"plan": plan.to_dict()}
    return out


# ------------------------------------------------------------------------------ worker
def _steps(tables: list[Any]) -> list[tuple[list[Any], list[dict[str, Any]]]]:
    """Per step: every rank's local batch and upstream gradients (integers × 12). Half the
    ids come from 3 hot ids per table (duplicates inside bags and across ranks, for the
    unique cluster), half are uniform over the table (every row shard is hit)."""
    import torch

    from embark.data.jagged import JaggedBatch

    g = torch.Generator().manual_seed(2024)
    steps = []
    for sizes in BATCH_SIZES:
        batches, grads = [], []
        for b in sizes:
            per_key, ups = {}, {}
            for t in tables:
                lengths = torch.randint(0, MAX_BAG + 1, (b,), generator=g, dtype=torch.int32)
                ids = torch.randint(0, t.num_rows, (int(lengths.sum()),), generator=g)
                hot = torch.randint(0, t.num_rows, (3,), generator=g)
                pick = torch.rand(ids.shape, generator=g) < 0.5
                ids[pick] = hot[torch.randint(0, 3, (int(pick.sum()),), generator=g)]
                per_key[t.name] = (ids, lengths)
                ups[t.name] = torch.randint(-3, 4, (b, t.dim), generator=g).float() * 12
            batches.append(JaggedBatch.from_per_key(per_key))
            grads.append(ups)
        steps.append((batches, grads))
    return steps


def _run(plan_d: dict[str, Any], rank: int, hierarchical: bool) -> dict[str, Any]:
    import torch

    from embark.sharding import ShardedEmbeddingCollection
    from embark.types import ShardingPlan

    tables = list(get_workload("tiny").tables)
    plan = ShardingPlan.from_dict(plan_d)
    g = torch.Generator().manual_seed(7)
    full = {t.name: torch.randint(-8, 9, (t.num_rows, t.dim), generator=g).float() for t in tables}
    m = ShardedEmbeddingCollection(tables, plan, rank, hierarchical=hierarchical)
    m.load_full_weights(full)
    res: dict[str, Any] = {t.name: {"fwd": True, "grad": True} for t in tables}
    for batches, ups in _steps(tables):
        ref_w, ref_out = reference_step(full, tables, batches, ups, rank)
        m.zero_grad(set_to_none=True)
        out = m(batches[rank])
        loss = sum((out[t.name] * ups[rank][t.name]).sum() for t in tables)
        loss.backward()  # type: ignore[union-attr]
        m.reduce_dp_gradients()
        for t in tables:
            got = out[t.name].detach()
            res[t.name]["fwd"] &= got.shape == ref_out[t.name].shape and torch.equal(
                got, ref_out[t.name]
            )
            s = m.local_shards.get(t.name)
            if s is None:
                continue
            p = m.weights[t.name]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            want = ref_w[t.name].grad[s.row_start : s.row_end, s.col_start : s.col_end]  # type: ignore[index]
            res[t.name]["grad"] &= torch.equal(grad, want)
    res["_stats"] = {f"{p}/{lv}": n for (p, lv), n in m.stats.bytes.items()}
    return res


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    plans = json.loads(Path(out_dir, "plans.json").read_text())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    try:
        for name, entry in plans.items():
            if "plan" not in entry:
                continue
            for mode in MODES:
                # every rank fails alike on a plan the runtime rejects (checked before any
                # collective), so recording the error keeps the ranks in step
                try:
                    report[f"{name}/{mode}"] = _run(entry["plan"], rank, mode == "hierarchical")
                except Exception as e:  # reported per plan; the test fails on it
                    report[f"{name}/{mode}"] = {"_error": f"{type(e).__name__}: {e}"}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def world_reports(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    d = tmp_path_factory.mktemp("sharding_plans")
    plans = make_plans()
    (d / "plans.json").write_text(json.dumps(plans))
    spawn_world(__file__, WORLD, d, timeout_s=120)
    return plans, [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _plan_of(plans: dict[str, Any], spec: str) -> dict[str, Any]:
    entry = plans[spec]
    assert "plan" in entry, (
        f"the planner could not make plan {spec!r} ({SPECS[spec]}): {entry['error']}"
    )
    return entry["plan"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", list(SPECS))
def test_planner_plan_matches_single_process(world_reports: Any, spec: str, mode: str) -> None:
    """Forward equals EmbeddingBag on the full tables on every rank; every shard's (and DP
    replica's) gradient equals the slice of the single-process gradient."""
    plans, reps = world_reports
    _plan_of(plans, spec)
    bad = []
    for r, rep in enumerate(reps):
        res = rep[f"{spec}/{mode}"]
        assert "_error" not in res, f"rank {r}: {spec} ({mode}) raised {res['_error']}"
        for table, v in res.items():
            if not table.startswith("_") and not (v["fwd"] and v["grad"]):
                bad.append(f"rank {r} {table}: {v}")
    assert not bad, f"{spec} ({mode}):\n" + "\n".join(bad)


def _reduction_inter_bytes(plan: dict[str, Any], hierarchical: bool) -> int:
    """Inter-node bytes of REDUCTION partials over all steps and ranks (forward; backward
    mirrors it). Flat: every row shard sends each source on another node a ``(B, cols)``
    partial; hierarchical: each node sends one per (table, column block) it holds a piece of."""
    total = 0
    for ts in plan["tables"]:
        if ts["cluster"] != "reduction":
            continue
        senders: set[tuple[int, int, int]] = set()  # (node or rank, col_start, cols)
        for s in ts["shards"]:
            who = s["rank"] // GPN if hierarchical else s["rank"]
            senders.add((who, s["col_start"], s["col_end"] - s["col_start"]))
        for who, _, cols in senders:
            node = who if hierarchical else who // GPN
            for sizes in BATCH_SIZES:
                remote = sum(b for r, b in enumerate(sizes) if r // GPN != node)
                total += remote * cols * ROW_BYTES
    return total


def _reduction_intra_bytes(plan: dict[str, Any], hierarchical: bool) -> int:
    """Intra-node bytes of REDUCTION partials over all steps and ranks (forward), as the cost
    model counts them. Flat: every row shard sends each other source on its node a
    ``(B, cols)`` partial. Hierarchical, per (node, column block) with ``k`` owners there:
    stage 1 sends each source's partial from the ``k - 1`` owners that are not its relay;
    stage 2 sends the sum to each non-owner source on the node."""
    total = 0
    for ts in plan["tables"]:
        if ts["cluster"] != "reduction":
            continue
        owners: dict[tuple[int, int, int], set[int]] = {}  # (node, col_start, cols) -> ranks
        for s in ts["shards"]:
            key = (s["rank"] // GPN, s["col_start"], s["col_end"] - s["col_start"])
            owners.setdefault(key, set()).add(s["rank"])
        for (node, _, cols), own in owners.items():
            for sizes in BATCH_SIZES:
                mates = [b for r, b in enumerate(sizes) if r // GPN == node]
                if hierarchical:
                    n = (len(own) - 1) * sum(sizes)
                    n += sum(b for r, b in enumerate(sizes) if r // GPN == node and r not in own)
                else:
                    n = sum(sum(mates) - sizes[o] for o in own)
                total += n * cols * ROW_BYTES
    return total


def _key_bytes(plan: dict[str, Any]) -> dict[str, int]:
    """Bytes of the keys exchange over all steps and ranks, per level, as the cost model counts
    them (:class:`~embark.planner.types.CostConstants`: int64 keys, one int32 length per bag),
    from the actual batches: to each shard on another rank, a REDUCTION source sends one length
    per local sample and its ids in the shard's rows (once per column block), a UNIQUE source
    its distinct ids there."""
    import torch

    c = CostConstants()
    out = {"intra": 0, "inter": 0}
    for batches, _ in _steps(list(get_workload("tiny").tables)):
        for r, batch in enumerate(batches):
            for ts in plan["tables"]:
                if ts["cluster"] == "data_parallel":
                    continue
                ids = batch.values_for(ts["name"])
                for s in ts["shards"]:
                    if s["rank"] == r:
                        continue
                    mine = ids[(ids >= s["row_start"]) & (ids < s["row_end"])]
                    if ts["cluster"] == "reduction":
                        n = batch.batch_size * c.length_bytes + mine.numel() * c.key_bytes
                    else:
                        n = torch.unique(mine).numel() * c.key_bytes
                    out["intra" if s["rank"] // GPN == r // GPN else "inter"] += n
    return out


@pytest.mark.parametrize("spec", list(SPECS))
def test_hierarchical_saves_exactly_the_reduction_bytes(world_reports: Any, spec: str) -> None:
    """Hierarchical changes only REDUCTION partials: keys and headers are unchanged, the
    inter-node vector bytes (and their gradients) fall by exactly the modelled amount and the
    intra-node ones grow by exactly the modelled amount (the cost model's reduce-scatter over
    a block's owners on a node). The keys (ids and bag lengths) are exactly the bytes the
    cost model counts for them."""
    plans, reps = world_reports
    plan = _plan_of(plans, spec)

    def total(mode: str, key: str) -> int:
        return sum(rep[f"{spec}/{mode}"].get("_stats", {}).get(key, 0) for rep in reps)

    for key in ("header/intra", "header/inter", "keys/intra", "keys/inter"):
        assert total("hierarchical", key) == total("flat", key), key
    keys = _key_bytes(plan)
    for level in ("intra", "inter"):
        assert total("flat", f"keys/{level}") == keys[level], (
            level,
            total("flat", f"keys/{level}"),
            keys,
        )
    saved = _reduction_inter_bytes(plan, False) - _reduction_inter_bytes(plan, True)
    added = _reduction_intra_bytes(plan, True) - _reduction_intra_bytes(plan, False)
    for phase in ("vectors", "vector_grads"):
        flat, hier = total("flat", f"{phase}/inter"), total("hierarchical", f"{phase}/inter")
        assert flat - hier == saved, (phase, flat, hier, saved)
        flat, hier = total("flat", f"{phase}/intra"), total("hierarchical", f"{phase}/intra")
        assert hier - flat == added, (phase, flat, hier, added)
    if all(t["cluster"] != "unique" for t in plan["tables"]):
        assert total("flat", "vectors/inter") == _reduction_inter_bytes(plan, False)
        assert total("hierarchical", "vectors/inter") == _reduction_inter_bytes(plan, True)


def test_specs_cover_the_layouts_they_were_picked_for(world_reports: Any) -> None:
    """Guards the spec list: the planner's plans together still exercise every sharding
    type it emits here and both non-DP clusters (re-pick the specs if this fails)."""
    plans, _ = world_reports
    seen = {
        (t["sharding_type"], t["cluster"])
        for name, e in plans.items()
        if "plan" in e
        for t in e["plan"]["tables"]
    }
    want = {
        ("table_wise", "reduction"),
        ("table_wise", "unique"),
        ("row_wise", "unique"),
        ("row_wise", "reduction"),
        ("table_row_wise", "reduction"),
        ("table_row_wise", "unique"),
        ("3d", "reduction"),
        ("data_parallel", "data_parallel"),
    }
    assert want <= seen, f"missing layouts {sorted(want - seen)}; seen {sorted(seen)}"


if __name__ == "__main__":
    worker_main(worker, "test_plans.py")
