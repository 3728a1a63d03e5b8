"""Trainer checkpoints: a folder of safetensors files and a versioned ``state.json``, written
atomically and checked whole before anything is loaded.

Folder layout (no pickle anywhere)::

    <dir>/model.safetensors      model.state_dict(), names as in the model
    <dir>/optimizer.safetensors  "<param name>::<state key>" -> tensor: the dense optimizer's
                                 (e.g. "top_mlp.0.weight::sum") and the fused tables' rows
                                 state ("embeddings.t0.weight::sum" or "::row_sum",
                                 :mod:`embark.training.fused`)
    <dir>/shards-<rank>.safetensors   (a sharded save) rank's pieces of the sharded tables
                                 and of their rows state, in chunks indexed by state.json
    <dir>/state.json             {"format_version", "step", "data_position", "batch_size",
                                  "data_stream", "workload", "train_config", "rng",
                                  "param_groups", "history", "files", "shards"}

A single-process save stores every tensor whole (``"shards": {}``); a sharded save
(``embark.sharding.save_sharded_checkpoint``) stores the sharded tables as the rectangles
their ranks held (:mod:`embark.training.checkpoint.shards`), the rest as here. Names and
optimizer-state keys are the single-process model's whatever the sharding, so either loads
as the other: :func:`read_checkpoint` assembles chunked tables whole, a sharded load reads
each rank's rectangles. ``format_version`` is :data:`CHECKPOINT_FORMAT_VERSION`; a
checkpoint of another version is refused (:class:`~embark.training.checkpoint.schema.FormatVersionError`;
:mod:`embark.training.checkpoint.schema` lists every field). ``batch_size`` is the
samples per step of the data stream that ``data_position`` counts batches of, and
``data_stream`` what else fixes that stream's batches
(:attr:`embark.training.state.TrainState.data_stream`), so a resume can check it is fed the
same stream. ``files`` records each tensor file's size and sha256, so a truncated or altered
file is a clear error on load. A save writes into a temporary sibling folder and renames it
into place: an interrupted save never leaves a half-written checkpoint at ``<dir>``.

Temporary siblings are named ``.<dir name>.tmp-<host>-<pid>-<random>`` (and, for the
checkpoint a save replaces, ``.old-``): each save and load removes those of this host whose
process is gone (a killed save), and never one whose owner runs (a save in progress). A
save killed between its two renames leaves ``<dir>`` missing and the previous checkpoint in
an ``.old-`` folder: the next save or load moves it back to ``<dir>``, with a warning naming it
(:mod:`embark.training.checkpoint.siblings`); where it cannot (another host's or a running
process's save), the load refuses naming the ``.old-`` folder.

Loading is three steps, so that nothing is touched until everything is checked:
:func:`read_checkpoint` (files, schema, tensor names), :func:`check_fits` (the model's
state-dict names, shapes and dtypes; the optimizer's groups and state shapes), then
:func:`restore` (writes the model and the optimizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from embark.models.workloads import Workload
from embark.outputs import check_parent_writable, fsync_dir
from embark.training.checkpoint.modules import (
    dry_run_loads,
    self_loading_modules,
    storage_mismatches,
)
from embark.training.checkpoint.schema import STATE_FILE, TENSOR_FILES, check_state
from embark.training.checkpoint.shards import Chunk, chunks_of, read_region
from embark.training.checkpoint.siblings import (
    fresh_sibling,
    previous_checkpoints,
    recover_previous,
    remove_stale_siblings,
)
from embark.training.config import TrainConfig
from embark.training.fused import EmbeddingUpdates
from embark.training.state import TrainState

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 3
MODEL_FILE, OPTIMIZER_FILE = TENSOR_FILES


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_replaceable(path: Path) -> bool:
    """Whether a save may write at ``path``: it does not exist, is an empty folder or a
    checkpoint folder (one holding ``state.json``)."""
    return not path.exists() or (
        path.is_dir() and (not any(path.iterdir()) or (path / STATE_FILE).is_file())
    )


def check_save_target(path: str | os.PathLike[str], what: str = "checkpoint folder") -> None:
    """Check, before training, that a checkpoint can be saved at ``path``.

    Args:
        what: how the caller names ``path`` in the message (``"--checkpoint-dir"``).

    Raises:
        ValueError: naming ``what`` and the path: it exists and is not a checkpoint folder
            (a save refuses to replace it), it is under a file, or its folder cannot be
            created or written.
    """
    p = Path(path)
    if p.exists() and not is_replaceable(p):
        raise ValueError(f"{what} {str(p)!r} exists and is not a checkpoint folder")
    # a save writes a sibling folder and renames it into place: the parent must be writable
    check_parent_writable(p, what)


# ------------------------------------------------------------------------------- save
def optimizer_files(
    optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[dict[str, Any]]]:
    """``(tensor state, scalar state, param groups)`` of ``optimizer``, keyed by parameter name."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            key = f"{names[p]}::{k}"
            if isinstance(v, torch.Tensor):
                tensors[key] = v.detach().cpu().contiguous()
            else:
                scalars[key] = v
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": [names[p] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return tensors, scalars, groups


def file_records(folder: Path, files: list[str]) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "sha256"}}`` of ``files`` in ``folder`` (``state.json``'s ``files``)."""
    return {f: {"bytes": (folder / f).stat().st_size, "sha256": _sha256(folder / f)} for f in files}


def state_document(
    workload: Any,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    state: TrainState,
    scalars: dict[str, Any],
    groups: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
    shards: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """The ``state.json`` of a checkpoint (:mod:`embark.training.checkpoint.schema`)."""
    return {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": state.step,
        "data_position": state.step,
        "batch_size": state.batch_size,
        "data_stream": state.data_stream,
        "workload": workload.to_dict() if isinstance(workload, Workload) else None,
        "train_config": cfg.to_dict(),
        "rng": {"trainer_generator": state.generator.get_state().numpy().tobytes().hex()},
        "optimizer": type(optimizer).__name__,
        "optimizer_scalars": scalars,
        "param_groups": groups,
        "history": state.history,
        "torch_version": torch.__version__,
        "files": files,
        "shards": shards,
    }


def begin_save(path: Path) -> Path:
    """Check that ``path`` may be replaced and make the temporary sibling a save writes into.

    Raises:
        ValueError: when ``path`` exists and is not a checkpoint folder (nothing is touched).
    """
    if not is_replaceable(path):
        raise ValueError(
            f"refusing to overwrite {str(path)!r}: it exists and is not a checkpoint folder"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    tmp = fresh_sibling(path, "tmp")
    tmp.mkdir()
    return tmp


def finish_save(tmp: Path, path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as ``tmp``'s ``state.json`` and rename ``tmp`` into place at ``path``
    (the previous checkpoint there is kept until the new one is in place)."""
    with open(tmp / STATE_FILE, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    if path.exists():
        old = fresh_sibling(path, "old")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    fsync_dir(path.parent)
    remove_stale_siblings(path)  # an .old- one kept while path was missing goes now


def write_tensors(tensors: dict[str, torch.Tensor], fp: Path) -> None:
    """Save ``tensors`` (detached, on the CPU, contiguous) as the safetensors file ``fp``."""
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        fp,
        metadata={"format": "pt"},
    )
    with open(fp, "rb+") as fh:
        os.fsync(fh.fileno())


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    state: TrainState,
    tables: EmbeddingUpdates | None = None,
) -> Path:
    """Write a checkpoint folder at ``path`` (replacing a checkpoint there, atomically).

    Args:
        model: a single-process model (its ``workload`` attribute, when a
            :class:`Workload`, is recorded so a load can rebuild it).
        optimizer: over ``model``'s dense parameters.
        tables: the fused tables whose rows state is saved beside the optimizer's.

    Raises:
        ValueError: when ``path`` exists and is not a checkpoint folder (nothing is touched).
    """
    path = Path(path)
    tmp = begin_save(path)
    try:
        write_tensors(model.state_dict(), tmp / MODEL_FILE)
        names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
        tensors, scalars, groups = optimizer_files(optimizer, names)
        if tables is not None:
            tensors |= tables.state_tensors()
        write_tensors(tensors, tmp / OPTIMIZER_FILE)
        files = file_records(tmp, list(TENSOR_FILES))
        workload = getattr(model, "workload", None)
        doc = state_document(workload, optimizer, cfg, state, scalars, groups, files, {})
        finish_save(tmp, path, doc)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved checkpoint at step %d to %s", state.step, path)
    return path


# ------------------------------------------------------------------------------- read
def read_state(path: str | os.PathLike[str], verify: Iterable[str] | None = None) -> dict[str, Any]:
    """``state.json`` of a checkpoint, after checking its format version and schema (every
    field's presence and type) and the size and hash of its tensor files.

    Args:
        verify: the tensor files to check (``None``: all of them); a rank of a sharded load
            checks the files it reads.

    Raises:
        FormatVersionError: naming the file, for another ``format_version``.
        ValueError: naming the file (and the field), for a missing, truncated or altered
            checkpoint file or a ``state.json`` that breaks the schema; for a missing
            ``state.json`` naming the ``.old-`` folder(s) holding a previous checkpoint that
            an interrupted save left and this process could not move back
            (:func:`~embark.training.checkpoint.siblings.recover_previous`).
    """
    path = Path(path)
    sp = path / STATE_FILE
    recover_previous(path)
    if not sp.is_file():
        left = previous_checkpoints(path)
        hint = (
            f"; an interrupted save left the previous checkpoint at {[str(p) for p in left]} "
            f"(its process may still run, or on another host): move it to {str(path)!r} to "
            "resume from it"
            if left
            else ""
        )
        raise ValueError(f"{str(path)!r} is not a checkpoint folder: {STATE_FILE} is missing{hint}")
    try:
        state = json.loads(sp.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint file {str(sp)!r} is corrupt or truncated: {err}") from err
    check_state(state, sp, CHECKPOINT_FORMAT_VERSION)
    names = state["files"] if verify is None else sorted(set(verify))
    for name in names:
        verify_file(path, name, state["files"][name])
    return state


def verify_file(path: Path, name: str, info: dict[str, Any]) -> None:
    """Check the tensor file ``name`` of the checkpoint ``path`` against its record
    ``{"bytes", "sha256"}``.

    Raises:
        ValueError: naming the file, when it is missing, of another size or hash.
    """
    fp = path / name
    if not fp.is_file():
        raise ValueError(f"checkpoint file {str(fp)!r} is missing")
    size = fp.stat().st_size
    if size != info["bytes"]:
        raise ValueError(
            f"checkpoint file {str(fp)!r} is {size} bytes but {info['bytes']} were written "
            f"(truncated or replaced)"
        )
    if _sha256(fp) != info["sha256"]:
        raise ValueError(f"checkpoint file {str(fp)!r} does not match its recorded sha256")


def _whole(chunks: list[Chunk]) -> list[tuple[int, int]]:
    """The region ``[(0, size)]`` per dimension of the whole tensor that ``chunks`` tile."""
    dims = range(len(chunks[0].offset))
    return [(0, max(c.offset[d] + c.shape[d] for c in chunks)) for d in dims]


def _load_tensors(fp: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(fp)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint file {str(fp)!r} cannot be read: {err}") from err


@dataclass
class Checkpoint:
    """A checkpoint read and checked by :func:`read_checkpoint` (nothing loaded anywhere yet).

    Attributes:
        path: the folder.
        state: its ``state.json``.
        cfg: its training configuration.
        model_tensors: ``model.safetensors``.
        optimizer_tensors: ``optimizer.safetensors`` (keys ``"<param name>::<state key>"``).
    """

    path: Path
    state: dict[str, Any]
    cfg: TrainConfig
    model_tensors: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    def workload(self) -> Workload:
        """The stored workload (to rebuild the model).

        Raises:
            ValueError: naming the checkpoint, when it stores none or an invalid one.
        """
        if self.state["workload"] is None:
            raise ValueError(f"checkpoint {str(self.path)!r} stores no workload: pass model=")
        try:
            return Workload.from_dict(self.state["workload"])
        except ValueError as err:
            raise ValueError(f"checkpoint file {str(self.state_file)!r}: workload: {err}") from None

    def train_state(self) -> TrainState:
        """Step, batch size, data stream, generator and history as saved."""
        gen = torch.Generator()
        raw = bytes.fromhex(self.state["rng"]["trainer_generator"])
        gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return TrainState(
            step=self.state["step"],
            batch_size=self.state["batch_size"],
            data_stream=self.state["data_stream"],
            generator=gen,
            history=list(self.state["history"]),
        )


def read_header(path: str | os.PathLike[str]) -> Checkpoint:
    """A checkpoint's ``state.json`` and configuration, checked against the schema, without
    reading or verifying its tensor files (``model_tensors`` and ``optimizer_tensors`` are
    empty): what a resume compares with its settings before a sharded load reads, and
    checks, each rank's files.

    Raises:
        FormatVersionError: naming the file, for another ``format_version``.
        ValueError: naming the file (and the field) of the first problem in ``state.json``.
    """
    path = Path(path)
    state = read_state(path, verify=())
    try:
        cfg = TrainConfig.from_dict(state["train_config"])
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"checkpoint file {str(path / STATE_FILE)!r}: train_config: {err}"
        ) from None
    return Checkpoint(path, state, cfg, {}, {})


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint folder and check it on its own (:func:`read_state`, readable tensor
    files, optimizer tensor names, a valid ``train_config``).

    Raises:
        ValueError: naming the file (and the field) of the first problem.
    """
    path = Path(path)
    state = read_state(path)
    remove_stale_siblings(path)
    tensors = _load_tensors(path / MODEL_FILE)
    opt_tensors = _load_tensors(path / OPTIMIZER_FILE)
    for key, chunks in chunks_of(state).items():  # a sharded save's tables: assembled whole
        whole = read_region(path, {key: chunks}, key, _whole(chunks))
        (opt_tensors if "::" in key else tensors)[key] = whole
    for key in opt_tensors:
        if key.count("::") != 1:
            raise ValueError(
                f"checkpoint file {str(path / OPTIMIZER_FILE)!r}: tensor {key!r} is not "
                f"named '<param name>::<state key>'"
            )
    try:
        cfg = TrainConfig.from_dict(state["train_config"])
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"checkpoint file {str(path / STATE_FILE)!r}: train_config: {err}"
        ) from None
    return Checkpoint(path, state, cfg, tensors, opt_tensors)


# ------------------------------------------------------------------- check and restore
def _check_model(ckpt: Checkpoint, model: nn.Module) -> None:
    tensors = ckpt.model_tensors
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    stored_otherwise = storage_mismatches(tensors, own)
    if stored_otherwise:
        raise ValueError(
            f"checkpoint {str(ckpt.path)!r} does not fit the model: tables stored in other "
            f"formats: {'; '.join(stored_otherwise)}. Load a quantized checkpoint into a model "
            "quantized with the same EmbeddingQuantConfig (embark.quant.quantize_embeddings_), "
            "a float one into a float model"
        )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(ckpt.path)!r} does not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    own_sizes = self_loading_modules(model)  # checked by a load into a copy instead
    dry_run_loads(ckpt.model_tensors, own_sizes, ckpt.path / MODEL_FILE)
    for k, v in own.items():
        if k.rpartition(".")[0] in own_sizes:
            continue
        if v.shape != tensors[k].shape or v.dtype != tensors[k].dtype:
            raise ValueError(
                f"checkpoint file {str(ckpt.path / MODEL_FILE)!r}: tensor {k!r} is "
                f"{tuple(tensors[k].shape)} {tensors[k].dtype}, "
                f"the model has {tuple(v.shape)} {v.dtype}"
            )


def _check_tables(ckpt: Checkpoint, tables: EmbeddingUpdates | None) -> set[str]:
    """Check the fused tables' state against ``tables``; returns its keys."""
    fp = ckpt.path / OPTIMIZER_FILE
    expected = tables.state_shapes() if tables is not None else {}
    table_params = set(tables.param_names.values()) if tables is not None else set()
    saved = {k for k in ckpt.optimizer_tensors if k.split("::")[0] in table_params}
    if saved != set(expected):
        missing, extra = sorted(set(expected) - saved), sorted(saved - set(expected))
        raise ValueError(
            f"checkpoint file {str(fp)!r}: embedding optimizer state does not fit this "
            f"trainer's ({ckpt.cfg.embedding_update.value}): missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    own = tables.state_tensors() if tables is not None else {}
    for key, shape in expected.items():
        v = ckpt.optimizer_tensors[key]
        if tuple(v.shape) != shape or v.dtype != own[key].dtype:
            raise ValueError(
                f"checkpoint file {str(fp)!r}: embedding optimizer state {key!r} is "
                f"{tuple(v.shape)} {v.dtype}, expected {shape} {own[key].dtype}"
            )
    return saved


def _check_optimizer(
    ckpt: Checkpoint,
    optimizer: torch.optim.Optimizer,
    names: dict[str, nn.Parameter],
    skip: set[str],
) -> None:
    path, sp = ckpt.path, ckpt.state_file
    by_param = {p: n for n, p in names.items()}
    saved_groups = ckpt.state["param_groups"]
    if [g["params"] for g in saved_groups] != [
        [by_param[p] for p in g["params"]] for g in optimizer.param_groups
    ]:
        raise ValueError(
            f"checkpoint {str(path)!r}: optimizer parameter groups do not match the model"
        )
    for i, (g, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        extra = sorted(set(saved) - set(g))
        if extra:
            raise ValueError(
                f"checkpoint file {str(sp)!r}: param_groups[{i}] has unknown option(s) "
                f"{extra}; {type(optimizer).__name__} has {sorted(set(g) - {'params'})}"
            )
        for key, value in saved.items():
            expected = _option_kind(g[key], value) if key != "params" else None
            if expected is not None:
                raise ValueError(
                    f"checkpoint file {str(sp)!r}: param_groups[{i}].{key} must be "
                    f"{expected}, got {value!r:.80}"
                )
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = {n: p for n, p in names.items() if id(p) in owned}
    keys = [*(k for k in ckpt.optimizer_tensors if k not in skip), *ckpt.state["optimizer_scalars"]]
    stray = sorted({k.split("::")[0] for k in keys} - set(names))
    if stray:
        raise ValueError(
            f"checkpoint {str(path)!r}: optimizer state for unknown parameters {stray[:5]}"
        )
    for key, v in ckpt.optimizer_tensors.items():  # a scalar or the parameter's shape
        if key in skip:
            continue
        p = names[key.split("::")[0]]
        if v.dim() and (v.shape != p.shape or v.dtype != p.dtype):
            raise ValueError(
                f"checkpoint file {str(path / OPTIMIZER_FILE)!r}: optimizer state {key!r} is "
                f"{tuple(v.shape)} {v.dtype}, its parameter is {tuple(p.shape)} {p.dtype}"
            )


def _option_kind(current: Any, saved: Any) -> str | None:
    """What a saved optimizer option must be, given the optimizer's own value of it, when
    ``saved`` is not that (``None``: it fits). An option of the wrong kind would load and
    then fail inside the optimizer's step (``lr: [..]``)."""
    if isinstance(current, bool):  # None: torch's default for its flags (fused, foreach)
        return None if saved is None or isinstance(saved, bool) else "null, true or false"
    if current is None:
        return None if saved is None or isinstance(saved, bool) else "null, true or false"
    if isinstance(current, int | float):
        ok = isinstance(saved, int | float) and not isinstance(saved, bool)
        return None if ok and math.isfinite(saved) else "a finite number"
    if isinstance(current, str):
        return None if isinstance(saved, str) else "a string"
    return None


def check_fits(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tables: EmbeddingUpdates | None = None,
) -> None:
    """Check that ``ckpt`` loads into ``model``, ``optimizer`` (built over ``model``'s dense
    parameters, with the checkpoint's configuration) and ``tables`` (its fused tables) without
    touching any.

    Raises:
        ValueError: for state-dict names, shapes or dtypes that differ from the checkpoint's,
            other optimizer parameter groups or options, or optimizer state of the wrong shape.
    """
    _check_model(ckpt, model)
    skip = _check_tables(ckpt, tables)
    _check_optimizer(ckpt, optimizer, dict(model.named_parameters()), skip)


def restore(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tables: EmbeddingUpdates | None = None,
) -> None:
    """Load ``ckpt``'s weights into ``model``, its options and state into ``optimizer`` and
    the tables' rows state into ``tables`` (after :func:`check_fits`)."""
    names = dict(model.named_parameters())
    model.load_state_dict(ckpt.model_tensors, strict=True)
    table_keys = set(tables.state_shapes()) if tables is not None else set()
    if tables is not None:
        tables.load_state({k: ckpt.optimizer_tensors[k] for k in table_keys})
    for g, saved in zip(optimizer.param_groups, ckpt.state["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
    for key, v in ckpt.optimizer_tensors.items():
        if key in table_keys:
            continue
        pname, skey = key.split("::")
        optimizer.state[names[pname]][skey] = v.to(names[pname].device)
    for key, sv in ckpt.state["optimizer_scalars"].items():
        pname, skey = key.split("::")
        optimizer.state[names[pname]][skey] = sv
