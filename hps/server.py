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
from dataclasses import dataclass

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.connections import EventLoop, HttpParser
from hps.serving.http_server import (
    MAX_CONNECTIONS,
    MAX_GRPC_PROCESSES,
    MAX_QUEUED,
    MAX_WORKERS,
    ModelBatching,
    ServerConfig,
    open_server,
)
from knobs import add_knobs, from_namespace, knob

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


_DEFAULTS = ServerConfig()


@dataclass(frozen=True)
class ServerKnobs:
    """The knobs of ``python -m hps.server`` (shown in ``--help``); the server's own limits
    are :class:`~hps.serving.http_server.ServerConfig`'s, checked when it is built."""

    config: str = knob("ps.json", "ps.json (e.g. written by export.artifacts)", required=True)
    host: str = knob(_DEFAULTS.host, "address to listen on")
    port: int = knob(_DEFAULTS.port, "HTTP port (0 picks a free port)", parse=int)
    grpc_port: int | None = knob(
        None,
        "also serve the KServe v2 gRPC protocol (tritonclient.grpc) on this port, on "
        "--host; 0 picks a free port (none: HTTP only)",
    )
    grpc_processes: int = knob(
        _DEFAULTS.grpc_processes,
        f"serve gRPC from this many front processes sharing --grpc-port (1 to "
        f"{MAX_GRPC_PROCESSES}), each carrying its calls to this process, so grpcio's work "
        "runs beside the batching and inference instead of in their interpreter; 0: grpcio "
        "threads in this process; -1: one front where this process may use 2 or more cores, "
        "else 0",
        parse=int,
    )
    models: tuple[str, ...] | None = knob(None, "models to serve (none: all)")
    workers: int = knob(
        _DEFAULTS.workers,
        f"threads that parse large or compressed requests (1 to {MAX_WORKERS}); with "
        "--max-queued, the requests in flight",
        parse=int,
    )
    max_queued: int = knob(
        _DEFAULTS.max_queued,
        f"requests in flight beyond --workers before new ones get 503 (at most {MAX_QUEUED})",
        parse=int,
    )
    max_batch_size: int = knob(
        _DEFAULTS.max_batch_size,
        "dynamic batching: most samples per merged execution of a model (0: the model's "
        "max_batch_size in ps.json)",
        parse=int,
    )
    max_queue_delay_us: int = knob(
        _DEFAULTS.max_queue_delay_us,
        "dynamic batching: the most microseconds a request waits for others to join its "
        "batch, counted from its arrival or, queued behind an execution, from that "
        "execution's end (for the requests it answered to come back); a batch waits only "
        "while clients that came back (sent a second request on their connection) may still "
        "send, so a lone client or one connecting per request never waits (0: merge only "
        "requests already waiting)",
        parse=int,
    )
    preferred_batch_size: int = knob(
        _DEFAULTS.preferred_batch_size,
        "dynamic batching: every waiting request joins a batch up to the merged max batch "
        "size; once nothing more is waiting, a batch of fewer than this many samples waits "
        "(at most --max-queue-delay-us) for more, or until no more requests can come: nothing "
        "else is being read and it holds as many requests as the clients that came back can "
        "have in flight at once (unlike Triton, which sends its largest preferred size and "
        "waits the full delay for it; 0: each model's merged max; capped at it)",
        parse=int,
    )
    model_batching: tuple[str, ...] = knob(
        (),
        "dynamic batching of single models, "
        "MODEL:MAX_BATCH_SIZE:MAX_QUEUE_DELAY_US[:PREFERRED_BATCH_SIZE] each, overriding "
        "the server's knobs (without PREFERRED_BATCH_SIZE: the server's)",
    )
    max_connections: int = knob(
        _DEFAULTS.max_connections,
        f"open connections; past it a new one gets 503 and is closed (at most "
        f"{MAX_CONNECTIONS}, and below the process's file-descriptor limit)",
        parse=int,
    )
    header_timeout_s: float = knob(
        _DEFAULTS.header_timeout_s,
        "seconds from connecting (or the last response) to a request's complete headers; "
        "a connection past it is closed",
        parse=float,
    )
    body_timeout_s: float = knob(
        _DEFAULTS.body_timeout_s,
        "seconds from a request's headers to its complete body; a connection past it is closed",
        parse=float,
    )
    ort_threads: int = knob(
        _DEFAULTS.ort_threads,
        "onnxruntime intra-op threads per execution (0: one per core this process may use)",
        parse=int,
    )
    ort_parallel_min_macs: int = knob(
        _DEFAULTS.ort_parallel_min_macs,
        "with --no-ort-measure-threads, an execution whose dense graph does fewer "
        "multiply-adds (its weight matrices × (batch + 10), the ten for reading the weights) "
        "runs on one onnxruntime thread, larger ones on --ort-threads (0, timed or not: all "
        "on --ort-threads); the scores are the same",
        parse=int,
    )
    ort_measure_threads: bool = knob(
        _DEFAULTS.ort_measure_threads,
        "time each model's dense graph on --ort-threads and on one thread at load (batch 1, "
        "2, 4, … its max batch) and run on one thread the batches it wins, rather than "
        "counting multiply-adds against --ort-parallel-min-macs (0 still turns it off)",
    )
    torch_threads: int = knob(
        _DEFAULTS.torch_threads,
        "torch intra-op threads of each model's inference thread (the lookups)",
        parse=int,
    )
    switch_interval_us: int = knob(
        _DEFAULTS.switch_interval_us,
        "the interpreter's thread switch interval while serving (Python's default: 5000)",
        parse=int,
    )
    gc_freeze: bool = knob(
        _DEFAULTS.gc_freeze,
        "collect the start-up's garbage, then freeze the interpreter's objects as serving "
        "starts (gc.freeze): the cyclic collector then skips the imports' and models' "
        "objects, and what serving allocates is collected as before",
    )
    max_request_mb: float = knob(
        _DEFAULTS.max_request_mb, "largest request body in MB", parse=float
    )
    max_json_mb: float = knob(
        _DEFAULTS.max_json_mb,
        "largest JSON part of a request (binary tensors do not count)",
        parse=float,
    )
    http: HttpParser = knob(
        _DEFAULTS.http,
        "HTTP/1.1 parser: httptools (C) or h11 (pure Python); auto: httptools when installed "
        "(a missing one falls back to h11, logged)",
    )
    loop: EventLoop = knob(
        _DEFAULTS.loop,
        "event loop of the HTTP server: uvloop or asyncio; auto: uvloop when installed (a "
        "missing one falls back to asyncio, logged)",
    )
    log_level: str = knob("info", "logging level", parse=str.lower, choices=LOG_LEVELS)

    def server_config(self) -> ServerConfig:
        """The server's configuration (``ValueError`` naming a value out of its range)."""
        return ServerConfig(
            host=self.host,
            port=self.port,
            grpc_port=self.grpc_port,
            grpc_processes=self.grpc_processes,
            workers=self.workers,
            max_queued=self.max_queued,
            ort_threads=self.ort_threads,
            ort_parallel_min_macs=self.ort_parallel_min_macs,
            ort_measure_threads=self.ort_measure_threads,
            torch_threads=self.torch_threads,
            switch_interval_us=self.switch_interval_us,
            gc_freeze=self.gc_freeze,
            max_request_mb=self.max_request_mb,
            max_json_mb=self.max_json_mb,
            max_batch_size=self.max_batch_size,
            max_queue_delay_us=self.max_queue_delay_us,
            preferred_batch_size=self.preferred_batch_size,
            model_batching=tuple(ModelBatching.parse(m) for m in self.model_batching),
            max_connections=self.max_connections,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            http=self.http,
            loop=self.loop,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hps.server",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_knobs(p, ServerKnobs)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = from_namespace(ServerKnobs, p.parse_args(argv))
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = a.server_config()
        ps = HierarchicalParameterServer.from_config(a.config)
    except (ValueError, OSError) as e:
        p.error(str(e))
    models = list(a.models) if a.models is not None else None
    try:
        srv = open_server(ps, cfg, models)
    except Exception as e:  # e.g. an update source that cannot start: exit 2 naming it
        p.error(str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}")
    try:
        srv.serve_until_signalled()  # in-flight requests finish, then the databases close
    finally:
        ps.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
