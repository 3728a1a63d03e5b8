"""``python -m hps.server --config out/ps.json``: the KServe v2 inference server on the models
of a ``ps.json`` (:mod:`hps.serving.http_server`; with ``--grpc-port`` gRPC too,
:mod:`hps.serving.grpc_server`), until SIGINT or SIGTERM.

A bad ``ps.json`` (unreadable, not UTF-8 JSON, or invalid), a bad flag, an address that is
taken or a model that cannot be served ends it with exit status 2 and the error on stderr.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import (
    MAX_CONNECTIONS,
    MAX_QUEUED,
    MAX_WORKERS,
    ModelBatching,
    ServerConfig,
    open_server,
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(
        prog="python -m hps.server",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="ps.json (e.g. written by export.artifacts)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the KServe v2 gRPC protocol (tritonclient.grpc) on this port, on "
        "--host; 0 picks a free port (default: HTTP only)",
    )
    p.add_argument("--models", nargs="*", default=None, help="models to serve (default: all)")
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help=f"threads that parse large or compressed requests (1 to {MAX_WORKERS}); with "
        "--max-queued, the requests in flight",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=d.max_queued,
        help=f"requests in flight beyond --workers before new ones get 503 (at most {MAX_QUEUED})",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=d.max_batch_size,
        help="dynamic batching: most samples per merged execution of a model (0: the model's "
        "max_batch_size in ps.json)",
    )
    p.add_argument(
        "--max-queue-delay-us",
        type=int,
        default=d.max_queue_delay_us,
        help="dynamic batching: microseconds a request may wait for others to join its batch "
        "(0: merge only requests already waiting)",
    )
    p.add_argument(
        "--model-batching",
        action="append",
        default=[],
        metavar="MODEL:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US",
        help="dynamic batching of one model, overriding the two flags above (repeatable)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help=f"open connections; past it a new one gets 503 and is closed (at most "
        f"{MAX_CONNECTIONS}, and below the process's file-descriptor limit)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=d.header_timeout_s,
        help="seconds from connecting (or the last response) to a request's complete headers; "
        "a connection past it is closed",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="seconds from a request's headers to its complete body; a connection past it is "
        "closed",
    )
    p.add_argument(
        "--ort-threads",
        type=int,
        default=d.ort_threads,
        help="onnxruntime intra-op threads per execution (0: one per core this process may use)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=d.torch_threads,
        help="torch intra-op threads of each model's inference thread (the lookups)",
    )
    p.add_argument(
        "--switch-interval-us",
        type=int,
        default=d.switch_interval_us,
        help="the interpreter's thread switch interval while serving (Python's default: 5000)",
    )
    p.add_argument("--max-request-mb", type=float, default=d.max_request_mb)
    p.add_argument(
        "--max-json-mb",
        type=float,
        default=d.max_json_mb,
        help="largest JSON part of a request (binary tensors do not count)",
    )
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = ServerConfig(
            host=a.host,
            port=a.port,
            grpc_port=a.grpc_port,
            workers=a.workers,
            max_queued=a.max_queued,
            ort_threads=a.ort_threads,
            torch_threads=a.torch_threads,
            switch_interval_us=a.switch_interval_us,
            max_request_mb=a.max_request_mb,
            max_json_mb=a.max_json_mb,
            max_batch_size=a.max_batch_size,
            max_queue_delay_us=a.max_queue_delay_us,
            model_batching=tuple(ModelBatching.parse(m) for m in a.model_batching),
            max_connections=a.max_connections,
            header_timeout_s=a.header_timeout_s,
            body_timeout_s=a.body_timeout_s,
        )
        ps = HierarchicalParameterServer.from_config(a.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    try:
        srv = open_server(ps, cfg, a.models)
    except Exception as e:  # e.g. an update source that cannot start: exit 2 naming it
        p.error(str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}")
    try:
        srv.serve_until_signalled()  # in-flight requests finish, then the databases close
    finally:
        ps.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
