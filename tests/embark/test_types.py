"""Sharding data types: validation rules, errors that name the table and rule, JSON round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embark.topology import PRESETS, get_topology
from embark.types import (
    Cluster,
    CommDtype,
    PlanError,
    Shard,
    ShardingPlan,
    ShardingType,
    TableConfig,
    TableSharding,
    Topology,
)


def _ts(shards, st=ShardingType.THREE_D, cluster=Cluster.REDUCTION, rows=100, dim=64, name="t0"):
    return TableSharding(name, rows, dim, st, cluster, tuple(Shard(*s) for s in shards))


def test_enums_are_str_valued():
    assert ShardingType("table_row_wise") is ShardingType.TRW
    assert Cluster("unique") is Cluster.UNIQUE
    assert CommDtype.BF16.nbytes == 2 and CommDtype.FP32.nbytes == 4
    assert {t.value for t in ShardingType} == {
        "data_parallel",
        "table_wise",
        "column_wise",
        "row_wise",
        "table_row_wise",
        "3d",
    }


@pytest.mark.parametrize("name", PRESETS)
def test_topology_presets(name):
    nodes = 1 if name == "cpu-local" else 3
    t = get_topology(name, nodes)
    assert t.world_size == nodes * t.gpus_per_node
    assert t.node_of(t.world_size - 1) == nodes - 1
    assert Topology.from_dict(t.to_dict()) == t


def test_topology_h100_figures_from_anchors():
    t = get_topology("dgx-h100", 2)
    assert (t.gpus_per_node, t.hbm_capacity_bytes, t.hbm_bandwidth_bytes_per_s) == (
        8,
        80e9,
        3.35e12,
    )
    assert (t.intra_node_bandwidth_bytes_per_s, t.inter_node_bandwidth_bytes_per_s) == (450e9, 50e9)
    assert get_topology("gb200-nvl72").gpus_per_node == 72


def test_topology_errors():
    with pytest.raises(ValueError, match="unknown topology 'dgx-z'"):
        get_topology("dgx-z")
    with pytest.raises(ValueError, match="nodes must be a positive integer, got 0"):
        get_topology("dgx-h100", 0)
    with pytest.raises(ValueError, match="cpu-local is one machine"):
        get_topology("cpu-local", 2)
    with pytest.raises(ValueError, match="hbm_capacity_bytes must be a positive"):
        Topology("x", 1, 8, -1.0, 1.0, 1.0, 1.0, 1.0)


def test_shard_rules():
    with pytest.raises(ValueError, match="is empty"):
        Shard(0, 5, 5, 0, 8)
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        Shard(-1, 0, 5, 0, 8)
    with pytest.raises(ValueError, match="missing \\['rank'\\]"):
        Shard.from_dict({"row_start": 0, "row_end": 1, "col_start": 0, "col_end": 1})


def test_valid_grid_layout():
    ts = _ts([(0, 0, 50, 0, 32), (1, 50, 100, 0, 32), (2, 0, 100, 32, 64)])
    assert ts.column_blocks == ((0, 32), (32, 64))
    assert ts.ranks == (0, 1, 2)


@pytest.mark.parametrize(
    "shards, st, match",
    [
        (
            [(0, 0, 60, 0, 64), (1, 50, 100, 0, 64)],
            ShardingType.TRW,
            r"rows 50:60 of columns 0:64 are owned twice",
        ),
        (
            [(0, 0, 40, 0, 64), (1, 50, 100, 0, 64)],
            ShardingType.TRW,
            r"rows 40:50 of columns 0:64 are owned by no shard",
        ),
        ([(0, 0, 100, 0, 64), (1, 0, 90, 0, 64)], ShardingType.THREE_D, r"owned twice"),
        ([(0, 0, 90, 0, 64)], ShardingType.TW, r"rows 90:100 .* owned by no shard"),
        (
            [(0, 0, 100, 0, 40), (1, 0, 100, 32, 64)],
            ShardingType.CW,
            r"column splits do not add up to dim 64.*overlap",
        ),
        (
            [(0, 0, 100, 0, 30), (1, 0, 100, 32, 64)],
            ShardingType.CW,
            r"column splits do not add up.*gap",
        ),
        ([(0, 0, 100, 0, 32)], ShardingType.TW, r"column splits do not add up to dim 64"),
        (
            [(0, 0, 50, 0, 64), (0, 50, 100, 0, 64)],
            ShardingType.TRW,
            r"rank\(s\) \[0\] hold more than one shard",
        ),
        (
            [(0, 0, 50, 0, 64), (1, 50, 100, 0, 64)],
            ShardingType.TW,
            r"table_wise needs exactly one shard",
        ),
        (
            [(0, 0, 100, 0, 64), (1, 0, 100, 0, 64)],
            ShardingType.DP,
            r"needs cluster 'data_parallel'",
        ),
        ([(0, 0, 100, 0, 200)], ShardingType.TW, r"lies outside the table"),
    ],
)
def test_table_sharding_rules(shards, st, match):
    with pytest.raises(PlanError, match=match) as info:
        _ts(shards, st)
    assert "table 't0'" in str(info.value)


def test_data_parallel_rules():
    ok = _ts([(0, 0, 100, 0, 64), (1, 0, 100, 0, 64)], ShardingType.DP, Cluster.DP)
    plan = ShardingPlan(2, 2, (ok,))
    assert plan["t0"].cluster is Cluster.DP
    with pytest.raises(PlanError, match="must hold the whole table"):
        _ts([(0, 0, 50, 0, 64)], ShardingType.DP, Cluster.DP)
    with pytest.raises(PlanError, match=r"replica on every rank, missing ranks \[2, 3\]"):
        ShardingPlan(4, 4, (ok,))


def test_plan_rules():
    trw = _ts([(2, 0, 50, 0, 64), (5, 50, 100, 0, 64)], ShardingType.TRW)
    with pytest.raises(
        PlanError, match=r"table_row_wise shards must sit in one node, got nodes \[0, 1\]"
    ):
        ShardingPlan(8, 4, (trw,))
    with pytest.raises(PlanError, match=r"shard on rank 5 but the plan has ranks 0..3"):
        ShardingPlan(4, 4, (trw,))
    rw = _ts([(0, 0, 50, 0, 64), (1, 50, 100, 0, 64)], ShardingType.RW)
    with pytest.raises(PlanError, match="row_wise needs a row shard on every rank"):
        ShardingPlan(4, 4, (rw,))
    with pytest.raises(PlanError, match="appears more than once"):
        ShardingPlan(2, 2, (rw, rw))
    with pytest.raises(PlanError, match="not a multiple of gpus_per_node"):
        ShardingPlan(6, 4, ())


def test_check_tables():
    plan = ShardingPlan(1, 1, (_ts([(0, 0, 100, 0, 64)], ShardingType.TW),))
    plan.check_tables([TableConfig("t0", 100, 64)])
    with pytest.raises(PlanError, match="table 't1': missing from the plan"):
        plan.check_tables([TableConfig("t0", 100, 64), TableConfig("t1", 5, 8)])
    with pytest.raises(PlanError, match="table 't0': in the plan but not in the workload"):
        plan.check_tables([])
    with pytest.raises(PlanError, match="plan says 100 rows × 64 cols, the workload has 100 × 32"):
        plan.check_tables([TableConfig("t0", 100, 32)])


def test_from_dict_errors():
    with pytest.raises(PlanError, match="unknown plan format"):
        ShardingPlan.from_dict(
            {"format": "other/9", "world_size": 1, "gpus_per_node": 1, "tables": []}
        )
    with pytest.raises(PlanError, match="missing field 'tables'"):
        ShardingPlan.from_dict({"world_size": 1, "gpus_per_node": 1})
    with pytest.raises(ValueError, match="table 't0': cluster must be one of"):
        TableSharding.from_dict(
            {
                "name": "t0",
                "num_rows": 4,
                "dim": 4,
                "sharding_type": "table_wise",
                "cluster": "magic",
                "shards": [{"rank": 0, "row_start": 0, "row_end": 4, "col_start": 0, "col_end": 4}],
            }
        )
    for shards in ("abc", [0]):
        with pytest.raises(PlanError, match="table 't0': shards must be a list of shard mappings"):
            TableSharding.from_dict(
                {
                    "name": "t0",
                    "num_rows": 4,
                    "dim": 4,
                    "sharding_type": "table_wise",
                    "cluster": "reduction",
                    "shards": shards,
                }
            )


@st.composite
def plans(draw):
    """Random valid grid plans: per table n column blocks × k row shards on distinct ranks."""
    gpn = draw(st.sampled_from([1, 2, 4]))
    world = gpn * draw(st.integers(1, 3))
    tables = []
    for i in range(draw(st.integers(1, 4))):
        rows, dim = draw(st.integers(1, 50)), draw(st.integers(1, 16))
        n = draw(st.integers(1, min(dim, world)))
        k = draw(st.integers(1, max(1, min(rows, world // n))))
        ranks = draw(st.permutations(range(world)))[: n * k]
        cuts_c = (
            sorted(draw(st.sets(st.integers(1, dim - 1), min_size=n - 1, max_size=n - 1)))
            if n > 1
            else []
        )
        cols = list(zip([0, *cuts_c], [*cuts_c, dim]))
        shards = []
        for j, (c0, c1) in enumerate(cols):
            cuts_r = (
                sorted(draw(st.sets(st.integers(1, rows - 1), min_size=k - 1, max_size=k - 1)))
                if k > 1
                else []
            )
            for q, (r0, r1) in enumerate(zip([0, *cuts_r], [*cuts_r, rows])):
                shards.append(Shard(ranks[j * k + q], r0, r1, c0, c1))
        cluster = draw(st.sampled_from([Cluster.REDUCTION, Cluster.UNIQUE]))
        dtype = draw(st.sampled_from(list(CommDtype)))
        tables.append(
            TableSharding(f"t{i}", rows, dim, ShardingType.THREE_D, cluster, tuple(shards), dtype)
        )
    return ShardingPlan(world, gpn, tuple(tables), "test")


@settings(max_examples=60, deadline=None)
@given(plans())
def test_plan_json_round_trip(plan):
    text = plan.to_json()
    back = ShardingPlan.from_json(text)
    assert back == plan
    assert json.loads(back.to_json()) == json.loads(text)


_GOOD_PLAN = {
    "format": "embark.sharding_plan/1",
    "world_size": 2,
    "gpus_per_node": 2,
    "tables": [
        {
            "name": "t0",
            "num_rows": 8,
            "dim": 4,
            "sharding_type": "table_wise",
            "cluster": "reduction",
            "shards": [{"rank": 0, "row_start": 0, "row_end": 8, "col_start": 0, "col_end": 4}],
        }
    ],
}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tables": {"t0": {}}}, r"tables must be a list of table entries, got \{'t0'"),
        ({"tables": ["t0"]}, r"tables\[0\] must be a mapping, got 't0'"),
        ({"tables": None}, "tables must be a list of table entries, got None"),
        (
            {"tables": [{**_GOOD_PLAN["tables"][0], "name": 5}]},
            "a table's name 5 is not a valid name; expected 1 to 128 ASCII letters",
        ),
        (
            {"tables": [{**_GOOD_PLAN["tables"][0], "name": ""}]},
            "a table's name '' is not a valid name",
        ),
        (
            {"tables": [{**_GOOD_PLAN["tables"][0], "name": "../t0"}]},
            r"a table's name '\.\./t0' is not a valid name",
        ),
        ({"topology": [1]}, r"topology must be a string, got \[1\]"),
        ({"topolgy": "dgx"}, r"unknown field\(s\) \['topolgy'\]"),
    ],
)
def test_malformed_plan_documents_name_the_bad_value(change, match) -> None:
    assert ShardingPlan.from_dict(_GOOD_PLAN).tables[0].name == "t0"
    with pytest.raises(PlanError, match=match):
        ShardingPlan.from_json(json.dumps(_GOOD_PLAN | change))


@pytest.mark.parametrize("bad", ["", "../t", "/abs/t", "a/b", "x.y", "-t0", 5, None])
def test_table_names_follow_the_name_rule(bad) -> None:
    """A table name becomes a parameter path, a checkpoint tensor and an exported folder."""
    assert TableConfig("user_id", 3, 2).name == "user_id"
    with pytest.raises(ValueError, match=r"TableConfig.name .* is not a valid name; expected 1 to"):
        TableConfig(bad, 3, 2)
    with pytest.raises(ValueError, match=r"TableConfig.name .* is not a valid name"):
        TableConfig.from_dict({"name": bad, "num_rows": 3, "dim": 2})
