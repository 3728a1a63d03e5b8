"""The inference server: the KServe v2 HTTP protocol over the parameter server, so
``tritonclient.http`` works unchanged. It serves every model of a ``ps.json`` whose
``network_file`` is a dense graph (see :mod:`hps.serving.servable` for the tensors).

    python -m hps.server --config out/ps.json --port 8000

Endpoints (errors are ``{"error": "..."}``: 400 for a bad request or an unknown model or
version, 404 / 405 for an unknown path or method, 503 when the parameter server had no free
lookup worker in time or a tier holding a looked-up key failed (the message names the table
and the tier: :class:`~hps.types.TierUnavailableError`), 422 for non-finite scores, 500
otherwise)::

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready    ready: 503 while online updates fail (hps.updates.health)
    GET  /v2/models/{m}[/versions/1]           model metadata (inputs, outputs)
    GET  /v2/models/{m}[/versions/1]/ready
    GET  /v2/models/{m}[/versions/1]/stats     Triton-style counts + per-table HPS statistics
                                               + "online_updates" (hps.updates.health)
    GET  /v2/models/stats                      the same for every model
    GET  /v2/models/{m}[/versions/1]/config    Triton's model configuration (JSON)
    POST /v2/repository/index                  every served model, READY
    POST /v2/models/{m}[/versions/1]/infer     JSON or binary tensors (Inference-Header-Content-Length)

A request is parsed on the event loop (a large or compressed body on one of ``workers``
threads), checked, and handed to its model's dynamic batcher (:mod:`hps.serving.batcher`):
one inference thread per model merges the requests waiting at once into one execution of up
to ``max_batch_size`` samples, waiting at most ``max_queue_delay_us`` for more; the answer is
encoded on the event loop. At most ``workers + max_queued`` requests are in flight; beyond
that a request whose body has arrived gets 503 at once, so memory stays bounded under any
number of clients. A request whose scores come out NaN or infinite gets 422 naming the model
(counted in ``/stats`` as ``non_finite_output``). Connections are bounded apart from that
(``max_connections``), and each request must arrive within ``header_timeout_s`` (its headers)
and ``body_timeout_s`` (the rest of its body) or its connection is closed
(:mod:`hps.serving.connections`): sockets that stall cannot take the place of requests. The
background work ``ps.json`` asks for (online updates, cache refresh) runs while the server does.
With ``grpc_port`` set, the same servables are served over gRPC too
(:mod:`hps.serving.grpc_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.batcher import (
    MAX_QUEUE_DELAY_US,
    BatchedResult,
    BatchingConfig,
    DynamicBatcher,
    start_batchers,
)
from hps.serving.connections import ConnectionLimits, protocol_class
from hps.serving.grpc_server import GrpcServer
from hps.serving.servable import DLRMServable, InputError, NonFiniteOutputError
from hps.serving.statistics import ModelCounts, PhaseNs
from hps.serving.v2_protocol import (
    HEADER_LENGTH,
    MODEL_VERSION,
    SERVER_NAME,
    InferRequest,
    ProtocolError,
    encode_infer_response,
    find_model,
    parse_infer_request,
    repository_index,
    repository_index_request,
    server_version,
)
from hps.types import TierUnavailableError

log = logging.getLogger(__name__)

__all__ = [
    "InferenceServer",
    "ModelBatching",
    "ServerConfig",
    "available_cores",
    "build_servables",
    "create_app",
    "open_server",
]


# The largest value of each integer knob: past these a server only exhausts threads, memory
# or file descriptors. Threads past the core count add contention, not throughput; 256 is one
# per core of the largest common servers (two sockets of 128 cores).
MAX_WORKERS = 256
MAX_ORT_THREADS = 256
MAX_QUEUED = 65536  # each queued request holds its body (up to max_request_mb)
MAX_CONNECTIONS = 65536  # one file descriptor each; also bounded by RLIMIT_NOFILE at start
_FD_RESERVE = 64  # file descriptors the process needs beside its connections (files, db, ort)
# Bodies up to this size (uncompressed) are parsed on the event loop: a binary request of a
# few hundred samples parses in ~50 µs, less than a thread hand-off costs; larger ones (JSON
# tensors parse at ~50 MB/s) go to a worker thread so they do not stall other requests.
_INLINE_PARSE_BYTES = 64 << 10


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ModelBatching:
    """Dynamic batching knobs of one model, overriding the server's (``--model-batching
    NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US``); see :class:`~hps.serving.batcher.BatchingConfig`."""

    model: str
    max_batch_size: int
    max_queue_delay_us: int

    @classmethod
    def parse(cls, text: str) -> ModelBatching:
        """``"NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US"`` (``ValueError`` naming the text)."""
        name, _, rest = text.rpartition(":")
        name, _, size = name.rpartition(":")
        try:
            return cls(name, int(size), int(rest))
        except ValueError:
            raise ValueError(
                f"model batching {text!r} is not NAME:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US "
                "(two integers)"
            ) from None


@dataclass(frozen=True)
class ServerConfig:
    """Server knobs (each is a ``--flag`` of ``python -m hps.server``).

    Raises:
        ValueError: naming the knob, for a count outside its range (``workers`` 1 to
            ``MAX_WORKERS``, ``max_queued`` 0 to ``MAX_QUEUED``, ``ort_threads`` 0 to
            ``MAX_ORT_THREADS``, ``max_connections`` 1 to ``MAX_CONNECTIONS``, ``port`` and
            ``grpc_port`` 0 to 65535, ``grpc_port`` equal to a fixed ``port``), a timeout that
            is not a finite number of seconds > 0, or a request limit that is not a finite
            number of MiB of at least one byte.
    """

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (read it from InferenceServer.port)
    workers: int = 4  # threads that parse large requests; with max_queued, requests in flight
    max_queued: int = 64  # requests in flight beyond workers before new ones get 503
    ort_threads: int = 0  # onnxruntime intra-op threads per execution (0: available_cores())
    torch_threads: int = 1  # torch intra-op threads of each model's inference thread (lookups)
    # The interpreter's thread switch interval while serving (process-wide, restored on stop).
    # Python's 5 ms default makes the event loop wait up to 5 ms for the lock at every step
    # while an inference thread runs Python: tiny model, 16 HTTP clients × batch 16 on 2
    # shared cores, 1,531 samples/s at 5 ms, 4,720 at 0.2 ms (benchmarks/hps/bench_server).
    switch_interval_us: int = 200
    max_request_mb: float = 256.0  # larger bodies (also once decompressed) are refused with 400
    max_json_mb: float = 16.0  # larger JSON parts are refused with 400 (binary tensors are not)
    max_batch_size: int = 0  # samples per merged execution (0: each model's, from ps.json)
    max_queue_delay_us: int = 100  # how long a request may wait for others to join its batch
    model_batching: tuple[ModelBatching, ...] = ()  # per-model overrides of the two above
    max_connections: int = 512  # open connections; past it a new one gets 503 and is closed
    header_timeout_s: float = 10.0  # connect (or last response) → request headers complete
    body_timeout_s: float = 60.0  # request headers complete → body complete
    grpc_port: int | None = None  # also serve the v2 gRPC protocol there (on host); 0: free

    def __post_init__(self) -> None:
        bounds = [
            ("workers", 1, MAX_WORKERS),
            ("max_queued", 0, MAX_QUEUED),
            ("ort_threads", 0, MAX_ORT_THREADS),
            ("torch_threads", 1, MAX_ORT_THREADS),
            ("switch_interval_us", 1, 5000),
            ("max_connections", 1, MAX_CONNECTIONS),
            ("max_batch_size", 0, 2**31 - 1),
            ("max_queue_delay_us", 0, MAX_QUEUE_DELAY_US),
            ("port", 0, 65535),
        ]
        if self.grpc_port is not None:
            bounds.append(("grpc_port", 0, 65535))
        for f, lo, hi in bounds:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(
                    f"ServerConfig.{f} must be an integer from {lo} to {hi}, got {v!r}"
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
        for m in self.model_batching:
            if m.model == servable.name:
                size, delay = m.max_batch_size, m.max_queue_delay_us
        size = size or servable.max_batch_size
        if size > servable.max_batch_size:
            raise ValueError(
                f"model {servable.name!r}: batching max_batch_size {size} exceeds the model's "
                f"max_batch_size {servable.max_batch_size} (ps.json), which bounds one lookup"
            )
        try:
            return BatchingConfig(size, delay)
        except ValueError as e:
            raise ValueError(f"model {servable.name!r}: batching {e}") from None


def _error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


class _V2Endpoints:
    """The endpoints of the v2 protocol over ``servables`` (model name → servable): request
    handlers, the worker limiter and the statistics of one application."""

    def __init__(
        self,
        servables: dict[str, DLRMServable],
        cfg: ServerConfig,
        counts: dict[str, ModelCounts],
        batchers: dict[str, DynamicBatcher],
    ) -> None:
        self.servables, self.counts, self.batchers = servables, counts, batchers
        self.limiter = anyio.CapacityLimiter(cfg.workers)
        self.workers, self.max_queued = cfg.workers, cfg.max_queued
        self.in_flight = 0  # requests between their body's arrival and their answer
        self.max_bytes = int(cfg.max_request_mb * 2**20)
        self.max_json_bytes = int(cfg.max_json_mb * 2**20)

    def routes(self) -> list[Route]:
        m = "/v2/models/{model}"
        v = m + "/versions/{version}"
        return [
            Route("/v2", self.server_metadata),
            Route("/v2/health/live", self.live),
            Route("/v2/health/ready", self.ready),
            Route("/v2/models/stats", self.all_stats),  # before {model}: all-model stats
            Route(m, self.model_metadata),
            Route(v, self.model_metadata),
            Route(m + "/ready", self.model_ready),
            Route(v + "/ready", self.model_ready),
            Route(m + "/stats", self.model_stats),
            Route(v + "/stats", self.model_stats),
            Route(m + "/config", self.model_config),
            Route(v + "/config", self.model_config),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route(m + "/infer", self.infer, methods=["POST"]),
            Route(v + "/infer", self.infer, methods=["POST"]),
        ]

    def model_of(self, request: Request) -> DLRMServable:
        """The servable a path names (``ProtocolError`` for an unknown model or version)."""
        p = request.path_params
        return find_model(self.servables, p["model"], p.get("version", MODEL_VERSION))

    # ------------------------------------------------------------------ metadata and health
    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse(
            {
                "name": SERVER_NAME,
                "version": server_version(),
                "extensions": ["binary_tensor_data", "statistics", "model_configuration"],
            }
        )

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        """200 once every model has loaded (the app exists then) while the online updates'
        readiness policy holds; else 503 naming why (:mod:`hps.updates.health`)."""
        for s in self.servables.values():
            status = s.session.update_status()
            if not status.ready:
                return _error(status.reason, 503)
        return Response(status_code=200)

    async def model_metadata(self, request: Request) -> Response:
        try:
            return JSONResponse(self.model_of(request).metadata())
        except ProtocolError as e:
            return _error(str(e))

    async def model_config(self, request: Request) -> Response:
        try:
            s = self.model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        return JSONResponse(model_config(s, self.batchers[s.name].cfg))

    async def repository_index(self, request: Request) -> Response:
        """Triton's index: every served model, ``READY``; the body may be empty or
        ``{"ready": bool}`` (all models are ready, so both answers are the same)."""
        try:
            repository_index_request(await self.read_body(request))  # bounded, as /infer's
        except ClientDisconnect:
            return Response(status_code=400)
        except ProtocolError as e:
            return _error(str(e))
        return JSONResponse(repository_index(self.servables))

    async def model_ready(self, request: Request) -> Response:
        try:
            self.model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        return Response(status_code=200)

    def stats_of(self, name: str) -> dict[str, Any]:
        session = self.servables[name].session
        return {
            **self.counts[name].to_dict(name),
            "hps": session.stats(),
            "online_updates": session.update_status().to_dict(),
        }

    async def model_stats(self, request: Request) -> Response:
        try:
            s = self.model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        return JSONResponse({"model_stats": [self.stats_of(s.name)]})

    async def all_stats(self, request: Request) -> Response:
        return JSONResponse({"model_stats": [self.stats_of(n) for n in self.servables]})

    # ------------------------------------------------------------------ inference
    async def read_body(self, request: Request) -> bytes | bytearray:
        """The request body, refused (``ProtocolError``) past ``max_request_mb``; with a
        ``Content-Length``, read into one buffer of that size (no list of chunks to join)."""
        limit = self.max_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise ProtocolError(
                    f"request body of {declared} bytes exceeds the server's limit of "
                    f"{limit} bytes (--max-request-mb)"
                )
            buf, size = bytearray(int(declared)), 0
            async for chunk in request.stream():
                if size + len(chunk) > len(buf):
                    raise ProtocolError(
                        f"request body is longer than its Content-Length {declared}"
                    )
                buf[size : size + len(chunk)] = chunk
                size += len(chunk)
            if size != len(buf):
                raise ClientDisconnect()  # uvicorn ends a short body only when the peer left
            return buf
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(
                    f"request body exceeds the server's limit of {limit} bytes (--max-request-mb)"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def busy(self) -> str | None:
        """Why a request whose body has arrived cannot be taken now (``None``: it can):
        ``workers + max_queued`` requests in flight. Only requests being processed count;
        connections that have not sent a whole request do not (see
        :mod:`hps.serving.connections`)."""
        slots = self.workers + self.max_queued
        if self.in_flight < slots:
            return None
        return (
            f"server busy: all {slots} request slots are taken (--workers {self.workers} "
            f"+ --max-queued {self.max_queued}); retry later"
        )

    async def parse(self, s: DLRMServable, body: bytes | bytearray, request: Request) -> Any:
        """The request parsed and checked: ``(InferRequest, checked inputs)``; on the event
        loop when small, else on a worker thread."""
        header_length = request.headers.get(HEADER_LENGTH)
        encoding = request.headers.get("content-encoding")
        if encoding is None and len(body) <= _INLINE_PARSE_BYTES:
            return self.parse_checked(s, body, header_length, encoding)
        return await anyio.to_thread.run_sync(
            self.parse_checked, s, body, header_length, encoding, limiter=self.limiter
        )

    def parse_checked(
        self,
        s: DLRMServable,
        body: bytes | bytearray,
        header_length: str | None,
        encoding: str | None,
    ) -> tuple[InferRequest, dict[str, Any]]:
        req = parse_infer_request(
            body, header_length, encoding, self.max_bytes, max_json_bytes=self.max_json_bytes
        )
        return req, s.check(req.inputs)

    async def infer(self, request: Request) -> Response:
        start = time.perf_counter_ns()
        name = request.path_params["model"]
        try:
            s = self.model_of(request)
            body = await self.read_body(request)
            if (busy := self.busy()) is not None:
                return self._failed(name, start, _error(busy, 503))
            self.in_flight += 1
            try:
                t0 = time.perf_counter_ns()
                req, inputs = await self.parse(s, body, request)
                del body
                t1 = time.perf_counter_ns()
                done: BatchedResult = await asyncio.wrap_future(
                    self.batchers[s.name].submit(inputs)
                )
                t2 = time.perf_counter_ns()
                out, headers = encode_infer_response(s.name, MODEL_VERSION, done.outputs, req)
            finally:
                self.in_flight -= 1
        except ClientDisconnect:  # the client went away mid-body: no one to answer, nothing failed
            log.debug("model %r: the client disconnected before sending the whole request", name)
            return Response(status_code=400)
        except (ProtocolError, InputError, ValueError) as e:
            return self._failed(name, start, _error(str(e)))
        except NonFiniteOutputError as e:
            return self._failed(name, start, _error(str(e), 422), non_finite=True)
        except TimeoutError as e:
            return self._failed(name, start, _error(f"parameter server busy: {e}", 503))
        except TierUnavailableError as e:  # a key that may exist could not be read: retry later
            return self._failed(name, start, _error(str(e), 503))
        except Exception as e:  # a bug or a backend that went away: say so, keep serving
            log.exception("model %r: inference failed", name)
            return self._failed(
                name, start, _error(f"internal error: {type(e).__name__}: {e}", 500)
            )
        t3 = time.perf_counter_ns()
        phases = PhaseNs(done.queue_ns, t1 - t0, done.infer_ns, t3 - t2)
        self.counts[s.name].succeeded(t3 - start, int(inputs["dense"].shape[0]), phases)
        media = headers.pop("Content-Type")
        return Response(out, media_type=media, headers=headers)

    def _failed(self, name: str, start: int, resp: Response, non_finite: bool = False) -> Response:
        if name in self.counts:
            self.counts[name].failed(time.perf_counter_ns() - start, non_finite)
        return resp


def model_config(s: DLRMServable, batching: BatchingConfig) -> dict[str, Any]:
    """Triton's configuration of ``s`` served with ``batching``: the servable's
    (:meth:`DLRMServable.config`) with Triton's ``dynamic_batching`` section."""
    return {
        **s.config(),
        "dynamic_batching": {
            "preferred_batch_size": [batching.max_batch_size],
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
        },
    }


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 / 405 as the protocol's JSON error, naming the method and path."""
    code = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", str(exc))
    return _error(f"{request.method} {request.url.path}: {detail}", code)


def create_app(
    servables: dict[str, DLRMServable],
    cfg: ServerConfig | None = None,
    counts: dict[str, ModelCounts] | None = None,
    batchers: dict[str, DynamicBatcher] | None = None,
) -> Starlette:
    """The v2 HTTP application over ``servables`` (model name → servable); its statistics go
    to ``counts`` (model name → counts; default: its own), which a gRPC server may share, and
    its requests to ``batchers`` (model name → batcher, shared likewise; default: its own,
    started with the application and closed when it shuts down)."""
    cfg = cfg or ServerConfig()
    counts = counts if counts is not None else {n: ModelCounts() for n in servables}
    own = batchers is None
    if batchers is None:
        batching = {n: cfg.batching(s) for n, s in servables.items()}
        batchers = start_batchers(servables, batching, counts, cfg.torch_threads)
    endpoints = _V2Endpoints(servables, cfg, counts, batchers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if own:
                for b in endpoints.batchers.values():
                    b.close()

    return Starlette(
        routes=endpoints.routes(),
        exception_handlers={404: _http_error, 405: _http_error},
        lifespan=lifespan,
    )


def build_servables(
    ps: HierarchicalParameterServer, models: Sequence[str] | None = None, ort_threads: int = 0
) -> dict[str, DLRMServable]:
    """One :class:`DLRMServable` per model of ``ps`` (or of ``models``), each running
    onnxruntime on ``ort_threads`` intra-op threads (0: :func:`available_cores`; one
    execution runs at a time per model, so it may use them all).

    Raises:
        ValueError: an unknown model name, or a model that cannot be served (see
            :class:`DLRMServable`).
    """
    names = list(models) if models else [m.model for m in ps.cfg.models]
    threads = ort_threads or available_cores()
    return {n: DLRMServable(ps.cfg.model(n), ps.session(n), ort_threads=threads) for n in names}


def _check_fd_limit(max_connections: int) -> None:
    """Refuse a connection bound the process cannot reach: past its file-descriptor limit
    ``accept`` fails instead of the server answering 503."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + _FD_RESERVE > soft:
        raise ValueError(
            f"max_connections {max_connections} needs about {max_connections + _FD_RESERVE} "
            f"file descriptors but this process may open {soft} (ulimit -n); raise that "
            f"limit or lower --max-connections to at most {max(1, soft - _FD_RESERVE)}"
        )


class InferenceServer:
    """The v2 server in a background thread (for tests, recipes and notebooks).

    >>> with InferenceServer(ps, ServerConfig(port=0)) as srv:      # doctest: +SKIP
    ...     client = tritonclient.http.InferenceServerClient(srv.address)

    Args:
        ps: a loaded parameter server (its ``close`` stays the caller's job).
        cfg: server knobs; ``port=0`` picks a free port.
        models: the models to serve (default: all of ``ps.json``).
    """

    def __init__(
        self,
        ps: HierarchicalParameterServer,
        cfg: ServerConfig | None = None,
        models: Sequence[str] | None = None,
    ) -> None:
        import uvicorn

        self.cfg = cfg or ServerConfig()
        _check_fd_limit(self.cfg.max_connections)
        self.servables = build_servables(ps, models, self.cfg.ort_threads)
        self.counts = {name: ModelCounts() for name in self.servables}  # both protocols' counts
        batching = {n: self.cfg.batching(s) for n, s in self.servables.items()}
        self.batchers = start_batchers(  # shared by both protocols too
            self.servables, batching, self.counts, self.cfg.torch_threads
        )
        try:
            self._bind()
        except BaseException:
            self._close_batchers()
            raise
        self._uv = uvicorn.Server(
            uvicorn.Config(
                create_app(self.servables, self.cfg, self.counts, self.batchers),
                log_level="warning",
                access_log=False,
                http=protocol_class(self.cfg.limits()),
            )
        )
        self._thread: threading.Thread | None = None
        self._saved_switch: float | None = None  # the switch interval before start()

    def _close_batchers(self) -> None:
        for b in self.batchers.values():
            b.close()

    def _bind(self) -> None:
        """Bind the HTTP socket and, with ``grpc_port``, the gRPC server."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted sockets inherit it. Without it, uvicorn's separate header and body writes
            # meet the client's delayed ACK: +44 ms on every request here (5 ms with it).
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.bind((self.cfg.host, self.cfg.port))
        except OSError as e:
            self._sock.close()
            raise OSError(
                e.errno, f"cannot listen on {self.cfg.host}:{self.cfg.port}: {e.strerror}"
            ) from e
        self.port: int = self._sock.getsockname()[1]
        self.grpc: GrpcServer | None = None
        if self.cfg.grpc_port is not None:
            try:
                self.grpc = self._grpc_server(self.cfg.grpc_port)
            except BaseException:
                self._sock.close()
                raise

    def _grpc_server(self, port: int) -> GrpcServer:
        c = self.cfg
        max_bytes = int(c.max_request_mb * 2**20)
        return GrpcServer(
            self.servables,
            c.host,
            port,
            c.workers,
            c.max_queued,
            max_bytes,
            self.counts,
            self.batchers,
        )

    @property
    def grpc_address(self) -> str | None:
        """``host:port`` of the gRPC server (``tritonclient.grpc``), or ``None`` without one."""
        return None if self.grpc is None else self.grpc.address

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.http.InferenceServerClient`` takes)."""
        return f"{self.cfg.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> InferenceServer:
        if self._saved_switch is None:
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.cfg.switch_interval_us / 1e6)
        if self.grpc is not None:
            self.grpc.start()
        self._thread = threading.Thread(
            target=self._uv.run, kwargs={"sockets": [self._sock]}, name="hps-v2-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the v2 server on {self.address} did not start")
            time.sleep(0.01)
        return self

    def request_stop(self) -> None:
        """Ask the server to finish in-flight requests and exit (safe from a signal handler)."""
        self._uv.should_exit = True

    def wait(self) -> None:
        """Block until the server thread has exited (signals are still handled meanwhile)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.2)

    def serve_until_signalled(self) -> None:
        """Start, then serve until SIGINT or SIGTERM (installed here: call it from the main
        thread); in-flight requests finish, then the server stops."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self.start()
            self.wait()
        finally:
            self.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: shutting down", signum)
        self.request_stop()

    def stop(self) -> None:
        """Stop serving (finishing in-flight requests, at most 10 s) and close the sockets."""
        if self.grpc is not None:
            self.grpc.stop(grace_s=10.0)
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.warning(
                    "the v2 server on %s did not finish within 10 s; closing its socket",
                    self.address,
                )
        self._sock.close()
        self._close_batchers()
        if self._saved_switch is not None:
            sys.setswitchinterval(self._saved_switch)
            self._saved_switch = None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def open_server(
    ps: HierarchicalParameterServer, cfg: ServerConfig, models: Sequence[str] | None = None
) -> InferenceServer:
    """A v2 server over ``ps`` (bound, not started) with the background work of ``ps.json``
    started (:meth:`HierarchicalParameterServer.start_background`).

    Raises:
        Exception: whatever building the servables or starting the background work raises
            (e.g. ``ValueError`` for a model that cannot be served); the bound socket is
            released and ``ps`` closed first.
    """
    srv = None
    try:
        srv = InferenceServer(ps, cfg, models)
        ps.start_background()
    except BaseException:
        if srv is not None:
            srv.stop()  # not started: releases the bound socket
        ps.close()
        raise
    log.info("serving %s on http://%s (v2 protocol)", sorted(srv.servables), srv.address)
    if srv.grpc_address is not None:
        log.info("serving %s on grpc://%s (v2 protocol)", sorted(srv.servables), srv.grpc_address)
    return srv
