"""CUTLASS tile-wise (TW) sparse GEMMs for tensor cores.

* :mod:`cutlass_kernels.manifest` — the kernel instances as data (dtype, arch, tiles, stages).
* :mod:`cutlass_kernels.emit` — CUDA C++ generated through ``cutlass_library``, stamped.
* :mod:`cutlass_kernels.reference` — the kernel's argument packing and a CPU emulation of it.
* :mod:`cutlass_kernels.build` — nvcc / torch-extension builds cached under
  ``$XDG_CACHE_HOME/tilerec/cutlass``; ``register_cuda_kernel()`` for ``tilesparse::tw_linear``.

Importing this package needs neither a GPU nor nvcc (``build`` and ``emit`` import CUTLASS and
compile only when called).
"""

from __future__ import annotations

from cutlass_kernels.manifest import Arch, DType, TWKernel, manifest, select
from cutlass_kernels.reference import (
    TWLaunch,
    TWPackedWeight,
    check_launch,
    emulate,
    pack_launch,
    pack_weight,
    tw_linear_emulated,
    unpack_output,
)

__all__ = [
    "Arch",
    "DType",
    "TWKernel",
    "manifest",
    "select",
    "TWLaunch",
    "TWPackedWeight",
    "pack_weight",
    "pack_launch",
    "emulate",
    "check_launch",
    "unpack_output",
    "tw_linear_emulated",
    "register_cuda_kernel",
]


def register_cuda_kernel() -> bool:
    """Register the CUDA implementation of ``tilesparse::tw_linear`` (see
    :func:`cutlass_kernels.build.register_cuda_kernel`)."""
    from cutlass_kernels.build import register_cuda_kernel as _register

    return _register()
