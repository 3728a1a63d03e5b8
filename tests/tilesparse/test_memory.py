"""tilesparse.memory: byte counts of condensed layers, read from their tensors.

The issue's acceptance: a condensed layer holds ≤ (1−s) of the dense weight in values plus ≤ 3%
in indices. Checked on real TW masks (``tilesparse.tw_mask``, G=128) of a 4096×4096 layer and a
shape that is not a multiple of G, against the bytes of the layout's actual tensors."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

import tilesparse
from tilesparse import memory
from tilesparse.format import TWLayout, condense
from tilesparse.linear import TileSparseLinear
from tilesparse.memory import LayerMemory, layer_memory, model_memory

# tw_mask keeps round((1-s)·K·N) weights minus at most one selection unit (a row segment of G
# weights, or a column of K): well under 0.5% of the layer at these shapes.
MASK_SPARSITY_ERROR = 0.005
INDEX_LIMIT = 0.03  # the acceptance: indices ≤ 3% of the dense weight


def _actual_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_module_doctest_runs():
    result = doctest.testmod(memory, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("K,N", [(4096, 4096), (1000, 3000)])
@pytest.mark.parametrize("sparsity", [0.5, 0.75, 0.9])
def test_tw_layer_memory_within_acceptance(K, N, sparsity):
    G = 128
    gen = torch.Generator().manual_seed(K + int(100 * sparsity))
    w = torch.randn(K, N, generator=gen)
    mask = tilesparse.tw_mask(w.abs(), sparsity, tile=G)
    lay = condense(w, mask, G)
    mem = layer_memory(lay)
    # the figures are the tensors' own sizes, not a formula
    assert mem.values_bytes == _actual_bytes(lay.values)
    assert mem.index_bytes == _actual_bytes(
        lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.val_ptr
    )
    assert mem.dense_bytes == K * N * 4 and mem.nnz == int(mask.sum())
    assert mem.values_fraction <= (1 - sparsity) + MASK_SPARSITY_ERROR
    assert mem.index_fraction <= INDEX_LIMIT
    assert mem.total_fraction == pytest.approx(mem.values_fraction + mem.index_fraction)
    assert mem.total_fraction <= (1 - sparsity) + MASK_SPARSITY_ERROR + INDEX_LIMIT


def test_exact_bytes_of_a_drawn_layout():
    """Tiles {0,1,2,3} rows {1,3}; {4,5} no rows; {7} row {0}; column 6 pruned (K=5, N=8)::

      n=0 1 2 3 4 5 6 7
    k=0 . . . . . . . x
    k=1 x x x x . . . .
    k=2 . . . . . . . .
    k=3 x x x x . . . .
    k=4 . . . . . . . .
    """
    i64 = torch.int64
    lay = TWLayout(
        in_features=5,
        out_features=8,
        tile=4,
        col_idx=torch.tensor([0, 1, 2, 3, 4, 5, 7], dtype=i64),
        tile_ptr=torch.tensor([0, 4, 6, 7], dtype=i64),
        row_idx=torch.tensor([1, 3, 0], dtype=i64),
        row_ptr=torch.tensor([0, 2, 2, 3], dtype=i64),
        values=torch.arange(1, 10, dtype=torch.bfloat16),
        val_ptr=torch.tensor([0, 8, 8, 9], dtype=i64),
    )
    lay.validate()
    mem = layer_memory(lay)
    # 7 col_idx + 3 row_idx + 3 pointers × 4 = 22 int64; 9 bf16 values; dense 5·8 bf16
    assert mem == LayerMemory(
        in_features=5,
        out_features=8,
        itemsize=2,
        nnz=9,
        dense_bytes=80,
        values_bytes=18,
        index_bytes=176,
        cache_bytes=0,
        bias_bytes=0,
    )
    assert (
        mem.density == 9 / 40 and mem.values_fraction == 18 / 80 and mem.index_fraction == 176 / 80
    )
    # a backend's derived tensors kept in the layout's cache are counted too
    lay.cache["cpu"] = {"packed": torch.zeros(3, 4, dtype=torch.float32)}
    assert layer_memory(lay).cache_bytes == 48 and layer_memory(lay).weight_bytes == 18 + 176 + 48


def test_tile_sparse_linear_counts_bias_and_follows_dtype():
    dense = nn.Linear(6, 4)
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[[0, 2, 5], :2] = True  # one tile of 2 columns, 3 rows
    layer = TileSparseLinear.from_dense(dense, mask_kn=mask, tile=2)
    mem = layer_memory(layer)
    # col_idx 2 + row_idx 3 + three pointers of 2 = 11 int64
    assert (mem.nnz, mem.values_bytes, mem.index_bytes, mem.bias_bytes, mem.dense_bytes) == (
        6,
        24,
        88,
        16,
        96,
    )
    half = layer_memory(layer.to(torch.bfloat16))
    assert (half.values_bytes, half.index_bytes, half.bias_bytes, half.dense_bytes) == (
        12,
        88,
        8,
        48,
    )


def test_masked_nn_linear_counts_original_and_mask():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    tilesparse.prune_(model, tilesparse.TileSparseConfig(sparsity=0.5, tile=8))
    mem = layer_memory(model[0])
    assert (mem.values_bytes, mem.index_bytes, mem.bias_bytes) == (32 * 16 * 4, 32 * 16, 16 * 4)


def test_model_memory_sums_layers_and_others():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(100, 8),
        nn.Linear(8, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.LayerNorm(128),
        nn.Linear(128, 3),
    )
    pruner = tilesparse.prune_(
        model, tilesparse.TileSparseConfig(sparsity=0.75, tile=32), lambda m, fqn: fqn in ("1", "3")
    )
    pruner.compress()
    mm = model_memory(model)
    assert [f for f, _ in mm.layers] == ["1", "3", "5"]
    assert mm.sparse_layers == ("1", "3")
    per = dict(mm.layers)
    assert mm.dense_bytes == (8 * 256 + 256 * 128 + 128 * 3) * 4
    assert mm.weight_bytes == sum(per[f].weight_bytes for f in per)
    assert per["5"].weight_bytes == per["5"].dense_bytes == 128 * 3 * 4  # the dense layer
    s1, s3 = model[1], model[3]
    assert (
        per["3"].values_bytes == s3.values.numel() * 4
        and per["1"].values_bytes == s1.values.numel() * 4
    )
    assert mm.bias_bytes == (256 + 128 + 3) * 4
    assert mm.other_bytes == (100 * 8 + 2 * 128) * 4  # the embedding and the LayerNorm
    assert mm.total_fraction < 0.5
    line = mm.summary()
    assert line.startswith("weights: ") and "MiB dense → " in line and "(2 sparse)" in line
    assert set(mm.to_dict()["layers"]) == {"1", "3", "5"}


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="got Tensor"):
        layer_memory(torch.zeros(3, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds no nn.Linear"):
        model_memory(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="takes an nn.Module, got dict"):
        model_memory({})  # type: ignore[arg-type]
