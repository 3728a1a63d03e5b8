from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embark.training.metrics import auc, log_loss


def _pairwise_auc(scores, labels) -> float:
    """Brute force: over all (positive, negative) pairs, 1 if the positive scores higher,
    1/2 on a tie."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_hand_computed_with_ties():
    # positives score 0.8, 0.4, 0.4; negatives 0.4, 0.1.
    # pairs (p, n): (.8,.4)=1 (.8,.1)=1 (.4,.4)=1/2 (.4,.1)=1 (.4,.4)=1/2 (.4,.1)=1 -> 5/6
    scores = torch.tensor([0.8, 0.4, 0.4, 0.4, 0.1])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    assert auc(scores, labels) == pytest.approx(5 / 6, abs=1e-15)


def test_auc_extremes_and_invariance():
    y = np.array([0, 0, 1, 1])
    assert auc([0.1, 0.2, 0.3, 0.4], y) == 1.0
    assert auc([0.4, 0.3, 0.2, 0.1], y) == 0.0
    assert auc([0.5, 0.5, 0.5, 0.5], y) == 0.5
    s = np.array([0.3, -1.0, 2.0, 0.7])
    # only the order matters: a monotone transform (logit -> probability) keeps the AUC
    assert auc(s, y) == auc(1 / (1 + np.exp(-s)), y)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 1)), min_size=2, max_size=40).filter(
        lambda xs: len({y for _, y in xs}) == 2
    )
)
def test_auc_matches_pairwise_count(pairs):
    scores = [float(s) for s, _ in pairs]  # small integer range: many ties
    labels = [y for _, y in pairs]
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)


def test_auc_errors():
    with pytest.raises(ValueError, match="both classes"):
        auc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1, got 2.0"):
        auc([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="3 entries but labels has 2"):
        auc([0.1, 0.2, 0.3], [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        auc([float("nan"), 0.2], [0, 1])


def test_log_loss_hand_computed_and_logits():
    p = torch.tensor([0.9, 0.2, 0.5], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0])
    want = -(math.log(0.9) + math.log(0.8) + math.log(0.5)) / 3
    assert log_loss(p, y) == pytest.approx(want, rel=1e-12)
    pd = p.double()
    logits = torch.log(pd / (1 - pd))
    assert log_loss(logits, y, from_logits=True) == pytest.approx(want, rel=1e-9)
    # auto-detection: values outside [0, 1] are logits
    big = torch.tensor([30.0, -30.0])
    assert log_loss(big, torch.tensor([1.0, 0.0])) == pytest.approx(math.exp(-30), rel=1e-6)
    # matches torch's reference implementation
    x = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    t = torch.rand(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) < 0.4
    ref = torch.nn.functional.binary_cross_entropy_with_logits(x, t.double()).item()
    assert log_loss(x, t.double(), from_logits=True) == pytest.approx(ref, rel=1e-12)


def test_log_loss_errors():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss([1.5, 0.2], [1, 0], from_logits=False)
    with pytest.raises(ValueError, match="empty"):
        log_loss([], [])
