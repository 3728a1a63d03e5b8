"""``hotness`` is the maximum bag size, enforced by one policy (embark.data.hotness); a TorchRec
model's hotness is taken per table or inferred from data, a missing table named; embark's
vocabulary lookup and hps's agree id for id (reserved row, hashed buckets, strings)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from embark.data import (
    HotnessError,
    JaggedBatch,
    OOVPolicy,
    Vocabulary,
    enforce_hotness,
    max_bag_sizes,
)
from embark.data.hotness import truncate_bags
from embark.types import HotnessPolicy, TableConfig
from hps.vocabulary import ServingVocabulary, TableVocabulary


def test_truncate_keeps_the_first_ids_of_each_bag() -> None:
    values = np.array([10, 11, 12, 20, 30, 31, 32, 33])
    v, n = truncate_bags(values, np.array([3, 1, 0, 4]), 2)
    assert v.tolist() == [10, 11, 20, 30, 31] and n.tolist() == [2, 1, 0, 2]


def test_enforce_hotness_refuses_or_truncates_and_passes_fitting_batches_through() -> None:
    sp = JaggedBatch.from_per_key(
        {
            "a": (torch.tensor([1, 2, 3, 4]), torch.tensor([3, 1], dtype=torch.int32)),
            "b": (torch.tensor([5, 6]), torch.tensor([1, 1], dtype=torch.int32)),
        }
    )
    fits = [TableConfig("a", 10, 2, hotness=3), TableConfig("b", 10, 2, hotness=1)]
    assert enforce_hotness(sp, fits) is sp
    refuse = [TableConfig("a", 10, 2, hotness=2), fits[1]]
    with pytest.raises(HotnessError, match=r"table 'a': sample 0 of this batch has a bag of 3"):
        enforce_hotness(sp, refuse)
    cut = [TableConfig("a", 10, 2, hotness=2, hotness_policy=HotnessPolicy.TRUNCATE), fits[1]]
    out = enforce_hotness(sp, cut)
    assert out.values.tolist() == [1, 2, 4, 5, 6] and out.lengths.tolist() == [2, 1, 1, 1]


def test_table_config_names_a_bad_policy_and_round_trips_it() -> None:
    with pytest.raises(
        ValueError, match="hotness_policy must be one of \\['refuse', 'truncate'\\]"
    ):
        TableConfig("t", 4, 2, hotness_policy="drop")
    t = TableConfig("t", 4, 2, hotness=3, hotness_policy=HotnessPolicy.TRUNCATE)
    assert TableConfig.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_max_bag_sizes_over_batches() -> None:
    a = JaggedBatch(["x", "y"], torch.arange(5), torch.tensor([2, 0, 1, 2], dtype=torch.int32))
    b = JaggedBatch(["x", "y"], torch.arange(3), torch.tensor([0, 0, 0, 3], dtype=torch.int32))
    assert max_bag_sizes([a, b]) == {"x": 2, "y": 3}


@pytest.mark.parametrize(
    ("keys", "oov", "buckets", "raw"),
    [
        ((42, 7, 19), OOVPolicy.RESERVED, 1, [7, 42, 5, -3, 2**62, 19]),
        ((42, 7, 19), OOVPolicy.HASH, 7, [7, 42, 5, -3, 2**62, 19, 123456789]),
        (("ab", "c"), OOVPolicy.HASH, 5, ["c", "zz", "ab", "", "ü"]),
        (("ab", "c"), OOVPolicy.RESERVED, 1, ["c", "zz", "ab"]),
        ((), OOVPolicy.HASH, 3, [1, 2, 3]),
    ],
)
def test_embark_and_hps_map_every_id_to_the_same_row(keys, oov, buckets, raw) -> None:
    v = Vocabulary(keys, oov, buckets)
    t = TableVocabulary("t", v.num_rows, 1, "refuse", keys, oov.value, buckets)
    arr = np.array(raw, dtype=object if isinstance(raw[0], str) else np.int64)
    ours = v.lookup(arr)
    assert ours.tolist() == t.rows_of(arr).tolist()
    assert all(0 <= r < v.num_rows for r in ours)
    known = [i for i, k in enumerate(raw) if k in keys]
    assert [int(ours[i]) for i in known] == [keys.index(raw[i]) for i in known]


def test_vocabulary_fit_threshold_max_size_and_order() -> None:
    v = Vocabulary.fit({5: 3, 9: 3, 2: 1, 7: 10}, min_count=2, max_size=2)
    assert v.keys == (7, 5) and v.num_rows == 3
    with pytest.raises(ValueError, match="oov 'reserved' has exactly 1 bucket"):
        Vocabulary((1,), OOVPolicy.RESERVED, 3)


def test_the_server_refuses_another_vocabulary_version(tmp_path) -> None:
    doc = {"format": "tilerec.vocabulary", "version": 9, "tables": []}
    (tmp_path / "vocabulary.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 9; this hps reads version 1"):
        ServingVocabulary.beside(tmp_path / "dense.onnx")
    assert ServingVocabulary.beside(tmp_path / "elsewhere" / "dense.onnx") is None


def test_torchrec_export_takes_hotness_from_data_and_names_missing_tables(tmp_path, require):
    require(importlib.util.find_spec("torchrec") is not None, "torchrec")
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embark.interop import batch_from_kjt
    from export.artifacts import write_serving_artifacts
    from hps.parameter_server import HierarchicalParameterServer
    from hps.serving.servable import DLRMServable

    torch.manual_seed(0)
    cfgs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=4, num_embeddings=30, feature_names=[f"f{i}"]
        )
        for i in range(2)
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=cfgs),
        dense_in_features=3,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
    ).eval()
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        lengths=torch.tensor([3, 1, 1, 2, 0, 2]),
    )
    with pytest.raises(ValueError, match=r"no entry for table\(s\) \['t1'\]"):
        write_serving_artifacts(model, tmp_path / "x", hotness={"t0": 3})
    hotness = max_bag_sizes([batch_from_kjt(kjt, cfgs)])
    assert hotness == {"t0": 3, "t1": 2}
    write_serving_artifacts(model, tmp_path / "art", model_name="tr", hotness=hotness)
    doc = json.loads((tmp_path / "art" / "ps.json").read_text())
    assert doc["models"][0]["maxnum_catfeature_query_per_table_per_sample"] == [3, 2]
    ps = HierarchicalParameterServer.from_config(tmp_path / "art" / "ps.json")
    servable = DLRMServable(ps.cfg.model("tr"), ps.session("tr"))
    dense = torch.rand(3, 3)
    req = {
        "dense": dense.numpy(),
        "ids_t0": np.array([[1, 2, 3], [4, -1, -1], [5, -1, -1]]),
        "ids_t1": np.array([[6, 7], [-1, -1], [8, 9]]),
    }
    with torch.no_grad():
        want = model(dense, kjt).reshape(-1).numpy()
    np.testing.assert_allclose(servable.infer(req)["logits"], want, rtol=0, atol=1e-5)
    ps.close()
