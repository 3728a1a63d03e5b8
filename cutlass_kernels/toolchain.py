"""The CUDA toolchain the TW kernels are built with, and the device they are built for.

* :func:`find_nvcc`, :func:`nvcc_version`, :func:`require_nvcc` — the compiler.
* :func:`cuda_toolkit_root`, :func:`toolkit_include`, :func:`cudart_library` — what the
  torch extension is compiled against and linked with.
* :func:`cache_dir` — ``$XDG_CACHE_HOME/tilerec/cutlass``, where objects and extensions live.
* :func:`device_arch` — the manifest architecture of a CUDA device.

Nothing here runs at import: each function looks when it is called and says what is missing.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from cutlass_kernels.manifest import Arch

__all__ = [
    "CACHE_ENV",
    "cache_dir",
    "cuda_toolkit_root",
    "cudart_library",
    "device_arch",
    "find_nvcc",
    "nvcc_version",
    "require_nvcc",
    "toolkit_include",
]


CACHE_ENV = "TILEREC_CUTLASS_CACHE"  # a cache folder of its own (e.g. objects built elsewhere)


def cache_dir() -> Path:
    """``$TILEREC_CUTLASS_CACHE`` when set (objects compiled on another machine and carried
    over), else ``$XDG_CACHE_HOME/tilerec/cutlass`` (``~/.cache/tilerec/cutlass`` by default)."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilerec" / "cutlass"


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH`` or ``PATH``; ``None`` when there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def require_nvcc(nvcc: str | None = None) -> str:
    """``nvcc`` when given, else :func:`find_nvcc`'s.

    Raises:
        RuntimeError: no nvcc was given and none is found.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError(
            "nvcc not found (set CUDA_HOME or put nvcc on PATH): the CUTLASS TW kernels "
            "cannot be compiled"
        )
    return nvcc


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


def toolkit_include(toolkit: Path) -> Path:
    """The toolkit's ``include`` (or its ``targets/<arch>-linux/include`` twin).

    Raises:
        RuntimeError: neither holds ``cuda_runtime_api.h``.
    """
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
    """``nvidia/*/include/cuda_runtime_api.h`` of the CUDA runtime wheels on ``sys.path``."""
    out: list[str] = []
    for site in sys.path:
        out += glob.glob(str(Path(site) / "nvidia" / "*" / "include" / "cuda_runtime_api.h"))
    return out


def device_arch(device: torch.device | str | int | None = None) -> Arch:
    """The manifest architecture to build for a CUDA device (sm_90 → sm_90a, 8.x → sm_80).

    Raises:
        RuntimeError: for a device older than sm_80.
    """
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return Arch.SM90A
    if major >= 8:
        return Arch.SM80  # 8.x runs sm_80 SASS; newer majors JIT the sm_80 PTX
    raise RuntimeError(f"the TW kernels need compute capability >= 8.0, got {major}.{minor}")
