"""The known clients (:mod:`hps.serving.known_clients`) that a batch smaller than its preferred
size waits for (at most the delay): bounded, forgotten when silent or when their HTTP
connection closes, peaks that decay, a closed connection that counts only its requests in
flight; and a cancelled request that does not stop its batcher. Batcher-level tests run on a
fake servable and an injected clock that only the test moves (a batch that would wait for the
delay waits for ever, so a result that arrives proves no wait); one test serves the tiny
model over loopback HTTP and gRPC."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th

from hps.parameter_server import HierarchicalParameterServer
from hps.serving import known_clients
from hps.serving.batcher import BatchingConfig, DynamicBatcher
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.serving.known_clients import KNOWN_CLIENT_NS, KnownClients
from hps.serving.statistics import ModelCounts
from tests.hps.serving.test_batching import grpc_inputs
from tests.hps.serving.tiny_dlrm import make_request, triton_inputs

RESULT_S = 30  # a request that waits for a delay the fake clock never reaches times out


class FakeServable:
    """Echoes ``dense[:, 0]``; fails merged executions if ``fail_merged``; blocks while
    ``gate`` is clear."""

    name = "fake"
    id_inputs: tuple[str, ...] = ()
    max_batch_size = 1024

    def __init__(self, fail_merged: bool = False) -> None:
        self.fail_merged = fail_merged
        self.gate = threading.Event()
        self.gate.set()
        self.sizes: list[int] = []

    def infer(self, x):
        self.gate.wait(RESULT_S)
        n = x["dense"].shape[0]
        self.sizes.append(n)
        if self.fail_merged and n > 1:
            raise RuntimeError("merged execution fails")
        return {"logits": x["dense"][:, 0].copy()}


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def until(condition: Callable[[], bool]) -> None:
    """Wait (at most ``RESULT_S``) until ``condition()`` holds."""
    for _ in range(RESULT_S * 1000):
        if condition():
            return
        threading.Event().wait(0.001)
    raise AssertionError(f"{condition} never held")


def req(n: int = 1, value: float = 1.0):
    return {"dense": np.full((n, 4), value, np.float32)}


def batcher(cfg: BatchingConfig, servable: FakeServable | None = None, clock=None):
    return DynamicBatcher(servable or FakeServable(), cfg, ModelCounts(), clock=clock or Clock())


def test_known_clients_do_not_grow_with_the_connections_served(monkeypatch) -> None:
    """Connections that send one request each, and connections that come back once, whose
    batches fill up (never asking who is known): both maps stay bounded, and empty once the
    clients are silent."""
    monkeypatch.setattr(known_clients, "MAX_KNOWN_CLIENTS", 16)
    clock = Clock()
    b = batcher(BatchingConfig(4, 1000, preferred_batch_size=4), clock=clock)
    try:
        for port in range(100):  # full batches: preferred size reached
            for _ in range(1 + port % 2):  # odd ports come back: known
                b.submit(req(4), client=("10.0.0.1", port)).result(RESULT_S)
                clock.ns += 1000
        assert b.known_clients == 16 and 16 < b.remembered_clients <= 32
        clock.ns += KNOWN_CLIENT_NS + 1
        b.submit(req(4), client=None).result(RESULT_S)
        assert b.remembered_clients == 0
    finally:
        b.close()


def test_a_client_counts_from_its_second_request_as_its_decaying_peak() -> None:
    """A connection's first request is not counted; a burst of 4 in flight on it counts as 4
    for the current window and the next, then as 1 (the peak decays while it stays active);
    a closed connection counts no more once its requests are answered, one that sent once
    never."""
    k, t = KnownClients(), 0
    k.sent("ch", t)
    assert k.capacity(t) == 0 and len(k) == 0  # seen once: remembered, not counted
    for _ in range(3):
        k.sent("ch", t)
    assert k.capacity(t) == 4 and len(k) == 1
    for _ in range(4):
        k.answered("ch", t)
    caps = []
    while t < 3 * KNOWN_CLIENT_NS:
        t += KNOWN_CLIENT_NS // 10
        k.sent("ch", t)
        caps.append((t, k.capacity(t)))
        k.answered("ch", t)
    assert all(c == 4 for s, c in caps if s < KNOWN_CLIENT_NS)
    assert all(c == 1 for s, c in caps if s >= 2.5 * KNOWN_CLIENT_NS)
    k.sent("once", t)
    assert k.capacity(t) == 1
    k.sent("other", t)
    k.answered("other", t)
    k.sent("other", t)  # came back
    k.forget("other", t)  # closed with a request in flight: still counted until answered
    assert k.capacity(t) == 2
    k.answered("other", t)
    assert k.capacity(t) == 1 and len(k) == 1


def test_a_closed_connection_counts_only_its_requests_in_flight() -> None:
    """A known client with a peak of 4 whose connection closes with 2 requests in flight
    counts as 2, then 1 as they are answered, not as its past peak 4."""
    k, t = KnownClients(), 0
    for _ in range(4):
        k.sent("burst", t)
    k.sent("other", t)
    k.answered("other", t)
    k.sent("other", t)  # came back: peak 1
    assert k.capacity(t) == 4 + 1
    k.answered("burst", t)
    k.answered("burst", t)  # 2 of 4 in flight
    k.forget("burst", t)
    assert k.capacity(t) == 2 + 1
    k.answered("burst", t)
    assert k.capacity(t) == 1 + 1
    k.answered("burst", t)
    assert k.capacity(t) == 1 and len(k) == 1


def test_a_client_is_open_when_known_and_its_connection_is() -> None:
    """``open``: known (came back) and its connection open, whatever it has in flight (a
    connection may carry several callers). A client seen once, a closed one and one never
    seen are not."""
    k, t = KnownClients(), 0
    k.sent("a", t)
    k.answered("a", t)
    assert not k.open("a")  # seen once
    k.sent("a", t)
    assert k.open("a")  # known, in flight
    k.answered("a", t)
    assert k.open("a")
    k.sent("a", t)
    k.forget("a", t)  # closed with a request in flight
    assert not k.open("a")
    k.answered("a", t)
    assert not k.open("a") and not k.open("never")


def test_a_request_submitted_after_its_connection_closed_is_a_new_client() -> None:
    """The HTTP server announces a request, the connection closes while its body is parsed
    (the client, known, is forgotten), then the request is submitted: it is the first request
    of a new client, never counted, so a lone live client still does not wait."""
    k, t = KnownClients(), 10**12
    for _ in range(2):  # both at once, twice
        for name in ("live", "gone"):
            k.sent(name, t)
        for name in ("live", "gone"):
            k.answered(name, t)
    assert k.capacity(t) == 2
    k.forget("gone", t)
    k.sent("gone", t)
    assert k.capacity(t) == 1
    k.answered("gone", t)
    assert k.capacity(t + 1) == 1 and len(k) == 1 and k.remembered == 2


def test_the_least_recently_active_idle_client_is_forgotten_first(monkeypatch) -> None:
    """An answer makes its client the most recently active: past ``MAX_KNOWN_CLIENTS`` known
    clients, the one idle since longest is forgotten, not the one whose long request just
    ended; a flood of clients that send once never pushes a known one out."""
    monkeypatch.setattr(known_clients, "MAX_KNOWN_CLIENTS", 2)
    k, t = KnownClients(), 0
    k.sent("slow", t)
    k.sent("slow", t)  # two long requests: known, peak 2
    for dt in (1, 2):
        k.sent("quick", t + dt)
        k.answered("quick", t + dt)
    k.answered("slow", t + 3)
    k.answered("slow", t + 3)
    for port in range(100):
        k.sent(port, t + 4)
        k.answered(port, t + 4)
    assert k.capacity(t + 4) == 2 + 1 and k.remembered == 4
    k.sent("new", t + 5)
    k.sent("new", t + 5)  # came back: the known map is full, "quick" is forgotten
    assert len(k) == 2 and k.capacity(t + 5) == 3  # 2 + 2, capped: never 4 in flight at once
    k.sent("slow", t + 6)
    k.sent("slow", t + 6)
    assert k.capacity(t + 6) == 2 + 2


def test_a_sequential_client_with_a_new_connection_per_request_never_waits() -> None:
    """The event sequences of curl in a loop (request, answer, connection closed, next request
    on a new port) and of a gRPC client with a channel per call (the same, but the server is
    never told of the close). With a 1 s delay and a clock that never reaches it, each request
    runs at once, also when the client's earlier connections came back (grpcio reuses a
    closed channel's connection) and are still known: they never had two requests in flight
    at once. A request of a new connection while two clients that came back and sent at once
    are still known waits until one of their closes is seen."""
    b = batcher(BatchingConfig(64, 10**6))
    try:
        for port in range(4):
            client = ("127.0.0.1", 40000 + port)
            assert b.submit(req(), client=client).result(RESULT_S).batch_size == 1
            b.forget(client)
        assert b.remembered_clients == 0
        for port in range(4):  # never forgotten: a channel's close is not seen
            peer = f"ipv4:127.0.0.1:{41000 + port}"
            assert b.submit(req(), client=peer).result(RESULT_S).batch_size == 1
        assert b.known_clients == 0 and b.remembered_clients == 4
        for port in range(3):  # reused connections: known, one at a time
            for _ in range(2):
                peer = f"ipv4:127.0.0.1:{42000 + port}"
                assert b.submit(req(), client=peer).result(RESULT_S).batch_size == 1
        assert b.known_clients == 3
        assert b.submit(req(), client="ipv4:127.0.0.1:43000").result(RESULT_S).batch_size == 1

    finally:
        b.close()
    b = batcher(BatchingConfig(64, 10**6))
    try:
        old = [("127.0.0.1", 50000), ("127.0.0.1", 50001)]
        for _ in range(2):  # both come back, with requests in flight at once
            with b.arrival():  # holds their batch until both are queued
                pair = [b.submit(req(), client=c) for c in old]
            assert [f.result(RESULT_S).batch_size for f in pair] == [2, 2]
        waiting = b.submit(req(), client=("127.0.0.1", 50002))  # `old` may still send
        until(lambda: b.batch_waiting)
        assert not waiting.done()
        b.forget(old[0])
        assert waiting.result(RESULT_S).batch_size == 1
    finally:
        b.close()


def test_a_failed_merged_execution_releases_each_clients_requests() -> None:
    """A merged execution of clients a and b fails, each request runs again alone: both are
    answered, and nothing stays in flight (closing their connections forgets them)."""
    servable = FakeServable(fail_merged=True)
    servable.gate.clear()
    b = batcher(BatchingConfig(64, 10**6, preferred_batch_size=2), servable)
    try:
        # c's request runs alone (c is the only known client) and holds the inference
        # thread at the gate while a's and b's queue: they form the next batch together
        fc = b.submit(req(value=0.0), client="c")
        until(fc.running)
        fa = b.submit(req(value=1.0), client="a")
        fb = b.submit(req(value=2.0), client="b")
        servable.gate.set()
        got = [float(f.result(RESULT_S).outputs["logits"][0]) for f in (fc, fa, fb)]
        assert servable.sizes == [1, 2, 1, 1]  # c; a and b merged, failed, each alone
        for client in "abc":
            b.forget(client)
        assert b.remembered_clients == 0
    finally:
        b.close()
    assert got == [0.0, 1.0, 2.0]


def test_a_cancelled_request_is_skipped_and_the_batcher_keeps_serving() -> None:
    servable = FakeServable()
    servable.gate.clear()
    b = batcher(BatchingConfig(64, 0, preferred_batch_size=8), servable)
    try:
        running = b.submit(req(value=1.0), client="a")
        while not servable.sizes and not running.running():
            threading.Event().wait(0.001)  # until the inference thread took it
        queued = b.submit(req(value=2.0), client="b")
        assert queued.cancel()
        servable.gate.set()
        assert float(running.result(RESULT_S).outputs["logits"][0]) == 1.0
        later = b.submit(req(value=3.0), client="a")
        assert float(later.result(RESULT_S).outputs["logits"][0]) == 3.0
    finally:
        b.close()
    assert servable.sizes == [1, 1]  # the cancelled request never ran


@pytest.fixture(scope="module")
def served(tiny_artifacts: Path) -> Iterator[InferenceServer]:
    """HTTP and gRPC, preferred batches of 8 that may wait 1 s."""
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    cfg = ServerConfig(port=0, grpc_port=0, max_queue_delay_us=10**6, preferred_batch_size=8)
    srv = InferenceServer(ps, cfg).start()
    try:
        yield srv
    finally:
        srv.stop()
        ps.close()


def _spy_arrivals(monkeypatch, b) -> list[object]:
    """The clients a server hands ``b.arrival``, in order, from now on."""
    seen: list[object] = []
    real = b.arrival

    def spy(client=None):
        seen.append(client)
        return real(client)

    monkeypatch.setattr(b, "arrival", spy)
    return seen


def test_servers_name_each_connection_and_forget_closed_http_ones(
    served, tiny, monkeypatch
) -> None:
    """HTTP hands the batcher each connection's (host, port), gRPC ``context.peer()``. A
    sequential HTTP client on a new connection per request never waits for the 1 s delay
    (a request that waited it shows queue ≥ 1 s), and its closed connections are forgotten."""
    b = served.batchers["tiny"]
    seen = _spy_arrivals(monkeypatch, b)
    counts = served.counts["tiny"]
    r = make_request(tiny, 2, seed=90)
    queue_ns = []
    for _ in range(3):
        before = counts.phase_ns.queue
        c = th.InferenceServerClient(served.address)
        c.infer("tiny", triton_inputs(r))
        c.close()
        queue_ns.append(counts.phase_ns.queue - before)
    assert all(q < 10**9 for q in queue_ns), queue_ns
    assert all(
        isinstance(p, tuple) and p[0] == "127.0.0.1" and isinstance(p[1], int) for p in seen
    ), seen
    assert len(set(seen)) == 3  # a new connection each
    for _ in range(100):  # the last close reaches the server's event loop
        if b.remembered_clients == 0:
            break
        threading.Event().wait(0.05)
    assert b.remembered_clients == 0

    seen.clear()
    g = tg.InferenceServerClient(str(served.grpc_address))
    for _ in range(2):
        g.infer("tiny", grpc_inputs(r))
    g.close()
    assert len(seen) == 2 and seen[0] == seen[1], seen
    assert isinstance(seen[0], str) and seen[0].startswith("ipv4:127.0.0.1:"), seen


def test_a_sequential_grpc_client_with_a_channel_per_request_never_waits(
    served, tiny, monkeypatch
) -> None:
    """A gRPC client that opens a channel per call (the server is never told it closed;
    grpcio may reuse a closed channel's connection, which then comes back): no request waits
    for the 1 s delay (a request that waited it shows queue ≥ 1 s), each is its own
    execution, since no two of its connections ever had requests in flight at once. Its
    connections stay remembered (the server never learns a channel closed; the module's
    earlier clients may or may not have been swept by then, so the count is a lower bound)."""
    b, counts = served.batchers["tiny"], served.counts["tiny"]
    peers = _spy_arrivals(monkeypatch, b)
    r = make_request(tiny, 2, seed=91)
    queue_ns, executions = [], counts.executions
    for _ in range(4):
        before = counts.phase_ns.queue
        g = tg.InferenceServerClient(str(served.grpc_address))
        g.infer("tiny", grpc_inputs(r))
        g.close()
        queue_ns.append(counts.phase_ns.queue - before)
    assert all(q < 10**9 for q in queue_ns), queue_ns
    assert counts.executions - executions == 4
    assert len(peers) == 4 and 1 <= len(set(peers)) <= 4, peers
    assert b.remembered_clients >= len(set(peers))
