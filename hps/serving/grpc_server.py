"""The KServe v2 protocol over gRPC (grpcio), beside the HTTP server and over the same
servables, so ``tritonclient.grpc`` works unchanged (Triton's port is 8001)::

    python -m hps.server --config out/ps.json --port 8000 --grpc-port 8001

The service ``inference.GRPCInferenceService`` of KServe's ``grpc_predict_v2.proto``, plus two
RPCs of Triton's that ``tritonclient.grpc`` calls (messages in :mod:`hps.serving.protos`)::

    ServerLive / ServerReady            live: true / ready: true (false while online updates fail)
    ServerMetadata                      name, version, extensions
    ModelReady                          ready: true for a served model and version "" or "1",
                                        false otherwise (never an error)
    ModelMetadata                       inputs and outputs, as GET /v2/models/{m}
    ModelInfer                          raw or typed tensors in, raw tensors out
    ModelConfig                         Triton's model configuration, as GET /v2/models/{m}/config
    RepositoryIndex                     every served model, READY

Other RPCs of Triton's service (statistics, streaming, shared memory, ...) answer
``UNIMPLEMENTED``. The checks and their messages are the HTTP protocol's; the status codes map
as ``INVALID_ARGUMENT`` where HTTP answers 400 (a malformed request, an unknown model or version,
tensors that do not fit the model) or 422 (scores that came out NaN or infinite),
``UNAVAILABLE`` where it answers 503 for a tier that failed or a parameter server with no free
lookup worker, ``INTERNAL`` for 500.

Threads: grpcio's asyncio server (``grpc.aio``) runs on an event loop of its own thread
(``hps-v2-grpc``). Each call is decoded, parsed (raw contents as ``np.frombuffer`` views),
checked and queued on that loop, awaits its batch there, and is encoded there: no thread pool,
no thread per call waiting on a lock. The model's dynamic batcher
(:mod:`hps.serving.batcher`) merges it with the model's other waiting requests, HTTP's too,
on the model's inference thread, which resolves the call's future (one wake-up of the loop)::

    grpcio core ──▶ event loop (hps-v2-grpc): decode · parse · check · submit ─┐
                                                                              ▼
    grpcio core ◀── event loop: encode ◀── future resolved ◀── inference thread (batch)

Limits: ``workers + max_queued`` calls in flight, past that grpcio answers
``RESOURCE_EXHAUSTED`` at once; a message larger than ``max_request_bytes`` (after
decompression) is refused by grpcio with ``RESOURCE_EXHAUSTED`` before it is read.
Names a client gives are clipped in error messages (:mod:`hps.serving.clipping`), so a
100,000-character model name gets ``NOT_FOUND`` with a short message.
Connections are HTTP/2's: grpcio bounds streams per connection and closes broken ones.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

import hps.serving.protos.grpc_predict_v2_pb2 as pb
import hps.serving.protos.triton_extensions_pb2 as ext
from hps.serving.batcher import DynamicBatcher, model_config
from hps.serving.clipping import clip
from hps.serving.grpc_protocol import encode_grpc_response, parse_grpc_request
from hps.serving.servable import DLRMServable, InputError, NonFiniteOutputError
from hps.serving.statistics import ModelCounts, PhaseNs
from hps.serving.v2_protocol import (
    MODEL_VERSION,
    SERVER_NAME,
    ProtocolError,
    find_model,
    repository_index,
    server_version,
)
from hps.types import TierUnavailableError

log = logging.getLogger(__name__)

__all__ = [
    "EXTENSIONS",
    "SERVICE",
    "GrpcInferenceServicer",
    "GrpcServer",
    "method_handlers",
    "status_of",
]

SERVICE = "inference.GRPCInferenceService"
EXTENSIONS = ("model_configuration",)
#: The event loop thread's name (the benchmark reads its CPU by it).
THREAD_NAME = "hps-v2-grpc"


class RpcAbort(Exception):
    """Ends the call it is raised in with ``code`` and ``message`` (the handler's wrapper
    turns it into grpcio's abort)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class GrpcInferenceServicer:
    """The RPCs of the service over ``servables`` (model name → servable); each method takes a
    request message and returns the response message (``model_infer`` is a coroutine, run on
    the server's event loop), or raises :class:`RpcAbort`. ``ModelInfer``
    calls go to ``batchers`` (model name → the model's dynamic batcher) and are counted into
    ``counts`` (model name → statistics; both shared with the HTTP server, so
    ``GET /v2/models/{m}/stats`` counts both protocols); their queue time is their wait in the
    batcher (grpcio's own queue is not visible)."""

    def __init__(
        self,
        servables: Mapping[str, DLRMServable],
        counts: Mapping[str, ModelCounts],
        batchers: Mapping[str, DynamicBatcher],
    ) -> None:
        self.servables, self.counts, self.batchers = servables, counts, batchers

    def _model(self, name: str, ver: str) -> DLRMServable:
        """The servable named; an unknown model is ``NOT_FOUND``, an unknown version of a
        served model ``INVALID_ARGUMENT`` (both messages clip the name)."""
        try:
            return find_model(self.servables, name, ver)
        except ProtocolError as e:
            served = name in self.servables
            code = grpc.StatusCode.INVALID_ARGUMENT if served else grpc.StatusCode.NOT_FOUND
            raise RpcAbort(code, str(e)) from None

    def server_live(
        self, request: pb.ServerLiveRequest
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def server_ready(
        self, request: pb.ServerReadyRequest
    ) -> pb.ServerReadyResponse:
        # the server exists once every model loaded; online updates' policy: hps.updates.health
        ready = all(s.session.update_status().ready for s in self.servables.values())
        return pb.ServerReadyResponse(ready=ready)

    def server_metadata(
        self, request: pb.ServerMetadataRequest
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS
        )

    def model_ready(
        self, request: pb.ModelReadyRequest
    ) -> pb.ModelReadyResponse:
        try:
            find_model(self.servables, request.name, request.version)
        except ProtocolError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def model_metadata(
        self, request: pb.ModelMetadataRequest
    ) -> pb.ModelMetadataResponse:
        doc = self._model(request.name, request.version).metadata()
        return json_format.ParseDict(doc, pb.ModelMetadataResponse())

    def model_config(
        self, request: ext.ModelConfigRequest
    ) -> ext.ModelConfigResponse:

        s = self._model(request.name, request.version)
        doc = model_config(s, self.batchers[s.name].cfg)
        return ext.ModelConfigResponse(config=json_format.ParseDict(doc, ext.ModelConfig()))

    def repository_index(
        self, request: ext.RepositoryIndexRequest
    ) -> ext.RepositoryIndexResponse:
        if request.repository_name:
            raise RpcAbort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown repository {clip(request.repository_name)!r}; this server has one, "
                "named by an empty repository_name",
            )
        models = [
            ext.RepositoryIndexResponse.ModelIndex(**m) for m in repository_index(self.servables)
        ]
        return ext.RepositoryIndexResponse(models=models)

    async def model_infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """Parse, queue, await the batch, encode (all on the event loop); errors end the call
        with the status the HTTP code maps to."""
        t0 = time.perf_counter_ns()
        s = self._model(request.model_name, request.model_version)
        try:
            with self.batchers[s.name].arrival() as arrival:
                req = parse_grpc_request(request)
                inputs = s.check(req.inputs)
                t1 = time.perf_counter_ns()
                future = arrival.submit(inputs)
            done = await asyncio.wrap_future(future)
            t2 = time.perf_counter_ns()
            resp = encode_grpc_response(s.name, MODEL_VERSION, done.outputs, req)
        except Exception as e:  # every failure of a request ends its call, never the server
            self.counts[s.name].failed(
                time.perf_counter_ns() - t0, isinstance(e, NonFiniteOutputError)
            )
            code, msg = status_of(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("model %r: inference failed", s.name)
            raise RpcAbort(code, msg) from None
        t3 = time.perf_counter_ns()
        phases = PhaseNs(done.queue_ns, t1 - t0, done.infer_ns, t3 - t2)
        self.counts[s.name].succeeded(t3 - t0, int(inputs["dense"].shape[0]), phases)
        return resp


def status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a request's failure ends its call with: the gRPC code of the
    HTTP status the HTTP server answers it with (400, 503, 500)."""
    if isinstance(e, (ProtocolError, InputError, ValueError, NonFiniteOutputError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"parameter server busy: {e}"
    if isinstance(e, TierUnavailableError):  # a key that may exist could not be read: retry
        return grpc.StatusCode.UNAVAILABLE, str(e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


# RPC name → (servicer method, request message class, response message class).
_RPCS: dict[str, tuple[str, Any, Any]] = {
    "ServerLive": ("server_live", pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": ("server_ready", pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ServerMetadata": ("server_metadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    "ModelReady": ("model_ready", pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ModelMetadata": ("model_metadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": ("model_infer", pb.ModelInferRequest, pb.ModelInferResponse),
    "ModelConfig": ("model_config", ext.ModelConfigRequest, ext.ModelConfigResponse),
    "RepositoryIndex": (
        "repository_index",
        ext.RepositoryIndexRequest,
        ext.RepositoryIndexResponse,
    ),
}


class _Decoded:
    """An RPC method (a coroutine on the server's event loop) that receives the request's bytes
    and decodes them itself, so bytes that are not a message of its type end the call with
    ``INVALID_ARGUMENT`` naming the type (grpcio's own deserializer answers ``INTERNAL``);
    :class:`RpcAbort` raised by the servicer ends the call with its status."""

    def __init__(self, fn: Callable[[Any], Any], request_cls: Any) -> None:
        self.fn, self.request_cls = fn, request_cls

    async def __call__(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = self.request_cls.FromString(data)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request is not a valid {self.request_cls.DESCRIPTOR.full_name} message: {e}",
            )
        try:
            out = self.fn(request)
            return await out if asyncio.iscoroutine(out) else out
        except RpcAbort as e:
            await context.abort(e.code, e.message)


def method_handlers(servicer: GrpcInferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """RPC name → grpcio handler of ``servicer``'s method (all unary-unary, coroutines for
    ``grpc.aio``)."""
    out = {}
    for rpc, (method, req_cls, resp_cls) in _RPCS.items():
        # a bound coroutine method: grpc.aio awaits it on the loop (an object with an async
        # __call__ is not recognised as one and would be sent to a thread pool)
        out[rpc] = grpc.unary_unary_rpc_method_handler(
            _Decoded(getattr(servicer, method), req_cls).__call__,
            response_serializer=resp_cls.SerializeToString,
        )
    return out


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_bindable(host: str, port: int) -> None:
    """Raise ``OSError`` naming the address and the OS's reason if ``host:port`` cannot be
    bound (grpcio's own error does not say why)."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpcio binds
            s.bind((host, port))
    except OSError as e:
        reason = e.strerror or str(e)
        raise OSError(e.errno, f"cannot listen on {host}:{port} (gRPC): {reason}") from e


class GrpcServer:
    """The v2 gRPC server (``grpc.aio`` on an event loop of its own thread), bound on
    construction, serving on :meth:`start` until :meth:`stop`.

    Args:
        servables: model name → servable (shared with the HTTP server).
        host: the address to listen on (``127.0.0.1``: this machine only).
        port: the port; 0 picks a free one (read :attr:`port`).
        workers: with ``max_queued``, the calls in flight (HTTP's meaning of the two knobs).
        max_queued: past ``workers + max_queued`` calls in flight, new ones get
            ``RESOURCE_EXHAUSTED``.
        max_request_bytes: the largest request message, after decompression.
        counts: model name → statistics to count ``ModelInfer`` calls into.
        batchers: model name → the model's dynamic batcher (shared with the HTTP server).

    Raises:
        OSError: the address cannot be bound (naming it and why).
    """

    def __init__(
        self,
        servables: Mapping[str, DLRMServable],
        host: str,
        port: int,
        workers: int,
        max_queued: int,
        max_request_bytes: int,
        counts: Mapping[str, ModelCounts],
        batchers: Mapping[str, DynamicBatcher],
    ) -> None:
        _check_bindable(host, port)
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        options = [
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ("grpc.max_receive_message_length", max_request_bytes),
        ]
        handlers = method_handlers(GrpcInferenceServicer(servables, counts, batchers))
        try:
            self._server = self._run(self._create(options, workers + max_queued, handlers))
            self.port: int = self._server.add_insecure_port(_target(host, port))
        except RuntimeError as e:
            self._loop.close()
            raise OSError(f"cannot listen on {host}:{port} (gRPC): {e}") from e

    @staticmethod
    async def _create(
        options: list[tuple[str, Any]], max_rpcs: int, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> grpc.aio.Server:
        # grpc.aio binds its server to the running loop: create it on the server's loop
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=max_rpcs)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        return server

    def _run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the server's loop: in the caller's thread before :meth:`start`,
        on the loop's thread after it."""
        if self._thread is None:
            return self._loop.run_until_complete(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.grpc.InferenceServerClient`` takes)."""
        return _target(self.host, self.port)

    def start(self) -> GrpcServer:
        self._run(self._server.start())
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=THREAD_NAME, daemon=True
        )
        self._thread.start()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting calls, let in-flight ones finish (at most ``grace_s``), then release
        the port and the event loop's thread."""
        if self._loop.is_closed():
            return
        try:
            if self._thread is None:  # never started: only the port to release
                self._loop.run_until_complete(self._server.stop(None))
            else:
                stopping = asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self._loop)
                stopping.result(grace_s + 5)
        except TimeoutError:
            log.warning("the gRPC server on %s did not stop within %g s", self.address, grace_s)
        finally:
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(grace_s + 5)
                self._thread = None
            self._loop.close()
