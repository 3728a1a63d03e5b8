"""The per-connection state both HTTP protocols share: the receipt deadlines and the connection
bound (:class:`ConnectionGuard`), and the corked transport that sends a response in one write."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["ConnectionGuard", "ConnectionLimits"]


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


class ConnectionGuard:
    """One connection's receipt deadline, its place under the connection bound and its corked
    transport; the protocol (h11 or httptools) reports what its parser has seen.

    Args:
        limits: the server's deadlines and bound.
        loop: the event loop the connection runs on (its timers).
        transport: the connection's transport; the protocol writes through :attr:`transport`.
        client: the peer's address, for log lines.
    """

    def __init__(
        self,
        limits: ConnectionLimits,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.Transport,
        client: tuple[str, int] | None,
    ) -> None:
        self.limits, self.loop, self.client = limits, loop, client
        self._cork = _CorkedTransport(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = _Phase.HEADERS

    @property
    def transport(self) -> asyncio.Transport:
        """The transport the protocol writes through (corked while a response is written)."""
        return self._cork  # type: ignore[return-value]  # the same interface, by delegation

    def opened(self, open_connections: int) -> None:
        """A connection was accepted, ``open_connections`` open counting it: past the bound
        it is answered 503 and closed, else the header deadline starts."""
        if open_connections > self.limits.max_connections:
            self._refuse()
        else:
            self._arm(_Phase.HEADERS)

    def follow(self, in_request: bool, more_body: bool) -> None:
        """After the parser has taken bytes: ``in_request`` (a request whose response is not
        complete) and ``more_body`` (its body is not complete). The body deadline runs once a
        request's headers are in, none once its body is; the response is corked from then."""
        if not in_request or self._cork.is_closing():
            return  # no request under way: the header deadline runs
        if more_body:
            if self._phase is _Phase.HEADERS:
                self._arm(_Phase.BODY)
        elif self._phase is not _Phase.HANDLING:
            self._disarm()
            self._phase = _Phase.HANDLING
            self._cork.corked = True  # the body is in: what is written now is the response

    def response_complete(self) -> None:
        """A response was written: send it, and start the next request's header deadline."""
        self._cork.uncork()
        if not self._cork.is_closing():
            self._arm(_Phase.HEADERS)

    def lost(self) -> None:
        """The connection closed: no deadline runs."""
        self._disarm()

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
        if self._cork.is_closing():
            return
        limits = self.limits
        delay = limits.body_timeout_s if self._phase is _Phase.BODY else limits.header_timeout_s
        log.debug(
            "closing the connection from %s: request %s incomplete after %g s",
            self.client,
            self._phase.value,
            delay,
        )
        self._cork.abort()  # close() would wait for a client that reads nothing

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
        self._cork.write(head + body)
        self._cork.close()
