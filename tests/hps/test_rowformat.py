"""Row formats (hps.rowformat): byte layouts, exact round trips, the int error bound, errors,
and both directions against FBGEMM's CPU inference TBE (fbgemm-gpu-cpu)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from hps.rowformat import (
    RowDtype,
    RowFormatError,
    check_rows,
    dequantize_rows,
    quantize_rows,
    row_bytes,
    scale_bias,
    scale_bias_to_back,
    scale_bias_to_front,
)
from tests.conftest import IN_CI

INT_DTYPES = (RowDtype.INT8, RowDtype.INT4, RowDtype.INT2)
FBGEMM_DTYPES = (RowDtype.FP32, RowDtype.FP16, *INT_DTYPES)


def _fbgemm():
    try:
        return (
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_inference"),
            importlib.import_module("fbgemm_gpu.split_table_batched_embeddings_ops_common"),
            importlib.import_module("fbgemm_gpu.split_embedding_configs"),
        )
    except ImportError:
        if IN_CI:
            pytest.fail("fbgemm_gpu does not import (CI needs it)")
        pytest.skip("fbgemm_gpu not installed")


def test_bytes_per_row_are_fbgemms():
    assert [row_bytes(d, 128) for d in RowDtype] == [512, 256, 256, 132, 68, 36]
    ops, _, configs = _fbgemm()
    for d in FBGEMM_DTYPES:
        for dim in (8, 16, 128, 200):
            fb = ops.rounded_row_size_in_bytes(dim, configs.SparseType(d.value), 1)
            assert row_bytes(d, dim) == fb, (d, dim)


def test_worked_example_bytes():
    w = torch.tensor([[-1.0, -0.5, 0.0, 6.5]])
    rows = quantize_rows(w, RowDtype.INT4)
    assert rows.tolist() == [[0x00, 0x38, 0x00, 0xBC, 0x10, 0xF2]]
    assert torch.equal(dequantize_rows(rows, RowDtype.INT4, 4), w)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_rows_round_trip_exactly(dtype):
    """A row bias + k, k in [0, 2**bits - 1] with both ends present, has scale 1: exact."""
    g = torch.Generator().manual_seed(1)
    levels = (1 << dtype.bits) - 1
    k = torch.randint(0, levels + 1, (50, 32), generator=g).float()
    k[:, 0], k[:, 1] = 0, levels
    w = k + torch.randint(-300, 300, (50, 1), generator=g).float()
    rows = quantize_rows(w, dtype)
    scale, _ = scale_bias(rows)
    assert torch.equal(scale, torch.ones(50, dtype=torch.float16))
    assert torch.equal(dequantize_rows(rows, dtype, 32), w)


@pytest.mark.parametrize("dtype", [RowDtype.FP32, RowDtype.FP16, RowDtype.BF16])
def test_float_rows_round_trip_exactly(dtype):
    w = torch.randint(-256, 257, (20, 8)).float()
    assert torch.equal(dequantize_rows(quantize_rows(w, dtype), dtype, 8), w)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("magnitude", [1e-4, 0.05, 1.0, 300.0, 1e4])
def test_error_within_half_a_scale(dtype, magnitude):
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(500, 64, generator=g) * 2 - 1) * magnitude
    w += torch.randn(500, 1, generator=g) * magnitude / 3
    w[0] = 0.25 * magnitude  # a constant row (scale 1)
    rows = quantize_rows(w, dtype)
    scale, bias = (t.float()[:, None] for t in scale_bias(rows))
    err = (dequantize_rows(rows, dtype, 64) - w).abs()
    # the dequantization's own float32 rounding: a few ulps of the values involved
    slack = 4 * torch.finfo(torch.float32).eps * (w.abs() + bias.abs() + scale * 255)
    assert bool((err <= scale / 2 + slack).all()), float((err - scale / 2).max())


def test_errors_name_the_table():
    what = "table 't3' (sparse/t3/emb_vector)"
    nan = torch.zeros(4, 8)
    nan[2, 5] = float("nan")
    with pytest.raises(RowFormatError, match=r"table 't3' \(sparse/t3/emb_vector\): row 2 "):
        quantize_rows(nan, RowDtype.INT8, what)
    with pytest.raises(RowFormatError, match="t3.*does not fit fp16"):
        quantize_rows(torch.full((2, 8), 7e4), RowDtype.FP16, what)
    with pytest.raises(RowFormatError, match="t3.*row minimum.*does not fit int4"):
        quantize_rows(torch.full((2, 8), -7e4), RowDtype.INT4, what)
    span = torch.zeros(1, 8)
    span[0, 1] = 7e4 * 255  # the int8 scale overflows float16; fp32 holds it
    with pytest.raises(RowFormatError, match="t3.*row 0 spans.*overflows float16"):
        quantize_rows(span, RowDtype.INT8, what)
    with pytest.raises(RowFormatError, match="t3.*multiple of 4; got 6"):
        quantize_rows(torch.zeros(2, 6), RowDtype.INT2, what)
    with pytest.raises(RowFormatError, match=r"t3.*int8 rows of width 8 are 12 bytes, got 13"):
        check_rows(torch.zeros(3, 13, dtype=torch.uint8), RowDtype.INT8, 8, what)
    rows = quantize_rows(torch.rand(3, 8), RowDtype.INT8)
    for bad in (float("nan"), float("inf")):
        corrupt = rows.clone()
        corrupt[1, 2:4] = torch.tensor([bad], dtype=torch.float16).view(torch.uint8)
        with pytest.raises(RowFormatError, match=r"t3.*row 1 has scale .* and bias (nan|inf)"):
            check_rows(corrupt, RowDtype.INT8, 8, what)
    with pytest.raises(ValueError, match="'int3' is not a valid RowDtype"):
        RowDtype("int3")


def _tbe_with_rows(rows: torch.Tensor, dtype: RowDtype, dim: int, mode: str):
    ops, common, configs = _fbgemm()
    tbe = ops.IntNBitTableBatchedEmbeddingBagsCodegen(
        [("t", rows.shape[0], dim, configs.SparseType(dtype.value), common.EmbeddingLocation.HOST)],
        device="cpu",
        pooling_mode=common.PoolingMode.SUM if mode == "sum" else common.PoolingMode.MEAN,
        output_dtype=configs.SparseType.FP32,
    )
    tbe.initialize_weights()
    ((whole, _, _),) = tbe.split_embedding_weights_with_scale_bias(0)
    whole.copy_(rows)  # ours, byte for byte, as FBGEMM's table
    return tbe


def _bags(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (32,), generator=g)
    ids = torch.randint(0, num_rows, (int(lengths.sum()),), generator=g)
    return ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def _pool(vectors: torch.Tensor, ids: torch.Tensor, ends: torch.Tensor, mode: str) -> torch.Tensor:
    return torch.nn.functional.embedding_bag(ids, vectors, ends[:-1], mode=mode)


@pytest.mark.parametrize("dtype", FBGEMM_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_our_rows_in_fbgemms_kernel(dtype, mode):
    """Integer-valued rows (exact in every dtype): FBGEMM's pooled bags equal ours exactly;
    random rows: equal to float32 rounding."""
    levels = (1 << dtype.bits) - 1 if dtype.quantized else 255
    g = torch.Generator().manual_seed(3)
    exact = torch.randint(0, levels + 1, (40, 16), generator=g).float()
    exact[:, 0], exact[:, 1] = 0, levels
    exact -= torch.randint(0, 9, (40, 1), generator=g).float()
    ids, ends = _bags(40, 4)
    # a mean divides by the bag's length (FBGEMM) or multiplies by its inverse: one ulp
    exact_tol = 0.0 if mode == "sum" else 2.5e-7
    for w, tol in ((exact, exact_tol), (torch.randn(40, 16, generator=g), 1e-5)):
        rows = quantize_rows(w, dtype)
        got = _tbe_with_rows(rows, dtype, 16, mode)(ids, ends)
        want = _pool(dequantize_rows(rows, dtype, 16), ids, ends, mode)
        torch.testing.assert_close(got, want, rtol=tol, atol=0 if w is exact else tol)
        if w is exact and mode == "sum":
            assert torch.equal(got, _pool(w, ids, ends, mode))


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_fbgemm_quantized_rows_load_into_ours(dtype):
    """FBGEMM's quantizer (scale, bias at the row's end) → ours: the same values as FBGEMM's
    dequantizer and the same pooled bags as FBGEMM's kernel over its own rows."""
    _fbgemm()
    w = torch.randn(40, 16, generator=torch.Generator().manual_seed(5))
    theirs = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, dtype.bits)
    rows = scale_bias_to_front(theirs)
    check_rows(rows, dtype, 16)
    assert torch.equal(scale_bias_to_back(rows), theirs)
    want = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloatOrHalf(theirs, dtype.bits, 0)
    torch.testing.assert_close(dequantize_rows(rows, dtype, 16), want, rtol=0, atol=1e-6)
    ids, ends = _bags(40, 6)
    pooled = _tbe_with_rows(rows, dtype, 16, "sum")(ids, ends)
    torch.testing.assert_close(pooled, _pool(want, ids, ends, "sum"), rtol=1e-5, atol=1e-5)


def test_importing_the_leaf_imports_nothing_else_of_hps():
    code = (
        "import sys, hps.rowformat; "
        "print(sorted(m for m in sys.modules if m == 'hps' or m.startswith('hps.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout
    assert out.strip() == "['hps', 'hps.rowformat']"


def test_row_files_round_trip_and_bad_files_name_table_and_file(tmp_path):
    from hps.rowformat import read_row_file, write_row_file

    rows = quantize_rows(torch.randn(6, 8), RowDtype.INT4)
    path = write_row_file(tmp_path / "emb_vector", rows)
    assert path.stat().st_size == 6 * 8 and not list(tmp_path.glob(".*"))
    assert torch.equal(read_row_file(path, RowDtype.INT4, 8, "t1"), rows)
    short = tmp_path / "short"
    short.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(RowFormatError, match=r"table 't1' \(.*short\): 45 bytes is not a whole"):
        read_row_file(short, RowDtype.INT4, 8, "t1")
    corrupt = rows.clone()
    corrupt[4, 0:2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    write_row_file(tmp_path / "nan", corrupt)
    with pytest.raises(RowFormatError, match=r"table 't1' \(.*nan\): row 4 has scale nan"):
        read_row_file(tmp_path / "nan", RowDtype.INT4, 8, "t1")
