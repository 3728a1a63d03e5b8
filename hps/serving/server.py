"""The inference server: the KServe v2 HTTP protocol over the parameter server, so
``tritonclient.http`` works unchanged. It serves every model of a ``ps.json`` whose
``network_file`` is a dense graph (see :mod:`hps.serving.servable` for the tensors).

    python -m hps.server --config out/ps.json --port 8000

Endpoints (errors are ``{"error": "..."}``: 400 for a bad request or an unknown model or
version, 404 / 405 for an unknown path or method, 503 when the parameter server had no free
lookup worker in time, 500 otherwise)::

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready
    GET  /v2/models/{m}[/versions/1]           model metadata (inputs, outputs)
    GET  /v2/models/{m}[/versions/1]/ready
    GET  /v2/models/{m}[/versions/1]/stats     Triton-style counts + per-table HPS statistics
    GET  /v2/models/stats                      the same for every model
    POST /v2/models/{m}[/versions/1]/infer     JSON or binary tensors (Inference-Header-Content-Length)

Requests run on ``workers`` threads (parsing and inference both: they are CPU work);
``max_queued`` more may wait, beyond that a connection gets 503 at once (uvicorn's
``limit_concurrency``; that one reply is plain text, sent before the application sees the
request), so memory stays bounded under any number of clients. The background
work ``ps.json`` asks for (online updates, cache refresh) runs while the server does.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.servable import DLRMServable, InputError
from hps.serving.v2_protocol import (
    HEADER_LENGTH,
    ProtocolError,
    encode_infer_response,
    parse_infer_request,
)

log = logging.getLogger(__name__)

__all__ = ["InferenceServer", "ServerConfig", "create_app", "main"]

MODEL_VERSION = "1"


@dataclass(frozen=True)
class ServerConfig:
    """Server knobs (each is a ``--flag`` of the CLI)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port (read it from InferenceServer.port)
    workers: int = 4  # threads that parse and run requests
    max_queued: int = 64  # requests waiting for a worker before new connections get 503
    ort_threads: int = 1  # onnxruntime intra-op threads per request
    max_request_mb: float = 256.0  # larger bodies are refused with 400

    def __post_init__(self) -> None:
        for f, lo in (("workers", 1), ("max_queued", 0), ("ort_threads", 0), ("port", 0)):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"ServerConfig.{f} must be an integer >= {lo}, got {v!r}")
        if self.port > 65535:
            raise ValueError(f"ServerConfig.port must be <= 65535, got {self.port}")
        mb = self.max_request_mb
        ok = isinstance(mb, (int, float)) and not isinstance(mb, bool) and math.isfinite(mb)
        if not ok or mb * 2**20 < 1:
            raise ValueError(
                f"ServerConfig.max_request_mb must be a finite number of MiB > 0 "
                f"(at least one byte), got {mb!r}"
            )


_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass
class _Counts:
    """Triton-style statistics of one model (counts and summed nanoseconds)."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    fail_ns: int = 0
    samples: int = 0  # Triton's inference_count: samples, not requests
    phase_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0))
    last_ms: int = 0  # wall-clock ms of the last successful inference
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self, ok: bool, ns: int, samples: int = 0, phases: dict[str, int] | None = None
    ) -> None:
        with self.lock:
            if ok:
                self.success, self.success_ns = self.success + 1, self.success_ns + ns
                self.samples += samples
                for k, v in (phases or {}).items():
                    self.phase_ns[k] += v
                self.last_ms = int(time.time() * 1e3)
            else:
                self.fail, self.fail_ns = self.fail + 1, self.fail_ns + ns

    def to_dict(self, name: str) -> dict[str, Any]:
        with self.lock:
            n = self.success
            stats = {
                "success": {"count": n, "ns": self.success_ns},
                "fail": {"count": self.fail, "ns": self.fail_ns},
                **{k: {"count": n, "ns": v} for k, v in self.phase_ns.items()},
            }
            return {
                "name": name,
                "version": MODEL_VERSION,
                "last_inference": self.last_ms,
                "inference_count": self.samples,
                "execution_count": n,
                "inference_stats": stats,
            }


def _error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


def _package_version() -> str:
    try:
        return version("tilerec")
    except PackageNotFoundError:
        return "0"


def create_app(servables: dict[str, DLRMServable], cfg: ServerConfig | None = None) -> Starlette:
    """The v2 HTTP application over ``servables`` (model name → servable)."""
    cfg = cfg or ServerConfig()
    limiter = anyio.CapacityLimiter(cfg.workers)
    counts = {name: _Counts() for name in servables}
    max_bytes = int(cfg.max_request_mb * 2**20)

    def model_of(request: Request) -> DLRMServable:
        name = request.path_params["model"]
        if name not in servables:
            raise ProtocolError(f"unknown model {name!r}; this server serves {sorted(servables)}")
        ver = request.path_params.get("version", MODEL_VERSION)
        if ver != MODEL_VERSION:
            raise ProtocolError(
                f"model {name!r} has no version {ver!r}; versions: ['{MODEL_VERSION}']"
            )
        return servables[name]

    async def server_metadata(request: Request) -> Response:
        return JSONResponse(
            {
                "name": "tilerec-hps",
                "version": _package_version(),
                "extensions": ["binary_tensor_data", "statistics"],
            }
        )

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def model_metadata(request: Request) -> Response:
        try:
            return JSONResponse(model_of(request).metadata())
        except ProtocolError as e:
            return _error(str(e))

    async def model_ready(request: Request) -> Response:
        try:
            model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        return Response(status_code=200)

    def stats_of(name: str) -> dict[str, Any]:
        return {**counts[name].to_dict(name), "hps": servables[name].session.stats()}

    async def model_stats(request: Request) -> Response:
        try:
            s = model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        return JSONResponse({"model_stats": [stats_of(s.name)]})

    async def all_stats(request: Request) -> Response:
        return JSONResponse({"model_stats": [stats_of(n) for n in servables]})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ProtocolError(
                f"request body of {declared} bytes exceeds the server's limit of "
                f"{max_bytes} bytes (--max-request-mb)"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ProtocolError(
                    f"request body exceeds the server's limit of {max_bytes} bytes "
                    "(--max-request-mb)"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def run(
        s: DLRMServable,
        body: bytes,
        header_length: str | None,
        encoding: str | None,
        queued_at: int,
    ) -> tuple[bytes, dict[str, str], int, dict[str, int]]:
        t0 = time.perf_counter_ns()
        req = parse_infer_request(body, header_length, encoding, max_bytes=max_bytes)
        t1 = time.perf_counter_ns()
        results = s.infer(req.inputs)
        t2 = time.perf_counter_ns()
        out, headers = encode_infer_response(s.name, MODEL_VERSION, results, req)
        t3 = time.perf_counter_ns()
        phases = {
            "queue": t0 - queued_at,
            "compute_input": t1 - t0,
            "compute_infer": t2 - t1,
            "compute_output": t3 - t2,
        }
        return (
            out,
            headers,
            int(req.inputs["dense"].shape[0]) if "dense" in req.inputs else 0,
            phases,
        )

    async def infer(request: Request) -> Response:
        start = time.perf_counter_ns()
        name = request.path_params["model"]
        try:
            s = model_of(request)
            body = await read_body(request)
            out, headers, samples, phases = await anyio.to_thread.run_sync(
                run,
                s,
                body,
                request.headers.get(HEADER_LENGTH),
                request.headers.get("content-encoding"),
                time.perf_counter_ns(),
                limiter=limiter,
            )
        except ClientDisconnect:  # the client went away mid-body: no one to answer, nothing failed
            log.debug("model %r: the client disconnected before sending the whole request", name)
            return Response(status_code=400)
        except (ProtocolError, InputError, ValueError) as e:
            return _failed(name, start, _error(str(e)))
        except TimeoutError as e:
            return _failed(name, start, _error(f"parameter server busy: {e}", 503))
        except Exception as e:  # a bug or a backend that went away: say so, keep serving
            log.exception("model %r: inference failed", name)
            return _failed(name, start, _error(f"internal error: {type(e).__name__}: {e}", 500))
        counts[s.name].add(True, time.perf_counter_ns() - start, samples, phases)
        media = headers.pop("Content-Type")
        return Response(out, media_type=media, headers=headers)

    def _failed(name: str, start: int, resp: Response) -> Response:
        if name in counts:
            counts[name].add(False, time.perf_counter_ns() - start)
        return resp

    m = "/v2/models/{model}"
    v = m + "/versions/{version}"
    routes = [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", live),  # the app exists only once every model has loaded
        Route("/v2/models/stats", all_stats),  # before {model}: tritonclient's all-model stats
        Route(m, model_metadata),
        Route(v, model_metadata),
        Route(m + "/ready", model_ready),
        Route(v + "/ready", model_ready),
        Route(m + "/stats", model_stats),
        Route(v + "/stats", model_stats),
        Route(m + "/infer", infer, methods=["POST"]),
        Route(v + "/infer", infer, methods=["POST"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 500)
        detail = getattr(exc, "detail", str(exc))
        return _error(f"{request.method} {request.url.path}: {detail}", code)

    return Starlette(routes=routes, exception_handlers={404: http_error, 405: http_error})


def build_servables(
    ps: HierarchicalParameterServer, models: Sequence[str] | None = None, ort_threads: int = 1
) -> dict[str, DLRMServable]:
    """One :class:`DLRMServable` per model of ``ps`` (or of ``models``).

    Raises:
        ValueError: an unknown model name, or a model that cannot be served (see
            :class:`DLRMServable`).
    """
    names = list(models) if models else [m.model for m in ps.cfg.models]
    return {n: DLRMServable(ps.cfg.model(n), ps.session(n), ort_threads=ort_threads) for n in names}


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
        self.servables = build_servables(ps, models, self.cfg.ort_threads)
        self.app = create_app(self.servables, self.cfg)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted sockets inherit it. Without it, uvicorn's separate header and body writes
            # meet the client's delayed ACK: +44 ms on every request here (5 ms with it).
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.bind((self.cfg.host, self.cfg.port))
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self._uv = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level="warning",
                access_log=False,
                limit_concurrency=self.cfg.workers + self.cfg.max_queued,
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.http.InferenceServerClient`` takes)."""
        return f"{self.cfg.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> InferenceServer:
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

    def stop(self) -> None:
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.warning(
                    "the v2 server on %s did not finish within 10 s; closing its socket",
                    self.address,
                )
        self._sock.close()

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="python -m hps.server",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="ps.json (e.g. written by export.artifacts)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--models", nargs="*", default=None, help="models to serve (default: all)")
    p.add_argument("--workers", type=int, default=d.workers, help="request threads")
    p.add_argument(
        "--max-queued",
        type=int,
        default=d.max_queued,
        help="requests that may wait for a worker before new ones get 503",
    )
    p.add_argument(
        "--ort-threads",
        type=int,
        default=d.ort_threads,
        help="onnxruntime intra-op threads per request (0: its default)",
    )
    p.add_argument("--max-request-mb", type=float, default=d.max_request_mb)
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = ServerConfig(a.host, a.port, a.workers, a.max_queued, a.ort_threads, a.max_request_mb)
        ps = HierarchicalParameterServer.from_config(a.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    srv = None
    try:
        srv = InferenceServer(ps, cfg, a.models)
        ps.start_background()
    except Exception as e:  # e.g. an update source that cannot start: exit 2 naming it
        if srv is not None:
            srv.stop()  # not started: releases the bound socket
        ps.close()
        p.error(str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}")
    log.info("serving %s on http://%s (v2 protocol)", sorted(srv.servables), srv.address)

    def shut_down(signum: int, frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        srv.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shut_down)
    try:
        srv.start()
        srv.wait()  # until SIGINT / SIGTERM: in-flight requests finish, then the databases close
    finally:
        srv.stop()
        ps.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
