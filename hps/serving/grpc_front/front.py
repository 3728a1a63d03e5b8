"""One gRPC front process: grpcio's asyncio server on the v2 gRPC port (shared with the other
fronts through ``SO_REUSEPORT``: the kernel spreads new connections over them), carrying each
call's request bytes to the server's process over a Unix socket and its answer back
(:mod:`hps.serving.grpc_front.wire`). It parses nothing: the server's process decodes, checks,
batches and encodes as for its own grpcio threads, so both answer alike.

It ends when the server asks (``STOP``: the calls in flight finish first, within the grace
the server gives; exit status 0), or when the server's process goes away (its calls in
flight end ``UNAVAILABLE``; exit status 1). SIGINT and SIGTERM are ignored
(:mod:`hps.serving.grpc_front.__main__`): a terminal's Ctrl-C and a service manager's SIGTERM
reach the whole process group, and the server's process stops its fronts itself once its own
calls are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import cast

import grpc

from hps.serving.grpc_front.wire import (
    MAX_FRAME_BYTES,
    RPC_NAMES,
    SERVICE,
    STOP,
    Answer,
    FrameError,
    FrameReader,
    call_frame,
    decode_answer,
    grpc_target,
    hello_frame,
)

log = logging.getLogger(__name__)

__all__ = ["RelayLink", "serve"]

_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class RelayLink(asyncio.Protocol):
    """The front's end of its Unix socket to the server's process: :meth:`call` sends a call
    and awaits its answer; answers resolve their calls as they arrive, in any order."""

    def __init__(self, max_frame: int) -> None:
        self._reader = FrameReader(max_frame)
        self._pending: dict[int, asyncio.Future[Answer]] = {}
        self._next_id = 1
        self._transport: asyncio.Transport | None = None
        self.stop_requested = asyncio.Event()
        self.grace_s = 10.0  # for the calls in flight, as the server's stop asks
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError as e:
            log.error("grpc front: the server's process sent a malformed frame (%s)", e)
            self.close()
            return
        for f in frames:
            try:
                a = decode_answer(f)
            except FrameError as e:
                log.error("grpc front: %s", e)
                self.close()
                return
            if a.call_id == 0:
                if a.code == STOP:
                    with contextlib.suppress(ValueError):
                        self.grace_s = max(0.0, float(a.body))
                    self.stop_requested.set()
                continue
            fut = self._pending.pop(a.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(a)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the server's process closed its connection"))
        self._pending.clear()
        self.stop_requested.set()

    def send(self, frame: bytes) -> None:
        if self._transport is None or self.lost:
            raise ConnectionError("the server's process closed its connection")
        self._transport.write(frame)

    async def call(self, rpc: int, peer: str, message: bytes) -> Answer:
        """The server's answer to one call (``ConnectionError`` if its process goes away)."""
        cid = self._next_id
        self._next_id += 1
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        try:
            self.send(call_frame(cid, rpc, peer, message))
            return await fut
        finally:
            self._pending.pop(cid, None)  # answered, failed or cancelled by the client

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _method(
    link: RelayLink, rpc: int
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            a = await link.call(rpc, context.peer(), request)
        except ConnectionError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down or its process is gone"
            )
            raise  # abort raises; never reached
        if a.code != 0:
            code = _STATUS.get(a.code, grpc.StatusCode.UNKNOWN)
            await context.abort(code, a.body.decode("utf-8", "replace"))
        return a.body

    return handle


async def serve(
    relay: str, host: str, port: int, max_request_bytes: int, max_in_flight: int, grace_s: float
) -> int:
    """Serve the v2 gRPC service on ``host:port`` for the server whose Unix socket is
    ``relay`` until it asks to stop; the exit status (0, or 2 if the port cannot be bound)."""
    loop = asyncio.get_running_loop()
    link = RelayLink(MAX_FRAME_BYTES)  # answers come from the server, within its own bound
    link.grace_s = grace_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + relay)  # an abstract socket (uvloop's connect cannot name one)
        await loop.create_unix_connection(lambda: link, sock=sock)
    except BaseException:
        sock.close()
        raise
    options = [
        ("grpc.so_reuseport", 1),  # the fronts share the port; the server checked it was free
        ("grpc.max_receive_message_length", max_request_bytes),
    ]
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=max_in_flight)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(_method(link, i))
        for i, name in enumerate(RPC_NAMES)
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    try:
        bound = server.add_insecure_port(grpc_target(host, port))
    except RuntimeError as e:
        link.send(hello_frame(None, f"cannot listen on {host}:{port} (gRPC): {e}"))
        await asyncio.sleep(0)  # let the hello reach the socket
        link.close()
        return 2
    await server.start()
    link.send(hello_frame(bound))
    await link.stop_requested.wait()
    await server.stop(link.grace_s)  # calls in flight finish while the link lasts
    lost = link.lost
    link.close()
    if lost:
        log.warning("grpc front: the server's process closed its connection; exiting")
        return 1
    return 0
