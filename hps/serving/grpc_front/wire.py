"""The frames between a gRPC front process and the server's process, over one Unix stream
socket per front (little-endian; grpcio and this module only, so a front imports nothing
else of ours).

Every frame is ``u32 length`` followed by ``length`` bytes::

    call     (front → server)   u64 call id ≥ 1 · u8 rpc · u16 peer length · peer · message
    answer   (server → front)   u64 call id · u8 status code · body
    hello    (front → server)   u64 0 · u8 HELLO · u16 0 · JSON {"port": p} or {"error": "..."}
    stop     (server → front)   u64 0 · u8 STOP · grace seconds (ASCII): stop accepting calls,
                                finish those in flight (at most the grace), then exit

``rpc`` indexes :data:`RPC_NAMES`; ``peer`` is the client's address as grpcio gives it (the
batcher's known clients); ``message`` the request's serialized bytes. An answer's ``body`` is
the serialized response when ``status code`` is 0 (OK), else the error message in UTF-8;
status codes are gRPC's numbers.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

__all__ = [
    "HELLO",
    "MAX_FRAME_BYTES",
    "MAX_PEER_BYTES",
    "RPC_NAMES",
    "STOP",
    "Answer",
    "Call",
    "FrameError",
    "FrameReader",
    "SERVICE",
    "answer_frame",
    "call_frame",
    "decode_answer",
    "decode_call",
    "grpc_target",
    "hello_frame",
    "parse_hello",
    "stop_frame",
]

#: The service's RPCs, in the order of their ``rpc`` byte (hps.serving.grpc_server.RPCS).
RPC_NAMES = (
    "ServerLive",
    "ServerReady",
    "ServerMetadata",
    "ModelReady",
    "ModelMetadata",
    "ModelInfer",
    "ModelConfig",
    "RepositoryIndex",
)
SERVICE = "inference.GRPCInferenceService"
HELLO = 254  # rpc byte of a front's first frame
STOP = 255  # rpc byte of the server's request that a front stop
MAX_PEER_BYTES = 1024  # a longer peer address is cut (it only names a connection)
#: The longest frame either end sends or takes (its length is a u32; grpcio's own messages
#: are at most 2 GiB - 1): a larger answer ends its call RESOURCE_EXHAUSTED.
MAX_FRAME_BYTES = 2**31 + MAX_PEER_BYTES + 64

_LEN = struct.Struct("<I")
_CALL = struct.Struct("<QBH")
_ANSWER = struct.Struct("<QB")


class FrameError(ValueError):
    """Bytes on a front's socket that are not a frame of this protocol (the connection is
    dropped: its other end is not a front of this server, or is broken)."""


@dataclass(frozen=True)
class Call:
    """A call a front carries to the server (or a hello / stop, by ``rpc``)."""

    call_id: int
    rpc: int
    peer: str
    message: bytes


@dataclass(frozen=True)
class Answer:
    """The server's answer to call ``call_id``: ``code`` 0 and the response's bytes, or a gRPC
    status code and its message."""

    call_id: int
    code: int
    body: bytes


def call_frame(call_id: int, rpc: int, peer: str, message: bytes) -> bytes:
    p = peer.encode("utf-8", "replace")[:MAX_PEER_BYTES]
    head = _CALL.pack(call_id, rpc, len(p))
    return _LEN.pack(len(head) + len(p) + len(message)) + head + p + message


def answer_frame(call_id: int, code: int, body: bytes) -> bytes:
    return _LEN.pack(_ANSWER.size + len(body)) + _ANSWER.pack(call_id, code) + body


def hello_frame(port: int | None, error: str | None = None) -> bytes:
    doc = {"error": error} if error is not None else {"port": port}
    return call_frame(0, HELLO, "", json.dumps(doc).encode())


def stop_frame(grace_s: float) -> bytes:
    return answer_frame(0, STOP, repr(float(grace_s)).encode())


def parse_hello(call: Call) -> int:
    """The port a front bound, from its hello.

    Raises:
        FrameError: not a hello, or a malformed one.
        OSError: the front could not bind (its reason).
    """
    if call.rpc != HELLO or call.call_id != 0:
        raise FrameError(f"a front's first frame must be its hello, got rpc {call.rpc}")
    try:
        doc = json.loads(call.message)
    except ValueError as e:
        raise FrameError(f"a front's hello is not JSON: {e}") from e
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        raise OSError(doc["error"])
    port = doc.get("port") if isinstance(doc, dict) else None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise FrameError(f"a front's hello names no port: {doc!r}")
    return port


class FrameReader:
    """Frames out of a byte stream fed in pieces: :meth:`feed` the bytes received, get the
    frames they complete. Frames longer than ``max_frame`` bytes raise :class:`FrameError`
    (before their bytes are buffered)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of a frame received but not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes | memoryview) -> list[memoryview]:
        """The frames (bodies, without their length) that ``data`` completes, in order."""
        self._buf += data
        out: list[memoryview] = []
        buf, pos, n = self._buf, 0, len(self._buf)
        while n - pos >= _LEN.size:
            (length,) = _LEN.unpack_from(buf, pos)
            if length > self.max_frame:
                raise FrameError(f"a frame of {length} bytes exceeds the {self.max_frame} allowed")
            if n - pos - _LEN.size < length:
                break
            start = pos + _LEN.size
            out.append(memoryview(bytes(buf[start : start + length])))
            pos = start + length
        if pos:
            del self._buf[:pos]
        return out


def decode_call(frame: memoryview) -> Call:
    """A call (or hello) frame's fields.

    Raises:
        FrameError: too short for its header and peer, or an rpc byte out of range.
    """
    if len(frame) < _CALL.size:
        raise FrameError(f"a call frame of {len(frame)} bytes is shorter than its header")
    call_id, rpc, peer_len = _CALL.unpack_from(frame, 0)
    if rpc >= len(RPC_NAMES) and rpc != HELLO:
        raise FrameError(f"unknown rpc {rpc} in a call frame")
    if (rpc == HELLO) != (call_id == 0):
        raise FrameError(f"call id {call_id} with rpc {rpc}: only a hello has call id 0")
    end = _CALL.size + peer_len
    if len(frame) < end:
        raise FrameError(f"a call frame of {len(frame)} bytes is shorter than its peer")
    peer = bytes(frame[_CALL.size : end]).decode("utf-8", "replace")
    return Call(call_id, rpc, peer, bytes(frame[end:]))


def decode_answer(frame: memoryview) -> Answer:
    """An answer (or stop) frame's fields.

    Raises:
        FrameError: shorter than its header.
    """
    if len(frame) < _ANSWER.size:
        raise FrameError(f"an answer frame of {len(frame)} bytes is shorter than its header")
    call_id, code = _ANSWER.unpack_from(frame, 0)
    return Answer(call_id, code, bytes(frame[_ANSWER.size :]))


def grpc_target(host: str, port: int) -> str:
    """``host:port`` as grpcio binds and dials it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
