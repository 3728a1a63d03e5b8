"""Serving artifacts: sparse files + dense ONNX + ps.json; one request served through the
parameter server and onnxruntime equals the eager model."""

from __future__ import annotations

import json

import pytest
import torch

from embark.data.jagged import JaggedBatch
from embark.model import build_model
from embark.workloads import get_workload
from export.artifacts import write_serving_artifacts
from export.onnx import run_onnx
from hps.config import load_config
from hps.parameter_server import HierarchicalParameterServer
from hps.sparse_files import read_table


def test_request_served_from_artifacts_equals_eager(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=3).eval()
    cfg = write_serving_artifacts(model, tmp_path / "art", model_name="tiny")
    assert cfg.model("tiny").network_file.endswith("dense.onnx")
    keys, rows = read_table(tmp_path / "art" / "sparse" / "t0", dim=model.workload.tables[0].dim)
    assert torch.equal(torch.from_numpy(rows.copy()), model.embeddings["t0"].weight.detach())
    assert keys.tolist() == list(range(rows.shape[0]))

    server = HierarchicalParameterServer(load_config(tmp_path / "art" / "ps.json"))
    try:
        session = server.session("tiny")
        gen = torch.Generator().manual_seed(0)
        batch = 6
        dense = torch.rand(batch, model.workload.dense_features, generator=gen)
        pooled, values, lengths = [], [], []
        for t in model.workload.tables:
            ids = torch.randint(0, t.num_rows, (batch, t.hotness), generator=gen)
            pooled.append(session.lookup(t.name, ids).sum(dim=1))  # sum combiner
            values.append(ids.flatten())
            lengths += [t.hotness] * batch
        sparse = JaggedBatch([t.name for t in model.workload.tables], torch.cat(values),
                             torch.tensor(lengths, dtype=torch.int32))
        want = model(dense, sparse).detach()
        got = run_onnx(tmp_path / "art" / "dense.onnx",
                       {"dense": dense, "pooled": torch.stack(pooled, dim=1)})
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    finally:
        server.close()


def test_existing_artifacts_are_not_overwritten(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    write_serving_artifacts(model, tmp_path)
    before = (tmp_path / "ps.json").read_text()
    with pytest.raises(ValueError, match="exists"):
        write_serving_artifacts(model, tmp_path, model_name="other")
    assert (tmp_path / "ps.json").read_text() == before
    assert json.loads(before)["models"][0]["model"] == "dlrm"


def test_bad_settings_fail_before_anything_is_written(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    with pytest.raises(ValueError, match=r"models\[0\].gpucacheper: 1.5 is impossible"):
        write_serving_artifacts(model, tmp_path / "a", cache_fraction=1.5)
    assert not (tmp_path / "a").exists()
    cfg = write_serving_artifacts(model, tmp_path / "a")  # the retry needs no overwrite=True
    assert cfg.model("dlrm").tables[0].name == "t0"


def test_cache_knobs_are_written_and_read_back(tmp_path) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    cfg = write_serving_artifacts(model, tmp_path / "lfu", cache_policy="lfu", cache_lfu_decay_keys_per_slot=5)
    doc = json.loads((tmp_path / "lfu" / "ps.json").read_text())["models"][0]
    assert (doc["cache_policy"], doc["cache_lfu_decay_keys_per_slot"]) == ("lfu", 5)
    m = cfg.model("dlrm")
    assert (m.cache_policy.value, m.cache_lfu_decay_keys_per_slot) == ("lfu", 5.0)
    write_serving_artifacts(model, tmp_path / "d")
    default = json.loads((tmp_path / "d" / "ps.json").read_text())["models"][0]
    assert (default["cache_policy"], default["cache_lfu_decay_keys_per_slot"]) == ("lru", 20.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cache_policy": "mru"}, r"models\[0\].cache_policy: 'mru' is not one of \['lru', 'lfu'\]"),
    ({"cache_lfu_decay_keys_per_slot": -1.0}, r"models\[0\].cache_lfu_decay_keys_per_slot: -1.0"),
])
def test_bad_cache_knobs_fail_before_anything_is_written(tmp_path, kwargs, match) -> None:
    model = build_model(get_workload("tiny"), seed=0)
    with pytest.raises(ValueError, match=match):
        write_serving_artifacts(model, tmp_path / "a", **kwargs)
    assert not (tmp_path / "a").exists()
