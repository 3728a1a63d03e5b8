"""The TW GEMM kernel instances, as data.

One :class:`TWKernel` is one CUTLASS instantiation of a gather/scatter TW GEMM template: main
loop, input dtype (fp16/bf16, always fp32 accumulate), target architecture, threadblock tile,
warp count, pipeline stages, alignment. The threadblock and math-instruction
descriptions are ``cutlass_library`` objects (:meth:`TWKernel.tile_description`), the same ones
CUTLASS's own generator lists, and the instances are gated by architecture and CUDA version the
way ``cutlass_library.generator`` gates its lists.

The kernel runs the layer transposed (see ``emit.py``), so the layer's output-feature axis N is
the CUTLASS GEMM's M axis: ``threadblock[0]`` is the tile width ``G`` of the TW pattern (one CTA
covers one whole tile), ``threadblock[1]`` the batch columns per CTA, ``threadblock[2]`` the
kept K rows per main-loop stage::

    threadblock = (G, batch tile, k tile) = (128, 128, 32), warps (2, 2, 1) -> warp tile 64x64x32

Two main loops (:class:`Mainloop`):

* ``sm80_multistage`` (``csrc/tw_gemm.h``, CUTLASS 2.x): ``cp.async`` multistage + ``mma.sync``
  m16n8k16, for sm_80 and (compiled for Hopper) sm_90a.
* ``sm90_cpasync_gmma`` (``csrc/tw_gemm_sm90.h``, CUTLASS 3.x collective): two producer warp
  groups gather with ``cp.async``, one consumer warp group runs ``wgmma``; sm_90a only. TMA is
  not used: it cannot gather arbitrary rows. ``warps`` is ``(4, 1, 1)``: the consumer group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "Arch",
    "Mainloop",
    "DType",
    "TWKernel",
    "manifest",
    "select",
    "widest_tile",
    "ALIGNMENT",
    "SMEM_BYTES",
    "MIN_CUDA",
]


class DType(StrEnum):
    """Input/output element type of an instance (accumulation is always fp32)."""

    F16 = "f16"
    BF16 = "bf16"


class Arch(StrEnum):
    """Target architecture (the ``-gencode`` ``sm_*`` name)."""

    SM80 = "sm_80"
    SM90A = "sm_90a"


class Mainloop(StrEnum):
    """Which kernel template (main loop + epilogue) an instance instantiates."""

    SM80_MULTISTAGE = "sm80_multistage"
    SM90_CPASYNC_GMMA = "sm90_cpasync_gmma"


# Elements per global access: 128-bit (16 B) cp.async of 16-bit types. Every leading dimension,
# the padded batch and the block pitch are multiples of it (reference.py pads to it).
ALIGNMENT = 8

# Largest dynamic shared memory per CTA, bytes (CUDA C Programming Guide, "Compute
# Capabilities" table: 163 KB on sm_80 (A100), 227 KB on sm_90 (H100)).
SMEM_BYTES = {Arch.SM80: 163 * 1024, Arch.SM90A: 227 * 1024}

# Oldest CUDA toolkit that can compile the arch/dtype (bf16 mma and sm_80: CUDA 11.0;
# sm_90a: CUDA 12.0), as in cutlass_library.generator's CudaToolkitVersionSatisfies gates.
MIN_CUDA = {Arch.SM80: (11, 0), Arch.SM90A: (12, 0)}

_INSTRUCTION = (16, 8, 16)  # mma.sync.m16n8k16, fp16/bf16 inputs, fp32 accumulate

# The batch tile the wave model prefers, and how much slower (modelled) it may be than the
# cheapest: on an H200 (benchmarks/results/cutlass_gpu_check_h200.json, 48 BERT/DCNv2 rows)
# the 128-wide multistage tile was the fastest instance or within 2 % of it on average.
_PREFERRED_BATCH_TILE = 128
_PREFERRED_TILE_SLACK = 1.25


@dataclass(frozen=True)
class TWKernel:
    """One kernel instance.

    Attributes:
        dtype: input and output element type (fp32 accumulate).
        arch: compile target.
        threadblock: ``(G, batch tile, k tile)``; ``G`` is the widest TW tile it serves.
        warps: warps along the three threadblock axes.
        stages: main-loop pipeline depth (>= 3 for the multistage main loop).
        alignment: elements per vector access (``ALIGNMENT``).
        mainloop: the kernel template.
    """

    dtype: DType
    arch: Arch
    threadblock: tuple[int, int, int]
    warps: tuple[int, int, int]
    stages: int
    alignment: int = ALIGNMENT
    mainloop: Mainloop = Mainloop.SM80_MULTISTAGE

    def __post_init__(self) -> None:
        if self.mainloop is Mainloop.SM90_CPASYNC_GMMA:
            self._check_gmma()
        else:
            self._check_multistage()
        if self.smem_bytes > SMEM_BYTES[self.arch]:
            raise ValueError(
                f"{self.name}: {self.smem_bytes} B of shared memory exceeds the "
                f"{SMEM_BYTES[self.arch]} B of {self.arch.value}"
            )

    def _check_gmma(self) -> None:
        m, n, k = self.threadblock
        if self.arch is not Arch.SM90A:
            raise ValueError(
                f"the {self.mainloop.value} main loop needs sm_90a, got {self.arch.value}"
            )
        if self.warps != (4, 1, 1) or m not in (64, 128) or n % 16 or not 16 <= n <= 256 or k % 16:
            raise ValueError(
                f"{self.mainloop.value}: threadblock {self.threadblock} must be (64|128, 16..256 "
                f"step 16, multiple of 16) with warps (4, 1, 1), got warps {self.warps}"
            )
        if self.stages < 2:
            raise ValueError(
                f"stages must be >= 2 for the {self.mainloop.value} main loop, got {self.stages}"
            )

    def _check_multistage(self) -> None:
        if self.stages < 3:
            raise ValueError(f"stages must be >= 3 for the multistage main loop, got {self.stages}")
        for a, w, i in zip(self.threadblock, self.warps, _INSTRUCTION, strict=True):
            if w <= 0 or a % w or (a // w) % i:
                raise ValueError(
                    f"threadblock {self.threadblock} must split into warps {self.warps} whose "
                    f"tiles are multiples of the instruction {_INSTRUCTION}"
                )

    @property
    def tile_g(self) -> int:
        """``G``: the widest TW tile (kept output columns) one CTA covers."""
        return self.threadblock[0]

    @property
    def warp_shape(self) -> tuple[int, int, int]:
        (m, n, k), (wm, wn, wk) = self.threadblock, self.warps
        return m // wm, n // wn, k // wk

    @property
    def instruction(self) -> tuple[int, int, int]:
        """The MMA instruction: m16n8k16 ``mma.sync``, or ``wgmma`` 64 x batch tile x 16."""
        if self.mainloop is Mainloop.SM90_CPASYNC_GMMA:
            return (64, min(self.threadblock[1], 256), 16)
        return _INSTRUCTION

    @property
    def threads(self) -> int:
        """Threads per CTA (the gmma kernel adds two 128-thread producer warp groups)."""
        consumers = 32 * self.warps[0] * self.warps[1] * self.warps[2]
        return consumers + (256 if self.mainloop is Mainloop.SM90_CPASYNC_GMMA else 0)

    @property
    def smem_bytes(self) -> int:
        """Main-loop shared memory: ``stages × (A' tile + B' tile)`` of 2-byte elements."""
        m, n, k = self.threadblock
        return self.stages * (m * k + k * n) * 2

    @property
    def name(self) -> str:
        """A C identifier naming the instance, e.g. ``tw_gemm_sm80_f16_g128x128x32_w2x2x1_s4_a8``."""
        m, n, k = self.threadblock
        wm, wn, wk = self.warps
        arch = self.arch.value.replace("_", "")
        if self.mainloop is Mainloop.SM90_CPASYNC_GMMA:
            arch += "_gmma"
        return f"tw_gemm_{arch}_{self.dtype.value}_g{m}x{n}x{k}_w{wm}x{wn}x{wk}_s{self.stages}_a{self.alignment}"

    def math_instruction(self) -> Any:  # a cutlass_library.MathInstruction (untyped package)
        """The ``cutlass_library.MathInstruction`` (tensor-op multiply-add, fp32 accumulate)."""
        from cutlass_library import library as cl

        el = cl.DataType.f16 if self.dtype is DType.F16 else cl.DataType.bf16
        return cl.MathInstruction(
            list(self.instruction),
            el,
            el,
            cl.DataType.f32,
            cl.OpcodeClass.TensorOp,
            cl.MathOperation.multiply_add,
        )

    def tile_description(self) -> Any:  # a cutlass_library.TileDescription (untyped package)
        """The ``cutlass_library.TileDescription`` of this instance."""
        from cutlass_library import library as cl

        cc = 90 if self.arch is Arch.SM90A else 80
        return cl.TileDescription(
            list(self.threadblock), self.stages, list(self.warps), self.math_instruction(), cc, cc
        )

    def to_dict(self) -> dict[str, object]:
        """Plain data (hashed into the generated files' banners)."""
        return {
            "name": self.name,
            "mainloop": self.mainloop.value,
            "dtype": self.dtype.value,
            "arch": self.arch.value,
            "threadblock": list(self.threadblock),
            "warps": list(self.warps),
            "instruction": list(self.instruction),
            "stages": self.stages,
            "alignment": self.alignment,
        }


# (threadblock, warps, stages) per G. Shapes from the CUTLASS sm80 16816 tile lists
# (cutlass_library.generator.GenerateSM80_TensorOp_16816), restricted to M' = G.
_CONFIGS: tuple[tuple[tuple[int, int, int], tuple[int, int, int], int], ...] = (
    ((128, 128, 32), (2, 2, 1), 4),
    ((128, 256, 32), (2, 4, 1), 3),
    ((128, 128, 64), (2, 2, 1), 3),
    # A 64-wide batch tile doubles the CTAs of layers with few tiles (BERT fc2 at 75%: 3 tiles).
    ((128, 64, 32), (2, 2, 1), 4),
    ((128, 64, 64), (2, 2, 1), 3),
    ((64, 128, 32), (2, 2, 1), 4),
    ((64, 256, 32), (1, 4, 1), 4),
)


# (threadblock, stages) of the sm_90a gmma main loop: 32 KB (128x128x64) or 24 KB per stage.
_GMMA_CONFIGS: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((128, 128, 64), 5),
    ((128, 64, 64), 6),
    ((64, 128, 64), 6),
)


def manifest(
    arch: Arch | str | None = None, cuda_version: tuple[int, int] | None = None
) -> tuple[TWKernel, ...]:
    """Every instance, optionally only one arch's and only those a CUDA toolkit can build.

    Args:
        arch: keep only this architecture (``"sm_80"`` / ``"sm_90a"``).
        cuda_version: ``(major, minor)`` of nvcc; instances it cannot compile are dropped.

    Returns:
        instances in a fixed order (dtype, arch, config), so emission is deterministic.
    """
    return _manifest(
        Arch(arch) if arch is not None else None,
        tuple(cuda_version) if cuda_version is not None else None,
    )


@functools.cache  # immutable instances; select_for and tile_limit ask for them on every call
def _manifest(arch: Arch | None, cuda_version: tuple[int, ...] | None) -> tuple[TWKernel, ...]:
    archs = [arch] if arch is not None else list(Arch)
    out = []
    for dtype in DType:
        for a in archs:
            if cuda_version is not None and tuple(cuda_version) < MIN_CUDA[a]:
                continue
            for tb, warps, stages in _CONFIGS:
                out.append(TWKernel(dtype, a, tb, warps, stages))
            if a is Arch.SM90A:
                for tb, stages in _GMMA_CONFIGS:
                    out.append(
                        TWKernel(
                            dtype, a, tb, (4, 1, 1), stages, ALIGNMENT, Mainloop.SM90_CPASYNC_GMMA
                        )
                    )
    return tuple(out)


def _candidates(
    kernels: tuple[TWKernel, ...] | list[TWKernel],
    dtype: DType,
    arch: Arch,
    mainloop: Mainloop | str | None,
) -> tuple[Mainloop, list[TWKernel]]:
    """The main loop :func:`select` uses (``mainloop``, else multistage where the arch has it,
    else the arch's only one) and the instances of ``dtype``/``arch`` on it.

    Multistage is the default on sm_90a too: on an H200 its instances beat the gmma ones on 42
    of 48 BERT/DCNv2 rows, and the gmma instance the wave model picks ran 1.33x the fastest
    instance's time on average (benchmarks/results/cutlass_gpu_check_h200.json)."""
    kernels = [k for k in kernels if k.dtype is dtype and k.arch is arch]
    if mainloop is None:
        have = {k.mainloop for k in kernels}
        mainloop = (
            Mainloop.SM80_MULTISTAGE
            if Mainloop.SM80_MULTISTAGE in have or not have
            else next(iter(have))
        )
    mainloop = Mainloop(mainloop)
    return mainloop, [k for k in kernels if k.mainloop is mainloop]


def widest_tile(
    kernels: tuple[TWKernel, ...] | list[TWKernel],
    dtype: DType | str,
    arch: Arch | str,
    mainloop: Mainloop | str | None = None,
) -> int | None:
    """The widest ``G`` among the instances :func:`select` chooses from for ``dtype``/``arch``/
    ``mainloop`` (same defaults): the widest tile a packed weight may have (wider tiles are
    packed as sub-tiles, ``reference.pack_weight(max_tile_width=...)``). None when there is no
    such instance."""
    _, kernels = _candidates(kernels, DType(dtype), Arch(arch), mainloop)
    return max((k.tile_g for k in kernels), default=None)


def select(
    kernels: tuple[TWKernel, ...] | list[TWKernel],
    dtype: DType | str,
    arch: Arch | str,
    max_tile_width: int,
    batch: int,
    num_tiles: int | None = None,
    num_sms: int | None = None,
    mainloop: Mainloop | str | None = None,
) -> TWKernel:
    """Pick the instance for a call: the smallest ``G >= max_tile_width``, then (k tile 32) a
    batch tile. With the tile and SM counts known, a wave model of the grid
    (``num_tiles × ceil(batch / batch tile)`` CTAs; 2 resident per SM for 128-thread
    instances, 1 for 256): the 128-wide batch tile when its modelled time is within
    ``_PREFERRED_TILE_SLACK`` of the best, else the cheapest (the widest of equals). Without
    them a 256-wide batch tile for batches >= 16384, else 128.

    The main loop is ``mainloop`` when given, else the multistage one (see :func:`_candidates`);
    its default k tile is 64 (gmma) or 32 (multistage).

    Raises:
        ValueError: no instance of that dtype/arch/main loop serves tiles that wide.
    """
    dtype, arch = DType(dtype), Arch(arch)
    mainloop, kernels = _candidates(kernels, dtype, arch, mainloop)
    k_default = 64 if mainloop is Mainloop.SM90_CPASYNC_GMMA else 32
    fit = [k for k in kernels if k.tile_g >= max_tile_width]
    if not fit:
        widths = sorted({k.tile_g for k in kernels})
        raise ValueError(
            f"no {dtype.value}/{arch.value}/{mainloop.value} TW kernel serves tiles {max_tile_width} columns wide; "
            f"built tile widths: {widths}"
        )
    g = min(k.tile_g for k in fit)
    fit = [k for k in fit if k.tile_g == g]
    k32 = sorted((k for k in fit if k.threadblock[2] == k_default), key=lambda k: -k.threadblock[1])
    if not k32:
        return fit[0]
    if num_tiles is not None and num_sms is not None and num_tiles > 0 and batch > 0:

        def cost(k: TWKernel) -> int:
            # waves × per-wave time; a wave's time ∝ batch columns per CTA × CTAs sharing an SM.
            n = k.threadblock[1]
            per_sm = 2 if k.threads <= 128 else 1  # registers: 255/thread × 128 threads × 2 fit
            waves = -(-(num_tiles * -(-batch // n)) // (num_sms * per_sm))
            return waves * n * per_sm

        best = min(cost(k) for k in k32)
        preferred = [k for k in k32 if k.threadblock[1] == _PREFERRED_BATCH_TILE]
        if preferred and cost(preferred[0]) <= _PREFERRED_TILE_SLACK * best:
            return preferred[0]
        return next(k for k in k32 if cost(k) == best)
    want_n = 256 if batch >= 16384 else 128
    return next((k for k in k32 if k.threadblock[1] == want_n), k32[0])
