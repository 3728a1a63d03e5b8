"""Which implementation runs a tile-wise (TW) linear layer.

One ``str``-valued enum, so a backend can be named in configs (``"auto"``) and compared with
the enum member alike (``Backend("cpu") is Backend.CPU``).

=========  ===========================================================================
AUTO       never slower than dense: on a CPU tensor, the ``CPU`` kernel or a dense GEMM on
           the layer's dense weight (built once, cached), whichever this machine measured
           faster for the layer's shape and density, the dtype, the thread count and the
           batch's power-of-two range (``tilesparse.kernels.auto``: measured on the first
           call, kept in a per-machine table); the dense GEMM when the kernel cannot be
           built. On a CUDA tensor the dense GEMM on the cached dense weight, because the
           CUTLASS op path measured slower than dense on an H200 (``tilesparse.kernels.cuda``).
REFERENCE  :func:`tilesparse.format.reference_matmul`: pure torch, tile by tile, any device;
           what every fast path is tested against.
CPU        the fused gather-GEMM C++ kernel (``tilesparse/csrc``, loaded by
           ``tilesparse.kernels.cpu``; ``python -m tilesparse.build_ext`` builds it ahead);
           falls back to ``REFERENCE`` with one logged warning when the build is missing
           and cannot be made.
CUTLASS    the CUDA kernel from ``cutlass_kernels`` (CUDA tensors only).
EMULATED   ``cutlass_kernels.reference``'s CPU emulation of exactly what the CUTLASS kernel
           computes from its packed arguments, for CI without a GPU.
=========  ===========================================================================
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Backend", "parse_backend"]


class Backend(StrEnum):
    """Implementation of ``tilesparse::tw_linear`` (see the module docstring)."""

    AUTO = "auto"
    REFERENCE = "reference"
    CPU = "cpu"
    CUTLASS = "cutlass"
    EMULATED = "emulated"

    def __str__(self) -> str:
        return self.value


def parse_backend(backend: Backend | str) -> Backend:
    """``Backend`` from a member or its name (case-insensitive).

    Raises:
        ValueError: naming the bad value and the accepted ones.
    """
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        try:
            return Backend(backend.strip().lower())
        except ValueError:
            pass
    accepted = ", ".join(repr(b.value) for b in Backend)
    raise ValueError(f"unknown tw_linear backend {backend!r}; expected one of {accepted}")
