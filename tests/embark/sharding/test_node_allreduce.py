"""The hierarchical all-reduce (:mod:`embark.sharding.node_allreduce`) against the flat one, on
one spawned 4-rank gloo world (loopback): as 2 nodes × 2 ranks its result is exactly
``(x_0 + x_1) + (x_2 + x_3)`` on every rank (the order its docstring states), equal to gloo's
flat all-reduce exactly on integer-valued inputs and within ``tol("allreduce_order")`` on
random ones; as 4 nodes × 1 and 1 node × 4 likewise; gradient buckets summed node by node
from inside backward equal the per-rank gradients summed in that order, bit for bit.

Run a worker by hand with
``python tests/embark/sharding/test_node_allreduce.py --worker RANK 4 INIT_FILE OUT_DIR``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.embark.gloo_world import spawn_world, worker_main
from tests.tolerances import tol

pytestmark = pytest.mark.slow  # one 4-rank spawn: ~20 s on 2 loaded cores

WORLD = 4
LENGTHS = (1001, 1000)  # 1001: not divisible by 2 or 4 ranks per node (a padded shard)
SHAPES = {"2x2": 2, "4x1": 1, "1x4": 4}  # nodes x ranks per node -> gpus_per_node


def _inputs(length: int, integer: bool) -> list[Any]:
    """Every rank's ``(length,)`` fp32 input (each rank draws all of them: a reference)."""
    import torch

    g = torch.Generator().manual_seed(length + 7 * integer)
    if integer:
        return [torch.randint(-1000, 1000, (length,), generator=g).float() for _ in range(WORLD)]
    return [torch.rand(length, generator=g) * 2 - 1 for _ in range(WORLD)]


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 31), nn.Linear(31, 1))


def _bucket_grads(rank: int, groups: Any) -> dict[str, Any]:
    """Two steps of GradBuckets summed node by node inside backward; the per-rank gradients
    summed as (g0 + g1) + (g2 + g3) locally."""
    import torch

    from embark.sharding.grad_buckets import GradBuckets
    from embark.sharding.node_allreduce import HierarchicalAllReduce

    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    per_rank = []
    for r in range(WORLD):
        m = _model(0)
        m(xs[r]).square().sum().backward()
        per_rank.append([p.grad.clone() for p in m.parameters()])
    want = [(a + b) + (c + d) for a, b, c, d in zip(*per_rank)]
    model = _model(0)
    buckets = GradBuckets(
        list(model.parameters()), None, True, bucket_bytes=600,
        hierarchical=HierarchicalAllReduce(groups),
    )  # fmt: skip
    exact, started = [], []
    for _ in range(2):  # the second step reuses the buffers, the scratch and the worker
        model.zero_grad(set_to_none=True)
        buckets.arm()
        model(xs[rank]).square().sum().backward()
        started.append(buckets.started)  # buckets started inside backward, before finish
        buckets.finish()
        exact.append(all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want)))
    buckets.close()
    return {"buckets": len(buckets.buckets), "exact": exact, "started": started}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    from embark.sharding.node_allreduce import HierarchicalAllReduce, NodeRailGroups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    try:
        for shape, gpn in SHAPES.items():
            reduce = HierarchicalAllReduce(NodeRailGroups.create(world, gpn, rank))
            for length in LENGTHS:
                for integer in (False, True):
                    xs = _inputs(length, integer)
                    hier, flat = xs[rank].clone(), xs[rank].clone()
                    reduce(hier)
                    again = xs[rank].clone()
                    reduce(again)  # the kept scratch gives the same result
                    dist.all_reduce(flat)
                    key = f"{shape}-{length}-{'int' if integer else 'float'}"
                    report[key] = {
                        "hier": hier.tolist(),
                        "again_equal": torch.equal(again, hier),
                        "flat": flat.tolist(),
                        "nodewise": ((xs[0] + xs[1]) + (xs[2] + xs[3])).tolist(),
                    }
        report["buckets"] = _bucket_grads(rank, NodeRailGroups.create(world, 2, rank))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import json

    d = tmp_path_factory.mktemp("node_allreduce")
    spawn_world(__file__, WORLD, d, timeout_s=180)
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_hierarchical_equals_flat(reports: list[dict[str, Any]], shape: str, length: int) -> None:
    import torch

    for kind in ("float", "int"):
        key = f"{shape}-{length}-{kind}"
        first = torch.tensor(reports[0][key]["hier"])
        for r, rep in enumerate(reports):
            hier, flat = torch.tensor(rep[key]["hier"]), torch.tensor(rep[key]["flat"])
            assert torch.equal(hier, first), f"rank {r} {key}: ranks got different bits"
            assert rep[key]["again_equal"], f"rank {r} {key}: a second call differs"
            if kind == "int":  # integer-valued sums are exact in any order
                assert torch.equal(hier, flat), f"rank {r} {key}"
            else:
                torch.testing.assert_close(hier, flat, **tol("allreduce_order"))
            if shape == "2x2":  # the documented order, bit for bit
                assert torch.equal(hier, torch.tensor(rep[key]["nodewise"])), f"rank {r} {key}"


def test_buckets_summed_node_by_node_inside_backward(reports: list[dict[str, Any]]) -> None:
    for r, rep in enumerate(reports):
        assert rep["buckets"]["buckets"] > 2  # several buckets, started from hooks
        assert rep["buckets"]["exact"] == [True, True], f"rank {r}"
        # every bucket's gradients are complete when backward returns: all started inside it
        assert rep["buckets"]["started"] == [rep["buckets"]["buckets"]] * 2, f"rank {r}"


def test_node_rail_groups_refuse_a_backend_other_than_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from embark.sharding.node_allreduce import NodeRailGroups

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="gloo only.*'nccl'"):
        NodeRailGroups.create(4, 2, 0)


if __name__ == "__main__":
    worker_main(worker, "test_node_allreduce.py")
