"""The fast CPU kernel of ``tilesparse::tw_linear``: built, loaded, called.

Sources (``tilesparse/csrc/``): ``tw_linear_cpu.cpp`` fp32, ``tw_microkernel_avx2.h`` its AVX2
micro-kernel, ``tw_linear_lowp.cpp`` bf16/fp16/fp64, ``tw_linear_amx.cpp`` bf16 on AMX,
``tw_linear_bf16.cpp`` bf16 on AVX512-BF16, ``tw_common.h`` / ``tw_bf16_common.h``.

The kernel transposes each block of ``X`` rows to K-major so that a tile's kept rows are
contiguous vectors. fp32: a register-blocked micro-kernel reads them through the tile's row
list — AVX-512 (12 × 32) where the CPU has it, else AVX2 + FMA (6 × 16), else scalar C
(``ext.simd()`` says which). bf16 on a CPU with AMX: the tile's kept rows are interleaved into
VNNI pairs and multiplied on the AMX tile unit (fp32 accumulation). bf16 on a CPU with
AVX512-BF16 and no AMX (AMD Zen 4/5, Intel Cooper Lake): the same pairs, multiplied by
``VDPBF16PS`` in a 6-column × 64-row register-blocked micro-kernel
(``TILESPARSE_DISABLE_AVX512BF16=1`` turns it off). Both flush subnormal inputs, products and
results to zero (the instructions do; so does oneDNN's bf16 GEMM there); the other routes keep
them. bf16/fp16 on a CPU without native 16-bit GEMM instructions (no AVX512-BF16 /
AVX512-FP16, e.g. AVX2-only machines; ``ext.lowp_via_fp32``, forced by
``TILESPARSE_LOWP_FP32``): widened to fp32, run on the fp32 kernel, rounded back. Otherwise
(fp16; bf16 with those kernels off or not built) and fp64 always: ``at::mm`` on gathered panels
(``addmm`` with the bias: every route rounds product + bias once). ``ext.bf16_kernel()`` names
the kernel a bf16 call takes.

The extension is compiled with the machine's C++ compiler through ``torch.utils.cpp_extension``
(ninja), with ``-O3 -march=native``, into a cache folder::

    $XDG_CACHE_HOME/tilerec/tilesparse_cpu/<torch version>-<source hash>/   (default ~/.cache)

so a rebuild happens only when the source, the compiler flags, the CPU (its feature flags:
:func:`extbuild.cpu_identity`) or the toolchain (the ninja version, the Python, the torch install)
change. The build runs through :func:`extbuild.load` (a leaf module of torch
and the standard library): one builder per folder at a time, a killed build's lock cleared
rather than waited on forever, and the interpreter environment's ninja whatever ``PATH`` says. ``make install`` builds it once
(``python -m tilesparse.build_ext``); at runtime :func:`load_extension` loads the cached build
(building it first if it is missing) and returns ``None`` after logging ONE warning when it
cannot, in which case :mod:`tilesparse.ops` uses the reference path.

Set ``TILESPARSE_DISABLE_EXT=1`` to force the reference path (the fallback test does).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from extbuild import CpuExtension

__all__ = [
    "DISABLE_ENV",
    "EXT",
    "build_dir",
    "build_extension",
    "cpu_kernel_available",
    "load_extension",
    "tw_linear_cpu",
]

EXT_NAME = "tilesparse_cpu"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
DISABLE_ENV = "TILESPARSE_DISABLE_EXT"
EXT = CpuExtension(
    name=EXT_NAME,
    label="tilesparse: fast CPU kernel",
    sources=(
        CSRC / "tw_linear_cpu.cpp",
        CSRC / "tw_linear_lowp.cpp",
        CSRC / "tw_linear_amx.cpp",
        CSRC / "tw_linear_bf16.cpp",
    ),
    headers=(CSRC / "tw_common.h", CSRC / "tw_microkernel_avx2.h", CSRC / "tw_bf16_common.h"),
    cflags=("-O3", "-march=native", "-fopenmp"),
    disable_env=DISABLE_ENV,
    build_command="python -m tilesparse.build_ext -v",
    logger=__name__,
    fallback="the reference path (slow)",
)


def build_dir() -> Path:
    """The cache folder of this source × checkout × flags × CPU × toolchain
    (:meth:`~extbuild.CpuExtension.build_dir`)."""
    return EXT.build_dir()


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it, through
    :func:`extbuild.load`: one builder at a time per folder (a live one is
    waited for, a killed one's lock is cleared) and one ninja whatever ``PATH`` says.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    return EXT.build(verbose)


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType | None:
    """The compiled kernel module, or ``None`` (with one logged warning) if it cannot be
    built or loaded. Cached: the build is attempted at most once per process."""
    return EXT.load_or_none()


def cpu_kernel_available() -> bool:
    """Whether the compiled CPU kernel is loaded (building it on first call if needed)."""
    return load_extension() is not None


def tw_linear_cpu(
    x: torch.Tensor,
    col_idx: torch.Tensor,
    tile_ptr: torch.Tensor,
    row_idx: torch.Tensor,
    row_ptr: torch.Tensor,
    values: torch.Tensor,
    val_ptr: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor | None:
    """``Y = X · W + b`` on the compiled kernel, or ``None`` when it is not available (after
    one logged warning; the caller then runs the reference).

    Args:
        x: ``(M, K)`` contiguous CPU activations; the rest as in the op schema
            (:mod:`tilesparse.kernels.schema`), already checked by ``check_op_inputs``.

    Returns:
        ``(M, N)`` in ``x.dtype``, or ``None``.
    """
    ext = load_extension()
    if ext is None:
        return None
    vals = values if values.is_contiguous() else values.contiguous()
    y: torch.Tensor = ext.tw_linear_cpu(
        x, col_idx, tile_ptr, row_idx, row_ptr, vals, val_ptr, bias, out_features
    )
    return y
