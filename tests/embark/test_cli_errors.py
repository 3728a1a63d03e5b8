"""Clear errors instead of tracebacks in ``python -m embark.plan`` and
``embark.sharded_train`` (issue #22, item 9): outputs checked before any work and written
atomically, sizes bounded, a strategy name that is not one listed, a diverging run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embark.plan import main as plan_main
from embark.sharded_train import main as train_main
from tests.embark.gloo_world import ROOT
from tests.unwritable import unwritable_folder

PLAN = ["--workload", "tiny", "--topology", "cpu-local", "--batch-size", "64", "--quiet"]
TRAIN = ["--steps", "3", "--batch-size", "32", "--eval-batches", "1", "--log-every", "1"]


def _bad_outputs(tmp_path: Path) -> list[tuple[Path, str]]:
    """(path, the message's end) for a folder, a path under a file and an unwritable one."""
    folder = tmp_path / "folder"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    locked = unwritable_folder(tmp_path) / "out.json"
    return [
        (folder, f"path {str(folder)!r} is a folder; expected a file path"),
        (
            a_file / "out.json",
            f"path {str(a_file / 'out.json')!r} is under {str(a_file)!r}, which is a file",
        ),
        (locked, f"path {str(locked)!r} cannot be written: "),
    ]


def test_plan_out_that_cannot_be_written_is_a_usage_error_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for out, msg in _bad_outputs(tmp_path):
        with pytest.raises(SystemExit) as e:
            plan_main([*PLAN, "--out", str(out)])
        assert e.value.code == 2
        assert f"argument --out: {msg}" in capsys.readouterr().err, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder"]  # no plans.tmp
    assert not any((tmp_path / "folder").iterdir())


def test_plan_out_is_written_atomically(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "plan.json"
    assert plan_main([*PLAN, "--out", str(out)]) == 0
    assert out.read_text().startswith("{") and sorted(os.listdir(out.parent)) == ["plan.json"]


def test_plan_an_unknown_strategy_lists_the_valid_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert plan_main([*PLAN, "--strategy", "magic"]) == 2
    assert (
        "error: strategy 'magic' is not one of auto, greedy, trw, rw, tw, dp, and no plan "
        "file of that name exists"
    ) in caplog.text


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--batch-size", str(10**9)], f"argument --batch-size: expected an integer in [1, 1048576], got {10**9}"),
        (["--seed", str(2**64)], f"argument --seed: expected an integer in [0, 4294967295], got {2**64}"),
        (["--seed", "9" * 5000], f"argument --seed: expected an integer in [0, 4294967295], got '{'9' * 40}'... (5000 characters)"),
    ],
)  # fmt: skip
def test_sharded_train_absurd_sizes_are_usage_errors(
    argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        train_main([*TRAIN, *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_sharded_train_out_that_cannot_be_written_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for out, msg in _bad_outputs(tmp_path):
        with pytest.raises(SystemExit) as e:
            train_main([*TRAIN, "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr()
        assert f"argument --out: {msg}" in err.err and "step" not in err.out, out


def test_sharded_train_checks_the_checkpoint_dir_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A --checkpoint-dir the save could not write is refused before the first step (no
    ``step`` line printed), not found by the save after training."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    locked = unwritable_folder(tmp_path) / "ckpt"
    for ckpt, msg in (
        (a_file / "ckpt", f"--checkpoint-dir {str(a_file / 'ckpt')!r} is under {str(a_file)!r}, which is a file"),
        (locked, f"--checkpoint-dir {str(locked)!r} cannot be written: "),
        (a_file, f"--checkpoint-dir {str(a_file)!r} exists and is not a checkpoint folder"),
    ):  # fmt: skip
        caplog.clear()
        assert train_main([*TRAIN, "--checkpoint-dir", str(ckpt)]) == 2
        assert msg in caplog.text, caplog.text
        assert "step" not in capsys.readouterr().out
    assert a_file.read_text() == "x"


def test_sharded_train_divergence_exits_1_saying_where() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "embark.sharded_train", *TRAIN, "--lr", "1e30"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert (
        p.stderr.strip()
        .splitlines()[-1]
        .startswith("ERROR __main__: error: training diverged at step 2: its loss is nan")
    )
