"""The embedding cache's per-slot bytes (int32 low words with a nibble naming the high word,
widened to int64 on demand, one counter byte, one tag byte, one homed bit) and the one-byte counter (hps.storage.cache.slot_counter)."""

from __future__ import annotations

import pytest
import torch

from hps.rowformat import RowDtype, row_bytes
from hps.storage.cache import (
    EMPTY_KEY,
    HALVE,
    LEVEL_COUNTS,
    EmbeddingCache,
    SlotKeys,
    add_weighted,
    count_of,
    draws,
    level_of,
    stream_of,
)
from hps.types import CachePolicy

DIM = 128
FBGEMM_ROW = {RowDtype.FP32: 512, RowDtype.FP16: 256, RowDtype.INT8: 132, RowDtype.INT4: 68}


@pytest.mark.parametrize("dtype", list(FBGEMM_ROW))
@pytest.mark.parametrize("compact", [True, False])
def test_bytes_per_slot_are_the_row_plus_the_pinned_metadata(
    dtype: RowDtype, compact: bool
) -> None:
    """int32 keys: row + 4 (key) + 1 (counter) + 1 (tag) + 1/8 (homed bit); int64: + 8."""
    cap = 256
    c = EmbeddingCache(cap, DIM, ways=64, row_format=dtype, compact_keys=compact)
    key = 4 if compact else 8
    assert c.slot_keys.keys.dtype == (torch.int32 if compact else torch.int64)
    assert (c.slot_keys.keys.shape, c.counters.shape, c.tags.shape) == ((4, 64),) * 3
    assert c.counters.dtype == c.tags.dtype == c.homed_bits.dtype == torch.uint8
    assert c.homed_bits.shape == (cap // 8,)
    assert c.storage.shape == (cap, row_bytes(dtype, DIM)) == (cap, FBGEMM_ROW[dtype])
    assert c.nbytes() == cap * (FBGEMM_ROW[dtype] + key + 2) + cap // 8
    per_slot = c.nbytes() / cap
    assert per_slot == FBGEMM_ROW[dtype] + key + 2.125
    if compact:  # issue 28: each tier's bytes per row ≤ 1.1 × FBGEMM's row of the same dtype
        assert per_slot <= 1.1 * FBGEMM_ROW[dtype]


def test_keys_keep_a_nibble_per_slot_for_up_to_16_high_words_then_widen() -> None:
    """One high word: int32 low words, + 8 B for the word; several: + a nibble per slot
    (slot metadata 6.625 B: INT4 rows stay within 1.1× FBGEMM's 68 B); a key sharing a cached
    key's low word but not its high word is not cached; a 17th word reuses a word no key has
    any more, and only 17 words in use widen the keys to int64 (+ 8 B per slot)."""
    cap = 64
    c = EmbeddingCache(cap, 2, ways=8)
    base = c.nbytes()
    assert base == cap * (4 * 2 + 4 + 2) + cap // 8 and c.slot_keys.high_words.numel() == 0
    small = torch.arange(10)
    c.insert(small, small[:, None].float().expand(10, 2))
    assert (
        c.slot_keys.keys.dtype == torch.int32
        and c.slot_keys.high_of is None
        and c.nbytes() == base + 8
    )
    assert int(c.slot_keys.keys.view(-1)[c.tags.view(-1) == 0][0]) == -1
    assert not bool(c.contains(torch.tensor([-1]))[0])  # -1 is an empty slot's word, no key
    assert not c.contains(small + 2**32).any()  # the same low words, another high word
    big = torch.tensor([-1, 2**31, -(2**62), 2**32 + 3])  # high words -1, 0, -2**30, 1
    assert c.insert(big, torch.ones(4, 2)) == 4
    assert c.slot_keys.keys.dtype == torch.int32 and c.slot_keys.high_words.tolist() == [
        0,
        -(2**30),
        -1,
        1,
    ]
    assert c.nbytes() == base + cap // 2 + 8 * 4
    assert not c.contains(torch.tensor([2**32 - 1, 3 + 2**33, 2**32]))[:2].any()
    got, hit = c.query(torch.cat([small, big]))
    assert hit.all() and torch.equal(got[:10, 0], small.float()) and bool((got[10:] == 1).all())
    assert sorted(c.cached_keys().tolist()) == sorted([*small.tolist(), *big.tolist()])
    c.invalidate(big[2:3])  # -2**62: its high word is in use by no key now
    more = torch.arange(13) * 2**32 + 2**40  # 13 new words: 16 in use, one reused
    assert c.insert(more, torch.full((13, 2), 2.0)) == 13
    assert c.slot_keys.keys.dtype == torch.int32 and c.slot_keys.high_words.numel() == 16
    assert -(2**30) not in c.slot_keys.high_words.tolist()
    assert c.contains(torch.cat([small, big[[0, 1, 3]], more])).all()
    assert c.insert(torch.tensor([7 * 2**50]), torch.zeros(1, 2)) == 1  # a 17th word in use
    assert c.slot_keys.keys.dtype == torch.int64 and c.slot_keys.high_of is None
    assert c.nbytes() == cap * (4 * 2 + 8 + 2) + cap // 8
    assert int(c.slot_keys.keys.view(-1)[c.tags.view(-1) == 0][0]) == EMPTY_KEY
    want = [*small.tolist(), *big[[0, 1, 3]].tolist(), *more.tolist(), 7 * 2**50]
    assert sorted(c.cached_keys().tolist()) == sorted(want)
    assert c.contains(torch.tensor(want)).all()


@pytest.mark.parametrize("dtype", list(FBGEMM_ROW))
def test_int64_keys_of_a_few_high_words_stay_within_1_1x_fbgemm(dtype: RowDtype) -> None:
    """Keys past 2**32 and negative keys in 3 high words: 4 B low word + 1/2 B nibble +
    counter + tag + homed bit, + 8 B per word for the cache."""
    cap = 256
    c = EmbeddingCache(cap, DIM, ways=64, row_format=dtype)
    k = torch.cat([torch.arange(50) - 25, torch.arange(50) + 2**40])
    c.insert(k, torch.zeros(k.numel(), DIM))
    assert c.slot_keys.high_words.numel() == 3 and c.slot_keys.keys.dtype == torch.int32
    assert c.nbytes() == cap * (FBGEMM_ROW[dtype] + 4 + 2) + cap // 8 + cap // 2 + 3 * 8
    assert c.nbytes() / cap <= 1.1 * FBGEMM_ROW[dtype] + 24 / cap


def test_homed_bits_are_one_bit_per_slot() -> None:
    c = EmbeddingCache(64, 2, ways=8)
    c._set_homed(torch.tensor([0, 1, 2, 9, 63]), True)
    assert c.homed_bits[:2].tolist() == [0b111, 0b10] and int(c.homed_bits[7]) == 0x80
    c._set_homed(torch.tensor([1, 63]), False)
    c._set_homed(torch.tensor([2]), True)  # already set: stays set
    assert c.homed_bits[:2].tolist() == [0b101, 0b10] and int(c.homed_bits[7]) == 0
    assert c.homed.nonzero().view(-1).tolist() == [0, 2, 9]


def test_lfu_levels_are_exact_up_to_18_then_logarithmic() -> None:
    assert LEVEL_COUNTS[:19] == tuple(range(19)) and len(LEVEL_COUNTS) == 128
    assert all(b > a for a, b in zip(LEVEL_COUNTS, LEVEL_COUNTS[1:], strict=False))
    assert LEVEL_COUNTS[19:22] == (21, 24, 28) and LEVEL_COUNTS[-1] == 2_110_814_135
    assert [HALVE[v] for v in range(19)] == [v >> 1 for v in range(19)]  # c >> 1, as before
    assert all(LEVEL_COUNTS[HALVE[v]] <= LEVEL_COUNTS[v] // 2 for v in range(128))
    counts = torch.tensor([0, 5, 18, 20, 1000, 2**31 - 1])
    assert count_of(level_of(counts)).tolist() == [0, 5, 18, 18, 959, 2_110_814_135]


def test_morris_steps_are_unbiased_and_reproducible() -> None:
    """Weights added through levels keep the expected count (10,000 counters, seeded draws:
    the same draws give the same levels, another seed other levels)."""
    n = 10_000
    for w in (1, 7, 100, 5000):
        lv = torch.full((n,), 19, dtype=torch.uint8)  # 21 uses: past the exact levels
        for step in range(5):
            lv = add_weighted(lv, torch.full((n,), w), draws(stream_of(0, step), torch.arange(n)))
        mean = float(count_of(lv).double().mean())
        assert abs(mean - (21 + 5 * w)) <= 0.02 * (21 + 5 * w), (w, mean)
    u = draws(stream_of(1, 5), torch.arange(n))
    assert torch.equal(u, draws(stream_of(1, 5), torch.arange(n)))
    assert not torch.equal(u, draws(stream_of(2, 5), torch.arange(n)))
    assert int(u.min()) >= 0 and int(u.max()) < 2**32


def test_an_lfu_query_counts_small_uses_exactly_and_large_ones_by_level() -> None:
    c = EmbeddingCache(8, 1, policy=CachePolicy.LFU, ways=8, lfu_decay_keys_per_slot=0)
    c.insert(torch.tensor([1, 2]), torch.zeros(2, 1))
    c.query(torch.tensor([1, 2]), counts=torch.tensor([4, 3000]))
    _, slot = c._slots(torch.tensor([1, 2]))
    got = count_of(c.counters.view(-1)[slot]).tolist()
    assert got[0] == 5  # 1 + 4: exact
    lo = max(x for x in LEVEL_COUNTS if x <= 3001)
    assert got[1] in (lo, min(x for x in LEVEL_COUNTS if x > 3001))  # 3001 rounded to a level


def test_lru_stamps_never_wrap() -> None:
    """7-bit LRU stamps: after 127 queries an entry's stamp would equal the clock again; the
    renormalisation every 64 queries keeps it the oldest, so it is the one evicted."""
    c = EmbeddingCache(2, 1, policy=CachePolicy.LRU, ways=2)
    c.insert(torch.tensor([1, 2]), torch.zeros(2, 1))  # both stamped at clock 1
    for q in range(127):  # 127 queries of absent keys
        c.query(torch.tensor([100 + q]))
    c.query(torch.tensor([2]))  # key 2 used now; key 1 last used 128 queries ago
    assert c.insert(torch.tensor([3]), torch.zeros(1, 1)) == 1
    assert c.contains(torch.tensor([1, 2, 3])).tolist() == [False, True, True]


def test_a_word_the_batch_needs_is_never_reused_for_another_word() -> None:
    """A high word held by no slot but needed by keys of the same insert stays theirs: the
    insert's keys keep their own high words (the reviewer's 16-word case)."""
    c = EmbeddingCache(256, 4, ways=4)
    ks = torch.tensor([(w << 32) | (100 + w) for w in range(16)])
    c.insert(ks, torch.arange(16, dtype=torch.float32)[:, None].repeat(1, 4))
    c.invalidate(ks[3:4])  # word 3 now held by no slot
    a, b = (3 << 32) | 77, (16 << 32) | 88
    assert c.insert(torch.tensor([a, b]), torch.tensor([[1.0] * 4, [2.0] * 4])) == 2
    assert c.contains(torch.tensor([a, b])).all() and not bool(c.contains(torch.tensor([77]))[0])
    want = sorted([*ks[[i for i in range(16) if i != 3]].tolist(), a, b])
    assert sorted(c.cached_keys().tolist()) == want
    got, hit = c.query(torch.tensor([a, b]))
    assert hit.all() and got[:, 0].tolist() == [1.0, 2.0]


def test_seventeen_words_in_one_insert_over_a_one_word_cache_widen() -> None:
    """A cache of one high word (no nibbles) whose only key is overwritten by an insert of
    17 words, that word among them: the keys widen to int64, none is renamed."""
    c2 = EmbeddingCache(64, 1, ways=64)
    c2.insert(torch.tensor([5]), torch.ones(1, 1))
    assert c2.slot_keys.high_of is None and c2.slot_keys.high_words.tolist() == [0]
    c2.invalidate(torch.tensor([5]))  # word 0 held by no slot
    keys = torch.tensor([6] + [(w << 32) | w for w in range(1, 17)])
    assert c2.insert(keys, keys[:, None].float()) == 17
    assert sorted(c2.cached_keys().tolist()) == sorted(keys.tolist())
    got, hit = c2.query(keys)
    assert hit.all() and torch.equal(got[:, 0], keys.float())


def test_slot_keys_stand_alone_write_read_clear_and_widen() -> None:
    """SlotKeys needs no cache: the held slots come in as tags (0 = empty)."""
    sk = SlotKeys((2, 4), torch.device("cpu"), compact=True)
    tags = torch.zeros(8, dtype=torch.uint8)
    slots = torch.tensor([0, 3, 5])
    keys = torch.tensor([7, -3, 2**40 + 1])
    sk.write(slots, keys, tags)
    tags[slots] = 1
    assert sk.keys.dtype == torch.int32 and sk.high_words.tolist() == [-1, 0, 256]
    assert torch.equal(sk.keys_of(slots), keys) and sk.nbytes() == 8 * 4 + 3 * 8 + 4
    sk.clear(slots[:1])
    tags[0] = 0
    assert int(sk.keys.view(-1)[0]) == sk.empty_key == -1
    sk.widen(tags)
    assert sk.wide and sk.high_of is None and sk.empty_key == EMPTY_KEY
    assert torch.equal(sk.keys_of(slots[1:]), keys[1:]) and int(sk.keys.view(-1)[0]) == EMPTY_KEY
