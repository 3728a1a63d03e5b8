"""uvicorn's h11 protocol (pure Python, always installed) under a :class:`ConnectionGuard`."""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

from hps.serving.connections.guarded import GuardedProtocol

__all__ = ["DeadlineH11Protocol"]


class DeadlineH11Protocol(GuardedProtocol, H11Protocol):
    """uvicorn's h11 protocol with the receipt deadlines and the connection bound of
    ``limits`` (:class:`~hps.serving.connections.guarded.GuardedProtocol`)."""
