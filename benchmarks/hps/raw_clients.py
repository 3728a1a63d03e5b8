"""The cheapest clients Python allows, for ``bench_server``'s concurrency cells: each request
serialized once, each answer compared byte for byte with an answer that was parsed and checked
in full before the cell. A C++ load generator such as Triton's perf_analyzer costs the host
little per request; tritonclient costs 300–800 µs of CPU per call here, on the 2 cores the
server also runs on, so these clients show what the server does when its clients are cheap.

- ``grpc-raw``: ``ModelInferRequest`` bytes through one generic grpcio method with no
  (de)serializers (:func:`raw_request_bytes`, :func:`check_raw_answer`).
- ``http-raw``: a whole HTTP/1.1 request (headers and the binary tensor extension's body) sent
  with one ``sendall`` on a kept-alive socket, the answer read by its ``Content-Length``
  (:func:`http_request_bytes`, :class:`HttpConnection`, :func:`check_http_answer`).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "HttpConnection",
    "check_http_answer",
    "check_raw_answer",
    "grpc_raw_client",
    "http_raw_client",
    "http_request_bytes",
    "raw_request_bytes",
]

_MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_HEADER_LENGTH = "Inference-Header-Content-Length"


def raw_request_bytes(req: dict[str, np.ndarray]) -> bytes:
    """The serialized ``ModelInferRequest`` of ``req`` for model ``dlrm``, raw tensors, as
    ``tritonclient.grpc`` sends it."""
    import hps.serving.protos.grpc_predict_v2_pb2 as pb

    msg = pb.ModelInferRequest(model_name="dlrm")
    for name, arr in req.items():
        dt = "FP32" if arr.dtype == np.float32 else "INT64"
        msg.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        msg.raw_input_contents.append(np.ascontiguousarray(arr).tobytes())
    return msg.SerializeToString()


def check_raw_answer(data: bytes, want: np.ndarray) -> None:
    """Parse a ``ModelInferResponse`` in full and check it holds ``logits`` equal to ``want``
    (FP32, its shape, its bytes) and ``probability`` of the same shape, FP32; raise
    ``AssertionError`` saying what differs."""
    import hps.serving.protos.grpc_predict_v2_pb2 as pb

    resp = pb.ModelInferResponse.FromString(data)
    got = [(o.name, o.datatype, list(o.shape)) for o in resp.outputs]
    shape = list(want.shape)
    if got != [("logits", "FP32", shape), ("probability", "FP32", shape)]:
        raise AssertionError(f"answer describes outputs {got}, expected logits, probability")
    raw = list(resp.raw_output_contents)
    if resp.model_name != "dlrm" or len(raw) != 2 or len(raw[1]) != 4 * want.size:
        raise AssertionError(f"answer of model {resp.model_name!r} has {len(raw)} raw outputs")
    if raw[0] != want.astype("<f4").tobytes():
        raise AssertionError("answer's logits differ from the servable's own scores")


def http_request_bytes(req: dict[str, np.ndarray], host: str) -> bytes:
    """The whole HTTP/1.1 ``POST /v2/models/dlrm/infer`` of ``req`` (request line, headers,
    body) in the binary tensor extension, every output asked for as binary data, as
    ``tritonclient.http`` sends it with ``binary_data=True``; ``host`` the ``Host`` header."""
    inputs, blobs = [], []
    for name, arr in req.items():
        raw = np.ascontiguousarray(arr).tobytes()
        dt = "FP32" if arr.dtype == np.float32 else "INT64"
        inputs.append(
            {
                "name": name,
                "shape": list(arr.shape),
                "datatype": dt,
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        blobs.append(raw)
    head = json.dumps(
        {"inputs": inputs, "parameters": {"binary_data_output": True}}, separators=(",", ":")
    ).encode()
    body = b"".join([head, *blobs])
    lines = [
        "POST /v2/models/dlrm/infer HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/octet-stream",
        f"{_HEADER_LENGTH}: {len(head)}",
        f"Content-Length: {len(body)}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class HttpConnection:
    """One kept-alive HTTP/1.1 connection (``TCP_NODELAY``): :meth:`call` sends a whole
    request and returns the answer's ``(status, headers, body)``. A connection the server
    closed before any byte of the answer came (an idle connection past the server's header
    deadline, say) is opened again and the request sent once more, as HTTP clients do with
    kept-alive connections; a connection closed mid-answer, or an answer without
    ``Content-Length``, raises ``ConnectionError``."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.reconnects = 0
        self._open()

    def _open(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def call(self, request: bytes) -> tuple[int, dict[str, str], bytes]:
        try:
            self.sock.sendall(request)
            first = self._buf or self._recv()
        except ConnectionError:  # closed before any byte of the answer: open again, once
            self.sock.close()
            self._open()
            self.reconnects += 1
            self.sock.sendall(request)
            first = self._recv()
        return self._answer(first)

    def _answer(self, buf: bytes) -> tuple[int, dict[str, str], bytes]:
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv()
        head, buf = buf[:end].decode("latin-1"), buf[end + 4 :]
        status_line, *header_lines = head.split("\r\n")
        headers = {}
        for line in header_lines:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" not in headers:
            raise ConnectionError(f"answer without Content-Length: {status_line!r}")
        n = int(headers["content-length"])
        while len(buf) < n:
            buf += self._recv()
        self._buf = buf[n:]
        return int(status_line.split()[1]), headers, buf[:n]

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def close(self) -> None:
        self.sock.close()


def check_http_answer(status: int, headers: dict[str, str], body: bytes, want: np.ndarray) -> None:
    """Parse an ``/infer`` answer in full and check it is a 200 holding ``logits`` equal to
    ``want`` (FP32, its shape, its bytes) and ``probability`` of the same shape, FP32, both
    binary; raise ``AssertionError`` saying what differs."""
    if status != 200:
        raise AssertionError(f"answer status {status}: {body[:200]!r}")
    n_json = int(headers.get(_HEADER_LENGTH.lower(), "-1"))
    if not 0 < n_json <= len(body):
        raise AssertionError(f"answer's {_HEADER_LENGTH} {n_json} outside its {len(body)} bytes")
    doc = json.loads(body[:n_json])
    shape = list(want.shape)
    outs = doc.get("outputs", [])
    got = [(o.get("name"), o.get("datatype"), o.get("shape")) for o in outs]
    if doc.get("model_name") != "dlrm" or got != [
        ("logits", "FP32", shape),
        ("probability", "FP32", shape),
    ]:
        raise AssertionError(f"answer describes outputs {got}, expected logits, probability")
    sizes = [o.get("parameters", {}).get("binary_data_size") for o in outs]
    if sizes != [4 * want.size] * 2 or n_json + sum(sizes) != len(body):
        raise AssertionError(f"answer's binary sizes {sizes} do not add up to its body")
    if body[n_json : n_json + sizes[0]] != want.astype("<f4").tobytes():
        raise AssertionError("answer's logits differ from the servable's own scores")


def http_raw_client(
    address: str,
    reqs: list[dict[str, np.ndarray]],
    wants: list[np.ndarray],
    start: Any,
) -> tuple[Callable[[int], Callable[[int], bytes]], Callable[[int, bytes], bool]]:
    """``(sender, right)`` for a cell's closed loop: every distinct answer is parsed and
    checked in full first (:func:`check_http_answer`, on a connection of its own) and its body
    kept; ``sender(k)`` opens client ``k``'s connection, whose sends return the answer's body
    (a status other than 200 raises), and ``right`` compares that with the kept body. A failed
    check aborts ``start``, so the parent's wait fails at once instead of timing out."""
    requests = [http_request_bytes(r, address) for r in reqs]
    expected = []
    first = HttpConnection(address)
    try:
        for data, want in zip(requests, wants, strict=True):
            status, headers, body = first.call(data)
            check_http_answer(status, headers, body, want)
            expected.append(body)
    except BaseException:
        start.abort()
        raise
    finally:
        first.close()

    def sender(k: int) -> Callable[[int], bytes]:
        conn = HttpConnection(address)

        def send(j: int) -> bytes:
            status, _, body = conn.call(requests[j])
            if status != 200:
                raise RuntimeError(f"status {status}: {body[:200]!r}")
            return body

        return send

    return sender, lambda j, body: body == expected[j]


def grpc_raw_client(
    address: str,
    reqs: list[dict[str, np.ndarray]],
    wants: list[np.ndarray],
    start: Any,
) -> tuple[Callable[[int], Callable[[int], bytes]], Callable[[int, bytes], bool]]:
    """:func:`http_raw_client` over gRPC: each request serialized once
    (:func:`raw_request_bytes`) and sent through one generic grpcio method with no
    (de)serializers, on one channel the clients share; every distinct answer parsed and
    checked in full first (:func:`check_raw_answer`) and its bytes kept."""
    import grpc

    bodies = [raw_request_bytes(r) for r in reqs]
    channel = grpc.insecure_channel(address)  # open while the process lives
    call = channel.unary_unary(_MODEL_INFER)  # no (de)serializers: bytes in, bytes out
    expected = []
    try:
        for body, want in zip(bodies, wants, strict=True):
            data = call(body)
            check_raw_answer(data, want)
            expected.append(data)
    except BaseException:
        start.abort()
        channel.close()
        raise
    return (lambda k: lambda j: call(bodies[j])), (lambda j, data: data == expected[j])
