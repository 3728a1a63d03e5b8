"""The typed table store: a model's tables, their fused updates and storage dtype reached
through ``TableModel.embedding_store()`` only (no attribute probing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embark.models.dlrm import build_model
from embark.models.tables import EmbeddingTables, FusedLookup, TableModel, table_weight_key
from embark.models.workloads import get_workload
from embark.quant import EmbeddingQuantConfig, quantize_embeddings_
from embark.training.config import TrainConfig
from embark.training.fused import SparseTableUpdate
from embark.training.trainer import Trainer
from embark.types import TableConfig
from hps.rowformat import RowDtype


def test_tables_read_like_a_dict_and_keep_state_dict_names():
    model = build_model(get_workload("tiny"))
    store = model.embedding_store()
    assert isinstance(store, EmbeddingTables) and store is model.embeddings
    assert store.keys() == model.table_names and len(store) == len(model.table_names)
    assert all(isinstance(store[n], nn.EmbeddingBag) for n in store)
    assert table_weight_key("t0") in model.state_dict()
    assert not any("_fused" in k for k in model.state_dict())
    with pytest.raises(KeyError, match="nope"):
        store["nope"]
    with pytest.raises(ValueError, match="_fused"):
        EmbeddingTables([TableConfig("_fused", 4, 4)])


def test_a_trainer_installs_typed_updates_and_quantization_drops_them():
    model = build_model(get_workload("tiny"))
    trainer = Trainer(model, TrainConfig())
    store = model.embedding_store()
    assert all(isinstance(store.update_of(n), SparseTableUpdate) for n in model.table_names)
    # the fused tables are not in the dense optimizer; nothing else is in "embeddings"
    names = {g["name"] for g in trainer.optimizer.param_groups}
    assert names == {"dense"}
    with pytest.raises(TypeError, match="FusedLookup"):
        store.install_update("t0", nn.Identity())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="nope"):
        store.install_update("nope", _Sum())
    with pytest.raises(ValueError, match="before a trainer"):
        store.set_storage_dtype_(RowDtype.FP16)
    quantize_embeddings_(model, EmbeddingQuantConfig("int8", per_table={"t1": "fp32"}))
    assert store.update_of("t0") is None and store.update_of("t1") is not None
    assert store.storage_dtype("t0") is RowDtype.INT8 and "t0" not in store.trainable_weights()
    trainer.rebuild_optimizer()
    assert set(trainer.embedding_updates.weights) == {"t1"}  # type: ignore[union-attr]


class _Sum(FusedLookup):
    """The smallest concrete fused lookup: a plain sum, no update."""

    def forward(self, weight, ids, offsets, mode):
        return torch.nn.functional.embedding_bag(ids, weight, offsets, mode=mode)


def test_the_table_bases_are_abstract():
    """FusedLookup, RowFormatTable, TableStore and TableModel cannot be made without their methods."""
    from embark.models.tables import RowFormatTable, TableStore

    for base in (FusedLookup, RowFormatTable, TableStore, TableModel):
        with pytest.raises(TypeError, match="abstract"):
            base()


class _LookAlike(nn.Module):
    """Has what the trainer once probed for (``embedding_tables``, ``sparse_updates``) but is
    no TableModel: its tables are ordinary parameters of the dense optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleDict({"t": nn.EmbeddingBag(8, 4)})
        self.sparse_updates = nn.ModuleDict()
        self.head = nn.Linear(4, 1)

    def embedding_tables(self) -> dict[str, nn.Parameter]:
        return {"t": self.embeddings["t"].weight}  # type: ignore[dict-item]

    def forward(self, dense: torch.Tensor, sparse: object) -> torch.Tensor:
        return self.head(dense).squeeze(-1)


def test_no_duck_typing_a_look_alike_is_not_taken_over():
    m = _LookAlike()
    assert not isinstance(m, TableModel)
    trainer = Trainer(m, TrainConfig())
    assert trainer.embedding_updates is None and len(m.sparse_updates) == 0
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert any(p is m.embeddings["t"].weight for p in params)


def test_half_tables_sum_bags_in_float32():
    """An FP16 table's bag is summed in float32: two rows of 40,000 give 80,000 (an FP16 sum
    overflows to inf), and every bag equals the float32 bag of the same rows."""
    store = EmbeddingTables([TableConfig("t", 6, 4)])
    with torch.no_grad():
        store["t"].weight.copy_(torch.arange(24, dtype=torch.float32).view(6, 4) * 0.37 + 40_000)
    want = torch.nn.functional.embedding_bag(
        torch.tensor([0, 1, 2, 5, 3]),
        store["t"].weight.half().float(),
        torch.tensor([0, 2]),
        mode="sum",
    )
    store.set_storage_dtype_(RowDtype.FP16)
    ids, offsets = torch.tensor([0, 1, 2, 5, 3]), torch.tensor([0, 2])
    for got in (store.bag("t", ids, offsets), store.lookup("t", ids, offsets, "sum")):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert torch.equal(got, want)
    assert bool((want[0] >= 80_000).all())  # beyond FP16 (65,504)
