"""What a ``TWChain`` call costs around its kernels: the tensor ops it dispatches outside the
kernel launches (counted with a ``TorchDispatchMode``; the emulated kernel's own arithmetic is
not counted, as the GPU kernel's would not be), host syncs, and how often the layouts are
validated."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import cutlass_kernels.packing as packing
import cutlass_kernels.reference as reference
from tests.tilesparse.test_chain import tw_layer
from tilesparse import TileSparseLinear, to_chain


class OpCounter(TorchDispatchMode):
    """Counts every non-view aten op (copies, allocations, fills, ``.item()``) while not
    paused."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused and not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpCounter]:
    """An :class:`OpCounter` that pauses inside ``reference.emulate`` (the kernel)."""
    counter = OpCounter()
    emulate = reference.emulate

    def kernel(*a: Any, **k: Any) -> torch.Tensor:
        counter.paused = True
        try:
            return emulate(*a, **k)
        finally:
            counter.paused = False

    monkeypatch.setattr(reference, "emulate", kernel)
    with counter:
        yield counter


def mlp(dtype: torch.dtype = torch.float16) -> nn.Sequential:
    gen = torch.Generator().manual_seed(11)
    return nn.Sequential(
        tw_layer(24, 40, 8, gen, dtype),
        nn.ReLU(),
        tw_layer(40, 32, 8, gen, dtype),
        nn.GELU(),
        tw_layer(32, 16, 8, gen, dtype, bias=False),
    ).eval()


def test_chain_call_makes_two_layout_copies_and_one_allocation(monkeypatch) -> None:
    """A warm chain call: one copy in (into the reused ``Xᵀ``), one allocation and one copy out;
    no copy, fill or allocation between layers, no ``.item()``."""
    chain = to_chain(mlp())
    x = torch.randint(-1, 2, (13, 24)).half()
    with torch.no_grad():
        first = chain(x)  # packs and allocates
        with counting(monkeypatch) as counter:
            for _ in range(3):
                y = chain(x)
    assert torch.equal(y, first)
    assert counter.ops == Counter({"aten.copy_.default": 2 * 3, "aten.new_empty.default": 1 * 3}), (
        counter.ops
    )


def test_counter_sees_the_per_layer_layout_copies(monkeypatch) -> None:
    """The same MLP through the single-layer emulated op (what ``tilesparse::tw_linear``
    runs): per layer it packs ``Xᵀ``, initialises ``Yᵀ`` and copies it back, so the counter
    sees several times the chain's copies and allocations."""
    seq = mlp()
    x = torch.randint(-1, 2, (13, 24)).half()

    def per_layer(h: torch.Tensor) -> torch.Tensor:
        for m in seq:
            if isinstance(m, TileSparseLinear):
                h = reference.tw_linear_emulated(h, m.layout, m.bias)
            else:
                h = m(h)
        return h

    with torch.no_grad():
        with counting(monkeypatch) as counter:
            per_layer(x)
    copies = sum(n for op, n in counter.ops.items() if "copy" in op or "clone" in op)
    allocs = sum(n for op, n in counter.ops.items() if "empty" in op or "zeros" in op)
    assert copies >= 3 * 2 and allocs >= 3 * 2, counter.ops


def test_layouts_validated_and_packed_once(monkeypatch) -> None:
    """``check_weight`` runs once per layer, not per call; again after an in-place edit."""
    calls: list[int] = []
    check = packing.check_weight

    def counted(weight: Any) -> None:
        calls.append(weight.in_features)
        check(weight)

    monkeypatch.setattr(packing, "check_weight", counted)
    chain = to_chain(mlp(torch.bfloat16))
    x = torch.randint(-1, 2, (9, 24)).bfloat16()
    with torch.no_grad():
        for _ in range(4):
            chain(x)
        assert calls == [24, 40, 32]
        chain(x[:5])  # a new batch size: new buffers, same packs
        assert calls == [24, 40, 32]
        chain.layers()[2].values.neg_()
        chain(x)
    assert calls == [24, 40, 32] * 2
