"""Zipf key streams and the side-by-side timer shared by the HPS benchmarks."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: where Linux lists the caches of CPU 0, one ``index*`` folder per cache
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


class Zipf:
    """Zipf(α) over ``n`` rows; rank r → key ``perm[r]`` (hot keys are not 0, 1, 2, ...)."""

    def __init__(self, n: int, alpha: float, seed: int = 0) -> None:
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(p / p.sum())
        self.perm = np.random.default_rng(seed).permutation(n).astype(np.int64)
        self.rng = np.random.default_rng(seed + 1)

    def sample(self, k: int) -> np.ndarray:
        r = np.minimum(np.searchsorted(self.cdf, self.rng.random(k)), self.cdf.size - 1)
        return self.perm[r]

    def hottest(self, k: int) -> np.ndarray:
        return self.perm[:k]


def side_by_side(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    before: Callable[[], object] | None = None,
    faults: dict[str, float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    fault_scope: int = resource.RUSAGE_SELF,
) -> dict[str, float]:
    """Median seconds per call of each function by ``clock`` (wall time unless told), calls
    interleaved (A B C A B C ...) so that the load of a shared machine hits every contender
    alike; ``before`` (untimed) runs before every timed call (e.g. :class:`CacheEvictor`, so
    that no contender reads what the one before it left in cache). ``faults``, where given,
    receives each function's median minor page faults per call, counted by ``getrusage`` of
    ``fault_scope`` (the whole process unless told) outside the timed span."""
    for fn in fns.values():
        fn()  # warm
    ts: dict[str, list[float]] = {k: [] for k in fns}
    fl: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before()
            f0 = resource.getrusage(fault_scope).ru_minflt if faults is not None else 0
            t0 = clock()
            fn()
            ts[k].append(clock() - t0)
            if faults is not None:
                fl[k].append(resource.getrusage(fault_scope).ru_minflt - f0)
    if faults is not None:
        faults.update({k: float(np.median(v)) for k, v in fl.items()})
    return {k: float(np.median(v)) for k, v in ts.items()}


def largest_cache_mib(caches: Path = CPU_CACHES) -> int | None:
    """The size of the largest CPU cache ``caches`` lists (``index*/size``, such as
    ``491520K``), in whole MiB rounded up; ``None`` where none can be read."""
    sizes = []
    for f in sorted(caches.glob("index*/size")):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return -(-max(sizes) // (1 << 20)) if sizes else None


def default_evict_mib(caches: Path = CPU_CACHES) -> int:
    """Twice the largest cache ``caches`` lists, at least 64 MiB (64 where none is listed)."""
    llc = largest_cache_mib(caches)
    return max(64, 2 * llc) if llc is not None else 64


class CacheEvictor:
    """Writes ``mib`` MiB when called, so that the next timed call finds none of its data in
    the CPU's caches: contenders that read the same rows (rows and bags over the same caches,
    say) then start alike, and none is timed on rows the one before it brought in.

    ``mib`` defaults to twice the machine's largest cache, at least 64
    (:func:`default_evict_mib`): a fixed 64 MiB evicts a 32 MiB last-level cache but leaves
    most of a 480 MiB one (seen on a 2-vCPU VM on a Xeon), where a contender then read rows
    that the ones before it brought in."""

    def __init__(self, mib: int | None = None) -> None:
        import torch  # the HPS benchmarks' dependency; this module itself needs only numpy

        self.mib = default_evict_mib() if mib is None else mib
        self._buf = torch.zeros(self.mib << 18, dtype=torch.float32)
        self._n = 0

    def __call__(self) -> None:
        self._n += 1
        self._buf.fill_(float(self._n))
