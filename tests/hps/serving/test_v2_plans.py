"""``/infer`` bodies sliced by their header's plan (:mod:`hps.serving.v2_plans`) parse to
exactly what the full parser gives, fail with exactly its errors, and only binary headers
become plans, at most ``MAX_PLANS`` of them."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import hps.serving.v2_plans as plans
from hps.serving.v2_plans import MAX_PLAN_HEADER_BYTES, parse_with_plans, plans_held
from hps.serving.v2_protocol import InferRequest, ProtocolError, parse_infer_request


@pytest.fixture(autouse=True)
def no_plans() -> Any:
    plans._plans.clear()
    yield
    plans._plans.clear()


def _body(
    arrays: dict[str, np.ndarray], extra: dict[str, Any] | None = None, json_input: str = ""
) -> tuple[bytes, str]:
    inputs, blobs = [], []
    for name, a in arrays.items():
        dt = {"float32": "FP32", "int64": "INT64", "int32": "INT32"}[str(a.dtype)]
        spec: dict[str, Any] = {"name": name, "shape": list(a.shape), "datatype": dt}
        if name == json_input:
            spec["data"] = a.reshape(-1).tolist()
        else:
            spec["parameters"] = {"binary_data_size": a.nbytes}
            blobs.append(a.tobytes())
        inputs.append(spec)
    head = json.dumps({"inputs": inputs, **(extra or {})}).encode()
    return head + b"".join(blobs), str(len(head))


def _arrays(seed: int, b: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense": rng.standard_normal((b, 4), dtype=np.float32),
        "ids_a": rng.integers(-1, 50, (b, 2)),
        "ids_b": rng.integers(0, 50, (b, 1)).astype(np.int32),
    }


def _same(got: InferRequest, want: InferRequest) -> None:
    assert list(got.inputs) == list(want.inputs)
    for name, a in want.inputs.items():
        g = got.inputs[name]
        assert (g.dtype, g.shape, g.flags.writeable) == (a.dtype, a.shape, a.flags.writeable)
        np.testing.assert_array_equal(g, a)
    assert got.datatypes == want.datatypes
    assert got.outputs == want.outputs and got.binary_output == want.binary_output
    assert got.id == want.id and got.parameters == want.parameters


EXTRAS = [
    None,
    {"parameters": {"binary_data_output": True}},
    {"outputs": [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "probability"}]},
    {"parameters": {"binary_data_output": False, "priority": 3, "tag": "x", "w": 0.5}},
]


@pytest.mark.parametrize("extra", EXTRAS)
def test_a_planned_body_parses_as_the_full_parser_parses_it(extra: dict[str, Any] | None) -> None:
    first, hl = _body(_arrays(0), extra)
    _same(parse_with_plans(first, hl, None, None, None), parse_infer_request(first, hl))
    assert plans_held() == 1
    for seed in (1, 2):  # new tensors under the same header: sliced by the plan
        body, hl2 = _body(_arrays(seed), extra)
        assert hl2 == hl and body[: int(hl)] == first[: int(hl)]
        got = parse_with_plans(bytearray(body), hl, None, None, None)  # as the server reads it
        _same(got, parse_infer_request(bytearray(body), hl))
        got.datatypes["dense"] = "changed"  # what a caller does to one request stays there
        got.parameters["changed"] = 1
        if got.outputs is not None:
            got.outputs.clear()
    assert plans_held() == 1
    _same(parse_with_plans(first, hl, None, None, None), parse_infer_request(first, hl))


def test_a_binary_part_of_another_length_gets_the_full_parsers_error() -> None:
    body, hl = _body(_arrays(0))
    parse_with_plans(body, hl, None, None, None)
    for bad in (body[:-1], body + b"\0"):
        with pytest.raises(ProtocolError) as want:
            parse_infer_request(bad, hl)
        with pytest.raises(ProtocolError) as got:
            parse_with_plans(bad, hl, None, None, None)
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize(
    "case",
    ["json tensor", "request id", "nested parameter", "gzip", "no header length", "too long"],
)
def test_only_binary_headers_without_an_id_become_plans(case: str) -> None:
    import gzip

    extra: dict[str, Any] = {}
    json_input, encoding = "", None
    if case == "json tensor":
        json_input = "ids_a"
    elif case == "request id":
        extra = {"id": "r1"}
    elif case == "nested parameter":
        extra = {"parameters": {"deep": {"x": 1}}}
    elif case == "too long":
        extra = {"parameters": {"pad": "x" * MAX_PLAN_HEADER_BYTES}}
    body, hl = _body(_arrays(0), extra, json_input)
    hl_arg: str | None = hl
    if case == "gzip":
        body, encoding = gzip.compress(body), "gzip"
    elif case == "no header length":
        body, hl_arg = (
            json.dumps(
                {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
            ).encode(),
            None,
        )
    for _ in range(2):
        got = parse_with_plans(body, hl_arg, encoding, None, None)
        _same(got, parse_infer_request(body, hl_arg, encoding))
    assert plans_held() == 0


def test_errors_are_the_full_parsers_and_leave_no_plan() -> None:
    body, hl = _body(_arrays(0))
    bad_bodies = [
        (body.replace(b'"FP32"', b'"FP99"'), hl),
        (body, "0"),
        (body, "x"),
        (body, str(len(body) + 1)),
    ]
    for b, h in bad_bodies:
        with pytest.raises(ProtocolError) as want:
            parse_infer_request(b, h)
        for _ in range(2):
            with pytest.raises(ProtocolError) as got:
                parse_with_plans(b, h, None, None, None)
            assert str(got.value) == str(want.value)
    with pytest.raises(ProtocolError, match="max-json-mb"):  # the JSON limit still holds
        parse_with_plans(body, hl, None, None, int(hl) - 1)
    assert plans_held() == 0


def test_plans_are_bounded_the_least_recently_used_goes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plans, "MAX_PLANS", 4)
    heads = {}
    for b in range(1, 8):  # each batch size its own header
        body, hl = _body(_arrays(b, b=b))
        parse_with_plans(body, hl, None, None, None)
        heads[b] = body[: int(hl)]
        assert plans_held() == min(b, 4)
        if b >= 2:  # batch size 1 is sent again after each other one: it stays
            one, hl1 = _body(_arrays(100, b=1))
            _same(parse_with_plans(one, hl1, None, None, None), parse_infer_request(one, hl1))
    assert list(plans._plans) == [heads[5], heads[6], heads[7], heads[1]]


@pytest.mark.parametrize(("extra", "json_input"), [({"id": "r1"}, ""), ({}, "ids_a")])
def test_a_request_without_a_plan_parses_its_header_once(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], json_input: str
) -> None:
    calls = [0]
    loads = json.loads

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return loads(*args, **kwargs)

    body, hl = _body(_arrays(0), extra, json_input)
    monkeypatch.setattr(json, "loads", counted)
    parse_with_plans(body, hl, None, None, None)
    assert calls[0] == 1 and plans_held() == 0  # the full parser's, none of its own
