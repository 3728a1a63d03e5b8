"""Connection handling below the HTTP application: an absolute deadline for receiving each
request, and a bound on open connections, in uvicorn's h11 protocol.

A connection costs a socket, a file descriptor and a parser buffer whether or not it ever
completes a request, so open connections are bounded on their own (``max_connections``), apart
from the requests being processed (``workers`` + ``max_queued``, counted by the application
once a request's body is complete). Each request must arrive within two deadlines::

    connection opened, or the previous response sent
      │◀──── header_timeout_s ────▶│ request line and headers complete
                                   │◀──── body_timeout_s ────▶│ body complete: no deadline
                                                              │   while the application runs
    idle socket, trickled headers: closed at the first deadline; trickled body: at the second

Neither is uvicorn's ``timeout_keep_alive``: that covers only the idle time between requests,
and every byte received resets it; and an ASGI middleware runs only once the headers are
parsed. So the deadline lives in the protocol: armed when a connection opens and after each
response, moved to the body deadline once the headers are complete, disarmed once the body is.
The server always runs this h11 protocol (httptools, if installed, is not used), so these
limits hold on every installation. A connection past its deadline is aborted (a request the
application already holds sees a client disconnect). A connection past ``max_connections``
is answered 503 (``{"error"}``) and closed at once; a client that had already sent its request
may see a reset instead.

>>> cls = protocol_class(ConnectionLimits(header_timeout_s=10, body_timeout_s=60,
...                                       max_connections=512))
>>> uvicorn.Config(app, http=cls)                                  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

__all__ = ["ConnectionLimits", "DeadlineH11Protocol", "protocol_class"]


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines and the connection bound of one server.

    Raises:
        ValueError: naming the field, for a timeout that is not a finite number of seconds
            > 0, or a ``max_connections`` below 1.
    """

    header_timeout_s: float  # connect (or last response) → request headers complete
    body_timeout_s: float  # request headers complete → body complete
    max_connections: int  # open connections; past it a new one gets 503 and is closed

    def __post_init__(self) -> None:
        for f in ("header_timeout_s", "body_timeout_s"):
            v = getattr(self, f)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v <= 0:
                raise ValueError(f"{f} must be a finite number of seconds > 0, got {v!r}")
        m = self.max_connections
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got {m!r}")


class _Phase(StrEnum):
    """What a connection is waiting for, and so which deadline runs."""

    HEADERS = "headers"  # a request's line and headers: header_timeout_s
    BODY = "body"  # the rest of its body: body_timeout_s
    HANDLING = "handling"  # the application's answer: no deadline (the workers bound it)


class _CorkedTransport:
    """A connection's transport that holds back what is written while corked and sends it
    in one write when uncorked (or before the connection is closed): uvicorn writes a
    response's head and body separately, two ``send`` calls and two TCP segments per
    response; corked from the end of the request's body to the end of its response, they
    leave as one. Everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self.corked = False

    def write(self, data: bytes) -> None:
        if self.corked:
            if data:
                self._held.append(bytes(data))
            return
        self._transport.write(data)

    def uncork(self) -> None:
        """Send what was held back (one write) and pass later writes straight through."""
        self.corked = False
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.uncork()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self.corked = False
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the receipt deadlines and the connection bound of
    ``limits`` (a subclass per server sets it: :func:`protocol_class`), sending each
    response in one write (:class:`_CorkedTransport`)."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = _Phase.HEADERS
        self._cork: _CorkedTransport | None = None

    # uvicorn's own signature: a stream server hands every protocol an asyncio.Transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._cork = _CorkedTransport(transport)
        self.transport = self._cork  # type: ignore[assignment]  # the same interface
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
        else:
            self._arm(_Phase.HEADERS)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        if self._cork is not None:
            self._cork.uncork()
        if not self.transport.is_closing():
            self._arm(_Phase.HEADERS)
        super().on_response_complete()  # may start a pipelined request already received
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Move to the body deadline once a request's headers are parsed, and drop the
        deadline once its body is complete."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            return  # no request under way: the header deadline runs
        if cycle.more_body:
            if self._phase is _Phase.HEADERS:
                self._arm(_Phase.BODY)
        elif self._phase is not _Phase.HANDLING:
            self._disarm()
            self._phase = _Phase.HANDLING
            if self._cork is not None:  # the body is in: what is written now is the response
                self._cork.corked = True

    def _arm(self, phase: _Phase) -> None:
        self._disarm()
        self._phase = phase
        limits = self.limits
        delay = limits.body_timeout_s if phase is _Phase.BODY else limits.header_timeout_s
        self._deadline = self.loop.call_later(delay, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        limits = self.limits
        delay = limits.body_timeout_s if self._phase is _Phase.BODY else limits.header_timeout_s
        log.debug(
            "closing the connection from %s: request %s incomplete after %g s",
            self.client,
            self._phase.value,
            delay,
        )
        self.transport.abort()  # close() would wait for a client that reads nothing

    def _refuse(self) -> None:
        n = self.limits.max_connections
        body = json.dumps(
            {
                "error": f"the server has its limit of {n} open connections (--max-connections); "
                "retry later"
            }
        ).encode()
        head = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        log.debug("refusing the connection from %s: %d connections open", self.client, n)
        self.transport.write(head + body)
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[DeadlineH11Protocol]:
    """A :class:`DeadlineH11Protocol` subclass holding ``limits`` (uvicorn makes one protocol
    object per connection from the class given as ``uvicorn.Config(http=...)``)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"limits": limits})
