"""A rank of :mod:`benchmarks.embark.bench_cluster`, started by torchrun inside a node's network
namespace of the emulated cluster: ``python -m benchmarks.embark.cluster_ranks CASE_DIR``.

Reads ``CASE_DIR/config.json`` (the case: workload, scale, batch, steps, our plans, TorchRec's
topology), then on every rank, in step, for each side in turn (our runtime under each plan,
plain and pipelined, and TorchRec DMP with its planner's plan):

1. a short probe of the emulated links and of this rank's compute under the load of the
   moment (:func:`probe`), measured with every rank busy at once;
2. the side: build, ``warmup`` steps, then ``steps`` timed steps on the same global batches
   (each rank its slice), per-phase wall time per rank;

and writes ``CASE_DIR/rank{r}.json``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.embark.training_sides import (
    OursSide,
    TorchRecSide,
    case_workload,
    make_batches,
    peak_rss_mb,
)
from embark.data.batch import Batch, local_batch
from embark.models.workloads import Workload
from embark.planner.cost import CostModel
from embark.sharding.model import ShardedDLRM
from embark.sharding.phases import Phase, PhaseClock
from embark.sharding.pipeline import SparseDistPipeline
from embark.training.callbacks import Callback
from embark.types import GradReduce

PROBE_BYTES = 1 << 20  # per rank and peer, per all-to-all of the bandwidth probes
PROBE_REPS = 2
SMALL_OP_REPS = 600
PROBE_LOOKUP_TABLES = 8  # tables of the workload the gather rate is probed on
PROBE_LOOKUP_S = 0.2  # seconds of gathers timed


def _a2a_seconds(send_to: list[int], nbytes: int, reps: int) -> float:
    """Mean seconds of an all-to-all sending ``nbytes`` to each rank flagged in ``send_to``."""
    world = dist.get_world_size()
    per = nbytes // 4
    splits = [per if send_to[r] else 0 for r in range(world)]
    x = torch.ones(sum(splits))
    # every rank sends to the same pattern of peers, so what it receives mirrors what it sends
    y = torch.empty(sum(splits))
    dist.all_to_all_single(y, x, splits, splits)  # warm the connections
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_to_all_single(y, x, splits, splits)
    return (time.perf_counter() - t0) / reps


def _small_op_seconds() -> float:
    """Seconds of one small tensor op (a 64-float gather, add and split), the unit of the
    runtime's per-table bookkeeping under the machine's load right now."""
    table = torch.randn(256, 16)
    ids = torch.randint(0, 256, (64,))
    offsets = torch.arange(0, 64, 8)
    t0 = time.perf_counter()
    for _ in range(SMALL_OP_REPS):
        y = F.embedding_bag(ids, table, offsets, mode="sum")
        (y + 1.0).split(4)
    return (time.perf_counter() - t0) / (3 * SMALL_OP_REPS)


def _lookup_rate(w: Workload, batch: Batch) -> float:
    """Bytes of pooled rows per second of ``embedding_bag`` on tables of the workload's own
    shapes with the global batch's ids: every ``k``-th table (at most
    :data:`PROBE_LOOKUP_TABLES`, so the mix of sizes is the workload's), each allocated whole.
    A fixed large table would rate a workload whose tables fit in cache at DRAM's random
    gather rate (t180's scaled tables are a few MB: 4-6× too slow a rate)."""
    step = -(-len(w.tables) // PROBE_LOOKUP_TABLES)
    picked = w.tables[::step]
    tables = {t.name: torch.randn(t.num_rows, t.dim) for t in picked}
    args = [
        (tables[t.name], batch.sparse.values_for(t.name), batch.sparse.bag_offsets(t.name))
        for t in picked
    ]
    nbytes = sum(ids.numel() * tab.shape[1] * 4 for tab, ids, _ in args)
    for tab, ids, off in args:  # first touch
        F.embedding_bag(ids, tab, off, mode="sum")
    # passes until PROBE_LOOKUP_S have gone by: one pass takes a few ms, less than the
    # scheduler's slices under this machine's load
    reps, t0 = 0, time.perf_counter()
    while reps == 0 or time.perf_counter() - t0 < PROBE_LOOKUP_S:
        for tab, ids, off in args:
            F.embedding_bag(ids, tab, off, mode="sum")
        reps += 1
    return nbytes * reps / (time.perf_counter() - t0)


def probe(cfg: dict[str, Any], rank: int, world: int, gpn: int, batch: Batch) -> dict[str, float]:
    """Per-rank rates measured with every rank busy at once, right before a side runs (so
    under the load that side then meets): inter- and intra-node all-to-all bandwidth, a small
    all-to-all's latency, gather rate on the workload's table shapes with ``batch``'s ids
    (:func:`_lookup_rate`), dense forward + backward FLOP/s on a local batch,
    optimizer-step bytes/s and one small op's seconds. Runs none of the plan."""
    node = rank // gpn
    inter = [int(r // gpn != node) for r in range(world)]
    intra = [int(r // gpn == node and r != rank) for r in range(world)]
    out: dict[str, float] = {"load_1min": os.getloadavg()[0]}
    t = _a2a_seconds(inter, PROBE_BYTES, PROBE_REPS)
    out["inter_node_bytes_per_s"] = PROBE_BYTES * sum(inter) / t
    if sum(intra):
        t = _a2a_seconds(intra, PROBE_BYTES, PROBE_REPS)
        out["intra_node_bytes_per_s"] = PROBE_BYTES * sum(intra) / t
    out["latency_s"] = _a2a_seconds([1] * world, 64, 5)
    out["lookup_bytes_per_s"] = _lookup_rate(case_workload(cfg), batch)
    # optimizer: Adagrad steps over 4 MiB of fp32 weights
    wgt = torch.nn.Parameter(torch.zeros(1 << 20))
    wgt.grad = torch.ones_like(wgt)
    opt = torch.optim.Adagrad([wgt], lr=0.01)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(PROBE_REPS):
        opt.step()
    out["optimizer_bytes_per_s"] = wgt.numel() * 4 * PROBE_REPS / (time.perf_counter() - t0)
    out["small_op_s"] = _small_op_seconds()
    # dense: forward + backward of the workload's dense part on a local batch
    from benchmarks.embark.training_sides import _skip_fill, dense_part_like_build_model

    w = case_workload(cfg)
    dense = dense_part_like_build_model(w, 0, _skip_fill)
    b = cfg["batch_size"] // world
    x = torch.randn(b, w.dense_features)
    pooled = [torch.randn(b, t.dim, requires_grad=True) for t in w.tables]
    dense.dense_forward(x, pooled).sum().backward()
    t0 = time.perf_counter()
    for _ in range(PROBE_REPS):
        dense.dense_forward(x, pooled).sum().backward()
    out["dense_param_bytes"] = float(sum(p.numel() * 4 for p in dense.parameters()))
    per_sample = CostModel(w, _one_rank_topology(), 1).dense_flops_per_sample()
    out["dense_flops_per_s"] = 3 * per_sample * b * PROBE_REPS / (time.perf_counter() - t0)
    dist.barrier()
    return out


def _one_rank_topology() -> Any:
    from embark.topology import emulated_topology

    return emulated_topology(nodes=1, ranks_per_node=1)


# ---------------------------------------------------------------------------------- sides
class _StepEnd(Callback):
    """Marks the optimizer phase when a training step ends."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock

    def on_step_end(self, trainer: Any, step: int, loss: float) -> None:
        self.clock.mark(Phase.OPTIMIZER)


def _run_ours(
    cfg: dict[str, Any],
    plan_name: str,
    mode: str,
    batches: list[Batch],
    rank: int,
) -> dict[str, Any]:
    """Our runtime under ``plan_name``; ``mode``: "+"-joined options, none (plain steps),
    "pipeline" (the next batch's input distribution ahead), "flat" (the dense gradients in one
    flat all-reduce, not node by node), "4mib" (in 4 MiB gradient buckets)."""
    modes = set(mode.split("+")) - {""}
    unknown = modes - {"pipeline", "flat", "4mib"}
    if unknown:
        raise ValueError(f"side {plan_name}+{mode}: unknown options {sorted(unknown)}")
    pipelined = "pipeline" in modes
    world = dist.get_world_size()
    side_cfg = {**cfg, "plans": {"ours": cfg["plans"][plan_name]}}
    t0 = time.perf_counter()
    side = OursSide(side_cfg, rank, world)
    setup = time.perf_counter() - t0
    trainer = side.trainer
    model = trainer.model
    assert isinstance(model, ShardedDLRM)
    if "flat" in modes:  # before the first backward, which makes the buckets
        model.grad_reduce = GradReduce.FLAT
    if "4mib" in modes:
        model.grad_bucket_bytes = 4 << 20
    clock = PhaseClock()
    model.set_phase_clock(clock)
    trainer.add_callback(_StepEnd(clock))
    mine = [local_batch(b, rank, world) for b in batches]
    warm, steps = cfg["warmup"], cfg["steps"]
    losses: list[float] = []

    def train(part: list[Batch]) -> list[float]:
        if pipelined:
            return list(SparseDistPipeline(trainer).train(part))
        return [trainer.train_step(b) for b in part]

    losses += train(mine[:warm])
    dist.barrier()
    clock.reset()
    t0 = time.perf_counter()
    losses += train(mine[warm : warm + steps])
    seconds = time.perf_counter() - t0
    stats = model.embeddings.stats.bytes
    inter = sum(v for (phase, level), v in stats.items() if level == "inter")
    out = {
        "setup_s": setup,
        "step_s": seconds / steps,
        "phases_s": {p.value: v / steps for p, v in clock.seconds.items()},
        "losses": losses,
        "inter_node_bytes_total": inter,
        "grad_reduce": (
            GradReduce.HIERARCHICAL if model.hierarchical_grad_reduce() else GradReduce.FLAT
        ).value,
    }
    model.set_phase_clock(None)
    return out


def _run_torchrec(cfg: dict[str, Any], batches: list[Batch], rank: int) -> dict[str, Any]:
    world = dist.get_world_size()
    t0 = time.perf_counter()
    side = TorchRecSide(cfg, rank, world)
    setup = time.perf_counter() - t0
    clock = PhaseClock()
    warm, steps = cfg["warmup"], cfg["steps"]
    losses: list[float] = []

    def step(batch: Batch) -> float:
        b = local_batch(batch, rank, world)
        side.dmp.train()
        clock.mark(Phase.OTHER)
        logits = side.dmp(b.dense, b.sparse.to_kjt())
        loss = F.binary_cross_entropy_with_logits(logits, b.labels)
        clock.mark(Phase.DENSE_FWD)  # TorchRec's whole forward: input dist, lookups, a2a, dense
        side.dense_opt.zero_grad()
        loss.backward()
        clock.mark(Phase.EMB_BWD)  # its whole backward, fused table updates and DDP included
        side.dense_opt.step()
        clock.mark(Phase.OPTIMIZER)
        value = loss.detach().clone()
        dist.all_reduce(value)
        clock.mark(Phase.OTHER)
        return float(value) / world

    losses += [step(b) for b in batches[:warm]]
    dist.barrier()
    clock.reset()
    t0 = time.perf_counter()
    losses += [step(b) for b in batches[warm : warm + steps]]
    seconds = time.perf_counter() - t0
    return {
        "setup_s": setup,
        "step_s": seconds / steps,
        "phases_s": {p.value: v / steps for p, v in clock.seconds.items()},
        "losses": losses,
        "layouts": side.layouts,
        "grad_reduce": GradReduce.FLAT.value,  # DDP's one all-reduce over every rank
    }


def worker(case_dir: Path) -> None:
    cfg = json.loads((case_dir / "config.json").read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gpn = int(os.environ["LOCAL_WORLD_SIZE"])
    report: dict[str, Any] = {"rank": rank, "node": rank // gpn, "sides": {}}
    try:
        n = cfg["warmup"] + cfg["steps"]
        batches = make_batches(case_workload(cfg), cfg["batch_size"], n, cfg["seed"])
        for side in cfg["sides"]:
            dist.barrier()
            probed = probe(cfg, rank, world, gpn, batches[0])
            if side == "torchrec":
                res = _run_torchrec(cfg, batches, rank)
            else:
                plan, _, mode = side.partition("+")
                res = _run_ours(cfg, plan, mode, batches, rank)
            res["rss_mb"] = peak_rss_mb()
            res["probe"] = probed
            res["load_1min_after"] = os.getloadavg()[0]
            report["sides"][side] = res
            gc.collect()
    except BaseException:
        report["error"] = traceback.format_exc()
        raise
    finally:
        (case_dir / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
