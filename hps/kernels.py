"""The compiled CPU kernels of the parameter server: built, loaded, or ``None``.

Source: ``hps/csrc/fused_lookup.cpp`` and the headers beside it — ``cache_gather`` (every table's cache-hit rows or
bags in one call, rows of any :class:`hps.rowformat.RowDtype` dequantized, :mod:`hps.fused`),
``gather_rows`` (stored rows by slot, dequantized, or bags of them summed in order:
:func:`hps.fused.gather_rows`), ``static_gather`` (the all-hit rows or bags of full static
caches, :mod:`hps.session.static_gather`) and ``KeyCounter`` (exact key counts in O(keys) per update,
:mod:`hps.key_counts`).

Built with the machine's C++ compiler through :func:`extbuild.load` (one
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
from pathlib import Path
from types import ModuleType

from extbuild import CpuExtension

__all__ = ["DISABLE_ENV", "EXT", "EXT_NAME", "build_dir", "build_extension", "load_extension"]

EXT_NAME = "hps_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
DISABLE_ENV = "HPS_DISABLE_EXT"
EXT = CpuExtension(
    name=EXT_NAME,
    label="hps: compiled lookup kernel",
    sources=(CSRC / "fused_lookup.cpp",),
    headers=(
        CSRC / "cache_probe.h",
        CSRC / "cache_tables.h",
        CSRC / "common.h",
        CSRC / "dense_rows.h",
        CSRC / "first_hits.h",
        CSRC / "gather_checks.h",
        CSRC / "key_counter.h",
        CSRC / "pooled_bags.h",
        CSRC / "probe_pass.h",
        CSRC / "row_formats.h",
        CSRC / "slot_uses.h",
        CSRC / "static_gather.h",
    ),
    cflags=("-O3", "-march=native", "-fopenmp", "-fvisibility-inlines-hidden"),
    disable_env=DISABLE_ENV,
    build_command="python -m hps.build_ext -v",
    logger=__name__,
)


def build_dir() -> Path:
    """The cache folder of this source × checkout × flags × CPU × toolchain
    (:meth:`~extbuild.CpuExtension.build_dir`)."""
    return EXT.build_dir()


def build_extension(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    return EXT.build(verbose)


@functools.lru_cache(maxsize=1)
def load_extension() -> ModuleType | None:
    """The compiled module, or ``None`` (with one logged warning) when it cannot be built or
    loaded, or when ``HPS_DISABLE_EXT`` is set. Cached: built at most once per process."""
    return EXT.load_or_none()
