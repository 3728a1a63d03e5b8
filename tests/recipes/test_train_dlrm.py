from __future__ import annotations

import json

import pytest

from embark.train import Trainer
from recipes.cli import parse_knobs
from recipes.train_dlrm import TrainDLRMKnobs, main


def test_main_on_a_shrunk_config_writes_results(tmp_path, capsys):
    cfg = TrainDLRMKnobs(
        steps=150, batch_size=256, eval_batches=4, train_eval_batches=2,
        out=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    results = main(cfg)
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    for key in ("eval_auc", "eval_logloss", "teacher_auc", "train_auc", "samples_per_s"):
        assert isinstance(on_disk[key], float), key
    assert on_disk["eval_auc"] > 0.65  # clearly better than chance after 150 steps
    assert on_disk["teacher_auc"] > on_disk["eval_auc"] - 0.01
    assert 0 < on_disk["eval_logloss"] < 0.693  # better than predicting 1/2
    assert on_disk["samples_per_s"] > 0 and on_disk["steps"] == 150
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 150
    restored = Trainer.load_checkpoint(on_disk["checkpoint"])
    assert restored.step == 150
    assert "eval AUC" in capsys.readouterr().out


def test_knobs_from_the_command_line():
    cfg = parse_knobs(TrainDLRMKnobs, ["--steps", "70", "--no-checkpoint", "--optimizer", "sgd"])
    assert cfg.steps == 70 and cfg.checkpoint is False and cfg.optimizer == "sgd"
    assert parse_knobs(TrainDLRMKnobs, []) == TrainDLRMKnobs()
    with pytest.raises(SystemExit):
        parse_knobs(TrainDLRMKnobs, ["--workload", "nope"])  # rejected by __post_init__
