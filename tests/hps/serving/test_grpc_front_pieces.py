"""The pieces of the gRPC front processes, without a model: the frames between a front and
the server (exact bytes, split reads, refusals); a front process alone against a stand-in
for the server (its bind error in its hello, the stop grace on both event loops, no grace, a
server gone); the relay's hello (frames that came with it kept), its accept (only the
started process), its answers' writer (a slow reader kept, a stopped one dropped)."""

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
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hps.serving.grpc_front import wire
from hps.serving.grpc_front.relay import _Front, accept_from, read_hello
from hps.serving.grpc_server import RPCS
from tests.hps.serving.tiny_dlrm import refused, wait_until

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
        assert wait_until(lambda: refused(port))  # it stopped listening, the call still waits
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
        assert refused(port)


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
        assert wait_until(lambda: front.broken, 10)
