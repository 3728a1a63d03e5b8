"""Sharded data-parallel DLRM training on synthetic teacher data: ``torchrun -m
embark.sharded_train`` (gloo on CPU; :func:`embark.sharding.run.run_sharded` does the run).

    torchrun --nproc-per-node 2 -m embark.sharded_train --workload tiny --steps 50 \\
        [--plan plan.json]        # a plan, or `python -m embark.plan --out` output; none = plan
                                  # here with the greedy planner for one cpu-local node
        [--checkpoint-dir ckpt [--checkpoint-every N]]   # rank 0 writes it at the end (and
                                  # every N steps), atomically, in the Trainer's format
        [--resume ckpt]           # continue a checkpoint of any world size, or of the
                                  # single-process Trainer (`python -m recipes.train_dlrm`)
    python -m embark.sharded_train --help   # every knob with its default

Rank 0 prints the loss every ``--log-every`` steps, then the eval AUC, and writes ``--out``.
``--steps`` is the TOTAL number of steps (a resumed run trains the rest). A bad plan, setting
or checkpoint (a plan for another world size, a missing or corrupt checkpoint, one of another
workload or one past ``--steps``) exits with status 2 on every rank, naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from embark.cli import MAX_BATCH_SIZE, MAX_SEED, float_at_least, int_at_least, int_in, output_file
from embark.models.workloads import PRESETS as WORKLOADS
from embark.outputs import write_text_atomic
from embark.planner.planner import STRATEGIES
from embark.sharding.run import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EMBEDDING_LR,
    DEFAULT_LR,
    ShardedRunConfig,
    ShardedRunResult,
    run_sharded,
)
from embark.training.callbacks import Callback, TrainerView
from embark.training.config import OptimizerKind
from embark.training.trainer import TrainingDiverged
from knobs import add_knobs, from_namespace, knob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardedTrainKnobs:
    """The knobs of ``torchrun -m embark.sharded_train`` (shown in ``--help``). ``None``: a
    fresh run's default, or the checkpoint's with ``--resume``."""

    # what is trained: workload, plan, optimizer, data stream
    workload: str = knob("tiny", "workload preset", choices=tuple(WORKLOADS))
    scale: float = knob(1.0, "divide every table's rows by this (>= 1)", parse=float_at_least(1.0))
    steps: int = knob(50, "TOTAL optimizer steps (>= 0)", parse=int_at_least(0))
    batch_size: int | None = knob(
        None,
        f"GLOBAL batch, all ranks; unset: {DEFAULT_BATCH_SIZE} (--resume: the checkpoint's)",
        parse=int_in(1, MAX_BATCH_SIZE),
    )
    plan: str | None = knob(
        None, "plan JSON (a plan, or `python -m embark.plan --out` output); none = plan here"
    )
    strategy: str = knob("auto", "planner strategy without --plan", choices=tuple(STRATEGIES))
    optimizer: OptimizerKind | None = knob(None, "none = the workload's choice")
    lr: float | None = knob(
        None,
        f"learning rate of the dense part; unset: {DEFAULT_LR} (--resume: the checkpoint's)",
    )
    embedding_lr: float | None = knob(
        None,
        f"learning rate of the tables; unset: {DEFAULT_EMBEDDING_LR} (--resume: the checkpoint's)",
    )
    seed: int | None = knob(
        None,
        "model, data and teacher seed; unset: 0 (--resume: the checkpoint's)",
        parse=int_in(0, MAX_SEED),
    )
    ragged: bool | None = knob(
        None,
        "variable bag sizes 0..hotness; unset: fixed hotness (--resume: the checkpoint's)",
    )
    label_sharpness: float | None = knob(
        None, "teacher logit scale, > 0; unset: 2.0 (--resume: the checkpoint's)"
    )
    # how the run is evaluated, logged, checkpointed and resumed
    eval_batches: int = knob(8, "held-out global batches (>= 1)", parse=int_at_least(1))
    log_every: int = knob(10, "print the loss every N steps (>= 1)", parse=int_at_least(1))
    out: str | None = knob(None, "rank 0 writes the results JSON here", parse=output_file)
    checkpoint_dir: str | None = knob(
        None,
        "rank 0 writes the final checkpoint here (replaced atomically; checked before training)",
    )
    checkpoint_every: int = knob(
        0,
        "also checkpoint every N steps (0 = only at the end); needs --checkpoint-dir",
        parse=int_at_least(0),
    )
    resume: str | None = knob(
        None,
        "continue this checkpoint (any world size, or the single-process Trainer's) to "
        "--steps TOTAL steps",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m embark.sharded_train",
        description="Sharded data-parallel DLRM training on synthetic teacher data (gloo, CPU).",
    )
    add_knobs(p, ShardedTrainKnobs)
    return p


def to_config(cfg: ShardedTrainKnobs) -> ShardedRunConfig:
    """The run's settings from the command line's knobs."""
    return ShardedRunConfig(
        workload=cfg.workload,
        scale=cfg.scale,
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        plan=cfg.plan,
        strategy=cfg.strategy,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        embedding_lr=cfg.embedding_lr,
        seed=cfg.seed,
        ragged=cfg.ragged,
        label_sharpness=cfg.label_sharpness,
        eval_batches=cfg.eval_batches,
        checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_every=cfg.checkpoint_every,
        resume=cfg.resume,
    )


class PrintLoss(Callback):
    """Print ``step N  loss L`` every ``every`` steps and at step ``last``."""

    def __init__(self, every: int, last: int) -> None:
        self.every, self.last = every, last

    def on_step_end(self, trainer: TrainerView, step: int, loss: float) -> None:
        if step % self.every == 0 or step == self.last:
            print(f"step {step:>6}  loss {loss:.4f}", flush=True)


def _summary(res: ShardedRunResult, args: ShardedTrainKnobs) -> str:
    loss = res.final_loss if res.final_loss is not None else float("nan")
    return (
        f"sharded_train [{res.workload}, world {res.world_size}, {res.steps} steps × "
        f"{res.batch_size}]  loss {loss:.4f}  eval AUC {res.eval_auc:.4f} (teacher "
        f"{res.teacher_auc:.4f})  eval logloss {res.eval_logloss:.4f}  "
        f"{res.samples_per_s:,.0f} samples/s"
        + (f"  (resumed at step {res.start_step})" if args.resume else "")
        + (f"  checkpoint {args.checkpoint_dir}" if args.checkpoint_dir else "")
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``torchrun --nproc-per-node N -m embark.sharded_train ...`` (gloo), or plain
    ``python -m embark.sharded_train`` for one rank. Exit status 2 on a bad plan, setting or
    checkpoint, on every rank (each checks the same inputs, so none waits in a collective)."""
    quiet = os.environ.get("RANK", "0") != "0"  # progress and planner logs from rank 0 only
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    args = from_namespace(ShardedTrainKnobs, _parser().parse_args(argv))
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    callbacks = [PrintLoss(args.log_every, args.steps)] if rank == 0 else []
    try:
        results = run_sharded(to_config(args), rank, world_size, callbacks)
    except ValueError as e:  # PlanError is a ValueError
        if rank == 0:
            log.error("error: %s", e)
        return 2
    except TrainingDiverged as e:  # raised on every rank at the same step (the global loss)
        if rank == 0:
            log.error("error: %s", e)
        return 1
    finally:
        if distributed:
            dist.destroy_process_group()
    if rank == 0:
        print(_summary(results, args), flush=True)
        if args.out:
            write_text_atomic(args.out, json.dumps(results.to_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    if "WORLD_SIZE" in os.environ:
        # A launched rank has finished (process group destroyed, results and checkpoint
        # written, output flushed below): skip the interpreter's teardown, where a gloo thread
        # still joinable at static destruction can abort a completed run ("terminate called
        # without an active exception", SIGABRT) and make a finished run look failed.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
