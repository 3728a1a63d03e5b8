"""Compile the emitted TW GEMMs, cached by input hash, and hook them into ``tilesparse``.

* :func:`compile_object` — ``nvcc -c`` of one instance into
  ``$XDG_CACHE_HOME/tilerec/cutlass/objects/<hash>/<name>.o`` (no GPU needed; what CI runs).
* :func:`load_extension` — a torch extension (``torch.utils.cpp_extension.load``) with every
  instance for one architecture plus ``csrc/tw_binding.cpp``, built under
  ``$XDG_CACHE_HOME/tilerec/cutlass/ext/<hash>/`` (needs nvcc and a CUDA build of torch).
* :func:`tw_gemm_kmajor` / :func:`tw_linear_cuda` — run it (K-major, or ``(M, K) → (M, N)``).
* :func:`register_cuda_kernel` — registers the CUDA implementation of
  ``tilesparse::tw_linear``; ``tilesparse.ops`` calls it lazily when a CUDA tensor arrives.

Importing this module needs neither a GPU nor nvcc; every such dependency is checked at call
time with an error that says what is missing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from cutlass_kernels import emit, reference
from cutlass_kernels.manifest import Arch, DType, TWKernel, manifest, select
from tilesparse.format import TWLayout, reference_matmul

__all__ = [
    "CompileResult",
    "cache_dir",
    "find_nvcc",
    "nvcc_version",
    "cuda_toolkit_root",
    "compile_object",
    "device_arch",
    "load_extension",
    "packed_weight",
    "select_for",
    "tw_gemm_kmajor",
    "tw_linear_cuda",
    "register_cuda_kernel",
    "OP_NAME",
]

log = logging.getLogger(__name__)

OP_NAME = "tilesparse::tw_linear"
_CACHE_KEY = "cutlass"  # TWLayout.cache key of the packed weights
_DTYPES = {torch.float16: DType.F16, torch.bfloat16: DType.BF16}
# torch.utils.cpp_extension compiles .cu files with -D__CUDA_NO_HALF_OPERATORS__ etc.; CUTLASS's
# half_t/bfloat16_t want cuda_fp16/cuda_bf16 complete, so the extension undoes them (as CUTLASS
# based torch extensions do). compile_object never sets them.
_UNDO_TORCH_NVCC_DEFINES = (
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
)


@dataclass(frozen=True)
class CompileResult:
    """One compiled object.

    Attributes:
        path: the ``.o`` file.
        seconds: wall time of the nvcc run (0 when it came from the cache).
        cached: whether the object was already in the cache.
        key: sha256 hex of everything that determines the object.
    """

    path: Path
    seconds: float
    cached: bool
    key: str


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tilerec/cutlass`` (``~/.cache/tilerec/cutlass`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilerec" / "cutlass"


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH`` or ``PATH``; ``None`` when there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_version(nvcc: str) -> tuple[int, int]:
    """``(major, minor)`` of an nvcc.

    Raises:
        RuntimeError: when its ``--version`` output has no ``release X.Y``.
    """
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`: {out!r}")
    return int(m.group(1)), int(m.group(2))


def cuda_toolkit_root(nvcc: str) -> Path:
    """The CUDA toolkit root nvcc really runs from (its ``TOP`` in ``nvcc --dryrun``).

    Raises:
        RuntimeError: when the dry run names no ``TOP``.
    """
    proc = subprocess.run(
        [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
        capture_output=True, text=True,
    )
    m = re.search(r"^#\$ TOP=(.+?)\s*$", proc.stdout + proc.stderr, re.MULTILINE)
    if not m:
        raise RuntimeError(f"cannot find the CUDA toolkit root from `{nvcc} --dryrun`")
    return Path(m.group(1)).resolve()


def _require_nvcc(nvcc: str | None) -> str:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError(
            "nvcc not found (set CUDA_HOME or put nvcc on PATH): the CUTLASS TW kernels "
            "cannot be compiled"
        )
    return nvcc


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p.encode())
    return h.hexdigest()


def compile_object(
    kernel: TWKernel, *, nvcc: str | None = None, cache: Path | None = None
) -> CompileResult:
    """``nvcc -c`` one instance for its architecture, cached by the hash of its emitted source,
    the template headers, the flags and the nvcc version.

    Raises:
        RuntimeError: nvcc missing, too old for the arch, or failing (its stderr included).
    """
    nvcc = _require_nvcc(nvcc)
    version = nvcc_version(nvcc)
    if not manifest(kernel.arch, version):
        raise RuntimeError(f"nvcc {version} cannot compile {kernel.arch.value} (needs a newer CUDA)")
    src = emit.emit_instance(kernel)
    flags = [*emit.NVCC_FLAGS, *emit.nvcc_arch_flags(kernel.arch)]
    key = _key(src.text, " ".join(flags), f"nvcc {version}", emit._template_text())
    out_dir = (cache or cache_dir()) / "objects" / key[:24]
    obj = out_dir / f"{kernel.name}.o"
    if obj.is_file():
        return CompileResult(obj, 0.0, True, key)
    out_dir.mkdir(parents=True, exist_ok=True)
    includes = [emit.csrc_dir(), *emit.cutlass_include_dirs()]
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        cu = Path(tmp) / src.name
        cu.write_text(src.text)
        tmp_obj = Path(tmp) / obj.name
        cmd = [nvcc, "-c", *flags, *(f"-I{d}" for d in includes), str(cu), "-o", str(tmp_obj)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"nvcc failed ({proc.returncode}) on {kernel.name}:\n{proc.stderr[-4000:]}"
            )
        tmp_obj.replace(obj)
    log.info("compiled %s for %s in %.1f s", kernel.name, kernel.arch.value, seconds)
    return CompileResult(obj, seconds, False, key)


def device_arch(device: torch.device | int | None = None) -> Arch:
    """The manifest architecture to build for a CUDA device (sm_90 → sm_90a, 8.x → sm_80).

    Raises:
        RuntimeError: for a device older than sm_80.
    """
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return Arch.SM90A
    if major >= 8:
        return Arch.SM80  # 8.x runs sm_80 SASS; newer majors JIT the sm_80 PTX (see below)
    raise RuntimeError(f"the TW kernels need compute capability >= 8.0, got {major}.{minor}")


def load_extension(
    arch: Arch | str | None = None,
    kernels: tuple[TWKernel, ...] | list[TWKernel] | None = None,
    *,
    verbose: bool = False,
) -> ModuleType:
    """Build (or load from the cache) the torch extension holding the TW GEMM instances.

    Args:
        arch: architecture to build for (default: the current CUDA device's).
        kernels: instances to include (default: every manifest instance of ``arch``).
        verbose: show the compiler commands.

    Returns:
        the extension module (``tw_gemm(...)``, ``instances()``), registered in
        ``sys.modules`` under a name derived from its input hash so later calls reuse it.

    Raises:
        RuntimeError: nvcc or a CUDA build of torch missing, or a compile error.
    """
    from torch.utils import cpp_extension

    arch = Arch(arch) if arch is not None else device_arch()
    nvcc = _require_nvcc(None)
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU build; the TW kernels need CUDA torch")
    # cpp_extension guesses CUDA_HOME as nvcc's grandparent, which is wrong when nvcc on PATH is
    # a wrapper or link (/usr/local/bin/nvcc -> /usr/local/cuda-X/bin/nvcc): ask nvcc itself.
    toolkit = cuda_toolkit_root(nvcc)
    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "include" / "cuda_runtime_api.h").is_file():
        log.info("using CUDA toolkit %s for the torch extension (cpp_extension had %s)", toolkit, home)
        cpp_extension.CUDA_HOME = str(toolkit)
    # Fast path for repeated calls: everything that names the build except the nvcc version
    # (which needs a subprocess); the full key below also covers the version.
    lookup = "tilerec_twl_" + _key(
        arch.value, ",".join(k.name for k in kernels) if kernels is not None else "<all>",
        emit.GENERATOR_VERSION, emit._template_text(), (emit.csrc_dir() / "tw_binding.cpp").read_text(),
        nvcc, torch.__version__,
    )[:16]
    if lookup in sys.modules:
        return sys.modules[lookup]
    version = nvcc_version(nvcc)
    kernels = tuple(kernels) if kernels is not None else manifest(arch, version)
    if not kernels or any(k.arch is not arch for k in kernels):
        raise ValueError(f"kernels must be a non-empty list of {arch.value} instances")
    files = emit.emit_sources(kernels)
    arch_flags = emit.nvcc_arch_flags(arch)
    if arch is Arch.SM80:  # PTX too, so GPUs newer than 8.x can JIT it
        arch_flags += ["-gencode", "arch=compute_80,code=compute_80"]
    binding = (emit.csrc_dir() / "tw_binding.cpp").read_text()
    key = _key(
        emit.sources_hash(files), binding, emit._template_text(), " ".join(arch_flags),
        f"nvcc {version}", f"torch {torch.__version__} cuda {torch.version.cuda}",
    )
    name = f"tilerec_tw_{key[:16]}"
    if name in sys.modules:
        sys.modules[lookup] = sys.modules[name]
        return sys.modules[name]
    root = cache_dir() / "ext" / key[:24]
    src_paths = emit.write_sources(files, root / "src")
    build_dir = root / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(emit.csrc_dir() / "tw_binding.cpp"), *(str(p) for p in src_paths if p.suffix == ".cu")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[*emit.NVCC_FLAGS, *_UNDO_TORCH_NVCC_DEFINES, *arch_flags],
        extra_include_paths=[str(emit.csrc_dir()), str(root / "src"), *map(str, emit.cutlass_include_dirs())],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=True,
    )
    log.info("TW extension %s (%d instances, %s) ready in %.1f s", name, len(kernels), arch.value,
             time.perf_counter() - t0)
    sys.modules[name] = sys.modules[lookup] = module
    return module


def packed_weight(layout: TWLayout, dtype: torch.dtype, device: torch.device) -> reference.TWPackedWeight:
    """The layout's packed weight for ``dtype``/``device``, cached in ``layout.cache``."""
    per_layout = layout.cache.setdefault(_CACHE_KEY, {})
    key = (dtype, str(device))
    if key not in per_layout:
        per_layout[key] = reference.pack_weight(layout, dtype=dtype, device=device)
    return per_layout[key]


def select_for(launch: reference.TWLaunch) -> TWKernel:
    """The instance :func:`tw_gemm_kmajor` uses by default for ``launch`` (its device's arch,
    :func:`manifest.select` with the device's SM count)."""
    pw = launch.weight
    if pw.dtype not in _DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    arch = device_arch(launch.xt.device)
    sms = torch.cuda.get_device_properties(launch.xt.device).multi_processor_count
    return select(manifest(arch), _DTYPES[pw.dtype], arch, pw.max_tile_width, launch.batch,
                  pw.num_tiles, sms)


def tw_gemm_kmajor(
    launch: reference.TWLaunch, *, kernel: TWKernel | None = None, ext: ModuleType | None = None
) -> torch.Tensor:
    """Run the kernel on packed arguments: ``launch.yt`` updated in place and returned.

    Args:
        launch: from :func:`reference.pack_launch` (CUDA tensors, fp16 or bf16), or built
            directly for K-major activations (``xt (K, ldx)``, ``yt (N, ldy)``).
        kernel: the instance (default: :func:`manifest.select` for the call).
        ext: the extension (default: :func:`load_extension` for the device).

    Raises:
        ValueError: unsupported dtype, or no instance wide enough for the tiles.
    """
    pw = launch.weight
    if pw.dtype not in _DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    arch = device_arch(launch.xt.device)
    ext = ext or load_extension(arch)
    if kernel is None:
        kernel = select_for(launch)
    elif kernel.tile_g < pw.max_tile_width:
        raise ValueError(f"{kernel.name} covers tiles of {kernel.tile_g} columns, the layer has {pw.max_tile_width}")
    if pw.num_tiles and launch.batch:
        ext.tw_gemm(kernel.name, pw.tile_meta, pw.col_idx, pw.row_idx, pw.w, pw.lda, launch.xt,
                    launch.yt, launch.batch, launch.alpha, launch.beta)
    return launch.yt


def tw_linear_cuda(
    x: torch.Tensor, layout: TWLayout, bias: torch.Tensor | None = None, *, kernel: TWKernel | None = None
) -> torch.Tensor:
    """``Y = X · W + b`` on the GPU: ``x (..., K)`` fp16/bf16 CUDA → ``(..., N)``.

    Includes the two layout changes a row-major caller needs (``X → X^T``, ``Y^T → Y``); a
    network kept K-major end to end calls :func:`tw_gemm_kmajor` and skips both.
    """
    if x.shape[-1] != layout.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {layout.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, layout.in_features)
    pw = packed_weight(layout, x.dtype, x.device)
    launch = reference.pack_launch(x2, pw, bias)
    tw_gemm_kmajor(launch, kernel=kernel)
    return reference.unpack_output(launch).reshape(*lead, layout.out_features)


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
    """CUDA implementation of ``tilesparse::tw_linear`` (x is ``(M, K)``)."""
    widths = tile_ptr[1:] - tile_ptr[:-1]
    tile = int(widths.max()) if widths.numel() else 1
    layout = TWLayout(x.shape[-1], out_features, max(tile, 1), col_idx, tile_ptr, row_idx,
                      row_ptr, values, val_ptr)
    backend = str(getattr(backend, "value", backend)).lower()
    if backend == "reference":
        return reference_matmul(x, layout, bias)
    if backend == "emulated":
        return reference.tw_linear_emulated(x, layout, bias)
    if x.dtype not in _DTYPES:
        if backend == "cutlass":
            raise ValueError(f"backend 'cutlass' takes float16 or bfloat16 inputs, got {x.dtype}")
        return reference_matmul(x, layout, bias)  # "auto" on fp32: no 16-bit kernel applies
    return tw_linear_cuda(x, layout, bias)


def register_cuda_kernel() -> bool:
    """Register the CUDA implementation of ``tilesparse::tw_linear`` (idempotent).

    The kernels are compiled on the first CUDA call, not here.

    Returns:
        True when the implementation is registered; False (with the reason logged) when this
        machine has no CUDA device, no CUDA torch or no nvcc.

    Raises:
        RuntimeError: ``tilesparse.ops`` does not define the op.
    """
    if not torch.cuda.is_available():
        log.info("no CUDA device: %s CUDA kernel not registered", OP_NAME)
        return False
    if find_nvcc() is None:
        log.warning("nvcc not found: %s CUDA kernel not registered", OP_NAME)
        return False
    import tilesparse.ops  # noqa: F401  (defines the op)

    ns, op = OP_NAME.split("::")
    if not hasattr(getattr(torch.ops, ns), op):
        raise RuntimeError(f"{OP_NAME} is not defined (tilesparse.ops must define it first)")
    if torch._C._dispatch_has_kernel_for_dispatch_key(OP_NAME, "CUDA"):
        return True
    torch.library.register_kernel(OP_NAME, "cuda", _op_impl)
    return True
