"""uvicorn's httptools protocol (llhttp, C; the ``httptools`` package) under a
:class:`ConnectionGuard`. Imported only when that package is installed and chosen
(:func:`~hps.serving.connections.protocol_class`)."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hps.serving.connections.guarded import GuardedProtocol

__all__ = ["DeadlineHttpToolsProtocol"]


class DeadlineHttpToolsProtocol(GuardedProtocol, HttpToolsProtocol):
    """uvicorn's httptools protocol with the receipt deadlines and the connection bound of
    ``limits`` (:class:`~hps.serving.connections.guarded.GuardedProtocol`)."""
