from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embark.data import JaggedBatch


def _docstring_example() -> JaggedBatch:
    # The worked example of embark/data/jagged.py, with V0..V7 = 10..17.
    return JaggedBatch(
        ["t0", "t1"],
        torch.arange(10, 18, dtype=torch.int64),
        torch.tensor([2, 1, 0, 1, 1, 3], dtype=torch.int32),
    )


def test_docstring_example_layout():
    jb = _docstring_example()
    assert jb.batch_size == 3
    assert torch.equal(jb.offsets, torch.tensor([0, 2, 3, 3, 4, 5, 8]))
    assert jb.offsets.dtype == torch.int64
    v, n = jb.per_key()["t1"]
    assert torch.equal(v, torch.tensor([13, 14, 15, 16, 17]))
    assert torch.equal(n, torch.tensor([1, 1, 3], dtype=torch.int32))
    assert torch.equal(jb.bag_offsets("t1"), torch.tensor([0, 1, 2]))
    assert torch.equal(jb.bag_offsets("t0"), torch.tensor([0, 2, 3]))


def test_embedding_bag_on_bag_offsets_matches_manual_sum():
    jb = _docstring_example()
    weight = torch.arange(20 * 2, dtype=torch.float32).reshape(20, 2)
    bag = torch.nn.EmbeddingBag.from_pretrained(weight, mode="sum")
    got = bag(jb.values_for("t1"), jb.bag_offsets("t1"))
    want = torch.stack([weight[13], weight[14], weight[15] + weight[16] + weight[17]])
    assert torch.equal(got, want)
    empty = bag(jb.values_for("t0"), jb.bag_offsets("t0"))[2]
    assert torch.equal(empty, torch.zeros(2))  # sample 2 has an empty t0 bag


@pytest.mark.parametrize(
    ("values", "lengths", "match"),
    [
        (torch.arange(3, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32), "int64"),
        (torch.arange(3), torch.tensor([1, 2]), "int32"),
        (torch.arange(3), torch.tensor([1, 1, 1], dtype=torch.int32), "multiple of 2"),
        (torch.arange(3), torch.tensor([1, 1], dtype=torch.int32), "sum to 2 but values has 3"),
        (torch.arange(1), torch.tensor([2, -1], dtype=torch.int32), "negative"),
    ],
)
def test_bad_inputs_raise(values, lengths, match):
    with pytest.raises(ValueError, match=match):
        JaggedBatch(["a", "b"], values, lengths)


def test_duplicate_and_unknown_keys():
    with pytest.raises(ValueError, match="duplicate"):
        JaggedBatch(["a", "a"], torch.arange(2), torch.ones(2, dtype=torch.int32))
    jb = _docstring_example()
    with pytest.raises(KeyError, match="'t9' not in"):
        jb.values_for("t9")


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda f: st.tuples(
            st.just(f),
            st.integers(0, 5).flatmap(
                lambda b: st.lists(st.integers(0, 4), min_size=f * b, max_size=f * b)
            ),
        )
    )
)
def test_per_key_round_trip(case):
    num_keys, lens = case
    keys = [f"k{i}" for i in range(num_keys)]
    lengths = torch.tensor(lens, dtype=torch.int32)
    values = torch.arange(int(lengths.sum()), dtype=torch.int64) * 7
    jb = JaggedBatch(keys, values, lengths)
    assert jb.batch_size == len(lens) // num_keys
    assert jb.offsets[-1] == values.numel()
    back = JaggedBatch.from_per_key(jb.per_key())
    assert back.equals(jb)
    # every bag, read through offsets, is the right slice of values
    for f, k in enumerate(keys):
        vk = jb.values_for(k)
        starts = jb.bag_offsets(k)
        for s in range(jb.batch_size):
            n = int(jb.lengths[f * jb.batch_size + s])
            lo = int(jb.offsets[f * jb.batch_size + s])
            assert torch.equal(vk[int(starts[s]) : int(starts[s]) + n], values[lo : lo + n])


def test_from_dense_bags_and_to():
    ids = [torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5], [6]])]
    jb = JaggedBatch.from_dense_bags(["a", "b"], ids)
    assert torch.equal(jb.values, torch.tensor([1, 2, 3, 4, 5, 6]))
    assert torch.equal(jb.lengths, torch.tensor([2, 2, 1, 1], dtype=torch.int32))
    assert jb.to("cpu") is jb
    moved = jb.to("meta")
    assert moved.values.device.type == "meta" and moved.keys == jb.keys


@pytest.mark.slow  # importing torchrec takes ~10 s
def test_torchrec_round_trip(require):
    try:
        import torchrec  # noqa: F401
    except ImportError:
        torchrec = None
    require(torchrec is not None, "torchrec")
    jb = _docstring_example()
    kjt = jb.to_kjt()
    assert kjt.keys() == jb.keys
    assert torch.equal(kjt.offsets(), jb.offsets)
    assert JaggedBatch.from_kjt(kjt).equals(jb)
