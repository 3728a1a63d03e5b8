// The probe of a set-associative cache as cache_gather (fused_lookup.cpp) reads it: a table's
// view, the set and tag of a hash, the tag match, the key check, the pipeline's per-key state.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "key_counter.h"

namespace hps_cpu {

// One table of a cache_gather call.
struct TableView {
  const int64_t* keys;
  int64_t n;  // keys (rows: m; bags: B * hotness)
  const void* ckeys;  // (capacity,) int32 low words (key32) or int64 keys
  bool key32;
  const int64_t* words;  // key32: the cached keys' distinct high words (n_words <= 16)
  int64_t n_words;
  const uint8_t* word_of;  // key32: a nibble per slot naming its high word; null: word 0
  const uint8_t* tags;
  uint8_t* counters;  // level (LFU) or stamp (LRU), 0..127
  const uint8_t* storage;
  int64_t num_sets, ways, dim, row_bytes, format;
  int64_t stamp;   // LRU: the stamp (0..127) a hit writes; -1: LFU
  int64_t stream;  // LFU: the draw of the use at position j is mix64(stream + j)
  const int64_t* gaps;  // LFU: (128,) a use at level v moves up where draw * gaps[v] < 2**32
  const int64_t* level_counts;  // LFU: (128,) the count of each level (hps.storage.cache)
  // the uses each hit counts: 0 none (its counter is not read or written), 1 one (a Morris
  // step; LRU: the stamp), w > 1 w of them at once (hps.storage.cache.add_weighted)
  int64_t weight = 1;
  int64_t hotness;  // 0: rows; > 0: bags of this many keys (-1 pads)
  bool mean;
  float* out;       // rows: this table's (n, dim) block; bags: column 0 of this table
  int64_t out_stride;  // bags: floats between two bags' rows
  KeyCounter* counter = nullptr;  // set: the pass also counts the table's keys >= 0 into it
  // the cache's dense key index: slot of each key in [0, n_dense) (-1: not cached), exact
  // under the cache's lock (hps/storage/cache/dense_index.py); null: every key is hashed
  const int32_t* dense = nullptr;
  int64_t n_dense = 0;
  // every key of the table is in the dense index's range (bags: or -1): its unique hits are
  // its distinct keys less its distinct missed keys (dense_distinct), and no hit sets a bit
  // in the slot bitmap (first_hits.h)
  bool by_key = false;
};

// The set of a hash: the high 32 bits scaled to [0, num_sets) (a multiply, no division);
// its tag: 1 + (low 16 bits % 255), so 0 marks an empty slot. hps.storage.cache.set_of/tag_of.
inline int64_t set_of(uint64_t h, int64_t num_sets) {
  return static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(num_sets)) >> 32);
}

inline uint8_t tag_of(uint64_t h) { return static_cast<uint8_t>(1 + (h & 0xFFFF) % 255); }

// Bit w set where tg[w] == tag, for the n <= 64 ways at tg.
inline uint64_t match_tags(const uint8_t* tg, int64_t n, uint8_t tag) {
#if defined(__AVX512BW__)
  const __mmask64 lanes = n >= 64 ? ~0ULL : ((1ULL << n) - 1);
  const __m512i v = _mm512_maskz_loadu_epi8(lanes, tg);
  return _mm512_mask_cmpeq_epi8_mask(lanes, v, _mm512_set1_epi8(static_cast<char>(tag)));
#else
#if defined(__AVX2__)
  if (n == 64) {  // a whole tag line: two 32-byte compares
    const __m256i t = _mm256_set1_epi8(static_cast<char>(tag));
    const uint32_t lo = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg)), t)));
    const uint32_t hi = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tg + 32)), t)));
    return static_cast<uint64_t>(hi) << 32 | lo;
  }
#endif
  uint64_t m = 0;
  for (int64_t w = 0; w < n; ++w) m |= static_cast<uint64_t>(tg[w] == tag) << w;
  return m;
#endif
}

// Whether slot s holds the key whose low word is lo and high word words[word] (key32), or
// the key itself (int64 keys).
inline bool holds(const TableView& t, int64_t s, int64_t key, int64_t word) {
  if (!t.key32) return static_cast<const int64_t*>(t.ckeys)[s] == key;
  return static_cast<const int32_t*>(t.ckeys)[s] == static_cast<int32_t>(key) &&
         (t.word_of == nullptr || ((t.word_of[s >> 1] >> ((s & 1) * 4)) & 0xF) == word);
}

// The index of key's high word among the cache's (key32), -1 if it has none.
inline int64_t word_index(const TableView& t, int64_t key) {
  const int64_t hi = key >> 32;
  for (int64_t w = 0; w < t.n_words; ++w)
    if (t.words[w] == hi) return w;
  return -1;
}

inline const void* key_addr(const TableView& t, int64_t s) {
  return t.key32 ? static_cast<const void*>(static_cast<const int32_t*>(t.ckeys) + s)
                 : static_cast<const void*>(static_cast<const int64_t*>(t.ckeys) + s);
}

inline const uint8_t* row_of(const TableView& t, int64_t slot) {
  return t.storage + slot * t.row_bytes;
}

// Keys a dense index entry is prefetched ahead of the key whose slot is read from it
// (pool_bags_dense, rows_dense; the slot is read kRowsAhead keys before the key's row is
// summed or copied).
constexpr int64_t kDenseAhead = 32;

// The slot of key k (in [0, t.n_dense)) read from its dense index entry, -1 for none or a slot
// outside the cache's `cap` slots; the slot's row prefetched and, with kUses, its counter byte
// and the key counter's entry for k (pool_bags_dense, rows_dense: kRowsAhead keys before the
// row is read).
template <bool kUses>
inline int64_t dense_slot(const TableView& t, int64_t k, uint64_t cap) {
  const int64_t s = t.dense[k];
  if (static_cast<uint64_t>(s) >= cap) return -1;
  prefetch_bytes(row_of(t, s), t.row_bytes);
  if (kUses && t.weight) __builtin_prefetch(t.counters + s, 1, 3);
  if (kUses && t.counter != nullptr) t.counter->prefetch_entry(mix64(k));
  return s;
}

// Whether every key of [i0, i1) lies in the table's dense index range: bags may hold -1 pads
// (keys below -1 were refused before the pass); in rows a negative key is a key like any
// other, which the probe pass hashes.
inline bool all_dense(const TableView& t, int64_t i0, int64_t i1, bool rows) {
  int64_t lo = 0, hi = -1;
  for (int64_t i = i0; i < i1; ++i) {
    lo = std::min(lo, t.keys[i]);
    hi = std::max(hi, t.keys[i]);
  }
  return lo >= (rows ? 0 : -1) && hi < t.n_dense;
}

// A run of keys (rows) or bags of one table: the unit of parallel work.
struct Piece {
  int64_t table, begin, end;
};

// Per-key state of the probe pipeline.
struct ProbeState {
  int64_t base;    // first slot of the key's set; -1: padding; -2: a high word the cache lacks;
                   // -3: a key of the dense index (its slot, or -1, in match)
  uint64_t hash;   // mix64(key) (keys >= 0, and every key of rows)
  uint64_t match;  // ways of the first tag line whose tag matches
  uint8_t tag;
  uint8_t word;    // key32: the index of the key's high word
};

}  // namespace hps_cpu
