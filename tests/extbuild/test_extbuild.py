"""The builder lock and the ninja of :mod:`extbuild`, without compiling: a live
holder is waited for (and named), a dead build's torch ``lock`` is removed once the processes
it left have ended, and the interpreter environment's ninja wins over ``PATH``'s. The whole
build (a real compile killed, a real second build) is in ``tests/faults/test_build_killed.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import extbuild


def test_a_live_holder_is_waited_for_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extbuild, "POLL_S", 0.01)
    holding, release = threading.Event(), threading.Event()
    events: list[str] = []

    def holder() -> None:
        with extbuild.build_lock(tmp_path):
            (tmp_path / extbuild.TORCH_LOCK_NAME).touch()  # torch's, of the live build
            holding.set()
            release.wait(timeout=30)
            events.append("holder done")
            (tmp_path / extbuild.TORCH_LOCK_NAME).unlink()

    def waiter() -> None:
        with extbuild.build_lock(tmp_path):
            events.append("waiter in")

    first = threading.Thread(target=holder)
    first.start()
    assert holding.wait(timeout=30)
    with caplog.at_level(logging.INFO, logger=extbuild.__name__):
        second = threading.Thread(target=waiter)
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive() and events == []  # waiting, and the holder's lock kept
        assert (tmp_path / extbuild.TORCH_LOCK_NAME).exists()
        release.set()
        first.join(timeout=30)
        second.join(timeout=30)
    assert events == ["holder done", "waiter in"]
    waits = [r.getMessage() for r in caplog.records if "waiting for the build" in r.getMessage()]
    assert len(waits) == 1 and f"pid {os.getpid()} on host" in waits[0], waits
    assert not any("removed the lock" in r.getMessage() for r in caplog.records)


def test_a_dead_builds_lock_is_removed_after_the_processes_it_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extbuild, "POLL_S", 0.01)
    (tmp_path / extbuild.LOCK_NAME).write_text("pid 999999 on host elsewhere since then (x)\n")
    (tmp_path / extbuild.TORCH_LOCK_NAME).touch()
    # a compiler the dead build started, still running (it carries the build's marker)
    env = {**os.environ, extbuild.BUILD_ENV: os.path.realpath(tmp_path)}
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    # Popen returns once the child's exec has begun, but Linux shows its environment in /proc
    # only after the new image is set up: wait until the scan can see it (a busy machine widens
    # that window past the lock's first scan).
    deadline = time.monotonic() + 30
    while orphan.pid not in extbuild._build_processes(tmp_path):
        assert orphan.poll() is None, f"the stand-in compiler ended early ({orphan.returncode})"
        assert time.monotonic() < deadline, "the stand-in compiler never showed its marker"
        time.sleep(0.01)
    said_waiting = threading.Event()

    class EndOrphanOnceWaitedFor(logging.Handler):
        """Ends the orphan once the lock has said it waits for it, so that the wait is seen
        whatever the machine's load (a fixed sleep could end before the scan)."""

        def emit(self, record: logging.LogRecord) -> None:
            if "left running" in record.getMessage() and not said_waiting.is_set():
                said_waiting.set()
                orphan.kill()

    handler = EndOrphanOnceWaitedFor()
    extbuild.log.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger=extbuild.__name__):
            with extbuild.build_lock(tmp_path):
                assert said_waiting.is_set()
                assert orphan.poll() is not None  # waited for it to end
                assert not (tmp_path / extbuild.TORCH_LOCK_NAME).exists()
                record = (tmp_path / extbuild.LOCK_NAME).read_text()
                assert record.startswith(f"pid {os.getpid()} on host ")
    finally:
        extbuild.log.removeHandler(handler)
        orphan.kill()
        orphan.wait()
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert f"pid {orphan.pid} " in messages and "left running" in messages, messages
    assert "removed the lock" in messages and "pid 999999 on host elsewhere" in messages


def test_no_torch_lock_nothing_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=extbuild.__name__):
        with extbuild.build_lock(tmp_path):
            pass
        with extbuild.build_lock(tmp_path):  # released on exit: taken again at once
            pass
    assert caplog.records == []


def test_the_environments_ninja_wins_over_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, require: Callable[[bool, str], None]
) -> None:
    scripts = Path(sysconfig.get_path("scripts"))
    require((scripts / "ninja").is_file(), f"ninja in the interpreter's environment ({scripts})")
    decoy = tmp_path / "ninja"
    decoy.write_text("#!/bin/sh\nexit 3\n")
    decoy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert extbuild.find_ninja() == scripts / "ninja"
    with extbuild._build_environment(tmp_path / "build"):
        ran = subprocess.run(["ninja", "--version"], capture_output=True, text=True)
        assert os.environ[extbuild.BUILD_ENV] == os.path.realpath(tmp_path / "build")
    assert ran.returncode == 0 and ran.stdout.strip() == extbuild.ninja_version(scripts / "ninja")
    assert os.environ["PATH"].startswith(str(tmp_path)) and extbuild.BUILD_ENV not in os.environ


def test_a_cpu_extensions_folder_follows_its_inputs_and_disabling_it_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the cache folder changes with the source, its folder, the flags, the CPU and the
    # toolchain; disabled, loading gives None after one warning from the owner's logger
    # naming the variable (no compile)
    source = tmp_path / "probe.cpp"
    source.write_text("int probe;\n")
    ext = extbuild.CpuExtension(
        name="probe_cpu",
        label="probe: compiled kernel",
        sources=(source,),
        headers=(),
        cflags=("-O1",),
        disable_env="PROBE_DISABLE_EXT",
        build_command="python -m probe.build_ext -v",
        logger="probe.kernels",
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    here = ext.build_dir()
    assert here.parent == tmp_path / "cache" / "tilerec" / "probe_cpu" and here == ext.build_dir()
    assert dataclasses.replace(ext, cflags=("-O2",)).build_dir() != here
    source.write_text("int probe2;\n")
    assert ext.build_dir() != here
    source.write_text("int probe;\n")
    assert ext.build_dir() == here
    moved = tmp_path / "other" / "probe.cpp"  # the same source in another checkout
    moved.parent.mkdir()
    moved.write_text("int probe;\n")
    assert dataclasses.replace(ext, sources=(moved,)).build_dir() != here
    with monkeypatch.context() as m:
        m.setattr(extbuild, "toolchain_key", lambda: "ninja 1.11.1 | python other | torch other")
        assert ext.build_dir() != here
    assert ext.build_dir() == here
    monkeypatch.setattr(extbuild, "cpu_identity", lambda: "fpu sse2")
    assert ext.build_dir() != here
    monkeypatch.setenv("PROBE_DISABLE_EXT", "1")
    with caplog.at_level(logging.WARNING, logger="probe.kernels"):
        assert ext.load_or_none() is None
    [record] = caplog.records
    assert record.name == "probe.kernels"
    assert "probe: compiled kernel disabled by PROBE_DISABLE_EXT" in record.getMessage()


def test_the_build_command_line_logs_where_and_fails_with_status_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``python -m <package>.build_ext``: 0 and the folder on success (with the caller's
    # detail), 1 and the error on a failed build; the compile itself is stood in for
    ext = extbuild.CpuExtension(
        name="probe_cpu",
        label="probe: compiled kernel",
        sources=(tmp_path / "probe.cpp",),
        headers=(),
        cflags=("-O1",),
        disable_env="PROBE_DISABLE_EXT",
        build_command="python -m probe.build_ext -v",
        logger="probe.kernels",
    )
    (tmp_path / "probe.cpp").write_text("int probe;\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = ModuleType("probe_cpu")
    calls: list[bool] = []

    def fake_build(self: extbuild.CpuExtension, verbose: bool = False) -> ModuleType:
        calls.append(verbose)
        return built

    monkeypatch.setattr(extbuild.CpuExtension, "build", fake_build)
    with caplog.at_level(logging.INFO, logger=extbuild.__name__):
        assert ext.command_line(["-v"], detail=lambda m: f"module {m.__name__}") == 0
    assert calls == [True]
    want = f"probe: built probe_cpu (module probe_cpu) in {ext.build_dir()}"
    assert [r.getMessage() for r in caplog.records] == [want]

    def failing_build(self: extbuild.CpuExtension, verbose: bool = False) -> ModuleType:
        raise RuntimeError("no compiler on PATH")

    monkeypatch.setattr(extbuild.CpuExtension, "build", failing_build)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=extbuild.__name__):
        assert ext.command_line([]) == 1
    assert [r.getMessage() for r in caplog.records] == ["probe: build failed: no compiler on PATH"]
