"""``torchrun`` on an :class:`~embark.cluster.netns.EmulatedCluster`: one agent per node,
inside the node's namespace, every rank's gloo traffic over the node's shaped interface.

    with EmulatedCluster(2, LinkShape(2e9, 50e-6)) as c:
        results = run_torchrun(c, ranks_per_node=2, argv=["-m", "embark.sharded_train", ...])

Rendezvous is torchrun's static one at node 0's address (inside node 0's namespace, reachable
only from the cluster's namespaces). ``GLOO_SOCKET_IFNAME`` pins gloo to the node's
interface, so ranks on different nodes talk through the bridge and its shaped links while
ranks of one node reach each other at their own node's address, through ``lo``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from embark.cluster.netns import NODE_IFNAME, EmulatedCluster

MASTER_PORT = 29_513  # inside the cluster's namespaces only: no clash with the host's ports


@dataclass(frozen=True)
class NodeResult:
    """One node's torchrun: exit status and merged output."""

    node: int
    returncode: int
    output: str


def torchrun_argv(
    cluster: EmulatedCluster, node: int, ranks_per_node: int, argv: Sequence[str]
) -> list[str]:
    """The command line of node ``node``'s agent (``python -m torch.distributed.run ...``)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={cluster.nodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={ranks_per_node}",
        f"--master-addr={cluster.node_addr(0)}",
        f"--master-port={MASTER_PORT}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        *argv,
    ]


def run_torchrun(
    cluster: EmulatedCluster,
    ranks_per_node: int,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    cwd: str | None = None,
) -> list[NodeResult]:
    """Run ``torchrun ... argv`` on every node and wait for all of them.

    Args:
        cluster: the entered cluster.
        ranks_per_node: processes per node (``--nproc-per-node``).
        argv: what torchrun runs (``["-m", "module", ...]`` or ``["script.py", ...]``).
        env: the environment (default: this process's), to which ``GLOO_SOCKET_IFNAME`` and
            ``OMP_NUM_THREADS=1`` (unless set) are added.
        timeout_s: wall-clock limit for the whole run.
        cwd: working directory of every node.

    Returns:
        per node, its exit status and output (a node still running at the deadline is killed
        and reported with status -9).
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    full = dict(os.environ if env is None else env)
    full["GLOO_SOCKET_IFNAME"] = NODE_IFNAME
    full.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        cluster.popen(n, torchrun_argv(cluster, n, ranks_per_node, argv), full, cwd)
        for n in range(cluster.nodes)
    ]
    deadline = time.monotonic() + timeout_s
    results = []
    for n, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append(NodeResult(n, p.returncode, out))
        except subprocess.TimeoutExpired:
            cluster.close()  # kills every node's session
            out, _ = p.communicate()
            results.append(NodeResult(n, -9, out + f"\n[killed after {timeout_s:g} s]"))
    return results
