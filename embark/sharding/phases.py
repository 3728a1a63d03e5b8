"""Wall time of a sharded training step by phase, for benchmarks: a :class:`PhaseClock` set on a
:class:`~embark.sharding.model.ShardedDLRM` (:meth:`~embark.sharding.model.ShardedDLRM.set_phase_clock`)
is marked at each phase boundary of the step, every interval charged to the phase that ends it::

    forward   OTHER (since the last mark) | INPUT_DIST | LOOKUP | OUTPUT_A2A | DENSE_FWD
    backward  OTHER (global loss) | DENSE_BWD (to the pooled embeddings' gradients)
              | EMB_BWD (vector-gradient all-to-all, table updates) | ALLREDUCE (dense buckets' wait)
    then      OPTIMIZER (marked by the caller after the optimizer step)

Waiting for a slower rank inside a collective is charged to that collective's phase.
"""

from __future__ import annotations

import time
from enum import StrEnum


class Phase(StrEnum):
    """A phase of a sharded training step."""

    INPUT_DIST = "input_dist"  # header + keys all-to-all (the wait, when started ahead)
    LOOKUP = "lookup"  # owner-side pooling of the received keys
    OUTPUT_A2A = "output_a2a"  # vectors all-to-all (and hierarchical stages), assembly
    DENSE_FWD = "dense_fwd"
    DENSE_BWD = "dense_bwd"
    EMB_BWD = "emb_bwd"  # vector-gradient all-to-all, fused table updates
    ALLREDUCE = "allreduce"  # the dense gradients' all-reduce still running after backward
    OPTIMIZER = "optimizer"
    OTHER = "other"  # global-loss all-reduce, zero_grad, Python between phases


class PhaseClock:
    """Seconds per :class:`Phase`, accumulated over steps (one clock per rank)."""

    def __init__(self) -> None:
        self.seconds: dict[Phase, float] = dict.fromkeys(Phase, 0.0)
        self._last = time.perf_counter()

    def restart(self) -> None:
        """Start the next interval now (e.g. at the start of a timed step)."""
        self._last = time.perf_counter()

    def mark(self, phase: Phase) -> None:
        """Charge the time since the last mark to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        """Zero every phase and restart."""
        self.seconds = dict.fromkeys(Phase, 0.0)
        self.restart()
