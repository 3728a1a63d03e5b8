"""The v2 server's lifecycle: building the servables, binding the HTTP socket (and the gRPC
server), serving in a background thread or until a signal, and stopping."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.batcher import start_batchers
from hps.serving.connections import EventLoop, HttpParser, pick_loop, pick_parser, protocol_class
from hps.serving.dense_cost import DEFAULT_PARALLEL_MIN_MACS
from hps.serving.grpc_front.relay import GrpcFronts
from hps.serving.grpc_server import GrpcInferenceServicer, GrpcServer
from hps.serving.http_server.config import ServerConfig, available_cores
from hps.serving.http_server.endpoints import create_app
from hps.serving.http_server.heap import freeze as freeze_heap
from hps.serving.http_server.heap import thaw as thaw_heap
from hps.serving.servable import DLRMServable
from hps.serving.statistics import ModelCounts

__all__ = ["InferenceServer", "build_servables", "open_server"]

log = logging.getLogger(__name__)

_FD_RESERVE = 64  # file descriptors the process needs beside its connections (files, db, ort)


def build_servables(
    ps: HierarchicalParameterServer,
    models: Sequence[str] | None = None,
    ort_threads: int = 0,
    ort_parallel_min_macs: int = DEFAULT_PARALLEL_MIN_MACS,
    ort_measure: bool = True,
) -> dict[str, DLRMServable]:
    """One :class:`DLRMServable` per model of ``ps`` (or of ``models``), each running
    onnxruntime on ``ort_threads`` intra-op threads (0: :func:`available_cores`; one
    execution runs at a time per model, so it may use them all), and on one thread the
    executions of the batch sizes one thread ran faster when both were timed at load
    (``ort_measure``), or else of those whose dense graph does fewer than
    ``ort_parallel_min_macs`` multiply-adds (0: none; logged per model).

    Raises:
        ValueError: an unknown model name, or a model that cannot be served (see
            :class:`DLRMServable`).
    """
    names = list(models) if models else [m.model for m in ps.cfg.models]
    threads = ort_threads or available_cores()
    out = {}
    for n in names:
        s = DLRMServable(
            ps.cfg.model(n), ps.session(n), threads, ort_parallel_min_macs, ort_measure
        )
        why = (
            f"timed at load, median on {threads} threads/one: {s.crossover.describe()}"
            if s.crossover is not None
            else f"{s.macs_per_sample} multiply-adds per sample in its dense graph, "
            f"ort_parallel_min_macs {ort_parallel_min_macs}"
        )
        if s.serial_below:
            log.info(
                "model %r: onnxruntime runs batches of 1-%d samples on one thread, larger "
                "ones on %d (%s)",
                n,
                s.serial_below - 1,
                threads,
                why,
            )
        elif threads == 1 or not ort_parallel_min_macs:
            log.info("model %r: onnxruntime runs every execution on %d threads", n, threads)
        else:
            log.info(
                "model %r: onnxruntime runs every execution on %d threads (%s)", n, threads, why
            )
        out[n] = s
    return out


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
        self.servables = build_servables(
            ps,
            models,
            self.cfg.ort_threads,
            self.cfg.ort_parallel_min_macs,
            self.cfg.ort_measure_threads,
        )
        self.counts = {name: ModelCounts() for name in self.servables}  # both protocols' counts
        batching = {n: self.cfg.batching(s) for n, s in self.servables.items()}
        self.batchers = start_batchers(  # shared by both protocols too
            self.servables, batching, self.counts, self.cfg.torch_threads
        )
        #: the HTTP parser and event loop in use (``cfg``'s, resolved: :func:`pick_parser`); the
        #: gRPC front processes run the same loop
        self.http_parser: HttpParser = pick_parser(self.cfg.http)
        self.event_loop: EventLoop = pick_loop(self.cfg.loop)
        try:
            self._bind()
        except BaseException:
            self._close_batchers()
            raise
        self.http_protocol = protocol_class(
            self.cfg.limits(), self.http_parser, on_lost=self._connection_lost
        )
        self._uv = uvicorn.Server(
            uvicorn.Config(
                create_app(self.servables, self.cfg, self.counts, self.batchers),
                log_level="warning",
                access_log=False,
                http=self.http_protocol,
                loop=self.event_loop.value,
            )
        )
        self._thread: threading.Thread | None = None
        self._saved_switch: float | None = None  # the switch interval before start()
        self._froze = False  # this server holds the heap frozen (freeze_heap)

    def _connection_lost(self, peer: tuple[str, int]) -> None:
        """An HTTP connection closed: no batch waits for its next request any more."""
        for b in self.batchers.values():
            b.forget(peer)

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
        self.grpc: GrpcServer | GrpcFronts | None = None
        if self.cfg.grpc_port is not None:
            try:
                self.grpc = self._grpc_server(self.cfg.grpc_port)
            except BaseException:
                self._sock.close()
                raise

    def _grpc_server(self, port: int) -> GrpcServer | GrpcFronts:
        c = self.cfg
        max_bytes = int(c.max_request_mb * 2**20)
        if c.grpc_fronts:
            servicer = GrpcInferenceServicer(self.servables, self.counts, self.batchers)
            in_flight = c.workers + c.max_queued
            loop = self.event_loop.value  # uvloop when installed, as the HTTP server's
            return GrpcFronts(
                servicer, c.host, port, c.grpc_fronts, in_flight, max_bytes, loop=loop
            )
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
        if self.cfg.gc_freeze and not self._froze:
            # the models are loaded: the start-up's garbage collected and the rest frozen
            # before any request comes, so none waits for that one walk of the heap
            freeze_heap()
            self._froze = True
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

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop serving HTTP (``None`` unless started)."""
        servers = self._uv.servers if self._uv.started else []
        return servers[0].get_loop() if servers else None

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
        if self._froze:
            self._froze = False
            thaw_heap()

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
