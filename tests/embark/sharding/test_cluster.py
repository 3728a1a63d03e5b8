"""The emulated cluster (:mod:`embark.cluster`): sharded training across network namespaces
equals one process; pipelined equals unpipelined; nothing is left behind, also after a run
killed with SIGKILL.

Needs root and iproute2: without them these tests fail when ``CI=true`` and skip elsewhere,
naming what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from embark.cluster import (
    EmulatedCluster,
    LinkShape,
    harness_namespaces,
    missing_capability,
    remove_stale,
    root_links_with_prefix,
    run_torchrun,
)
from tests.embark.sharding import cluster_worker
from tests.tolerances import tol

ROOT = Path(__file__).resolve().parents[3]
SHAPE = LinkShape(rate_bits_per_s=1e9)


@pytest.fixture(autouse=True)
def _capability() -> None:
    why = missing_capability()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"emulated cluster unavailable in CI: {why}")
        pytest.skip(why)


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (``None``: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _tc_root() -> str:
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def test_cluster_is_built_shaped_and_removed() -> None:
    root_qdiscs = _tc_root()
    with EmulatedCluster(2, SHAPE) as c:
        names = c.namespaces()
        assert set(names) <= set(harness_namespaces())
        qd = c.qdiscs()
        # every node's uplink and every bridge port carries the token bucket at 1 Gbit/s
        for i in range(2):
            assert "tbf 1: dev ebk0 root" in qd[c.node_ns(i)] and "rate 1Gbit" in qd[c.node_ns(i)]
            assert f"tbf 1: dev p{i} root" in qd[c.bridge_ns]
        assert root_links_with_prefix() == []
    assert not set(names) & set(harness_namespaces())
    assert root_links_with_prefix() == []
    assert _tc_root() == root_qdiscs


HOLDER = """
import sys, time
from embark.cluster import EmulatedCluster, LinkShape
c = EmulatedCluster(2, LinkShape(1e9)).__enter__()
p = c.popen(0, ["sleep", "300"], {"PATH": "/usr/bin:/bin"})
print(" ".join(c.namespaces()), p.pid, flush=True)
time.sleep(300)
"""


def test_sigkilled_run_is_cleaned_up_by_the_next() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        *names, sleeper = holder.stdout.readline().split()
        assert names, "the holder did not report its namespaces"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    pid = int(sleeper)
    # the dead run left its namespaces and the process it started inside one
    assert set(names) <= set(harness_namespaces())
    assert _state(pid) not in (None, "Z")
    with EmulatedCluster(2, SHAPE) as c:  # the next run removes what the dead one left
        assert not set(names) & set(harness_namespaces())
        assert set(c.namespaces()) <= set(harness_namespaces())
    for _ in range(100):  # reaped by init once killed
        if _state(pid) in (None, "Z"):
            break
        time.sleep(0.05)
    assert _state(pid) in (None, "Z")
    assert not set(names) & set(harness_namespaces())
    assert root_links_with_prefix() == []
    assert remove_stale() == []


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 nodes × 1 rank: the worker's runs, written under the returned folder."""
    out = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with EmulatedCluster(2, SHAPE) as c:
        res = run_torchrun(
            c, 1, [cluster_worker.__file__, str(out)], env=env, timeout_s=180, cwd=str(ROOT)
        )
    for r in res:
        assert r.returncode == 0, f"node {r.node} failed:\n{r.output[-3000:]}"
    return out


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], list[float]]:
    """The single-process Trainer on the whole global batches."""
    import torch

    from embark.data import SyntheticCTR
    from embark.models.dlrm import build_model
    from embark.models.workloads import get_workload
    from embark.training.trainer import TrainConfig, Trainer

    torch.set_num_threads(1)
    w = get_workload("tiny")
    data = SyntheticCTR(w, cluster_worker.GLOBAL_BATCH, seed=cluster_worker.DATA_SEED)
    t = Trainer(build_model(w, seed=cluster_worker.MODEL_SEED), TrainConfig(**cluster_worker.TRAIN))
    losses = [t.train_step(b) for b in data.batches(cluster_worker.STEPS)]
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}, losses


@pytest.mark.slow
def test_sharded_across_namespaces_equals_single_process(
    cluster_run: Path, reference: tuple[dict[str, Any], list[float]]
) -> None:
    import torch
    from safetensors.torch import load_file

    want, want_losses = reference
    reports = [json.loads((cluster_run / f"rank{r}.json").read_text()) for r in range(2)]
    # two ranks in two namespaces, neither the test's own, gloo over the shaped interface
    inodes = {rep["netns"] for rep in reports}
    assert len(inodes) == 2 and os.stat("/proc/self/ns/net").st_ino not in inodes
    assert all(rep["ifname"] == "ebk0" and rep["master_addr"] == "10.213.0.1" for rep in reports)
    for r, rep in enumerate(reports):
        got = load_file(str(cluster_run / f"plain-rank{r}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tol("sharded_train"), msg=f"{r} {k}")
        torch.testing.assert_close(
            torch.tensor(rep["plain"]), torch.tensor(want_losses), **tol("sharded_train")
        )


@pytest.mark.slow
def test_pipelined_equals_unpipelined_across_namespaces(cluster_run: Path) -> None:
    """Bit for bit: the pipeline issues the same collectives on the same data, earlier."""
    import torch
    from safetensors.torch import load_file

    for r in range(2):
        rep = json.loads((cluster_run / f"rank{r}.json").read_text())
        assert rep["prefetched"] == cluster_worker.STEPS  # every step's input started ahead
        assert rep["pipelined"] == rep["plain"]
        plain = load_file(str(cluster_run / f"plain-rank{r}.safetensors"))
        piped = load_file(str(cluster_run / f"pipelined-rank{r}.safetensors"))
        assert plain.keys() == piped.keys()
        for k in plain:
            assert torch.equal(plain[k], piped[k]), k
