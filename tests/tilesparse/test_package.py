"""The package's public surface: the names of ``__all__``, the root doctest, and what importing
it does not pull in (no CUDA glue, no ``cutlass_kernels``, not the build CLI)."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from pathlib import Path

import tilesparse
import tilesparse.kernels

REPO = Path(__file__).resolve().parents[2]  # this checkout's packages, not an installed copy


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""},
    )


def test_public_names() -> None:
    for pkg in (tilesparse, tilesparse.kernels):
        assert pkg.__doc__
        missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
        assert not missing, (pkg.__name__, missing)
    for name in ("prune_", "TileSparseConfig", "TileSparseLinear", "TileSparsePruner"):
        assert name in tilesparse.__all__


def test_root_doctest_runs() -> None:
    assert doctest.testmod(tilesparse).failed == 0


def test_import_pulls_in_no_cuda_glue_and_no_cli() -> None:
    proc = _run(
        "-c",
        "import sys, tilesparse, tilesparse.kernels;"
        "bad = [m for m in sys.modules if m.startswith('cutlass')"
        " or m in ('tilesparse.kernels.cuda', 'tilesparse.build_ext')]; assert not bad, bad",
    )
    assert proc.returncode == 0, proc.stderr


def test_build_ext_runs_as_a_module_without_a_runpy_warning() -> None:
    # runpy warns when the package imports the module it is asked to run
    proc = _run("-W", "error::RuntimeWarning", "-m", "tilesparse.build_ext", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "fast CPU kernel" in proc.stdout and "found in sys.modules" not in proc.stderr
