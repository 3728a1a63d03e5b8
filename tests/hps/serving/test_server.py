"""The v2 inference server end to end: tritonclient.http against a served tiny DLRM-DCNv2 (half
its tables mean-pooled), checked against the eager model; every bad request a 400 that names
the problem while the server keeps serving; online updates visible through it; the CLI."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from embark.models.dlrm import DLRM
from export.onnx import export_onnx, run_onnx
from hps.parameter_server import HierarchicalParameterServer
from hps.server import main
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.updates import FileLogPublisher
from tests.hps.serving.tiny_dlrm import ROOT, write_artifacts
from tests.hps.serving.tiny_dlrm import eager_logits as _eager
from tests.hps.serving.tiny_dlrm import free_port as _free_port
from tests.hps.serving.tiny_dlrm import make_request as _request
from tests.hps.serving.tiny_dlrm import tiny_model as _model
from tests.hps.serving.tiny_dlrm import triton_inputs as _inputs
from tests.tolerances import tol


@pytest.fixture(scope="module")
def model() -> DLRM:
    return _model()


@pytest.fixture(scope="module")
def artifacts(model: DLRM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_artifacts(model, tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def served(artifacts: Path) -> Iterator[InferenceServer]:
    ps = HierarchicalParameterServer.from_config(artifacts / "ps.json")
    srv = InferenceServer(ps, ServerConfig(port=0, workers=4, max_request_mb=1.0)).start()
    try:
        yield srv
    finally:
        srv.stop()
        ps.close()


@pytest.fixture
def client(served: InferenceServer) -> th.InferenceServerClient:
    return th.InferenceServerClient(served.address, concurrency=4)


@pytest.mark.parametrize(
    "binary,int32,narrow", [(True, False, False), (False, False, True), (True, True, True)]
)
def test_infer_equals_eager_model(client, model, binary: bool, int32: bool, narrow: bool) -> None:
    req = _request(model, 9, seed=1, narrow=narrow)
    want = _eager(model, req)
    outs = [
        th.InferRequestedOutput("logits", binary_data=binary),
        th.InferRequestedOutput("probability", binary_data=not binary),
    ]
    res = client.infer("tiny", _inputs(req, binary, int32), outputs=outs, request_id="r7")
    np.testing.assert_allclose(res.as_numpy("logits"), want, **tol("served"))
    np.testing.assert_allclose(
        res.as_numpy("probability"), 1 / (1 + np.exp(-want)), **tol("served")
    )
    assert res.get_response()["id"] == "r7" and res.as_numpy("logits").dtype == np.float32


def test_same_request_runs_on_the_full_onnx_graph(client, model, tmp_path) -> None:
    """A client sends the request it would send the server to export_onnx's full graph."""
    full = export_onnx(model, tmp_path / "full.onnx")
    req = _request(model, 5, seed=2)
    res = client.infer("tiny", _inputs(req))  # no outputs named: all, binary
    graph = run_onnx(full, {k: torch.from_numpy(v) for k, v in req.items()}).numpy()
    np.testing.assert_allclose(res.as_numpy("logits"), graph, **tol("served"))


def test_keys_found_nowhere_pool_the_default_vector(client, model) -> None:
    """t0 (sum) gets unknown keys: default 0.0 rows, so the sample scores as with an empty bag."""
    req = _request(model, 4, seed=3)
    unknown = dict(req, ids_t0=np.array([[10**12], [7], [2**62], [3]], dtype=np.int64))
    empty = dict(req, ids_t0=np.array([[-1], [7], [-1], [3]], dtype=np.int64))
    got = client.infer("tiny", _inputs(unknown)).as_numpy("logits")
    np.testing.assert_allclose(got, _eager(model, empty), **tol("served"))


def test_metadata_health_and_stats(client, model) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    assert not client.is_model_ready("nope") and not client.is_model_ready("tiny", "2")
    meta = client.get_model_metadata("tiny")
    names = [i["name"] for i in meta["inputs"]]
    assert names == ["dense"] + [f"ids_t{i}" for i in range(8)]
    assert meta["inputs"][0]["shape"] == [-1, 13] and meta["inputs"][4]["shape"] == [-1, 3]
    assert [o["name"] for o in meta["outputs"]] == ["logits", "probability"]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    before = client.get_inference_statistics("tiny")["model_stats"][0]
    client.infer("tiny", _inputs(_request(model, 2, seed=4)))
    with pytest.raises(InferenceServerException):
        client.infer("tiny", _inputs({"dense": np.zeros((1, 13), np.float32)}))
    after = client.get_inference_statistics("tiny")["model_stats"][0]
    assert (
        after["inference_stats"]["success"]["count"]
        == before["inference_stats"]["success"]["count"] + 1
    )
    assert (
        after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    )
    assert after["hps"]["t3"]["lookups"] > before["hps"]["t3"]["lookups"]
    held = [t["bytes"] for t in after["hps"].values()]  # per table, in its row format
    assert all(b["row_format"] == "fp32" and b["row_bytes_per_row"] > 0 for b in held)
    assert after["hps_bytes"] == {  # per tier: Σ over the model's tables
        tier: sum(b["tiers"][tier]["bytes"] for b in held) for tier in held[0]["tiers"]
    }
    assert after["hps_bytes"]["cache"] > 0


def test_statistics_before_and_after_the_first_request(artifacts, model) -> None:
    """Stats work on a fresh server (no latency sample yet), for one model and for all, and
    count samples as Triton does (inference_count) beside requests (execution_count)."""
    ps = HierarchicalParameterServer.from_config(artifacts / "ps.json")
    try:
        with InferenceServer(ps, ServerConfig(port=0)) as srv:
            c = th.InferenceServerClient(srv.address)
            fresh = c.get_inference_statistics("tiny")["model_stats"][0]
            assert fresh["inference_count"] == 0 and fresh["hps"]["t0"]["latency_p50_ms"] is None
            assert [m["name"] for m in c.get_inference_statistics()["model_stats"]] == ["tiny"]
            c.infer("tiny", _inputs(_request(model, 3, seed=11)))
            st = c.get_inference_statistics("tiny")["model_stats"][0]
            assert (st["inference_count"], st["execution_count"]) == (3, 1)
            phases = st["inference_stats"]
            assert all(
                phases[k]["count"] == 1 and phases[k]["ns"] > 0
                for k in ("queue", "compute_input", "compute_infer", "compute_output")
            )
            assert (
                phases["compute_infer"]["ns"] <= phases["success"]["ns"]
                and st["last_inference"] > 0
            )
    finally:
        ps.close()


def _post(
    served: InferenceServer,
    body: bytes,
    headers: dict | None = None,
    path: str = "/v2/models/tiny/infer",
) -> httpx.Response:
    return httpx.post(
        f"http://{served.address}{path}", content=body, headers=headers or {}, timeout=30
    )


def _doc(req: dict[str, np.ndarray], **change) -> bytes:
    inputs = [
        {
            "name": k,
            "shape": list(v.shape),
            "datatype": "FP32" if v.dtype == np.float32 else "INT64",
            "data": v.reshape(-1).tolist(),
        }
        for k, v in req.items()
    ]
    for name, patch in change.items():
        for i in inputs:
            if i["name"] == name:
                i.update(patch)
    return json.dumps({"inputs": inputs}).encode()


def _with_key(req: dict[str, np.ndarray], key: int) -> np.ndarray:
    """``req``'s ``ids_t2`` with ``key`` as the second sample's first id."""
    ids = req["ids_t2"].copy()
    ids[1, 0] = key
    return ids


def test_bad_requests_are_400_naming_the_problem(served, model) -> None:
    req = _request(model, 3, seed=6)
    wide = np.zeros((3, 4), dtype=np.int64)
    cases = [
        (_doc(req, dense={"datatype": "FP64"}), "input 'dense' must be FP32"),
        (_doc(req, dense={"shape": [3, 12], "data": [0.0] * 36}), "shape [B, 13]"),
        (_doc({k: v for k, v in req.items() if k != "ids_t2"}), "missing inputs ['ids_t2']"),
        (_doc({**req, "ids_t9": req["ids_t0"]}), "unknown inputs ['ids_t9']"),
        (_doc({**req, "ids_t3": wide}), "allows at most 3"),
        (_doc({**req, "ids_t0": np.array([[1], [-5], [2]])}), "holds key -5"),
        (  # one reduction bounds every table's keys: a padded table beside a bad key
            _doc({**req, "ids_t0": np.array([[1], [-1], [2]]), "ids_t2": _with_key(req, -3)}),
            "input 'ids_t2' holds key -3",
        ),
        (_doc({**req, "ids_t0": req["ids_t0"][:2]}), "must have shape [3, w]"),
        (_doc(_request(model, 65, seed=7)), "batch 65 exceeds model 'tiny''s max_batch_size 64"),
        (_doc(req, dense={"data": [float("nan")] * 39}), "NaN or infinite"),
        (b"{oops", "malformed"),
    ]
    for body, match in cases:
        r = _post(served, body)
        assert r.status_code == 400 and match in r.json()["error"], (match, r.text)
    r = _post(served, _doc(req), path="/v2/models/nope/infer")
    assert r.status_code == 400 and "unknown model 'nope'" in r.json()["error"]
    r = _post(served, _doc(req), path="/v2/models/tiny/versions/3/infer")
    assert r.status_code == 400 and "no version '3'" in r.json()["error"]
    r = _post(served, b"x" * (2**20 + 1))
    assert r.status_code == 400 and "exceeds the server's limit" in r.json()["error"]
    r = _post(served, _doc(req), headers={"Inference-Header-Content-Length": "99999999"})
    assert r.status_code == 400 and "outside the body" in r.json()["error"]
    r = httpx.get(f"http://{served.address}/v2/models/tiny/infer", timeout=30)
    assert r.status_code == 405 and "GET /v2/models/tiny/infer" in r.json()["error"]
    r = httpx.get(f"http://{served.address}/v3/nothing", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    ok = _post(served, _doc(req), path="/v2/models/tiny/versions/1/infer")  # still serving
    assert ok.status_code == 200
    got = np.array(
        next(o for o in ok.json()["outputs"] if o["name"] == "logits")["data"], np.float32
    )
    np.testing.assert_allclose(got, _eager(model, req), **tol("served"))


def test_a_client_gone_mid_body_is_neither_an_error_nor_a_failure(served, caplog) -> None:
    def fails() -> int:
        r = httpx.get(f"http://{served.address}/v2/models/tiny/stats", timeout=30)
        return r.json()["model_stats"][0]["inference_stats"]["fail"]["count"]

    before = fails()
    caplog.set_level(logging.WARNING, logger="hps.serving.http_server")
    with socket.create_connection(("127.0.0.1", served.port)) as s:
        s.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            b'{"inputs": ['
        )
        time.sleep(0.2)
    time.sleep(0.5)  # the server notices the disconnect
    assert fails() == before
    assert not [
        r
        for r in caplog.records
        if r.name.startswith("hps.serving.http_server") and r.levelno >= logging.WARNING
    ]


def test_gzip_request_and_many_concurrent_clients(served, model) -> None:
    reqs = [_request(model, 1 + i % 7, seed=100 + i) for i in range(48)]
    want = [_eager(model, r) for r in reqs]
    errors: list[str] = []

    def worker(k: int) -> None:
        c = th.InferenceServerClient(served.address)
        for i in range(k, len(reqs), 12):
            try:
                res = c.infer(
                    "tiny",
                    _inputs(reqs[i]),
                    request_compression_algorithm="gzip" if i % 2 else None,
                )
                np.testing.assert_allclose(res.as_numpy("logits"), want[i], **tol("served"))
            except Exception as e:  # collected: a failure in a thread must fail the test
                errors.append(f"request {i}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_backend_errors_map_to_503_and_500(served, model, monkeypatch) -> None:
    s = served.servables["tiny"]
    body = _doc(_request(model, 2, seed=8))
    monkeypatch.setattr(s, "infer", lambda inputs: (_ for _ in ()).throw(TimeoutError("4 busy")))
    r = _post(served, body)
    assert r.status_code == 503 and "busy" in r.json()["error"]
    monkeypatch.setattr(s, "infer", lambda inputs: (_ for _ in ()).throw(RuntimeError("db gone")))
    r = _post(served, body)
    assert r.status_code == 500 and "RuntimeError: db gone" in r.json()["error"]
    monkeypatch.undo()
    assert _post(served, body).status_code == 200


def test_online_update_is_visible_through_the_server(artifacts, model, tmp_path) -> None:
    art = tmp_path / "art"
    shutil.copytree(artifacts, art)
    doc = json.loads((art / "ps.json").read_text())
    doc["update_source"] = {"type": "file_log", "path": "updates.log", "poll_interval_s": 0.05}
    (art / "ps.json").write_text(json.dumps(doc))
    pub = FileLogPublisher(art / "updates.log")
    ps = HierarchicalParameterServer.from_config(art / "ps.json")
    ps.start_background()
    req = _request(model, 3, seed=9)
    req["ids_t0"] = np.array([[4], [4], [5]], dtype=np.int64)
    try:
        with InferenceServer(ps, ServerConfig(port=0)) as srv:
            c = th.InferenceServerClient(srv.address)
            np.testing.assert_allclose(
                c.infer("tiny", _inputs(req)).as_numpy("logits"),
                _eager(model, req),
                **tol("served"),
            )
            new_row = torch.linspace(-1, 1, 16)
            pub.publish({"t0": (np.array([4], np.int64), new_row.numpy()[None].astype(np.float32))})
            updated = _model()
            with torch.no_grad():
                updated.embeddings["t0"].weight[4] = new_row
            want = _eager(updated, req)
            deadline = time.monotonic() + 10
            while True:
                got = c.infer("tiny", _inputs(req)).as_numpy("logits")
                if np.allclose(got, want, **tol("served")) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            np.testing.assert_allclose(got, want, **tol("served"))
            assert not np.allclose(want[:2], _eager(model, req)[:2])  # the update changed them
    finally:
        ps.close()


def test_models_that_cannot_be_served_are_named(artifacts, tmp_path) -> None:
    art = tmp_path / "art"
    shutil.copytree(artifacts, art)
    ps = HierarchicalParameterServer.from_config(art / "ps.json")
    try:
        with pytest.raises(ValueError, match="no model 'other'"):
            InferenceServer(ps, ServerConfig(port=0), models=["other"])
        (art / "dense.onnx").write_bytes(b"not an onnx file")
        with pytest.raises(ValueError, match="cannot load"):
            InferenceServer(ps, ServerConfig(port=0))
    finally:
        ps.close()
    with pytest.raises(ValueError, match="workers must be an integer from 1 to 256"):
        ServerConfig(workers=0)


def test_cli_serves_until_sigterm(artifacts, model) -> None:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hps.server",
            "--config",
            str(artifacts / "ps.json"),
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        c = th.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        while True:
            try:
                if c.is_server_ready():
                    break
            except Exception:  # not listening yet
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        req = _request(model, 4, seed=10)
        np.testing.assert_allclose(
            c.infer("tiny", _inputs(req)).as_numpy("logits"), _eager(model, req), **tol("served")
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"127.0.0.1:{port}" in out and "serving ['tiny']" in out and "shutting down" in out


def test_cli_bad_config_exits_2(tmp_path) -> None:
    bad = tmp_path / "ps.json"
    bad.write_text('{"models": [}')
    r = subprocess.run(
        [sys.executable, "-m", "hps.server", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "line 1" in r.stderr


@pytest.mark.parametrize("mb", [math.inf, math.nan, 1e-9])
def test_max_request_mb_must_be_a_finite_size(mb: float) -> None:
    with pytest.raises(
        ValueError, match=r"max_request_mb must be a finite number of MiB > 0 .*got"
    ):
        ServerConfig(max_request_mb=mb)


def test_cli_rejects_an_infinite_request_limit(artifacts, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--config", str(artifacts / "ps.json"), "--port", "0", "--max-request-mb", "inf"])
    assert e.value.code == 2 and "max_request_mb must be a finite number" in capsys.readouterr().err


def test_cli_background_work_that_cannot_start_exits_2(artifacts, monkeypatch, capsys) -> None:
    def cannot_start(self: HierarchicalParameterServer, refresh_interval_s: float = 10.0) -> list:
        raise ValueError("update_source: cannot start (test)")

    monkeypatch.setattr(HierarchicalParameterServer, "start_background", cannot_start)
    port = _free_port()
    with pytest.raises(SystemExit) as e:
        main(["--config", str(artifacts / "ps.json"), "--port", str(port)])
    assert e.value.code == 2 and "update_source: cannot start (test)" in capsys.readouterr().err
    with socket.socket() as s:  # the server's socket was released
        s.bind(("127.0.0.1", port))
