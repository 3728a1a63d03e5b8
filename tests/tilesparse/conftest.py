"""Fixtures of the tilesparse tests: the compiled CPU kernel and the CPU's feature flags."""

from __future__ import annotations

from types import ModuleType

import pytest

from tilesparse.kernels import cpu as cpu_kernels


@pytest.fixture
def ext(require) -> ModuleType:
    """The compiled CPU kernel (built into the cache on first use; ``make install`` already does)."""
    mod = cpu_kernels.load_extension()
    require(mod is not None, "the compiled tilesparse CPU kernel (python -m tilesparse.build_ext)")
    return mod


@pytest.fixture(scope="session")
def cpu_flags() -> set[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
