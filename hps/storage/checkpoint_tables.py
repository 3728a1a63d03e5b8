"""Reading one embedding table out of a trainer checkpoint folder, whole or sharded.

The parameter server reads the trainer's checkpoint format without importing ``embark``: this
module knows what :func:`hps.storage.sparse_files.convert_checkpoint` needs of it. A table's
weight has the same key however it was trained, ``embeddings.<table>.weight``
``(num_rows, dim) float32``; where it is stored depends on the save:

- one process (and every data-parallel table of a sharded save): whole, in
  ``model.safetensors``;
- a sharded save by any number of ranks: in chunks, one rectangle per shard, in the
  per-rank files ``shards-<rank>.safetensors``, indexed by ``state.json["shards"]``::

    "shards": {"embeddings.t0.weight": [
        {"file": "shards-0.safetensors", "name": "embeddings.t0.weight@0,0",
         "offset": [0, 0],   "shape": [250, 16]},
        {"file": "shards-1.safetensors", "name": "embeddings.t0.weight@250,0",
         "offset": [250, 0], "shape": [750, 16]}]}

  (row-wise here; a column-wise table's chunks sit side by side: ``"offset": [0, 8]``).

The chunks of a table must tile it exactly (inside it, no two overlapping, covering every
value), each entry must have its recorded shape, and a file that ``state.json["files"]``
records (``{"bytes", "sha256"}``) must match it: a checkpoint that breaks any of these is
refused naming the file and the key, never converted with a hole or a stale shard.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.json"
_SHARD_FILE = re.compile(r"shards-(0|[1-9][0-9]*)\.safetensors")
_HASH_BLOCK = 1 << 20  # bytes hashed at a time


def weight_key(table: str) -> str:
    """The tensor key of ``table``'s weight: ``embeddings.<table>.weight``."""
    return f"embeddings.{table}.weight"


@dataclass(frozen=True)
class TableChunk:
    """One stored rectangle of a sharded table: entry ``name`` of ``file`` holds rows
    ``offset[0]:offset[0] + shape[0]`` and columns ``offset[1]:offset[1] + shape[1]``."""

    file: str
    name: str
    offset: tuple[int, int]
    shape: tuple[int, int]


def table_chunks(state: Mapping[str, Any], state_path: Path, table: str) -> list[TableChunk]:
    """The chunks of ``table``'s weight in ``state["shards"]`` (``[]`` when it is stored whole).

    Raises:
        ValueError: naming ``state_path`` and the field for a malformed index entry.
    """
    shards = state.get("shards", {})
    if not isinstance(shards, dict):
        raise ValueError(f"{state_path}: 'shards' must be a mapping, got {type(shards).__name__}")
    key = weight_key(table)
    raw = shards.get(key, [])
    if not isinstance(raw, list):
        raise ValueError(f"{state_path}: shards[{key!r}] must be a list of chunks, got {raw!r}")
    out = []
    for i, c in enumerate(raw):
        ok = (
            isinstance(c, dict)
            and isinstance(c.get("file"), str)
            and _SHARD_FILE.fullmatch(c["file"]) is not None
            and isinstance(c.get("name"), str)
            and _is_pair(c.get("offset"), 0)
            and _is_pair(c.get("shape"), 1)
        )
        if not ok:
            raise ValueError(
                f"{state_path}: shards[{key!r}][{i}] must be {{'file': 'shards-<rank>.safetensors', "
                f"'name': str, 'offset': [row, col] >= 0, 'shape': [rows, cols] >= 1}}, got {c!r}"
            )
        out.append(TableChunk(c["file"], c["name"], tuple(c["offset"]), tuple(c["shape"])))
    return out


def _is_pair(v: Any, least: int) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= least for i in v)
    )


def check_tiling(chunks: list[TableChunk], shape: tuple[int, int], where: str) -> None:
    """Raise unless ``chunks`` tile a ``shape`` tensor exactly: each inside it, no two
    overlapping, their areas summing to its size (so every value is covered once).

    Raises:
        ValueError: naming ``where`` (the checkpoint and key) and the offending chunk(s).
    """
    rows, cols = shape
    for c in chunks:
        (r, k), (h, w) = c.offset, c.shape
        if r + h > rows or k + w > cols:
            raise ValueError(
                f"{where}: chunk {c.name!r} at {list(c.offset)} of shape {list(c.shape)} lies "
                f"outside the table's {list(shape)}"
            )
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if _overlaps(a, b):
                raise ValueError(f"{where}: chunks {a.name!r} and {b.name!r} overlap")
    covered = sum(c.shape[0] * c.shape[1] for c in chunks)
    if covered != rows * cols:
        raise ValueError(
            f"{where}: its chunks cover {covered} of the {rows * cols} values of the table "
            f"{list(shape)}"
        )


def _overlaps(a: TableChunk, b: TableChunk) -> bool:
    return all(
        max(a.offset[d], b.offset[d]) < min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d])
        for d in (0, 1)
    )


def verify_file(ckpt_dir: Path, file: str, files: Mapping[str, Any]) -> None:
    """Check ``ckpt_dir/file`` exists and, when ``files`` (``state.json["files"]``) records
    it, has the recorded ``bytes`` and ``sha256``.

    Raises:
        ValueError: naming the file and what differs.
    """
    fp = ckpt_dir / file
    if not fp.is_file():
        raise ValueError(f"checkpoint {ckpt_dir}: missing {file}")
    info = files.get(file)
    if not isinstance(info, dict):
        return
    size = fp.stat().st_size
    if size != info.get("bytes"):
        raise ValueError(
            f"checkpoint file {fp} has {size} bytes, state.json records {info.get('bytes')}"
        )
    h = hashlib.sha256()
    with fp.open("rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    if h.hexdigest() != info.get("sha256"):
        raise ValueError(f"checkpoint file {fp} does not match its recorded sha256")


def read_table_weight(
    ckpt_dir: Path, state: Mapping[str, Any], table: str, shape: tuple[int, int]
) -> np.ndarray:
    """``table``'s weight ``(num_rows, dim) float32`` from a checkpoint folder, assembled from
    its chunks (a sharded save, any world size) or read whole (``model.safetensors``).

    Args:
        ckpt_dir: the checkpoint folder.
        state: its parsed ``state.json``.
        table: the table's name.
        shape: ``(num_rows, dim)`` the workload gives it.

    Raises:
        ValueError: naming the file and key for a missing file or tensor, a file that does not
            match its record, chunks that do not tile ``shape``, or a stored shape that
            disagrees with ``shape``.
    """
    from safetensors import SafetensorError, safe_open

    key = weight_key(table)
    state_path = ckpt_dir / STATE_FILE
    files = state.get("files", {})
    files = files if isinstance(files, dict) else {}
    chunks = table_chunks(state, state_path, table)
    if not chunks:
        model_path = ckpt_dir / MODEL_FILE
        verify_file(ckpt_dir, MODEL_FILE, files)
        with safe_open(str(model_path), framework="numpy") as f:
            if key not in set(f.keys()):
                raise ValueError(
                    f"{model_path}: no tensor {key!r} for table {table!r}, and "
                    f"{state_path.name} indexes no shards of it"
                )
            w = f.get_tensor(key)
        if tuple(w.shape) != shape:
            raise ValueError(
                f"{model_path}: {key} has shape {tuple(w.shape)}, workload says {shape}"
            )
        return np.ascontiguousarray(w, dtype=np.float32)
    check_tiling(chunks, shape, f"checkpoint {ckpt_dir}: {key}")
    out = np.empty(shape, dtype=np.float32)
    for file in sorted({c.file for c in chunks}):
        verify_file(ckpt_dir, file, files)
        fp = ckpt_dir / file
        try:
            with safe_open(str(fp), framework="numpy") as f:
                present = set(f.keys())
                for c in (c for c in chunks if c.file == file):
                    if c.name not in present:
                        raise ValueError(f"{fp}: no tensor {c.name!r} (a chunk of {key})")
                    part = f.get_tensor(c.name)
                    if tuple(part.shape) != c.shape:
                        raise ValueError(
                            f"{fp}: {c.name} has shape {tuple(part.shape)}, state.json says "
                            f"{c.shape}"
                        )
                    (r, k), (h, w) = c.offset, c.shape
                    out[r : r + h, k : k + w] = part
        except (SafetensorError, OSError) as err:
            raise ValueError(f"checkpoint file {fp} cannot be read: {err}") from err
    return out
