"""CUDA C++ for the TW GEMM instances of the manifest, generated through ``cutlass_library``.

What the kernel computes (templates ``csrc/tw_gemm.h`` — CUTLASS 2.x multistage, sm_80/sm_90a —
and ``csrc/tw_gemm_sm90.h`` — CUTLASS 3.x cp.async + wgmma collective, sm_90a; one launch for
all tiles, the same arguments for both). The layer
``Y = X · W`` runs transposed, in the K-major activation layout of Guo et al. (SC20)::

    Y^T[cols_t, :] = alpha · B_t^T · X^T[rows_t, :] + beta · Y^T[cols_t, :]     for every tile t

    CUTLASS GEMM per tile        M' = G_t (kept columns)  N' = batch  K' = R_t (kept rows)
    A' = B_t^T   ColumnMajor     the packed block, lda = pitch      (no gather)
    B' = X^T     RowMajor (K, ldx)  rows GATHERED by row_idx in the main-loop global→shared
                                 load: a kept row of X^T is a contiguous batch vector, so the
                                 cp.async stays 16 B wide
    D' = Y^T     RowMajor (N, ldy)  rows SCATTERED by col_idx in the epilogue store

    grid = (T, ceil(batch / batch_tile)); CTA (t, b) computes tile t's G_t x batch_tile block.

Argument layout, for the format's worked example (K=4, N=6, G=2; ``x`` kept)::

            n=0 1 2 3 4 5        tile_meta (T x 4 int32)      col_off ncols row_off nrows
      k=0     x x . . x .          tile 0: cols {0,1} rows {0,2,3}    0     2      0      3
      k=1     . . . . x x          tile 1: col  {4}   rows {0,1}      2     1      3      2
      k=2     x x . . . x          tile 2: col  {5}   rows {1,2}      3     1      5      2
      k=3     x x . . . .
                                 col_idx (scatter) = [0 1 4 5]          int32
                                 row_idx (gather)  = [0 2 3 | 0 1 | 1 2] int32
    w (R x lda, lda = 8: the widest tile rounded up to the 16-byte access, zero padded):
      row 0..2 (tile 0)  [W00 W01 0 0 0 0 0 0] [W20 W21 0 ...] [W30 W31 0 ...]
      row 3..4 (tile 1)  [W04  0 ...] [W14  0 ...]
      row 5..6 (tile 2)  [W15  0 ...] [W25  0 ...]
    tile t's block starts at w + row_off·lda, so A'(m, k) = w[(row_off + k)·lda + m].

``cutlass_kernels.reference`` packs exactly these arguments and emulates the kernel on them.

Every generated file starts with a banner naming the generator, the nvidia-cutlass version and
the sha256 of its inputs (instance description, kernel template sources, generator version);
emission is a pure function of those inputs, so the same manifest gives byte-identical files.
``cutlass_cppgen`` is not used for the kernel itself: its ``Gemm``/``GroupedGemm`` plans cannot
express a gather along K with per-tile index lists; the template parameters are filled from
``cutlass_library``'s tile descriptions and tag tables instead (the sm_90a gmma template gets
its main loop from CUTLASS's ``CollectiveBuilder`` with ``KernelCpAsyncWarpSpecialized``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from cutlass_kernels.manifest import Arch, DType, Mainloop, TWKernel

__all__ = [
    "GENERATOR_VERSION",
    "EmittedFile",
    "csrc_dir",
    "cutlass_include_dirs",
    "emit_instance",
    "emit_registry",
    "emit_sources",
    "write_sources",
    "nvcc_arch_flags",
    "NVCC_FLAGS",
    "cutlass_version",
]

# Bump when the emitted text changes for the same inputs.
GENERATOR_VERSION = "tilerec-tw-emit 1"

# Flags every instance is compiled with (DEPENDENCIES.md; --expt-relaxed-constexpr for CUTLASS;
# -fPIC: the objects are linked into the torch extension's shared library).
NVCC_FLAGS = ("-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC")

_TEMPLATE_SOURCES = (
    "tw_args.h",
    "tw_activation.h",
    "tw_epilogue.h",
    "tw_gemm.h",
    "tw_gemm_sm90.h",
)


@dataclass(frozen=True)
class EmittedFile:
    """One generated source file.

    Attributes:
        name: file name (``<instance>.cu`` or ``tw_instances.h``).
        text: the full text, banner included.
        input_hash: sha256 hex of the generator inputs (also in the banner).
    """

    name: str
    text: str
    input_hash: str


def csrc_dir() -> Path:
    """The folder holding the hand-written template sources (``tw_gemm.h`` ...)."""
    return Path(__file__).resolve().parent / "csrc"


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS's ``include`` and ``tools/util/include`` inside the nvidia-cutlass wheel."""
    import cutlass_library

    src = Path(cutlass_library.__file__).resolve().parent / "source"
    dirs = [src / "include", src / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise FileNotFoundError(f"nvidia-cutlass headers not found at {missing}")
    return dirs


def cutlass_version() -> str:
    """The installed nvidia-cutlass distribution's version."""
    return importlib.metadata.version("nvidia-cutlass")


def nvcc_arch_flags(arch: Arch | str) -> list[str]:
    """``-gencode`` for one architecture: ``sm_90a`` SASS only (wgmma needs the arch-specific
    ``a`` target, which has no forward-compatible PTX); ``sm_80`` SASS plus its PTX, so GPUs
    newer than 8.x can JIT it."""
    arch = Arch(arch)
    a = arch.value.removeprefix("sm_")
    if arch is Arch.SM80:
        return ["-gencode", f"arch=compute_{a},code=[sm_{a},compute_{a}]"]
    return ["-gencode", f"arch=compute_{a},code=sm_{a}"]


def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p.encode())
    return h.hexdigest()


def _template_text() -> str:
    return "".join(f"// {n}\n{(csrc_dir() / n).read_text()}" for n in _TEMPLATE_SOURCES)


def _banner(what: str, digest: str, inputs: str) -> str:
    return (
        f"// Generated by {GENERATOR_VERSION} (cutlass_kernels/emit.py) with nvidia-cutlass "
        f"{cutlass_version()} (cutlass_library). DO NOT EDIT.\n"
        f"// {what}\n"
        f"// Input hash: sha256:{digest}\n"
        f"// Inputs: {inputs}\n"
    )


def _shape(v: list[int] | tuple[int, ...]) -> str:
    return f"cutlass::gemm::GemmShape<{v[0]}, {v[1]}, {v[2]}>"


def emit_instance(kernel: TWKernel) -> EmittedFile:
    """The ``.cu`` of one instance: the template instantiated with ``cutlass_library``'s tags
    for the instance's tile description, and an ``extern "C"`` launcher named ``kernel.name``.
    """
    from cutlass_library import library as cl

    td = kernel.tile_description()
    mi = td.math_instruction
    spec = json.dumps(kernel.to_dict(), sort_keys=True)
    digest = _hash(GENERATOR_VERSION, cutlass_version(), spec, _template_text())
    if kernel.mainloop is Mainloop.SM90_CPASYNC_GMMA:
        m, n, k = td.threadblock_shape
        body = f"""#include "tw_gemm_sm90.h"

namespace {{
using Traits = tilerec::sm90::TwGemmSm90Traits<
    {cl.DataTypeTag[mi.element_a]},  // element of A' (W^T), B' (X^T), D' (Y^T)
    {cl.DataTypeTag[mi.element_accumulator]},  // accumulator
    {m}, {n}, {k},  // CTA tile (G, batch tile, k tile); wgmma {mi.instruction_shape[0]}x{mi.instruction_shape[1]}x{mi.instruction_shape[2]}
    {td.stages}>;  // stages
}}  // namespace

extern "C" int {kernel.name}(const tilerec::TwGemmArgs *args, cudaStream_t stream) {{
  return tilerec::sm90::tw_gemm_sm90_launch<Traits>(*args, stream);
}}
"""
        text = _banner(f"TW GEMM instance {kernel.name}", digest, spec) + "\n" + body
        return EmittedFile(f"{kernel.name}.cu", text, digest)
    warp = [td.threadblock_shape[i] // td.warp_count[i] for i in range(3)]
    # The multistage template runs the Ampere cp.async + mma.sync main loop on both archs.
    arch_tag = "cutlass::arch::Sm80"
    body = f"""#include "tw_gemm.h"

namespace {{
using Traits = tilerec::TwGemmTraits<
    {cl.DataTypeTag[mi.element_a]},  // element of A' (W^T), B' (X^T), D' (Y^T)
    {cl.DataTypeTag[mi.element_accumulator]},  // accumulator
    {cl.OpcodeClassTag[mi.opcode_class]},
    {arch_tag},  // main loop: cp.async multistage + mma.sync ({kernel.arch.value} target)
    {_shape(td.threadblock_shape)},  // threadblock (G, batch tile, k tile)
    {_shape(warp)},  // warp
    {_shape(mi.instruction_shape)},  // instruction
    {td.stages},  // stages
    {kernel.alignment},  // alignment (elements per access)
    {cl.MathOperationTag[mi.math_operation]}>;
}}  // namespace

extern "C" int {kernel.name}(const tilerec::TwGemmArgs *args, cudaStream_t stream) {{
  return tilerec::tw_gemm_launch<Traits>(*args, stream);
}}
"""
    text = _banner(f"TW GEMM instance {kernel.name}", digest, spec) + "\n" + body
    return EmittedFile(f"{kernel.name}.cu", text, digest)


def emit_registry(kernels: tuple[TWKernel, ...] | list[TWKernel]) -> EmittedFile:
    """``tw_instances.h``: the table of launchers the torch binding dispatches on by name.

    Raises:
        ValueError: for an empty or duplicated instance list.
    """
    if not kernels:
        raise ValueError("emit_registry needs at least one kernel instance")
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise ValueError(
            f"duplicate kernel instances: {sorted(n for n in names if names.count(n) > 1)}"
        )
    spec = json.dumps([k.to_dict() for k in kernels], sort_keys=True)
    digest = _hash(
        GENERATOR_VERSION, cutlass_version(), spec, (csrc_dir() / "tw_args.h").read_text()
    )
    decls = "\n".join(f"int {k.name}(const tilerec::TwGemmArgs *, cudaStream_t);" for k in kernels)
    rows = "\n".join(
        f'    {{"{k.name}", {"true" if k.dtype is DType.BF16 else "false"}, {k.alignment}, '
        f"{k.threadblock[0]}, {k.threadblock[1]}, {k.threadblock[2]}, &{k.name}}},"
        for k in kernels
    )
    body = f"""#pragma once

#include <cuda_runtime_api.h>

#include "tw_args.h"

extern "C" {{
{decls}
}}

namespace tilerec {{

struct TwInstance {{
  const char *name;
  bool is_bf16;
  int alignment;
  int tile_m, tile_n, tile_k;
  int (*launch)(const TwGemmArgs *, cudaStream_t);
}};

static const TwInstance kTwInstances[] = {{
{rows}
}};
static const int kTwNumInstances = {len(kernels)};

}}  // namespace tilerec
"""
    names_line = ", ".join(names)
    text = _banner("TW GEMM instance table", digest, names_line) + "\n" + body
    return EmittedFile("tw_instances.h", text, digest)


def emit_sources(kernels: tuple[TWKernel, ...] | list[TWKernel]) -> list[EmittedFile]:
    """Every instance's ``.cu`` plus the registry, in manifest order."""
    files = [emit_instance(k) for k in kernels]
    files.append(emit_registry(kernels))
    return files


def write_sources(files: list[EmittedFile], directory: str | Path) -> list[Path]:
    """Write the files into ``directory`` (created), leaving identical files untouched so
    incremental builds (ninja) see no change.

    Returns:
        the paths, in the order given.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        p = d / f.name
        if not p.exists() or p.read_text() != f.text:
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(f.text)
            tmp.replace(p)
        out.append(p)
    return out
