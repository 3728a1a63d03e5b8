"""The hooks that put one of uvicorn's HTTP protocols under a :class:`ConnectionGuard`: one
mixin for both parsers (h11 and httptools), placed before the parser's protocol class in the
bases so its ``super()`` calls reach uvicorn's methods."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar

from hps.serving.connections.guard import ConnectionGuard, ConnectionLimits

__all__ = ["GuardedProtocol"]


class GuardedProtocol(asyncio.Protocol):
    """Receipt deadlines and the connection bound of ``limits`` (a subclass per server sets it:
    :func:`~hps.serving.connections.protocol_class`), each response sent in one write;
    ``on_lost`` (if set) is told the ``(host, port)`` of each connection that closes.

    Reads what uvicorn's protocols keep: ``loop``, ``client``, ``connections`` (the server's
    open connections), ``cycle`` (the request being answered, or None) and ``transport``.
    """

    limits: ClassVar[ConnectionLimits]
    on_lost: ClassVar[Callable[[Any], None] | None] = None
    loop: asyncio.AbstractEventLoop
    client: Any
    connections: set[Any]
    cycle: Any
    transport: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard: ConnectionGuard | None = None

    # uvicorn's own signature: a stream server hands every protocol an asyncio.Transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard = ConnectionGuard(self.limits, self.loop, transport, self.client)
        self.transport = self._guard.transport
        self._guard.opened(len(self.connections))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        if self._guard is not None:
            self._guard.response_complete()
        # uvicorn's protocol (next in the bases) defines it; it may start a pipelined request
        super().on_response_complete()  # type: ignore[misc]
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._guard is not None:
            self._guard.lost()
        super().connection_lost(exc)
        on_lost = type(self).on_lost  # via the class: a plain function, not a bound method
        if on_lost is not None and self.client is not None:
            on_lost(self.client)

    def _follow_request(self) -> None:
        c = self.cycle
        if self._guard is not None and c is not None:
            self._guard.follow(not c.response_complete, c.more_body)
