"""Triton-style inference statistics of a served model, counted by both protocols' servers
(``GET /v2/models/{m}/stats``): requests that succeeded and failed, samples, the nanoseconds
spent in each phase of the successful ones, and the executions the dynamic batcher ran
(:mod:`hps.serving.batcher`), as Triton reports them::

    inference_count    samples of successful requests
    execution_count    executions (merged batches): fewer than requests when batching merges
    inference_stats    per phase {count: requests, ns: their summed time}; queue is the time
                       from a request's arrival at the batcher to the start of its execution
    batch_stats        per execution size {batch_size, compute_infer: {count, ns}}
    non_finite_output  requests refused because their scores came out NaN or infinite
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hps.serving.v2_protocol import MODEL_VERSION

__all__ = ["RECENT_REQUESTS", "ModelCounts", "PhaseNs"]

#: Successful requests whose latencies :class:`ModelCounts` keeps (the latest; for percentiles),
#: in a ring of two int64 per request: 1 MiB per model.
RECENT_REQUESTS = 65536


@dataclass
class PhaseNs:
    """Nanoseconds spent in each phase of requests (Triton's statistics names)."""

    queue: int = 0
    compute_input: int = 0
    compute_infer: int = 0
    compute_output: int = 0

    def add(self, other: PhaseNs) -> None:
        # each phase by name: once per request, where a loop over fields() costs ~4× more
        self.queue += other.queue
        self.compute_input += other.compute_input
        self.compute_infer += other.compute_infer
        self.compute_output += other.compute_output


@dataclass
class ModelCounts:
    """Triton-style statistics of one model (counts and summed nanoseconds)."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    samples: int = 0  # Triton's inference_count: samples, not requests
    phase_ns: PhaseNs = field(default_factory=PhaseNs)
    last_ms: int = 0  # wall-clock ms of the last successful inference
    executions: int = 0
    batch_ns: dict[int, list[int]] = field(default_factory=dict)  # size → [count, infer ns]
    non_finite: int = 0
    # ring of the latest successful requests' (whole request ns, queue + compute_infer ns,
    # compute_infer ns): request k (counting successes from 0) is row k % RECENT_REQUESTS
    recent: np.ndarray = field(
        default_factory=lambda: np.zeros((RECENT_REQUESTS, 3), np.int64), repr=False, compare=False
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def succeeded(self, ns: int, samples: int, phases: PhaseNs) -> None:
        with self.lock:
            self.success, self.success_ns = self.success + 1, self.success_ns + ns
            self.samples += samples
            self.phase_ns.add(phases)
            self.recent[(self.success - 1) % RECENT_REQUESTS] = (
                ns,
                phases.queue + phases.compute_infer,
                phases.compute_infer,
            )
            self.last_ms = int(time.time() * 1e3)

    def failed(self, ns: int, non_finite: bool = False) -> None:
        """Count a failed request (``non_finite``: its scores were NaN or infinite)."""
        with self.lock:
            self.fail, self.fail_ns = self.fail + 1, self.fail_ns + ns
            self.non_finite += non_finite

    def executed(self, batch_size: int, ns: int) -> None:
        """Count one execution of ``batch_size`` samples that took ``ns``."""
        with self.lock:
            self.executions += 1
            entry = self.batch_ns.setdefault(batch_size, [0, 0])
            entry[0] += 1
            entry[1] += ns

    def recent_ns(self, n: int) -> list[tuple[int, int, int]]:
        """The latest ``n`` successful requests (at most :data:`RECENT_REQUESTS`), oldest
        first: (ns from the request's start to its answer encoded, ns in the batcher: queue +
        its execution, ns of its execution alone)."""
        with self.lock:  # copies only the n rows asked for
            k = max(0, min(n, self.success, RECENT_REQUESTS))
            rows = np.arange(self.success - k, self.success) % RECENT_REQUESTS
            latest = self.recent[rows].tolist()
        return [(a, b, c) for a, b, c in latest]

    def to_dict(self, name: str) -> dict[str, Any]:
        """The model's entry of Triton's statistics document."""
        with self.lock:
            n = self.success
            stats = {
                "success": {"count": n, "ns": self.success_ns},
                "fail": {"count": self.fail, "ns": self.fail_ns},
                **{k: {"count": n, "ns": v} for k, v in asdict(self.phase_ns).items()},
            }
            return {
                "name": name,
                "version": MODEL_VERSION,
                "last_inference": self.last_ms,
                "inference_count": self.samples,
                "execution_count": self.executions,
                "inference_stats": stats,
                "batch_stats": [
                    {"batch_size": size, "compute_infer": {"count": c, "ns": ns}}
                    for size, (c, ns) in sorted(self.batch_ns.items())
                ],
                "non_finite_output": self.non_finite,
            }
