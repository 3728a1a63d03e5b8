"""Execution of the condensed TW format: the ``tilesparse::tw_linear`` custom op.

``tw_linear(x, layout, bias, backend)`` computes ``Y = X · W + b`` for a condensed weight
(:class:`~tilesparse.format.TWLayout`, drawn in ``tilesparse/format.py``). It is built on one
``torch.library.custom_op`` with a FIXED schema (:mod:`tilesparse.kernels.schema`), whose CUDA
implementation :mod:`tilesparse.kernels.cuda` registers for the same op::

    tilesparse::tw_linear(Tensor x, Tensor col_idx, Tensor tile_ptr, Tensor row_idx,
                          Tensor row_ptr, Tensor values, Tensor val_ptr, Tensor? bias,
                          int out_features, str backend) -> Tensor

``x`` is ``(M, K)`` contiguous; the result ``(M, N)`` has ``x``'s dtype. The op has a fake
(meta) kernel, so ``torch.export`` and ``torch.compile`` trace through it, and an autograd
formula for ``x`` and ``bias`` (the condensed ``values`` are buffers, not trained).

Backends (:class:`~tilesparse.backend.Backend`) on a CPU tensor: ``cpu`` runs the compiled
kernel (:mod:`tilesparse.kernels.cpu`; the reference, after one logged warning, when it cannot
be built); ``auto`` runs the compiled kernel or a dense GEMM on the layer's cached dense weight,
whichever the machine's measured crossover says is faster for the layer, dtype and batch range
(:mod:`tilesparse.kernels.auto`; :func:`auto_decision` reports the choice,
:func:`calibrate_auto` measures ahead of the first call), and the dense GEMM when the kernel
cannot be built; ``reference`` :func:`~tilesparse.format.reference_matmul`, ``emulated``
the CPU emulation of the CUTLASS kernel (``cutlass_kernels.reference``); ``cutlass`` is refused
off CUDA. On a CUDA tensor see :mod:`tilesparse.kernels.cuda`.

Every real implementation starts with
:func:`~tilesparse.kernels.schema.check_op_inputs`: a layout whose offsets or indices would
make the C++ (or CUDA) kernel read out of bounds or write one column twice is rejected with a
``ValueError`` before any kernel runs (the check is cached per index set). The CUDA kernel is
registered lazily: the first CUDA tensor that reaches :func:`tw_linear` calls
:func:`tilesparse.kernels.cuda.register_cuda_kernel`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from tilesparse.backend import Backend, parse_backend
from tilesparse.format import TWLayout, reference_matmul
from tilesparse.kernels.auto import AutoDecision, auto_key, auto_linear_cpu, crossover_table
from tilesparse.kernels.cpu import tw_linear_cpu
from tilesparse.kernels.schema import (
    OP_NAME,
    SUPPORTED_DTYPES,
    check_args,
    check_op_inputs,
    op_layout,
)

__all__ = ["OP_NAME", "SUPPORTED_DTYPES", "auto_decision", "calibrate_auto", "tw_linear"]

log = logging.getLogger(__name__)


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
    tensors = (col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    if be is Backend.EMULATED:
        try:
            from cutlass_kernels.reference import tw_linear_emulated
        except ImportError as e:
            raise ValueError(f"backend 'emulated' needs cutlass_kernels.reference ({e})") from e
        return tw_linear_emulated(x, op_layout(x.shape[1], out_features, tensors), bias)
    if be is Backend.CUTLASS:  # a CUDA tensor (check_op_inputs), but no CUDA kernel took it
        raise ValueError(
            "backend 'cutlass' needs the CUDA kernel from cutlass_kernels, and none is "
            "registered (see tilesparse.kernels.cuda.register_cuda_kernel)"
        )
    if x.device.type == "cpu" and be is Backend.AUTO:
        return auto_linear_cpu(x, tensors, bias, out_features)
    if x.device.type == "cpu" and be is Backend.CPU:
        y = tw_linear_cpu(x, *tensors, bias, out_features)  # None: the reference runs
        if y is not None:
            return y
    return reference_matmul(x, op_layout(x.shape[1], out_features, tensors), bias)


@_tw_linear_op.register_fake
def _tw_linear_fake(
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
    check_args(x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features)
    parse_backend(backend)
    return x.new_empty((x.shape[0], out_features))


# ctx below is autograd's context object: attributes are set on it freely (hence Any)
def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
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
    grad_y: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    in_features: int,
) -> torch.Tensor:
    return grad_y.new_empty((grad_y.shape[0], in_features))


def _grad_x_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    grad_y, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, _ = inputs
    ctx.save_for_backward(col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    ctx.out_features = grad_y.shape[1]


def _grad_x_backward(ctx: Any, grad_grad_x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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


def _backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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
        from tilesparse.kernels.cuda import register_cuda_kernel
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


def _layout_tensors(layout: TWLayout) -> tuple[torch.Tensor, ...]:
    return (
        layout.col_idx,
        layout.tile_ptr,
        layout.row_idx,
        layout.row_ptr,
        layout.values,
        layout.val_ptr,
    )


def auto_decision(layout: TWLayout, batch: int, threads: int | None = None) -> AutoDecision | None:
    """What ``backend="auto"`` runs for a CPU call of ``batch`` rows on ``layout`` (in its
    ``values``' dtype), as measured on this machine, or ``None`` when that layer signature and
    batch range is not measured yet (its first call, or :func:`calibrate_auto`, measures it).

    Args:
        layout: the condensed weight (e.g. ``TileSparseLinear.layout``).
        batch: rows of the call ``M`` (the decision covers the power-of-two range holding it).
        threads: torch threads of the call (default: the current ``torch.get_num_threads()``).

    Returns:
        the :class:`~tilesparse.kernels.auto.AutoDecision` (its ``route``, ``"tw"`` or
        ``"dense"``, and the two measured times), or ``None``.
    """
    key = auto_key(
        _layout_tensors(layout),
        layout.in_features,
        layout.out_features,
        layout.values.dtype,
        batch,
        threads,
    )
    return crossover_table().get(key)


def calibrate_auto(
    layout: TWLayout, batches: tuple[int, ...] | list[int], seed: int = 0
) -> list[AutoDecision]:
    """Measure AUTO's crossover for ``layout`` at each batch size ahead of the real calls (on
    random CPU inputs in ``values``' dtype), so no later call pays for the calibration.
    Batch ranges already measured are not measured again.

    Args:
        layout: a CPU condensed weight.
        batches: batch sizes ``M`` (each >= 1).
        seed: of the random inputs.

    Returns:
        the decision of each batch size, in order.

    Raises:
        ValueError: for a batch size below 1 or a layout off the CPU.
    """
    bad = [b for b in batches if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"calibrate_auto: batch sizes must be integers >= 1, got {bad}")
    if layout.values.device.type != "cpu":
        raise ValueError(
            f"calibrate_auto: AUTO measures CPU layers; this layout is on {layout.values.device}"
        )
    gen = torch.Generator().manual_seed(seed)
    out: list[AutoDecision] = []
    for b in batches:
        decision = auto_decision(layout, b)
        if decision is None:
            with torch.no_grad():
                x = torch.randn(b, layout.in_features, generator=gen).to(layout.values.dtype)
                tw_linear(x, layout, None, Backend.AUTO)
            decision = auto_decision(layout, b)
        if decision is None:  # a forced route or no kernel: nothing is measured
            raise ValueError(
                "calibrate_auto: nothing was measured (TILESPARSE_AUTO_ROUTE is set, the "
                "compiled CPU kernel is missing, or the layout was made under inference_mode)"
            )
        out.append(decision)
    return out
