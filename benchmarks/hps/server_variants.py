"""``bench_server --servers``: the servers a concurrency run compares cell by cell, one
``PARSER/LOOP[@DELAY_US[:PREFERRED]][#GRPC_PROCESSES][^MACS]`` item each."""

from __future__ import annotations

from typing import NamedTuple

from hps.serving.connections import EventLoop, HttpParser
from hps.serving.http_server import ServerConfig

__all__ = ["SERVER_FORM", "ServerVariant", "parse_servers"]


class ServerVariant(NamedTuple):
    """One ``--servers`` item: a server's HTTP parser and event loop, its queue delay and
    preferred batch size (``None``: ``--queue-delay-us``, ``--preferred-batch``), its gRPC
    front processes and its ``ort_parallel_min_macs`` (``None``: ``--ort-parallel-min-macs``;
    a bound given means multiply-adds counted against it rather than both sessions timed)."""

    parser: HttpParser
    loop: EventLoop
    delay_us: int | None
    preferred: int | None
    grpc_processes: int
    parallel_min_macs: int | None


SERVER_FORM = "PARSER/LOOP[@DELAY_US[:PREFERRED]][#GRPC_PROCESSES][^MACS]"


def parse_servers(text: str) -> list[ServerVariant]:
    """``--servers``: comma-separated ``PARSER/LOOP[@DELAY_US[:PREFERRED]][#GRPC_PROCESSES]
    [^MACS]`` items (``h11/asyncio,auto/auto@5000:256,auto/auto#2,auto/auto^0``); a server's
    queue delay, preferred batch size and onnxruntime single-thread bound are
    ``--queue-delay-us``, ``--preferred-batch`` and ``--ort-parallel-min-macs`` unless its item
    gives them; its gRPC front processes (0: grpcio in the server's process) the server's
    default unless it gives them."""
    out: list[ServerVariant] = []
    for item in text.split(","):
        head, _, macs = item.strip().partition("^")
        head, _, procs = head.partition("#")
        pair, _, batching = head.partition("@")
        parser, _, loop = pair.partition("/")
        delay, _, preferred = batching.partition(":")
        try:
            out.append(
                ServerVariant(
                    HttpParser(parser),
                    EventLoop(loop or "auto"),
                    int(delay) if delay else None,
                    int(preferred) if preferred else None,
                    int(procs) if procs else ServerConfig.grpc_processes,
                    int(macs) if macs else None,
                )
            )
        except ValueError:
            raise ValueError(
                f"--servers: {item!r} is not {SERVER_FORM} "
                f"with PARSER one of {[p.value for p in HttpParser]}, LOOP one of "
                f"{[v.value for v in EventLoop]} and integers"
            ) from None
    return out
