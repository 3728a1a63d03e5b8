from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilesparse.config import TileSparseConfig
from tilesparse.format import condense
from tilesparse.patterns import (
    bw_mask,
    bw_masks,
    column_scores,
    ew_mask,
    ew_masks,
    is_tile_wise,
    masks_for_config,
    nm_mask,
    render_mask,
    select_units,
    split_budget,
    tew_mask,
    tw_mask,
    tw_masks,
    tw_rows_mask,
)


def M(text: str) -> torch.Tensor:
    """A mask from its drawing: rows of 'x' (kept) and '.' (pruned)."""
    return torch.tensor([[c == "x" for c in line.split()] for line in text.strip().splitlines()])


def distinct_scores(k: int, n: int, seed: int) -> torch.Tensor:
    # integer-valued, all distinct: no ties, so every mask is unique and checked exactly
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(k * n, generator=g).view(k, n).double() + 1.0


# -- hand-made matrices, exact masks ------------------------------------------------------
S6 = torch.tensor(
    [[9.0, 1, 8, 7, 2, 6], [8, 2, 1, 6, 1, 1], [1, 1, 9, 1, 3, 7], [7, 2, 8, 9, 1, 6]]
)


def test_tw_hand_made() -> None:
    expected = M(
        """
        x . x x . x
        x . x . . .
        x . x . . .
        x . x x . x
        """
    )
    assert torch.equal(tw_mask(S6, 0.5, tile=2), expected)
    assert render_mask(expected).splitlines()[0] == "x . x x . x"


def test_tw_column_share_one_prunes_columns_only() -> None:
    # all of the budget to columns: 12 weights = the 3 best columns (2, 0, 3)
    expected = M(
        """
        x . x x . .
        x . x x . .
        x . x x . .
        x . x x . .
        """
    )
    assert torch.equal(tw_mask(S6, 0.5, tile=2, column_share=1.0), expected)


def test_tile_losing_every_row_and_k_n_not_multiples_of_g() -> None:
    S = torch.tensor([[9.0, 9, 9, 1, 1], [9, 9, 9, 1, 1], [8, 8, 8, 1, 2]])  # K=3, N=5, G=3
    mask = tw_rows_mask(S, 0.4, tile=3)  # keep 9 of 15: tile {0,1,2} whole, tile {3,4} nothing
    assert torch.equal(mask, M("x x x . .\nx x x . .\nx x x . ."))
    layout = condense(S, mask, 3)
    assert layout.num_tiles == 1
    assert torch.equal(layout.to_dense(), S * mask)


def test_tw_rows_and_tew_hand_made() -> None:
    S = torch.tensor([[9.0, 1, 8, 7], [1, 2, 1, 6], [1, 1, 9, 9]])
    assert torch.equal(tw_rows_mask(S, 0.5, tile=2), M("x x x x\n. . . .\n. . x x"))
    tew = tew_mask(S, 0.5, tile=2, delta=1 / 12, column_share=0.0)
    assert torch.equal(tew, M("x . x x\n. . . x\n. . x x"))


def test_ew_nm_bw_hand_made() -> None:
    assert torch.equal(ew_mask(torch.tensor([[4.0, 1], [2, 3]]), 0.5), M("x .\n. x"))
    S = torch.tensor([[1.0, 5], [4, 1], [3, 2], [2, 8], [9, 1]])  # K=5: last group partial
    assert torch.equal(nm_mask(S, 2, 4), M(". x\nx .\nx .\n. x\nx x"))
    B = torch.tensor([[9.0, 9, 1], [9, 9, 1], [1, 1, 8]])
    assert torch.equal(bw_mask(B, 0.5, block=(2, 2)), M("x x .\nx x .\n. . ."))


def test_split_budget_is_the_papers() -> None:
    for s in (0.0, 0.25, 0.5, 0.6, 0.75, 0.9):
        col, row = split_budget(s)
        paper = (100 - math.sqrt(10000 - 100 * (100 * s))) / 100
        assert col == pytest.approx(paper, abs=1e-12) and row == pytest.approx(paper, abs=1e-12)
        assert (1 - col) * (1 - row) == pytest.approx(1 - s, abs=1e-12)
    assert split_budget(0.75, 1.0) == pytest.approx((0.75, 0.0))


def test_select_units_floors_and_skipping() -> None:
    # group 0 is better everywhere, but group 1's floor forces its best unit in
    keep = select_units(
        [torch.tensor([5.0, 4.0, 3.0]), torch.tensor([1.0, 2.0])],
        [torch.tensor([2, 2, 2]), torch.tensor([1, 1])],
        keep=5,
        floors=[0, 1],
    )
    assert keep[0].tolist() == [True, True, False] and keep[1].tolist() == [False, True]
    # a unit too big for the rest of the budget is skipped, a smaller later one fits
    keep = select_units([torch.tensor([3.0, 2.0, 1.0])], [torch.tensor([2, 4, 1])], keep=4)
    assert keep[0].tolist() == [True, False, True]


def test_column_scores_are_rms() -> None:
    s = torch.tensor([[3.0, 0.0], [4.0, 0.0]])
    assert torch.equal(
        column_scores(s), torch.tensor([5.0 / math.sqrt(2), 0.0], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda: tw_mask(torch.tensor([[1.0, -1.0]]), 0.5, 2), "finite and >= 0"),
        (lambda: tw_mask(torch.ones(4), 0.5, 2), "2-D float"),
        (lambda: tw_mask(torch.ones(2, 2), 1.0, 2), "sparsity must be in [0, 1), got 1.0"),
        (lambda: tw_mask(torch.ones(2, 2), 0.5, 0), "tile must be a positive integer, got 0"),
        (lambda: nm_mask(torch.ones(4, 2), 3, 2), "1 <= n <= m"),
        (lambda: bw_mask(torch.ones(4, 2), 0.5, (0, 2)), "block must be positive"),
        (
            lambda: tew_mask(torch.ones(4, 4), 0.9, 2, delta=0.2),
            "delta must be in [0, 1 - sparsity",
        ),
    ],
)
def test_bad_input(call, text: str) -> None:
    with pytest.raises(ValueError) as e:
        call()
    assert text in str(e.value)


# -- properties on random shapes ------------------------------------------------------------
shapes = st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 16))
sparsities = st.floats(0.0, 0.95)


@settings(max_examples=60, deadline=None)
@given(shapes, sparsities, st.integers(0, 10_000))
def test_tw_properties(shape, sparsity, seed) -> None:
    k, n, tile = shape
    S = distinct_scores(k, n, seed)
    mask = tw_mask(S, sparsity, tile)
    budget = round((1 - sparsity) * k * n)
    kept = int(mask.sum())
    assert mask.shape == (k, n) and mask.dtype == torch.bool
    assert 0 <= budget - kept <= k + tile  # at most one column / one segment short
    assert is_tile_wise(mask, tile)
    layout = condense(S, mask, tile)  # condensed blocks reproduce the masked weight exactly
    layout.validate()
    assert torch.equal(layout.to_dense(), S * mask)
    assert layout.num_tiles == math.ceil(int(mask.any(0).sum()) / tile)


@settings(max_examples=40, deadline=None)
@given(shapes, st.floats(0.0, 0.8), st.floats(0.0, 0.15), st.integers(0, 10_000))
def test_tew_contains_tw_and_hits_budget_exactly(shape, sparsity, delta, seed) -> None:
    k, n, tile = shape
    S = distinct_scores(k, n, seed)
    base = tw_mask(S, sparsity + delta, tile)
    tew = tew_mask(S, sparsity, tile, delta)
    assert bool((tew | ~base).all())  # TW part kept
    assert int(tew.sum()) == round((1 - sparsity) * k * n)
    restored = tew & ~base
    if restored.any() and (~tew).any():
        assert float(S[restored].min()) > float(S[~tew].max())  # best single weights back


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 30), sparsities, st.integers(0, 10_000))
def test_ew_keeps_exactly_the_best(k, n, sparsity, seed) -> None:
    S = distinct_scores(k, n, seed)
    mask = ew_mask(S, sparsity)
    assert int(mask.sum()) == round((1 - sparsity) * k * n)
    if mask.any() and (~mask).any():
        assert float(S[mask].min()) > float(S[~mask].max())


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(1, 10),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 10_000),
)
def test_nm_properties(k, n_cols, n, m, seed) -> None:
    if n > m:
        n, m = m, n
    S = distinct_scores(k, n_cols, seed)
    mask = nm_mask(S, n, m)
    for g in range(0, k, m):
        grp, sc = mask[g : g + m], S[g : g + m]
        assert (grp.sum(0) == min(n, grp.shape[0])).all()
        for c in range(n_cols):
            if grp[:, c].any() and (~grp[:, c]).any():
                assert float(sc[grp[:, c], c].min()) > float(sc[~grp[:, c], c].max())


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(1, 8),
    st.integers(1, 8),
    sparsities,
    st.integers(0, 10_000),
)
def test_bw_properties(k, n, bk, bn, sparsity, seed) -> None:
    S = distinct_scores(k, n, seed)
    mask = bw_mask(S, sparsity, (bk, bn))
    assert int(mask.sum()) <= round((1 - sparsity) * k * n)
    for i in range(0, k, bk):
        for j in range(0, n, bn):
            blk = mask[i : i + bk, j : j + bn]
            assert bool(blk.all()) or not bool(blk.any())  # kept or pruned whole


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(2, 30), st.integers(2, 30)), min_size=1, max_size=4),
    st.floats(0.1, 0.9),
    st.integers(0, 10_000),
)
def test_global_masks_share_one_budget_with_floors(layer_shapes, sparsity, seed) -> None:
    scores = [distinct_scores(k, n, seed + i) for i, (k, n) in enumerate(layer_shapes)]
    total = sum(k * n for k, n in layer_shapes)
    floor = 0.1
    budget = round((1 - sparsity) * total)
    floors = [math.ceil(floor * k * n) for k, n in layer_shapes]
    cases = {  # pattern -> (masks, largest selection unit of each layer)
        "tw": (
            tw_masks(scores, sparsity, 4, min_density=floor),
            [max(k, 4) for k, _ in layer_shapes],
        ),
        "ew": (ew_masks(scores, sparsity, floor), [1] * len(layer_shapes)),
        "bw": (bw_masks(scores, sparsity, (3, 3), floor), [9] * len(layer_shapes)),
    }
    for masks, unit in cases.values():
        kept = sum(int(m.sum()) for m in masks)
        # the floors may cost at most one unit each beyond themselves; otherwise the budget holds
        assert kept <= max(budget, sum(f + u for f, u in zip(floors, unit)))
        for m, f in zip(masks, floors):
            assert int(m.sum()) >= f  # no layer pruned away
    for m in tw_masks(scores, sparsity, 4, min_density=floor):
        assert is_tile_wise(m, 4)


def test_global_threshold_differs_from_per_layer() -> None:
    # a strong layer and a weak one: one threshold prunes the weak one harder
    strong, weak = distinct_scores(8, 8, 0) + 100, distinct_scores(8, 8, 1)
    m_strong, m_weak = ew_masks([strong, weak], 0.5)
    assert int(m_strong.sum()) == 64 and int(m_weak.sum()) == 0
    m_strong, m_weak = ew_masks([strong, weak], 0.5, min_density=0.25)
    assert int(m_weak.sum()) == 16 and int(m_strong.sum()) == 48


def test_masks_for_config_dispatch() -> None:
    S = distinct_scores(12, 10, 3)
    for pattern, fn in (
        ("tw", lambda: tw_mask(S, 0.5, 4)),
        ("ew", lambda: ew_mask(S, 0.5)),
        ("nm", lambda: nm_mask(S, 2, 4)),
        ("bw", lambda: bw_mask(S, 0.5, (4, 4))),
    ):
        cfg = TileSparseConfig(pattern=pattern, sparsity=0.5, tile=4, block=(4, 4))
        assert torch.equal(masks_for_config(cfg, [S], 0.5, min_density=0.0)[0], fn())
    assert masks_for_config(TileSparseConfig(), [S], 0.0)[0].all()


@pytest.mark.parametrize("k", [13, 64])
def test_tw_narrow_layer_keeps_its_column_and_prunes_rows(k: int) -> None:
    """A one-column layer at 75 %: the column budget (round(0.5·K) weights) is under one
    column, which must not drop the only column (100 % sparse). The column is kept and the row
    step keeps the round(0.25·K) best rows (segments one column wide), the budget exactly."""
    g = torch.Generator().manual_seed(k)
    S = (torch.randperm(k, generator=g).float() + 1).unsqueeze(1)  # (K, 1), distinct
    keep = round(0.25 * k)  # 3 of 13, 16 of 64
    want = S >= torch.topk(S.flatten(), keep).values.min()
    mask = tw_mask(S, 0.75, tile=16)
    assert torch.equal(mask, want), render_mask(mask.T)
    assert int(mask.sum()) == keep


def test_tw_global_column_step_keeps_a_narrow_layers_last_column() -> None:
    """Under one threshold a 64x1 layer whose column scores lowest (RMS 5 against 10) keeps that
    column through the column step, so the shared row step can keep its 4 strong rows (width-1
    segments scoring 20 against the wide layer's RMS 10) instead of losing it whole."""
    wide = torch.full((64, 64), 10.0)
    narrow = torch.full((64, 1), 0.0)
    strong = [3, 17, 40, 63]
    narrow[strong] = 20.0
    masks = tw_masks([wide, narrow], 0.75, tile=16)
    assert masks[1][strong].all()  # (the budget's remainder under one wide segment may add
    total = sum(int(m.sum()) for m in masks)  # some of its weak rows too)
    assert 0 <= round(0.25 * 65 * 64) - total <= 16


def test_tw_ranks_equal_valued_tiles_of_different_widths_by_magnitude() -> None:
    """K=4, N=17, G=16, rows only: a 16-wide tile of weights 10 and a 1-wide last tile of 3.
    Row segments scored ``‖·‖₂ / |cols_t|`` made the 10s score 2.5 and the 3s score 3, so the
    weak narrow tile was kept whole first (at 50 %: 16 of the 10s kept, all 4 of the 3s). Scored
    by RMS (10 against 3) the wide tile's rows come first."""
    S = torch.full((4, 17), 10.0)
    S[:, 16] = 3.0
    # 50 %: 34 weights; two 16-wide rows (32) fit, a third does not, and 2 of the 1-wide
    # segments fill the rest of the budget
    m = tw_masks([S], 0.5, tile=16, column_share=0.0)[0]
    assert int(m[:, :16].sum()) == 32 and int(m[:, 16].sum()) == 2, render_mask(m)
    assert int(m.sum()) == 34
    # a budget of exactly three wide rows (48 of 68): the weak tile loses every row
    m = tw_masks([S], 20 / 68, tile=16, column_share=0.0)[0]
    assert int(m[:, :16].sum()) == 48 and not m[:, 16].any(), render_mask(m)


def test_tw_global_threshold_does_not_favour_a_layer_narrower_than_the_tile() -> None:
    """Two layers under one threshold, the narrow one (N=4 < G=16) of weaker weights: it is
    pruned first. Under ``/ |cols_t|`` its 4-wide segments of 3 (score 1.5) beat the wide
    layer's 16-wide segments of 5 (score 1.25) and it was kept whole."""
    wide, narrow = torch.full((8, 32), 5.0), torch.full((8, 4), 3.0)
    m_wide, m_narrow = tw_masks([wide, narrow], 0.5, tile=16, column_share=0.0)
    assert not m_narrow.any(), render_mask(m_narrow)
    assert int(m_wide.sum()) == 144  # the budget, round(0.5 · 288): 9 of the 16 wide segments


def test_masks_for_config_floors_shared_layers_not_a_lone_one() -> None:
    """min_density=None: ``config.min_layer_density`` for two or more layers under one
    threshold, none for one layer (which the floor of 0.25 would cap at 75 %)."""
    cfg = TileSparseConfig(pattern="ew", sparsity=0.9, min_layer_density=0.25)
    strong, weak = distinct_scores(8, 8, 0) + 100, distinct_scores(8, 8, 1)
    (alone,) = masks_for_config(cfg, [weak], 0.9)
    assert int(alone.sum()) == round(0.1 * 64)
    m_strong, m_weak = masks_for_config(cfg, [strong, weak], 0.5)
    assert int(m_weak.sum()) == 16 and int(m_strong.sum()) == 48  # the weak layer's floor
    (capped,) = masks_for_config(cfg, [weak], 0.9, min_density=0.25)  # an explicit floor holds
    assert int(capped.sum()) == 16
