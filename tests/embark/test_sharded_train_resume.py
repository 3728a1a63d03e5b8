"""``python -m embark.sharded_train --checkpoint-dir / --resume`` as launched ranks (torchrun's
environment, :func:`gloo_world.launch_ranks`): 2 ranks train 4 steps and checkpoint, 1 rank
resumes to 6 steps, and its final checkpoint equals an uninterrupted 6-step 2-rank run's; a
corrupt checkpoint exits 2 on every rank, rank 0 naming the path."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from embark.sharded_train import main
from embark.training.checkpoint import read_checkpoint
from tests.embark.gloo_world import launch_ranks
from tests.embark.sharding.plans import tiny_plan
from tests.tolerances import tol

COMMON = ["--workload", "tiny", "--batch-size", "64", "--eval-batches", "1", "--log-every", "100"]


def _ranks(nproc: int, *args: str) -> list[subprocess.CompletedProcess[str]]:
    return launch_ranks(nproc, ["-m", "embark.sharded_train", *COMMON, *args])


def _ok(ranks: list[subprocess.CompletedProcess[str]]) -> str:
    """Rank 0's stdout, once every rank exited 0."""
    for r, p in enumerate(ranks):
        assert p.returncode == 0, f"rank {r}: " + p.stdout[-3000:] + p.stderr[-3000:]
    return ranks[0].stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("resume")
    plan = d / "plan2.json"
    plan.write_text(json.dumps(tiny_plan(2)))  # TW, RW, CW, TRW, DP: resharded to world 1
    _ok(_ranks(2, "--steps", "4", "--plan", str(plan), "--checkpoint-dir", str(d / "c4")))
    out = _ok(
        _ranks(1, "--steps", "6", "--resume", str(d / "c4"), "--checkpoint-dir", str(d / "c6r"))
    )
    assert "sharded_train [tiny, world 1, 6 steps × 64]" in out and "(resumed at step 4)" in out
    _ok(
        _ranks(
            2,
            "--steps",
            "6",
            "--plan",
            str(plan),
            "--checkpoint-dir",
            str(d / "c6"),
            "--checkpoint-every",
            "3",
        )
    )
    return d


def test_resume_on_another_world_size_equals_an_uninterrupted_run(runs: Path) -> None:
    for ckpt, step in (("c4", 4), ("c6r", 6), ("c6", 6)):
        state = json.loads((runs / ckpt / "state.json").read_text())
        assert state["step"] == step and state["batch_size"] == 64, (ckpt, state["batch_size"])
    assert not [p.name for p in runs.iterdir() if p.name.startswith(".")]  # no temporary left
    # each checkpoint stores its sharded tables in chunks of its own plan: compare them whole
    resumed, whole = (read_checkpoint(runs / c) for c in ("c6r", "c6"))
    for got, want in (
        (resumed.model_tensors, whole.model_tensors),
        (resumed.optimizer_tensors, whole.optimizer_tensors),
    ):
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tol("sharded_train"), msg=k)
    four = read_checkpoint(runs / "c4").model_tensors
    six = whole.model_tensors
    assert any(not torch.equal(four[k], six[k]) for k in six)  # the last 2 steps did train


def test_corrupt_checkpoint_exits_2_on_every_rank(runs: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(runs / "c4", bad)
    with open(bad / "optimizer.safetensors", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff" * 8)  # same size, other bytes
    ranks = _ranks(2, "--steps", "6", "--resume", str(bad))
    assert [p.returncode for p in ranks] == [2, 2], [p.stderr[-2000:] for p in ranks]
    err = ranks[0].stderr
    assert f"--resume {str(bad)!r}" in err and "does not match its recorded sha256" in err, err
    assert "Traceback" not in ranks[1].stderr, ranks[1].stderr  # a clean exit 2, not a crash


def test_resume_errors_in_process(runs: Path, caplog: pytest.LogCaptureFixture) -> None:
    c4 = str(runs / "c4")
    cases = [
        (["--resume", str(runs / "none")], "is not a checkpoint folder"),
        (["--resume", c4, "--scale", "2"], "is a checkpoint of workload 'tiny'"),
        (["--resume", c4, "--seed", "3"], "was trained with --seed 0, not 3"),
        (["--resume", c4, "--steps", "3"], "is at step 4, past --steps 3"),
        (["--resume", c4, "--batch-size", "32"], "was trained with --batch-size 64, not 32"),
        (["--resume", c4, "--ragged"], "was trained with --ragged False, not True"),
        (
            ["--resume", c4, "--label-sharpness", "8"],
            "was trained with --label-sharpness 2.0, not 8.0",
        ),
    ]
    for argv, msg in cases:
        caplog.clear()
        assert main(["--steps", "6", "--batch-size", "64", *argv]) == 2
        assert msg in caplog.text and "--resume '" in caplog.text, caplog.text


def test_resume_keeps_the_checkpoints_batch_size(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Without --batch-size a resume takes the checkpoint's; a checkpoint that records no
    batch size or no data stream (not of this format) is refused, naming the field."""
    out = tmp_path / "r.json"
    assert (
        main(
            ["--steps", "4", "--eval-batches", "1", "--resume", str(runs / "c4"), "--out", str(out)]
        )
        == 0
    )
    assert (
        json.loads(out.read_text())["batch_size"] == 64
        and "4 steps × 64]" in capsys.readouterr().out
    )
    for field in ("batch_size", "data_stream"):
        old = tmp_path / f"without_{field}"
        shutil.copytree(runs / "c4", old)
        state = json.loads((old / "state.json").read_text())
        del state[field]
        (old / "state.json").write_text(json.dumps(state))
        caplog.clear()
        argv = ["--steps", "4", "--eval-batches", "1", "--resume", str(old), "--batch-size", "64"]
        assert main(argv) == 2
        assert f"--resume {str(old)!r}" in caplog.text, caplog.text
        assert f"missing field {field!r}" in caplog.text, caplog.text


def test_a_train_dlrm_checkpoint_resumes_on_its_own_data_stream(tmp_path: Path) -> None:
    """``recipes.train_dlrm --ragged --label-sharpness 8`` for 4 steps, resumed here to 6,
    equals train_dlrm's uninterrupted 6 steps: the resume regenerates the recorded stream."""
    from recipes.train_dlrm import TrainDLRMKnobs
    from recipes.train_dlrm import main as train_dlrm

    def knobs(steps: int, out: str) -> TrainDLRMKnobs:
        return TrainDLRMKnobs(
            steps=steps,
            batch_size=64,
            ragged=True,
            label_sharpness=8.0,
            eval_batches=1,
            train_eval_batches=1,
            out=str(tmp_path / out),
            progress=False,
        )

    train_dlrm(knobs(4, "four"))
    train_dlrm(knobs(6, "six"))
    assert (
        main(
            [
                "--steps",
                "6",
                "--eval-batches",
                "1",
                "--resume",
                str(tmp_path / "four" / "checkpoint"),
                "--checkpoint-dir",
                str(tmp_path / "resumed"),
            ]
        )
        == 0
    )
    state = json.loads((tmp_path / "resumed" / "state.json").read_text())
    assert state["data_stream"]["ragged"] is True and state["data_stream"]["label_sharpness"] == 8.0
    resumed = read_checkpoint(tmp_path / "resumed").model_tensors  # sharded: assembled whole
    whole = load_file(tmp_path / "six" / "checkpoint" / "model.safetensors")
    assert resumed.keys() == whole.keys()
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], **tol("sharded_train"), msg=k)
