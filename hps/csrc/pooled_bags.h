// The pooled-bag passes of the fused lookup for FP32 tables of dim 16, 32, 64 or 128: pool_bags
// (bags summed from the slots a probe pass found) and pool_bags_dense (a dense key index's
// pieces, slots read and bags summed in one pass). Included by hps/csrc/fused_lookup.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cache_probe.h"
#include "common.h"
#include "first_hits.h"
#include "key_counter.h"
#include "row_formats.h"
#include "slot_uses.h"

namespace hps_cpu {

#if defined(__AVX__)
// One bag of an FP32 table of dim 8 × kVecs being summed in kVecs AVX registers, key by key in
// request order from +0.0 (so the sum equals ((0.0f + r0) + r1) + ..., as gather_piece's):
// add() each key's slot (-1 miss, -2 padding: skipped), then store() it once, a MEAN bag
// without a miss divided by its keys. The output row is never re-read per key.
template <int kVecs>
struct BagSum {
  __m256 acc[kVecs];
  int64_t n_valid = 0;
  bool missed = false;
  BagSum() {
    for (int r = 0; r < kVecs; ++r) acc[r] = _mm256_setzero_ps();
  }
  void add(const TableView& t, int64_t s) {
    n_valid += s != -2;
    missed |= s == -1;
    if (s < 0) return;
    const float* f = reinterpret_cast<const float*>(row_of(t, s));
    for (int r = 0; r < kVecs; ++r) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(f + 8 * r));
  }
  void store(const TableView& t, float* dst) {
    if (t.mean && !missed && n_valid > 0) {
      const __m256 cnt = _mm256_set1_ps(static_cast<float>(n_valid));
      for (int r = 0; r < kVecs; ++r) acc[r] = _mm256_div_ps(acc[r], cnt);
    }
    for (int r = 0; r < kVecs; ++r) _mm256_storeu_ps(dst + 8 * r, acc[r]);
  }
};

// The bags of keys [i0, i1) (whole bags) of an FP32 table of dim 8 × kVecs, pooled from their
// slots sl (-1 miss, -2 padding) after gather_piece<.., kProbeOnly> found them (BagSum), rows
// prefetched kRowsAhead keys ahead (26 pooled tables of dlrm_dcnv2 ÷ 300: the rows by known
// slot 2.9 → 2.3 ms against a sum into the output row, CPU time of one thread).
template <int kVecs>
void pool_bags(const TableView& t, int64_t i0, int64_t i1, const int64_t* sl) {
  const int64_t h = t.hotness;
  float* dst = t.out + (i0 / h) * t.out_stride;
  for (int64_t b0 = i0; b0 < i1; b0 += h, dst += t.out_stride) {
    BagSum<kVecs> bag;
    for (int64_t i = b0; i < b0 + h; ++i) {
      if (i + kRowsAhead < i1 && sl[i + kRowsAhead] >= 0)
        prefetch_bytes(row_of(t, sl[i + kRowsAhead]), t.row_bytes);
      bag.add(t, sl[i]);
    }
    bag.store(t, dst);
  }
}

// gather_piece and pool_bags in one pass for a piece of an FP32 table of dim 8 × kVecs whose
// keys are all in its dense index's range (all_dense, bags): no hash, tag or key line, so
// nothing to pipeline but the index entry (prefetched kDenseAhead keys ahead) and the row
// (prefetched kRowsAhead keys ahead, when its slot is read from the entry: with its counter
// byte and, for the key counter, its entry). Each key's slot is written to sl (-1 miss, -2 padding); with
// kUses the hits are used (use_slot) and counted into t.counter, key by key in order as
// gather_piece<true> does. Returns the misses. 26 pooled FP32 tables of dlrm_dcnv2 ÷ 300
// over caches holding every row, the CPU's caches evicted before each call, one thread: with
// the unique hits counted by key (dense_distinct) the kernel took 0.87-0.97 of the probe
// pass's and pool_bags' time in 17 rounds (two at 0.99-1.03 with every use counted); this pass
// with the slot bitmap, or the count by key with the probe pass, took no less
// (docs/benchmarks.md, "the dense index's own pooling pass").
template <int kVecs, bool kUses>
int64_t pool_bags_dense(const TableView& t, int64_t i0, int64_t i1, int64_t* sl, int64_t& hits,
                        FirstHits& firsts) {
  const int64_t h = t.hotness;
  const uint64_t cap = static_cast<uint64_t>(t.num_sets * t.ways);
  const int64_t* keys = t.keys;
  const auto slot_at = [&](int64_t i) -> int64_t {  // -2: padding
    return keys[i] < 0 ? -2 : dense_slot<kUses>(t, keys[i], cap);
  };
  for (int64_t i = i0; i < std::min(i1, i0 + kDenseAhead); ++i)
    if (keys[i] >= 0) __builtin_prefetch(t.dense + keys[i], 0, 3);
  for (int64_t i = i0; i < std::min(i1, i0 + kRowsAhead); ++i) sl[i] = slot_at(i);
  int64_t n_missed = 0;
  float* dst = t.out + (i0 / h) * t.out_stride;
  for (int64_t b0 = i0; b0 < i1; b0 += h, dst += t.out_stride) {
    BagSum<kVecs> bag;
    for (int64_t i = b0; i < b0 + h; ++i) {
      if (i + kDenseAhead < i1 && keys[i + kDenseAhead] >= 0)
        __builtin_prefetch(t.dense + keys[i + kDenseAhead], 0, 3);
      if (i + kRowsAhead < i1) sl[i + kRowsAhead] = slot_at(i + kRowsAhead);
      const int64_t s = sl[i];
      n_missed += s == -1;
      if (kUses && s >= 0) {
        if (t.counter != nullptr) t.counter->add_hashed(keys[i], mix64(keys[i]), t.counter->weight());
        use_slot(t, s, i, hits, firsts);
      }
      bag.add(t, s);
    }
    bag.store(t, dst);
  }
  return n_missed;
}
#endif

// The AVX registers a bag of an FP32 table of dim `dim` is pooled in (pool_bags), 0: none
// (dims other than 16, 32, 64, 128 take gather_piece's row-by-row path).
// Without AVX every table takes the row-by-row path.
inline int pooled_vecs(const TableView& t) {
#if defined(__AVX__)
  if (t.hotness <= 0 || t.format != kFp32) return 0;
  return t.dim == 128 || t.dim == 64 || t.dim == 32 || t.dim == 16 ? static_cast<int>(t.dim / 8) : 0;
#else
  (void)t;
  return 0;
#endif
}

}  // namespace hps_cpu
