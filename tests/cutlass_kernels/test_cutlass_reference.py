"""Packing of the kernel arguments (exact, on a hand-drawn example) and the emulation from
those packed arguments against the TW reference (exact, integer-valued inputs)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cutlass_kernels.reference import (
    _bad_shape,
    check_launch,
    emulate,
    pack_launch,
    pack_weight,
    round_up,
    tw_linear_emulated,
    unpack_output,
)
from tests.cutlass_kernels.layouts import random_layout
from tilesparse.format import condense, reference_matmul
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
    assert torch.equal(
        pw.tile_meta, torch.tensor([[0, 2, 0, 3], [2, 1, 3, 2], [3, 1, 5, 2]], dtype=torch.int32)
    )
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
def test_emulation_equals_reference_exactly(
    K, N, G, M, col_p, row_p, empty_tile, with_bias, seed
) -> None:
    layout = random_layout(K, N, G, col_p, row_p, empty_tile, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(-4, 5, (M, K), generator=g).float()
    bias = torch.randint(-4, 5, (N,), generator=g).float() if with_bias else None
    got = tw_linear_emulated(x, layout, bias)
    assert torch.equal(got, reference_matmul(x, layout, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_emulation_is_exact_on_small_integers(dtype) -> None:
    # Values in {-1, 0, 1} and K=40: every partial sum and output is an integer of magnitude
    # <= 42, exact in fp16 (11-bit significand) and bf16 (8-bit: exact up to 256).
    layout = random_layout(40, 37, 16, 0.8, 0.5, True, 3)
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
    module = TileSparseLinear.from_dense(dense, mask_kn=mask_kn, tile=8)
    x = torch.randint(-3, 4, (2, 1, 45)).float()  # leading dims, M=2
    got = tw_linear_emulated(x, module.layout, module.bias)
    assert got.shape == (2, 1, 30)
    with torch.no_grad():
        assert torch.equal(got, module(x))
        assert torch.equal(got, x @ (dense.weight.T * mask_kn) + dense.bias)


def test_m_equal_one_and_aligned_batch_need_no_padding_copy() -> None:
    layout = random_layout(20, 20, 8, 1.0, 0.5, False, 7)
    pw = pack_weight(layout)
    one = pack_launch(torch.ones(1, 20), pw)
    assert (one.batch, one.rows, tuple(one.xt.shape)) == (8, 1, (20, 8))
    assert torch.equal(one.xt[:, 1:], torch.zeros(20, 7))
    eight = pack_launch(torch.ones(16, 20), pw)
    assert (eight.batch, tuple(eight.xt.shape)) == (16, (20, 16))


def test_bad_inputs_raise_clear_errors() -> None:
    layout = random_layout(20, 20, 8, 1.0, 0.5, False, 7)
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
    broken = random_layout(20, 20, 8, 1.0, 0.5, False, 7)
    broken.row_idx[0] = 99
    with pytest.raises(ValueError, match="row_idx out of range"):
        pack_weight(broken)


def test_round_up() -> None:
    assert [round_up(v, 8) for v in (0, 1, 8, 9, 16)] == [0, 8, 8, 16, 16]


def test_select_for_rejects_fp32_and_a_bad_mainloop_variable(monkeypatch) -> None:
    from cutlass_kernels.launch import MAINLOOP_ENV, select_for

    layout = condense(torch.randn(40, 50), torch.rand(40, 50) < 0.5, 32)
    with pytest.raises(ValueError, match="float16 or bfloat16, got torch.float32"):
        select_for(pack_launch(torch.randn(3, 40), pack_weight(layout)))
    monkeypatch.setenv(MAINLOOP_ENV, "sm70_wmma")
    launch = pack_launch(torch.randn(3, 40).half(), pack_weight(layout, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"TILEREC_CUTLASS_MAINLOOP='sm70_wmma': expected one of"):
        select_for(launch)


# --- Tiles wider than the widest kernel instance: packed as sub-tiles sharing the kept rows ---


def test_split_packing_of_a_drawn_example() -> None:
    # K=3, N=5, one tile of 5 columns keeping rows 0 and 2, split at 2 columns: 3 sub-tiles.
    w = (10 * torch.arange(3).unsqueeze(1) + torch.arange(5) + 1).float()  # W[k, n] = 10k + n + 1
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[[0, 2], :] = True
    layout = condense(w, mask, tile=5)
    pw = pack_weight(layout, max_tile_width=2)
    assert torch.equal(
        pw.tile_meta, torch.tensor([[0, 2, 0, 2], [2, 2, 2, 2], [4, 1, 4, 2]], dtype=torch.int32)
    )
    assert torch.equal(pw.col_idx, torch.arange(5, dtype=torch.int32))  # unchanged
    assert torch.equal(pw.row_idx, torch.tensor([0, 2, 0, 2, 0, 2], dtype=torch.int32))
    assert (pw.lda, pw.max_tile_width, pw.num_tiles) == (8, 2, 3)
    expect = torch.zeros(6, 8)
    expect[0, :2], expect[1, :2] = torch.tensor([1.0, 2]), torch.tensor([21.0, 22])
    expect[2, :2], expect[3, :2] = torch.tensor([3.0, 4]), torch.tensor([23.0, 24])
    expect[4, 0], expect[5, 0] = 5.0, 25.0
    assert torch.equal(pw.w, expect)
    x = torch.arange(6, dtype=torch.float32).view(2, 3)
    launch = pack_launch(x, pw)
    emulate(launch, tile_m=2)
    assert torch.equal(unpack_output(launch), x @ (w * mask))


def test_split_is_a_no_op_for_tiles_no_wider_than_the_limit() -> None:
    layout = random_layout(50, 300, 128, 0.9, 0.5, True, 4)
    plain = pack_weight(layout)
    for limit in (128, 256, 1000):
        same = pack_weight(layout, max_tile_width=limit)
        for f in ("tile_meta", "col_idx", "row_idx", "w"):
            assert torch.equal(getattr(same, f), getattr(plain, f)), (limit, f)
        assert (same.lda, same.max_tile_width) == (plain.lda, plain.max_tile_width)
    with pytest.raises(ValueError, match="max_tile_width must be >= 1, got 0"):
        pack_weight(layout, max_tile_width=0)


@settings(max_examples=25, deadline=None)
@given(
    K=st.integers(1, 40),
    N=st.integers(1, 700),
    G=st.sampled_from([256, 200, 129]),
    limit=st.sampled_from([128, 64]),
    M=st.integers(1, 19),
    col_p=st.sampled_from([0.0, 0.4, 0.9, 1.0]),
    row_p=st.sampled_from([0.0, 0.3, 1.0]),
    empty_tile=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_wide_tiles_split_into_sub_tiles_emulate_exactly(
    K, N, G, limit, M, col_p, row_p, empty_tile, with_bias, seed
) -> None:
    # Tiles up to G > 128 wide (a tail tile narrower; a tile with no kept rows; every column
    # pruned when col_p = 0), packed for a kernel of G = limit: same result, exactly.
    layout = random_layout(K, N, G, col_p, row_p, empty_tile, seed)
    pw = pack_weight(layout, max_tile_width=limit)
    assert pw.max_tile_width <= limit and pw.lda % 8 == 0
    widths = (layout.tile_ptr[1:] - layout.tile_ptr[:-1]).tolist()
    assert pw.num_tiles == sum(max(1, -(-w // limit)) for w in widths)
    assert int(pw.tile_meta[:, 1].sum()) == layout.col_idx.numel()  # every kept column once
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(-4, 5, (M, K), generator=g).float()
    bias = torch.randint(-4, 5, (N,), generator=g).float() if with_bias else None
    launch = pack_launch(x, pw, bias)
    emulate(launch, tile_m=limit)
    assert torch.equal(unpack_output(launch), reference_matmul(x, layout, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tile_256_layer_on_128_wide_kernels_equals_tile_sparse_linear(dtype) -> None:
    # TileSparseConfig(tile=256)'s layers on kernels of G = 128: 256-wide tiles, a narrower tail
    # tile, pruned columns; then a layout whose first tile keeps no rows. Values in {-1, 0, 1},
    # K = 40: every sum is exact in fp16 and bf16.
    torch.manual_seed(1)
    K, N = 40, 557
    dense = torch.nn.Linear(K, N)
    with torch.no_grad():
        dense.weight.copy_(torch.randint(-1, 2, dense.weight.shape).float())
        dense.bias.copy_(torch.randint(-2, 3, dense.bias.shape).float())
    mask_kn = torch.zeros(K, N, dtype=torch.bool)
    mask_kn[torch.randperm(K)[:25]] = True
    mask_kn[:, torch.randperm(N)[:12]] = False  # a few pruned columns: a 289-wide rest, tail 33
    module = TileSparseLinear.from_dense(dense, mask_kn=mask_kn, tile=256)
    empty_first = random_layout(K, N, 256, 0.9, 0.6, True, 5)
    empty_first.values.clamp_(-1, 1)
    x = torch.randint(-1, 2, (9, K)).float()
    for layout in (module.layout, empty_first):
        module.set_layout(layout)
        widths = (layout.tile_ptr[1:] - layout.tile_ptr[:-1]).tolist()
        assert max(widths) == 256 and widths[-1] < 256
        with torch.no_grad():
            want = module(x)  # the TileSparseLinear reference (fp32, CPU)
        pw = pack_weight(layout, dtype=dtype, max_tile_width=128)
        assert pw.max_tile_width == 128 and pw.num_tiles == sum(-(-w // 128) for w in widths)
        launch = pack_launch(x.to(dtype), pw, module.bias.detach().to(dtype))
        emulate(launch, tile_m=128)
        assert torch.equal(unpack_output(launch).float(), want)
        with pytest.raises(
            ValueError, match="a tile is 256 columns wide but the kernel covers G=128"
        ):
            emulate(pack_launch(x.to(dtype), pack_weight(layout, dtype=dtype)), tile_m=128)
    assert int(empty_first.row_ptr[1]) == 0


def test_all_columns_pruned_with_a_split_limit() -> None:
    layout = condense(torch.ones(5, 300), torch.zeros(5, 300, dtype=torch.bool), tile=256)
    pw = pack_weight(layout, max_tile_width=128)
    assert pw.num_tiles == 0 and pw.w.shape == (0, 8)
    bias = torch.arange(300.0)
    launch = pack_launch(torch.ones(3, 5), pw, bias)
    emulate(launch, tile_m=128)
    assert torch.equal(unpack_output(launch), bias.expand(3, 300))


# --- The kernel's shape preconditions: K = 1 layers, and pitches the launcher refuses ---


@pytest.mark.parametrize("M", [1, 5, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_k_equal_one_packs_a_kernel_pitch_and_emulates_exactly(M, with_bias) -> None:
    # A (M, 1) x: its transpose (1, M) counts as contiguous with stride (1, 1), which once
    # gave ldx = 1 for batches that need no padding (M = 8, 16): the launcher refuses that.
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[:, [3, 9]] = False
    layout = condense(torch.randint(-3, 4, (1, 16)).float(), mask, 8)
    bias = torch.randint(-3, 4, (16,)).float() if with_bias else None
    for dtype in (torch.float32, torch.float16):
        x = torch.randint(-3, 4, (M, 1)).to(dtype)
        launch = pack_launch(
            x, pack_weight(layout, dtype=dtype), None if bias is None else bias.to(dtype)
        )
        batch = round_up(M, 8)
        assert (launch.batch, launch.ldx, launch.ldy) == (batch, batch, batch)
        assert launch.xt.stride() == (batch, 1) and launch.yt.stride() == (batch, 1)
        assert check_launch(launch) is True
        emulate(launch)
        want = reference_matmul(x, layout, None if bias is None else bias.to(dtype))
        assert torch.equal(unpack_output(launch), want)


def test_one_output_feature_and_aligned_batches_keep_the_pitch() -> None:
    layout = condense(torch.randint(-3, 4, (5, 1)).float(), torch.ones(5, 1, dtype=torch.bool), 4)
    for M in (8, 16):
        launch = pack_launch(torch.ones(M, 5), pack_weight(layout), torch.ones(1))
        assert (launch.ldx, launch.ldy) == (M, M)
        emulate(launch)
        assert torch.equal(
            unpack_output(launch), reference_matmul(torch.ones(M, 5), layout, torch.ones(1))
        )


def _cxx_bad_shape_condition(header: str) -> str:
    """The condition before ``return kTwBadShape;`` in a launcher, as Python."""
    text = (Path(__file__).resolve().parents[2] / "cutlass_kernels" / "csrc" / header).read_text()
    m = re.search(r"if \((args\.batch % align[^{]*)\)\s*\{\s*return kTwBadShape;", text)
    assert m, header
    return " ".join(m.group(1).replace("args.", "").replace("||", " or ").split())


def test_emulate_checks_the_launchers_shape_condition_exactly() -> None:
    conds = {h: _cxx_bad_shape_condition(h) for h in ("tw_gemm.h", "tw_gemm_sm90.h")}
    assert len(set(conds.values())) == 1, conds  # both launchers check the same thing
    cond = next(iter(conds.values()))
    values = [0, 1, 4, 7, 8, 12, 16, 24, 32]
    for batch, lda, ldx, ldy in itertools.product([8, 16, 24], values, values, values):
        want = bool(
            eval(cond, {}, {"batch": batch, "lda": lda, "ldx": ldx, "ldy": ldy, "align": 8})
        )
        assert _bad_shape(batch, lda, ldx, ldy, 8) == want, (batch, lda, ldx, ldy)
    for batch in (1, 5, 9):  # an unpadded batch is refused whatever the pitches
        assert _bad_shape(batch, 8, 16, 16, 8)


def _k1_launch(M: int = 8):
    layout = condense(torch.ones(1, 16), torch.ones(1, 16, dtype=torch.bool), 16)
    return pack_launch(torch.ones(M, 1), pack_weight(layout))


def test_emulate_refuses_pitches_the_kernel_refuses() -> None:
    good = _k1_launch(8)
    bad_shape = r"batch, lda, ldx, ldy must be multiples of 8 and ldx, ldy >= batch"
    # ldx = 1: the (1, 8) transpose of an (8, 1) x, the pitch x2.t().contiguous() would give
    x = torch.ones(8, 1)
    assert x.t().stride() == (1, 1)
    with pytest.raises(ValueError, match=bad_shape + r" \(got batch=8 lda=16 ldx=1 ldy=8\)"):
        emulate(dataclasses.replace(good, xt=x.t()))
    # ldy not a multiple of the alignment (a (16, 20) buffer's first 8 columns)
    yt = torch.zeros(16, 20)[:, :8]
    with pytest.raises(ValueError, match=bad_shape + r" \(got batch=8 lda=16 ldx=8 ldy=20\)"):
        emulate(dataclasses.replace(good, yt=yt))
    # ldx < batch (two overlapping rows of 16 columns, pitch 8)
    two = random_layout(2, 16, 8, 1.0, 1.0, False, 0)
    wide = pack_launch(torch.ones(16, 2), pack_weight(two))
    with pytest.raises(ValueError, match=bad_shape + r" \(got batch=16 lda=8 ldx=8 ldy=16\)"):
        emulate(dataclasses.replace(wide, xt=torch.zeros(32).as_strided((2, 16), (8, 1))))
    # a padded batch that is not a multiple of the alignment
    with pytest.raises(ValueError, match=r"\(got batch=5 lda=16 ldx=8 ldy=8\)"):
        emulate(dataclasses.replace(good, batch=5))
    # lda not a multiple of the alignment
    pw = good.weight
    odd = dataclasses.replace(pw, lda=12, w=torch.zeros(pw.w.shape[0], 12))
    with pytest.raises(ValueError, match=r"\(got batch=8 lda=12 ldx=8 ldy=8\)"):
        emulate(dataclasses.replace(good, weight=odd))
    # the binding's own checks
    with pytest.raises(ValueError, match="w must have row pitch lda=16"):
        emulate(
            dataclasses.replace(good, weight=dataclasses.replace(pw, w=torch.zeros(1, 24)[:, :16]))
        )
    with pytest.raises(ValueError, match="xt and yt must hold batch=8 columns"):
        emulate(dataclasses.replace(good, yt=torch.zeros(16, 8)[:, :4]))
    with pytest.raises(ValueError, match="xt must be 16-byte aligned"):
        emulate(dataclasses.replace(good, xt=torch.zeros(1, 9)[:, 1:]))
    with pytest.raises(ValueError, match="xt must have unit stride in its last dimension"):
        emulate(dataclasses.replace(good, xt=torch.zeros(1, 16)[:, ::2]))
    # nothing to compute: the launcher returns before its shape check, and so does emulate
    pruned = condense(torch.ones(1, 16), torch.zeros(1, 16, dtype=torch.bool), 16)
    empty = dataclasses.replace(good, weight=pack_weight(pruned))
    assert check_launch(dataclasses.replace(empty, xt=x.t())) is False
    emulate(dataclasses.replace(empty, xt=x.t()))
    # and a good launch passes, including the grid check
    assert check_launch(good, batch_tile=128) is True
    huge = dataclasses.replace(
        good, batch=8 * 65536, xt=torch.zeros(1, 8 * 65536), yt=torch.zeros(16, 8 * 65536)
    )
    with pytest.raises(ValueError, match="needs more than 65535 batch blocks"):
        check_launch(huge, batch_tile=8)
