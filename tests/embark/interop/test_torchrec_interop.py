"""TorchRec adapters: tables, state dicts both ways, KJTs (weighted refused, variable batch
expanded exactly or refused) and plans (TorchRec's planner → ours → TorchRec equals).

Weights are integer-valued, so pooled sums and means of a few ids are exact in fp32 and the
comparisons with TorchRec's own forward use ``torch.equal``."""

from __future__ import annotations

import warnings

import pytest
import torch

from embark.data.jagged import JaggedBatch
from embark.interop import (
    batch_from_kjt,
    ebc_configs_from_tables,
    ebc_to_embark_state_dict,
    embark_to_ebc_state_dict,
    plan_from_torchrec,
    plan_to_torchrec,
    tables_from_ebc_configs,
    workload_from_ebc_configs,
)
from embark.models.dlrm import build_model
from embark.types import Combiner, ShardingType, TableConfig


@pytest.fixture(scope="module")
def torchrec_modules():
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        return None
    return EmbeddingBagConfig, PoolingType, EmbeddingBagCollection, KeyedJaggedTensor


@pytest.fixture
def trm(torchrec_modules, require):
    require(torchrec_modules is not None, "torchrec")
    return torchrec_modules


def _configs(trm):
    cfg, pooling, _, _ = trm
    return [
        cfg(name="t0", num_embeddings=20, embedding_dim=4, feature_names=["f0"]),
        cfg(
            name="t1",
            num_embeddings=7,
            embedding_dim=4,
            feature_names=["f1"],
            pooling=pooling.MEAN,
        ),
        cfg(name="t2", num_embeddings=30, embedding_dim=4, feature_names=["f2"]),
    ]


def _ebc(trm, weighted: bool = False, seed: int = 0):
    _, _, ebc_cls, _ = trm
    ebc = ebc_cls(tables=_configs(trm), is_weighted=weighted)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            bag.weight.copy_(torch.randint(-8, 9, bag.weight.shape, generator=gen).float())
    return ebc


def _kjt(trm, weighted: bool = False):
    """f0, f1, f2 over B = 3 samples; f1's middle bag empty."""
    kjt_cls = trm[3]
    lengths = torch.tensor([2, 1, 1, 1, 0, 3, 1, 2, 2])
    values = torch.tensor([3, 19, 0, 5, 6, 1, 2, 6, 29, 0, 7, 8, 9])
    weights = torch.arange(1, 14, dtype=torch.float32) if weighted else None
    return kjt_cls(keys=["f0", "f1", "f2"], values=values, lengths=lengths, weights=weights)


def test_tables_and_workload_from_configs(trm) -> None:
    tables = tables_from_ebc_configs(_configs(trm), hotness={"t0": 2, "t1": 1, "t2": 3})
    assert tables == (
        TableConfig("t0", 20, 4, 2, Combiner.SUM),
        TableConfig("t1", 7, 4, 1, Combiner.MEAN),
        TableConfig("t2", 30, 4, 3, Combiner.SUM),
    )
    w = workload_from_ebc_configs(_configs(trm), 5, (8, 4), (8, 1))
    assert w.tables == tuple(t.__class__(t.name, t.num_rows, t.dim, 1, t.combiner) for t in tables)
    back = tables_from_ebc_configs(ebc_configs_from_tables(tables), hotness=1)
    assert [(t.name, t.num_rows, t.dim, t.combiner) for t in back] == [
        (t.name, t.num_rows, t.dim, t.combiner) for t in tables
    ]


def test_configs_tilerec_cannot_hold_are_refused_by_name(trm) -> None:
    cfg, pooling, _, _ = trm
    with pytest.raises(ValueError, match=r"table 's' serves features \['a', 'b'\]"):
        tables_from_ebc_configs(
            [cfg(name="s", num_embeddings=4, embedding_dim=2, feature_names=["a", "b"])]
        )
    with pytest.raises(ValueError, match="table 'n': pooling NONE"):
        tables_from_ebc_configs(
            [cfg(name="n", num_embeddings=4, embedding_dim=2, pooling=pooling.NONE)]
        )
    with pytest.raises(ValueError, match=r"hotness: no entry for table\(s\) \['t1', 't2'\]"):
        tables_from_ebc_configs(_configs(trm), hotness={"t0": 1})


def test_state_dicts_both_ways_are_exact(trm) -> None:
    ebc = _ebc(trm)
    w = workload_from_ebc_configs(_configs(trm), 5, (8, 4), (8, 1))
    model = build_model(w, seed=1)
    missing, unexpected = model.load_state_dict(
        ebc_to_embark_state_dict(ebc.state_dict()), strict=False
    )
    assert not unexpected and all(not k.startswith("embeddings.") for k in missing)
    for name, bag in ebc.embedding_bags.items():
        assert torch.equal(model.embeddings[name].weight, bag.weight)
    # our pooling of the same batch equals TorchRec's, exactly (integer weights)
    kjt = _kjt(trm)
    ours = model.pool(batch_from_kjt(kjt, _configs(trm)))
    theirs = ebc(kjt).to_dict()
    for got, feature in zip(ours, ["f0", "f1", "f2"]):
        assert torch.equal(got, theirs[feature])
    # and back into a fresh EBC, strictly
    fresh = trm[2](tables=_configs(trm))
    fresh.load_state_dict(embark_to_ebc_state_dict(model.state_dict()))
    for name, bag in fresh.embedding_bags.items():
        assert torch.equal(bag.weight, ebc.embedding_bags[name].weight)
    with pytest.raises(ValueError, match=r"\['bottom_mlp.0.weight'.*are not 'embedding_bags"):
        ebc_to_embark_state_dict({"bottom_mlp.0.weight": torch.zeros(1)})


def test_kjt_round_trip_and_weighted_refused(trm) -> None:
    kjt = _kjt(trm)
    jb = JaggedBatch.from_kjt(kjt)
    assert jb.keys == ["f0", "f1", "f2"] and jb.batch_size == 3
    assert torch.equal(jb.values, kjt.values()) and torch.equal(jb.lengths, kjt.lengths().int())
    back = jb.to_kjt()
    assert back.keys() == kjt.keys() and back.stride() == 3
    assert torch.equal(back.values(), kjt.values()) and torch.equal(back.offsets(), kjt.offsets())
    with pytest.raises(ValueError, match=r"keys \['f0', 'f1', 'f2'\] is weighted.*drop them"):
        JaggedBatch.from_kjt(_kjt(trm, weighted=True))


def _vbe_kjt(trm, with_inverse: bool, strides=((2,), (3,), (1,))):
    """f0 has 2 distinct bags, f1 3, f2 1 (``strides``: per key, per rank) for B = 4 samples,
    which reuse them through the inverse indices."""
    kjt_cls = trm[3]
    lengths = torch.tensor([2, 1, 1, 0, 3, 2])
    values = torch.tensor([3, 19, 0, 5, 1, 2, 6, 7, 8])
    inverse = torch.tensor([[1, 0, 1, 1], [2, 0, 1, 2], [0, 0, 0, 0]])
    return kjt_cls(
        keys=["f0", "f1", "f2"],
        values=values,
        lengths=lengths,
        stride_per_key_per_rank=[list(s) for s in strides],
        inverse_indices=(["f0", "f1", "f2"], inverse) if with_inverse else None,
    )


@pytest.mark.parametrize("strides", [((2,), (3,), (1,)), ((1, 1), (2, 1), (1, 0))])
def test_variable_batch_kjt_expands_exactly_or_is_refused(trm, strides) -> None:
    """One rank, or two (each key's bags rank after rank): the same bags, the same batch."""
    kjt = _vbe_kjt(trm, with_inverse=True, strides=strides)
    jb = JaggedBatch.from_kjt(kjt)
    assert jb.batch_size == 4
    # f0 bags [3, 19], [0]; f1 bags [5], [], [1, 2, 6]; f2 bag [7, 8]
    assert jb.lengths.tolist() == [1, 2, 1, 1, 3, 1, 0, 3, 2, 2, 2, 2]
    assert jb.values.tolist() == [0, 3, 19, 0, 0, 1, 2, 6, 5, 1, 2, 6, *[7, 8] * 4]
    # TorchRec's EBC pools the same KJT to the same (B, ·) vectors
    ebc = _ebc(trm)
    model = build_model(workload_from_ebc_configs(_configs(trm), 5, (8, 4), (8, 1)), seed=0)
    model.load_state_dict(ebc_to_embark_state_dict(ebc.state_dict()), strict=False)
    theirs = ebc(kjt).to_dict()
    for got, feature in zip(model.pool(batch_from_kjt(kjt, _configs(trm))), ["f0", "f1", "f2"]):
        assert torch.equal(got, theirs[feature])
    with pytest.raises(ValueError, match=r"variable batch.*stride_per_key_per_rank.*inverse_ind"):
        JaggedBatch.from_kjt(_vbe_kjt(trm, with_inverse=False, strides=strides))


def test_torchrec_stays_optional() -> None:
    """Importing embark (interop included) and export loads no torchrec."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    code = "import sys, embark, embark.interop, export; print('torchrec' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


# -------------------------------------------------------------------------------------- plans
def _planner_plan(trm):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner import Topology as TRTopology

    cfg = trm[0]
    shapes = {"rw": (5, 64), "dp": (10, 16), "twrw": (5_000, 128), "cw": (300, 256)}
    kinds = {
        "rw": "row_wise",
        "dp": "data_parallel",
        "twrw": "table_row_wise",
        "cw": "column_wise",
    }
    cfgs = [
        cfg(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
        for n, (r, d) in shapes.items()
    ]
    ebc = trm[2](tables=cfgs, device=torch.device("meta"))
    cons = {n: ParameterConstraints(sharding_types=[k]) for n, k in kinds.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner = EmbeddingShardingPlanner(
            topology=TRTopology(world_size=4, compute_device="cuda", local_world_size=2),
            batch_size=64,
            constraints=cons,
        )
        plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return plan, tables_from_ebc_configs(cfgs)


def test_planner_plan_round_trips_exactly(trm) -> None:
    tr_plan, tables = _planner_plan(trm)
    ours = plan_from_torchrec(tr_plan, tables, world_size=4, gpus_per_node=2)
    by_name = {t.name: t for t in ours.tables}
    assert by_name["dp"].sharding_type is ShardingType.DP
    assert by_name["twrw"].sharding_type is ShardingType.TRW
    assert by_name["cw"].sharding_type is ShardingType.CW
    # 5 rows over 4 ranks: TorchRec's ceil split 2, 2, 1, 0 leaves rank 3 empty
    assert [(s.rank, s.row_start, s.row_end) for s in by_name["rw"].shards] == [
        (0, 0, 2),
        (1, 2, 4),
        (2, 4, 5),
    ]
    back = plan_to_torchrec(ours).plan[""]
    assert dict(back) == dict(tr_plan.plan[""])


def test_handmade_plans_round_trip_and_bad_input_is_named(trm) -> None:
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan as TRPlan

    ebc = _ebc(trm)
    module_plan = construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=3), "t1": row_wise(), "t2": table_wise(rank=1)},
        world_size=4,
        local_size=2,
        device_type="cuda",
    )
    tr_plan = TRPlan({"sparse.ebc": module_plan})
    tables = tables_from_ebc_configs(_configs(trm))
    ours = plan_from_torchrec(tr_plan, tables, 4, 2)
    assert [t.sharding_type for t in ours.tables] == [
        ShardingType.TW,
        ShardingType.RW,
        ShardingType.TW,
    ]
    assert ours.tables[0].shards[0].rank == 3
    # construct_module_sharding_plan picks "dense" for a parameter without a fused optimizer
    back = plan_to_torchrec(ours, "sparse.ebc", compute_kernel="dense")
    assert dict(back.plan["sparse.ebc"]) == dict(module_plan)
    with pytest.raises(ValueError, match=r"module_path 'x' is not in the plan's \['sparse.ebc'\]"):
        plan_from_torchrec(tr_plan, tables, 4, 2, module_path="x")
    extra = (*tables, TableConfig("t9", 4, 4))
    with pytest.raises(ValueError, match=r"tables \['t9'\] are not in the TorchRec plan"):
        plan_from_torchrec(tr_plan, extra, 4, 2)


def test_a_weighted_kjt_keeps_its_weights_through_an_ebc_model(trm) -> None:
    """The path that can use weights: EBCModel runs TorchRec's weighted EBC on the KJT as it
    is; each pooled vector is the weighted sum of its rows, exactly (TorchRec's unsharded EBC
    weights sum pooling only: nn.EmbeddingBag refuses weights with mean)."""
    from embark.interop import EBCModel

    cfg, _, ebc_cls, _ = trm
    sizes = {"t0": 20, "t1": 7, "t2": 30}
    cfgs = [
        cfg(name=n, num_embeddings=r, embedding_dim=4, feature_names=[f"f{n[1]}"])
        for n, r in sizes.items()
    ]
    ebc = ebc_cls(tables=cfgs, is_weighted=True)
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            bag.weight.copy_(torch.randint(-8, 9, bag.weight.shape).float())

    class Head(torch.nn.Module):
        def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
            return dense.sum(1) + torch.stack(pooled, 1).sum((1, 2))

    model = EBCModel(ebc, Head(), dense_features=2)
    kjt = _kjt(trm, weighted=True)
    pooled = model.pool(kjt)
    w, v, lengths = kjt.weights(), kjt.values(), kjt.lengths().tolist()
    pos = 0
    for f, name in enumerate(["t0", "t1", "t2"]):
        rows = ebc.embedding_bags[name].weight.detach()
        for b in range(3):
            n = lengths[f * 3 + b]
            want = (w[pos : pos + n, None] * rows[v[pos : pos + n]]).sum(0)
            assert torch.equal(pooled[f][b], want)
            pos += n
    assert model(torch.ones(3, 2), kjt).shape == (3,)


@pytest.mark.parametrize("kind", ["DLRM", "DLRM_DCN"])
def test_from_torchrec_dlrm_scores_like_the_model(trm, kind) -> None:
    """The EBCModel shares TorchRec's modules: the same logits, bit for bit, squeezed to (B,)."""
    import torchrec.models.dlrm as tr_dlrm

    from embark.interop import from_torchrec_dlrm

    torch.manual_seed(3)
    extra = {"dcn_num_layers": 2, "dcn_low_rank_dim": 4} if kind == "DLRM_DCN" else {}
    model = getattr(tr_dlrm, kind)(
        embedding_bag_collection=_ebc(trm),
        dense_in_features=5,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
        **extra,
    ).eval()
    ours = from_torchrec_dlrm(model, hotness=2)
    assert ours.dense_features == 5 and [t.hotness for t in ours.tables] == [2, 2, 2]
    dense, kjt = torch.rand(3, 5), _kjt(trm)
    with torch.no_grad():
        assert torch.equal(ours(dense, kjt), model(dense, kjt).squeeze(-1))
    with pytest.raises(TypeError, match=r"a Linear has no \['sparse_arch'"):
        from_torchrec_dlrm(torch.nn.Linear(2, 2), hotness=1)
