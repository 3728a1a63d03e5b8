"""tilesparse.ops: what the op refuses before a kernel runs — layouts whose offsets or
indices would send the C++ kernel out of bounds or write a column twice, and a bias of another
dtype. Every backend that reads the data (cpu, reference, emulated) goes through the same
checks (``tilesparse.kernels.schema.check_op_inputs``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tilesparse import ops
from tilesparse.format import TWLayout, condense, reference_matmul

BACKENDS = ["cpu", "reference", "emulated"]
i64 = torch.int64


def drawn_layout() -> TWLayout:
    """The layout drawn in tilesparse/format.py (K=4, N=6, G=2): tiles {0,1} {4} {5}."""
    return TWLayout(
        in_features=4,
        out_features=6,
        tile=2,
        col_idx=torch.tensor([0, 1, 4, 5]),
        tile_ptr=torch.tensor([0, 2, 3, 4]),
        row_idx=torch.tensor([0, 2, 3, 0, 1, 1, 2]),
        row_ptr=torch.tensor([0, 3, 5, 7]),
        val_ptr=torch.tensor([0, 6, 8, 10]),
        values=torch.arange(1.0, 11.0),
    )


# (name, field, new value, expected message): each keeps the lengths _check_args looks at
CORRUPTIONS = [
    ("tile_ptr_from_1", "tile_ptr", [1, 2, 3, 4], r"tile_ptr must start at 0, got tile_ptr\[0\]=1"),
    (
        "row_ptr_down",
        "row_ptr",
        [0, 5, 3, 7],
        r"row_ptr must never decrease, got row_ptr\[2\]=3 < row_ptr\[1\]=5",
    ),
    (
        "val_ptr_down",
        "val_ptr",
        [0, 6, 4, 10],
        r"val_ptr must never decrease, got val_ptr\[2\]=4 < val_ptr\[1\]=6",
    ),
    (
        "val_ptr_negative",
        "val_ptr",
        [-2, 6, 8, 10],
        r"val_ptr must start at 0, got val_ptr\[0\]=-2",
    ),
    (
        "col_twice",
        "col_idx",
        [0, 1, 1, 5],
        r"col_idx must be strictly ascending.*col_idx\[2\]=1 follows col_idx\[1\]=1",
    ),
    ("cols_descending", "col_idx", [1, 0, 4, 5], r"col_idx must be strictly ascending"),
    (
        "rows_unsorted",
        "row_idx",
        [2, 0, 3, 0, 1, 1, 2],
        r"tile 0 rows must be strictly ascending, got \[2, 0, 3\]",
    ),
]


def test_the_drawn_layout_is_valid_and_runs() -> None:
    lay = drawn_layout()
    lay.validate()
    x = torch.randint(-3, 4, (3, 4)).float()
    for backend in BACKENDS:
        assert torch.equal(ops.tw_linear(x, lay, None, backend), x @ lay.to_dense())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c[0])
def test_corrupt_layout_is_refused_before_the_kernel(case, backend) -> None:
    _, field, value, message = case
    lay = drawn_layout()
    setattr(lay, field, torch.tensor(value, dtype=i64))
    with pytest.raises(ValueError, match=message):
        lay.validate()
    with pytest.raises(ValueError, match=message):
        ops.tw_linear(torch.ones(2, 4), lay, None, backend)


def test_a_checked_layout_is_checked_again_after_its_pointers_change() -> None:
    """The cached check (tilesparse.kernels.schema._VALIDATED) must not let an in-place edit of a pointer through."""
    lay = drawn_layout()
    x = torch.ones(2, 4)
    want = ops.tw_linear(x, lay, None, "cpu")
    assert torch.equal(ops.tw_linear(x, lay, None, "cpu"), want)  # cached
    lay.tile_ptr[0] = 1
    with pytest.raises(ValueError, match="tile_ptr must start at 0"):
        ops.tw_linear(x, lay, None, "cpu")
    lay.tile_ptr[0] = 0
    lay.col_idx[2] = 1
    with pytest.raises(ValueError, match="col_idx must be strictly ascending"):
        ops.tw_linear(x, lay, None, "cpu")


def test_negative_row_ptr_is_an_error_not_a_crash() -> None:
    """row_ptr = [-2, 0] would make the C++ kernel read before row_idx (exit 139) if it got
    through: run in a child process so that a crash fails this test instead of the test run."""
    code = (
        "import torch\n"
        "from tilesparse import ops\n"
        "from tilesparse.format import TWLayout\n"
        "lay = TWLayout(4, 4, 1, col_idx=torch.tensor([0]), tile_ptr=torch.tensor([0, 1]),\n"
        "               row_idx=torch.zeros(0, dtype=torch.int64), row_ptr=torch.tensor([-2, 0]),\n"
        "               values=torch.zeros(0), val_ptr=torch.tensor([-2, 0]))\n"
        "for backend in ('cpu', 'auto', 'reference'):\n"
        "    try:\n"
        "        ops.tw_linear(torch.ones(2, 4), lay, None, backend)\n"
        "    except ValueError as e:\n"
        "        print(backend, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all(
        "row_ptr must start at 0, got row_ptr[0]=-2" in ln for ln in lines
    ), out.stdout


def test_empty_layout_is_valid() -> None:
    """T = 0 (every column pruned): the pointers are [0]; the output is the bias."""
    lay = condense(torch.ones(5, 3), torch.zeros(5, 3, dtype=torch.bool), 2)
    bias = torch.tensor([1.0, 2.0, 3.0])
    for backend in BACKENDS:
        assert torch.equal(ops.tw_linear(torch.ones(2, 5), lay, bias, backend), bias.expand(2, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_of_another_dtype_is_refused(backend) -> None:
    gen = torch.Generator().manual_seed(0)
    lay = condense(torch.randn(8, 6, generator=gen), torch.rand(8, 6, generator=gen) < 0.5, 4)
    x = torch.randn(3, 8, generator=gen)
    with pytest.raises(ValueError, match="bias has dtype torch.float64 but x has torch.float32"):
        ops.tw_linear(x, lay, torch.zeros(6, dtype=torch.float64), backend)
    with pytest.raises(ValueError, match="bias has dtype torch.int64 but x has torch.float32"):
        ops.tw_linear(x, lay, torch.arange(6), backend)
    bias = torch.randn(6, generator=gen)
    torch.testing.assert_close(ops.tw_linear(x, lay, bias, backend), reference_matmul(x, lay, bias))


def test_fake_kernel_refuses_a_bias_of_another_dtype_too() -> None:
    """The shape/dtype checks are shared with the fake kernel, so tracing fails the same way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lay = condense(torch.randn(8, 6), torch.ones(8, 6, dtype=torch.bool), 4)
    with FakeTensorMode() as mode:
        args = [
            mode.from_tensor(t)
            for t in (
                torch.randn(3, 8),
                lay.col_idx,
                lay.tile_ptr,
                lay.row_idx,
                lay.row_ptr,
                lay.values,
                lay.val_ptr,
                torch.zeros(6).double(),
            )
        ]
        with pytest.raises(ValueError, match="bias has dtype torch.float64"):
            torch.ops.tilesparse.tw_linear(*args[:7], args[7], 6, "cpu")
