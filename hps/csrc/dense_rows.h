// The rows pass of a dense key index (rows_dense): FP32 rows of a table whose keys all lie in
// its index's range, found and copied in one pass. Included by hps/csrc/fused_lookup.cpp.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cache_probe.h"
#include "common.h"
#include "first_hits.h"
#include "key_counter.h"
#include "row_formats.h"
#include "slot_uses.h"

namespace hps_cpu {

// gather_piece for the rows of a piece of an FP32 table whose keys all lie in its dense
// index's range (all_dense, rows): the index entry prefetched kDenseAhead keys ahead, the slot
// read from it kRowsAhead keys ahead and the row (with its counter byte and, for the key
// counter, its entry) prefetched then, as pool_bags_dense does for bags. The probe pass's
// pipeline stages a dense key's entry, slot and row 24, 16 and 8 keys ahead in its ring of
// per-key states. Each key's slot is written to sl (-1: a miss, its output row left for the
// miss path); with kUses the hits are used (use_slot) and counted into t.counter, key by key
// in order as gather_piece<true> does. Returns the misses.
template <bool kUses>
int64_t rows_dense(const TableView& t, int64_t i0, int64_t i1, int64_t* sl, int64_t& hits,
                   FirstHits& firsts) {
  const uint64_t cap = static_cast<uint64_t>(t.num_sets * t.ways);
  const int64_t* keys = t.keys;
  const auto slot_at = [&](int64_t i) { return dense_slot<kUses>(t, keys[i], cap); };
  for (int64_t i = i0; i < std::min(i1, i0 + kDenseAhead); ++i)
    __builtin_prefetch(t.dense + keys[i], 0, 3);
  for (int64_t i = i0; i < std::min(i1, i0 + kRowsAhead); ++i) sl[i] = slot_at(i);
  int64_t n_missed = 0;
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kDenseAhead < i1) __builtin_prefetch(t.dense + keys[i + kDenseAhead], 0, 3);
    if (i + kRowsAhead < i1) sl[i + kRowsAhead] = slot_at(i + kRowsAhead);
    const int64_t s = sl[i];
    if (s < 0) {
      ++n_missed;
      continue;
    }
    if (kUses) {
      if (t.counter != nullptr) t.counter->add_hashed(keys[i], mix64(keys[i]), t.counter->weight());
      use_slot(t, s, i, hits, firsts);
    }
    dequant_row<kFp32, kSet>(row_of(t, s), t.dim, t.out + i * t.dim);
  }
  return n_missed;
}

}  // namespace hps_cpu
