"""Start and stop local ``redis-server`` processes (a cluster, or one node) for tests,
benchmarks and demos. Servers bind 127.0.0.1 on free ports, keep nothing on disk
(``--save "" --appendonly no``) and are stopped by pid.

>>> with LocalRedisCluster(3, workdir) as rc:      # doctest: +SKIP
...     backend = RedisClusterBackend(rc.addresses)
...     rc.kill(1); rc.restart(1)
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"


def redis_available() -> bool:
    """True when ``redis-server`` and ``redis-cli`` are on PATH."""
    return shutil.which(REDIS_SERVER) is not None and shutil.which(REDIS_CLI) is not None


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (and its +10000 cluster-bus port, checked too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port+10000) found on 127.0.0.1")


def _ping(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), "ping"], capture_output=True, text=True
        )
        if r.stdout.strip() == "PONG":
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {timeout_s} s")


class LocalRedisCluster:
    """``n`` local redis-server processes; a Redis cluster when ``cluster`` (default).

    Args:
        n: number of nodes (a cluster needs ≥ 3 masters).
        workdir: folder for node configs and logs.
        cluster: run in cluster mode and create the cluster (``redis-cli --cluster create``).
        node_timeout_ms: ``cluster-node-timeout`` (how soon peers notice a dead node).
    """

    def __init__(
        self, n: int, workdir: str | Path, cluster: bool = True, node_timeout_ms: int = 1000
    ) -> None:
        if cluster and n < 3:
            raise ValueError(f"a Redis cluster needs at least 3 nodes, got {n}")
        self.n = n
        self.workdir = Path(workdir)
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen | None] = []

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.ports]

    @property
    def address(self) -> str:
        """ps.json form: ``"127.0.0.1:P1,127.0.0.1:P2,..."``."""
        return ",".join(f"{h}:{p}" for h, p in self.addresses)

    def _spawn(self, i: int) -> subprocess.Popen:
        port = self.ports[i]
        node_dir = self.workdir / f"node{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(node_dir),
            "--protected-mode",
            "no",
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                "--cluster-require-full-coverage",
                "no",
            ]
        logf = open(node_dir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT)
        logf.close()
        return proc

    def start(self) -> LocalRedisCluster:
        if not redis_available():
            raise RuntimeError(
                "redis-server/redis-cli are not installed (apt-get install redis-server)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = []
        for _ in range(self.n):
            p = free_port()
            while p in self.ports:
                p = free_port()
            self.ports.append(p)
        self.procs = [self._spawn(i) for i in range(self.n)]
        for p in self.ports:
            _ping(p)
        if self.cluster:
            cmd = [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in self.ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                self.stop()
                raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout}\n{r.stderr}")
            self.wait_ok()
        log.info("local redis %s on ports %s", "cluster" if self.cluster else "servers", self.ports)
        return self

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Wait until every live node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = []
            for i, p in enumerate(self.ports):
                if self.procs[i] is None:
                    continue
                r = subprocess.run(
                    [REDIS_CLI, "-p", str(p), "cluster", "info"], capture_output=True, text=True
                )
                states.append("cluster_state:ok" in r.stdout)
            if states and all(states):
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"redis cluster on {self.ports} did not reach cluster_state:ok in {timeout_s} s"
        )

    def kill(self, i: int) -> None:
        """Kill node ``i`` (SIGKILL, by pid): its data is gone, as after a crash."""
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self.procs[i] = None

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its port with its cluster config (it rejoins, empty)."""
        if self.procs[i] is None:
            self.procs[i] = self._spawn(i)
            _ping(self.ports[i])
            if self.cluster:
                self.wait_ok()

    def owner(self, key: str) -> int:
        """The index of the node that owns Redis key ``key`` (its hash slot)."""
        import redis
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for i, port in enumerate(self.ports):
            if self.procs[i] is None:
                continue
            for lo, hi, master, *_ in redis.Redis(port=port).execute_command("CLUSTER SLOTS"):
                if lo <= slot <= hi:
                    return self.ports.index(int(master[1]))
        raise RuntimeError(f"no live node of {self.ports} reports the slot {slot} of {key!r}")

    def stop(self) -> None:
        for i in range(len(self.procs)):
            proc = self.procs[i]
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self.procs[i] = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
