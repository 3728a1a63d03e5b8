"""Compile the emitted TW GEMMs, cached by input hash, into a torch extension.

* :func:`compile_object` — ``nvcc -c`` of one instance into
  ``$XDG_CACHE_HOME/tilerec/cutlass/objects/<hash>/<name>.o`` (no GPU needed; what CI runs).
* :func:`compile_objects` — many of them, in parallel.
* :func:`load_extension` — a torch extension: those objects linked with ``csrc/tw_binding.cpp``
  (``torch.utils.cpp_extension.load``, host compiler) and ``libcudart``, built under
  ``$XDG_CACHE_HOME/tilerec/cutlass/ext/<hash>/`` by :func:`extbuild.load`
  (one builder at a time, a killed build's lock cleared, one ninja). Needs nvcc; builds and
  imports with a CPU-only torch too (CI), runs kernels with a CUDA build of torch on a CUDA
  device.
* :func:`default_extension` — the extension a launch uses when given none.

Importing this module needs neither a GPU nor nvcc; every such dependency is checked at call
time with an error that says what is missing (:mod:`cutlass_kernels.toolchain`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

import cutlass_kernels.emit as emit
import cutlass_kernels.toolchain as toolchain
import extbuild
from cutlass_kernels.manifest import Arch, TWKernel, manifest

__all__ = [
    "CompileResult",
    "compile_object",
    "compile_objects",
    "default_extension",
    "load_extension",
]

log = logging.getLogger(__name__)


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
    nvcc = toolchain.require_nvcc(nvcc)
    version = toolchain.nvcc_version(nvcc)
    if not manifest(kernel.arch, version):
        raise RuntimeError(
            f"nvcc {version} cannot compile {kernel.arch.value} (needs a newer CUDA)"
        )
    src = emit.emit_instance(kernel)
    flags = [*emit.NVCC_FLAGS, *emit.nvcc_arch_flags(kernel.arch)]
    key = _key(src.text, " ".join(flags), f"nvcc {version}", emit._template_text())
    out_dir = (cache or toolchain.cache_dir()) / "objects" / key[:24]
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

    nvcc = toolchain.require_nvcc(nvcc)
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


# load_extension's memo: (arch, instance names or None for the whole manifest, skip_failed)
_LOADED: dict[tuple[str, tuple[str, ...] | None, bool], ModuleType] = {}
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
    arch = Arch(arch) if arch is not None else toolchain.device_arch()
    names = tuple(k.name for k in kernels) if kernels is not None else None
    memo = (arch.value, names, skip_failed)
    if memo in _LOADED:
        return _LOADED[memo]
    nvcc = toolchain.require_nvcc(None)
    kernels = (
        tuple(kernels) if kernels is not None else manifest(arch, toolchain.nvcc_version(nvcc))
    )
    if not kernels or any(k.arch is not arch for k in kernels):
        raise ValueError(f"kernels must be a non-empty list of {arch.value} instances")
    objects, failed = compile_objects(kernels, nvcc=nvcc, jobs=jobs, skip_failed=skip_failed)
    built = [k for k in kernels if k.name in objects]
    if not built:
        raise RuntimeError(
            f"no {arch.value} TW instance compiled; first error:\n{next(iter(failed.values()))}"
        )
    t0 = time.perf_counter()
    module = _link_extension(nvcc, [objects[k.name] for k in built], built, verbose)
    vars(module)["failed"] = dict(failed)  # the instances left out, with their errors
    if failed:
        log.warning(
            "TW extension built without %d instance(s) that failed to compile: %s",
            len(failed),
            ", ".join(sorted(failed)),
        )
    log.info(
        "TW extension %s (%d instances, %s, %d failed) ready in %.1f s",
        module.__name__,
        len(built),
        arch.value,
        len(failed),
        time.perf_counter() - t0,
    )
    _LOADED[memo] = module
    if names is None:
        _DEFAULT[arch.value] = module
    return module


def _link_extension(
    nvcc: str, objects: list[CompileResult], built: list[TWKernel], verbose: bool
) -> ModuleType:
    """Compile the binding and the instance table of ``built`` with the host compiler and link
    them with ``objects`` and ``libcudart``, under a folder named by the hash of all inputs."""
    toolkit = toolchain.cuda_toolkit_root(nvcc)
    include = toolchain.toolkit_include(toolkit)
    cudart = toolchain.cudart_library(toolkit)
    libdir = cudart.parent
    registry = emit.emit_registry(built)
    binding = emit.csrc_dir() / "tw_binding.cpp"
    key = _key(
        *(o.key for o in objects),
        registry.text,
        binding.read_text(),
        (emit.csrc_dir() / "tw_args.h").read_text(),
        str(include),
        str(cudart),
        f"torch {torch.__version__} cuda {torch.version.cuda}",
        sys.version,
        extbuild.toolchain_key(),
    )
    root = toolchain.cache_dir() / "ext" / key[:24]
    emit.write_sources([registry], root / "src")
    return extbuild.load(
        f"tilerec_tw_{key[:16]}",
        [str(binding)],
        root / "build",
        extra_cflags=["-O2"],
        extra_include_paths=[str(emit.csrc_dir()), str(root / "src"), str(include)],
        extra_ldflags=[
            *(str(o.path) for o in objects),
            f"-L{libdir}",
            f"-l:{cudart.name}",
            f"-Wl,-rpath,{libdir}",
        ],
        verbose=verbose,
        with_cuda=False,
    )


def default_extension(arch: Arch | str | None = None) -> ModuleType:
    """The extension a launch uses when given none: the last full-manifest build of ``arch``
    loaded in this process, else ``load_extension(arch, skip_failed=True)`` (an instance that
    does not compile is left out, with a warning, rather than failing every call)."""
    arch = Arch(arch) if arch is not None else toolchain.device_arch()
    return _DEFAULT.get(arch.value) or load_extension(arch, skip_failed=True)
