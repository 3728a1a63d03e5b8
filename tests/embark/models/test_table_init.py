"""A table's initial values drawn block by block (``uniform_block_``) and the dense part built
without its tables (``build_dense_part``) are exactly ``build_model``'s: what a rank of the
sharded model uses to hold only its shards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embark.models.dlrm import build_dense_part, build_model, uniform_block_
from embark.models.workloads import get_workload


def _whole(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table drawn whole, and the generator's next draws after it."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.empty(shape).uniform_(-0.25, 0.25, generator=gen)
    return full, torch.empty(7).normal_(generator=gen)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    dim=st.integers(1, 9),
    scratch=st.integers(1, 50),
    data=st.data(),
)
def test_a_block_is_the_same_slice_of_the_whole_draw(
    rows: int, dim: int, scratch: int, data: st.DataObject
) -> None:
    """Any block (empty, whole rows, a column block, the whole table), through any scratch
    size (one row at a time up to the whole table): the exact values, and the generator
    left where the whole draw leaves it."""
    r0 = data.draw(st.integers(0, rows))
    r1 = data.draw(st.integers(r0, rows))
    c0 = data.draw(st.integers(0, dim))
    c1 = data.draw(st.integers(c0, dim))
    full, after = _whole((rows, dim), seed=rows * 100 + dim)
    gen = torch.Generator().manual_seed(rows * 100 + dim)
    out = torch.full((r1 - r0, c1 - c0), float("nan"))
    uniform_block_((rows, dim), 0.25, gen, out, r0, c0, scratch_elements=scratch)
    assert torch.equal(out, full[r0:r1, c0:c1])
    assert torch.equal(torch.empty(7).normal_(generator=gen), after)


def test_keeping_nothing_advances_the_generator_as_the_whole_draw() -> None:
    _, after = _whole((1000, 3), seed=5)
    gen = torch.Generator().manual_seed(5)
    uniform_block_((1000, 3), 0.25, gen, scratch_elements=64)
    assert torch.equal(torch.empty(7).normal_(generator=gen), after)


def test_a_non_contiguous_block_of_whole_rows_is_filled_exactly() -> None:
    full, _ = _whole((30, 4), seed=2)
    holder = torch.zeros(4, 30)
    out = holder.t()[10:20]  # (10, 4), not contiguous
    uniform_block_((30, 4), 0.25, torch.Generator().manual_seed(2), out, 10, 0, 8)
    assert torch.equal(out, full[10:20])


@pytest.mark.parametrize(
    ("out", "row_start", "col_start", "match"),
    [
        (torch.zeros(5, 2), 8, 0, r"rows 8:13, columns 0:2 is outside the 10 × 4 table"),
        (torch.zeros(2, 3), 0, 2, r"columns 2:5 is outside"),
        (torch.zeros(2, 2), -1, 0, r"rows -1:1"),
        (torch.zeros(2, 2, dtype=torch.float64), 0, 0, r"2-d float32 tensor, got torch.float64"),
    ],
)
def test_a_block_outside_the_table_is_refused(
    out: torch.Tensor, row_start: int, col_start: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        uniform_block_((10, 4), 0.5, torch.Generator(), out, row_start, col_start)


@pytest.mark.parametrize("name", ["tiny", "dlrm_dcnv2"])
def test_the_dense_part_equals_build_models_and_holds_no_table(name: str) -> None:
    """With every table's draw replayed (keeping nothing), the dense part is bit for bit
    ``build_model``'s; it has no embedding parameter, and a table-less build draws none."""
    w = get_workload(name).scaled(200_000) if name != "tiny" else get_workload(name)
    whole = build_model(w, seed=11).state_dict()
    shapes = {t.name: (t.num_rows, t.dim) for t in w.tables}
    seen: list[str] = []

    def replay(table: str, bound: float, gen: torch.Generator) -> None:
        seen.append(table)
        uniform_block_(shapes[table], bound, gen)

    dense = build_dense_part(w, seed=11, fill_table=replay)
    assert seen == [t.name for t in w.tables]
    got = dense.state_dict()
    assert set(got) == {k for k in whole if not k.startswith("embeddings.")}
    for k, v in got.items():
        assert torch.equal(v, whole[k]), k
    assert len(dense.embeddings) == 0
    placeholder = build_dense_part(w, seed=11)
    assert set(placeholder.state_dict()) == set(got)
