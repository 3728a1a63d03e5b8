"""Hand-written plans and constraint files (JSON or YAML).

A plan file is either the full form written by :meth:`ShardingPlan.to_dict`, or a short
form where a table entry gives a grid instead of shards; rows (and columns) are then split
evenly. ``world_size``, ``gpus_per_node``, ``num_rows`` and ``dim`` default to the topology
and workload::

    tables:
      - {name: t0, cluster: data_parallel}              # replicated on every rank
      - {name: t1, ranks: [3]}                          # table-wise on rank 3
      - {name: t2, ranks: [0, 1, 2, 3]}                 # rows split over ranks 0-3
      - {name: t3, grid: [[4, 5], [6, 7]], cluster: unique, comm_dtype: bf16}
                                                        # 2 column blocks × 2 row shards

A constraints file maps table names to :class:`TableConstraints` fields::

    t3: {sharding_types: [table_wise, column_wise], ranks: [0, 1], cluster: unique}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from embark.models.workloads import Workload
from embark.planner.layout import make_sharding
from embark.planner.types import TableConstraints
from embark.types import Cluster, CommDtype, PlanError, ShardingPlan, TableSharding, Topology


def _read(path_or_doc: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(path_or_doc, dict):
        return path_or_doc
    path = Path(path_or_doc)
    if not path.is_file():
        raise FileNotFoundError(f"plan/constraints file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"{str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        doc = yaml.safe_load(text)  # YAML is a superset of JSON
    except (yaml.YAMLError, RecursionError) as e:  # RecursionError: nesting past the stack
        raise PlanError(f"{str(path)!r} is neither valid JSON nor YAML: {e}") from None
    if not isinstance(doc, dict):
        raise PlanError(f"{str(path)!r} must hold a mapping at the top, got {type(doc).__name__}")
    return doc


def _expand(
    entry: dict[str, Any], workload: Workload, world: int, gpn: int
) -> dict[str, Any] | TableSharding:
    if "shards" in entry:
        return entry
    name = entry.get("name")
    if not isinstance(name, str):
        raise PlanError(f"a table entry's name must be a string, got {name!r}")
    by_name = {t.name: t for t in workload.tables}
    if name not in by_name:
        raise PlanError(f"table {name!r}: not in workload {workload.name!r}")
    allowed = {"name", "ranks", "grid", "cluster", "comm_dtype", "sharding_type"}
    unknown = set(entry) - allowed
    if unknown:
        raise PlanError(
            f"table {name!r}: unknown field(s) {sorted(unknown)}; short form allows {sorted(allowed)}"
        )
    try:
        cluster = Cluster(entry.get("cluster", Cluster.REDUCTION.value))
    except ValueError:
        raise PlanError(
            f"table {name!r}: unknown cluster {entry.get('cluster')!r}; expected one of "
            f"{[c.value for c in Cluster]}"
        ) from None
    try:
        dtype = CommDtype(entry.get("comm_dtype", CommDtype.FP32.value))
    except ValueError:
        raise PlanError(
            f"table {name!r}: unknown comm_dtype {entry.get('comm_dtype')!r}; expected one of "
            f"{[c.value for c in CommDtype]}"
        ) from None
    if cluster is Cluster.DP:
        grid: list[list[int]] = []
    elif "grid" in entry:
        grid = entry["grid"]
    elif "ranks" in entry:
        grid = [entry["ranks"]]
    else:
        raise PlanError(
            f"table {name!r}: give 'shards', 'ranks' or 'grid' (or cluster: data_parallel)"
        )
    if not isinstance(grid, list) or any(not isinstance(b, list) or not b for b in grid):
        raise PlanError(
            f"table {name!r}: grid must be a list of non-empty rank lists, got {grid!r}"
        )
    for block in grid:
        for r in block:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise PlanError(f"table {name!r}: rank {r!r} out of range 0..{world - 1}")
    t = by_name[name]
    try:
        ts = make_sharding(t, grid, cluster, dtype, world, gpn)
    except ValueError as e:
        raise PlanError(f"table {name!r}: {e}") from None
    if "sharding_type" in entry and entry["sharding_type"] != ts.sharding_type.value:
        raise PlanError(
            f"table {name!r}: sharding_type {entry['sharding_type']!r} does not match its layout, "
            f"which is {ts.sharding_type.value!r}"
        )
    return ts


def load_plan(
    path_or_doc: str | Path | dict[str, Any], workload: Workload, topology: Topology
) -> ShardingPlan:
    """Read a hand-written plan and validate it against ``workload`` and ``topology``.

    Raises:
        PlanError: naming the table and the rule broken (missing table, overlapping rows,
            gap in rows, column splits that do not add up, rank out of range, unknown
            cluster, ...).
    """
    doc = _read(path_or_doc)
    if isinstance(path_or_doc, dict):
        return _plan_of(dict(doc), workload, topology)
    try:
        return _plan_of(dict(doc), workload, topology)
    except ValueError as e:  # PlanError, and the table types' own checks
        raise PlanError(f"plan file {str(path_or_doc)!r}: {e}") from None


def _plan_of(doc: dict[str, Any], workload: Workload, topology: Topology) -> ShardingPlan:
    """:func:`load_plan` of a parsed document (a copy: defaults are filled in)."""
    world = doc.setdefault("world_size", topology.world_size)
    gpn = doc.setdefault("gpus_per_node", topology.gpus_per_node)
    for field, value in (("world_size", world), ("gpus_per_node", gpn)):
        # a JSON string "8" would otherwise print as 8 in the mismatch message below
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlanError(f"plan: {field} must be a positive integer, got {value!r}")
    if (world, gpn) != (topology.world_size, topology.gpus_per_node):
        raise PlanError(
            f"plan is for {world} ranks ({gpn} per node) but topology {topology.name!r} × "
            f"{topology.num_nodes} has {topology.world_size} ({topology.gpus_per_node} per node)"
        )
    doc.setdefault("topology", topology.name)
    entries = doc.get("tables")
    if not isinstance(entries, list):
        raise PlanError("plan: 'tables' must be a list of table entries")
    by_name = {t.name: t for t in workload.tables}
    tables = []
    for e in entries:
        if not isinstance(e, dict):
            raise PlanError(f"plan: each table entry must be a mapping, got {e!r}")
        got = _expand(e, workload, world, gpn)
        if isinstance(got, dict):
            full = dict(got)
            name = full.get("name")
            t = by_name.get(name) if isinstance(name, str) else None
            if t is not None:
                full.setdefault("num_rows", t.num_rows)
                full.setdefault("dim", t.dim)
            got = TableSharding.from_dict(full)
        tables.append(got.to_dict())
    doc["tables"] = tables
    plan = ShardingPlan.from_dict(doc)
    plan.check_tables(workload.tables)
    return plan


def load_constraints(
    path_or_doc: str | Path | dict[str, Any], workload: Workload
) -> dict[str, TableConstraints]:
    """Read per-table constraints (see the module docstring).

    Raises:
        ValueError: unknown table or field, bad values.
    """
    doc = _read(path_or_doc)
    if isinstance(path_or_doc, dict):
        return _constraints_of(doc, workload)
    try:
        return _constraints_of(doc, workload)
    except ValueError as e:
        raise ValueError(f"constraints file {str(path_or_doc)!r}: {e}") from None


def _constraints_of(doc: dict[str, Any], workload: Workload) -> dict[str, TableConstraints]:
    doc = doc.get("constraints", doc)
    names = {t.name for t in workload.tables}
    out = {}
    for name, c in doc.items():
        if name not in names:
            raise ValueError(
                f"constraints name table {name!r}, which is not in workload {workload.name!r}"
            )
        if not isinstance(c, dict):
            raise ValueError(f"constraints for table {name!r} must be a mapping, got {c!r}")
        try:
            out[name] = TableConstraints.from_dict(c)
        except ValueError as e:
            raise ValueError(f"constraints for table {name!r}: {e}") from None
    return out
