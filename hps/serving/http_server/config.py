"""The server's knobs: :class:`ServerConfig` (each a ``--flag`` of ``python -m hps.server``),
the per-model batching overrides (:class:`ModelBatching`) and the bounds of each knob."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hps.serving.batcher import MAX_QUEUE_DELAY_US, BatchingConfig
from hps.serving.connections import ConnectionLimits, EventLoop, HttpParser
from hps.serving.dense_cost import DEFAULT_PARALLEL_MIN_MACS
from hps.serving.grpc_front.relay import MAX_PROCESSES
from hps.serving.servable import DLRMServable

__all__ = [
    "MAX_CONNECTIONS",
    "GRPC_PROCESSES_AUTO",
    "MAX_GRPC_PROCESSES",
    "MAX_ORT_THREADS",
    "MAX_QUEUED",
    "MAX_WORKERS",
    "ModelBatching",
    "ServerConfig",
    "available_cores",
]

# The largest value of each integer knob: past these a server only exhausts threads, memory
# or file descriptors. Threads past the core count add contention, not throughput; 256 is one
# per core of the largest common servers (two sockets of 128 cores).
MAX_WORKERS = 256
MAX_ORT_THREADS = 256
MAX_QUEUED = 65536  # each queued request holds its body (up to max_request_mb)
MAX_CONNECTIONS = 65536  # one file descriptor each; also bounded by RLIMIT_NOFILE at start
MAX_GRPC_PROCESSES = MAX_PROCESSES
GRPC_PROCESSES_AUTO = -1  # one gRPC front process where 2 or more cores are available


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ModelBatching:
    """Dynamic batching knobs of one model, overriding the server's (``--model-batching
    NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US[:PREFERRED_BATCH_SIZE]``); see
    :class:`~hps.serving.batcher.BatchingConfig`. ``max_batch_size`` 0: the model's own
    (``ps.json``); ``preferred_batch_size`` ``None``: the server's (either capped at the
    batch size).

    Raises:
        ValueError: naming the model and the knob, for a value outside its range
            (``max_batch_size`` and ``preferred_batch_size`` 0 to 2**31 - 1,
            ``max_queue_delay_us`` 0 to ``MAX_QUEUE_DELAY_US``).
    """

    model: str
    max_batch_size: int
    max_queue_delay_us: int
    preferred_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name, hi in (
            ("max_batch_size", 2**31 - 1),
            ("max_queue_delay_us", MAX_QUEUE_DELAY_US),
            ("preferred_batch_size", 2**31 - 1),
        ):
            v = getattr(self, name)
            if name == "preferred_batch_size" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
                raise ValueError(
                    f"model batching of {self.model!r}: {name} must be an integer from 0 to "
                    f"{hi}, got {v!r}"
                )

    @classmethod
    def parse(cls, text: str) -> ModelBatching:
        """``"NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US[:PREFERRED_BATCH_SIZE]"`` (model names
        hold no ``:``; ``ValueError`` naming the text, or the model and the knob out of its
        range)."""
        name, *numbers = text.split(":")
        try:
            if len(numbers) not in (2, 3):
                raise ValueError
            size, delay, *preferred = (int(n) for n in numbers)
        except ValueError:
            raise ValueError(
                f"model batching {text!r} is not NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US"
                "[:PREFERRED_BATCH_SIZE] (two or three integers)"
            ) from None
        return cls(name, size, delay, preferred[0] if preferred else None)


@dataclass(frozen=True)
class ServerConfig:
    """Server knobs (each is a ``--flag`` of ``python -m hps.server``).

    Raises:
        ValueError: naming the knob, for a count outside its range (``workers`` 1 to
            ``MAX_WORKERS``, ``max_queued`` 0 to ``MAX_QUEUED``, ``ort_threads`` 0 to
            ``MAX_ORT_THREADS``, ``ort_parallel_min_macs`` 0 to 2**62, ``max_connections`` 1
            to ``MAX_CONNECTIONS``, ``port`` and ``grpc_port`` 0 to 65535, ``grpc_port`` equal
            to a fixed ``port``), a timeout that is not a finite number of seconds > 0, or a
            request limit that is not a finite number of MiB of at least one byte.
    """

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (read it from InferenceServer.port)
    workers: int = 4  # threads that parse large requests; with max_queued, requests in flight
    max_queued: int = 64  # requests in flight beyond workers before new ones get 503
    ort_threads: int = 0  # onnxruntime intra-op threads per execution (0: available_cores())
    # With ort_measure_threads off, an execution whose dense graph does fewer multiply-adds
    # runs it on one onnxruntime thread (0, either way: every execution on ort_threads):
    # waking the pool costs a small one more than it saves. Scores are the same either way.
    # hps.serving.dense_cost
    ort_parallel_min_macs: int = DEFAULT_PARALLEL_MIN_MACS
    # Time the dense graph on both sessions at load (batch 1, 2, 4, … max_batch_size) and run
    # on one thread the batches it wins, rather than counting multiply-adds against
    # ort_parallel_min_macs (0 still means every execution on ort_threads): where the pool
    # starts to pay depends on the host (hps.serving.dense_cost).
    ort_measure_threads: bool = True
    torch_threads: int = 1  # torch intra-op threads of each model's inference thread (lookups)
    # The interpreter's thread switch interval while serving (process-wide, restored on stop).
    # Python's 5 ms default makes the event loop wait up to 5 ms for the lock at every step
    # while an inference thread runs Python: tiny model, 16 HTTP clients × batch 16 on 2
    # shared cores, 1,531 samples/s at 5 ms, 4,720 at 0.2 ms (benchmarks/hps/bench_server).
    switch_interval_us: int = 200
    # Collect the start-up's garbage, then freeze the interpreter's objects as serving starts
    # (gc.freeze, process-wide; the last server to stop unfreezes them): the cyclic collector
    # then skips the few hundred thousand objects of the imports and models, which it walked
    # while holding the interpreter lock.
    # Tiny model, 16 HTTP clients × batch 16 on 2 shared cores, 20 s cells: unfrozen, one full
    # collection stopped the server for 346-347 ms (the cells' max latency 370-372 ms);
    # frozen, no collection took over 2.7 ms (max latency 35-38 ms). hps.serving.http_server.heap
    gc_freeze: bool = True
    max_request_mb: float = 256.0  # larger bodies (also once decompressed) are refused with 400
    max_json_mb: float = 16.0  # larger JSON parts are refused with 400 (binary tensors are not)
    max_batch_size: int = 0  # samples per merged execution (0: each model's, from ps.json)
    # The longest a request waits for others to join its batch (one queued behind an
    # execution: the longest it waits after that execution ends, for the requests it answered
    # to come back). A batch waits only while known clients (connections that came back) may
    # still send, so a lone client or one that connects per request never pays it. Measured on the tiny model, 16 closed-loop
    # clients × batch 16, 2 shared cores at load 9.7-14.2: 10 ms gives 20,629-23,541
    # samples/s (100 µs: 14,389-17,333) and a p99 of 15.9-21.2 ms, within 2 × delay + one
    # execution (~22 ms), for HTTP and raw gRPC (tritonclient's gRPC: 32.8-36.1 ms); at
    # 5 ms the p99 (17.6-38.3 ms) never met its bound (12-13.7 ms). docs/benchmarks.md,
    # "Default batching: a client counts once it comes back" and "v2 server over gRPC:
    # preferred batches and known clients".
    max_queue_delay_us: int = 10_000
    # Once nothing more is waiting, a batch of fewer samples waits (at most the delay) and
    # one of this many runs at once; every waiting request joins a batch up to the merged
    # max_batch_size regardless (Triton sends its largest preferred size instead). 0: the
    # merged max_batch_size; every model.
    preferred_batch_size: int = 0
    model_batching: tuple[ModelBatching, ...] = ()  # per-model overrides of the three above
    max_connections: int = 512  # open connections; past it a new one gets 503 and is closed
    header_timeout_s: float = 10.0  # connect (or last response) → request headers complete
    body_timeout_s: float = 60.0  # request headers complete → body complete
    grpc_port: int | None = None  # also serve the v2 gRPC protocol there (on host); 0: free
    # gRPC in front processes (hps.serving.grpc_front) sharing grpc_port, each carrying its
    # calls to this process; 0: grpcio's threads in this process; -1 (auto): one front where
    # this process may use 2 or more cores, else 0. grpcio costs ~0.4 ms of CPU per call,
    # which in this process competes with batching and inference for the interpreter: tiny
    # model, 16 tritonclient gRPC clients × batch 16 on 2 cores, one front served 1.19-1.44×
    # the samples/s of grpcio's threads in six alternated pairs; a lone client ran 4-15 %
    # slower for the extra hop with uvloop fronts (docs/benchmarks.md, "gRPC front
    # processes").
    grpc_processes: int = GRPC_PROCESSES_AUTO

    @property
    def grpc_fronts(self) -> int:
        """The gRPC front processes this configuration starts (``grpc_processes`` resolved;
        0 without ``grpc_port``)."""
        if self.grpc_port is None:
            return 0
        if self.grpc_processes == GRPC_PROCESSES_AUTO:
            return 1 if available_cores() >= 2 else 0
        return self.grpc_processes

    # The HTTP parser and event loop (auto: httptools and uvloop when installed, else h11 and
    # asyncio's, logged). Tiny model, 16 HTTP clients × batch 16, 2 shared cores: the event
    # loop's CPU per request 676 µs with h11 + asyncio, 438 µs with httptools + uvloop.
    http: HttpParser = HttpParser.AUTO
    loop: EventLoop = EventLoop.AUTO

    def __post_init__(self) -> None:
        bounds = [
            ("workers", 1, MAX_WORKERS),
            ("max_queued", 0, MAX_QUEUED),
            ("ort_threads", 0, MAX_ORT_THREADS),
            ("ort_parallel_min_macs", 0, 2**62),
            ("torch_threads", 1, MAX_ORT_THREADS),
            ("switch_interval_us", 1, 5000),
            ("max_connections", 1, MAX_CONNECTIONS),
            ("max_batch_size", 0, 2**31 - 1),
            ("max_queue_delay_us", 0, MAX_QUEUE_DELAY_US),
            ("preferred_batch_size", 0, 2**31 - 1),
            ("port", 0, 65535),
            ("grpc_processes", GRPC_PROCESSES_AUTO, MAX_GRPC_PROCESSES),
        ]
        if self.grpc_port is not None:
            bounds.append(("grpc_port", 0, 65535))
        for f, lo, hi in bounds:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(
                    f"ServerConfig.{f} must be an integer from {lo} to {hi}, got {v!r}"
                )
        for flag in ("gc_freeze", "ort_measure_threads"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"ServerConfig.{flag} must be True or False, got {getattr(self, flag)!r}"
                )
        for f, kind in (("http", HttpParser), ("loop", EventLoop)):
            if not isinstance(getattr(self, f), kind):
                raise ValueError(
                    f"ServerConfig.{f} must be one of {[k.value for k in kind]} "
                    f"({kind.__name__}), got {getattr(self, f)!r}"
                )
        if self.grpc_processes > 0 and self.grpc_port is None:
            raise ValueError(
                f"ServerConfig.grpc_processes {self.grpc_processes} needs a grpc_port to serve on"
            )
        if self.grpc_port == self.port != 0:
            raise ValueError(
                f"ServerConfig.grpc_port {self.grpc_port} is also the HTTP port; give each "
                "protocol its own"
            )
        for f in ("max_request_mb", "max_json_mb"):
            mb = getattr(self, f)
            ok = isinstance(mb, (int, float)) and not isinstance(mb, bool) and math.isfinite(mb)
            if not ok or mb * 2**20 < 1:
                raise ValueError(
                    f"ServerConfig.{f} must be a finite number of MiB > 0 "
                    f"(at least one byte), got {mb!r}"
                )
        names = [m.model for m in self.model_batching]
        if len(set(names)) != len(names):
            raise ValueError(f"ServerConfig.model_batching names a model twice: {names}")
        try:
            self.limits()
        except ValueError as e:
            raise ValueError(f"ServerConfig.{e}") from None

    def limits(self) -> ConnectionLimits:
        """The connection deadlines and bound (:mod:`hps.serving.connections`)."""
        return ConnectionLimits(self.header_timeout_s, self.body_timeout_s, self.max_connections)

    def batching(self, servable: DLRMServable) -> BatchingConfig:
        """How ``servable``'s requests are merged: its ``model_batching`` entry, else the
        server's knobs (``max_batch_size`` 0: the model's own).

        Raises:
            ValueError: a batch size above the model's ``max_batch_size`` (naming both).
        """
        size, delay = self.max_batch_size, self.max_queue_delay_us
        preferred = self.preferred_batch_size
        for m in self.model_batching:
            if m.model == servable.name:
                size, delay = m.max_batch_size, m.max_queue_delay_us
                if m.preferred_batch_size is not None:
                    preferred = m.preferred_batch_size
        size = size or servable.max_batch_size
        preferred = min(preferred, size)
        if size > servable.max_batch_size:
            raise ValueError(
                f"model {servable.name!r}: batching max_batch_size {size} exceeds the model's "
                f"max_batch_size {servable.max_batch_size} (ps.json), which bounds one lookup"
            )
        try:
            return BatchingConfig(size, delay, preferred)
        except ValueError as e:
            raise ValueError(f"model {servable.name!r}: batching {e}") from None
