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
from gloo_world import launch_ranks
from safetensors.torch import load_file
from test_sharded_train import tiny_plan

from embark.sharded_train import main

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
    out = _ok(_ranks(1, "--steps", "6", "--resume", str(d / "c4"), "--checkpoint-dir", str(d / "c6r")))
    assert "sharded_train [tiny, world 1, 6 steps × 64]" in out and "(resumed at step 4)" in out
    _ok(_ranks(2, "--steps", "6", "--plan", str(plan), "--checkpoint-dir", str(d / "c6"),
               "--checkpoint-every", "3"))
    return d


def test_resume_on_another_world_size_equals_an_uninterrupted_run(runs: Path) -> None:
    for ckpt, step in (("c4", 4), ("c6r", 6), ("c6", 6)):
        state = json.loads((runs / ckpt / "state.json").read_text())
        assert state["step"] == step and state["batch_size"] == 64, (ckpt, state["batch_size"])
    assert not [p.name for p in runs.iterdir() if p.name.startswith(".")]  # no temporary left
    for f in ("model.safetensors", "optimizer.safetensors"):
        resumed, whole = load_file(runs / "c6r" / f), load_file(runs / "c6" / f)
        assert resumed.keys() == whole.keys()
        for k in whole:
            torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-5, msg=k)
    four, six = (load_file(runs / c / "model.safetensors") for c in ("c4", "c6"))
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
    ]
    for argv, msg in cases:
        caplog.clear()
        assert main(["--steps", "6", "--batch-size", "64", *argv]) == 2
        assert msg in caplog.text and "--resume '" in caplog.text, caplog.text


def test_resume_keeps_the_checkpoints_batch_size(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Without --batch-size a resume takes the checkpoint's; a checkpoint from before batch
    sizes were recorded resumes with --batch-size (default 512), warning that it must match."""
    out = tmp_path / "r.json"
    assert main(["--steps", "4", "--eval-batches", "1", "--resume", str(runs / "c4"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["batch_size"] == 64 and "4 steps × 64]" in capsys.readouterr().out
    old = tmp_path / "old"
    shutil.copytree(runs / "c4", old)
    state = json.loads((old / "state.json").read_text())
    del state["batch_size"]
    (old / "state.json").write_text(json.dumps(state))
    caplog.clear()
    argv = ["--steps", "4", "--eval-batches", "1", "--resume", str(old), "--out", str(out)]
    assert main([*argv, "--batch-size", "64"]) == 0
    assert json.loads(out.read_text())["batch_size"] == 64
    assert "records no batch size" in caplog.text and "--batch-size 64" in caplog.text
