"""Gradients of ``tilesparse::tw_linear`` checked numerically (``torch.autograd.gradcheck``,
float64) on every backend that runs on the CPU, and double backward (``gradgradcheck``),
including the edge shapes: one row (M=1), every weight pruned, a tile without rows, 3-D x."""

from __future__ import annotations

import pytest
import torch

from tilesparse import ops
from tilesparse.format import TWLayout, condense
from tilesparse.kernels import cpu as cpu_kernels

BACKENDS = ["reference", "cpu", "emulated"]
f64 = torch.float64


@pytest.fixture
def backend(request, require) -> str:
    if request.param == "cpu":
        require(cpu_kernels.load_extension() is not None, "the compiled tilesparse CPU kernel")
    return request.param


def _layout(K: int, N: int, G: int, keep: float, seed: int) -> TWLayout:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(K, N, generator=gen) < keep
    mask[:, N // 2] = False  # one pruned column at least
    return condense(torch.randn(K, N, generator=gen, dtype=f64), mask, G)


def _empty_tile_layout() -> TWLayout:
    """K=5, N=6: tiles {0,1} rows {1,3}; {2,3} no rows; {5} row {0}. Column 4 pruned."""
    return TWLayout(
        5,
        6,
        2,
        col_idx=torch.tensor([0, 1, 2, 3, 5]),
        tile_ptr=torch.tensor([0, 2, 4, 5]),
        row_idx=torch.tensor([1, 3, 0]),
        row_ptr=torch.tensor([0, 2, 2, 3]),
        values=torch.randn(5, dtype=f64, generator=torch.Generator().manual_seed(1)),
        val_ptr=torch.tensor([0, 4, 4, 5]),
    )


CASES = {  # name: (layout, x shape)
    "random": (lambda: _layout(13, 11, 4, 0.5, 0), (3, 13)),
    "one_row": (lambda: _layout(13, 11, 4, 0.5, 1), (1, 13)),
    "all_pruned": (
        lambda: condense(torch.randn(7, 5, dtype=f64), torch.zeros(7, 5, dtype=torch.bool), 4),
        (2, 7),
    ),
    "empty_tile": (_empty_tile_layout, (4, 5)),
    "three_d": (lambda: _layout(9, 10, 3, 0.6, 2), (2, 3, 9)),
}


def _inputs(case: str, seed: int = 0) -> tuple[TWLayout, torch.Tensor, torch.Tensor]:
    make, shape = CASES[case]
    lay = make()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=f64, requires_grad=True)
    b = torch.randn(lay.out_features, generator=gen, dtype=f64, requires_grad=True)
    return lay, x, b


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck(backend, case) -> None:
    lay, x, b = _inputs(case)
    assert torch.autograd.gradcheck(lambda x, b: ops.tw_linear(x, lay, b, backend), (x, b))
    assert torch.autograd.gradcheck(lambda x: ops.tw_linear(x, lay, None, backend), (x,))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("case", ["random", "one_row", "all_pruned", "empty_tile"])
def test_gradgradcheck(backend, case) -> None:
    lay, x, b = _inputs(case, seed=1)
    assert torch.autograd.gradgradcheck(lambda x, b: ops.tw_linear(x, lay, b, backend), (x, b))


def test_gradient_penalty_matches_dense() -> None:
    """A use of double backward: ``‖∂L/∂x‖²`` differentiated again, against the dense layer."""
    lay, x, b = _inputs("random", seed=2)
    w = lay.to_dense()

    def penalty(f):
        xx = x.detach().clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(xx).square().sum(), xx, create_graph=True)
        (g2,) = torch.autograd.grad(gx.square().sum(), xx)
        return g2

    sparse = penalty(lambda xx: ops.tw_linear(xx, lay, b.detach(), "cpu"))
    dense = penalty(lambda xx: xx @ w + b.detach())
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)


def test_opcheck_of_the_gradient_op() -> None:
    lay, x, _ = _inputs("random", seed=3)
    gy = torch.randn(3, lay.out_features, dtype=f64)
    args = (
        gy,
        lay.col_idx,
        lay.tile_ptr,
        lay.row_idx,
        lay.row_ptr,
        lay.values,
        lay.val_ptr,
        lay.in_features,
    )
    torch.library.opcheck(torch.ops.tilesparse.tw_linear_grad_x, args)
    torch.library.opcheck(torch.ops.tilesparse.tw_linear_grad_x, (gy.requires_grad_(), *args[1:]))
