"""Zipf key streams and the side-by-side timer shared by the HPS benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


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


def side_by_side(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved (A B C A B C ...) so that
    the load of a shared machine hits every contender alike."""
    for fn in fns.values():
        fn()  # warm
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in ts.items()}
