"""The v2 HTTP application (:func:`create_app`): its routes and their handlers, and the
mapping of errors to status codes (see :mod:`hps.serving.http_server`). ``POST .../infer``
goes straight to its handler (:mod:`hps.serving.http_server.inference`: admission, batching,
statistics); every other request through Starlette's router."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hps.serving.batcher import (
    DynamicBatcher,
    model_config,
    start_batchers,
)
from hps.serving.http_server.bodies import RequestBodies
from hps.serving.http_server.config import ServerConfig
from hps.serving.http_server.inference import InferFirst, InferHandler, Receive, Scope, Send
from hps.serving.servable import DLRMServable
from hps.serving.statistics import ModelCounts
from hps.serving.v2_protocol import (
    MODEL_VERSION,
    SERVER_NAME,
    ProtocolError,
    find_model,
    repository_index,
    repository_index_request,
    server_version,
)
from hps.session_stats import bytes_per_tier

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _error(msg: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": msg}, status_code=status)


class _V2Endpoints:
    """The endpoints of the v2 protocol over ``servables`` (model name → servable): request
    handlers and the statistics of one application; inference by :attr:`inference`."""

    def __init__(
        self,
        servables: dict[str, DLRMServable],
        cfg: ServerConfig,
        counts: dict[str, ModelCounts],
        batchers: dict[str, DynamicBatcher],
    ) -> None:
        self.servables, self.counts, self.batchers = servables, counts, batchers
        self.bodies = RequestBodies(
            int(cfg.max_request_mb * 2**20),
            int(cfg.max_json_mb * 2**20),
            anyio.CapacityLimiter(cfg.workers),
        )
        self.inference = InferHandler(
            servables, counts, batchers, self.bodies, cfg.workers, cfg.max_queued
        )

    def routes(self) -> list[Route]:
        m = "/v2/models/{model}"
        v = m + "/versions/{version}"
        return [
            # POSTs to these two go straight to the handler (InferFirst); the router answers
            # their other methods (405)
            Route(m + "/infer", _InferRoute(self.inference), methods=["POST"]),
            Route(v + "/infer", _InferRoute(self.inference), methods=["POST"]),
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


class _InferRoute:
    """The inference routes' ASGI endpoint: the handler, given the router's path parameters."""

    def __init__(self, handler: InferHandler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send, dict(scope["path_params"]))


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
    return InferFirst(app, endpoints.inference)
