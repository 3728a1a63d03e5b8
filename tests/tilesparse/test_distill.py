"""distill_: a pruned student moves toward its dense teacher without labels; pruned weights
stay exactly zero; bad budgets and losses are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tilesparse
from tilesparse.distill import distill_loss


def _setup() -> tuple[nn.Sequential, nn.Sequential, tilesparse.TileSparsePruner, list]:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    student = copy.deepcopy(teacher)
    pruner = tilesparse.prune_(student, tilesparse.TileSparseConfig(sparsity=0.75, tile=8))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 16, generator=g),) for _ in range(4)]
    return teacher, student, pruner, batches


def _gap(student: nn.Module, teacher: nn.Module, batches: list) -> float:
    with torch.no_grad():
        return float(sum(nn.functional.mse_loss(student(*b), teacher(*b)) for b in batches))


def test_distillation_closes_the_gap_and_keeps_the_mask() -> None:
    teacher, student, pruner, batches = _setup()
    masks = pruner.masks()
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    before = _gap(student, teacher, batches)
    report = tilesparse.distill_(student, teacher, batches, pruner, steps=100, lr=3e-2)
    assert report.steps == 100 and len(report.losses) == 100
    assert _gap(student, teacher, batches) < 0.9 * before  # 75 % sparse: 0.194 -> 0.162
    for fqn, mask in masks.items():
        assert torch.equal(pruner.mask(fqn), mask)
        assert torch.equal(student.get_submodule(fqn).weight.detach().T != 0, mask)
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in teacher_state.items())


def test_kl_loss_matches_its_definition() -> None:
    s, t = torch.randn(5, 7), torch.randn(5, 7)
    p_t = torch.softmax(t / 2, -1)
    want = (p_t * (p_t.log() - torch.log_softmax(s / 2, -1))).sum(-1).mean() * 4
    torch.testing.assert_close(distill_loss(s, t, "kl", temperature=2.0), want)
    torch.testing.assert_close(distill_loss(s, t, "mse"), ((s - t) ** 2).mean())


def test_bad_input() -> None:
    teacher, student, pruner, batches = _setup()
    with pytest.raises(ValueError, match="needs a budget"):
        tilesparse.distill_(student, teacher, batches, pruner)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        tilesparse.distill_(student, teacher, batches, pruner, steps=0)
    with pytest.raises(ValueError, match="got no batches"):
        tilesparse.distill_(student, teacher, [], pruner, steps=1)
    with pytest.raises(ValueError, match="prepared on student"):
        tilesparse.distill_(teacher, teacher, batches, pruner, steps=1)
    with pytest.raises(ValueError, match=r"student outputs \(2, 3\) and teacher outputs \(2, 4\)"):
        distill_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    nan = [(torch.full((4, 16), float("nan")),)]
    with pytest.raises(ValueError, match="loss is nan at step 0"):
        tilesparse.distill_(student, teacher, nan, pruner, steps=1)


def test_the_student_runs_without_dropout_unless_asked() -> None:
    # with the student in eval mode, the first step's loss is the deterministic gap (dropout
    # p=0.5 between the layers would change it); train_mode=True turns dropout on
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8))
    batches = [(torch.randn(32, 16, generator=torch.Generator().manual_seed(1)),)]
    losses = {}
    for train_mode in (False, True):
        student = copy.deepcopy(teacher)
        pruner = tilesparse.prune_(student, tilesparse.TileSparseConfig(sparsity=0.75, tile=8))
        want = _gap(student.eval(), teacher.eval(), batches)
        report = tilesparse.distill_(
            student, teacher, batches, pruner, steps=1, lr=1e-9, train_mode=train_mode
        )
        losses[train_mode] = (report.losses[0], want)
        assert not student.training
    assert losses[False][0] == pytest.approx(losses[False][1], rel=1e-6)
    assert losses[True][0] != pytest.approx(losses[True][1], rel=1e-3)
