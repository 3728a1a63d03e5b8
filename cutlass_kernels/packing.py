"""The weight side of the TW GEMM's arguments: a condensed TW weight (plain index tensors)
checked and packed once into the arrays the kernel reads (layout drawn in ``emit.py`` and in
:mod:`cutlass_kernels.reference`)::

    tile_meta  (T, 4) int32    per tile t: col_off, ncols, row_off, nrows
    col_idx    (Nk,)  int32    scatter indices: kept output columns, tile after tile
    row_idx    (R,)   int32    gather indices: each tile's kept K rows, tile after tile
    w          (R, lda)        packed blocks: row row_off+k of tile t holds B_t[k, :ncols]
                               then zeros up to lda (a multiple of ALIGNMENT >= widest tile)

A tile wider than the kernel's ``G`` is packed as several sub-tiles (``pack_weight(...,
max_tile_width=G)``): consecutive column ranges of the tile, each with its own ``tile_meta`` row
and its own copy of the tile's kept rows in ``row_idx`` and ``w``; ``col_idx`` is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cutlass_kernels.manifest import ALIGNMENT

__all__ = ["CondensedWeight", "TWPackedWeight", "check_weight", "pack_weight", "round_up"]

_INT32_MAX = 2**31 - 1


def round_up(v: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= v``."""
    return (v + m - 1) // m * m


@dataclass(frozen=True)
class TWPackedWeight:
    """The weight-side kernel arguments of one layer (packed once, reused every call).

    Attributes:
        in_features: ``K``.
        out_features: ``N``.
        lda: row pitch of ``w`` in elements (multiple of ``ALIGNMENT``, >= widest tile).
        max_tile_width: the widest tile (host int; the kernel's ``G`` must be >= it).
        tile_meta: ``(T, 4) int32`` ``[col_off, ncols, row_off, nrows]`` per tile.
        col_idx: ``(Nk,) int32`` scatter indices.
        row_idx: ``(R,) int32`` gather indices.
        w: ``(R, lda)`` packed blocks, zero padded beyond each tile's width.
    """

    in_features: int
    out_features: int
    lda: int
    max_tile_width: int
    tile_meta: torch.Tensor
    col_idx: torch.Tensor
    row_idx: torch.Tensor
    w: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return int(self.tile_meta.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def device(self) -> torch.device:
        return self.w.device

    def to(self, device: torch.device | str) -> TWPackedWeight:
        """A copy with every tensor on ``device``."""
        return TWPackedWeight(
            self.in_features,
            self.out_features,
            self.lda,
            self.max_tile_width,
            self.tile_meta.to(device),
            self.col_idx.to(device),
            self.row_idx.to(device),
            self.w.to(device),
        )


class CondensedWeight(Protocol):
    """A condensed TW weight as plain tensors: what :func:`pack_weight` reads.

    ``tilesparse.format.TWLayout`` is one (its docstring draws the format); any object with
    these attributes is. Offsets and indices are ``int64``; block ``t`` of ``values`` is
    ``(R_t, G_t)`` row-major with ``G_t = tile_ptr[t+1] - tile_ptr[t]``,
    ``R_t = row_ptr[t+1] - row_ptr[t]``.
    """

    @property
    def in_features(self) -> int:
        """``K``."""
        ...

    @property
    def out_features(self) -> int:
        """``N``."""
        ...

    @property
    def col_idx(self) -> torch.Tensor:
        """``(Nk,) int64`` kept output columns, strictly ascending."""
        ...

    @property
    def tile_ptr(self) -> torch.Tensor:
        """``(T+1,) int64`` offsets into ``col_idx``."""
        ...

    @property
    def row_idx(self) -> torch.Tensor:
        """``(R,) int64`` kept input rows of every tile, strictly ascending within a tile."""
        ...

    @property
    def row_ptr(self) -> torch.Tensor:
        """``(T+1,) int64`` offsets into ``row_idx``."""
        ...

    @property
    def values(self) -> torch.Tensor:
        """``(V,)`` the blocks, flattened."""
        ...

    @property
    def val_ptr(self) -> torch.Tensor:
        """``(T+1,) int64`` offsets into ``values``."""
        ...


def check_weight(weight: CondensedWeight) -> None:
    """Refuse index tensors the kernel would read or write out of bounds with (it trusts
    every offset and index), or that write one output column twice.

    Raises:
        ValueError: naming the broken invariant: index tensors not 1-D int64, offsets of
            unequal lengths, not starting at 0, decreasing or not ending at their array's
            length, indices out of ``[0, K)`` / ``[0, N)``, ``col_idx`` not strictly
            ascending, a tile without columns, a block not ``R_t·G_t`` values, or a tile's
            rows not strictly ascending.
    """
    K, N = weight.in_features, weight.out_features
    ptrs = {"tile_ptr": weight.tile_ptr, "row_ptr": weight.row_ptr, "val_ptr": weight.val_ptr}
    for name, t in (("col_idx", weight.col_idx), ("row_idx", weight.row_idx), *ptrs.items()):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if weight.values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(weight.values.shape)}")
    lengths = [int(p.numel()) for p in ptrs.values()]
    if lengths[0] < 1 or len(set(lengths)) != 1:
        raise ValueError(
            f"tile_ptr, row_ptr, val_ptr must have T+1 >= 1 entries each, got {lengths}"
        )
    col_idx, row_idx = weight.col_idx, weight.row_idx
    if col_idx.numel() and (int(col_idx.min()) < 0 or int(col_idx.max()) >= N):
        raise ValueError(f"col_idx out of range [0, {N})")
    if row_idx.numel() and (int(row_idx.min()) < 0 or int(row_idx.max()) >= K):
        raise ValueError(f"row_idx out of range [0, {K})")
    if bool((col_idx[1:] <= col_idx[:-1]).any()):
        raise ValueError("col_idx must be strictly ascending (one tile per output column)")
    ends = {
        "tile_ptr": col_idx.numel(),
        "row_ptr": row_idx.numel(),
        "val_ptr": weight.values.numel(),
    }
    for name, p in ptrs.items():
        if int(p[0]) != 0 or bool((p[1:] < p[:-1]).any()) or int(p[-1]) != ends[name]:
            raise ValueError(f"{name} must run from 0 to {ends[name]} without decreasing")
    widths = weight.tile_ptr.diff()
    heights = weight.row_ptr.diff()
    if bool((widths <= 0).any()) or not torch.equal(weight.val_ptr.diff(), widths * heights):
        raise ValueError("every tile needs >= 1 column and a block of rows × columns values")
    up = row_idx[1:] > row_idx[:-1]
    starts = weight.row_ptr[1:-1]
    up[starts[(starts > 0) & (starts < row_idx.numel())] - 1] = True  # across two tiles: any
    if not bool(up.all()):
        raise ValueError("the rows of every tile must be strictly ascending")


@dataclass(frozen=True)
class _SubTiles:
    """Tile ``t`` packed as ``n_sub[t] >= 1`` sub-tiles of at most ``cap`` columns, ``S`` in
    all; per sub-tile ``s``: its tile, its index ``j`` within the tile, and its
    ``tile_meta`` row ``[col_off, width, row_off, height]``."""

    tile: torch.Tensor  # (S,) int64
    j: torch.Tensor  # (S,)
    col_off: torch.Tensor  # (S,)
    width: torch.Tensor  # (S,)
    row_off: torch.Tensor  # (S,)
    height: torch.Tensor  # (S,)

    @property
    def count(self) -> int:
        return int(self.tile.numel())


def _sub_tiles(tile_ptr: torch.Tensor, row_ptr: torch.Tensor, cap: int) -> _SubTiles:
    widths = tile_ptr[1:] - tile_ptr[:-1]
    heights = row_ptr[1:] - row_ptr[:-1]
    T = int(widths.numel())
    dev = tile_ptr.device
    n_sub = ((widths + cap - 1) // cap).clamp(min=1)
    S = int(n_sub.sum()) if T else 0
    tile_of_sub = torch.repeat_interleave(torch.arange(T, device=dev), n_sub, output_size=S)
    first_sub = torch.cumsum(n_sub, 0) - n_sub
    j_sub = torch.arange(S, device=dev) - first_sub[tile_of_sub]  # index within its tile
    height = heights[tile_of_sub]
    return _SubTiles(
        tile=tile_of_sub,
        j=j_sub,
        col_off=tile_ptr[:-1][tile_of_sub] + j_sub * cap,
        width=(widths[tile_of_sub] - j_sub * cap).clamp(min=0, max=cap),
        row_off=torch.cumsum(height, 0) - height,
        height=height,
    )


def pack_weight(
    layout: CondensedWeight,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    max_tile_width: int | None = None,
) -> TWPackedWeight:
    """Pack a condensed TW weight into the kernel's weight arguments.

    A tile wider than ``max_tile_width`` is packed as consecutive sub-tiles of at most that many
    columns (the last one the remainder), each with the tile's kept rows: sub-tile ``j`` of tile
    ``t`` scatters to ``col_idx[tile_ptr[t] + j·w : ...]`` (``col_idx`` is unchanged), gathers
    the same ``row_idx`` entries (repeated once per sub-tile) and holds columns ``j·w ...`` of
    ``B_t``. Every output column is still computed from the same products, exactly as one tile
    computes it, so a layer with tiles wider than the widest kernel instance (``G``) runs on it.
    A tile that keeps no rows gives sub-tiles that keep none (they write 0 or the bias).

    Args:
        layout: the condensed weight (checked here by :func:`check_weight`).
        dtype: element type of ``w`` (default ``layout.values.dtype``).
        device: where the packed tensors live (default the layout's device).
        max_tile_width: the widest (sub-)tile to pack, >= 1 (default: no splitting).

    Returns:
        the packed weight; ``max_tile_width`` is its widest (sub-)tile.

    Raises:
        ValueError: an invalid layout, ``max_tile_width < 1``, or sizes beyond the kernel's
            int32 indices.
    """
    check_weight(layout)
    if max_tile_width is not None and max_tile_width < 1:
        raise ValueError(f"max_tile_width must be >= 1, got {max_tile_width}")
    dev = torch.device(device) if device is not None else layout.values.device
    dtype = dtype or layout.values.dtype
    K, N = layout.in_features, layout.out_features
    tile_ptr = layout.tile_ptr.to(dev)
    row_ptr = layout.row_ptr.to(dev)
    widths = tile_ptr[1:] - tile_ptr[:-1]
    T = int(widths.numel())
    cap = max_tile_width if max_tile_width is not None else max(int(widths.max()) if T else 1, 1)
    sub = _sub_tiles(tile_ptr, row_ptr, cap)
    S = sub.count
    R = int(sub.height.sum()) if S else 0
    V = int(layout.values.numel())
    if max(K, N, R, V, S) > _INT32_MAX:
        raise ValueError(
            f"layout too large for int32 kernel indices: K={K} N={N} R={R} V={V} tiles={S}"
        )
    max_width = int(sub.width.max()) if S else 0
    lda = round_up(max(max_width, 1), ALIGNMENT)
    meta = torch.stack([sub.col_off, sub.width, sub.row_off, sub.height], dim=1)
    row_idx, w = _pack_rows(layout, sub, cap, R, lda, dtype, dev)
    return TWPackedWeight(
        in_features=K,
        out_features=N,
        lda=lda,
        max_tile_width=max_width,
        tile_meta=meta.to(torch.int32).contiguous(),
        col_idx=layout.col_idx.to(device=dev, dtype=torch.int32, copy=True),
        row_idx=row_idx.to(torch.int32).contiguous(),
        w=w.contiguous(),
    )


def _pack_rows(
    layout: CondensedWeight,
    sub: _SubTiles,
    cap: int,
    R: int,
    lda: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_idx (R,) int64, w (R, lda))`` of the packed sub-tiles.

    Packed row r (sub-tile s of tile t, local row k) is row ``row_ptr[t] + k`` of the layout:
    ``row_idx[r] = layout.row_idx[row_ptr[t] + k]`` and ``w[r, c] = B_t[k, j_s·cap + c]`` for
    ``c < width_s``, with ``B_t[k, i] = values[val_ptr[t] + k·width_t + i]``; zeros beyond.
    """
    tile_ptr, row_ptr = layout.tile_ptr.to(dev), layout.row_ptr.to(dev)
    val_ptr = layout.val_ptr.to(dev)
    widths = tile_ptr[1:] - tile_ptr[:-1]
    sub_of_row = torch.repeat_interleave(
        torch.arange(sub.count, device=dev), sub.height, output_size=R
    )
    tile_of_row = sub.tile[sub_of_row]
    local = torch.arange(R, device=dev) - sub.row_off[sub_of_row]
    row_idx = layout.row_idx.to(dev)[row_ptr[:-1][tile_of_row] + local]
    c = torch.arange(lda, device=dev)
    base = val_ptr[:-1][tile_of_row] + sub.j[sub_of_row] * cap + local * widths[tile_of_row]
    src = base.unsqueeze(1) + c.unsqueeze(0)
    valid = c.unsqueeze(0) < sub.width[sub_of_row].unsqueeze(1)
    vals = layout.values.to(device=dev, dtype=dtype)
    V = int(vals.numel())
    if V:
        w = torch.where(valid, vals[src.clamp(max=V - 1)], torch.zeros((), dtype=dtype, device=dev))
    else:
        w = torch.zeros(R, lda, dtype=dtype, device=dev)
    return row_idx, w
