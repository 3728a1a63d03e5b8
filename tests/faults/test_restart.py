"""A server restarted on changed artifacts (issue #22, item 4).

``ps.json`` with ``persistent_db: rocks_db``; model A exported and served (the RocksDB loaded
from A's sparse files); A's ``sparse/`` and ``dense.onnx`` replaced by model B's export; a
restart. A writable RocksDB loads the changed tables again, so the answers are B's; a
read-only one refuses to start with an error naming the DB to delete. Never A's rows with B's
graph.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from embark.data.jagged import JaggedBatch
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import get_workload
from export.artifacts import write_serving_artifacts
from hps.parameter_server import HierarchicalParameterServer
from hps.server import main as server_main
from tests.tolerances import tol

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def _export(seed: int, out: Path) -> DLRM:
    model = build_model(get_workload("tiny"), seed=seed).eval()
    write_serving_artifacts(model, out, model_name=MODEL, max_batch_size=64, cache_fraction=0.3)
    return model


def _use_rocksdb(art: Path, pdb: Path, read_only: bool = False) -> Path:
    """Point ``art/ps.json`` at a RocksDB at ``pdb`` (outside the artifacts: it outlives them)."""
    ps = art / "ps.json"
    doc = json.loads(ps.read_text())
    doc["persistent_db"] = {"type": "rocks_db", "path": str(pdb), "read_only": read_only}
    ps.write_text(json.dumps(doc))
    return ps


def _replace_artifacts(art: Path, other: Path) -> None:
    """Put ``other``'s sparse files and dense graph in place of ``art``'s (ps.json kept)."""
    shutil.rmtree(art / "sparse")
    shutil.copytree(other / "sparse", art / "sparse")
    shutil.copy2(other / "dense.onnx", art / "dense.onnx")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[DLRM, Path, DLRM, Path]:
    """Models A and B (same workload, other weights) and their pristine exports."""
    root = tmp_path_factory.mktemp("exports")
    a, b = _export(0, root / "a"), _export(1, root / "b")
    return a, root / "a", b, root / "b"


def _table_rows(ps: HierarchicalParameterServer, model: DLRM) -> dict[str, torch.Tensor]:
    """Every row of every table as the parameter server serves it."""
    s = ps.session(MODEL)
    ids = {t.name: torch.arange(t.num_rows).split(64) for t in model.workload.tables}  # per request
    return {name: torch.cat([s.lookup(name, c) for c in chunks]) for name, chunks in ids.items()}


def _weights(model: DLRM) -> dict[str, torch.Tensor]:
    return {t.name: model.embeddings[t.name].weight.detach() for t in model.workload.tables}


def _assert_serves(rows: dict[str, torch.Tensor], model: DLRM) -> None:
    for name, w in _weights(model).items():
        assert torch.equal(rows[name], w), f"table {name!r} is not the expected model's"


def test_a_restart_on_another_export_serves_its_rows(exports, tmp_path: Path) -> None:
    a, a_dir, b, b_dir = exports
    art = tmp_path / "art"
    shutil.copytree(a_dir, art)
    ps_json = _use_rocksdb(art, tmp_path / "pdb")
    ps = HierarchicalParameterServer.from_config(ps_json)
    _assert_serves(_table_rows(ps, a), a)
    ps.close()

    _replace_artifacts(art, b_dir)
    ps = HierarchicalParameterServer.from_config(ps_json)
    try:
        _assert_serves(_table_rows(ps, b), b)
    finally:
        ps.close()
    ps = HierarchicalParameterServer.from_config(ps_json)  # and again: nothing reloads now
    try:
        _assert_serves(_table_rows(ps, b), b)
    finally:
        ps.close()


def test_a_read_only_database_of_another_export_refuses_to_start(
    exports, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, a_dir, b, b_dir = exports
    art, pdb = tmp_path / "art", tmp_path / "pdb"
    shutil.copytree(a_dir, art)
    HierarchicalParameterServer.from_config(_use_rocksdb(art, pdb)).close()  # loads A
    ps_json = _use_rocksdb(art, pdb, read_only=True)
    HierarchicalParameterServer.from_config(ps_json).close()  # A's files: served as they are

    _replace_artifacts(art, b_dir)
    want = (
        rf"table 't0' was loaded from other sparse files .* than '{art}/sparse/t0' holds now.*"
        rf"read_only false.*delete '{pdb}'"
    )
    with pytest.raises(ValueError, match=want):
        HierarchicalParameterServer.from_config(ps_json)
    with pytest.raises(SystemExit) as e:  # python -m hps.server: exit 2, the error on stderr
        server_main(["--config", str(ps_json), "--port", "0"])
    assert e.value.code == 2
    assert f"delete '{pdb}'" in capsys.readouterr().err


# ------------------------------------------------------------------------- the real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(model: DLRM, batch: int, seed: int) -> dict[str, np.ndarray]:
    """``dense (B, D) float32`` and ``ids_<t> (B, H_t) int64`` over every table's rows."""
    g = np.random.default_rng(seed)
    out = {"dense": g.random((batch, model.workload.dense_features), dtype=np.float32)}
    for t in model.workload.tables:
        out[f"ids_{t.name}"] = g.integers(0, t.num_rows, (batch, t.hotness))
    return out


@torch.no_grad()
def _eager(model: DLRM, req: dict[str, np.ndarray]) -> np.ndarray:
    values = [torch.from_numpy(req[f"ids_{t.name}"]).flatten() for t in model.workload.tables]
    lengths = [
        torch.full((req["dense"].shape[0],), t.hotness, dtype=torch.int32)
        for t in model.workload.tables
    ]
    sparse = JaggedBatch(model.table_names, torch.cat(values), torch.cat(lengths))
    return model(torch.from_numpy(req["dense"]), sparse).numpy()


def _infer(port: int, req: dict[str, np.ndarray]) -> np.ndarray:
    body = {
        "inputs": [
            {
                "name": k,
                "shape": list(v.shape),
                "datatype": "FP32" if v.dtype == np.float32 else "INT64",
                "data": v.reshape(-1).tolist(),
            }
            for k, v in req.items()
        ]
    }
    r = httpx.post(f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (out,) = [o for o in r.json()["outputs"] if o["name"] == "logits"]
    return np.asarray(out["data"], np.float32)


def _serve_and_infer(ps_json: Path, req: dict[str, np.ndarray]) -> np.ndarray:
    """Start ``python -m hps.server`` on ``ps_json``, answer ``req``, stop it by SIGTERM."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "hps.server", "--config", str(ps_json), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--workers", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a start imports torch and onnxruntime
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5).is_success:
                    break
            except httpx.TransportError:  # not listening yet
                pass
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        return _infer(port, req)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out


@pytest.mark.slow
def test_the_server_restarted_on_another_export_answers_like_it(exports, tmp_path: Path) -> None:
    a, a_dir, b, b_dir = exports
    art = tmp_path / "art"
    shutil.copytree(a_dir, art)
    ps_json = _use_rocksdb(art, tmp_path / "pdb")
    req = _request(a, 16, seed=3)
    want_a, want_b = _eager(a, req), _eager(b, req)
    assert np.abs(want_a - want_b).max() > 1e-3  # the two models answer differently
    np.testing.assert_allclose(_serve_and_infer(ps_json, req), want_a, **tol("served"))

    _replace_artifacts(art, b_dir)
    np.testing.assert_allclose(_serve_and_infer(ps_json, req), want_b, **tol("served"))
