"""A ``TWChain`` on the ``cutlass`` backend without a GPU (the device faked, the extension
emulating exactly the arguments it receives): instances bound once per call shape, one binding
call per layer, no host work beyond the two layout copies; and the CUDA-graph policy
(:mod:`tilesparse.kernels.graphs`) with a stand-in graph."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import cutlass_kernels.launch as launch
import tilesparse.chain as chain_mod
import tilesparse.kernels.graphs as graphs
from cutlass_kernels.manifest import Arch
from tests.cutlass_kernels.fake_device import EmulatingExt, fake_device
from tests.tilesparse.test_chain_overhead import OpCounter, mlp
from tilesparse import to_chain
from tilesparse.kernels.graphs import GraphAction, GraphRunner, decide


class FakeGraph:
    """A stand-in CUDA graph: capture keeps the callable (running nothing, as a capture does),
    replay runs it."""

    made = 0

    def __init__(self, device: Any = None, fail: bool = False) -> None:
        FakeGraph.made += 1
        self.recorded: Callable[[], None] | None = None
        self.fail = fail
        self.replays = 0

    def capture(self, launches: Callable[[], None]) -> None:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.recorded = launches

    def replay(self) -> None:
        assert self.recorded is not None
        self.replays += 1
        self.recorded()


E, C, R = GraphAction.EAGER, GraphAction.CAPTURE, GraphAction.REPLAY


@pytest.mark.parametrize(
    ("enabled", "on_cuda", "capturing", "failed", "eager_calls", "captured", "want"),
    [
        (False, True, False, False, 5, False, E),
        (True, False, False, False, 5, False, E),
        (True, True, True, False, 5, True, E),
        (True, True, False, True, 5, False, E),
        (True, True, False, False, 0, False, E),
        (True, True, False, False, 1, False, C),
        (True, True, False, False, 1, True, R),
    ],
)
def test_decide(enabled, on_cuda, capturing, failed, eager_calls, captured, want) -> None:
    got = decide(
        enabled=enabled,
        on_cuda=on_cuda,
        capturing=capturing,
        failed=failed,
        eager_calls=eager_calls,
        warmup=1,
        captured=captured,
    )
    assert got is want


def test_runner_warms_up_captures_replays_and_falls_back() -> None:
    runs: list[int] = []
    capturing = [False]
    runner = GraphRunner(
        lambda: runs.append(1),
        FakeGraph,
        enabled=True,
        on_cuda=True,
        warmup=2,
        is_capturing=lambda: capturing[0],
    )
    assert [runner() for _ in range(5)] == [E, E, C, R, R]
    assert len(runs) == 5 and runner.actions == [E, C, R]  # the capture ran nothing itself
    capturing[0] = True  # inside the caller's own capture: launch, so it records them
    assert runner() is E and len(runs) == 6
    failing = GraphRunner(
        lambda: runs.append(2),
        lambda: FakeGraph(fail=True),
        enabled=True,
        on_cuda=True,
        is_capturing=lambda: False,
    )
    assert [failing() for _ in range(3)] == [E, E, E]
    assert failing.failed is not None and "not permitted" in failing.failed
    assert runs.count(2) == 3
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphRunner(lambda: None, FakeGraph, enabled=True, on_cuda=True, warmup=0)


@pytest.fixture
def cutlass_on_cpu(monkeypatch) -> EmulatingExt:
    """The ``cutlass`` backend on CPU tensors: device faked (sm_90a, 132 SMs), the extension
    emulating, graphs replaced by :class:`FakeGraph`."""
    ext = fake_device(monkeypatch, Arch.SM90A)
    monkeypatch.setattr(chain_mod, "_on_kernel_device", lambda x: True)
    monkeypatch.setattr(graphs, "TorchCudaGraph", FakeGraph)
    return ext


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cutlass_chain_binds_once_and_equals_the_emulation(
    cutlass_on_cpu: EmulatingExt, monkeypatch, cuda_graph: bool
) -> None:
    binds: list[str] = []
    real_bind = launch.bind

    def counted_bind(*a: Any, **k: Any) -> launch.BoundLaunch:
        b = real_bind(*a, **k)
        binds.append(b.kernel.name)
        return b

    monkeypatch.setattr(launch, "bind", counted_bind)
    seq = mlp()  # ReLU, GELU, last layer without bias
    emulated = to_chain(seq, backend="emulated")
    chain = to_chain(seq, backend="cutlass", cuda_graph=cuda_graph)
    x = torch.randint(-1, 2, (13, 24)).half()
    counter = OpCounter()
    real_gemm = cutlass_on_cpu.tw_gemm

    def kernel(*a: Any, **k: Any) -> None:  # the kernel's own work is not counted
        counter.paused = True
        try:
            real_gemm(*a, **k)
        finally:
            counter.paused = False

    monkeypatch.setattr(cutlass_on_cpu, "tw_gemm", kernel)
    with torch.no_grad():
        want = emulated(x)
        assert torch.equal(chain(x), want)  # first call: packs, binds, eager
        with counter:
            outs = [chain(x) for _ in range(3)]
        assert all(torch.equal(y, want) for y in outs)
        assert len(binds) == 3 and len(cutlass_on_cpu.calls) == 3 * 4
        runner = chain._bufs.runner  # type: ignore[union-attr]
        assert runner is not None
        assert runner.actions == ([E, C, R] if cuda_graph else [E])
        assert counter.ops == Counter({"aten.copy_.default": 2 * 3, "aten.new_empty.default": 3})
        assert torch.equal(chain(x[:5]), emulated(x[:5]))  # a new shape: bound again
        assert len(binds) == 6
