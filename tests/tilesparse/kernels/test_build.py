"""The CPU kernel's build: one ninja whatever ``PATH`` says, and a cache folder per toolchain.

``make demo`` runs the venv's python with the system ninja first on ``PATH``; an activated venv
has the venv's ninja first. A ninja that finds another version's ``.ninja_log`` rebuilds
everything (80–170 s for the real kernel), so the two must run the same ninja. The build here
is the production ``build_extension`` on a one-second source
(:mod:`tests.tilesparse.kernels.build_probe`) in child processes with the two ``PATH`` orders.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

import extbuild
import tilesparse.kernels.cpu as cpu_kernels
from tests.tilesparse.kernels import build_probe as probe

BUILD_S = 300  # one build of the probe takes seconds; only a hang reaches this


def _other_ninja(interpreters: Path) -> Path:
    """A ninja that is not the interpreter environment's: another version when the machine
    has one (a system ninja), else the same binary."""
    ours = interpreters.resolve()
    version = extbuild.ninja_version(interpreters)
    for folder in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/usr/local/bin"]:
        candidate = Path(folder) / "ninja"
        if candidate.is_file() and candidate.resolve() != ours:
            if extbuild.ninja_version(candidate) != version:
                return candidate
    return ours


def _decoy(folder: Path, real: Path) -> Path:
    """A folder whose ``ninja`` records each call in ``folder/decoy-calls`` and runs ``real``."""
    bin_dir = folder / "decoy-bin"
    bin_dir.mkdir()
    ninja = bin_dir / "ninja"
    ninja.write_text(f'#!/bin/sh\necho "$@" >> {folder / "decoy-calls"}\nexec {real} "$@"\n')
    ninja.chmod(ninja.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _build(source: Path, env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tilesparse.kernels.build_probe", str(source)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"PROBE {probe.ANSWER}" in proc.stdout, proc.stdout + proc.stderr
    return proc.stderr


@pytest.mark.slow
def test_make_and_an_activated_venv_run_one_ninja_and_never_rebuild_each_other(
    tmp_path: Path, require: Callable[[bool, str], None]
) -> None:
    require(bool(shutil.which("g++") or shutil.which("c++")), "a C++ compiler (g++)")
    scripts = Path(sysconfig.get_path("scripts"))
    require((scripts / "ninja").is_file(), f"ninja in the interpreter's environment ({scripts})")
    source = probe.write_source(tmp_path)
    decoy = _decoy(tmp_path, _other_ninja(scripts / "ninja"))
    base = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != scripts]
    make_path = os.pathsep.join([str(decoy), *base])  # the venv's python, another ninja first
    venv_path = os.pathsep.join([str(scripts), *make_path.split(os.pathsep)])  # activated
    cache, cxx = tmp_path / "cache", probe.slow_compiler(tmp_path)

    def env(path: str) -> dict[str, str]:
        return probe.probe_env(
            cache, PATH=path, CXX=str(cxx), PROBE_MARK=str(tmp_path / "compiles")
        )

    _build(source, env(make_path), tmp_path)
    built = probe.object_files(cache)
    assert len(built) == 1 and (tmp_path / "compiles").read_text().count("\n") == 1
    for path in (venv_path, make_path):
        _build(source, env(path), tmp_path)
        assert probe.object_files(cache) == built  # nothing compiled, in this folder or another
    assert (tmp_path / "compiles").read_text().count("\n") == 1
    assert not (tmp_path / "decoy-calls").exists()  # PATH's first ninja never ran


def test_the_build_folder_follows_the_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two environments sharing a cache keep a build each: another ninja version, Python or
    torch install is another folder."""
    here = cpu_kernels.build_dir()
    ninja = extbuild.find_ninja()
    assert ninja is not None
    key = extbuild.toolchain_key()
    assert f"ninja {extbuild.ninja_version(ninja)} |" in key and sys.implementation.cache_tag in key
    monkeypatch.setattr(extbuild, "toolchain_key", lambda: key.replace("ninja", "ninja 0.0"))
    other = cpu_kernels.build_dir()
    assert other != here and other.parent == here.parent
