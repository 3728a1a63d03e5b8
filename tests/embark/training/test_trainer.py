from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import embark.training.checkpoint.store as ckpt_mod
from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import Workload, get_workload
from embark.training.trainer import Callback, TrainConfig, Trainer
from embark.types import TableConfig


@pytest.fixture(scope="module")
def data() -> SyntheticCTR:
    w = get_workload("tiny")
    return SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=64, seed=5)


def _trainer(data: SyntheticCTR, **cfg) -> Trainer:
    return Trainer(build_model(data.workload, seed=1), TrainConfig(lr=0.05, **cfg))


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    pa = {n: p for n, p in a.model.named_parameters()}
    pb = {n: p for n, p in b.model.named_parameters()}
    for n in pa:
        st_a, st_b = a.optimizer.state[pa[n]], b.optimizer.state[pb[n]]
        assert st_a.keys() == st_b.keys()
        for k in st_a:
            assert torch.equal(torch.as_tensor(st_a[k]), torch.as_tensor(st_b[k])), (n, k)
    assert a.embedding_updates is not None and b.embedding_updates is not None
    ea, eb = a.embedding_updates.state_tensors(), b.embedding_updates.state_tensors()
    assert ea.keys() == eb.keys()
    for k in ea:
        assert torch.equal(ea[k], eb[k]), k


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_same_seed_gives_bit_identical_metrics(data, optimizer):
    evals = list(data.batches(2, split="eval"))
    runs = []
    for _ in range(2):
        t = _trainer(data, optimizer=optimizer, momentum=0.9 if optimizer == "sgd" else 0.0)
        stats = t.fit(data.batches(12), 12, progress=False)
        runs.append((t, stats.loss, t.evaluate(evals)))
    (a, loss_a, m_a), (b, loss_b, m_b) = runs
    assert loss_a == loss_b
    assert m_a == m_b  # floats compared exactly
    _assert_same_state(a, b)


def test_resume_equals_uninterrupted(data, tmp_path):
    full = _trainer(data, seed=3)
    full.fit(data.batches(16), 16, progress=False)

    first = _trainer(data, seed=3)
    first.fit(data.batches(9), 9, progress=False)
    torch.rand(3, generator=first.generator)  # advance the trainer RNG: it must be restored
    first.save_checkpoint(tmp_path / "ck")
    state = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert state["step"] == state["data_position"] == 9 and state["batch_size"] == 64
    assert state["workload"] == data.workload.to_dict()

    resumed = Trainer.load_checkpoint(tmp_path / "ck")
    assert resumed.step == 9 and resumed.batch_size == 64
    assert torch.equal(resumed.generator.get_state(), first.generator.get_state())
    resumed.fit(
        data.batches(16 - resumed.step, start=resumed.step), 16 - resumed.step, progress=False
    )
    assert resumed.step == 16
    _assert_same_state(full, resumed)


def test_a_larger_batch_than_the_recorded_one_is_refused(data, tmp_path):
    """The first step records the stream's batch size, a checkpoint keeps it: a shorter batch
    (a file's last) is taken, a larger one refused, before the step changes anything."""
    t = _trainer(data)
    t.fit(data.batches(2), 2, progress=False)
    short = SyntheticCTR(data.workload, batch_size=10, seed=5)
    big = SyntheticCTR(data.workload, batch_size=65, seed=5)
    # a checkpoint that recorded it refuses the larger batch at once
    strict = Trainer.load_checkpoint(t.save_checkpoint(tmp_path / "ck2"))
    strict.train_step(next(iter(short.batches(1))))
    with pytest.raises(
        ValueError, match=r"a batch of 65 samples, but this trainer's data stream has 64"
    ):
        strict.train_step(next(iter(big.batches(1))))
    assert strict.step == 3 and strict.batch_size == 64


def test_misshaped_optimizer_state_is_refused_before_anything_loads(data, tmp_path):
    """An optimizer state tensor of the wrong shape (its file's hash rewritten to match) is a
    clear error at load, naming the key, not a failure at the first step."""
    from safetensors.torch import load_file, save_file

    t = _trainer(data, optimizer="adagrad")
    t.fit(data.batches(2), 2, progress=False)
    ck = t.save_checkpoint(tmp_path / "ck")
    f = ck / "optimizer.safetensors"
    opt = load_file(str(f))
    key = next(k for k in opt if k.endswith("::sum") and k.startswith("embeddings."))
    opt[key] = torch.zeros(3, 3)
    save_file(opt, str(f))
    state = json.loads((ck / "state.json").read_text())
    state["files"][f.name] = {"bytes": f.stat().st_size, "sha256": ckpt_mod._sha256(f)}
    (ck / "state.json").write_text(json.dumps(state))
    with pytest.raises(
        ValueError,
        match=rf"optimizer state '{key}' is \(3, 3\) torch.float32, expected \(1000, 16\)",
    ):
        Trainer.load_checkpoint(ck)


def test_truncated_checkpoint_is_a_clear_error_and_touches_nothing(data, tmp_path):
    t = _trainer(data)
    t.fit(data.batches(3), 3, progress=False)
    ck = t.save_checkpoint(tmp_path / "ck")
    f = ck / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    target = build_model(data.workload, seed=9)
    weights = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"model\.safetensors' is \d+ bytes but \d+ were written"):
        Trainer.load_checkpoint(ck, model=target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in weights.items())
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    # A truncated file whose record was rewritten to match still fails clearly (safetensors'
    # own check). (A state.json with no record for it is a schema error: test_checkpoint_schema.)
    state = json.loads((ck / "state.json").read_text())
    state["files"]["model.safetensors"] = {
        "bytes": f.stat().st_size,
        "sha256": ckpt_mod._sha256(f),
    }
    (ck / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="cannot be read"):
        Trainer.load_checkpoint(ck, model=target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in weights.items())


def test_failed_save_keeps_the_old_checkpoint(data, tmp_path, monkeypatch):
    t = _trainer(data)
    ck = t.save_checkpoint(tmp_path / "ck")
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    t.fit(data.batches(2), 2, progress=False)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        t.save_checkpoint(ck)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp folder left behind
    assert Trainer.load_checkpoint(ck).step == 0

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        t.save_checkpoint(tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"


def test_checkpoint_of_a_different_model_is_rejected(data, tmp_path):
    ck = _trainer(data).save_checkpoint(tmp_path / "ck")
    other = build_model(replace(data.workload, tables=data.workload.tables[:3]))
    with pytest.raises(ValueError, match="does not fit the model"):
        Trainer.load_checkpoint(ck, model=other)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: TableConfig("t0", num_rows=-5, dim=8), "num_rows"),
        (lambda: TableConfig("t0", num_rows=10, dim=0), "dim"),
        (
            lambda: Workload.from_dict(
                get_workload("tiny").to_dict()
                | {"tables": [{"name": "a", "num_rows": -1, "dim": 4}]}
            ),
            "num_rows",
        ),
        (lambda: TrainConfig(lr=-0.1), "lr"),
        (lambda: TrainConfig(optimizer="adam"), "optimizer"),
        (lambda: TrainConfig(eval_every=-1), "eval_every"),
        (lambda: TrainConfig(checkpoint_every=5), "checkpoint_dir"),
    ],
)
def test_bad_config_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_callbacks_see_grads_before_the_step_and_evals(data):
    seen: list[tuple] = []

    class Recorder(Callback):
        def on_after_backward(self, trainer, step):
            w = trainer.model.top_mlp[0].weight
            seen.append(("backward", step, w.grad is not None, w.detach().clone()))

        def on_step_end(self, trainer, step, loss):
            seen.append(("end", step, loss, trainer.model.top_mlp[0].weight.detach().clone()))

        def on_eval(self, trainer, step, metrics):
            seen.append(("eval", step, metrics["auc"]))

    t = _trainer(data, eval_every=2)
    t.add_callback(Recorder())
    evals = list(data.batches(1, split="eval"))
    t.fit(data.batches(4), 4, progress=False, eval_batches=evals)
    kinds = [s[:2] for s in seen]
    assert kinds == [
        ("backward", 1), ("end", 1), ("backward", 2), ("end", 2), ("eval", 2),
        ("backward", 3), ("end", 3), ("backward", 4), ("end", 4), ("eval", 4),
    ]  # fmt: skip
    back1, end1 = seen[0], seen[1]
    assert back1[2] is True
    assert not torch.equal(back1[3], end1[3])  # the optimizer step ran between the hooks
    assert [h["step"] for h in t.history] == [2, 4]


def test_rebuild_optimizer_keeps_state_of_parametrized_weights(data):
    t = _trainer(data)
    t.fit(data.batches(2), 2, progress=False)
    lin = t.model.top_mlp[0]
    weight = lin.weight
    acc = t.optimizer.state[weight]["sum"].clone()

    class Mask(nn.Module):
        def forward(self, w):
            return w * (torch.arange(w.shape[1]) % 2 == 0)

    parametrize.register_parametrization(lin, "weight", Mask())
    t.rebuild_optimizer()
    original = lin.parametrizations.weight.original
    assert original is weight
    assert torch.equal(t.optimizer.state[original]["sum"], acc)
    t.fit(data.batches(1, start=2), 1, progress=False)
    assert t.step == 3


def test_fit_errors_when_batches_run_out(data):
    t = _trainer(data)
    with pytest.raises(ValueError, match="ran out after 2 of 5"):
        t.fit(data.batches(2), 5, progress=False)


def test_checkpoint_with_torchs_default_optimizer_flags_loads(data, tmp_path):
    """The dense Adagrad runs torch's fused kernel (``fused: true`` in the saved groups); a
    checkpoint whose groups hold torch's default ``null`` for it loads and trains on, and a
    flag of another kind is refused naming it."""
    t = _trainer(data, optimizer="adagrad")
    t.fit(data.batches(2), 2, progress=False)
    ck = t.save_checkpoint(tmp_path / "ck")
    path = ck / "state.json"
    state = json.loads(path.read_text())
    assert [g["fused"] for g in state["param_groups"]] == [True] * len(state["param_groups"])
    for g in state["param_groups"]:
        g["fused"] = None
    path.write_text(json.dumps(state))
    resumed = Trainer.load_checkpoint(ck)
    resumed.fit(data.batches(1, start=2), 1, progress=False)
    assert resumed.step == 3
    state["param_groups"][0]["fused"] = "yes"
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.fused must be null, true or false"):
        Trainer.load_checkpoint(ck)
