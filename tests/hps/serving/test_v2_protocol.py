"""The v2 protocol codec on its own: JSON and binary inputs, outputs read back by tritonclient's
own parser, and every malformed request rejected with a message naming what is wrong."""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest
import tritonclient.http as th

from hps.serving.v2_protocol import ProtocolError, encode_infer_response, parse_infer_request


def _client_body(
    inputs: list[th.InferInput], outputs: list[th.InferRequestedOutput] | None = None
) -> tuple[bytes, int | None]:
    """The exact body tritonclient.http sends (its own request builder)."""
    body, json_size = th.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    return body, json_size


def _input(name: str, arr: np.ndarray, dt: str, binary: bool) -> th.InferInput:
    x = th.InferInput(name, list(arr.shape), dt)
    x.set_data_from_numpy(arr, binary_data=binary)
    return x


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_request_round_trips(binary: bool) -> None:
    dense = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    ids = np.array([[5, -1], [2**40, 3]], dtype=np.int64)
    small = np.array([[1], [2]], dtype=np.int32)
    body, n = _client_body(
        [
            _input("dense", dense, "FP32", binary),
            _input("ids", ids, "INT64", binary),
            _input("small", small, "INT32", not binary),
        ]
    )
    req = parse_infer_request(body, n)
    assert list(req.inputs) == ["dense", "ids", "small"]
    assert req.inputs["dense"].dtype == np.float32 and np.array_equal(req.inputs["dense"], dense)
    assert req.inputs["ids"].dtype == np.int64 and np.array_equal(req.inputs["ids"], ids)
    assert req.inputs["small"].dtype == np.int32 and np.array_equal(req.inputs["small"], small)
    assert req.outputs is None and req.binary_output  # tritonclient names no outputs → binary


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_bodies(encoding: str, compress) -> None:
    dense = np.ones((1, 4), dtype=np.float32)
    body, n = _client_body([_input("dense", dense, "FP32", True)])
    req = parse_infer_request(compress(body), n, encoding)
    assert np.array_equal(req.inputs["dense"], dense)


def test_nested_json_data_and_outputs() -> None:
    doc = {
        "id": "r1",
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}],
        "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": True}}],
    }
    req = parse_infer_request(json.dumps(doc).encode())
    assert req.inputs["x"].tolist() == [[1, 2], [3, 4]] and req.id == "r1"
    results = {
        "a": np.array([1.5, -2.0], dtype=np.float32),
        "b": np.array([[7], [8]], dtype=np.int64),
        "c": np.zeros(3, dtype=np.float32),
    }
    body, headers = encode_infer_response("m", "1", results, req)
    res = th.InferResult.from_response_body(
        body, header_length=int(headers["Inference-Header-Content-Length"])
    )
    assert np.array_equal(res.as_numpy("a"), results["a"]) and res.as_numpy("a").dtype == np.float32
    assert np.array_equal(res.as_numpy("b"), results["b"]) and res.as_numpy("b").dtype == np.int64
    assert res.as_numpy("c") is None  # not asked for
    out = res.get_response()
    assert out["id"] == "r1" and out["model_name"] == "m" and "data" in out["outputs"][0]
    assert out["outputs"][1]["parameters"]["binary_data_size"] == 16


def test_all_outputs_json_when_not_binary() -> None:
    req = parse_infer_request(b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}')
    body, headers = encode_infer_response("m", "1", {"y": np.array([0.25], dtype=np.float32)}, req)
    assert "Inference-Header-Content-Length" not in headers
    assert json.loads(body)["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1], "data": [0.25]}
    ]


def _raw(inputs: list[dict], extra: bytes = b"", **doc) -> tuple[bytes, int | None]:
    head = json.dumps({"inputs": inputs, **doc}).encode()
    return head + extra, (len(head) if extra else None)


_X = {"name": "x", "shape": [2], "datatype": "FP32"}
BAD = [
    (b"{not json", None, "malformed"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"inputs": []}', None, "non-empty 'inputs'"),
    (*_raw([{**_X, "datatype": "FP8", "data": [1, 2]}]), "datatype 'FP8'"),
    (*_raw([{**_X, "shape": [2, -1], "data": [1, 2]}]), "must not be negative"),
    (*_raw([{**_X, "shape": "2", "data": [1, 2]}]), "list of integers"),
    (*_raw([{**_X, "data": [1, 2, 3]}]), "needs 2 values, data has 3"),
    (*_raw([{**_X, "data": [[1], [2, 3]]}]), "not a regular array"),
    (*_raw([{**_X, "data": ["a", "b"]}]), "must hold numbers"),
    (*_raw([{**_X, "datatype": "INT32", "data": [1.5, 2]}]), "non-integer"),
    (*_raw([{**_X, "datatype": "INT32", "data": [2**40, 1]}]), "out of range for INT32"),
    (*_raw([_X]), "neither 'data' nor"),
    (*_raw([{**_X, "data": [1, 2]}, {**_X, "data": [1, 2]}]), "given twice"),
    (*_raw([{**_X, "parameters": {"binary_data_size": 4}}], b"\0" * 4), "needs 8 bytes"),
    (*_raw([{**_X, "parameters": {"binary_data_size": 8}}], b"\0" * 4), "carries 4 bytes"),
    (
        *_raw([{**_X, "parameters": {"binary_data_size": 8}}], b"\0" * 12),
        "4 bytes after the JSON header",
    ),
    (
        *_raw([{**_X, "data": [1, 2], "parameters": {"binary_data_size": 8}}], b"\0" * 8),
        "both 'data'",
    ),
    (*_raw([{**_X, "data": [1, 2]}], outputs={"name": "y"}), "'outputs' must be a list"),
    (
        *_raw([{**_X, "parameters": {"binary_data_size": True}}], b"\0"),
        "non-negative integer, got True",
    ),
    (
        *_raw([{**_X, "datatype": "INT64", "data": [2**63, -1]}]),
        r"value 9223372036854775808 is out of range for INT64",
    ),
    (
        *_raw([{**_X, "datatype": "INT64", "data": [2**64 + 5, 1]}]),
        r"value 18446744073709551621 is out of range for INT64",
    ),
    (
        *_raw([{**_X, "datatype": "UINT8", "data": [-1, 2**70]}]),
        r"value -1 is out of range for UINT8",
    ),
    (
        *_raw([{**_X, "datatype": "INT64", "data": [1.5, 2**64]}]),
        r"non-integer values .*\(e\.g\. 1\.5\)",
    ),
    (b'{"inputs": ' + b"[" * 100000 + b"]" * 100000 + b"}", None, "nested too deeply"),
    (
        json.dumps({"inputs": [{**_X, "data": [1, 2]}]})
        .replace("[1, 2]", "[" * 3000 + "1" + "]" * 3000)
        .encode(),
        None,
        "nested too deeply",
    ),
    (
        *_raw(
            [{**_X, "data": [1, 2]}],
            outputs=[{"name": "y", "parameters": {"binary_data": "false"}}],
        ),
        r"outputs\[0\]\.parameters\.binary_data must be true or false, got 'false'",
    ),
    (
        *_raw([{**_X, "data": [1, 2]}], parameters={"binary_data_output": 1}),
        r"parameters\.binary_data_output must be true or false, got 1",
    ),
    # numpy would read true/false as 1/0 and serve real rows for them
    (
        *_raw([{**_X, "datatype": "INT64", "data": [True, False]}]),
        r"holds true/false for datatype INT64",
    ),
    (
        *_raw([{**_X, "datatype": "INT64", "data": [1, True]}]),
        r"holds true/false for datatype INT64",
    ),
    (
        *_raw([{**_X, "shape": [2, 2], "data": [[0.5, 1.0], [2.0, False]]}]),
        r"holds true/false for datatype FP32",
    ),
]


def test_a_bool_input_keeps_its_booleans() -> None:
    body, n = _raw(
        [{"name": "mask", "shape": [3], "datatype": "BOOL", "data": [True, False, True]}]
    )
    assert parse_infer_request(body, n).inputs["mask"].tolist() == [True, False, True]


@pytest.mark.parametrize("body,n,match", BAD, ids=[m[:60] for *_, m in BAD])
def test_malformed_requests_name_the_problem(body: bytes, n: int | None, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_infer_request(body, n)


def test_bad_headers() -> None:
    body, _ = _raw([{**_X, "data": [1, 2]}])
    with pytest.raises(ProtocolError, match="must be an integer"):
        parse_infer_request(body, "ten")
    with pytest.raises(ProtocolError, match="outside the body"):
        parse_infer_request(body, len(body) + 1)
    with pytest.raises(ProtocolError, match="not valid gzip"):
        parse_infer_request(body, None, "gzip")
    with pytest.raises(ProtocolError, match="unsupported Content-Encoding 'br'"):
        parse_infer_request(body, None, "br")


def test_unknown_output_is_an_error() -> None:
    req = parse_infer_request(_raw([{**_X, "data": [1, 2]}], outputs=[{"name": "nope"}])[0])
    with pytest.raises(ProtocolError, match="unknown output 'nope'"):
        encode_infer_response("m", "1", {"y": np.zeros(1, dtype=np.float32)}, req)


def test_decompressed_size_is_limited() -> None:
    """A small gzip body that expands past the limit is refused without expanding it all."""
    head = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    bomb = gzip.compress(head.encode() + b" " * (8 << 20))
    assert len(bomb) < 64 << 10
    with pytest.raises(
        ProtocolError, match="decompresses to more than the server's limit of 1048576"
    ):
        parse_infer_request(bomb, None, "gzip", max_bytes=1 << 20)
    assert parse_infer_request(
        gzip.compress(head.encode()), None, "gzip", max_bytes=1 << 20
    ).inputs["x"].tolist() == [1.0]
    with pytest.raises(ProtocolError, match="truncated stream"):
        parse_infer_request(gzip.compress(head.encode())[:-9], None, "gzip")


def test_huge_declared_shapes_and_empty_data() -> None:
    body, n = _raw(
        [
            {
                "name": "x",
                "shape": [2**62, 4],
                "datatype": "INT64",
                "parameters": {"binary_data_size": 0},
            }
        ],
        b"",
    )
    with pytest.raises(ProtocolError, match="needs 147573952589676412928 bytes"):
        parse_infer_request(body, n)
    with pytest.raises(ProtocolError, match="needs 18446744073709551616 values"):
        parse_infer_request(
            _raw([{"name": "x", "shape": [2**32, 2**32], "datatype": "FP32", "data": [1]}])[0]
        )
    req = parse_infer_request(
        _raw([{"name": "ids", "shape": [0, 1], "datatype": "INT64", "data": []}])[0]
    )
    assert req.inputs["ids"].shape == (0, 1) and req.inputs["ids"].dtype == np.int64


def test_data_that_recurses_while_converting_is_a_protocol_error() -> None:
    from hps.serving.v2_protocol import _json_data

    class Deep:  # np.asarray recursing without end (JSON itself is bounded by json.loads)
        def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
            return np.asarray(self)

    with pytest.raises(ProtocolError, match="input 'x'.data is nested too deeply"):
        _json_data(Deep(), np.dtype("<f4"), (1,), "input 'x'")
