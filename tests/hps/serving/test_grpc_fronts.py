"""A server with gRPC front processes (``grpc_processes``): a front killed mid-service is
replaced on the same port and the next calls score exactly (calls in flight on it fail
``UNAVAILABLE``); stopping the server lets a call in flight finish, then ends every front,
frees the port and closes the relay's socket; a server killed with SIGKILL takes its fronts
with it; fronts ignore signals sent to the process group; concurrent clients through two
fronts get bit-equal answers; an answer larger than the request limit goes through; an
unexpected servicer failure is ``INTERNAL`` both ways; the knob's bad values are refused. The
protocol itself (scores, errors, statistics, gzip, limits) is tested through a front by
``test_grpc_server.py`` and ``test_grpc_fuzz.py``, whose server runs both ways; the pieces
without a model by ``test_grpc_front_pieces.py``."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.grpc_front.relay import (
    SEND_TIMEOUT_S,
    GrpcFronts,
)
from hps.serving.grpc_server import GrpcInferenceServicer
from hps.serving.http_server import InferenceServer, ServerConfig
from tests.hps.serving.test_grpc_server import grpc_inputs
from tests.hps.serving.tiny_dlrm import (
    CliServer,
    bindable,
    free_port,
    make_request,
    refused,
    triton_inputs,
    wait_until,
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_grpc_processes_knob_is_checked() -> None:
    with pytest.raises(ValueError, match="grpc_processes 2 needs a grpc_port"):
        ServerConfig(grpc_processes=2)
    with pytest.raises(
        ValueError, match=r"grpc_processes must be an integer from -1 to 64, got 65"
    ):
        ServerConfig(grpc_port=0, grpc_processes=65)
    assert ServerConfig(grpc_port=0, grpc_processes=3).grpc_fronts == 3
    assert ServerConfig(grpc_processes=-1).grpc_fronts == 0  # no gRPC, no fronts
    auto = ServerConfig(grpc_port=0).grpc_fronts
    assert auto == (1 if len(os.sched_getaffinity(0)) >= 2 else 0)


# --- a server with fronts -----------------------------------------------------------------


def _server(artifacts: Path, fronts: int) -> tuple[HierarchicalParameterServer, InferenceServer]:
    """The tiny model served with ``fronts`` gRPC front processes, on the default event loop
    (uvloop, installed here, for HTTP and the fronts alike)."""
    ps = HierarchicalParameterServer.from_config(artifacts / "ps.json")
    cfg = ServerConfig(port=0, grpc_port=0, workers=4, grpc_processes=fronts)
    return ps, InferenceServer(ps, cfg).start()


def _fronts(srv: InferenceServer) -> GrpcFronts:
    assert isinstance(srv.grpc, GrpcFronts)
    return srv.grpc


def test_a_killed_front_is_replaced_on_the_same_port(tiny_artifacts: Path, tiny: DLRM) -> None:
    ps, srv = _server(tiny_artifacts, 1)
    try:
        fronts = _fronts(srv)
        (old,) = fronts.pids
        with open(f"/proc/{old}/cmdline", "rb") as f:  # the HTTP server's loop, resolved
            assert b"\0--loop\0" + srv.event_loop.value.encode() + b"\0" in f.read() + b"\0"
        req = make_request(tiny, 6, seed=31)
        want = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: fronts.pids != [old] and all(_alive(p) for p in fronts.pids))
        (new,) = fronts.pids
        assert not _alive(old)
        g = tg.InferenceServerClient(srv.grpc_address or "")
        got = g.infer("tiny", grpc_inputs(req)).as_numpy("logits")
        g.close()
        np.testing.assert_array_equal(got, want.as_numpy("logits"))
        assert srv.grpc_address == f"127.0.0.1:{fronts.port}"  # the port did not change
    finally:
        srv.stop()
        ps.close()
    assert not _alive(new)


def _relay_closed(name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect("\0" + name)
        except ConnectionRefusedError:
            return True
    return False


def _hold(srv: InferenceServer) -> tuple[threading.Event, threading.Event, Callable[[], None]]:
    """Make the tiny model's executions wait: (entered, release, undo)."""
    s = srv.servables["tiny"]
    real = s.infer
    entered, release = threading.Event(), threading.Event()

    def held(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entered.set()
        release.wait(30)
        return real(inputs)

    def undo() -> None:
        release.set()
        s.infer = real  # type: ignore[method-assign]

    s.infer = held  # type: ignore[method-assign]
    return entered, release, undo


def test_stop_ends_every_front_and_frees_port_and_socket(tiny_artifacts: Path, tiny: DLRM) -> None:
    """A call whose execution is running when the server stops gets its answer after the
    fronts stopped listening; then every front has exited, the port is free, the relay's
    socket is closed and no thread is left."""
    before = set(threading.enumerate())
    ps, srv = _server(tiny_artifacts, 2)
    answers: list[np.ndarray] = []
    entered, release, undo = _hold(srv)
    try:
        fronts = _fronts(srv)
        pids, port, name = fronts.pids, fronts.port, fronts.socket_name
        assert len(pids) == 2 and all(_alive(p) for p in pids) and not _relay_closed(name)
        # timeout mode (non-blocking at the OS level): an answer's write never blocks
        assert all(f is not None and f.sock.gettimeout() == SEND_TIMEOUT_S for f in fronts._fronts)
        assert not bindable(port)
        req = make_request(tiny, 3, seed=32)
        g = tg.InferenceServerClient(str(srv.grpc_address))
        t = threading.Thread(
            target=lambda: answers.append(g.infer("tiny", grpc_inputs(req)).as_numpy("logits"))
        )
        t.start()
        assert entered.wait(30)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        assert wait_until(lambda: refused(port))  # both fronts stopped accepting calls...
        assert t.is_alive()  # ...while the call in flight still waits for its execution
        release.set()
        stopper.join(30)
        t.join(30)
        g.close()
        undo()
        want = srv.servables["tiny"].infer(srv.servables["tiny"].check(req))["logits"]
        np.testing.assert_array_equal(answers[0], want)
    finally:
        undo()
        srv.stop()
        ps.close()
    assert not any(_alive(p) for p in pids)
    assert bindable(port) and _relay_closed(name)
    assert wait_until(lambda: not (set(threading.enumerate()) - before), 5)


def test_a_call_in_flight_on_a_killed_front_fails_unavailable(
    tiny_artifacts: Path, tiny: DLRM
) -> None:
    """Its client learns at once (no hang); the server goes on with a new front."""
    ps, srv = _server(tiny_artifacts, 1)
    entered, release, undo = _hold(srv)
    try:
        (front,) = _fronts(srv).pids
        req = make_request(tiny, 2, seed=35)
        g = tg.InferenceServerClient(str(srv.grpc_address))
        errors: list[InferenceServerException] = []

        def call() -> None:
            try:
                g.infer("tiny", grpc_inputs(req), client_timeout=60)
            except InferenceServerException as e:
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        assert entered.wait(30)
        os.kill(front, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and len(errors) == 1
        assert errors[0].status() == "StatusCode.UNAVAILABLE", errors[0]
        undo()
        assert wait_until(lambda: _fronts(srv).pids != [front])
        got = g.infer("tiny", grpc_inputs(req)).as_numpy("logits")
        g.close()
        want = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
        np.testing.assert_array_equal(got, want.as_numpy("logits"))
    finally:
        undo()
        srv.stop()
        ps.close()


def test_an_answer_larger_than_any_request_goes_through(tiny_artifacts: Path, tiny: DLRM) -> None:
    """A request may name an output many times: its answer (here ~2.3 MiB) can exceed the
    request limit (1 MiB); the front carries it like in-process gRPC, and lives on."""
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    cfg = ServerConfig(port=0, grpc_port=0, max_request_mb=1.0, grpc_processes=1)
    srv = InferenceServer(ps, cfg).start()
    try:
        (front,) = _fronts(srv).pids
        req = make_request(tiny, 64, seed=36)
        outputs = [tg.InferRequestedOutput("logits") for _ in range(9000)]
        g = tg.InferenceServerClient(str(srv.grpc_address))
        resp = g.infer("tiny", grpc_inputs(req), outputs=outputs)
        assert len(resp.get_response().outputs) == 9000
        assert resp.get_response().ByteSize() > 2 * 2**20
        want = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
        np.testing.assert_array_equal(resp.as_numpy("logits"), want.as_numpy("logits"))
        g.close()
        assert _fronts(srv).pids == [front] and _alive(front)
    finally:
        srv.stop()
        ps.close()


def test_two_fronts_answer_concurrent_clients_bit_equal(tiny_artifacts: Path, tiny: DLRM) -> None:
    """Eight clients, each on its own connection (the kernel spreads connections over the
    fronts by a hash of their addresses), merged by the batcher: each gets exactly the rows
    its request gets alone over HTTP."""
    ps, srv = _server(tiny_artifacts, 2)
    try:
        reqs = [make_request(tiny, 1 + k % 5, seed=40 + k) for k in range(8)]
        http = th.InferenceServerClient(srv.address)
        wants = [http.infer("tiny", triton_inputs(r)).as_numpy("logits") for r in reqs]
        errors: list[BaseException] = []

        def client(k: int) -> None:
            g = tg.InferenceServerClient(str(srv.grpc_address))
            try:
                for _ in range(25):
                    got = g.infer("tiny", grpc_inputs(reqs[k])).as_numpy("logits")
                    np.testing.assert_array_equal(got, wants[k])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
            finally:
                g.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        st = http.get_inference_statistics("tiny")["model_stats"][0]
        assert st["inference_stats"]["success"]["count"] >= 200 + 8
    finally:
        srv.stop()
        ps.close()


def test_a_taken_port_is_refused_naming_it(tiny_artifacts: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
        try:
            cfg = ServerConfig(port=0, grpc_port=port, grpc_processes=1)
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(gRPC\\)"):
                InferenceServer(ps, cfg)
        finally:
            ps.close()


def test_a_server_killed_outright_takes_its_fronts_with_it(
    tiny_artifacts: Path, tiny: DLRM
) -> None:
    gport = free_port()
    flags = ("--grpc-port", str(gport), "--grpc-processes", "2")
    with CliServer(tiny_artifacts / "ps.json", *flags) as srv:
        g = tg.InferenceServerClient(f"127.0.0.1:{gport}")
        g.infer("tiny", grpc_inputs(make_request(tiny, 2, seed=33)))
        fronts = srv.children()
        assert len(fronts) == 2 and all(_alive(p) for p in fronts)
        os.kill(srv.pid, signal.SIGKILL)
        assert wait_until(lambda: not any(_alive(p) for p in fronts)), "a front outlived its server"
        with pytest.raises(InferenceServerException):
            g.infer("tiny", grpc_inputs(make_request(tiny, 2, seed=33)), client_timeout=10)
        g.close()
    assert bindable(gport)


def test_cli_fronts_ignore_signals_and_stop_with_their_server(
    tiny_artifacts: Path, tiny: DLRM
) -> None:
    """Ctrl-C and a service manager's SIGTERM reach the whole process group: the fronts ignore
    both, and the server (SIGTERM) stops them once its own calls are done."""
    gport = free_port()
    req = make_request(tiny, 4, seed=34)
    with CliServer(
        tiny_artifacts / "ps.json", "--grpc-port", str(gport), "--grpc-processes", "1"
    ) as srv:
        (front,) = srv.children()
        os.kill(front, signal.SIGINT)
        os.kill(front, signal.SIGTERM)
        g = tg.InferenceServerClient(f"127.0.0.1:{gport}")
        got = g.infer("tiny", grpc_inputs(req)).as_numpy("logits")
        g.close()
        assert srv.children() == [front]  # still the same front
        want = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
        np.testing.assert_array_equal(got, want.as_numpy("logits"))
    assert srv.returncode == 0, srv.output
    assert not _alive(front) and bindable(gport)
    assert "Traceback" not in srv.output, srv.output


def test_an_unexpected_servicer_failure_is_internal_in_process_and_through_a_front(
    tiny_artifacts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(self: GrpcInferenceServicer, request: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(GrpcInferenceServicer, "server_live", boom)
    for fronts in (0, 1):
        ps, srv = _server(tiny_artifacts, fronts)
        try:
            g = tg.InferenceServerClient(str(srv.grpc_address))
            with pytest.raises(InferenceServerException) as e:
                g.is_server_live()
            assert e.value.status() == "StatusCode.INTERNAL", (fronts, e.value)
            assert "internal error: RuntimeError: boom" in str(e.value)
            assert g.is_server_ready()  # the server lives on
            g.close()
        finally:
            srv.stop()
            ps.close()
