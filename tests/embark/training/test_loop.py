"""The training loop: frozen tables and layers, early stopping, keep-best checkpoints, epochs
with reshuffling, parameter groups, the typed fit report, torch.save / deepcopy after fit."""

from __future__ import annotations

import copy
import io
import json
from dataclasses import replace

import pytest
import torch

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training import (
    EarlyStopping,
    EmbeddingKernel,
    FitReport,
    KeepBest,
    MetricMode,
    Monitor,
    ParamGroup,
    TrainConfig,
    Trainer,
    reshuffled,
)


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=64, seed=5)


def _trainer(data: SyntheticCTR, **cfg) -> Trainer:
    return Trainer(build_model(data.workload, seed=1), TrainConfig(lr=0.05, **cfg))


#: "step" grows at every evaluation: watched with mode MIN it improves once, then never
NEVER_AGAIN = Monitor("step", MetricMode.MIN)
ALWAYS = Monitor("step", MetricMode.MAX)


@pytest.mark.parametrize("kernel", [EmbeddingKernel.AUTO, EmbeddingKernel.REFERENCE])
def test_requires_grad_false_freezes_a_table_and_a_layer(data, kernel):
    model = build_model(data.workload, seed=1)
    frozen_table = model.embeddings["t1"].weight
    frozen_layer = model.bottom_mlp[0].weight
    frozen_table.requires_grad_(False)
    frozen_layer.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = Trainer(model, TrainConfig(lr=0.05, embedding_kernel=kernel))
    t.fit(data.batches(3), 3, progress=False)
    after = dict(model.named_parameters())
    assert torch.equal(after["embeddings.t1.weight"], before["embeddings.t1.weight"])
    assert torch.equal(after["bottom_mlp.0.weight"], before["bottom_mlp.0.weight"])
    assert not torch.equal(after["embeddings.t0.weight"], before["embeddings.t0.weight"])
    assert not torch.equal(after["top_mlp.0.weight"], before["top_mlp.0.weight"])
    assert t.embedding_updates is not None and t.embedding_updates.frozen == {"t1"}
    # a second trainer over the same model keeps the table frozen (and t0 trainable)
    t2 = Trainer(model, TrainConfig(lr=0.05, embedding_kernel=kernel))
    assert t2.embedding_updates is not None and t2.embedding_updates.frozen == {"t1"}
    t2.embedding_updates.set_frozen("t1", False)
    t2.fit(data.batches(1, start=3), 1, progress=False)
    assert not torch.equal(after["embeddings.t1.weight"], before["embeddings.t1.weight"])


def test_fit_report_is_typed(data):
    t = _trainer(data)
    report = t.fit(data.batches(3), 3, progress=False)
    assert isinstance(report, FitReport)
    assert (report.steps, report.samples, report.epochs) == (3, 192, 0)
    assert report.stop_reason is None and not report.stopped_early
    assert report.loss == pytest.approx(report.loss_sum / 3)
    assert report.samples_per_s > 0


def test_early_stopping_stops_fit(data):
    t = _trainer(data, eval_every=2)
    stop = EarlyStopping(NEVER_AGAIN, patience=2)
    t.add_callback(stop)
    evals = list(data.batches(1, split="eval"))
    report = t.fit(data.batches(20), 20, progress=False, eval_batches=evals)
    # evaluations at steps 2 (best), 4, 6 (patience 2 spent): stopped after step 6
    assert report.steps == 6 and t.step == 6
    assert report.stopped_early and "early stopping at step 6" in (report.stop_reason or "")
    assert [e["step"] for e in report.evaluations] == [2, 4, 6]
    assert (stop.best, stop.best_step, stop.waited) == (2.0, 2, 2)
    # the next fit starts afresh (the request was for the call that stopped)
    again = t.fit(data.batches(1, start=6), 1, progress=False)
    assert again.steps == 1 and not again.stopped_early


def test_early_stopping_waits_while_the_metric_improves(data):
    t = _trainer(data, eval_every=2)
    t.add_callback(EarlyStopping(ALWAYS, patience=1))
    evals = list(data.batches(1, split="eval"))
    report = t.fit(data.batches(8), 8, progress=False, eval_batches=evals)
    assert report.steps == 8 and not report.stopped_early


def _step_of(folder) -> int:
    return json.loads((folder / "state.json").read_text())["step"]


def test_keep_best_never_replaces_the_best_with_a_worse_one(data, tmp_path):
    evals = list(data.batches(1, split="eval"))
    t = _trainer(data, eval_every=2)
    keep = KeepBest(tmp_path / "ckpt", NEVER_AGAIN)
    t.add_callback(keep)
    t.fit(data.batches(6), 6, progress=False, eval_batches=evals)
    assert _step_of(keep.best_path) == 2 and _step_of(keep.last_path) == 6
    best = Trainer.load_checkpoint(keep.best_path)
    assert best.step == 2
    # a resumed run (a new callback on the same folder) still has to beat the saved best
    resumed = Trainer.load_checkpoint(keep.last_path)
    again = KeepBest(tmp_path / "ckpt", NEVER_AGAIN)
    assert again.best == 2.0
    resumed.add_callback(again)
    resumed.fit(data.batches(2, start=6), 2, progress=False, eval_batches=evals)
    assert _step_of(keep.best_path) == 2 and _step_of(keep.last_path) == 8


def test_keep_best_follows_an_improving_metric(data, tmp_path):
    evals = list(data.batches(1, split="eval"))
    t = _trainer(data, eval_every=2)
    keep = KeepBest(tmp_path / "ckpt", ALWAYS)
    t.add_callback(keep)
    t.fit(data.batches(4), 4, progress=False, eval_batches=evals)
    assert _step_of(keep.best_path) == 4 and keep.best == 4.0


def test_reshuffled_epochs(data):
    batches = list(data.batches(3))  # 192 samples
    e0, e0_again, e1 = reshuffled(batches, 0), reshuffled(batches, 0), reshuffled(batches, 1)
    assert [b.batch_size for b in e0] == [64, 64, 64]
    for a, b in zip(e0, e0_again, strict=True):
        assert torch.equal(a.dense, b.dense) and a.sparse.equals(b.sparse)
    assert not torch.equal(e0[0].dense, e1[0].dense)
    # a permutation of the samples: each sample's dense row, label and bags travel together
    whole = {}
    for b in batches:
        for i in range(b.batch_size):
            bags = tuple(
                tuple(
                    b.sparse.values_for(k)[b.sparse.bag_offsets(k)[i] :][
                        : int(b.sparse.lengths_for(k)[i])
                    ].tolist()
                )
                for k in b.sparse.keys
            )
            whole[tuple(b.dense[i].tolist())] = (float(b.labels[i]), bags)
    seen = 0
    for b in e1:
        for i in range(b.batch_size):
            label, bags = whole[tuple(b.dense[i].tolist())]
            assert float(b.labels[i]) == label
            got = tuple(
                tuple(
                    b.sparse.values_for(k)[b.sparse.bag_offsets(k)[i] :][
                        : int(b.sparse.lengths_for(k)[i])
                    ].tolist()
                )
                for k in b.sparse.keys
            )
            assert got == bags
            seen += 1
    assert seen == 192


def test_fit_epochs_counts_epochs_and_stops(data):
    batches = list(data.batches(2))
    t = _trainer(data)
    report = t.fit_epochs(lambda e: reshuffled(batches, e), epochs=2, progress=False)
    assert (report.epochs, report.steps, t.step) == (2, 4, 4)
    t2 = _trainer(data, eval_every=1)
    t2.add_callback(EarlyStopping(NEVER_AGAIN, patience=1))
    evals = list(data.batches(1, split="eval"))
    r2 = t2.fit_epochs(
        lambda e: reshuffled(batches, e), epochs=5, progress=False, eval_batches=evals
    )
    assert (r2.epochs, r2.steps) == (1, 2) and r2.stopped_early  # evaluations at 1, 2
    t3 = _trainer(data, eval_every=1)
    t3.add_callback(EarlyStopping(NEVER_AGAIN, patience=1))
    three = list(data.batches(3))
    r3 = t3.fit_epochs(lambda e: three, epochs=5, progress=False, eval_batches=evals)
    assert (r3.epochs, r3.steps) == (0, 2) and r3.stopped_early  # stopped inside epoch 0


def test_param_groups_have_their_own_learning_rates(data, tmp_path):
    groups = (
        ParamGroup("head", ("top_mlp.*",), lr=0.5),
        ParamGroup("t0", ("embeddings.t0.weight",), lr=0.25),
    )
    t = _trainer(data, param_groups=groups, warmup_steps=2)
    by_name = {g["name"]: g for g in t.optimizer.param_groups}
    assert set(by_name) == {"dense", "head"}
    head = {id(p) for p in t.model.top_mlp.parameters()}
    assert {id(p) for p in by_name["head"]["params"]} == head
    assert not head & {id(p) for p in by_name["dense"]["params"]}
    t.fit(data.batches(1), 1, progress=False)  # warm-up: half of each rate
    assert by_name["head"]["lr"] == 0.25 and by_name["dense"]["lr"] == 0.025
    assert t.embedding_updates is not None
    lrs = {n: u.optimizer.lr for n, u in t.embedding_updates.updates.items()}
    assert lrs["t0"] == 0.125 and lrs["t1"] == 0.025
    t.fit(data.batches(2, start=1), 2, progress=False)
    assert by_name["head"]["lr"] == 0.5
    # the groups round-trip through a checkpoint, and a resumed run continues exactly
    saved = t.save_checkpoint(tmp_path / "c")
    loaded = Trainer.load_checkpoint(saved)
    assert loaded.cfg.param_groups == groups
    t.fit(data.batches(1, start=3), 1, progress=False)
    loaded.fit(data.batches(1, start=3), 1, progress=False)
    for (k, a), (_, b) in zip(
        t.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k


def test_param_group_errors_name_the_field():
    with pytest.raises(ValueError, match="not one of"):
        ParamGroup("dense", ("x",), lr=0.1)
    with pytest.raises(ValueError, match="lr must be"):
        ParamGroup("g", ("x",), lr=0.0)
    with pytest.raises(ValueError, match="distinct"):
        TrainConfig(param_groups=(ParamGroup("g", ("a",), 0.1), ParamGroup("g", ("b",), 0.1)))
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)


def test_torch_save_and_deepcopy_after_fit(data):
    t = _trainer(data)  # the default kernel: FBGEMM's where it imports
    t.fit(data.batches(2), 2, progress=False)
    buf = io.BytesIO()
    torch.save(t.model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(t.model)
    b = next(iter(data.batches(1, split="eval")))
    with torch.no_grad():
        want = t.model(b.dense, b.sparse)
        assert torch.equal(loaded(b.dense, b.sparse), want)
        assert torch.equal(copied(b.dense, b.sparse), want)
    # the loaded model trains on (its kernels rebuilt on first use) exactly as the original
    t2 = Trainer(loaded, t.cfg)
    t3 = Trainer(t.model, t.cfg)
    t2.fit(data.batches(1, start=2), 1, progress=False)
    t3.fit(data.batches(1, start=2), 1, progress=False)
    for (k, x), (_, y) in zip(
        loaded.state_dict().items(), t.model.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), k
