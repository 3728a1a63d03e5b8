"""CUTLASS tile-wise (TW) sparse GEMMs for tensor cores: emitted, built and launched on plain
index tensors.

A condensed TW weight (per tile: kept output columns, kept input rows, a dense block) is
packed into the kernel's arguments, and one launch computes every tile's small GEMM with the
activation rows gathered in the main loop and the output columns scattered in the epilogue.

* :mod:`cutlass_kernels.manifest` — the kernel instances as data (dtype, arch, tiles, stages).
* :mod:`cutlass_kernels.emit` — CUDA C++ generated through ``cutlass_library``, stamped.
* :mod:`cutlass_kernels.packing` — a condensed weight checked and packed into the kernel's
  weight arguments (once per layer).
* :mod:`cutlass_kernels.reference` — one call's arguments and a CPU emulation of the kernel.
* :mod:`cutlass_kernels.epilogue` — the fused epilogue (bias, ReLU, GELU) as fp32 arithmetic
  the kernel and the emulation share bit for bit.
* :mod:`cutlass_kernels.toolchain` — nvcc, the CUDA toolkit, the device's architecture.
* :mod:`cutlass_kernels.build` — nvcc / torch-extension builds cached under
  ``$XDG_CACHE_HOME/tilerec/cutlass``.
* :mod:`cutlass_kernels.launch` — instance selection and launches on packed arguments.

>>> import torch, cutlass_kernels
>>> class Weight:  # one tile: columns {0, 2} of N=3, rows {1} of K=2
...     in_features, out_features = 2, 3
...     col_idx, tile_ptr = torch.tensor([0, 2]), torch.tensor([0, 2])
...     row_idx, row_ptr = torch.tensor([1]), torch.tensor([0, 1])
...     values, val_ptr = torch.tensor([5.0, 7.0]), torch.tensor([0, 2])
>>> cutlass_kernels.tw_linear_emulated(torch.tensor([[1.0, 2.0]]), Weight())
tensor([[10.,  0., 14.]])

This package imports nothing else of the project but the shared builder leaf :mod:`extbuild`
(``build`` compiles through it). Importing it needs neither a GPU nor nvcc
nor nvidia-cutlass (``build``, ``emit`` and ``launch`` compile, import CUTLASS and query the
device only when called).
"""

from __future__ import annotations

from cutlass_kernels.manifest import Arch, DType, Mainloop, TWKernel, manifest, select
from cutlass_kernels.reference import (
    CondensedWeight,
    TWLaunch,
    TWPackedWeight,
    check_launch,
    check_weight,
    emulate,
    pack_launch,
    pack_weight,
    tw_linear_emulated,
    unpack_output,
)

__all__ = [
    "Arch",
    "CondensedWeight",
    "DType",
    "Mainloop",
    "TWKernel",
    "TWLaunch",
    "TWPackedWeight",
    "check_launch",
    "check_weight",
    "emulate",
    "manifest",
    "pack_launch",
    "pack_weight",
    "select",
    "tw_linear_emulated",
    "unpack_output",
]
