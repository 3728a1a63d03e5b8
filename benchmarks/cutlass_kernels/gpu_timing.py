"""GPU timing for ``gpu_check``: launch-overhead-proof, cold-L2 CUDA event timing, and the
time budget of the run.

Two biases of naive event timing (``start; fn() × n; end``) are removed here:

* **Launch overhead.** When the host needs longer per call (Python wrapper, pybind, argument
  checks, launch) than the kernel runs, the GPU idles between calls and the events measure the
  CPU. Every timed loop is therefore queued behind ``torch.cuda._sleep`` (a GPU busy-wait sized
  from the host time per call), so all calls are enqueued before the first one starts. The host
  time per call is measured too (wall clock of the enqueue loop / calls); a row whose host
  µs/call is >= its GPU µs/call is flagged ``launch_bound``: the GPU figure is right, but an
  eager caller would not reach it.
* **Warm L2.** An H200 has 60 MB of L2: a TW layer at 75-90 % touches 30-60 MB, the dense one
  100-200 MB, so back-to-back repetitions favour TW. The main ("cold") figure writes over a
  256 MB scratch buffer before every repetition and times each repetition with its own event
  pair around the op only (the flush is outside). The back-to-back ("hot") figure is kept too.

Everything that needs no GPU (the budget, the stall length, the flags) is plain arithmetic,
tested on the CPU; :class:`Timer` takes its device as an argument so that the loop logic runs on
the CPU in the tests with stand-in events.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "L2_FLUSH_BYTES",
    "Budget",
    "Timing",
    "Timer",
    "launch_bound",
    "stall_us",
    "make_timing",
    "gpu_warmup",
]

L2_FLUSH_BYTES = 256 << 20  # > 4x the H100/H200 L2 (50/60 MB)
_MAX_STALL_US = 300_000.0  # never busy-wait longer than this in front of one loop
_MIN_STALL_US = 2_000.0
_PER_CALL_EXTRA_US = 20.0  # host cost of the flush launch and two event records per repetition


class Budget:
    """Seconds left of a wall-clock budget counted from ``t0`` (default: now).

    ``clock`` is injectable for tests (default ``time.perf_counter``)."""

    def __init__(
        self,
        budget_s: float,
        t0: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget_s = float(budget_s)
        self.clock = clock
        self.t0 = clock() if t0 is None else t0

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        """Seconds left (negative once over)."""
        return self.budget_s - self.elapsed()

    def over(self) -> bool:
        return self.left() <= 0.0

    def child_timeout(self, cap: float) -> float:
        """Timeout of a child started now: ``min(cap, left)``, never below 0."""
        return max(0.0, min(cap, self.left()))


def launch_bound(host_us: float, gpu_us: float) -> bool:
    """Whether the host needs at least as long per call as the GPU (then an eager caller,
    calling back to back, is limited by the CPU, not by the kernel)."""
    return host_us >= gpu_us


def stall_us(host_us_per_call: float, calls: int) -> float:
    """Length of the GPU busy-wait to queue in front of ``calls`` calls so that all of them are
    enqueued before the first runs: 1.5x their estimated host time plus 1 ms, clamped to
    [2 ms, 300 ms]."""
    want = 1.5 * calls * (max(host_us_per_call, 0.0) + _PER_CALL_EXTRA_US) + 1000.0
    return min(max(want, _MIN_STALL_US), _MAX_STALL_US)


@dataclass(frozen=True)
class Timing:
    """One op's figures, µs per call.

    Attributes:
        us: cold: median over repetitions each timed alone after an L2 flush (the main figure).
        us_min: the fastest cold repetition.
        hot_us: mean of back-to-back calls (warm L2).
        host_us: host wall time per call of the back-to-back enqueue loop.
        launch_bound: ``host_us >= us``.
        queue_drained: a timed loop took the host longer to enqueue than the busy-wait in front
            of it lasted, so the GPU may have waited for the host inside the timed region.
    """

    us: float
    us_min: float
    hot_us: float
    host_us: float
    launch_bound: bool
    queue_drained: bool

    def fields(self, prefix: str = "") -> dict[str, float | bool]:
        """The figures as row fields (``us``, ``hot_us``, ...), names prefixed by ``prefix``."""
        return {f"{prefix}{k}": v for k, v in self.__dict__.items()}


def make_timing(cold_us: list[float], hot_us: float, host_us: float, drained: bool) -> Timing:
    """A :class:`Timing` from the per-repetition cold times, the hot mean and the host µs/call.

    Raises:
        ValueError: no cold repetition.
    """
    if not cold_us:
        raise ValueError("no cold repetition timed")
    us = float(statistics.median(cold_us))
    return Timing(
        us,
        float(min(cold_us)),
        float(hot_us),
        float(host_us),
        launch_bound(host_us, us),
        bool(drained),
    )


class Timer:
    """CUDA event timing with a busy-wait in front of every loop and an L2 flush before every
    cold repetition.

    Args:
        device: where the flush buffer lives (``"cuda"``; the tests pass ``"cpu"`` with
            stand-in events).
        flush_bytes: size of the scratch buffer written before each cold repetition
            (``scratch``: ``(flush_bytes // 4,)`` fp32).
    """

    def __init__(
        self, device: str | torch.device = "cuda", flush_bytes: int = L2_FLUSH_BYTES
    ) -> None:
        self.device = torch.device(device)
        self.scratch = torch.empty(
            max(flush_bytes // 4, 1), dtype=torch.float32, device=self.device
        )
        self.has_sleep = hasattr(torch.cuda, "_sleep")
        self.cycles_per_us = self._calibrate() if self.has_sleep else 0.0

    @staticmethod
    def _event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def _calibrate(self, cycles: int = 2_000_000) -> float:
        """GPU clock cycles per µs of ``torch.cuda._sleep`` (timed with events)."""
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        start, end = self._event(), self._event()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / max(start.elapsed_time(end) * 1000.0, 1.0)

    def _stall(self, us: float) -> float:
        """Queue a busy-wait of ``us`` µs on the current stream; returns the µs queued."""
        if not self.has_sleep:
            return 0.0
        torch.cuda._sleep(int(us * self.cycles_per_us))
        return us

    def flush(self) -> None:
        """Write over the scratch buffer (evicts the L2)."""
        self.scratch.zero_()

    def host_estimate(self, fn: Callable[[], object], warmup: int = 3) -> float:
        """Run ``fn`` once, then ``warmup`` more times; host µs per call of the latter (an
        upper bound when ``fn`` blocks on the GPU)."""
        fn()
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            fn()
        host = (time.perf_counter() - t0) * 1e6 / max(warmup, 1)
        torch.cuda.synchronize()
        return host

    def time(self, fn: Callable[[], object], reps: int, warmup: int = 3) -> Timing:
        """Hot (back to back) and cold (flushed, one event pair each) figures of ``fn``."""
        host_est = self.host_estimate(fn, warmup)
        # Hot: all reps between one event pair, queued behind a busy-wait.
        start, end = self._event(), self._event()
        stalled = self._stall(stall_us(host_est, reps))
        t0 = time.perf_counter()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        host_total = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        hot = start.elapsed_time(end) * 1000.0 / reps
        drained = self.has_sleep and host_total > stalled
        cold, drained_cold = self._cold({"fn": fn}, reps, host_est)
        return make_timing(cold["fn"], hot, host_total / reps, drained or drained_cold)

    def _cold(
        self, fns: dict[str, Callable[[], object]], reps: int, host_est: float
    ) -> tuple[dict[str, list[float]], bool]:
        """Per-repetition cold µs of each of ``fns``, interleaved (flush before every call)."""
        pairs = {k: [(self._event(), self._event()) for _ in range(reps)] for k in fns}
        stalled = self._stall(stall_us(host_est, reps * len(fns)))
        t0 = time.perf_counter()
        for i in range(reps):
            for k, fn in fns.items():
                self.flush()
                pairs[k][i][0].record()
                fn()
                pairs[k][i][1].record()
        host_total = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        out = {k: [s.elapsed_time(e) * 1000.0 for s, e in ps] for k, ps in pairs.items()}
        return out, self.has_sleep and host_total > stalled

    def interleaved(self, fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        """A fresh cold measurement of several ops, alternating call by call (so clock and
        thermal drift hit them alike): median µs per call of each."""
        host_est = max(self.host_estimate(fn, 1) for fn in fns.values())
        cold, _ = self._cold(fns, reps, host_est)
        return {k: float(statistics.median(v)) for k, v in cold.items()}


def gpu_warmup(min_ms: float = 150.0, n: int = 4096, device: str = "cuda") -> float:
    """Spin the GPU with dense fp16 matmuls for at least ``min_ms`` of wall time (clocks up,
    cuBLAS handles and workspaces created); returns the ms spent."""
    a = torch.randn(n, n, device=device, dtype=torch.float16)
    b = torch.randn(n, n, device=device, dtype=torch.float16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1000.0 < min_ms:
        for _ in range(8):
            torch.matmul(a, b)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000.0
