"""Half-size tables in training: held-out AUC of FP16-trained tables against FP32 training (and
of INT8 / INT4 tables quantized from the FP32-trained model), FP16 vs FP32 step throughput,
and the peak memory of a large FP16 run in one process.

    python -m benchmarks.embark.bench_half_tables auc [--workload tiny] [--scale 1]
        [--steps 400] [--batch-size 256] [--optimizer adagrad] [--lr 0.05] [--embedding-lr E]
        [--test-batches 32] [--fewer-sides]
    python -m benchmarks.embark.bench_half_tables speed [--workload dlrm_dcnv2] [--scale 100]
        [--steps 12] [--batch-size 1024]
    python -m benchmarks.embark.bench_half_tables memory [--workload dlrm_dcnv2] [--scale 5]
        [--steps 5] [--batch-size 1024]

``auc``: one model initialised once, trained twice on the same batches (row-wise Adagrad,
FBGEMM's fused update for FP32 tables; FP16 tables stochastically rounded on our compiled
fused backward, and rounded to nearest on FBGEMM's FP16 kernel), scored on ``--test-batches`` held-out
eval batches (another split of the synthetic stream: no training sample among them);
the FP32-trained model's tables are then quantized to INT8 and INT4 and scored again.
``speed``: FP32, FP16 (nearest: FBGEMM) and FP16 (stochastic: the compiled fused backward of
:mod:`embark.training.half_kernel`, or the reference path when it is not built —
``half_kernel`` in the row says which) trainers over the same initial model step on the same
batches, interleaved, median step time of each.
``memory``: a model built with FP16 tables (never held in FP32) trains ``--steps`` steps on
random fixed-hotness batches; the process's peak RSS (``ru_maxrss``) is reported. Each mode writes its row to
``benchmarks/results/embark_half_tables.json`` (rows of other cases kept).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.meta import RESULTS_DIR, write_json
from embark.data import Batch, SyntheticCTR
from embark.data.jagged import JaggedBatch
from embark.models import DLRM, build_model, get_workload
from embark.models.workloads import Workload
from embark.quant import EmbeddingQuantConfig, evaluate_auc, quantize_embeddings_
from embark.training.config import (
    EmbeddingKernel,
    EmbeddingOptimizerKind,
    TableRounding,
    TrainConfig,
)
from embark.training.half_kernel import load_extension
from embark.training.trainer import Trainer
from hps.rowformat import RowDtype, row_bytes


def _workload(args: argparse.Namespace) -> Workload:
    workload = get_workload(args.workload)
    return workload.scaled(args.scale) if args.scale > 1 else workload


def _cfg(
    args: argparse.Namespace, dtype: RowDtype, rounding: TableRounding = TableRounding.STOCHASTIC
) -> TrainConfig:
    return TrainConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        embedding_lr=args.embedding_lr,
        embedding_optimizer=EmbeddingOptimizerKind.ROWWISE_ADAGRAD,
        warmup_steps=args.warmup,
        seed=args.seed,
        table_dtype=dtype,
        table_rounding=rounding,
    )


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def auc_case(args: argparse.Namespace) -> dict[str, Any]:
    workload = _workload(args)
    data = SyntheticCTR(workload, batch_size=args.batch_size, seed=args.seed)
    train = list(data.batches(args.steps))
    test = list(data.batches(args.test_batches, split="eval"))
    init = build_model(workload, seed=args.seed)
    sides = {
        "fp32": _cfg(args, RowDtype.FP32),
        "fp16 stochastic": _cfg(args, RowDtype.FP16, TableRounding.STOCHASTIC),
        "fp16 nearest": _cfg(args, RowDtype.FP16, TableRounding.NEAREST),
        # the noise floor: FP32 again, its tables updated by the reference kernel (the same
        # update up to float32 operation order) — how far a 1e-7 perturbation moves the AUC
        "fp32 reference kernel": replace(
            _cfg(args, RowDtype.FP32), embedding_kernel=EmbeddingKernel.REFERENCE
        ),
    }
    if args.fewer_sides:
        sides = {k: v for k, v in sides.items() if k in ("fp32", "fp16 stochastic")}
    models: dict[str, DLRM] = {}
    seconds: dict[str, float] = {}
    for name, cfg in sides.items():
        model = copy.deepcopy(init)
        trainer = Trainer(model, cfg)
        t0 = time.perf_counter()
        trainer.fit(train, args.steps, progress=False)
        seconds[name] = time.perf_counter() - t0
        models[name] = model
    aucs = {name: evaluate_auc(m, test) for name, m in models.items()}
    base = aucs["fp32"]
    for dtype in (RowDtype.INT8, RowDtype.INT4):
        q = quantize_embeddings_(copy.deepcopy(models["fp32"]), EmbeddingQuantConfig(dtype))
        aucs[f"fp32-trained, {dtype.value} tables"] = evaluate_auc(q, test)
    dim = workload.tables[0].dim
    return {
        "mode": "auc",
        "workload": args.workload,
        "scale": args.scale,
        "rows": sum(t.num_rows for t in workload.tables),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "embedding_lr": args.embedding_lr,
        "test_samples": sum(b.batch_size for b in test),
        "teacher_auc": data.teacher_auc(args.test_batches),
        "untrained_auc": evaluate_auc(init, test),
        "train_seconds": seconds,
        "auc": aucs,
        "auc_change_vs_fp32_training": {k: v - base for k, v in aucs.items()},
        "bytes_per_row": {d.value: row_bytes(d, dim) for d in RowDtype},
    }


def _step_ms(
    trainers: dict[str, Trainer], batches: list[Batch], warm: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall-clock and process-CPU ms per step of each trainer (the CPU time is the
    steadier figure on a loaded machine for a single-threaded run)."""
    wall: dict[str, list[float]] = {k: [] for k in trainers}
    cpu: dict[str, list[float]] = {k: [] for k in trainers}
    for i, b in enumerate(batches):
        for name, t in trainers.items():  # interleaved: every side steps on batch i in turn
            t0, c0 = time.perf_counter(), time.process_time()
            t.train_step(b)
            if i >= warm:
                wall[name].append(1e3 * (time.perf_counter() - t0))
                cpu[name].append(1e3 * (time.process_time() - c0))
    return (
        {k: statistics.median(v) for k, v in wall.items()},
        {k: statistics.median(v) for k, v in cpu.items()},
    )


def speed_case(args: argparse.Namespace) -> dict[str, Any]:
    workload = _workload(args)
    data = SyntheticCTR(workload, batch_size=args.batch_size, seed=args.seed)
    batches = list(data.batches(args.steps))
    init = build_model(workload, seed=args.seed)
    trainers = {
        "fp32": Trainer(copy.deepcopy(init), _cfg(args, RowDtype.FP32)),
        "fp16 nearest (fbgemm)": Trainer(
            copy.deepcopy(init), _cfg(args, RowDtype.FP16, TableRounding.NEAREST)
        ),
        "fp16 stochastic (fused kernel)": Trainer(
            init, _cfg(args, RowDtype.FP16, TableRounding.STOCHASTIC)
        ),
    }
    load_before = os.getloadavg()
    ms, cpu_ms = _step_ms(trainers, batches, warm=2)
    sps = {k: args.batch_size / (v / 1e3) for k, v in ms.items()}
    cpu_sps = {k: args.batch_size / (v / 1e3) for k, v in cpu_ms.items()}
    return {
        "mode": "speed",
        "workload": args.workload,
        "scale": args.scale,
        "rows": sum(t.num_rows for t in workload.tables),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "step_ms_median": ms,
        "samples_per_s": sps,
        "ratio_vs_fp32": {k: v / sps["fp32"] for k, v in sps.items()},
        "cpu_ms_median": cpu_ms,
        "cpu_ratio_vs_fp32": {k: v / cpu_sps["fp32"] for k, v in cpu_sps.items()},
        "kernel_fp32": EmbeddingKernel.AUTO.value,
        "half_kernel": "compiled" if load_extension() is not None else "reference",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "threads": args.threads,
    }


def _random_batches(workload: Workload, args: argparse.Namespace) -> list[Batch]:
    """Fixed-hotness batches of uniform ids and coin-flip labels: a synthetic teacher would
    hold a float32 copy of every table (its tables are the workload's), doubling the memory
    this case measures."""
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.steps):
        b = args.batch_size
        ids = [torch.randint(0, t.num_rows, (b, t.hotness), generator=gen) for t in workload.tables]
        sparse = JaggedBatch.from_dense_bags([t.name for t in workload.tables], ids)
        dense = torch.rand(b, workload.dense_features, generator=gen)
        labels = torch.randint(0, 2, (b,), generator=gen).float()
        out.append(Batch(dense, sparse, labels))
    return out


def memory_case(args: argparse.Namespace) -> dict[str, Any]:
    workload = _workload(args)
    rows = sum(t.num_rows for t in workload.tables)
    t0 = time.perf_counter()
    model = build_model(workload, seed=args.seed, table_dtype=RowDtype.FP16)
    build_s = time.perf_counter() - t0
    after_build = _peak_rss_gib()
    trainer = Trainer(model, _cfg(args, RowDtype.FP16))
    t0 = time.perf_counter()
    report = trainer.fit(_random_batches(workload, args), args.steps, progress=False)
    return {
        "mode": "memory",
        "workload": args.workload,
        "scale": args.scale,
        "rows": rows,
        "table_gib_fp16": rows * row_bytes(RowDtype.FP16, workload.tables[0].dim) / 2**30,
        "table_gib_fp32": rows * row_bytes(RowDtype.FP32, workload.tables[0].dim) / 2**30,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "build_seconds": build_s,
        "train_seconds": time.perf_counter() - t0,
        "mean_loss": report.loss_sum / max(report.steps, 1),
        "peak_rss_gib_after_build": after_build,
        "peak_rss_gib": _peak_rss_gib(),
    }


def _case(row: dict[str, Any]) -> tuple[str, str, float]:
    return row["mode"], row["workload"], row["scale"]


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["auc", "speed", "memory"])
    p.add_argument("--workload", default=None, help="tiny (auc) / dlrm_dcnv2 (speed, memory)")
    p.add_argument("--scale", type=float, default=None, help="1 / 100 / 5 by mode")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--optimizer", default="adagrad", help="the dense part's: adagrad or sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--embedding-lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--test-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fewer-sides", action="store_true", help="auc: fp32 and fp16 stochastic only")
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_half_tables.json"))
    args = p.parse_args(argv)
    defaults = {
        "auc": ("tiny", 1.0, 400, 256),
        "speed": ("dlrm_dcnv2", 100.0, 12, 1024),
        "memory": ("dlrm_dcnv2", 5.0, 5, 1024),
    }[args.mode]
    for field, value in zip(("workload", "scale", "steps", "batch_size"), defaults):
        if getattr(args, field) is None:
            setattr(args, field, value)
    torch.set_num_threads(args.threads)
    case = {"auc": auc_case, "speed": speed_case, "memory": memory_case}[args.mode]
    row = case(args)
    out = Path(args.out)
    rows = [row]
    if out.exists():  # keep the other cases' rows
        old = json.loads(out.read_text()).get("rows", [])
        rows = [r for r in old if _case(r) != _case(row)]
        rows.append(row)
    return write_json(out, rows)


if __name__ == "__main__":
    print(main())
