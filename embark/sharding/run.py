"""A sharded training run on synthetic teacher data, as ``torchrun -m embark.sharded_train``
runs it: :func:`run_sharded` over a :class:`ShardedRunConfig`, every rank in step.

Every rank generates only its slice of each global batch
(:meth:`SyntheticCTR.batch <embark.data.synthetic.SyntheticCTR.batch>` with its rank), the
same samples :func:`~embark.data.batch.local_batch` would cut from the whole batch: features
are per-sample draws and labels a per-sample float64 teacher evaluation, so a rank does
1/world of the data work. The plan is a file (checked against the world and the workload)
or the planner's for one ``cpu-local`` node.

Resuming. ``steps`` is the TOTAL number of steps (as ``Trainer``'s ``total - t.step``
example): a checkpoint at step ``k`` trains ``steps - k`` more steps on global batches
``k, k+1, ...`` (batch ``i`` at step ``i + 1``, as an uninterrupted run), so the weights end
as an uninterrupted ``steps``-step run's, up to float sums (on another world size). The
seed, optimizer, learning rates, global batch size and data stream are the checkpoint's
(giving a different one is an error: another batch size would be another data stream, batch
``k`` of it not the samples an uninterrupted run trains on next).

Errors are ``ValueError`` (or :class:`~embark.types.PlanError`) raised on every rank, since
every rank checks the same inputs, so none waits in a collective alone. They name the
settings by their command-line flags (``--resume``, ``--plan``, ...).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from embark.data.synthetic import SyntheticCTR
from embark.models.workloads import Workload, get_workload
from embark.planner.planner import plan_sharding
from embark.sharding.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from embark.sharding.model import ShardedDLRM
from embark.topology import get_topology
from embark.training.callbacks import Callback
from embark.training.checkpoint import Checkpoint, check_save_target, read_header
from embark.training.config import OptimizerKind, TrainConfig
from embark.training.trainer import Trainer
from embark.types import ShardingPlan

DEFAULT_LR = 0.02  # dense part
DEFAULT_EMBEDDING_LR = 0.1
DEFAULT_SEED = 0
DEFAULT_BATCH_SIZE = 512  # global, all ranks
DEFAULT_LABEL_SHARPNESS = 2.0


@dataclass(frozen=True)
class ShardedRunConfig:
    """The settings of a sharded run (``None``: a fresh run's default, or the checkpoint's
    when resuming).

    Args:
        workload: a preset name (:func:`~embark.models.workloads.get_workload`).
        scale: divide every table's rows by this (>= 1).
        steps: TOTAL optimizer steps (a resumed run trains ``steps - checkpoint step``).
        batch_size: GLOBAL samples per step (default :data:`DEFAULT_BATCH_SIZE`).
        plan: a plan JSON file (a plan, or ``python -m embark.plan --out``'s document);
            ``None``: plan here with ``strategy``.
        strategy: planner strategy without ``plan``.
        optimizer: ``None``: the workload's choice.
        lr, embedding_lr: learning rates of the dense part and the tables.
        seed: model, data and teacher seed.
        ragged: variable bag sizes ``0..hotness`` (default: fixed hotness).
        label_sharpness: teacher logit scale, > 0.
        eval_batches: held-out global batches for the final evaluation.
        checkpoint_dir: rank 0 writes the final checkpoint here (replaced atomically).
        checkpoint_every: also checkpoint every this many steps (0: only at the end).
        resume: continue this checkpoint (any world size, or a single-process trainer's).
    """

    workload: str = "tiny"
    scale: float = 1.0
    steps: int = 50
    batch_size: int | None = None
    plan: str | None = None
    strategy: str = "auto"
    optimizer: OptimizerKind | None = None
    lr: float | None = None
    embedding_lr: float | None = None
    seed: int | None = None
    ragged: bool | None = None
    label_sharpness: float | None = None
    eval_batches: int = 8
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None


@dataclass(frozen=True)
class ShardedRunResult:
    """What a run did (equal on every rank); :meth:`to_dict` is the CLI's ``--out`` JSON."""

    workload: str
    world_size: int
    steps: int
    start_step: int
    resumed_from: str | None
    checkpoint: str | None
    batch_size: int
    optimizer: str
    final_loss: float | None
    mean_loss: float | None
    eval_auc: float
    eval_logloss: float
    teacher_auc: float
    train_seconds: float
    samples_per_s: float
    plan: ShardingPlan

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"plan": self.plan.to_dict()}


# ------------------------------------------------------------------------------ checks
def resolve_plan(
    cfg: ShardedRunConfig, workload: Workload, world_size: int, batch_size: int
) -> ShardingPlan:
    """The plan of ``cfg.plan`` (checked against the world and the workload), or one made by
    the planner for ``world_size`` ranks on one ``cpu-local`` node at global ``batch_size``.

    Raises:
        ValueError: naming the file, for a plan whose world size is not ``world_size``, or
            one that does not place exactly the workload's tables.
    """
    if cfg.plan is None:
        topology = replace(get_topology("cpu-local"), gpus_per_node=world_size)
        return plan_sharding(workload, topology, batch_size, cfg.strategy)
    try:
        doc = json.loads(Path(cfg.plan).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON
        raise ValueError(f"--plan {cfg.plan!r} cannot be read as JSON: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("plan"), dict):
        doc = doc["plan"]  # the document `python -m embark.plan --out` writes
    try:
        plan = ShardingPlan.from_dict(doc)
    except ValueError as e:  # PlanError, and the table types' own checks
        raise ValueError(f"--plan {cfg.plan!r}: {e}") from None
    if plan.world_size != world_size:
        raise ValueError(
            f"--plan {cfg.plan!r} is for world size {plan.world_size} but this run has "
            f"{world_size} rank(s): start it with `torchrun --nproc-per-node {plan.world_size}` "
            f"or plan for {world_size} rank(s)"
        )
    try:
        plan.check_tables(workload.tables)
    except ValueError as e:
        raise ValueError(f"--plan {cfg.plan!r}: {e}") from None
    return plan


def check_checkpoint_dir(cfg: ShardedRunConfig) -> None:
    """``checkpoint_dir`` / ``checkpoint_every`` are usable (checked on every rank before
    training, so a save cannot fail on rank 0 alone for these reasons).

    Raises:
        ValueError: ``checkpoint_every`` without a folder, or a path that exists and is not
            a checkpoint folder (a save refuses to replace it), is under a file or cannot be
            written (:func:`~embark.training.checkpoint.check_save_target`).
    """
    if cfg.checkpoint_every and not cfg.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if cfg.checkpoint_dir is not None:
        check_save_target(cfg.checkpoint_dir, "--checkpoint-dir")


def _stream_flags(
    cfg: ShardedRunConfig, stream: dict[str, Any] | None, path: str
) -> list[tuple[str, Any, Any]]:
    """``(flag, given, saved)`` for the data-stream settings against a checkpoint's
    ``data_stream``.

    Raises:
        ValueError: when the checkpoint records no :class:`SyntheticCTR` stream.
    """
    if stream is None or set(stream) != set(SyntheticCTR.STREAM_KEYS):
        got = "none" if stream is None else f"one with keys {sorted(stream)}"
        raise ValueError(
            f"--resume {path!r} records {got}, not a SyntheticCTR data stream "
            f"(keys {sorted(SyntheticCTR.STREAM_KEYS)}): this run cannot regenerate its data"
        )
    return [
        ("--ragged", cfg.ragged, stream["ragged"]),
        ("--label-sharpness", cfg.label_sharpness, stream["label_sharpness"]),
    ]


def load_resume(cfg: ShardedRunConfig, workload: Workload) -> Checkpoint:
    """The ``state.json`` of ``cfg.resume`` (:func:`~embark.training.checkpoint.read_header`;
    each rank's sharded load reads and checks its tensor files), checked against this run's
    settings.

    Raises:
        ValueError: naming the path, for a missing, corrupt or unreadable checkpoint, one of
            another workload, one trained with another seed / optimizer / learning rate /
            batch size / ``ragged`` / ``label_sharpness`` than given, one that records no
            :class:`SyntheticCTR` stream, or one past ``steps``.
    """
    path = cfg.resume
    assert path is not None  # only called to resume
    try:
        single = read_header(path)
        stored = single.workload()
    except (ValueError, OSError) as e:
        raise ValueError(f"--resume {path!r}: {e}") from None
    run = single.train_state()
    if stored != workload:
        rows = [t.num_rows for t in workload.tables]
        raise ValueError(
            f"--resume {path!r} is a checkpoint of workload {stored.name!r} (rows "
            f"{[t.num_rows for t in stored.tables]}), not of --workload {cfg.workload} "
            f"--scale {cfg.scale:g} ({workload.name!r}, rows {rows})"
        )
    saved = single.cfg
    embedding_lr = saved.lr if saved.embedding_lr is None else saved.embedding_lr
    for flag, given, was in (
        ("--seed", cfg.seed, saved.seed),
        ("--optimizer", cfg.optimizer and cfg.optimizer.value, saved.optimizer.value),
        ("--lr", cfg.lr, saved.lr),
        ("--embedding-lr", cfg.embedding_lr, embedding_lr),
        ("--batch-size", cfg.batch_size, run.batch_size),  # None: saved at step 0
        *_stream_flags(cfg, run.data_stream, path),
    ):
        if given is not None and was is not None and given != was:
            raise ValueError(
                f"--resume {path!r} was trained with {flag} {was}, not {given}: leave {flag} "
                "out (a resumed run keeps the checkpoint's)"
            )
    if run.step > cfg.steps:
        raise ValueError(
            f"--resume {path!r} is at step {run.step}, past --steps {cfg.steps} "
            "(the total number of steps)"
        )
    return single


def _batch_size(cfg: ShardedRunConfig, single: Checkpoint | None, world_size: int) -> int:
    """The global batch size: given, else the checkpoint's, else the default."""
    saved = single.state["batch_size"] if single is not None else None
    batch_size = cfg.batch_size or saved or DEFAULT_BATCH_SIZE
    if batch_size < world_size:
        what = (
            "--batch-size"
            if cfg.batch_size
            else "the checkpoint's batch size"
            if saved
            else "the default batch size"
        )
        raise ValueError(f"{what} {batch_size} is smaller than the world size {world_size}")
    return batch_size


# ----------------------------------------------------------------------------- the run
def _fresh_trainer(
    cfg: ShardedRunConfig,
    workload: Workload,
    plan: ShardingPlan,
    rank: int,
    callbacks: Iterable[Callback],
) -> Trainer:
    seed = DEFAULT_SEED if cfg.seed is None else cfg.seed
    train_cfg = TrainConfig(
        lr=DEFAULT_LR if cfg.lr is None else cfg.lr,
        embedding_lr=DEFAULT_EMBEDDING_LR if cfg.embedding_lr is None else cfg.embedding_lr,
        seed=seed,
        optimizer=cfg.optimizer or OptimizerKind(workload.optimizer),
    )
    return Trainer(ShardedDLRM.build(workload, plan, rank, seed=seed), train_cfg, callbacks)


def _data(
    cfg: ShardedRunConfig, workload: Workload, batch_size: int, trainer: Trainer
) -> SyntheticCTR:
    """The run's stream: the checkpoint's when resuming, else the one ``cfg`` describes."""
    seed = trainer.cfg.seed
    if trainer.data_stream is not None:
        return SyntheticCTR.from_stream_config(workload, batch_size, seed, trainer.data_stream)
    sharpness = DEFAULT_LABEL_SHARPNESS if cfg.label_sharpness is None else cfg.label_sharpness
    return SyntheticCTR(
        workload, batch_size, seed=seed, ragged=bool(cfg.ragged), label_sharpness=sharpness
    )


def _train(
    cfg: ShardedRunConfig, trainer: Trainer, data: SyntheticCTR, rank: int, world_size: int
) -> tuple[list[float], float]:
    """Train to ``cfg.steps`` total steps, checkpointing as asked; ``(losses, seconds)``
    (the seconds of training alone, saves left out)."""
    saved_at: int | None = None
    save_seconds = 0.0

    def save() -> None:
        nonlocal saved_at, save_seconds
        assert cfg.checkpoint_dir is not None  # check_checkpoint_dir
        t = time.perf_counter()
        save_sharded_checkpoint(trainer, cfg.checkpoint_dir)  # a collective; rank 0 writes
        saved_at, save_seconds = trainer.step, save_seconds + time.perf_counter() - t

    t0 = time.perf_counter()
    losses = []
    start = trainer.step
    mine = data.batches(cfg.steps - start, start=start, rank=rank, world_size=world_size)
    for batch in mine:  # batch i → step i + 1
        losses.append(trainer.train_step(batch))
        if cfg.checkpoint_every and trainer.step % cfg.checkpoint_every == 0:
            save()
    if cfg.checkpoint_dir is not None and saved_at != trainer.step:
        save()
    return losses, time.perf_counter() - t0 - save_seconds


def run_sharded(
    cfg: ShardedRunConfig, rank: int, world_size: int, callbacks: Iterable[Callback] = ()
) -> ShardedRunResult:
    """Train and evaluate (every rank calls it, in step, with the same ``cfg``).

    Args:
        cfg: the run's settings.
        rank, world_size: this process in the default process group (``0, 1`` without
            ``torch.distributed``).
        callbacks: the trainer's (e.g. a progress printer on rank 0).

    Returns:
        the results, equal on every rank.

    Raises:
        ValueError: (on every rank) for a bad plan, setting or checkpoint (module docstring).
    """
    workload = get_workload(cfg.workload)
    if cfg.scale > 1:
        workload = workload.scaled(cfg.scale)
    single = load_resume(cfg, workload) if cfg.resume is not None else None
    batch_size = _batch_size(cfg, single, world_size)
    plan = resolve_plan(cfg, workload, world_size, batch_size)
    check_checkpoint_dir(cfg)
    if single is not None:
        try:  # each rank reads the stored parts of its shards
            trainer = load_sharded_checkpoint(single.path, plan, rank, callbacks=callbacks)
        except ValueError as e:
            raise ValueError(f"--resume {cfg.resume!r}: {e}") from None
    else:
        trainer = _fresh_trainer(cfg, workload, plan, rank, callbacks)
    data = _data(cfg, workload, batch_size, trainer)
    trainer.data_stream = data.stream_config()
    start = trainer.step
    losses, seconds = _train(cfg, trainer, data, rank, world_size)
    evals = list(data.batches(cfg.eval_batches, split="eval", rank=rank, world_size=world_size))
    metrics = trainer.evaluate(evals)
    samples = len(losses) * batch_size
    return ShardedRunResult(
        workload=workload.name,
        world_size=world_size,
        steps=trainer.step,
        start_step=start,
        resumed_from=cfg.resume,
        checkpoint=cfg.checkpoint_dir,
        batch_size=batch_size,
        optimizer=trainer.cfg.optimizer.value,
        final_loss=losses[-1] if losses else None,
        mean_loss=sum(losses) / len(losses) if losses else None,
        eval_auc=metrics["auc"],
        eval_logloss=metrics["logloss"],
        teacher_auc=data.teacher_auc(cfg.eval_batches, split="eval"),
        train_seconds=seconds,
        samples_per_s=samples / seconds if seconds > 0 else 0.0,
        plan=plan,
    )
