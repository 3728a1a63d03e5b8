from __future__ import annotations

import json

import pytest

import recipes.train_dlrm as train_dlrm
from embark.models.workloads import get_workload
from embark.training.trainer import OptimizerKind, Trainer
from recipes.cli import foreign_entries, parse_knobs
from recipes.train_dlrm import OUTPUTS, TrainDLRMKnobs, build, main


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
    # every entry is one a later --overwrite may remove
    assert foreign_entries([p.name for p in (tmp_path / "run").iterdir()], OUTPUTS) == []


def test_knobs_from_the_command_line():
    cfg = parse_knobs(TrainDLRMKnobs, ["--steps", "70", "--no-checkpoint", "--optimizer", "sgd"])
    assert cfg.steps == 70 and cfg.checkpoint is False and cfg.optimizer == "sgd"
    assert parse_knobs(TrainDLRMKnobs, []) == TrainDLRMKnobs()
    with pytest.raises(SystemExit):
        parse_knobs(TrainDLRMKnobs, ["--workload", "nope"])  # rejected by __post_init__


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--embedding-lr", "-1"], "--embedding-lr must be a finite number > 0, got -1.0"),
        (["--eval-every", "-1"], "--eval-every must be an integer >= 0, got -1"),
        (["--label-sharpness", "0"], "--label-sharpness must be a finite number > 0, got 0.0"),
        (["--seed", "-3"], "--seed must be an integer in [0, 4294967295], got -3"),
        (["--scale", "nan"], "--scale must be a finite number >= 1, got nan"),
        (
            ["--optimizer", "adam"],
            "argument --optimizer: invalid choice: 'adam' (choose from adagrad, sgd, none)",
        ),
    ],
)
def test_bad_knobs_are_usage_errors_before_anything_is_created(argv, message, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        parse_knobs(TrainDLRMKnobs, ["--out", str(out), *argv])
    assert info.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not out.exists()


def test_optimizer_none_means_the_workloads_choice():
    cfg = parse_knobs(TrainDLRMKnobs, ["--optimizer", "none"])
    assert cfg.optimizer is None
    assert build(cfg)[2].cfg.optimizer == OptimizerKind(get_workload("tiny").optimizer)
    assert TrainDLRMKnobs(optimizer="sgd").optimizer is OptimizerKind.SGD


def test_a_failing_build_leaves_no_empty_out_folder(tmp_path, monkeypatch):
    def boom(cfg):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(train_dlrm, "build", boom)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="out of memory"):
        main(TrainDLRMKnobs(out=str(out), progress=False))
    assert not out.exists()


def test_a_diverging_run_stops_saves_its_last_finite_state_and_says_where(tmp_path):
    """--lr 1e30: the loss is nan at step 2. The run stops there (no crash in the final
    eval), the state after step 1 is saved and loads, results.json records the divergence."""
    import torch

    from embark.training.trainer import TrainingDiverged

    out = tmp_path / "run"
    cfg = TrainDLRMKnobs(
        lr=1e30, steps=20, batch_size=64, eval_batches=1, train_eval_batches=1,
        out=str(out), progress=False,
    )  # fmt: skip
    with pytest.raises(TrainingDiverged, match="training diverged at step 2: its loss is nan") as e:
        main(cfg)
    assert e.value.step == 2
    assert e.value.__notes__ == [f"saved the last finite state (step 1) to {out / 'checkpoint'}"]
    results = json.loads((out / "results.json").read_text())
    assert results["diverged"] == {"step": 2, "loss": "nan"} and results["steps"] == 1
    restored = Trainer.load_checkpoint(out / "checkpoint")
    assert restored.step == 1
    assert all(torch.isfinite(t).all() for t in restored.model.state_dict().values())


def test_a_diverging_run_exits_1_with_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.train_dlrm", "--lr", "1e30", "--steps", "20",
         "--batch-size", "64", "--eval-batches", "1", "--train-eval-batches", "1",
         "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "train_dlrm.py: error: training diverged at step 2: its loss is nan (the weights are "
        "those after step 1; a lower learning rate may train); saved the last finite state "
        f"(step 1) to {out / 'checkpoint'}"
    )


def test_checkpoint_every_saves_during_the_run(tmp_path, monkeypatch):
    import embark.training.checkpoint.store as ckpt

    saved_at = []
    save = ckpt.save_checkpoint

    def recording(path, model, optimizer, cfg, state, *tables):
        saved_at.append((state.step, path))
        return save(path, model, optimizer, cfg, state, *tables)

    monkeypatch.setattr(ckpt, "save_checkpoint", recording)
    out = tmp_path / "run"
    main(TrainDLRMKnobs(
        steps=6, batch_size=64, eval_batches=1, train_eval_batches=1, out=str(out),
        progress=False, checkpoint_every=2,
    ))  # fmt: skip
    assert saved_at == [(s, str(out / "checkpoint")) for s in (2, 4, 6)] + [(6, out / "checkpoint")]
    with pytest.raises(ValueError, match="--checkpoint-every needs the checkpoint"):
        TrainDLRMKnobs(checkpoint_every=5, checkpoint=False)
