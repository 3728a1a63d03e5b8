"""The server's side of the gRPC front processes: :class:`GrpcFronts` starts them, answers the
calls they carry, starts another front when one dies, and stops them.

Per front, one reader thread decodes, parses, checks and submits its calls. A ``ModelInfer``
answer is encoded by the thread that resolves its execution and written at once when the
socket takes it without waiting; otherwise it waits for the front's writer thread. So
neither the reader nor the model's inference thread ever blocks on a front. A front that
takes no byte for :data:`SEND_TIMEOUT_S` (it stopped reading) is dropped: its socket is
closed, so it exits, and another one is started.

The fronts connect to an abstract Unix socket (no file to leave behind), named with a random
token; a connection is taken only from the process just started (``SO_PEERCRED``), whose
first frame is its hello: the port it bound. The first front binds the port asked for (0
included); the others bind the port it got.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from hps.serving.grpc_front.wire import (
    MAX_FRAME_BYTES,
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
    unexpected_error,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_PROCESSES", "SEND_TIMEOUT_S", "GrpcFronts", "accept_from", "read_hello"]

MAX_PROCESSES = 64
SEND_TIMEOUT_S = 5.0
_JOIN_BYTES = 1 << 20  # answers queued together are sent in one call up to this size
_RETRY_S = (0.5, 1.0, 2.0, 5.0)  # waits between attempts to replace a front (then 5 s each)
_INFER = RPC_NAMES.index("ModelInfer")
_OK = grpc.StatusCode.OK.value[0]
_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding the hps package
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _Stopping(Exception):
    """The server began stopping while a front was being started."""


def _abort_frame(cid: int, e: RpcAbort) -> bytes:
    return answer_frame(cid, e.code.value[0], e.message.encode())


class _Front:
    """One front process, the server's end of its socket, and the answers waiting for it.

    An answer is written at once when nothing waits before it and the socket takes it whole
    without waiting (the socket is in timeout mode, so non-blocking at the OS level); the
    rest waits for the front's writer thread. So the thread that resolves an execution never
    blocks on a front, and a lone client's answer costs no thread hand-off.
    """

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.broken = False
        self.reader: FrameReader | None = None
        self.early: list[memoryview] = []  # frames that came with the hello
        self.writer: threading.Thread | None = None
        self._cond = threading.Condition()
        self._waiting: deque[bytes | memoryview] = deque()
        self._writing = self._closing = False
        self._writer_done = self._writer_closes = False

    def close(self) -> None:
        """End the writer, then close the socket (never under a send in flight, whose file
        descriptor could be reused meanwhile)."""
        with self._cond:
            self.broken = self._closing = True
            self._waiting.clear()
            self._cond.notify()
        if self.writer is not None and self.writer is not threading.current_thread():
            self.writer.join(timeout=SEND_TIMEOUT_S + 1)
        with self._cond:
            if self.writer is not None and not self._writer_done:  # still in a send
                self._writer_closes = True  # it closes the socket when the send ends
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                return
        self.sock.close()

    def send(self, frame: bytes | memoryview) -> None:
        """Send ``frame`` (dropped once the front is broken); never blocks."""
        with self._cond:
            if self.broken:
                return
            if not self._waiting and not self._writing:
                try:
                    n = os.write(self.sock.fileno(), frame)
                except BlockingIOError:
                    n = 0
                except OSError as e:
                    self.drop(f"cannot send to it: {e}")
                    return
                if n == len(frame):
                    return
                frame = memoryview(frame)[n:]  # no copy under the lock
            self._waiting.append(frame)
            self._cond.notify()

    def write(self) -> None:
        """The writer thread: send what waits (joined up to :data:`_JOIN_BYTES` per system
        call) until the front is closed; a front that takes no byte for ``SEND_TIMEOUT_S``
        (its socket's timeout) is dropped."""
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if self._closing:
                    self._writer_done = True
                    if self._writer_closes:
                        self.sock.close()
                    return
                frames, size = [], 0
                while self._waiting and size < _JOIN_BYTES:
                    frames.append(self._waiting.popleft())
                    size += len(frames[-1])
                self._writing = True
            try:
                data = memoryview(b"".join(frames) if len(frames) > 1 else frames[0])
                while data and not self.broken:  # each send() waits at most the timeout
                    data = data[self.sock.send(data) :]
            except OSError as e:  # gone, or no progress for SEND_TIMEOUT_S (the frame is cut)
                self.drop(f"cannot send to it: {e}")
            except BaseException as e:  # e.g. MemoryError: the front cannot be answered
                self.drop(f"its answers failed: {type(e).__name__}: {e}")
            finally:
                with self._cond:
                    self._writing = False

    def drop(self, why: str) -> None:
        """Give the front up: it sees its socket end and exits; its reader replaces it."""
        if not self.broken:
            self.broken = True
            log.warning("grpc front pid %d dropped: %s", self.proc.pid, why)
        with contextlib.suppress(OSError):
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
        loop: the fronts' event loop, ``uvloop`` or ``asyncio`` (the HTTP server's).

    Raises:
        OSError: the address cannot be bound (naming it and why), or a front did not start.
        ValueError: ``processes`` out of range, or a front's hello was malformed
            (:class:`~hps.serving.grpc_front.wire.FrameError`).
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
        loop: str = "asyncio",
    ) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"grpc front processes must be 1 to {MAX_PROCESSES}, got {processes}")
        check_bindable(host, port)
        self.servicer, self.host, self.port = servicer, host, port
        self._max_in_flight, self._max_request_bytes = max_in_flight, max_request_bytes
        self._start_timeout_s = start_timeout_s
        if loop not in ("uvloop", "asyncio"):
            raise ValueError(f"grpc fronts' event loop must be uvloop or asyncio, got {loop!r}")
        self._loop = loop
        self._max_frame = min(max_request_bytes + MAX_PEER_BYTES + 64, MAX_FRAME_BYTES)
        self._methods: list[tuple[Callable[[Any], Any], Any]] = [
            (getattr(servicer, RPCS[name][0]), RPCS[name][1]) for name in RPC_NAMES
        ]
        self._name = f"hps-grpc-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fronts: list[_Front | None] = []
        self._threads: list[threading.Thread] = []
        self._started = self._stopping = False
        self._mu = threading.Lock()
        self._spawning = threading.Lock()  # one front starts at a time (one listener)
        try:
            self._listener.bind("\0" + self._name)
            self._listener.listen(processes + 4)
            for _ in range(processes):
                front, self.port = self._spawn(self.port)
                self._fronts.append(front)
        except BaseException:
            self._end_all()
            raise

    @property
    def address(self) -> str:
        """``host:port`` (what ``tritonclient.grpc.InferenceServerClient`` takes)."""
        return grpc_target(self.host, self.port)

    @property
    def socket_name(self) -> str:
        """The abstract Unix socket the fronts connect to (``"\\0" + socket_name``)."""
        return self._name

    @property
    def pids(self) -> list[int]:
        """The front processes' ids (live or not)."""
        return [f.proc.pid for f in self._fronts if f is not None]

    def _spawn(self, port: int) -> tuple[_Front, int]:
        """Start one front on ``port`` and read its hello: the front and the port it bound.

        Raises:
            OSError: it did not start (why); _Stopping: the server began stopping.
        """
        with self._spawning:
            if self._stopping:
                raise _Stopping
            cmd = [
                sys.executable,
                "-m",
                "hps.serving.grpc_front",
                "--relay",
                self._name,
                "--host",
                self.host,
                "--port",
                str(port),
                "--max-request-bytes",
                str(self._max_request_bytes),
                "--max-in-flight",
                str(self._max_in_flight),
                "--log-level",
                str(max(logging.getLogger().getEffectiveLevel(), logging.INFO)),
                "--loop",
                self._loop,
            ]
            # the front imports this checkout's hps, wherever the server was started from
            path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, PYTHONPATH=path)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
            deadline = time.monotonic() + self._start_timeout_s
            try:
                sock = self._accept(proc, deadline)
                try:
                    front = _Front(proc, sock)
                    bound = self._hello(front, deadline)
                except BaseException:
                    sock.close()
                    raise
            except BaseException:
                _end(proc, timeout_s=0)
                raise
        sock.settimeout(SEND_TIMEOUT_S)  # bounds the writer's sends; the reader retries
        log.info("grpc front pid %d serving on %s", proc.pid, grpc_target(self.host, bound))
        return front, bound

    def _check_waiting(self, proc: subprocess.Popen[bytes], deadline: float, what: str) -> None:
        if self._stopping:
            raise _Stopping
        if proc.poll() is not None:
            raise OSError(f"a gRPC front process exited with status {proc.returncode} {what}")
        if time.monotonic() > deadline:
            raise OSError(f"a gRPC front process did not start in {self._start_timeout_s} s")

    def _accept(self, proc: subprocess.Popen[bytes], deadline: float) -> socket.socket:
        return accept_from(
            self._listener,
            proc.pid,
            lambda: self._check_waiting(proc, deadline, "before connecting"),
        )

    def _hello(self, front: _Front, deadline: float) -> int:
        """The port in ``front``'s hello; frames that came with it wait in ``front.early``."""
        port, front.reader, front.early = read_hello(
            front.sock,
            self._max_frame,
            lambda: self._check_waiting(front.proc, deadline, "before its hello"),
        )
        return port

    def start(self) -> GrpcFronts:
        """Answer the fronts' calls (each front's calls waited in its socket until now)."""
        with self._mu:
            if self._started or self._stopping:
                raise RuntimeError("the gRPC fronts were already started or are stopped")
            self._started = True
            for i, f in enumerate(self._fronts):
                if f is not None:
                    self._serve(i, f)
        return self

    def _serve(self, slot: int, front: _Front) -> None:
        """Start ``front``'s reader and writer threads (with ``self._mu`` held)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        reader = threading.Thread(
            target=self._read, args=(slot, front), name=f"hps-grpc-relay-{slot}", daemon=True
        )
        writer = threading.Thread(target=front.write, name=f"hps-grpc-answers-{slot}", daemon=True)
        front.writer = writer
        for t in (writer, reader):
            self._threads.append(t)
            t.start()

    def _read(self, slot: int, front: _Front) -> None:
        """Answer one front's calls until its socket ends; then replace the front unless the
        server is stopping."""
        reader = front.reader or FrameReader(self._max_frame)
        buf = bytearray(1 << 18)
        view = memoryview(buf)
        try:
            for frame in front.early:
                self._dispatch(front, decode_call(frame))
            front.early = []
            while True:
                try:
                    n = front.sock.recv_into(buf)
                except TimeoutError:
                    continue
                if n == 0:
                    break
                for frame in reader.feed(view[:n]):
                    self._dispatch(front, decode_call(frame))
        except FrameError as e:
            log.error("grpc front pid %d sent a malformed frame: %s", front.proc.pid, e)
        except OSError:
            pass  # dropped by its writer, or the server is stopping
        finally:
            if not self._stopping:
                front.drop("its connection ended")
            self._replace(slot, front)

    def _dispatch(self, front: _Front, call: Call) -> None:
        """Answer ``call``; a ``ModelInfer`` answer is sent when its execution resolves.

        Raises:
            FrameError: a call that is not one of the service's RPCs.
        """
        cid = call.call_id
        if call.rpc >= len(RPC_NAMES):
            raise FrameError(f"rpc {call.rpc} after the hello")
        method, request_cls = self._methods[call.rpc]
        try:
            request = decode_request(request_cls, call.message)
            if call.rpc == _INFER:
                ic = self.servicer.start_infer(request, call.peer)
                ic.future.add_done_callback(lambda _: self._finish(front, cid, ic))
                return
            frame = self._answer(cid, method(request).SerializeToString())
        except RpcAbort as e:
            frame = _abort_frame(cid, e)
        except Exception as e:  # a bug of ours: the call fails INTERNAL, the front lives on
            log.exception("grpc %s failed", RPC_NAMES[call.rpc])
            frame = _abort_frame(cid, unexpected_error(e))
        front.send(frame)

    def _finish(self, front: _Front, cid: int, ic: InferCall) -> None:
        try:
            frame = self._answer(cid, ic.finish().SerializeToString())
        except RpcAbort as e:
            frame = _abort_frame(cid, e)
        except Exception as e:
            log.exception("grpc ModelInfer failed")
            frame = _abort_frame(cid, unexpected_error(e))
        front.send(frame)

    @staticmethod
    def _answer(cid: int, body: bytes) -> bytes:
        """The answer frame of ``body``; one too large for a frame ends its call."""
        if len(body) + 64 > MAX_FRAME_BYTES:
            raise RpcAbort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the answer of {len(body)} bytes exceeds the {MAX_FRAME_BYTES - 64} a gRPC "
                "front carries",
            )
        return answer_frame(cid, _OK, body)

    def _replace(self, slot: int, dead: _Front) -> None:
        """Start another front in ``slot`` after ``dead`` went away, retrying until one
        starts or the server stops."""
        code = _end(dead.proc, timeout_s=SEND_TIMEOUT_S)
        dead.close()
        if self._stopping:
            return
        log.warning(
            "grpc front pid %d ended (status %s); starting another on port %d",
            dead.proc.pid,
            code,
            self.port,
        )
        attempt = 0
        while True:
            try:
                front, _ = self._spawn(self.port)
            except _Stopping:
                return
            except (OSError, FrameError) as e:
                wait = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                attempt += 1
                log.error(
                    "grpc front: attempt %d to start another failed (%s); again in %g s",
                    attempt,
                    e,
                    wait,
                )
                time.sleep(wait)
                continue
            with self._mu:
                if self._stopping:
                    _end(front.proc, timeout_s=0)
                    front.close()
                    return
                self._fronts[slot] = front
                self._serve(slot, front)
            return

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask every front to stop accepting calls and finish those in flight (at most
        ``grace_s``), then end them; a front being started meanwhile is not started."""
        with self._mu:
            if self._stopping:
                return
            self._stopping = True
            fronts = [f for f in self._fronts if f is not None]
            started = self._started
        for f in fronts:
            if started:
                f.send(stop_frame(grace_s))  # after the answers already waiting
            else:  # no writer runs: nothing was answered
                with contextlib.suppress(OSError):
                    f.sock.sendall(stop_frame(grace_s))
        for f in fronts:
            _end(f.proc, timeout_s=grace_s + 5)
        with self._spawning:  # a replacement under way gives up at its next check
            pass
        for t in list(self._threads):
            t.join(timeout=SEND_TIMEOUT_S + 1)
        self._end_all()

    def _end_all(self) -> None:
        self._stopping = True
        for f in self._fronts:
            if f is not None:
                _end(f.proc, timeout_s=0)
                f.close()
        self._listener.close()


def accept_from(listener: socket.socket, pid: int, waiting: Callable[[], None]) -> socket.socket:
    """The next connection to ``listener`` made by process ``pid``; connections of other
    processes are closed. ``waiting`` runs every 0.1 s meanwhile (it raises to give up)."""
    listener.settimeout(0.1)
    while True:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            waiting()
            continue
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        if _PEERCRED.unpack(cred)[0] == pid:
            return sock
        log.warning("grpc fronts: refused a connection of process %d", _PEERCRED.unpack(cred)[0])
        sock.close()


def read_hello(
    sock: socket.socket, max_frame: int, waiting: Callable[[], None]
) -> tuple[int, FrameReader, list[memoryview]]:
    """Read a front's hello from ``sock``: the port it bound, the reader holding any partial
    frame after it, and the frames that came with it (calls, in order). ``waiting`` runs
    every 0.1 s meanwhile (it raises to give up).

    Raises:
        OSError: the front closed first, or could not bind (its reason).
        FrameError: a malformed hello.
    """
    reader = FrameReader(max_frame)
    sock.settimeout(0.1)
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            waiting()
            continue
        if data == b"":
            raise OSError("a gRPC front process closed its connection before its hello")
        frames = reader.feed(data)
        if frames:
            return parse_hello(decode_call(frames[0])), reader, frames[1:]


def _end(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """Wait for ``proc`` to exit (at most ``timeout_s``), then kill it; its exit status."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
