"""The tiny workload's hand-written sharding plan of every sharding type and cluster, for the
sharded-training and command-line tests."""

from __future__ import annotations

from typing import Any

from embark.models.workloads import get_workload

GPN = 2  # ranks per node


def _cuts(n: int, parts: int) -> list[int]:
    """Uneven row boundaries ``0 = b0 < ... < b_parts = n`` (quadratic spacing)."""
    return [n * i * i // (parts * parts) for i in range(parts + 1)]


def _rows(name: str, n: int, dim: int, ranks: list[int]) -> list[dict[str, int]]:
    b = _cuts(n, len(ranks))
    return [
        {"rank": r, "row_start": b[i], "row_end": b[i + 1], "col_start": 0, "col_end": dim}
        for i, r in enumerate(ranks)
    ]


def tiny_plan(world: int) -> dict[str, Any]:
    """The tiny workload's 8 tables as TW, RW, CW, TRW and DP, REDUCTION and UNIQUE."""
    tables = {t.name: t for t in get_workload("tiny").tables}
    every = list(range(world))
    last = world - 1
    spec = {  # name: (sharding_type, cluster, shards)
        "t0": ("row_wise", "reduction", _rows("t0", 1000, 16, every)),
        "t1": ("table_wise", "unique", _rows("t1", 500, 16, [1])),
        "t2": (
            "column_wise",
            "reduction",
            [
                {"rank": r, "row_start": 0, "row_end": 200, "col_start": c0, "col_end": c1}
                for r, (c0, c1) in zip(every[::-1], zip(_cuts(16, world), _cuts(16, world)[1:]))
            ],
        ),
        "t3": ("data_parallel", "data_parallel", None),
        "t4": ("table_wise", "reduction", _rows("t4", 100, 16, [last])),
        "t5": ("data_parallel", "data_parallel", None),
        "t6": ("row_wise", "unique", _rows("t6", 800, 16, every[::-1])),
        "t7": ("table_row_wise", "reduction", _rows("t7", 300, 16, [last - 1, last])),
    }
    entries = []
    for name, (stype, cluster, shards) in spec.items():
        t = tables[name]
        if shards is None:
            shards = [
                {"rank": r, "row_start": 0, "row_end": t.num_rows, "col_start": 0, "col_end": t.dim}
                for r in every
            ]
        entries.append(
            {
                "name": name,
                "num_rows": t.num_rows,
                "dim": t.dim,
                "sharding_type": stype,
                "cluster": cluster,
                "shards": shards,
            }
        )
    return {"world_size": world, "gpus_per_node": GPN, "tables": entries}


def uniform_plan(world: int, sharding_type: str) -> dict[str, Any]:
    """The tiny workload's tables all ``"table_wise"`` (table i on rank i mod world) or all
    ``"row_wise"`` (rows cut evenly over every rank): a plan change for resharding tests."""
    entries = []
    for i, t in enumerate(get_workload("tiny").tables):
        if sharding_type == "table_wise":
            shards = _rows(t.name, t.num_rows, t.dim, [i % world])
        else:
            b = [t.num_rows * r // world for r in range(world + 1)]
            shards = [
                {
                    "rank": r,
                    "row_start": b[r],
                    "row_end": b[r + 1],
                    "col_start": 0,
                    "col_end": t.dim,
                }
                for r in range(world)
            ]
        entries.append(
            {
                "name": t.name,
                "num_rows": t.num_rows,
                "dim": t.dim,
                "sharding_type": sharding_type if world > 1 else "table_wise",  # 1 rank: whole
                "cluster": "reduction",
                "shards": shards,
            }
        )
    return {"world_size": world, "gpus_per_node": min(GPN, world), "tables": entries}
