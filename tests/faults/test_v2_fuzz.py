"""Random v2 ``/infer`` request bodies against the real server (``python -m hps.server`` in a
subprocess): raw random bytes, byte-level mutations of valid JSON and binary-tensor requests,
and valid requests with fields set to random JSON or removed, each with or without the binary
extension's ``Inference-Header-Content-Length`` and a ``Content-Encoding``. Every answer is a 200 (a
mutation can still be a valid request) or a 4xx ``{"error": "..."}``: never a 5xx, never a
dropped connection; afterwards the server is live and scores a valid request correctly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embark.models.dlrm import DLRM
from tests.hps.serving.tiny_dlrm import (
    CliServer,
    eager_logits,
    make_request,
    tiny_model,
    write_artifacts,
)
from tests.tolerances import tol

HEADER_LENGTH = "Inference-Header-Content-Length"
INFER = "/v2/models/tiny/infer"
NAMES = ["dense", *(f"ids_t{i}" for i in range(8)), "logits", "", "x" * 300]
DATATYPES = ["FP32", "INT64", "INT32", "BOOL", "FP16", "FP64", "UINT64", "INT8", "BYTES", "fp32"]


@pytest.fixture(scope="module")
def model() -> DLRM:
    return tiny_model()


@pytest.fixture(scope="module")
def server(model: DLRM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    art = write_artifacts(model, tmp_path_factory.mktemp("serving"))
    with CliServer(Path(art) / "ps.json", "--workers", "2", "--max-request-mb", "1") as srv:
        yield srv
    assert srv.returncode == 0, srv.output
    assert "Traceback" not in srv.output, srv.output


@pytest.fixture(scope="module")
def http(server: CliServer) -> Iterator[httpx.Client]:
    """One kept-alive connection for every example: a request that breaks the connection's
    state shows as a dropped connection on the next one."""
    with httpx.Client(base_url=f"http://{server.address}", timeout=60) as c:
        yield c


def _json_body(req: dict[str, np.ndarray]) -> bytes:
    inputs = [
        {
            "name": k,
            "shape": list(v.shape),
            "datatype": "FP32" if v.dtype == np.float32 else "INT64",
            "data": v.reshape(-1).tolist(),
        }
        for k, v in req.items()
    ]
    return json.dumps({"inputs": inputs}).encode()


def _binary_body(req: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """The binary-extension body of ``req`` and its JSON header's length."""
    inputs = [
        {
            "name": k,
            "shape": list(v.shape),
            "datatype": "FP32" if v.dtype == np.float32 else "INT64",
            "parameters": {"binary_data_size": v.nbytes},
        }
        for k, v in req.items()
    ]
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(v.tobytes() for v in req.values()), len(head)


_scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
# What a mutation may set a field of a request to: a value of its own kind (often out of
# range), or any JSON.
_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "name": st.sampled_from(NAMES),
    "shape": st.lists(st.integers(-2, 2**66), max_size=4),
    "datatype": st.sampled_from(DATATYPES),
    "data": st.lists(st.lists(st.integers(-(2**65), 2**65) | st.floats(), max_size=14), max_size=4),
    "parameters": st.fixed_dictionaries(
        {}, optional={"binary_data_size": st.integers(-2, 300), "binary_data": _json}
    ),
    "outputs": st.lists(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["logits", "probability", "x"])},
            optional={"parameters": st.fixed_dictionaries({"binary_data": _json})},
        ),
        max_size=3,
    ),
}
_INPUT_FIELDS = ["name", "shape", "datatype", "data", "parameters"]
_TOP_FIELDS = ["inputs", "outputs", "id", "parameters"]


@dataclass(frozen=True)
class _Valid:
    """A valid request in both encodings: ``binary`` starts with ``head`` bytes of JSON."""

    tensors: dict[str, np.ndarray]
    json: bytes
    binary: bytes
    head: int


# One edit of a valid body: (where, as a fraction of its length; what; the bytes).
_Edit = tuple[float, str, bytes]
_edits = st.lists(
    st.tuples(
        st.floats(0, 1),
        st.sampled_from(["replace", "insert", "cut"]),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=4,
)


def _mutate(body: bytes, edits: list[_Edit]) -> bytes:
    """``body`` with random bytes replaced, inserted or cut."""
    out = bytearray(body)
    for where, edit, chunk in edits:
        at = int(where * len(out))
        if edit == "replace":
            out[at : at + len(chunk)] = chunk
        elif edit == "insert":
            out[at:at] = chunk
        else:
            del out[at : at + len(chunk)]
    return bytes(out)


@st.composite
def _headers(draw: st.DrawFn, body_len: int) -> dict[str, str]:
    """Random binary-extension and encoding headers for a body of ``body_len`` bytes."""
    h: dict[str, str] = {}
    if draw(st.booleans()):
        n = st.integers(-2, body_len + 2).map(str)
        h[HEADER_LENGTH] = draw(n | st.text("0123456789+-_x", min_size=1, max_size=6))
    if draw(st.integers(0, 3)) == 0:
        h["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "identity", "br"]))
    return h


@st.composite
def _document(draw: st.DrawFn, valid: _Valid) -> tuple[bytes, dict[str, str]]:
    """A valid request's JSON (either encoding) with one to three fields set to random values
    or removed: an input's name, shape, datatype, data or parameters, or a top-level field."""
    binary = draw(st.booleans())
    doc = json.loads(valid.binary[: valid.head] if binary else valid.json)
    for _ in range(draw(st.integers(1, 3))):
        target, field = doc, draw(st.sampled_from(["input", "input", "input", *_TOP_FIELDS]))
        if field == "input":
            inputs = doc.get("inputs")
            if not isinstance(inputs, list) or not inputs:
                continue
            target = inputs[draw(st.integers(0, len(inputs) - 1))]
            if not isinstance(target, dict):
                continue
            field = draw(st.sampled_from(_INPUT_FIELDS))
        if draw(st.integers(0, 4)) == 0:
            target.pop(field, None)
        else:
            target[field] = draw(_FIELD_VALUES.get(field, _json) | _json)
    head = json.dumps(doc).encode()
    if binary:
        return head + valid.binary[valid.head :], {HEADER_LENGTH: str(len(head))}
    return head, {}


@st.composite
def _requests(draw: st.DrawFn, valid: _Valid) -> tuple[str, bytes, dict[str, str]]:
    """``(kind, body, headers)``: kind ``random`` must get a 4xx; the others 200 or 4xx."""
    kind = draw(st.sampled_from(["random", "mutated", "document", "document"]))
    if kind == "mutated":
        if draw(st.booleans()):
            return kind, _mutate(valid.binary, draw(_edits)), {HEADER_LENGTH: str(valid.head)}
        return kind, _mutate(valid.json, draw(_edits)), {}
    if kind == "document":
        body, headers = draw(_document(valid))
    else:
        body, headers = draw(st.binary(max_size=2048)), {}
    return kind, body, {**headers, **draw(_headers(len(body)))}


def _error_of(r: httpx.Response) -> Any:
    try:
        return r.json().get("error")
    except (ValueError, AttributeError):
        return None


@pytest.fixture(scope="module")
def valid(model: DLRM) -> _Valid:
    tensors = make_request(model, 2, seed=3)
    binary, head = _binary_body(tensors)
    return _Valid(tensors, _json_body(tensors), binary, head)


def _check_answer(http: httpx.Client, kind: str, body: bytes, headers: dict[str, str]) -> None:
    r = http.post(INFER, content=body, headers=headers)  # a dropped connection raises here
    seen = (r.status_code, r.text[:300], body[:300], headers)
    assert r.status_code < 500, seen
    if r.status_code != 200 or kind == "random":
        assert 400 <= r.status_code < 500, seen
        error = _error_of(r)
        assert isinstance(error, str) and error, seen


def test_random_request_bodies_get_a_clear_4xx_and_the_server_lives(
    http: httpx.Client, server: CliServer, model: DLRM, valid: _Valid
) -> None:
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(request=_requests(valid))
    def answered_clearly(request: tuple[str, bytes, dict[str, str]]) -> None:
        _check_answer(http, *request)

    answered_clearly()
    assert http.get("/v2/health/live").status_code == 200
    r = http.post(INFER, content=valid.json)
    assert r.status_code == 200, r.text
    logits = next(o for o in r.json()["outputs"] if o["name"] == "logits")["data"]
    np.testing.assert_allclose(
        np.array(logits, np.float32), eager_logits(model, valid.tensors), **tol("served")
    )
    assert server.alive()
