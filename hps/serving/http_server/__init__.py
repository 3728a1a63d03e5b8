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
                                               (with the bytes each tier holds) + "hps_bytes"
                                               (per tier, Σ tables) + "online_updates"
                                               (hps.updates.health)
    GET  /v2/models/stats                      the same for every model
    GET  /v2/models/{m}[/versions/1]/config    Triton's model configuration (JSON)
    POST /v2/repository/index                  every served model, READY
    POST /v2/models/{m}[/versions/1]/infer     JSON or binary tensors (Inference-Header-Content-Length)

A request is parsed on the event loop (a large or compressed body on one of ``workers``
threads), checked, and handed to its model's dynamic batcher (:mod:`hps.serving.batcher`):
one inference thread per model merges every waiting request into one execution of up to
``max_batch_size`` samples; a batch smaller than ``preferred_batch_size`` waits for more, at
most ``max_queue_delay_us`` (from its oldest request, or from the end of the execution it
queued behind, for the requests that execution answered), only while requests are still
being parsed or its known clients (connections that came back) may still send, so a lone
client does not wait; the answer is
encoded on the event loop. The parser
and the event loop are httptools and uvloop when installed (``http``, ``loop``:
:mod:`hps.serving.connections`). At most ``workers + max_queued`` requests are in flight; beyond
that a request whose body has arrived gets 503 at once, so memory stays bounded under any
number of clients. A request whose scores come out NaN or infinite gets 422 naming the model
(counted in ``/stats`` as ``non_finite_output``). Connections are bounded apart from that
(``max_connections``), and each request must arrive within ``header_timeout_s`` (its headers)
and ``body_timeout_s`` (the rest of its body) or its connection is closed
(:mod:`hps.serving.connections`): sockets that stall cannot take the place of requests. The
background work ``ps.json`` asks for (online updates, cache refresh) runs while the server does.
With ``grpc_port`` set, the same servables are served over gRPC too
(:mod:`hps.serving.grpc_server`).

- :mod:`~hps.serving.http_server.config`: :class:`ServerConfig` and the bounds of its knobs.
- :mod:`~hps.serving.http_server.bodies`: reading and parsing request bodies within the limits.
- :mod:`~hps.serving.http_server.endpoints`: the application (:func:`create_app`), its routes
  and error statuses.
- :mod:`~hps.serving.http_server.inference`: ``POST .../infer`` at the ASGI level, past
  Starlette's router: admission, batching, statistics.
- :mod:`~hps.serving.http_server.server`: :class:`InferenceServer` (bind, start, stop) and
  :func:`open_server`.
- :mod:`~hps.serving.http_server.heap`: the process's objects frozen out of the cyclic
  collector's walks while a server runs (``gc_freeze``).
"""

from hps.serving.batcher import model_config
from hps.serving.http_server.config import (
    MAX_CONNECTIONS,
    MAX_GRPC_PROCESSES,
    MAX_ORT_THREADS,
    MAX_QUEUED,
    MAX_WORKERS,
    ModelBatching,
    ServerConfig,
    available_cores,
)
from hps.serving.http_server.endpoints import create_app
from hps.serving.http_server.server import InferenceServer, build_servables, open_server

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_GRPC_PROCESSES",
    "MAX_ORT_THREADS",
    "MAX_QUEUED",
    "MAX_WORKERS",
    "InferenceServer",
    "ModelBatching",
    "ServerConfig",
    "available_cores",
    "build_servables",
    "create_app",
    "model_config",
    "open_server",
]
