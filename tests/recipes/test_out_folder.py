"""A recipe run never overwrites another silently (issue #22, item 6), and a bad ``--out`` or
an absurd ``--batch-size`` / ``--seed`` / ``--threads`` is a usage error naming the flag
(item 9): :class:`recipes.cli.OutFolder` and the knob bounds, shared by both recipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.prune_dlrm import PruneDLRMConfig, parse_args
from recipes.prune_dlrm import main as prune_main
from recipes.train_dlrm import OUTPUTS as TRAIN_OUTPUTS
from recipes.train_dlrm import TrainDLRMKnobs
from recipes.train_dlrm import main as train_main
from recipes.train_dlrm import parse_args as train_parse_args
from tests.unwritable import unwritable_folder

ROOT = Path(__file__).resolve().parents[2]
MARKER = ".recipe-run.json"  # recipes.cli.RUN_MARKER

# a train_dlrm run of a second or two
FAST_TRAIN = ["--steps", "6", "--batch-size", "64", "--eval-batches", "1",
              "--train-eval-batches", "1", "--no-progress"]  # fmt: skip


def _train(out: Path, **kw: object) -> TrainDLRMKnobs:
    base: dict[str, object] = dict(
        steps=6, batch_size=64, eval_batches=1, train_eval_batches=1, progress=False
    )
    return TrainDLRMKnobs(out=str(out), **(base | kw))  # type: ignore[arg-type]


def _prune(out: Path, **kw: object) -> PruneDLRMConfig:
    base: dict[str, object] = dict(
        batch_size=32, dense_steps=4, steps=12, eval_batches=2, schedule="oneshot",
        progress=False, speed_batch=0, serve_batches=0,
    )  # fmt: skip
    return PruneDLRMConfig(out=str(out), **(base | kw))  # type: ignore[arg-type]


def _run(module: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _usage_error(argv: list[str], parse, capsys) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _parse_train(argv: list[str]) -> TrainDLRMKnobs:
    return train_parse_args(argv)


# -- item 6: no silent overwrite ---------------------------------------------------------------
def test_a_second_train_dlrm_into_the_same_out_is_refused_and_the_first_run_is_kept(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    first = _run("recipes.train_dlrm", *FAST_TRAIN, "--out", str(out), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = _run("recipes.train_dlrm", *FAST_TRAIN, "--seed", "1", "--out", str(out), cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train_dlrm.py: error: --out {str(out)!r} is not empty (it holds ")
    assert "pass --overwrite to replace the run there, --resume to continue it" in last
    assert "Traceback" not in again.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_prune_dlrm_refuses_a_folder_with_an_earlier_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    (out / "serving").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    err = _usage_error(["--out", str(out)], parse_args, capsys)
    assert f"error: --out {str(out)!r} is not empty (it holds report.json, serving/)" in err
    assert "pass --overwrite to replace the run there, or choose another folder" in err
    assert (out / "report.json").read_text() == "{}"


def test_overwrite_clears_what_the_earlier_run_left(tmp_path: Path) -> None:
    """A run with --overwrite leaves no stale ``serving/`` or ``checkpoint/`` of the earlier
    one beside its results; the earlier run's folder is a recipe's (it holds the marker)."""
    out = tmp_path / "run"
    train_main(_train(out))
    assert (out / "checkpoint" / "state.json").is_file() and (out / MARKER).is_file()
    (out / ".checkpoint.tmp-host-1-0000aaaa").mkdir()  # as a killed save would leave
    report = prune_main(_prune(out, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MARKER, "report.json", "report.md", *report["plots"]]
    )
    assert json.loads((out / MARKER).read_text())["recipe"] == "prune_dlrm"


def test_overwrite_removes_links_and_never_follows_them(tmp_path: Path) -> None:
    """Only what is inside --out goes: a link to a folder outside is removed, its target kept."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"recipe": "train_dlrm", "outputs": [*TRAIN_OUTPUTS]}))
    (out / "checkpoint").symlink_to(outside, target_is_directory=True)
    (out / "config.json").mkdir()
    (out / "config.json" / "x").write_text("old")
    train_main(_train(out, overwrite=True, checkpoint=False))
    assert not (out / "checkpoint").exists() and (out / "config.json").is_file()
    assert (outside / "keep.txt").read_text() == "mine"
    assert (out / "results.json").is_file()


def test_overwrite_refuses_files_the_earlier_run_did_not_write_and_lists_them(
    tmp_path: Path, capsys
) -> None:
    """A user's notes (a file, a folder, a link) beside an earlier run's results: ``--overwrite``
    refuses naming each of them, before anything is removed; once they are moved away it
    replaces the run. A marker that does not say what its run wrote removes nothing."""
    out = tmp_path / "run"
    train_main(_train(out, checkpoint=False))
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.csv").write_text("1,2")
    (out / "ref").symlink_to(tmp_path)
    before = sorted(p.name for p in out.iterdir())
    err = _usage_error(["--out", str(out), "--overwrite"], parse_args, capsys)
    assert (
        f"--overwrite: --out {str(out)!r} holds 3 entries the earlier train_dlrm run did not "
        "write: data/, notes.txt, ref/; --overwrite removes only a run's own files" in err
    )
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "notes.txt").read_text() == "mine"
    for name in ("notes.txt", "data", "ref"):
        (out / name).rename(tmp_path / name)
    prune_main(_prune(out, overwrite=True))
    assert not (out / "results.json").exists() and (out / "report.json").is_file()
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({"recipe": marker["recipe"]}))  # no "outputs"
    err = _usage_error(["--out", str(out), "--overwrite"], _parse_train, capsys)
    assert "does not say which files the earlier run wrote" in err
    assert (out / "report.json").is_file()


def test_overwrite_refuses_a_folder_no_recipe_made(tmp_path: Path, capsys) -> None:
    """``--out <a repository> --overwrite`` must not empty it."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "README.md").write_text("precious")
    err = _usage_error(["--out", str(out), "--overwrite"], _parse_train, capsys)
    assert f"--out {str(out)!r} holds files no recipe run wrote (README.md)" in err
    assert (out / "README.md").read_text() == "precious"


def test_empty_or_new_out_and_the_default_folder_work(tmp_path: Path, monkeypatch) -> None:
    """An empty --out is used as it is; without --out every run gets a fresh folder, even
    two in the same second (``make demo`` twice)."""
    (tmp_path / "empty").mkdir()
    assert train_parse_args(["--out", str(tmp_path / "empty")]).out == str(tmp_path / "empty")
    monkeypatch.chdir(tmp_path)
    from recipes.cli import OutFolder

    folders = [OutFolder("prune_dlrm", None).open() for _ in range(3)]
    assert len(set(folders)) == 3
    assert all(f.parent == Path("runs") and f.name.startswith("prune_dlrm-") for f in folders)
    assert all(sorted(p.name for p in f.iterdir()) == [MARKER] for f in folders)


def test_resume_continues_the_run_in_out_exactly(tmp_path: Path) -> None:
    """``--resume`` continues ``<out>/checkpoint`` to --steps in all: the weights equal an
    uninterrupted run's."""
    from safetensors.torch import load_file

    train_main(_train(tmp_path / "a", steps=4))
    resumed = train_main(_train(tmp_path / "a", steps=8, resume=True))
    train_main(_train(tmp_path / "b", steps=8))
    assert resumed["steps"] == 8 and resumed["resumed_at"] == 4
    a = load_file(tmp_path / "a" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), k


def test_resume_with_other_knobs_or_nothing_to_resume_is_a_usage_error(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    train_main(_train(out, steps=4))
    common = ["--out", str(out), "--resume", "--batch-size", "64", "--train-eval-batches", "1"]
    ckpt = str(out / "checkpoint")
    for argv, msg in (
        (["--lr", "0.5"], f"--resume: {ckpt!r} was trained with --lr 0.02, not 0.5"),
        (["--steps", "2"], f"--resume: {ckpt!r} is at step 4, past --steps 2"),
        (["--overwrite"], "--overwrite and --resume exclude each other"),
    ):
        assert msg in _usage_error([*common, *argv], _parse_train, capsys), argv
    empty = tmp_path / "empty"
    err = _usage_error(["--out", str(empty), "--resume"], _parse_train, capsys)
    assert f"--resume: --out {str(empty)!r} holds no train_dlrm run to continue" in err


# -- item 9: --out that cannot be written ------------------------------------------------------
@pytest.mark.parametrize("parse", [_parse_train, parse_args], ids=["train_dlrm", "prune_dlrm"])
def test_out_that_is_a_file_under_a_file_or_unwritable_is_a_usage_error(
    tmp_path: Path, capsys, parse
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    locked = unwritable_folder(tmp_path) / "run"
    for out, msg in (
        (a_file, f"error: --out {str(a_file)!r} is a file; expected a folder"),
        (a_file / "run", f"error: --out {str(a_file / 'run')!r} is under {str(a_file)!r}, which is a file"),
        (locked, f"error: --out {str(locked)!r} cannot be written: "),
    ):  # fmt: skip
        assert msg in _usage_error(["--out", str(out)], parse, capsys), out
    assert a_file.read_text() == "x"


# -- item 9: absurd sizes ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--batch-size", str(10**9)], f"--batch-size must be an integer in [1, 1048576], got {10**9}"),
        (["--seed", str(2**64)], f"--seed must be an integer in [0, 4294967295], got {2**64}"),
        (["--threads", "100000"], "--threads must be an integer in [1, 512], got 100000"),
        (["--batch-size", "7" * 5000], f"invalid int value: '{'7' * 40}'... (5000 characters)"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("parse", [_parse_train, parse_args], ids=["train_dlrm", "prune_dlrm"])
def test_absurd_sizes_are_usage_errors_naming_the_flag(
    tmp_path: Path, capsys, parse, argv: list[str], msg: str
) -> None:
    out = tmp_path / "run"
    assert msg in _usage_error([*argv, "--out", str(out)], parse, capsys)
    assert not out.exists()


def test_help_documents_the_limits(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 256; in [1, 1048576])" in text  # --batch-size
    assert "(default: 1; in [1, 512])" in text  # --threads
    assert "(default: 0; in [0, 4294967295])" in text  # --seed
