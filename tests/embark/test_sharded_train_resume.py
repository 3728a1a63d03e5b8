"""``python -m embark.sharded_train --checkpoint-dir / --resume`` under real ``torchrun``:
2 ranks train 4 steps and checkpoint, 1 rank resumes to 6 steps, and its final checkpoint
equals an uninterrupted 6-step 2-rank run's; a corrupt checkpoint exits 2, naming the path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sharded_train import tiny_plan
from test_sharded_train_cli import _free_port

from embark.sharded_train import main

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--workload", "tiny", "--batch-size", "64", "--eval-batches", "1", "--log-every", "100"]


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "embark.sharded_train", *COMMON, *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("resume")
    plan = d / "plan2.json"
    plan.write_text(json.dumps(tiny_plan(2)))  # TW, RW, CW, TRW, DP: resharded to world 1
    _ok(_torchrun(2, "--steps", "4", "--plan", str(plan), "--checkpoint-dir", str(d / "c4")))
    out = _ok(_torchrun(1, "--steps", "6", "--resume", str(d / "c4"), "--checkpoint-dir", str(d / "c6r")))
    assert "sharded_train [tiny, world 1, 6 steps × 64]" in out and "(resumed at step 4)" in out
    _ok(_torchrun(2, "--steps", "6", "--plan", str(plan), "--checkpoint-dir", str(d / "c6"),
                  "--checkpoint-every", "3"))
    return d


def test_resume_on_another_world_size_equals_an_uninterrupted_run(runs: Path) -> None:
    for ckpt, step in (("c4", 4), ("c6r", 6), ("c6", 6)):
        assert json.loads((runs / ckpt / "state.json").read_text())["step"] == step
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
    p = _torchrun(2, "--steps", "6", "--resume", str(bad))
    assert p.returncode != 0
    assert f"--resume {str(bad)!r}" in p.stderr and "does not match its recorded sha256" in p.stderr
    assert p.stderr.count("exitcode  : 2") == 2, p.stderr[-3000:]  # torchrun's per-rank report


def test_resume_errors_in_process(runs: Path, caplog: pytest.LogCaptureFixture) -> None:
    c4 = str(runs / "c4")
    cases = [
        (["--resume", str(runs / "none")], "is not a checkpoint folder"),
        (["--resume", c4, "--scale", "2"], "is a checkpoint of workload 'tiny'"),
        (["--resume", c4, "--seed", "3"], "was trained with --seed 0, not 3"),
        (["--resume", c4, "--steps", "3"], "is at step 4, past --steps 3"),
    ]
    for argv, msg in cases:
        caplog.clear()
        assert main(["--steps", "6", "--batch-size", "64", *argv]) == 2
        assert msg in caplog.text and "--resume '" in caplog.text, caplog.text
