"""Training throughput of our default trainer against TorchRec ``DistributedModelParallel``
with FBGEMM's fused CPU kernels: same tables, same batches, same optimizer, interleaved.

    python -m benchmarks.embark.bench_training [--quick] [--scales 1000,300,100,30,10]
        [--batches 512,4096] [--worlds 1,2,4] [--embedding-optimizer adagrad]
        [--embedding-kernel auto] [--reps 5] [--steps-per-rep 2] [--warmup 2] [--out F]

Workload: ``dlrm_dcnv2`` with every table's rows divided by S (26 tables of dim 128, 214 ids
per sample; S = 10 is 20.4 M rows, 10.5 GB of fp32 weights). The sides
(:mod:`benchmarks.embark.training_sides`): ``ours`` is :class:`embark.training.Trainer`
(world 1) or :class:`embark.sharding.ShardedDLRM` under it with our planner's plan;
``torchrec`` is DMP over an ``EmbeddingBagCollection`` on FBGEMM's fused kernel, the
embedding optimizer applied in backward, TorchRec's planner's plan, and our DLRM-DCNv2 dense
part as a plain module (so only the embedding path differs). Embedding optimizer: exact
Adagrad (MLPerf's) unless ``--embedding-optimizer rowwise_adagrad|sgd``; the dense part
trains with Adagrad on both sides; one learning rate for everything.

Worlds: 1 (one process per side, torch's default threads), 2 (one node of 2 ranks) and 4
(2 nodes × 2 ranks, :func:`benchmarks.embark.bench_sharding.topology_2x2`), gloo, one thread
per rank, every rank a process launched as ``bench_sharding`` launches its world (file
rendezvous). Each side is its own world of processes, so the peak RSS of a side is its
own; the driver steps the two worlds in turn — per repetition ``--steps-per-rep`` steps of
one, then of the other, the first side alternating — so a shared host's load falls on both
alike. The first ``--warmup`` steps of each side are not timed. A step's time is the
slowest rank's (a barrier before each step); the figure is the median over the timed steps.

Memory: before a case, each side's peak RSS is estimated from the table sizes and the
optimizer state; a side whose estimate exceeds 90 % of the memory available now is skipped
(the row says why), and two sides that do not fit together run one after the other (the
row says ``interleaved: false``).

Which embedding path ours used is in each row: ``dense-grad`` when this checkout's
``TrainConfig`` has no ``embedding_kernel`` field (``nn.EmbeddingBag`` with dense gradients
and ``torch.optim``), else the configured ``--embedding-kernel`` (or the kernel the trainer
reports it chose).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.embark.bench_planner import _layouts
from benchmarks.embark.bench_sharding import topology_2x2
from benchmarks.embark.training_sides import (
    EMBEDDING_OPTIMIZERS,
    SIDES,
    case_workload,
    fused_fields_present,
)
from benchmarks.meta import REPO_ROOT, RESULTS_DIR, write_json
from embark.models.dlrm import SCRATCH_ELEMENTS
from embark.planner import plan_sharding
from embark.topology import get_topology
from embark.types import Topology

log = logging.getLogger("bench_training")

MEMORY_FRACTION = 0.9  # of MemAvailable a side (or both sides together) may be estimated at
PROCESS_BASE_BYTES = 0.7e9  # torch + torchrec + fbgemm imported, gloo up (measured: 0.6-0.9 GB)
ACTIVATION_BYTES_PER_SAMPLE = 250e3  # DLRM-DCNv2 forward + backward (batch 4096 ≈ 1 GB)
QUICK = {
    "scales": "1000",
    "batches": "512",
    "worlds": "1,2",
    "reps": 3,
    "steps_per_rep": 1,
    "warmup": 1,
}


@dataclass(frozen=True)
class Case:
    """One measured setting."""

    scale: float
    batch_size: int
    world: int


# ----------------------------------------------------------------------------- memory
def mem_available_bytes() -> float:
    """``MemAvailable`` of ``/proc/meminfo`` (inf where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def estimate_rss_bytes(cfg: dict[str, Any], side: str, fused: bool) -> float:
    """A side's peak RSS over all its ranks: weights, gradients and optimizer state of the
    tables, plus a base and the activations per process.

    ours without the fused path: every table holds a dense gradient and (Adagrad) a state as
    large as itself; with it, weights + state. World > 1: every rank of ours builds only its
    shards (``ShardedDLRM.build``: plus its 4 MiB scratch); every rank of TorchRec draws a
    whole table at a time."""
    w = case_workload(cfg)
    world = cfg["world"]
    weights = float(sum(t.num_rows * t.dim * 4 for t in w.tables))
    rows = float(sum(t.num_rows for t in w.tables))
    opt = cfg["embedding_optimizer"]
    state = {"adagrad": weights, "rowwise_adagrad": 4 * rows, "sgd": 0.0}[opt]
    per_process = PROCESS_BASE_BYTES + ACTIVATION_BYTES_PER_SAMPLE * cfg["batch_size"] / world
    if side == "ours":
        tables = weights + state + (0.0 if fused else weights)
        build = 4.0 * SCRATCH_ELEMENTS * world if world > 1 else 0.0
    else:
        tables = weights + state
        build = max(t.num_rows * t.dim * 4 for t in w.tables) * world if world > 1 else 0.0
    return tables + build + per_process * world


# ------------------------------------------------------------------------------ plans
def topology_for(world: int) -> Topology:
    """World 1 and 2: one ``cpu-local`` node of ``world`` ranks; 4: 2 nodes × 2 ranks."""
    if world == 4:
        return topology_2x2("cpu-local")
    if world in (1, 2):
        return replace(get_topology("cpu-local"), gpus_per_node=world)
    raise ValueError(f"world must be 1, 2 or 4, got {world}")


def case_config(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The ``config.json`` both sides' workers read."""
    cfg: dict[str, Any] = {
        "workload": args.workload,
        "scale": case.scale,
        "batch_size": case.batch_size,
        "world": case.world,
        "seed": args.seed,
        "lr": args.lr,
        "eps": 1e-8,
        "embedding_optimizer": args.embedding_optimizer,
        "embedding_kernel": args.embedding_kernel,
        "num_batches": min(args.warmup + args.reps * args.steps_per_rep, args.batch_pool),
        "plans": {},
    }
    topo = topology_for(case.world)
    cfg["torchrec_topology"] = {"local_world_size": topo.gpus_per_node}
    if case.world > 1:
        plan = plan_sharding(case_workload(cfg), topo, case.batch_size, "auto")
        cfg["plans"]["ours"] = plan.to_dict()
        cfg["ours_layouts"] = _layouts(plan)
    return cfg


# ----------------------------------------------------------------------- side worlds
class SideWorld:
    """One side's world of worker processes, commanded through files in ``d``."""

    def __init__(self, d: Path, side: str, world: int, timeout_s: float) -> None:
        self.d, self.side, self.world, self.timeout_s = d, side, world, timeout_s
        self.n = 0
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        if world > 1:  # one thread per rank: the ranks share the host's cores
            env |= {"OMP_NUM_THREADS": "1", "BENCH_TRAINING_THREADS": "1"}
        self.logs = [d / f"log.{side}.{r}.txt" for r in range(world)]
        self.procs = []
        for r in range(world):
            with self.logs[r].open("w") as f:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.embark.training_sides"]
                        + [str(d), side, str(r), str(world)],
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )

    def _collect(self, name: str) -> list[dict[str, Any]]:
        """Every rank's ``name.{rank}.json``, waiting; raises when a rank died or timed out."""
        paths = [self.d / f"{name}.{r}.json" for r in range(self.world)]
        t0 = time.monotonic()
        while not all(p.exists() for p in paths):
            for r, p in enumerate(self.procs):
                if p.poll() is not None and not paths[r].exists():
                    raise RuntimeError(
                        f"{self.side} rank {r} exited ({p.returncode}):\n{self._tail(r)}"
                    )
            if time.monotonic() - t0 > self.timeout_s:
                raise RuntimeError(f"{self.side}: no {name} within {self.timeout_s:.0f} s")
            time.sleep(0.005)
        return [json.loads(p.read_text()) for p in paths]

    def _tail(self, r: int) -> str:
        err = self.d / f"error.{self.side}.{r}.txt"
        text = err.read_text() if err.exists() else self.logs[r].read_text()
        return text[-3000:]

    def ready(self) -> list[dict[str, Any]]:
        return self._collect(f"ready.{self.side}")

    def run(self, first: int, steps: int) -> list[dict[str, Any]]:
        """Steps ``first .. first + steps - 1`` on every rank; each rank's seconds and losses."""
        self._command({"steps": steps, "first": first})
        return self._collect(f"res.{self.side}.{self.n - 1}")

    def stop(self) -> list[dict[str, Any]]:
        self._command({"stop": True})
        done = self._collect(f"done.{self.side}")
        for p in self.procs:
            p.wait(timeout=self.timeout_s)
        return done

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def _command(self, doc: dict[str, Any]) -> None:
        path = self.d / f"cmd.{self.side}.{self.n}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
        self.n += 1


@dataclass
class SideRecord:
    """What one side did in a case."""

    ready: list[dict[str, Any]]
    step_s: list[float]  # per step: the slowest rank's seconds, warm-up included
    losses: list[float]  # per step (rank 0's: the global loss)
    done: list[dict[str, Any]]


def _append(rec: SideRecord, res: list[dict[str, Any]]) -> None:
    rec.step_s += [max(steps) for steps in zip(*(r["seconds"] for r in res))]
    rec.losses += res[0]["losses"]


def run_sides(
    d: Path, sides: list[str], cfg: dict[str, Any], args: argparse.Namespace, together: bool
) -> dict[str, SideRecord]:
    """Run ``sides`` of one case: both worlds alive and stepped in turn (``together``), or
    each world alone, one after the other."""
    (d / "config.json").write_text(json.dumps(cfg))
    groups = [sides] if together else [[s] for s in sides]
    out: dict[str, SideRecord] = {}
    for group in groups:
        worlds = {s: SideWorld(d, s, cfg["world"], args.timeout) for s in group}
        try:
            for s, w in worlds.items():
                out[s] = SideRecord(w.ready(), [], [], [])
            for s, w in worlds.items():
                _append(out[s], w.run(0, args.warmup))
            for rep in range(args.reps):
                order = list(worlds) if rep % 2 == 0 else list(reversed(worlds))
                for s in order:
                    first = args.warmup + rep * args.steps_per_rep
                    _append(out[s], worlds[s].run(first, args.steps_per_rep))
            for s, w in worlds.items():
                out[s].done = w.stop()
        finally:
            for w in worlds.values():
                w.kill()
    return out


# ------------------------------------------------------------------------------- rows
def _base_row(case: Case, cfg: dict[str, Any], side: str) -> dict[str, Any]:
    w = case_workload(cfg)
    topo = topology_for(case.world)
    return {
        "workload": cfg["workload"],
        "scale": case.scale,
        "rows": sum(t.num_rows for t in w.tables),
        "weight_mb": sum(t.num_rows * t.dim * 4 for t in w.tables) / 1e6,
        "batch_size": case.batch_size,
        "world": case.world,
        "nodes": topo.num_nodes,
        "ranks_per_node": topo.gpus_per_node,
        "side": side,
        "plan": "ours" if side == "ours" else "torchrec",
        "embedding_optimizer": cfg["embedding_optimizer"],
        "dense_optimizer": "adagrad",
    }


def side_row(
    case: Case, cfg: dict[str, Any], side: str, rec: SideRecord | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """The JSON row of one side of one case (``rec`` ``None``: skipped, ``extra`` says why)."""
    row = _base_row(case, cfg, side) | extra
    if rec is None:
        return row | {"step_ms": None, "samples_per_s": None, "peak_rss_mb": None}
    timed = rec.step_s[int(cfg["warmup"]) :]
    med = statistics.median(timed)
    row |= {
        "embedding_kernel": rec.ready[0]["embedding_kernel"],
        "layouts": rec.ready[0].get("layouts") if side == "torchrec" else cfg.get("ours_layouts"),
        "threads_per_rank": rec.ready[0]["torch_threads"],
        "step_ms": 1e3 * med,
        "step_ms_min": 1e3 * min(timed),
        "step_ms_max": 1e3 * max(timed),
        "steps_timed": len(timed),
        "samples_per_s": case.batch_size / med,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rec.done),
        "peak_rss_total_mb": sum(r["peak_rss_mb"] for r in rec.done),
        "setup_rss_mb": max(r["rss_setup_mb"] for r in rec.ready),
        "setup_s": max(r["setup_s"] for r in rec.ready),
        "losses": rec.losses,
        "step_ms_all": [1e3 * s for s in rec.step_s],
    }
    return row


def run_case(case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both sides' rows of one case (skipped sides included, with the reason)."""
    cfg = case_config(case, args) | {"warmup": args.warmup}
    fused = fused_fields_present()
    avail = mem_available_bytes()
    est = {s: estimate_rss_bytes(cfg, s, fused) for s in SIDES}
    extra: dict[str, dict[str, Any]] = {
        s: {"estimated_rss_mb": est[s] / 1e6, "available_mb": avail / 1e6} for s in SIDES
    }
    runnable = []
    for s in SIDES:
        if s == "ours" and not fused and args.embedding_optimizer != "adagrad":
            extra[s]["skipped"] = (
                f"this checkout's TrainConfig has no embedding_optimizer: ours cannot train "
                f"its tables with {args.embedding_optimizer}"
            )
        elif est[s] > MEMORY_FRACTION * avail:
            extra[s]["skipped"] = (
                f"estimated peak RSS {est[s] / 1e9:.1f} GB exceeds {MEMORY_FRACTION:.0%} of the "
                f"{avail / 1e9:.1f} GB available"
            )
        else:
            runnable.append(s)
    together = sum(est[s] for s in runnable) <= MEMORY_FRACTION * avail
    recs: dict[str, SideRecord] = {}
    if runnable:
        with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp:
            recs = run_sides(Path(tmp), runnable, cfg, args, together)
    for s in runnable:
        extra[s]["interleaved"] = together and len(runnable) == 2
    return [side_row(case, cfg, s, recs.get(s), extra[s]) for s in SIDES]


def case_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """ours ÷ torchrec samples/s and the loss agreement of one case's two rows."""
    by = {r["side"]: r for r in rows}
    ours, theirs = by.get("ours"), by.get("torchrec")
    if not (ours and theirs and ours.get("losses") and theirs.get("losses")):
        return None
    diffs = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])]
    return {
        "scale": ours["scale"],
        "batch_size": ours["batch_size"],
        "world": ours["world"],
        "ours_over_torchrec_samples_per_s": ours["samples_per_s"] / theirs["samples_per_s"],
        "loss_diff_step0": diffs[0],
        "loss_max_diff": max(diffs),
    }


# ------------------------------------------------------------------------------ output
def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "—"


def _gb(row: dict[str, Any]) -> float | None:
    mb = row.get("peak_rss_total_mb")
    return mb / 1e3 if mb is not None else None


def table_lines(rows: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one line per case, both sides side by side (RSS: all ranks)."""
    head = (
        "| S | rows | batch | world | ours ms | TorchRec ms | ours samples/s | "
        "TorchRec samples/s | ours ÷ TorchRec | ours RSS GB | TorchRec RSS GB | ours path | "
        "loss Δ step 0 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["scale"], r["batch_size"], r["world"]), {})[r["side"]] = r
    sums = {(s["scale"], s["batch_size"], s["world"]): s for s in summaries}
    for key, sides in by.items():
        o, t = sides["ours"], sides["torchrec"]
        s = sums.get(key, {})
        lines.append(
            f"| {key[0]:g} | {o['rows'] / 1e6:.2f} M | {key[1]} | {key[2]} | "
            f"{_fmt(o['step_ms'], '.0f')} | {_fmt(t['step_ms'], '.0f')} | "
            f"{_fmt(o['samples_per_s'], '.0f')} | {_fmt(t['samples_per_s'], '.0f')} | "
            f"{_fmt(s.get('ours_over_torchrec_samples_per_s'), '.2f')} | "
            f"{_fmt(_gb(o), '.2f')} | {_fmt(_gb(t), '.2f')} | "
            f"{o.get('embedding_kernel', '—')} | {_fmt(s.get('loss_diff_step0'), '.1e')} |"
        )
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"\nskipped {r['side']} at S={r['scale']:g} batch {r['batch_size']} "
                f"world {r['world']}: {r['skipped']}"
            )
    return lines


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{what} must be positive integers, got {text!r}")
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    p.add_argument("--workload", default="dlrm_dcnv2")
    p.add_argument("--scales", default="1000,300,100,30,10", help="rows divided by each")
    p.add_argument("--batches", default="512,4096", help="global batch sizes")
    p.add_argument("--worlds", default="1,2,4", help="1, 2 (one node) and/or 4 (2 × 2)")
    p.add_argument("--embedding-optimizer", default="adagrad", choices=EMBEDDING_OPTIMIZERS)
    p.add_argument(
        "--embedding-kernel",
        default="auto",
        choices=["auto", "fbgemm", "reference"],
        help="ours' embedding path (where TrainConfig has embedding_kernel)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="every learning rate, both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per side")
    p.add_argument("--steps-per-rep", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    p.add_argument("--batch-pool", type=int, default=16, help="distinct batches, cycled")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds a side may take per command"
    )
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_training.json"))
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    for k in ("reps", "steps_per_rep", "batch_pool"):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    args.scale_list = [float(s) for s in args.scales.split(",")]
    if min(args.scale_list) < 1:
        raise SystemExit(f"--scales must be >= 1, got {args.scales!r}")
    args.batch_list = _ints(args.batches, "--batches")
    args.world_list = _ints(args.worlds, "--worlds")
    bad = [w for w in args.world_list if w not in (1, 2, 4)]
    if bad:
        raise SystemExit(f"--worlds must be 1, 2 or 4, got {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse(argv)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for world in args.world_list:
        for batch in args.batch_list:
            for scale in args.scale_list:
                case = Case(scale, batch, world)
                log.info("S=%g batch %d world %d", scale, batch, world)
                case_rows = run_case(case, args)
                for r in case_rows:
                    log.info(
                        "  %-8s %s ms/step, peak RSS %s MB%s",
                        r["side"],
                        _fmt(r["step_ms"], ".0f"),
                        _fmt(r.get("peak_rss_total_mb"), ".0f"),
                        f" — skipped: {r['skipped']}" if r.get("skipped") else "",
                    )
                rows += case_rows
    summaries = [
        s
        for i in range(0, len(rows), len(SIDES))
        if (s := case_summary(rows[i : i + len(SIDES)])) is not None
    ]
    lines = table_lines(rows, summaries)
    sys.stdout.write("\n".join(lines) + "\n")
    path = write_json(
        args.out,
        rows,
        benchmark="embark_training",
        args={k: v for k, v in vars(args).items() if not k.endswith("_list")},
        summaries=summaries,
        ours_embedding_path_selectable=fused_fields_present(),
        wall_s=time.perf_counter() - t0,
        table="\n".join(lines),
    )
    log.info("wrote %s (%.0f s)", path, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
