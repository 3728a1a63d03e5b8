"""The inference application: a whole DLRM served from its artifacts, embedding bags pooled
from the parameter server and the dense graph run by onnxruntime, behind the KServe v2 HTTP
protocol (``tritonclient.http`` works unchanged).

- :mod:`hps.serving.servable`: one model: HPS lookups + the dense ONNX graph.
- :mod:`hps.serving.v2_protocol`: request parsing and response encoding (binary tensors too).
- :mod:`hps.serving.http_server`: the HTTP application and the server
  (``python -m hps.server``, whose argument parsing lives in :mod:`hps.server`).
- :mod:`hps.serving.connections`: below the application, per connection: the deadlines for
  receiving a request and the bound on open connections.

    >>> with InferenceServer(ps, ServerConfig(port=0)) as srv:      # doctest: +SKIP
    ...     client = tritonclient.http.InferenceServerClient(srv.address)
"""

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

__all__ = [
    "DLRMServable",
    "InferRequest",
    "InferenceServer",
    "InputError",
    "ProtocolError",
    "ServerConfig",
    "build_servables",
    "create_app",
    "encode_infer_response",
    "open_server",
    "parse_infer_request",
]
