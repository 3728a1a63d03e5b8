"""The v2 HTTP application (:func:`create_app`): its routes and their handlers, the
admission bound (``workers + max_queued`` requests in flight) and the mapping of errors to
status codes (see :mod:`hps.serving.http_server`).

``POST .../infer`` goes straight to its handler (:class:`InferFirst`); every other request
goes through Starlette's router and middleware, which cost about 65 µs of CPU per request on
this project's 2-core host (docs/benchmarks.md), a tenth of a small request's whole time on
the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hps.serving.batcher import (
    BatchedResult,
    DynamicBatcher,
    model_config,
    start_batchers,
)
from hps.serving.http_server.bodies import RequestBodies
from hps.serving.http_server.config import ServerConfig
from hps.serving.servable import DLRMServable, InputError, NonFiniteOutputError
from hps.serving.statistics import ModelCounts, PhaseNs
from hps.serving.v2_protocol import (
    MODEL_VERSION,
    SERVER_NAME,
    ProtocolError,
    encode_infer_response,
    find_model,
    repository_index,
    repository_index_request,
    server_version,
)
from hps.session_stats import bytes_per_tier
from hps.types import TierUnavailableError

__all__ = ["InferFirst", "create_app"]

_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]

log = logging.getLogger(__name__)


def _error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


class _V2Endpoints:
    """The endpoints of the v2 protocol over ``servables`` (model name → servable): request
    handlers, admission (requests in flight) and the statistics of one application."""

    def __init__(
        self,
        servables: dict[str, DLRMServable],
        cfg: ServerConfig,
        counts: dict[str, ModelCounts],
        batchers: dict[str, DynamicBatcher],
    ) -> None:
        self.servables, self.counts, self.batchers = servables, counts, batchers
        self.workers, self.max_queued = cfg.workers, cfg.max_queued
        self.in_flight = 0  # requests between their body's arrival and their answer
        self.bodies = RequestBodies(
            int(cfg.max_request_mb * 2**20),
            int(cfg.max_json_mb * 2**20),
            anyio.CapacityLimiter(cfg.workers),
        )

    def routes(self) -> list[Route]:
        m = "/v2/models/{model}"
        v = m + "/versions/{version}"
        return [
            # inference first: the router tries routes in order, one regex each, per request
            Route(m + "/infer", self.infer, methods=["POST"]),
            Route(v + "/infer", self.infer, methods=["POST"]),
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
            repository_index_request(await self.bodies.read(request))  # bounded, as /infer's
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
        """``name``'s statistics document. It asks the databases what they hold (a Redis
        cluster answers over the network, within its socket timeout when a node is down): the
        handlers call it on a worker thread, never on the event loop."""
        session = self.servables[name].session
        held = {t: session.held_bytes(t) for t in session.tables}
        return {
            **self.counts[name].to_dict(name),
            "hps": session.stats(held=held, with_bytes=True),
            # Σ over the model's tables of the bytes each tier holds (per table: "hps"[t]["bytes"])
            "hps_bytes": bytes_per_tier(list(held.values())),
            "online_updates": session.update_status().to_dict(),
        }

    async def model_stats(self, request: Request) -> Response:
        try:
            s = self.model_of(request)
        except ProtocolError as e:
            return _error(str(e))
        doc = await anyio.to_thread.run_sync(self.stats_of, s.name)
        return JSONResponse({"model_stats": [doc]})

    async def all_stats(self, request: Request) -> Response:
        docs = [await anyio.to_thread.run_sync(self.stats_of, n) for n in self.servables]
        return JSONResponse({"model_stats": docs})

    # ------------------------------------------------------------------ inference
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

    async def infer(self, request: Request) -> Response:
        start = time.perf_counter_ns()
        name = request.path_params["model"]
        try:
            s = self.model_of(request)
            body = await self.bodies.read(request)
            if (busy := self.busy()) is not None:
                return self._failed(name, start, _error(busy, 503))
            self.in_flight += 1
            try:
                peer = request.client  # (host, port) of the connection, or None
                with self.batchers[s.name].arrival(peer and (peer.host, peer.port)) as arrival:
                    t0 = time.perf_counter_ns()
                    req, inputs = await self.bodies.parse(s, body, request)
                    del body
                    t1 = time.perf_counter_ns()
                    future = arrival.submit(inputs)
                done: BatchedResult = await asyncio.wrap_future(future)
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


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 / 405 as the protocol's JSON error, naming the method and path."""
    code = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", str(exc))
    return _error(f"{request.method} {request.url.path}: {detail}", code)


def infer_path_params(path: str) -> dict[str, str] | None:
    """The path parameters of an inference path (``/v2/models/{model}/infer`` or
    ``/v2/models/{model}/versions/{version}/infer``; each parameter non-empty, without ``/``,
    as Starlette's router matches them), or ``None`` for any other path."""
    if not (path.startswith("/v2/models/") and path.endswith("/infer")):
        return None
    parts = path[len("/v2/models/") : -len("/infer")].split("/")
    if len(parts) == 1 and parts[0]:
        return {"model": parts[0]}
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return {"model": parts[0], "version": parts[2]}
    return None


class InferFirst:
    """The ASGI application the server runs: ``POST`` to an inference path
    (:func:`infer_path_params`) goes straight to the inference handler, as its route would
    send it, every other request (and the lifespan) to the Starlette application ``app``."""

    def __init__(self, app: Starlette, infer: Callable[[Request], Awaitable[Response]]) -> None:
        self.app, self.infer = app, infer

    async def __call__(self, scope: _Message, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            params = infer_path_params(scope["path"])
            if params is not None:
                scope["path_params"] = params
                response = await self.infer(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    servables: dict[str, DLRMServable],
    cfg: ServerConfig | None = None,
    counts: dict[str, ModelCounts] | None = None,
    batchers: dict[str, DynamicBatcher] | None = None,
) -> InferFirst:
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

    app = Starlette(
        routes=endpoints.routes(),
        exception_handlers={404: _http_error, 405: _http_error},
        lifespan=lifespan,
    )
    return InferFirst(app, endpoints.infer)
