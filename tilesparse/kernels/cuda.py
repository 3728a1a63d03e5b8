"""The CUDA implementation of ``tilesparse::tw_linear``: the glue from a condensed layout to
the CUTLASS kernels of :mod:`cutlass_kernels`.

* :func:`register_cuda_kernel` — registers :func:`_op_impl` for CUDA tensors;
  :func:`tilesparse.ops.tw_linear` calls it lazily when the first CUDA tensor arrives, so this
  module and ``cutlass_kernels`` are not imported on a machine that never sees one (backend
  ``emulated`` imports only ``cutlass_kernels.reference``).
* :func:`packed_weight` — a layer's kernel arguments, packed once per set of layout tensors
  (:class:`~tilesparse.kernels.cache.LayoutCache`: again only after a tensor is replaced or
  edited in place).
* :func:`tw_linear_cuda` — ``Y = X · W + b`` for a :class:`~tilesparse.format.TWLayout` on the
  kernel, through that cache.

Backends on a CUDA tensor (:class:`~tilesparse.backend.Backend`): ``reference`` and
``emulated`` run as on the CPU; ``cutlass`` runs the kernel (fp16/bf16 only); ``auto`` runs the
dense GEMM (cuBLAS) on the layer's dense weight, pruned entries zero, reconstructed once per
set of layout tensors (:func:`dense_weight`). The kernel's row-major op path measured 0.09–0.31×
of that GEMM on an H200 (``benchmarks/results/cutlass_gpu_check_h200.json``: the activations'
and output's layout copies cost 3–8 times the kernel), and ``auto`` is never slower than dense.
"""

from __future__ import annotations

import logging

import torch

import cutlass_kernels.launch as launch
import cutlass_kernels.reference as reference
import cutlass_kernels.toolchain as toolchain
from cutlass_kernels.manifest import TWKernel
from tilesparse.backend import Backend
from tilesparse.format import TWLayout, reference_matmul
from tilesparse.kernels.cache import LayoutCache
from tilesparse.kernels.schema import OP_NAME, check_op_inputs, op_layout

__all__ = ["dense_weight", "packed_weight", "register_cuda_kernel", "tw_linear_cuda"]

log = logging.getLogger(__name__)

# Packed weights, anchored on the layout's values tensor; the stamp holds the six tensors'
# versions, K and N; by (dtype, device, widest sub-tile).
_PACKED: LayoutCache[reference.TWPackedWeight] = LayoutCache()
# Dense reconstructions for backend "auto", anchored and stamped as the packed weights; by
# (dtype, device).
_DENSE: LayoutCache[torch.Tensor] = LayoutCache()


def _pack(
    layout: TWLayout, dtype: torch.dtype, device: str, max_tile_width: int | None
) -> reference.TWPackedWeight:
    pw = reference.pack_weight(layout, dtype=dtype, device=device, max_tile_width=max_tile_width)
    if max_tile_width is not None and pw.num_tiles > layout.num_tiles:
        log.info(
            "TW layer %dx%d: tiles wider than %d columns (the widest kernel instance) packed as "
            "%d sub-tiles of at most %d columns (%d tiles)",
            layout.in_features,
            layout.out_features,
            max_tile_width,
            pw.num_tiles,
            max_tile_width,
            layout.num_tiles,
        )
    return pw


def _packed(
    tensors: tuple[torch.Tensor, ...],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_tile_width: int | None,
    layout: TWLayout | None = None,
) -> reference.TWPackedWeight:
    """:func:`packed_weight` of the op's tensors (``col_idx .. val_ptr``); their
    :class:`TWLayout` is built only when they must be packed (it reads the widest tile, a host
    sync on a CUDA tensor), unless given."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    dev = str(torch.device(device))

    def pack() -> reference.TWPackedWeight:
        lay = layout if layout is not None else op_layout(in_features, out_features, tensors)
        return _pack(lay, dtype, dev, max_tile_width)

    return _PACKED.get(
        (values, col_idx, tile_ptr, row_idx, row_ptr, val_ptr),
        (in_features, out_features),
        (dtype, dev, max_tile_width),
        pack,
    )


def packed_weight(
    layout: TWLayout,
    dtype: torch.dtype,
    device: torch.device | str,
    max_tile_width: int | None = None,
) -> reference.TWPackedWeight:
    """The layout's packed weight for ``dtype``/``device`` (tiles wider than ``max_tile_width``
    packed as sub-tiles, see :func:`cutlass_kernels.reference.pack_weight`): packed once per
    set of layout tensors, and again after any of them is replaced or edited in place (its
    version bumps). The record leaves with ``layout.values``.

    Raises:
        ValueError: an invalid layout (from :func:`cutlass_kernels.reference.pack_weight`).
    """
    tensors = (
        layout.col_idx,
        layout.tile_ptr,
        layout.row_idx,
        layout.row_ptr,
        layout.values,
        layout.val_ptr,
    )
    return _packed(
        tensors, layout.in_features, layout.out_features, dtype, device, max_tile_width, layout
    )


def dense_weight(
    tensors: tuple[torch.Tensor, ...],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """``(in_features, out_features)`` weight of the op's layout tensors (``col_idx ..
    val_ptr``) in ``dtype`` on ``device``, pruned entries zero: built once per set of layout
    tensors (on the host: the tile loop reads offsets), again after one is replaced or edited
    in place. The record leaves with ``values``."""
    col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr = tensors
    dev = str(torch.device(device))

    def build() -> torch.Tensor:
        host = tuple(t.detach().cpu() for t in tensors)
        w = op_layout(in_features, out_features, host).to_dense()
        return w.to(device=dev, dtype=dtype)

    return _DENSE.get(
        (values, col_idx, tile_ptr, row_idx, row_ptr, val_ptr),
        (in_features, out_features),
        (dtype, dev),
        build,
    )


def tw_linear_cuda(
    x: torch.Tensor,
    layout: TWLayout,
    bias: torch.Tensor | None = None,
    *,
    kernel: TWKernel | None = None,
) -> torch.Tensor:
    """``Y = X · W + b`` on the GPU: ``x (..., K)`` fp16/bf16 CUDA → ``(..., N)``, the weight
    packed once (:func:`packed_weight`) with tiles no wider than the instances cover.

    Includes the two layout changes a row-major caller needs (``X → X^T``, ``Y^T → Y``); a
    network kept K-major end to end calls :func:`cutlass_kernels.launch.tw_gemm_kmajor`.

    Raises:
        ValueError: ``x`` has the wrong number of features, or as
            :func:`cutlass_kernels.launch.tw_linear_packed`.
    """
    if x.shape[-1] != layout.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {layout.in_features}")
    limit = kernel.tile_g if kernel is not None else launch.tile_limit(x.dtype, x.device)
    pw = packed_weight(layout, x.dtype, x.device, limit)
    return launch.tw_linear_packed(x, pw, bias, kernel=kernel)


def _op_impl(
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
    """CUDA implementation of ``tilesparse::tw_linear`` (x is ``(M, K)``).

    Runs the same checks as the CPU implementation first (``check_op_inputs``: shapes, dtypes,
    contiguity, the backend for the device, the layout's offsets and indices), then the
    reference, the emulation, the dense GEMM on the cached dense weight (``auto``) or the kernel
    on the cached packed weight (``cutlass``). Tiles wider than the widest built instance
    (``G = 128``) are packed as sub-tiles of at most ``G`` columns that share the tile's kept
    rows (exact), so any tile width runs on the kernel.

    Raises:
        ValueError: as ``check_op_inputs``; backend ``cpu`` (for a CPU tensor that reached
            this implementation directly); ``cutlass`` for a dtype other than fp16/bf16.
    """
    be = check_op_inputs(
        x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features, backend
    )
    tensors = (col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)
    if be is Backend.CPU:
        raise ValueError(
            f"backend 'cpu' is the CPU kernel; the CUDA implementation got it for a {x.device.type} tensor"
        )
    if be is Backend.REFERENCE:
        return reference_matmul(x, op_layout(x.shape[1], out_features, tensors), bias)
    if be is Backend.EMULATED:
        return reference.tw_linear_emulated(x, op_layout(x.shape[1], out_features, tensors), bias)
    if be is Backend.AUTO:
        w = dense_weight(tensors, x.shape[1], out_features, x.dtype, x.device)
        return x @ w if bias is None else torch.addmm(bias, x, w)
    if x.dtype not in launch.DTYPES:
        raise ValueError(f"backend 'cutlass' takes float16 or bfloat16 inputs, got {x.dtype}")
    limit = launch.tile_limit(x.dtype, x.device)
    pw = _packed(tensors, x.shape[1], out_features, x.dtype, x.device, limit)
    return launch.tw_linear_packed(x, pw, bias)


def register_cuda_kernel() -> bool:
    """Register the CUDA implementation of ``tilesparse::tw_linear`` (idempotent).

    The kernels are compiled on the first CUDA call, not here.

    Returns:
        True when the implementation is registered; False (with the reason logged) when this
        machine has no CUDA device, no CUDA torch or no nvcc.

    Raises:
        RuntimeError: the op is not defined (``tilesparse.ops`` defines it on import).
    """
    if not torch.cuda.is_available():
        log.info("no CUDA device: %s CUDA kernel not registered", OP_NAME)
        return False
    if toolchain.find_nvcc() is None:
        log.warning("nvcc not found: %s CUDA kernel not registered", OP_NAME)
        return False
    ns, op = OP_NAME.split("::")
    if not hasattr(getattr(torch.ops, ns), op):
        raise RuntimeError(f"{OP_NAME} is not defined (import tilesparse.ops first)")
    if torch._C._dispatch_has_kernel_for_dispatch_key(OP_NAME, "CUDA"):
        return True
    torch.library.register_kernel(OP_NAME, "cuda", _op_impl)
    return True
