"""The implementations behind ``tilesparse::tw_linear`` (the op itself: :mod:`tilesparse.ops`).

* :mod:`tilesparse.kernels.schema` — the op's name, dtypes and the input checks every
  implementation runs first (:func:`check_op_inputs`).
* :mod:`tilesparse.kernels.cache` — :class:`LayoutCache`, data derived from a layout's tensors
  (the index check, packed weights), kept while those tensors live unchanged.
* :mod:`tilesparse.kernels.cpu` — the compiled CPU kernel (``tilesparse/csrc``): built into a
  cache folder, loaded, called.
* :mod:`tilesparse.kernels.auto` — ``Backend.AUTO`` on the CPU: the TW kernel or a dense GEMM
  on the cached dense weight, from a crossover measured per layer signature and batch range
  and kept in a per-machine table.
* :mod:`tilesparse.kernels.cuda` — the CUDA implementation on the CUTLASS kernels of
  ``cutlass_kernels`` (packed-weight cache, registration). Imported only when a CUDA tensor
  reaches the op or :func:`register_cuda_kernel` is called, so importing this package needs no
  GPU, no nvcc and no nvidia-cutlass.
"""

from __future__ import annotations

from tilesparse.kernels.auto import AutoDecision, AutoKey, Route, crossover_table
from tilesparse.kernels.cache import LayoutCache
from tilesparse.kernels.cpu import cpu_kernel_available, load_extension
from tilesparse.kernels.schema import OP_NAME, SUPPORTED_DTYPES, check_op_inputs

__all__ = [
    "OP_NAME",
    "SUPPORTED_DTYPES",
    "AutoDecision",
    "AutoKey",
    "LayoutCache",
    "Route",
    "check_op_inputs",
    "cpu_kernel_available",
    "crossover_table",
    "load_extension",
    "register_cuda_kernel",
]


def register_cuda_kernel() -> bool:
    """Register the CUDA implementation of ``tilesparse::tw_linear`` (see
    :func:`tilesparse.kernels.cuda.register_cuda_kernel`); False where there is no CUDA
    device or no nvcc."""
    from tilesparse.kernels.cuda import register_cuda_kernel as register

    return register()
