"""The cost model: bytes each rank moves per training iteration, per table, and the times
they take.

Per table sharding the model fills a ``(world_size, NUM_CHANNELS)`` array of bytes
(:meth:`CostModel.traffic`); arrays add over tables, and :meth:`CostModel.phase_times` turns
the sum into per-rank seconds. Conventions (``B`` global batch, ``b = B / W`` per rank,
``h`` hotness, ``w`` a column block's width, ``f`` a shard's fraction of the rows, ``e``
the wire dtype's bytes; ids are assumed hashed, so a shard receives a share ``f`` of the
lookups and of the distinct keys):

* lookup (HBM): forward reads ``h·f·B`` rows of ``w`` fp32 values; backward scatters the
  gradients and updates the distinct rows (read + write weight and optimizer state).
* reduction cluster: keys ``b·h·f`` (int64) + ``b`` lengths go to each owner; owners pool
  partial sums for all ``B`` samples, reduce them inside the node (reduce-scatter over
  NVLink), then each node sends one ``b × w`` partial to every rank (hierarchical); on one
  node, every owner sends each other rank its ``b × w`` partial (the runtime's flat exchange).
* unique cluster: each rank de-duplicates its ``b·h`` keys (expected distinct count
  ``U(b·h)`` under the table's Zipf, :mod:`embark.planner.zipf`) and receives one vector per
  distinct key from its owner; pooling happens at the destination.
* data parallel: local lookups; gradients all-reduced (hierarchical ring, or an all-gather
  of the distinct rows' gradients when smaller).
* backward all-to-all mirrors the forward output all-to-all byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embark.models.workloads import Workload
from embark.planner.types import CostConstants
from embark.planner.zipf import expected_distinct
from embark.types import Cluster, TableConfig, TableSharding, Topology

# Channels of the traffic array (bytes per rank per iteration).
LOOKUP_FWD, LOOKUP_BWD = 0, 1
KEY_SEND_INTRA, KEY_RECV_INTRA, KEY_SEND_INTER, KEY_RECV_INTER = 2, 3, 4, 5
OUT_SEND_INTRA, OUT_RECV_INTRA, OUT_SEND_INTER, OUT_RECV_INTER = 6, 7, 8, 9
AR_INTRA, AR_INTER = 10, 11
NUM_CHANNELS = 12

OPTIMIZER_STATES = {"sgd": 0, "adagrad": 1}  # fp32 state values per weight (elementwise Adagrad)


@dataclass(frozen=True)
class TableStats:
    """Batch-dependent facts of one table: draws and expected distinct keys."""

    config: TableConfig
    local_ids: float  # b·h
    global_ids: float  # B·h
    local_unique: float  # U(b·h)
    global_unique: float  # U(B·h)


class CostModel:
    """Per-iteration bytes and times for ``workload`` on ``topology`` at global batch
    ``batch_size`` (samples per iteration over all ranks).

    Raises:
        ValueError: for a batch smaller than the number of ranks.
    """

    def __init__(
        self,
        workload: Workload,
        topology: Topology,
        batch_size: int,
        constants: CostConstants | None = None,
    ) -> None:
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, int)
            or batch_size < topology.world_size
        ):
            raise ValueError(
                f"batch_size must be an integer >= world_size {topology.world_size}, got {batch_size!r}"
            )
        self.workload = workload
        self.topology = topology
        self.batch_size = batch_size
        self.c = constants or CostConstants()
        self.world = topology.world_size
        self.gpn = topology.gpus_per_node
        self.nodes = topology.num_nodes
        self.local_batch = batch_size / self.world
        self.node_of = np.arange(self.world) // self.gpn
        self.opt_states = OPTIMIZER_STATES[workload.optimizer]
        self.tables: dict[str, TableStats] = {}
        for t in workload.tables:
            lb, gb = self.local_batch * t.hotness, batch_size * t.hotness
            self.tables[t.name] = TableStats(
                t,
                lb,
                gb,
                expected_distinct(t.num_rows, workload.zipf_alpha, lb),
                expected_distinct(t.num_rows, workload.zipf_alpha, gb),
            )

    # -- memory --------------------------------------------------------------------------
    @property
    def memory_cap_bytes(self) -> float:
        """Bytes of one GPU available to embedding tables."""
        return self.topology.hbm_capacity_bytes * (1 - self.c.hbm_reserved_fraction)

    def bytes_per_element(self) -> float:
        """Weight plus optimizer-state bytes stored per table element."""
        return self.c.weight_bytes * (1 + self.opt_states)

    def memory(self, ts: TableSharding) -> np.ndarray:
        """``(world_size,)`` bytes of weights + optimizer state ``ts`` puts on each rank."""
        out = np.zeros(self.world)
        per = self.bytes_per_element()
        for s in ts.shards:
            out[s.rank] += s.num_rows * s.num_cols * per
        return out

    # -- traffic -------------------------------------------------------------------------
    def traffic(self, ts: TableSharding) -> np.ndarray:
        """``(world_size, NUM_CHANNELS)`` bytes moved per iteration because of ``ts``."""
        st = self.tables[ts.name]
        acc = np.zeros((self.world, NUM_CHANNELS))
        if ts.cluster is Cluster.DP:
            self._dp(st, ts, acc)
            return acc
        for c0, c1 in ts.column_blocks:
            block = [s for s in ts.shards if s.col_start == c0]
            ranks = np.array([s.rank for s in block])
            frac = np.array([s.num_rows for s in block], dtype=np.float64) / st.config.num_rows
            self._block(st, ts.cluster, ts.comm_dtype.nbytes, c1 - c0, ranks, frac, acc)
        return acc

    def block_traffic(
        self,
        name: str,
        cluster: Cluster,
        comm_bytes: int,
        width: int,
        ranks: np.ndarray,
        frac: np.ndarray,
    ) -> np.ndarray:
        """``(W, NUM_CHANNELS)`` bytes of one column block of table ``name``, ``width``
        columns wide, row-split over ``ranks`` (distinct) with row fractions ``frac``."""
        acc = np.zeros((self.world, NUM_CHANNELS))
        self._block(
            self.tables[name],
            cluster,
            comm_bytes,
            width,
            np.asarray(ranks),
            np.asarray(frac, dtype=np.float64),
            acc,
        )
        return acc

    def _dp(self, st: TableStats, ts: TableSharding, acc: np.ndarray) -> None:
        d, h, wb = st.config.dim, st.config.hotness, self.c.weight_bytes
        b, e = self.local_batch, ts.comm_dtype.nbytes
        upd = 2 + 2 * self.opt_states
        acc[:, LOOKUP_FWD] += b * h * d * wb + b * d * wb
        acc[:, LOOKUP_BWD] += b * h * d * wb + st.global_unique * d * wb * upd
        if self.world == 1:
            return
        g, n = self.gpn, self.nodes
        ring = st.config.num_rows * d * e
        ring_intra, ring_inter = 2 * (g - 1) / g * ring, 2 * (n - 1) / n * ring / g
        sparse = st.local_unique * (d * e + self.c.key_bytes)
        ag_intra, ag_inter = (g - 1) * n * sparse, (n - 1) * sparse
        if self.c.dp_sparse_allgather and self._link_time(ag_intra, ag_inter) < self._link_time(
            ring_intra, ring_inter
        ):
            ring_intra, ring_inter = ag_intra, ag_inter
        acc[:, AR_INTRA] += ring_intra
        acc[:, AR_INTER] += ring_inter

    def _link_time(self, intra: float, inter: float) -> float:
        t = self.topology
        return intra / (
            t.intra_node_bandwidth_bytes_per_s * self.c.intra_a2a_efficiency
        ) + inter / (t.inter_node_bandwidth_bytes_per_s * self.c.inter_a2a_efficiency)

    def _block(
        self,
        st: TableStats,
        cluster: Cluster,
        e: int,
        w: int,
        ranks: np.ndarray,
        frac: np.ndarray,
        acc: np.ndarray,
    ) -> None:
        """One column block of width ``w`` row-split over ``ranks`` (row fractions ``frac``)."""
        h, wb, kb = st.config.hotness, self.c.weight_bytes, self.c.key_bytes
        B, b = self.batch_size, self.local_batch
        W, G = self.world, self.gpn
        upd = 2 + 2 * self.opt_states
        unique = cluster is Cluster.UNIQUE
        owner_nodes = ranks // G
        is_owner = np.zeros(W, dtype=bool)
        is_owner[ranks] = True
        f_self = np.zeros(W)
        f_self[ranks] = frac
        node_frac = np.bincount(owner_nodes, weights=frac, minlength=self.nodes)
        node_owners = np.bincount(owner_nodes, minlength=self.nodes).astype(np.float64)
        my_node = self.node_of

        # Input distribution: bytes one rank sends to each owner.
        if unique:
            key_per_owner = st.local_unique * frac * kb
        else:
            key_per_owner = b * (h * frac * kb + self.c.length_bytes)
        node_keys = np.bincount(owner_nodes, weights=key_per_owner, minlength=self.nodes)
        self_keys = np.zeros(W)
        self_keys[ranks] = key_per_owner
        acc[:, KEY_SEND_INTRA] += node_keys[my_node] - self_keys
        acc[:, KEY_SEND_INTER] += node_keys.sum() - node_keys[my_node]
        acc[ranks, KEY_RECV_INTRA] += key_per_owner * (G - 1)
        acc[ranks, KEY_RECV_INTER] += key_per_owner * (W - G)

        if unique:
            vec = st.local_unique * frac * w * e  # to each destination rank
            acc[ranks, OUT_SEND_INTRA] += vec * (G - 1)
            acc[ranks, OUT_SEND_INTER] += vec * (W - G)
            per_dest = st.local_unique * w * e
            acc[:, OUT_RECV_INTRA] += per_dest * (node_frac[my_node] - f_self)
            acc[:, OUT_RECV_INTER] += per_dest * (1.0 - node_frac[my_node])
            gathered = W * st.local_unique * frac * w * wb
            acc[ranks, LOOKUP_FWD] += 2 * gathered
            acc[ranks, LOOKUP_BWD] += gathered + st.global_unique * frac * w * wb * upd
            acc[:, LOOKUP_FWD] += b * h * w * wb  # pooling at the destination
            acc[:, LOOKUP_BWD] += b * h * w * wb
            return

        if self.nodes == 1:
            # one node: the runtime's flat exchange (hierarchical mode needs two nodes): every
            # owner sends each other rank its (b, w) partial; the same bytes in total as the
            # reduce-scatter below, spread differently over the ranks
            acc[ranks, OUT_SEND_INTRA] += (W - 1) * b * w * e
            acc[:, OUT_RECV_INTRA] += (ranks.size - is_owner) * b * w * e
            reads = B * h * frac * w * wb
            acc[ranks, LOOKUP_FWD] += reads + B * w * wb
            acc[ranks, LOOKUP_BWD] += reads + st.global_unique * frac * w * wb * upd
            return
        k_m = node_owners[owner_nodes]
        rs = (k_m - 1) / k_m * B * w * e  # reduce-scatter of partial sums inside the node
        acc[ranks, OUT_SEND_INTRA] += rs + (G - k_m) / k_m * b * w * e
        acc[ranks, OUT_RECV_INTRA] += rs
        acc[ranks, OUT_SEND_INTER] += (W - G) / k_m * b * w * e
        has_owner = node_owners[my_node] > 0
        acc[:, OUT_RECV_INTRA] += np.where(has_owner & ~is_owner, b * w * e, 0.0)
        n_owner_nodes = float(np.count_nonzero(node_owners))
        acc[:, OUT_RECV_INTER] += (n_owner_nodes - has_owner) * b * w * e
        reads = B * h * frac * w * wb
        acc[ranks, LOOKUP_FWD] += reads + B * w * wb
        acc[ranks, LOOKUP_BWD] += reads + st.global_unique * frac * w * wb * upd

    # -- times ---------------------------------------------------------------------------
    def phase_times(self, acc: np.ndarray, latency: bool = True) -> dict[str, np.ndarray]:
        """Per-rank seconds of each phase from summed traffic ``acc`` ``(W, NUM_CHANNELS)``.

        Returns ``lookup_fwd``, ``lookup_bwd``, ``input_a2a``, ``output_a2a``, ``grad_a2a``
        (the backward mirror of ``output_a2a``) and ``dp_allreduce``, each ``(W,)``.
        A full-duplex link moves send and receive at once: a phase's time on one level is
        ``max(send, recv) / bandwidth``; the intra-node and inter-node levels run one after
        the other (hierarchical). ``latency=False`` leaves out the fixed per-collective cost
        (to rate one table alone: the collectives are shared by all tables).
        """
        t, c = self.topology, self.c
        hbm = t.hbm_bandwidth_bytes_per_s * c.lookup_hbm_efficiency
        bi = t.intra_node_bandwidth_bytes_per_s * c.intra_a2a_efficiency
        be = t.inter_node_bandwidth_bytes_per_s * c.inter_a2a_efficiency

        def a2a(si: int, ri: int, se: int, re: int) -> np.ndarray:
            intra = np.maximum(acc[:, si], acc[:, ri])
            inter = np.maximum(acc[:, se], acc[:, re])
            out = intra / bi + inter / be
            if latency and intra.any():
                out = out + t.intra_node_latency_s
            if latency and inter.any():
                out = out + t.inter_node_latency_s
            return out

        out_a2a = a2a(OUT_SEND_INTRA, OUT_RECV_INTRA, OUT_SEND_INTER, OUT_RECV_INTER)
        ar = acc[:, AR_INTRA] / bi + acc[:, AR_INTER] / be
        return {
            "lookup_fwd": acc[:, LOOKUP_FWD] / hbm,
            "lookup_bwd": acc[:, LOOKUP_BWD] / hbm,
            "input_a2a": a2a(KEY_SEND_INTRA, KEY_RECV_INTRA, KEY_SEND_INTER, KEY_RECV_INTER),
            "output_a2a": out_a2a,
            "grad_a2a": out_a2a,
            "dp_allreduce": ar,
        }

    def step_seconds(self, acc: np.ndarray) -> tuple[float, float, float]:
        """``(pipelined step, step without overlap, embedding time)`` in seconds."""
        ph = self.phase_times(acc)
        m = {k: float(v.max()) for k, v in ph.items()}
        emb = sum(m.values())
        dense = self.dense_seconds()
        hidden = m["input_a2a"] + m["dp_allreduce"]
        critical = emb - hidden + dense
        return critical + max(0.0, hidden - dense), emb + dense, emb

    # -- dense part ----------------------------------------------------------------------
    def dense_flops_per_sample(self) -> float:
        """Forward FLOPs of bottom MLP + interaction + top MLP for one sample."""
        w = self.workload
        flops, width = 0.0, w.dense_features
        for out in w.bottom_mlp:
            flops += 2 * width * out
            width = out
        n_feat = len(w.tables) + 1
        if w.interaction.type == "dot":
            flops += n_feat * n_feat * w.bottom_mlp[-1]  # (F²/2 dots) × 2·dim
            width = w.bottom_mlp[-1] + n_feat * (n_feat - 1) // 2
        else:
            width = w.bottom_mlp[-1] + sum(t.dim for t in w.tables)
            flops += w.interaction.num_layers * (4 * width * w.interaction.low_rank + 3 * width)
        for out in w.top_mlp:
            flops += 2 * width * out
            width = out
        return flops

    def dense_seconds(self) -> float:
        """Forward + backward (3× forward) of the dense part for one rank's batch."""
        peak = self.topology.dense_peak_flops_per_s * self.c.dense_mfu
        return 3 * self.dense_flops_per_sample() * self.local_batch / peak
