"""The pruner across training: resuming a pruned run from a checkpoint, pruned weights held at 0
with any optimizer, and what a compressed model can (not) train."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer
from tilesparse import MultiStageSchedule, TileSparseConfig, TileSparsePruner, prune_
from tilesparse.callback import PruningCallback

# stages 0.25 (steps 0-3), 0.5 (4-7), 0.75 (8 on)
SCHEDULE = MultiStageSchedule((0.25, 0.5), steps_per_stage=4)


@pytest.fixture(scope="module")
def tiny():
    w = get_workload("tiny")
    data = SyntheticCTR(w, batch_size=64, seed=0)
    return w, [data.batch(i) for i in range(12)]


def _pruned_trainer(w, cfg: TileSparseConfig, train_cfg: TrainConfig | None = None):
    model = build_model(w, seed=0)
    pruner = TileSparsePruner(cfg)
    trainer = Trainer(model, train_cfg or TrainConfig(lr=0.05))
    pruner.prepare(model)
    trainer.rebuild_optimizer()
    trainer.add_callback(pruner.callback())
    return trainer, pruner


def _resume(w, cfg: TileSparseConfig, ckpt) -> tuple[Trainer, TileSparsePruner]:
    model = build_model(w, seed=0)
    pruner = TileSparsePruner(cfg)
    pruner.prepare(model)
    return Trainer.load_checkpoint(
        ckpt, model=model, callbacks=[pruner.callback(step_offset=0)]
    ), pruner


def test_resume_continues_the_schedule_from_the_trainer_step(tiny, tmp_path) -> None:
    """Checkpoint at step 5 (stage 0.5); the resumed run must reach 0.75 at step 8 as the
    uninterrupted one does, not restart the schedule at step 0 (0.75 only at step 13)."""
    w, batches = tiny
    cfg = TileSparseConfig(sparsity=0.75, tile=16, schedule=SCHEDULE)
    trainer, pruner = _pruned_trainer(w, cfg)
    for b in batches[:5]:
        trainer.train_step(b)
    assert pruner.current_sparsity == 0.5
    trainer.save_checkpoint(tmp_path / "ck")

    resumed, pr2 = _resume(w, cfg, tmp_path / "ck")
    assert resumed.step == 5
    assert abs(pr2.overall_sparsity() - 0.5) <= 0.01  # the masks came back with the model
    for i, b in enumerate(batches[5:], start=6):
        resumed.train_step(b)
        assert pr2.step_count == resumed.step == i
        assert pr2.current_sparsity == (0.5 if i < 8 else 0.75), i
    assert abs(pr2.overall_sparsity() - 0.75) <= 0.01
    # the masks recomputed at the resume are the schedule's and keep pruned weights at 0
    for f, lin in pr2.layers.items():
        mask_nk = pr2.mask(f).T
        assert not bool(lin.parametrizations.weight.original.detach()[~mask_nk].any())


def test_resume_with_pruner_state_is_exact(tiny, tmp_path) -> None:
    """With the pruner's state_dict saved beside the checkpoint (JSON + safetensors), the resumed
    run ends bit-identical to the uninterrupted one: masks, weights, update count, movement sums."""
    w, batches = tiny
    cfg = TileSparseConfig(sparsity=0.75, tile=16, importance="movement", schedule=SCHEDULE)
    ref, ref_pruner = _pruned_trainer(w, cfg)
    for b in batches[:6]:
        ref.train_step(b)
    ref.save_checkpoint(tmp_path / "ck")
    state = ref_pruner.state_dict()
    sums = state.pop("tracker_sums")
    assert sums  # movement keeps per-layer sums
    (tmp_path / "pruner.json").write_text(json.dumps(state))
    save_file(sums, tmp_path / "pruner.safetensors")
    for b in batches[6:]:
        ref.train_step(b)

    resumed, pr2 = _resume(w, cfg, tmp_path / "ck")
    pr2.load_state_dict(
        json.loads((tmp_path / "pruner.json").read_text())
        | {"tracker_sums": load_file(tmp_path / "pruner.safetensors")}
    )
    for b in batches[6:]:
        resumed.train_step(b)
    assert (
        (pr2.step_count, pr2.current_sparsity, pr2.updates)
        == (ref_pruner.step_count, ref_pruner.current_sparsity, ref_pruner.updates)
        == (12, 0.75, 3)
    )
    for f in ref_pruner.layers:
        assert torch.equal(pr2.mask(f), ref_pruner.mask(f)), f
    want, got = ref.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_load_state_dict_refuses_foreign_state(tiny) -> None:
    w, _ = tiny
    cfg = TileSparseConfig(sparsity=0.75, tile=16, schedule=SCHEDULE)
    _, pruner = _pruned_trainer(w, cfg)
    good = pruner.state_dict()
    with pytest.raises(ValueError, match="lacks"):
        pruner.load_state_dict({k: v for k, v in good.items() if k != "updates"})
    with pytest.raises(ValueError, match=r"step_count must be an integer >= 0, got -1"):
        pruner.load_state_dict(good | {"step_count": -1})
    with pytest.raises(ValueError, match=r"current_sparsity must be in \[0, 1\), got 1.5"):
        pruner.load_state_dict(good | {"current_sparsity": 1.5})
    with pytest.raises(ValueError, match="is for layers"):
        pruner.load_state_dict(good | {"layers": ["nope"]})
    with pytest.raises(ValueError, match="keeps none"):
        pruner.load_state_dict(good | {"tracker_steps": 3, "tracker_sums": {}})
    assert pruner.step_count == 0 and pruner.current_sparsity == 0.25  # unchanged
    with pytest.raises(ValueError, match="step_offset must be an integer >= 0 or None, got -2"):
        PruningCallback(pruner, step_offset=-2)


def _dense_then_pruner(w, batches) -> tuple[Trainer, TileSparsePruner]:
    """3 dense steps, then a pruner prepared on the model (no callback yet)."""
    model = build_model(w, seed=0)
    trainer = Trainer(model, TrainConfig(lr=0.05))
    for b in batches[:3]:
        trainer.train_step(b)
    pruner = TileSparsePruner(TileSparseConfig(sparsity=0.75, tile=16, schedule=SCHEDULE))
    pruner.prepare(model)
    trainer.rebuild_optimizer()
    return trainer, pruner


def test_step_offset_starts_the_schedule_after_dense_training(tiny) -> None:
    w, batches = tiny
    trainer, pruner = _dense_then_pruner(w, batches)
    trainer.add_callback(pruner.callback(step_offset=trainer.step))
    for b in batches[3:7]:
        trainer.train_step(b)
    assert (trainer.step, pruner.step_count, pruner.current_sparsity) == (7, 4, 0.5)


def test_sgd_momentum_keeps_pruned_original_at_zero(tiny) -> None:
    """SGD momentum moves ``original`` where the gradient is 0; the pruner zeroes it after each
    optimizer step, so the weights and the saved state hold zeros at every pruned position."""
    w, batches = tiny
    cfg = TileSparseConfig(sparsity=0.75, tile=16, schedule=SCHEDULE)
    model = build_model(w, seed=0)
    trainer = Trainer(model, TrainConfig(lr=0.05, optimizer="sgd", momentum=0.9))
    trainer.fit(batches[:2], 2, progress=False)  # momentum buffers exist before pruning
    pruner = TileSparsePruner(cfg)
    pruner.prepare(model)
    trainer.rebuild_optimizer()
    trainer.add_callback(pruner.callback(step_offset=trainer.step))
    for b in batches[2:]:
        trainer.train_step(b)
        sd = model.state_dict()
        for f in pruner.layers:
            orig = sd[f + ".parametrizations.weight.original"]
            mask = sd[f + ".parametrizations.weight.0.mask"]
            assert not bool(orig[~mask].any()), (trainer.step, f)
    assert pruner.current_sparsity == 0.75
    moved = sum(
        int(
            trainer.optimizer.state[lin.parametrizations.weight.original]["momentum_buffer"][
                ~lin.parametrizations.weight[0].mask
            ]
            .ne(0)
            .sum()
        )
        for lin in pruner.layers.values()
    )
    assert moved > 0  # the momentum did push pruned entries: the zeroing is what holds them


def test_compressed_model_trains_biases_only(tiny) -> None:
    """Documented: after compress() the kept weights are buffers (inference only)."""
    w, batches = tiny
    model = build_model(w, seed=0)
    pruner = prune_(model, TileSparseConfig(sparsity=0.75, tile=16))
    pruner.compress()
    names = {n for n, _ in model.named_parameters()}
    for f, lin in pruner.layers.items():
        assert f + ".values" not in names and not lin.values.requires_grad
        assert f + ".values" in model.state_dict()
    trainer = Trainer(model, TrainConfig(lr=0.05))
    before = {f: lin.values.clone() for f, lin in pruner.layers.items()}
    trainer.fit(batches[:2], 2, progress=False)
    assert all(torch.equal(lin.values, before[f]) for f, lin in pruner.layers.items())


def test_a_fresh_pruner_on_a_trained_trainer_must_say_where_the_schedule_starts(tiny) -> None:
    """Attached after 3 dense steps without step_offset, the callback cannot tell "start now"
    from "continue a resumed schedule" (which would jump straight to the target): the first
    step raises before the optimizer moves anything, naming both choices."""
    w, batches = tiny
    trainer, pruner = _dense_then_pruner(w, batches)
    model = trainer.model
    trainer.add_callback(pruner.callback())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"step_offset=3\) to start .* or step_offset=0 to continue"
    ):
        trainer.train_step(batches[3])
    assert trainer.step == 3 and pruner.step_count == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
