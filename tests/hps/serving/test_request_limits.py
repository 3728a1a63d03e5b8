"""Bounded memory for hostile bodies and bounded error messages for hostile names: a gzip bomb
is refused having inflated 1 MiB at a time, never its limit's worth; a JSON part over its limit
is refused before it is parsed; the server's RSS stays flat over 50 of each; a 100,000-character
model name is answered NOT_FOUND (gRPC) / 400 (HTTP) with the name clipped."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.clipping import ECHO_MAX_CHARS, clip
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.serving.v2_protocol import ProtocolError, parse_infer_request

MiB = 2**20


def _bomb(inflated: int) -> bytes:
    """A gzip body that inflates to ``inflated`` zero bytes (~1/1000 of that on the wire)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(MiB)
    parts = [c.compress(block) for _ in range(inflated // MiB)]
    return b"".join([*parts, c.flush()])


def _peak_bytes(fn: object, *args: object, **kw: object) -> int:
    """Peak Python-heap bytes allocated while ``fn`` runs (it must raise ProtocolError)."""
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            fn(*args, **kw)  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_gzip_bomb_is_refused_without_inflating_to_the_limit() -> None:
    bomb = _bomb(96 * MiB)
    peak = _peak_bytes(parse_infer_request, bomb, content_encoding="gzip", max_bytes=64 * MiB)
    assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB held to refuse a bomb over a 64 MiB limit"
    with pytest.raises(ProtocolError, match="decompresses to more than the server's limit"):
        parse_infer_request(bomb, content_encoding="gzip", max_bytes=64 * MiB)


def test_a_gzip_body_within_the_limit_decodes_exactly() -> None:
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.5, 2.0]}]}
    body = json.dumps(doc).encode()
    req = parse_infer_request(gzip.compress(body), content_encoding="gzip", max_bytes=len(body))
    assert np.array_equal(req.inputs["x"], np.array([1.5, 2.0], np.float32))
    with pytest.raises(ProtocolError, match="truncated stream"):
        parse_infer_request(gzip.compress(body)[:-12], content_encoding="gzip")


def test_json_over_its_limit_is_refused_before_parsing() -> None:
    values = ",".join(["0.125"] * 400_000)  # 2.4 MB of text, ~14 MB once parsed by json
    body = f'{{"inputs":[{{"name":"x","datatype":"FP32","shape":[400000],"data":[{values}]}}]}}'
    peak = _peak_bytes(parse_infer_request, body.encode(), max_json_bytes=MiB)
    assert peak < MiB, f"{peak / MiB:.1f} MiB allocated to refuse an oversized JSON part"
    with pytest.raises(
        ProtocolError, match=r"request JSON of \d+ bytes exceeds .* \(--max-json-mb\)"
    ):
        parse_infer_request(body.encode(), max_json_bytes=MiB)


@pytest.fixture(scope="module")
def limited(tiny_artifacts: Path) -> Iterator[InferenceServer]:
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    cfg = ServerConfig(port=0, grpc_port=0, max_request_mb=4.0, max_json_mb=1.0)
    try:
        with InferenceServer(ps, cfg) as srv:
            yield srv
    finally:
        ps.close()


def test_rss_stays_flat_over_50_bombs_and_50_oversized_json_bodies(limited) -> None:
    bomb = _bomb(64 * MiB)
    big_json = (
        b'{"inputs":[{"name":"dense","datatype":"FP32","shape":[1],"data":['
        + (b"0.125," * (2 * MiB // 6))
        + b"0]}]}"
    )
    url = f"http://{limited.address}/v2/models/tiny/infer"
    me = psutil.Process()
    with httpx.Client(timeout=60) as c:

        def send(n: int) -> None:
            for _ in range(n):
                r = c.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
                assert r.status_code == 400 and "decompresses to more" in r.json()["error"]
                r = c.post(url, content=big_json)
                assert r.status_code == 400 and "--max-json-mb" in r.json()["error"]

        send(5)  # warm-up: allocator arenas and buffers reach their working size
        before = me.memory_info().rss
        send(50)
        grown = me.memory_info().rss - before
    assert grown < 48 * MiB, f"RSS grew {grown / MiB:.0f} MiB over 50 refused pairs"


def test_a_huge_model_name_is_not_found_with_a_clipped_message(limited) -> None:
    name = "m" * 100_000
    g = tg.InferenceServerClient(str(limited.grpc_address))
    with pytest.raises(InferenceServerException) as e:
        g.get_model_config(name)
    assert e.value.status() == "StatusCode.NOT_FOUND", e.value
    assert len(e.value.message()) < 1000 and "(100000 chars)" in e.value.message()
    channel = grpc.insecure_channel(str(limited.grpc_address))
    with channel:
        from tritonclient.grpc import service_pb2 as triton_pb

        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        msg = triton_pb.ModelInferRequest(model_name=name)
        msg.inputs.add(name="dense", datatype="FP32", shape=[0, 13])
        with pytest.raises(grpc.RpcError) as r:
            call(msg.SerializeToString(), timeout=60)
    assert r.value.code() == grpc.StatusCode.NOT_FOUND, r.value
    assert f"unknown model '{'m' * ECHO_MAX_CHARS}…(100000 chars)'" in r.value.details()
    resp = httpx.post(f"http://{limited.address}/v2/models/{'m' * 20_000}/infer", timeout=60)
    assert resp.status_code == 400 and len(resp.text) < 1000


def test_clip_keeps_short_text_and_counts_long_text() -> None:
    assert clip("tiny") == "tiny"
    assert clip("x" * 200, 3) == "xxx…(200 chars)"


class _Checked:
    """A stand-in servable whose check passes inputs through (the body's route is the test)."""

    def check(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return inputs


@pytest.mark.parametrize(
    "binary_mib,json_kib,inline",
    [(2, 0, True), (8, 0, False), (0, 100, False), (0, 1, True)],
)
def test_binary_tensors_parse_on_the_event_loop_whatever_their_size(
    monkeypatch, binary_mib: int, json_kib: int, inline: bool
) -> None:
    """Binary tensors are views of the body, not parsed: a 2 MiB binary request is parsed on
    the event loop (no worker hand-off), a JSON part over 64 KiB or binary data over 4 MiB on a
    worker thread; the tensors come back as views of the body, bit-exact either way."""
    import anyio

    from hps.serving.http_server.bodies import RequestBodies

    n = binary_mib * MiB // 4
    x = np.arange(n, dtype=np.float32)
    spec = {
        "name": "x",
        "datatype": "FP32",
        "shape": [n],
        "parameters": {"binary_data_size": 4 * n},
    }
    scalar = {"name": "p", "datatype": "FP32", "shape": [1], "data": [0.5]}
    doc = {"inputs": [spec if n else scalar], "id": "a" * (json_kib * 1024)}
    head = json.dumps(doc).encode()
    body = bytearray(head + x.tobytes())
    header_length = str(len(head)) if n else None
    handed: list[object] = []

    async def to_thread(fn, *args, limiter=None):  # type: ignore[no-untyped-def]
        handed.append(fn)
        return fn(*args)

    monkeypatch.setattr(anyio.to_thread, "run_sync", to_thread)
    bodies = RequestBodies(64 * MiB, 16 * MiB, anyio.CapacityLimiter(1))
    _, inputs = anyio.run(bodies.parse, _Checked(), body, header_length, None)
    assert (not handed) is inline
    if n:
        assert np.array_equal(inputs["x"], x) and not inputs["x"].flags.owndata
