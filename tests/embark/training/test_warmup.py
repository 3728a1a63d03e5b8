"""The trainer's linear learning-rate warm-up (``TrainConfig.warmup_steps``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer

LR = 0.05


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=64, seed=5)


def _trainer(data: SyntheticCTR, **cfg) -> Trainer:
    return Trainer(build_model(data.workload, seed=1), TrainConfig(**cfg))


def _assert_same_weights(a: Trainer, b: Trainer) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_warmup_steps_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match=rf"TrainConfig\.warmup_steps .*got {bad!r}"):
        TrainConfig(warmup_steps=bad)


def test_lr_scale_ramps_linearly_then_stays_at_one():
    cfg = TrainConfig(warmup_steps=4)
    assert [cfg.lr_scale(k) for k in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [TrainConfig().lr_scale(k) for k in (1, 2, 1000)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kernel", ["reference", "fbgemm"])
def test_a_warm_step_is_a_step_at_the_scaled_lr(data, kernel):
    """Step 1 of a 4-step warm-up moves the dense part and the tables exactly as a step at
    lr / 4 (the tables' kernel is built at the full lr before the warm-up lowers it), and the
    learning rates read k / 4 of lr after step k, then lr."""
    warm = _trainer(data, lr=LR, warmup_steps=4, embedding_kernel=kernel)
    slow = _trainer(data, lr=LR / 4, embedding_kernel=kernel)
    batches = list(data.batches(6))
    warm.train_step(batches[0])
    slow.train_step(batches[0])
    _assert_same_weights(warm, slow)
    assert warm.embedding_updates is not None
    for k, batch in enumerate(batches, start=1):
        if k > 1:
            warm.train_step(batch)
        expected = LR * min(k, 4) / 4
        assert [g["lr"] for g in warm.optimizer.param_groups] == [expected]
        assert warm.embedding_updates.optimizer.lr == expected
        assert {u.optimizer.lr for u in warm.embedding_updates.updates.values()} == {expected}


def test_the_embedding_lr_warms_up_from_its_own_base(data):
    t = _trainer(data, lr=LR, embedding_lr=0.2, warmup_steps=2)
    t.train_step(next(iter(data.batches(1))))
    assert t.optimizer.param_groups[0]["lr"] == LR / 2
    assert t.embedding_updates is not None and t.embedding_updates.optimizer.lr == 0.1


def test_resume_inside_the_warm_up_equals_uninterrupted(data, tmp_path):
    full = _trainer(data, lr=LR, warmup_steps=6)
    full.fit(data.batches(9), 9, progress=False)
    first = _trainer(data, lr=LR, warmup_steps=6)
    first.fit(data.batches(3), 3, progress=False)
    first.save_checkpoint(tmp_path / "ck")
    resumed = Trainer.load_checkpoint(tmp_path / "ck")
    assert resumed.cfg.warmup_steps == 6
    resumed.fit(data.batches(6, start=3), 6, progress=False)
    _assert_same_weights(full, resumed)
