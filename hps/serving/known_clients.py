"""The known clients of one model's batcher (:mod:`hps.serving.batcher`): how many requests
the clients that are still sending can have in flight at once, so that a batch waiting to
grow to its preferred size closes as soon as no more requests can come.

A client is a connection (HTTP's ``(host, port)``, gRPC's ``context.peer()``). It is *known*
once it has **come back**: sent a second request on the same connection (a later one, or one
while the first is in flight). A client that has sent one request is only remembered, never
waited for, so a client that opens a connection per request (curl in a loop, a gRPC channel
per call: grpcio tells the server nothing when a channel closes) never makes a batch wait,
and a lone client never does either (its request is every request it can send). A known
client stays known while it has a request in flight and for :data:`KNOWN_CLIENT_NS` after it
last sent a request or got an answer; a connection that closes (:meth:`KnownClients.forget`)
is forgotten as soon as nothing of it is in flight, and counts only its requests in flight
until then. Each other known client counts as its *peak*: the most requests it had in flight
at once over the last one to two windows of :data:`KNOWN_CLIENT_NS` (a windowed maximum, so a
past burst stops counting once the client sends one request at a time). The sum of the peaks is capped by the most requests all
clients had in flight at once over the same windows: one client that switches connections
(grpcio's channels share connections in a process, so a channel per call reuses some and
opens others) leaves several known connections of which only one ever sends::

    client a: one request, then a new connection   remembered, never counted
    client b: burst of 4, then 1 at a time         known from its 2nd request: peak 4 … 4,
                                                   then 1 after at most 2 s
    client c: came back, then its connection closed  forgotten at once (nothing in flight;
                                                   else counts what is, until answered)
    client d: came back, then silent for > 1 s      forgotten at the next sweep
    client e: came back on connections 1 and 2,    capacity 1 (never 2 in flight at once):
              one at a time, now on connection 3   its request on 3 closes its batch

Costs: :meth:`KnownClients.capacity` is O(1) (the sum of the known clients' peaks is kept up
to date); every :data:`SWEEP_NS` one call sweeps: the known clients' peaks decay and silent
ones are forgotten (O(known clients)); the clients seen once are kept in recency order, so
the silent ones are forgotten from the front (O(forgotten)). Each of the two maps holds at
most :data:`MAX_KNOWN_CLIENTS` clients: past it a new one makes the least recently active one
of its map with nothing in flight forgotten, so memory does not grow with the connections
served, and a flood of one-request connections never pushes a known client out.
Not thread-safe: the batcher calls it with its lock held; times are the caller's clock (ns).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["KNOWN_CLIENT_NS", "MAX_KNOWN_CLIENTS", "SWEEP_NS", "KnownClients"]

#: A client that sent nothing and got no answer for this long is no longer waited for (nor
#: remembered); also the window of each client's peak in-flight count.
KNOWN_CLIENT_NS = 1_000_000_000
#: How often the maps are swept for silent clients and decayed peaks.
SWEEP_NS = 100_000_000
#: Most clients of each map (known; seen once): past it a new client makes the least
#: recently active one with nothing in flight forgotten (those with requests in flight are
#: bounded by the server's own request limits).
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
        # insertion order is recency order in both maps: each touch moves a client to the end
        self._known: dict[Hashable, _Client] = {}  # came back: counted
        self._once: dict[Hashable, _Client] = {}  # sent one request: remembered only
        self._total = 0  # Σ peak over the known clients
        self._all = _Client()  # every remembered client's requests together: their peak
        self._swept_ns: int | None = None

    def __len__(self) -> int:
        """How many clients are known (came back)."""
        return len(self._known)

    @property
    def remembered(self) -> int:
        """How many clients are remembered, known or seen once: at most
        :data:`MAX_KNOWN_CLIENTS` of each map, plus those with requests in flight that a full
        map cannot forget (bounded by the server's limits on requests in flight)."""
        return len(self._known) + len(self._once)

    def sent(self, client: Hashable, now: int) -> None:
        """``client`` sent a request at ``now`` (it is in flight until :meth:`answered`). Its
        second request makes it known, unless its connection closed."""
        self.sweep(now)
        c, clients = self._find(client)
        if c is None:  # its first request: remember it
            c, clients = _Client(window_ns=now), self._once
            self._make_room(self._once)
        elif clients is self._once and not c.closed:  # it came back: count it from now on
            del self._once[client]
            clients = self._known
            self._make_room(self._known)
            self._total += c.peak
        else:
            del clients[client]
        clients[client] = c  # the most recently active
        counted = clients is self._known
        self._roll(c, now, counted)
        before = c.peak
        c.in_flight += 1
        c.last_ns = now
        c.cur = max(c.cur, c.in_flight)
        if counted:
            self._total += c.peak - before
        self._roll(self._all, now, False)
        self._all.in_flight += 1
        self._all.cur = max(self._all.cur, self._all.in_flight)

    def answered(self, client: Hashable, now: int) -> None:
        """A request of ``client`` was answered (or failed) at ``now``."""
        c, clients = self._find(client)
        if c is None:
            return
        del clients[client]
        clients[client] = c  # the most recently active
        c.in_flight -= 1
        c.last_ns = now
        self._all.in_flight -= 1
        if c.closed:
            if c.in_flight:
                self._lower_to_in_flight(c, clients)
            else:
                self._drop(clients, client)

    def forget(self, client: Hashable, now: int) -> None:
        """``client``'s connection closed at ``now``: it sends no more. It is kept only while
        it has requests in flight (which it can no longer add to; one submitted after the
        close, announced before it, counts only while in flight)."""
        c, clients = self._find(client)
        if c is None:
            return
        if c.in_flight:
            c.closed = True
            self._lower_to_in_flight(c, clients)
        else:
            self._drop(clients, client)

    def open(self, client: Hashable) -> bool:
        """Whether ``client`` is known and its connection open: each of its answered requests
        may be followed by another (a closed-loop caller on it sends again)."""
        c = self._known.get(client)
        return c is not None and not c.closed

    def capacity(self, now: int) -> int:
        """How many requests the known clients can have in flight at once: the sum of their
        peaks, but no more than the most requests every client had in flight at once over
        the same windows (one client that switches connections, as grpcio's channels do,
        leaves several known connections of which only one sends; exact as of the last
        sweep, at most :data:`SWEEP_NS` ago)."""
        self.sweep(now)
        return min(self._total, self._all.peak)

    def sweep(self, now: int) -> None:
        """Forget the clients silent for :data:`KNOWN_CLIENT_NS` and decay the peaks, if the
        last sweep is :data:`SWEEP_NS` old (else nothing: O(1))."""
        if self._swept_ns is not None and now - self._swept_ns < SWEEP_NS:
            return
        self._swept_ns = now
        oldest = now - KNOWN_CLIENT_NS
        for k, c in list(self._known.items()):
            if not c.in_flight and c.last_ns < oldest:
                del self._known[k]
            else:
                self._roll(c, now, False)
        self._total = sum(c.peak for c in self._known.values())
        self._roll(self._all, now, False)
        # recency order: the silent ones are at the front, so the walk stops at the first
        # active one (one with a request in flight for longer than KNOWN_CLIENT_NS is passed
        # over and stays): O(forgotten + such long-running ones)
        silent = []
        for k, c in self._once.items():
            if c.last_ns >= oldest:
                break
            if not c.in_flight:
                silent.append(k)
        for k in silent:
            del self._once[k]

    # ------------------------------------------------------------------------------ internals
    def _find(self, client: Hashable) -> tuple[_Client | None, dict[Hashable, _Client]]:
        """``client``'s record and the map that holds it (``None``: not remembered)."""
        c = self._known.get(client)
        if c is not None:
            return c, self._known
        return self._once.get(client), self._once

    def _roll(self, c: _Client, now: int, counted: bool) -> None:
        """Start a new peak window if the current one is over (the windowed maximum); keep
        the running sum if ``c`` is counted in it."""
        age = now - c.window_ns
        if age < KNOWN_CLIENT_NS:
            return
        before = c.peak
        c.prev = c.cur if age < 2 * KNOWN_CLIENT_NS else c.in_flight
        c.cur = c.in_flight
        c.window_ns = now
        if counted:
            self._total += c.peak - before

    def _lower_to_in_flight(self, c: _Client, clients: dict[Hashable, _Client]) -> None:
        """A closed connection can send no more: it counts only the requests it still has in
        flight, not its past peak."""
        before = c.peak
        c.cur = c.prev = c.in_flight
        if clients is self._known:
            self._total += c.peak - before

    def _drop(self, clients: dict[Hashable, _Client], client: Hashable) -> None:
        c = clients.pop(client)  # idle: nothing of it is in flight
        if clients is self._known:
            self._total -= c.peak

    def _make_room(self, clients: dict[Hashable, _Client]) -> None:
        """Make room for one more client in ``clients``: forget its least recently active
        idle one."""
        if len(clients) < MAX_KNOWN_CLIENTS:
            return
        idle = next((k for k, c in clients.items() if not c.in_flight), None)
        if idle is not None:  # the front of the map: O(1) unless many are in flight
            self._drop(clients, idle)
