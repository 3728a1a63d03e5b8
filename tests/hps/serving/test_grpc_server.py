"""The v2 gRPC server beside HTTP, over the same servables: ``tritonclient.grpc`` gets exactly
the scores ``tritonclient.http`` gets (raw and typed tensors); the same bad-request table is a
400 on HTTP and ``INVALID_ARGUMENT`` on gRPC with the same message; tier failures are 503 /
``UNAVAILABLE``; model config and repository index on both; the CLI's ``--grpc-port`` serves
and stops cleanly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.types import TierUnavailableError
from tests.hps.serving.tiny_dlrm import (
    CliServer,
    bindable,
    eager_logits,
    free_port,
    make_request,
    triton_inputs,
)
from tests.tolerances import tol

Tensors = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def model(tiny: DLRM) -> DLRM:
    return tiny


@pytest.fixture(scope="module")
def artifacts(tiny_artifacts: Path) -> Path:
    return tiny_artifacts


@pytest.fixture(scope="module")
def served(both_served: InferenceServer) -> InferenceServer:
    return both_served


@pytest.fixture(scope="module")
def clients(
    served: InferenceServer,
) -> Iterator[tuple[th.InferenceServerClient, tg.InferenceServerClient]]:
    assert served.grpc_address is not None
    g = tg.InferenceServerClient(served.grpc_address)
    yield th.InferenceServerClient(served.address), g
    g.close()


def grpc_inputs(req: Tensors, int32: bool = False) -> list[tg.InferInput]:
    """``req`` as tritonclient.grpc inputs (raw contents)."""
    out = []
    for name, arr in req.items():
        if arr.dtype == np.int64 and int32:
            arr = arr.astype(np.int32)
        dt = {np.float32: "FP32", np.int64: "INT64", np.int32: "INT32"}.get(arr.dtype.type, "FP64")
        x = tg.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


@pytest.mark.parametrize(
    "batch,int32,narrow", [(9, False, False), (64, True, True), (1, False, True)]
)
def test_grpc_scores_equal_http_scores_exactly(clients, model, batch, int32, narrow) -> None:
    http, g = clients
    req = make_request(model, batch, seed=batch, narrow=narrow)
    got = g.infer("tiny", grpc_inputs(req, int32), request_id="g7")
    for binary in (True, False):
        want = http.infer("tiny", triton_inputs(req, binary, int32))
        for out in ("logits", "probability"):
            assert got.as_numpy(out).dtype == np.float32 and got.as_numpy(out).shape == (batch,)
            np.testing.assert_array_equal(got.as_numpy(out), want.as_numpy(out))
    np.testing.assert_allclose(got.as_numpy("logits"), eager_logits(model, req), **tol("served"))
    resp = got.get_response()
    assert (resp.id, resp.model_name, resp.model_version) == ("g7", "tiny", "1")


def _stub(served: InferenceServer) -> tuple[grpc.Channel, triton_grpc.GRPCInferenceServiceStub]:
    assert served.grpc_address is not None
    channel = grpc.insecure_channel(served.grpc_address)
    return channel, triton_grpc.GRPCInferenceServiceStub(channel)


def _typed_request(req: Tensors, **contents_field: str) -> triton_pb.ModelInferRequest:
    """``req`` with typed contents: FP32 in fp32_contents, INT64 in int64_contents, unless
    ``contents_field[name]`` names another field (its datatype then follows the field)."""
    msg = triton_pb.ModelInferRequest(model_name="tiny")
    kinds = {"int_contents": "INT32", "fp64_contents": "FP64", "uint_contents": "UINT32"}
    for name, arr in req.items():
        field = contents_field.get(
            name, "fp32_contents" if arr.dtype == np.float32 else "int64_contents"
        )
        dt = kinds.get(field, "FP32" if field == "fp32_contents" else "INT64")
        t = msg.inputs.add(name=name, datatype=dt, shape=list(arr.shape))
        getattr(t.contents, field).extend(arr.reshape(-1).tolist())
    return msg


def test_typed_contents_score_exactly_as_raw(served, clients, model) -> None:
    _, g = clients
    req = make_request(model, 7, seed=21)
    raw = g.infer("tiny", grpc_inputs(req)).as_numpy("logits")
    channel, stub = _stub(served)
    with channel:
        for fields in ({}, {"ids_t1": "int_contents"}):
            resp = stub.ModelInfer(_typed_request(req, **fields))
            names = [o.name for o in resp.outputs]
            got = np.frombuffer(resp.raw_output_contents[names.index("logits")], np.float32)
            np.testing.assert_array_equal(got, raw)


def _ids_with(req: Tensors, name: str, value: np.ndarray) -> Tensors:
    return {**req, name: value}


# (what is wrong, the request (model, batch) → tensors, words the error must hold); the same
# table is sent to both protocols.
BAD: list[tuple[str, Callable[[DLRM], Tensors], str]] = [
    (
        "dense FP64",
        lambda m: {
            **make_request(m, 3, 6),
            "dense": make_request(m, 3, 6)["dense"].astype(np.float64),
        },
        "input 'dense' must be FP32",
    ),
    (
        "dense 12 wide",
        lambda m: {**make_request(m, 3, 6), "dense": np.zeros((3, 12), np.float32)},
        "shape [B, 13]",
    ),
    (
        "missing table",
        lambda m: {k: v for k, v in make_request(m, 3, 6).items() if k != "ids_t2"},
        "missing inputs ['ids_t2']",
    ),
    (
        "unknown input",
        lambda m: {**make_request(m, 3, 6), "ids_t9": np.zeros((3, 1), np.int64)},
        "unknown inputs ['ids_t9']",
    ),
    (
        "too many ids",
        lambda m: _ids_with(make_request(m, 3, 6), "ids_t3", np.zeros((3, 4), np.int64)),
        "allows at most 3",
    ),
    (
        "key below -1",
        lambda m: _ids_with(make_request(m, 3, 6), "ids_t0", np.array([[1], [-5], [2]])),
        "holds key -5",
    ),
    (
        "short batch",
        lambda m: _ids_with(make_request(m, 3, 6), "ids_t0", np.zeros((2, 1), np.int64)),
        "must have shape [3, w]",
    ),
    (
        "batch 65",
        lambda m: make_request(m, 65, 7),
        "batch 65 exceeds model 'tiny''s max_batch_size 64",
    ),
    (
        "NaN dense",
        lambda m: {**make_request(m, 3, 6), "dense": np.full((3, 13), np.nan, np.float32)},
        "NaN or infinite",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_are_400_and_invalid_argument_with_the_same_words(
    clients, model, case
) -> None:
    http, g = clients
    _, build, words = case
    req = build(model)
    with pytest.raises(InferenceServerException) as h:
        http.infer("tiny", triton_inputs(req, binary=False))
    with pytest.raises(InferenceServerException) as r:
        g.infer("tiny", grpc_inputs(req))
    assert h.value.status() == "400" and words in h.value.message(), h.value
    assert r.value.status() == "StatusCode.INVALID_ARGUMENT" and words in r.value.message(), r.value
    assert r.value.message() == h.value.message()


def test_model_version_and_output_errors_match(clients, model) -> None:
    http, g = clients
    req = make_request(model, 2, seed=8)
    calls = [
        ({"model_name": "nope"}, "unknown model 'nope'"),
        ({"model_version": "3"}, "model 'tiny' has no version '3'"),
        ({"outputs_of": ["x"]}, "unknown output 'x'"),
    ]
    for kw, words in calls:
        name, ver = kw.get("model_name", "tiny"), kw.get("model_version", "")
        outs = kw.get("outputs_of")
        with pytest.raises(InferenceServerException) as h:
            http.infer(
                name,
                triton_inputs(req),
                model_version=ver,
                outputs=[th.InferRequestedOutput(o) for o in outs] if outs else None,
            )
        with pytest.raises(InferenceServerException) as r:
            g.infer(
                name,
                grpc_inputs(req),
                model_version=ver,
                outputs=[tg.InferRequestedOutput(o) for o in outs] if outs else None,
            )
        code = "NOT_FOUND" if name != "tiny" else "INVALID_ARGUMENT"
        assert h.value.status() == "400" and words in h.value.message()
        assert r.value.status() == f"StatusCode.{code}" and words in r.value.message()


def test_malformed_grpc_messages_are_invalid_argument_naming_the_input(
    served, clients, model
) -> None:
    req = make_request(model, 2, seed=9)
    good = _typed_request(req)

    def raw_of(msg: triton_pb.ModelInferRequest) -> triton_pb.ModelInferRequest:
        out = triton_pb.ModelInferRequest()
        out.CopyFrom(msg)
        for t in out.inputs:
            t.ClearField("contents")
        out.raw_input_contents.extend(v.tobytes() for v in req.values())
        return out

    def edit(
        fn: Callable[[triton_pb.ModelInferRequest], object], raw: bool = False
    ) -> triton_pb.ModelInferRequest:
        msg = raw_of(good) if raw else triton_pb.ModelInferRequest()
        if not raw:
            msg.CopyFrom(good)
        fn(msg)
        return msg

    cases = [
        (edit(lambda m: m.ClearField("inputs")), "non-empty 'inputs'"),
        (edit(lambda m: setattr(m.inputs[0], "name", "")), "inputs[0].name must be a non-empty"),
        (edit(lambda m: setattr(m.inputs[1], "name", "dense")), "input 'dense' is given twice"),
        (
            edit(lambda m: setattr(m.inputs[0], "datatype", "FP17")),
            "input 'dense': datatype 'FP17' is not one of",
        ),
        (
            edit(lambda m: m.inputs[0].shape.__setitem__(0, -2)),
            "input 'dense'.shape must not be negative",
        ),
        (
            edit(lambda m: m.inputs[0].contents.fp32_contents.append(1.0)),
            "input 'dense': shape [2, 13] needs 26 values, contents.fp32_contents has 27",
        ),
        (
            edit(lambda m: m.inputs[1].contents.fp32_contents.append(1.0)),
            "input 'ids_t0': datatype INT64 carries its values in contents.int64_contents, got contents.fp32_contents",
        ),
        (
            edit(lambda m: setattr(m.inputs[0], "datatype", "FP16")),
            "input 'dense': datatype FP16 has no typed contents",
        ),
        (
            edit(lambda m: m.raw_input_contents.pop(), raw=True),
            "raw_input_contents has 8 entries for 9 inputs",
        ),
        (
            edit(lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 7), raw=True),
            "input 'dense': raw_input_contents holds 7 bytes but shape [2, 13] × FP32 needs 104 bytes",
        ),
        (
            edit(lambda m: m.inputs[0].contents.fp32_contents.append(1.0), raw=True),
            "input 'dense' has both 'contents' and raw_input_contents",
        ),
        (
            edit(
                lambda m: (
                    setattr(m.inputs[1], "datatype", "INT8"),
                    m.inputs[1].contents.ClearField("int64_contents"),
                    m.inputs[1].contents.int_contents.extend([300, 1]),
                )
            ),
            "input 'ids_t0': contents.int_contents value 300 is out of range for INT8 [-128, 127]",
        ),
    ]
    channel, stub = _stub(served)
    with channel:
        for msg, words in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(msg)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, e.value)
            assert words in e.value.details(), (words, e.value.details())
        big = raw_of(good)
        big.raw_input_contents[0] = b"\0" * (2**20 + 1)  # past --max-request-mb 1
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(big)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.value.details()
        ok = stub.ModelInfer(good)  # still serving
    got = np.frombuffer(ok.raw_output_contents[0], np.float32)
    np.testing.assert_allclose(got, eager_logits(model, req), **tol("served"))


def _raiser(exc: Exception) -> Callable[[Tensors], Tensors]:
    def infer(inputs: Tensors) -> Tensors:
        raise exc

    return infer


def test_backend_failures_are_503_unavailable_and_500_internal(
    served, clients, model, monkeypatch
) -> None:
    http, g = clients
    req = make_request(model, 2, seed=10)
    s = served.servables["tiny"]
    tier = TierUnavailableError("t0", "volatile db (redis_cluster)", 3, "connection refused")
    for exc, code, status in [
        (tier, "503", "StatusCode.UNAVAILABLE"),
        (TimeoutError("4 lookups busy"), "503", "StatusCode.UNAVAILABLE"),
        (RuntimeError("db gone"), "500", "StatusCode.INTERNAL"),
    ]:
        monkeypatch.setattr(s, "infer", _raiser(exc))
        with pytest.raises(InferenceServerException) as h:
            http.infer("tiny", triton_inputs(req))
        with pytest.raises(InferenceServerException) as r:
            g.infer("tiny", grpc_inputs(req))
        assert h.value.status() == code and r.value.status() == status, (exc, h.value, r.value)
        assert str(exc) in h.value.message() and r.value.message() == h.value.message()
    monkeypatch.undo()
    g.infer("tiny", grpc_inputs(req))


def test_health_metadata_config_and_index_on_both(clients) -> None:
    http, g = clients
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("tiny")
    assert g.is_model_ready("tiny", "1") and not g.is_model_ready("tiny", "2")
    assert not g.is_model_ready("nope") and not http.is_model_ready("nope")
    meta = g.get_server_metadata(as_json=True)
    assert meta["name"] == http.get_server_metadata()["name"] == "tilerec-hps"
    assert "model_configuration" in meta["extensions"]
    gm, hm = g.get_model_metadata("tiny"), http.get_model_metadata("tiny")
    assert [(t.name, t.datatype, list(t.shape)) for t in gm.inputs] == [
        (t["name"], t["datatype"], t["shape"]) for t in hm["inputs"]
    ]
    assert [t.name for t in gm.outputs] == ["logits", "probability"]
    # The gRPC answer parsed with Triton's full model_config.proto (tritonclient's stubs).
    cfg = g.get_model_config("tiny").config
    hcfg = http.get_model_config("tiny")
    assert (cfg.name, cfg.max_batch_size) == (hcfg["name"], hcfg["max_batch_size"]) == ("tiny", 64)
    assert cfg.input[0].data_type == triton_config.TYPE_FP32 and list(cfg.input[0].dims) == [13]
    assert [
        (i.name, triton_config.DataType.Name(i.data_type), list(i.dims)) for i in cfg.input
    ] == [(i["name"], i["data_type"], i["dims"]) for i in hcfg["input"]]
    assert list(cfg.input[4].dims) == [3] and cfg.input[4].data_type == triton_config.TYPE_INT64
    out = cfg.output[1]
    assert (out.name, list(out.dims), out.HasField("reshape"), list(out.reshape.shape)) == (
        "probability",
        [1],
        True,
        [],
    )
    assert hcfg["output"][1] == {
        "name": "probability",
        "data_type": "TYPE_FP32",
        "dims": [1],
        "reshape": {"shape": []},
    }
    index = [{"name": "tiny", "version": "1", "state": "READY"}]
    assert http.get_model_repository_index() == index
    assert g.get_model_repository_index(as_json=True) == {"models": index}
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
        g.get_model_config("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        http.get_model_config("nope")


def test_stop_leaves_no_threads_and_frees_both_ports(artifacts, model) -> None:
    before = set(threading.enumerate())
    ps = HierarchicalParameterServer.from_config(artifacts / "ps.json")
    try:
        srv = InferenceServer(ps, ServerConfig(port=0, grpc_port=0, workers=2)).start()
        assert srv.grpc is not None
        ports = (srv.port, srv.grpc.port)
        c = tg.InferenceServerClient(str(srv.grpc_address))
        c.infer("tiny", grpc_inputs(make_request(model, 2, seed=12)))
        c.close()
        srv.stop()
    finally:
        ps.close()
    deadline = time.monotonic() + 5
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, sorted(t.name for t in left)
    assert all(bindable(p) for p in ports), ports


def test_cli_grpc_port_serves_and_shuts_down_cleanly(artifacts, model) -> None:
    gport = free_port()
    req = make_request(model, 5, seed=13)
    with CliServer(artifacts / "ps.json", "--workers", "2", "--grpc-port", str(gport)) as srv:
        g = tg.InferenceServerClient(f"127.0.0.1:{gport}")
        got = g.infer("tiny", grpc_inputs(req)).as_numpy("logits")
        g.close()
        want = th.InferenceServerClient(srv.address).infer("tiny", triton_inputs(req))
        np.testing.assert_array_equal(got, want.as_numpy("logits"))
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 15, "SIGTERM took too long to stop the server"
    assert srv.returncode == 0, srv.output
    assert f"grpc://127.0.0.1:{gport}" in srv.output and "Traceback" not in srv.output
    assert bindable(gport) and bindable(srv.port)


def test_grpc_calls_count_in_the_models_statistics(clients, model) -> None:
    http, g = clients

    def counts() -> tuple[int, int, int]:
        st = http.get_inference_statistics("tiny")["model_stats"][0]
        s = st["inference_stats"]
        return s["success"]["count"], s["fail"]["count"], st["inference_count"]

    before = counts()
    g.infer("tiny", grpc_inputs(make_request(model, 5, seed=14)))
    with pytest.raises(InferenceServerException):
        g.infer("tiny", grpc_inputs({"dense": np.zeros((1, 13), np.float32)}))
    assert counts() == (before[0] + 1, before[1] + 1, before[2] + 5)


def test_past_workers_plus_queued_a_call_is_refused_at_once(tiny_artifacts, model) -> None:
    """One worker, no queue: while a call runs, the next gets RESOURCE_EXHAUSTED (HTTP: 503)."""
    ps = HierarchicalParameterServer.from_config(tiny_artifacts / "ps.json")
    cfg = ServerConfig(port=0, grpc_port=0, workers=1, max_queued=0)
    release, entered = threading.Event(), threading.Event()
    try:
        with InferenceServer(ps, cfg) as srv:
            s = srv.servables["tiny"]
            real = s.infer

            def held(inputs: Tensors) -> Tensors:
                entered.set()
                release.wait(30)
                return real(inputs)

            s.infer = held  # type: ignore[method-assign]
            req = make_request(model, 2, seed=15)
            first = tg.InferenceServerClient(str(srv.grpc_address))
            second = tg.InferenceServerClient(str(srv.grpc_address))
            results: list[np.ndarray] = []
            t = threading.Thread(
                target=lambda: results.append(
                    first.infer("tiny", grpc_inputs(req)).as_numpy("logits")
                )
            )
            t.start()
            assert entered.wait(30)
            with pytest.raises(InferenceServerException) as e:
                second.infer("tiny", grpc_inputs(req), client_timeout=30)
            release.set()
            t.join(30)
            assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED", e.value
            assert len(results) == 1  # the running call finished normally
            s.infer = real  # type: ignore[method-assign]
            np.testing.assert_array_equal(
                second.infer("tiny", grpc_inputs(req)).as_numpy("logits"), results[0]
            )
            first.close()
            second.close()
    finally:
        release.set()
        ps.close()


def test_http_repository_index_bodies(served) -> None:
    url = f"http://{served.address}/v2/repository/index"
    index = [{"name": "tiny", "version": "1", "state": "READY"}]
    for body in (b"", b'{"ready": true}', b'{"ready": false}'):
        r = httpx.post(url, content=body, timeout=30)
        assert (r.status_code, r.json()) == (200, index), body
    for body, words in [
        (b'{"ready": "yes"}', "'ready' must be true or false, got 'yes'"),
        (b"[1]", "must be a JSON object, got list"),
        (b"{oops", "malformed"),
        (b" " * (2**20 + 1), "exceeds the server's limit of 1048576 bytes"),
    ]:
        r = httpx.post(url, content=body, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"], (body[:20], r.text)
    assert httpx.get(url, timeout=30).status_code == 405


def test_gzip_calls_score_alike_and_their_decompressed_size_is_capped(clients, model) -> None:
    http, g = clients
    req = make_request(model, 16, seed=16)
    got = g.infer("tiny", grpc_inputs(req), compression_algorithm="gzip").as_numpy("logits")
    np.testing.assert_array_equal(got, http.infer("tiny", triton_inputs(req)).as_numpy("logits"))
    bomb = tg.InferInput("dense", [1, 300_000], "FP32")  # 1.2 MB of zeros, ~1 KB gzipped
    bomb.set_data_from_numpy(np.zeros((1, 300_000), np.float32))
    with pytest.raises(InferenceServerException) as e:
        g.infer("tiny", [bomb], compression_algorithm="gzip")
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "Decompressed message larger than max" in e.value.message()
