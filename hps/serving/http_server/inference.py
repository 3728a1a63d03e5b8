"""``POST /v2/models/{m}[/versions/{v}]/infer`` at the ASGI level (:class:`InferHandler`) and
the application that sends those requests straight to it (:class:`InferFirst`).

Every other request goes through Starlette's router and middleware; an inference request goes
around them, with no Request or Response object either: its headers are read from the ASGI
scope in one pass, its body from ``receive`` into one buffer, its answer written with two
``send`` calls. On this project's 2-core host, Starlette's routing, middleware and response
objects cost about 65 µs of CPU per request, a tenth of a small request's whole time on the
event loop (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect

from hps.serving.batcher import BatchedResult, DynamicBatcher
from hps.serving.http_server.bodies import RequestBodies
from hps.serving.servable import DLRMServable, InputError, NonFiniteOutputError
from hps.serving.statistics import ModelCounts, PhaseNs
from hps.serving.v2_protocol import (
    HEADER_LENGTH,
    MODEL_VERSION,
    ProtocolError,
    encode_infer_response,
    find_model,
)
from hps.types import TierUnavailableError

__all__ = ["InferFirst", "InferHandler", "error_body", "infer_path_params"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: an answer: status, raw headers, body
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]

_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
_JSON = [(b"content-type", b"application/json")]


def error_body(msg: str) -> bytes:
    """``{"error": msg}`` as Starlette's ``JSONResponse`` renders it."""
    return json.dumps(
        {"error": msg}, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


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


def _request_headers(scope: Scope) -> tuple[str | None, str | None, str | None]:
    """``(Content-Length, Inference-Header-Content-Length, Content-Encoding)`` of a request,
    each its first occurrence (as Starlette's ``Headers.get``), ``None`` when absent."""
    length = header_length = encoding = None
    for key, value in scope["headers"]:
        if key == b"content-length":
            length = length if length is not None else value.decode("latin-1")
        elif key == _HEADER_LENGTH_KEY:
            header_length = header_length if header_length is not None else value.decode("latin-1")
        elif key == b"content-encoding":
            encoding = encoding if encoding is not None else value.decode("latin-1")
    return length, header_length, encoding


class InferHandler:
    """The inference requests of one application: admission (at most ``workers + max_queued``
    in flight), reading and parsing, the model's batcher, the answer and its statistics.

    Args:
        servables: model name → servable.
        counts: model name → statistics.
        batchers: model name → dynamic batcher.
        bodies: the application's body reader.
        workers, max_queued: the admission bound's two parts (named in the 503's message).
    """

    def __init__(
        self,
        servables: dict[str, DLRMServable],
        counts: dict[str, ModelCounts],
        batchers: dict[str, DynamicBatcher],
        bodies: RequestBodies,
        workers: int,
        max_queued: int,
    ) -> None:
        self.servables, self.counts, self.batchers = servables, counts, batchers
        self.bodies, self.workers, self.max_queued = bodies, workers, max_queued
        self.in_flight = 0  # requests between their body's arrival and their answer

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

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, params: dict[str, str]
    ) -> None:
        """Answer the inference request of ``scope`` (path parameters ``params``)."""
        status, headers, body = await self.answer(scope, receive, params)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def answer(self, scope: Scope, receive: Receive, params: dict[str, str]) -> Answer:
        """The answer to the inference request of ``scope``: every error is answered with its
        status and ``{"error": ...}``, not raised; a client that left mid-body gets an empty
        400 (no one reads it)."""
        start = time.perf_counter_ns()
        name = params["model"]
        try:
            s = find_model(self.servables, name, params.get("version", MODEL_VERSION))
            length, header_length, encoding = _request_headers(scope)
            body = await self.bodies.read_from(length, receive)
            if (busy := self.busy()) is not None:
                return self._failed(name, start, busy, 503)
            self.in_flight += 1
            try:
                peer = scope.get("client")  # (host, port) of the connection, or None
                with self.batchers[s.name].arrival(peer and (peer[0], peer[1])) as arrival:
                    t0 = time.perf_counter_ns()
                    req, inputs = await self.bodies.parse(s, body, header_length, encoding)
                    del body
                    t1 = time.perf_counter_ns()
                    future = arrival.submit(inputs)
                done: BatchedResult = await asyncio.wrap_future(future)
                t2 = time.perf_counter_ns()
                out, out_headers = encode_infer_response(s.name, MODEL_VERSION, done.outputs, req)
            finally:
                self.in_flight -= 1
        except ClientDisconnect:  # the client went away mid-body: no one to answer, nothing failed
            log.debug("model %r: the client disconnected before sending the whole request", name)
            return 400, [], b""
        except (ProtocolError, InputError, ValueError) as e:
            return self._failed(name, start, str(e), 400)
        except NonFiniteOutputError as e:
            return self._failed(name, start, str(e), 422, non_finite=True)
        except TimeoutError as e:
            return self._failed(name, start, f"parameter server busy: {e}", 503)
        except TierUnavailableError as e:  # a key that may exist could not be read: retry later
            return self._failed(name, start, str(e), 503)
        except Exception as e:  # a bug or a backend that went away: say so, keep serving
            log.exception("model %r: inference failed", name)
            return self._failed(name, start, f"internal error: {type(e).__name__}: {e}", 500)
        t3 = time.perf_counter_ns()
        phases = PhaseNs(done.queue_ns, t1 - t0, done.infer_ns, t3 - t2)
        self.counts[s.name].succeeded(t3 - start, int(inputs["dense"].shape[0]), phases)
        return 200, [(k.lower().encode(), v.encode()) for k, v in out_headers.items()], out

    def _failed(
        self, name: str, start: int, msg: str, status: int, non_finite: bool = False
    ) -> Answer:
        if name in self.counts:
            self.counts[name].failed(time.perf_counter_ns() - start, non_finite)
        return status, list(_JSON), error_body(msg)


class InferFirst:
    """The ASGI application the server runs: ``POST`` to an inference path
    (:func:`infer_path_params`) goes straight to ``infer``, every other request (and the
    lifespan) to the Starlette application ``app``."""

    def __init__(
        self,
        app: Starlette,
        infer: Callable[[Scope, Receive, Send, dict[str, str]], Awaitable[None]],
    ) -> None:
        self.app, self.infer = app, infer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            params = infer_path_params(scope["path"])
            if params is not None:
                await self.infer(scope, receive, send, params)
                return
        await self.app(scope, receive, send)
