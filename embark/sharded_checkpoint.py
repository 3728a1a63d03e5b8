"""Checkpoints of sharded training in the single-process :class:`~embark.training.trainer.Trainer`'s
format, so they resume on any world size (reshard) or in one process.

A sharded trainer is converted to the Trainer it equals: full tables and their optimizer
state (e.g. Adagrad's ``sum``) assembled from the shards, the dense part and its state as
they are (identical on every rank), the same param-group options, step, generator and
history. Rank 0 then writes it with :meth:`Trainer.save_checkpoint` (same files, same
``state.json``, same atomic rename)::

    world 2 ──save_sharded_checkpoint──▶ <dir>/{model,optimizer}.safetensors + state.json
    <dir> ──Trainer.load_checkpoint──▶ world 1          (the single-process trainer)
    <dir> ──load_sharded_checkpoint(plan for world 4)──▶ world 4   (each rank slices its shards)

A table's state of the table's shape is sliced like the table; scalar state (Adagrad's
``step``) is the same for every parameter, because :class:`ShardedTrainer` gives every
parameter a gradient on every step (as the Trainer's ``EmbeddingBag`` modules always get).

The checks ``python -m embark.sharded_train`` makes of ``--checkpoint-dir`` and ``--resume``
(:func:`check_checkpoint_dir`, :func:`load_resume`) live here too.

Limits of this first step: every rank of the loading world builds the full model (the
whole tables) before slicing, and the gather is one all-reduce per table and state key:
fine for the tiny and scaled workloads, not for production-sized tables.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embark.data.synthetic import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import Workload
from embark.sharded_train import ShardedDLRM, ShardedTrainer
from embark.sharding.comm import distributed_world
from embark.training.trainer import Callback, Trainer
from embark.types import CommDtype, ShardingPlan


@torch.no_grad()
def _gather_table_states(trainer: ShardedTrainer, dst: int | None) -> dict[str, dict[str, Any]]:
    """``{table: {state key: full tensor or scalar}}`` on ``dst`` (a collective)."""
    model = trainer.model
    coll, opt = model.embeddings, trainer.optimizer
    dense0 = next(model.dense.parameters())
    keys = sorted(opt.state.get(dense0, {}))
    group = model.process_group
    out: dict[str, dict[str, Any]] = {}
    for t in coll.layout.tables:
        shard = coll.local_shards.get(t.name)
        state = opt.state.get(coll.weights[t.name], {}) if shard is not None else {}
        if shard is not None and sorted(state) != keys:
            raise ValueError(
                f"table {t.name!r}: optimizer state keys {sorted(state)} differ from the dense "
                f"part's {keys} (parameters out of lockstep)"
            )
        entry: dict[str, Any] = {}
        for k in keys:
            ref = opt.state[dense0][k]
            if isinstance(ref, torch.Tensor) and ref.shape == dense0.shape:
                if coll.layout.is_dp(t.name):
                    entry[k] = state[k].detach().clone()
                    continue
                buf = torch.zeros(t.num_rows, t.dim, dtype=ref.dtype)
                if shard is not None:
                    buf[shard.row_start : shard.row_end, shard.col_start : shard.col_end] = state[k]
                if distributed_world(group) is not None:
                    dist.all_reduce(buf, group=group)
                entry[k] = buf
            else:  # scalar state: equal for every parameter (lockstep)
                entry[k] = ref.clone() if isinstance(ref, torch.Tensor) else ref
        out[t.name] = entry
    return out if dst is None or dst == model.rank else {}


def to_single_process(trainer: ShardedTrainer, dst: int | None = 0) -> Trainer | None:
    """The single-process :class:`Trainer` equal to ``trainer`` (a collective).

    Args:
        dst: the rank (of the trainer's process group) that gets it; ``None``: every rank.

    Returns:
        the Trainer on ``dst``, ``None`` elsewhere.
    """
    model = trainer.model
    full = model.full_state_dict(dst=dst)
    tables = _gather_table_states(trainer, dst)
    if not full:
        return None
    single = build_model(model.workload)
    single.load_state_dict(full, strict=True)
    out = Trainer(single, trainer.cfg)
    params = dict(single.named_parameters())
    for name, st in tables.items():
        out.optimizer.state[params[f"embeddings.{name}.weight"]] = st
    for name, p in model.dense.named_parameters():
        out.optimizer.state[params[name]] = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in trainer.optimizer.state.get(p, {}).items()
        }
    _copy_group_options(out.optimizer, trainer.optimizer)
    out.generator.set_state(trainer.generator.get_state())
    out.step, out.batch_size, out.data_stream = (
        trainer.step,
        trainer.batch_size,
        trainer.data_stream,
    )
    out._batch_size_provisional = trainer._batch_size_provisional
    out.history = list(trainer.history)
    return out


def _copy_group_options(dst: torch.optim.Optimizer, src: torch.optim.Optimizer) -> None:
    """Copy the options (lr, ...) of ``src``'s param groups onto ``dst``'s groups of the same
    ``"name"`` (``"embeddings"`` / ``"dense"``, :func:`embark.training.trainer.build_optimizer`). By name,
    not position: a rank that holds no embedding parameter has only the dense group."""
    theirs = {g.get("name"): g for g in src.param_groups}
    for mine in dst.param_groups:
        g = theirs.get(mine.get("name"))
        if g is not None:
            mine.update({k: v for k, v in g.items() if k != "params"})


def save_sharded_checkpoint(trainer: ShardedTrainer, path: str | os.PathLike[str]) -> Path:
    """Write the Trainer-format checkpoint of ``trainer`` at ``path`` from the group's rank 0
    (a collective; every rank returns once it is written, or raises if it was not).

    Raises:
        ValueError: on every rank when rank 0 could not write it: there as
            :meth:`Trainer.save_checkpoint` (or an ``OSError``, naming ``path``), elsewhere
            naming ``path`` (so no rank goes on to wait in a collective alone).
    """
    single = to_single_process(trainer, dst=0)
    error: ValueError | None = None
    if single is not None:
        try:
            single.save_checkpoint(path)
        except ValueError as e:
            error = e
        except OSError as e:
            error = ValueError(f"cannot write the checkpoint {str(path)!r}: {e}")
    group = trainer.model.process_group
    failed = error is not None
    if distributed_world(group) is not None:
        flag = torch.tensor([int(failed)])
        dist.all_reduce(flag, group=group)  # also the barrier: rank 0 has finished writing
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"rank 0 could not write the checkpoint {str(path)!r}")
    return Path(path)


def from_single_process(
    single: Trainer,
    plan: ShardingPlan,
    rank: int,
    process_group: Any | None = None,
    comm_dtype: CommDtype | str | None = None,
    callbacks: list[Callback] | None = None,
) -> ShardedTrainer:
    """Shard a single-process :class:`Trainer` (of a :class:`~embark.models.dlrm.DLRM`) per ``plan``:
    weights, optimizer state (table-shaped state sliced like the table), options, step,
    batch size, generator and history. Every rank passes an equal ``single``."""
    model = ShardedDLRM(single.model, plan, rank, process_group, comm_dtype)  # type: ignore[arg-type]
    out = ShardedTrainer(model, single.cfg, callbacks or ())
    names = {p: n for n, p in single.model.named_parameters()}
    state = {names[p]: st for p, st in single.optimizer.state.items()}
    coll = model.embeddings
    for name, s in coll.local_shards.items():
        p = coll.weights[name]
        full_shape = (coll.layout.plan[name].num_rows, coll.layout.plan[name].dim)
        st: dict[str, Any] = {}
        for k, v in state.get(f"embeddings.{name}.weight", {}).items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == full_shape:
                v = v[s.row_start : s.row_end, s.col_start : s.col_end]
            st[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        out.optimizer.state[p] = st
    for name, p in model.dense.named_parameters():
        out.optimizer.state[p] = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.get(name, {}).items()
        }
    _copy_group_options(out.optimizer, single.optimizer)
    out.generator.set_state(single.generator.get_state())
    out.step, out.batch_size, out.data_stream = single.step, single.batch_size, single.data_stream
    out._batch_size_provisional = single._batch_size_provisional
    out.history = list(single.history)
    return out


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    plan: ShardingPlan,
    rank: int,
    process_group: Any | None = None,
    comm_dtype: CommDtype | str | None = None,
) -> ShardedTrainer:
    """Resume a Trainer-format checkpoint (from any world size, or a single-process run) on
    this world per ``plan`` (every rank calls it).

    Raises:
        ValueError: as :meth:`Trainer.load_checkpoint` (missing, altered or foreign files),
            or from :class:`ShardedDLRM` (a plan that does not fit the world or the tables).
    """
    return from_single_process(Trainer.load_checkpoint(path), plan, rank, process_group, comm_dtype)


# ------------------------------------------------- embark.sharded_train's checks
def check_checkpoint_dir(args: argparse.Namespace) -> None:
    """``--checkpoint-dir`` / ``--checkpoint-every`` are usable (checked on every rank before
    training, so a save cannot fail on rank 0 alone for these reasons).

    Raises:
        ValueError: ``--checkpoint-every`` without a folder, or a path that exists and is not
            a checkpoint folder (the Trainer refuses to replace it).
    """
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir is None:
        return
    path = Path(args.checkpoint_dir)
    if path.exists() and (
        not path.is_dir() or (any(path.iterdir()) and not (path / "state.json").is_file())
    ):
        raise ValueError(
            f"--checkpoint-dir {args.checkpoint_dir!r} exists and is not a checkpoint folder"
        )


def _stream_flags(
    args: argparse.Namespace, stream: dict[str, Any] | None, path: str
) -> list[tuple[str, Any, Any]]:
    """``(flag, given, saved)`` for the data-stream flags against a checkpoint's
    ``data_stream`` (saved ``None`` where it records none)."""
    if stream is None:
        return [("--ragged", args.ragged, None), ("--label-sharpness", args.label_sharpness, None)]
    if set(stream) != set(SyntheticCTR.STREAM_KEYS):
        raise ValueError(
            f"--resume {path!r} records a data stream with keys {sorted(stream)}, not a "
            f"SyntheticCTR stream's {sorted(SyntheticCTR.STREAM_KEYS)}: this CLI cannot regenerate it"
        )
    return [
        ("--ragged", args.ragged, stream["ragged"]),
        ("--label-sharpness", args.label_sharpness, stream["label_sharpness"]),
    ]


def load_resume(args: argparse.Namespace, workload: Workload) -> Trainer:
    """The single-process Trainer of ``--resume``, checked against this run's settings.

    Raises:
        ValueError: naming the path, for a missing, corrupt or unreadable checkpoint, one of
            another workload, one trained with another seed / optimizer / learning rate /
            batch size / ``--ragged`` / ``--label-sharpness`` than given, one whose
            ``data_stream`` is not a :class:`~embark.data.SyntheticCTR` stream, or one past
            ``--steps``.
    """
    path = args.resume
    try:
        single = Trainer.load_checkpoint(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"--resume {path!r}: {e}") from None
    stored = single.model.workload
    if stored != workload:
        rows = [t.num_rows for t in workload.tables]
        raise ValueError(
            f"--resume {path!r} is a checkpoint of workload {stored.name!r} (rows "
            f"{[t.num_rows for t in stored.tables]}), not of --workload {args.workload} "
            f"--scale {args.scale:g} ({workload.name!r}, rows {rows})"
        )
    cfg = single.cfg
    for flag, given, saved in (
        ("--seed", args.seed, cfg.seed),
        ("--optimizer", args.optimizer, cfg.optimizer.value),
        ("--lr", args.lr, cfg.lr),
        (
            "--embedding-lr",
            args.embedding_lr,
            cfg.lr if cfg.embedding_lr is None else cfg.embedding_lr,
        ),
        ("--batch-size", args.batch_size, single.batch_size),  # None: not recorded (older)
        *_stream_flags(args, single.data_stream, path),
    ):
        if given is not None and saved is not None and given != saved:
            raise ValueError(
                f"--resume {path!r} was trained with {flag} {saved}, not {given}: leave {flag} "
                "out (a resumed run keeps the checkpoint's)"
            )
    if single.step > args.steps:
        raise ValueError(
            f"--resume {path!r} is at step {single.step}, past --steps {args.steps} "
            "(the total number of steps)"
        )
    return single
