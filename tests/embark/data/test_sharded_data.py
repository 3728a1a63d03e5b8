"""Sharded training where every rank generates only its slice of each global batch
(``torchrun -m embark.sharded_train`` on worlds 2 and 4, launched by
:func:`gloo_world.launch_ranks`) equals one process trained on the whole global batches, and
its checkpoint records the data stream exactly. The global batch (30) does not divide by 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from embark.data.synthetic import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.sharding.run import DEFAULT_EMBEDDING_LR, DEFAULT_LR, DEFAULT_SEED
from embark.training.config import OptimizerKind, TrainConfig
from embark.training.trainer import Trainer
from tests.embark.gloo_world import launch_ranks
from tests.embark.sharding.plans import tiny_plan
from tests.tolerances import tol

STEPS, BATCH = 3, 30
# SGD: Adagrad without a starting accumulator turns reordered sums of cancelling gradients
# into visible steps (tests/embark/sharding/test_sharded_training.py, CASES)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    world = request.param
    d = tmp_path_factory.mktemp(f"per_rank{world}")
    plan = d / "plan.json"
    plan.write_text(json.dumps(tiny_plan(world)))
    args = ["-m", "embark.sharded_train", "--workload", "tiny", "--steps", str(STEPS),
            "--batch-size", str(BATCH), "--eval-batches", "1", "--log-every", "100",
            "--optimizer", "sgd", "--plan", str(plan), "--checkpoint-dir", str(d / "ckpt")]  # fmt: skip
    for r, p in enumerate(launch_ranks(world, args)):
        assert p.returncode == 0, f"rank {r}: " + p.stdout[-3000:] + p.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def reference() -> tuple[Trainer, SyntheticCTR]:
    w = get_workload("tiny")
    cfg = TrainConfig(
        lr=DEFAULT_LR, embedding_lr=DEFAULT_EMBEDDING_LR, seed=DEFAULT_SEED,
        optimizer=OptimizerKind.SGD,
    )  # fmt: skip
    trainer = Trainer(build_model(w, seed=DEFAULT_SEED), cfg)
    data = SyntheticCTR(w, BATCH, seed=DEFAULT_SEED)
    for i in range(STEPS):
        trainer.train_step(data.batch(i))
    return trainer, data


def test_per_rank_data_trains_like_one_process(
    run: Path, reference: tuple[Trainer, SyntheticCTR]
) -> None:
    single, data = reference
    sharded = Trainer.load_checkpoint(run / "ckpt")
    assert sharded.step == STEPS
    want, got = single.model.state_dict(), sharded.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol("sharded_train"), msg=k)
    assert any(
        not torch.equal(want[k], build_model(data.workload, seed=0).state_dict()[k]) for k in want
    )
    # the recorded stream regenerates the very batches the ranks trained on
    assert sharded.data_stream == json.loads(json.dumps(data.stream_config()))
    again = SyntheticCTR.from_stream_config(data.workload, BATCH, DEFAULT_SEED, sharded.data_stream)
    a, b = again.batch(STEPS - 1), data.batch(STEPS - 1)
    assert (
        torch.equal(a.labels, b.labels)
        and torch.equal(a.dense, b.dense)
        and a.sparse.equals(b.sparse)
    )
