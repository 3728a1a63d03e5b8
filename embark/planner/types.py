"""Planner data types: constraints, cost constants, simulation results, the planner error.

Strategies (greedy, local search, baselines) live in their own modules and only exchange
these types and :mod:`embark.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embark.types import Cluster, ShardingType


def format_bytes(n: float) -> str:
    """``1.5e9 -> '1.50 GB'``, ``2e6 -> '2.00 MB'`` (decimal units, as HBM sizes are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class TableConstraints:
    """User constraints on one table.

    Args:
        sharding_types: allowed layouts (``None`` = any).
        ranks: the only ranks its shards may use (``None`` = any).
        cluster: forced cluster (``None`` = the planner chooses).
    """

    sharding_types: tuple[ShardingType, ...] | None = None
    ranks: tuple[int, ...] | None = None
    cluster: Cluster | None = None

    def __post_init__(self) -> None:
        if self.sharding_types is not None:
            try:
                types = tuple(ShardingType(t) for t in self.sharding_types)
            except ValueError:
                raise ValueError(
                    f"sharding_types must be among {[t.value for t in ShardingType]}, "
                    f"got {list(self.sharding_types)}"
                ) from None
            if not types:
                raise ValueError("sharding_types must not be empty (use None for any)")
            object.__setattr__(self, "sharding_types", types)
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            if not ranks or any(
                isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks
            ):
                raise ValueError(
                    f"ranks must be a non-empty list of non-negative ints, got {self.ranks!r}"
                )
            object.__setattr__(self, "ranks", tuple(sorted(set(ranks))))
        if self.cluster is not None:
            try:
                object.__setattr__(self, "cluster", Cluster(self.cluster))
            except ValueError:
                raise ValueError(
                    f"cluster must be one of {[c.value for c in Cluster]}, got {self.cluster!r}"
                ) from None
        if (
            self.cluster is Cluster.DP
            and self.sharding_types
            and ShardingType.DP not in self.sharding_types
        ):
            raise ValueError(
                "cluster 'data_parallel' needs sharding type 'data_parallel' to be allowed"
            )

    def allows(self, st: ShardingType) -> bool:
        return self.sharding_types is None or st in self.sharding_types

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConstraints:
        allowed = {"sharding_types", "ranks", "cluster"}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"constraints: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        for key in ("sharding_types", "ranks"):
            if d.get(key) is not None and not isinstance(d[key], (list, tuple)):
                raise ValueError(f"{key} must be a list, got {d[key]!r}")
        st = d.get("sharding_types")
        return cls(
            sharding_types=tuple(st) if st is not None else None,
            ranks=tuple(d["ranks"]) if d.get("ranks") is not None else None,
            cluster=d.get("cluster"),
        )


@dataclass(frozen=True)
class CostConstants:
    """Efficiency factors and sizes of the cost model. The hardware peaks come from the
    :class:`~embark.types.Topology`; these say how much of a peak a kernel reaches.

    Args:
        lookup_hbm_efficiency: fraction of peak HBM bandwidth reached by row gathers and
            scatters of 128–1024-byte rows (assumed 0.6; FBGEMM's TBE benchmarks report
            roughly half to two thirds of peak for such rows).
        intra_a2a_efficiency: fraction of NVLink bandwidth an NCCL all-to-all reaches
            (assumed 0.8; nccl-tests alltoall bus bandwidth on DGX H100 ≈ 360 of 450 GB/s).
        inter_a2a_efficiency: same over InfiniBand (assumed 0.8; ≈ 40 of 50 GB/s).
        dense_mfu: fraction of dense peak FLOP/s the MLPs reach (assumed 0.5).
        hbm_reserved_fraction: HBM kept free for activations, the dense model, workspaces and
            communication buffers (assumed 0.1).
        weight_bytes: bytes per stored weight (fp32 master weights).
        key_bytes: bytes per key on the wire (int64, the JaggedBatch dtype).
        length_bytes: bytes per bag length on the wire (int32).
        min_column_block: smallest column block the planner creates (elements).
        dp_sparse_allgather: a data-parallel table's gradients may travel as an all-gather of
            the touched rows when that is cheaper than the ring all-reduce of the whole
            replica. ``embark.sharding`` all-reduces whole replicas: rating a plan for it
            (e.g. on the emulated cluster) needs ``False``.
    """

    lookup_hbm_efficiency: float = 0.6
    intra_a2a_efficiency: float = 0.8
    inter_a2a_efficiency: float = 0.8
    dense_mfu: float = 0.5
    hbm_reserved_fraction: float = 0.1
    weight_bytes: int = 4
    key_bytes: int = 8
    length_bytes: int = 4
    min_column_block: int = 32
    dp_sparse_allgather: bool = True

    def __post_init__(self) -> None:
        for f in (
            "lookup_hbm_efficiency",
            "intra_a2a_efficiency",
            "inter_a2a_efficiency",
            "dense_mfu",
        ):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"CostConstants.{f} must be in (0, 1], got {v!r}")
        if not 0 <= self.hbm_reserved_fraction < 1:
            raise ValueError(
                f"CostConstants.hbm_reserved_fraction must be in [0, 1), got {self.hbm_reserved_fraction!r}"
            )


@dataclass(frozen=True)
class GpuStats:
    """One rank's share of an iteration (times in milliseconds, memory in bytes)."""

    rank: int
    memory_bytes: float
    memory_cap_bytes: float
    lookup_fwd_ms: float
    lookup_bwd_ms: float
    input_a2a_ms: float
    output_a2a_ms: float
    grad_a2a_ms: float
    dp_allreduce_ms: float
    num_tables: int
    num_shards: int

    @property
    def lookup_ms(self) -> float:
        return self.lookup_fwd_ms + self.lookup_bwd_ms

    @property
    def comm_ms(self) -> float:
        return self.input_a2a_ms + self.output_a2a_ms + self.grad_a2a_ms + self.dp_allreduce_ms

    @property
    def total_ms(self) -> float:
        return self.lookup_ms + self.comm_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "memory_gb": self.memory_bytes / 1e9,
            "memory_cap_gb": self.memory_cap_bytes / 1e9,
            "lookup_fwd_ms": self.lookup_fwd_ms,
            "lookup_bwd_ms": self.lookup_bwd_ms,
            "input_a2a_ms": self.input_a2a_ms,
            "output_a2a_ms": self.output_a2a_ms,
            "grad_a2a_ms": self.grad_a2a_ms,
            "dp_allreduce_ms": self.dp_allreduce_ms,
            "lookup_ms": self.lookup_ms,
            "comm_ms": self.comm_ms,
            "num_tables": self.num_tables,
            "num_shards": self.num_shards,
        }


@dataclass(frozen=True)
class SimResult:
    """Simulated iteration of one plan.

    Collectives synchronise the ranks, so each phase lasts as long as its slowest rank:
    ``embedding_ms = Σ_phase max_rank(phase)``. ``step_ms`` overlaps the input all-to-all
    and the data-parallel all-reduce with the dense compute (pipelining, as EMBark and
    TorchRec's train pipeline do); ``step_ms_no_overlap`` runs everything back to back.
    """

    step_ms: float
    step_ms_no_overlap: float
    embedding_ms: float
    dense_ms: float
    phases_ms: dict[str, float]
    per_gpu: tuple[GpuStats, ...]
    table_ms: dict[str, float] = field(default_factory=dict)
    fits_memory: bool = True

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank embedding time (1.0 = perfectly balanced)."""
        totals = [g.total_ms for g in self.per_gpu]
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "simulated_step_ms": self.step_ms,
            "simulated_step_ms_no_overlap": self.step_ms_no_overlap,
            "embedding_ms": self.embedding_ms,
            "dense_ms": self.dense_ms,
            "phases_ms": dict(self.phases_ms),
            "imbalance": self.imbalance,
            "fits_memory": self.fits_memory,
            "per_gpu": [g.to_dict() for g in self.per_gpu],
        }
