"""Triton-style inference statistics of a served model, counted by both protocols' servers
(``GET /v2/models/{m}/stats``): requests that succeeded and failed, samples, and the
nanoseconds spent in each phase of the successful ones."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hps.serving.v2_protocol import MODEL_VERSION

__all__ = ["ModelCounts", "PhaseNs"]


@dataclass
class PhaseNs:
    """Nanoseconds spent in each phase of requests (Triton's statistics names)."""

    queue: int = 0
    compute_input: int = 0
    compute_infer: int = 0
    compute_output: int = 0

    def add(self, other: PhaseNs) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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
    lock: threading.Lock = field(default_factory=threading.Lock)

    def succeeded(self, ns: int, samples: int, phases: PhaseNs) -> None:
        with self.lock:
            self.success, self.success_ns = self.success + 1, self.success_ns + ns
            self.samples += samples
            self.phase_ns.add(phases)
            self.last_ms = int(time.time() * 1e3)

    def failed(self, ns: int) -> None:
        with self.lock:
            self.fail, self.fail_ns = self.fail + 1, self.fail_ns + ns

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
                "execution_count": n,
                "inference_stats": stats,
            }
