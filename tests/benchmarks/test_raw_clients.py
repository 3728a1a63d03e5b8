"""``bench_server``'s cheapest clients (``benchmarks.hps.raw_clients``): the HTTP request
bytes parse, with the server's own parser, into exactly the tensors they were built from; the
connection reads answers split across reads and kept-alive answers back to back; the checks
refuse an answer that differs in status, description, sizes or one logit's bytes."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from benchmarks.hps.raw_clients import (
    HttpConnection,
    check_http_answer,
    check_raw_answer,
    http_raw_client,
    http_request_bytes,
    raw_request_bytes,
)
from hps.serving.v2_protocol import InferRequest, encode_infer_response, parse_infer_request


def _request() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "dense": rng.standard_normal((4, 13), dtype=np.float32),
        "ids_t0": rng.integers(0, 100, (4, 2)),
        "ids_t1": rng.integers(0, 100, (4, 1)),
    }


def _split_http(data: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    first, *lines = head.decode().split("\r\n")
    return first, {k.lower(): v for k, v in (x.split(": ", 1) for x in lines)}, body


def test_http_request_bytes_parse_into_the_same_tensors_with_binary_outputs() -> None:
    req = _request()
    first, headers, body = _split_http(http_request_bytes(req, "127.0.0.1:8000"))
    assert first == "POST /v2/models/dlrm/infer HTTP/1.1"
    assert headers["host"] == "127.0.0.1:8000"
    assert int(headers["content-length"]) == len(body)
    parsed = parse_infer_request(body, headers["inference-header-content-length"])
    assert list(parsed.inputs) == list(req)
    for name, arr in req.items():
        assert parsed.inputs[name].dtype == arr.dtype
        np.testing.assert_array_equal(parsed.inputs[name], arr)
    assert parsed.datatypes == {"dense": "FP32", "ids_t0": "INT64", "ids_t1": "INT64"}
    assert parsed.binary_output is True and parsed.outputs is None


def _answer(logits: np.ndarray) -> tuple[int, dict[str, str], bytes]:
    """An answer as the server encodes it (every output binary)."""
    req = InferRequest({}, {}, None, True)
    prob = (1 / (1 + np.exp(-logits))).astype(np.float32)
    body, headers = encode_infer_response("dlrm", "1", {"logits": logits, "probability": prob}, req)
    return 200, {k.lower(): v for k, v in headers.items()}, body


def test_check_http_answer_takes_the_right_answer_and_names_each_difference() -> None:
    want = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    status, headers, body = _answer(want)
    check_http_answer(status, headers, body, want)
    with pytest.raises(AssertionError, match="status 503"):
        check_http_answer(503, headers, body, want)
    with pytest.raises(AssertionError, match="logits differ"):
        other = want.copy()
        other[1] = np.nextafter(other[1], np.float32(0))  # one ulp, one sample
        check_http_answer(status, headers, body, other)
    with pytest.raises(AssertionError, match="describes outputs"):
        check_http_answer(status, headers, body, want[:2])
    with pytest.raises(AssertionError, match="do not add up"):
        check_http_answer(status, headers, body + b"\0", want)
    with pytest.raises(AssertionError, match="outside"):
        check_http_answer(status, {**headers, "inference-header-content-length": "0"}, body, want)


def test_check_raw_answer_takes_the_right_grpc_answer_and_refuses_one_ulp() -> None:
    import hps.serving.protos.grpc_predict_v2_pb2 as pb

    assert pb.ModelInferRequest.FromString(raw_request_bytes(_request())).model_name == "dlrm"
    want = np.array([0.5, -1.25], dtype=np.float32)
    resp = pb.ModelInferResponse(model_name="dlrm")
    for name in ("logits", "probability"):
        resp.outputs.add(name=name, datatype="FP32", shape=[2])
    resp.raw_output_contents.extend([want.tobytes(), want.tobytes()])
    check_raw_answer(resp.SerializeToString(), want)
    with pytest.raises(AssertionError, match="logits differ"):
        check_raw_answer(resp.SerializeToString(), want + np.float32(1))


def _serve(listener: socket.socket, conversations: list[list[bytes]]) -> None:
    """Accept one connection per conversation; in each, per chunk list entry: read one
    request's head, then send the entry (its own segment: TCP_NODELAY); then close."""
    for chunks in conversations:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for c in chunks:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                conn.sendall(c)


def _connection_answering(
    conversations: list[list[bytes]],
) -> tuple[HttpConnection, threading.Thread, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=_serve, args=(listener, conversations), daemon=True)
    t.start()
    conn = HttpConnection(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=10)
    return conn, t, listener


ONE = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nX-A: b\r\n\r\nhello"
TWO = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\nno"
GET = b"GET / HTTP/1.1\r\n\r\n"


def test_http_connection_reads_split_answers_and_two_answers_sent_as_one() -> None:
    # the first answer in three pieces (one inside the head), the second glued to its end
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        c, _ = listener.accept()
        with c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(4096)
            for p in (ONE[:10], ONE[10:40], ONE[40:] + TWO):
                c.sendall(p)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    conn = HttpConnection(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=10)
    try:
        assert conn.call(GET) == (200, {"content-length": "5", "x-a": "b"}, b"hello")
        assert conn.call(GET) == (400, {"content-length": "2"}, b"no")  # already received
        assert conn.reconnects == 0
    finally:
        conn.close()
        t.join(10)
        listener.close()


def test_a_connection_the_server_closed_idle_is_opened_again_once() -> None:
    conn, t, listener = _connection_answering([[ONE], [TWO]])
    try:
        assert conn.call(GET)[0] == 200  # then the server closes the connection
        assert conn.call(GET) == (400, {"content-length": "2"}, b"no")  # on a new one
        assert conn.reconnects == 1
        t.join(10)
        listener.close()
        with pytest.raises(ConnectionError):  # closed again, and nothing listens now
            conn.call(GET)
    finally:
        conn.close()
        t.join(10)
        listener.close()


def test_http_connection_refuses_an_answer_without_content_length() -> None:
    conn, t, listener = _connection_answering([[b"HTTP/1.1 200 OK\r\nX: y\r\n\r\nbody"]])
    try:
        with pytest.raises(ConnectionError, match="without Content-Length"):
            conn.call(GET)
    finally:
        conn.close()
        t.join(10)
        listener.close()


def _http_answer_bytes(logits: np.ndarray) -> bytes:
    status, headers, body = _answer(logits)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"HTTP/1.1 {status} OK\r\n{head}content-length: {len(body)}\r\n\r\n".encode() + body


class _Start:
    """The cell's start barrier, as far as the client uses it."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_the_http_raw_client_checks_every_answer_first_then_compares_bytes() -> None:
    reqs = [_request(), {k: v[:2] for k, v in _request().items()}]
    wants = [np.array([0.5, 1, 2, 3], np.float32), np.array([-1, 4], np.float32)]
    answers = [_http_answer_bytes(w) for w in wants]
    listener = socket.create_server(("127.0.0.1", 0))
    # the checking connection: both answers; client 0's connection: answer 1, then a wrong one
    wrong = _http_answer_bytes(np.array([-1, 5], np.float32))
    t = threading.Thread(
        target=_serve, args=(listener, [answers, [answers[1], wrong]]), daemon=True
    )
    t.start()
    start = _Start()
    try:
        sender, right = http_raw_client(
            f"127.0.0.1:{listener.getsockname()[1]}", reqs, wants, start
        )
        send = sender(0)
        assert right(1, send(1)) and not right(1, send(1))
        assert not start.aborted
    finally:
        t.join(10)
        listener.close()


def test_the_http_raw_client_aborts_the_cell_on_a_wrong_first_answer() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    answer = _http_answer_bytes(np.array([0.5, 1, 2, 9], np.float32))
    t = threading.Thread(target=_serve, args=(listener, [[answer]]), daemon=True)
    t.start()
    start = _Start()
    try:
        with pytest.raises(AssertionError, match="logits differ"):
            http_raw_client(
                f"127.0.0.1:{listener.getsockname()[1]}",
                [_request()],
                [np.array([0.5, 1, 2, 3], np.float32)],
                start,
            )
        assert start.aborted  # the parent's wait fails at once instead of timing out
    finally:
        t.join(10)
        listener.close()
