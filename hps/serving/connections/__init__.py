"""Connection handling below the HTTP application: an absolute deadline for receiving each
request and a bound on open connections, in either of uvicorn's HTTP/1.1 protocols, and the
choice of that protocol and of the event loop.

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
response, moved to the body deadline once the headers are complete, disarmed once the body is
(:class:`~hps.serving.connections.guard.ConnectionGuard`, which both protocols below hold, so
these limits hold whichever parses). A connection past its deadline is aborted (a request the
application already holds sees a client disconnect). A connection past ``max_connections``
is answered 503 (``{"error"}``) and closed at once; a client that had already sent its request
may see a reset instead.

The parser (:class:`HttpParser`) and the event loop (:class:`EventLoop`) are knobs whose
default, ``auto``, is the fastest installed (the ``serve`` extra installs both):

=============  =====================================================  ======================
knob value     what                                                   needs
=============  =====================================================  ======================
``httptools``  llhttp (C) parses requests                             ``httptools``
``h11``        h11 (pure Python) parses requests                      (uvicorn's own)
``uvloop``     libuv event loop                                       ``uvloop``
``asyncio``    the standard library's event loop                      —
=============  =====================================================  ======================

A choice whose package is missing falls back to the pure-Python one with a logged note. Tiny
model, 16 HTTP clients × batch 16 on 2 shared cores, side by side: the event loop's CPU per
request 676 µs with h11 + asyncio, 438 µs with httptools + uvloop; 10,744 against 19,688
samples/s (docs/benchmarks.md, "v2 server: httptools, uvloop and a batcher that does not wait
alone").

>>> cls = protocol_class(ConnectionLimits(header_timeout_s=10, body_timeout_s=60,
...                                       max_connections=512), HttpParser.AUTO)
>>> uvicorn.Config(app, http=cls, loop=pick_loop(EventLoop.AUTO).value)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from hps.serving.connections.guard import ConnectionGuard, ConnectionLimits
from hps.serving.connections.h11_protocol import DeadlineH11Protocol

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionGuard",
    "ConnectionLimits",
    "DeadlineH11Protocol",
    "EventLoop",
    "HttpParser",
    "pick_loop",
    "pick_parser",
    "protocol_class",
]


class HttpParser(StrEnum):
    """Which HTTP/1.1 parser the server's connections use."""

    AUTO = "auto"  # the fastest installed: httptools, else h11
    HTTPTOOLS = "httptools"  # llhttp (C), the ``httptools`` package
    H11 = "h11"  # pure Python, always present with uvicorn


class EventLoop(StrEnum):
    """Which event loop runs the HTTP server."""

    AUTO = "auto"  # the fastest installed: uvloop, else asyncio
    UVLOOP = "uvloop"  # libuv, the ``uvloop`` package
    ASYNCIO = "asyncio"  # the standard library's


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pick_parser(choice: HttpParser) -> HttpParser:
    """The parser ``choice`` resolves to here: ``AUTO`` the fastest installed, and a parser
    whose package is missing falls back to ``H11`` (logged)."""
    if choice is HttpParser.H11 or _installed("httptools"):
        return HttpParser.HTTPTOOLS if choice is HttpParser.AUTO else choice
    level = logging.WARNING if choice is HttpParser.HTTPTOOLS else logging.INFO
    log.log(
        level,
        "HTTP parser %r: the httptools package is not installed (pip install httptools, or "
        "the serve extra); parsing with h11 (pure Python, slower)",
        choice.value,
    )
    return HttpParser.H11


def pick_loop(choice: EventLoop) -> EventLoop:
    """The event loop ``choice`` resolves to here: ``AUTO`` the fastest installed, and a loop
    whose package is missing falls back to ``ASYNCIO`` (logged)."""
    if choice is EventLoop.ASYNCIO or _installed("uvloop"):
        return EventLoop.UVLOOP if choice is EventLoop.AUTO else choice
    level = logging.WARNING if choice is EventLoop.UVLOOP else logging.INFO
    log.log(
        level,
        "event loop %r: the uvloop package is not installed (pip install uvloop, or the "
        "serve extra); running on asyncio's loop",
        choice.value,
    )
    return EventLoop.ASYNCIO


def protocol_class(
    limits: ConnectionLimits,
    parser: HttpParser,
    on_lost: Callable[[Any], None] | None = None,
) -> type[asyncio.Protocol]:
    """The protocol class of one server (uvicorn makes one object per connection from the
    class given as ``uvicorn.Config(http=...)``): a subclass of the deadline protocol of
    ``pick_parser(parser)`` (:class:`DeadlineH11Protocol` or ``DeadlineHttpToolsProtocol``)
    holding ``limits``; ``on_lost``, if given, is called with the ``(host, port)`` of each
    connection that closes (on the event loop: it must not block)."""
    if pick_parser(parser) is HttpParser.HTTPTOOLS:
        from hps.serving.connections.httptools_protocol import DeadlineHttpToolsProtocol

        base: type[asyncio.Protocol] = DeadlineHttpToolsProtocol
    else:
        base = DeadlineH11Protocol
    return type(base.__name__, (base,), {"limits": limits, "on_lost": on_lost})
