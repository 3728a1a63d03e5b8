"""gRPC from front processes (``grpc_processes``): the frames between a front and the server
(exact bytes, split reads, refusals); a front killed mid-service is replaced on the same port
and the next calls score exactly; stopping the server ends every front, frees the port and
removes the relay's socket; a server killed with SIGKILL takes its fronts with it; concurrent
clients through two fronts get bit-equal answers; the knobs' bad values are refused. The
protocol itself (scores, errors, statistics, gzip, limits) is tested through a front by
``test_grpc_server.py`` and ``test_grpc_fuzz.py``, whose server runs both ways."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.grpc_front import wire
from hps.serving.grpc_front.relay import (
    SEND_TIMEOUT_S,
    GrpcFronts,
    _Front,
    accept_from,
    read_hello,
)
from hps.serving.grpc_server import RPCS, GrpcInferenceServicer
from hps.serving.http_server import InferenceServer, ServerConfig
from tests.hps.serving.test_grpc_server import grpc_inputs
from tests.hps.serving.tiny_dlrm import (
    CliServer,
    bindable,
    free_port,
    make_request,
    triton_inputs,
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond, timeout_s: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- frames -------------------------------------------------------------------------------


def test_frames_are_exact_bytes_and_survive_any_split() -> None:
    call = wire.call_frame(7, 5, "ipv4:127.0.0.1:5", b"\x01\x02")
    peer = b"ipv4:127.0.0.1:5"
    body = struct.pack("<QBH", 7, 5, len(peer)) + peer + b"\x01\x02"
    assert call == struct.pack("<I", len(body)) + body
    answer = wire.answer_frame(7, 3, b"bad")
    assert answer == struct.pack("<I", 12) + struct.pack("<QB", 7, 3) + b"bad"
    stream = call + answer + wire.hello_frame(4321) + wire.stop_frame(2.5)
    for step in (1, 3, 7, len(stream)):  # fed byte by byte, in odd pieces, at once
        r = wire.FrameReader(max_frame=1 << 16)
        frames = [f for i in range(0, len(stream), step) for f in r.feed(stream[i : i + step])]
        assert r.buffered == 0 and len(frames) == 4
        assert wire.decode_call(frames[0]) == wire.Call(7, 5, "ipv4:127.0.0.1:5", b"\x01\x02")
        assert wire.decode_answer(frames[1]) == wire.Answer(7, 3, b"bad")
        assert wire.parse_hello(wire.decode_call(frames[2])) == 4321
        assert wire.decode_answer(frames[3]) == wire.Answer(0, wire.STOP, b"2.5")


def test_bad_frames_are_refused_naming_what_is_wrong() -> None:
    r = wire.FrameReader(max_frame=100)
    with pytest.raises(wire.FrameError, match="101 bytes exceeds the 100"):
        r.feed(struct.pack("<I", 101))  # refused from its length, before its bytes arrive
    with pytest.raises(wire.FrameError, match="unknown rpc 9"):
        wire.decode_call(memoryview(struct.pack("<QBH", 1, 9, 0)))
    with pytest.raises(wire.FrameError, match="shorter than its peer"):
        wire.decode_call(memoryview(struct.pack("<QBH", 1, 0, 50) + b"ab"))
    with pytest.raises(wire.FrameError, match="shorter than its header"):
        wire.decode_answer(memoryview(b"\x00" * 8))
    with pytest.raises(wire.FrameError, match="only a hello has call id 0"):
        wire.decode_call(memoryview(struct.pack("<QBH", 0, 5, 0)))
    with pytest.raises(wire.FrameError, match="first frame must be its hello"):
        wire.parse_hello(wire.Call(3, 0, "", b""))
    with pytest.raises(wire.FrameError, match="names no port"):
        wire.parse_hello(wire.Call(0, wire.HELLO, "", b'{"port": 0}'))
    with pytest.raises(OSError, match="cannot listen on here"):
        wire.parse_hello(
            wire.decode_call(
                wire.FrameReader(1 << 16).feed(wire.hello_frame(None, "cannot listen on here"))[0]
            )
        )
    assert tuple(RPCS) == wire.RPC_NAMES  # the rpc byte means the same on both ends


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
        assert _wait(lambda: fronts.pids != [old] and all(_alive(p) for p in fronts.pids))
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


def _refused(port: int) -> bool:
    """Whether nothing listens on ``port`` any more."""
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


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
        assert _wait(lambda: _refused(port))  # both fronts stopped accepting calls...
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
    assert _wait(lambda: not (set(threading.enumerate()) - before), 5)


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
        assert _wait(lambda: _fronts(srv).pids != [front])
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
        assert _wait(lambda: not any(_alive(p) for p in fronts)), "a front outlived its server"
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


# --- a front process alone, against a stand-in for the server -------------------------------


class _FakeRelay:
    """An abstract Unix socket a front started by hand connects to."""

    def __init__(self, port: int, loop: str = "asyncio") -> None:
        self.name = f"hps-grpc-test-{os.getpid()}-{time.monotonic_ns()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(1)
        self.listener.settimeout(60)
        argv = ["--relay", self.name, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--max-request-bytes", "1048576", "--max-in-flight", "4", "--loop", loop]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hps.serving.grpc_front", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            self.sock, _ = self.listener.accept()
        except BaseException:
            self.proc.kill()
            self.proc.communicate()
            self.listener.close()
            raise
        self.sock.settimeout(60)

    def first_frame(self) -> wire.Call:
        reader = wire.FrameReader(1 << 20)
        while True:
            frames = reader.feed(self.sock.recv(65536))
            if frames:
                return wire.decode_call(frames[0])

    def close(self) -> None:
        self.sock.close()
        self.listener.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def test_a_front_that_cannot_bind_says_why_in_its_hello_and_exits_2() -> None:
    with socket.socket() as taken:  # listening without SO_REUSEPORT: no front can share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        relay = _FakeRelay(port)
        try:
            hello = relay.first_frame()
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(gRPC\\)"):
                wire.parse_hello(hello)
            assert relay.proc.wait(30) == 2
        finally:
            relay.close()


@contextlib.contextmanager
def _front_with_a_call(
    loop: str = "asyncio",
) -> Iterator[tuple[_FakeRelay, int, grpc.Future, wire.Call]]:
    """A front started by hand (on event loop ``loop``), its port, and a ServerLive call in
    flight through it (the future, and the call as the stand-in server received it)."""
    relay = _FakeRelay(0, loop)
    ch = None
    try:
        port = wire.parse_hello(relay.first_frame())
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        fut = ch.unary_unary(f"/{wire.SERVICE}/ServerLive").future(b"", timeout=60)
        call = relay.first_frame()
        assert call.rpc == wire.RPC_NAMES.index("ServerLive") and call.peer.startswith("ipv4:")
        yield relay, port, fut, call
    finally:
        if ch is not None:
            ch.close()
        relay.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_front_finishes_a_call_within_the_stop_grace_and_exits_0(loop: str) -> None:
    with _front_with_a_call(loop) as (relay, port, fut, call):
        relay.proc.send_signal(signal.SIGTERM)  # ignored: only the server stops its fronts
        relay.sock.sendall(wire.stop_frame(30.0))
        assert _wait(lambda: _refused(port))  # it stopped listening, the call still waits
        assert not fut.done() and relay.proc.poll() is None
        relay.sock.sendall(wire.answer_frame(call.call_id, 0, b"\x08\x01"))
        assert fut.result(timeout=30) == b"\x08\x01"
        assert relay.proc.wait(30) == 0


def test_a_front_with_no_grace_cancels_its_calls_and_exits_0() -> None:
    with _front_with_a_call() as (relay, _, fut, _call):
        relay.sock.sendall(wire.stop_frame(0.0))
        assert relay.proc.wait(30) == 0
        with pytest.raises(grpc.RpcError):
            fut.result(timeout=30)


def test_a_front_whose_server_is_gone_fails_its_calls_unavailable_and_exits_1() -> None:
    with _front_with_a_call() as (relay, port, fut, _call):
        relay.sock.close()
        with pytest.raises(grpc.RpcError) as e:
            fut.result(timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert relay.proc.wait(30) == 1
        assert _refused(port)


# --- the relay's pieces -----------------------------------------------------------------------


def test_the_hello_keeps_the_frames_that_came_with_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        nxt = wire.call_frame(2, 0, "p", b"xyz")
        b.sendall(wire.hello_frame(5001) + wire.call_frame(1, 5, "p", b"ab") + nxt[:7])
        port, reader, early = read_hello(a, 1 << 16, lambda: None)
        assert port == 5001 and reader.buffered == 7
        assert [wire.decode_call(f) for f in early] == [wire.Call(1, 5, "p", b"ab")]
        assert [wire.decode_call(f) for f in reader.feed(nxt[7:])] == [wire.Call(2, 0, "p", b"xyz")]


def test_only_the_started_process_is_accepted() -> None:
    name = f"hps-grpc-test-accept-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind("\0" + name)
        listener.listen(4)
        foreign = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        foreign.connect("\0" + name)  # this process: not the front
        code = f"import socket,time; s=socket.socket(socket.AF_UNIX); s.connect('\\0{name}'); time.sleep(30)"
        child = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 30

            def waiting() -> None:
                assert time.monotonic() < deadline, "the child never connected"

            sock = accept_from(listener, child.pid, waiting)
            with sock:
                cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                assert struct.unpack("3i", cred)[0] == child.pid
            foreign.settimeout(10)
            assert foreign.recv(1) == b""  # closed by the relay
        finally:
            foreign.close()
            child.kill()
            child.wait()


@contextlib.contextmanager
def _front_on_a_socketpair() -> Iterator[tuple[_Front, socket.socket]]:
    """A ``_Front`` whose writer runs, on one end of a socket pair with a 0.5 s send timeout
    (a sleeping child stands for its process), and the pair's other end: its reader."""
    a, b = socket.socketpair()
    a.settimeout(0.5)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    front = _Front(proc, a)
    front.writer = threading.Thread(target=front.write, daemon=True)
    front.writer.start()
    try:
        yield front, b
    finally:
        front.close()
        b.close()
        proc.kill()
        proc.wait()


def test_a_front_that_stops_reading_is_dropped_one_that_reads_slowly_is_not() -> None:
    """Answers go out in order whether written at once or by the writer; a reader taking
    64 KiB every 50 ms keeps its front (the timeout is per send, not per answer), one that
    reads nothing loses it."""
    frames = [wire.answer_frame(k, 0, bytes([k % 251]) * 50_000) for k in range(1, 41)]
    with _front_on_a_socketpair() as (front, reader):
        for f in frames:
            front.send(f)
        got = bytearray()
        while len(got) < sum(map(len, frames)):
            time.sleep(0.05)
            got += reader.recv(65536)
        assert bytes(got) == b"".join(frames) and not front.broken
    with _front_on_a_socketpair() as (front, _):
        for f in frames:
            front.send(f)
        assert _wait(lambda: front.broken, 10)


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
