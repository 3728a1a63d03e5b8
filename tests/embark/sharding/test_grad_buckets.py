"""Gradient buckets: which parameters share a bucket, and that arming, backward and finish
leave every gradient as plain backward does (a one-rank world: the all-reduce is the
identity; the multi-rank sums are checked by test_sharded_training against one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embark.sharding.grad_buckets import GradBuckets, bucket_indices


def test_large_parameters_are_buckets_alone_small_ones_share() -> None:
    # bytes 8, 8, 120, 8: the 120-byte one is over half of an 80-byte bucket
    assert bucket_indices([2, 2, 30, 2], 80) == [[2], [3, 1, 0]]
    # small ones fill a bucket up to its size, then start the next where it filled up
    assert bucket_indices([4, 4, 4, 4, 4], 40) == [[4, 3], [2, 1], [0]]
    # a shared bucket not filled up goes last, after the large ones walked past it
    assert bucket_indices([10, 1, 10], 80) == [[2], [0], [1]]
    assert bucket_indices([], 80) == []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 40), nn.ReLU(), nn.Linear(40, 30), nn.Linear(30, 1))


@pytest.mark.parametrize("overlap", [True, False])
def test_finish_leaves_the_gradients_of_plain_backward(overlap: bool) -> None:
    ref, model = _model(), _model()
    unused = nn.Parameter(torch.ones(3))  # never in the graph: gets zeros
    x = torch.randn(8, 6)
    ref(x).square().sum().backward()
    buckets = GradBuckets([*model.parameters(), unused], None, overlap, bucket_bytes=600)
    assert len(buckets.buckets) > 2  # several buckets, large and small
    for _ in range(2):  # the second step reuses the buffers
        for p in model.parameters():
            p.grad = None
        buckets.arm()
        model(x).square().sum().backward()
        buckets.finish()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert unused.grad is not None and torch.equal(unused.grad, torch.zeros(3))


def test_parameters_without_gradients_are_left_out() -> None:
    frozen = nn.Parameter(torch.ones(4), requires_grad=False)
    live = nn.Parameter(torch.ones(4))
    assert GradBuckets([frozen, live], None).params == [live]
