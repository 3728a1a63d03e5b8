"""Quantized embedding tables: AUC change per row format, bytes, the planner's choice, and the
pooled lookup's time per format — on a trained synthetic DLRM.

    python -m benchmarks.embark.bench_quant [--workload dlrm_dcnv2] [--scale 1000]
        [--steps 300] [--batch-size 256] [--test-batches 32] [--val-batches 16]
        [--budget 0.25] [--reps 5] [--out benchmarks/results/embark_quant.json]

A model is trained for ``--steps`` (Adagrad, FBGEMM's fused table update); then every table is
quantized to each dtype in turn and the whole model is scored on ``--test-batches`` eval
batches (the AUC change against fp32 tables); the planner chooses per-table dtypes for
``--budget`` of the fp32 tables' bytes on ``--val-batches`` other eval batches (validation),
and its plan is scored on the test batches. Lookup time: one eval batch's bags of every table
pooled, fp32 ``nn.EmbeddingBag`` against each format through FBGEMM's fused kernel and through
the reference, interleaved, median of ``--reps`` rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.meta import RESULTS_DIR, write_json
from embark.data import Batch, SyntheticCTR
from embark.models import DLRM, build_model, get_workload
from embark.quant import (
    EmbeddingQuantConfig,
    RowDtype,
    evaluate_auc,
    model_size,
    plan_compression,
    quantize_embeddings_,
)
from embark.training.config import EmbeddingKernel, TrainConfig
from embark.training.trainer import Trainer
from hps.rowformat import row_bytes

DTYPES = (RowDtype.FP16, RowDtype.BF16, RowDtype.INT8, RowDtype.INT4, RowDtype.INT2)


def _train(args: argparse.Namespace) -> tuple[DLRM, SyntheticCTR, float]:
    workload = get_workload(args.workload)
    if args.scale > 1:
        workload = workload.scaled(args.scale)
    data = SyntheticCTR(workload, batch_size=args.batch_size, seed=args.seed)
    model = build_model(workload, seed=args.seed)
    trainer = Trainer(model, TrainConfig(lr=args.lr, seed=args.seed, warmup_steps=args.steps // 10))
    t0 = time.perf_counter()
    trainer.fit(data.batches(args.steps), args.steps, progress=False)
    return model, data, time.perf_counter() - t0


def _lookup_all(model: DLRM, batch: Batch) -> Callable[[], None]:
    sparse = batch.sparse

    def run() -> None:
        with torch.no_grad():
            model.pool(sparse)

    return run


def _time_lookups(model: DLRM, batch: Batch, reps: int) -> dict[str, float]:
    """Median ms of pooling every table of ``batch``, per format and kernel, interleaved."""
    sides: dict[str, Callable[[], None]] = {"fp32 nn.EmbeddingBag": _lookup_all(model, batch)}
    for dtype in (RowDtype.FP16, RowDtype.INT8, RowDtype.INT4):
        for kernel in (EmbeddingKernel.FBGEMM, EmbeddingKernel.REFERENCE):
            q = quantize_embeddings_(
                copy.deepcopy(model), EmbeddingQuantConfig(dtype, kernel=kernel)
            )
            sides[f"{dtype.value} {kernel.value}"] = _lookup_all(q, batch)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for run in sides.values():
        run()  # warm-up (kernels built)
    for _ in range(reps):
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    model, data, train_s = _train(args)
    test = list(data.batches(args.test_batches, split="eval"))
    val = list(data.batches(args.val_batches, split="eval", start=args.test_batches))
    base = evaluate_auc(model, test)
    dim = model.workload.tables[0].dim
    fp32 = model_size(model)
    formats: list[dict[str, Any]] = [
        {"dtype": "fp32", "bytes_per_row": row_bytes(RowDtype.FP32, dim), "auc": base,
         "auc_change": 0.0, "table_bytes": fp32.tables}
    ]  # fmt: skip
    for dtype in DTYPES:
        q = quantize_embeddings_(copy.deepcopy(model), EmbeddingQuantConfig(dtype))
        auc = evaluate_auc(q, test)
        formats.append(
            {
                "dtype": dtype.value,
                "bytes_per_row": row_bytes(dtype, dim),
                "auc": auc,
                "auc_change": auc - base,
                "table_bytes": model_size(q).tables,
            }
        )
    t0 = time.perf_counter()
    plan = plan_compression(model, val, budget_bytes=int(args.budget * fp32.tables))
    plan_s = time.perf_counter() - t0
    planned = quantize_embeddings_(copy.deepcopy(model), plan.config())
    plan_auc = evaluate_auc(planned, test)
    return {
        "workload": args.workload,
        "scale": args.scale,
        "rows": sum(t.num_rows for t in model.workload.tables),
        "tables": len(model.table_names),
        "dim": dim,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "train_seconds": train_s,
        "test_samples": sum(b.batch_size for b in test),
        "val_samples": sum(b.batch_size for b in val),
        "dense_bytes": fp32.dense,
        "formats": formats,
        "plan": {
            **plan.to_dict(),
            "test_auc": plan_auc,
            "test_auc_change": plan_auc - base,
            "seconds": plan_s,
        },
        "lookup_ms": _time_lookups(model, test[0], args.reps),
    }


def _case(row: dict[str, Any]) -> tuple[str, float, str]:
    return row["workload"], row["scale"], row.get("kind", "trained")


def lookups_only(args: argparse.Namespace) -> dict[str, Any]:
    """Lookup times alone (they do not depend on training): an initialised model."""
    workload = get_workload(args.workload)
    if args.scale > 1:
        workload = workload.scaled(args.scale)
    model = build_model(workload, seed=args.seed)
    batch = next(SyntheticCTR(workload, batch_size=args.batch_size).batches(1, split="eval"))
    return {
        "workload": args.workload,
        "scale": args.scale,
        "kind": "lookups",
        "batch_size": args.batch_size,
        "lookup_ms": _time_lookups(model, batch, args.reps),
    }


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="dlrm_dcnv2")
    p.add_argument("--scale", type=float, default=1000.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--test-batches", type=int, default=32)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lookups-only", action="store_true", help="time lookups of an untrained model")
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_quant.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = lookups_only(args) if args.lookups_only else run_case(args)
    out = Path(args.out)
    rows = [row]
    if out.exists():  # keep the other workloads' rows
        old = json.loads(out.read_text()).get("rows", [])
        rows = [r for r in old if _case(r) != _case(row)]
        rows.append(row)
    return write_json(out, rows)


if __name__ == "__main__":
    print(main())
