from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from embark.data import SyntheticCTR
from embark.models.dlrm import build_model
from embark.models.workloads import get_workload
from embark.training.trainer import TrainConfig, Trainer
from tests.tolerances import tol
from tilesparse import (
    MultiStageSchedule,
    OneShotSchedule,
    TileSparseConfig,
    TileSparseLinear,
    TileSparsePruner,
    is_tile_wise,
    prune_,
)
from tilesparse.format import condense


@pytest.fixture(scope="module")
def tiny():
    w = get_workload("tiny")
    data = SyntheticCTR(w, batch_size=64, seed=0)
    return w, data, [data.batch(i) for i in range(12)]


def test_dlrm_tw_masks_structure_and_compression(tiny) -> None:
    w, _, batches = tiny
    model = build_model(w, seed=0)
    dense = copy.deepcopy(model)
    pruner = prune_(model, TileSparseConfig(pattern="tw", sparsity=0.75, tile=16))
    fqns = set(pruner.layers)
    assert {
        "bottom_mlp.0",
        "interaction.v.0",
        "interaction.u.1",
        "top_mlp.4",
    } <= fqns  # MLPs + cross
    assert abs(pruner.overall_sparsity() - 0.75) <= 0.01
    sparsities = {s.fqn: s.sparsity for s in pruner.stats()}
    assert max(sparsities.values()) - min(sparsities.values()) > 0.2  # one global threshold
    assert all(s.kept >= 0.02 * s.params for s in pruner.stats())  # per-layer floor
    masks = pruner.masks()
    for fqn, mask in masks.items():
        assert is_tile_wise(mask, 16), fqn  # every kept column's tile has one row set
        lin = model.get_submodule(fqn)
        assert torch.equal(lin.weight.detach().T, dense.get_submodule(fqn).weight.detach().T * mask)
        layout = condense(lin.weight.detach().T, mask, 16)
        assert torch.equal(layout.to_dense(), lin.weight.detach().T)
    b = batches[0]
    with torch.no_grad():
        masked_out = model(b.dense, b.sparse)
    pruner.compress()
    for fqn, mask in masks.items():
        sl = model.get_submodule(fqn)
        assert isinstance(sl, TileSparseLinear)
        assert torch.equal(sl.to_dense().weight, dense.get_submodule(fqn).weight.detach() * mask.T)
    with torch.no_grad():
        torch.testing.assert_close(
            model(b.dense, b.sparse), masked_out, **tol("tw_layer", torch.float32)
        )


def test_fine_tuning_keeps_pruned_weights_zero(tiny) -> None:
    w, _, batches = tiny
    model = build_model(w, seed=1)
    cfg = TileSparseConfig(
        sparsity=0.5, tile=16, schedule=MultiStageSchedule((0.25,), steps_per_stage=4)
    )
    pruner = TileSparsePruner(cfg)
    trainer = Trainer(model, TrainConfig(lr=0.05))
    pruner.prepare(model)
    trainer.rebuild_optimizer()
    trainer.add_callback(pruner.callback())
    assert pruner.current_sparsity == 0.25  # stage 0 applied at prepare (magnitude)
    before = {f: model.get_submodule(f).weight.detach().clone() for f in pruner.layers}
    trainer.fit(batches, 10, progress=False)
    assert pruner.current_sparsity == 0.5 and pruner.updates == 2
    assert abs(pruner.overall_sparsity() - 0.5) <= 0.01
    changed = 0
    for f, lin in pruner.layers.items():
        mask_nk = pruner.mask(f).T
        weight = lin.weight.detach()
        assert torch.equal(weight[~mask_nk], torch.zeros(int((~mask_nk).sum())))
        assert torch.equal(
            lin.parametrizations.weight.original.detach()[~mask_nk],
            torch.zeros(int((~mask_nk).sum())),
        )
        changed += int((weight[mask_nk] != before[f][mask_nk]).sum())
        assert lin.parametrizations.weight.original.grad is not None  # gradients flow
    assert changed > 0  # the kept weights did train


def test_taylor_first_update_waits_for_gradients(tiny) -> None:
    w, _, batches = tiny
    model = build_model(w, seed=2)
    cfg = TileSparseConfig(
        sparsity=0.6, tile=16, importance="taylor", schedule=OneShotSchedule(step=3)
    )
    pruner = TileSparsePruner(cfg)
    trainer = Trainer(model, TrainConfig(lr=0.05))
    pruner.prepare(model)
    trainer.rebuild_optimizer()
    trainer.add_callback(pruner.callback())
    trainer.fit(batches, 2, progress=False)
    assert pruner.current_sparsity == 0.0 and pruner.tracker.steps == 2
    trainer.fit(batches[2:], 1, progress=False)
    assert pruner.current_sparsity == 0.6 and pruner.tracker.steps == 0  # reset after the update
    assert abs(pruner.overall_sparsity() - 0.6) <= 0.01
    with pytest.raises(ValueError, match="needs gradients"):
        prune_(build_model(w, seed=2), cfg)


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def _ffn_only(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] in ("linear1", "linear2")


def test_transformer_only_filtered_layers_and_identical_at_sparsity_zero() -> None:
    enc = _encoder()
    ref = copy.deepcopy(enc)
    x = torch.randn(3, 5, 32)
    pruner = prune_(enc, TileSparseConfig(sparsity=0.0, tile=16), filter_fn=_ffn_only)
    assert sorted(pruner.layers) == [f"layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)]
    with torch.no_grad():
        assert torch.equal(enc(x), ref(x))
    enc2 = _encoder()
    pruner = prune_(enc2, TileSparseConfig(sparsity=0.5, tile=16), filter_fn=_ffn_only)
    assert abs(pruner.overall_sparsity() - 0.5) <= 0.01
    for name, m in enc2.named_modules():
        if isinstance(m, nn.Linear):
            parametrized = hasattr(m, "parametrizations")
            assert parametrized == (name in pruner.layers), name
    assert torch.equal(
        enc2.layers[0].self_attn.out_proj.weight, ref.layers[0].self_attn.out_proj.weight
    )
    with torch.no_grad():
        masked = enc2(x)
        pruner.compress()
        torch.testing.assert_close(enc2(x), masked, **tol("tw_layer", torch.float32))
    assert isinstance(enc2.layers[1].linear2, TileSparseLinear)


def test_overrides_and_per_layer_thresholds() -> None:
    model = nn.Sequential(
        nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8)
    )
    cfg = TileSparseConfig(sparsity=0.7, tile=8, overrides={"4": 0.25})
    pruner = prune_(copy.deepcopy(model), cfg)
    by = {s.fqn: s for s in pruner.stats()}
    assert abs(by["4"].sparsity - 0.25) <= 0.02
    shared = [by["0"], by["2"]]
    kept = sum(s.kept for s in shared)
    assert abs(1 - kept / sum(s.params for s in shared) - 0.7) <= 0.01
    local = prune_(
        copy.deepcopy(model), TileSparseConfig(sparsity=0.7, tile=8, global_threshold=False)
    )
    for s in local.stats():
        assert abs(s.sparsity - 0.7) <= 0.03, s
    with pytest.raises(ValueError, match=r"overrides name layer\(s\) \['9'\]"):
        prune_(copy.deepcopy(model), TileSparseConfig(overrides={"9": 0.5}))


def test_bad_use() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    pruner = prune_(model, TileSparseConfig(sparsity=0.5, tile=2))
    with pytest.raises(ValueError, match="already prepared"):
        pruner.prepare(model)
    with pytest.raises(ValueError, match="already has a weight parametrization"):
        prune_(model, TileSparseConfig(sparsity=0.5, tile=2))
    with pytest.raises(ValueError, match="no nn.Linear layer selected"):
        prune_(nn.Sequential(nn.ReLU()), TileSparseConfig())
    with pytest.raises(ValueError, match="call prepare"):
        TileSparsePruner(TileSparseConfig()).step()
    pruner.compress()
    with pytest.raises(ValueError, match="compressed"):
        pruner.update_masks(0.5)


def test_compress_leaves_an_earlier_deepcopy_working() -> None:
    """compress() replaces the parametrized layers instead of un-parametrizing them in place:
    a deep copy shares each layer's generated ``Parametrized*`` class, whose ``weight``
    property ``remove_parametrizations`` would delete."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))
    pruner = prune_(model, TileSparseConfig(sparsity=0.75, tile=32))
    snapshot = copy.deepcopy(model)
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = model(x)
        pruner.compress()
        assert [type(m).__name__ for m in model if not isinstance(m, nn.ReLU)] == [
            "TileSparseLinear"
        ] * 2
        torch.testing.assert_close(snapshot(x), want, rtol=0, atol=0)
        torch.testing.assert_close(model(x), want, **tol("tw_two_layers", torch.float32))


def test_apply_masks_to_builds_the_masked_dense_reference() -> None:
    torch.manual_seed(1)

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32))

    model = build()
    pruner = prune_(model, TileSparseConfig(sparsity=0.75, tile=32))
    ref = pruner.apply_masks_to(build())
    for fqn in ("0", "2"):
        assert torch.equal(ref.get_submodule(fqn).weight != 0, pruner.mask(fqn).T)
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(
            pruner.compress()(x), ref(x), **tol("tw_two_layers", torch.float32)
        )
    with pytest.raises(ValueError, match="weight is \\(96, 64\\), the mask is \\(32, 96\\)"):
        pruner.apply_masks_to(nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(64, 96)))
    with pytest.raises(ValueError, match="no layer '2'"):
        pruner.apply_masks_to(nn.Sequential(nn.Linear(64, 96)))


def _observed_training(importance: str, steps: int) -> tuple[TileSparsePruner, list[torch.Tensor]]:
    """A 16x16 layer trained ``steps`` steps with mask updates after steps 1 and 3; returns
    the pruner and every ``-g·w`` term (K x N) the tracker was shown."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    sched = MultiStageSchedule((0.25,), steps_per_stage=2, start=1)
    pruner = TileSparsePruner(
        TileSparseConfig(pattern="ew", sparsity=0.5, importance=importance, schedule=sched)
    )
    pruner.prepare(model)
    terms: list[torch.Tensor] = []
    observe = pruner.tracker.observe

    def recording(weights, grads):
        terms.append(-(grads["0"].float() * weights["0"].float()))
        observe(weights, grads)

    pruner.tracker.observe = recording
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 16)).sum().backward()
        pruner.observe()
        opt.step()
        opt.zero_grad()
        pruner.step()
    return pruner, terms


def test_movement_accumulates_across_mask_updates() -> None:
    pruner, terms = _observed_training("movement", 4)
    assert pruner.updates == 2 and pruner.current_sparsity == 0.5
    assert pruner.tracker.steps == 4  # never reset by the pruner
    torch.testing.assert_close(pruner.tracker._acc["0"], sum(terms), rtol=0, atol=1e-6)
    pruner.tracker.reset()  # by hand it still starts afresh
    assert pruner.tracker.steps == 0


def test_taylor_restarts_after_each_mask_update() -> None:
    pruner, _ = _observed_training("taylor", 4)
    assert pruner.updates == 2 and pruner.tracker.steps == 1  # step 4 is after the update at 3


@pytest.mark.parametrize("pattern", ["tw", "ew", "nm"])
@pytest.mark.parametrize("shape", [(0, 4), (4, 0)])
def test_empty_layer_is_refused_by_prepare(pattern, shape) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(*shape))
    cfg = TileSparseConfig(pattern=pattern, sparsity=None if pattern == "nm" else 0.5, tile=4)
    want = rf"layer '1' has an empty weight of shape \({shape[1]}, {shape[0]}\)"
    with pytest.raises(ValueError, match=want):
        prune_(model, cfg)
    assert not hasattr(model[0], "parametrizations")  # nothing attached to the other layer
    prune_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "1")


def test_compress_refuses_an_unknown_backend_before_replacing_anything() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    pruner = prune_(model, TileSparseConfig(sparsity=0.5, tile=4))
    with pytest.raises(ValueError, match="unknown tw_linear backend 'fast'"):
        pruner.compress(backend="fast")
    assert not pruner.compressed and all(type(m) is not TileSparseLinear for m in model)
    pruner.compress(backend="reference")
    assert all(isinstance(m, TileSparseLinear) and m.backend == "reference" for m in model)


@pytest.mark.parametrize("pattern", ["ew", "tw"])
def test_min_layer_density_floors_only_layers_sharing_a_threshold(pattern) -> None:
    """``min_layer_density`` (0.02) also capped layers pruned alone: at 0.99 with
    global_threshold=False each layer came out 0.98, and so did an override of 0.99. A layer
    pruned alone now reaches its sparsity; layers sharing the threshold keep the floor."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))

    tol = 0.001 if pattern == "ew" else 16 / 4096  # TW: at most one segment short
    alone = prune_(
        model(), TileSparseConfig(pattern=pattern, sparsity=0.99, tile=16, global_threshold=False)
    )
    for s in alone.stats():
        assert abs(s.sparsity - 0.99) <= tol, s
    over = prune_(
        model(), TileSparseConfig(pattern=pattern, sparsity=0.5, tile=16, overrides={"1": 0.99})
    )
    by = {s.fqn: s.sparsity for s in over.stats()}
    assert abs(by["1"] - 0.99) <= tol and abs(by["0"] - 0.5) <= tol, by
    one = prune_(
        nn.Sequential(nn.Linear(64, 64)), TileSparseConfig(pattern=pattern, sparsity=0.99, tile=16)
    )
    assert abs(one.overall_sparsity() - 0.99) <= tol
    shared = prune_(model(), TileSparseConfig(pattern=pattern, sparsity=0.99, tile=16))
    assert all(s.kept >= 0.02 * s.params for s in shared.stats())  # the floor, as documented
    assert shared.overall_sparsity() <= 0.98 + 1e-9


@pytest.mark.parametrize("importance", ["taylor", "movement"])
def test_a_selected_layer_without_gradients_is_a_clear_error(importance) -> None:
    """Movement raised a bare KeyError('0') when a selected layer got no gradient (frozen)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    pruner = TileSparsePruner(
        TileSparseConfig(
            importance=importance, sparsity=0.5, tile=4, schedule=OneShotSchedule(step=1)
        )
    )
    pruner.prepare(model)
    for p in model[0].parameters():
        p.requires_grad_(False)
    model(torch.randn(4, 8)).sum().backward()
    pruner.observe()
    with pytest.raises(RuntimeError, match=r"importance has no gradients for layer\(s\) \['0'\]"):
        pruner.step()
