"""Slow-loris against the real server (``python -m hps.server`` in a subprocess): 80 stalled
sockets (idle, trickled headers, trickled bodies; more than ``--workers`` + ``--max-queued``)
beside a legitimate ``tritonclient.http`` client. The client is served, with the right scores,
while every stalled socket is still open (so within the header timeout); then the server closes
each stalled socket at its deadline and keeps serving."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th

from embark.models.dlrm import DLRM
from tests.hps.serving.tiny_dlrm import (
    CliServer,
    eager_logits,
    make_request,
    tiny_model,
    triton_inputs,
    write_artifacts,
)
from tests.tolerances import tol

HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 5.0
# 80 stalled sockets: 35 idle, 35 trickling headers, 10 trickling a body. Idle and header
# sockets alone (70) exceed --workers 4 + --max-queued 64, where a server that counts
# connections as requests locks every client out.
KINDS = ["idle"] * 35 + ["headers"] * 35 + ["body"] * 10
HANG_S = 60.0  # a stalled socket still open this long after its deadline was never closed
TRICKLE_EVERY_S = 0.5


@dataclass
class _Stalled:
    """One stalled socket: what it sends, one byte every TRICKLE_EVERY_S, after ``head``."""

    kind: str  # "idle", "headers" or "body"
    sock: socket.socket
    opened: float  # time.monotonic() before connecting
    trickle: bytes
    deadline_s: float  # the server's deadline for it, counted from ``opened``
    closed_after: float | None = None


def _open(kind: str, port: int) -> _Stalled:
    opened = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    if kind == "headers":
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n")
        return _Stalled(kind, s, opened, b"X-Slow: " + b"a" * 400, HEADER_TIMEOUT_S)
    if kind == "body":
        s.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n"
        )
        return _Stalled(kind, s, opened, b'{"inputs": [' + b" " * 400, BODY_TIMEOUT_S)
    return _Stalled(kind, s, opened, b"", HEADER_TIMEOUT_S)


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF or reset), without waiting."""
    try:
        while select.select([s], [], [], 0)[0]:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def _trickle(stalled: list[_Stalled], stop: threading.Event) -> None:
    """Keep every stalled socket stalled: one byte each per round, and note when the server
    closes it."""
    sent = 0
    while not stop.wait(TRICKLE_EVERY_S):
        for st in stalled:
            if st.closed_after is not None:
                continue
            if _closed(st.sock):
                st.closed_after = time.monotonic() - st.opened
                continue
            if sent < len(st.trickle):
                try:
                    st.sock.sendall(st.trickle[sent : sent + 1])
                except (ConnectionResetError, BrokenPipeError):
                    st.closed_after = time.monotonic() - st.opened
        sent += 1
        if all(st.closed_after is not None for st in stalled):
            return


@pytest.fixture(scope="module")
def model() -> DLRM:
    return tiny_model()


@pytest.fixture(scope="module")
def server(model: DLRM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    art = write_artifacts(model, tmp_path_factory.mktemp("serving"))
    flags = ["--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S)]
    with CliServer(Path(art) / "ps.json", "--workers", "4", "--max-queued", "64", *flags) as srv:
        yield srv
    assert srv.returncode == 0, srv.output
    assert "Traceback" not in srv.output and "ERROR" not in srv.output, srv.output


def _infer(address: str, model: DLRM, seed: int) -> float:
    """One legitimate request; its scores must be the eager model's. Its seconds."""
    req = make_request(model, 8, seed=seed)
    client = th.InferenceServerClient(address, network_timeout=HANG_S)
    t = time.perf_counter()
    got = client.infer("tiny", triton_inputs(req)).as_numpy("logits")
    took = time.perf_counter() - t
    np.testing.assert_allclose(got, eager_logits(model, req), **tol("served"))
    return took


@pytest.mark.slow
def test_stalled_sockets_lock_no_one_out_and_are_closed(
    server: CliServer, model: DLRM, record_property: Callable[[str, object], None]
) -> None:
    stalled = [_open(kind, server.port) for kind in KINDS]
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(stalled, stop), daemon=True)
    trickler.start()
    try:
        time.sleep(2 * TRICKLE_EVERY_S)  # the server has accepted them and read some bytes
        took = _infer(server.address, model, seed=1)
        record_property("legit_request_s_with_80_stalled", took)
        still_open = [st.kind for st in stalled if st.closed_after is None and not _closed(st.sock)]
        assert len(still_open) == len(KINDS), "stalled sockets were closed before their deadline"
        trickler.join(max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + HANG_S)
        assert not trickler.is_alive(), [st.kind for st in stalled if st.closed_after is None]
    finally:
        stop.set()
        for st in stalled:
            st.sock.close()
    for st in stalled:
        assert st.closed_after is not None and st.closed_after >= st.deadline_s, st
    _infer(server.address, model, seed=2)
    assert server.alive()
