"""The chain part of the prepared GPU check (``gpu_chains.py``) without a GPU: ``gpu_check.sh
--dry-run`` end to end, the row order and the time budget, the exit status without a device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cutlass_kernels import gpu_chains

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_runs_the_chains_end_to_end(tmp_path) -> None:
    """``gpu_check.sh --dry-run`` on the CPU: every chain block, sparsity and dtype built and
    verified exactly (GELU included) on the emulated backend, the JSON written."""
    out = tmp_path / "chains.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks/cutlass_kernels/gpu_check.sh"),
            "--dry-run",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(gpu_chains.BLOCKS) * len(gpu_chains.SPARSITIES) * 2
    assert {r["verify"] for r in rows} == {"equal"}
    assert {r["dtype"] for r in rows} == {"f16", "bf16"}
    assert [(r["block"], r["sparsity"], r["dtype"]) for r in rows[:4]] == list(gpu_chains.FIRST)


def test_plan_puts_the_acceptance_rows_first() -> None:
    todo = gpu_chains.plan(list(gpu_chains.BLOCKS), ["f16", "bf16"])
    assert todo[: len(gpu_chains.FIRST)] == list(gpu_chains.FIRST)
    assert sorted(todo) == sorted(
        (b, s, d) for b in gpu_chains.BLOCKS for s in gpu_chains.SPARSITIES for d in ("f16", "bf16")
    )
    assert gpu_chains.plan(["single_bert_base_fc1"], ["bf16"]) == [
        ("single_bert_base_fc1", s, "bf16") for s in gpu_chains.SPARSITIES
    ]


def test_budget_stops_starting_rows(tmp_path) -> None:
    out = tmp_path / "x.json"
    args = ["--dry-run", "--out", str(out), "--blocks", "dcnv2_bottom_mlp", "--dtype", "f16"]
    assert gpu_chains.main([*args, "--budget-s", "0"]) == 5  # nothing ran
    doc = json.loads(out.read_text())
    assert doc["rows"] == []
    assert doc["meta"]["skipped"] == [f"dcnv2_bottom_mlp/{s}/f16" for s in (75, 50, 90)]


def test_gpu_chains_without_a_device_exits_3(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_chains.main(["--out", str(tmp_path / "x.json")]) == 3
