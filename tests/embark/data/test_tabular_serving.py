"""The frictions of bringing your own data, each tested where a user meets it: a bag longer
than ``hotness`` gets the same answer in training and in the server (refused, or truncated by
the declared policy), and an id the training data never held gets the same score in-process
and served (its out-of-vocabulary row, through the same vocabulary)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from embark.data import (
    Categorical,
    ColumnTransform,
    Dense,
    HotnessError,
    JaggedBatch,
    OOVPolicy,
    TabularSource,
    TabularSpec,
)
from embark.data.batch import Batch
from embark.models.dlrm import build_model
from embark.models.workloads import Interaction, Workload
from embark.training import TrainConfig, Trainer
from embark.types import HotnessPolicy, TableConfig
from export.artifacts import write_serving_artifacts
from hps.parameter_server import HierarchicalParameterServer
from hps.serving.batcher import BatchingConfig, DynamicBatcher
from hps.serving.servable import DLRMServable, InputError
from hps.serving.statistics import ModelCounts

pytest.importorskip("onnxruntime")


def _workload(policy: HotnessPolicy) -> Workload:
    tables = (
        TableConfig("t0", num_rows=20, dim=4, hotness=2, hotness_policy=policy),
        TableConfig("t1", num_rows=10, dim=4, hotness=1, hotness_policy=policy),
    )
    return Workload(
        "h",
        tables,
        dense_features=2,
        bottom_mlp=(8, 4),
        top_mlp=(8, 1),
        interaction=Interaction(type="dot"),
    )


def _long_bag_batch() -> Batch:
    """Sample 1's t0 bag holds 3 ids, one over t0's hotness 2."""
    sparse = JaggedBatch.from_per_key(
        {
            "t0": (torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 3, 1], dtype=torch.int32)),
            "t1": (torch.tensor([7, 8, 9]), torch.tensor([1, 1, 1], dtype=torch.int32)),
        }
    )
    return Batch(torch.rand(3, 2), sparse, torch.tensor([0.0, 1.0, 1.0]))


@pytest.fixture
def serve(tmp_path):
    """``serve(model, vocabularies=None)``: export ``model`` and return the servable the v2
    server runs for it (parameter servers closed at the end)."""
    opened = []

    def make(model, vocabularies=None) -> DLRMServable:
        out = tmp_path / f"art{len(opened)}"
        write_serving_artifacts(model, out, model_name="m", vocabularies=vocabularies)
        opened.append(HierarchicalParameterServer.from_config(out / "ps.json"))
        return DLRMServable(opened[-1].cfg.model("m"), opened[-1].session("m"))

    yield make
    for ps in opened:
        ps.close()


def _request(batch: Batch, width: int = 3) -> dict[str, np.ndarray]:
    out = {"dense": batch.dense.numpy()}
    for k in batch.sparse.keys:
        v, n = batch.sparse.values_for(k).numpy(), batch.sparse.lengths_for(k).numpy()
        ids = np.full((n.size, width), -1, dtype=np.int64)
        pos = 0
        for i, m in enumerate(n):
            ids[i, :m] = v[pos : pos + m]
            pos += m
        out[f"ids_{k}"] = ids
    return out


def test_a_bag_over_hotness_is_refused_by_training_and_by_the_server(serve) -> None:
    model = build_model(_workload(HotnessPolicy.REFUSE), seed=0)
    batch = _long_bag_batch()
    trainer = Trainer(model, TrainConfig(lr=0.1))
    with pytest.raises(HotnessError, match=r"table 't0': sample 1 .* bag of 3 ids but hotness"):
        trainer.fit([batch], steps=1, progress=False)  # training accepted it silently before
    servable = serve(model.eval())
    with pytest.raises(InputError, match=r"'ids_t0': sample 1 has a bag of 3 ids .* at most 2"):
        servable.infer(_request(batch))


def test_truncate_policy_scores_the_same_in_process_and_served(serve) -> None:
    model = build_model(_workload(HotnessPolicy.TRUNCATE), seed=0).eval()
    batch = _long_bag_batch()
    with torch.no_grad():
        local = model(batch.dense, batch.sparse).numpy()
        cut = JaggedBatch.from_per_key(
            {
                "t0": (torch.tensor([1, 2, 3, 4, 6]), torch.tensor([2, 2, 1], dtype=torch.int32)),
                "t1": (torch.tensor([7, 8, 9]), torch.tensor([1, 1, 1], dtype=torch.int32)),
            }
        )
        assert np.array_equal(local, model(batch.dense, cut).numpy())  # the first 2 ids kept
    served = serve(model).infer(_request(batch))["logits"]
    np.testing.assert_allclose(served, local, rtol=0, atol=1e-5)
    trainer = Trainer(model.train(), TrainConfig(lr=0.1))
    assert trainer.fit([batch], steps=1, progress=False).steps == 1


def _frame(n: int, seed: int) -> pd.DataFrame:
    g = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "user": g.integers(100, 140, n),
            "tags": [list(g.integers(0, 8, g.integers(0, 4))) for _ in range(n)],
            "x": g.random(n) * 10,
            "y": g.integers(0, 2, n),
        }
    )


@pytest.mark.parametrize("oov", [OOVPolicy.RESERVED, OOVPolicy.HASH])
def test_an_unseen_id_gets_the_same_score_in_process_and_served(serve, oov) -> None:
    spec = TabularSpec(
        categorical=(
            Categorical("user", oov=oov, oov_buckets=1 if oov is OOVPolicy.RESERVED else 5),
            Categorical("tags", multi_hot=True, hotness_policy=HotnessPolicy.TRUNCATE),
        ),
        dense=(Dense("x", ColumnTransform.LOG1P_STANDARDIZE),),
        label="y",
    )
    prep = TabularSource.from_pandas(_frame(400, 0), spec).fit()
    model = build_model(prep.workload(dim=4, bottom_mlp=(8, 4), top_mlp=(8, 1)), seed=0).eval()
    rows = _frame(6, 1)
    rows.loc[0, "user"], rows.loc[1, "user"] = 10**12, -7  # never seen in training
    rows.at[2, "tags"] = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2]  # longer than any training bag
    batch = prep.encode(rows)
    with torch.no_grad():
        local = model(batch.dense, batch.sparse).numpy()
    unseen_rows = batch.sparse.values_for("user")[:2].tolist()
    assert all(r >= len(prep.vocabularies["user"].keys) for r in unseen_rows)
    servable = serve(model, prep.vocabularies)
    served = servable.infer(prep.serving_inputs(rows))
    np.testing.assert_allclose(served["logits"], local, rtol=0, atol=1e-5)
    # the server's route: checked (raw ids mapped) once on arrival, then run by the batcher,
    # which must not map the already-mapped row ids a second time
    batcher = DynamicBatcher(servable, BatchingConfig(64, max_queue_delay_us=0), ModelCounts())
    try:
        got = batcher.submit(servable.check(prep.serving_inputs(rows))).result(timeout=60)
    finally:
        batcher.close()
    np.testing.assert_array_equal(got.outputs["logits"], served["logits"])


def test_an_artifact_without_vocabularies_still_takes_row_ids(serve) -> None:
    model = build_model(_workload(HotnessPolicy.REFUSE), seed=0).eval()
    batch = Batch(
        torch.rand(2, 2),
        JaggedBatch.from_per_key(
            {
                "t0": (torch.tensor([1, 19]), torch.tensor([1, 1], dtype=torch.int32)),
                "t1": (torch.tensor([0, 9]), torch.tensor([1, 1], dtype=torch.int32)),
            }
        ),
        torch.zeros(2),
    )
    with torch.no_grad():
        local = model(batch.dense, batch.sparse).numpy()
    served = serve(model).infer(_request(batch, width=2))["logits"]
    np.testing.assert_allclose(served, local, rtol=0, atol=1e-5)
