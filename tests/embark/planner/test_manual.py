"""Hand-written plans (JSON/YAML, full and short forms) and constraint files: accepted when
valid, rejected with an error naming the table and the rule otherwise."""

from __future__ import annotations

import json

import pytest
import yaml

from embark.models.workloads import get_workload
from embark.planner.cost import CostModel
from embark.planner.manual import load_constraints, load_plan
from embark.planner.planner import plan_sharding
from embark.planner.simulator import simulate
from embark.planner.types import TableConstraints
from embark.topology import get_topology
from embark.types import Cluster, CommDtype, PlanError, ShardingType

W = get_workload("tiny")  # t0..t7, dim 16
TOPO = get_topology("dgx-h100", 1)  # 8 ranks


def short_form() -> dict:
    return {
        "tables": [
            {"name": "t0", "cluster": "data_parallel"},
            {"name": "t1", "ranks": [3]},
            {"name": "t2", "ranks": [0, 1, 2, 3], "cluster": "unique", "comm_dtype": "bf16"},
            {"name": "t3", "grid": [[4, 5], [6, 7]]},
            {"name": "t4", "ranks": list(range(8))},
            {"name": "t5", "grid": [[1], [2]]},
            {"name": "t6", "ranks": [7]},
            {"name": "t7", "ranks": [0]},
        ]
    }


def full_form() -> dict:
    return plan_sharding(W, TOPO, 1024, "trw").to_dict()


def test_short_form_yaml(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(short_form()))
    plan = load_plan(path, W, TOPO)
    assert plan["t0"].sharding_type is ShardingType.DP
    assert plan["t1"].sharding_type is ShardingType.TW and plan["t1"].ranks == (3,)
    assert plan["t2"].sharding_type is ShardingType.TRW and plan["t2"].cluster is Cluster.UNIQUE
    assert plan["t2"].comm_dtype is CommDtype.BF16
    assert plan["t3"].sharding_type is ShardingType.THREE_D and plan["t3"].column_blocks == (
        (0, 8),
        (8, 16),
    )
    assert plan["t4"].sharding_type is ShardingType.RW
    assert plan["t5"].sharding_type is ShardingType.CW
    assert simulate(plan, CostModel(W, TOPO, 1024)).step_ms > 0


def test_full_form_json_round_trip(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(full_form()))
    plan = load_plan(path, W, TOPO)
    assert plan.to_dict() == full_form()


def _break(kind: str) -> dict:
    d = full_form()
    tables = {t["name"]: t for t in d["tables"]}
    t2 = tables["t2"]  # 200 rows row-split over 8 ranks of 25 rows each
    if kind == "missing table":
        d["tables"] = [t for t in d["tables"] if t["name"] != "t5"]
    elif kind == "overlapping rows":
        t2["shards"][1]["row_start"] -= 5
    elif kind == "gap in rows":
        t2["shards"][1]["row_start"] += 5
    elif kind == "columns do not add up":
        t2["shards"] = [dict(s, col_end=12) for s in t2["shards"]]
    elif kind == "rank out of range":
        t2["shards"][0]["rank"] = 8
    elif kind == "unknown cluster":
        t2["cluster"] = "hierarchical"
    elif kind == "unknown table":
        d["tables"].append(dict(t2, name="t99"))
    elif kind == "wrong shape":
        t2["num_rows"] = 201
        t2["shards"][-1]["row_end"] = 201
    elif kind == "trw across nodes":
        d["world_size"], d["gpus_per_node"] = 8, 4
    elif kind == "two shards on one rank":
        t2["shards"][1]["rank"] = t2["shards"][0]["rank"]
    elif kind == "bad comm dtype":
        t2["comm_dtype"] = "int4"
    return d


@pytest.mark.parametrize(
    "kind, match",
    [
        ("missing table", r"table 't5': missing from the plan"),
        ("overlapping rows", r"table 't2': rows 20:25 of columns 0:16 are owned twice"),
        ("gap in rows", r"table 't2': rows 25:30 of columns 0:16 are owned by no shard"),
        ("columns do not add up", r"table 't2': column splits do not add up to dim 16"),
        ("rank out of range", r"table 't2': shard on rank 8 but the plan has ranks 0..7"),
        ("unknown cluster", r"table 't2': cluster must be one of .* got 'hierarchical'"),
        ("unknown table", r"table 't99': in the plan but not in the workload"),
        ("wrong shape", r"table 't2': plan says 201 rows × 16 cols, the workload has 200 × 16"),
        ("two shards on one rank", r"table 't2': rank\(s\) \[0\] hold more than one shard"),
        ("bad comm dtype", r"table 't2': comm_dtype must be one of"),
    ],
)
def test_invalid_hand_written_plans(kind, match):
    with pytest.raises(PlanError, match=match):
        load_plan(_break(kind), W, TOPO)


def test_plan_for_other_topology_rejected():
    d = _break("trw across nodes")
    with pytest.raises(
        PlanError, match="plan is for 8 ranks \\(4 per node\\) but topology 'dgx-h100'"
    ):
        load_plan(d, W, TOPO)


def test_short_form_errors():
    bad = short_form()
    bad["tables"][1] = {"name": "t1", "ranks": [9]}
    with pytest.raises(PlanError, match=r"table 't1': rank 9 out of range 0..7"):
        load_plan(bad, W, TOPO)
    bad["tables"][1] = {"name": "t1", "ranks": [3], "cluster": "magic"}
    with pytest.raises(PlanError, match=r"table 't1': unknown cluster 'magic'"):
        load_plan(bad, W, TOPO)
    bad["tables"][1] = {"name": "t1", "ranks": [3], "sharding_type": "row_wise"}
    with pytest.raises(
        PlanError,
        match=r"table 't1': sharding_type 'row_wise' does not match its layout, which is 'table_wise'",
    ):
        load_plan(bad, W, TOPO)
    bad["tables"][1] = {"name": "t1"}
    with pytest.raises(PlanError, match=r"table 't1': give 'shards', 'ranks' or 'grid'"):
        load_plan(bad, W, TOPO)
    bad["tables"][1] = {"name": ["t1"], "ranks": [3]}
    with pytest.raises(PlanError, match=r"a table entry's name must be a string, got \['t1'\]"):
        load_plan(bad, W, TOPO)


def test_unreadable_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("tables: [unclosed")
    with pytest.raises(PlanError, match="neither valid JSON nor YAML"):
        load_plan(p, W, TOPO)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_plan(tmp_path / "nope.json", W, TOPO)


def test_constraints_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "t3: {sharding_types: [table_wise], ranks: [2], cluster: unique}\nt0: {cluster: data_parallel}\n"
    )
    cons = load_constraints(p, W)
    assert cons["t3"] == TableConstraints((ShardingType.TW,), (2,), Cluster.UNIQUE)
    plan = plan_sharding(W, TOPO, 1024, constraints=cons)
    assert plan["t3"].ranks == (2,) and plan["t3"].cluster is Cluster.UNIQUE
    assert plan["t0"].sharding_type is ShardingType.DP
    p.write_text("t42: {}\n")
    with pytest.raises(ValueError, match="'t42', which is not in workload 'tiny'"):
        load_constraints(p, W)
    p.write_text("t1: {sharding_types: [diagonal]}\n")
    with pytest.raises(
        ValueError, match="constraints for table 't1': sharding_types must be among"
    ):
        load_constraints(p, W)
    # a scalar where a list belongs: named, not a TypeError or a string split into letters
    p.write_text("t0: {ranks: 3}\n")
    with pytest.raises(
        ValueError, match=r"constraints for table 't0': ranks must be a list, got 3"
    ):
        load_constraints(p, W)
    p.write_text("t0: {sharding_types: table_wise}\n")
    with pytest.raises(
        ValueError,
        match=r"constraints for table 't0': sharding_types must be a list, got 'table_wise'",
    ):
        load_constraints(p, W)
