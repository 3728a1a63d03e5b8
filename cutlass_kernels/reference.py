"""Host side of the TW GEMM: the packing of every argument the kernel reads, and a CPU
emulation that computes the result from exactly those packed arguments.

The kernel (``csrc/tw_gemm.h``, argument layout drawn in ``emit.py``) reads, per launch::

    tile_meta  (T, 4) int32    per tile t: col_off, ncols, row_off, nrows
    col_idx    (Nk,)  int32    scatter indices: kept output columns, tile after tile
    row_idx    (R,)   int32    gather indices: each tile's kept K rows, tile after tile
    w          (R, lda)        packed blocks: row row_off+k of tile t holds B_t[k, :ncols]
                               then zeros up to lda (a multiple of ALIGNMENT >= widest tile)
    xt         (K, ldx)        activations K-major (X^T), batch padded to a multiple of ALIGNMENT
    yt         (N, ldy)        output K-major (Y^T); rows of pruned columns are never written,
                               so they keep their initial value: 0, or the bias (with beta = 1)

Worked example (K=4, N=6, G=2, the format's example; M=3 batch rows, padded to batch=8)::

    tile_meta = [[0, 2, 0, 3],      col_idx = [0, 1, 4, 5]
                 [2, 1, 3, 2],      row_idx = [0, 2, 3, 0, 1, 1, 2]
                 [3, 1, 5, 2]]      lda = 8, w = (7, 8): w[0] = [W00 W01 0 0 0 0 0 0], ...
    xt = (4, 8): xt[k, m] = X[m, k] for m < 3, zero for the padding columns 3..7
    yt = (6, 8): zeros (no bias, beta=0) or bias[n] in every column (beta=1)

For each CTA (t, b) the kernel computes, in fp32::

    A = w[row_off : row_off+nrows, :ncols].T                      (ncols, nrows)
    B = xt[row_idx[row_off : row_off+nrows], b·bn : (b+1)·bn]       (nrows, bn)   gathered
    yt[col_idx[col_off : col_off+ncols], b·bn : (b+1)·bn] = alpha·A·B + beta·yt[...]  scattered

A tile wider than the kernel's ``G`` is packed as several sub-tiles (``pack_weight(...,
max_tile_width=G)``): consecutive column ranges of the tile, each with its own ``tile_meta`` row
and its own copy of the tile's kept rows in ``row_idx`` and ``w``; ``col_idx`` is unchanged.

:func:`emulate` does the same arithmetic through the same flat buffers, offsets and pitches
(``as_strided`` views), after the same argument checks as the binding and the launchers
(:func:`check_launch`), so a packing bug or a pitch the kernel refuses shows up here on a
machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cutlass_kernels.epilogue import Activation, apply_epilogue
from cutlass_kernels.manifest import ALIGNMENT

__all__ = [
    "CondensedWeight",
    "TWPackedWeight",
    "TWLaunch",
    "check_weight",
    "pack_weight",
    "pack_launch",
    "emulate",
    "check_launch",
    "unpack_output",
    "tw_linear_emulated",
    "round_up",
]

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


@dataclass(frozen=True)
class TWLaunch:
    """Every argument of one kernel launch (mirrors ``tilerec::TwGemmArgs``).

    Attributes:
        weight: the packed weight.
        xt: ``(K, ldx)`` K-major activations; ``ldx = xt.stride(0)``.
        yt: ``(N, ldy)`` K-major output, initialised; ``ldy = yt.stride(0)``.
        batch: padded batch the kernel covers (multiple of ``ALIGNMENT``).
        rows: real batch rows ``M`` (<= batch).
        alpha, beta: epilogue ``D = alpha·acc + beta·C``.
        bias: optional ``(N,)`` added to every written row in the epilogue (fp32, before the
            activation): ``D = act(alpha·acc + beta·C + bias[n])``
            (:mod:`cutlass_kernels.epilogue`); rows of pruned columns are never written.
        activation: applied in the epilogue before the one rounding.
    """

    weight: TWPackedWeight
    xt: torch.Tensor
    yt: torch.Tensor
    batch: int
    rows: int
    alpha: float
    beta: float
    bias: torch.Tensor | None = None
    activation: Activation = Activation.NONE

    @property
    def ldx(self) -> int:
        return int(self.xt.stride(0))

    @property
    def ldy(self) -> int:
        return int(self.yt.stride(0))

    def grid(self, batch_tile: int) -> tuple[int, int]:
        """The kernel's grid: ``(T, ceil(batch / batch_tile))``."""
        return self.weight.num_tiles, -(-self.batch // batch_tile)


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


def pack_launch(
    x2: torch.Tensor, weight: TWPackedWeight, bias: torch.Tensor | None = None
) -> TWLaunch:
    """Pack one call's activations and output buffer.

    Args:
        x2: ``(M, K)`` activations (row-major, as a layer receives them).
        weight: the packed weight (same dtype and device as ``x2``).
        bias: optional ``(N,)``; written into every column of ``yt`` and added with beta = 1.

    Returns:
        the launch: ``xt (K, batch)`` = ``X^T`` zero padded to ``batch = round_up(M,
        ALIGNMENT)`` columns, ``yt (N, batch)`` initialised to zeros (beta 0) or the bias.

    Raises:
        ValueError: for a shape, dtype or device that does not match the weight.
    """
    if x2.dim() != 2 or x2.shape[1] != weight.in_features:
        raise ValueError(f"x must be (M, {weight.in_features}), got {tuple(x2.shape)}")
    if x2.dtype != weight.dtype or x2.device != weight.device:
        raise ValueError(
            f"x is {x2.dtype} on {x2.device} but the packed weight is {weight.dtype} on {weight.device}"
        )
    M, K = x2.shape
    N = weight.out_features
    if M > _INT32_MAX:
        raise ValueError(f"batch of {M} rows exceeds the kernel's int32 batch")
    batch = round_up(M, ALIGNMENT)
    # Fresh (K, batch) / (N, batch) buffers: their row pitch is always `batch`. (x2.t().contiguous()
    # is not: for K = 1 the (1, M) transpose already counts as contiguous, with stride (1, 1),
    # and would reach the kernel as is, with ldx = 1.)
    xt = x2.new_empty((K, batch)) if batch == M else x2.new_zeros((K, batch))
    xt[:, :M] = x2.t()
    if bias is None:
        yt = x2.new_zeros((N, batch))
        beta = 0.0
    else:
        if bias.shape != (N,):
            raise ValueError(f"bias must be ({N},), got {tuple(bias.shape)}")
        yt = x2.new_empty((N, batch))
        yt.copy_(bias.to(device=x2.device, dtype=x2.dtype).unsqueeze(1).expand(N, batch))
        beta = 1.0
    return TWLaunch(weight, xt, yt, batch, M, 1.0, beta)


def _operand_problem(
    t: torch.Tensor, name: str, dtype: torch.dtype, dim: int, device: torch.device
) -> str | None:
    """``check_operand`` of ``csrc/tw_binding.cpp`` (the dtype is the launch's, not an instance's)."""
    if t.device != device:
        return f"{name} must be on {device}, got {t.device}"
    if t.dtype != dtype:
        return f"{name} must be {dtype}, got {t.dtype}"
    if t.dim() != dim:
        return f"{name} must be {dim}-D, got {t.dim()}-D"
    if not (t.dim() == 0 or t.stride(-1) == 1 or t.size(-1) <= 1):
        return f"{name} must have unit stride in its last dimension"
    if t.data_ptr() % 16:
        return f"{name} must be 16-byte aligned"
    return None


def _bad_shape(batch: int, lda: int, ldx: int, ldy: int, align: int) -> bool:
    """The launchers' ``kTwBadShape`` condition, term for term (``tw_gemm_launch``,
    ``tw_gemm_sm90_launch``; a test compares it with the headers' text)."""
    return bool(
        batch % align
        or ldx % align
        or ldy % align
        or lda % align
        or ldx < batch
        or ldy < batch
        or lda < 1
    )


def check_launch(
    launch: TWLaunch, batch_tile: int | None = None, alignment: int = ALIGNMENT
) -> bool:
    """Refuse a launch the kernel would refuse, with the checks of ``csrc/tw_binding.cpp``
    (``tw_gemm``) and of the launchers (``tw_gemm_launch`` in ``tw_gemm.h``,
    ``tw_gemm_sm90_launch`` in ``tw_gemm_sm90.h``), in their order and on the same values:
    the binding passes ``ldx = xt.stride(0)``, ``ldy = yt.stride(0)``.

    Args:
        launch: the packed arguments.
        batch_tile: the instance's batch columns per CTA, for the grid-size check (default:
            not checked).
        alignment: the instance's elements per vector access (``ALIGNMENT`` for every one).

    Returns:
        False when the launcher returns without launching (no tiles or an empty batch: nothing
        to compute), True when the kernel would run.

    Raises:
        ValueError: what the binding's ``TORCH_CHECK`` would raise (``kTwBadShape``: batch,
            lda, ldx, ldy not multiples of ``alignment``, ldx or ldy < batch, lda < 1;
            ``kTwTooManyBlocks``: more than 65535 batch blocks).
    """
    pw = launch.weight
    dev, dt = launch.xt.device, pw.w.dtype
    problem = (
        _operand_problem(pw.tile_meta, "tile_meta", torch.int32, 2, dev)
        or _operand_problem(pw.col_idx, "col_idx", torch.int32, 1, dev)
        or _operand_problem(pw.row_idx, "row_idx", torch.int32, 1, dev)
        or _operand_problem(pw.w, "w", dt, 2, dev)
        or _operand_problem(launch.xt, "xt", dt, 2, dev)
        or _operand_problem(launch.yt, "yt", dt, 2, dev)
    )
    if problem is None and launch.bias is not None:
        problem = _operand_problem(launch.bias, "bias", dt, 1, dev)
        if problem is None and launch.bias.numel() != pw.out_features:
            problem = f"bias must be ({pw.out_features},), got {tuple(launch.bias.shape)}"
    if problem:
        raise ValueError(problem)
    if pw.tile_meta.size(1) != 4 or not pw.tile_meta.is_contiguous():
        raise ValueError("tile_meta must be a contiguous (T, 4) int32 tensor")
    if not (pw.w.size(0) == 0 or pw.w.stride(0) == pw.lda):
        raise ValueError(f"w must have row pitch lda={pw.lda}")
    batch, lda, ldx, ldy = launch.batch, pw.lda, launch.ldx, launch.ldy
    if not (launch.xt.size(1) >= batch and launch.yt.size(1) >= batch):
        raise ValueError(f"xt and yt must hold batch={batch} columns")
    if not 0 <= batch <= 1 << 30:
        raise ValueError(f"batch must be in [0, 2^30], got {batch}")
    if pw.num_tiles <= 0 or batch <= 0:
        return False  # kTwOk: nothing to compute (every column pruned, or an empty batch)
    if _bad_shape(batch, lda, ldx, ldy, alignment):
        raise ValueError(
            f"TW GEMM: batch, lda, ldx, ldy must be multiples of {alignment} and ldx, ldy >= batch "
            f"(got batch={batch} lda={lda} ldx={ldx} ldy={ldy})"
        )
    if batch_tile is not None and -(-batch // batch_tile) > 65535:
        raise ValueError(f"TW GEMM: batch {batch} needs more than 65535 batch blocks")
    return True


def emulate(
    launch: TWLaunch, tile_m: int | None = None, batch_tile: int | None = None
) -> torch.Tensor:
    """Compute ``launch.yt`` in place, as the kernel does, from the packed buffers.

    The launch is first checked as the binding and the launcher check it
    (:func:`check_launch`): a packing the kernel would refuse raises here too. Each tile reads
    its block at ``w + row_off·lda`` with pitch ``lda``, gathers its rows of ``xt`` through
    ``row_idx`` and scatters its result rows through ``col_idx``; products are accumulated in
    fp32 and rounded once to the output dtype, as the epilogue does. CTAs along the batch are
    independent, so all batch blocks of a tile are computed at once.

    Args:
        launch: the packed arguments.
        tile_m: the instance's ``G``; a tile wider than it raises, as the kernel would drop
            its columns beyond ``G`` (default: no check).
        batch_tile: the instance's batch tile, for :func:`check_launch`'s grid check.

    Returns:
        ``launch.yt``.

    Raises:
        ValueError: a tile wider than ``tile_m``, or a launch :func:`check_launch` refuses.
    """
    pw = launch.weight
    if tile_m is not None and pw.max_tile_width > tile_m:
        raise ValueError(
            f"a tile is {pw.max_tile_width} columns wide but the kernel covers G={tile_m}"
        )
    if not check_launch(launch, batch_tile):
        return launch.yt  # the launcher returns before launching: yt untouched
    K, N, lda = pw.in_features, pw.out_features, pw.lda
    acc_t = torch.float64 if launch.yt.dtype == torch.float64 else torch.float32
    w_flat = pw.w.reshape(-1)
    xt = launch.xt.as_strided((K, launch.batch), (launch.ldx, 1))
    yt = launch.yt.as_strided((N, launch.batch), (launch.ldy, 1))
    for col_off, ncols, row_off, nrows in pw.tile_meta.tolist():
        # A'(m, k) = w[(row_off + k) * lda + m]: column-major (ncols, nrows), pitch lda.
        a = w_flat.as_strided((ncols, nrows), (1, lda), row_off * lda)
        gather = pw.row_idx[row_off : row_off + nrows].long()
        scatter = pw.col_idx[col_off : col_off + ncols].long()
        acc = a.to(acc_t) @ xt[gather].to(acc_t)  # (ncols, batch)
        d = launch.alpha * acc
        if launch.beta != 0.0:  # the epilogue reads C only when beta != 0
            d = d + launch.beta * yt[scatter].to(acc_t)
        bias = launch.bias[scatter] if launch.bias is not None else None
        yt[scatter] = apply_epilogue(d, bias, launch.activation).to(yt.dtype)
    return launch.yt


def unpack_output(launch: TWLaunch) -> torch.Tensor:
    """``(M, N)`` row-major ``Y`` from the K-major ``yt``."""
    return launch.yt[:, : launch.rows].t().contiguous()


def tw_linear_emulated(
    x: torch.Tensor, layout: CondensedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``Y = X · W + b`` through pack → emulate → unpack (any dtype, any device).

    Args:
        x: ``(..., K)``.
        layout: the condensed weight.
        bias: optional ``(N,)``.

    Returns:
        ``(..., N)`` in ``x.dtype``.
    """
    if x.shape[-1] != layout.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {layout.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, layout.in_features)
    pw = pack_weight(layout, dtype=x.dtype, device=x.device)
    launch = pack_launch(x2, pw, bias)
    emulate(launch)
    return unpack_output(launch).reshape(*lead, layout.out_features)
