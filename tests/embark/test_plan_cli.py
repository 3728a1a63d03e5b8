"""``python -m embark.plan``: stats table on stdout, JSON with the promised fields."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from embark.plan import main
from embark.types import ShardingPlan


def test_cli_writes_json_fields(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "--workload",
            "t200",
            "--topology",
            "dgx-h100",
            "--nodes",
            "2",
            "--batch-size",
            "16384",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in (
        "plan",
        "simulated_step_ms",
        "per_gpu",
        "baselines",
        "top_tables",
        "imbalance",
        "phases_ms",
    ):
        assert key in doc, key
    assert set(doc["baselines"]) >= {"trw", "rw", "tw"}
    assert len(doc["per_gpu"]) == 16 and doc["world_size"] == 16
    assert {"memory_gb", "lookup_ms", "comm_ms", "num_tables", "num_shards"} <= set(
        doc["per_gpu"][0]
    )
    assert len(doc["top_tables"]) == 5
    assert doc["simulated_step_ms"] <= doc["baselines"]["trw"]
    plan = ShardingPlan.from_dict(doc["plan"])
    assert plan.world_size == 16 and len(plan.tables) == 200
    text = capsys.readouterr().out
    assert "imbalance" in text and "costliest tables" in text and "baselines: trw" in text
    assert len([ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "15 "))]) >= 2


@pytest.mark.parametrize("strategy", ["trw", "tw", "rw"])
def test_cli_baseline_strategies(tmp_path, strategy):
    out = tmp_path / f"{strategy}.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--topology",
                "cpu-local",
                "--batch-size",
                "256",
                "--strategy",
                strategy,
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["simulated_step_ms"] == pytest.approx(doc["baselines"][strategy])


def test_cli_plan_file_round_trip_and_errors(tmp_path):
    first = tmp_path / "a.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--nodes",
                "1",
                "--batch-size",
                "1024",
                "--quiet",
                "--out",
                str(first),
            ]
        )
        == 0
    )
    doc = json.loads(first.read_text())
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(doc["plan"]))
    second = tmp_path / "b.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--batch-size",
                "1024",
                "--strategy",
                str(plan_file),
                "--quiet",
                "--out",
                str(second),
            ]
        )
        == 0
    )
    again = json.loads(second.read_text())
    assert again["plan"] == doc["plan"]
    assert again["simulated_step_ms"] == pytest.approx(doc["simulated_step_ms"])
    bad = dict(doc["plan"], tables=doc["plan"]["tables"][1:])
    plan_file.write_text(json.dumps(bad))
    third = tmp_path / "c.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--batch-size",
                "1024",
                "--strategy",
                str(plan_file),
                "--quiet",
                "--out",
                str(third),
            ]
        )
        == 2
    )
    assert not third.exists()


def test_cli_as_module():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "embark.plan",
            "--workload",
            "tiny",
            "--topology",
            "cpu-local",
            "--batch-size",
            "64",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "step" in r.stdout and "rank" in r.stdout.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "argument --nodes: expected an integer >= 1, got 0"),
        (["--nodes", "two"], "argument --nodes: expected an integer >= 1, got 'two'"),
        (["--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
        (["--rounds", "-5"], "argument --rounds: expected an integer >= 0, got -5"),
    ],
)
def test_cli_rejects_bad_numbers_as_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "tiny", "--quiet", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "embark.plan", "--workload", "tiny", "--quiet", *argv],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "4"], "error: batch_size must be an integer >= world_size 8, got 4"),
        (
            ["--topology", "cpu-local", "--nodes", "2"],
            "error: cpu-local is one machine; nodes must be 1, got 2",
        ),
    ],
)
def test_cli_bad_combinations_exit_2_without_traceback(argv, message):
    r = _run_cli(*argv)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_constraints_on_an_unknown_table_exit_2(tmp_path):
    cons = tmp_path / "c.json"
    cons.write_text(json.dumps({"t99": {"ranks": [0]}}))
    r = _run_cli("--constraints", str(cons))
    assert r.returncode == 2, r.stderr
    assert "constraints name table 't99', which is not in workload 'tiny'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("world", ["8", 8.0, True])
def test_cli_plan_file_with_a_non_integer_world_size(tmp_path, world, caplog):
    plan_file = tmp_path / "p.json"
    plan_file.write_text(json.dumps({"world_size": world, "tables": []}))
    assert main(["--workload", "tiny", "--strategy", str(plan_file), "--quiet"]) == 2
    assert f"plan: world_size must be a positive integer, got {world!r}" in caplog.text


def test_cli_rounds_zero_is_allowed(tmp_path):
    out = tmp_path / "r0.json"
    assert (
        main(
            [
                "--workload",
                "tiny",
                "--topology",
                "cpu-local",
                "--batch-size",
                "64",
                "--rounds",
                "0",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["simulated_step_ms"] > 0
