"""What the HPS lookup benchmark sets up before it times anything: the cache evictor, sized
from the caches the machine lists, and glibc kept from handing freed memory back; and the
page faults its side-by-side timer records per contender."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.hps.zipf_keys import (
    CacheEvictor,
    default_evict_mib,
    largest_cache_mib,
    side_by_side,
)


def _caches(root: Path, sizes: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for index, size in sizes.items():
        (root / index).mkdir()
        (root / index / "size").write_text(size + "\n")
    return root


def test_the_largest_listed_cache_in_whole_mib(tmp_path: Path) -> None:
    """Sizes as Linux writes them (``48K``, ``2048K``, ``491520K``), the largest taken and
    rounded up to whole MiB; a size that is not one is skipped."""
    root = _caches(
        tmp_path, {"index0": "48K", "index2": "2048K", "index3": "491520K", "index4": "big"}
    )
    assert largest_cache_mib(root) == 480
    assert largest_cache_mib(_caches(tmp_path / "m", {"index0": "1536K", "index1": "3M"})) == 3
    assert largest_cache_mib(_caches(tmp_path / "up", {"index0": "1025K"})) == 2


def test_no_listed_cache_reads_as_none(tmp_path: Path) -> None:
    assert largest_cache_mib(tmp_path / "none") is None
    assert largest_cache_mib(_caches(tmp_path / "bad", {"index0": "K"})) is None


@pytest.mark.parametrize("mib", [1, 3])
def test_an_evictor_writes_its_whole_buffer_each_call(mib: int) -> None:
    """Each call writes every float of its ``mib`` MiB with a value it has not written before."""
    ev = CacheEvictor(mib)
    assert ev.mib == mib
    assert ev._buf.numel() * 4 == mib << 20
    for n in (1, 2):
        ev()
        assert bool((ev._buf == n).all())


def test_the_default_is_twice_the_largest_cache_and_at_least_64_mib(tmp_path: Path) -> None:
    assert default_evict_mib(_caches(tmp_path / "big", {"index3": "491520K"})) == 960
    assert default_evict_mib(_caches(tmp_path / "small", {"index3": "16384K"})) == 64
    assert default_evict_mib(tmp_path / "none") == 64


_FAULTS = """
import resource, statistics, sys, torch
if sys.argv[1] == "keep":
    from benchmarks.hps.bench_lookup import keep_freed_memory
    assert keep_freed_memory()
def call():
    return torch.empty(16 << 20).fill_(1.0)  # a fresh 64 MiB result, as a peer's call makes
for _ in range(3):
    call()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults))
"""


def _median_faults(mode: str) -> float:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_kept_freed_memory_spares_a_fresh_result_its_page_faults() -> None:
    """With glibc's defaults a fresh 64 MiB result is faulted in on each call; once
    :func:`keep_freed_memory` has run, a call reuses the pages of the one before (none).

    64 MiB is above the 32 MiB ceiling of glibc's sliding mmap threshold, so with the defaults
    every call maps and unmaps its own result whatever the heap held before. A smaller result
    may land on the heap, where whether freeing it trims the heap depends on what sits above it:
    a 4 MiB result faulted 1,024 pages per call on one machine and none on another. At least 16
    faults: 16,384 of 4 KiB pages, or 32 where the kernel backs the mapping with 2 MiB pages."""
    assert _median_faults("default") >= 16
    assert _median_faults("keep") == 0


def _fresh_8_mib() -> None:
    """Writes a fresh 8 MiB anonymous mapping: at least one page fault per 2 MiB of it."""
    import mmap

    m = mmap.mmap(-1, 8 << 20)
    for off in range(0, 8 << 20, 4096):
        m[off] = 1
    m.close()


def test_the_side_by_side_timer_counts_each_contenders_faults_outside_its_timing() -> None:
    """``side_by_side(..., faults=)``: per contender, the median minor faults of its calls. A
    contender that writes a fresh 8 MiB anonymous mapping each call faults at least one page
    per 2 MiB of it (4 KiB pages: 2,048); one that touches nothing faults none."""
    calls = {"fresh": 0, "none": 0}

    def counted(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            calls[name] += 1
            fn()

        return call

    faults: dict[str, float] = {}
    t = side_by_side(
        {"fresh": counted("fresh", _fresh_8_mib), "none": counted("none", lambda: None)},
        5,
        None,
        faults,
    )
    assert calls == {"fresh": 6, "none": 6}  # one warm-up call each, then the timed ones
    assert set(t) == set(faults) == {"fresh", "none"}
    assert faults["fresh"] >= 4
    assert faults["none"] == 0


def test_the_one_thread_cpu_timer_counts_the_threads_faults_and_restores_the_threads() -> None:
    """:func:`cpu_side_by_side`: CPU seconds and faults of the calling thread, each contender
    run with one torch thread, the thread count restored afterwards."""
    import torch

    from benchmarks.hps.bench_lookup import cpu_side_by_side

    seen: list[int] = []
    before = torch.get_num_threads()
    cpu, faults = cpu_side_by_side(
        {"fresh": _fresh_8_mib, "threads": lambda: seen.append(torch.get_num_threads())}, 3
    )
    assert torch.get_num_threads() == before
    assert seen == [1] * 4
    assert faults["fresh"] >= 4 and faults["threads"] == 0
    assert cpu["fresh"] > 0.0
