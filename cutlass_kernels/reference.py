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

:func:`emulate` does the same arithmetic through the same flat buffers, offsets and pitches
(``as_strided`` views), so a packing bug shows up here on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cutlass_kernels.manifest import ALIGNMENT
from tilesparse.format import TWLayout

__all__ = [
    "TWPackedWeight",
    "TWLaunch",
    "pack_weight",
    "pack_launch",
    "emulate",
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
            self.in_features, self.out_features, self.lda, self.max_tile_width,
            self.tile_meta.to(device), self.col_idx.to(device), self.row_idx.to(device),
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
    """

    weight: TWPackedWeight
    xt: torch.Tensor
    yt: torch.Tensor
    batch: int
    rows: int
    alpha: float
    beta: float

    @property
    def ldx(self) -> int:
        return int(self.xt.stride(0))

    @property
    def ldy(self) -> int:
        return int(self.yt.stride(0))

    def grid(self, batch_tile: int) -> tuple[int, int]:
        """The kernel's grid: ``(T, ceil(batch / batch_tile))``."""
        return self.weight.num_tiles, -(-self.batch // batch_tile)


def pack_weight(
    layout: TWLayout, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> TWPackedWeight:
    """Pack a condensed TW weight into the kernel's weight arguments.

    Args:
        layout: the condensed weight (validated here).
        dtype: element type of ``w`` (default ``layout.values.dtype``).
        device: where the packed tensors live (default the layout's device).

    Returns:
        the packed weight.

    Raises:
        ValueError: an invalid layout, or sizes beyond the kernel's int32 indices.
    """
    layout.validate()
    dev = torch.device(device) if device is not None else layout.values.device
    dtype = dtype or layout.values.dtype
    K, N = layout.in_features, layout.out_features
    R, V = int(layout.row_idx.numel()), int(layout.values.numel())
    if max(K, N, R, V) > _INT32_MAX:
        raise ValueError(f"layout too large for int32 kernel indices: K={K} N={N} R={R} V={V}")
    tile_ptr = layout.tile_ptr.to(dev)
    row_ptr = layout.row_ptr.to(dev)
    val_ptr = layout.val_ptr.to(dev)
    widths = tile_ptr[1:] - tile_ptr[:-1]
    heights = row_ptr[1:] - row_ptr[:-1]
    T = int(widths.numel())
    max_width = int(widths.max()) if T else 0
    lda = round_up(max(max_width, 1), ALIGNMENT)
    meta = torch.stack([tile_ptr[:-1], widths, row_ptr[:-1], heights], dim=1).to(torch.int32)
    # w[r, j] = values[val_ptr[t] + (r - row_ptr[t]) * width_t + j] for j < width_t, else 0.
    tile_of_row = torch.repeat_interleave(torch.arange(T, device=dev), heights, output_size=R)
    local = torch.arange(R, device=dev) - row_ptr[:-1][tile_of_row]
    j = torch.arange(lda, device=dev)
    width_r = widths[tile_of_row].unsqueeze(1)
    src = val_ptr[:-1][tile_of_row].unsqueeze(1) + local.unsqueeze(1) * width_r + j.unsqueeze(0)
    valid = j.unsqueeze(0) < width_r
    vals = layout.values.to(device=dev, dtype=dtype)
    if V:
        w = torch.where(valid, vals[src.clamp(max=V - 1)], torch.zeros((), dtype=dtype, device=dev))
    else:
        w = torch.zeros(R, lda, dtype=dtype, device=dev)
    return TWPackedWeight(
        in_features=K,
        out_features=N,
        lda=lda,
        max_tile_width=max_width,
        tile_meta=meta.contiguous(),
        col_idx=layout.col_idx.to(device=dev, dtype=torch.int32),
        row_idx=layout.row_idx.to(device=dev, dtype=torch.int32),
        w=w.contiguous(),
    )


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
    if batch == M:
        xt = x2.t().contiguous()
    else:
        xt = x2.new_zeros(K, batch)
        xt[:, :M] = x2.t()
    if bias is None:
        yt = x2.new_zeros(N, batch)
        beta = 0.0
    else:
        if bias.shape != (N,):
            raise ValueError(f"bias must be ({N},), got {tuple(bias.shape)}")
        yt = bias.to(device=x2.device, dtype=x2.dtype).unsqueeze(1).expand(N, batch).contiguous()
        beta = 1.0
    return TWLaunch(weight, xt, yt, batch, M, 1.0, beta)


def emulate(launch: TWLaunch, tile_m: int | None = None) -> torch.Tensor:
    """Compute ``launch.yt`` in place, as the kernel does, from the packed buffers.

    Each tile reads its block at ``w + row_off·lda`` with pitch ``lda``, gathers its rows of
    ``xt`` through ``row_idx`` and scatters its result rows through ``col_idx``; products are
    accumulated in fp32 and rounded once to the output dtype, as the epilogue does. CTAs along
    the batch are independent, so all batch blocks of a tile are computed at once.

    Args:
        launch: the packed arguments.
        tile_m: the instance's ``G``; a tile wider than it raises, as the kernel would drop
            its columns beyond ``G`` (default: no check).

    Returns:
        ``launch.yt``.
    """
    pw = launch.weight
    if tile_m is not None and pw.max_tile_width > tile_m:
        raise ValueError(f"a tile is {pw.max_tile_width} columns wide but the kernel covers G={tile_m}")
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
        yt[scatter] = d.to(yt.dtype)
    return launch.yt


def unpack_output(launch: TWLaunch) -> torch.Tensor:
    """``(M, N)`` row-major ``Y`` from the K-major ``yt``."""
    return launch.yt[:, : launch.rows].t().contiguous()


def tw_linear_emulated(
    x: torch.Tensor, layout: TWLayout, bias: torch.Tensor | None = None
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
