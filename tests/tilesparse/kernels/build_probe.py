"""A tiny extension built by the production CPU build (``tilesparse.kernels.cpu.build_extension``),
for tests of the build itself: its lock, its cache folder, its ninja.

Run in a child process (the build is process-wide state: torch's loaded extensions, the lock,
PATH)::

    python -m tests.tilesparse.kernels.build_probe SOURCE.cpp

The child swaps the real kernel sources for ``SOURCE.cpp`` (a C++ Python module, see
:func:`write_source`, compiled in a second instead of minutes) and calls the real
``build_extension``; everything else is the production path: the cache folder under
``$XDG_CACHE_HOME``, torch's ``cpp_extension.load``, the compiler from ``$CXX``, ninja.
It prints ``PROBE <answer>`` when the module imports and answers.

:func:`slow_compiler` writes a ``$CXX`` that records each compile it starts (one line, its pid,
to ``$PROBE_MARK``) and waits ``$PROBE_DELAY`` seconds before running the real compiler: the
window a test kills a build in, or holds the lock through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # this checkout's packages, not an installed copy
NAME = "tilerec_build_probe"
ANSWER = 42

_SOURCE = """\
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(%(answer)d); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "the probe's answer"},
                                {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "%(name)s", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_%(name)s(void) { return PyModule_Create(&module); }
"""


def write_source(folder: Path) -> Path:
    """The probe's C++ source (a Python module ``tilerec_build_probe`` whose ``answer()`` is 42)."""
    src = folder / f"{NAME}.cpp"
    src.write_text(_SOURCE % {"answer": ANSWER, "name": NAME})
    return src


def slow_compiler(folder: Path) -> Path:
    """A ``g++`` wrapper for ``$CXX`` (see the module docstring); its name keeps torch's compiler
    check quiet."""
    real = shutil.which("g++") or shutil.which("c++")
    if real is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    cxx = folder / "slow-g++"
    cxx.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*)\n'
        '  [ -n "$PROBE_MARK" ] && echo $$ >> "$PROBE_MARK"\n'
        '  sleep "${PROBE_DELAY:-0}";;\n'
        "esac\n"
        f'exec {real} "$@"\n'
    )
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    return cxx


def probe_env(cache: Path, **extra: str) -> dict[str, str]:
    """The child's environment: this checkout first on ``sys.path``, the cache in ``cache``."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "PROBE_MARK", "PROBE_DELAY")}
    return {**env, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache), **extra}


def start(source: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """The probe build in a child process of its own session (so a test can kill its whole
    process group: python, ninja and the compilers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tilesparse.kernels.build_probe", str(source)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a probe's python, its ninja and the compilers ninja
    started, each of those in a process group of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:  # gone
                continue
    return pids


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``."""
    for pid in session_pids(sid):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def object_files(cache: Path) -> dict[str, int]:
    """Every object file under ``cache`` with its modification time (ns): a build that compiled
    anything changes this."""
    return {str(p): p.stat().st_mtime_ns for p in sorted(cache.rglob("*.o"))}


def main(source: str) -> int:
    """The child: build ``source`` through the production build and call it."""
    import tilesparse.kernels.cpu as cpu

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cpu.EXT = dataclasses.replace(
        cpu.EXT, name=NAME, sources=(Path(source),), headers=(), cflags=("-O0",)
    )
    module = cpu.build_extension()
    print("PROBE", module.answer(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
