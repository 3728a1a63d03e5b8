from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from hps.advisor import (
    KeyStatistics,
    TableKeyStats,
    cache_slot_bytes,
    fit_zipf,
    format_table,
    index_bytes,
    overall_hit_rate,
    plot_hit_curves,
    recommend,
    zipf_hit_curve,
)
from hps.rowformat import RowDtype, row_bytes
from hps.storage.cache import EmbeddingCache, dense_key_bound


def _zipf_counts(n: int, alpha: float, samples: int, seed: int) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    draws = np.random.default_rng(seed).choice(n, size=samples, p=p)
    return np.bincount(draws, minlength=n)


@pytest.mark.parametrize("alpha", [0.9, 1.05, 1.2])
def test_fit_zipf_recovers_alpha(alpha: float) -> None:
    counts = _zipf_counts(20_000, alpha, 400_000, seed=1)
    assert fit_zipf(counts) == pytest.approx(alpha, abs=0.08)


def test_zipf_curve_matches_direct_sum() -> None:
    n, alpha = 50_000, 1.05
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    direct = np.cumsum(p) / p.sum()
    c = np.array([1, 10, 5000, 12_345, 49_999, 50_000])
    np.testing.assert_allclose(zipf_hit_curve(n, alpha, c), direct[c - 1], rtol=1e-6)
    assert zipf_hit_curve(n, alpha, np.array([0]))[0] == 0.0


def test_ideal_figures_from_anchors() -> None:
    # ANCHORS.md: ideal hit rate caching the hottest 10% of 10M rows: 0.906 (1.05), 0.978 (1.2)
    assert zipf_hit_curve(10_000_000, 1.05, np.array([1_000_000]))[0] == pytest.approx(
        0.906, abs=0.01
    )
    assert zipf_hit_curve(10_000_000, 1.2, np.array([1_000_000]))[0] == pytest.approx(
        0.978, abs=0.01
    )


def test_recommend_beats_every_grid_split() -> None:
    tables = {
        "a": TableKeyStats.from_zipf(100_000, 16, 1.2, lookups=1.0),
        "b": TableKeyStats.from_zipf(50_000, 64, 0.9, lookups=2.0),
        "c": TableKeyStats(
            20_000, 8, lookups=0.5, counts=_zipf_counts(20_000, 1.0, 100_000, seed=3)
        ),
    }
    budget = 2 * 2**20
    recs = recommend(tables, budget)
    assert sum(r.bytes for r in recs) <= budget
    best = overall_hit_rate(recs)
    bytes_per_row = {r.table: r.slot_bytes for r in recs}
    grid = np.linspace(0, 1, 21)
    for fa, fb in itertools.product(grid, grid):  # brute force over budget shares
        if fa + fb > 1:
            continue
        share = {"a": fa, "b": fb, "c": 1 - fa - fb}
        h = 0.0
        total = sum(t.lookups for t in tables.values())
        for n, t in tables.items():
            rows = min(t.num_rows, int(share[n] * budget // bytes_per_row[n]))
            h += t.lookups / total * float(t.curve(np.array([rows]))[0])
        assert h <= best + 1e-3
    text = format_table(recs)
    assert "gpucacheper" in text and "overall ideal hit rate" in text


def test_key_statistics_bounded_and_hottest_first(tmp_path: Path) -> None:
    ks = KeyStatistics(max_keys=100)
    g = np.random.default_rng(0)
    for _ in range(20):
        ks.update(
            np.concatenate([np.repeat(np.arange(10), 3), g.integers(1000, 10**9, 300)]).astype(
                np.int64
            )
        )
    hot = ks.hottest(10)
    assert sorted(hot.tolist()) == list(range(10))
    assert len(ks.counts()) <= 200 and ks.counts()[0] == 60 and ks.total == 20 * 330
    stats = {"t": TableKeyStats.from_statistics(ks, num_rows=10**9, dim=8)}
    png = plot_hit_curves(stats, tmp_path / "hit.png", recommend(stats, 4096))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_aged_or_trimmed_statistics_do_not_overstate_hit_rates() -> None:
    """Key 1 is half the occurrences. Halving drops the keys seen once (their counts reach
    0) and trimming drops the coldest, but their mass stays in the curve's denominator: one
    cached row still hits half of the lookups, not all of them."""
    ks = KeyStatistics()
    ks.update(np.array([1] * 8 + list(range(2, 10)), dtype=np.int64))
    ks.halve()
    assert ks.counts().tolist() == [4] and ks.aged_mass == 8.0 and ks.total == 16
    curve = TableKeyStats.from_statistics(ks, num_rows=100, dim=4).curve(np.array([0, 1, 5]))
    assert curve.tolist() == [0.0, 0.5, 0.5]
    trimmed = KeyStatistics(max_keys=1)
    trimmed.update(
        np.array([1] * 4 + [2, 3, 4, 5], dtype=np.int64)
    )  # 5 distinct > 2 × 1: trimmed to 1
    assert trimmed.counts().tolist() == [4]
    assert TableKeyStats.from_statistics(trimmed, 100, 4).curve(np.array([1])).tolist() == [0.5]
    ks.halve(2000)  # any number of halvings: the mass stays a finite float
    assert ks.aged_mass == 0.0 and ks.counts().size == 0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        recommend({"a": TableKeyStats.from_zipf(10, 4, 1.0)}, 0)
    with pytest.raises(ValueError, match="at least 2 distinct"):
        fit_zipf(np.array([5]))


@pytest.mark.parametrize("dtype", [RowDtype.FP32, RowDtype.FP16, RowDtype.INT8, RowDtype.INT4])
def test_a_cache_slot_costs_its_row_format_and_its_metadata(dtype: RowDtype) -> None:
    """One slot: the row in its format plus 6.125 bytes of metadata (int32 keys), rounded up
    to a byte per slot; a cache of ``k`` slots holds ``k`` rows + ``k × 6.125`` bytes."""
    row = {RowDtype.FP32: 512, RowDtype.FP16: 256, RowDtype.INT8: 132, RowDtype.INT4: 68}[dtype]
    assert row_bytes(dtype, 128) == row
    slot = {RowDtype.FP32: 519, RowDtype.FP16: 263, RowDtype.INT8: 139, RowDtype.INT4: 75}[dtype]
    assert cache_slot_bytes(128, dtype) == slot
    c = EmbeddingCache(4 * 64, 128, ways=64, row_format=dtype)
    assert c.nbytes() == c.capacity * row + c.capacity * 49 // 8


def test_an_int8_table_gets_three_point_seven_times_the_rows() -> None:
    """The same budget and key statistics: the INT8 table caches 519 / 139 ≈ 3.7× the FP32
    table's rows (512 and 132 B rows + 6.125 B of metadata, rounded up per slot), each
    recommendation's bytes exactly rows × slot bytes."""
    budget = 3 * 2**20
    recs = {
        dt: recommend({"t": TableKeyStats.from_zipf(10**6, 128, 1.05, row_format=dt)}, budget)[0]
        for dt in (RowDtype.FP32, RowDtype.INT8, RowDtype.INT4)
    }
    for dt, r in recs.items():
        slot = cache_slot_bytes(128, dt)
        assert (r.row_format, r.slot_bytes) == (dt, slot)
        assert r.rows == budget // slot and r.bytes == r.rows * slot  # the whole budget spent
        assert r.fraction == r.rows / 10**6
    ratio = recs[RowDtype.INT8].rows / recs[RowDtype.FP32].rows
    assert ratio == pytest.approx(
        cache_slot_bytes(128) / cache_slot_bytes(128, RowDtype.INT8), 1e-3
    )
    assert [recs[dt].slot_bytes for dt in recs] == [519, 139, 75]
    assert 3.7 < ratio < 3.75
    assert recs[RowDtype.INT8].hit_rate > recs[RowDtype.FP32].hit_rate


def test_a_budget_split_between_mixed_formats_counts_bytes() -> None:
    """An FP32 and an INT8 table with the same keys: the split spends the budget in bytes
    (the INT8 table's cheaper rows reach further down its curve: equal marginal hit per byte
    means more of its rows), and every byte is accounted for."""
    budget = 2**20
    tables = {
        "f": TableKeyStats.from_zipf(200_000, 64, 1.05),
        "q": TableKeyStats.from_zipf(200_000, 64, 1.05, row_format=RowDtype.INT8),
    }
    f, q = recommend(tables, budget)
    sf, sq = cache_slot_bytes(64), cache_slot_bytes(64, RowDtype.INT8)
    meta = sf - row_bytes(RowDtype.FP32, 64)  # the slot's metadata, the same in both caches
    assert (f.slot_bytes, q.slot_bytes) == (sf, sq) and sq == row_bytes(RowDtype.INT8, 64) + meta
    assert f.bytes == f.rows * sf and q.bytes == q.rows * sq
    assert budget - max(sf, sq) < f.bytes + q.bytes <= budget
    # with identical curves, equal marginal gain per byte puts sf/sq × more rows in the INT8 cache
    assert q.rows / f.rows == pytest.approx((sf / sq) ** (1 / 1.05), rel=0.05)
    text = format_table([f, q])
    assert "int8" in text and f"{q.bytes:>14d}" in text and str(sq) in text


def test_a_cache_with_a_dense_key_index_pays_for_it_from_the_budget() -> None:
    """A 100,000-row FP32 table of dim 128 cached at ~40 %: the server gives its cache a dense
    key index (4 B per row of the table, within an eighth of the cached rows' bytes), which
    the recommendation counts and the rows leave room for; the cache the server builds at that
    size holds those bytes (up to the rounding of a slot's bytes and of its last set)."""
    t = TableKeyStats.from_zipf(100_000, 128, 1.05)
    budget = 20 * 2**20
    (r,) = recommend({"t": t}, budget)
    slot = cache_slot_bytes(128)
    assert r.index_bytes == index_bytes(t, r.rows) == 4 * 100_000
    assert r.bytes == r.rows * slot + r.index_bytes <= budget
    assert r.rows == (budget - r.index_bytes) // slot  # the rest of the budget spent on rows
    c = EmbeddingCache(r.rows, 128, key_bound=dense_key_bound(100_000, r.rows, 512))
    # a slot's metadata rounded up to a byte; the cache rounded up to whole sets
    assert -r.rows < c.nbytes() - r.bytes < 64 * slot
    # no index: a cache under an eighth's threshold, and a cache of the whole table (static)
    assert index_bytes(t, 100_000 * 32 // 512 - 1) == 0 < index_bytes(t, 100_000 * 32 // 512)
    assert index_bytes(t, 100_000) == 0 and index_bytes(t, 0) == 0
    (whole,) = recommend({"t": t}, 10**9)
    assert whole.rows == 100_000 and whole.index_bytes == 0


def test_budgets_around_the_index_threshold_are_never_exceeded() -> None:
    """Two tables and budgets from a few rows to all of both: whichever caches get an index,
    the recommendation's bytes (rows and indexes) stay within the budget, and each index is
    the one the server would give a cache of that many rows."""
    tables = {
        "a": TableKeyStats.from_zipf(50_000, 128, 1.1, lookups=2.0),
        "b": TableKeyStats.from_zipf(20_000, 64, 0.9),
    }
    whole = sum(cache_slot_bytes(t.dim) * t.num_rows for t in tables.values())
    for budget in np.linspace(5_000, 1.1 * whole, 97).astype(np.int64):
        recs = recommend(tables, int(budget))
        assert sum(r.bytes for r in recs) <= budget
        for r, t in zip(recs, tables.values(), strict=True):
            assert r.index_bytes == index_bytes(t, r.rows)
            assert r.bytes == r.rows * r.slot_bytes + r.index_bytes
