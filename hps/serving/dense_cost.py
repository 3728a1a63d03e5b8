"""What one sample costs the dense graph, and how many onnxruntime threads an execution of a
given batch runs on.

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

``dlrm_dcnv2``'s dense graph does 16 M multiply-adds per sample, and two threads ran even a
one-sample batch 1.4× faster.

Each thread computes whole output rows with the same reduction order, so the scores do not
depend on the thread count: an execution's samples come out bit-equal whichever session runs
them (tests/hps/serving/test_dense_cost.py).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = [
    "DEFAULT_PARALLEL_MIN_MACS",
    "WEIGHT_READ_SAMPLES",
    "serial_batch_limit",
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
