"""Workload presets and ``Workload.from_dict``: strict schema, errors that name the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from embark.models.workloads import PRESETS, Interaction, Workload, get_workload

SHIPPED = Path(__file__).resolve().parents[3] / "embark" / "models" / "presets"


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_round_trip(name):
    w = get_workload(name)
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_preset_files_load(path):
    w = Workload.from_dict(json.loads(path.read_text()))
    assert w.name == path.stem and isinstance(w.zipf_alpha, float)
    assert all(type(x) is int for x in (w.dense_features, *w.bottom_mlp, *w.top_mlp))


def _tiny() -> dict[str, Any]:
    return copy.deepcopy(get_workload("tiny").to_dict())


def _set(**kw: Any):
    return lambda d: d.update(kw)


def _pop(key: str):
    return lambda d: d.pop(key)


def _inter(**kw: Any):
    return lambda d: d["interaction"].update(kw)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set(botom_mlp=[8]), r"unknown field\(s\) \['botom_mlp'\]"),
        (_pop("name"), "missing field 'name'"),
        (_pop("tables"), "missing field 'tables'"),
        (_set(name=""), "name must be a non-empty string, got ''"),
        (_set(name=3), "name must be a non-empty string, got 3"),
        (_set(dense_features=13.9), "dense_features must be a positive integer, got 13.9"),
        (_set(dense_features=True), "dense_features must be a positive integer, got True"),
        (_set(dense_features="13"), "dense_features must be a positive integer, got '13'"),
        (_set(dense_features=0), "dense_features must be a positive integer, got 0"),
        (_set(bottom_mlp=[64.5, 16]), r"bottom_mlp\[0\] must be a positive integer, got 64.5"),
        (
            _set(bottom_mlp="64"),
            "bottom_mlp must be a non-empty list of positive integers, got '64'",
        ),
        (_set(bottom_mlp=[]), "bottom_mlp must be a non-empty list"),
        (_set(top_mlp=[8, False]), r"top_mlp\[1\] must be a positive integer, got False"),
        (_set(top_mlp=[8, 2]), r"top_mlp must end in 1 \(the logit\), got \(8, 2\)"),
        (_set(zipf_alpha=float("nan")), "zipf_alpha must be a finite number > 0, got nan"),
        (_set(zipf_alpha=float("inf")), "zipf_alpha must be a finite number > 0, got inf"),
        (_set(zipf_alpha="1.1"), "zipf_alpha must be a finite number > 0, got '1.1'"),
        (_set(zipf_alpha=0), "zipf_alpha must be a finite number > 0, got 0"),
        (_set(optimizer="adam"), "optimizer must be 'adagrad' or 'sgd', got 'adam'"),
        (_set(source=None), "source must be a string, got None"),
        (_set(tables={"name": "x"}), "tables must be a list of tables"),
        (_set(tables=[]), "tables must be a non-empty list"),
        (_set(tables=["t0"]), r"tables\[0\] must be a mapping, got str"),
        (
            lambda d: d["tables"][0].update(num_rows="100"),
            "num_rows must be a positive integer, got '100'",
        ),
        (lambda d: d["tables"].append(dict(d["tables"][0])), r"duplicate table names \['t0'\]"),
        (_inter(lowrank=4), r"interaction: unknown field\(s\) \['lowrank'\]"),
        (_inter(num_layers="3"), "interaction.num_layers must be a positive integer, got '3'"),
        (_inter(low_rank=2.5), "interaction.low_rank must be a positive integer, got 2.5"),
        (_inter(type="cross"), "interaction.type must be 'dot' or 'dcnv2', got 'cross'"),
        (_set(interaction="dot"), "interaction must be a mapping, got str"),
    ],
)
def test_from_dict_rejects_bad_fields(mutate, match):
    d = _tiny()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        Workload.from_dict(d)


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(ValueError, match="workload must be a mapping, got list"):
        Workload.from_dict([_tiny()])


def test_from_dict_defaults_and_int_alpha():
    d = {"name": "w", "tables": [{"name": "a", "num_rows": 10, "dim": 4}], "zipf_alpha": 2}
    w = Workload.from_dict(d)
    assert w.zipf_alpha == 2.0 and isinstance(w.zipf_alpha, float)
    assert w.interaction == Interaction() and w.bottom_mlp == (512, 256, 128)


def test_dot_needs_no_matching_bottom_width():
    # The last bottom width (16) differs from a table dim (8): the model projects, not rejects.
    d = _tiny() | {"interaction": {"type": "dot"}}
    d["tables"][0]["dim"] = 8
    assert Workload.from_dict(d).interaction.type == "dot"


def test_constructor_checks_types_too():
    t = get_workload("tiny").tables
    with pytest.raises(ValueError, match=r"bottom_mlp\[1\] must be a positive integer, got 3.0"):
        Workload("w", t, bottom_mlp=(4, 3.0))
    assert Workload("w", list(t), bottom_mlp=[4, 2]).bottom_mlp == (4, 2)
