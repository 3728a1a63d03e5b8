"""FP16/BF16-trained tables against FP32 training over several seeds: per-seed held-out AUC,
the mean paired difference with its standard error, and the FP32-vs-FP32 (float32 operation
order) spread that bounds what any difference can mean.

    python -m benchmarks.embark.bench_half_auc_seeds --workload tiny --seeds 0 1 2 3 4
        [--sides fp32 fp32-reference fp16-nearest fp16-stochastic bf16-stochastic]

Per seed, every side starts from the same initial model (``build_model(seed)``) and trains on
the same batches (``SyntheticCTR(seed)``, train split), then is scored on held-out batches
(no training sample among them): the eval split, or for a preset with ``split="test"`` the
test split, its validation (eval-split) AUC recorded beside it. The hyperparameters are fixed
per preset in :data:`PRESETS` (those of the earlier single-seed runs in ``docs/benchmarks.md``,
and ``dlrm_dcnv2_lr02`` chosen on validation AUC), never tuned on the test batches. Each (workload, side, seed) result is one row of
``benchmarks/results/embark_half_auc_seeds.json``; rows of other cases are kept, so sides can be
run in separate invocations, and the summary is recomputed over all rows of the workload.

Sides: ``fp32`` (FBGEMM's fused FP32 update), ``fp32-reference`` (the same update by the
reference kernel: float32 operation order only), ``fp16-nearest`` (FBGEMM's FP16 kernel),
``fp16-stochastic`` and ``bf16-stochastic`` (stochastic rounding: the compiled fused backward),
``bf16-nearest``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.meta import RESULTS_DIR, git_changed, git_sha, write_json
from embark.data import SyntheticCTR
from embark.models import build_model, get_workload
from embark.quant import evaluate_auc
from embark.training.config import (
    EmbeddingKernel,
    EmbeddingOptimizerKind,
    OptimizerKind,
    TableRounding,
    TrainConfig,
)
from embark.training.trainer import Trainer, TrainingDiverged
from hps.rowformat import RowDtype


@dataclass(frozen=True)
class Preset:
    """A workload's fixed training recipe (dense optimizer and lr, tables' lr, steps)."""

    scale: float
    steps: int
    batch_size: int
    optimizer: OptimizerKind
    lr: float
    embedding_lr: float | None
    test_batches: int
    warmup: int = 20
    #: the workload trained (``None``: the preset's own name)
    workload: str | None = None
    #: the split scored as ``auc``; a preset scored on ``test`` also records ``val_auc`` on
    #: the ``eval`` (validation) split, the only one its setting was chosen on
    split: str = "eval"


#: fixed before any of these runs: the settings of the single-seed runs they re-examine
PRESETS = {
    "tiny": Preset(1.0, 800, 256, OptimizerKind.ADAGRAD, 0.05, None, 64),
    "dlrm_dcnv2": Preset(1000.0, 100, 256, OptimizerKind.SGD, 0.05, 0.05, 32),
    # the dense lr 2.5x lower (loss spikes start once warm-up reaches 0.05, FP32 included)
    # and 150 steps; chosen on validation AUC (FP32 vs FP32-reference agreement), scored on
    # the test split
    "dlrm_dcnv2_lr02": Preset(
        1000.0, 150, 256, OptimizerKind.SGD, 0.02, 0.05, 32, workload="dlrm_dcnv2", split="test"
    ),
}

#: side -> (table dtype, rounding, kernel)
SIDES: dict[str, tuple[RowDtype, TableRounding, EmbeddingKernel]] = {
    "fp32": (RowDtype.FP32, TableRounding.NEAREST, EmbeddingKernel.AUTO),
    "fp32-reference": (RowDtype.FP32, TableRounding.NEAREST, EmbeddingKernel.REFERENCE),
    "fp16-nearest": (RowDtype.FP16, TableRounding.NEAREST, EmbeddingKernel.AUTO),
    "fp16-stochastic": (RowDtype.FP16, TableRounding.STOCHASTIC, EmbeddingKernel.AUTO),
    "bf16-stochastic": (RowDtype.BF16, TableRounding.STOCHASTIC, EmbeddingKernel.AUTO),
    "bf16-nearest": (RowDtype.BF16, TableRounding.NEAREST, EmbeddingKernel.AUTO),
}


def _cfg(preset: Preset, side: str, seed: int) -> TrainConfig:
    dtype, rounding, kernel = SIDES[side]
    return TrainConfig(
        optimizer=preset.optimizer,
        lr=preset.lr,
        embedding_lr=preset.embedding_lr,
        embedding_optimizer=EmbeddingOptimizerKind.ROWWISE_ADAGRAD,
        warmup_steps=preset.warmup,
        seed=seed,
        table_dtype=dtype,
        table_rounding=rounding,
        embedding_kernel=kernel,
    )


def run_seed(workload_name: str, seed: int, sides: Sequence[str]) -> list[dict[str, Any]]:
    """One row per side: held-out AUC after training from seed ``seed``'s init and data."""
    preset = PRESETS[workload_name]
    workload = get_workload(preset.workload or workload_name)
    if preset.scale > 1:
        workload = workload.scaled(preset.scale)
    data = SyntheticCTR(workload, batch_size=preset.batch_size, seed=seed)
    train = list(data.batches(preset.steps))
    test = list(data.batches(preset.test_batches, split=preset.split))
    val = list(data.batches(preset.test_batches, split="eval")) if preset.split != "eval" else []
    init = build_model(workload, seed=seed)
    untrained = evaluate_auc(init, test)
    rows = []
    for side in sides:
        model = copy.deepcopy(init)
        t0 = time.perf_counter()
        diverged: int | None = None
        try:
            Trainer(model, _cfg(preset, side, seed)).fit(train, preset.steps, progress=False)
        except TrainingDiverged as err:  # recorded, not scored: the other sides still run
            diverged = err.step
        rows.append(
            {
                "workload": workload_name,
                "scale": preset.scale,
                "side": side,
                "seed": seed,
                "auc": None if diverged is not None else evaluate_auc(model, test),
                "split": preset.split,
                "val_auc": None if diverged is not None or not val else evaluate_auc(model, val),
                "diverged_at_step": diverged,
                "untrained_auc": untrained,
                "train_seconds": time.perf_counter() - t0,
                "preset": preset.__dict__,
                "test_samples": sum(b.batch_size for b in test),
                "git_sha": git_sha(),
                "git_changed": git_changed(),
            }
        )
    return rows


def _mean_se(xs: list[float]) -> dict[str, float]:
    n = len(xs)
    sd = statistics.stdev(xs) if n > 1 else math.nan
    return {"n": n, "mean": statistics.fmean(xs), "sd": sd, "se": sd / math.sqrt(n)}


def _paired(mine: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per side: ``key``'s per-seed AUCs and its paired difference to ``fp32``."""
    by = {(r["side"], r["seed"]): r[key] for r in mine if r.get(key) is not None}
    out: dict[str, Any] = {}
    for side in SIDES:
        seeds = sorted(s for (sd, s) in by if sd == side)
        if not seeds:
            continue
        entry: dict[str, Any] = {"auc_by_seed": {str(s): by[(side, s)] for s in seeds}}
        entry["diverged_seeds"] = sorted(
            r["seed"] for r in mine if r["side"] == side and r.get("auc") is None
        )
        paired = [s for s in seeds if ("fp32", s) in by]
        if side != "fp32" and paired:
            diffs = [by[(side, s)] - by[("fp32", s)] for s in paired]
            entry["minus_fp32_by_seed"] = {str(s): d for s, d in zip(paired, diffs, strict=True)}
            entry["minus_fp32"] = _mean_se(diffs)
            entry["max_abs_minus_fp32"] = max(abs(d) for d in diffs)
        out[side] = entry
    return out


def summarize(rows: list[dict[str, Any]], workload_name: str) -> dict[str, Any]:
    """Per side: its per-seed AUCs and the paired difference to ``fp32`` over the seeds both
    have (mean, sample sd, standard error = sd / sqrt(n)); a run that diverged (its loss not
    finite, :class:`TrainingDiverged`) is listed, not scored. A preset scored on ``test``
    adds the same on its validation AUCs under ``"validation"`` (what its setting was chosen
    on)."""
    mine = [r for r in rows if r["workload"] == workload_name]
    out = _paired(mine, "auc")
    if any(r.get("val_auc") is not None for r in mine):
        out["validation"] = _paired(mine, "val_auc")
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS_DIR / "embark_half_auc_seeds.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    old: list[dict[str, Any]] = json.loads(out.read_text())["rows"] if out.exists() else []
    for seed in args.seeds:
        new = run_seed(args.workload, seed, args.sides)
        keys = {(r["workload"], r["side"], r["seed"]) for r in new}
        old = [r for r in old if (r["workload"], r["side"], r["seed"]) not in keys] + new
        # written after every seed: a long run interrupted keeps what it measured
        summaries = {w: summarize(old, w) for w in sorted({r["workload"] for r in old})}
        path = write_json(out, old, summary=summaries)
    return path


if __name__ == "__main__":
    print(main())
