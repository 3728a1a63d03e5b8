"""``python -m hps.serving.grpc_front --relay SOCKET --port P ...``: one gRPC front process,
started by the v2 server with ``--grpc-processes`` (:mod:`hps.serving.grpc_front.relay`);
not meant to be run by hand."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from hps.serving.grpc_front.front import serve


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hps.serving.grpc_front", description=__doc__)
    p.add_argument("--relay", required=True, help="the server's abstract Unix socket's name")
    p.add_argument("--host", required=True)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--max-request-bytes", required=True, type=int)
    p.add_argument("--max-in-flight", required=True, type=int)
    p.add_argument("--grace-s", type=float, default=10.0)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="asyncio",
        help="event loop under grpcio's asyncio server (the server passes its own --loop)",
    )
    a = p.parse_args(argv)
    level = int(a.log_level) if a.log_level.isdigit() else a.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s[%(process)d] %(message)s")
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole process group; the
    # server's process stops its fronts after its own calls (or its end closes their socket).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run: Callable[[Coroutine[Any, Any, int]], int] = asyncio.run
    if a.loop == "uvloop":  # a quarter less CPU per call than asyncio's (docs/benchmarks.md)
        import uvloop

        run = uvloop.run
    try:
        return run(serve(a.relay, a.host, a.port, a.max_request_bytes, a.max_in_flight, a.grace_s))
    except OSError as e:  # the server's socket is gone before the front connected
        print(f"grpc front: cannot reach the server at {a.relay}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
