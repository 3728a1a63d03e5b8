"""The README's quick starts run as written.

The Python blocks of quick starts (a), (c), (d) and (e) are taken from README.md and run in a
fresh folder, in the README's order of dependence: (d) writes ``out/``, (c) looks rows up from
``out/ps.json``, the server of (d) serves ``out/`` and (d)'s client scores a request; (e) runs
over a small ``ratings.parquet`` with the columns it names, written by the test. Only the
server's ports are changed (free ones instead of 8000 and 8001). The shell commands of (b) are covered
by the CLI tests of ``embark.plan`` and ``embark.sharded_train``.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.embark.gloo_world import free_port

ROOT = Path(__file__).resolve().parents[1]


def quick_starts() -> dict[str, list[tuple[str, str]]]:
    """``{"a": [(language, code), ...], ...}``: the fenced blocks under each ``**(x) ...**``."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick starts", 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^\*\*\(([a-z])\)", section, flags=re.M)[1:]:
        if len(part) == 1:
            key = part
            out[key] = []
            continue
        out[key] = re.findall(r"```(\w+)\n(.*?)```", part, flags=re.S)
    return out


def run_python(code: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"README block failed:\n{code}\n--- output:\n{r.stdout}{r.stderr}"
    return r.stdout


def test_the_readme_has_the_five_quick_starts() -> None:
    blocks = quick_starts()
    assert sorted(blocks) == ["a", "b", "c", "d", "e"]
    assert [lang for lang, _ in blocks["e"]] == ["python"]
    assert [lang for lang, _ in blocks["d"]] == ["python", "bash", "python"]
    assert [lang for lang, _ in blocks["a"]] == ["python"]
    assert [lang for lang, _ in blocks["c"]] == ["python"]


def test_quick_start_a_prunes_and_compresses(tmp_path: Path) -> None:
    (code,) = [c for _, c in quick_starts()["a"]]
    out = run_python(code + "\nprint(type(model[0]).__name__, tuple(y.shape))\n", tmp_path)
    sparsity, last = out.strip().splitlines()[-2:]
    assert sparsity == "0.75"
    assert last == "TileSparseLinear (256, 1024)"


def _write_ratings(path: Path) -> None:
    """A small ``ratings.parquet`` with the columns quick start (e) names."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    n = 2048
    genres = [list(rng.choice(18, size=int(k), replace=False)) for k in rng.integers(0, 4, n)]
    table = pa.table(
        {
            "user_id": rng.integers(0, 300, n),
            "genres": genres,
            "age": rng.integers(18, 70, n).astype("float64"),
            "rating": rng.integers(1, 6, n).astype("float64"),
        }
    )
    pq.write_table(table, path)


def test_quick_start_e_trains_on_a_parquet_file_and_exports(tmp_path: Path) -> None:
    (code,) = [c for _, c in quick_starts()["e"]]
    _write_ratings(tmp_path / "ratings.parquet")  # the test's input, in process
    run_python(code, tmp_path)
    out = tmp_path / "out"
    assert {"dense.onnx", "ps.json", "sparse", "vocabulary.json"} <= {p.name for p in out.iterdir()}
    vocab = (out / "vocabulary.json").read_text()
    assert "user_id" in vocab and "genres" in vocab


@pytest.mark.slow
def test_quick_starts_d_and_c_export_look_up_and_serve(tmp_path: Path) -> None:
    export_code, server_cmd, client_code = (c for _, c in quick_starts()["d"])
    run_python(export_code, tmp_path)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "dense.onnx",
        "ps.json",
        "sparse",
        "vocabulary.json",
    ]

    (lookup_code,) = [c for _, c in quick_starts()["c"]]
    lines = run_python(lookup_code + "print(tuple(rows.shape))\n", tmp_path).strip().splitlines()
    hit_rate, shape = ast.literal_eval(lines[-2]), ast.literal_eval(lines[-1])
    assert shape[:2] == (2, 2) and len(shape) == 3
    for over in ("unique", "all"):  # every key was answered by exactly one tier
        assert set(hit_rate[over]) == {"cache", "volatile", "persistent", "default"}
        assert sum(hit_rate[over].values()) == pytest.approx(1.0)

    port, grpc_port = free_port(), free_port()
    while grpc_port == port:
        grpc_port = free_port()
    argv = server_cmd.split("#")[0].split()  # the command, without its comment
    assert argv[:3] == ["python", "-m", "hps.server"] and "8000" in argv and "8001" in argv
    argv = [sys.executable, *argv[1:]]
    argv[argv.index("8000")] = str(port)
    argv[argv.index("8001")] = str(grpc_port)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        client = client_code.replace("localhost:8000", f"localhost:{port}")
        ready = (
            "import time, tritonclient.http as http\n"
            f"c = http.InferenceServerClient('localhost:{port}')\n"
            "for _ in range(300):\n"
            "    try:\n"
            "        if c.is_server_ready(): break\n"
            "    except Exception: pass\n"
            "    time.sleep(0.2)\n"
        )
        out = run_python(ready + client, tmp_path)
        probs = [float(v) for v in re.findall(r"[-+0-9.e]+", out.strip().splitlines()[-1])]
        assert len(probs) == 4 and all(0.0 < p < 1.0 for p in probs), out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
