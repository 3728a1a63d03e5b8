"""The compiled CPU kernels of the parameter server: built, loaded, or ``None``.

Source: ``hps/csrc/fused_lookup.cpp`` and the headers beside it — ``cache_gather`` (every table's cache-hit rows or
bags in one call, rows of any :class:`hps.rowformat.RowDtype` dequantized, :mod:`hps.fused`),
``gather_rows`` (stored rows by slot, dequantized, or bags of them summed in order:
:func:`hps.fused.gather_rows`) and ``KeyCounter`` (exact key counts in O(keys) per update,
:mod:`hps.key_counts`).

Built with the machine's C++ compiler through :func:`cutlass_kernels.torch_ext.load` (one
builder per folder at a time, one ninja) with ``-O3 -march=native`` into a cache folder::

    $XDG_CACHE_HOME/tilerec/hps_cpu/<torch version>-<source hash>/   (default ~/.cache)

``make install`` builds it once (``python -m hps.build_ext``); at runtime :func:`load_extension`
loads the cached build (building it first when missing) and returns ``None`` after ONE logged
warning when it cannot: every caller then takes the pure-torch reference path
(:func:`hps.fused.gather_reference`, :func:`hps.fused.gather_rows_reference`), which gives
bit-identical results.

Set ``HPS_DISABLE_EXT=1`` to force the reference path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["DISABLE_ENV", "EXT_NAME", "build_dir", "build_extension", "load_extension"]

log = logging.getLogger(__name__)

EXT_NAME = "hps_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "fused_lookup.cpp",)
HEADERS = (
    CSRC / "common.h",
    CSRC / "gather_checks.h",
    CSRC / "key_counter.h",
    CSRC / "row_formats.h",
)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
DISABLE_ENV = "HPS_DISABLE_EXT"


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for (the CPU's feature flags), so a cache folder shared
    between machines never hands one CPU a build using instructions it lacks."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):  # x86 / arm64
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def build_dir() -> Path:
    """The cache folder of this source × checkout × flags × CPU × toolchain."""
    from cutlass_kernels import torch_ext

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    h = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        h.update(f.read_bytes())
    h.update(str(CSRC).encode())  # ninja's build file names the source paths
    h.update(" ".join(CFLAGS).encode())
    h.update(_cpu_flags().encode())
    h.update(torch_ext.toolchain_key().encode())
    return base / "tilerec" / EXT_NAME / f"{torch.__version__}-{h.hexdigest()[:12]}"


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    from cutlass_kernels import torch_ext

    return torch_ext.load(
        EXT_NAME,
        [str(f) for f in SOURCES],
        build_dir(),
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType | None:
    """The compiled module, or ``None`` (with one logged warning) when it cannot be built or
    loaded, or when ``HPS_DISABLE_EXT`` is set. Cached: built at most once per process."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        log.warning(
            "hps: compiled lookup kernel disabled by %s; using the reference path", DISABLE_ENV
        )
        return None
    try:
        return build_extension()
    except (RuntimeError, OSError, ImportError, SystemExit) as e:
        log.warning(
            "hps: compiled lookup kernel could not be built or loaded (%s: %s); using the "
            "reference path. Rebuild with `python -m hps.build_ext -v`.",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None
