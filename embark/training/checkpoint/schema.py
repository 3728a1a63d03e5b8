"""The schema of a trainer checkpoint's ``state.json``, checked before anything is loaded.

:meth:`embark.training.trainer.Trainer.read_state` calls :func:`check_state` right after parsing the
JSON, so a hand-edited or foreign ``state.json`` fails with an error naming the file and the
field, before any weight, optimizer slot or generator is touched. The fields (as written by
:meth:`~embark.training.trainer.Trainer.save_checkpoint`)::

    {"format_version": 3,
     "step": 9, "data_position": 9,                       # integers >= 0
     "batch_size": 64 | null,                             # optional: integer >= 1 or null
     "data_stream": {...} | null,                         # optional: mapping or null
     "workload": {...} | null,                            # Workload.to_dict() or null
     "train_config": {...},                               # TrainConfig.to_dict()
     "rng": {"trainer_generator": "<hex of the torch.Generator state>"},
     "optimizer": "Adagrad", "torch_version": "2.13.0",   # informational strings
     "optimizer_scalars": {"<param>::<key>": number, ...},
     "param_groups": [{"params": ["<param>", ...], "lr": 0.05, ...}, ...],
     "history": [{"step": 4, "auc": 0.7, ...}, ...],
     "files": {"model.safetensors": {"bytes": 515428, "sha256": "<64 hex>"},
               "optimizer.safetensors": {...},
               "shards-0.safetensors": {...}, ...},          # a sharded save: one per rank
     "shards": {"<key>": [{"file": "shards-0.safetensors", "name": "<key>@0,0",
                           "offset": [0, 0], "shape": [250, 16]}, ...]}}   # {} in one process

``shards`` indexes the tensors stored in chunks (:mod:`embark.training.checkpoint.shards`);
every file it names is in ``files`` and every ``shards-<rank>`` file in ``files`` is named.

Fields not listed are ignored (a writer of the same version may add information).
``batch_size`` is the samples per step of the data stream, ``data_stream`` what else fixes
its batches (e.g. ``SyntheticCTR.stream_config()``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")
STATE_FILE = "state.json"
_SHARD_FILE = re.compile(r"shards-(0|[1-9][0-9]*)\.safetensors")
_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class FormatVersionError(ValueError):
    """A checkpoint of another ``format_version`` than this reader's (the message names the
    file, its version and the expected one)."""


def _fail(sp: Path, field: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"checkpoint file {str(sp)!r}: {field} must be {expected}, got {got!r:.120}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _require(state: dict[str, Any], sp: Path, field: str) -> Any:
    if field not in state:
        raise ValueError(f"checkpoint file {str(sp)!r}: missing field {field!r}")
    return state[field]


def _check_param_key(key: Any, sp: Path, field: str) -> None:
    if not isinstance(key, str) or key.count("::") != 1 or not all(key.split("::")):
        raise _fail(sp, f"a key of {field}", "'<param name>::<state key>'", key)


def check_state(state: Any, sp: Path, version: int) -> dict[str, Any]:
    """Check the structure and types of a parsed ``state.json`` (see the module docstring).

    Args:
        state: the parsed JSON document.
        sp: the ``state.json`` path, for messages.
        version: the format version this reader understands.

    Returns:
        ``state``, unchanged.

    Raises:
        ValueError: naming ``sp`` and the first bad field: a non-mapping document, a missing
            field, a value of the wrong type (``"step": "abc"``), a generator state torch
            cannot restore, or a ``files`` record that does not list exactly the tensor files.
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"checkpoint file {str(sp)!r} must hold a JSON object, got {type(state).__name__}"
        )
    fv = _require(state, sp, "format_version")
    if not _is_int(fv) or fv != version:
        raise FormatVersionError(
            f"checkpoint file {str(sp)!r} has format_version {fv!r}, expected {version}"
        )
    _check_run(state, sp)
    _check_rng(_require(state, sp, "rng"), sp)
    _check_optimizer(state, sp)
    history = _require(state, sp, "history")
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise _fail(sp, "history", "a list of mappings", history)
    _check_files(_require(state, sp, "files"), sp)
    _check_shards(_require(state, sp, "shards"), state["files"], sp)
    return state


def _check_run(state: dict[str, Any], sp: Path) -> None:
    """Step, data position, batch size, data stream, workload, config, informational strings."""
    for field in ("step", "data_position"):
        v = _require(state, sp, field)
        if not _is_int(v) or v < 0:
            raise _fail(sp, field, "an integer >= 0", v)
    bs = _require(state, sp, "batch_size")
    if bs is None and state["step"] > 0:
        raise _fail(sp, "batch_size", "an integer >= 1 after step 0", bs)
    if bs is not None and (not _is_int(bs) or bs < 1):
        raise _fail(sp, "batch_size", "an integer >= 1 or null", bs)
    stream = _require(state, sp, "data_stream")
    if stream is not None and not isinstance(stream, dict):
        raise _fail(sp, "data_stream", "a mapping or null", stream)
    workload = _require(state, sp, "workload")
    if workload is not None and not isinstance(workload, dict):
        raise _fail(sp, "workload", "a mapping or null", workload)
    if not isinstance(_require(state, sp, "train_config"), dict):
        raise _fail(sp, "train_config", "a mapping", state["train_config"])
    for field in ("optimizer", "torch_version"):
        if field in state and not isinstance(state[field], str):
            raise _fail(sp, field, "a string", state[field])


def _check_rng(rng: Any, sp: Path) -> None:
    gen = rng.get("trainer_generator") if isinstance(rng, dict) else None
    if not isinstance(gen, str) or not gen or not _HEX.fullmatch(gen):
        raise _fail(
            sp, "rng.trainer_generator", "a hex string", gen if isinstance(rng, dict) else rng
        )
    try:
        torch.Generator().set_state(
            torch.frombuffer(bytearray(bytes.fromhex(gen)), dtype=torch.uint8)
        )
    except RuntimeError as err:  # wrong length: torch checks the state size
        raise _fail(
            sp, "rng.trainer_generator", "a torch.Generator state", f"{len(gen) // 2} bytes"
        ) from err


def _check_optimizer(state: dict[str, Any], sp: Path) -> None:
    scalars = _require(state, sp, "optimizer_scalars")
    if not isinstance(scalars, dict):
        raise _fail(sp, "optimizer_scalars", "a mapping", scalars)
    for key, v in scalars.items():
        _check_param_key(key, sp, "optimizer_scalars")
        if v is not None and not isinstance(v, bool | int | float):
            raise _fail(sp, f"optimizer_scalars[{key!r}]", "a number, a bool or null", v)
    groups = _require(state, sp, "param_groups")
    if not isinstance(groups, list) or not groups:
        raise _fail(sp, "param_groups", "a non-empty list", groups)
    for i, g in enumerate(groups):
        params = g.get("params") if isinstance(g, dict) else None
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise _fail(sp, f"param_groups[{i}]", "a mapping with 'params': a list of names", g)


def _check_files(files: Any, sp: Path) -> None:
    ok = isinstance(files, dict) and set(TENSOR_FILES) <= set(files)
    if not ok or not all(f in TENSOR_FILES or _SHARD_FILE.fullmatch(f) for f in files):
        got = sorted(files) if isinstance(files, dict) else files
        raise _fail(
            sp, "files", f"a record of {list(TENSOR_FILES)} and shards-<rank>.safetensors", got
        )
    for name, info in files.items():
        if not isinstance(info, dict) or not _is_int(info.get("bytes")) or info["bytes"] < 0:
            raise _fail(sp, f"files[{name!r}]", "{'bytes': integer >= 0, 'sha256': hex}", info)
        if not isinstance(info.get("sha256"), str) or not _SHA256.fullmatch(info["sha256"]):
            raise _fail(
                sp, f"files[{name!r}].sha256", "64 lowercase hex digits", info.get("sha256")
            )


def _is_index_list(v: Any, least: int) -> bool:
    return isinstance(v, list) and v != [] and all(_is_int(i) and i >= least for i in v)


def _check_shards(shards: Any, files: dict[str, Any], sp: Path) -> None:
    if not isinstance(shards, dict):
        raise _fail(sp, "shards", "a mapping", shards)
    named: set[str] = set()
    for key, chunks in shards.items():
        if not isinstance(chunks, list) or not chunks:
            raise _fail(sp, f"shards[{key!r}]", "a non-empty list of chunks", chunks)
        for i, c in enumerate(chunks):
            field = f"shards[{key!r}][{i}]"
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                raise _fail(sp, field, "{'file', 'name', 'offset', 'shape'}", c)
            if c.get("file") not in files or not _SHARD_FILE.fullmatch(str(c["file"])):
                raise _fail(
                    sp, f"{field}.file", "a shards-<rank> file listed in files", c.get("file")
                )
            off: Any = c.get("offset")
            shape: Any = c.get("shape")
            if not _is_index_list(off, 0) or not _is_index_list(shape, 1) or len(off) != len(shape):
                raise _fail(sp, field, "offset (>= 0) and shape (>= 1) of equal length", c)
            named.add(c["file"])
    unnamed = sorted(f for f in files if f not in TENSOR_FILES and f not in named)
    if unnamed:
        raise _fail(sp, "files", "only files that shards names", unnamed)
