"""Two inference processes sharing one Redis cluster both see an update published once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hps.config import parse_config
from hps.parameter_server import HierarchicalParameterServer
from hps.storage.sparse_files import write_table
from hps.updates import RedisStreamPublisher, redis_client
from tests.hps.hps_helpers import make_table

pytestmark = pytest.mark.redis
DIM = 4


def _ask(proc: subprocess.Popen, cmd: dict) -> dict:
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"replica exited: {proc.stderr.read()}")
    return json.loads(line)


def test_two_processes_see_one_update(redis_cluster, tmp_path: Path) -> None:
    table = f"so_{tmp_path.name[-12:]}".replace("-", "_")
    keys, rows = make_table(300, DIM, seed=9)
    write_table(tmp_path / "sparse" / table, keys, rows)
    stream = f"stream_{table}"

    def doc(state: str) -> dict:
        return {
            "volatile_db": {
                "type": "redis_cluster",
                "address": redis_cluster.address,
                "num_partitions": 4,
            },
            "update_source": {"type": "redis_stream", "stream": stream, "state_path": state},
            "models": [
                {
                    "model": "m",
                    "max_batch_size": 64,
                    "sparse_files": [f"sparse/{table}"],
                    "embedding_table_names": [table],
                    "embedding_vecsize_per_table": [DIM],
                    "maxnum_catfeature_query_per_table_per_sample": [1],
                    "gpucacheper": 0.5,
                    "cache_exact": True,
                    "hit_rate_threshold": 1.0,
                }
            ],
        }

    loader = HierarchicalParameterServer(
        parse_config(doc("loader.off"), tmp_path)
    )  # fills Redis once
    loader.close()
    env = {
        **os.environ,
        # the repository root first: the replica imports this checkout's hps
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
        ),
    }
    procs = []
    try:
        for i in range(2):
            cfg = tmp_path / f"ps{i}.json"
            cfg.write_text(json.dumps(doc(f"replica{i}.off")))
            p = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "hps_replica.py"), str(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            procs.append(p)
        for p in procs:
            assert json.loads(p.stdout.readline())["ready"]
        q = keys[:8].tolist()
        for p in procs:  # both cache the old rows
            assert np.array_equal(
                np.array(_ask(p, {"op": "lookup", "table": table, "keys": q})["rows"]), rows[:8]
            )
        client = redis_client(redis_cluster.address, cluster=True)
        RedisStreamPublisher(client, stream).publish(
            {table: (keys[:8].copy(), rows[:8] + 0.5)}
        )  # once
        for p in procs:
            assert _ask(p, {"op": "poll"})["applied"] == 1
            got = np.array(_ask(p, {"op": "lookup", "table": table, "keys": q})["rows"])
            assert np.array_equal(got, rows[:8] + 0.5)
        client.delete(stream)
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
