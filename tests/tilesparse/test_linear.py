from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tolerances import tol
from tilesparse.linear import TileSparseLinear
from tilesparse.patterns import tw_mask

# assert_close tolerances per dtype for the tile-by-tile reference vs. the masked dense GEMM


def int_linear(
    k: int, n: int, seed: int, bias: bool = True, dtype: torch.dtype = torch.float32
) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-4, 5, (n, k), generator=g))
        if bias:
            lin.bias.copy_(torch.randint(-4, 5, (n,), generator=g))
    return lin


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 40),
    st.integers(1, 16),
    st.floats(0.0, 0.95),
    st.booleans(),
    st.integers(0, 1000),
)
def test_round_trip_and_forward_exact(k, n, tile, sparsity, bias, seed) -> None:
    lin = int_linear(k, n, seed, bias)
    mask = tw_mask(lin.weight.detach().T.abs() + 1e-3 * torch.rand(k, n), sparsity, tile)
    sparse = TileSparseLinear.from_dense(lin, mask=mask.T, tile=tile, backend="reference")
    sparse.layout.validate()
    assert torch.equal(sparse.mask(), mask.T)
    dense = sparse.to_dense()
    assert torch.equal(dense.weight, lin.weight * mask.T)
    assert torch.equal(sparse.mask_kn(), mask)
    if bias:
        assert torch.equal(dense.bias, lin.bias)
    x = torch.randint(-3, 4, (5, k)).float()  # integer-valued: both paths exact
    ref = torch.nn.functional.linear(x, lin.weight * mask.T, lin.bias)
    assert torch.equal(sparse(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_random_values_and_batch_dims(dtype) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(37, 53, dtype=dtype)
    mask = tw_mask(lin.weight.detach().T.abs().float(), 0.75, 16)
    sparse = TileSparseLinear.from_dense(lin, mask_kn=mask, tile=16, backend="reference")
    x = torch.randn(2, 3, 37, dtype=dtype)
    ref = torch.nn.functional.linear(x, lin.weight * mask.T, lin.bias)
    torch.testing.assert_close(sparse(x), ref, **tol("tw_layer", dtype))


def test_state_dict_round_trip_into_an_empty_module() -> None:
    lin = int_linear(30, 20, 1)
    mask = tw_mask(lin.weight.detach().T.abs() + 0.5, 0.6, 8)
    sparse = TileSparseLinear.from_dense(lin, mask_kn=mask, tile=8)
    buf = io.BytesIO()
    torch.save(sparse.state_dict(), buf)
    buf.seek(0)
    fresh = TileSparseLinear(30, 20, tile=128)
    assert fresh.nnz == 0 and fresh.layout.num_tiles == 0
    fresh.load_state_dict(torch.load(buf))
    assert fresh.tile == 8 and fresh.nnz == sparse.nnz
    for name in ("col_idx", "tile_ptr", "row_idx", "row_ptr", "values", "val_ptr", "bias"):
        assert torch.equal(getattr(fresh, name), getattr(sparse, name))
    assert fresh.layout.values is fresh.values  # the layout is rebuilt over the new buffers
    x = torch.randint(-3, 4, (4, 30)).float()
    assert torch.equal(fresh(x), sparse(x))
    with pytest.raises(ValueError, match="state dict holds a 30x20"):
        TileSparseLinear(31, 20).load_state_dict(sparse.state_dict())


def test_layout_is_the_buffers_and_follows_to() -> None:
    sparse = TileSparseLinear.from_dense(
        int_linear(8, 6, 2), mask_kn=torch.ones(8, 6, dtype=torch.bool), tile=4
    )
    lay = sparse.layout
    assert lay is sparse.layout and lay.values is sparse.values and lay.col_idx is sparse.col_idx
    lay.cache["cpu"] = "packed"
    sparse.to(torch.float64)
    assert sparse.layout is not lay and sparse.layout.cache == {}
    assert sparse.layout.values.dtype == torch.float64 and sparse.col_idx.dtype == torch.int64


def test_extra_repr_and_sparsity() -> None:
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:2, :4] = True
    sparse = TileSparseLinear.from_dense(int_linear(4, 6, 3, bias=False), mask_kn=mask, tile=2)
    assert sparse.sparsity == pytest.approx(1 - 8 / 24)
    assert repr(sparse) == (
        "TileSparseLinear(in_features=4, out_features=6, tile=2, tiles=2, kept_columns=4/6, "
        "nnz=8/24 (sparsity 66.7%), bias=False, backend=auto)"
    )


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="tile must be a positive integer, got 0"):
        TileSparseLinear(4, 4, tile=0)
    lin = torch.nn.Linear(3, 2)  # weight (2, 3)
    with pytest.raises(
        ValueError,
        match=r"mask_kn must be \(in, out\) = \(3, 2\).*got \(2, 3\); a \(out, in\) mask is passed as mask=",
    ):
        TileSparseLinear.from_dense(lin, mask_kn=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(
        ValueError,
        match=r"mask must be \(out, in\) = \(2, 3\).*\(in, out\) would be \(3, 2\).*got \(3, 2\); a \(in, out\) mask is passed as mask_kn=",
    ):
        TileSparseLinear.from_dense(lin, mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(
        ValueError,
        match=r"mask must be \(out, in\) = \(2, 3\) for this layer \(\(in, out\) would be \(3, 2\)\), got \(4, 4\)$",
    ):
        TileSparseLinear.from_dense(lin, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a 2-D bool tensor .* got torch.float32"):
        TileSparseLinear.from_dense(lin, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="exactly one mask"):
        TileSparseLinear.from_dense(lin)
    ones = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="exactly one mask"):
        TileSparseLinear.from_dense(lin, mask=ones, mask_kn=ones.T)


def test_mask_layouts_on_a_square_layer() -> None:
    """A square layer: ``mask=`` is (out, in), like ``weight``; ``mask_kn=`` is (in, out). Both
    give the same module, the masked dense layer is reproduced exactly, and a positional mask
    (whose layout a square shape cannot tell) is an error, not a guess."""
    lin = int_linear(4, 4, 11)
    mask = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.bool
    )  # (out, in): not symmetric, so the two readings differ
    a = TileSparseLinear.from_dense(lin, mask=mask, tile=2)
    with pytest.raises(ValueError, match="takes its mask by keyword"):
        TileSparseLinear.from_dense(lin, mask.T.contiguous(), tile=2)
    b = TileSparseLinear.from_dense(lin, mask_kn=mask.T.contiguous(), tile=2)
    assert torch.equal(a.to_dense().weight, lin.weight * mask)
    assert torch.equal(a.mask(), mask) and torch.equal(a.mask_kn(), mask.T)
    x = torch.randint(-3, 4, (3, 4)).float()
    assert torch.equal(a(x), b(x))
    assert torch.equal(a(x), torch.nn.functional.linear(x, lin.weight * mask, lin.bias))
    transposed = TileSparseLinear.from_dense(lin, mask_kn=mask, tile=2)  # the other reading
    assert not torch.equal(transposed(x), a(x))


def _two_tile_module() -> TileSparseLinear:
    """4x4, tile 2: tiles {0,1} with rows {0,1,2,3} and {2,3} with rows {0,1} (the reviewer's)."""
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2:, 2:] = False
    return TileSparseLinear.from_dense(int_linear(4, 4, 5), mask_kn=mask, tile=2)


def _snapshot(m: TileSparseLinear) -> dict[str, object]:
    state = {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
    return state | {"tile": m.tile}


def _assert_unchanged(
    m: TileSparseLinear, before: dict[str, object], x: torch.Tensor, y: torch.Tensor
) -> None:
    now = _snapshot(m)
    assert now.keys() == before.keys() and now["tile"] == before["tile"]
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(now[k], v), k
    assert torch.equal(m(x), y)


CORRUPT_STATE = [  # (name, {key: value}, expected message)
    (
        "negative_pointers",
        {"row_ptr": [-2, 2, 6], "val_ptr": [-4, 4, 12]},
        r"row_ptr must start at 0, got row_ptr\[0\]=-2",
    ),
    (
        "decreasing_pointer",
        {"row_ptr": [0, -2, 0], "val_ptr": [0, -4, 0]},
        r"row_ptr must never decrease",
    ),
    ("column_twice", {"col_idx": [0, 1, 0, 1]}, r"col_idx must be strictly ascending"),
    ("values_truncated", {"values": None}, r"val_ptr must end at len\(values\)"),
    ("rows_reversed", {"row_idx": [3, 2, 1, 0, 1, 0]}, r"tile 0 rows must be strictly ascending"),
]


@pytest.mark.parametrize("case", CORRUPT_STATE, ids=lambda c: c[0])
def test_corrupt_state_dict_is_refused_and_changes_nothing(case) -> None:
    _, edits, message = case
    good = _two_tile_module()
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in good.state_dict().items()}
    for key, value in edits.items():
        sd[key] = sd[key][:-1] if value is None else torch.tensor(value)
    target = TileSparseLinear.from_dense(
        int_linear(4, 4, 6), mask_kn=torch.rand(4, 4) < 0.5, tile=2, backend="cpu"
    )
    x = torch.randint(-3, 4, (3, 4)).float()
    before, y = _snapshot(target), target(x)
    model = torch.nn.Sequential(torch.nn.Sequential(target))
    sd = {f"0.0.{k}": v for k, v in sd.items()}
    with pytest.raises(
        ValueError, match=r"state dict for TileSparseLinear '0\.0': keys 0\.0\.\{col_idx"
    ) as err:
        model.load_state_dict(sd)
    assert err.match(message)
    _assert_unchanged(target, before, x, y)


def test_failed_load_leaves_the_module_as_it_was() -> None:
    """A load that the base class rejects (a bias of the wrong shape; another layer's shape)
    must not leave the saved layout half-adopted."""
    good = _two_tile_module()
    target = TileSparseLinear.from_dense(
        int_linear(4, 4, 6), mask_kn=torch.rand(4, 4) < 0.5, tile=2
    )
    x = torch.randint(-3, 4, (3, 4)).float()
    before, y = _snapshot(target), target(x)
    sd = dict(good.state_dict())
    sd["bias"] = torch.zeros(5)
    with pytest.raises(RuntimeError, match="size mismatch for bias"):
        target.load_state_dict(sd)
    _assert_unchanged(target, before, x, y)
    wrong = TileSparseLinear.from_dense(
        int_linear(5, 4, 7), mask_kn=torch.ones(5, 4, dtype=torch.bool), tile=4
    )
    with pytest.raises(ValueError, match="state dict holds a 5x4"):
        target.load_state_dict(wrong.state_dict())
    _assert_unchanged(target, before, x, y)
    no_bias = {k: v for k, v in good.state_dict().items() if k != "bias"}
    target.load_state_dict(no_bias, strict=False)  # the saved layout, the module's own bias
    assert torch.equal(target.values, good.values) and torch.equal(target.row_idx, good.row_idx)
    assert torch.equal(target.bias, before["bias"])


def test_backend_is_validated_when_set() -> None:
    with pytest.raises(ValueError, match="unknown tw_linear backend 'fast'"):
        TileSparseLinear(4, 4, backend="fast")
    with pytest.raises(ValueError, match="unknown tw_linear backend 'gpu'"):
        TileSparseLinear.from_dense(
            torch.nn.Linear(4, 4), mask_kn=torch.ones(4, 4, dtype=torch.bool), backend="gpu"
        )
    m = TileSparseLinear(4, 4, backend="CPU")
    assert m.backend == "cpu"
    with pytest.raises(ValueError, match="unknown tw_linear backend 'fast'"):
        m.backend = "fast"
    assert m.backend == "cpu"
    from tilesparse.backend import Backend

    m.backend = Backend.REFERENCE
    assert m.backend == "reference" and "backend=reference" in repr(m)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).backend == "reference"


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int16, torch.uint8]
)
def test_index_tensors_of_a_cast_state_dict_are_refused(dtype) -> None:
    """A state dict with every tensor cast to fp16 is refused: loaded, col_idx 2049 would come
    back 2048 (fp16 holds integers exactly only up to 2048) and the module compute other
    columns."""
    k, n = 8, 4096
    mask = torch.zeros(k, n, dtype=torch.bool)
    mask[:, [2049, 3001]] = True
    src = TileSparseLinear.from_dense(torch.nn.Linear(k, n), mask_kn=mask, tile=1)
    sd = {key: v.to(dtype) if key == "col_idx" else v for key, v in src.state_dict().items()}
    dst = TileSparseLinear(k, n, tile=1)
    with pytest.raises(
        ValueError,
        match=rf"key 'col_idx' is an index tensor and must be torch.int64 or torch.int32, got {dtype}",
    ):
        dst.load_state_dict(sd)
    assert dst.nnz == 0 and dst.col_idx.numel() == 0  # unchanged
    # every tensor cast, the reviewer's case: the first index buffer is named
    cast = {
        key: v.half() if isinstance(v, torch.Tensor) else v for key, v in src.state_dict().items()
    }
    with pytest.raises(ValueError, match="key 'col_idx' .* got torch.float16"):
        TileSparseLinear(k, n, tile=1).half().load_state_dict(cast)


def test_int32_index_tensors_load_exactly() -> None:
    good = _two_tile_module()
    sd = {
        key: v.int() if key in ("col_idx", "tile_ptr", "row_idx", "row_ptr", "val_ptr") else v
        for key, v in good.state_dict().items()
    }
    dst = TileSparseLinear(4, 4, tile=128)
    dst.load_state_dict(sd)
    assert dst.col_idx.dtype == torch.int64 and torch.equal(dst.col_idx, good.col_idx)
    x = torch.randint(-3, 4, (3, 4)).float()
    assert torch.equal(dst(x), good(x))


@pytest.mark.parametrize(
    "state",
    [
        torch.tensor([4, 4, 0]),
        torch.tensor([4, 4, -3]),
        torch.tensor([4.0, 4.0, 2.7]),  # an int() would truncate it to 2
        torch.tensor([True, True, True]),
        torch.tensor([4, 4]),
        {"in_features": 4, "out_features": 4, "tile": 2},  # state dicts hold tensors only
        None,
    ],
)
def test_corrupt_saved_tile_is_refused(state) -> None:
    from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

    good = _two_tile_module()
    sd = dict(good.state_dict())
    sd[_EXTRA_STATE_KEY_SUFFIX] = state
    target = TileSparseLinear.from_dense(
        int_linear(4, 4, 6), mask_kn=torch.rand(4, 4) < 0.5, tile=2
    )
    x = torch.randint(-3, 4, (3, 4)).float()
    before, y = _snapshot(target), target(x)
    with pytest.raises(
        ValueError, match=r"key '_extra_state': (the saved tile must be an integer >= 1|expected)"
    ):
        target.load_state_dict(sd)
    _assert_unchanged(target, before, x, y)


def test_state_dict_holds_tensors_only() -> None:
    sd = _two_tile_module().state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    assert torch.equal(sd["_extra_state"], torch.tensor([4, 4, 2]))


@pytest.mark.parametrize("tile", [0, -1, 2.0, True])
def test_layout_validate_requires_an_integer_tile(tile) -> None:
    from dataclasses import replace

    layout = replace(_two_tile_module().layout, tile=tile)
    with pytest.raises(ValueError, match=r"TWLayout.tile must be an integer >= 1"):
        layout.validate()
