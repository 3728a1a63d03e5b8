"""tilesparse.ops: the tw_linear custom op, its backends and the compiled CPU kernel.

Every fast path is compared with :func:`tilesparse.format.reference_matmul`. The first test
that needs the extension builds it once into the cache (``make install`` already does)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import extbuild
from tests.tilesparse.tw_cases import (
    GEMM_DTYPES,
    int_tensor,
    layout_with_empty_tile,
    tw_random_mask,
)
from tests.tolerances import tol
from tilesparse import ops
from tilesparse.backend import Backend, parse_backend
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.kernels import cpu as cpu_kernels
from tilesparse.linear import TileSparseLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "M,K,N,G", [(1, 130, 70, 32), (37, 300, 200, 64), (130, 257, 129, 128), (5, 64, 33, 16)]
)
def test_cpu_matches_reference(ext, dtype, M, K, N, G):
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    w = torch.randn(K, N, generator=gen).to(dtype)
    mask = tw_random_mask(K, N, G, 0.4, gen, drop_cols=0.2)
    layout = condense(w, mask, G)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for b in (None, bias):
        got = ops.tw_linear(x, layout, b, "cpu")
        want = reference_matmul(x, layout, b)
        assert got.dtype == dtype and got.shape == (M, N)
        torch.testing.assert_close(got, want, **tol("tw_gemm", dtype))


def test_cpu_exact_on_integers(ext):
    gen = torch.Generator().manual_seed(1)
    K, N, G = 515, 300, 128
    layout = condense(int_tensor((K, N), gen), tw_random_mask(K, N, G, 0.3, gen, 0.3), G)
    x = int_tensor((200, K), gen)
    bias = int_tensor((N,), gen)
    assert torch.equal(ops.tw_linear(x, layout, bias, "cpu"), reference_matmul(x, layout, bias))
    # and against the plain dense product of the masked weight
    assert torch.equal(ops.tw_linear(x, layout, bias, "cpu"), x @ layout.to_dense() + bias)


# Strip edges of both micro-kernels (AVX-512 12 × 32, AVX2 6 × 16): G=8 and 20 leave strips
# narrower than NR; drop 0 keeps them contiguous (masked stores), drop 0.3 leaves gaps (scatter
# / scalar stores); M=1, 5, 7, 13 and 97 are not multiples of MR = 6 or 12, 97 is one row past
# an M block; K=600 with every row kept is several k-blocks (the accumulate path).
@pytest.mark.parametrize("G", [8, 20, 40, 128])
@pytest.mark.parametrize("drop", [0.0, 0.3])
@pytest.mark.parametrize("M", [1, 5, 7, 13, 97])
def test_cpu_exact_on_strip_edges(ext, G, drop, M):
    gen = torch.Generator().manual_seed(G * 100 + M + int(drop * 10))
    K, N = 600, 150
    layout = condense(int_tensor((K, N), gen), tw_random_mask(K, N, G, 1.0, gen, drop), G)
    x = int_tensor((M, K), gen)
    bias = int_tensor((N,), gen)
    for b in (None, bias):
        assert torch.equal(ops.tw_linear(x, layout, b, "cpu"), reference_matmul(x, layout, b))


def test_simd_reports_the_cpus_vector_isa(ext, cpu_flags):
    """-march=native picks the widest fp32 micro-kernel the CPU has; simd() says which."""
    flags = cpu_flags
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"
    assert ext.simd() == want
    assert ext.has_avx512() == (want == "avx512")


@pytest.mark.parametrize(
    "M, K, N, G",
    [(1, 40, 50, 32), (70, 100, 90, 32), (64, 64, 64, 16), (129, 77, 300, 128), (33, 2, 17, 8)],
)
def test_amx_bf16_exact_on_small_integers(ext, cpu_flags, M, K, N, G):
    """bf16 on the AMX kernel (where the CPU has it): with entries in -2..2 and K ≤ 100 every
    product, sum and the bf16 output are exact, so the result equals the fp64 reference bit
    for bit — any packing, pair-interleave or transpose error shows. Covers M=1, K and N not
    multiples of 16/32 and pruned columns (tiles without rows: test_tile_without_rows_and_pruned_columns,
    whose bf16 case takes the same path)."""
    if not ext.has_amx():
        assert "amx_bf16" not in cpu_flags, "the CPU has AMX-BF16 but the kernel's AMX path is off"
        pytest.skip(
            "this CPU has no AMX-BF16 (bf16 takes the AVX512-BF16 kernel, test_ops_bf16.py, or the fp32-kernel or at::mm path: test_16bit_through_the_fp32_kernel_and_through_mm)"
        )
    gen = torch.Generator().manual_seed(M * K + N)
    mask = tw_random_mask(K, N, G, keep_rows=0.6, gen=gen, drop_cols=0.25)
    lay = condense(int_tensor((K, N), gen, -2, 3), mask, G)
    x = int_tensor((M, K), gen, -2, 3)
    bias = int_tensor((N,), gen, -2, 3)
    want = reference_matmul(x.double(), _with_values(lay, lay.values.double()), bias.double())
    got = ext.tw_linear_cpu(
        x.bfloat16(),
        lay.col_idx,
        lay.tile_ptr,
        lay.row_idx,
        lay.row_ptr,
        lay.values.bfloat16(),
        lay.val_ptr,
        bias.bfloat16(),
        N,
    )
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert torch.equal(got.double(), want)


def _with_values(lay: TWLayout, values: torch.Tensor) -> TWLayout:
    return TWLayout(
        lay.in_features,
        lay.out_features,
        lay.tile,
        lay.col_idx,
        lay.tile_ptr,
        lay.row_idx,
        lay.row_ptr,
        values,
        lay.val_ptr,
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    M=st.integers(1, 40),
    K=st.integers(1, 90),
    N=st.integers(1, 90),
    G=st.sampled_from([1, 3, 16, 32, 48]),
    keep=st.floats(0.0, 1.0),
    drop=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_cpu_property_shapes(ext, M, K, N, G, keep, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    layout = condense(int_tensor((K, N), gen), tw_random_mask(K, N, G, keep, gen, drop), G)
    x = int_tensor((M, K), gen)
    bias = int_tensor((N,), gen)
    assert torch.equal(ops.tw_linear(x, layout, bias, "cpu"), reference_matmul(x, layout, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_without_rows_and_pruned_columns(ext, dtype):
    layout = layout_with_empty_tile(K=5, N=8, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    x = int_tensor((3, 5), gen, dtype=dtype)
    bias = int_tensor((8,), gen, dtype=dtype)
    got = ops.tw_linear(x, layout, bias, "cpu")
    assert torch.equal(got, reference_matmul(x, layout, bias))
    # the empty tile's columns and the pruned column hold exactly the bias
    assert torch.equal(got[:, [4, 5, 6]], bias[[4, 5, 6]].expand(3, 3))


def test_all_columns_pruned(ext):
    layout = condense(torch.randn(10, 6), torch.zeros(10, 6, dtype=torch.bool), 4)
    assert layout.num_tiles == 0
    x = torch.randn(4, 10)
    bias = torch.randn(6)
    assert torch.equal(ops.tw_linear(x, layout, bias, "cpu"), bias.expand(4, 6))
    assert torch.equal(ops.tw_linear(x, layout, None, "cpu"), torch.zeros(4, 6))


def test_three_d_input_and_auto(ext):
    gen = torch.Generator().manual_seed(3)
    K, N, G = 48, 40, 16
    layout = condense(int_tensor((K, N), gen), tw_random_mask(K, N, G, 0.5, gen), G)
    x = int_tensor((2, 3, 5, K), gen)
    got = ops.tw_linear(x, layout, None, Backend.AUTO)
    assert got.shape == (2, 3, 5, N)
    assert torch.equal(got, reference_matmul(x, layout))
    # a non-contiguous view is accepted by the Python API (copied), same result
    xt = int_tensor((K, 7), gen).T
    assert torch.equal(ops.tw_linear(xt, layout), reference_matmul(xt.contiguous(), layout))


def test_emulated_backend_matches_reference():
    gen = torch.Generator().manual_seed(4)
    K, N, G = 70, 50, 16
    layout = condense(int_tensor((K, N), gen), tw_random_mask(K, N, G, 0.5, gen, 0.2), G)
    x = int_tensor((9, K), gen)
    torch.testing.assert_close(
        ops.tw_linear(x, layout, None, "emulated"), reference_matmul(x, layout)
    )


def _op_args(layout, x, bias, backend="cpu"):
    return (
        x,
        layout.col_idx,
        layout.tile_ptr,
        layout.row_idx,
        layout.row_ptr,
        layout.values,
        layout.val_ptr,
        bias,
        layout.out_features,
        backend,
    )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_opcheck(ext, backend):
    gen = torch.Generator().manual_seed(5)
    K, N, G = 40, 30, 8
    layout = condense(torch.randn(K, N, generator=gen), tw_random_mask(K, N, G, 0.5, gen, 0.2), G)
    x = torch.randn(6, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    torch.library.opcheck(torch.ops.tilesparse.tw_linear, _op_args(layout, x, bias, backend))
    xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
    torch.library.opcheck(torch.ops.tilesparse.tw_linear, _op_args(layout, xg, bg, backend))


def test_gradients_match_dense(ext):
    gen = torch.Generator().manual_seed(6)
    K, N, G = 33, 20, 8
    layout = condense(torch.randn(K, N, generator=gen), tw_random_mask(K, N, G, 0.5, gen, 0.2), G)
    x = torch.randn(5, K, generator=gen, requires_grad=True)
    b = torch.randn(N, generator=gen, requires_grad=True)
    ops.tw_linear(x, layout, b).square().sum().backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (x2 @ layout.to_dense() + b2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **tol("tw_gemm", torch.float32))
    torch.testing.assert_close(b.grad, b2.grad, **tol("tw_gemm", torch.float32))


def test_torch_export_and_compile_of_module(ext):
    gen = torch.Generator().manual_seed(7)
    dense = torch.nn.Linear(64, 48)
    mask = tw_random_mask(64, 48, 16, 0.5, gen, 0.2)
    model = torch.nn.Sequential(
        TileSparseLinear.from_dense(dense, mask_kn=mask, tile=16), torch.nn.ReLU()
    )
    x = torch.randn(10, 64, generator=gen)
    ep = torch.export.export(model, (x,))
    assert "tilesparse.tw_linear" in str(ep.graph)
    torch.testing.assert_close(ep.module()(x), model(x))
    x2 = torch.randn(3, 64, generator=gen)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x2), model(x2))


def test_fallback_without_extension_warns_once(monkeypatch, caplog):
    gen = torch.Generator().manual_seed(8)
    layout = condense(int_tensor((20, 12), gen), tw_random_mask(20, 12, 4, 0.5, gen), 4)
    x = int_tensor((3, 20), gen)
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    cpu_kernels.load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tilesparse.kernels.cpu"):
            y1 = ops.tw_linear(x, layout, None, "cpu")
            y2 = ops.tw_linear(x, layout, None, "auto")
        warnings = [r for r in caplog.records if "reference path" in r.getMessage()]
        assert len(warnings) == 1
        assert not cpu_kernels.cpu_kernel_available()
        assert torch.equal(y1, reference_matmul(x, layout)) and torch.equal(y2, y1)
    finally:
        monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
        cpu_kernels.load_extension.cache_clear()


def test_the_build_cache_is_per_cpu(monkeypatch):
    """Two CPUs never share a -march=native build: the folder changes with the feature flags."""
    here = cpu_kernels.build_dir()
    assert extbuild.cpu_identity() and here == cpu_kernels.build_dir()
    monkeypatch.setattr(extbuild, "cpu_identity", lambda: "fpu sse2 avx2")
    other = cpu_kernels.build_dir()
    assert other != here and other.parent == here.parent


def test_bad_inputs_raise_clear_errors(ext):
    gen = torch.Generator().manual_seed(9)
    layout = condense(torch.randn(20, 12, generator=gen), tw_random_mask(20, 12, 4, 0.5, gen), 4)
    with pytest.raises(ValueError, match="x has 19 features.*K=20"):
        ops.tw_linear(torch.randn(3, 19), layout)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        ops.tw_linear(torch.ones(3, 20, dtype=torch.int64), layout)
    with pytest.raises(ValueError, match="values are torch.float32"):
        ops.tw_linear(torch.randn(3, 20, dtype=torch.bfloat16), layout)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.tw_linear(torch.randn(3, 20), layout, torch.zeros(5))
    with pytest.raises(ValueError, match="unknown tw_linear backend 'fast'"):
        ops.tw_linear(torch.randn(3, 20), layout, None, "fast")
    with pytest.raises(ValueError, match="backend 'cutlass' runs on CUDA"):
        ops.tw_linear(torch.randn(3, 20), layout, None, "cutlass")
    xt = torch.randn(20, 3).T
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.tilesparse.tw_linear(*_op_args(layout, xt, None))
    with pytest.raises(ValueError, match=r"row_idx must lie in \[0, K=10\)"):
        torch.ops.tilesparse.tw_linear(*_op_args(layout, torch.randn(3, 10), None))


def test_backend_enum():
    assert parse_backend("CPU") is Backend.CPU
    assert parse_backend(Backend.EMULATED) is Backend.EMULATED
    assert [b.value for b in Backend] == ["auto", "reference", "cpu", "cutlass", "emulated"]
    with pytest.raises(ValueError, match="expected one of 'auto'"):
        parse_backend(3)


def _insert_empty_tile(layout: TWLayout, cols: list[int]) -> TWLayout:
    """``layout`` plus one tile over the (pruned) columns ``cols`` that keeps no row at all, in
    its ascending place: a layout :func:`condense` never makes but the format allows."""
    tiles = [
        (layout.tile_cols(t).tolist(), layout.tile_rows(t), layout.block(t))
        for t in range(layout.num_tiles)
    ]
    tiles.append((cols, torch.zeros(0, dtype=torch.int64), layout.values.new_zeros(0, len(cols))))
    tiles.sort(key=lambda t: t[0][0])
    i64 = torch.int64
    out = TWLayout(
        in_features=layout.in_features,
        out_features=layout.out_features,
        tile=layout.tile,
        col_idx=torch.tensor([c for cs, _, _ in tiles for c in cs], dtype=i64),
        tile_ptr=torch.tensor(
            [0, *torch.tensor([len(cs) for cs, _, _ in tiles]).cumsum(0).tolist()], dtype=i64
        ),
        row_idx=torch.cat([r for _, r, _ in tiles]).to(i64),
        row_ptr=torch.tensor(
            [0, *torch.tensor([r.numel() for _, r, _ in tiles]).cumsum(0).tolist()], dtype=i64
        ),
        values=torch.cat([b.flatten() for _, _, b in tiles]),
        val_ptr=torch.tensor(
            [0, *torch.tensor([b.numel() for _, _, b in tiles]).cumsum(0).tolist()], dtype=i64
        ),
    )
    out.validate()
    return out


# (name, M, K, N, G, layout kind, input kind); none of K, N is a multiple of its G, and no M
# is a multiple of 12 or 96 (the kernel's row blocks) except where M=1 is the point.
TOLERANCE_CASES = [
    ("kn_not_multiple_g16", 37, 300, 201, 16, "tw", "2d"),
    ("m1_g64", 1, 130, 70, 64, "tw", "2d"),
    ("m97_g128", 97, 257, 300, 128, "tw", "2d"),
    ("tile_without_rows_g16", 13, 70, 90, 16, "empty_tile", "2d"),
    ("all_columns_pruned_g64", 25, 100, 70, 64, "all_pruned", "2d"),
    ("noncontiguous_3d_g64", 2 * 29, 200, 150, 64, "tw", "3d_strided"),
]


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", TOLERANCE_CASES, ids=lambda c: c[0])
def test_cpu_matches_reference_tolerance_table(ext, dtype, case):
    name, M, K, N, G, kind, x_kind = case
    gen = torch.Generator().manual_seed(M * 7919 + K * 31 + N)
    w = torch.randn(K, N, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "all_pruned":
        mask = torch.zeros(K, N, dtype=torch.bool)
    else:
        mask = tw_random_mask(K, N, G, 0.4, gen, drop_cols=0.2)
    if kind == "empty_tile":
        mask[:, 8 : 8 + G] = False  # these G columns become one tile with no rows
    layout = condense(w, mask, G)
    if kind == "empty_tile":
        layout = _insert_empty_tile(layout, list(range(8, 8 + G)))
        assert any(layout.tile_rows(t).numel() == 0 for t in range(layout.num_tiles))
    if kind == "all_pruned":
        assert layout.num_tiles == 0
    if x_kind == "3d_strided":
        # (2, 29, K) picked out of a (2, 29, 2K) buffer: every row strided, not contiguous
        x = torch.randn(2, M // 2, 2 * K, generator=gen, dtype=torch.float64).to(dtype)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = torch.randn(M, K, generator=gen, dtype=torch.float64).to(dtype)
    bias = torch.randn(N, generator=gen, dtype=torch.float64).to(dtype)
    for b in (None, bias):
        got = ops.tw_linear(x, layout, b, "cpu")
        want = ops.tw_linear(x, layout, b, "reference")
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], N)
        torch.testing.assert_close(got, want, **tol("tw_gemm", dtype))
        # columns no tile computes hold exactly the bias (or zero)
        computed = torch.zeros(N, dtype=torch.bool)
        for t in range(layout.num_tiles):
            if layout.tile_rows(t).numel():
                computed[layout.tile_cols(t)] = True
        idle = got[..., ~computed]
        expect = torch.zeros_like(idle) if b is None else b[~computed].expand_as(idle)
        assert torch.equal(idle, expect), name


def test_large_outputs_from_the_pool_stay_independent(ext):
    """Outputs of ≥ 8 MiB come from the kernel's huge-page pool: a live output is never handed
    out again, a freed one is reused (same address), results stay exact, and
    release_scratch() returns the pooled bytes."""
    gen = torch.Generator().manual_seed(5)
    M, K, N, G = 2048, 48, 1100, 32  # 2048·1100·4 B = 8.6 MiB ≥ the pool's threshold
    mask = tw_random_mask(K, N, G, keep_rows=0.5, gen=gen, drop_cols=0.3)
    lay = condense(int_tensor((K, N), gen), mask, G)
    bias = int_tensor((N,), gen)
    xs = [int_tensor((M, K), gen) for _ in range(3)]
    wants = [reference_matmul(x, lay, bias) for x in xs]

    def run(x: torch.Tensor) -> torch.Tensor:
        return ops.tw_linear(x, lay, bias, "cpu")

    first = run(xs[0])
    second = run(xs[1])  # first is alive: a different buffer
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, wants[0], rtol=0, atol=0)
    torch.testing.assert_close(second, wants[1], rtol=0, atol=0)
    freed = second.data_ptr()
    del second
    third = run(xs[2])  # reuses the freed buffer, and overwrites all of it
    assert third.data_ptr() == freed
    torch.testing.assert_close(third, wants[2], rtol=0, atol=0)
    torch.testing.assert_close(first, wants[0], rtol=0, atol=0)
    del first, third
    assert ext.release_scratch() >= 2 * M * N * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("M, K, N", [(0, 16, 16), (5, 0, 16), (5, 16, 0), (1, 1, 1), (3, 7, 5)])
def test_degenerate_shapes(ext, dtype, M, K, N):
    """No rows, no input features (output = bias), no outputs, 1×1×1 — every dtype's path."""
    gen = torch.Generator().manual_seed(M + 7 * K + 31 * N)
    w = int_tensor((K, N), gen)
    lay = condense(w, torch.ones(K, N, dtype=torch.bool), 8)
    lay_d = _with_values(lay, lay.values.to(dtype))
    x, bias = int_tensor((M, K), gen, dtype=dtype), int_tensor((N,), gen, dtype=dtype)
    got = ops.tw_linear(x, lay_d, bias, "cpu")
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(
        got, (x.double() @ w.double() + bias.double()).to(dtype), rtol=0, atol=0
    )


def test_checked_layout_is_checked_again_after_an_in_place_edit(ext):
    """The bounds check is skipped for an index set already checked (it costs more than the
    kernel at small M) — but not after the indices change in place."""
    gen = torch.Generator().manual_seed(9)
    lay = condense(int_tensor((40, 30), gen), tw_random_mask(40, 30, 8, 0.5, gen), 8)
    x = int_tensor((4, 40), gen)
    want = reference_matmul(x, lay)
    assert torch.equal(ops.tw_linear(x, lay, None, "cpu"), want)
    assert torch.equal(ops.tw_linear(x, lay, None, "cpu"), want)  # the cached check
    lay.row_idx[0] = 40  # out of range for K = 40
    with pytest.raises(ValueError, match="row_idx must lie in"):
        ops.tw_linear(x, lay, None, "cpu")
    lay.row_idx[0] = 0
    lay.col_idx[-1] = 30  # out of range for N = 30
    with pytest.raises(ValueError, match="col_idx must lie in"):
        ops.tw_linear(x, lay, None, "cpu")


def test_disable_amx_env_takes_the_mm_path(ext):
    """TILESPARSE_DISABLE_AMX=1 (read once per process) and TILESPARSE_DISABLE_AVX512BF16=1: bf16
    runs at::mm on gathered panels, with the same results as the reference on small integers."""
    import subprocess
    import sys

    code = (
        "import torch; from tilesparse import ops; from tilesparse.kernels import cpu as cpu_kernels; from tilesparse.format import condense, reference_matmul\n"
        "ext = cpu_kernels.load_extension(); assert not ext.has_amx() and ext.bf16_kernel() == 'mm'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = torch.randint(-2, 3, (50, 40), generator=g).float(); m = torch.rand(50, 40, generator=g) < 0.5\n"
        "lay = condense(w, m, 16); x = torch.randint(-2, 3, (9, 50), generator=g).float()\n"
        "lb = condense(w, m, 16); lb.values = lb.values.bfloat16()\n"
        "got = ops.tw_linear(x.bfloat16(), lb, None, 'cpu')\n"
        "assert torch.equal(got.double(), reference_matmul(x.double(), lay).double().bfloat16().double())\n"
        "print('ok')\n"
    )
    env = {
        **__import__("os").environ,
        "TILESPARSE_DISABLE_AMX": "1",
        "TILESPARSE_LOWP_FP32": "0",
        "TILESPARSE_DISABLE_AVX512BF16": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_through_the_fp32_kernel_and_through_mm(ext, cpu_flags, dtype, monkeypatch):
    """bf16/fp16 take the fp32 kernel where the CPU has no native 16-bit GEMM (auto, from
    CPUID), or when TILESPARSE_LOWP_FP32=1; at::mm on panels with =0. Both exact on small
    integers (bf16 on AMX goes to the AMX kernel first, whatever the variable says; the
    AVX512-BF16 kernel, which would come next, is turned off here: test_ops_bf16.py)."""
    name = str(dtype).removeprefix("torch.")
    flag = {"bfloat16": "avx512_bf16", "float16": "avx512_fp16"}[name]
    monkeypatch.delenv("TILESPARSE_LOWP_FP32", raising=False)
    monkeypatch.setenv("TILESPARSE_DISABLE_AVX512BF16", "1")
    if cpu_flags:
        assert ext.lowp_via_fp32(name) is (flag not in cpu_flags)
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-2, 3, (300, 150), generator=g).float()
    mask = torch.rand(300, 150, generator=g) < 0.4
    lay = condense(w, mask, 32)
    low = condense(w, mask, 32)
    low.values = low.values.to(dtype)
    x = torch.randint(-2, 3, (37, 300), generator=g).float()
    bias = torch.randint(-3, 4, (150,), generator=g).float()
    want = reference_matmul(x.double(), lay, bias.double()).to(dtype)
    for env in ("1", "0"):
        monkeypatch.setenv("TILESPARSE_LOWP_FP32", env)
        assert ext.lowp_via_fp32(name) is (env == "1")
        got = ops.tw_linear(x.to(dtype), low, bias.to(dtype), "cpu")
        assert got.dtype == dtype and torch.equal(got, want), env
    with pytest.raises(RuntimeError, match="'bfloat16' or 'float16'"):
        ext.lowp_via_fp32("float32")


@pytest.mark.parametrize("route", ["default", "fp32", "mm"])
@pytest.mark.parametrize(("dtype", "big"), [(torch.bfloat16, 256.0), (torch.float16, 2048.0)])
def test_every_16bit_route_rounds_product_plus_bias_once(ext, monkeypatch, route, dtype, big):
    """Column 0 sums big + 1, plus bias 1: the exact big + 2 is representable (the type steps
    by 2 there); rounding the product first gives big + 1 -> big (a tie, nearest even), then
    + 1 -> big again. Every route (the default kernel, the fp32 route, at::mm on panels) must
    round once, also in a tile with every row pruned (its columns are the bias) and when
    every column is kept (no pre-filled output)."""
    monkeypatch.setenv("TILESPARSE_LOWP_FP32", {"default": "", "fp32": "1", "mm": "0"}[route])
    monkeypatch.setenv("TILESPARSE_DISABLE_AVX512BF16", "1" if route != "default" else "0")
    if dtype == torch.bfloat16 and not ext.has_amx():
        assert (
            ext.bf16_kernel() == {"default": ext.bf16_kernel(), "fp32": "fp32", "mm": "mm"}[route]
        )
    w = torch.tensor([[big, big, 5.0], [1.0, 3.0, 7.0]])
    x = torch.ones(3, 2, dtype=dtype)
    for mask, bias, want in (
        (
            torch.tensor([[True, True, False], [True, True, False]]),
            [1.0, 0.0, -4.0],
            [big + 2, big + 4, -4.0],
        ),
        (torch.ones(2, 3, dtype=torch.bool), [1.0, 0.0, 1.0], [big + 2, big + 4, 13.0]),
    ):
        lay = condense(w, mask, 2)
        lay.values = lay.values.to(dtype)
        got = ops.tw_linear(x, lay, torch.tensor(bias, dtype=dtype), "cpu")
        assert got.dtype == dtype and got.float().tolist() == [want] * 3, (route, got)
