"""The compiled fused backward of FP16/BF16 tables (:mod:`embark.training.half_kernel`): the
same random bits as the reference (:func:`counter_bits`), the same rows and state bit for
bit as the pure-torch path (:func:`row_gradients` + :meth:`RowOptimizer.apply_`) on dyadic
and on random gradients (both sum in the same order), unbiased, saturating, and independent
of the thread count; the reference on a CUDA table."""

from __future__ import annotations

import os

import pytest
import torch

import embark.training.fused as fused
import embark.training.sparse_rows as sparse_rows
from embark.training.config import EmbeddingKernel, EmbeddingOptimizerKind, TableRounding
from embark.training.half_kernel import fits_sort_key, fused_half_backward, load_extension
from embark.training.rounding import counter_bits, rounding_bits, stochastic_round_reference
from embark.training.sparse_rows import RowOptimizer, row_gradients, row_mean_squares

HALF = [torch.float16, torch.bfloat16]
KINDS = list(EmbeddingOptimizerKind)


@pytest.fixture(scope="module")
def ext():
    mod = load_extension()
    if mod is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                "the embark compiled kernel could not be built (python -m embark.build_ext -v)"
            )
        pytest.skip("the embark compiled kernel is not built")
    return mod


def _weights(rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of every kind the rounding treats apart: ordinary values, values whose update lands
    among FP16 subnormals, values at FP16's max, inf and NaN."""
    w = torch.randn(rows, dim, generator=gen) * 0.1
    w[1] = torch.randn(dim, generator=gen) * 3e-6  # FP16 subnormals after a 1e-6 step
    w[2] = 65504.0
    w[3, 0], w[3, 1], w[3, 2] = float("inf"), -float("inf"), float("nan")
    return w.to(dtype)


def _case(rows: int, dim: int, dtype: torch.dtype, mean: bool, seed: int):
    """Weights, bags and a dyadic gradient: multiples of 2^-12 below 2^-6 in magnitude, bags of
    1, 2 or 4 ids (a mean divides by a power of two): every gradient sum, square and row-wise
    mean is exact in float32, so the two paths see the same float32 values."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 2, 4])[torch.randint(0, 3, (48,), generator=gen)]
    lengths[5] = 0 if not mean else 1  # an empty bag (sum pooling)
    ids = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    ids[:4] = torch.tensor([1, 2, 3, 1])  # the awkward rows are touched
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    grad = torch.randint(-63, 64, (48, dim), generator=gen).float() * 2.0**-12
    return _weights(rows, dim, dtype, gen), ids, offsets, grad


def _state_tensor(state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return next(iter(state.values()), None)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mean", [False, True])
def test_fused_backward_equals_the_reference_bit_for_bit(ext, dtype, kind, mean):
    # three steps, dim 20 (two 8-wide groups and a scalar tail): weights and state equal
    # exactly, the keys differing per step
    rows, dim = 40, 20
    w0, ids, offsets, grad = _case(rows, dim, dtype, mean, seed=11)
    # FP16: steps below 2^-14, so row 1 lands among the subnormals under every update
    opt = RowOptimizer(kind, lr=2e-5 if dtype == torch.float16 else 0.05, eps=1e-8)
    fast_w, ref_w = w0.clone(), w0.clone()
    fast_s, ref_s = opt.new_state(rows, dim), opt.new_state(rows, dim)
    for key in (7, 2**62 + 5, 12345):
        assert fused_half_backward(
            grad,
            ids,
            offsets,
            mean,
            fast_w,
            _state_tensor(fast_s),
            kind.value,
            opt.lr,
            opt.eps,
            key,
        )
        touched, row_grads = row_gradients(grad, ids, offsets, mean)
        opt.apply_(ref_w, ref_s, touched, row_grads, TableRounding.STOCHASTIC, key)
    assert torch.equal(fast_w.view(torch.int16), ref_w.view(torch.int16))
    for k in ref_s:
        assert torch.equal(fast_s[k], ref_s[k])
    moved = (fast_w.float() != w0.float()) & w0.float().isfinite()
    untouched = [r for r in range(rows) if r not in ids]
    assert moved.any() and untouched and not moved[untouched].any()
    assert fast_w[3, 0] == float("inf") and fast_w[3, 2].isnan()
    if dtype == torch.float16:
        assert (fast_w[1].float().abs() < 2.0**-14).any()  # subnormal results were made


@pytest.mark.parametrize("dtype", HALF)
def test_a_step_past_the_largest_value_saturates(ext, dtype):
    # ±max pushed 0.2% further out (still finite in float32) by SGD (lr 1), every column a different random draw: ±max
    # always, never inf, and the reference's result
    fmax = torch.finfo(dtype).max
    w = torch.tensor([[fmax] * 64, [-fmax] * 64], dtype=dtype)
    grad = torch.tensor([[-0.002 * fmax] * 64, [0.002 * fmax] * 64])
    want = stochastic_round_reference(
        w.float() - grad, dtype, counter_bits(21, torch.arange(2), 64)
    )
    fused_half_backward(grad, torch.arange(2), torch.arange(2), False, w, None, "sgd", 1.0, 0.0, 21)
    assert torch.equal(w.float().abs(), torch.full((2, 64), fmax))
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dim", [128, 21])
def test_fused_backward_random_gradients_equal_the_reference_bit_for_bit(ext, dim):
    # non-dyadic gradients, mean pooling over bags of 3: the reference sums a row's squared
    # gradient in the kernel's order (row_mean_squares), so state and rows agree exactly
    gen = torch.Generator().manual_seed(3)
    rows = 300
    w0 = (torch.randn(rows, dim, generator=gen) * 0.05).half()
    ids = torch.randint(0, rows, (256 * 3,), generator=gen)
    offsets = torch.arange(0, 256 * 3, 3)
    grad = torch.randn(256, dim, generator=gen) * 0.01
    opt = RowOptimizer(EmbeddingOptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
    fast_w, ref_w = w0.clone(), w0.clone()
    fast_s, ref_s = opt.new_state(rows, dim), opt.new_state(rows, dim)
    for key in (9, 10):
        fused_half_backward(
            grad, ids, offsets, True, fast_w, fast_s["row_sum"], "rowwise_adagrad", 0.05, 1e-8, key
        )
        touched, row_grads = row_gradients(grad, ids, offsets, True)
        opt.apply_(ref_w, ref_s, touched, row_grads, TableRounding.STOCHASTIC, key)
    assert torch.equal(fast_s["row_sum"], ref_s["row_sum"])
    assert torch.equal(fast_w.view(torch.int16), ref_w.view(torch.int16))
    # torch's mean sums in another order: the fixed order is what makes them equal
    assert not torch.equal(row_mean_squares(row_grads), row_grads.square().mean(1))


def _f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def test_row_mean_squares_is_the_mean_in_the_kernels_order():
    # dim 21: two groups of 8 in lanes, 5 tail values. The order written out in Python floats,
    # each step rounded to float32 (the exact float64 sum or quotient of float32 values rounds
    # to the float32 one), equals the vectorized one; both are the mean within rounding
    g = torch.randn(6, 21, generator=torch.Generator().manual_seed(2))
    got = row_mean_squares(g)
    q = (g * g).tolist()
    for i, row in enumerate(q):
        lanes = [_f32(row[j] + row[8 + j]) for j in range(8)]
        pair = [_f32(lanes[2 * k] + lanes[2 * k + 1]) for k in range(4)]
        total = _f32(_f32(pair[0] + pair[1]) + _f32(pair[2] + pair[3]))
        for d in range(16, 21):
            total = _f32(total + row[d])
        assert got[i].item() == _f32(total / 21)
    torch.testing.assert_close(got, g.square().mean(1))


@pytest.mark.parametrize("dim", [1, 6, 130])
def test_counter_bits_are_the_kernels_and_a_function_of_key_row_and_column(ext, dim):
    rows = torch.tensor([0, 1, 5, 2**40 + 3, 1])
    for key in (0, 1, 2**63 - 1):
        bits = counter_bits(key, rows, dim)
        assert bits.shape == (5, dim) and bits.dtype == torch.int32
        assert torch.equal(ext.counter_bits(key, rows, dim), bits)
        assert torch.equal(bits[1], bits[4]) and not torch.equal(bits[0], bits[1])
        assert ((bits >= 0) & (bits < 2**16)).all()
    assert not torch.equal(counter_bits(1, rows, dim), counter_bits(2, rows, dim))
    with pytest.raises(ValueError, match="2\\^63"):
        counter_bits(-1, rows, dim)


def test_counter_bits_are_uniform():
    # 2^20 values' 13 low bits: each bit set half the time (5 standard errors of 2^20 draws)
    bits = counter_bits(99, torch.arange(8192), 128).reshape(-1)
    for b in range(16):
        share = bits.bitwise_right_shift(b).bitwise_and(1).float().mean().item()
        assert abs(share - 0.5) < 5 * 0.5 / 2**10, (b, share)


@pytest.mark.parametrize("dtype", HALF)
def test_fused_stochastic_rounding_is_unbiased(ext, dtype):
    # rows at 1 + f ulp after one SGD step from 1: each lands on 1 or 1 + ulp, and the mean
    # over 4096 rows × 8 columns is 1 + f ulp within 5 standard errors
    ulp = 2.0 ** (rounding_bits(dtype) - 23)
    rows, dim = 4096, 8
    for f in (0.1, 0.5, 0.95):
        w = torch.ones(rows, dim, dtype=dtype)
        grad = torch.full((rows, dim), -f * ulp)  # lr 1: w = 1 + f ulp before rounding
        fused_half_backward(
            grad, torch.arange(rows), torch.arange(rows), False, w, None, "sgd", 1.0, 0.0, 4
        )
        got = w.float()
        assert set(got.unique().tolist()) <= {1.0, 1.0 + ulp}
        bias = (got.mean().item() - 1.0) / ulp - f
        assert abs(bias) <= 5 * (f * (1 - f) / (rows * dim)) ** 0.5, (f, bias)


def test_fused_update_is_the_same_on_one_or_two_threads(ext):
    gen = torch.Generator().manual_seed(8)
    w0 = (torch.randn(5000, 64, generator=gen) * 0.1).bfloat16()
    ids = torch.randint(0, 5000, (4096,), generator=gen)
    grad = torch.randn(4096, 64, generator=gen)
    out = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            w, s = w0.clone(), torch.zeros(5000, 64)
            fused_half_backward(grad, ids, torch.arange(4096), False, w, s, "adagrad", 0.1, 1e-8, 3)
            out.append((w, s))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0][0].view(torch.int16), out[1][0].view(torch.int16))
    assert torch.equal(out[0][1], out[1][1])


_W = torch.zeros(4, 8, dtype=torch.float16)
_I, _O = torch.tensor([0, 1]), torch.tensor([0, 1])
#: bad input -> (ids, offsets, weight, state, kind, the error it raises: names the table and
#: the bad value)
BAD_INPUT = {
    "id": (torch.tensor([0, 9]), _O, _W, None, "sgd", "table 'clicks': id 9 at position 1 outside its 4 rows"),
    "ids dtype": (_I.int(), _O, _W, None, "sgd", "ids must be .* int64, got \\[2\\] int"),
    "offset": (_I, torch.tensor([0, 5]), _W, None, "sgd", "bag 0 starts at 0 and ends at 5"),
    "first offset": (_I, torch.tensor([1, 1]), _W, None, "sgd", "offsets must start at 0, got 1"),
    "weight dtype": (_I, _O, _W.float(), None, "sgd", "float16 or bfloat16 table, got \\[4, 8\\] float"),
    "no state": (_I, _O, _W, None, "adagrad", "'clicks': adagrad needs its float32 state, got none"),
    "state dtype": (_I, _O, _W, torch.zeros(4).double(), "rowwise_adagrad", "rowwise_adagrad needs its state contiguous float32, got double"),
    "state size": (_I, _O, _W, torch.zeros(5), "rowwise_adagrad", "rowwise_adagrad state has 5 values, expected 4"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_fused_backward_refuses_bad_input_naming_the_value(ext, case):
    ids, offsets, weight, state, kind, message = BAD_INPUT[case]
    with pytest.raises(RuntimeError, match=message):
        fused_half_backward(
            torch.zeros(2, 8), ids, offsets, False, weight, state, kind, 0.1, 0.0, 1, "clicks"
        )


def test_fused_backward_refuses_an_unknown_optimizer(ext):
    with pytest.raises(ValueError, match="got 'momentum'"):
        fused_half_backward(torch.zeros(2, 8), _I, _O, False, _W, None, "momentum", 0.1, 0.0, 1)


@pytest.mark.parametrize("dtype", HALF)
def test_table_update_trains_alike_with_and_without_the_kernel(ext, dtype, monkeypatch):
    # the table's module: the compiled path and the reference path (kernel unavailable) draw
    # the same key per backward from the table's generator and sum in the same order, so 3
    # steps of random (non-dyadic) gradients with mean pooling give the same rows and state:
    # a run that resumes on the other path continues bit for bit
    rows, dim = 40, 20
    w0, ids, offsets, _ = _case(rows, dim, dtype, True, seed=4)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(offsets.numel(), dim, generator=gen) * 0.3 for _ in range(3)]
    real = fused.fused_half_backward
    calls: list[torch.dtype] = []

    def counted(grad, ids, offsets, mean, weight, *rest):
        calls.append(weight.dtype)
        return real(grad, ids, offsets, mean, weight, *rest)

    monkeypatch.setattr(fused, "fused_half_backward", counted)
    out = []
    for built in (True, False):
        if not built:
            monkeypatch.setattr(fused, "load_extension", lambda: None)
        opt = RowOptimizer(EmbeddingOptimizerKind.ROWWISE_ADAGRAD, lr=0.01)
        upd = fused.SparseTableUpdate("t", rows, dim, opt, EmbeddingKernel.AUTO, seed=1)
        w = w0.clone()
        for g in grads:
            upd(w, ids, offsets, "mean").backward(g)
        out.append((w, upd.row_sum.clone()))
        # the built pass ran the compiled kernel once per backward, the other pass never
        assert calls == [dtype] * len(grads)
    assert torch.equal(out[0][0].view(torch.int16), out[1][0].view(torch.int16))
    assert torch.equal(out[0][1], out[1][1])
    assert not torch.equal(out[0][0].view(torch.int16), w0.view(torch.int16))


def test_reference_update_rounds_chunk_by_chunk_with_the_rows_bits():
    # more rows than one chunk of the reference's update: each row rounded with its own bits
    rows = 2 * 2048 + 7
    w = (torch.randn(rows, 4, generator=torch.Generator().manual_seed(1)) * 0.1).half()
    grad = torch.full((rows, 4), 1e-3)
    want = stochastic_round_reference(
        w.float() - 1e-3, torch.float16, counter_bits(5, torch.arange(rows), 4)
    )
    opt = RowOptimizer(EmbeddingOptimizerKind.SGD, lr=1.0)
    opt.apply_(w, {}, torch.arange(rows), grad, TableRounding.STOCHASTIC, 5)
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


class _CpuBits:
    """Stands for counter_bits' CPU tensor: records the device it is moved to."""

    def __init__(self, bits: torch.Tensor, moved: list[torch.device]) -> None:
        self.bits, self.moved = bits, moved

    def to(self, device: torch.device) -> torch.Tensor:
        self.moved.append(device)
        return self.bits.to(device)


def test_reference_update_moves_the_bits_to_the_rows_device(monkeypatch):
    # counter_bits computes on the CPU; a CUDA table's rows are on CUDA: the update hands
    # the rounding the bits moved to the rows' device (here the CPU), and rounds with them
    moved: list[torch.device] = []
    monkeypatch.setattr(
        sparse_rows, "counter_bits", lambda k, r, d: _CpuBits(counter_bits(k, r, d), moved)
    )
    w = (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)) * 0.1).half()
    want = stochastic_round_reference(
        w.float() - 1e-3, torch.float16, counter_bits(5, torch.arange(6), 4)
    )
    opt = RowOptimizer(EmbeddingOptimizerKind.SGD, lr=1.0)
    opt.apply_(w, {}, torch.arange(6), torch.full((6, 4), 1e-3), TableRounding.STOCHASTIC, 5)
    assert moved == [w.device]
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_table_rounds_stochastically_on_the_reference_path(kind):
    # a CUDA table takes the reference path: its bits come from the CPU and are moved over;
    # the rows agree with the CPU table's within one unit in the last place
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(6)
    w0 = (torch.randn(50, 24, generator=gen) * 0.1).half()
    rows = torch.tensor([0, 3, 7, 49])
    grads = torch.randn(4, 24, generator=gen) * 0.01
    opt = RowOptimizer(kind, lr=0.05)
    out = []
    for device in ("cpu", "cuda"):
        w, state = w0.to(device), {k: v.to(device) for k, v in opt.new_state(50, 24).items()}
        opt.apply_(w, state, rows.to(device), grads.to(device), TableRounding.STOCHASTIC, 17)
        out.append(w.cpu().float())
    ulp = torch.finfo(torch.float16).eps * out[0].abs().clamp(min=2.0**-14)
    assert ((out[0] - out[1]).abs() <= ulp).all()
    assert not torch.equal(out[0], w0.float())


_M64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix_finalizer(z: int) -> int:
    """SplitMix64's finalizer on Python ints (the published constants), written apart from
    both implementations under test."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _bit_of(key: int, row: int, col: int) -> int:
    h = _splitmix_finalizer(key ^ _splitmix_finalizer((row + _GOLDEN) & _M64))
    word = _splitmix_finalizer((h + (col // 4 + 1) * _GOLDEN) & _M64)
    return (word >> (16 * (col % 4))) & 0xFFFF


#: (key, row, col) -> the value counter_bits gives: pinned, so a change to both the kernel's
#: and the reference's bits (which would leave them equal) still fails
PINNED_BITS = {
    (0, 0, 0): 1516,
    (1, 7, 5): 17882,
    (2**63 - 1, 2**40 + 3, 130): 32859,
    (12345, 99, 3): 36399,
}


def test_counter_bits_are_pinned_to_fixed_values(ext):
    for (key, row, col), want in PINNED_BITS.items():
        assert _bit_of(key, row, col) == want
        rows = torch.tensor([row])
        assert counter_bits(key, rows, col + 1)[0, col].item() == want
        assert ext.counter_bits(key, rows, col + 1)[0, col].item() == want


def test_counter_bits_of_no_rows_are_empty(ext):
    none = torch.zeros(0, dtype=torch.int64)
    for dim in (0, 3, 8):
        assert counter_bits(4, none, dim).shape == (0, dim)
        assert ext.counter_bits(4, none, dim).shape == (0, dim)


def test_fits_sort_key_is_the_kernels_range():
    # pos_bits = max(1, ceil(log2 nnz)); rows up to 2^(63 - pos_bits)
    assert fits_sort_key(2**62, 2) and not fits_sort_key(2**62 + 1, 2)
    assert fits_sort_key(2**61, 4) and not fits_sort_key(2**61, 5)
    assert fits_sort_key(2**60, 5) and fits_sort_key(10, 1)


@pytest.mark.parametrize("case", ["int32 ids", "strided state", "sort key"])
def test_table_falls_back_to_the_reference_where_the_kernel_would_refuse(ext, case, monkeypatch):
    # ids not int64, a non-contiguous state, or rows × ids past the 63-bit sort key: the
    # backward takes the reference path instead of raising (int32 ids: the kernel may run on
    # the reference's int64 distinct rows), and updates the table as the reference does
    rows, dim = 40, 20
    real = fused.fused_half_backward
    calls: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def checked(grad, ids, offsets, mean, weight, state, *rest):
        calls.append((ids.dtype, offsets.dtype, state.is_contiguous()))
        return real(grad, ids, offsets, mean, weight, state, *rest)

    w0, ids, offsets, grad = _case(rows, dim, torch.float16, False, seed=2)
    out = []
    for fallback in (True, False):
        opt = RowOptimizer(EmbeddingOptimizerKind.ROWWISE_ADAGRAD, lr=0.01)
        upd = fused.SparseTableUpdate("t", rows, dim, opt, EmbeddingKernel.AUTO, seed=1)
        i, o = ids, offsets
        if fallback and case == "int32 ids":
            i, o = ids.int(), offsets.int()
        if fallback and case == "strided state":
            upd.row_sum = torch.zeros(2 * rows)[::2]
        with monkeypatch.context() as m:
            if fallback and case == "sort key":
                m.setattr(fused, "fits_sort_key", lambda num_rows, nnz: False)
            if fallback:
                m.setattr(fused, "fused_half_backward", checked)
            else:
                m.setattr(fused, "load_extension", lambda: None)
            w = w0.clone()
            upd(w, i, o, "sum").backward(grad)
        out.append((w, upd.row_sum.clone()))
    assert torch.equal(out[0][0].view(torch.int16), out[1][0].view(torch.int16))
    assert torch.equal(out[0][1], out[1][1])
    assert all(c == (torch.int64, torch.int64, True) for c in calls)
    assert len(calls) == (1 if case == "int32 ids" else 0)
