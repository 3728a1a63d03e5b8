"""The embedding cache: a set-associative cache of rows held as torch tensors on the compute
device (CPU here, CUDA when present), LRU or LFU within each set, and the static cache (one
fixed slot per key of a table that fits whole).

Modules: :mod:`~hps.storage.cache.set_associative` (:class:`EmbeddingCache`),
:mod:`~hps.storage.cache.static` (:class:`StaticEmbeddingCache`),
:mod:`~hps.storage.cache.slot_keys` (:class:`SlotKeys`, the key of each slot),
:mod:`~hps.storage.cache.dense_index` (:class:`DenseKeyIndex`, the slot of each key of a
dense range),
:mod:`~hps.storage.cache.slot_counter` (the one-byte LFU level / LRU stamp),
:mod:`~hps.storage.cache.index` (set, tag, word and bit helpers),
:mod:`~hps.storage.cache.records` (:class:`CacheStats`, :class:`Placed`, :class:`RowHome`).

Layout for ``capacity = 8`` rows, ``ways = 4`` (HugeCTR: 2 slabs of 32 → 64 ways)::

    set(key) = hi32(splitmix64(key)) × num_sets >> 32       num_sets = ceil(capacity / ways) = 2

    keys     (num_sets, ways) int32    [[ 7, 12, E,  3],      low 32 bits of each key; E = -1
                                        [ 5,  E, E,  E]]      (int64 keys: the key, EMPTY_KEY)
    high_words (h,) int64              [0, 5]                 the keys' distinct high 32 bits
    high_of  (capacity / 2,) uint8     4 bits per slot: its key's high word in ``high_words``
                                       (none while h ≤ 1: every key has ``high_words[0]``)
    counters (num_sets, ways) uint8    [[40, 38, 0, 12],      one byte (cache.slot_counter):
                                        [41,  0, 0,  0]]      LFU log level / LRU stamp
    tags     (num_sets, ways) uint8    [[ 9, 201, 0, 77],     tag_of(key); 0 = empty
                                        [14,  0, 0,  0]]
    homed    (capacity / 8,) uint8     one bit per slot: the slot holds the in-process volatile
                                       tier's only copy of its row (see below)
    storage  (num_sets * ways, row_bytes) uint8   row of slot s*ways + w, in ``row_format``
    values   (num_sets * ways, dim) float32       the FP32 view of ``storage`` (FP32 rows only)

Bytes per slot: the row + 6.125 while the cached keys share one high word (low word 4, counter
1, tag 1, homed 1/8: any keys in ``[0, 2**32)``, or in any one aligned 2**32 range), + 6.625
with up to ``MAX_HIGH_WORDS`` = 16 high words (the nibble), + 10.125 with int64 keys; plus 8 B
per high word for the cache. A compact cache adds a high word the first time a key has a new
one; when a 17th is needed it reuses the words no cached key has any more (one scan of the
nibbles), and only when all 16 are in use does it widen its keys to int64 (one copy, under
its lock; ``compact_keys=False``: int64 from the start). Any key but ``EMPTY_KEY`` can be
cached either way; keys spread over more than 16 high words (64-bit hashes) are held as int64.

A probe of the compiled path (:mod:`hps.fused`) looks the key's high word up among the
cache's (at most 16, in one cache line; a key with none is a miss without a probe), reads the
set's tag line (64 ways = one 64-byte cache line), then only the low word (and nibble) of a way
whose tag matches (1 in 255 false matches per way), then the row and the slot's counter byte:
O(1) cache lines per key. A cache built with a ``key_bound`` also keeps a dense key index
(``(key_bound,) int32``, 4 bytes per key of ``[0, key_bound)``: the slot or -1), exact under
its lock; the compiled probe of such a key reads its 4-byte entry instead of hashing it and
reading the tag and key lines, and the cache's own operations gather its slot from the entry
(checked to hold the key). The torch query below compares every other key (and every key of
a cache without an index) with the ``ways`` keys of its set in one vectorised ``==``; an
insertion sorts the new keys by set and, inside a set, by their frequency in the request,
and gives the r-th new key of a set that set's r-th victim (empty slots first, then the
lowest counter) if that victim is colder (see :meth:`EmbeddingCache.insert`). No per-key
Python loop anywhere.

LFU counts are logarithmic (one byte, exact up to 18 uses, then ~3/16 apart; a use moves a level
up with a probability drawn from a splitmix64 stream seeded per cache: reproducible, see
:mod:`hps.storage.cache.slot_counter`). LRU stamps are the query clock modulo 128, ages capped
at 63 every 64 queries (exact recency for the last 63 queries, older entries tie).

LFU aging (TinyLFU's "reset"): every ``lfu_decay_interval`` looked-up keys every count is
halved, before the query's own uses count (worked example in :mod:`hps.storage.cache.slot_counter`).

Exclusive tiers (no row held twice in host RAM). A CPU cache can be attached to the in-process
hash map below it (:meth:`hps.storage.volatile.HashMapBackend.attach_cache`, a
:class:`RowHome`): an insertion then *moves* rows up (the hash map drops the rows the cache
placed; ``homed`` marks the slots whose row the hash map held) and an eviction moves a homed
row back down, both under the home's lock, which every read of the hash map also holds (so a
key is always in one of the two for any reader). A row the hash map never held (read from the
persistent DB) is cached unhomed and dropped on eviction, as without exclusivity::

    hash map {3, 7, 9}   cache {}           insert 7, 9 (read from the hash map)
    hash map {3}         cache {7*, 9*}     * homed: the hash map's only copy
    insert 12 (from the persistent DB) into 9's slot: 9 goes back down
    hash map {3, 9}      cache {7*, 12}

Row formats: ``storage`` holds each row in the table's :class:`~hps.rowformat.RowDtype`
(512 / 256 / 132 / 68 bytes at dim 128 for FP32 / FP16 / INT8 / INT4); :meth:`query`
dequantizes, :meth:`insert` quantizes float32 rows or stores a tier's bytes as they are.

The cache itself is exact (it returns only rows it holds). What a *request* gets for a miss is
decided by :class:`hps.session.LookupSession` (synchronous fill below the hit-rate threshold,
default vector + background insertion above it, or the exact mode).
"""

from hps.storage.cache.dense_index import DenseKeyIndex, dense_key_bound
from hps.storage.cache.index import (
    EMPTY_KEY,
    MAX_HIGH_WORDS,
    high_word,
    homed_at,
    join_words,
    low_word,
    mix64_int,
    mix_keys,
    nibble_at,
    set_homed,
    set_nibbles,
    set_of,
    tag_of,
)
from hps.storage.cache.records import CacheStats, Placed, RowHome
from hps.storage.cache.set_associative import DEFAULT_WAYS, EmbeddingCache
from hps.storage.cache.slot_counter import (
    EXACT_LEVELS,
    HALVE,
    LEVEL_COUNTS,
    LRU_PERIOD,
    MAX_LEVEL,
    add_weighted,
    aging_lut,
    count_of,
    draws,
    gaps,
    level_of,
    lru_renormalised,
    stream_of,
)
from hps.storage.cache.slot_keys import SlotKeys
from hps.storage.cache.static import StaticEmbeddingCache, StaticLayout

__all__ = [
    "CacheStats",
    "DEFAULT_WAYS",
    "DenseKeyIndex",
    "EMPTY_KEY",
    "EXACT_LEVELS",
    "EmbeddingCache",
    "HALVE",
    "LEVEL_COUNTS",
    "LRU_PERIOD",
    "MAX_HIGH_WORDS",
    "MAX_LEVEL",
    "Placed",
    "RowHome",
    "SlotKeys",
    "StaticEmbeddingCache",
    "StaticLayout",
    "add_weighted",
    "aging_lut",
    "count_of",
    "dense_key_bound",
    "draws",
    "gaps",
    "high_word",
    "homed_at",
    "join_words",
    "level_of",
    "low_word",
    "lru_renormalised",
    "mix64_int",
    "mix_keys",
    "nibble_at",
    "set_homed",
    "set_nibbles",
    "set_of",
    "stream_of",
    "tag_of",
]
