"""Checkpoints of sharded training: each rank writes its own shards, any world size or plan
(or one process) loads them.

Format: :mod:`embark.training.checkpoint` (version 3) with the sharded tables in chunks
(:mod:`embark.training.checkpoint.shards`)::

    world 2 ──save_sharded_checkpoint──▶ <dir>/shards-0.safetensors   rank 0's table pieces
                                         <dir>/shards-1.safetensors   rank 1's
                                         <dir>/{model,optimizer}.safetensors + state.json
                                             (rank 0: the dense part, DP tables, the index)
    <dir> ──Trainer.load_checkpoint──▶ world 1          (chunks assembled into whole tables)
    <dir> ──load_sharded_checkpoint(plan for world 4)──▶ world 4
                                         (each rank reads the chunk parts that overlap its
                                          shards: another world size or plan reshards)

Save: every rank writes its pieces of the sharded tables and of their rows state
(:mod:`embark.training.fused`: ``sum`` shaped like the table, ``row_sum`` one value per row)
into the shared temporary folder; the ranks exchange only file records and chunk indexes
(``all_gather_object`` of a few hundred bytes per shard), never table rows. Rank 0 writes the
replicated rest (identical on every rank), ``state.json`` and renames the folder into place,
so an interrupted or failed save leaves the previous checkpoint intact. Keys are the
single-process model's (``embeddings.<table>.weight::<state key>``), whatever the sharding
type. The folder must be on a file system every rank sees (as for
``torch.distributed.checkpoint``).

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle and it records no
hash of its data files; this format keeps the single-process checkpoint's guarantees (no
pickle, a size and sha256 per file so a corrupt one is refused by name) and is the same
format, so a single-process checkpoint loads sharded and a sharded one in one process.

:func:`to_single_process` / :func:`from_single_process` convert a trainer between the two
forms in memory (a gather of whole tables: for tests and small models, not used by the save).

Memory on load: a rank checks its files and the pieces that cover its shards, builds its
model with :meth:`ShardedDLRM.build` (``seed=None``: its shards, DP replicas and dense part
only, nothing drawn), then reads each stored piece straight into its shard or rows state. It
never holds a table, or a piece of one, that it does not own, and beyond its model at most
one stored piece at a time.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

import embark.training.checkpoint.store as ckpt
from embark.models.dlrm import DLRM, build_model
from embark.models.tables import table_weight_key
from embark.models.workloads import Workload
from embark.sharding.comm import distributed_world
from embark.sharding.model import ShardedDLRM
from embark.training.callbacks import Callback
from embark.training.checkpoint.schema import TENSOR_FILES, FormatVersionError
from embark.training.checkpoint.shards import (
    Chunk,
    Piece,
    chunks_of,
    files_for,
    plan_region,
    read_pieces,
    shard_file,
)
from embark.training.config import TrainConfig, copy_group_options
from embark.training.fused import EmbeddingUpdates
from embark.training.sparse_rows import STATE_KEYS
from embark.training.trainer import Trainer
from embark.types import CommDtype, ShardingPlan

log = logging.getLogger(__name__)


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


def _all_gather(obj: Any, group: Any | None) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` without ``torch.distributed``)."""
    if distributed_world(group) is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _single_names(model: ShardedDLRM) -> dict[torch.Tensor, str]:
    """Each parameter of ``model`` -> its name in the single-process DLRM."""
    names: dict[torch.Tensor, str] = {p: n for n, p in model.dense.named_parameters()}
    for t, w in model.embeddings.weights.items():
        names[w] = table_weight_key(t)
    return names


def _local_pieces(
    trainer: Trainer,
) -> tuple[dict[str, torch.Tensor], dict[str, list[dict[str, Any]]]]:
    """This rank's pieces of the sharded tables and their rows state: ``(tensors by entry
    name, {key: [chunk]})`` (a per-row state once per row range: from the column-0 block)."""
    model = _sharded_model(trainer)
    coll = model.embeddings
    updates = _table_updates(trainer).updates
    file = shard_file(model.rank)
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, list[dict[str, Any]]] = {}
    for t, s in coll.local_shards.items():
        if coll.layout.is_dp(t):
            continue
        key = table_weight_key(t)
        pieces: list[tuple[str, torch.Tensor, tuple[int, ...]]] = [
            (key, coll.weights[t].detach(), (s.row_start, s.col_start))
        ]
        for k, v in updates[t].state().items():
            if v.dim() == 2:
                pieces.append((f"{key}::{k}", v, (s.row_start, s.col_start)))
            elif s.col_start == 0:
                pieces.append((f"{key}::{k}", v, (s.row_start,)))
        for k, v, offset in pieces:
            chunk = Chunk.of(k, file, offset, tuple(v.shape))
            tensors[chunk.name] = v
            index[k] = [chunk.to_dict()]
    return tensors, index


_Written = tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]


def _write_shards(trainer: Trainer, tmp: Path) -> _Written:
    """Write this rank's ``shards-<rank>.safetensors`` into ``tmp`` (none when it holds no
    sharded table); ``(its file record, its chunk index)``."""
    tensors, index = _local_pieces(trainer)
    if not tensors:
        return {}, {}
    name = shard_file(_sharded_model(trainer).rank)
    ckpt.write_tensors(tensors, tmp / name)
    return ckpt.file_records(tmp, [name]), index


def _write_replicated(trainer: Trainer, tmp: Path, written: list[_Written]) -> dict[str, Any]:
    """Write the dense part and the DP tables (rank 0's replicas) and their optimizer state;
    the ``state.json`` document."""
    model = _sharded_model(trainer)
    coll = model.embeddings
    updates = _table_updates(trainer).updates
    weights = dict(model.dense.state_dict())
    rows: dict[str, torch.Tensor] = {}
    for t in coll.layout.dp_tables:
        weights[table_weight_key(t)] = coll.weights[t]
        rows |= {f"{table_weight_key(t)}::{k}": v for k, v in updates[t].state().items()}
    ckpt.write_tensors(weights, tmp / ckpt.MODEL_FILE)
    tensors, scalars, groups = ckpt.optimizer_files(trainer.optimizer, _single_names(model))
    ckpt.write_tensors(tensors | rows, tmp / ckpt.OPTIMIZER_FILE)
    files = ckpt.file_records(tmp, list(TENSOR_FILES))
    shards: dict[str, list[dict[str, Any]]] = {}
    for records, index in written:
        files |= records
        for key, chunks in index.items():
            shards.setdefault(key, []).extend(chunks)
    return ckpt.state_document(
        model.workload,
        trainer.optimizer,
        trainer.cfg,
        trainer.state,
        scalars,
        groups,
        files,
        shards,
    ) | {"world_size": model.world_size}


def save_sharded_checkpoint(trainer: Trainer, path: str | os.PathLike[str]) -> Path:
    """Write the checkpoint of ``trainer`` (of a :class:`ShardedDLRM`) at ``path``: each rank
    its own shards, rank 0 the replicated rest and the index (a collective; every rank
    returns once the folder is in place, or raises if it is not).

    Raises:
        ValueError: on every rank, naming ``path`` (and the rank that failed), when ``path``
            exists and is not a checkpoint folder or a rank could not write its file; the
            previous checkpoint at ``path`` is then left as it was.
    """
    model = _sharded_model(trainer)
    group, path = model.process_group, Path(path)
    tmp: Path | None = None
    error: str | None = None
    if model.rank == 0:
        try:
            tmp = ckpt.begin_save(path)
        except (ValueError, OSError) as e:
            error = str(e) if isinstance(e, ValueError) else f"cannot write {str(path)!r}: {e}"
    started = _all_gather((None if tmp is None else str(tmp), error), group)[0]
    if started[0] is None:
        raise ValueError(started[1])
    tmp = Path(started[0])
    written: _Written = ({}, {})
    try:
        written = _write_shards(trainer, tmp)
    except OSError as e:
        error = f"rank {model.rank} cannot write its shards of {str(path)!r}: {e}"
    every = _all_gather((written, error), group)
    errors = [e for _, e in every if e is not None]
    if model.rank == 0:
        try:
            if not errors:
                doc = _write_replicated(trainer, tmp, [w for w, _ in every])
                ckpt.finish_save(tmp, path, doc)
        except (ValueError, OSError) as e:
            errors.append(f"cannot write the checkpoint {str(path)!r}: {e}")
        finally:
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
    final = _all_gather(errors[0] if errors else None, group)[0]  # rank 0 is done
    if final is not None:
        raise ValueError(final)
    log.info("rank %d saved its shards at step %d to %s", model.rank, trainer.step, path)
    return path


# ----------------------------------------------------------------------------- load
def _regions(
    workload: Workload, plan: ShardingPlan, rank: int, cfg: TrainConfig
) -> dict[str, list[tuple[int, int]]]:
    """``{key: region}`` this rank reads: its shard of each table (a DP table whole) and the
    same rows (and columns, for a per-weight state) of the tables' rows state."""
    out: dict[str, list[tuple[int, int]]] = {}
    plan.check_tables(workload.tables)
    for t in workload.tables:
        mine = [s for s in plan[t.name].shards if s.rank == rank]
        if not mine:
            continue
        rows, cols = (mine[0].row_start, mine[0].row_end), (mine[0].col_start, mine[0].col_end)
        key = table_weight_key(t.name)
        out[key] = [rows, cols]
        for k, per_weight in STATE_KEYS[cfg.embedding_update].items():
            out[f"{key}::{k}"] = [rows, cols] if per_weight else [rows]
    return out


def _read_whole(folder: Path, file: str, keep: Any) -> dict[str, torch.Tensor]:
    """The entries of ``file`` whose key ``keep(key)`` accepts (others are not read)."""
    fp = folder / file
    try:
        with safe_open(str(fp), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys() if keep(k)}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint file {str(fp)!r} cannot be read: {err}") from err


def _dense_filter(tables: list[str]) -> Any:
    """``key -> bool``: whether a checkpoint entry is the dense part's (not a table's weight
    or its optimizer state, :func:`~embark.models.tables.table_weight_key`)."""
    table_keys = {table_weight_key(t) for t in tables}

    def is_dense(key: str) -> bool:
        return key.split("::", 1)[0] not in table_keys

    return is_dense


@dataclass
class _RankState:
    """What one rank reads of a checkpoint (see :func:`_read_rank`)."""

    ckpt: ckpt.Checkpoint
    dense: dict[str, torch.Tensor]
    dense_optimizer: dict[str, torch.Tensor]
    tables: dict[str, list[Piece]]  # key -> the stored pieces of this rank's region, unread


def _read_rank(path: Path, plan: ShardingPlan, rank: int) -> _RankState:
    """Check this rank's part of a checkpoint (sizes and hashes of the files it reads, the
    pieces that cover its regions) and read its dense part; table pieces are read later,
    straight into the model (:func:`_check_and_restore`)."""
    checkpoint = ckpt.read_header(path)
    state, cfg = checkpoint.state, checkpoint.cfg
    workload = checkpoint.workload()
    chunks = chunks_of(state)
    regions = _regions(workload, plan, rank, cfg)
    for f in sorted(files_for(chunks, regions) | set(TENSOR_FILES)):
        ckpt.verify_file(path, f, state["files"][f])
    tables = {k: plan_region(path, chunks, k, r) for k, r in regions.items()}
    is_dense = _dense_filter([t.name for t in workload.tables])
    dense = _read_whole(path, ckpt.MODEL_FILE, is_dense)
    dense_opt = _read_whole(path, ckpt.OPTIMIZER_FILE, is_dense)
    return _RankState(checkpoint, dense, dense_opt, tables)


def _check_and_restore(trainer: Trainer, read: _RankState) -> None:
    """Check ``read`` against ``trainer``'s dense part and optimizer, then write it all."""
    model = _sharded_model(trainer)
    path = read.ckpt.path
    own = model.dense.state_dict()
    if set(own) != set(read.dense) or any(own[k].shape != read.dense[k].shape for k in own):
        raise ValueError(
            f"checkpoint file {str(path / ckpt.MODEL_FILE)!r} does not fit the model's dense "
            f"part: {sorted(set(own) ^ set(read.dense))[:5]}"
        )
    params = dict(model.dense.named_parameters())
    for key, v in read.dense_optimizer.items():
        name = key.split("::")[0]
        if name not in params or (v.dim() and v.shape != params[name].shape):
            raise ValueError(
                f"checkpoint file {str(path / ckpt.OPTIMIZER_FILE)!r}: optimizer state "
                f"{key!r} does not fit the model's dense part"
            )
    model.dense.load_state_dict(read.dense, strict=True)
    updates = _table_updates(trainer).updates
    with torch.no_grad():
        for key, pieces in read.tables.items():  # into the model: no copy of a whole shard
            table = key.split(".")[1]
            if "::" in key:
                read_pieces(path, pieces, updates[table].state()[key.split("::")[1]])
            else:
                read_pieces(path, pieces, model.embeddings.weights[table])
    for key, v in read.dense_optimizer.items():
        name, k = key.split("::")
        trainer.optimizer.state[params[name]][k] = v
    for key, sv in read.ckpt.state["optimizer_scalars"].items():
        name, k = key.split("::")
        if name in params:
            trainer.optimizer.state[params[name]][k] = sv
    saved = {g.get("name"): g for g in read.ckpt.state["param_groups"]}
    for g in trainer.optimizer.param_groups:
        if g.get("name") in saved:
            g.update({k: v for k, v in saved[g.get("name")].items() if k != "params"})


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    plan: ShardingPlan,
    rank: int,
    process_group: Any | None = None,
    comm_dtype: CommDtype | str | None = None,
    callbacks: Iterable[Callback] = (),
) -> Trainer:
    """Resume a checkpoint (of any world size or plan, or of a single-process run) on this
    world per ``plan`` (a collective: every rank calls it). Each rank reads only the parts
    of the stored chunks that overlap its shards.

    Raises:
        FormatVersionError: on every rank, for a checkpoint of another format version.
        ValueError: on every rank, naming the file, for a missing, truncated or altered file
            or a ``state.json`` that breaks the schema (checked before any trainer is
            built), or from :class:`ShardedDLRM` (a plan that does not fit the world or the
            tables).
    """
    path = Path(path)
    read: _RankState | None = None
    error: ValueError | None = None
    try:
        read = _read_rank(path, plan, rank)
    except ValueError as e:
        error = e
    reports = _all_gather(
        None if error is None else (type(error).__name__, str(error)), process_group
    )
    if error is not None:
        raise error
    bad = next((r for r in reports if r is not None), None)
    if bad is not None:
        kind = FormatVersionError if bad[0] == FormatVersionError.__name__ else ValueError
        raise kind(bad[1])
    assert read is not None  # no error
    model = ShardedDLRM.build(
        read.ckpt.workload(), plan, rank, process_group, comm_dtype, seed=None
    )
    trainer = Trainer(model, read.ckpt.cfg, callbacks, state=read.ckpt.train_state())
    _check_and_restore(trainer, read)
    return trainer
