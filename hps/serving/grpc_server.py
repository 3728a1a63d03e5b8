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
lookup worker, ``INTERNAL`` for 500. A request is parsed and checked on a grpcio thread, then
merged with the model's other waiting requests, HTTP's too, by the model's dynamic batcher
(:mod:`hps.serving.batcher`). Limits: ``workers + max_queued`` calls in flight, past that
grpcio answers ``RESOURCE_EXHAUSTED`` at once; a message larger than ``max_request_bytes``
(after decompression) is refused by grpcio with ``RESOURCE_EXHAUSTED`` before it is read.
With ``--grpc-processes`` the calls arrive from front processes instead
(:mod:`hps.serving.grpc_front`): the same :class:`GrpcInferenceServicer` answers them, so
statuses, messages and statistics are the same. Names a client gives are clipped in error
messages (:mod:`hps.serving.clipping`), so a
100,000-character model name gets ``NOT_FOUND`` with a short message.
Connections are HTTP/2's: grpcio bounds streams per connection and closes broken ones.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

import hps.serving.protos.grpc_predict_v2_pb2 as pb
import hps.serving.protos.triton_extensions_pb2 as ext
from hps.serving.batcher import BatchedResult, DynamicBatcher, model_config
from hps.serving.clipping import clip
from hps.serving.grpc_front.wire import RPC_NAMES, SERVICE, grpc_target
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
    "RPCS",
    "GrpcInferenceServicer",
    "GrpcServer",
    "InferCall",
    "RpcAbort",
    "check_bindable",
    "decode_request",
    "method_handlers",
    "unexpected_error",
    "status_of",
]

EXTENSIONS = ("model_configuration",)
# grpcio threads: each call in flight holds one while it waits for its batch, so up to
# workers + max_queued of them, but no more than this many threads.
MAX_GRPC_THREADS = 256


class RpcAbort(Exception):
    """A call that ends with ``code`` (not OK) and ``message``: raised by the servicer, turned
    into the call's status by whichever transport carries it (grpcio in this process, or a
    front process, :mod:`hps.serving.grpc_front`)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    context.abort(code, msg)
    raise AssertionError("grpc's context.abort returned")  # it raises; this line is unreachable


class InferCall:
    """A ``ModelInfer`` call submitted to its model's batcher: :attr:`future` resolves when its
    execution ran; :meth:`finish` then encodes the response (or raises :class:`RpcAbort`) and
    counts the call into the model's statistics."""

    def __init__(
        self,
        servicer: GrpcInferenceServicer,
        servable: DLRMServable,
        req: Any,
        samples: int,
        future: Future[BatchedResult],
        t0: int,
        t1: int,
    ) -> None:
        self._servicer, self._s, self._req, self._samples = servicer, servable, req, samples
        self.future, self._t0, self._t1 = future, t0, t1

    def finish(self) -> pb.ModelInferResponse:
        """The response of a call whose :attr:`future` is done.

        Raises:
            RpcAbort: the request failed (its status and message).
        """
        s, t0 = self._s, self._t0
        try:
            done = self.future.result()
            t2 = time.perf_counter_ns()
            resp = encode_grpc_response(s.name, MODEL_VERSION, done.outputs, self._req)
        except Exception as e:  # every failure of a request ends its call, never the server
            raise self._servicer._failed(s, t0, e) from e
        t3 = time.perf_counter_ns()
        phases = PhaseNs(done.queue_ns, self._t1 - t0, done.infer_ns, t3 - t2)
        self._servicer.counts[s.name].succeeded(t3 - t0, self._samples, phases)
        return resp


class GrpcInferenceServicer:
    """The RPCs of the service over ``servables`` (model name → servable); each method takes a
    request message and returns the response message, or raises :class:`RpcAbort`.
    ``ModelInfer`` calls go to ``batchers`` (model name → the model's dynamic batcher) and are
    counted into ``counts`` (model name → statistics; both shared with the HTTP server, so
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
            raise RpcAbort(code, str(e)) from e

    def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        # the server exists once every model loaded; online updates' policy: hps.updates.health
        ready = all(s.session.update_status().ready for s in self.servables.values())
        return pb.ServerReadyResponse(ready=ready)

    def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS
        )

    def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        try:
            find_model(self.servables, request.name, request.version)
        except ProtocolError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        doc = self._model(request.name, request.version).metadata()
        return json_format.ParseDict(doc, pb.ModelMetadataResponse())

    def model_config(self, request: ext.ModelConfigRequest) -> ext.ModelConfigResponse:
        s = self._model(request.name, request.version)
        doc = model_config(s, self.batchers[s.name].cfg)
        return ext.ModelConfigResponse(config=json_format.ParseDict(doc, ext.ModelConfig()))

    def repository_index(self, request: ext.RepositoryIndexRequest) -> ext.RepositoryIndexResponse:
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

    def start_infer(self, request: pb.ModelInferRequest, peer: str) -> InferCall:
        """Parse and check a ``ModelInfer`` request from ``peer`` (the connection's address,
        for the known clients) and submit it to its model's batcher.

        Raises:
            RpcAbort: an unknown model, or a request that failed before its execution.
        """
        t0 = time.perf_counter_ns()
        s = self._model(request.model_name, request.model_version)
        try:
            with self.batchers[s.name].arrival(peer) as arrival:
                req = parse_grpc_request(request)
                inputs = s.check(req.inputs)
                t1 = time.perf_counter_ns()
                future = arrival.submit(inputs)
        except Exception as e:  # every failure of a request ends its call, never the server
            raise self._failed(s, t0, e) from e
        return InferCall(self, s, req, int(inputs["dense"].shape[0]), future, t0, t1)

    def model_infer(self, request: pb.ModelInferRequest, peer: str) -> pb.ModelInferResponse:
        """Parse, infer, encode (waiting for the execution on this thread)."""
        return self.start_infer(request, peer).finish()  # finish waits for the future

    def _failed(self, s: DLRMServable, t0: int, e: Exception) -> RpcAbort:
        """Count a failed call of model ``s`` and the status it ends with."""
        self.counts[s.name].failed(time.perf_counter_ns() - t0, isinstance(e, NonFiniteOutputError))
        code, msg = status_of(e)
        if code is grpc.StatusCode.INTERNAL:
            log.error("model %r: inference failed", s.name, exc_info=e)
        return RpcAbort(code, msg)


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
RPCS: dict[str, tuple[str, Any, Any]] = {
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
assert tuple(RPCS) == RPC_NAMES, "the front processes' rpc numbers follow RPCS"


class _Decoded:
    """An RPC method that receives the request's bytes and decodes them itself, so bytes that
    are not a message of its type end the call with ``INVALID_ARGUMENT`` naming the type
    (grpcio's own deserializer answers ``INTERNAL``); the servicer's :class:`RpcAbort` ends
    the call with its status."""

    def __init__(self, fn: Callable[..., Any], request_cls: Any, peer: bool) -> None:
        self.fn, self.request_cls, self.peer = fn, request_cls, peer

    def __call__(self, data: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = decode_request(self.request_cls, data)
            return self.fn(request, context.peer()) if self.peer else self.fn(request)
        except RpcAbort as e:
            _abort(context, e.code, e.message)
        except Exception as e:  # a bug of ours: the call fails INTERNAL, the server lives on
            log.exception("grpc %s failed", self.request_cls.DESCRIPTOR.name)
            bug = unexpected_error(e)
            _abort(context, bug.code, bug.message)


def unexpected_error(e: Exception) -> RpcAbort:
    """The status a call ends with when the servicer fails unexpectedly: ``INTERNAL``."""
    return RpcAbort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def decode_request(request_cls: Any, data: bytes) -> Any:
    """``data`` as a message of ``request_cls``.

    Raises:
        RpcAbort: ``INVALID_ARGUMENT``, bytes that are not such a message.
    """
    try:
        return request_cls.FromString(data)
    except DecodeError as e:
        raise RpcAbort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid {request_cls.DESCRIPTOR.full_name} message: {e}",
        ) from e


def method_handlers(servicer: GrpcInferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """RPC name → grpcio handler of ``servicer``'s method (all unary-unary)."""
    out = {}
    for rpc, (method, req_cls, resp_cls) in RPCS.items():
        out[rpc] = grpc.unary_unary_rpc_method_handler(
            _Decoded(getattr(servicer, method), req_cls, peer=rpc == "ModelInfer"),
            response_serializer=resp_cls.SerializeToString,
        )
    return out


def check_bindable(host: str, port: int) -> None:
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
    """The v2 gRPC server, bound on construction, serving on :meth:`start` until :meth:`stop`.

    Args:
        servables: model name → servable (shared with the HTTP server).
        host: the address to listen on (``127.0.0.1``: this machine only).
        port: the port; 0 picks a free one (read :attr:`port`).
        workers: threads that parse and run requests.
        max_queued: requests that may wait for a worker; past ``workers + max_queued``
            requests in flight, new ones get ``RESOURCE_EXHAUSTED``.
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
        check_bindable(host, port)
        self.host = host
        threads = min(workers + max_queued, MAX_GRPC_THREADS)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hps-v2-grpc")
        options = [
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
            ("grpc.max_receive_message_length", max_request_bytes),
        ]
        self._server = grpc.server(
            self._executor, options=options, maximum_concurrent_rpcs=workers + max_queued
        )
        handlers = method_handlers(GrpcInferenceServicer(servables, counts, batchers))
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        try:
            self.port: int = self._server.add_insecure_port(grpc_target(host, port))
        except RuntimeError as e:
            self._executor.shutdown(wait=False)
            raise OSError(f"cannot listen on {host}:{port} (gRPC): {e}") from e

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.grpc.InferenceServerClient`` takes)."""
        return grpc_target(self.host, self.port)

    def start(self) -> GrpcServer:
        self._server.start()
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting calls, let in-flight ones finish (at most ``grace_s``), then release
        the port and the worker threads."""
        done = self._server.stop(grace_s)
        if not done.wait(grace_s + 5):
            log.warning("the gRPC server on %s did not stop within %g s", self.address, grace_s)
        self._executor.shutdown(wait=True)
