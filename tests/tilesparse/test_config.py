from __future__ import annotations

import json
import re

import pytest

from tilesparse.config import (
    CubicSchedule,
    Importance,
    MultiStageSchedule,
    OneShotSchedule,
    Pattern,
    TileSparseConfig,
    schedule_from_dict,
)


def test_defaults() -> None:
    cfg = TileSparseConfig()
    assert cfg.pattern is Pattern.TW
    assert cfg.sparsity == 0.75 and cfg.tile == 128
    assert cfg.importance is Importance.MAGNITUDE
    assert TileSparseConfig(pattern="nm", n=1, m=4).sparsity == 0.75
    assert TileSparseConfig(pattern="nm").sparsity == 0.5


@pytest.mark.parametrize(
    "schedule",
    [OneShotSchedule(step=3), MultiStageSchedule((0.25, 0.5), steps_per_stage=7, start=2), CubicSchedule(1, 50, 5, 0.1)],
)
def test_json_round_trip(schedule: object) -> None:
    cfg = TileSparseConfig(
        pattern="tew", sparsity=0.6, tile=64, importance="taylor", column_share=0.3, block=(8, 4),
        tew_delta=0.1, global_threshold=False, min_layer_density=0.1,
        overrides={"top.0": 0.5, "a.b": 0.25}, taylor_steps=10, schedule=schedule,
    )
    text = cfg.to_json()
    json.loads(text)  # plain JSON
    back = TileSparseConfig.from_json(text)
    assert back == cfg
    assert back.override_for("a.b") == 0.25 and back.override_for("nope") is None
    assert hash(back) == hash(cfg)  # frozen and hashable


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"sparsity": 1.0}, "sparsity", "[0, 1)"),
        ({"sparsity": -0.1}, "sparsity", "[0, 1)"),
        ({"sparsity": float("nan")}, "sparsity", "[0, 1)"),
        ({"tile": 0}, "tile", ">= 1"),
        ({"tile": -8}, "tile", ">= 1"),
        ({"column_share": 1.5}, "column_share", "[0, 1]"),
        ({"min_layer_density": 0.0}, "min_layer_density", "(0, 1]"),
        ({"pattern": "diagonal"}, "pattern", "'tw'"),
        ({"importance": "random"}, "importance", "'magnitude'"),
        ({"pattern": "nm", "n": 5, "m": 4}, "n", "<= m"),
        ({"pattern": "nm", "sparsity": 0.75}, "sparsity", "1 - n/m"),
        ({"pattern": "tew", "sparsity": 0.9, "tew_delta": 0.2}, "tew_delta", "< 1 - sparsity"),
        ({"block": (0, 4)}, "block", ">= 1"),
        ({"overrides": {"fc": 1.2}}, "overrides", "[0, 1)"),
        ({"pattern": "tew", "sparsity": 0.5, "overrides": {"1": 0.97}}, "overrides['1']",
         "= 0.97 plus tew_delta = 0.05 must be < 1"),
        ({"taylor_steps": 0}, "taylor_steps", ">= 1"),
    ],
)
def test_bad_values_name_field_and_range(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as e:
        TileSparseConfig(**kwargs)
    assert f"TileSparseConfig.{field}" in str(e.value)
    assert allowed in str(e.value)


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: MultiStageSchedule(stages=(0.5, 0.25)), "ascending"),
        (lambda: MultiStageSchedule(stages=(0.5, 1.0)), "stages[i] must be in [0, 1)"),
        (lambda: MultiStageSchedule(steps_per_stage=0), "steps_per_stage must be an integer >= 1"),
        (lambda: CubicSchedule(begin_step=10, end_step=10), "end_step must be an integer >= 11"),
        (lambda: CubicSchedule(frequency=0), "frequency"),
        (lambda: OneShotSchedule(step=-1), "step must be an integer >= 0"),
    ],
)
def test_bad_schedules(make, text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(text)):
        make()


def test_unknown_keys_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sparsty'\]"):
        TileSparseConfig.from_dict({"sparsty": 0.5})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stages'\]"):
        schedule_from_dict({"kind": "cubic", "stages": [0.1]})
    with pytest.raises(ValueError, match="schedule.kind must be one of"):
        schedule_from_dict({"kind": "linear"})


def test_recipe_files(tmp_path) -> None:
    y = tmp_path / "r.yaml"
    y.write_text(
        "pattern: tw\nsparsity: 0.9\ntile: 32\nimportance: taylor\n"
        "schedule: {kind: multistage, stages: [0.5, 0.75], steps_per_stage: 20}\n"
        "overrides: {top_mlp.0: 0.5}\n"
    )
    cfg = TileSparseConfig.load(y)
    assert cfg.sparsity == 0.9 and cfg.tile == 32 and cfg.importance is Importance.TAYLOR
    assert cfg.schedule == MultiStageSchedule((0.5, 0.75), steps_per_stage=20)
    assert cfg.overrides == (("top_mlp.0", 0.5),)
    for suffix in (".json", ".yaml"):
        p = tmp_path / f"saved{suffix}"
        cfg.save(p)
        assert TileSparseConfig.load(p) == cfg

    bad = tmp_path / "bad.yaml"
    bad.write_text("pattern: tw\ntile_size: 64\n")
    with pytest.raises(ValueError) as e:
        TileSparseConfig.load(bad)
    assert "bad.yaml" in str(e.value) and "tile_size" in str(e.value) and "'tile'" in str(e.value)

    neg = tmp_path / "neg.json"
    neg.write_text('{"tile": 0}')
    with pytest.raises(ValueError, match=r"neg.json: TileSparseConfig.tile must be an integer >= 1, got 0"):
        TileSparseConfig.load(neg)

    txt = tmp_path / "x.txt"
    txt.write_text("pattern: tw\n")
    with pytest.raises(ValueError, match="expected a .yaml, .yml or .json suffix"):
        TileSparseConfig.load(txt)


def test_tew_override_below_one_minus_delta_is_accepted() -> None:
    cfg = TileSparseConfig(pattern="tew", sparsity=0.5, tew_delta=0.05, overrides={"1": 0.94})
    assert cfg.override_for("1") == 0.94
    # the same override under a pattern without restored elements is fine at 0.97
    assert TileSparseConfig(pattern="tw", overrides={"1": 0.97}).override_for("1") == 0.97
