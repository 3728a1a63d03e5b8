"""The inference application: a whole DLRM served from its artifacts, embedding bags pooled
from the parameter server and the dense graph run by onnxruntime, behind the KServe v2 protocol
over HTTP and gRPC (``tritonclient.http`` and ``tritonclient.grpc`` work unchanged).

- :mod:`hps.serving.servable`: one model: HPS lookups + the dense ONNX graph.
- :mod:`hps.serving.v2_protocol`: request parsing and response encoding (binary tensors too);
  :mod:`hps.serving.v2_plans`: a repeated binary header's parse kept as a plan.
- :mod:`hps.serving.http_server`: the HTTP application and the server
  (``python -m hps.server``, whose argument parsing lives in :mod:`hps.server`).
- :mod:`hps.serving.connections`: below the application, per connection: the deadlines for
  receiving a request and the bound on open connections; the HTTP parser and event loop.
- :mod:`hps.serving.grpc_server`: the gRPC server (``--grpc-port``), with
  :mod:`hps.serving.grpc_protocol` (its messages ↔ tensors) and :mod:`hps.serving.protos` (the
  compiled ``.proto`` files).
- :mod:`hps.serving.grpc_front`: gRPC served by front processes (``--grpc-processes``), which
  carry each call's bytes to the server's process and back, so grpcio's own work runs beside
  the interpreter that batches and infers, not inside it.
- :mod:`hps.serving.statistics`: the per-model counts both servers keep.

    >>> with InferenceServer(ps, ServerConfig(port=0, grpc_port=0)) as srv:  # doctest: +SKIP
    ...     client = tritonclient.grpc.InferenceServerClient(srv.grpc_address)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hps.serving.connections import EventLoop, HttpParser
    from hps.serving.grpc_protocol import encode_grpc_response, parse_grpc_request
    from hps.serving.grpc_server import GrpcServer
    from hps.serving.http_server import (
        InferenceServer,
        ServerConfig,
        build_servables,
        create_app,
        open_server,
    )
    from hps.serving.servable import DLRMServable, InputError
    from hps.serving.v2_protocol import (
        InferRequest,
        ProtocolError,
        encode_infer_response,
        parse_infer_request,
    )

# Names are imported on first use, so that a front process (hps.serving.grpc_front), which
# needs grpcio and nothing else, does not import torch, onnxruntime and the servers.
_EXPORTS = {
    "EventLoop": "hps.serving.connections",
    "HttpParser": "hps.serving.connections",
    "encode_grpc_response": "hps.serving.grpc_protocol",
    "parse_grpc_request": "hps.serving.grpc_protocol",
    "GrpcServer": "hps.serving.grpc_server",
    "InferenceServer": "hps.serving.http_server",
    "ServerConfig": "hps.serving.http_server",
    "build_servables": "hps.serving.http_server",
    "create_app": "hps.serving.http_server",
    "open_server": "hps.serving.http_server",
    "DLRMServable": "hps.serving.servable",
    "InputError": "hps.serving.servable",
    "InferRequest": "hps.serving.v2_protocol",
    "ProtocolError": "hps.serving.v2_protocol",
    "encode_infer_response": "hps.serving.v2_protocol",
    "parse_infer_request": "hps.serving.v2_protocol",
}

__all__ = [
    "DLRMServable",
    "EventLoop",
    "GrpcServer",
    "HttpParser",
    "InferRequest",
    "InferenceServer",
    "InputError",
    "ProtocolError",
    "ServerConfig",
    "build_servables",
    "create_app",
    "encode_grpc_response",
    "encode_infer_response",
    "open_server",
    "parse_grpc_request",
    "parse_infer_request",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hps.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
