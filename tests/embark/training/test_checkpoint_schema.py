"""``state.json`` schema: every bad field is a ValueError naming the file and the field, raised
before the model, its trainer's optimizer or anything else is touched."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Any], SyntheticCTR]:
    w = get_workload("tiny")
    data = SyntheticCTR(replace(w, tables=w.tables[:3]), batch_size=32, seed=2)
    t = Trainer(build_model(data.workload, seed=1), TrainConfig(lr=0.05))
    t.data_stream = data.stream_config()
    t.fit(data.batches(3), 3, progress=False)
    ck = t.save_checkpoint(tmp_path_factory.mktemp("ck") / "ck")
    return ck, json.loads((ck / "state.json").read_text()), data


def _without(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda s: {k: v for k, v in s.items() if k != key}


def _with(**kw: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda s: s | kw


def _files(mutate: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], Any]:
    def f(s: dict[str, Any]) -> dict[str, Any]:
        mutate(s["files"])
        return s

    return f


def _chunk(**chunk: Any) -> Callable[[dict[str, Any]], Any]:
    """A state whose ``shards-0`` file (a copy of the model file's record) holds one chunk of
    key ``k`` with ``chunk``'s fields."""

    def f(s: dict[str, Any]) -> dict[str, Any]:
        s["files"]["shards-0.safetensors"] = s["files"]["model.safetensors"]
        s["shards"] = {"k": [{"file": "shards-0.safetensors", "name": "k@0"} | chunk]}
        return s

    return f


CASES = [
    (lambda s: [s], "must hold a JSON object, got list"),
    (_with(format_version="3"), "has format_version '3', expected 3"),
    (_with(format_version=2), "has format_version 2, expected 3"),  # tables whole, no shards
    (_without("format_version"), "missing field 'format_version'"),
    (_without("files"), "missing field 'files'"),
    (_without("rng"), "missing field 'rng'"),
    (_without("step"), "missing field 'step'"),
    (_without("param_groups"), "missing field 'param_groups'"),
    (_with(step="abc"), "step must be an integer >= 0, got 'abc'"),
    (_with(step=3.0), "step must be an integer >= 0, got 3.0"),
    (_with(step=-1), "step must be an integer >= 0, got -1"),
    (_with(step=True), "step must be an integer >= 0, got True"),
    (_with(data_position="3"), "data_position must be an integer >= 0, got '3'"),
    (_without("batch_size"), "missing field 'batch_size'"),
    (_without("data_stream"), "missing field 'data_stream'"),
    (_with(batch_size=None), "batch_size must be an integer >= 1 after step 0, got None"),
    (_with(batch_size=0), "batch_size must be an integer >= 1 or null, got 0"),
    (_with(batch_size="32"), "batch_size must be an integer >= 1 or null, got '32'"),
    (_with(data_stream=[1]), r"data_stream must be a mapping or null, got \[1\]"),
    (_with(workload=[1]), r"workload must be a mapping or null, got \[1\]"),
    (_with(train_config="lr=1"), "train_config must be a mapping, got 'lr=1'"),
    (_with(rng="00"), "rng.trainer_generator must be a hex string, got '00'"),
    (_with(rng={}), "rng.trainer_generator must be a hex string, got None"),
    (
        _with(rng={"trainer_generator": "zz"}),
        "rng.trainer_generator must be a hex string, got 'zz'",
    ),
    (
        _with(rng={"trainer_generator": "0011"}),
        "rng.trainer_generator must be a torch.Generator state, got '2 bytes'",
    ),
    (_with(optimizer_scalars=[]), r"optimizer_scalars must be a mapping, got \[\]"),
    (
        _with(optimizer_scalars={"w": 1}),
        "a key of optimizer_scalars must be '<param name>::<state key>', got 'w'",
    ),
    (_with(optimizer_scalars={"w::step": [1]}), r"optimizer_scalars\['w::step'\] must be a number"),
    (_with(param_groups=[]), r"param_groups must be a non-empty list, got \[\]"),
    (_with(param_groups=[{"lr": 1}]), r"param_groups\[0\] must be a mapping with 'params'"),
    (_with(history={}), "history must be a list of mappings, got {}"),
    (
        _with(files={}),
        r"files must be a record of \['model.safetensors', 'optimizer.safetensors'\] and "
        r"shards-<rank>.safetensors, got \[\]",
    ),
    (
        _files(lambda f: f.pop("model.safetensors")),
        r"files must be a record of .*got \['optimizer.safetensors'\]",
    ),
    (
        _files(lambda f: f.update({"shards-01.safetensors": f["model.safetensors"]})),
        r"files must be a record of .*got \[.*'shards-01.safetensors'\]",
    ),
    (
        _files(lambda f: f.update({"shards-1.safetensors": f["model.safetensors"]})),
        r"files must be only files that shards names, got \['shards-1.safetensors'\]",
    ),
    (_without("shards"), "missing field 'shards'"),
    (_with(shards=[]), r"shards must be a mapping, got \[\]"),
    (
        _with(shards={"embeddings.t0.weight": []}),
        r"shards\['embeddings.t0.weight'\] must be a non-empty",
    ),
    (
        _with(
            shards={
                "k": [{"file": "model.safetensors", "name": "k@0", "offset": [0], "shape": [1]}]
            }
        ),
        r"shards\['k'\]\[0\].file must be a shards-<rank> file listed in files, got 'model.safetensors'",
    ),
    (
        _with(
            shards={
                "k": [{"file": "shards-0.safetensors", "name": "k@0", "offset": [0], "shape": [1]}]
            }
        ),
        r"shards\['k'\]\[0\].file must be a shards-<rank> file listed in files, got 'shards-0",
    ),
    (
        _chunk(offset=[0, -1], shape=[2, 2]),
        r"shards\['k'\]\[0\] must be offset \(>= 0\) and shape \(>= 1\) of equal length",
    ),
    (
        _chunk(offset=[0], shape=[2, 2]),
        r"shards\['k'\]\[0\] must be offset \(>= 0\) and shape \(>= 1\) of equal length",
    ),
    (_chunk(offset=[0], shape=[0]), r"shards\['k'\]\[0\] must be offset"),
    (
        _files(lambda f: f["model.safetensors"].update(bytes="12")),
        r"files\['model.safetensors'\] must be",
    ),
    (
        _files(lambda f: f["model.safetensors"].update(sha256=None)),
        r"files\['model.safetensors'\].sha256 must be 64",
    ),
]


def test_another_format_version_is_refused_by_name(checkpoint, tmp_path) -> None:
    """A version-2 checkpoint (tables whole, no chunk index) raises FormatVersionError."""
    from embark.training import FormatVersionError

    src, state, _ = checkpoint
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in src.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    (ck / "state.json").write_text(json.dumps(state | {"format_version": 2}))
    with pytest.raises(FormatVersionError, match="has format_version 2, expected 3"):
        Trainer.load_checkpoint(ck)


@pytest.mark.parametrize(("mutate", "match"), CASES)
def test_bad_state_is_named_and_touches_nothing(checkpoint, tmp_path, mutate, match):
    src, state, data = checkpoint
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in src.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    (ck / "state.json").write_text(json.dumps(mutate(copy.deepcopy(state))))

    # A live trainer whose model is handed to load_checkpoint: neither its weights nor its
    # optimizer state may change when the load fails.
    live = Trainer(build_model(data.workload, seed=7), TrainConfig(lr=0.05))
    live.fit(data.batches(2), 2, progress=False)
    weights = {k: v.clone() for k, v in live.model.state_dict().items()}
    opt = copy.deepcopy(live.optimizer.state_dict())

    with pytest.raises(ValueError, match=match) as exc:
        Trainer.load_checkpoint(ck, model=live.model)
    assert str(ck / "state.json") in str(exc.value)

    assert all(torch.equal(v, live.model.state_dict()[k]) for k, v in weights.items())
    now = live.optimizer.state_dict()
    assert now["param_groups"] == opt["param_groups"]
    for pid, slots in opt["state"].items():
        for key, v in slots.items():
            assert torch.equal(torch.as_tensor(now["state"][pid][key]), torch.as_tensor(v)), (
                pid,
                key,
            )


def test_bad_workload_or_train_config_names_the_file(checkpoint, tmp_path):
    src, state, _ = checkpoint
    for field, bad, match in [
        (
            "workload",
            state["workload"] | {"botom_mlp": [8]},
            r"workload: .*unknown field\(s\) \['botom_mlp'\]",
        ),
        (
            "train_config",
            state["train_config"] | {"lr": "fast"},
            "train_config: TrainConfig.lr must be",
        ),
    ]:
        ck = tmp_path / field
        ck.mkdir()
        for f in src.iterdir():
            (ck / f.name).write_bytes(f.read_bytes())
        (ck / "state.json").write_text(json.dumps(state | {field: bad}))
        with pytest.raises(ValueError, match=match) as exc:
            Trainer.load_checkpoint(ck)
        assert str(ck / "state.json") in str(exc.value)


def test_unknown_param_group_option_is_rejected(checkpoint, tmp_path):
    src, state, data = checkpoint
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in src.iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    bad = copy.deepcopy(state)
    bad["param_groups"][0]["lr_schedule"] = "cosine"
    (ck / "state.json").write_text(json.dumps(bad))
    target = build_model(data.workload, seed=9)
    weights = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"param_groups\[0\] has unknown option\(s\) \['lr_schedule'\]"
    ):
        Trainer.load_checkpoint(ck, model=target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in weights.items())


def test_good_checkpoint_still_loads(checkpoint):
    ck, state, data = checkpoint
    t = Trainer.load_checkpoint(ck)
    assert t.step == state["step"] == 3 and type(t.step) is int
    assert t.batch_size == state["batch_size"] == 32
    assert t.data_stream == state["data_stream"] == json.loads(json.dumps(data.stream_config()))


def test_a_batch_larger_than_the_stream_s_is_refused(checkpoint):
    ck, _, data = checkpoint
    t = Trainer.load_checkpoint(ck)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    bigger = SyntheticCTR(data.workload, batch_size=64, seed=2)
    with pytest.raises(
        ValueError, match="a batch of 64 samples, but this trainer's data stream has 32"
    ):
        t.train_step(bigger.batch(3))
    assert t.step == 3 and all(torch.equal(v, t.model.state_dict()[k]) for k, v in before.items())
    t.train_step(
        SyntheticCTR(data.workload, batch_size=20, seed=2).batch(3)
    )  # a shorter last batch
    assert t.step == 4 and t.batch_size == 32
