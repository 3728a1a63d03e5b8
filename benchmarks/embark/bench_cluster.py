"""End-to-end sharded training on the emulated cluster (:mod:`embark.cluster`): 2 nodes × 2 gloo
ranks, node links shaped as :mod:`embark.topology` maps DGX H100 + InfiniBand onto this machine.

    python -m benchmarks.embark.bench_cluster [--workloads dlrm_dcnv2,t180,t200,t510]
        [--batch-sizes 512] [--scale 1000] [--steps 3] [--warmup 1] [--repeats 1]
        [--sides ours,trw,rw,tw,ours+pipeline,torchrec[,ours+flat,ours+flat+4mib]]

Per workload (rows divided by ``--scale``) and global batch: our planner's plan, table-row-wise,
row-wise and table-wise on our runtime (plain steps), our plan pipelined
(:class:`~embark.sharding.SparseDistPipeline`), and TorchRec DMP with its own planner's plan
(``--sides ...,ours+flat`` adds our plan with the dense gradients in one flat all-reduce
instead of node by node),
one after the other in one torchrun world (so every side sees the same links and load), on the
same global batches; step-0 losses compared. Each rank also probes the links and its compute
first; the cost model, calibrated with those rates (efficiencies 1), predicts every run's step.

Writes ``benchmarks/results/embark_cluster.json`` (one row per side: plan, shaping, samples/s,
per-rank phase times, predicted step) and ``benchmarks/results/embark_cluster.png`` (step time
by phase per plan) and prints the markdown table of docs/benchmarks.md. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.meta import REPO_ROOT, RESULTS_DIR, git_sha, scrub_paths
from embark.cluster import EmulatedCluster, LinkShape, missing_capability, run_torchrun
from embark.models.workloads import Workload, get_workload
from embark.planner.cost import CostModel
from embark.planner.planner import plan_sharding
from embark.planner.runtime_model import DDP_BUCKET_BYTES, HostRates, runtime_phases
from embark.planner.types import CostConstants
from embark.topology import (
    EMULATED_INTER_NODE_BYTES_PER_S,
    EMULATED_INTRA_TO_INTER_RATIO,
    emulated_topology,
)
from embark.types import GradReduce, ShardingPlan, Topology

NODES, RANKS_PER_NODE = 2, 2
OUR_PLANS = {"ours": "auto", "trw": "trw", "rw": "rw", "tw": "tw"}
SIDES = ("ours", "trw", "rw", "tw", "ours+pipeline", "torchrec")
# sides run only when named in --sides: our plan with the dense gradients in one flat ring
# (in the runtime's buckets, 1 MiB for DLRM-DCNv2's dense part, or in 4 MiB ones: one bucket there)
OPTIONAL_SIDES = ("ours+flat", "ours+flat+4mib")
# every efficiency 1: the calibrated figures are rates reached, not peaks
CALIBRATED = CostConstants(
    lookup_hbm_efficiency=1.0,
    intra_a2a_efficiency=1.0,
    inter_a2a_efficiency=1.0,
    dense_mfu=1.0,
    dp_sparse_allgather=False,
)
# the planner rates DP tables as the runtime moves their gradients (whole replicas)
PLANNING = CostConstants(dp_sparse_allgather=False)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def workload_for(name: str, scale: float, dense_scale: int) -> Workload:
    """``name`` with rows divided by ``scale`` and the dense part narrowed by ``dense_scale``:
    every top-MLP width but the output and DCNv2's rank divided by it, the bottom MLP kept
    (its last width is the embedding dim the dot interaction needs). Why: MLPerf's batch per
    GPU is 8,192 (65,536 over 8); ours is 128 per rank, 64× less, so the embedding traffic,
    which scales with the batch, is 64× smaller while the dense gradients are not; narrowing
    the dense part brings their all-reduce back to a share of the step like the real one."""
    w = get_workload(name)
    w = w.scaled(scale) if scale > 1 else w
    if dense_scale <= 1:
        return w
    top = tuple(max(1, x // dense_scale) for x in w.top_mlp[:-1]) + (w.top_mlp[-1],)
    inter = replace(w.interaction, low_rank=max(1, w.interaction.low_rank // dense_scale))
    return replace(w, top_mlp=top, interaction=inter)


def torchrec_plan(w: Workload, batch: int) -> ShardingPlan | None:
    """TorchRec's planner's plan (as TorchRecSide makes it, on one process) in our types."""
    try:
        import torch
        from torch import nn
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner
        from torchrec.distributed.planner import Topology as TRTopology
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        from benchmarks.embark.training_sides import torchrec_plan_constraints
        from embark.interop.torchrec_plan import plan_from_torchrec
    except ImportError:
        return None
    world = NODES * RANKS_PER_NODE
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name]
            )
            for t in w.tables
        ],
        device=torch.device("meta"),
    )
    holder = nn.Module()
    holder.ebc = ebc
    planner = EmbeddingShardingPlanner(
        topology=TRTopology(
            world_size=world, local_world_size=RANKS_PER_NODE, compute_device="cpu"
        ),
        batch_size=batch // world,
        constraints=torchrec_plan_constraints(w, world),
    )
    plan = planner.plan(holder, [EmbeddingBagCollectionSharder()])
    return plan_from_torchrec(plan, w.tables, world, RANKS_PER_NODE, module_path="ebc")


def calibrated_topology(probes: list[dict[str, float]]) -> Topology:
    """The emulated topology with the probe's rates (means over the ranks)."""

    def mean(k: str) -> float:
        return sum(p[k] for p in probes) / len(probes)

    return emulated_topology(
        NODES,
        RANKS_PER_NODE,
        inter_node_bytes_per_s=mean("inter_node_bytes_per_s"),
        intra_node_bytes_per_s=mean("intra_node_bytes_per_s"),
        lookup_bytes_per_s=mean("lookup_bytes_per_s"),
        flops_per_s=mean("dense_flops_per_s"),
        latency_s=mean("latency_s"),
    )


def add_prediction(row: dict[str, Any], w: Workload, plan: ShardingPlan | None) -> None:
    """Set ``row``'s predicted step (and phases) from its plan and its side's probe: the
    calibrated cost model of the runtime (``None`` where there is no plan to rate)."""
    if plan is None:
        row["predicted_step_s"] = row["predicted_over_measured"] = None
        row["predicted_phases_s"] = None
        return
    calib = Topology.from_dict(row["calibrated_topology"])
    probes = row["probe_per_rank"]
    rates = HostRates(
        dense_param_bytes=probes[0]["dense_param_bytes"],
        optimizer_bytes_per_s=sum(p["optimizer_bytes_per_s"] for p in probes) / len(probes),
        small_op_s=statistics.median(p["small_op_s"] for p in probes),
    )
    model = CostModel(w, calib, row["batch_size"], CALIBRATED)
    side = row["side"]
    modes = side.split("+")
    bucket_bytes = (
        DDP_BUCKET_BYTES if side == "torchrec" else (4 << 20 if "4mib" in modes else None)
    )
    phases = runtime_phases(
        plan,
        model,
        rates,
        "pipeline" in modes,
        side == "torchrec",
        GradReduce(row["grad_reduce"]),
        bucket_bytes,
    )
    row["predicted_phases_s"] = phases
    row["predicted_step_s"] = sum(phases.values())
    row["predicted_over_measured"] = row["predicted_step_s"] / row["step_s"]


def plan_record(plan: ShardingPlan | None) -> dict[str, Any] | None:
    """What a row keeps of its plan: tables per (sharding type, cluster) and the sha256 of the
    plan's JSON (the plans themselves are recomputed: the planners are deterministic)."""
    if plan is None:
        return None
    kinds: dict[str, int] = {}
    for ts in plan.tables:
        k = f"{ts.sharding_type.value}/{ts.cluster.value}"
        kinds[k] = kinds.get(k, 0) + 1
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return {"tables_by_kind": kinds, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def case_plans(w: Workload, batch: int) -> dict[str, ShardingPlan | None]:
    """Every side's plan: ours and the baselines from our planner, TorchRec's from its own."""
    topo = emulated_topology(NODES, RANKS_PER_NODE)
    plans: dict[str, ShardingPlan | None] = {
        k: plan_sharding(w, topo, batch, s, constants=PLANNING) for k, s in OUR_PLANS.items()
    }
    plans["torchrec"] = torchrec_plan(w, batch)
    return plans


def repredict(doc: dict[str, Any]) -> None:
    """Recompute every row's prediction from its plan (recomputed, checked against the
    recorded sha256) and its probe (in place)."""
    cache: dict[tuple[str, int], dict[str, ShardingPlan | None]] = {}
    for r in doc["rows"]:
        w = workload_for(r["workload"], r["scale"], r["dense_scale"])
        key = (r["workload"], r["batch_size"])
        if key not in cache:
            cache[key] = case_plans(w, r["batch_size"])
        plan = cache[key][r["side"].partition("+")[0]]
        record = plan_record(plan)
        if record != r["plan"]:
            raise ValueError(f"{key} {r['side']}: the recomputed plan is not the one run")
        add_prediction(r, w, plan)


def _publish(doc: dict[str, Any], out: Path) -> None:
    """The JSON and its plot, each written whole then renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(doc))
    tmp_out.replace(out)
    plot(doc["rows"], out.with_suffix(".png"))


def run_case(
    c: EmulatedCluster, name: str, batch: int, args: argparse.Namespace, d: Path, turn: int
) -> list[dict[str, Any]]:
    """One workload at one batch: every side in one torchrun world, the sides' order rotated
    by ``turn`` so that no side always meets the load of the same point of a case."""
    w = workload_for(name, args.scale, args.dense_scale)
    sides = [s for s in args.sides.split(",") if s]
    order = sides[turn % len(sides) :] + sides[: turn % len(sides)]
    plans = case_plans(w, batch)
    cfg: dict[str, Any] = {
        "workload": name,
        "workload_doc": w.to_dict(),
        "scale": 1.0,  # already in workload_doc
        "batch_size": batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": 0,
        "lr": 0.01,
        "eps": 1e-8,
        "embedding_optimizer": "adagrad" if w.optimizer == "adagrad" else "sgd",
        "embedding_kernel": "auto",
        "plans": {k: p.to_dict() for k, p in plans.items() if k in OUR_PLANS and p is not None},
        "torchrec_topology": {
            "world_size": NODES * RANKS_PER_NODE,
            "local_world_size": RANKS_PER_NODE,
        },
        "sides": order,
    }
    case_dir = d / f"{name}-{batch}"
    case_dir.mkdir(parents=True)
    (case_dir / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    res = run_torchrun(
        c,
        RANKS_PER_NODE,
        ["-m", "benchmarks.embark.cluster_ranks", str(case_dir)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout_s=args.timeout,
        cwd=str(REPO_ROOT),
    )
    wall = time.perf_counter() - t0
    ranks: list[dict[str, Any]] = []
    for r in range(NODES * RANKS_PER_NODE):
        f = case_dir / f"rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else {"error": "no report"})
    bad = [n for n in res if n.returncode != 0]
    if bad or any("error" in r for r in ranks):
        tails = "\n".join(n.output[-2500:] for n in bad)
        errs = "\n".join(str(r.get("error", ""))[-2500:] for r in ranks)
        raise RuntimeError(f"{name} batch {batch} failed:\n{tails}\n{errs}")
    rows = []
    loss0 = {s: ranks[0]["sides"][s]["losses"][0] for s in cfg["sides"]}
    for side in cfg["sides"]:
        per_rank = [r["sides"][side] for r in ranks]
        probes = [p["probe"] for p in per_rank]
        calib = calibrated_topology(probes)
        step = max(p["step_s"] for p in per_rank)
        plan = plans[side.partition("+")[0]]
        rows.append(
            {
                "workload": name,
                "scale": args.scale,
                "dense_scale": args.dense_scale,
                "batch_size": batch,
                "side": side,
                "steps": args.steps,
                "samples_per_s": batch / step,
                "step_s": step,
                "loss_step0": loss0[side],
                "loss_step0_diff_vs_ours": loss0[side] - loss0.get("ours", loss0[side]),
                "phases_s_per_rank": [p["phases_s"] for p in per_rank],
                "step_s_per_rank": [p["step_s"] for p in per_rank],
                "inter_node_bytes_rank0": per_rank[0].get("inter_node_bytes_total"),
                "grad_reduce": per_rank[0]["grad_reduce"],
                "rss_mb_per_rank": [p["rss_mb"] for p in per_rank],
                "plan": plan_record(plan),
                "torchrec_layouts": per_rank[0].get("layouts"),
                "probe_per_rank": probes,
                "calibrated_topology": calib.to_dict(),
                "case_wall_s": wall,
                "load_1min": [probes[0]["load_1min"], per_rank[0]["load_1min_after"]],
            }
        )
        add_prediction(rows[-1], w, plan)
    return rows


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| workload | batch | side | samples/s | step ms | vs trw | vs TorchRec | predicted ms (pred/meas) | loss step 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["workload"], r["batch_size"], r["side"], r.get("repeat", 0)): r for r in rows}
    order = {s: i for i, s in enumerate(SIDES + OPTIONAL_SIDES)}

    def key(r: dict[str, Any]) -> tuple[int, str, int, int]:
        return (r["batch_size"], r["workload"], r.get("repeat", 0), order.get(r["side"], 99))

    for r in sorted(rows, key=key):
        case = (r["workload"], r["batch_size"])
        trw = by.get((*case, "trw", r.get("repeat", 0)))
        tr = by.get((*case, "torchrec", r.get("repeat", 0)))
        vs = f"{r['samples_per_s'] / trw['samples_per_s']:.2f}x" if trw else "-"
        vt = f"{r['samples_per_s'] / tr['samples_per_s']:.2f}x" if tr else "-"
        pred = (
            f"{1e3 * r['predicted_step_s']:.0f} ({r['predicted_over_measured']:.2f})"
            if r["predicted_step_s"] is not None
            else "-"
        )
        out.append(
            f"| {r['workload']} | {r['batch_size']} | {r['side']} | {r['samples_per_s']:.0f} | "
            f"{1e3 * r['step_s']:.0f} | {vs} | {vt} | {pred} | {r['loss_step0']:.6f} |"
        )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars: mean-over-ranks step time by phase, per side, one panel per case
    (workloads across, batch sizes down); a black mark at each run's predicted step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    batches = sorted({r["batch_size"] for r in rows})
    phases = list(rows[0]["phases_s_per_rank"][0])
    fig, axes = plt.subplots(
        len(batches), len(names), figsize=(4.2 * len(names), 4.2 * len(batches)), squeeze=False
    )
    for i, b in enumerate(batches):
        for j, wl in enumerate(names):
            ax = axes[i][j]
            mine = [r for r in rows if (r["workload"], r["batch_size"]) == (wl, b)]
            if not mine:
                ax.set_axis_off()
                continue
            known = SIDES + OPTIONAL_SIDES
            mine.sort(key=lambda r: known.index(r["side"]) if r["side"] in known else 99)
            sides = [r["side"] for r in mine]
            bottom = [0.0] * len(mine)
            for ph in phases:
                vals = [
                    sum(p[ph] for p in r["phases_s_per_rank"]) / len(r["phases_s_per_rank"])
                    for r in mine
                ]
                ax.bar(sides, vals, bottom=bottom, label=ph)
                bottom = [a + v for a, v in zip(bottom, vals)]
            pred = [r.get("predicted_step_s") for r in mine]
            ax.plot(
                [s for s, p in zip(sides, pred) if p is not None],
                [p for p in pred if p is not None],
                "k_",
                markersize=18,
                markeredgewidth=2,
                label="predicted",
            )
            ax.set_title(f"{wl}, batch {b}")
            ax.set_ylabel("s per step (mean over ranks)")
            ax.tick_params(axis="x", rotation=60)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=80)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embark.bench_cluster")
    p.add_argument("--workloads", default="dlrm_dcnv2,t180,t200,t510")
    p.add_argument("--batch-sizes", default="512")
    p.add_argument("--scale", type=float, default=1000.0)
    p.add_argument("--dense-scale", type=int, default=32, help="narrow the dense part by this")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"comma-separated, of {', '.join(SIDES + OPTIONAL_SIDES)}",
    )
    p.add_argument(
        "--inter-bytes-per-s",
        type=float,
        default=EMULATED_INTER_NODE_BYTES_PER_S,
        help="inter-node bandwidth per rank (the node link is ranks-per-node times this)",
    )
    p.add_argument("--intra-ratio", type=float, default=EMULATED_INTRA_TO_INTER_RATIO)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each case this many times (each its own torchrun world, sides rotated); "
        "rows carry their repeat index and are compared within it",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_cluster.json"))
    p.add_argument(
        "--append",
        action="store_true",
        help="keep --out's rows of other cases (a case run again replaces its rows)",
    )
    p.add_argument(
        "--repredict",
        action="store_true",
        help="only recompute the predictions of --out's rows (no run)",
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.sides.split(",") if s and s not in SIDES + OPTIONAL_SIDES]
    if unknown:
        p.error(f"--sides: unknown {unknown}; expected some of {list(SIDES + OPTIONAL_SIDES)}")
    out = Path(args.out)
    if args.repredict:
        stored = json.loads(out.read_text())
        repredict(stored)
        stored["predictions_git_sha"] = git_sha()
        _publish(stored, out)
        print("\n".join(table_lines(stored["rows"])))
        return 0
    why = missing_capability()
    if why is not None:
        print(f"bench_cluster: {why}", file=sys.stderr)
        return 2
    node_rate = 8 * args.inter_bytes_per_s * RANKS_PER_NODE
    shape = LinkShape(rate_bits_per_s=node_rate, intra_rate_bits_per_s=node_rate * args.intra_ratio)
    shaping = {
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "node_link_bits_per_s": node_rate,
        "node_loopback_bits_per_s": node_rate * args.intra_ratio,
        "tc": shape.tbf_args(),
    }
    doc: dict[str, Any] = {"rows": []}
    if args.append and out.exists():
        doc = json.loads(out.read_text())
        if doc.get("shaping") != shaping:
            raise ValueError(f"--append: {out} was measured with other links: {doc.get('shaping')}")
    doc.update(
        benchmark="embark_cluster",
        git_sha=git_sha(),
        machine={"platform": platform.platform(), "cpus": os.cpu_count()},
        shaping=shaping,
    )
    doc.setdefault("args", []).append(scrub_paths(vars(args)))
    rows: list[dict[str, Any]] = doc["rows"]
    turn = len({(r["workload"], r["batch_size"]) for r in rows})
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(NODES, shape) as c:
        for name in args.workloads.split(","):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                rows[:] = [r for r in rows if (r["workload"], r["batch_size"]) != (name, batch)]
                for rep in range(args.repeats):
                    print(
                        f"{name} batch {batch} repeat {rep} (load {_load()}) ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    new = run_case(c, name, batch, args, Path(tmp) / str(rep), turn)
                    turn += 1
                    for r in new:
                        r["repeat"] = rep
                    rows += new
                    _publish(doc, out)  # after every run: a cut-short run keeps what it measured
                    for line in table_lines(new):
                        print(line, file=sys.stderr, flush=True)
    print("\n".join(table_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
