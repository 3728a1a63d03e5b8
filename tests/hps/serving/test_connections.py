"""Connection handling (:mod:`hps.serving.connections`): stalled sockets are closed at their
receipt deadline and do not count against the requests being processed; open connections are
bounded on their own — with the httptools parser and with h11; the parser and event loop
chosen (auto: httptools on uvloop) and their logged fallback; the knobs are validated."""

from __future__ import annotations

import http.client
import json
import math
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.connections import EventLoop, HttpParser
from hps.serving.http_server import InferenceServer, ServerConfig
from tests.hps.serving.tiny_dlrm import (
    eager_logits,
    make_request,
    tiny_model,
    triton_inputs,
    write_artifacts,
)
from tests.tolerances import tol

HANG_S = 30.0  # a socket still open this long after its deadline: the server never closed it
# the limits hold whichever parser reads the requests (the serve extra installs httptools)
PARSERS = pytest.mark.parametrize("parser", [HttpParser.HTTPTOOLS, HttpParser.H11])
INFER_HEAD = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n"


@pytest.fixture(scope="module")
def model() -> DLRM:
    return tiny_model()


@pytest.fixture(scope="module")
def ps(model: DLRM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    art = write_artifacts(model, tmp_path_factory.mktemp("serving"))
    p = HierarchicalParameterServer.from_config(Path(art) / "ps.json")
    try:
        yield p
    finally:
        p.close()


def _connect(srv: InferenceServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=HANG_S)


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (EOF or reset), without waiting; any bytes it sent
    before closing are read and dropped."""
    try:
        while select.select([s], [], [], 0)[0]:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def _trickle_until_closed(
    s: socket.socket, since: float, data: bytes = b"", every_s: float = 0.1
) -> float:
    """Send ``data`` one byte every ``every_s`` (nothing when empty) until the server closes
    ``s``; the seconds from ``since`` (a ``time.monotonic()``) to then. Fails if it stays open
    ``HANG_S``."""
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < HANG_S:
        if _closed_by_server(s):
            return time.monotonic() - since
        if sent < len(data):
            try:
                s.sendall(data[sent : sent + 1])
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - since
            sent += 1
        time.sleep(every_s)
    pytest.fail(f"the server left a stalled connection open for {HANG_S} s")


def _infer(srv: InferenceServer, model: DLRM, seed: int) -> None:
    """One request through tritonclient; its scores must be the eager model's."""
    req = make_request(model, 3, seed=seed)
    got = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
    np.testing.assert_allclose(got.as_numpy("logits"), eager_logits(model, req), **tol("served"))


@PARSERS
def test_idle_and_trickled_headers_are_closed_at_the_header_deadline(ps, parser) -> None:
    cfg = ServerConfig(port=0, header_timeout_s=0.5, body_timeout_s=HANG_S, http=parser)
    with InferenceServer(ps, cfg) as srv:
        t0 = time.monotonic()
        with _connect(srv) as idle, _connect(srv) as slow:
            slow.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n")
            # every byte would reset uvicorn's keep-alive timer; the deadline is absolute
            assert 0.5 <= _trickle_until_closed(slow, t0, b"X-Slow: " + b"a" * 1000) < HANG_S
            assert 0.5 <= _trickle_until_closed(idle, t0) < HANG_S


@PARSERS
def test_a_trickled_body_is_closed_at_the_body_deadline_and_fails_nothing(
    ps, model, parser
) -> None:
    cfg = ServerConfig(port=0, header_timeout_s=HANG_S, body_timeout_s=0.6, http=parser)
    with InferenceServer(ps, cfg) as srv:
        with _connect(srv) as s:
            s.sendall(INFER_HEAD)
            took = _trickle_until_closed(s, time.monotonic(), b'{"inputs": [' + b" " * 1000)
        assert 0.6 <= took < HANG_S  # the body deadline replaced the (longer) header deadline
        _infer(srv, model, seed=1)
        stats = th.InferenceServerClient(srv.address).get_inference_statistics("tiny")
        counts = stats["model_stats"][0]["inference_stats"]
        assert (counts["success"]["count"], counts["fail"]["count"]) == (1, 0)


def test_each_request_on_a_kept_alive_connection_gets_a_fresh_deadline(ps) -> None:
    cfg = ServerConfig(port=0, header_timeout_s=2.0, body_timeout_s=2.0)
    with InferenceServer(ps, cfg) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=HANG_S)
        for _ in range(6):  # 3 s on one connection, each request well within its 2 s
            conn.request("GET", "/v2/health/live")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
            answered = time.monotonic()
            time.sleep(0.5)
        assert conn.sock is not None
        assert 1.0 <= _trickle_until_closed(conn.sock, answered) < HANG_S
        conn.close()


def test_a_request_running_past_the_deadlines_is_answered(ps, model, monkeypatch) -> None:
    cfg = ServerConfig(port=0, header_timeout_s=0.3, body_timeout_s=0.3)
    with InferenceServer(ps, cfg) as srv:
        servable = srv.servables["tiny"]
        infer = servable.infer

        def slow_infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            time.sleep(1.0)
            return infer(inputs)

        monkeypatch.setattr(servable, "infer", slow_infer)
        _infer(srv, model, seed=2)


@PARSERS
def test_connections_past_max_connections_get_503_and_are_closed(ps, model, parser) -> None:
    cfg = ServerConfig(port=0, max_connections=4, http=parser)
    with InferenceServer(ps, cfg) as srv:
        held = [_connect(srv) for _ in range(4)]
        with _connect(srv) as extra:
            reply = b""
            while chunk := extra.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), reply
        assert "limit of 4 open connections (--max-connections)" in json.loads(body)["error"]
        for s in held:
            s.close()
        deadline = time.monotonic() + HANG_S
        while True:  # the server sees the four closes
            try:
                _infer(srv, model, seed=3)
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, "still refused after the connections closed"
                time.sleep(0.1)


@PARSERS
def test_stalled_sockets_do_not_count_as_requests(ps, model, monkeypatch, parser) -> None:
    """workers + max_queued = 1: twenty idle sockets leave room for a request; a request
    waiting for the busy worker is refused with a JSON 503 naming the limits."""
    cfg = ServerConfig(port=0, workers=1, max_queued=0, http=parser)
    with InferenceServer(ps, cfg) as srv:
        idle = [_connect(srv) for _ in range(20)]
        _infer(srv, model, seed=4)
        servable = srv.servables["tiny"]
        infer, entered, release = servable.infer, threading.Event(), threading.Event()

        def blocked_infer(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            entered.set()
            assert release.wait(HANG_S)
            return infer(inputs)

        monkeypatch.setattr(servable, "infer", blocked_infer)
        first = threading.Thread(target=_infer, args=(srv, model, 5))
        first.start()
        try:
            assert entered.wait(HANG_S)
            with pytest.raises(InferenceServerException) as e:
                _infer(srv, model, seed=6)
            assert e.value.status() == "503"
            assert (
                "server busy: all 1 request slots are taken (--workers 1 + --max-queued 0)"
                in str(e.value)
            )
        finally:
            release.set()
            first.join(HANG_S)
        for s in idle:
            s.close()


@pytest.mark.parametrize(
    "knob,value,match",
    [
        ("workers", 10**6, "workers must be an integer from 1 to 256, got 1000000"),
        ("workers", 0, "workers must be an integer from 1 to 256, got 0"),
        ("max_queued", 65537, "max_queued must be an integer from 0 to 65536"),
        ("ort_threads", 1000, "ort_threads must be an integer from 0 to 256"),
        ("ort_parallel_min_macs", -1, "ort_parallel_min_macs must be an integer from 0 to "),
        ("max_connections", 0, "max_connections must be an integer from 1 to 65536, got 0"),
        ("max_connections", True, "max_connections must be an integer from 1 to 65536"),
        ("header_timeout_s", 0.0, "header_timeout_s must be a finite number of seconds > 0"),
        ("header_timeout_s", math.inf, "header_timeout_s must be a finite number of seconds"),
        ("body_timeout_s", math.nan, "body_timeout_s must be a finite number of seconds > 0"),
        ("body_timeout_s", "60", "body_timeout_s must be a finite number of seconds > 0, got '60'"),
        ("http", "h2", r"http must be one of \['auto', 'httptools', 'h11'\] \(HttpParser\)"),
        ("loop", "trio", r"loop must be one of \['auto', 'uvloop', 'asyncio'\] \(EventLoop\)"),
    ],
)
def test_server_config_refuses_values_out_of_range(knob: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=rf"ServerConfig\.{match}"):
        ServerConfig(**{knob: value})


def test_a_connection_bound_past_the_fd_limit_is_refused(ps, monkeypatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 4096))
    with pytest.raises(ValueError, match=r"max_connections 512 needs about 576 .* may open 256"):
        InferenceServer(ps, ServerConfig(port=0, max_connections=512))
    InferenceServer(ps, ServerConfig(port=0, max_connections=192)).stop()  # 192 + 64 fit


@pytest.mark.parametrize(
    "parser,loop", [(HttpParser.AUTO, EventLoop.AUTO), (HttpParser.H11, EventLoop.ASYNCIO)]
)
def test_the_chosen_parser_and_loop_serve(ps, model, parser, loop) -> None:
    """``auto`` is httptools on uvloop where both are installed (the serve extra); the pure
    Python pair stays selectable; each answers a request right."""
    import uvloop
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    fast = parser is HttpParser.AUTO
    with InferenceServer(ps, ServerConfig(port=0, http=parser, loop=loop)) as srv:
        assert srv.http_parser is (HttpParser.HTTPTOOLS if fast else HttpParser.H11)
        assert srv.event_loop is (EventLoop.UVLOOP if fast else EventLoop.ASYNCIO)
        base = HttpToolsProtocol if fast else H11Protocol
        assert issubclass(srv.http_protocol, base)
        running = srv.running_loop()
        assert isinstance(running, uvloop.Loop) is fast
        _infer(srv, model, seed=7)


def test_a_missing_parser_or_loop_falls_back_with_a_note(ps, monkeypatch, caplog) -> None:
    """Without httptools and uvloop installed, an explicit choice of either falls back to
    h11 and asyncio's loop, saying so."""
    import hps.serving.connections as conn

    monkeypatch.setattr(conn, "_installed", lambda module: False)
    cfg = ServerConfig(port=0, http=HttpParser.HTTPTOOLS, loop=EventLoop.UVLOOP)
    with caplog.at_level("WARNING", logger="hps.serving.connections"):
        srv = InferenceServer(ps, cfg)
    srv.stop()
    assert (srv.http_parser, srv.event_loop) == (HttpParser.H11, EventLoop.ASYNCIO)
    text = caplog.text
    assert "the httptools package is not installed" in text and "parsing with h11" in text
    assert "the uvloop package is not installed" in text and "asyncio's loop" in text
