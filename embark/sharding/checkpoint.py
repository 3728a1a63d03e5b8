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

A table's rows state (:mod:`embark.training.fused`: ``sum`` shaped like the table, or
``row_sum`` one value per row) is sliced like the table; its keys
(``embeddings.<table>.weight::<key>``) do not depend on the sharding.

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
from embark.training.fused import EmbeddingUpdates
from embark.training.sparse_rows import STATE_KEYS
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


def _table_updates(trainer: Trainer) -> EmbeddingUpdates:
    if trainer.embedding_updates is None:
        raise ValueError("expected a trainer whose tables train through fused updates")
    return trainer.embedding_updates


@torch.no_grad()
def _gather_table_states(trainer: Trainer, dst: int | None) -> dict[str, dict[str, torch.Tensor]]:
    """``{table: {state key: full state tensor}}`` on ``dst`` (a collective).

    A per-weight state (``sum``) is assembled like the table; a per-row one (``row_sum``) by
    rows (every column block of a row holds its own; the first block's is kept).
    """
    model = _sharded_model(trainer)
    coll = model.embeddings
    updates = _table_updates(trainer).updates
    group = model.process_group
    out: dict[str, dict[str, torch.Tensor]] = {}
    for t in coll.layout.tables:
        shard = coll.local_shards.get(t.name)
        entry: dict[str, torch.Tensor] = {}
        for k, per_weight in STATE_KEYS[trainer.cfg.embedding_update].items():
            if coll.layout.is_dp(t.name):
                entry[k] = updates[t.name].state()[k].detach().clone()
                continue
            buf = torch.zeros((t.num_rows, t.dim) if per_weight else (t.num_rows,))
            if shard is not None:
                mine = updates[t.name].state()[k]
                if per_weight:
                    buf[shard.row_start : shard.row_end, shard.col_start : shard.col_end] = mine
                elif shard.col_start == 0:
                    buf[shard.row_start : shard.row_end] = mine
            if distributed_world(group) is not None:
                dist.all_reduce(buf, group=group)
            entry[k] = buf
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
    updates = _table_updates(out).updates
    for name, st in tables.items():
        for k, v in st.items():
            updates[name].state()[k].copy_(v)
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
    theirs, mine = _table_updates(single).updates, _table_updates(out).updates
    with torch.no_grad():
        for name, s in coll.local_shards.items():
            for k, v in theirs[name].state().items():
                piece = v[s.row_start : s.row_end]
                if v.dim() == 2:
                    piece = piece[:, s.col_start : s.col_end]
                mine[name].state()[k].copy_(piece)
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
