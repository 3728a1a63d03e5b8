"""The known clients of one model's batcher (:mod:`hps.serving.batcher`): how many requests
the clients that are still sending can have in flight at once, so that a batch waiting for a
``preferred_batch_size`` closes as soon as no more requests can come.

A client (a connection: HTTP's ``(host, port)``, gRPC's ``context.peer()``) is known while it
has a request in flight, and for :data:`KNOWN_CLIENT_NS` after it last sent a request or got
an answer; a connection that closes (:meth:`KnownClients.forget`) is forgotten as soon as
nothing of it is in flight. Each known client counts as its *peak*: the most requests it had
in flight at once over the last one to two windows of :data:`KNOWN_CLIENT_NS` (a windowed
maximum, so a past burst stops counting once the client sends one request at a time)::

    client a: burst of 4, then 1 at a time      peak 4 … 4, then 1 after at most 2 s
    client b: answered, its connection closed   forgotten at once (nothing in flight)
    client c: answered, silent for > 1 s        forgotten at the next sweep
    client d: closed while its request was read counted only while that request is in flight

Costs: :meth:`KnownClients.capacity` is O(1) (the sum of peaks is kept up to date); every
:data:`SWEEP_NS` one call sweeps the map (O(known clients)): peaks decay, silent clients are
forgotten. Past :data:`MAX_KNOWN_CLIENTS` clients, a new one makes the least recently
active one with nothing in flight forgotten, and closed connections are remembered for
:data:`KNOWN_CLIENT_NS` (at most as many), so memory does not grow with the connections
served.
Not thread-safe: the batcher calls it with its lock held; times are the caller's clock (ns).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["KNOWN_CLIENT_NS", "MAX_KNOWN_CLIENTS", "SWEEP_NS", "KnownClients"]

#: A client that sent nothing and got no answer for this long is no longer waited for; also
#: the window of each client's peak in-flight count.
KNOWN_CLIENT_NS = 1_000_000_000
#: How often the map is swept for silent clients and decayed peaks.
SWEEP_NS = 100_000_000
#: Most clients remembered: past it a new client makes the least recently active one with
#: nothing in flight forgotten (those with requests in flight are bounded by the server's own
#: request limits).
MAX_KNOWN_CLIENTS = 4096


@dataclass
class _Client:
    in_flight: int = 0
    last_ns: int = 0  # when it last sent a request or got an answer
    window_ns: int = 0  # start of the current peak window
    cur: int = 0  # most in flight at once in the current window
    prev: int = 0  # … in the previous window
    closed: bool = False  # its connection closed: forget it once nothing is in flight

    @property
    def peak(self) -> int:
        return max(self.cur, self.prev)


class KnownClients:
    """The clients a batcher waits for, and how many requests they can send at once."""

    def __init__(self) -> None:
        # insertion order is recency order: each touch moves a client to the end
        self._clients: dict[Hashable, _Client] = {}
        self._total = 0  # Σ peak over the map
        self._swept_ns: int | None = None
        # closed connections → when they closed (oldest first): a request announced before
        # its connection closed and submitted after does not make it known again (kept for
        # KNOWN_CLIENT_NS, at most MAX_KNOWN_CLIENTS)
        self._closed: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._clients)

    def sent(self, client: Hashable, now: int) -> None:
        """``client`` sent a request at ``now`` (it is in flight until :meth:`answered`). A
        client whose connection closed (:meth:`forget`) counts only while this request is
        in flight."""
        self.sweep(now)
        c = self._clients.pop(client, None)
        if c is None:
            c = _Client(window_ns=now, closed=client in self._closed)
            self._bound_idle()
        self._clients[client] = c
        self._roll(c, now)
        c.in_flight += 1
        c.last_ns = now
        self._set_cur(c, max(c.cur, c.in_flight))

    def answered(self, client: Hashable, now: int) -> None:
        """A request of ``client`` was answered (or failed) at ``now``."""
        c = self._clients.pop(client, None)
        if c is None:
            return
        self._clients[client] = c  # the most recently active
        c.in_flight -= 1
        c.last_ns = now
        if c.closed and not c.in_flight:
            self._drop(client)

    def forget(self, client: Hashable, now: int) -> None:
        """``client``'s connection closed at ``now``: it sends no more (kept only while it
        has requests in flight, which it can no longer add to; a request it announced
        before closing and that is submitted after counts only while in flight)."""
        self._closed.pop(client, None)
        if len(self._closed) >= MAX_KNOWN_CLIENTS:
            del self._closed[next(iter(self._closed))]
        self._closed[client] = now
        c = self._clients.get(client)
        if c is None:
            return
        if c.in_flight:
            c.closed = True
        else:
            self._drop(client)

    def capacity(self, now: int) -> int:
        """How many requests the known clients can have in flight at once: the sum of their
        peaks (exact as of the last sweep, at most :data:`SWEEP_NS` ago)."""
        self.sweep(now)
        return self._total

    def sweep(self, now: int) -> None:
        """Forget the clients silent for :data:`KNOWN_CLIENT_NS` (and the closed connections
        closed as long ago) and decay the peaks, if the last sweep is :data:`SWEEP_NS` old
        (else nothing: O(1))."""
        if self._swept_ns is not None and now - self._swept_ns < SWEEP_NS:
            return
        self._swept_ns = now
        oldest = now - KNOWN_CLIENT_NS
        for k, c in list(self._clients.items()):
            if not c.in_flight and c.last_ns < oldest:
                del self._clients[k]
            else:
                self._roll(c, now)
        self._total = sum(c.peak for c in self._clients.values())
        while self._closed and next(iter(self._closed.values())) < oldest:
            del self._closed[next(iter(self._closed))]  # the oldest close first: O(expired)

    # ------------------------------------------------------------------------------ internals
    def _set_cur(self, c: _Client, cur: int) -> None:
        before = c.peak
        c.cur = cur
        self._total += c.peak - before

    def _roll(self, c: _Client, now: int) -> None:
        """Start a new peak window if the current one is over (the windowed maximum)."""
        age = now - c.window_ns
        if age < KNOWN_CLIENT_NS:
            return
        before = c.peak
        c.prev = c.cur if age < 2 * KNOWN_CLIENT_NS else c.in_flight
        c.cur = c.in_flight
        c.window_ns = now
        self._total += c.peak - before

    def _drop(self, client: Hashable) -> None:
        self._total -= self._clients.pop(client).peak

    def _bound_idle(self) -> None:
        """Make room for one more client: forget the least recently active idle ones."""
        if len(self._clients) < MAX_KNOWN_CLIENTS:
            return
        idle = next((k for k, c in self._clients.items() if not c.in_flight), None)
        if idle is not None:  # the front of the map: O(1) unless many are in flight
            self._drop(idle)
