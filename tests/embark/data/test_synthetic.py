from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from embark.data import Batch, JaggedBatch, SyntheticCTR
from embark.models.workloads import get_workload
from embark.training.metrics import auc


def _workload(n_tables: int = 3):
    w = get_workload("tiny")
    return replace(w, tables=w.tables[:n_tables])


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and a.sparse.equals(b.sparse)
        and torch.equal(a.labels, b.labels)
    )


@pytest.fixture(scope="module")
def gen() -> SyntheticCTR:
    return SyntheticCTR(_workload(), batch_size=256, seed=7)


def test_deterministic_by_seed_and_seekable(gen):
    again = SyntheticCTR(_workload(), batch_size=256, seed=7)
    other = SyntheticCTR(_workload(), batch_size=256, seed=8)
    stream = list(gen.batches(4))
    assert all(_same(a, b) for a, b in zip(stream, again.batches(4)))
    assert _same(stream[2], gen.batch(2))
    assert all(_same(a, b) for a, b in zip(stream[1:], gen.batches(3, start=1)))
    assert not _same(stream[0], other.batch(0))
    assert not _same(stream[0], gen.batch(0, split="eval"))
    endless = list(itertools.islice(gen.batches(), 5))
    assert len(endless) == 5 and _same(endless[4], gen.batch(4))


def test_shapes_dtypes_and_fixed_hotness(gen):
    b = gen.batch(0)
    assert b.dense.shape == (256, 13) and b.dense.dtype == torch.float32
    assert b.labels.shape == (256,) and b.labels.dtype == torch.float32
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.sparse.keys == [t.name for t in gen.workload.tables]
    for t in gen.workload.tables:
        assert torch.all(b.sparse.lengths_for(t.name) == t.hotness)
        ids = b.sparse.values_for(t.name)
        assert int(ids.min()) >= 0 and int(ids.max()) < t.num_rows


def test_ragged_bags_never_exceed_hotness():
    g = SyntheticCTR(_workload(), batch_size=2000, seed=1, ragged=True)
    b = g.batch(0)
    for t in g.workload.tables:
        n = b.sparse.lengths_for(t.name).double()
        assert int(n.min()) == 0 and int(n.max()) == t.hotness  # hotness is the maximum bag
        assert abs(n.mean().item() - t.hotness / 2) < 0.05 * t.hotness + 0.05


def test_ids_follow_zipf(gen):
    t = gen.workload.tables[0]  # 1000 rows, hotness 1
    ids = torch.cat([b.sparse.values_for(t.name) for b in gen.batches(80)]).numpy()
    counts = np.bincount(ids, minlength=t.num_rows)
    pmf = np.arange(1, t.num_rows + 1, dtype=np.float64) ** -gen.workload.zipf_alpha
    pmf /= pmf.sum()
    n = ids.size
    for k in range(5):  # each of the hottest ids within 4 standard errors of its probability
        se = np.sqrt(pmf[k] * (1 - pmf[k]) / n)
        assert abs(counts[k] / n - pmf[k]) < 4 * se, k
    assert counts[0] > counts[1] > counts[3] > counts[20]


def test_dense_features_are_log1p_of_lognormal(gen):
    dense = torch.cat([b.dense for b in gen.batches(10)]).double()
    log_raw = torch.log(torch.expm1(dense))  # back to log of the raw counts
    assert abs(log_raw.mean().item() - gen.dense_mu) < 0.02
    assert abs(log_raw.std().item() - gen.dense_sigma) < 0.02


def test_teacher_labels_are_calibrated_and_informative(gen):
    probs, labels = [], []
    for i in range(20):
        b = gen.batch(i, split="eval")
        probs.append(torch.sigmoid(gen.teacher_logits(b.dense, b.sparse)))
        labels.append(b.labels)
    p, y = torch.cat(probs), torch.cat(labels)
    assert abs(p.mean().item() - y.mean().item()) < 0.02  # labels ~ Bernoulli(teacher)
    ceiling = gen.teacher_auc(20)
    assert 0.75 < ceiling < 0.95
    assert ceiling == gen.teacher_auc(20)
    assert all(not q.requires_grad for q in gen.teacher.parameters())


def test_signal_is_in_both_dense_and_sparse_features(gen):
    big = SyntheticCTR(gen.workload, batch_size=4096, seed=7)
    b = big.batch(0, split="eval")
    full = auc(big.teacher_logits(b.dense, b.sparse), b.labels)
    same_ids = JaggedBatch(b.sparse.keys, torch.zeros_like(b.sparse.values), b.sparse.lengths)
    mean_dense = b.dense.mean(0, keepdim=True).expand_as(b.dense)
    without_ids = auc(big.teacher_logits(b.dense, same_ids), b.labels)
    without_dense = auc(big.teacher_logits(mean_dense, b.sparse), b.labels)
    assert without_ids < full - 0.05, (full, without_ids)
    assert without_dense < full - 0.05, (full, without_dense)


def test_scaled_workload_rows():
    w = get_workload("tiny").scaled(10)
    g = SyntheticCTR(replace(w, tables=w.tables[:4]), batch_size=128, seed=0)
    b = g.batch(0)
    for t in g.workload.tables:
        assert int(b.sparse.values_for(t.name).max()) < t.num_rows <= 200


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"batch_size": 0}, "batch_size"), ({"batch_size": 8, "label_sharpness": 0}, "sharpness")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticCTR(_workload(), **kwargs)


@pytest.mark.parametrize("std", [0.1, 0.5])
def test_teacher_rows_are_redrawn_with_teacher_embedding_std(std):
    # Module docstring: teacher rows ~ N(0, teacher_embedding_std²), default 0.1 (not N(0, 1)).
    g = SyntheticCTR(_workload(), batch_size=64, seed=0, teacher_embedding_std=std)
    rows = torch.cat([bag.weight.flatten() for bag in g.teacher.embeddings.values()])
    assert rows.numel() > 20_000
    assert abs(rows.mean().item()) < 0.05 * std
    assert rows.std().item() == pytest.approx(std, rel=0.03)


def test_default_teacher_embedding_std_is_0_1():
    g = SyntheticCTR(_workload(), batch_size=64, seed=0)
    rows = torch.cat([bag.weight.flatten() for bag in g.teacher.embeddings.values()])
    assert rows.std().item() == pytest.approx(0.1, rel=0.03)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"teacher_embedding_std": 0.0},
            "teacher_embedding_std must be a finite number > 0, got 0.0",
        ),
        (
            {"teacher_embedding_std": float("nan")},
            "teacher_embedding_std must be a finite number > 0, got nan",
        ),
        (
            {"teacher_workload": get_workload("tiny")},
            "teacher_workload 'tiny' must have workload 'tiny'",
        ),
        (
            {"teacher_workload": replace(_workload(), dense_features=4)},
            "must have workload 'tiny'.s tables .* and dense_features 13; got .* and 4",
        ),
    ],
)
def test_bad_teacher_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticCTR(_workload(), batch_size=8, **kwargs)


def test_teacher_workload_with_other_widths_is_used():
    teacher = replace(_workload(), name="wide-teacher", top_mlp=(8, 1), bottom_mlp=(16,))
    g = SyntheticCTR(_workload(), batch_size=8, teacher_workload=teacher)
    assert g.teacher.workload is teacher and g.teacher.top_mlp[0].out_features == 8


def test_stream_config_regenerates_the_stream_exactly():
    w = get_workload("tiny")
    data = SyntheticCTR(w, 16, seed=5, ragged=True, label_sharpness=6.0, dense_sigma=0.5)
    config = json.loads(json.dumps(data.stream_config()))  # as a checkpoint stores it
    again = SyntheticCTR.from_stream_config(w, 16, 5, config)
    for i in (0, 3):
        a, b = data.batch(i), again.batch(i)
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(
            a.sparse.lengths, b.sparse.lengths
        )
    assert again.stream_config() == data.stream_config()
    other = SyntheticCTR.from_stream_config(w, 16, 5, config | {"label_sharpness": 2.0})
    b0 = data.batch(0)
    torch.testing.assert_close(
        other.teacher_logits(b0.dense, b0.sparse) * 6.0,
        (data.teacher_logits(b0.dense, b0.sparse) + 1.0) * 2.0 - 6.0,
    )


def test_a_bad_stream_config_names_the_keys():
    w = get_workload("tiny")
    config = SyntheticCTR(w, 8).stream_config()
    with pytest.raises(ValueError, match=r"exactly the keys .* got \['ragged'\]"):
        SyntheticCTR.from_stream_config(w, 8, 0, {"ragged": True})
    with pytest.raises(ValueError, match="label_sharpness must be > 0, got -1"):
        SyntheticCTR.from_stream_config(w, 8, 0, config | {"label_sharpness": -1})


# -- per-rank slices (issue 19, item 3) ----------------------------------------------------
@pytest.mark.parametrize("ragged", [False, True])
def test_rank_slices_concatenate_to_the_single_process_batch_bit_for_bit(ragged):
    from embark.data import local_batch

    data = SyntheticCTR(_workload(), batch_size=301, seed=9, ragged=ragged)
    for i, split in ((0, "train"), (5, "train"), (2, "eval")):
        whole = data.batch(i, split)
        for world in (2, 3, 4):
            for r in range(world):
                assert _same(
                    data.batch(i, split, rank=r, world_size=world), local_batch(whole, r, world)
                )
        got = list(data.batches(2, start=i, split=split, rank=1, world_size=3))
        assert _same(got[0], local_batch(whole, 1, 3))


def test_a_sample_depends_only_on_its_number_not_its_batch():
    """Sample g is the same sample (features and label) in any batch size that holds it."""
    w = _workload()
    small, large = SyntheticCTR(w, 8, seed=4), SyntheticCTR(w, 24, seed=4)
    from embark.data import slice_batch

    big = large.batch(1)  # samples 24..47 = batches 3, 4, 5 of size 8
    for k in range(3):
        assert _same(small.batch(3 + k), slice_batch(big, 8 * k, 8 * (k + 1)))


def test_a_bad_rank_is_refused():
    data = SyntheticCTR(_workload(), 8)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        data.batch(0, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got -1"):
        next(data.batches(1, rank=-1, world_size=3))


def test_a_stream_config_of_another_version_is_refused():
    w = get_workload("tiny")
    config = SyntheticCTR(w, 8).stream_config()
    assert config["version"] == 3
    with pytest.raises(ValueError, match="data stream version 2 cannot be regenerated"):
        SyntheticCTR.from_stream_config(w, 8, 0, config | {"version": 2})
    old = {k: v for k, v in config.items() if k != "version"}  # a stream recorded before versions
    with pytest.raises(ValueError, match="exactly the keys"):
        SyntheticCTR.from_stream_config(w, 8, 0, old)
