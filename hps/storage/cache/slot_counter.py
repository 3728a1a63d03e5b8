"""The one-byte use counter of an embedding-cache slot: a 7-bit level.

Byte layout (``EmbeddingCache.counters``, ``(num_sets, ways) uint8``)::

    bit 7      0
    bits 0..6  level 0..127
               LFU: a logarithmic (Morris) use count, ``LEVEL_COUNTS[level]`` uses
               LRU: the query clock of the last use modulo 128 (ages renormalised every 64
                    queries, see :func:`lru_renormalised`)

LFU levels (``LEVEL_COUNTS``): exact counts 0..18, then each level ~3/16 above the one below
(``c + c·3 // 16``), up to 2.11e9 at level 127. A use moves level ``v`` up by one with
probability ``1 / (LEVEL_COUNTS[v + 1] - LEVEL_COUNTS[v])`` (1 up to level 18, so small counts
stay exact), so the expected count after ``n`` uses is ``LEVEL_COUNTS[v] + n`` (Morris, 1978;
Redis's ``lfu-log-factor`` counter). A weight ``w`` (a key's occurrences in a request) moves it
to ``LEVEL_COUNTS[v] + w`` rounded to a level up or down in proportion (same expectation).
Aging halves a count: ``HALVE[v]`` is the highest level at or below ``LEVEL_COUNTS[v] // 2``
(``v >> 1`` for the exact levels).

LFU aging in the cache (TinyLFU's "reset", Einziger et al., 2017): counts that only grow pin
yesterday's hot keys forever once popularity drifts, since no new key can reach them. So every
``lfu_decay_interval`` looked-up keys (occurrences, hits and misses: the same unit the counters
grow by), every count is halved (``HALVE``: ``c >> 1`` for counts up to 18). Worked example,
``lfu_decay_interval = 10``::

    one set's counts (slot 3 empty)                 [5, 3, 1, -]   clock  0   decay_epoch 0
    query 6 keys, no hit                             [5, 3, 1, -]   clock  6
    query 5 keys, slot 0 hit once: [5, 3, 1, -] >> 1 = [2, 1, 0, -]
                                 then the hit: [3, 1, 0, -]   clock 11   decay_epoch 1
    query 25 keys, no hit (crosses 20 and 30):  >> 2 = [0, 0, 0, -]   clock 36   decay_epoch 3

A query first advances the clock by its keys (halving what came before), then counts its own
hits in full, as TinyLFU counts the uses after a reset: a query longer than the period (a
65,536-key batch against a 128-slot cache's 2,560) would otherwise halve its own hits several
times over and lose them to every cold miss (hit rate 0.52 vs LRU's 0.58 in such a run). A
priority counted at the query's epoch is counted the same way. A counter that reaches 0
stays cached until a new key (priority ≥ 1) wants its slot. Insertions and warm-up never move
the clock; LRU ignores it.

The draws are deterministic: the use by the key at position ``j`` of a call draws the low 32
bits of ``mix64(stream + j)`` (splitmix64), ``stream`` derived from the cache's seed and its query
clock (:func:`stream_of`), so a run repeats and the compiled pass (``hps/csrc``) and the
torch reference count the same levels bit for bit.
"""

from __future__ import annotations

import torch

from hps.storage.cache.index import mix64_int, mix_keys

__all__ = [
    "EXACT_LEVELS",
    "HALVE",
    "LEVEL_COUNTS",
    "LRU_PERIOD",
    "MAX_LEVEL",
    "add_weighted",
    "aging_lut",
    "count_of",
    "draws",
    "gaps",
    "level_of",
    "lru_renormalised",
    "stream_of",
]

MAX_LEVEL = 127
EXACT_LEVELS = 18  # levels 0..18 are exact counts
LRU_PERIOD = 128  # LRU stamps are the query clock modulo this
LRU_RENORM = 64  # ... and ages are capped at LRU_RENORM - 1 every LRU_RENORM queries


def _levels() -> tuple[int, ...]:
    lv = list(range(EXACT_LEVELS + 1))
    while len(lv) <= MAX_LEVEL:
        c = lv[-1]
        lv.append(c + max(1, c * 3 // 16))
    if lv[-1] >= 2**31:  # the counts fit int32 priorities
        raise AssertionError(f"level table overflows: {lv[-1]}")
    return tuple(lv)


#: uses counted by each LFU level (strictly increasing; exact for 0..EXACT_LEVELS)
LEVEL_COUNTS: tuple[int, ...] = _levels()


def _halve() -> tuple[int, ...]:
    out = []
    for c in LEVEL_COUNTS:
        half = c // 2
        out.append(max(v for v, x in enumerate(LEVEL_COUNTS) if x <= half))
    return tuple(out)


#: the level of half a level's count (rounded down to a level)
HALVE: tuple[int, ...] = _halve()


def count_of(levels: torch.Tensor) -> torch.Tensor:
    """``levels`` uint8 (bits 0..6) → the same shape of int64 counts."""
    table = torch.tensor(LEVEL_COUNTS, dtype=torch.int64, device=levels.device)
    return table[(levels & MAX_LEVEL).long()]


def level_of(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` int64 ≥ 0 → uint8 levels: the highest level whose count is ≤ the count."""
    table = torch.tensor(LEVEL_COUNTS, dtype=torch.int64, device=counts.device)
    lv = torch.searchsorted(table, counts.contiguous(), right=True) - 1
    return lv.clamp(0, MAX_LEVEL).to(torch.uint8)


def gaps() -> torch.Tensor:
    """``(128,) int64``: ``LEVEL_COUNTS[v + 1] - LEVEL_COUNTS[v]`` (0 at the top level): a use
    at level ``v`` moves up where ``draw × gap < 2**32`` (the compiled pass's table)."""
    g = [b - a for a, b in zip(LEVEL_COUNTS, LEVEL_COUNTS[1:], strict=False)] + [0]
    return torch.tensor(g, dtype=torch.int64)


def aging_lut(times: int) -> torch.Tensor:
    """``(128,) uint8``: the level after ``times`` halvings of each level (``HALVE`` applied
    ``times`` times; 0 for every level after 128)."""
    lut = list(range(MAX_LEVEL + 1))
    for _ in range(min(times, MAX_LEVEL + 1)):
        lut = [HALVE[v] for v in lut]
    return torch.tensor(lut, dtype=torch.uint8)


def stream_of(seed: int, clock: int) -> int:
    """The draw stream of one query: ``mix64(seed · 2**32 + clock)`` as a signed int64 (the
    ``j``-th use draws ``mix64(stream + j)``)."""
    return mix64_int((seed & 0xFFFFFFFF) << 32 | (clock & 0xFFFFFFFF))


def draws(stream: int, positions: torch.Tensor) -> torch.Tensor:
    """``positions (n,) int64`` → ``(n,) int64`` draws in ``[0, 2**32)``: the low 32 bits of
    ``mix64(stream + position)`` (int64 addition wraps, as the kernel's uint64)."""
    return mix_keys(positions + stream) & 0xFFFFFFFF


def add_weighted(levels: torch.Tensor, weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """LFU levels after ``weights`` more uses each (``levels (n,) uint8``;
    ``weights (n,) int64 ≥ 1``; ``u (n,) int64`` draws in ``[0, 2**32)``): the count
    ``LEVEL_COUNTS[v] + w`` rounded to the level below or above it, up with probability
    (count − lower) / (upper − lower). For ``w = 1`` this is one Morris step."""
    table = torch.tensor(LEVEL_COUNTS, dtype=torch.int64, device=levels.device)
    target = table[levels.long()] + weights
    lo = (torch.searchsorted(table, target, right=True) - 1).clamp(0, MAX_LEVEL)
    top = lo == MAX_LEVEL
    gap = table[(lo + 1).clamp(max=MAX_LEVEL)] - table[lo]
    up = ~top & (u * gap < (target - table[lo]) * 2**32)
    return (lo + up.long()).to(torch.uint8)


def lru_renormalised(stamps: torch.Tensor, clock: int) -> torch.Tensor:
    """LRU stamps (``uint8``, ``clock mod 128``) with every age ``(clock − stamp) mod 128``
    above 63 set to 63: called every 64 queries, it keeps every age below 128, so ages never
    wrap (exact for the last 63 queries; older uses tie)."""
    cap = LRU_RENORM - 1
    age = (clock - stamps.long()) % LRU_PERIOD
    old = ((clock - cap) % LRU_PERIOD) + torch.zeros_like(age)
    return torch.where(age > cap, old, stamps.long()).to(torch.uint8)
