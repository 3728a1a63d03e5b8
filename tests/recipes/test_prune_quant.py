"""recipes.prune_quant: the compressed-tables half of prune_dlrm (sizes exact, AUC changes
against the same model with fp32 tables, the plan within its budget)."""

from __future__ import annotations

import copy

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models import build_model, get_workload
from embark.quant import evaluate_auc, model_size
from recipes.prune_quant import quant_report, quant_section, quant_summary


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quant_report_sizes_and_changes():
    w = get_workload("tiny")
    data = SyntheticCTR(w, batch_size=64)
    dense = build_model(w, seed=0)
    pruned = copy.deepcopy(dense)
    with torch.no_grad():
        pruned.top_mlp[0].weight[:, ::2] = 0  # another dense part, the same tables
    test = list(data.batches(2, split="eval"))
    val = list(data.batches(2, split="eval", start=2))
    q = quant_report(dense, pruned, "tw 75%", test, val, budget_fraction=0.25)
    v = q["variants"]
    assert list(v) == [
        "dense", "dense + int8", "tw 75%", "tw 75% + int8", "tw 75% + int4", "tw 75% + plan"
    ]  # fmt: skip
    rows = sum(t.num_rows for t in w.tables)  # every table 16 wide
    assert v["dense"]["size"]["tables"] == rows * 64
    assert v["dense + int8"]["size"]["tables"] == rows * 20
    assert v["tw 75% + int4"]["size"]["tables"] == rows * 12
    assert v["tw 75% + plan"]["size"]["tables"] <= q["budget_bytes"] == rows * 64 // 4
    dense_bytes = model_size(dense).dense
    for row in v.values():
        assert row["size"]["dense"] == dense_bytes
        assert row["size"]["total"] == row["size"]["tables"] + dense_bytes
        assert row["compression"] == pytest.approx(
            v["dense"]["size"]["total"] / row["size"]["total"]
        )
    assert v["dense"]["auc"] == evaluate_auc(dense, test)
    assert v["tw 75%"]["auc"] == evaluate_auc(pruned, test)
    assert v["tw 75% + int8"]["auc_change"] == pytest.approx(
        v["tw 75% + int8"]["auc"] - v["tw 75%"]["auc"]
    )
    assert v["dense + int8"]["auc_change"] == pytest.approx(
        v["dense + int8"]["auc"] - v["dense"]["auc"]
    )
    md = quant_section(q)
    assert "## Compressed tables" in md and "| tw 75% + plan |" in md and "| **all** |" in md
    assert "tw 75% + int4" in quant_summary(q)
