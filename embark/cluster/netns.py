"""An emulated multi-node cluster on one Linux machine: each node a network namespace, the
nodes joined through a bridge (in a namespace of its own) by ``tc``-shaped veth links.

Layout for ``nodes=2`` (every name starts with :data:`PREFIX`, then the owner's pid and a
per-cluster token, so that cleanup finds what a killed run left)::

    namespace  ebkc-<pid>-<tok>-n0          ebkc-<pid>-<tok>-br            ebkc-<pid>-<tok>-n1
               lo, ebk0 10.213.0.1/24 ─veth─ p0 ┐                        ┌ p1 ─veth─ ebk0 10.213.0.2/24
                 tc: tbf rate R                  └──── br0 (bridge) ─────┘  tc: tbf rate R
               ranks 0..g-1 (torchrun)          p0, p1: tbf rate R             ranks g..2g-1

A packet from node 0 to node 1 leaves ``ebk0`` of node 0 (shaped: the node's uplink) and
``p1`` of the bridge (shaped: the node's downlink), so every node sends and receives at most
``R`` bits/s (an optional netem delay ``D`` per hop, where the kernel has ``sch_netem``). Ranks of one node talk to each other over the
node's own address, which the kernel routes through ``lo``: unshaped, memory speed, like
NVLink beside InfiniBand. Nothing is created in the root namespace (veth pairs are created
with both ends already in their namespaces), so deleting the namespaces removes every link
and qdisc.

Lifetime: :class:`EmulatedCluster` is a context manager; leaving it (also by an exception,
``SIGTERM`` or ``SIGINT``) kills the processes it started and deletes its namespaces. A run
killed with ``SIGKILL`` cannot clean up; the next :class:`EmulatedCluster` (or
:func:`remove_stale`) deletes every namespace of this prefix whose owner pid is dead,
killing the processes still inside it first.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

PREFIX = "ebkc-"  # every namespace of the harness starts with this
NODE_IFNAME = "ebk0"  # a node's interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE_NAME = "br0"
SUBNET = "10.213.0"  # /24 inside the harness's namespaces only
NETEM_LIMIT = 100_000  # packets queued in the delay line: deep enough never to drop


class ClusterUnavailable(RuntimeError):
    """The machine cannot host an emulated cluster (not root, or no ``ip`` / ``tc``)."""


@dataclass(frozen=True)
class LinkShape:
    """The shaping of every node's link to the bridge, each direction: a token bucket
    (``tc qdisc ... tbf``), with an added one-way delay through ``netem`` when asked for.

    Args:
        rate_bits_per_s: the node's bandwidth (all its ranks together), > 0.
        delay_s: one-way delay added on each of the two shaped hops, >= 0 (needs the kernel's
            ``sch_netem``; 0 adds none: the veth hops and gloo's TCP stack already cost
            tens of microseconds, more than InfiniBand's ~1-2 µs).
        intra_rate_bits_per_s: the node's loopback (its ranks' traffic to each other) shaped
            to this rate; ``None``: unshaped, as fast as the CPU copies.
    """

    rate_bits_per_s: float
    delay_s: float = 0.0
    intra_rate_bits_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate_bits_per_s > 0:
            raise ValueError(f"LinkShape.rate_bits_per_s must be > 0, got {self.rate_bits_per_s}")
        if not self.delay_s >= 0:
            raise ValueError(f"LinkShape.delay_s must be >= 0, got {self.delay_s}")
        if self.intra_rate_bits_per_s is not None and not self.intra_rate_bits_per_s > 0:
            raise ValueError(
                f"LinkShape.intra_rate_bits_per_s must be > 0 or None, got {self.intra_rate_bits_per_s}"
            )

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_bits_per_s / 8

    def tbf_args(self, rate_bits_per_s: float | None = None) -> list[str]:
        """``tbf`` arguments (of ``rate_bits_per_s``, default the node link's): the rate; a bucket of 2 ms of traffic (256 KiB .. 64 MiB: veth
        hands the qdisc 64 KiB GSO packets, which a smaller bucket could never pass); a queue
        of 0.5 s of traffic (4 MiB .. 256 MiB), so shaping delays packets rather than drop them."""
        bits = self.rate_bits_per_s if rate_bits_per_s is None else rate_bits_per_s
        rate = bits / 8
        burst = min(64 << 20, max(256 << 10, round(rate * 2e-3)))
        limit = min(256 << 20, max(4 << 20, round(rate * 0.5)))
        rate_kbit = max(8, round(bits / 1e3))
        return ["tbf", "rate", f"{rate_kbit}kbit", "burst", str(burst), "limit", str(limit)]

    def netem_args(self) -> list[str]:
        """``netem`` arguments of the added delay (only used when ``delay_s > 0``)."""
        return ["netem", "delay", f"{round(self.delay_s * 1e6)}us", "limit", str(NETEM_LIMIT)]


def missing_capability() -> str | None:
    """Why this machine cannot host an emulated cluster, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed: apt-get install -y iproute2"
    return None


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def harness_namespaces() -> list[str]:
    """Every network namespace whose name starts with :data:`PREFIX`."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def root_links_with_prefix() -> list[str]:
    """Links of the root namespace named like the harness's (there should never be any)."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith((PREFIX, NODE_IFNAME, "ebkp"))]


def _owner_pid(ns: str) -> int | None:
    parts = ns[len(PREFIX) :].split("-")
    return int(parts[0]) if parts and parts[0].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace ``ns`` (all were started by the
    harness that made it), by pid."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(ns: str) -> None:
    _kill_inside(ns)
    _run(["ip", "netns", "del", ns], check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of this prefix whose owner process is dead (a run killed with
    SIGKILL), after killing what still runs inside them; the names deleted."""
    gone = []
    for ns in harness_namespaces():
        pid = _owner_pid(ns)
        if pid is None or not _alive(pid):
            _delete(ns)
            gone.append(ns)
    if gone:
        log.info("removed %d stale namespace(s) of a dead run: %s", len(gone), gone)
    return gone


class EmulatedCluster:
    """``nodes`` network namespaces joined through a bridge by shaped links (module docstring).

    Args:
        nodes: number of nodes (2 .. 250).
        shape: every node link's :class:`LinkShape`.

    Raises:
        ClusterUnavailable: from :meth:`__enter__`, naming what is missing.
        ValueError: for a bad node count.
    """

    def __init__(self, nodes: int, shape: LinkShape) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 250:
            raise ValueError(f"EmulatedCluster: nodes must be an integer in 2..250, got {nodes!r}")
        self.nodes = nodes
        self.shape = shape
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[str]] = []
        self._old_handlers: dict[int, object] = {}

    # ------------------------------------------------------------------ names
    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-br"

    def node_ns(self, node: int) -> str:
        """The namespace of node ``node``."""
        return f"{self.name}-n{node}"

    def node_addr(self, node: int) -> str:
        """Node ``node``'s IPv4 address (inside its namespace only)."""
        return f"{SUBNET}.{node + 1}"

    def namespaces(self) -> list[str]:
        """This cluster's namespaces (bridge first)."""
        return [self.bridge_ns, *(self.node_ns(i) for i in range(self.nodes))]

    # --------------------------------------------------------------- lifetime
    def __enter__(self) -> EmulatedCluster:
        why = missing_capability()
        if why is not None:
            raise ClusterUnavailable(why)
        remove_stale()
        self._trap()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _trap(self) -> None:
        """SIGTERM / SIGINT leave through ``close`` (as an exception would)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def _untrap(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self.bridge_ns
        self._ns(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE_NAME, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE_NAME, "up"])
        for i in range(self.nodes):
            ns, port = self.node_ns(i), f"p{i}"
            self._ns(ns)
            _run(
                ["ip", "-n", ns, "link", "add", NODE_IFNAME, "type", "veth"]
                + ["peer", "name", port, "netns", br]
            )
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE_NAME])
            _run(["ip", "-n", br, "link", "set", port, "up"])
            self._shape(ns, NODE_IFNAME)
            self._shape(br, port)
            if self.shape.intra_rate_bits_per_s is not None:
                tbf = self.shape.tbf_args(self.shape.intra_rate_bits_per_s)
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf])

    def _shape(self, ns: str, dev: str) -> None:
        """The token bucket at the root of ``dev``'s egress, the delay line under it."""
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        _run([*tc, "root", "handle", "1:", *self.shape.tbf_args()])
        if self.shape.delay_s > 0:
            res = _run([*tc, "parent", "1:1", "handle", "10:", *self.shape.netem_args()], False)
            if res.returncode != 0:
                raise ClusterUnavailable(
                    f"LinkShape.delay_s={self.shape.delay_s} needs the netem qdisc, which this "
                    f"kernel refused ({res.stderr.strip()}); use delay_s=0"
                )

    def close(self) -> None:
        """Kill the processes started here, delete the namespaces (idempotent)."""
        try:
            for p in self._procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
            self._procs.clear()
            for ns in reversed(self._made):
                _delete(ns)
            self._made.clear()
        finally:
            self._untrap()

    # ------------------------------------------------------------- processes
    def popen(
        self, node: int, argv: Sequence[str], env: dict[str, str], cwd: str | None = None
    ) -> subprocess.Popen[str]:
        """Start ``argv`` inside node ``node``'s namespace (a session of its own, killed by
        :meth:`close`), stdout and stderr merged into a pipe."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in 0..{self.nodes - 1}, got {node}")
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns(node), *argv],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def qdiscs(self) -> dict[str, str]:
        """``{namespace: tc qdisc show}`` of this cluster's namespaces."""
        return {
            ns: _run(["tc", "-n", ns, "qdisc", "show"], check=False).stdout for ns in self._made
        }


@contextmanager
def emulated_cluster(nodes: int, shape: LinkShape) -> Iterator[EmulatedCluster]:
    """``with emulated_cluster(2, LinkShape(1e9)) as c: ...`` (see :class:`EmulatedCluster`)."""
    with EmulatedCluster(nodes, shape) as c:
        yield c
