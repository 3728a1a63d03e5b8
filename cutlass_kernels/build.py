"""Compile the emitted TW GEMMs, cached by input hash, and hook them into ``tilesparse``.

* :func:`compile_object` — ``nvcc -c`` of one instance into
  ``$XDG_CACHE_HOME/tilerec/cutlass/objects/<hash>/<name>.o`` (no GPU needed; what CI runs).
* :func:`compile_objects` — many of them, in parallel.
* :func:`load_extension` — a torch extension: those objects linked with ``csrc/tw_binding.cpp``
  (``torch.utils.cpp_extension.load``, host compiler) and ``libcudart``, built under
  ``$XDG_CACHE_HOME/tilerec/cutlass/ext/<hash>/``. Needs nvcc; builds and imports with a
  CPU-only torch too (CI), runs kernels with a CUDA build of torch on a CUDA device.
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
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from cutlass_kernels import emit, reference
from cutlass_kernels.manifest import Arch, DType, Mainloop, TWKernel, manifest, select, widest_tile
from tilesparse.backend import Backend
from tilesparse.format import TWLayout, reference_matmul
from tilesparse.ops import check_op_inputs

__all__ = [
    "CompileResult",
    "cache_dir",
    "find_nvcc",
    "nvcc_version",
    "cuda_toolkit_root",
    "cudart_library",
    "compile_object",
    "compile_objects",
    "device_arch",
    "load_extension",
    "default_extension",
    "packed_weight",
    "select_for",
    "tile_limit",
    "MAINLOOP_ENV",
    "tw_gemm_kmajor",
    "tw_linear_cuda",
    "register_cuda_kernel",
    "OP_NAME",
]

log = logging.getLogger(__name__)

OP_NAME = "tilesparse::tw_linear"
_DTYPES = {torch.float16: DType.F16, torch.bfloat16: DType.BF16}


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
        capture_output=True,
        text=True,
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
        raise RuntimeError(
            f"nvcc {version} cannot compile {kernel.arch.value} (needs a newer CUDA)"
        )
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


def _toolkit_include(toolkit: Path) -> Path:
    """The toolkit's ``include`` (or its ``targets/<arch>-linux/include`` twin)."""
    for d in (toolkit / "include", *sorted((toolkit / "targets").glob("*-linux/include"))):
        if (d / "cuda_runtime_api.h").is_file():
            return d
    raise RuntimeError(
        f"no cuda_runtime_api.h under the CUDA toolkit {toolkit} (include/, targets/*/include/)"
    )


def cudart_library(toolkit: Path) -> Path:
    """The shared ``libcudart`` to link: the toolkit's (``lib64``, ``targets/*/lib``), else the
    one a CUDA build of torch ships (``nvidia/*/lib`` in site-packages, versioned name only).

    Raises:
        RuntimeError: none found (the places looked in are named).
    """
    dirs = [toolkit / "lib64", *sorted((toolkit / "targets").glob("*-linux/lib"))]
    dirs += sorted(Path(p).parent.parent / "lib" for p in _nvidia_runtime_markers())
    for d in dirs:
        found = sorted(d.glob("libcudart.so*"), key=lambda p: (len(p.name), p.name))
        if found:
            return found[0]  # libcudart.so when there, else libcudart.so.<major>
    raise RuntimeError(f"no shared libcudart in {[str(d) for d in dirs]}")


def _nvidia_runtime_markers() -> list[str]:
    import glob

    out: list[str] = []
    for site in sys.path:
        out += glob.glob(str(Path(site) / "nvidia" / "*" / "include" / "cuda_runtime_api.h"))
    return out


def compile_objects(
    kernels: tuple[TWKernel, ...] | list[TWKernel],
    *,
    nvcc: str | None = None,
    jobs: int | None = None,
    skip_failed: bool = False,
    cache: Path | None = None,
) -> tuple[dict[str, CompileResult], dict[str, str]]:
    """:func:`compile_object` for many instances, ``jobs`` nvcc processes at a time (default
    ``$MAX_JOBS``, else the CPU count), logging each as it finishes.

    Returns:
        ``(objects, failed)``: compiled instances by name, and the error of each that failed
        (only with ``skip_failed``).

    Raises:
        RuntimeError: an instance failed to compile and ``skip_failed`` is false.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    nvcc = _require_nvcc(nvcc)
    jobs = jobs or int(os.environ.get("MAX_JOBS") or 0) or os.cpu_count() or 1
    objects: dict[str, CompileResult] = {}
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(compile_object, k, nvcc=nvcc, cache=cache): k for k in kernels}
        for done, fut in enumerate(as_completed(futures), 1):
            k = futures[fut]
            try:
                objects[k.name] = res = fut.result()
            except RuntimeError as e:
                if not skip_failed:
                    for f in futures:
                        f.cancel()
                    raise
                failed[k.name] = str(e)
                log.error(
                    "[%d/%d] %s FAILED to compile: %s", done, len(kernels), k.name, str(e)[-800:]
                )
                continue
            how = "cached" if res.cached else f"{res.seconds:.0f} s"
            log.info(
                "[%d/%d] %s (%s; %.0f s elapsed)",
                done,
                len(kernels),
                k.name,
                how,
                time.perf_counter() - t0,
            )
    return objects, failed


_LOADED: dict[tuple[str, tuple[str, ...] | None, bool], ModuleType] = {}  # load_extension's memo
_DEFAULT: dict[str, ModuleType] = {}  # arch -> last full-manifest build (default_extension)


def load_extension(
    arch: Arch | str | None = None,
    kernels: tuple[TWKernel, ...] | list[TWKernel] | None = None,
    *,
    verbose: bool = False,
    skip_failed: bool = False,
    jobs: int | None = None,
) -> ModuleType:
    """Build (or load from the cache) the torch extension holding the TW GEMM instances.

    The instances are compiled one object each by :func:`compile_objects` (nvcc, in parallel,
    cached by input hash: the very objects CI compiles), then ``csrc/tw_binding.cpp`` and the
    generated instance table are compiled by ``torch.utils.cpp_extension`` with the host
    compiler and linked with the objects and the toolkit's ``libcudart``. The binding uses only
    torch's device-generic API, so the extension builds and imports with a CPU-only torch too
    (CI does so); running a kernel needs a CUDA device and a CUDA build of torch.

    Args:
        arch: architecture to build for (default: the current CUDA device's).
        kernels: instances to include (default: every manifest instance of ``arch`` that the
            installed nvcc can build).
        verbose: show the compiler commands of the binding build.
        skip_failed: leave out instances that fail to compile (their errors are in the
            module's ``failed`` dict) instead of raising; at least one must compile.
        jobs: parallel nvcc processes (default ``$MAX_JOBS``, else the CPU count).

    Returns:
        the extension module: ``tw_gemm(...)``, ``instances()``, and ``failed``.

    Raises:
        RuntimeError: nvcc missing, a compile or link error.
        ValueError: an empty instance list, or instances of another arch.
    """
    from torch.utils import cpp_extension

    arch = Arch(arch) if arch is not None else device_arch()
    names = tuple(k.name for k in kernels) if kernels is not None else None
    memo = (arch.value, names, skip_failed)
    if memo in _LOADED:
        return _LOADED[memo]
    nvcc = _require_nvcc(None)
    version = nvcc_version(nvcc)
    kernels = tuple(kernels) if kernels is not None else manifest(arch, version)
    if not kernels or any(k.arch is not arch for k in kernels):
        raise ValueError(f"kernels must be a non-empty list of {arch.value} instances")
    objects, failed = compile_objects(kernels, nvcc=nvcc, jobs=jobs, skip_failed=skip_failed)
    built = [k for k in kernels if k.name in objects]
    if not built:
        raise RuntimeError(
            f"no {arch.value} TW instance compiled; first error:\n{next(iter(failed.values()))}"
        )
    toolkit = cuda_toolkit_root(nvcc)
    include = _toolkit_include(toolkit)
    cudart = cudart_library(toolkit)
    libdir = cudart.parent
    registry = emit.emit_registry(built)
    binding = emit.csrc_dir() / "tw_binding.cpp"
    key = _key(
        *(objects[k.name].key for k in built),
        registry.text,
        binding.read_text(),
        (emit.csrc_dir() / "tw_args.h").read_text(),
        str(include),
        str(cudart),
        f"torch {torch.__version__} cuda {torch.version.cuda}",
        sys.version,
    )
    name = f"tilerec_tw_{key[:16]}"
    root = cache_dir() / "ext" / key[:24]
    emit.write_sources([registry], root / "src")
    build_dir = root / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(binding)],
        extra_cflags=["-O2"],
        extra_include_paths=[str(emit.csrc_dir()), str(root / "src"), str(include)],
        extra_ldflags=[
            *(str(objects[k.name].path) for k in built),
            f"-L{libdir}",
            f"-l:{cudart.name}",
            f"-Wl,-rpath,{libdir}",
        ],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=False,
    )
    module.failed = dict(failed)
    if failed:
        log.warning(
            "TW extension built without %d instance(s) that failed to compile: %s",
            len(failed),
            ", ".join(sorted(failed)),
        )
    log.info(
        "TW extension %s (%d instances, %s, %d failed) ready in %.1f s",
        name,
        len(built),
        arch.value,
        len(failed),
        time.perf_counter() - t0,
    )
    _LOADED[memo] = module
    if names is None:
        _DEFAULT[arch.value] = module
    return module


def default_extension(arch: Arch | str | None = None) -> ModuleType:
    """The extension :func:`tw_gemm_kmajor` uses when given none: the last full-manifest build
    of ``arch`` loaded in this process, else ``load_extension(arch, skip_failed=True)`` (an
    instance that does not compile is left out, with a warning, rather than failing every call)."""
    arch = Arch(arch) if arch is not None else device_arch()
    return _DEFAULT.get(arch.value) or load_extension(arch, skip_failed=True)


# Packed weights by id() of the layout's values tensor. tilesparse::tw_linear hands the CUDA
# implementation bare tensors (a fresh TWLayout per call, so nothing can be kept on one), and
# packing costs more than the kernel at small batches while a layer's tensors do not change
# between calls. A record holds weak references to the six layout tensors (a new tensor is not
# the old one, whatever its id), their versions (an in-place edit bumps them) and K, N; when
# any differs the layer is packed again. Entries leave with their values tensor.
_PackRecord = tuple[
    tuple[int, ...],  # versions of the six tensors, K, N
    tuple[weakref.ref, ...],  # the six tensors
    dict[
        tuple[torch.dtype, str, int | None], reference.TWPackedWeight
    ],  # by (dtype, device, max width)
]
_PACKED: dict[int, _PackRecord] = {}


def _packed(
    tensors: tuple[torch.Tensor, ...],
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layout: Callable[[], TWLayout],
    max_tile_width: int | None = None,
) -> reference.TWPackedWeight:
    """The packed weight of ``tensors`` (``col_idx, tile_ptr, row_idx, row_ptr, values,
    val_ptr``) for ``dtype``/``device``, tiles wider than ``max_tile_width`` split into
    sub-tiles, packed from ``layout()`` only when not in _PACKED."""
    device = str(torch.device(device))
    try:
        stamp = (*(t._version for t in tensors), in_features, out_features)
    except RuntimeError:  # inference-mode tensors have no version counter: pack every time
        return _pack(layout(), dtype, device, max_tile_width)
    values = tensors[4]
    key = id(values)
    rec = _PACKED.get(key)
    if rec is None or rec[0] != stamp or any(r() is not t for r, t in zip(rec[1], tensors)):
        refs = tuple(
            weakref.ref(t, (lambda _r, k=key: _PACKED.pop(k, None)) if t is values else None)
            for t in tensors
        )
        rec = (stamp, refs, {})
        _PACKED[key] = rec
    packs = rec[2]
    pkey = (dtype, device, max_tile_width)
    if pkey not in packs:
        packs[pkey] = _pack(layout(), dtype, device, max_tile_width)
    return packs[pkey]


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


def packed_weight(
    layout: TWLayout,
    dtype: torch.dtype,
    device: torch.device | str,
    max_tile_width: int | None = None,
) -> reference.TWPackedWeight:
    """The layout's packed weight for ``dtype``/``device`` (tiles wider than ``max_tile_width``
    packed as sub-tiles, see :func:`reference.pack_weight`): packed once per set of layout
    tensors, and again after any of them is replaced or edited in place (its version bumps).

    Raises:
        ValueError: an invalid layout (from :func:`reference.pack_weight`).
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
        tensors,
        layout.in_features,
        layout.out_features,
        dtype,
        device,
        lambda: layout,
        max_tile_width,
    )


MAINLOOP_ENV = "TILEREC_CUTLASS_MAINLOOP"


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
    if pw.dtype not in _DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    mainloop = _mainloop_env()
    arch = device_arch(launch.xt.device)
    kernels = _built(arch, ext)
    sms = torch.cuda.get_device_properties(launch.xt.device).multi_processor_count
    return select(
        kernels,
        _DTYPES[pw.dtype],
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
    ``dtype`` on ``device`` (built into ``ext``, default :func:`default_extension`; main loop as
    ``$TILEREC_CUTLASS_MAINLOOP`` says): the layer is packed with wider tiles split into
    sub-tiles of at most this many columns. None for a dtype without kernels, or when no
    instance of it was built.

    Raises:
        ValueError: a bad ``$TILEREC_CUTLASS_MAINLOOP``.
    """
    if dtype not in _DTYPES:
        return None
    mainloop = _mainloop_env()
    arch = device_arch(device)
    return widest_tile(_built(arch, ext or default_extension(arch)), _DTYPES[dtype], arch, mainloop)


def tw_gemm_kmajor(
    launch: reference.TWLaunch, *, kernel: TWKernel | None = None, ext: ModuleType | None = None
) -> torch.Tensor:
    """Run the kernel on packed arguments: ``launch.yt`` updated in place and returned.

    Args:
        launch: from :func:`reference.pack_launch` (CUDA tensors, fp16 or bf16), or built
            directly for K-major activations (``xt (K, ldx)``, ``yt (N, ldy)``).
        kernel: the instance (default: :func:`manifest.select` for the call).
        ext: the extension (default: :func:`default_extension` for the device).

    Raises:
        ValueError: unsupported dtype, or no instance wide enough for the tiles.
    """
    pw = launch.weight
    if pw.dtype not in _DTYPES:
        raise ValueError(f"the TW kernels take float16 or bfloat16, got {pw.dtype}")
    arch = device_arch(launch.xt.device)
    ext = ext or default_extension(arch)
    if kernel is None:
        kernel = select_for(launch, ext)
    elif kernel.tile_g < pw.max_tile_width:
        raise ValueError(
            f"{kernel.name} covers tiles of {kernel.tile_g} columns, the layer has {pw.max_tile_width}"
        )
    if pw.num_tiles and launch.batch:
        stream = torch.cuda.current_stream(launch.xt.device).cuda_stream
        ext.tw_gemm(
            kernel.name,
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
            stream,
        )
    return launch.yt


def tw_linear_cuda(
    x: torch.Tensor,
    layout: TWLayout,
    bias: torch.Tensor | None = None,
    *,
    kernel: TWKernel | None = None,
) -> torch.Tensor:
    """``Y = X · W + b`` on the GPU: ``x (..., K)`` fp16/bf16 CUDA → ``(..., N)``.

    Includes the two layout changes a row-major caller needs (``X → X^T``, ``Y^T → Y``); a
    network kept K-major end to end calls :func:`tw_gemm_kmajor` and skips both.
    """
    if x.shape[-1] != layout.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the layer expects {layout.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, layout.in_features)
    limit = kernel.tile_g if kernel is not None else tile_limit(x.dtype, x.device)
    y = _run_packed(x2, packed_weight(layout, x.dtype, x.device, limit), bias, kernel)
    return y.reshape(*lead, layout.out_features)


def _run_packed(
    x2: torch.Tensor,
    pw: reference.TWPackedWeight,
    bias: torch.Tensor | None,
    kernel: TWKernel | None = None,
) -> torch.Tensor:
    """``(M, K) → (M, N)`` through the kernel on an already packed weight."""
    launch = reference.pack_launch(x2, pw, bias)
    tw_gemm_kmajor(launch, kernel=kernel)
    return reference.unpack_output(launch)


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

    Runs the same checks as the CPU implementation first (``tilesparse.ops.check_op_inputs``:
    shapes, dtypes, contiguity, the backend for the device, the layout's offsets and indices),
    then the reference, the emulation or the kernel on the cached packed weight. Tiles wider
    than the widest built instance (``G = 128``) are packed as sub-tiles of at most ``G``
    columns that share the tile's kept rows (exact), so any tile width runs on the kernel;
    ``auto`` runs the reference (one logged warning) only when no instance of the dtype was
    built for the device.

    Raises:
        ValueError: as ``check_op_inputs``; backend ``cpu`` (for a CPU tensor that reached
            this implementation directly); ``cutlass`` for a dtype other than fp16/bf16.
    """
    be = check_op_inputs(
        x, col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr, bias, out_features, backend
    )
    tensors = (col_idx, tile_ptr, row_idx, row_ptr, values, val_ptr)

    def layout() -> TWLayout:
        widths = tile_ptr[1:] - tile_ptr[:-1]
        tile = int(widths.max()) if widths.numel() else 1
        return TWLayout(x.shape[1], out_features, max(tile, 1), *tensors)

    if be is Backend.CPU:
        raise ValueError(
            f"backend 'cpu' is the CPU kernel; the CUDA implementation got it for a {x.device.type} tensor"
        )
    if be is Backend.REFERENCE:
        return reference_matmul(x, layout(), bias)
    if be is Backend.EMULATED:
        return reference.tw_linear_emulated(x, layout(), bias)
    if x.dtype not in _DTYPES:
        if be is Backend.CUTLASS:
            raise ValueError(f"backend 'cutlass' takes float16 or bfloat16 inputs, got {x.dtype}")
        return reference_matmul(x, layout(), bias)  # "auto" on fp32/fp64: no 16-bit kernel applies
    # Tiles wider than the widest built instance are packed as sub-tiles (exact), so every
    # valid tile width runs on the kernel.
    limit = tile_limit(x.dtype, x.device)
    if limit is None and be is Backend.AUTO:  # no instance of this dtype was built
        if x.dtype not in _NO_KERNEL_WARNED:
            _NO_KERNEL_WARNED.add(x.dtype)
            log.warning(
                "no %s TW kernel instance is built for this device: backend 'auto' runs "
                "the reference",
                x.dtype,
            )
        return reference_matmul(x, layout(), bias)
    pw = _packed(tensors, x.shape[1], out_features, x.dtype, x.device, layout, limit)
    return _run_packed(x, pw, bias)


_NO_KERNEL_WARNED: set[torch.dtype] = set()


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
