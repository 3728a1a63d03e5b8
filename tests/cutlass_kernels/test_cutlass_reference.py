"""Packing of the kernel arguments (exact, on a hand-drawn example) and the emulation from
those packed arguments against the TW reference (exact, integer-valued inputs)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cutlass_kernels.reference import (
    emulate,
    pack_launch,
    pack_weight,
    round_up,
    tw_linear_emulated,
    unpack_output,
)
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.linear import TileSparseLinear

I64 = torch.int64


def _drawn_example() -> tuple[torch.Tensor, torch.Tensor]:
    """The format's worked example: K=4, N=6, G=2; W[k, n] = 10k + n + 1 (distinct)."""
    w = (10 * torch.arange(4).unsqueeze(1) + torch.arange(6) + 1).float()
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[[0, 2, 3], 0] = mask[[0, 2, 3], 1] = True
    mask[[0, 1], 4] = True
    mask[[1, 2], 5] = True
    return w, mask


def test_packing_of_the_drawn_example() -> None:
    w, mask = _drawn_example()
    layout = condense(w, mask, tile=2)
    pw = pack_weight(layout)
    assert torch.equal(pw.tile_meta, torch.tensor([[0, 2, 0, 3], [2, 1, 3, 2], [3, 1, 5, 2]], dtype=torch.int32))
    assert torch.equal(pw.col_idx, torch.tensor([0, 1, 4, 5], dtype=torch.int32))
    assert torch.equal(pw.row_idx, torch.tensor([0, 2, 3, 0, 1, 1, 2], dtype=torch.int32))
    assert (pw.lda, pw.max_tile_width, pw.num_tiles) == (8, 2, 3)
    expect = torch.zeros(7, 8)
    expect[0, :2] = torch.tensor([1.0, 2.0])  # W00 W01
    expect[1, :2] = torch.tensor([21.0, 22.0])  # W20 W21
    expect[2, :2] = torch.tensor([31.0, 32.0])  # W30 W31
    expect[3, 0], expect[4, 0] = 5.0, 15.0  # W04 W14
    expect[5, 0], expect[6, 0] = 16.0, 26.0  # W15 W25
    assert torch.equal(pw.w, expect)

    x = torch.arange(12, dtype=torch.float32).view(3, 4)  # M=3 → batch padded to 8
    bias = torch.tensor([1.0, 2, 3, 4, 5, 6])
    launch = pack_launch(x, pw, bias)
    assert (launch.batch, launch.rows, launch.ldx, launch.ldy, launch.beta) == (8, 3, 8, 8, 1.0)
    assert launch.grid(128) == (3, 1)
    xt = torch.zeros(4, 8)
    xt[:, :3] = x.t()
    assert torch.equal(launch.xt, xt)
    assert torch.equal(launch.yt, bias.unsqueeze(1).expand(6, 8))
    emulate(launch)
    y = unpack_output(launch)
    assert torch.equal(y, x @ (w * mask) + bias)
    # Pruned columns 2, 3 keep the bias; the padding columns of yt are never read back.
    assert torch.equal(y[:, 2:4], bias[2:4].expand(3, 2))


def _layout(K: int, N: int, G: int, col_p: float, row_p: float, empty_tile: bool, seed: int) -> TWLayout:
    """A random TW layout built directly (so a tile may keep no rows), integer values."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.nonzero(torch.rand(N, generator=g) < col_p).flatten()
    col_idx, tile_ptr, row_idx, row_ptr, val_ptr, vals = [], [0], [], [0], [0], []
    for start in range(0, kept.numel(), G):
        cols = kept[start : start + G]
        rows = torch.nonzero(torch.rand(K, generator=g) < row_p).flatten()
        if empty_tile and start == 0:
            rows = rows[:0]
        col_idx += cols.tolist()
        tile_ptr.append(len(col_idx))
        row_idx += rows.tolist()
        row_ptr.append(len(row_idx))
        block = torch.randint(-4, 5, (rows.numel(), cols.numel()), generator=g).float()
        vals.append(block.flatten())
        val_ptr.append(val_ptr[-1] + block.numel())
    layout = TWLayout(
        K, N, G, torch.tensor(col_idx, dtype=I64), torch.tensor(tile_ptr, dtype=I64),
        torch.tensor(row_idx, dtype=I64), torch.tensor(row_ptr, dtype=I64),
        torch.cat(vals) if vals else torch.zeros(0), torch.tensor(val_ptr, dtype=I64),
    )
    layout.validate()
    return layout


@settings(max_examples=60, deadline=None)
@given(
    K=st.integers(1, 70),
    N=st.integers(1, 70),
    G=st.sampled_from([1, 3, 8, 16, 24]),
    M=st.integers(1, 19),
    col_p=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    row_p=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
    empty_tile=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_emulation_equals_reference_exactly(K, N, G, M, col_p, row_p, empty_tile, with_bias, seed) -> None:
    layout = _layout(K, N, G, col_p, row_p, empty_tile, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(-4, 5, (M, K), generator=g).float()
    bias = torch.randint(-4, 5, (N,), generator=g).float() if with_bias else None
    got = tw_linear_emulated(x, layout, bias)
    assert torch.equal(got, reference_matmul(x, layout, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_emulation_is_exact_on_small_integers(dtype) -> None:
    # Values in {-1, 0, 1} and K=40: every partial sum and output is an integer of magnitude
    # <= 42, exact in fp16 (11-bit significand) and bf16 (8-bit: exact up to 256).
    layout = _layout(40, 37, 16, 0.8, 0.5, True, 3)
    layout.values.clamp_(-1, 1)
    x = torch.randint(-1, 2, (9, 40)).to(dtype)
    bias = torch.randint(-2, 3, (37,)).to(dtype)
    got = tw_linear_emulated(x, layout, bias)
    assert got.dtype == dtype
    assert torch.equal(got, reference_matmul(x, layout, bias))


def test_all_columns_pruned_gives_bias_only() -> None:
    layout = condense(torch.ones(5, 7), torch.zeros(5, 7, dtype=torch.bool), tile=4)
    pw = pack_weight(layout)
    assert pw.num_tiles == 0 and pw.w.shape == (0, 8) and pw.tile_meta.shape == (0, 4)
    bias = torch.arange(7.0)
    x = torch.ones(3, 5)
    assert torch.equal(tw_linear_emulated(x, layout, bias), bias.expand(3, 7))
    assert torch.equal(tw_linear_emulated(x, layout), torch.zeros(3, 7))


def test_matches_tile_sparse_linear_module() -> None:
    torch.manual_seed(0)
    dense = torch.nn.Linear(45, 30)
    with torch.no_grad():
        dense.weight.copy_(torch.randint(-3, 4, dense.weight.shape).float())
        dense.bias.copy_(torch.randint(-3, 4, dense.bias.shape).float())
    mask_kn = torch.rand(45, 30) < 0.4
    module = TileSparseLinear.from_dense(dense, mask_kn, tile=8)
    x = torch.randint(-3, 4, (2, 1, 45)).float()  # leading dims, M=2
    got = tw_linear_emulated(x, module.layout, module.bias)
    assert got.shape == (2, 1, 30)
    with torch.no_grad():
        assert torch.equal(got, module(x))
        assert torch.equal(got, x @ (dense.weight.T * mask_kn) + dense.bias)


def test_m_equal_one_and_aligned_batch_need_no_padding_copy() -> None:
    layout = _layout(20, 20, 8, 1.0, 0.5, False, 7)
    pw = pack_weight(layout)
    one = pack_launch(torch.ones(1, 20), pw)
    assert (one.batch, one.rows, tuple(one.xt.shape)) == (8, 1, (20, 8))
    assert torch.equal(one.xt[:, 1:], torch.zeros(20, 7))
    eight = pack_launch(torch.ones(16, 20), pw)
    assert (eight.batch, tuple(eight.xt.shape)) == (16, (20, 16))


def test_bad_inputs_raise_clear_errors() -> None:
    layout = _layout(20, 20, 8, 1.0, 0.5, False, 7)
    pw = pack_weight(layout)
    with pytest.raises(ValueError, match=r"x must be \(M, 20\)"):
        pack_launch(torch.ones(3, 19), pw)
    with pytest.raises(ValueError, match="float16"):
        pack_launch(torch.ones(3, 20, dtype=torch.float16), pw)
    with pytest.raises(ValueError, match=r"bias must be \(20,\)"):
        pack_launch(torch.ones(3, 20), pw, torch.ones(21))
    with pytest.raises(ValueError, match="kernel covers G=4"):
        emulate(pack_launch(torch.ones(3, 20), pw), tile_m=4)
    with pytest.raises(ValueError, match="features"):
        tw_linear_emulated(torch.ones(2, 3), layout)
    broken = _layout(20, 20, 8, 1.0, 0.5, False, 7)
    broken.row_idx[0] = 99
    with pytest.raises(ValueError, match="row_idx out of range"):
        pack_weight(broken)


def test_round_up() -> None:
    assert [round_up(v, 8) for v in (0, 1, 8, 9, 16)] == [0, 8, 8, 16, 16]


@pytest.mark.parametrize("backend", ["emulated", "reference"])
def test_op_schema_adapter_rebuilds_the_layout(backend) -> None:
    # The CUDA implementation of tilesparse::tw_linear receives the layout as the op schema's
    # tensors; its non-kernel branches run on any device, so the adapter is checked here.
    from cutlass_kernels.build import _op_impl

    layout = _layout(33, 41, 8, 0.8, 0.5, True, 11)
    x = torch.randint(-3, 4, (6, 33)).float()
    bias = torch.randint(-3, 4, (41,)).float()
    got = _op_impl(x, layout.col_idx, layout.tile_ptr, layout.row_idx, layout.row_ptr,
                   layout.values, layout.val_ptr, bias, 41, backend)
    assert torch.equal(got, reference_matmul(x, layout, bias))


def test_register_cuda_kernel_without_cuda_returns_false() -> None:
    from cutlass_kernels import register_cuda_kernel

    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists: registration is covered by test_cutlass_cuda.py")
    assert register_cuda_kernel() is False


def test_select_for_rejects_fp32_and_a_bad_mainloop_variable(monkeypatch) -> None:
    from cutlass_kernels.build import MAINLOOP_ENV, select_for

    layout = condense(torch.randn(40, 50), torch.rand(40, 50) < 0.5, 32)
    with pytest.raises(ValueError, match="float16 or bfloat16, got torch.float32"):
        select_for(pack_launch(torch.randn(3, 40), pack_weight(layout)))
    monkeypatch.setenv(MAINLOOP_ENV, "sm70_wmma")
    launch = pack_launch(torch.randn(3, 40).half(), pack_weight(layout, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"TILEREC_CUTLASS_MAINLOOP='sm70_wmma': expected one of"):
        select_for(launch)
