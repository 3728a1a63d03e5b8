"""``ShardedDLRM.build`` on worlds of 2 and 4 ranks: each rank allocates only its shards (and
the dense part, the DP replicas and 4 MiB of scratch), never a whole table, and its values are
bit for bit those of ``ShardedDLRM(build_model(...))``, which copies them out of the whole
single-process model.

The workload is ``tiny`` with table ``t0`` grown to BIG_ROWS rows (64 MB, split by rows over
every rank, unevenly), on the hand-written plan of every sharding type
(:func:`~tests.embark.sharding.plans.tiny_plan`). An allocation spy (a ``TorchDispatchMode``)
records the largest tensor storage any operation produces while the model is built. Run a
worker by hand with
``python tests/embark/sharding/test_sharded_build.py --worker RANK WORLD INIT_FILE OUT_DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.embark.gloo_world import spawn_reports, worker_main
from tests.embark.sharding.plans import tiny_plan

WORLDS = (2, 4)
BIG_ROWS = 1_000_000  # × 16 float32 = 64 MB, 16 times the 4 MiB scratch
SEED = 3


def big_plan(world: int) -> dict[str, Any]:
    """``tiny_plan(world)`` with ``t0`` of BIG_ROWS rows, row-wise over every rank (uneven)."""
    plan = tiny_plan(world)
    t0 = next(t for t in plan["tables"] if t["name"] == "t0")
    cuts = [BIG_ROWS * i * i // (world * world) for i in range(world + 1)]
    t0["num_rows"] = BIG_ROWS
    for s, a, b in zip(t0["shards"], cuts, cuts[1:]):
        s["row_start"], s["row_end"] = a, b
    return plan


def _spy() -> Any:
    """A dispatch mode recording the largest storage (bytes) of any CPU tensor an operation
    returns (meta tensors hold no memory)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllocationSpy(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
            return out

    return AllocationSpy()


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from embark import ShardedDLRM, ShardingPlan, build_model, get_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tiny = get_workload("tiny")
        big = replace(tiny, tables=(replace(tiny.tables[0], num_rows=BIG_ROWS), *tiny.tables[1:]))
        plan = ShardingPlan.from_dict(big_plan(world))
        with _spy() as spy:
            built = ShardedDLRM.build(big, plan, rank, seed=SEED)
        with _spy() as legacy_spy:
            legacy = ShardedDLRM(build_model(big, seed=SEED), plan, rank)
        want = legacy.state_dict()
        got = built.state_dict()
        report = {
            "keys_equal": list(got) == list(want),
            "unequal": [k for k in want if not torch.equal(got[k], want[k])],
            "largest": spy.largest,
            "legacy_largest": legacy_spy.largest,
            "param_bytes": sum(p.nbytes for p in built.parameters()),
            "own_table_bytes": sum(p.nbytes for p in built.embedding_tables().values()),
            "largest_own_table": max(p.nbytes for p in built.embedding_tables().values()),
            "dense_bytes": sum(p.nbytes for p in built.dense.parameters()),
            "replicated_bytes": sum(p.nbytes for p in built.replicated_parameters()),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    d = tmp_path_factory.mktemp(f"build{world}")
    return world, spawn_reports(__file__, world, d)


def test_build_equals_the_copy_of_the_whole_model(reports: Any) -> None:
    """Every shard, DP replica and dense weight, bit for bit, on every rank (RW, TW, CW, TRW,
    DP; the big table's shards start and end inside scratch blocks)."""
    _, reps = reports
    for r, rep in enumerate(reps):
        assert rep["keys_equal"] and rep["unequal"] == [], (r, rep["unequal"])


def test_a_rank_allocates_its_shards_never_a_whole_table(reports: Any) -> None:
    """The largest allocation while building is a piece the rank keeps (its largest shard or
    replica, the dense part's broadcast buffer) or the 4 MiB scratch, never the 64 MB table,
    which the construction from a whole model does allocate; the model holds its shards,
    replicas and dense part only."""
    from embark.models.dlrm import SCRATCH_ELEMENTS
    from embark.models.workloads import get_workload

    world, reps = reports
    table = BIG_ROWS * 16 * 4
    rows = [BIG_ROWS * i * i // (world * world) for i in range(world + 1)]
    for r, rep in enumerate(reps):
        assert rep["legacy_largest"] >= table, (r, rep)  # the spy sees a whole table
        bound = max(rep["largest_own_table"], 4 * SCRATCH_ELEMENTS, rep["replicated_bytes"])
        assert rep["largest"] <= bound < table, (r, rep)
        assert rep["param_bytes"] == rep["own_table_bytes"] + rep["dense_bytes"], (r, rep)
    # rank r holds rows rows[r]:rows[r+1] of the big table (uneven cuts), and at most the
    # other (small) tables
    small = sum(t.num_rows * t.dim * 4 for t in get_workload("tiny").tables[1:])
    for r, rep in enumerate(reps):
        shard = (rows[r + 1] - rows[r]) * 16 * 4
        assert shard < rep["own_table_bytes"] <= shard + small, (r, rep)


if __name__ == "__main__":
    worker_main(worker, "test_sharded_build.py")
