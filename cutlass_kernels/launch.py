"""Run the TW GEMM on packed arguments: choose the instance, launch it.

* :func:`select_for` / :func:`tile_limit` — which instance a launch takes, and the widest tile
  any candidate covers (the packing splits wider tiles into sub-tiles).
* :func:`tw_gemm_kmajor` — one launch on K-major activations (``xt (K, ldx) → yt (N, ldy)``),
  bias and activation fused in the epilogue.
* :func:`bind` — a launch with its instance and extension resolved once
  (:class:`BoundLaunch`): what a fixed-shape caller (``tilesparse.TWChain``) runs per call, with
  no instance selection, device query or host sync on the hot path.
* :func:`tw_linear_packed` — ``(..., K) → (..., N)`` row-major on a packed weight (the two
  transposes included).

Inputs are the plain tensors of :mod:`cutlass_kernels.reference` (``TWPackedWeight``,
``TWLaunch``); the extension comes from :func:`cutlass_kernels.build.default_extension` unless
one is given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import ModuleType

import torch

import cutlass_kernels.build as build
import cutlass_kernels.reference as reference
import cutlass_kernels.toolchain as toolchain
from cutlass_kernels.epilogue import ACTIVATION_CODE
from cutlass_kernels.manifest import Arch, DType, Mainloop, TWKernel, manifest, select, widest_tile

__all__ = [
    "DTYPES",
    "MAINLOOP_ENV",
    "BoundLaunch",
    "bind",
    "select_for",
    "tile_limit",
    "tw_gemm_kmajor",
    "tw_linear_packed",
]

MAINLOOP_ENV = "TILEREC_CUTLASS_MAINLOOP"
DTYPES = {torch.float16: DType.F16, torch.bfloat16: DType.BF16}  # the kernels' element types


def select_for(launch: reference.TWLaunch, ext: ModuleType | None = None) -> TWKernel:
    """The instance :func:`tw_gemm_kmajor` uses by default for ``launch``: :func:`manifest.select`
    for its device's arch and SM count, among the instances built into ``ext`` (all of the
    arch's when ``ext`` is None), on the main loop ``$TILEREC_CUTLASS_MAINLOOP`` names
    (``sm80_multistage`` / ``sm90_cpasync_gmma``; default: the arch's best).

    Raises:
        ValueError: fp32 or another unsupported dtype, a bad ``$TILEREC_CUTLASS_MAINLOOP``, or
            no instance wide enough.
    """
    pw = launch.weight
    if pw.dtype not in DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    mainloop = _mainloop_env()
    arch = toolchain.device_arch(launch.xt.device)
    kernels = _built(arch, ext)
    sms = torch.cuda.get_device_properties(launch.xt.device).multi_processor_count
    return select(
        kernels,
        DTYPES[pw.dtype],
        arch,
        pw.max_tile_width,
        launch.batch,
        pw.num_tiles,
        sms,
        mainloop,
    )


def _mainloop_env() -> str | None:
    mainloop = os.environ.get(MAINLOOP_ENV) or None
    if mainloop is not None and mainloop not in {m.value for m in Mainloop}:
        raise ValueError(
            f"${MAINLOOP_ENV}={mainloop!r}: expected one of {[m.value for m in Mainloop]}"
        )
    return mainloop


def _built(arch: Arch, ext: ModuleType | None) -> tuple[TWKernel, ...]:
    """The arch's manifest instances, only those built into ``ext`` when given."""
    kernels = manifest(arch)
    if ext is not None:
        have = set(ext.instances())
        kernels = tuple(k for k in kernels if k.name in have)
    return kernels


def tile_limit(
    dtype: torch.dtype,
    device: torch.device | str | int | None = None,
    ext: ModuleType | None = None,
) -> int | None:
    """The widest tile (``G``) among the instances :func:`select_for` would choose from for
    ``dtype`` on ``device`` (built into ``ext``, default
    :func:`~cutlass_kernels.build.default_extension`; main loop as ``$TILEREC_CUTLASS_MAINLOOP``
    says): a layer is packed with wider tiles split into sub-tiles of at most this many
    columns. None for a dtype without kernels, or when no instance of it was built.

    Raises:
        ValueError: a bad ``$TILEREC_CUTLASS_MAINLOOP``.
    """
    if dtype not in DTYPES:
        return None
    mainloop = _mainloop_env()
    arch = toolchain.device_arch(device)
    kernels = _built(arch, ext or build.default_extension(arch))
    return widest_tile(kernels, DTYPES[dtype], arch, mainloop)


@dataclass(frozen=True)
class BoundLaunch:
    """One launch with everything but the stream resolved: the instance, the extension, and
    the binding's arguments. :meth:`run` only calls the binding (which checks its operands in
    C++), so a caller that reuses its buffers (a K-major chain) pays no selection, device query
    or Python-side check per call, and the launch can be captured into a CUDA graph.

    Attributes:
        launch: the packed arguments (their tensors are read at every run: refill ``xt`` in
            place between runs).
        kernel: the instance that runs it.
        ext: the extension holding ``kernel``.
    """

    launch: reference.TWLaunch
    kernel: TWKernel
    ext: ModuleType

    def run(self, stream: int) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` as an int:
        ``torch.cuda.current_stream().cuda_stream``); ``launch.yt`` is written in place."""
        launch, pw = self.launch, self.launch.weight
        if not (pw.num_tiles and launch.batch):
            return  # the launcher would return without launching
        self.ext.tw_gemm(
            self.kernel.name,
            pw.tile_meta,
            pw.col_idx,
            pw.row_idx,
            pw.w,
            pw.lda,
            launch.xt,
            launch.yt,
            launch.batch,
            launch.alpha,
            launch.beta,
            launch.bias,
            ACTIVATION_CODE[launch.activation],
            stream,
        )


def bind(
    launch: reference.TWLaunch, *, kernel: TWKernel | None = None, ext: ModuleType | None = None
) -> BoundLaunch:
    """Resolve a launch's instance and extension once (see :class:`BoundLaunch`).

    Args:
        launch: from :func:`reference.pack_launch` (CUDA tensors, fp16 or bf16), or built
            directly for K-major activations (``xt (K, ldx)``, ``yt (N, ldy)``), with an
            optional epilogue bias (``alpha = 1``, ``beta = 0``) and activation.
        kernel: the instance (default: :func:`select_for` the launch).
        ext: the extension (default: :func:`~cutlass_kernels.build.default_extension` for the
            device).

    Raises:
        ValueError: unsupported dtype, no instance wide enough for the tiles, or an epilogue
            the kernel refuses (a bias with ``alpha != 1`` or ``beta != 0``).
    """
    pw = launch.weight
    if pw.dtype not in DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    if launch.bias is not None and (launch.alpha != 1.0 or launch.beta != 0.0):
        raise ValueError(
            "a launch with an epilogue bias needs alpha = 1 and beta = 0, got "
            f"alpha={launch.alpha} beta={launch.beta}"
        )
    arch = toolchain.device_arch(launch.xt.device)
    ext = ext or build.default_extension(arch)
    if kernel is None:
        kernel = select_for(launch, ext)
    elif kernel.tile_g < pw.max_tile_width:
        raise ValueError(
            f"{kernel.name} covers tiles of {kernel.tile_g} columns, the layer has {pw.max_tile_width}"
        )
    return BoundLaunch(launch, kernel, ext)


def tw_gemm_kmajor(
    launch: reference.TWLaunch, *, kernel: TWKernel | None = None, ext: ModuleType | None = None
) -> torch.Tensor:
    """Run the kernel on packed arguments: ``launch.yt`` updated in place and returned.

    ``yt[col_idx[...], :batch] = act(alpha·acc + beta·yt[...])``, or ``act(acc + bias[...])``
    with a bias (:mod:`cutlass_kernels.epilogue`), on the current stream. One-off: a caller that
    launches the same buffers again binds them once (:func:`bind`).

    Args:
        launch: the packed arguments (as :func:`bind`).
        kernel: the instance (default: :func:`manifest.select` for the call).
        ext: the extension (default: :func:`~cutlass_kernels.build.default_extension` for the
            device).

    Raises:
        ValueError: as :func:`bind`.
    """
    bound = bind(launch, kernel=kernel, ext=ext)
    bound.run(torch.cuda.current_stream(launch.xt.device).cuda_stream)
    return launch.yt


def tw_linear_packed(
    x: torch.Tensor,
    weight: reference.TWPackedWeight,
    bias: torch.Tensor | None = None,
    *,
    kernel: TWKernel | None = None,
) -> torch.Tensor:
    """``Y = X · W + b`` on the GPU for an already packed weight.

    Includes the two layout changes a row-major caller needs (``X → X^T``, ``Y^T → Y``); a
    network kept K-major end to end calls :func:`tw_gemm_kmajor` and skips both.

    Args:
        x: ``(..., K)`` fp16/bf16 CUDA activations, ``weight``'s dtype and device.
        weight: from :func:`reference.pack_weight`, packed with tiles no wider than the
            instance that runs it (:func:`tile_limit`, or ``kernel.tile_g``).
        bias: optional ``(N,)``.
        kernel: the instance (default: :func:`select_for` the call).

    Returns:
        ``(..., N)`` in ``x.dtype``; pruned columns hold the bias (or zero).

    Raises:
        ValueError: ``x`` does not match the weight, or as :func:`tw_gemm_kmajor`.
    """
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {weight.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), weight.in_features)  # (-1 cannot be inferred when K = 0)
    launch = reference.pack_launch(x2, weight, bias)
    tw_gemm_kmajor(launch, kernel=kernel)
    return reference.unpack_output(launch).reshape(*lead, weight.out_features)
