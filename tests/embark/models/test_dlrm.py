from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from embark.data import JaggedBatch, SyntheticCTR
from embark.models.dlrm import CrossNetV2, DotInteraction, build_model
from embark.models.workloads import Interaction, Workload, get_workload
from embark.types import Combiner, TableConfig


def _small(interaction: str = "dot", dims=(4, 4, 4), combiner=Combiner.SUM) -> Workload:
    tables = tuple(
        TableConfig(f"t{i}", num_rows=10 + i, dim=d, hotness=3, combiner=combiner)
        for i, d in enumerate(dims)
    )
    return Workload(
        name="small",
        tables=tables,
        dense_features=5,
        bottom_mlp=(8, 4),
        top_mlp=(6, 1),
        interaction=Interaction(type=interaction, num_layers=2, low_rank=3),
    )


def _batch(w: Workload, b: int = 6) -> tuple[torch.Tensor, JaggedBatch]:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(b, w.dense_features, generator=gen)
    per_key = {}
    for t in w.tables:
        lengths = torch.randint(0, 4, (b,), generator=gen, dtype=torch.int32)
        lengths[0] = 0  # an empty bag
        values = torch.randint(0, t.num_rows, (int(lengths.sum()),), generator=gen)
        per_key[t.name] = (values, lengths)
    return dense, JaggedBatch.from_per_key(per_key)


@pytest.mark.parametrize("interaction", ["dot", "dcnv2"])
@pytest.mark.parametrize("dims", [(4, 4, 4), (4, 2, 8)])
def test_forward_shape_names_and_dense_forward(interaction, dims):
    w = _small(interaction, dims)
    model = build_model(w, seed=0)
    dense, sparse = _batch(w)
    out = model(dense, sparse)
    assert out.shape == (6,) and out.dtype == torch.float32
    sd = model.state_dict()
    for t in w.tables:
        assert sd[f"embeddings.{t.name}.weight"].shape == (t.num_rows, t.dim)
    assert set(model.projections) == {t.name for t in w.tables if t.dim != 4}
    pooled = model.pool(sparse)
    assert torch.equal(model.dense_forward(dense, pooled), out)
    if len(set(dims)) == 1:
        assert torch.equal(model.dense_forward(dense, torch.stack(pooled, 1)), out)


def test_every_dense_parameter_lives_in_a_linear():
    # A pruner finds the dense compute by looking for nn.Linear: nothing else may own weights.
    for inter in ("dot", "dcnv2"):
        model = build_model(_small(inter, (4, 2, 8)))
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear | nn.EmbeddingBag):
                own = list(mod.parameters(recurse=False))
                assert not own, f"{name} ({type(mod).__name__}) owns parameters"
    assert isinstance(build_model(_small("dcnv2")).interaction, CrossNetV2)


@pytest.mark.parametrize("combiner", [Combiner.SUM, Combiner.MEAN])
def test_pooling_matches_manual(combiner):
    w = _small("dot", combiner=combiner)
    model = build_model(w)
    with torch.no_grad():  # integer-valued rows: sums are exact
        for bag in model.embeddings.values():
            bag.weight.copy_(torch.arange(bag.weight.numel()).reshape(bag.weight.shape) % 7)
    dense, sparse = _batch(w)
    pooled = model.pool(sparse)
    for i, t in enumerate(w.tables):
        weight = model.embeddings[t.name].weight
        vals, lens = sparse.values_for(t.name), sparse.lengths_for(t.name)
        start = 0
        for s in range(sparse.batch_size):
            n = int(lens[s])
            rows = weight[vals[start : start + n]]
            want = rows.sum(0) if combiner == Combiner.SUM or n == 0 else rows.mean(0)
            torch.testing.assert_close(pooled[i][s], want, rtol=0, atol=1e-6)
            start += n


def test_dot_interaction_matches_loop():
    x = torch.randint(-3, 4, (2, 3)).float()
    emb = torch.randint(-3, 4, (2, 2, 3)).float()
    out = DotInteraction(3)(x, emb)
    z = torch.cat([x[:, None], emb], 1)
    pairs = [z[:, i] @ z[:, j].T for i in range(3) for j in range(i + 1, 3)]
    want = torch.cat([x, torch.stack([p.diagonal() for p in pairs], 1)], 1)
    assert out.shape == (2, DotInteraction.out_features(3, 2))
    assert torch.equal(out, want)


def test_crossnet_matches_formula():
    net = CrossNetV2(4, num_layers=2, low_rank=2)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    x = x0
    for v, u in zip(net.v, net.u):
        x = x0 * (x @ v.weight.T @ u.weight.T + u.bias) + x
    torch.testing.assert_close(net(x0), x, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the inference path writes into u's output instead of a new tensor
        x0_before = x0.clone()
        torch.testing.assert_close(net(x0), x, rtol=1e-6, atol=1e-6)
        assert torch.equal(x0, x0_before)  # the input is not the buffer written into


def test_crossnet_in_place_path_equals_autograd_path_exactly():
    net = CrossNetV2(24, num_layers=3, low_rank=5)
    x0 = torch.randn(7, 24, generator=torch.Generator().manual_seed(2))
    want = net(x0).detach()  # autograd on: out of place
    with torch.no_grad():
        no_grad = net(x0)
    with torch.inference_mode():
        inference = net(x0)
    assert torch.equal(no_grad, want) and torch.equal(inference, want)


def test_crossnet_under_autocast_keeps_the_running_sum_in_fp32():
    net = CrossNetV2(24, num_layers=3, low_rank=5)
    x0 = torch.randn(7, 24, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x0).detach()  # u's output is bf16; x0 * u + x is fp32
        with torch.no_grad():
            got = net(x0)
    assert want.dtype == got.dtype == torch.float32
    assert torch.equal(got, want)


def test_crossnet_does_not_overwrite_what_a_forward_hook_holds():
    net = CrossNetV2(24, num_layers=2, low_rank=5)
    x0 = torch.randn(7, 24, generator=torch.Generator().manual_seed(4))
    seen: list[torch.Tensor] = []
    handle = net.u[0].register_forward_hook(lambda m, i, o: seen.append((o, o.clone())))
    try:
        with torch.no_grad():
            net(x0)
    finally:
        handle.remove()
    held, copy = seen[0]
    assert torch.equal(held, copy)


def test_seeded_and_leaves_global_rng_alone():
    w = _small("dcnv2")
    state = torch.get_rng_state()
    a, b, c = build_model(w, 3), build_model(w, 3), build_model(w, 4)
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.top_mlp[0].weight, c.top_mlp[0].weight)


def test_bad_inputs():
    w = _small("dot")
    model = build_model(w)
    dense, sparse = _batch(w)
    with pytest.raises(ValueError, match=r"dense must be \(B, 5\)"):
        model(dense[:, :4], sparse)
    with pytest.raises(ValueError, match="batch 5 but sparse has batch 6"):
        model(dense[:5], sparse)
    missing = JaggedBatch.from_per_key({k: v for k, v in sparse.per_key().items() if k != "t1"})
    with pytest.raises(KeyError, match="'t1'"):
        model(dense, missing)


def test_tiny_preset_trains_on_synthetic_batch():
    w = get_workload("tiny")
    data = SyntheticCTR(replace(w, tables=w.tables[:3]), batch_size=32)
    model = build_model(data.workload)
    b = data.batch(0)
    loss = nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("bad", "rows"), [(11, 11), (-1, 11), (2**40, 11)])
def test_out_of_range_id_names_the_table(bad, rows):
    w = _small("dot")
    model = build_model(w)
    dense, sparse = _batch(w)
    per_key = sparse.per_key()
    values, lengths = per_key["t1"]  # t1 has 11 rows
    values = values.clone()
    values[-1] = bad
    per_key["t1"] = (values, lengths)
    msg = rf"table 't1' has {rows} rows but id {bad} was looked up \(expected ids 0\.\.{rows - 1}\)"
    with pytest.raises(ValueError, match=msg):
        model(dense, JaggedBatch.from_per_key(per_key))


def test_in_range_edge_ids_and_all_empty_bags_pool():
    w = _small("dot")
    model = build_model(w)
    b = 3
    per_key = {
        t.name: (torch.tensor([0, t.num_rows - 1]), torch.tensor([2, 0, 0], dtype=torch.int32))
        for t in w.tables
    }
    per_key["t2"] = (torch.zeros(0, dtype=torch.int64), torch.zeros(b, dtype=torch.int32))
    pooled = model.pool(JaggedBatch.from_per_key(per_key))
    for t, p in zip(w.tables, pooled):
        emb = model.embeddings[t.name].weight
        want = emb[0] + emb[t.num_rows - 1] if t.name != "t2" else torch.zeros_like(emb[0])
        assert torch.equal(p[0], want) and torch.equal(p[1:], torch.zeros_like(p[1:]))
