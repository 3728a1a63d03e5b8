"""A quantized DLRM (tables in row formats, ``embark.quant``) saves and loads through the
trainer's checkpoints and round-trips exactly, also TW-compressed; a model of other tables'
storage is refused naming the table and both formats, never loaded as reinterpreted bytes.
``torch.save`` and ``copy.deepcopy`` of a quantized model (FBGEMM's kernel built) work."""

from __future__ import annotations

import copy
import io
import re
from dataclasses import replace

import pytest
import torch
from torch import nn

from embark.data import SyntheticCTR
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import get_workload
from embark.quant import EmbeddingQuantConfig, QuantizedEmbeddingBag, quantize_embeddings_
from embark.training import TrainConfig, Trainer
from hps.rowformat import RowDtype, row_bytes
from tilesparse import TileSparseConfig, TileSparseLinear, TileSparsePruner

INT8 = EmbeddingQuantConfig("int8")


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=64, seed=5)


def _trained(data: SyntheticCTR) -> Trainer:
    t = Trainer(build_model(data.workload, seed=1), TrainConfig(lr=0.05))
    t.fit(data.batches(2), 2, progress=False)
    return t


def _eval(model: nn.Module, data: SyntheticCTR) -> torch.Tensor:
    batch = next(iter(data.batches(1, split="eval")))
    model.eval()
    with torch.no_grad():
        return model(batch.dense, batch.sparse)


def _assert_same(a: nn.Module, b: nn.Module, data: SyntheticCTR) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert torch.equal(_eval(a, data), _eval(b, data))


@pytest.mark.parametrize("cfg", [INT8, EmbeddingQuantConfig("int4", {"t1": "int8", "t2": "fp32"})])
def test_quantized_dlrm_round_trips(data, tmp_path, cfg):
    t = _trained(data)
    quantize_embeddings_(t.model, cfg)
    quantized = [n for n in t.model.table_names if cfg.dtype_of(n) is not RowDtype.FP32]
    with pytest.raises(ValueError, match=re.escape(f"tables {quantized} were replaced")):
        t.save_checkpoint(tmp_path / "q")  # the fused update still holds the float tables
    t.rebuild_optimizer()
    _eval(t.model, data)  # the lookups' kernels built before the save
    path = t.save_checkpoint(tmp_path / "q")
    skeleton = quantize_embeddings_(build_model(data.workload, seed=7), cfg)
    loaded = Trainer.load_checkpoint(path, model=skeleton)
    for name in quantized:
        table = loaded.model.embeddings[name]
        assert isinstance(table, QuantizedEmbeddingBag) and table.dtype is cfg.dtype_of(name)
        assert torch.equal(table.rows, t.model.embeddings[name].rows)
    _assert_same(t.model, loaded.model, data)
    assert loaded.step == t.step
    # and trains on (dense layers, a float table left) exactly as the original
    t.fit(data.batches(1, start=2), 1, progress=False)
    loaded.fit(data.batches(1, start=2), 1, progress=False)
    _assert_same(t.model, loaded.model, data)


def _compressed_skeleton(like: nn.Module, data: SyntheticCTR) -> DLRM:
    model = build_model(data.workload, seed=7)
    for fqn, m in like.named_modules():
        if isinstance(m, TileSparseLinear):
            parent, _, child = fqn.rpartition(".")
            empty = TileSparseLinear(
                m.in_features, m.out_features, m.tile, m.bias is not None, backend="reference"
            )
            setattr(model.get_submodule(parent) if parent else model, child, empty)
    return quantize_embeddings_(model, INT8)


def test_compressed_and_quantized_dlrm_round_trips(data, tmp_path):
    t = _trained(data)
    pruner = TileSparsePruner(TileSparseConfig(pattern="tw", sparsity=0.5, tile=16))
    pruner.prepare(t.model)
    t.rebuild_optimizer()
    t.fit(data.batches(1, start=2), 1, progress=False)
    pruner.compress(backend="reference")
    quantize_embeddings_(t.model, INT8)
    t.rebuild_optimizer()
    path = t.save_checkpoint(tmp_path / "cq")
    loaded = Trainer.load_checkpoint(path, model=_compressed_skeleton(t.model, data))
    assert any(isinstance(m, TileSparseLinear) for m in loaded.model.modules())
    _assert_same(t.model, loaded.model, data)


def test_quantized_model_deepcopies_and_pickles(data):
    t = _trained(data)
    model = quantize_embeddings_(t.model, EmbeddingQuantConfig("int4", {"t0": "int8"}))
    expected = _eval(model, data)  # builds FBGEMM's lookups where it imports
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        for name in model.table_names:
            a, b = model.embeddings[name], other.embeddings[name]
            assert b.rows.data_ptr() != a.rows.data_ptr() and torch.equal(a.rows, b.rows)
        assert torch.equal(_eval(other, data), expected)


def test_load_refuses_tables_of_another_storage(data, tmp_path):
    t = _trained(data)
    quantize_embeddings_(t.model, INT8)
    t.rebuild_optimizer()
    path = t.save_checkpoint(tmp_path / "q")
    float_model = build_model(data.workload, seed=7)
    before = {k: v.clone() for k, v in float_model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"'embeddings.t0': the checkpoint holds int8 rows, the "
        r"model has float32 weight",
    ):
        Trainer.load_checkpoint(path, model=float_model)
    for k, v in float_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    fp16 = quantize_embeddings_(build_model(data.workload, seed=7), EmbeddingQuantConfig("fp16"))
    with pytest.raises(ValueError, match=r"table 't0'.* holds int8 rows, this table is fp16"):
        Trainer.load_checkpoint(path, model=fp16)


def test_rows_of_the_same_width_are_not_reinterpreted():
    # int8 and fp16 rows of dim 4 are both 8 bytes: only the saved format tells them apart
    dim = 4
    assert row_bytes(RowDtype.INT8, dim) == row_bytes(RowDtype.FP16, dim)
    weight = torch.randn(5, dim)
    int8 = QuantizedEmbeddingBag.from_float("t", weight, RowDtype.INT8)
    fp16 = QuantizedEmbeddingBag.from_float("t", weight, RowDtype.FP16)
    before = fp16.rows.clone()
    with pytest.raises(ValueError, match=r"table 't'.* holds int8 rows, this table is fp16"):
        fp16.load_state_dict(int8.state_dict())
    assert torch.equal(fp16.rows, before)
