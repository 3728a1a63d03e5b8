"""``python -m embark.sharded_train``: a real ``torchrun`` launch of 2 gloo ranks, the
one-rank planner path in process, and a plan for the wrong world size on 2 launched ranks
(:func:`gloo_world.launch_ranks`: every rank must exit 2, which torchrun's agent would race)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from embark.sharded_train import ShardedTrainKnobs, main
from embark.types import ShardingPlan
from knobs import flag
from tests.embark.gloo_world import ROOT, free_port, launch_ranks
from tests.embark.sharding.plans import tiny_plan


def test_torchrun_two_ranks_with_a_plan_file(tmp_path: Path) -> None:
    """A hand plan (TW, RW, CW, TRW, DP) in `embark.plan --out`'s document form; rank 0 prints
    the loss and the eval AUC and writes the results."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"workload": "tiny", "plan": tiny_plan(2)}))
    out = tmp_path / "results.json"
    cmd = [
        # a static rendezvous on a free port: --standalone's c10d rendezvous adds ~6 s here
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "embark.sharded_train",
        "--workload",
        "tiny",
        "--steps",
        "4",
        "--batch-size",
        "64",
        "--eval-batches",
        "1",
        "--log-every",
        "2",
        "--plan",
        str(plan),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("sharded_train [tiny, world 2, 4 steps × 64]") == 1  # rank 0 only
    assert [line.split()[1] for line in p.stdout.splitlines() if line.startswith("step")] == [
        "2",
        "4",
    ]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["steps"] == 4
    assert ShardingPlan.from_dict(res["plan"]) == ShardingPlan.from_dict(tiny_plan(2))
    assert 0.0 <= res["eval_auc"] <= 1.0 and math.isfinite(res["final_loss"])


def test_one_rank_with_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["--steps", "2", "--batch-size", "32", "--eval-batches", "1", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["world_size"] == 1 and res["plan"]["world_size"] == 1 and res["steps"] == 2
    assert "eval AUC" in capsys.readouterr().out


@pytest.mark.parametrize("scale", ["0.5", "nan", "-3", "inf", "x"])
def test_a_bad_scale_is_a_usage_error(scale: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--scale", scale, "--steps", "0"])
    assert e.value.code == 2
    assert "argument --scale: expected a" in capsys.readouterr().err


def test_plan_for_another_world_size_exits_2_on_every_rank(tmp_path: Path) -> None:
    plan = tmp_path / "plan4.json"
    plan.write_text(json.dumps(tiny_plan(4)))
    ranks = launch_ranks(2, ["-m", "embark.sharded_train", "--steps", "1", "--plan", str(plan)])
    assert [p.returncode for p in ranks] == [2, 2], [p.stderr[-2000:] for p in ranks]
    msg = ranks[0].stderr
    assert f"--plan {str(plan)!r} is for world size 4 but this run has 2 rank(s)" in msg, msg
    assert "torchrun --nproc-per-node 4" in msg
    assert "Traceback" not in ranks[1].stderr, ranks[1].stderr


def test_help_lists_every_knob_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` (no torchrun) shows one option per field of :class:`ShardedTrainKnobs`, in
    order, each with the field's default."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    fields = dataclasses.fields(ShardedTrainKnobs)
    starts = [text.index("options:")]
    for f in fields:  # each option's entry, in field order
        m = re.compile(rf"(?<= ){re.escape(flag(f.name))}(?=[ ,])").search(text, starts[-1])
        assert m is not None, f"{flag(f.name)} missing from --help"
        starts.append(m.start())
    for f, a, b in zip(fields, starts[1:], [*starts[2:], len(text)], strict=True):
        assert f"(default: {f.default})" in text[a:b], text[a:b]
