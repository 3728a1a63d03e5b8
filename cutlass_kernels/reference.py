"""Host side of the TW GEMM: one call's arguments (the weight's are packed by
:mod:`cutlass_kernels.packing`), and a CPU emulation that computes the result from exactly
those packed arguments, epilogue included (:mod:`cutlass_kernels.epilogue`).

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

from dataclasses import dataclass

import torch

from cutlass_kernels.epilogue import ACTIVATION_CODE, Activation, apply_epilogue
from cutlass_kernels.manifest import ALIGNMENT
from cutlass_kernels.packing import (
    _INT32_MAX,
    CondensedWeight,
    TWPackedWeight,
    check_weight,
    pack_weight,
    round_up,
)

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


@dataclass(frozen=True)
class TWLaunch:
    """Every argument of one kernel launch (mirrors ``tilerec::TwGemmArgs``).

    Attributes:
        weight: the packed weight.
        xt: ``(K, ldx)`` K-major activations; ``ldx = xt.stride(0)``.
        yt: ``(N, ldy)`` K-major output, initialised; ``ldy = yt.stride(0)``.
        batch: padded batch the kernel covers (multiple of ``ALIGNMENT``).
        rows: real batch rows ``M`` (<= batch).
        alpha, beta: epilogue ``D = act(alpha·acc + beta·C)``.
        bias: optional ``(N,)`` added to every written row in the epilogue (fp32, before the
            activation): ``D = act(acc + bias[n])``, only with ``alpha = 1``, ``beta = 0``
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
        if problem is None and launch.bias.numel() != launch.yt.size(0):
            problem = f"bias must be ({launch.yt.size(0)},), got {tuple(launch.bias.shape)}"
        if problem is None and (launch.alpha != 1.0 or launch.beta != 0.0):
            problem = (
                "a launch with a bias needs alpha = 1 and beta = 0, got "
                f"alpha={launch.alpha} beta={launch.beta}"
            )
    if problem is None and launch.activation not in ACTIVATION_CODE:
        problem = (
            f"activation must be one of {[a.value for a in Activation]}, got {launch.activation!r}"
        )
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
    fp32, the epilogue's bias and activation applied in fp32 (:mod:`cutlass_kernels.epilogue`,
    op for op as the kernel) and the result rounded once to the output dtype. CTAs along the batch are
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
