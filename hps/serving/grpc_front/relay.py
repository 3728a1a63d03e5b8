"""The server's side of the gRPC front processes: :class:`GrpcFronts` starts them, answers the
calls they carry (one reader thread per front; a ``ModelInfer`` answer is sent by the thread
that resolves its execution, so no thread waits on a call), starts another front when one
dies, and stops them.

A front's first frame is its hello: the port it bound (the first front binds the one asked
for, 0 included; the others bind the port the first got). An answer that cannot be sent
within :data:`SEND_TIMEOUT_S` (a front that stopped reading) drops that front's connection,
so a stuck front never holds up the batcher: it exits on the closed socket and another one is
started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from hps.serving.grpc_front.wire import (
    MAX_PEER_BYTES,
    RPC_NAMES,
    Call,
    FrameError,
    FrameReader,
    answer_frame,
    decode_call,
    grpc_target,
    parse_hello,
    stop_frame,
)
from hps.serving.grpc_server import (
    RPCS,
    GrpcInferenceServicer,
    InferCall,
    RpcAbort,
    check_bindable,
    decode_request,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_PROCESSES", "SEND_TIMEOUT_S", "GrpcFronts"]

MAX_PROCESSES = 64
SEND_TIMEOUT_S = 5.0
_RESTARTS = 3  # attempts to replace a front that died, one after another, before giving up
_INFER = RPC_NAMES.index("ModelInfer")
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding the hps package
_OK = grpc.StatusCode.OK.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]


class _Front:
    """One front process and the server's end of its socket."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.lock = threading.Lock()  # one frame at a time on the socket
        self.broken = False

    def send(self, frame: bytes) -> None:
        """Send one frame; a front that does not take it within the timeout is dropped."""
        with self.lock:
            if self.broken:
                return
            try:
                self.sock.sendall(frame)
            except OSError as e:  # gone, or stuck past SEND_TIMEOUT_S (the frame is cut)
                self.broken = True
                log.warning("grpc front (pid %d): dropped: %s", self.proc.pid, e)
                with contextlib.suppress(OSError):  # its reader sees the end and replaces it
                    self.sock.shutdown(socket.SHUT_RDWR)


class GrpcFronts:
    """The v2 gRPC service served by ``processes`` front processes
    (:mod:`hps.serving.grpc_front`), started on construction (the port is bound then, as
    :class:`~hps.serving.grpc_server.GrpcServer` binds it); their calls are answered from
    :meth:`start` until :meth:`stop`.

    Args:
        servicer: answers the calls (shared servables, batchers and statistics).
        host, port: the address; port 0 picks a free one (read :attr:`port`).
        processes: front processes (1 to :data:`MAX_PROCESSES`).
        max_in_flight: calls in flight per front; past it grpcio answers
            ``RESOURCE_EXHAUSTED``.
        max_request_bytes: the largest request message, after decompression.
        start_timeout_s: how long a front may take to bind and say hello.

    Raises:
        OSError: the address cannot be bound (naming it and why), or a front did not start.
        ValueError: ``processes`` out of range.
    """

    def __init__(
        self,
        servicer: GrpcInferenceServicer,
        host: str,
        port: int,
        processes: int,
        max_in_flight: int,
        max_request_bytes: int,
        start_timeout_s: float = 60.0,
    ) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"grpc front processes must be 1 to {MAX_PROCESSES}, got {processes}")
        check_bindable(host, port)
        self.servicer, self.host = servicer, host
        self._max_in_flight, self._max_request_bytes = max_in_flight, max_request_bytes
        self._start_timeout_s = start_timeout_s
        self._max_frame = max_request_bytes + MAX_PEER_BYTES + 64
        self._methods: list[tuple[Callable[[Any], Any], Any]] = [
            (getattr(servicer, RPCS[name][0]), RPCS[name][1]) for name in RPC_NAMES
        ]
        self._dir = tempfile.mkdtemp(prefix="hps-grpc-")  # 0700: this user's processes only
        self._path = os.path.join(self._dir, "relay.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(processes + 4)
        self._fronts: list[_Front | None] = []
        self._readers: list[threading.Thread] = []
        self._started = self._stopping = False
        self._mu = threading.Lock()
        self.port = port
        try:
            for _ in range(processes):
                front, self.port = self._spawn(self.port)
                self._fronts.append(front)
        except BaseException:
            self._kill_all()
            raise

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.grpc.InferenceServerClient`` takes)."""
        return grpc_target(self.host, self.port)

    @property
    def pids(self) -> list[int]:
        """The front processes' ids (live or not)."""
        return [f.proc.pid for f in self._fronts if f is not None]

    def _spawn(self, port: int) -> tuple[_Front, int]:
        """Start one front on ``port`` and read its hello: the front and the port it bound."""
        cmd = [
            sys.executable,
            "-m",
            "hps.serving.grpc_front",
            "--relay",
            self._path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--max-request-bytes",
            str(self._max_request_bytes),
            "--max-in-flight",
            str(self._max_in_flight),
            "--log-level",
            logging.getLevelName(max(logging.getLogger().getEffectiveLevel(), logging.INFO)),
        ]
        # the front imports this checkout's hps, wherever the server was started from
        path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self._start_timeout_s
        try:
            sock = self._accept(proc, deadline)
            try:
                bound = self._hello(sock, proc, deadline)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            _end(proc)
            raise
        sock.settimeout(SEND_TIMEOUT_S)
        log.info("grpc front pid %d serving on %s", proc.pid, grpc_target(self.host, bound))
        return _Front(proc, sock), bound

    def _accept(self, proc: subprocess.Popen[bytes], deadline: float) -> socket.socket:
        self._listener.settimeout(0.1)
        while True:
            try:
                sock, _ = self._listener.accept()
                return sock
            except TimeoutError:
                pass
            if proc.poll() is not None:
                raise OSError(f"a gRPC front process exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise OSError(f"a gRPC front process did not start in {self._start_timeout_s} s")

    def _hello(self, sock: socket.socket, proc: subprocess.Popen[bytes], deadline: float) -> int:
        reader = FrameReader(self._max_frame)
        sock.settimeout(0.1)
        while True:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                data = None
            if data == b"":
                raise OSError(f"a gRPC front process (pid {proc.pid}) closed before its hello")
            if data:
                frames = reader.feed(data)
                if frames:
                    return parse_hello(decode_call(frames[0]))
            if time.monotonic() > deadline:
                raise OSError(f"a gRPC front process sent no hello in {self._start_timeout_s} s")

    def start(self) -> GrpcFronts:
        """Answer the fronts' calls (each front's calls waited in its socket until now)."""
        with self._mu:
            self._started = True
            for i, f in enumerate(self._fronts):
                if f is not None:
                    self._start_reader(i, f)
        return self

    def _start_reader(self, slot: int, front: _Front) -> None:
        t = threading.Thread(
            target=self._read, args=(slot, front), name=f"hps-grpc-relay-{slot}", daemon=True
        )
        self._readers.append(t)
        t.start()

    def _read(self, slot: int, front: _Front) -> None:
        """Answer one front's calls until its socket closes; then replace the front unless
        the server is stopping."""
        reader = FrameReader(self._max_frame)
        buf = bytearray(1 << 18)
        view = memoryview(buf)
        try:
            while True:
                try:
                    n = front.sock.recv_into(buf)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if n == 0:
                    break
                for frame in reader.feed(view[:n]):
                    self._dispatch(front, decode_call(frame))
        except FrameError as e:
            log.error("grpc front (pid %d): malformed frame, dropped: %s", front.proc.pid, e)
        front.broken = True
        front.sock.close()
        self._replace(slot, front)

    def _dispatch(self, front: _Front, call: Call) -> None:
        """Answer ``call``; a ``ModelInfer`` answer is sent when its execution resolves."""
        cid = call.call_id
        method, request_cls = self._methods[call.rpc]
        try:
            request = decode_request(request_cls, call.message)
            if call.rpc == _INFER:
                ic = self.servicer.start_infer(request, call.peer)
                ic.future.add_done_callback(lambda _: self._finish(front, cid, ic))
                return
            frame = answer_frame(cid, _OK, method(request).SerializeToString())
        except RpcAbort as e:
            frame = answer_frame(cid, e.code.value[0], e.message.encode())
        except Exception as e:  # a bug of ours: the call fails, the front lives on
            log.exception("grpc %s failed", RPC_NAMES[call.rpc])
            frame = answer_frame(
                cid, _INTERNAL, f"internal error: {type(e).__name__}: {e}".encode()
            )
        front.send(frame)

    @staticmethod
    def _finish(front: _Front, cid: int, ic: InferCall) -> None:
        try:
            frame = answer_frame(cid, _OK, ic.finish().SerializeToString())
        except RpcAbort as e:
            frame = answer_frame(cid, e.code.value[0], e.message.encode())
        except Exception as e:
            log.exception("grpc ModelInfer failed")
            frame = answer_frame(
                cid, _INTERNAL, f"internal error: {type(e).__name__}: {e}".encode()
            )
        front.send(frame)

    def _replace(self, slot: int, dead: _Front) -> None:
        """Start another front in ``slot`` after ``dead`` went away (not while stopping)."""
        code = _end(dead.proc, timeout_s=SEND_TIMEOUT_S)
        with self._mu:
            if self._stopping:
                return
        log.warning(
            "grpc front pid %d ended (status %s); starting another on port %d",
            dead.proc.pid,
            code,
            self.port,
        )
        for attempt in range(_RESTARTS):
            try:
                front, _ = self._spawn(self.port)
            except OSError as e:
                log.error("grpc front: attempt %d to start another failed: %s", attempt + 1, e)
                time.sleep(0.5 * (attempt + 1))
                continue
            with self._mu:
                if self._stopping:
                    front.sock.close()
                    _end(front.proc)
                    return
                self._fronts[slot] = front
                self._start_reader(slot, front)
            return
        log.error("grpc front: gave up replacing the front of slot %d", slot)
        with self._mu:
            self._fronts[slot] = None

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask every front to stop accepting calls and finish those in flight (at most
        ``grace_s``), then end them and release the socket."""
        with self._mu:
            if self._stopping:
                return
            self._stopping = True
            fronts = [f for f in self._fronts if f is not None]
        for f in fronts:
            f.send(stop_frame())
        for f in fronts:
            _end(f.proc, timeout_s=grace_s + 5)
        for t in list(self._readers):
            t.join(timeout=SEND_TIMEOUT_S + 1)
        self._kill_all()

    def _kill_all(self) -> None:
        for f in self._fronts:
            if f is not None:
                _end(f.proc, timeout_s=0)
                f.sock.close()
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _end(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """Wait for ``proc`` to exit (at most ``timeout_s``), then kill it; its exit status."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
