"""The one Trainer over a :class:`ShardedDLRM` on a one-rank world (no process group): the
same steps, loss and evaluation as over the single-process DLRM, and checkpoints only through
the sharded save."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from embark import (
    ShardedDLRM,
    SyntheticCTR,
    TrainConfig,
    Trainer,
    build_model,
    get_topology,
    get_workload,
    load_sharded_checkpoint,
    plan_sharding,
    save_sharded_checkpoint,
)
from embark.sharding.model import ShardedSync
from embark.training.sync import LocalSync
from embark.types import GradReduce
from tests.tolerances import tol

CFG = TrainConfig(lr=0.05, embedding_lr=0.1, initial_accumulator_value=0.01)


def test_one_rank_sharded_trainer_equals_the_single_process_one(tmp_path: Path) -> None:
    w = get_workload("tiny")
    plan = plan_sharding(w, replace(get_topology("cpu-local"), gpus_per_node=1), 32)
    data = SyntheticCTR(w, 32, seed=4)
    single = Trainer(build_model(w, seed=3), CFG)
    sharded = Trainer(ShardedDLRM(build_model(w, seed=3), plan, 0), CFG)
    assert isinstance(single.sync, LocalSync) and isinstance(sharded.sync, ShardedSync)
    want = [single.train_step(b) for b in data.batches(3)]
    got = [sharded.train_step(b) for b in data.batches(3)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol("sharded_train"))
    full = sharded.model.full_state_dict(dst=None)
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(full[k], v, **tol("sharded_train"), msg=k)
    evals = list(data.batches(2, split="eval"))
    a, b = single.evaluate(evals), sharded.evaluate(evals)
    assert a["num_samples"] == b["num_samples"] == 64 and a["step"] == b["step"] == 3
    assert a["auc"] == pytest.approx(b["auc"], abs=1e-4)

    with pytest.raises(ValueError, match="save it with embark.sharding.save_sharded_checkpoint"):
        sharded.save_checkpoint(tmp_path / "direct")
    assert not (tmp_path / "direct").exists()
    save_sharded_checkpoint(sharded, tmp_path / "ck")
    resumed = Trainer.load_checkpoint(tmp_path / "ck")
    assert (resumed.step, resumed.batch_size) == (3, 32)
    again = load_sharded_checkpoint(tmp_path / "ck", plan, 0)
    assert again.step == 3 and isinstance(again.sync, ShardedSync)
    b3 = next(iter(data.batches(1, start=3)))
    torch.testing.assert_close(
        torch.tensor(again.train_step(b3)),
        torch.tensor(single.train_step(b3)),
        **tol("sharded_train"),
    )


def test_build_equals_the_model_built_whole_bit_for_bit() -> None:
    """``ShardedDLRM.build`` on one rank: every table and dense weight equal to
    ``ShardedDLRM(build_model(...))``'s; ``seed=None`` has the same parameters, tables zero."""
    w = get_workload("tiny")
    plan = plan_sharding(w, replace(get_topology("cpu-local"), gpus_per_node=1), 32)
    want = ShardedDLRM(build_model(w, seed=3), plan, 0).state_dict()
    got = ShardedDLRM.build(w, plan, 0, seed=3).state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    blank = ShardedDLRM.build(w, plan, 0, seed=None)
    assert {k: v.shape for k, v in blank.state_dict().items()} == {
        k: v.shape for k, v in want.items()
    }
    assert all(not p.any() for p in blank.embedding_tables().values())


def test_grad_reduce_and_bucket_size_are_fixed_once_the_buckets_exist() -> None:
    w = get_workload("tiny")
    plan = plan_sharding(w, replace(get_topology("cpu-local"), gpus_per_node=1), 32)
    model = ShardedDLRM(build_model(w, seed=3), plan, 0)
    model.grad_reduce = GradReduce.FLAT  # before the first step: taken
    model.grad_bucket_bytes = 4 << 20
    buckets = model.gradient_buckets()
    assert buckets.bucket_bytes == 4 << 20
    with pytest.raises(RuntimeError, match="grad_reduce to <GradReduce.HIERARCHICAL"):
        model.grad_reduce = GradReduce.HIERARCHICAL
    with pytest.raises(RuntimeError, match="grad_bucket_bytes to 1048576"):
        model.grad_bucket_bytes = 1 << 20
    assert model.grad_reduce is GradReduce.FLAT and model.grad_bucket_bytes == 4 << 20
