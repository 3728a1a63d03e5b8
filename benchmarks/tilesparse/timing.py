"""Side-by-side timing for the tile-wise (TW) sparse benchmarks.

Contenders are timed *interleaved*: every contender is warmed, then the calls run round-robin
``A B C A B C ...`` ``repeats`` times, so that a burst of load on a shared machine hits every
contender alike instead of whichever happened to run during it. Per contender we keep the
median (the figure the tables report), the minimum and the inter-quartile range (spread)::

    round      0     1     2     3   ...
    dense    0.45  0.47  0.45  0.52        median 0.46 s, min 0.45 s, IQR 0.02 s
    tw       0.12  0.12  0.13  0.12        median 0.12 s, ...

A contender may be given a smaller cap of rounds (``caps``, e.g. a CSR matmul that takes
seconds per call): it joins the first ``cap`` rounds and sits out the rest, still interleaved
with the others while it runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_THREADS",
    "Timing",
    "add_threads_arg",
    "cpu_features",
    "free_memory",
    "interleaved",
    "interleaved_medians",
    "set_threads",
    "time_once",
]

# The machine the README numbers come from has 2 cores; the lead measures on it.
DEFAULT_THREADS = 2
# CPU flags that decide which kernels run: the TW fp32 micro-kernel is AVX-512, else AVX2 + FMA,
# else scalar; torch's dense bf16 matmul (oneDNN) uses AVX512-BF16 / AMX tiles where present.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one contender over its interleaved rounds.

    Attributes:
        median_s: median seconds per call.
        min_s: fastest call.
        iqr_s: inter-quartile range (75th − 25th percentile); 0 with fewer than 2 samples.
        samples: calls timed (warm-up calls excluded).
    """

    median_s: float
    min_s: float
    iqr_s: float
    samples: int

    @property
    def median_ms(self) -> float:
        return 1e3 * self.median_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _summarise(samples: list[float]) -> Timing:
    if not samples:
        raise ValueError("a contender needs at least one timed call, got none")
    if len(samples) >= 2:
        q = statistics.quantiles(samples, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return Timing(statistics.median(samples), min(samples), iqr, len(samples))


def time_once(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    caps: Mapping[str, int] | None = None,
) -> dict[str, Timing]:
    """Time ``fns`` side by side, round-robin.

    Args:
        fns: name → a zero-argument callable (its result is discarded).
        repeats: rounds (>= 1); each round calls every contender once, in ``fns`` order.
        warmup: untimed calls of each contender before the first round (>= 0).
        caps: name → the most rounds that contender joins (the first ``cap`` ones, >= 1).

    Returns:
        name → :class:`Timing`, in ``fns`` order.

    Raises:
        ValueError: for ``repeats < 1``, ``warmup < 0``, or a cap below 1 or naming no contender.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    caps = dict(caps or {})
    unknown = sorted(set(caps) - set(fns))
    if unknown:
        raise ValueError(f"caps name contenders {unknown} that are not among {sorted(fns)}")
    bad = {k: v for k, v in caps.items() if v < 1}
    if bad:
        raise ValueError(f"caps must be >= 1, got {bad}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            if r < caps.get(name, repeats):
                samples[name].append(time_once(fn))
    return {k: _summarise(v) for k, v in samples.items()}


def interleaved_medians(
    fns: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, timed round-robin (see :func:`interleaved`).

    Returns:
        name → median seconds, in ``fns`` order.
    """
    return {k: t.median_s for k, t in interleaved(fns, repeats, warmup).items()}


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (torch intra-op threads, default :data:`DEFAULT_THREADS`)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"torch.set_num_threads for every contender (default {DEFAULT_THREADS})",
    )


def set_threads(n: int) -> int:
    """``torch.set_num_threads(n)`` (the TW CPU kernel's ``at::parallel_for`` follows it).

    Returns:
        the thread count now in effect.

    Raises:
        ValueError: for ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return torch.get_num_threads()


def cpu_flags() -> set[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_features() -> dict[str, Any]:
    """Which of :data:`CPU_FLAGS` the CPU has (``/proc/cpuinfo``; empty elsewhere), which fp32
    micro-kernel the TW extension runs (``tw_kernel_simd``: ``"avx512"`` / ``"avx2"`` /
    ``"scalar"``; ``tw_kernel_avx512``: whether it is the AVX-512 one), whether it runs its AMX bf16
    kernel, and which kernel a bf16 call takes (``tw_kernel_bf16``: ``"amx"`` /
    ``"avx512_bf16"`` / ``"fp32"`` / ``"mm"``) (``None`` where the extension is not loaded)."""
    flags = cpu_flags()
    from tilesparse.kernels.cpu import load_extension

    ext = load_extension()
    return {f: f in flags for f in CPU_FLAGS} | {
        "tw_kernel_simd": None if ext is None else str(ext.simd()),
        "tw_kernel_avx512": None if ext is None else bool(ext.has_avx512()),
        "tw_kernel_amx_bf16": None if ext is None else bool(ext.has_amx()),
        "tw_kernel_bf16": None if ext is None else str(ext.bf16_kernel()),
    }


def native_bf16() -> bool:
    """Whether the CPU has native bf16 matrix instructions (``avx512_bf16`` or ``amx_bf16`` in
    ``/proc/cpuinfo``). Without them torch's dense bf16 matmul is one to two orders of magnitude
    slower than fp32 (a 2048×1024×1024 call took 5 s on an AVX2 Zen 3, fp32 42 ms)."""
    f = cpu_flags()
    return "avx512_bf16" in f or "amx_bf16" in f


def default_dtypes(names: list[str], quick: bool) -> list[str]:
    """The benchmark's default dtypes: ``names`` without bf16 on a CPU without native bf16
    (full-size dense bf16 rows would take minutes each), with a warning saying how to force it;
    ``--quick`` keeps every dtype (its shapes are tiny)."""
    if quick or native_bf16() or "bf16" not in names:
        return list(names)
    log.warning(
        "bf16 rows skipped: this CPU has no avx512_bf16/amx_bf16, so dense bf16 matmul (the "
        "baseline) takes minutes per full-size call; pass --dtypes %s to run them anyway",
        ",".join(names),
    )
    return [n for n in names if n != "bf16"]


def free_memory() -> None:
    """Collect garbage between rows, so one row's tensors are not alive during the next."""
    gc.collect()
