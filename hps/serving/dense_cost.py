"""What one sample costs the dense graph, and how many onnxruntime threads an execution of a
given batch runs on: measured at load (:func:`measure_crossover`), or estimated from the
graph's multiply-adds (:func:`serial_batch_limit`).

Onnxruntime wakes its intra-op pool for every node it splits between threads; with spinning
off (the server's setting: spinning pool threads take the cores the event loop needs) each wake
is a futex round trip, and a small execution spends more waking the pool than it saves. The
tiny model (48,512 multiply-adds per sample) in the v2 server, one HTTP client, the two
settings side by side (2-core VM; docs/benchmarks.md, "v2 server: small executions on one
onnxruntime thread"):

- batch 16 over HTTP: 0.42-0.45 ms per execution on one thread against 0.49-0.59 on two,
  11,242-12,389 samples/s against 9,658-11,413 (three cells); over gRPC, one cell, one thread
  behind: 7,370 against 8,885 (0.63 against 0.51 ms, the host slower during it);
- batch 256: the same wall time within the host's noise, the pool thread's 280-390 µs of CPU
  per request saved; with 16 clients merging 256-sample batches, even or slightly behind;
- its graph alone: one thread behind from batch 768.

Where the pool starts to pay depends on the host as much as on the graph: on a 2-vCPU Intel
Xeon VM the tiny model's graph alone ran faster on one thread at every batch up to 1,024
(batch 256: 234 µs against 328 µs on two threads without spinning), so the server measures
both sessions at load rather than trusting a bound set on another machine.

``dlrm_dcnv2``'s dense graph does 16 M multiply-adds per sample, and two threads ran even a
one-sample batch 1.4× faster.

Each thread computes whole output rows with the same reduction order, so the scores do not
depend on the thread count: an execution's samples come out bit-equal whichever session runs
them (tests/hps/serving/test_dense_cost.py).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_PARALLEL_MIN_MACS",
    "MEASURE_BUDGET_S",
    "MEASURE_MAX_BYTES",
    "MEASURE_RUNS",
    "PARALLEL_MIN_GAIN",
    "WEIGHT_READ_SAMPLES",
    "Crossover",
    "SizeTiming",
    "crossover_sizes",
    "measure_crossover",
    "serial_batch_limit",
    "time_sessions",
    "timed_batch_limit",
    "weight_macs_per_sample",
]

#: Multiply-adds below which an execution's dense graph runs on one onnxruntime thread: about
#: a quarter millisecond of one core; the tiny model's batches under 155 samples.
DEFAULT_PARALLEL_MIN_MACS = 8_000_000

#: An execution reads every weight once, which costs one thread about as long as this many
#: samples' multiply-adds: ``dlrm_dcnv2``'s dense graph (64 MB of weights, 16 M multiply-adds
#: per sample) took 3.8-4.3 ms for one sample and 0.38 ms per sample at batch 256. So a large
#: graph's small batches still run on every thread (two threads: 2.7-3.0 ms for one sample).
WEIGHT_READ_SAMPLES = 10

_WEIGHT_OPS = frozenset({"MatMul", "Gemm"})


def weight_macs_per_sample(graph: Path) -> int:
    """Multiply-adds one sample costs the weight matrices of ``graph`` (an ONNX file): for
    each ``MatMul`` or ``Gemm`` node with a constant (initializer) operand of two or more
    dimensions, that operand's element count (a ``(K, N)`` weight is ``K·N`` per row of the
    other operand). Products of two activations (a dot interaction) are not counted: they are
    a small share of a DLRM's dense graph.

    Raises:
        ValueError: ``graph`` is not a readable ONNX model.
    """
    import onnx

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and OSError subclasses of its own
        raise ValueError(f"cannot read ONNX graph {str(graph)!r}: {e}") from None
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer if len(t.dims) >= 2}
    total = 0
    for node in model.graph.node:
        if node.op_type in _WEIGHT_OPS:
            total += sum(sizes.get(name, 0) for name in node.input[:2])
    return total


def serial_batch_limit(macs_per_sample: int, parallel_min_macs: int, max_batch_size: int) -> int:
    """The batch size from which an execution runs on every onnxruntime thread; smaller ones
    run on one (0: none does). An execution of ``b`` samples counts as
    ``macs_per_sample × (b + WEIGHT_READ_SAMPLES)`` multiply-adds: it also reads every weight
    once. ``macs_per_sample`` 0 (nothing counted) or ``parallel_min_macs`` 0: 0.

    Raises:
        ValueError: a negative count.
    """
    for name, v in (
        ("macs_per_sample", macs_per_sample),
        ("parallel_min_macs", parallel_min_macs),
        ("max_batch_size", max_batch_size),
    ):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if macs_per_sample == 0:  # not counted: no estimate to go by
        return 0
    # the fewest samples reaching the bound
    limit = -(-parallel_min_macs // macs_per_sample) - WEIGHT_READ_SAMPLES
    limit = min(limit, max_batch_size + 1)
    return limit if limit > 1 else 0


#: The pool is chosen at a batch size only where its median beats one thread's by this share:
#: a tie goes to one thread, which leaves the other cores to the event loop and the lookups.
PARALLEL_MIN_GAIN = 0.10

#: Timed runs of each session at each measured batch size (their median counts).
MEASURE_RUNS = 9

#: Seconds :func:`measure_crossover` spends at most; the sizes it did not reach run on the pool.
MEASURE_BUDGET_S = 1.0

#: Bytes of random inputs one timed size may take (:func:`timed_batch_limit`): a model of 26
#: tables × 128 floats and a batch of 65,536 would otherwise allocate 872 MB at load.
MEASURE_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class SizeTiming:
    """One measured batch size: the median seconds of a run on the pool and on one thread."""

    batch: int
    pool_s: float
    one_s: float

    @property
    def pool_wins(self) -> bool:
        """Whether the pool beat one thread by :data:`PARALLEL_MIN_GAIN`."""
        return self.pool_s < (1.0 - PARALLEL_MIN_GAIN) * self.one_s


@dataclass(frozen=True)
class Crossover:
    """What :func:`measure_crossover` found: batches under ``serial_below`` run on one
    onnxruntime thread (0: none does), from the ``timings`` it measured, smallest first."""

    serial_below: int
    timings: tuple[SizeTiming, ...]

    def describe(self) -> str:
        """The timings as ``batch: pool/one µs`` items, for a log line."""
        return ", ".join(
            f"{t.batch}: {t.pool_s * 1e6:.0f}/{t.one_s * 1e6:.0f} µs" for t in self.timings
        )


def crossover_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes :func:`measure_crossover` times: 1, 2, 4, … below ``max_batch_size``,
    then ``max_batch_size`` (none for 0).

    >>> crossover_sizes(100)
    [1, 2, 4, 8, 16, 32, 64, 100]
    """
    sizes = [1 << k for k in range(max(max_batch_size, 1).bit_length()) if 1 << k < max_batch_size]
    return [*sizes, max_batch_size] if max_batch_size > 0 else []


def timed_batch_limit(max_batch_size: int, bytes_per_sample: int) -> int:
    """The largest batch :func:`measure_crossover` times for a model taking ``max_batch_size``
    samples of ``bytes_per_sample`` input bytes each: its inputs stay within
    :data:`MEASURE_MAX_BYTES` (larger batches, not timed, run on the pool).

    >>> timed_batch_limit(65_536, 26 * 128 * 4 + 13 * 4)
    5021
    """
    if max_batch_size < 0 or bytes_per_sample < 1:
        raise ValueError(
            f"need max_batch_size >= 0 and bytes_per_sample >= 1, got {max_batch_size} "
            f"and {bytes_per_sample}"
        )
    return min(max_batch_size, max(1, MEASURE_MAX_BYTES // bytes_per_sample))


def measure_crossover(
    time_both: Callable[[int], SizeTiming],
    max_batch_size: int,
    budget_s: float = MEASURE_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
) -> Crossover:
    """The batch size from which an execution runs on the onnxruntime pool: the smallest of
    :func:`crossover_sizes` at which the pool wins (:attr:`SizeTiming.pool_wins`) and wins at
    the next size too (or is the last size), timed smallest first by ``time_both`` and stopped
    there. A lone win is taken for noise; where the pool never wins every batch the model takes
    runs on one thread (``max_batch_size + 1``). Once ``budget_s`` has passed, the sizes not yet
    timed run on the pool (a pending win counts). A crossover at batch 1 is 0 (no batch runs on
    one thread).

    Raises:
        ValueError: a negative ``max_batch_size`` or a ``budget_s`` that is not > 0.
    """
    if max_batch_size < 0:
        raise ValueError(f"max_batch_size must be >= 0, got {max_batch_size}")
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    start = clock()
    timings: list[SizeTiming] = []
    pending: int | None = None  # the first size of the current run of pool wins

    def found(b: int) -> Crossover:
        return Crossover(b if b > 1 else 0, tuple(timings))

    for b in crossover_sizes(max_batch_size):
        if timings and clock() - start > budget_s:
            return found(pending if pending is not None else b)
        t = time_both(b)
        timings.append(t)
        if not t.pool_wins:
            pending = None
        elif pending is not None:
            return found(pending)
        else:
            pending = b
    return found(pending if pending is not None else max_batch_size + 1)


Runner = Callable[[list[str], dict[str, np.ndarray]], Any]


def time_sessions(
    pool: Runner,
    one: Runner,
    inputs: dict[str, tuple[int, ...]],
    outputs: list[str],
    runs: int = MEASURE_RUNS,
) -> Callable[[int], SizeTiming]:
    """A ``time_both`` for :func:`measure_crossover`: at batch ``b``, each session run once
    to warm, then ``runs`` times each, the two alternating and the first of each pair taking
    turns, on seeded standard-normal float32 inputs of ``(b, *inputs[name])``.

    Args:
        pool, one: the ``run`` of the session on every thread and of the one-thread session.
        inputs: each input's shape after the batch dimension.
        outputs: the output names a run asks for.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    rng = np.random.default_rng(0)

    def time_both(b: int) -> SizeTiming:
        f = {n: rng.standard_normal((b, *shape), dtype=np.float32) for n, shape in inputs.items()}
        pool(outputs, f)
        one(outputs, f)
        took: dict[bool, list[float]] = {True: [], False: []}
        for k in range(runs):
            for is_pool in (True, False) if k % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                (pool if is_pool else one)(outputs, f)
                took[is_pool].append(time.perf_counter() - t0)
        return SizeTiming(b, statistics.median(took[True]), statistics.median(took[False]))

    return time_both
