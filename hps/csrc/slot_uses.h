// The uses a fused pass makes of the slots it hits (use_slot: counters, unique hits) and the
// distinct keys of a table it counts by key (dense_distinct). Included by
// hps/csrc/fused_lookup.cpp.
#pragma once

#include <cstdint>

#include "cache_probe.h"
#include "common.h"
#include "first_hits.h"
#include "gather_checks.h"

namespace hps_cpu {

// The uses of slot s by the hit at position j: LFU `weight` uses of the level (one: a Morris
// step, up where the draw × gap < 2**32; more: the count LEVEL_COUNTS[level] + weight rounded
// to a level below or above in proportion, hps.storage.cache.add_weighted), LRU the stamp;
// weight 0: none. A slot's first hit in this call is recorded in firsts (the unique hits).
// The counter byte is written only when it changes.
__attribute__((always_inline)) inline void use_slot(const TableView& t, int64_t s, int64_t j,
                                                     int64_t& hits, FirstHits& firsts) {
  ++hits;
  if (!t.by_key) firsts.see(s);
  if (t.weight == 0) return;
  const uint8_t m = t.counters[s];
  uint8_t lv = m;
  if (t.stamp >= 0) {
    lv = static_cast<uint8_t>(t.stamp);
  } else if (lv < kMaxLevel) {
    const uint64_t gap = static_cast<uint64_t>(t.gaps[lv]);
    if (t.weight == 1 && gap == 1) {  // an exact level: every use counts (no draw can miss)
      ++lv;
    } else {
      const uint64_t u = mix64(static_cast<int64_t>(static_cast<uint64_t>(t.stream) +
                                                    static_cast<uint64_t>(j))) &
                         0xFFFFFFFFULL;
      if (t.weight == 1) {
        lv += u * gap < (1ULL << 32);
      } else {
        const int64_t* c = t.level_counts;
        const int64_t target = c[lv] + t.weight;
        int64_t lo = lv;
        while (lo < kMaxLevel && c[lo + 1] <= target) ++lo;
        const bool up = lo < kMaxLevel &&
                        u * static_cast<uint64_t>(c[lo + 1] - c[lo]) <
                            static_cast<uint64_t>(target - c[lo]) << 32;
        lv = static_cast<uint8_t>(lo + up);
      }
    }
  }
  if (lv != m) t.counters[s] = lv;
}

// The distinct keys of a table with a dense key index, counted in this thread's slot bitmap
// (first_hits.h; all zero again when it returns) by key rather than by slot: the keys of
// positions `pos` ([0, n) when null), -1 pads of bags skipped. Returns -1 when a key is outside
// the index's range (a key the pass hashes: the table counts its unique hits by slot).
// With the index exact under the cache's lock, a cached key has one slot and a slot one key,
// so a table's distinct hit keys are its distinct hit slots: its distinct keys less its
// distinct missed keys. Counting keys here is a tight pass over the keys before any row is
// read, while a bit set per hit by slot waits for the slot's index entry, in a bitmap that the
// rows the pass streams evict (with pool_bags_dense, see there for what the two save).
inline int64_t dense_distinct(const TableView& t, const int64_t* pos, int64_t n) {
  uint64_t* w = slot_bits(t.n_dense).data();
  const bool bags = t.hotness > 0;
  int64_t distinct = 0, j = 0;
  for (; j < n; ++j) {
    const int64_t k = t.keys[pos ? pos[j] : j];
    if (bags && k == -1) continue;
    if (k < 0 || k >= t.n_dense) break;
    const uint64_t bit = uint64_t{1} << (k & 63);
    distinct += (w[k >> 6] & bit) == 0;
    w[k >> 6] |= bit;
  }
  for (int64_t i = 0; i < j; ++i) {  // whole words: only this table's keys set bits in them
    const int64_t k = t.keys[pos ? pos[i] : i];
    if (k >= 0) w[k >> 6] = 0;
  }
  return j == n ? distinct : -1;
}

}  // namespace hps_cpu
