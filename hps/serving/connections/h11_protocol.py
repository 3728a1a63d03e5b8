"""uvicorn's h11 protocol (pure Python, always installed) under a :class:`ConnectionGuard`."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from hps.serving.connections.guard import ConnectionGuard, ConnectionLimits

__all__ = ["DeadlineH11Protocol"]


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the receipt deadlines and the connection bound of
    ``limits`` (a subclass per server sets it: :func:`~hps.serving.connections.protocol_class`),
    sending each response in one write."""

    limits: ClassVar[ConnectionLimits]

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
        super().on_response_complete()  # may start a pipelined request already received
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._guard is not None:
            self._guard.lost()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        c = self.cycle
        if self._guard is not None and c is not None:
            self._guard.follow(not c.response_complete, c.more_body)
