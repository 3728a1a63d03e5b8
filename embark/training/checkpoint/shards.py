"""Chunked tensors of a checkpoint: a table (or its rows state) stored as the rectangles its
ranks held, and reading any rectangle of it back without loading the rest.

A sharded save (``embark.sharding.save_sharded_checkpoint``) writes each rank's pieces of the
sharded tables into its own ``shards-<rank>.safetensors``; ``state.json`` indexes them under
``"shards"``: for each tensor key the chunks that tile it, each a safetensors entry of one
file at an offset. Table ``t0`` (1000 × 16) row-wise on 2 ranks with Adagrad::

    "shards": {
      "embeddings.t0.weight":      [{"file": "shards-0.safetensors", "name": "embeddings.t0.weight@0,0",
                                     "offset": [0, 0],   "shape": [250, 16]},
                                    {"file": "shards-1.safetensors", "name": "embeddings.t0.weight@250,0",
                                     "offset": [250, 0], "shape": [750, 16]}],
      "embeddings.t0.weight::sum": [ ...the same two rectangles... ]}

A per-row state (``row_sum``, ``(num_rows,)``) has 1-d chunks: ``"offset": [250]``; a table
split by columns stores it once per row range (from the column block at column 0, every
block holds equal values). A tensor not in ``"shards"`` (the dense part, data-parallel
tables, every table of a single-process save) is whole in ``model.safetensors`` (weights) or
``optimizer.safetensors`` (``"<param>::<state key>"``).

:func:`read_region` reads rows ``start:stop`` (and columns) of any tensor through
``safetensors.safe_open`` slices, so a rank of another plan reads only the bytes that overlap
its own shards: resharding reads ``O(shard)`` per rank, never a whole table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from embark.training.checkpoint.schema import TENSOR_FILES

MODEL_FILE, OPTIMIZER_FILE = TENSOR_FILES
# read_pieces reads a stored piece this many bytes of rows at a time (64 MiB): a shard loads
# through that much memory beyond itself, not a second copy of itself.
READ_BLOCK_BYTES = 64 << 20


def shard_file(rank: int) -> str:
    """The file of rank ``rank``'s pieces: ``shards-<rank>.safetensors``."""
    return f"shards-{rank}.safetensors"


def whole_file(key: str) -> str:
    """The file a tensor not stored in chunks is in: optimizer state (``"::"`` in the key) in
    ``optimizer.safetensors``, weights in ``model.safetensors``."""
    return OPTIMIZER_FILE if "::" in key else MODEL_FILE


@dataclass(frozen=True)
class Chunk:
    """One stored rectangle of a tensor.

    Attributes:
        file: the safetensors file (in the checkpoint folder).
        name: the entry in it.
        offset: its first index along each dimension of the whole tensor.
        shape: its size along each dimension.
    """

    file: str
    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def of(key: str, file: str, offset: Sequence[int], shape: Sequence[int]) -> Chunk:
        """The chunk of ``key`` at ``offset`` (its entry named ``"<key>@<offset>"``)."""
        return Chunk(file, f"{key}@{','.join(map(str, offset))}", tuple(offset), tuple(shape))

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "name": self.name,
            "offset": [*self.offset],
            "shape": [*self.shape],
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Chunk:
        return Chunk(d["file"], d["name"], tuple(d["offset"]), tuple(d["shape"]))


def chunks_of(state: Mapping[str, Any]) -> dict[str, list[Chunk]]:
    """``{tensor key: its chunks}`` of a checked ``state.json``."""
    return {k: [Chunk.from_dict(c) for c in v] for k, v in state["shards"].items()}


def files_for(
    chunks: Mapping[str, Sequence[Chunk]], regions: Mapping[str, Sequence[tuple[int, int]]]
) -> set[str]:
    """The files holding any part of ``regions`` (``{key: [(start, stop) per dimension]}``)."""
    out: set[str] = set()
    for key, region in regions.items():
        if key not in chunks:
            out.add(whole_file(key))
            continue
        out |= {c.file for c in chunks[key] if _overlap(c, region) is not None}
    return out


def _overlap(c: Chunk, region: Sequence[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The part of ``region`` that chunk ``c`` covers (whole-tensor indices), or ``None``."""
    out = []
    for (start, stop), off, size in zip(region, c.offset, c.shape):
        lo, hi = max(start, off), min(stop, off + size)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def _read(folder: Path, file: str, name: str, index: Sequence[slice]) -> torch.Tensor:
    fp = folder / file
    try:
        with safe_open(str(fp), framework="pt") as fh:
            part: torch.Tensor = fh.get_slice(name)[tuple(index)]
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint file {str(fp)!r} cannot be read: {err}") from err
    return part


@dataclass(frozen=True)
class Piece:
    """One stored rectangle's part of a region: ``file``'s entry ``name`` at ``source``
    (indices in the entry) goes to ``dest`` (indices in the region)."""

    file: str
    name: str
    source: tuple[slice, ...]
    dest: tuple[slice, ...]


def plan_region(
    folder: Path,
    chunks: Mapping[str, Sequence[Chunk]],
    key: str,
    region: Sequence[tuple[int, int]],
) -> list[Piece]:
    """The pieces that make up rows (and columns) ``region`` of the stored tensor ``key``,
    from the index (and a whole entry's header) alone: no tensor data is read.

    Args:
        folder: the checkpoint folder (its files already checked).
        chunks: :func:`chunks_of` the checkpoint's state.
        key: ``"embeddings.<t>.weight"`` or ``"embeddings.<t>.weight::<state key>"``.
        region: ``[(start, stop)]`` per dimension of the whole tensor.

    Raises:
        ValueError: naming the file for an unreadable entry, or naming ``key`` when its chunks
            (or its whole entry) do not cover ``region`` exactly once.
    """
    whole = [slice(a, b) for a, b in region]
    if key not in chunks:
        shape = _entry_shape(folder, whole_file(key), key)
        if len(shape) != len(region) or any(b > n for (_, b), n in zip(region, shape)):
            raise ValueError(
                f"checkpoint {str(folder)!r}: {key!r} is {list(shape)}, which does not hold "
                f"region {list(region)}"
            )
        dest = tuple(slice(0, b - a) for a, b in region)
        return [Piece(whole_file(key), key, tuple(whole), dest)]
    pieces, covered = [], 0
    for c in chunks[key]:
        ov = _overlap(c, region)
        if ov is None:
            continue
        src = tuple(slice(lo - off, hi - off) for (lo, hi), off in zip(ov, c.offset))
        dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(ov, region))
        pieces.append(Piece(c.file, c.name, src, dst))
        covered += int(torch.Size([hi - lo for lo, hi in ov]).numel())
    size = int(torch.Size([b - a for a, b in region]).numel())
    if covered != size:
        raise ValueError(
            f"checkpoint {str(folder)!r}: the chunks of {key!r} cover {covered} of the "
            f"{size} values of region {list(region)}"
        )
    return pieces


def _entry_shape(folder: Path, file: str, name: str) -> list[int]:
    fp = folder / file
    try:
        with safe_open(str(fp), framework="pt") as fh:
            return list(fh.get_slice(name).get_shape())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint file {str(fp)!r} cannot be read: {err}") from err


def read_pieces(
    folder: Path, pieces: Sequence[Piece], out: torch.Tensor, block_bytes: int = READ_BLOCK_BYTES
) -> torch.Tensor:
    """Read :func:`plan_region`'s ``pieces`` into ``out`` (shaped like the region) and return
    it. A piece is read in blocks of rows of at most ``block_bytes`` (one row if larger), so
    reading costs that much memory beyond ``out``, however large the piece.

    Raises:
        ValueError: naming the file for an unreadable entry.
    """
    row_bytes = max(1, out[:1].numel() * out.element_size())
    step = max(1, block_bytes // row_bytes)
    for p in pieces:
        src, dst = p.source[0], p.dest[0]
        for i in range(0, src.stop - src.start, step):
            j = min(src.stop - src.start, i + step)
            rows_src = (slice(src.start + i, src.start + j), *p.source[1:])
            rows_dst = (slice(dst.start + i, dst.start + j), *p.dest[1:])
            out[rows_dst] = _read(folder, p.file, p.name, rows_src)
    return out


def read_region(
    folder: Path,
    chunks: Mapping[str, Sequence[Chunk]],
    key: str,
    region: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Rows (and columns) ``region`` of the stored tensor ``key``, read from only the chunks
    (or the whole entry) that overlap it (:func:`plan_region`, then :func:`read_pieces`).

    Returns:
        a tensor shaped ``[stop - start per dimension]``, of the stored dtype.

    Raises:
        ValueError: as :func:`plan_region` and :func:`read_pieces`.
    """
    pieces = plan_region(folder, chunks, key, region)
    dtype = torch.float32
    if pieces:
        first = pieces[0]
        dtype = _read(folder, first.file, first.name, tuple(slice(0, 0) for _ in region)).dtype
    out = torch.zeros([b - a for a, b in region], dtype=dtype)
    return read_pieces(folder, pieces, out)
