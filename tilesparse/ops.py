"""Execution of the condensed TW format: the ``tilesparse::tw_linear`` custom op.

``tw_linear(x, layout, bias, backend)`` computes ``Y = X · W + b`` for a condensed weight
(:class:`~tilesparse.format.TWLayout`, drawn in ``tilesparse/format.py``). It is built on one
``torch.library.custom_op`` with a FIXED schema, shared with the CUDA kernel that
``cutlass_kernels`` registers for the same op::

    tilesparse::tw_linear(Tensor x, Tensor col_idx, Tensor tile_ptr, Tensor row_idx,
                          Tensor row_ptr, Tensor values, Tensor val_ptr, Tensor? bias,
                          int out_features, str backend) -> Tensor

``x`` is ``(M, K)`` contiguous; the result ``(M, N)`` has ``x``'s dtype. The op has a fake
(meta) kernel, so ``torch.export`` and ``torch.compile`` trace through it, and an autograd
formula for ``x`` and ``bias`` (the condensed ``values`` are buffers, not trained).

Backends (:class:`~tilesparse.backend.Backend`): ``auto``, ``reference``, ``cpu``,
``cutlass``, ``emulated``. The CPU kernel (``tilesparse/csrc/``) transposes each block of
``X`` rows to K-major so that a tile's kept rows are contiguous vectors. fp32: a
register-blocked micro-kernel reads them through the tile's row list — AVX-512 (12 × 32)
where the CPU has it, else AVX2 + FMA (6 × 16), else scalar C (``ext.simd()`` says which).
bf16 on a CPU with AMX: the tile's kept rows are interleaved into VNNI pairs and multiplied on
the AMX tile unit (fp32 accumulation). bf16 on a CPU with AVX512-BF16 and no AMX (AMD Zen 4/5,
Intel Cooper Lake): the same pairs, multiplied by ``VDPBF16PS`` in a 6-column × 64-row
register-blocked micro-kernel (``TILESPARSE_DISABLE_AVX512BF16=1`` turns it off). Both flush
subnormal inputs, products and results to zero (the instructions do; so does oneDNN's bf16
GEMM there); the other routes keep them. bf16/fp16 on
a CPU without native 16-bit GEMM instructions (no AVX512-BF16 / AVX512-FP16, e.g. AVX2-only
machines; ``ext.lowp_via_fp32``, forced by ``TILESPARSE_LOWP_FP32``): widened to fp32, run on
the fp32 kernel, rounded back. Otherwise (fp16; bf16 with those kernels off or not built) and
fp64 always: ``at::mm`` on gathered panels (``addmm`` with the bias: every route rounds
product + bias once).
``ext.bf16_kernel()`` names the kernel a bf16 call takes.

Every real implementation starts with :func:`check_op_inputs`: a layout whose offsets or
indices would make the C++ (or CUDA) kernel read out of bounds or write one column twice is
rejected with a ``ValueError`` before any kernel runs (the check is cached per index set).
The CUDA kernel is registered lazily: the first CUDA tensor that reaches :func:`tw_linear`
calls ``cutlass_kernels.build.register_cuda_kernel()``.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import Any

import torch

from tilesparse.backend import Backend, parse_backend
from tilesparse.build_ext import load_extension
from tilesparse.format import (
    TWLayout,
    _first_not_ascending,
    _first_tile_with_unsorted_rows,
    _pointer_problem,
    reference_matmul,
)

__all__ = ["OP_NAME", "SUPPORTED_DTYPES", "check_op_inputs", "cpu_kernel_available", "tw_linear"]

log = logging.getLogger(__name__)

OP_NAME = "tilesparse::tw_linear"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_NAMES = ("col_idx", "tile_ptr", "row_idx", "row_ptr", "val_ptr")


def cpu_kernel_available() -> bool:
    """Whether the compiled CPU kernel is loaded (building it on first call if needed)."""
    return load_extension() is not None


def _check_args(
    x: torch.Tensor,
    index: dict[str, torch.Tensor],
    values: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> None:
    """Shape/dtype checks that need no data (shared by the real and the fake kernel)."""
    if x.dim() != 2:
        raise ValueError(f"tilesparse::tw_linear takes x of shape (M, K), got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"tw_linear: x has dtype {x.dtype}; expected one of {names}")
    if values.dtype != x.dtype:
        raise ValueError(
            f"tw_linear: x has dtype {x.dtype} but the layer's values are {values.dtype}; "
            f"cast one to the other (e.g. module.to({x.dtype}))"
        )
    if values.dim() != 1:
        raise ValueError(f"tw_linear: values must be 1-D, got shape {tuple(values.shape)}")
    for name, t in index.items():
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(
                f"tw_linear: {name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    n_ptr = index["tile_ptr"].shape[0]
    if n_ptr < 1 or index["row_ptr"].shape[0] != n_ptr or index["val_ptr"].shape[0] != n_ptr:
        raise ValueError(
            "tw_linear: tile_ptr, row_ptr and val_ptr must have T+1 >= 1 entries each, got "
            f"{index['tile_ptr'].shape[0]}, {index['row_ptr'].shape[0]}, {index['val_ptr'].shape[0]}"
        )
    if out_features < 0:
        raise ValueError(f"tw_linear: out_features must be >= 0, got {out_features}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"tw_linear: bias must have shape ({out_features},), got {tuple(bias.shape)}"
        )
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(
            f"tw_linear: bias has dtype {bias.dtype} but x has {x.dtype}; cast one to the other "
            f"(e.g. module.to({x.dtype}))"
        )


def _check_data(
    K: int,
    N: int,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
) -> None:
    """Checks that read index values (real kernels only): a bad layout must not reach the C++
    kernel, which trusts every offset and index (it would read or write out of bounds, or
    give wrong columns). The tensors passed :func:`_check_args`."""
    for name, ptr in (("tile_ptr", tile_ptr), ("row_ptr", row_ptr), ("val_ptr", val_ptr)):
        problem = _pointer_problem(name, ptr)
        if problem:
            raise ValueError(f"tw_linear: {problem}")
    nk, R = col_idx.numel(), row_idx.numel()
    if int(tile_ptr[-1]) != nk or int(row_ptr[-1]) != R:
        raise ValueError(
            f"tw_linear: tile_ptr/row_ptr must end at len(col_idx)={nk}/len(row_idx)={R}, got "
            f"{int(tile_ptr[-1])}/{int(row_ptr[-1])}"
        )
    if int(val_ptr[-1]) != values.numel():
        raise ValueError(
            f"tw_linear: val_ptr ends at {int(val_ptr[-1])} but values has {values.numel()} entries"
        )
    if R and (int(row_idx.min()) < 0 or int(row_idx.max()) >= K):
        raise ValueError(f"tw_linear: row_idx must lie in [0, K={K}); x has K={K} features")
    if nk and (int(col_idx.min()) < 0 or int(col_idx.max()) >= N):
        raise ValueError(f"tw_linear: col_idx must lie in [0, out_features={N})")
    bad = _first_not_ascending(col_idx)
    if bad is not None:
        raise ValueError(
            f"tw_linear: col_idx must be strictly ascending (one tile per column), but "
            f"col_idx[{bad + 1}]={int(col_idx[bad + 1])} follows col_idx[{bad}]={int(col_idx[bad])}"
        )
    widths = tile_ptr[1:] - tile_ptr[:-1]
    heights = row_ptr[1:] - row_ptr[:-1]
    if bool((widths <= 0).any()) or not torch.equal(val_ptr[1:] - val_ptr[:-1], widths * heights):
        raise ValueError(
            "tw_linear: every tile needs >= 1 column and val_ptr blocks of rows × columns"
        )
    t = _first_tile_with_unsorted_rows(row_idx, row_ptr)
    if t is not None:
        rows = row_idx[int(row_ptr[t]) : int(row_ptr[t + 1])].tolist()
        raise ValueError(f"tw_linear: tile {t} rows must be strictly ascending, got {rows}")


# Index sets that passed _check_data, by id() of their col_idx tensor: the check costs a few
# dozen small tensor ops with host syncs (~170 us for a 1024x1024 layer at G=128, one thread
# of an AMD EPYC; more than the kernel at small M), and a layer's indices do not change
# between calls. A record holds weak references to the five index tensors (a new tensor is
# not the old one, whatever its id), their versions (in-place edits bump them) and
# len(values), K, N; anything different is checked again. Entries leave with their col_idx.
_VALIDATED: dict[int, tuple[Any, ...]] = {}


def _check_data_once(K: int, N: int, tensors: tuple[torch.Tensor, ...]) -> None:
    """:func:`_check_data` unless this exact index set was checked already (see _VALIDATED).

    Args:
        K, N: in- and out-features.
        tensors: ``(col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)``.
    """
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    index = (col_idx, tile_ptr, row_idx, row_ptr, val_ptr)
    try:
        stamp = (*(t._version for t in index), values.numel(), K, N)
    except RuntimeError:  # inference-mode tensors have no version counter: always check
        stamp = None
    key = id(col_idx)
    if stamp is not None:
        rec = _VALIDATED.get(key)
        if rec is not None and rec[0] == stamp and all(r() is t for r, t in zip(rec[1], index)):
            return
    _check_data(K, N, *tensors)
    if stamp is not None:
        refs = (
            weakref.ref(col_idx, lambda _r, k=key: _VALIDATED.pop(k, None)),
            *(weakref.ref(t) for t in index[1:]),
        )
        _VALIDATED[key] = (stamp, refs)


def check_op_inputs(
    x: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    backend: Backend | str,
) -> Backend:
    """Every check a real implementation of ``tilesparse::tw_linear`` runs before it touches
    the data (this module's CPU/reference implementation and the CUDA one that
    ``cutlass_kernels.build`` registers both start here).

    Args:
        x: ``(M, K)`` contiguous activations; the rest as in the op schema (module docstring).

    Returns:
        the parsed backend.

    Raises:
        ValueError: bad shapes or dtypes, a non-contiguous ``x``, an unknown backend or one
            that cannot run on ``x``'s device (``cpu`` off the CPU, ``cutlass`` off CUDA), or
            an index set that is not a valid layout for ``K = x.shape[1]``, ``N = out_features``.
    """
    index = dict(zip(_INDEX_NAMES, (col_idx, tile_ptr, row_idx, row_ptr, val_ptr)))
    _check_args(x, index, values, bias, out_features)
    if not x.is_contiguous():
        raise ValueError(
            f"tilesparse::tw_linear needs a contiguous x, got strides {x.stride()} for shape "
            f"{tuple(x.shape)}; call x.contiguous() (tilesparse.ops.tw_linear does)"
        )
    be = parse_backend(backend)
    if be is Backend.CPU and x.device.type != "cpu":
        raise ValueError(f"backend 'cpu' runs on CPU tensors, got a {x.device.type} tensor")
    if be is Backend.CUTLASS and x.device.type != "cuda":
        raise ValueError(
            f"backend 'cutlass' runs on CUDA tensors with the kernel from cutlass_kernels; got a "
            f"{x.device.type} tensor"
        )
    _check_data_once(
        x.shape[1], out_features, (col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    )
    return be


def _layout(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, out_features) -> TWLayout:
    widths = tile_ptr[1:] - tile_ptr[:-1]
    tile = int(widths.max()) if widths.numel() else 1
    return TWLayout(
        x.shape[1], out_features, max(tile, 1), col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr
    )


@torch.library.custom_op(OP_NAME, mutates_args=())
def _tw_linear_op(
    x: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    backend: str,
) -> torch.Tensor:
    be = check_op_inputs(
        x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features, backend
    )

    def layout() -> TWLayout:  # built only where a path needs it (the compiled kernel does not)
        return _layout(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, out_features)

    if be is Backend.EMULATED:
        try:
            from cutlass_kernels.reference import tw_linear_emulated
        except ImportError as e:
            raise ValueError(f"backend 'emulated' needs cutlass_kernels.reference ({e})") from e
        return tw_linear_emulated(x, layout(), bias)
    if be is Backend.CUTLASS:  # a CUDA tensor (check_op_inputs), but no CUDA kernel took it
        raise ValueError(
            "backend 'cutlass' needs the CUDA kernel from cutlass_kernels, and none is "
            "registered (see cutlass_kernels.build.register_cuda_kernel)"
        )
    if x.device.type == "cpu" and be in (Backend.AUTO, Backend.CPU):
        ext = load_extension()  # None after one logged warning: then the reference runs
        if ext is not None:
            vals = values if values.is_contiguous() else values.contiguous()
            return ext.tw_linear_cpu(
                x, col_idx, tile_ptr, row_idx, row_ptr, vals, val_ptr, bias, out_features
            )
    return reference_matmul(x, layout(), bias)


@_tw_linear_op.register_fake
def _tw_linear_fake(
    x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features, backend
):
    index = dict(zip(_INDEX_NAMES, (col_idx, tile_ptr, row_idx, row_ptr, val_ptr)))
    _check_args(x, index, values, bias, out_features)
    parse_backend(backend)
    return x.new_empty((x.shape[0], out_features))


def _setup_context(ctx, inputs, output) -> None:
    x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features, _ = inputs
    ctx.save_for_backward(col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    ctx.in_features = x.shape[1]
    ctx.has_bias = bias is not None


@torch.library.custom_op("tilesparse::tw_linear_grad_x", mutates_args=())
def _tw_linear_grad_x(
    grad_y: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    in_features: int,
) -> torch.Tensor:
    """``dX (M, K)``: ``dX[:, rows_t] += dY[:, cols_t] · B_tᵀ`` for every tile."""
    grad_x = grad_y.new_zeros(grad_y.shape[0], in_features)
    tp, rp, vp = tile_ptr.tolist(), row_ptr.tolist(), val_ptr.tolist()
    vals = values.to(grad_y.dtype)
    for t in range(len(tp) - 1):
        r = rp[t + 1] - rp[t]
        if r == 0:
            continue
        cols, rows = col_idx[tp[t] : tp[t + 1]], row_idx[rp[t] : rp[t + 1]]
        block = vals[vp[t] : vp[t + 1]].view(r, tp[t + 1] - tp[t])
        grad_x.index_add_(1, rows, grad_y[:, cols] @ block.T)
    return grad_x


@_tw_linear_grad_x.register_fake
def _tw_linear_grad_x_fake(
    grad_y, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, in_features
):
    return grad_y.new_empty((grad_y.shape[0], in_features))


def _grad_x_setup_context(ctx, inputs, output) -> None:
    grad_y, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, _ = inputs
    ctx.save_for_backward(col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    ctx.out_features = grad_y.shape[1]


def _grad_x_backward(ctx, grad_grad_x: torch.Tensor):
    """``dX = dY · Wᵀ`` is linear in ``dY``, so its gradient is ``ddX · W``: the forward op
    again (what double backward, e.g. a gradient penalty, needs)."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = ctx.saved_tensors
    grad_grad_y = torch.ops.tilesparse.tw_linear(
        grad_grad_x.contiguous(),
        col_idx,
        tile_ptr,
        row_idx,
        row_ptr,
        values.to(grad_grad_x.dtype),
        val_ptr,
        None,
        ctx.out_features,
        Backend.AUTO.value,
    )
    return grad_grad_y, None, None, None, None, None, None, None


_tw_linear_grad_x.register_autograd(_grad_x_backward, setup_context=_grad_x_setup_context)


def _backward(ctx, grad_y: torch.Tensor):
    """Gradients for ``x`` and ``bias``; ``values`` get none (they are buffers: fine-tune a
    pruned model before condensing it)."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = ctx.saved_tensors
    grad_x = _tw_linear_grad_x(
        grad_y.contiguous(), col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, ctx.in_features
    )
    grad_b = grad_y.sum(0) if ctx.has_bias else None
    return grad_x, None, None, None, None, None, None, grad_b, None, None


_tw_linear_op.register_autograd(_backward, setup_context=_setup_context)


@functools.lru_cache(maxsize=1)
def _register_cuda_kernel() -> bool:
    """Ask ``cutlass_kernels`` for the CUDA kernel, once per process (only when a CUDA tensor
    arrives, so nothing CUDA is imported on a CPU machine)."""
    try:
        from cutlass_kernels.build import register_cuda_kernel
    except ImportError as e:
        log.warning(
            "tilesparse: cutlass_kernels unavailable (%s); CUDA tensors use the reference path", e
        )
        return False
    return bool(register_cuda_kernel())


def tw_linear(
    x: torch.Tensor,
    layout: TWLayout,
    bias: torch.Tensor | None = None,
    backend: Backend | str = Backend.AUTO,
) -> torch.Tensor:
    """``Y = X · W + b`` for a condensed TW weight.

    Args:
        x: ``(..., K)`` float32/bfloat16/float16/float64 activations (any strides; copied to
            contiguous when needed).
        layout: the condensed ``(K, N)`` weight; ``layout.values`` in ``x``'s dtype.
        bias: optional ``(N,)`` in ``x``'s dtype.
        backend: a :class:`~tilesparse.backend.Backend` or its name.

    Returns:
        ``(..., N)`` in ``x.dtype``; pruned columns hold the bias (or zero).

    Raises:
        ValueError: ``x`` has the wrong number of features or an unsupported dtype, the dtype
            of ``values`` or ``bias`` is not ``x``'s, ``bias`` is not ``(N,)``, the layout's
            offsets or indices are invalid (see :meth:`TWLayout.validate`), or the backend is
            unknown or cannot run on ``x``'s device.
    """
    be = parse_backend(backend)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"tw_linear: x must be a tensor of shape (..., K), got {type(x).__name__}")
    if x.shape[-1] != layout.in_features:
        raise ValueError(
            f"tw_linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}), the layer "
            f"expects K={layout.in_features}"
        )
    if x.device.type == "cuda":
        _register_cuda_kernel()
    lead = x.shape[:-1]
    k = layout.in_features
    # (-1 cannot be inferred from zero elements when K = 0)
    x2 = (x.reshape(-1, k) if k > 0 else x.reshape(math.prod(lead), 0)).contiguous()
    y = torch.ops.tilesparse.tw_linear(
        x2,
        layout.col_idx,
        layout.tile_ptr,
        layout.row_idx,
        layout.row_ptr,
        layout.values,
        layout.val_ptr,
        bias,
        layout.out_features,
        be.value,
    )
    return y.reshape(*lead, layout.out_features)
