"""Build a torch C++ extension into a cache folder: one builder at a time, a killed builder's
lock cleared, one ninja. Every build of the project goes through :func:`load`: the TW binding
of :mod:`cutlass_kernels.build` and the CPU kernels of ``tilesparse``, ``hps`` and ``embark``
(through :class:`CpuExtension`). A leaf: it imports only the standard library and torch, so
the CUTLASS leaf and the kernel rooms all may import it.

``torch.utils.cpp_extension.load`` guards a build folder with a ``lock`` file that it creates
before compiling and deletes after; a builder killed in between (SIGKILL, OOM, a lost terminal)
leaves the file, and every later load waits on it forever. :func:`load` therefore holds an
OS lock of its own around torch's, ``flock`` on ``<folder>/builder.lock``, which the kernel
releases when its holder dies however it dies:

* holder alive (another process or thread building the same folder): wait for it, logging who
  it is (the holder writes its pid, host, start time and command into the file);
* lock taken and torch's ``lock`` present: its builder died mid-build. The compilers it started
  may still run (ninja starts each in a process group of its own, so even a kill of the whole
  group leaves them); they are found by the ``TILEREC_EXT_BUILD`` variable every build process
  inherits, and waited for. Then torch's lock is removed and the build runs again; ninja
  recompiles what did not finish (an output without a ``.ninja_log`` entry is dirty).

One ninja: :func:`find_ninja` prefers the interpreter environment's ninja (the ``ninja`` wheel
in a virtualenv's ``bin``) over ``PATH``'s, and :func:`load` puts it first on ``PATH`` for the
build (a folder holding only a link to it, so the compiler ``PATH`` finds stays). ninja's ``.ninja_log`` / ``.ninja_deps`` formats change between versions and a ninja that
finds another version's files rebuilds everything (minutes for the CPU kernel), so an activated
venv and a ``make`` that runs the venv's python with the system ninja first on ``PATH`` must
not alternate. :func:`toolchain_key` (ninja, Python, torch install) goes into the folders' cache
keys, so two environments that share a cache keep a build each instead of rebuilding each
other's.

:class:`CpuExtension` is the rest every CPU kernel of the project shares (``tilesparse``'s,
``hps``'s, ``embark``'s): its cache folder, keyed by the sources, flags, :func:`cpu_identity`
and :func:`toolchain_key`; its build; and loading it or ``None`` after one logged warning, for
a caller that then runs its reference path.

Importing this package imports neither ``torch.utils.cpp_extension`` nor anything of the
project; it uses Linux's ``/proc`` to find a dead build's compilers (elsewhere none are found).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "BUILD_ENV",
    "CpuExtension",
    "build_lock",
    "cpu_identity",
    "find_ninja",
    "load",
    "ninja_version",
    "toolchain_key",
]

log = logging.getLogger(__name__)

BUILD_ENV = "TILEREC_EXT_BUILD"  # set to the build folder for every process of a build
NINJA_DIR = ".ninja-bin"  # a folder holding only a link to the ninja a build runs
LOCK_NAME = "builder.lock"  # ours: flock'ed while a builder works in the folder
TORCH_LOCK_NAME = "lock"  # torch.utils.file_baton's, in cpp_extension.load's build_directory
POLL_S = 0.2  # how often a waiting builder looks again
REPORT_EVERY_S = 60.0  # how often a long wait is logged again


def find_ninja() -> Path | None:
    """The ninja a build runs: the interpreter environment's (its ``scripts`` folder, where the
    ``ninja`` wheel installs it; then the user scheme's), else the first on ``PATH``; ``None``
    when there is none."""
    schemes = [sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")]
    for scheme in schemes:
        candidate = Path(sysconfig.get_path("scripts", scheme)) / "ninja"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("ninja")
    return Path(found) if found else None


@functools.lru_cache(maxsize=8)
def ninja_version(ninja: Path) -> str:
    """``ninja --version`` (e.g. ``1.13.2``); ``"?"`` when it does not run."""
    try:
        out = subprocess.run(
            [str(ninja), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cannot run %s --version (%s)", ninja, e)
        return "?"
    return out.strip() or "?"


def toolchain_key() -> str:
    """What besides the sources and flags decides a build folder's contents and whether ninja
    finds it up to date: the ninja version, the Python ABI and include folder, and the torch
    version and install folder (both are in the compile commands of ``build.ninja``)."""
    ninja = find_ninja()
    return " | ".join(
        (
            f"ninja {ninja_version(ninja) if ninja else 'none'}",
            f"python {sys.implementation.cache_tag} {sysconfig.get_paths()['include']}",
            f"torch {torch.__version__} {Path(torch.__file__).parent}",
        )
    )


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (``/proc/cpuinfo``), else
    the platform's processor name — for a build folder's cache key, so a cache shared between
    machines never hands one CPU a build using instructions it lacks."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):  # x86 / arm64
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


@dataclass(frozen=True)
class CpuExtension:
    """A CPU torch extension compiled for this machine (``-march=native`` in ``cflags``) into
    ``$XDG_CACHE_HOME/tilerec/<name>/<torch version>-<hash>/`` (default ``~/.cache``).

    Args:
        name: the module's name and its cache folder's.
        label: who and what, for the log: ``"hps: compiled lookup kernel"``.
        sources: the ``.cpp`` files compiled.
        headers: the headers they include (in the hash, not compiled).
        cflags: compiler flags (``-fopenmp`` links OpenMP as well).
        disable_env: the variable that, set to anything but ``""``/``"0"``, disables it.
        build_command: the command that rebuilds it verbosely, for the warning.
        logger: the logger that warns (the owning module's).
        fallback: what runs instead, for the warning.
    """

    name: str
    label: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    disable_env: str
    build_command: str
    logger: str
    fallback: str = "the reference path"

    def build_dir(self) -> Path:
        """The cache folder of these sources × their folder × flags × CPU × toolchain: the
        hash of the sources and headers, the folder of the first source (ninja's build file
        names the source paths: two checkouts sharing a folder would rebuild each other's),
        the flags, :func:`cpu_identity` (a cache shared between machines never hands one CPU
        a build using instructions it lacks) and :func:`toolchain_key`."""
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        h = hashlib.sha256()
        for f in (*self.sources, *self.headers):
            h.update(f.read_bytes())
        h.update(str(self.sources[0].parent).encode())
        h.update(" ".join(self.cflags).encode())
        h.update(cpu_identity().encode())
        h.update(toolchain_key().encode())
        return base / "tilerec" / self.name / f"{torch.__version__}-{h.hexdigest()[:12]}"

    def build(self, verbose: bool = False) -> ModuleType:
        """Compile (or reuse the cached build of) the extension through :func:`load` and
        import it.

        Raises:
            RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
        """
        openmp = ["-fopenmp"] if "-fopenmp" in self.cflags else []
        return load(
            self.name,
            [str(f) for f in self.sources],
            self.build_dir(),
            extra_cflags=list(self.cflags),
            extra_ldflags=openmp,
            verbose=verbose,
        )

    def load_or_none(self) -> ModuleType | None:
        """The built module, or ``None`` after one logged warning when it cannot be built or
        loaded or :attr:`disable_env` is set (callers cache the answer per process)."""
        owner = logging.getLogger(self.logger)
        if os.environ.get(self.disable_env, "") not in ("", "0"):
            owner.warning(
                "%s disabled by %s; using %s", self.label, self.disable_env, self.fallback
            )
            return None
        try:
            return self.build()
        except (RuntimeError, OSError, ImportError, SystemExit) as e:
            owner.warning(
                "%s could not be built or loaded (%s: %s); using %s. Rebuild with `%s`.",
                self.label,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                self.fallback,
                self.build_command,
            )
            return None

    def command_line(
        self, argv: list[str] | None = None, detail: Callable[[ModuleType], str] | None = None
    ) -> int:
        """``python -m <package>.build_ext [-v]``: build (or find built) the extension and log
        where; ``detail(module)`` adds a line of what was built. 0 on success, 1 when the build
        failed (the error logged)."""
        package, _, what = self.label.partition(": ")
        ap = argparse.ArgumentParser(
            description=f"Build the {what or self.name} of {package} into its cache folder."
        )
        ap.add_argument("-v", "--verbose", action="store_true", help="show compiler output")
        args = ap.parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            module = self.build(verbose=args.verbose)
        except (RuntimeError, OSError, ImportError) as e:
            log.error("%s: build failed: %s", package, e)
            return 1
        extra = f" ({detail(module)})" if detail is not None else ""
        log.info("%s: built %s%s in %s", package, self.name, extra, self.build_dir())
        return 0


def load(
    name: str,
    sources: list[str],
    build_directory: Path,
    *,
    verbose: bool = False,
    extra_cflags: list[str] | None = None,
    extra_ldflags: list[str] | None = None,
    extra_include_paths: list[str] | None = None,
    with_cuda: bool | None = None,
) -> ModuleType:
    """``torch.utils.cpp_extension.load`` into ``build_directory`` under :func:`build_lock`,
    with :func:`find_ninja`'s ninja first on ``PATH``.

    Raises:
        RuntimeError / OSError / ImportError: from the compiler or the loader, unchanged.
    """
    from torch.utils import cpp_extension

    build_directory.mkdir(parents=True, exist_ok=True)
    with build_lock(build_directory), _build_environment(build_directory):
        module: ModuleType = cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=extra_cflags,
            extra_ldflags=extra_ldflags,
            extra_include_paths=extra_include_paths,
            build_directory=str(build_directory),
            verbose=verbose,
            with_cuda=with_cuda,
        )
    return module


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s builder lock: wait while a live builder holds it; once held, clear
    what a dead builder left (its compilers, torch's ``lock``).

    Raises:
        OSError: the lock file cannot be created or locked (other than being held).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path)
        previous = _read_record(fd)
        _write_record(fd)
        _clear_dead_build(folder, previous)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: Path) -> None:
    """``flock(fd)``, waiting (and saying for whom) while another builder holds it."""
    started = time.monotonic()
    next_report = started
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            now = time.monotonic()
            if now >= next_report:
                log.warning(
                    "waiting for the build in %s: it is being built by %s (%.0f s so far)",
                    path.parent,
                    _read_record(fd) or "another builder",
                    now - started,
                )
                next_report = now + REPORT_EVERY_S
            time.sleep(POLL_S)
    if next_report > started:
        log.info("the other build of %s finished; going on", path.parent)


def _read_record(fd: int) -> str:
    """Who holds (or last held) the lock, as its holder wrote it."""
    return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()


def _write_record(fd: int) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    command = " ".join(sys.orig_argv)[:400]
    record = f"pid {os.getpid()} on host {socket.gethostname()} since {stamp} ({command})\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)


def _clear_dead_build(folder: Path, previous: str) -> None:
    """With the builder lock held, a torch ``lock`` in ``folder`` belongs to a builder that
    died (every live builder holds the builder lock while torch's exists): wait for the
    processes it left running, then remove the lock."""
    torch_lock = folder / TORCH_LOCK_NAME
    if not torch_lock.exists():
        return
    _wait_for_orphans(folder)
    torch_lock.unlink(missing_ok=True)
    log.warning(
        "removed the lock of a build of %s that did not finish (its builder, %s, is gone); "
        "building again",
        folder,
        previous or "unknown",
    )


def _wait_for_orphans(folder: Path) -> None:
    """Wait while processes of a dead build of ``folder`` (ninja, compilers) still run."""
    started = time.monotonic()
    next_report = started
    while orphans := _build_processes(folder):
        now = time.monotonic()
        if now >= next_report:
            log.warning(
                "waiting for %d process(es) left running in %s by a build that was killed "
                "(%.0f s so far): %s",
                len(orphans),
                folder,
                now - started,
                "; ".join(f"pid {pid} {cmd}" for pid, cmd in orphans.items()),
            )
            next_report = now + REPORT_EVERY_S
        time.sleep(POLL_S)


def _build_processes(folder: Path) -> dict[int, str]:
    """Processes (pid → command, shortened) whose environment marks them as part of a build
    of ``folder`` (:data:`BUILD_ENV`); only this user's are readable, which are the ones that
    share the folder."""
    marker = f"{BUILD_ENV}={os.path.realpath(folder)}".encode()
    found: dict[int, str] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:  # gone, or another user's
            continue
        found[int(entry.name)] = cmd.strip()[:100]
    return found


@contextlib.contextmanager
def _build_environment(folder: Path) -> Iterator[None]:
    """``os.environ`` for torch's ninja and compiler runs (torch copies it): :data:`BUILD_ENV`
    naming the folder, and :func:`find_ninja`'s ninja first on ``PATH`` when ``PATH`` would
    find another (through a folder holding only a link to it, so that nothing else on
    ``PATH``, the compiler above all, changes)."""
    saved = {k: os.environ.get(k) for k in (BUILD_ENV, "PATH")}
    os.environ[BUILD_ENV] = os.path.realpath(folder)
    ninja = find_ninja()
    on_path = shutil.which("ninja")
    if ninja is not None and (on_path is None or not os.path.samefile(on_path, ninja)):
        pinned = _link_ninja(folder / NINJA_DIR, ninja)
        os.environ["PATH"] = os.pathsep.join([str(pinned), saved["PATH"] or os.defpath])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _link_ninja(bin_dir: Path, ninja: Path) -> Path:
    """``bin_dir`` holding ``ninja`` → ``ninja`` (replaced atomically when it points elsewhere)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "ninja"
    if not (link.is_symlink() and os.readlink(link) == str(ninja)):
        tmp = bin_dir / f".ninja.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(ninja)
        tmp.replace(link)
    return bin_dir
