"""Gradient buckets: which parameters share a bucket, and that arming, backward and finish
leave every gradient as plain backward does (a one-rank world: the all-reduce is the
identity; the multi-rank sums are checked by test_sharded_training against one process)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, cast

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


def _bucket_threads() -> list[threading.Thread]:
    """The live worker threads of gradient buckets, once the ended ones had time to end."""
    deadline = time.monotonic() + 10.0
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("grad-buckets")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


class _Reducer:
    """A stand-in for the hierarchical all-reduce run on the worker thread: call ``fail_at``
    raises (a peer died), the others count."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, flat: torch.Tensor) -> None:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("peer died")


def test_a_failed_bucket_skips_the_queued_ones_and_leaves_no_thread() -> None:
    model = _model()
    reducer = _Reducer(fail_at=0)
    buckets = GradBuckets(list(model.parameters()), None, True, 600, hierarchical=reducer)
    assert len(buckets.buckets) > 2
    buckets.arm()
    model(torch.randn(8, 6)).square().sum().backward()
    with pytest.raises(RuntimeError, match="peer died"):
        buckets.finish()
    # the buckets behind the failed one issued no collective (each would wait for the gloo
    # timeout), and the worker thread ended
    assert reducer.calls == 1
    assert _bucket_threads() == []
    # the next steps run on a new worker, one thread kept from step to step
    reducer.fail_at = None
    threads = []
    for _ in range(2):
        buckets.arm()
        model(torch.randn(8, 6)).square().sum().backward()
        buckets.finish()
        threads.append([t for t in threading.enumerate() if t.name == "grad-buckets"])
    assert reducer.calls == 1 + 2 * len(buckets.buckets)
    assert len(threads[0]) == 1 and threads[1] == threads[0]
    buckets.close()
    assert _bucket_threads() == []


def test_a_failed_backward_drops_the_step_and_leaves_no_thread() -> None:
    from embark.sharding.model import ShardedSync

    started: list[int] = []

    class Boom(torch.autograd.Function):  # raises in backward, after the top layers' buckets
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            started.append(buckets.started)
            raise RuntimeError("backward failed")

    model = _model()
    reducer = _Reducer(fail_at=None)
    buckets = GradBuckets(list(model.parameters()), None, True, 600, hierarchical=reducer)
    stub = SimpleNamespace(gradient_buckets=lambda: buckets, phase_clock=None)
    sync = ShardedSync(cast(Any, stub))
    loss = model[2:](Boom.apply(model[:2](torch.randn(8, 6)))).square().sum()
    with pytest.raises(RuntimeError, match="backward failed"):
        sync.backward(loss)
    assert started[0] >= 1  # a bucket had started inside the failed backward
    assert _bucket_threads() == []
    assert buckets.started == 0 and buckets._hooks == []
    # the next step is not blocked by the dropped one and sums every bucket
    calls = reducer.calls
    buckets.arm()
    model(torch.randn(8, 6)).square().sum().backward()
    buckets.finish()
    assert reducer.calls == calls + len(buckets.buckets)
    buckets.close()
