"""Online updates that fail make the server not ready, through both protocols: a refused
record (a NaN row a foreign publisher wrote) turns ``/v2/health/ready`` into 503 naming it and
gRPC ``ServerReady`` false once the policy's failures are reached, ``/stats`` shows it under
``online_updates``, and ``python -m hps.updates skip`` with the offset the statistics give
makes the server ready again with the records after it applied (:mod:`hps.updates.health`)."""

from __future__ import annotations

import json
import shutil
import struct
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import torch
import tritonclient.grpc as tg

from hps.parameter_server import HierarchicalParameterServer
from hps.serving.http_server import InferenceServer, ServerConfig
from hps.updates import FileLogPublisher, encode_batch
from hps.updates.__main__ import main as updates_cli


def _wait(pred, what: str, timeout_s: float = 30.0) -> None:
    """Wait for a background thread to reach a state (not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.02)


def test_a_stuck_update_makes_the_server_not_ready_until_skipped(
    tiny_artifacts: Path, tmp_path: Path
) -> None:
    """Through the servers: /v2/health/ready 503 naming the record and gRPC ServerReady false
    after 2 failures, /stats shows it; ``python -m hps.updates skip`` with the offset from the
    statistics makes it ready and the records after it served."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts, art)
    doc = json.loads((art / "ps.json").read_text())
    doc["update_source"] = {
        "type": "file_log",
        "path": "u.log",
        "poll_interval_s": 0.02,
        "max_retry_interval_s": 0.1,
        "unready_after_failures": 2,
    }
    (art / "ps.json").write_text(json.dumps(doc))
    pub = FileLogPublisher(art / "u.log")
    bad = {"t0": (np.array([4], np.int64), np.ones((1, 16), np.float32))}
    payload = encode_batch(bad)[17:]
    payload = payload[:-4] + struct.pack("<f", float("nan"))
    with open(art / "u.log", "ab") as f:
        f.write(struct.pack("<4sBQI", b"HPSU", 1, len(payload), zlib.crc32(payload)) + payload)
    good = {"t0": (np.array([5], np.int64), np.full((1, 16), 3.0, np.float32))}
    pub.publish(good)
    ps = HierarchicalParameterServer.from_config(art / "ps.json")
    try:
        ps.start_background()
        with InferenceServer(ps, ServerConfig(port=0, grpc_port=0)) as srv:
            http = httpx.Client(base_url=f"http://{srv.address}")
            grpc = tg.InferenceServerClient(srv.grpc_address)
            _wait(lambda: http.get("/v2/health/ready").status_code == 503, "not ready")
            r = http.get("/v2/health/ready")
            assert "failed" in r.json()["error"] and "non-finite" in r.json()["error"]
            assert not grpc.is_server_ready()
            st = http.get("/v2/models/tiny/stats").json()["model_stats"][0]["online_updates"]
            assert not st["ready"] and st["failures"] >= 2 and st["refused_offset"]
            args = ["skip", "--config", str(art / "ps.json"), "--offset", st["refused_offset"]]
            assert updates_cli([*args, "--log-id", st["refused_log_id"]]) == 0
            _wait(lambda: http.get("/v2/health/ready").status_code == 200, "ready again")
            assert grpc.is_server_ready()
            st = http.get("/v2/models/tiny/stats").json()["model_stats"][0]["online_updates"]
            assert st["ready"] and st["skipped"] == 1 and st["refused_offset"] is None
            rows = ps.session("tiny").lookup("t0", torch.tensor([4, 5]))
            assert rows[1, 0].item() == 3.0 and rows[0, 0].item() != 1.0
            grpc.close()
            http.close()
    finally:
        ps.close()
