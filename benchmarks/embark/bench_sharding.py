"""ShardedEmbeddingCollection on a 4-rank gloo world (2 nodes × 2): per-step time and bytes
sent intra- vs inter-node, flat vs hierarchical vs pipelined, our GreedyPlanner plan vs the
table-row-wise baseline, side by side in one run.

    python -m benchmarks.embark.bench_sharding [--scale 500] [--local-batch 1024]
        [--steps 10] [--warmup 2] [--topology cpu-local] [--out F]

Workload: ``dlrm_dcnv2`` with every table's rows divided by ``--scale`` (500: 26 tables of
dim 128, 209 MB of fp32 weights over all ranks, 214 ids per sample). Plans: ``auto`` (greedy
+ local search) and ``trw`` from :func:`embark.planner.plan_sharding` for the 2 × 2 topology
(``cpu-local``: this machine's per-rank figures on 2 nodes; ``dgx-h100``: H100 figures, 2
GPUs per node) at global batch ``4 × local batch``. Ids: per table, bags of exactly
``hotness`` ids drawn from Zipf(``workload.zipf_alpha``) over the rows, then put through a
fixed random permutation of the rows (the cost model assumes hashed ids, so hot ids are not
all in a table's first row shard). Modes:

* ``flat``: one all-to-all of the output vectors over the world;
* ``hierarchical``: REDUCTION partials summed on a node relay before crossing nodes;
* ``pipelined``: flat exchange, batch ``i+1``'s keys sent while batch ``i`` is looked up
  (:meth:`ShardedEmbeddingCollection.pipeline`).

A step is forward + backward (loss: the sum of every output) + the DP gradient all-reduce;
its time is the median over ``--steps`` steps after ``--warmup``, the slowest rank's. All six
(plan, mode) collections live side by side and are stepped round-robin, a barrier before
each timed step, so the load of a shared host falls on all of them alike. Bytes
are what all ranks send per step, averaged over every step including the warm-up (CommStats:
self-sends not counted; the DP all-reduce is its buffer size per rank, level "all").

On one CPU host every "node" is the same machine: gloo's inter-node traffic is loopback, as
fast as intra-node, and 4 ranks share the cores. The byte figures are the meaningful result;
the times are not a network measurement (they show the runtime's CPU overheads, and 4 ranks
on 2 shared cores make them noisy). The table also shows the planner's modelled bytes for
each plan (its cost model assumes the hierarchical reduction), beside the measured ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.embark.bench_planner import _layouts
from benchmarks.meta import REPO_ROOT, RESULTS_DIR, write_json
from embark.models.workloads import get_workload
from embark.planner import plan_sharding
from embark.planner.cost import (
    KEY_SEND_INTER,
    KEY_SEND_INTRA,
    OUT_SEND_INTER,
    OUT_SEND_INTRA,
    CostModel,
)
from embark.topology import get_topology
from embark.types import ShardingPlan, Topology

log = logging.getLogger("bench_sharding")

WORLD, GPN = 4, 2
PLANS = ("auto", "trw")
MODES = ("flat", "hierarchical", "pipelined")
PHASES = ("header", "keys", "vectors", "vector_grads")


def topology_2x2(preset: str) -> Topology:
    """``preset``'s per-rank figures on 2 nodes × 2 ranks."""
    if preset == "cpu-local":
        return replace(get_topology("cpu-local"), name="cpu-local-2x2", num_nodes=2)
    return replace(get_topology(preset, nodes=2), name=f"{preset}-2x2", gpus_per_node=GPN)


# ------------------------------------------------------------------------------ worker
def _batches(tables: list[Any], alpha: float, batch: int, n: int, seed: int) -> list[Any]:
    import numpy as np
    import torch

    from embark.data.jagged import JaggedBatch

    rng = np.random.default_rng(seed)
    perm_rng = np.random.default_rng(12345)  # one permutation per table, the same on every rank
    cdfs, perms = [], []
    for t in tables:
        p = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -alpha
        cdf = np.cumsum(p)
        cdfs.append(cdf / cdf[-1])
        perms.append(perm_rng.permutation(t.num_rows))
    out = []
    for _ in range(n):
        ids = []
        for t, cdf, perm in zip(tables, cdfs, perms):
            draw = np.searchsorted(cdf, rng.random(batch * t.hotness), side="right")
            ids.append(
                torch.from_numpy(perm[np.minimum(draw, t.num_rows - 1)]).view(batch, t.hotness)
            )
        out.append(JaggedBatch.from_dense_bags([t.name for t in tables], ids))
    return out


def _run_all(
    tables: list[Any], plans: dict[str, ShardingPlan], rank: int, batches: list[Any], warmup: int
) -> dict[str, Any]:
    """Every (plan, mode) collection side by side, stepped round-robin (step ``i`` of each
    before step ``i+1`` of any), so load on the shared host drifts over all of them alike."""
    import torch
    import torch.distributed as dist

    from embark.sharding import ShardedEmbeddingCollection

    runs: dict[str, tuple[Any, Any]] = {}
    for name, plan in plans.items():
        for mode in MODES:
            m = ShardedEmbeddingCollection(tables, plan, rank, hierarchical=mode == "hierarchical")
            outs = m.pipeline(batches) if mode == "pipelined" else (m(b) for b in batches)
            runs[f"{name}/{mode}"] = (m, outs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in batches:
        for key, (m, outs) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            out = next(outs)
            m.zero_grad(set_to_none=True)
            torch.stack([o.sum() for o in out.values()]).sum().backward()
            m.reduce_dp_gradients()
            times[key].append(time.perf_counter() - t0)
    # bytes over every step, warm-up included: pipelined sends batch i+1's keys during step i,
    # so a counter reset at the first timed step would miss that batch's keys
    return {
        key: {
            "times_s": times[key][warmup:],
            "steps": len(batches),
            "bytes": {f"{p}/{lv}": n for (p, lv), n in m.stats.bytes.items()},
        }
        for key, (m, _) in runs.items()
    }


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = json.loads(Path(out_dir, "config.json").read_text())
    w = get_workload("dlrm_dcnv2").scaled(cfg["scale"])
    tables = list(w.tables)
    n = cfg["warmup"] + cfg["steps"]
    batches = _batches(tables, w.zipf_alpha, cfg["local_batch"], n, seed=1000 + rank)
    plans = {name: ShardingPlan.from_dict(d) for name, d in cfg["plans"].items()}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report: dict[str, Any] = {}
    try:
        report = _run_all(tables, plans, rank, batches, cfg["warmup"])
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ driver
def _spawn(cfg: dict[str, Any], timeout_s: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.embark.bench_sharding",
                    "--worker",
                    str(r),
                    str(WORLD),
                    str(Path(d, "init")),
                    d,
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(WORLD)
        ]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout_s)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, (p, text) in enumerate(zip(procs, logs)):
            if p.returncode != 0:
                raise RuntimeError(f"rank {r} failed (exit {p.returncode}):\n{text[-4000:]}")
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(WORLD)]


def _row(plan: str, mode: str, reps: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics

    key = f"{plan}/{mode}"
    per_rank_ms = [1e3 * statistics.median(rep[key]["times_s"]) for rep in reps]
    tot: dict[str, float] = {}
    for rep in reps:
        for k, n in rep[key]["bytes"].items():
            tot[k] = tot.get(k, 0) + n / rep[key]["steps"]
    row: dict[str, Any] = {
        "plan": plan,
        "mode": mode,
        "step_ms": max(per_rank_ms),
        "step_ms_per_rank": per_rank_ms,
    }
    for lv in ("intra", "inter"):
        row[f"{lv}_bytes"] = sum(v for k, v in tot.items() if k.endswith(f"/{lv}"))
        for ph in PHASES:
            row[f"{ph}_{lv}_bytes"] = tot.get(f"{ph}/{lv}", 0)
    row["dp_grads_bytes"] = tot.get("dp_grads/all", 0)
    return row


def modelled_bytes(model: CostModel, plan: ShardingPlan) -> dict[str, float]:
    """The planner's cost model: bytes all ranks send per step for keys and (hierarchical)
    output vectors, intra and inter; the backward mirrors the vectors."""
    acc = np.asarray(sum(model.traffic(ts) for ts in plan.tables))
    return {
        "keys_intra_bytes": float(acc[:, KEY_SEND_INTRA].sum()),
        "keys_inter_bytes": float(acc[:, KEY_SEND_INTER].sum()),
        "vectors_intra_bytes": float(acc[:, OUT_SEND_INTRA].sum()),
        "vectors_inter_bytes": float(acc[:, OUT_SEND_INTER].sum()),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=500, help="dlrm_dcnv2 rows divided by this")
    p.add_argument("--local-batch", type=int, default=1024, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per (plan, mode)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--topology", default="cpu-local", choices=["cpu-local", "dgx-h100", "dgx-a100"])
    p.add_argument("--timeout", type=int, default=600, help="seconds before the world is killed")
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_sharding.json"))
    return p.parse_args(argv)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Hierarchical and pipelined over flat per plan; auto over trw per mode."""
    by = {(r["plan"], r["mode"]): r for r in rows}
    ratios: dict[str, Any] = {}
    for s in PLANS:
        f, h, pl = by[(s, "flat")], by[(s, "hierarchical")], by[(s, "pipelined")]
        ratios[s] = {
            "hierarchical_over_flat_inter_bytes": _ratio(h["inter_bytes"], f["inter_bytes"]),
            "hierarchical_over_flat_intra_bytes": _ratio(h["intra_bytes"], f["intra_bytes"]),
            "hierarchical_over_flat_step_ms": _ratio(h["step_ms"], f["step_ms"]),
            "pipelined_over_flat_step_ms": _ratio(pl["step_ms"], f["step_ms"]),
        }
    for m in MODES:
        a, b = by[("auto", m)], by[("trw", m)]
        ratios[f"auto_over_trw/{m}"] = {
            "inter_bytes": _ratio(a["inter_bytes"], b["inter_bytes"]),
            "intra_bytes": _ratio(a["intra_bytes"], b["intra_bytes"]),
            "step_ms": _ratio(a["step_ms"], b["step_ms"]),
        }
    return ratios


def _table_rows(rows: list[dict[str, Any]], modelled: dict[str, dict[str, float]]) -> list[str]:
    """The markdown table: measured rows, then the cost model's bytes per plan."""
    mb = 1e6
    head = (
        f"| {'plan':<5} | {'mode':<12} | {'step ms':>8} | {'intra MB':>8} | {'inter MB':>8} | "
        f"{'keys i/x MB':>13} | {'vec i/x MB':>13} | {'grad i/x MB':>13} | {'dp MB':>6} |"
    )
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:

        def ix(ph: str, r: dict[str, Any] = r) -> str:
            return f"{r[f'{ph}_intra_bytes'] / mb:6.2f}/{r[f'{ph}_inter_bytes'] / mb:6.2f}"

        lines.append(
            f"| {r['plan']:<5} | {r['mode']:<12} | {r['step_ms']:8.1f} | {r['intra_bytes'] / mb:8.2f} | "
            f"{r['inter_bytes'] / mb:8.2f} | {ix('keys'):>13} | {ix('vectors'):>13} | "
            f"{ix('vector_grads'):>13} | {r['dp_grads_bytes'] / mb:6.2f} |"
        )
    for s in PLANS:
        q = modelled[s]
        lines.append(
            f"| {s:<5} | {'model':<12} | {'':>8} | {'':>8} | {'':>8} | "
            f"{q['keys_intra_bytes'] / mb:6.2f}/{q['keys_inter_bytes'] / mb:6.2f} | "
            f"{q['vectors_intra_bytes'] / mb:6.2f}/{q['vectors_inter_bytes'] / mb:6.2f} | {'':>13} | {'':>6} |"
        )
    return lines


def _notes(
    ratios: dict[str, Any], args: argparse.Namespace, weight_mb: float, topo: Topology
) -> list[str]:
    """The lines under the table: what ``model`` means, the setting, the ratios."""
    lines = [
        "",
        "model: the planner's CostModel bytes for the same plan and batch (vectors as "
        "hierarchical; its backward mirrors them)",
        f"dlrm_dcnv2 / {args.scale:g} ({weight_mb:.0f} MB fp32), {topo.name}, gloo on one CPU host "
        f"(inter-node = loopback), local batch {args.local_batch}, median of {args.steps} steps; "
        "bytes per step, all ranks",
    ]
    for s in PLANS:
        q = ratios[s]
        lines.append(
            f"{s}: hierarchical/flat inter bytes {q['hierarchical_over_flat_inter_bytes']:.3f}, intra "
            f"{q['hierarchical_over_flat_intra_bytes']:.3f}, step {q['hierarchical_over_flat_step_ms']:.2f}×; "
            f"pipelined/flat step {q['pipelined_over_flat_step_ms']:.2f}×"
        )
    for m in MODES:
        q = ratios[f"auto_over_trw/{m}"]
        lines.append(
            f"auto/trw ({m}): inter bytes {q['inter_bytes']:.3f}, intra {q['intra_bytes']:.3f}, "
            f"step {q['step_ms']:.2f}×"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse(argv)
    w = get_workload("dlrm_dcnv2").scaled(args.scale)
    topo = topology_2x2(args.topology)
    global_batch = args.local_batch * WORLD
    plans = {s: plan_sharding(w, topo, global_batch, s) for s in PLANS}
    weight_mb = sum(t.num_rows * t.dim * 4 for t in w.tables) / 1e6
    log.info(
        "dlrm_dcnv2 / %g: %d tables, %.0f MB fp32; %s; global batch %d",
        args.scale,
        len(w.tables),
        weight_mb,
        topo.name,
        global_batch,
    )
    for s, plan in plans.items():
        log.info("plan %s: %s", s, _layouts(plan))
    cfg = {
        "scale": args.scale,
        "local_batch": args.local_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "plans": {s: pl.to_dict() for s, pl in plans.items()},
    }
    t0 = time.perf_counter()
    reps = _spawn(cfg, args.timeout)
    wall = time.perf_counter() - t0
    rows = [_row(s, m, reps) for s in PLANS for m in MODES]
    model = CostModel(w, topo, global_batch)
    modelled = {s: modelled_bytes(model, pl) for s, pl in plans.items()}
    ratios = _ratios(rows)
    lines = _table_rows(rows, modelled) + _notes(ratios, args, weight_mb, topo)
    sys.stdout.write("\n".join(lines) + "\n")
    path = write_json(
        args.out,
        rows,
        benchmark="embark_sharding",
        args=vars(args),
        topology=topo.to_dict(),
        plans={s: {"layouts": _layouts(pl), "plan": pl.to_dict()} for s, pl in plans.items()},
        ratios=ratios,
        modelled=modelled,
        world_wall_s=wall,
        table="\n".join(lines),
        note="one CPU host: inter-node traffic is loopback; bytes are the measurement, times are not a network figure",
    )
    log.info("wrote %s (world ran %.0f s)", path, wall)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        sys.exit(0)
    sys.exit(main())
