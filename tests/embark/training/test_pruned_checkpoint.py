"""A pruned DLRM saves and loads through the trainer's checkpoints and round-trips exactly:
masked (weights under tilesparse's parametrizations) and compressed (``TileSparseLinear``
layers whose buffer sizes follow the masks). ``embark`` knows nothing of ``tilesparse``: the
route is the state dict, loaded into a model of the same structure."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from embark.data import SyntheticCTR
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import get_workload
from embark.training import TrainConfig, Trainer
from tilesparse import TileSparseConfig, TileSparseLinear, TileSparsePruner

PRUNE = TileSparseConfig(pattern="tw", sparsity=0.5, tile=16)


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=64, seed=5)


def _pruned(data: SyntheticCTR) -> tuple[Trainer, TileSparsePruner]:
    t = Trainer(build_model(data.workload, seed=1), TrainConfig(lr=0.05))
    t.fit(data.batches(2), 2, progress=False)
    pruner = TileSparsePruner(PRUNE)
    pruner.prepare(t.model)
    t.rebuild_optimizer()
    t.fit(data.batches(1, start=2), 1, progress=False)
    return t, pruner


def _assert_same(a: nn.Module, b: nn.Module, data: SyntheticCTR) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    batch = next(iter(data.batches(1, split="eval")))
    with torch.no_grad():
        assert torch.equal(a(batch.dense, batch.sparse), b(batch.dense, batch.sparse))


def test_masked_dlrm_round_trips(data, tmp_path):
    t, _ = _pruned(data)
    path = t.save_checkpoint(tmp_path / "masked")
    skeleton = build_model(data.workload, seed=7)
    TileSparsePruner(PRUNE).prepare(skeleton)  # the same parametrizations, masks from the file
    loaded = Trainer.load_checkpoint(path, model=skeleton)
    _assert_same(t.model, loaded.model, data)
    # and it fine-tunes on exactly as the original
    t.fit(data.batches(1, start=3), 1, progress=False)
    loaded.fit(data.batches(1, start=3), 1, progress=False)
    _assert_same(t.model, loaded.model, data)


def _compressed_skeleton(like: nn.Module, workload) -> DLRM:
    """A fresh DLRM whose layers compressed in ``like`` are empty ``TileSparseLinear``s."""
    model = build_model(workload, seed=7)
    for fqn, m in like.named_modules():
        if isinstance(m, TileSparseLinear):
            parent, _, child = fqn.rpartition(".")
            empty = TileSparseLinear(
                m.in_features, m.out_features, m.tile, m.bias is not None, backend="reference"
            )
            setattr(model.get_submodule(parent) if parent else model, child, empty)
    return model


def test_compressed_dlrm_round_trips(data, tmp_path):
    t, pruner = _pruned(data)
    pruner.compress(backend="reference")
    with pytest.raises(ValueError, match="rebuild_optimizer"):
        t.save_checkpoint(tmp_path / "c")  # the optimizer still holds the replaced layers
    t.rebuild_optimizer()
    path = t.save_checkpoint(tmp_path / "c")
    loaded = Trainer.load_checkpoint(path, model=_compressed_skeleton(t.model, data.workload))
    _assert_same(t.model, loaded.model, data)
    assert loaded.step == t.step


def test_compressed_load_refuses_a_layer_of_another_shape(data, tmp_path):
    t, pruner = _pruned(data)
    pruner.compress(backend="reference")
    t.rebuild_optimizer()
    path = t.save_checkpoint(tmp_path / "c")
    skeleton = _compressed_skeleton(t.model, data.workload)
    before = {k: v.clone() for k, v in skeleton.state_dict().items()}
    fqn = next(n for n, m in skeleton.named_modules() if isinstance(m, TileSparseLinear))
    wrong = TileSparseLinear(3, 5, 16, True, backend="reference")
    parent, _, child = fqn.rpartition(".")
    setattr(skeleton.get_submodule(parent) if parent else skeleton, child, wrong)
    with pytest.raises(ValueError, match=fqn):
        Trainer.load_checkpoint(path, model=skeleton)
    for k, v in skeleton.state_dict().items():  # nothing written
        if k in before and not k.startswith(fqn + "."):
            assert torch.equal(v, before[k]), k
