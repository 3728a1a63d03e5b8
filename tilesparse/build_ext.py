"""Build and load the fast CPU kernel (``tilesparse/csrc/``: ``tw_linear_cpu.cpp`` fp32, ``tw_microkernel_avx2.h`` its AVX2 micro-kernel, ``tw_linear_lowp.cpp`` bf16/fp16/fp64, ``tw_linear_amx.cpp`` bf16 on AMX, ``tw_linear_bf16.cpp`` bf16 on AVX512-BF16, ``tw_common.h`` / ``tw_bf16_common.h``).

The extension is compiled with the machine's C++ compiler through
``torch.utils.cpp_extension`` (ninja), with ``-O3 -march=native``, into a cache folder::

    $XDG_CACHE_HOME/tilerec/tilesparse_cpu/<torch version>-<source hash>/   (default ~/.cache)

so a rebuild happens only when the source, the torch version, the compiler flags or the CPU
(its feature flags: :func:`cpu_identity`) change. ``make install`` runs ``python -m tilesparse.build_ext`` once; at runtime
:func:`load_extension` loads the cached build (building it first if it is missing) and
returns ``None`` after logging ONE warning when it cannot, in which case
:mod:`tilesparse.ops` uses the reference path.

Set ``TILESPARSE_DISABLE_EXT=1`` to force the reference path (used by the fallback test).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["build_dir", "build_extension", "cpu_identity", "load_extension", "main"]

log = logging.getLogger(__name__)

EXT_NAME = "tilesparse_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "tw_linear_cpu.cpp",
    CSRC / "tw_linear_lowp.cpp",
    CSRC / "tw_linear_amx.cpp",
    CSRC / "tw_linear_bf16.cpp",
)
HEADERS = (CSRC / "tw_common.h", CSRC / "tw_microkernel_avx2.h", CSRC / "tw_bf16_common.h")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_ENV = "TILESPARSE_DISABLE_EXT"


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (``/proc/cpuinfo``), else
    the platform's processor name. Part of the build hash, so a cache folder shared between
    machines (a home directory on NFS, a copied cache) never hands one CPU a build that uses
    instructions it lacks (SIGILL) or that leaves out kernels it has."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):  # x86 / arm64
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def build_dir() -> Path:
    """The cache folder of this source × checkout × torch version × flags × CPU."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    h = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        h.update(f.read_bytes())
    # ninja's build file names the source paths: two checkouts sharing one folder would rebuild
    # each other's build on every load
    h.update(str(CSRC).encode())
    h.update(" ".join(CFLAGS).encode())
    h.update(cpu_identity().encode())
    return base / "tilerec" / EXT_NAME / f"{torch.__version__}-{h.hexdigest()[:12]}"


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=EXT_NAME,
        sources=[str(f) for f in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        verbose=verbose,
    )


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType | None:
    """The compiled kernel module, or ``None`` (with one logged warning) if it cannot be
    built or loaded. Cached: the build is attempted at most once per process."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        log.warning(
            "tilesparse: fast CPU kernel disabled by %s; using the reference path (slow)",
            DISABLE_ENV,
        )
        return None
    try:
        return build_extension()
    except (RuntimeError, OSError, ImportError, SystemExit) as e:
        log.warning(
            "tilesparse: fast CPU kernel could not be built or loaded (%s: %s); "
            "using the reference path (slow). Rebuild with `python -m tilesparse.build_ext -v`.",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tilesparse.build_ext [-v]``; exit status 1 if the build failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="show compiler output")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        mod = build_extension(verbose=args.verbose)
    except (RuntimeError, OSError, ImportError) as e:
        log.error("tilesparse: build failed: %s", e)
        return 1
    log.info(
        "tilesparse: built %s (fp32 micro-kernel: %s) in %s", EXT_NAME, mod.simd(), build_dir()
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
