"""A build killed mid-compile (issue #22, item 5).

A real build (the production ``tilesparse.kernels.cpu.build_extension`` on a one-second source,
see :mod:`tests.tilesparse.kernels.build_probe`) is started in a child process and killed with
SIGKILL once torch's ``lock`` exists and the compiler runs; the next build must finish (and its
module answer) within a bound that only a hang exceeds. Two kills: the builder's python alone
(``kill -9 PID``: ninja and the compiler go on without it) and every process of its session
(nothing left running). And a builder that is alive must be waited for, never broken into.

Every build here uses its own ``XDG_CACHE_HOME`` under ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.tilesparse.kernels import build_probe as probe

pytestmark = pytest.mark.slow

HANG_S = 120  # a recovering build takes seconds (about 3 s here); only a hang reaches this
STARTED_S = 120  # time for a child to reach its compiler


@pytest.fixture
def probe_dir(tmp_path: Path, require: Callable[[bool, str], None]) -> Path:
    require(bool(shutil.which("g++") or shutil.which("c++")), "a C++ compiler (g++)")
    require(Path("/proc").is_dir(), "/proc (Linux)")
    probe.write_source(tmp_path)
    probe.slow_compiler(tmp_path)
    return tmp_path


@pytest.fixture
def sessions() -> Iterator[list[int]]:
    """Session ids of the children a test starts; every process left in them is killed after."""
    started: list[int] = []
    yield started
    for sid in started:
        probe.kill_session(sid)


def _env(folder: Path, delay: float) -> dict[str, str]:
    return probe.probe_env(
        folder / "cache",
        CXX=str(folder / "slow-g++"),
        PROBE_MARK=str(folder / "compiles"),
        PROBE_DELAY=str(delay),
    )


def _compiles(folder: Path) -> int:
    mark = folder / "compiles"
    return len(mark.read_text().split()) if mark.exists() else 0


def _wait_until_compiling(folder: Path, child: subprocess.Popen[str]) -> Path:
    """Wait for the child's first compile; returns its build folder (holding torch's lock)."""
    deadline = time.monotonic() + STARTED_S
    while _compiles(folder) == 0:
        if child.poll() is not None:
            pytest.fail(f"the build ended before compiling:\n{child.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the build did not reach its compiler in {STARTED_S} s")
        time.sleep(0.05)
    (lock,) = (folder / "cache").rglob("lock")  # torch.utils.file_baton's
    return lock.parent


def _finish(child: subprocess.Popen[str], what: str) -> str:
    """The child's output once it exits 0; a failure naming ``what`` if it hangs or fails."""
    try:
        out, _ = child.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        pytest.fail(f"{what} hung for {HANG_S} s (waiting on a dead build's lock?):\n{out}")
    assert child.returncode == 0, f"{what} failed:\n{out}"
    assert f"PROBE {probe.ANSWER}" in out, out
    return out


@pytest.mark.parametrize("kill", ["builder", "session"])
def test_a_build_killed_mid_compile_is_rebuilt_by_the_next_run(
    probe_dir: Path, sessions: list[int], kill: str
) -> None:
    source = probe_dir / f"{probe.NAME}.cpp"
    # the killed builder's compiler sleeps 3 s: what a surviving compiler (kill="builder")
    # leaves the next build to wait for
    first = probe.start(source, _env(probe_dir, delay=3 if kill == "builder" else 600), probe_dir)
    sessions.append(first.pid)
    folder = _wait_until_compiling(probe_dir, first)
    assert (folder / "lock").exists()
    if kill == "builder":
        os.kill(first.pid, signal.SIGKILL)
        assert first.stdout is not None
        first.stdout.close()  # as a dead builder's pipe: ninja's next write gets SIGPIPE
    else:
        probe.kill_session(first.pid)
    first.wait(timeout=30)
    assert (folder / "lock").exists()  # what made every later build wait forever

    t0 = time.monotonic()
    second = probe.start(source, _env(probe_dir, delay=0), probe_dir)
    sessions.append(second.pid)
    out = _finish(second, "the build after a killed one")
    print(f"killed ({kill}) build recovered in {time.monotonic() - t0:.1f} s")
    assert "removed the lock of a build" in out and f"pid {first.pid}" in out, out
    assert not (folder / "lock").exists()
    if kill == "session":
        assert _compiles(probe_dir) == 2  # the killed compile, then the next build's own


def test_a_live_builder_is_waited_for_not_broken(probe_dir: Path, sessions: list[int]) -> None:
    source = probe_dir / f"{probe.NAME}.cpp"
    first = probe.start(source, _env(probe_dir, delay=4), probe_dir)
    sessions.append(first.pid)
    _wait_until_compiling(probe_dir, first)
    second = probe.start(source, _env(probe_dir, delay=0), probe_dir)
    sessions.append(second.pid)

    first_out = _finish(first, "the first build")
    second_out = _finish(second, "the build that waited")
    assert "removed the lock" not in first_out + second_out
    # the waiting build said for whom, and compiled nothing: it found the first one's build
    assert "waiting for the build" in second_out and f"pid {first.pid} " in second_out, second_out
    assert _compiles(probe_dir) == 1
