"""The bf16 kernel for CPUs with AVX512-BF16 and no AMX (``tw_linear_bf16.cpp``: AMD Zen 4/5,
Intel Cooper Lake), the bf16 dispatch, and compile checks of the kernel variants this machine
does not run (AMX, AVX2, no AVX512-BF16).

The kernel is called directly (``ext.tw_linear_avx512_bf16``), so it is tested on every CPU
that has the instruction, AMX machines included (where the dispatch prefers AMX)."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tilesparse.tw_cases import (
    int_tensor,
    layout_with_empty_tile,
    tw_random_mask,
)
from tests.tolerances import tol
from tilesparse import ops
from tilesparse.format import condense, reference_matmul
from tilesparse.kernels import cpu as cpu_kernels

DISABLE = "TILESPARSE_DISABLE_AVX512BF16"


@pytest.fixture
def bf16dot(ext, cpu_flags, monkeypatch):
    """The extension, where this CPU has AVX512-BF16 (skip elsewhere: no such instruction to test)."""
    monkeypatch.delenv(DISABLE, raising=False)
    if "avx512_bf16" not in cpu_flags:
        assert not ext.has_avx512_bf16()
        pytest.skip("this CPU has no AVX512-BF16 (bf16 takes AMX, the fp32 kernel or at::mm)")
    assert ext.has_avx512_bf16(), "the CPU has AVX512-BF16 but the extension's kernel is off"
    return ext


def run_kernel(ext, x, lay, bias):
    return ext.tw_linear_avx512_bf16(
        x.bfloat16(),
        lay.col_idx,
        lay.tile_ptr,
        lay.row_idx,
        lay.row_ptr,
        lay.values.bfloat16(),
        lay.val_ptr,
        None if bias is None else bias.bfloat16(),
        lay.out_features,
    )


def exact_reference(x, lay, bias):
    """fp64 reference rounded once to bf16: with small integers every product and fp32 sum is
    exact, so the kernel's single rounding (nearest even) must give these bits."""
    return reference_matmul(x.double(), lay, None if bias is None else bias.double()).bfloat16()


@pytest.mark.parametrize(
    "M, K, N, G, keep, drop",
    [
        (1, 40, 50, 32, 0.6, 0.25),  # M = 1: one vector of 16 batch rows, 15 of them padding
        (20, 60, 45, 32, 0.6, 0.2),  # M = 20: two vectors of batch rows (mv = 2)
        (84, 60, 45, 16, 0.6, 0.2),  # a second block of 20 rows
        (64, 64, 64, 16, 1.0, 0.0),  # one full block, every column kept (no gaps)
        (70, 100, 90, 32, 0.6, 0.25),  # a second block of 6 rows
        (129, 77, 300, 128, 0.5, 0.3),  # G = 128 with pruned columns: widths not multiples of 6
        (200, 90, 77, 3, 0.3, 0.2),  # G = 3: a strip narrower than the micro-kernel's 6
        (33, 2, 17, 8, 0.5, 0.5),  # K = 2: one pair or a lone row per tile
        (50, 31, 40, 16, 0.0, 0.1),  # no tile keeps a row: bias only
    ],
)
def test_exact_on_small_integers(bf16dot, M, K, N, G, keep, drop):
    gen = torch.Generator().manual_seed(M * K + N)
    lay = condense(int_tensor((K, N), gen, -2, 3), tw_random_mask(K, N, G, keep, gen, drop), G)
    x = int_tensor((M, K), gen, -2, 3)
    bias = int_tensor((N,), gen, -2, 3)
    for b in (bias, None):
        got = run_kernel(bf16dot, x, lay, b)
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        assert torch.equal(got, exact_reference(x, lay, b))


@pytest.fixture(params=[1, 4], ids=lambda n: f"threads{n}")
def threads(request):
    """torch's thread count for the test: 1 (a block per item) and 4, where M <= 64 (one block)
    and M = 70 (two) take the small-batch split of a block's strips between threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "M, K, N, G", [(1, 40, 50, 32), (64, 100, 300, 128), (70, 77, 300, 16), (130, 90, 77, 3)]
)
def test_small_batches_split_a_block_between_threads(bf16dot, threads, M, K, N, G):
    """With fewer 64-row blocks than threads a block's strips are split between threads into a
    shared staging block, stored in a second pass; with one thread each block is one item."""
    gen = torch.Generator().manual_seed(M + K + N)
    lay = condense(int_tensor((K, N), gen, -2, 3), tw_random_mask(K, N, G, 0.5, gen, 0.3), G)
    x = int_tensor((M, K), gen, -2, 3)
    bias = int_tensor((N,), gen, -2, 3)
    for b in (bias, None):
        assert torch.equal(run_kernel(bf16dot, x, lay, b), exact_reference(x, lay, b))


@pytest.mark.parametrize("M", [5, 70])
def test_tile_without_rows_and_pruned_columns(bf16dot, threads, M):
    lay = layout_with_empty_tile(6, 8)
    gen = torch.Generator().manual_seed(4)
    x = int_tensor((M, 6), gen)
    bias = int_tensor((8,), gen)
    for b in (bias, None):
        assert torch.equal(run_kernel(bf16dot, x, lay, b), exact_reference(x, lay, b))


def test_rounds_once_to_nearest_even(bf16dot):
    """Column 0 sums 256 + 1 = 257, plus bias 1: rounded once that is 258 (bf16 steps by 2 above
    256); rounding the sum before the bias would give 256 + 1 -> 256. Column 1 sums 256 + 3 =
    259, no bias: a tie between 258 and 260, and nearest even gives 260 (truncation 258)."""
    w = torch.tensor([[256.0, 256.0], [1.0, 3.0]])
    lay = condense(w, torch.ones(2, 2, dtype=torch.bool), 2)
    x = torch.ones(3, 2)
    got = run_kernel(bf16dot, x, lay, torch.tensor([1.0, 0.0]))
    assert torch.equal(got.float(), torch.tensor([[258.0, 260.0]] * 3))


def test_subnormals_are_flushed_to_zero_as_documented(bf16dot):
    """VDPBF16PS flushes subnormal products and VCVTNE2PS2BF16 subnormal results (ops.py's
    docstring says so): column 0's only product is 2**-60 · 2**-70 = 2**-130 (the smallest
    normal is 2**-126), column 1 is pruned and holds a subnormal bias; both come out 0, where
    the reference keeps them, and the normal column 2 next to them is exact."""
    w = torch.tensor([[2.0**-70, 0.0, 0.0], [0.0, 0.0, 4.0]])
    lay = condense(w, torch.tensor([[True, False, True], [True, False, True]]), 1)
    x = torch.tensor([[2.0**-60, 1.0]] * 2)
    bias = torch.tensor([0.0, 2.0**-130, 1.0])
    assert bool((exact_reference(x, lay, bias)[:, :2] != 0).all())
    assert run_kernel(bf16dot, x, lay, bias).float().tolist() == [[0.0, 0.0, 5.0]] * 2


@pytest.mark.parametrize("M, K, N", [(0, 5, 7), (4, 0, 7), (4, 5, 0)])
def test_empty_dimensions(bf16dot, M, K, N):
    gen = torch.Generator().manual_seed(0)
    lay = condense(int_tensor((K, N), gen), torch.ones(K, N, dtype=torch.bool), 4)
    x = int_tensor((M, K), gen)
    bias = int_tensor((N,), gen)
    got = run_kernel(bf16dot, x, lay, bias)
    assert got.shape == (M, N) and torch.equal(got, exact_reference(x, lay, bias))


def test_argument_errors(bf16dot):
    gen = torch.Generator().manual_seed(0)
    lay = condense(int_tensor((8, 6), gen), torch.ones(8, 6, dtype=torch.bool), 4)
    x = int_tensor((5, 8), gen).bfloat16()
    with pytest.raises(RuntimeError, match="contiguous"):
        run_kernel(bf16dot, int_tensor((8, 5), gen).bfloat16().t(), lay, None)
    with pytest.raises(RuntimeError, match="bias must have out_features = 6 entries, got 5"):
        run_kernel(bf16dot, x, lay, torch.ones(5))


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    M=st.integers(1, 140),
    K=st.integers(1, 90),
    N=st.integers(1, 90),
    G=st.sampled_from([1, 5, 6, 7, 16, 48, 128]),
    keep=st.floats(0.0, 1.0),
    drop=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_shapes(bf16dot, M, K, N, G, keep, drop, seed):
    gen = torch.Generator().manual_seed(seed)
    lay = condense(int_tensor((K, N), gen, -2, 3), tw_random_mask(K, N, G, keep, gen, drop), G)
    x = int_tensor((M, K), gen, -2, 3)
    bias = int_tensor((N,), gen, -2, 3)
    assert torch.equal(run_kernel(bf16dot, x, lay, bias), exact_reference(x, lay, bias))


def test_random_values_within_the_bf16_tolerance(bf16dot):
    """Real-valued inputs, K = 300: against the fp32 reference of the same bf16 inputs."""
    gen = torch.Generator().manual_seed(7)
    K, N, G = 300, 260, 128
    w = torch.randn(K, N, generator=gen).bfloat16().float()
    lay = condense(w, tw_random_mask(K, N, G, 0.5, gen, 0.3), G)
    x = torch.randn(150, K, generator=gen).bfloat16()
    bias = torch.randn(N, generator=gen).bfloat16()
    want = reference_matmul(x.float(), lay, bias.float())
    got = run_kernel(bf16dot, x, lay, bias)
    torch.testing.assert_close(got.float(), want, **tol("tw_gemm", torch.bfloat16))


def test_dispatch_takes_it_for_bf16_and_env_turns_it_off(bf16dot, monkeypatch):
    """Without AMX a bf16 call takes this kernel (``bf16_kernel()`` says so) and equals the
    reference through ``ops.tw_linear``; ``TILESPARSE_DISABLE_AVX512BF16=1`` (read per call)
    sends it to the fp32 kernel or at::mm instead, with the same result."""
    gen = torch.Generator().manual_seed(5)
    lay = condense(int_tensor((60, 40), gen, -2, 3), tw_random_mask(60, 40, 16, 0.5, gen, 0.2), 16)
    lay.values = lay.values.bfloat16()
    x = int_tensor((20, 60), gen, -2, 3).bfloat16()
    want = exact_reference(x, lay, None)
    if not bf16dot.has_amx():
        assert bf16dot.bf16_kernel() == "avx512_bf16"
    assert torch.equal(ops.tw_linear(x, lay, None, "cpu"), want)
    monkeypatch.setenv(DISABLE, "1")
    assert not bf16dot.has_avx512_bf16()
    if not bf16dot.has_amx():
        assert bf16dot.bf16_kernel() in ("fp32", "mm")
    assert torch.equal(ops.tw_linear(x, lay, None, "cpu"), want)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        bf16dot.tw_linear_avx512_bf16(
            x.float(),
            lay.col_idx,
            lay.tile_ptr,
            lay.row_idx,
            lay.row_ptr,
            lay.values,
            lay.val_ptr,
            None,
            lay.out_features,
        )


# Each source under a -march that takes the kernel paths this machine's -march=native build
# may not: AMX (Sapphire Rapids), AVX512-BF16 without AMX (Cooper Lake, as Zen 4), AVX2 only (Zen 3: the AVX2
# fp32 micro-kernel, no bf16 kernel), plain x86-64 (scalar C).
# A variant the native build already compiled is left out (each compile parses ATen: ~10-20 s).
CROSS_BUILDS = [
    ("tw_linear_amx.cpp", "sapphirerapids", "TILESPARSE_AMX", lambda ext, flags: ext.has_amx()),
    (
        "tw_linear_bf16.cpp",
        "cooperlake",
        "TILESPARSE_BF16_BLOCK",
        lambda ext, flags: "avx512_bf16" in flags,
    ),
    ("tw_linear_cpu.cpp", "znver3", "TILESPARSE_AVX2", lambda ext, flags: ext.simd() == "avx2"),
    ("tw_linear_bf16.cpp", "x86-64", None, lambda ext, flags: "avx512_bf16" not in flags),
    ("tw_linear_cpu.cpp", "x86-64", None, lambda ext, flags: ext.simd() == "scalar"),
]


def _compile(src: Path, march: str, macro: str | None) -> subprocess.CompletedProcess[str]:
    from torch.utils.cpp_extension import include_paths

    check = (
        f"\n#ifndef {macro}\n#error {macro} is not defined for -march={march}\n#endif\n"
        if macro
        else ""
    )
    code = f'#include "{src}"\n{check}'
    cmd = [
        os.environ.get("CXX", "c++"),
        "-std=c++17",
        "-fsyntax-only",
        "-w",
        f"-march={march}",
        "-DTORCH_EXTENSION_NAME=tilesparse_cpu",
        "-x",
        "c++",
        "-",
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{src.parent}",
    ]
    return subprocess.run(cmd, input=code, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_kernel_variants_compile_for_other_cpus(ext, cpu_flags):
    """Every variant compiles (syntax and template instantiation), and the -march really selects
    it (its macro is defined): the AMX kernel, which no CI machine here can run, included."""
    todo = [
        (src, march, macro)
        for src, march, macro, native in CROSS_BUILDS
        if not native(ext, cpu_flags)
    ]
    assert todo  # no machine compiles every variant natively (AMX and the stub exclude each other)
    csrc = cpu_kernels.CSRC
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda c: _compile(csrc / c[0], c[1], c[2]), todo))
    for (src, march, _), res in zip(todo, results):
        assert res.returncode == 0, f"{src} -march={march}:\n{res.stderr[-3000:]}"
