"""Checkpoints of sharded training, in the single-process checkpoint format
(:mod:`embark.training.checkpoint`), so they resume on any world size (reshard) or in one
process.

A trainer of a :class:`~embark.sharding.model.ShardedDLRM` is converted to the trainer of a
:class:`~embark.models.dlrm.DLRM` it equals (:func:`to_single_process`): full tables and
their optimizer state (e.g. Adagrad's ``sum``) assembled from the shards, the dense part and
its state as they are (identical on every rank), the same param-group options and
:class:`~embark.training.state.TrainState`. Rank 0 then writes it with
:meth:`Trainer.save_checkpoint` (same files, same ``state.json``, same atomic rename)::

    world 2 ──save_sharded_checkpoint──▶ <dir>/{model,optimizer}.safetensors + state.json
    <dir> ──Trainer.load_checkpoint──▶ world 1          (the single-process trainer)
    <dir> ──load_sharded_checkpoint(plan for world 4)──▶ world 4   (each rank slices its shards)

A table's state of the table's shape is sliced like the table; scalar state (Adagrad's
``step``) is the same for every parameter, because the sharded step gives every parameter a
gradient on every step (:class:`~embark.sharding.model.ShardedSync`).

Limits: every rank of the loading world builds the full model (the whole tables) before
slicing, and the gather is one all-reduce per table and state key: fine for the tiny and
scaled workloads, not for production-sized tables.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embark.models.dlrm import DLRM, build_model
from embark.sharding.comm import distributed_world
from embark.sharding.model import ShardedDLRM
from embark.training.callbacks import Callback
from embark.training.config import copy_group_options
from embark.training.trainer import Trainer
from embark.types import CommDtype, ShardingPlan


def _sharded_model(trainer: Trainer) -> ShardedDLRM:
    if not isinstance(trainer.model, ShardedDLRM):
        raise ValueError(
            f"expected a trainer of a ShardedDLRM, got one of {type(trainer.model).__name__}"
        )
    return trainer.model


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@torch.no_grad()
def _gather_table_states(trainer: Trainer, dst: int | None) -> dict[str, dict[str, Any]]:
    """``{table: {state key: full tensor or scalar}}`` on ``dst`` (a collective)."""
    model = _sharded_model(trainer)
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


def to_single_process(trainer: Trainer, dst: int | None = 0) -> Trainer | None:
    """The single-process :class:`Trainer` equal to ``trainer`` of a :class:`ShardedDLRM`
    (a collective).

    Args:
        dst: the rank (of the trainer's process group) that gets it; ``None``: every rank.

    Returns:
        the Trainer on ``dst``, ``None`` elsewhere.

    Raises:
        ValueError: for a trainer of another model, or optimizer state out of lockstep.
    """
    model = _sharded_model(trainer)
    full = model.full_state_dict(dst=dst)
    tables = _gather_table_states(trainer, dst)
    if not full:
        return None
    single = build_model(model.workload)
    single.load_state_dict(full, strict=True)
    out = Trainer(single, trainer.cfg, state=trainer.state.copy())
    params = dict(single.named_parameters())
    for name, st in tables.items():
        out.optimizer.state[params[f"embeddings.{name}.weight"]] = st
    for name, p in model.dense.named_parameters():
        out.optimizer.state[params[name]] = _copy_state(trainer.optimizer.state.get(p, {}))
    copy_group_options(out.optimizer, trainer.optimizer)
    return out


def save_sharded_checkpoint(trainer: Trainer, path: str | os.PathLike[str]) -> Path:
    """Write the checkpoint of ``trainer`` (of a :class:`ShardedDLRM`) at ``path`` from the
    group's rank 0 (a collective; every rank returns once it is written, or raises if it
    was not).

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
    group = _sharded_model(trainer).process_group
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
    callbacks: Iterable[Callback] = (),
) -> Trainer:
    """Shard a single-process :class:`Trainer` of a :class:`~embark.models.dlrm.DLRM` per
    ``plan``: weights, optimizer state (table-shaped state sliced like the table), options
    and :class:`~embark.training.state.TrainState`. Every rank passes an equal ``single``.

    Raises:
        ValueError: for a trainer of another model, or from :class:`ShardedDLRM` (a plan
            that does not fit the world or the tables).
    """
    if not isinstance(single.model, DLRM):
        raise ValueError(f"expected a trainer of a DLRM, got one of {type(single.model).__name__}")
    model = ShardedDLRM(single.model, plan, rank, process_group, comm_dtype)
    out = Trainer(model, single.cfg, callbacks, state=single.state.copy())
    names: dict[torch.Tensor, str] = {p: n for n, p in single.model.named_parameters()}
    state = {names[p]: st for p, st in single.optimizer.state.items()}
    coll = model.embeddings
    for name, s in coll.local_shards.items():
        full_shape = (coll.layout.plan[name].num_rows, coll.layout.plan[name].dim)
        st: dict[str, Any] = {}
        for k, v in state.get(f"embeddings.{name}.weight", {}).items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == full_shape:
                v = v[s.row_start : s.row_end, s.col_start : s.col_end]
            st[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        out.optimizer.state[coll.weights[name]] = st
    for name, p in model.dense.named_parameters():
        out.optimizer.state[p] = _copy_state(state.get(name, {}))
    copy_group_options(out.optimizer, single.optimizer)
    return out


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    plan: ShardingPlan,
    rank: int,
    process_group: Any | None = None,
    comm_dtype: CommDtype | str | None = None,
) -> Trainer:
    """Resume a checkpoint (from any world size, or a single-process run) on this world per
    ``plan`` (every rank calls it).

    Raises:
        ValueError: as :meth:`Trainer.load_checkpoint` (missing, altered or foreign files),
            or from :class:`ShardedDLRM` (a plan that does not fit the world or the tables).
    """
    return from_single_process(Trainer.load_checkpoint(path), plan, rank, process_group, comm_dtype)
