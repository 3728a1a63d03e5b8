"""The one tolerance table of the test suite: ``(what is compared, dtype) -> rtol, atol``.

Every numerical test compares against a reference (a dense GEMM, the single-process trainer,
eager PyTorch) with ``torch.testing.assert_close(got, want, **tol(what, dtype))`` or
``np.testing.assert_allclose(got, want, **tol(what))``. A bound says why it is that wide;
where a figure was observed it is quoted, so a loosened bound is a visible change here.
Masks, layouts, byte counts and integer-valued cases are compared exactly, not through this.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # One TW GEMM (a kernel, the op, TileSparseLinear) against the dense masked matmul of the
    # same dtype. fp32 worst observed 3.8e-6 abs / 6.9e-5 rel over the tolerance cases; the
    # 16-bit and fp64 bounds leave room for another summation order (eps fp16 9.8e-4, fp64
    # 2.2e-16; outputs |y| <= 50 at K <= 300).
    ("tw_gemm", torch.float64): (1e-10, 1e-10),
    ("tw_gemm", torch.float32): (1e-4, 1e-4),
    ("tw_gemm", torch.bfloat16): (2e-2, 5e-2),
    ("tw_gemm", torch.float16): (5e-3, 1e-2),
    # A layer small enough that only the tile-by-tile summation order differs.
    ("tw_layer", torch.float64): (1e-12, 1e-12),
    ("tw_layer", torch.float32): (1e-5, 1e-5),
    # A compressed model of two small layers (K <= 96) against the masked dense model: the
    # tile-by-tile summation order differs in two layers only.
    ("tw_two_layers", torch.float32): (1e-5, 1e-6),
    # A whole compressed model against the masked dense model: 14 layers deep (fp32: another
    # summation order per layer; bf16: ~8 mantissa bits per layer, against the fp32 model).
    ("tw_model", torch.float32): (1e-4, 1e-5),
    ("tw_model", torch.bfloat16): (5e-2, 5e-2),
    # A CUTLASS TW kernel on tensor cores (fp32 accumulation) against its CPU emulation.
    ("cutlass", torch.float16): (1e-2, 1e-2),
    ("cutlass", torch.bfloat16): (4e-2, 4e-2),
    # One embedding exchange with 16-bit vectors on the wire against fp32 (absolute bound on
    # pooled vectors and gradients of magnitude <= 1).
    ("wire", torch.float16): (0.0, 5e-3),
    ("wire", torch.bfloat16): (0.0, 3e-2),
    # Sharded training after 5 steps against the single-process trainer on the global batch:
    # fp32 observed max |diff| 5e-8 (worlds 2 and 4); 16-bit wires observed 3.8e-3 (fp16,
    # world 4) and 7.7e-4 (bf16).
    ("sharded_train", torch.float32): (0.0, 1e-5),
    ("sharded_train_16bit_wire", torch.float32): (0.0, 1e-2),
    # One SUM over 4 ranks in two orders (node by node against gloo's flat ring): addends
    # |x| <= 1, so the two orders differ by at most 3 roundings of a sum <= 4 (3 · 4 · 2^-24
    # ≈ 7.2e-7); the bound leaves room for a tie rounded the other way.
    ("allreduce_order", torch.float32): (0.0, 2e-6),
    # The exported ONNX graph in onnxruntime against eager PyTorch.
    ("onnx", torch.float32): (1e-4, 1e-5),
    # A served model (HPS lookups + onnxruntime) against eager PyTorch.
    ("served", torch.float32): (1e-5, 1e-6),
}


def tol(what: str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """``{"rtol", "atol"}`` for comparing ``what`` in ``dtype``.

    Raises:
        KeyError: naming the pair and the table's entries, for a pair without a bound.
    """
    try:
        rtol, atol = TOLERANCES[(what, dtype)]
    except KeyError:
        raise KeyError(
            f"no tolerance for ({what!r}, {dtype}); the table has {sorted(map(str, TOLERANCES))}"
        ) from None
    return {"rtol": rtol, "atol": atol}
