"""Train a DLRM on synthetic teacher data and report how close it gets to the teacher.

    python -m recipes.train_dlrm                 # tiny default, CPU, well under a minute
    python -m recipes.train_dlrm --help          # every knob with its default
    python -m recipes.train_dlrm --workload dlrm_dcnv2 --scale 20000 --steps 200

Writes into ``--out`` (default ``runs/train_dlrm-<UTC timestamp>`` under the current folder):
``results.json`` (``eval_auc``, ``eval_logloss``, ``teacher_auc``, ``train_auc``,
``samples_per_s``, ...), ``config.json`` (the knobs) and ``checkpoint/`` (a trainer
checkpoint that :meth:`embark.training.trainer.Trainer.load_checkpoint` restores).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import PRESETS, Workload, get_workload
from embark.training.trainer import OptimizerKind, TrainConfig, Trainer
from recipes.cli import knob, parse_knobs

log = logging.getLogger("recipes.train_dlrm")


@dataclass(frozen=True)
class TrainDLRMKnobs:
    """Train a DLRM on synthetic data labelled by a planted teacher DLRM."""

    workload: str = knob("tiny", f"workload preset, one of {', '.join(PRESETS)}")
    scale: float = knob(1.0, "divide every table's rows by this (>= 1) to fit the machine")
    batch_size: int = knob(512, "samples per step")
    steps: int = knob(4000, "optimizer steps (one fresh batch each)")
    optimizer: OptimizerKind | None = knob(None, "adagrad or sgd; none = the workload's choice")
    lr: float = knob(0.02, "learning rate of the dense part")
    embedding_lr: float = knob(0.1, "learning rate of the embedding tables")
    seed: int = knob(0, "seed of the model, the data stream and the teacher")
    eval_batches: int = knob(32, "held-out batches for the final eval AUC and teacher AUC")
    eval_every: int = knob(0, "also evaluate every this many steps (0 = only at the end)")
    train_eval_batches: int = knob(8, "last training batches re-scored for train_auc")
    label_sharpness: float = knob(2.0, "teacher logit scale; higher = easier labels")
    ragged: bool = knob(False, "variable bag sizes (0..2*hotness) instead of fixed hotness")
    threads: int = knob(1, "torch intra-op threads (1 is fastest for the tiny model)")
    out: str | None = knob(None, "output folder; none = runs/train_dlrm-<timestamp>")
    checkpoint: bool = knob(True, "save the final trainer checkpoint under <out>/checkpoint")
    progress: bool = knob(True, "show a tqdm progress bar")

    def __post_init__(self) -> None:
        # Everything TrainConfig and SyntheticCTR would reject is checked here, so a bad knob
        # is a usage error (exit 2) before main() creates --out.
        if self.workload not in PRESETS:
            raise ValueError(f"workload must be one of {list(PRESETS)}, got {self.workload!r}")
        for name in ("batch_size", "steps", "eval_batches", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {v!r}")
        for name in ("eval_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.train_eval_batches <= 0 or self.train_eval_batches > self.steps:
            raise ValueError(
                f"train_eval_batches must be in 1..steps={self.steps}, got {self.train_eval_batches}"
            )
        for name in ("lr", "embedding_lr", "label_sharpness"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not (math.isfinite(v) and v > 0)
            ):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, int | float)
            or not (math.isfinite(self.scale) and self.scale >= 1)
        ):
            raise ValueError(f"scale must be a finite number >= 1, got {self.scale!r}")
        if self.optimizer is not None:
            try:
                object.__setattr__(self, "optimizer", OptimizerKind(self.optimizer))
            except ValueError:
                raise ValueError(
                    f"optimizer must be one of {[o.value for o in OptimizerKind]} or None, "
                    f"got {self.optimizer!r}"
                ) from None


def _out_dir(cfg: TrainDLRMKnobs) -> Path:
    if cfg.out is not None:
        return Path(cfg.out)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"train_dlrm-{stamp}"


def build(cfg: TrainDLRMKnobs) -> tuple[Workload, SyntheticCTR, Trainer]:
    """The workload, data and a fresh trainer for ``cfg`` (reused by other recipes)."""
    workload = get_workload(cfg.workload)
    if cfg.scale > 1:
        workload = workload.scaled(cfg.scale)
    data = SyntheticCTR(
        workload,
        cfg.batch_size,
        seed=cfg.seed,
        ragged=cfg.ragged,
        label_sharpness=cfg.label_sharpness,
    )
    train_cfg = TrainConfig(
        lr=cfg.lr,
        embedding_lr=cfg.embedding_lr,
        optimizer=OptimizerKind(cfg.optimizer or workload.optimizer),
        eval_every=cfg.eval_every,
        seed=cfg.seed,
    )
    trainer = Trainer(build_model(workload, seed=cfg.seed), train_cfg)
    trainer.data_stream = data.stream_config()  # checkpoints record it; a resume checks it
    return workload, data, trainer


def main(cfg: TrainDLRMKnobs) -> dict[str, Any]:
    """Train, evaluate, write ``results.json`` (and the checkpoint); return the results."""
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    out = _out_dir(cfg)
    workload, data, trainer = build(cfg)  # before mkdir: a failure leaves no empty folder
    out.mkdir(parents=True, exist_ok=True)
    eval_set = list(data.batches(cfg.eval_batches, split="eval"))
    teacher_auc = data.teacher_auc(cfg.eval_batches, split="eval")

    fit = trainer.fit(
        data.batches(cfg.steps), cfg.steps, progress=cfg.progress, eval_batches=eval_set
    )
    final = trainer.evaluate(eval_set)
    train = trainer.evaluate(
        data.batches(cfg.train_eval_batches, start=cfg.steps - cfg.train_eval_batches)
    )
    ckpt = trainer.save_checkpoint(out / "checkpoint") if cfg.checkpoint else None
    results = {
        "recipe": "train_dlrm",
        "workload": workload.name,
        "eval_auc": final["auc"],
        "eval_logloss": final["logloss"],
        "teacher_auc": teacher_auc,
        "auc_gap": teacher_auc - final["auc"],
        "train_auc": train["auc"],
        "train_logloss": train["logloss"],
        "samples_per_s": fit["samples_per_s"],
        "steps": trainer.step,
        "samples": fit["samples"],
        "train_seconds": fit["seconds"],
        "wall_seconds": time.perf_counter() - t_start,
        "eval_samples": final["num_samples"],
        "positive_rate": final["positive_rate"],
        "threads": cfg.threads,
        "history": trainer.history,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "torch_version": torch.__version__,
    }
    knobs = dataclasses.asdict(cfg) | {"optimizer": trainer.cfg.optimizer.value}
    (out / "config.json").write_text(json.dumps(knobs, indent=1) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"train_dlrm [{workload.name}, {len(workload.tables)} tables, {trainer.step} steps × "
        f"{cfg.batch_size}]\n"
        f"  eval AUC     {final['auc']:.4f}   (teacher {teacher_auc:.4f}, gap "
        f"{teacher_auc - final['auc']:+.4f})\n"
        f"  eval logloss {final['logloss']:.4f}\n"
        f"  train AUC    {train['auc']:.4f}\n"
        f"  throughput   {fit['samples_per_s']:,.0f} samples/s ({fit['seconds']:.1f} s training, "
        f"{results['wall_seconds']:.1f} s total)\n"
        f"  results      {out / 'results.json'}"
    )
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main(parse_knobs(TrainDLRMKnobs))
