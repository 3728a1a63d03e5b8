"""``python -m hps.server --config out/ps.json``: the KServe v2 inference server on the models
of a ``ps.json`` (:mod:`hps.serving.http_server`), until SIGINT or SIGTERM.

A bad ``ps.json``, a bad flag or a model that cannot be served ends it with exit status 2 and
the error on stderr.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import ServerConfig, open_server


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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = ServerConfig(a.host, a.port, a.workers, a.max_queued, a.ort_threads, a.max_request_mb)
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
