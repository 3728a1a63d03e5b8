"""The compression planner: budgets respected, its figures equal to an independent evaluation
of the planned model, the AUC-loss target held by the measured plan."""

from __future__ import annotations

import copy

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.quant import RowDtype, plan_compression, quantize_embeddings_, table_bytes
from embark.training.config import TrainConfig
from embark.training.metrics import auc
from embark.training.trainer import Trainer


@pytest.fixture(scope="module")
def trained():
    w = get_workload("tiny")
    data = SyntheticCTR(w, batch_size=128, seed=1)
    model = build_model(w, seed=1)
    Trainer(model, TrainConfig(lr=0.05)).fit(data.batches(40), 40, progress=False)
    return model, list(data.batches(4, split="eval"))


def _auc(model, batches) -> float:
    with torch.no_grad():
        logits = torch.cat([model(b.dense, b.sparse) for b in batches])
    return auc(logits, torch.cat([b.labels for b in batches]))


def test_budget_is_met_and_the_plan_is_what_it_reports(trained):
    model, val = trained
    fp32 = sum(table_bytes(model).values())
    plan = plan_compression(model, val, budget_bytes=fp32 // 4)
    assert plan.table_bytes <= fp32 // 4 < plan.fp32_bytes == fp32
    assert {c.dtype for c in plan.choices} <= {
        RowDtype.INT4,
        RowDtype.INT8,
        RowDtype.FP16,
        RowDtype.FP32,
    }
    assert all(c.auc_change == c.sensitivity.get(c.dtype, 0.0) for c in plan.choices)
    q = quantize_embeddings_(copy.deepcopy(model), plan.config())
    assert sum(table_bytes(q).values()) == plan.table_bytes
    assert _auc(q, val) == pytest.approx(plan.planned_auc, abs=1e-12)
    assert _auc(model, val) == pytest.approx(plan.base_auc, abs=1e-12)
    assert "| **all** |" in plan.markdown() and plan.to_dict()["table_bytes"] == plan.table_bytes


def test_budget_edges(trained):
    model, val = trained
    fp32 = table_bytes(model)
    keep = plan_compression(model, val, budget_bytes=sum(fp32.values()))
    assert all(c.dtype is RowDtype.FP32 for c in keep.choices)
    assert keep.planned_auc == keep.base_auc
    int4 = sum(b * 12 // 64 for b in fp32.values())  # 16 fp32 (64 B) → 8 + 4 bytes
    tight = plan_compression(model, val, budget_bytes=int4)
    assert all(c.dtype is RowDtype.INT4 for c in tight.choices)
    with pytest.raises(ValueError, match=f"at least {int4} bytes .* budget of {int4 - 1} bytes"):
        plan_compression(model, val, budget_bytes=int4 - 1)


def test_max_auc_loss_holds_when_measured(trained):
    model, val = trained
    plan = plan_compression(model, val, max_auc_loss=0.0)
    assert plan.base_auc - plan.planned_auc <= 0.0
    loose = plan_compression(model, val, max_auc_loss=1.0)
    assert all(c.dtype is RowDtype.INT4 for c in loose.choices)


def test_bad_targets(trained):
    model, val = trained
    with pytest.raises(ValueError, match="exactly one of budget_bytes and max_auc_loss"):
        plan_compression(model, val)
    with pytest.raises(ValueError, match="exactly one"):
        plan_compression(model, val, budget_bytes=1, max_auc_loss=0.1)
    with pytest.raises(ValueError, match="targets must be >= 0"):
        plan_compression(model, val, max_auc_loss=-0.1)
