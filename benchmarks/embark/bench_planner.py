"""Simulated step time of our EMBark plan vs table-row-wise, row-wise, table-wise and
TorchRec's ``EmbeddingShardingPlanner``, on DGX-H100 × 1, 8, 16 nodes.

    python -m benchmarks.embark.bench_planner [--workloads dlrm_dcnv2,t180,t200,t510]
        [--nodes 1,8,16] [--local-batch 8192] [--comm-dtype fp32] [--no-torchrec]
        [--torchrec-timeout 60] [--out F]

Every plan is rated by OUR simulator (embark.planner.simulator); TorchRec's plan is converted
into our format (its shards, ranks; reduction cluster, the same wire dtype). TorchRec is a
benchmark-only peer; without it the column is skipped with a logged note. Weak scaling: the
global batch is ``local_batch × world_size``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from typing import Any

from benchmarks.meta import RESULTS_DIR, write_json
from embark.interop import plan_from_torchrec
from embark.models.workloads import Workload, get_workload
from embark.planner.baselines import BASELINES
from embark.planner.cost import CostModel
from embark.planner.planner import plan_sharding
from embark.planner.simulator import simulate
from embark.topology import get_topology
from embark.types import CommDtype, PlanError, ShardingPlan, Topology

log = logging.getLogger("bench_planner")


def torchrec_plan(
    workload: Workload, topo: Topology, model: CostModel, dtype: CommDtype, timeout_s: int
) -> ShardingPlan:
    """Plan with TorchRec's EmbeddingShardingPlanner (its best plan within ``timeout_s``)
    and convert it to our ShardingPlan (:func:`embark.interop.plan_from_torchrec`)."""
    import torch
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # noqa: F401
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TRTopology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfgs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.num_rows,
            feature_names=[f"f_{t.name}"],
        )
        for t in workload.tables
    ]
    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    tr_topo = TRTopology(
        world_size=topo.world_size,
        compute_device="cuda",
        local_world_size=topo.gpus_per_node,
        hbm_cap=int(topo.hbm_capacity_bytes),
        # TorchRec takes bandwidths in bytes per millisecond
        hbm_mem_bw=topo.hbm_bandwidth_bytes_per_s / 1e3,
        intra_host_bw=topo.intra_node_bandwidth_bytes_per_s / 1e3,
        inter_host_bw=topo.inter_node_bandwidth_bytes_per_s / 1e3,
    )
    cons = {
        t.name: ParameterConstraints(pooling_factors=[float(t.hotness)]) for t in workload.tables
    }
    planner = EmbeddingShardingPlanner(
        topology=tr_topo,
        batch_size=int(model.local_batch),
        constraints=cons,
        storage_reservation=FixedPercentageStorageReservation(model.c.hbm_reserved_fraction),
        debug=False,
        timeout_seconds=timeout_s,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr_plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return plan_from_torchrec(
        tr_plan, workload.tables, topo.world_size, topo.gpus_per_node, dtype, topology=topo.name
    )


def bench_one(
    name: str, nodes: int, local_batch: int, dtype: CommDtype, use_torchrec: bool, tr_timeout_s: int
) -> dict[str, Any]:
    w = get_workload(name)
    topo = get_topology("dgx-h100", nodes)
    batch = local_batch * topo.world_size
    model = CostModel(w, topo, batch)
    row: dict[str, Any] = {
        "workload": name,
        "nodes": nodes,
        "world_size": topo.world_size,
        "batch_size": batch,
    }
    t0, c0 = time.perf_counter(), time.process_time()
    ours = plan_sharding(w, topo, batch, "auto", comm_dtype=dtype)
    row["planning_s"] = time.perf_counter() - t0
    row["planning_cpu_s"] = time.process_time() - c0
    sim = simulate(ours, model)
    row["ours_ms"] = sim.step_ms
    row["ours_no_overlap_ms"] = sim.step_ms_no_overlap
    row["ours_embedding_ms"] = sim.embedding_ms
    row["dense_ms"] = sim.dense_ms
    row["ours_layouts"] = _layouts(ours)
    for b in ("trw", "rw", "tw"):
        try:
            r = simulate(BASELINES[b](model, dtype), model)
            row[f"{b}_ms"] = r.step_ms
        except PlanError as e:
            row[f"{b}_ms"] = None
            row[f"{b}_note"] = str(e)
    row["torchrec_ms"] = None
    if use_torchrec:
        try:
            t0 = time.perf_counter()
            tp = torchrec_plan(w, topo, model, dtype, tr_timeout_s)
            row["torchrec_planning_s"] = time.perf_counter() - t0
            row["torchrec_hit_timeout"] = row["torchrec_planning_s"] >= tr_timeout_s
            r = simulate(tp, model)
            row["torchrec_ms"] = r.step_ms
            row["torchrec_fits_our_memory_model"] = r.fits_memory
            row["torchrec_layouts"] = _layouts(tp)
        except (RuntimeError, ValueError, KeyError) as e:  # TorchRec failures vary (PlanError too)
            row["torchrec_note"] = f"{type(e).__name__}: {e}"[:400]
            log.warning("torchrec on %s × %d: %s", name, nodes, row["torchrec_note"])
    if row.get("trw_ms"):
        row["speedup_over_trw"] = row["trw_ms"] / row["ours_ms"]
    return row


def _layouts(plan: ShardingPlan) -> dict[str, int]:
    out: dict[str, int] = {}
    for ts in plan.tables:
        k = f"{ts.sharding_type.value}/{ts.cluster.value}"
        out[k] = out.get(k, 0) + 1
    return out


def _fmt(v: float | None) -> str:
    return f"{v:9.3f}" if v is not None else f"{'—':>9}"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="dlrm_dcnv2,t180,t200,t510")
    p.add_argument("--nodes", default="1,8,16")
    p.add_argument("--local-batch", type=int, default=8192, help="samples per GPU per iteration")
    p.add_argument("--comm-dtype", default="fp32", choices=[d.value for d in CommDtype])
    p.add_argument("--no-torchrec", action="store_true")
    p.add_argument(
        "--torchrec-timeout",
        type=int,
        default=60,
        help="seconds TorchRec's planner may search (it keeps its best plan so far)",
    )
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_planner.json"))
    return p.parse_args(argv)


def _torchrec_available() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        log.warning(
            "torchrec is not installed: the TorchRec column is skipped "
            "(pip install fbgemm-gpu-cpu==1.8.0 ... see the README)"
        )
        return False
    return True


def _summary(rows: list[dict[str, Any]], workloads: list[str], use_tr: bool) -> dict[str, Any]:
    """Mean and max speed-up over TRW (overall and per workload), TorchRec over ours."""
    per_model: dict[str, float] = {}
    for name in workloads:
        sps = [
            r["speedup_over_trw"]
            for r in rows
            if r["workload"] == name and r.get("speedup_over_trw")
        ]
        per_model[name] = sum(sps) / len(sps)
    all_sp = [r["speedup_over_trw"] for r in rows if r.get("speedup_over_trw")]
    summary: dict[str, Any] = {
        "mean_speedup_over_trw": sum(all_sp) / len(all_sp),
        "max_speedup_over_trw": max(all_sp),
        "per_model_mean_speedup_over_trw": per_model,
        "torchrec": use_tr,
    }
    tr_rows = [r for r in rows if r.get("torchrec_ms")]
    if tr_rows:
        summary["mean_torchrec_over_ours"] = sum(
            r["torchrec_ms"] / r["ours_ms"] for r in tr_rows
        ) / len(tr_rows)
    return summary


def _table(
    rows: list[dict[str, Any]], summary: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    head = f"| {'workload':<10} | nodes | {'ours':>9} | {'trw':>9} | {'rw':>9} | {'tw':>9} | {'torchrec':>9} | trw/ours | plan s |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        sp = r.get("speedup_over_trw")
        lines.append(
            f"| {r['workload']:<10} | {r['nodes']:>5} | {_fmt(r['ours_ms'])} | {_fmt(r['trw_ms'])} | {_fmt(r['rw_ms'])} | "
            f"{_fmt(r['tw_ms'])} | {_fmt(r['torchrec_ms'])} | {sp:7.2f}× | {r['planning_s']:6.2f} |"
        )
    per_model = summary["per_model_mean_speedup_over_trw"]
    lines.append("")
    lines.append(
        "simulated step ms (pipelined), DGX-H100, weak scaling "
        f"{args.local_batch} samples/GPU, comm {args.comm_dtype}"
    )
    lines.append(
        f"speedup over TRW: mean {summary['mean_speedup_over_trw']:.2f}×, max {summary['max_speedup_over_trw']:.2f}×; "
        + ", ".join(f"{k} {v:.2f}×" for k, v in per_model.items())
    )
    if "mean_torchrec_over_ours" in summary:
        lines.append(f"TorchRec plan / ours (mean): {summary['mean_torchrec_over_ours']:.2f}×")
    return lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("torchrec").setLevel(logging.WARNING)  # its planner logs every table
    args = _parse(argv)
    use_tr = not args.no_torchrec and _torchrec_available()
    workloads = args.workloads.split(",")
    rows = []
    for name in workloads:
        for nodes in (int(n) for n in args.nodes.split(",")):
            log.info("planning %s on dgx-h100 × %d", name, nodes)
            rows.append(
                bench_one(
                    name,
                    nodes,
                    args.local_batch,
                    CommDtype(args.comm_dtype),
                    use_tr,
                    args.torchrec_timeout,
                )
            )
    summary = _summary(rows, workloads, use_tr)
    lines = _table(rows, summary, args)
    sys.stdout.write("\n".join(lines) + "\n")
    path = write_json(
        args.out,
        rows,
        benchmark="embark_planner",
        args=vars(args),
        summary=summary,
        table="\n".join(lines),
    )
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
