// The all-hit pass over full static caches laid out IDENTITY (hps/session/static_gather.py is
// the caller): table i's key k lives in slot k, so a key is a hit exactly when
// 0 <= k < capacity. First every key of every table is checked (a key out of range, or a -1
// in rows, and the call returns without writing anything, for the caller's per-table path)
// and counted: the table's keys >= 0 and its distinct ones (check_and_count); then, side by
// side on the threads, the keys of each table given a key counter are counted into it and
// every table's rows are copied (rows) or its bags summed in order from +0.0, -1 padding
// skipped (pool_bag: FP32 dims 16/32/64/128 in AVX registers; each bag's output row prefetched
// for writing kOutAhead bags ahead), MEAN bags with a key divided by it. Included by
// hps/csrc/fused_lookup.cpp.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "first_hits.h"
#include "gather_checks.h"
#include "key_counter.h"
#include "row_formats.h"

namespace hps_cpu {

struct StaticTable {
  const int64_t* keys;
  int64_t n;
  const uint8_t* storage;
  int64_t capacity, row_bytes, dim, format, hotness;
  bool mean;
  float* out;  // the table's first output value (rows: row i at + i * dim; bags: + b * stride)
};

// Keys [i0, i1) of table t (bags: whole bags) into its output.
template <int64_t kFormat>
void static_piece(const StaticTable& t, int64_t i0, int64_t i1, int64_t out_stride) {
  const int64_t rb = t.row_bytes;
  if (t.hotness == 0) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kRowsAhead < i1) prefetch_bytes(t.storage + t.keys[i + kRowsAhead] * rb, rb);
      dequant_row<kFormat, kSet>(t.storage + t.keys[i] * rb, t.dim, t.out + i * t.dim);
    }
    return;
  }
  const int64_t h = t.hotness;
  const int vecs = bag_vecs<kFormat>(t.dim);
  for (int64_t b0 = i0; b0 < i1; b0 += h) {
    float* dst = t.out + (b0 / h) * out_stride;
    if (b0 + kOutAhead * h < i1) prefetch_bytes<kWrite>(dst + kOutAhead * out_stride, t.dim * 4);
    const int64_t n_valid = pool_bag<kFormat>(t.storage, rb, t.keys, b0, h, i1, t.dim, vecs, dst);
    if (t.mean && n_valid > 0) {
      const float cnt = static_cast<float>(n_valid);
      for (int64_t d = 0; d < t.dim; ++d) dst[d] /= cnt;
    }
  }
}

inline void static_piece_any(const StaticTable& t, int64_t i0, int64_t i1, int64_t out_stride) {
  switch (t.format) {
    case kFp32: static_piece<kFp32>(t, i0, i1, out_stride); break;
    case kFp16: static_piece<kFp16>(t, i0, i1, out_stride); break;
    case kBf16: static_piece<kBf16>(t, i0, i1, out_stride); break;
    case kInt8: static_piece<kInt8>(t, i0, i1, out_stride); break;
    case kInt4: static_piece<kInt4>(t, i0, i1, out_stride); break;
    default: static_piece<kInt2>(t, i0, i1, out_stride); break;
  }
}

// Checks table t's keys (each in [lo, capacity); lo -1 for bags, 0 for rows) and counts them:
// returns {keys >= 0, distinct keys >= 0}, or {-1, -1} at the first key out of range. Every
// bit it set is clear again when it returns.
inline std::pair<int64_t, int64_t> check_and_count(const int64_t* keys, int64_t n, int64_t lo,
                                                   int64_t capacity) {
  std::vector<uint64_t>& bits = slot_bits(capacity);
  uint64_t* w = bits.data();
  int64_t valid = 0, unique = 0, j = 0;
  for (; j < n; ++j) {
    const int64_t k = keys[j];
    if (k < lo || k >= capacity) break;
    if (k < 0) continue;
    ++valid;
    const uint64_t bit = uint64_t{1} << (k & 63);
    unique += (w[k >> 6] & bit) == 0;
    w[k >> 6] |= bit;
  }
  const bool ok = j == n;
  for (int64_t i = 0; i < j; ++i)  // whole words: only this table's keys set bits in them
    if (keys[i] >= 0) w[keys[i] >> 6] = 0;
  if (!ok) return {-1, -1};
  return {valid, unique};
}

// Every table's rows (hotness 0) or bags (hotness h > 0) read from full IDENTITY static caches.
// keys: per table (n,) int64 (bags: n = B × h, -1 pads); storage: per table the cache's
// (capacity, >= row bytes) uint8 rows; out: contiguous float32, table i's rows at
// out_offsets[i] + r × dims[i], its bags at out_offsets[i] + b × out_stride; key_counters:
// empty, or per table a KeyCounter (or None) that the table's keys >= 0 (every one a hit) are
// counted into, as its weight each, once every key of the call has been checked.
// Returns per_table (T, 5) int64 {0, hits, unique hits, looked-up keys, 0} (hits = looked-up
// keys = keys >= 0), or a (0, 5) tensor, nothing written or counted, when a key is not its
// table's.
inline at::Tensor static_gather(const std::vector<at::Tensor>& keys,
                                const std::vector<at::Tensor>& storage,
                                const std::vector<int64_t>& formats,
                                const std::vector<int64_t>& dims,
                                const std::vector<int64_t>& hotness,
                                const std::vector<int64_t>& mean, at::Tensor out,
                                const std::vector<int64_t>& out_offsets, int64_t out_stride,
                                const std::vector<KeyCounter*>& key_counters) {
  const size_t T = keys.size();
  check(key_counters.empty() || key_counters.size() == T,
        "static_gather: key_counters: none, or one KeyCounter (or None) per table");
  check(storage.size() == T && formats.size() == T && dims.size() == T && hotness.size() == T &&
            mean.size() == T && out_offsets.size() == T,
        "static_gather: one storage, format, dim, hotness, mean and offset per table expected");
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
        "static_gather: out must be a contiguous CPU float32 tensor");
  const int64_t out_n = out.numel();
  std::vector<at::Tensor> held(T);  // contiguous keys, alive for the call
  std::vector<StaticTable> ts(T);
  for (size_t i = 0; i < T; ++i) {
    const auto tab = [i] { return "static_gather: table " + std::to_string(i) + ": "; };
    held[i] = keys[i].contiguous();
    const at::Tensor& k = held[i];
    const at::Tensor& s = storage[i];
    check(k.scalar_type() == at::kLong && k.device().is_cpu(),
          [&] { return tab() + "keys must be CPU int64"; });
    check(s.scalar_type() == at::kByte && s.dim() == 2 && s.is_contiguous() && s.device().is_cpu(),
          [&] { return tab() + "storage must be (capacity, row_bytes) contiguous CPU uint8"; });
    const int64_t rb = format_row_bytes(formats[i], dims[i]);
    check(rb > 0 && s.size(1) >= rb, [&] {
      return tab() + "rows of format " + std::to_string(formats[i]) + " and dim " +
             std::to_string(dims[i]) + " need " + std::to_string(rb) +
             " bytes, storage rows hold " + std::to_string(s.size(1));
    });
    const int64_t n = k.numel(), h = hotness[i];
    check_output(tab, n, h, dims[i], out_offsets[i], out_stride, out_n);
    ts[i] = {k.data_ptr<int64_t>(), n, s.data_ptr<uint8_t>(), s.size(0), s.size(1), dims[i],
             formats[i], h, mean[i] != 0, out.data_ptr<float>() + out_offsets[i]};
  }
  // every key checked and counted before anything is written
  auto per_table = cpu_tensor({static_cast<int64_t>(T), 5}, at::kLong, true);
  int64_t* pt = per_table.data_ptr<int64_t>();
  int64_t total = 0;
  for (size_t i = 0; i < T; ++i) {
    const StaticTable& t = ts[i];
    const auto [valid, unique] = check_and_count(t.keys, t.n, t.hotness > 0 ? -1 : 0, t.capacity);
    if (valid < 0) return at::zeros({0, 5}, at::kLong);
    pt[i * 5 + 1] = valid;
    pt[i * 5 + 2] = unique;
    pt[i * 5 + 3] = valid;
    total += t.n;
  }
  // the tables whose keys are counted (every key is a hit: all of them), each one unit of work
  std::vector<size_t> counted;
  for (size_t i = 0; i < key_counters.size(); ++i)
    if (key_counters[i] != nullptr) counted.push_back(i);
  const auto count = [&](size_t i) { key_counters[i]->update(held[i], at::Tensor(), true); };
  // pieces of about 2048 keys (whole bags), in table order; small calls on the calling thread
  struct Span {
    size_t table;
    int64_t begin, end;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < T; ++i) {
    const int64_t h = std::max<int64_t>(1, ts[i].hotness);
    const int64_t step = std::max<int64_t>(1, 2048 / h) * h;
    for (int64_t a = 0; a < ts[i].n; a += step) spans.push_back({i, a, std::min(ts[i].n, a + step)});
  }
  const int64_t P = static_cast<int64_t>(spans.size());
  const auto run = [&](int64_t p) {
    static_piece_any(ts[spans[p].table], spans[p].begin, spans[p].end, out_stride);
  };
  const int64_t C = static_cast<int64_t>(counted.size()), U = C + P;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), U);
  if (total < 8192 || threads <= 1 || at::in_parallel_region()) {
    for (const size_t i : counted) count(i);
    for (int64_t p = 0; p < P; ++p) run(p);
    return per_table;
  }
  // units: each counted table's keys (first: one thread counts while the other copies), then
  // the pieces. Each thread takes the next unit when it is done with its last (one shared
  // counter). Two fixed halves of the pieces leave the thread whose rows lie further away, or
  // that wakes later, finishing while the other waits: over the 26 tables of dlrm_dcnv2 ÷ 300
  // (rows) that pass took 6.98 ms on one thread and 4.71 ms on two, against index_select's
  // 7.18 and 3.62 ms. A counter that cannot grow throws out of the region (the first error,
  // once every thread is done): rows may then be written, as the tables counted before it are.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < U;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      if (u < C)
        count(counted[u]);
      else
        run(u - C);
    }
  });
  return per_table;
}

}  // namespace hps_cpu
