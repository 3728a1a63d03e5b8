"""Data types of a sharding plan, shared by the embark packages: topologies, shards and plans.

Only dataclasses and enums live here; strategies live in ``embark.planner``. The table types
(:class:`TableConfig`, :class:`Combiner`, :class:`HotnessPolicy`) live in
:mod:`embark.table_config` and are exported here too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum, StrEnum
from functools import cached_property
from typing import Any

from embark.names import check_name
from embark.table_config import Combiner, HotnessPolicy, TableConfig

__all__ = [
    "Combiner",
    "HotnessPolicy",
    "TableConfig",
    "ShardingType",
    "Cluster",
    "CommDtype",
    "GradReduce",
    "grad_bucket_bytes",
    "PlanError",
    "Topology",
    "Shard",
    "TableSharding",
    "PLAN_FORMAT",
    "ShardingPlan",
]


class ShardingType(StrEnum):
    """How one table is laid out over GPUs (EMBark's 3D sharding and its named special cases).

    ``DP`` replicates the table on every rank; ``TW`` puts the whole table on one rank; ``CW``
    cuts it into column blocks on different ranks; ``RW`` cuts its rows over all ranks; ``TRW``
    cuts its rows over ranks of one node; ``THREE_D`` is any grid (placement × row split ×
    column split) that none of the others names.
    """

    DP = "data_parallel"
    TW = "table_wise"
    CW = "column_wise"
    RW = "row_wise"
    TRW = "table_row_wise"
    THREE_D = "3d"


class Cluster(StrEnum):
    """EMBark's communication clusters.

    ``DP``: data parallel, replicas, gradients all-reduced. ``REDUCTION``: each owner pools
    its rows into partial sums per sample; partial sums are reduced inside a node, then sent
    with an all-to-all. ``UNIQUE``: keys are de-duplicated per GPU before the all-to-all and
    owners return one vector per distinct key; pooling happens at the destination.
    """

    DP = "data_parallel"
    REDUCTION = "reduction"
    UNIQUE = "unique"


class CommDtype(StrEnum):
    """Dtype of the embedding vectors and gradients sent over the wire (keys stay int64)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def nbytes(self) -> int:
        """Bytes per element."""
        return 4 if self is CommDtype.FP32 else 2


class GradReduce(StrEnum):
    """How the replicated parameters' gradients (the dense part, DP replicas) are summed over
    the ranks.

    ``FLAT``: one all-reduce over every rank (gloo's ring in rank order, whose node boundaries
    each carry ``2 (W-1)/W`` of the bytes). ``HIERARCHICAL``: a reduce-scatter inside each node,
    an all-reduce of each shard across the nodes (the ranks of one local index), an all-gather
    inside each node: a node's uplink carries ``2 (N-1)/N`` of the bytes
    (:mod:`embark.sharding.node_allreduce`).
    """

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"


# Bucket size of the replicated gradients' all-reduce (embark.sharding.grad_buckets), chosen by
# the bytes bucketed. A third of them, so that a dense part of a few MB still makes three
# buckets, the first of which can start once the last layers' backward is done (DLRM-DCNv2
# narrowed to 2.5 MB on the emulated cluster: three 1 MiB buckets, where one 4 MiB bucket
# started only after the whole backward). At most 4 MiB: every bucket pays a fixed latency per
# collective (a node-by-node bucket is three dependent collectives, serialized on one worker
# thread), so a 64 MB dense part makes 16 buckets rather than 64 of 1 MiB; 4 MiB is the size
# the 64 MB measurement of that module's overlap was made with. At least 1 MiB, for the same
# latency reason.
MIN_GRAD_BUCKET_BYTES = 1 << 20
MAX_GRAD_BUCKET_BYTES = 4 << 20


def grad_bucket_bytes(nbytes: float) -> int:
    """The gradient bucket size for ``nbytes`` of replicated gradients: ``nbytes / 3``
    clamped to ``[MIN_GRAD_BUCKET_BYTES, MAX_GRAD_BUCKET_BYTES]`` (see the constants).

    >>> grad_bucket_bytes(2.5e6), grad_bucket_bytes(9e6) // 1000, grad_bucket_bytes(64e6)
    (1048576, 3000, 4194304)
    """
    third = -(-int(nbytes) // 3)
    return min(MAX_GRAD_BUCKET_BYTES, max(MIN_GRAD_BUCKET_BYTES, third))


class PlanError(ValueError):
    """A sharding plan breaks a rule, or the planner cannot satisfy its input; the message
    names the table and the rule, or what does not fit and by how much (e.g. ``table 't3'
    needs 95.0 GB per replica but one GPU holds 72.0 GB``)."""


def _enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise PlanError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}") from None


def _positive(value: Any, what: str, kind: type = float) -> None:
    ok_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types) or not value > 0:
        raise ValueError(f"{what} must be a positive {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class Topology:
    """A cluster of identical GPUs in identical nodes.

    Bandwidths are per GPU and per direction (what one GPU can send, and separately receive,
    at the same time). Presets with their sources: :func:`embark.topology.get_topology`.

    Args:
        name: preset name, e.g. ``"dgx-h100"``.
        num_nodes: nodes (≥ 1).
        gpus_per_node: GPUs per node (≥ 1); ranks ``n*gpus_per_node .. (n+1)*gpus_per_node-1``
            are node ``n``.
        hbm_capacity_bytes: memory of one GPU.
        hbm_bandwidth_bytes_per_s: peak HBM bandwidth of one GPU.
        intra_node_bandwidth_bytes_per_s: NVLink (or shared-memory) bandwidth per GPU.
        inter_node_bandwidth_bytes_per_s: network (InfiniBand) bandwidth per GPU.
        dense_peak_flops_per_s: peak dense matmul throughput of one GPU (bf16 tensor cores).
        intra_node_latency_s: fixed cost of one intra-node collective.
        inter_node_latency_s: fixed cost of one inter-node collective.
    """

    name: str
    num_nodes: int
    gpus_per_node: int
    hbm_capacity_bytes: float
    hbm_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float
    inter_node_bandwidth_bytes_per_s: float
    dense_peak_flops_per_s: float
    intra_node_latency_s: float = 10e-6
    inter_node_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        _positive(self.num_nodes, f"topology {self.name!r}: num_nodes", int)
        _positive(self.gpus_per_node, f"topology {self.name!r}: gpus_per_node", int)
        for f in (
            "hbm_capacity_bytes",
            "hbm_bandwidth_bytes_per_s",
            "intra_node_bandwidth_bytes_per_s",
            "inter_node_bandwidth_bytes_per_s",
            "dense_peak_flops_per_s",
        ):
            _positive(getattr(self, f), f"topology {self.name!r}: {f}")
        for f in ("intra_node_latency_s", "inter_node_latency_s"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"topology {self.name!r}: {f} must be >= 0, got {value!r}")

    @property
    def world_size(self) -> int:
        """Number of GPUs (ranks)."""
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """Node index of ``rank``."""
        return rank // self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"Topology: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        return cls(**d)


@dataclass(frozen=True)
class Shard:
    """One rectangle of a table, owned by one rank: rows ``row_start:row_end`` (ids, end
    exclusive) and columns ``col_start:col_end`` of the embedding dimension.

    A key ``k`` of the table is served by the shards whose row range holds ``k``: one per
    column block; each returns its columns and the destination concatenates them.
    """

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    def __post_init__(self) -> None:
        for f in ("rank", "row_start", "row_end", "col_start", "col_end"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Shard.{f} must be a non-negative integer, got {v!r}")
        if self.row_end <= self.row_start or self.col_end <= self.col_start:
            raise ValueError(
                f"shard on rank {self.rank} is empty: rows {self.row_start}:{self.row_end}, "
                f"cols {self.col_start}:{self.col_end} (end must be > start)"
            )

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_start

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Shard:
        allowed = {"rank", "row_start", "row_end", "col_start", "col_end"}
        missing, unknown = allowed - set(d), set(d) - allowed
        if missing or unknown:
            raise ValueError(
                f"Shard needs exactly the fields {sorted(allowed)}; "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(**d)


@dataclass(frozen=True)
class TableSharding:
    """Where one table lives: its shards, communication cluster and wire dtype.

    Worked example: a 1000 × 128 table, 2 column blocks × 2 row shards on ranks 0-3
    (``THREE_D``)::

                 cols 0:64     cols 64:128
        rows   0:500  rank 0       rank 2
        rows 500:1000 rank 1       rank 3

    Rules (checked on construction, :class:`PlanError` otherwise): the column ranges of the
    shards partition ``0:dim`` (column splits add up); within each column block the row
    ranges partition ``0:num_rows`` (every row owned exactly once, no overlap, no gap); no
    rank holds two shards of one table; a ``DP`` table (cluster ``DP``) has one full-table
    replica on every rank; ``sharding_type`` matches the layout (``TW``: one shard; ``CW``:
    whole-row column blocks; ``RW``: one column block row-split over every rank; ``TRW``: one
    column block row-split inside one node); rank range and node checks are done by
    :class:`ShardingPlan`.
    """

    name: str
    num_rows: int
    dim: int
    sharding_type: ShardingType
    cluster: Cluster
    shards: tuple[Shard, ...]
    comm_dtype: CommDtype = CommDtype.FP32

    def __post_init__(self) -> None:
        check_name(self.name, "a table's name", PlanError)
        object.__setattr__(
            self,
            "sharding_type",
            _enum(ShardingType, self.sharding_type, f"table {self.name!r}: sharding_type"),
        )
        object.__setattr__(
            self, "cluster", _enum(Cluster, self.cluster, f"table {self.name!r}: cluster")
        )
        object.__setattr__(
            self,
            "comm_dtype",
            _enum(CommDtype, self.comm_dtype, f"table {self.name!r}: comm_dtype"),
        )
        object.__setattr__(self, "shards", tuple(self.shards))
        for f in ("num_rows", "dim"):
            _positive(getattr(self, f), f"table {self.name!r}: {f}", int)
        if not self.shards:
            raise PlanError(f"table {self.name!r}: has no shards (every row must be owned)")
        if (self.sharding_type is ShardingType.DP) != (self.cluster is Cluster.DP):
            raise PlanError(
                f"table {self.name!r}: sharding_type {self.sharding_type.value!r} needs cluster "
                f"{repr('data_parallel') if self.sharding_type is ShardingType.DP else repr('reduction') + ' or ' + repr('unique')}, "
                f"got {self.cluster.value!r}"
            )
        for s in self.shards:
            if s.row_end > self.num_rows or s.col_end > self.dim:
                raise PlanError(
                    f"table {self.name!r}: shard on rank {s.rank} (rows {s.row_start}:{s.row_end}, "
                    f"cols {s.col_start}:{s.col_end}) lies outside the table "
                    f"({self.num_rows} rows × {self.dim} cols)"
                )
        if self.sharding_type is ShardingType.DP:
            for s in self.shards:
                if (s.row_start, s.row_end, s.col_start, s.col_end) != (
                    0,
                    self.num_rows,
                    0,
                    self.dim,
                ):
                    raise PlanError(
                        f"table {self.name!r}: data-parallel replica on rank {s.rank} must hold the "
                        f"whole table (rows 0:{self.num_rows}, cols 0:{self.dim})"
                    )
            ranks = [s.rank for s in self.shards]
            if len(set(ranks)) != len(ranks):
                raise PlanError(f"table {self.name!r}: two data-parallel replicas on one rank")
            return
        self._check_grid()

    def _check_grid(self) -> None:
        ranks = [s.rank for s in self.shards]
        if len(set(ranks)) != len(ranks):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise PlanError(f"table {self.name!r}: rank(s) {dup} hold more than one shard of it")
        blocks = sorted({(s.col_start, s.col_end) for s in self.shards})
        pos = 0
        for c0, c1 in blocks:
            if c0 != pos:
                what = "overlap" if c0 < pos else "leave a gap"
                raise PlanError(
                    f"table {self.name!r}: column splits do not add up to dim {self.dim}: "
                    f"column ranges {blocks} {what} at column {min(c0, pos)}"
                )
            pos = c1
        if pos != self.dim:
            raise PlanError(
                f"table {self.name!r}: column splits do not add up to dim {self.dim}: "
                f"column ranges {blocks} end at column {pos}"
            )
        for c0, c1 in blocks:
            rows = sorted(
                (s.row_start, s.row_end, s.rank) for s in self.shards if s.col_start == c0
            )
            pos = 0
            for r0, r1, rank in rows:
                if r0 < pos:
                    raise PlanError(
                        f"table {self.name!r}: rows {r0}:{min(r1, pos)} of columns {c0}:{c1} are "
                        f"owned twice (overlapping shards; the second is on rank {rank})"
                    )
                if r0 > pos:
                    raise PlanError(
                        f"table {self.name!r}: rows {pos}:{r0} of columns {c0}:{c1} are owned by "
                        f"no shard (gap in the row split)"
                    )
                pos = r1
            if pos != self.num_rows:
                raise PlanError(
                    f"table {self.name!r}: rows {pos}:{self.num_rows} of columns {c0}:{c1} are "
                    f"owned by no shard (gap in the row split)"
                )
        st = self.sharding_type
        single_block = len(blocks) == 1
        whole_rows = all(s.num_rows == self.num_rows for s in self.shards)
        if st is ShardingType.TW and len(self.shards) != 1:
            raise PlanError(
                f"table {self.name!r}: table_wise needs exactly one shard, got {len(self.shards)}"
            )
        if st is ShardingType.CW and not whole_rows:
            raise PlanError(f"table {self.name!r}: column_wise shards must hold every row")
        if st in (ShardingType.RW, ShardingType.TRW) and not single_block:
            raise PlanError(
                f"table {self.name!r}: {st.value} shards must hold every column "
                f"(got {len(blocks)} column blocks; use '3d')"
            )

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Ranks holding a shard, in shard order."""
        return tuple(s.rank for s in self.shards)

    @property
    def column_blocks(self) -> tuple[tuple[int, int], ...]:
        """Sorted ``(col_start, col_end)`` of the column blocks."""
        return tuple(sorted({(s.col_start, s.col_end) for s in self.shards}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "sharding_type": self.sharding_type.value,
            "cluster": self.cluster.value,
            "comm_dtype": self.comm_dtype.value,
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableSharding:
        allowed = {"name", "num_rows", "dim", "sharding_type", "cluster", "comm_dtype", "shards"}
        unknown = set(d) - allowed
        missing = {"name", "num_rows", "dim", "sharding_type", "cluster", "shards"} - set(d)
        name = d.get("name", "?")
        if unknown or missing:
            raise PlanError(
                f"table {name!r}: plan entry has unknown field(s) {sorted(unknown)} / "
                f"missing field(s) {sorted(missing)}; allowed {sorted(allowed)}"
            )
        if not isinstance(d["shards"], list) or not all(isinstance(s, dict) for s in d["shards"]):
            raise PlanError(
                f"table {name!r}: shards must be a list of shard mappings, got {d['shards']!r:.80}"
            )
        try:
            shards = tuple(Shard.from_dict(s) for s in d["shards"])
        except (ValueError, TypeError) as e:
            raise PlanError(f"table {name!r}: bad shard: {e}") from None
        return cls(
            name=d["name"],
            num_rows=d["num_rows"],
            dim=d["dim"],
            sharding_type=d["sharding_type"],
            cluster=d["cluster"],
            comm_dtype=d.get("comm_dtype", CommDtype.FP32.value),
            shards=shards,
        )


PLAN_FORMAT = "embark.sharding_plan/1"


@dataclass(frozen=True)
class ShardingPlan:
    """Placement of every table of a workload on ``world_size`` ranks.

    Validated on construction: table names unique; every shard's rank in
    ``0 .. world_size-1``; data-parallel tables replicated on every rank; ``table_row_wise``
    tables inside one node and ``row_wise`` tables over every rank. :meth:`check_tables`
    compares against the workload's tables (missing/unknown tables, shapes).

    JSON form (``to_dict``)::

        {"format": "embark.sharding_plan/1", "world_size": 8, "gpus_per_node": 8,
         "topology": "dgx-h100",
         "tables": [{"name": "t0", "num_rows": 1000, "dim": 128, "sharding_type": "table_wise",
                     "cluster": "reduction", "comm_dtype": "fp32",
                     "shards": [{"rank": 3, "row_start": 0, "row_end": 1000,
                                 "col_start": 0, "col_end": 128}]}, ...]}
    """

    world_size: int
    gpus_per_node: int
    tables: tuple[TableSharding, ...]
    topology: str = ""

    def __post_init__(self) -> None:
        _positive(self.world_size, "ShardingPlan.world_size", int)
        _positive(self.gpus_per_node, "ShardingPlan.gpus_per_node", int)
        if self.world_size % self.gpus_per_node:
            raise PlanError(
                f"world_size {self.world_size} is not a multiple of gpus_per_node {self.gpus_per_node}"
            )
        object.__setattr__(self, "tables", tuple(self.tables))
        seen: set[str] = set()
        for t in self.tables:
            if t.name in seen:
                raise PlanError(f"table {t.name!r}: appears more than once in the plan")
            seen.add(t.name)
            for s in t.shards:
                if s.rank >= self.world_size:
                    raise PlanError(
                        f"table {t.name!r}: shard on rank {s.rank} but the plan has ranks "
                        f"0..{self.world_size - 1}"
                    )
            ranks = set(t.ranks)
            nodes = {r // self.gpus_per_node for r in ranks}
            if t.sharding_type is ShardingType.DP and len(ranks) != self.world_size:
                raise PlanError(
                    f"table {t.name!r}: data_parallel needs a replica on every rank, "
                    f"missing ranks {sorted(set(range(self.world_size)) - ranks)}"
                )
            if t.sharding_type is ShardingType.RW and len(ranks) != self.world_size:
                raise PlanError(
                    f"table {t.name!r}: row_wise needs a row shard on every rank "
                    f"({self.world_size}), got {len(ranks)}; use table_row_wise or 3d"
                )
            if t.sharding_type is ShardingType.TRW and len(nodes) != 1:
                raise PlanError(
                    f"table {t.name!r}: table_row_wise shards must sit in one node, got nodes "
                    f"{sorted(nodes)}"
                )

    def __getitem__(self, name: str) -> TableSharding:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table {name!r} is not in the plan")

    def check_tables(self, tables: Sequence[TableConfig]) -> None:
        """Check the plan covers exactly ``tables`` with matching shapes.

        Raises:
            PlanError: naming a missing, unknown or mis-shaped table.
        """
        by_name = {t.name: t for t in self.tables}
        want = {t.name: t for t in tables}
        for name in want:
            if name not in by_name:
                raise PlanError(
                    f"table {name!r}: missing from the plan (every table must be placed)"
                )
        for name in by_name:
            if name not in want:
                raise PlanError(f"table {name!r}: in the plan but not in the workload")
        for name, cfg in want.items():
            ts = by_name[name]
            if (ts.num_rows, ts.dim) != (cfg.num_rows, cfg.dim):
                raise PlanError(
                    f"table {name!r}: plan says {ts.num_rows} rows × {ts.dim} cols, the workload "
                    f"has {cfg.num_rows} × {cfg.dim}"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "topology": self.topology,
            "tables": [t.to_dict() for t in self.tables],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardingPlan:
        if not isinstance(d, dict):
            raise PlanError(f"a sharding plan must be a mapping, got {type(d).__name__}")
        fmt = d.get("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise PlanError(f"unknown plan format {fmt!r}; expected {PLAN_FORMAT!r}")
        allowed = {"format", "world_size", "gpus_per_node", "tables", "topology"}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise PlanError(f"sharding plan: unknown field(s) {unknown}; allowed {sorted(allowed)}")
        for f in ("world_size", "gpus_per_node", "tables"):
            if f not in d:
                raise PlanError(f"sharding plan: missing field {f!r}")
        tables = d["tables"]
        if not isinstance(tables, list):
            raise PlanError(
                f"sharding plan: tables must be a list of table entries, got {tables!r:.80}"
            )
        for i, t in enumerate(tables):
            if not isinstance(t, dict):
                raise PlanError(f"sharding plan: tables[{i}] must be a mapping, got {t!r:.80}")
        topology = d.get("topology", "")
        if not isinstance(topology, str):
            raise PlanError(f"sharding plan: topology must be a string, got {topology!r:.80}")
        return cls(
            world_size=d["world_size"],
            gpus_per_node=d["gpus_per_node"],
            tables=tuple(TableSharding.from_dict(t) for t in tables),
            topology=topology,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        return cls.from_dict(json.loads(text))
