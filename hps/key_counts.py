"""A session's key statistics in O(keys of the update): :class:`KeyCounts`.

:class:`hps.advisor.KeyStatistics` (the reference) merges every update into one sorted array
of every key it tracks (``np.unique`` over the tracked keys plus the new ones: O(tracked keys)
per update). :class:`KeyCounts` keeps the same counts in an open-addressing hash map of the
compiled extension (:mod:`hps.kernels`): an update or a ``count_of`` costs O(its keys); a
halving, a trim past ``2 × max_keys`` and :meth:`KeyCounts.hottest` cost O(tracked keys) but
run once per LFU aging period, once per ``max_keys`` new keys, and on warm-up. Its answers
equal the reference's (tests/hps/test_key_counts.py); without the extension it is the reference.

With ``sample_every = s > 1`` the statistics sample whole calls: each update without counts
(and each fused lookup's hits of the table, :mod:`hps.session.fused`) is counted with
probability ``1/s`` (:meth:`KeyCounts.take_call`, the statistics' own generator seeded by
``seed``), every occurrence of a counted call as ``s``, so a key's count is an unbiased
estimate of its occurrences, and ``s - 1`` calls in ``s`` cost the map nothing. A key seen
``n_c`` times in call ``c`` reads ``Σ n_c`` give or take ``sqrt((s - 1)·Σ n_c²)`` (one
standard deviation): a key seen alike in ``C`` calls is within ``sqrt((s - 1) / C)`` of its
count (10 % after 700 calls with ``s = 8``). A session's fused lookups count their *misses*
one for one, always (pre-counted updates: exact, never skipped), so a cold key's history,
which admission weighs, stays exact; only the hits of resident keys are sampled. The total
(:attr:`~hps.advisor.KeyStatistics.total`, the aged mass) is weighted alike, so it is the sum
of the counts, an estimate of the occurrences. The reference path (no extension) counts every
call.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from hps.advisor import KeyStatistics
from hps.kernels import load_extension

__all__ = ["KeyCounts"]


class KeyCounts(KeyStatistics):
    """Bounded, thread-safe running counts of looked-up keys for one table (the interface and
    answers of :class:`~hps.advisor.KeyStatistics`, O(keys) per update).

    Args:
        max_keys: distinct keys kept after a trim (at most ``2 × max_keys`` are kept; past
            that the coldest are dropped).
        sample_every: count about one call in this many, as this many (module docstring); 1:
            every call, exact.
        seed: the sampling generator's seed.

    Raises:
        ValueError: for ``sample_every`` that is not an integer >= 1.
    """

    def __init__(self, max_keys: int = 1_000_000, sample_every: int = 1, seed: int = 0) -> None:
        if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(
                f"KeyCounts: sample_every must be an integer >= 1, got {sample_every!r}"
            )
        super().__init__(max_keys)
        ext = load_extension()
        self._counter = ext.KeyCounter() if ext is not None else None
        self.sample_every = sample_every if self._counter is not None else 1
        self._rng = random.Random(seed)
        if self._counter is not None and sample_every > 1:
            self._counter.set_weight(sample_every)

        # an estimate of the counter's distinct keys from above: it grows by the keys a caller
        # is about to count (will_count, before the counter can gain them) and is set to the
        # counter's size by a trim; a pass that announced its keys before a concurrent trim and
        # counts them after it is missed until the next updates, so the counter may pass
        # 2 × max_keys by the keys of the calls in flight; the size is asked for, and a trim
        # considered, only once the estimate passes 2 × max_keys, not on every update
        self._size_bound = 0

    def take_call(self) -> bool:
        """Whether the next call's keys are counted (always, unsampled; else with probability
        ``1 / sample_every``). A caller counting keys straight into :attr:`counter` asks once
        per call and, when ``False``, neither counts nor reports it."""
        return self.sample_every == 1 or self._rng.random() * self.sample_every < 1.0

    @property
    def counter(self) -> object | None:
        """The compiled counter (``None`` on the reference path); :mod:`hps.fused` counts a
        whole batch of tables into their counters in one call."""
        return self._counter

    def update(self, keys: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Add observations: ``keys (n,) int64`` (with ``counts (n,) int64`` occurrences each)."""
        if self._counter is None:
            super().update(keys, counts)
            return
        k = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64))
        c = (
            torch.empty(0, dtype=torch.int64)
            if counts is None
            else torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))
        )
        if counts is None and not self.take_call():
            return
        self.will_count(int(k.numel()))
        self._counter.update(k, c, False)
        self.observed(int(k.numel()) * self.sample_every if counts is None else int(c.sum()))

    def will_count(self, keys: int) -> None:
        """A caller is about to count at most ``keys`` distinct new keys straight into
        :attr:`counter` (a fused pass, :func:`hps.session.fused` counting): the size bound
        grows first, so it holds whether or not :meth:`observed` follows."""
        with self._lock:
            self._size_bound += keys

    def observed(self, occurrences: int) -> None:
        """Account for ``occurrences`` keys counted straight into :attr:`counter` (after
        :meth:`will_count`), and trim to the ``max_keys`` hottest when more than
        ``2 × max_keys`` distinct keys are held."""
        with self._lock:
            self.total += occurrences
            self.aged_mass += float(occurrences)
            if self._size_bound > 2 * self.max_keys:
                # size and trim in one hold of the counter, the bound set under this lock:
                # nothing counted meanwhile is lost (no caller holds the counter and then
                # waits for this lock)
                assert self._counter is not None
                self._size_bound = self._counter.trim(self.max_keys)

    def halve(self, times: int = 1) -> None:
        """Age the counts: ``c >> times`` each (keys reaching 0 dropped), ``aged_mass / 2**times``.

        Raises:
            ValueError: for ``times < 0``.
        """
        if self._counter is None or times <= 0:
            super().halve(times)
            return
        with self._lock:  # the reference's arrays are empty here: only the mass to age
            self.aged_mass = math.ldexp(self.aged_mass, -min(times, 1100))
        self._counter.halve(times)

    def counter_halved(self, times: int) -> None:
        """Age the rest of the counts (the mass) after a fused pass halved :attr:`counter`
        ``times`` itself (:func:`hps.fused.gather`: an aging of the table's cache fell in
        the query it counted)."""
        with self._lock:
            self.aged_mass = math.ldexp(self.aged_mass, -min(times, 1100))

    def count_of(self, keys: np.ndarray) -> np.ndarray:
        """Observed occurrences of each of ``keys (n,) int64`` so far (0 for an unseen key)."""
        if self._counter is None:
            return super().count_of(keys)
        k = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64).reshape(-1))
        return self._counter.count_of(k).numpy().reshape(np.shape(keys))

    def _items(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._counter is not None
        keys, counts = self._counter.items()  # keys ascending, as the reference's arrays
        return keys.numpy(), counts.numpy()

    def hottest(self, n: int | None = None) -> np.ndarray:
        """Keys hottest first (ties: smaller key first), ``(min(n, distinct),) int64``."""
        if self._counter is None:
            return super().hottest(n)
        keys, counts = self._items()
        return keys[np.argsort(-counts, kind="stable")[:n]].copy()

    def counts(self) -> np.ndarray:
        """Counts hottest first, ``(distinct,) int64``."""
        if self._counter is None:
            return super().counts()
        return np.sort(self._items()[1])[::-1].copy()
