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
    fitting_tile,
    schedule_from_dict,
)


def test_fitting_tile_never_makes_a_small_layer_one_tile() -> None:
    assert fitting_tile([1536, 384]) == 128  # MiniLM's FFN: the paper's G
    assert fitting_tile([512, 256, 128, 1]) == 64  # the logit head does not count
    assert fitting_tile([3]) == 8
    for widths in ([1024, 512, 256], [512, 256, 64], [48, 40]):
        g = fitting_tile(widths)
        assert all(-(-w // g) >= 2 for w in widths), (widths, g)


def test_defaults() -> None:
    cfg = TileSparseConfig()
    assert cfg.pattern is Pattern.TW
    assert cfg.sparsity == 0.75 and cfg.tile is None  # automatic: fitting_tile
    assert cfg.importance is None and cfg.column_share is None and cfg.damping is None
    plain = cfg.resolved(calibrated=False)
    assert plain.importance is Importance.MAGNITUDE and plain.global_threshold is True
    assert plain.column_share == 0.5
    cal = cfg.resolved(calibrated=True)
    assert cal.importance is Importance.ACTIVATION and cal.global_threshold is True
    explicit = TileSparseConfig(importance="magnitude", global_threshold=True, column_share=0.2)
    assert explicit.resolved(calibrated=True) == explicit  # explicit knobs win
    assert TileSparseConfig(pattern="nm", n=1, m=4).sparsity == 0.75
    assert TileSparseConfig(pattern="nm").sparsity == 0.5


@pytest.mark.parametrize(
    "schedule",
    [
        OneShotSchedule(step=3),
        MultiStageSchedule((0.25, 0.5), steps_per_stage=7, start=2),
        CubicSchedule(1, 50, 5, 0.1),
    ],
)
def test_json_round_trip(schedule: object) -> None:
    cfg = TileSparseConfig(
        pattern="tew",
        sparsity=0.6,
        tile=64,
        importance="taylor",
        column_share=0.3,
        block=(8, 4),
        tew_delta=0.1,
        global_threshold=False,
        min_layer_density=0.1,
        overrides={"top.0": 0.5, "a.b": 0.25},
        taylor_steps=10,
        schedule=schedule,
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
        (
            {"pattern": "tew", "sparsity": 0.5, "overrides": {"1": 0.97}},
            "overrides['1']",
            "= 0.97 plus tew_delta = 0.05 must be < 1",
        ),
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
        (lambda: MultiStageSchedule(stages=(0.5, 1.0)), "stages[1] must be in [0, 1), got 1.0"),
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
    with pytest.raises(
        ValueError, match=r"neg.json: TileSparseConfig.tile must be an integer >= 1, got 0"
    ):
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


BAD_RECIPES = [  # (file name, text, expected message after "recipe file <path>: ")
    (
        "stages_scalar.yaml",
        "schedule: {kind: multistage, stages: 0.5}\n",
        "TileSparseConfig.schedule: MultiStageSchedule.stages must be a list of sparsities in [0, 1) or None, got 0.5",
    ),
    (
        "stage_str.yaml",
        "schedule: {kind: multistage, stages: [0.5, x]}\n",
        "TileSparseConfig.schedule: MultiStageSchedule.stages[1] must be in [0, 1), got 'x'",
    ),
    ("kind.yaml", "schedule: {kind: linear}\n", "TileSparseConfig.schedule.kind must be one of"),
    (
        "sched_scalar.yaml",
        "schedule: 5\n",
        "TileSparseConfig.schedule must be a schedule config or a mapping",
    ),
    (
        "truncated.json",
        '{"pattern": "tw", ',
        "not valid JSON: Expecting property name enclosed in double quotes at line 1, column 19",
    ),
    (
        "broken.yaml",
        "pattern: [tw\n",
        "not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1",
    ),
    (
        "overrides_list.yaml",
        "overrides: [fc1, 0.5]\n",
        "TileSparseConfig.overrides must be a mapping of module name to sparsity",
    ),
    ("overrides_str.yaml", "overrides: fc1\n", "TileSparseConfig.overrides must be a mapping"),
    ("top_list.yaml", "- pattern: tw\n", "TileSparseConfig: expected a mapping, got list"),
    (
        "block_three.yaml",
        "pattern: bw\nblock: [4, 4, 4]\n",
        "TileSparseConfig.block must be (bk, bn) or one integer",
    ),
    (
        "block_str.yaml",
        "pattern: bw\nblock: '16'\n",
        "TileSparseConfig.block must be (bk, bn) or one integer",
    ),
    (
        "block_zero.yaml",
        "pattern: bw\nblock: 0\n",
        "TileSparseConfig.block[0] must be an integer >= 1, got 0",
    ),
    ("int_keys.yaml", "1: 2\nfoo: 3\n", "TileSparseConfig: unknown key(s) [1, 'foo']"),
    (  # a key given twice: YAML (and JSON) keep the last value silently
        "dup_top.yaml",
        "pattern: tw\nsparsity: 0.5\ntile: 64\nsparsity: 0.9\n",
        "key 'sparsity' at line 4 (first at line 2) is given twice in one mapping",
    ),
    (
        "dup_nested.yaml",
        "pattern: tw\nschedule:\n  kind: multistage\n  stages: [0.5]\n  kind: oneshot\n",
        "key 'kind' at line 5 (first at line 3) is given twice in one mapping",
    ),
    (
        "dup.json",
        '{"pattern": "tw",\n "schedule": {"kind": "oneshot"},\n "pattern": "ew"}',
        "key 'pattern' at line 3 (first at line 1) is given twice in one mapping",
    ),
    (
        "latin1.yaml",
        b"pattern: tw\n# caf\xe9\n",
        "not UTF-8 text (invalid continuation byte at byte 17)",
    ),
]


@pytest.mark.parametrize(("name", "text", "message"), BAD_RECIPES, ids=[c[0] for c in BAD_RECIPES])
def test_malformed_recipe_files_are_one_line_value_errors_naming_file_and_field(
    tmp_path, name, text, message
) -> None:
    """A ValueError naming the file and the field, not a TypeError (a scalar stages), a
    JSONDecodeError / yaml ParserError without the path (multi-line for YAML), or a message
    that names no field."""
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as e:
        TileSparseConfig.load(p)
    assert type(e.value) is ValueError
    assert str(e.value).startswith(f"recipe file {p}: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_scalar_block_is_square(tmp_path) -> None:
    """``block: 16`` raised TypeError in a recipe file; one integer b means (b, b)."""
    p = tmp_path / "block_int.yaml"
    p.write_text("pattern: bw\nblock: 16\n")
    assert TileSparseConfig.load(p).block == (16, 16)
    assert TileSparseConfig(pattern="bw", block=8).block == (8, 8)
    assert TileSparseConfig.from_json(TileSparseConfig(pattern="bw", block=8).to_json()).block == (
        8,
        8,
    )
    with pytest.raises(ValueError, match="block must be"):
        TileSparseConfig(block=True)
