"""Cache-sizing advisor: how much cache each table should get from one memory budget.

From per-table key statistics (observed counts, or a Zipf exponent fitted to them or given)
it computes each table's ideal hit-rate curve ``h_t(c)`` (the share of lookups that hit when
the ``c`` hottest rows are cached) and spends the budget row by row where the marginal hit
per byte is highest. Because every ``h_t`` is concave (rows sorted hottest first), that
greedy allocation maximises the overall hit rate ``Σ_t w_t · h_t(c_t)`` with
``w_t`` = table t's share of all looked-up keys, subject to ``Σ_t c_t · slot_t ≤ budget``.

Budgets are bytes, not rows: a cached row costs a cache slot, ``slot_t`` = the row in the
table's :class:`~hps.rowformat.RowDtype` (``row_bytes``: 512 / 256 / 132 / 68 at dim 128 for
FP32 / FP16 / INT8 / INT4) plus the slot's key, counter, tag and flags, as
:meth:`hps.storage.cache.EmbeddingCache.nbytes` reports them (:func:`cache_slot_bytes`). At
dim 128 with 6.125 bytes of slot metadata (rounded up per slot) an FP32 slot is 519 bytes and
an INT8 slot 139, so the same budget caches 3.7× the rows of an INT8 table. A table whose cache
the parameter server gives a dense key index (:func:`~hps.storage.cache.dense_key_bound`, keys
taken as ``0 .. num_rows - 1``) also costs that index's 4 bytes per row of the table: the
budget holds both (:func:`recommend`)::

    budget 64 MiB, dim 128     fp32: 129,304 rows     int8: 482,797 rows     int4: 894,784 rows

>>> stats = {"t0": TableKeyStats.from_zipf(1_000_000, 128, alpha=1.05, lookups=3.0),
...          "t1": TableKeyStats.from_zipf(100_000, 64, alpha=1.2, lookups=1.0,
...                                        row_format=RowDtype.INT8)}
>>> rec = recommend(stats, budget_bytes=64 * 2**20)            # doctest: +SKIP
>>> print(format_table(rec))                                   # doctest: +SKIP
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hps.rowformat import RowDtype, row_bytes
from hps.storage.cache import DEFAULT_WAYS, EmbeddingCache, dense_key_bound

_CURVE_POINTS = 2048  # breakpoints per table curve (piecewise linear between them)


class KeyStatistics:
    """Bounded, thread-safe running counts of looked-up keys for one table.

    Keeps at most ``2 × max_keys`` distinct keys; when it grows past that, the coldest are
    dropped (a heavy-hitters sketch: hot keys' counts are exact once they are resident).

    Args:
        max_keys: distinct keys kept after a trim.
    """

    def __init__(self, max_keys: int = 1_000_000) -> None:
        if max_keys <= 0:
            raise ValueError(f"max_keys must be > 0, got {max_keys}")
        self.max_keys = max_keys
        self._keys = np.zeros(0, np.int64)
        self._counts = np.zeros(0, np.int64)
        self.total = 0  # keys observed (all occurrences)
        #: the occurrences' mass after aging: ``total`` halved as the counts are (float, so the
        #: mass of keys whose counts rounded down to 0 stays in the denominator of hit rates)
        self.aged_mass = 0.0
        self._lock = threading.Lock()

    def update(self, keys: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add observations: ``keys (n,) int64`` (with ``counts (n,) int64`` occurrences each)."""
        if counts is None:
            keys, counts = np.unique(keys, return_counts=True)
        with self._lock:
            k = np.concatenate([self._keys, keys.astype(np.int64, copy=False)])
            c = np.concatenate([self._counts, counts.astype(np.int64, copy=False)])
            uk, inv = np.unique(k, return_inverse=True)
            uc = np.bincount(inv, weights=c, minlength=uk.size).astype(np.int64)
            if uk.size > 2 * self.max_keys:
                # the hottest, ties the smaller key (uk ascending: a stable sort keeps them)
                top = np.sort(np.argsort(-uc, kind="stable")[: self.max_keys])
                uk, uc = uk[top], uc[top]
            self._keys, self._counts = uk, uc
            self.total += int(counts.sum())
            self.aged_mass += float(counts.sum())

    def halve(self, times: int = 1) -> None:
        """Age the counts: ``c >> times`` each, and ``aged_mass / 2**times`` (``total`` is not
        aged); keys whose count reaches 0 are dropped. A session halves its tables' statistics in step with an LFU cache's
        aging, so admission priorities, warm-up and the advisor see recent popularity.

        Raises:
            ValueError: for ``times < 0``.
        """
        if times < 0:
            raise ValueError(f"halve needs times >= 0, got {times}")
        if times == 0:
            return
        with self._lock:
            c = self._counts >> min(times, 63)
            keep = c > 0
            self._keys, self._counts = self._keys[keep], c[keep]
            self.aged_mass = math.ldexp(self.aged_mass, -min(times, 1100))

    def count_of(self, keys: np.ndarray) -> np.ndarray:
        """Observed occurrences of each of ``keys (n,) int64`` so far, ``(n,) int64`` (0 for a
        key never seen or trimmed)."""
        keys = np.asarray(keys, dtype=np.int64)
        with self._lock:
            if self._keys.size == 0:
                return np.zeros(keys.shape, np.int64)
            pos = np.minimum(np.searchsorted(self._keys, keys), self._keys.size - 1)
            return np.where(self._keys[pos] == keys, self._counts[pos], 0)

    def hottest(self, n: int | None = None) -> np.ndarray:
        """Keys hottest first, ``(min(n, distinct),) int64``."""
        with self._lock:
            order = np.argsort(-self._counts, kind="stable")
            return self._keys[order[:n]].copy()

    def counts(self) -> np.ndarray:
        """Counts hottest first, ``(distinct,) int64``."""
        with self._lock:
            return np.sort(self._counts)[::-1].copy()


def fit_zipf(counts: np.ndarray) -> float:
    """Fit a Zipf exponent α to observed counts (least squares on log count vs log rank over
    the ranks holding 99% of the mass, which the tail's sampling noise would otherwise skew).

    Args:
        counts: ``(k,) int`` occurrences per key (any order).

    Raises:
        ValueError: with fewer than 2 distinct observed keys.
    """
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    c = c[c > 0]
    if c.size < 2:
        raise ValueError(f"fit_zipf needs counts of at least 2 distinct keys, got {c.size}")
    cut = int(np.searchsorted(np.cumsum(c) / c.sum(), 0.99)) + 1
    cut = max(cut, 2)
    ranks = np.arange(1, cut + 1, dtype=np.float64)
    # Weighted by count: the head's counts are precise, the single-digit tail is not.
    w = np.sqrt(c[:cut])
    slope = np.polyfit(np.log(ranks), np.log(c[:cut]), 1, w=w)[0]
    return float(-slope)


def zipf_hit_curve(num_rows: int, alpha: float, cached: np.ndarray) -> np.ndarray:
    """Ideal hit rate with the ``cached`` hottest rows of a Zipf(α) table of ``num_rows`` rows.

    ``h(c) = H(c, α) / H(N, α)`` with generalised harmonic numbers, computed from an exact
    prefix plus the Euler-Maclaurin tail (accurate to ~1e-6 for any N).
    """
    cached = np.clip(np.asarray(cached, dtype=np.float64), 0, num_rows)
    exact = 10_000

    def harmonic(n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        head = np.cumsum(np.arange(1, exact + 1, dtype=np.float64) ** -alpha)
        small = head[np.clip(n.astype(np.int64) - 1, 0, exact - 1)] * (n >= 1)
        a = float(exact)

        def integral(x: np.ndarray) -> np.ndarray:
            return np.log(x) if abs(alpha - 1.0) < 1e-12 else x ** (1 - alpha) / (1 - alpha)

        big = (
            head[-1]
            + integral(np.maximum(n, a))
            - integral(np.array(a))
            + 0.5 * (np.maximum(n, a) ** -alpha - a**-alpha)
        )
        return np.where(n <= exact, small, big)

    return harmonic(np.floor(cached)) / harmonic(np.array(float(num_rows)))


def cache_slot_bytes(dim: int, row_format: RowDtype = RowDtype.FP32) -> int:
    """Bytes one slot of an :class:`~hps.storage.cache.EmbeddingCache` of ``dim``-wide
    ``row_format`` rows costs: its stored row (:func:`hps.rowformat.row_bytes`) and the slot's
    share of the metadata, as :meth:`~hps.storage.cache.EmbeddingCache.nbytes` reports them for
    one full set of :data:`~hps.storage.cache.DEFAULT_WAYS` slots (rounded up to a byte).
    519 / 263 / 139 / 75 at dim 128 for FP32 / FP16 / INT8 / INT4 (6.125 bytes of metadata per
    slot with int32 keys).

    Raises:
        hps.rowformat.RowFormatError: a dim ``row_format`` cannot pack.
    """
    row_bytes(row_format, dim)  # the format's error for a bad dim, before any allocation
    one_set = EmbeddingCache(DEFAULT_WAYS, dim, ways=DEFAULT_WAYS, row_format=row_format)
    return -(-one_set.nbytes() // one_set.capacity)


@dataclass
class TableKeyStats:
    """What the advisor knows about one table.

    Args:
        num_rows: rows in the table.
        dim: row width (values per row).
        lookups: relative lookup volume (keys per request, or observed key total); weights
            the table's hit rate in the overall hit rate.
        counts: observed counts (any order) — used as the curve when given.
        alpha: Zipf exponent — used when ``counts`` is None.
        mass: the occurrences ``counts`` are a part of (``None``: their sum): keys dropped
            from the counts (trimmed, or aged to 0) still count as misses, so the curve
            ``cumsum(sorted counts) / max(mass, sum(counts))`` does not overstate hit rates.
        row_format: how the table's cache stores a row (``tilerec_row_format_per_table``);
            sets the bytes a cached row costs (:func:`cache_slot_bytes`).
    """

    num_rows: int
    dim: int
    lookups: float = 1.0
    counts: np.ndarray | None = None
    alpha: float | None = None
    mass: float | None = None
    row_format: RowDtype = RowDtype.FP32

    def __post_init__(self) -> None:
        self.row_format = RowDtype(self.row_format)

    @classmethod
    def from_zipf(
        cls,
        num_rows: int,
        dim: int,
        alpha: float,
        lookups: float = 1.0,
        row_format: RowDtype = RowDtype.FP32,
    ) -> TableKeyStats:
        return cls(num_rows=num_rows, dim=dim, lookups=lookups, alpha=alpha, row_format=row_format)

    @classmethod
    def from_statistics(
        cls,
        stats: KeyStatistics,
        num_rows: int,
        dim: int,
        fit: bool = False,
        row_format: RowDtype = RowDtype.FP32,
    ) -> TableKeyStats:
        """From a session's :class:`KeyStatistics`; ``fit`` replaces the counts by a fitted α."""
        counts = stats.counts()
        if fit:
            return cls(
                num_rows, dim, float(stats.total), alpha=fit_zipf(counts), row_format=row_format
            )
        return cls(
            num_rows,
            dim,
            float(stats.total),
            counts=counts,
            mass=stats.aged_mass,
            row_format=row_format,
        )

    def curve(self, rows: np.ndarray) -> np.ndarray:
        """Ideal hit rate with ``rows`` hottest rows cached, ``(k,) float64``."""
        rows = np.asarray(rows, dtype=np.float64)
        if self.counts is not None:
            c = np.sort(np.asarray(self.counts, dtype=np.float64))[::-1]
            cum = np.concatenate([[0.0], np.cumsum(c)]) / max(c.sum(), self.mass or 0.0, 1.0)
            return np.interp(rows, np.arange(cum.size, dtype=np.float64), cum)
        if self.alpha is None:
            raise ValueError("TableKeyStats needs counts or alpha")
        return zipf_hit_curve(self.num_rows, self.alpha, rows)


@dataclass(frozen=True)
class Recommendation:
    """One table's recommended cache size."""

    table: str
    fraction: float  # of the table's rows, for ps.json gpucacheper
    rows: int
    bytes: int  # rows × slot_bytes + index_bytes: what the cache holds, metadata included
    hit_rate: float  # ideal, at this size
    weight: float  # share of all lookups
    row_format: RowDtype  # how the table's rows are stored (cache and databases alike)
    slot_bytes: int  # one cached row: its stored bytes and its slot's metadata
    index_bytes: int = 0  # the cache's dense key index (0: the server gives it none)


def index_bytes(t: TableKeyStats, rows: int) -> int:
    """Bytes of the dense key index the parameter server gives a set-associative cache of
    ``rows`` slots of table ``t`` (its keys taken as ``0 .. num_rows - 1``): 4 per key where
    :func:`~hps.storage.cache.dense_key_bound` grants one, else 0; 0 for no cache and for one
    that covers the table (a static cache, which needs none)."""
    if rows <= 0 or rows >= t.num_rows:
        return 0
    bound = dense_key_bound(t.num_rows, rows, row_bytes(t.row_format, t.dim))
    return 4 * bound if bound is not None else 0


def recommend(tables: dict[str, TableKeyStats], budget_bytes: int) -> list[Recommendation]:
    """Split ``budget_bytes`` of cache between ``tables`` to maximise the overall hit rate,
    each cached row costing its table's :func:`cache_slot_bytes` (its row format's bytes and
    the slot's metadata). The dense key indexes the parameter server adds (:func:`index_bytes`)
    come out of the same budget: the rows are split again within what the split's indexes
    leave, until the indexes of a split fit what was set aside for them, so the total stays
    within ``budget_bytes``.

    Returns:
        one :class:`Recommendation` per table, in the input order.

    Raises:
        ValueError: for a non-positive budget or no tables.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    if not tables:
        raise ValueError("recommend needs at least one table")
    total = sum(t.lookups for t in tables.values())
    slot = [cache_slot_bytes(t.dim, t.row_format) for t in tables.values()]
    ts = list(tables.values())
    reserved = 0  # for the indexes: grows strictly until the split's indexes fit it
    while True:
        granted = _split(ts, slot, total, budget_bytes - reserved)
        idx = [index_bytes(t, int(min(g, t.num_rows))) for t, g in zip(ts, granted, strict=True)]
        if sum(idx) <= reserved:
            break
        reserved = sum(idx)
    out = []
    for i, (name, t) in enumerate(tables.items()):
        r = int(min(granted[i], t.num_rows))
        out.append(
            Recommendation(
                name,
                r / t.num_rows,
                r,
                r * slot[i] + idx[i],
                float(t.curve(np.array([r]))[0]),
                t.lookups / total,
                t.row_format,
                slot[i],
                idx[i],
            )
        )
    return out


def _split(
    tables: list[TableKeyStats], slot: list[int], total: float, budget_bytes: int
) -> np.ndarray:
    """Rows granted per table (``(T,) int64``, possibly above a table's rows): the greedy
    split of ``budget_bytes`` by marginal hit per byte, each row costing ``slot[i]``."""
    if budget_bytes <= 0:
        return np.zeros(len(tables), dtype=np.int64)
    names, gains, costs, sizes = [], [], [], []
    for i, t in enumerate(tables):
        # Geometric breakpoints: the head, where the gain is, is resolved finely.
        pts = np.unique(
            np.concatenate([[0], np.geomspace(1, t.num_rows, _CURVE_POINTS).astype(np.int64)])
        )
        h = t.curve(pts)
        dh = np.diff(h) * (t.lookups / total)
        drows = np.diff(pts)
        bytes_ = drows * slot[i]
        names.append(np.full(dh.size, i))
        gains.append(dh / bytes_)
        costs.append(bytes_)
        sizes.append(drows)
    names_a, gain, cost, rows = map(np.concatenate, (names, gains, costs, sizes))
    order = np.argsort(-gain, kind="stable")
    spent = np.cumsum(cost[order])
    take = order[spent <= budget_bytes]
    granted = np.bincount(names_a[take], weights=rows[take], minlength=len(tables)).astype(np.int64)
    # Spend what is left inside the next segment, in whole rows.
    nxt = order[spent > budget_bytes]
    if nxt.size:
        i = int(names_a[nxt[0]])
        left = budget_bytes - (spent[spent <= budget_bytes][-1] if take.size else 0)
        granted[i] += int(left // slot[i])
    return granted


def overall_hit_rate(recs: list[Recommendation]) -> float:
    return float(sum(r.hit_rate * r.weight for r in recs))


def format_table(recs: list[Recommendation]) -> str:
    """A plain-text table of recommendations (for logs and CLIs)."""
    head = (
        f"{'table':<16}{'dtype':>6}{'B/row':>7}{'gpucacheper':>12}{'rows':>12}{'bytes':>14}"
        f"{'MiB':>10}{'hit rate':>10}{'weight':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in recs:
        lines.append(
            f"{r.table:<16}{r.row_format.value:>6}{r.slot_bytes:>7d}{r.fraction:>12.4f}"
            f"{r.rows:>12d}{r.bytes:>14d}{r.bytes / 2**20:>10.1f}{r.hit_rate:>10.4f}"
            f"{r.weight:>8.3f}"
        )
    lines.append(
        f"overall ideal hit rate: {overall_hit_rate(recs):.4f}; "
        f"cache bytes: {sum(r.bytes for r in recs)}"
    )
    return "\n".join(lines)


def plot_hit_curves(
    tables: dict[str, TableKeyStats], path: str | Path, recs: list[Recommendation] | None = None
) -> Path:
    """PNG of ideal hit rate vs cache fraction per table (recommendations marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    frac = np.geomspace(1e-5, 1.0, 200)
    for name, t in tables.items():
        ax.plot(frac, t.curve(frac * t.num_rows), label=name)
    for r in recs or []:
        ax.plot([max(r.fraction, 1e-5)], [r.hit_rate], "o", color="black")
    ax.set_xscale("log")
    ax.set_xlabel("cache size (fraction of table rows)")
    ax.set_ylabel("ideal hit rate (share of lookups)")
    ax.set_title("hit rate vs cache size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
